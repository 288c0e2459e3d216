//! Where the process's log lines go: stderr, or a file (`--log-file`) reopened on SIGHUP and SIGUSR1 for rotation.
//! Access-log lines are gathered by each thread in a buffer of its own and written out in batches by a thread of the
//! log's own, never on the request's thread; the lines waiting are bounded, and past the bound lines are dropped and
//! counted. Every other line is written at once, after what is waiting, so a warning is never held back nor cut
//! into. The lines waiting are written out when the process drains and before it exits.

use std::cell::RefCell;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

/// The most bytes of lines waiting to be written; past it, access-log lines are dropped and counted.
pub const DEFAULT_BOUND: usize = 8 << 20;
/// How long the writing thread lets lines gather once the first of a batch has come.
const GATHER: Duration = Duration::from_millis(50);
/// A thread that has gathered this much has the lines written at once, not held for the rest of [`GATHER`]: under
/// load the lines waiting stay within the caches' reach, as nginx's `buffer=64k`. It is also how much of the bound
/// a thread takes at a time.
const BATCH: usize = 64 << 10;

/// The one writer of the process's lines.
#[derive(Debug)]
pub struct LogWriter {
    /// Tells this writer's gathering buffers, in each thread's table, from another's (tests make several).
    id: u64,
    /// Every thread's gathering buffer, in the order the threads first wrote.
    threads: Mutex<Vec<Arc<Gathering>>>,
    waiting: Mutex<Waiting>,
    /// Wakes the writing thread: a first line after it went idle, or a thread's batch full.
    wake: Condvar,
    /// The writing thread found nothing gathered and is about to wait for a first line: the thread that gathers one
    /// wakes it.
    idle: AtomicBool,
    dropped: AtomicU64,
    bound: usize,
    output: Mutex<Output>,
}

/// What the threads' buffers hold and the writing thread is told, under one lock.
#[derive(Debug, Default)]
struct Waiting {
    /// Bytes of the bound taken: the room threads hold for their lines, and the lines taken and not yet written.
    taken: usize,
    /// A line came after the writing thread went idle.
    woken: bool,
    /// A thread's buffer holds a whole batch.
    full: bool,
}

/// One thread's access-log lines, gathered: written to by that thread alone, a lock that only the writing thread
/// ever takes besides (once a batch), so a line costs no cache line another core writes.
#[derive(Debug, Default)]
struct Gathering {
    lines: Mutex<Lines>,
}

#[derive(Debug, Default)]
struct Lines {
    bytes: Vec<u8>,
    /// Bytes of the bound this thread holds: its lines and the room left for more.
    held: usize,
}

/// The target, and the batch last written kept empty with its capacity: lines are copied into room already there
/// rather than into a buffer grown from nothing each batch.
#[derive(Debug)]
struct Output {
    target: LogTarget,
    spare: Vec<u8>,
}

/// A batch buffer larger than this after a burst is let go once written, not kept for the process's life.
const KEPT_CAPACITY: usize = 1 << 20;

/// Where lines are written.
#[derive(Debug)]
enum LogTarget {
    Stderr,
    File { path: PathBuf, file: std::fs::File },
}

static WRITER: OnceLock<LogWriter> = OnceLock::new();

thread_local! {
    /// This thread's gathering buffer, by the writer it gathers for.
    static GATHERING: RefCell<Vec<(u64, Arc<Gathering>)>> = const { RefCell::new(Vec::new()) };
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LogTarget {
    fn open(path: Option<PathBuf>) -> std::io::Result<LogTarget> {
        Ok(match path {
            None => LogTarget::Stderr,
            Some(path) => LogTarget::File {
                file: std::fs::OpenOptions::new().create(true).append(true).open(&path)?,
                path,
            },
        })
    }

    fn write_all(&mut self, bytes: &[u8]) {
        // A log that cannot be written is not worth failing a request or the process for.
        let _ = match self {
            LogTarget::Stderr => std::io::stderr().lock().write_all(bytes),
            LogTarget::File { file, .. } => file.write_all(bytes),
        };
    }
}

impl LogWriter {
    fn new(target: LogTarget, bound: usize) -> LogWriter {
        static IDS: AtomicU64 = AtomicU64::new(0);
        LogWriter {
            id: IDS.fetch_add(1, Ordering::Relaxed),
            threads: Mutex::new(Vec::new()),
            waiting: Mutex::new(Waiting::default()),
            wake: Condvar::new(),
            idle: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
            bound,
            output: Mutex::new(Output {
                target,
                spare: Vec::new(),
            }),
        }
    }

    /// This thread's gathering buffer, made and registered at its first line.
    fn gathering(&self) -> Arc<Gathering> {
        GATHERING.with_borrow_mut(|mine| {
            if let Some((_, gathering)) = mine.iter().find(|(id, _)| *id == self.id) {
                return gathering.clone();
            }
            let gathering = Arc::new(Gathering::default());
            lock(&self.threads).push(gathering.clone());
            mine.push((self.id, gathering.clone()));
            gathering
        })
    }

    /// Appends a line to this thread's lines; false (and counted) when the lines waiting already hold the bound.
    fn append(&self, line: &[u8]) -> bool {
        let gathered = GATHERING.try_with(|mine| {
            let mine = mine.borrow();
            let gathering = mine.iter().find(|(id, _)| *id == self.id)?;
            Some(self.gather(&gathering.1, line))
        });
        match gathered {
            Ok(Some(kept)) => kept,
            Ok(None) => self.gather(&self.gathering(), line),
            // A line written as the thread ends, its table gone: written at once.
            Err(_) => {
                self.write_out(Some(line));
                true
            }
        }
    }

    fn gather(&self, gathering: &Gathering, line: &[u8]) -> bool {
        let mut lines = lock(&gathering.lines);
        if lines.bytes.len() + line.len() > lines.held && !self.take_room(&mut lines, line.len()) {
            drop(lines);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let before = lines.bytes.len();
        lines.bytes.extend_from_slice(line);
        drop(lines);
        // A batch's first line wakes an idle writing thread to start gathering; the line that fills one, to write.
        let filled = before < BATCH && before + line.len() >= BATCH;
        if filled || (before == 0 && self.idle.load(Ordering::SeqCst)) {
            let mut waiting = lock(&self.waiting);
            waiting.woken = true;
            waiting.full |= filled;
            drop(waiting);
            self.wake.notify_one();
        }
        true
    }

    /// Takes another batch's worth of the bound (at least `wanted` bytes) for a thread whose room is used up; false
    /// when the bound has not that much left.
    fn take_room(&self, lines: &mut Lines, wanted: usize) -> bool {
        let mut waiting = lock(&self.waiting);
        let left = self.bound - waiting.taken;
        let more = BATCH.max(wanted).min(left);
        if lines.bytes.len() + wanted > lines.held + more {
            return false;
        }
        waiting.taken += more;
        lines.held += more;
        true
    }

    /// Writes every thread's lines, and then `line` when given, in one turn of the target.
    fn write_out(&self, line: Option<&[u8]>) {
        // The output's lock first: batches are written whole and in order.
        let mut output = lock(&self.output);
        let Output { target, spare } = &mut *output;
        let mut threads = lock(&self.threads);
        // The room each thread held and has not used goes back to the bound (a thread idle since holds none).
        let mut unused = 0;
        for gathering in threads.iter() {
            let mut lines = lock(&gathering.lines);
            unused += lines.held - lines.bytes.len();
            lines.held = 0;
            if spare.is_empty() {
                std::mem::swap(&mut lines.bytes, spare);
            } else {
                spare.extend_from_slice(&lines.bytes);
                lines.bytes.clear();
            }
        }
        // A thread gone, its lines taken, needs no buffer (one that gathered a line after the take keeps it till
        // the next write-out).
        threads.retain(|gathering| Arc::strong_count(gathering) > 1 || !lock(&gathering.lines).bytes.is_empty());
        drop(threads);
        lock(&self.waiting).taken -= unused;
        if !spare.is_empty() {
            target.write_all(spare);
            let mut waiting = lock(&self.waiting);
            waiting.taken -= spare.len();
            drop(waiting);
            spare.clear();
        }
        if spare.capacity() > KEPT_CAPACITY {
            *spare = Vec::new();
        }
        if let Some(line) = line {
            target.write_all(line);
        }
    }

    /// Reopens the file written to, by its path; a file that cannot be opened leaves the old one and says why.
    fn reopen(&self) {
        let mut output = lock(&self.output);
        if let LogTarget::File { path, .. } = &output.target {
            match LogTarget::open(Some(path.clone())) {
                Ok(reopened) => output.target = reopened,
                Err(error) => {
                    drop(output);
                    self.write_out(Some(format!("could not reopen the log file: {error}\n").as_bytes()));
                }
            }
        }
    }

    /// Whether any thread has lines gathered.
    fn gathered(&self) -> bool {
        lock(&self.threads)
            .iter()
            .any(|gathering| !lock(&gathering.lines).bytes.is_empty())
    }

    /// Waits for a batch's first line, lets more gather until a thread's batch is full or [`GATHER`] has passed,
    /// and writes them all at once; for ever.
    fn writing(&self) {
        loop {
            // Idle, said before looking: a thread gathering a first line after the look sees it and wakes this one.
            self.idle.store(true, Ordering::SeqCst);
            let gathered = self.gathered();
            let mut waiting = lock(&self.waiting);
            if !gathered {
                waiting = self
                    .wake
                    .wait_while(waiting, |waiting| !waiting.woken)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            self.idle.store(false, Ordering::SeqCst);
            waiting.woken = false;
            let (mut waiting, _) = self
                .wake
                .wait_timeout_while(waiting, GATHER, |waiting| !waiting.full)
                .unwrap_or_else(PoisonError::into_inner);
            waiting.full = false;
            drop(waiting);
            self.write_out(None);
        }
    }
}

/// Installs the process's writer: to `file` when given, else stderr, holding at most `bound` bytes of access-log
/// lines. Installing it again, or after a line was written, changes nothing.
pub fn install(file: Option<PathBuf>, bound: usize) -> std::io::Result<()> {
    let target = LogTarget::open(file)?;
    let _ = WRITER.set(LogWriter::new(target, bound));
    Ok(())
}

/// The installed writer (one writing to stderr when none was installed: tests, tools), its thread started with
/// the first use.
fn writer() -> &'static LogWriter {
    static STARTED: std::sync::Once = std::sync::Once::new();
    let installed: &'static LogWriter = WRITER.get_or_init(|| LogWriter::new(LogTarget::Stderr, DEFAULT_BOUND));
    STARTED.call_once(|| {
        // Without the thread lines still reach the target, at the next warning, flush or exit.
        let _ = std::thread::Builder::new()
            .name("oipgate-log".to_owned())
            .spawn(move || installed.writing());
    });
    installed
}

/// Appends an access-log line (ending in a line feed), to be written with the next batch; dropped and counted when
/// the lines waiting already fill the bound.
pub fn access_line(line: &[u8]) {
    writer().append(line);
}

/// Writes every line waiting, now, on the caller's thread (the drain's end, an exit).
pub fn flush() {
    if let Some(writer) = WRITER.get() {
        writer.write_out(None);
    }
}

/// Writes one line at once, after the lines waiting (a warning, an error: never held back).
pub fn immediate(line: &[u8]) {
    writer().write_out(Some(line));
}

/// Reopens the log file (after a rotation moved it); stderr stays as it is.
pub fn reopen() {
    writer().reopen();
}

/// Access-log lines dropped so far for want of room.
pub fn dropped() -> u64 {
    writer().dropped.load(Ordering::Relaxed)
}

/// The `tracing` output of every line but the access log's: each written at once, whole.
#[derive(Debug, Clone, Copy, Default)]
pub struct ImmediateLines;

/// One event's line, gathered as `tracing` writes it in pieces, written whole when done.
#[derive(Debug, Default)]
pub struct LineBuffer(Vec<u8>);

impl Write for LineBuffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineBuffer {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            immediate(&self.0);
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for ImmediateLines {
    type Writer = LineBuffer;

    fn make_writer(&'a self) -> LineBuffer {
        LineBuffer::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory of this test's own.
    fn directory(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("oipgate-log-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        dir
    }

    #[test]
    fn lines_past_the_bound_are_dropped_and_counted_and_the_rest_kept_in_order() {
        let path = directory("bound").join("access.log");
        let writer = LogWriter::new(LogTarget::open(Some(path.clone())).expect("the file opens"), 10);
        assert!(writer.append(b"one\n"));
        assert!(writer.append(b"two\n"));
        assert!(!writer.append(b"three\n"));
        assert_eq!(writer.dropped.load(Ordering::Relaxed), 1);
        writer.write_out(None);
        // Written out, the batch has room again.
        assert!(writer.append(b"four\n"));
        writer.write_out(Some(b"warning\n"));
        assert_eq!(std::fs::read(&path).expect("the log"), b"one\ntwo\nfour\nwarning\n");
    }

    /// Many threads' lines, written by the writing thread as they come: every line once and whole, each thread's in
    /// the order it wrote them, the last ones (after the writer went idle) without a flush; and the bound holds
    /// across the threads (a writer of a few batches' bound, never written out, drops what is past it).
    #[test]
    fn each_threads_lines_are_written_whole_and_in_order_and_the_bound_holds_across_threads() {
        let path = directory("threads").join("access.log");
        let writer: &'static LogWriter = Box::leak(Box::new(LogWriter::new(
            LogTarget::open(Some(path.clone())).expect("the file opens"),
            DEFAULT_BOUND,
        )));
        std::thread::spawn(move || writer.writing());
        const THREADS: usize = 4;
        const LINES: usize = 20_000;
        std::thread::scope(|scope| {
            for thread in 0..THREADS {
                scope.spawn(move || {
                    for line in 0..LINES {
                        // Now and then a pause, so the writing thread goes idle and must be woken.
                        if line % 5_000 == 4_999 {
                            std::thread::sleep(GATHER * 2);
                        }
                        assert!(
                            writer.append(format!("thread {thread} line {line:05} {}\n", "x".repeat(40)).as_bytes())
                        );
                    }
                });
            }
        });
        let mut next = [0; THREADS];
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while next.iter().sum::<usize>() < THREADS * LINES {
            assert!(std::time::Instant::now() < deadline, "written so far: {next:?}");
            std::thread::sleep(GATHER);
            next = [0; THREADS];
            let text = std::fs::read_to_string(&path).expect("the log");
            // Up to the last whole line: the writing thread may be part way through a batch.
            for line in text[..text.rfind('\n').map_or(0, |end| end + 1)].lines() {
                let fields: Vec<&str> = line.split(' ').collect();
                let (thread, number): (usize, usize) = (fields[1].parse().unwrap(), fields[3].parse().unwrap());
                assert_eq!(
                    number, next[thread],
                    "thread {thread}'s lines in order, each once: {line}"
                );
                assert_eq!(fields[4].len(), 40, "a whole line: {line}");
                next[thread] += 1;
            }
        }
        assert_eq!(writer.dropped.load(Ordering::Relaxed), 0);
        // All written, the threads gone: the whole bound is free again, and no gone thread's buffer is kept.
        writer.write_out(None);
        assert_eq!(lock(&writer.waiting).taken, 0);
        // (A thread's table goes with it after it has been joined, a moment later.)
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !lock(&writer.threads).is_empty() {
            assert!(std::time::Instant::now() < deadline, "a gone thread's buffer kept");
            std::thread::sleep(Duration::from_millis(10));
            writer.write_out(None);
        }

        let bounded = LogWriter::new(LogTarget::open(Some(path)).expect("the file opens"), 3 * BATCH);
        let line = [b'x'; 100];
        let kept: usize = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..THREADS)
                .map(|_| scope.spawn(|| (0..5_000).filter(|_| bounded.append(&line)).count()))
                .collect();
            threads.into_iter().map(|thread| thread.join().unwrap()).sum()
        });
        assert!(kept * line.len() <= 3 * BATCH, "kept {kept} lines");
        assert!(
            kept * line.len() > 2 * BATCH,
            "kept {kept} lines: the room of the bound is used"
        );
        assert_eq!(
            kept as u64 + bounded.dropped.load(Ordering::Relaxed),
            (THREADS * 5_000) as u64
        );
    }

    #[test]
    fn reopening_follows_a_rotated_file_to_its_new_one() {
        let dir = directory("rotate");
        let path = dir.join("access.log");
        let writer = LogWriter::new(LogTarget::open(Some(path.clone())).expect("the file opens"), 1 << 10);
        writer.append(b"before\n");
        writer.write_out(None);
        std::fs::rename(&path, dir.join("access.log.1")).expect("rotated");
        writer.append(b"moved\n");
        writer.write_out(None);
        writer.reopen();
        writer.append(b"after\n");
        writer.write_out(None);
        assert_eq!(
            std::fs::read(dir.join("access.log.1")).expect("old"),
            b"before\nmoved\n"
        );
        assert_eq!(std::fs::read(&path).expect("new"), b"after\n");
    }
}
