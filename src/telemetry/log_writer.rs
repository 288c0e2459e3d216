//! Where the process's log lines go: stderr, or a file (`--log-file`) reopened on SIGHUP and SIGUSR1 for rotation.
//! Access-log lines are appended whole to one buffer, a short lock each, and written out in batches by a thread of
//! its own, never on the request's thread; past a bound the buffer takes no more and lines are dropped and counted.
//! Every other line is written at once, after what is pending, so a warning is never held back nor cut into. The
//! buffer is written out when the process drains and before it exits.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

/// The most bytes of lines waiting to be written; past it, access-log lines are dropped and counted.
pub const DEFAULT_BOUND: usize = 8 << 20;
/// How long the writing thread lets lines gather once the first of a batch has come.
const GATHER: Duration = Duration::from_millis(50);
/// A batch this large is written at once, not held for the rest of [`GATHER`]: under load the lines waiting stay
/// within the caches' reach (a 50 ms batch at 40,000 lines a second is half a megabyte), as nginx's `buffer=64k`.
const BATCH: usize = 64 << 10;

/// The one writer of the process's lines.
#[derive(Debug)]
pub struct LogWriter {
    pending: Mutex<Pending>,
    /// Wakes the writing thread when a batch's first line comes.
    wake: Condvar,
    dropped: AtomicU64,
    bound: usize,
    output: Mutex<Output>,
}

/// The target, and the batch last written kept empty with its capacity: swapped with the pending one at each
/// write-out, so lines are appended into room already there rather than into a buffer grown from nothing each batch.
#[derive(Debug)]
struct Output {
    target: LogTarget,
    spare: Vec<u8>,
}

/// A batch buffer larger than this after a burst is let go once written, not kept for the process's life.
const KEPT_CAPACITY: usize = 1 << 20;

#[derive(Debug, Default)]
struct Pending {
    lines: Vec<u8>,
}

/// Where lines are written.
#[derive(Debug)]
enum LogTarget {
    Stderr,
    File { path: PathBuf, file: std::fs::File },
}

static WRITER: OnceLock<LogWriter> = OnceLock::new();

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
        LogWriter {
            pending: Mutex::new(Pending::default()),
            wake: Condvar::new(),
            dropped: AtomicU64::new(0),
            bound,
            output: Mutex::new(Output {
                target,
                spare: Vec::new(),
            }),
        }
    }

    /// Appends a line to the batch; false (and counted) when the batch already holds the bound.
    fn append(&self, line: &[u8]) -> bool {
        let mut pending = lock(&self.pending);
        if pending.lines.len() + line.len() > self.bound {
            drop(pending);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let before = pending.lines.len();
        pending.lines.extend_from_slice(line);
        drop(pending);
        // The first line of a batch wakes the writer to start gathering; the line that fills a batch, to write it.
        if before == 0 || (before < BATCH && before + line.len() >= BATCH) {
            self.wake.notify_one();
        }
        true
    }

    /// Writes the batch, and then `line` when given, in one turn of the target.
    fn write_out(&self, line: Option<&[u8]>) {
        // The output's lock first: batches are written whole and in order.
        let mut output = lock(&self.output);
        let Output { target, spare } = &mut *output;
        std::mem::swap(&mut lock(&self.pending).lines, spare);
        if !spare.is_empty() {
            target.write_all(spare);
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

    /// Waits for a batch's first line, lets more gather until the batch is full or [`GATHER`] has passed, and
    /// writes them all at once; for ever.
    fn writing(&self) {
        loop {
            {
                let pending = lock(&self.pending);
                let pending = self
                    .wake
                    .wait_while(pending, |pending| pending.lines.is_empty())
                    .unwrap_or_else(PoisonError::into_inner);
                let _pending = self
                    .wake
                    .wait_timeout_while(pending, GATHER, |pending| pending.lines.len() < BATCH)
                    .unwrap_or_else(PoisonError::into_inner);
            }
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
