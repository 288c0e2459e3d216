//! Large flat numeric `data` arrays, read and written on several threads. The output is byte for byte what one
//! thread would produce; anything unusual (nesting, an error anywhere) goes back to the one-thread path, which also
//! gives the exact error message.

use std::num::NonZeroUsize;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;

/// Arrays shorter than this are handled on the calling thread: below it, thread start-up is not worth it.
pub const PARALLEL_MIN_ELEMENTS: usize = 1 << 18;
/// The least work one extra thread is given.
const MIN_ELEMENTS_PER_WORKER: usize = 1 << 17;
/// The most threads one array uses by default.
const MAX_WORKERS: usize = 8;

/// The configured limit; 0 means the default (the machine's cores, at most `MAX_WORKERS`).
static LIMIT: AtomicUsize = AtomicUsize::new(0);

/// Sets the most threads one array may use; 1 keeps all codec work on the calling thread, 0 restores the default.
pub fn set_max_workers(limit: usize) {
    LIMIT.store(limit, Ordering::Relaxed);
}

/// How many threads to use for an array of `elements`.
pub fn workers(elements: usize) -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    if elements < PARALLEL_MIN_ELEMENTS {
        return 1;
    }
    let limit = match LIMIT.load(Ordering::Relaxed) {
        0 => (*CORES.get_or_init(|| thread::available_parallelism().map_or(1, NonZeroUsize::get))).min(MAX_WORKERS),
        limit => limit,
    };
    limit.min(elements / MIN_ELEMENTS_PER_WORKER).max(1)
}

/// Runs `work` on every part but the first on other threads, and `first` on the first part on the calling thread
/// meanwhile; gives the other parts' results in order. A thread that cannot be started leaves its part to the
/// calling thread.
fn run_parts<P: Sync, R: Send>(parts: &[P], first: impl FnOnce(&P), work: impl Fn(&P) -> R + Sync) -> Vec<R> {
    thread::scope(|scope| {
        let spawned: Vec<_> = parts[1..]
            .iter()
            .map(|part| {
                thread::Builder::new()
                    .name("oipgate-codec".into())
                    .spawn_scoped(scope, || work(part))
            })
            .collect();
        first(&parts[0]);
        spawned
            .into_iter()
            .zip(&parts[1..])
            .map(|(handle, part)| match handle {
                Ok(handle) => handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                Err(_) => work(part),
            })
            .collect()
    })
}

/// Writes `data` (elements of `N` bytes) in `workers` contiguous parts, each by `write_part`, appending to `out` in
/// order. The calling thread writes the first part straight into `out`; the others are copied in after it.
pub fn write<const N: usize>(
    out: &mut Vec<u8>,
    data: &[u8],
    workers: usize,
    write_part: impl Fn(&mut Vec<u8>, &[u8]) + Sync,
) {
    let per_part = (data.len() / N).div_ceil(workers.max(1)).max(1) * N;
    let parts: Vec<&[u8]> = data.chunks(per_part).collect();
    if parts.len() <= 1 {
        write_part(out, data);
        return;
    }
    let texts = run_parts(
        &parts,
        |part| write_part(out, part),
        |part| {
            let mut text = Vec::new();
            write_part(&mut text, part);
            text
        },
    );
    out.reserve(texts.iter().map(Vec::len).sum());
    for text in texts {
        out.extend_from_slice(&text);
    }
}

/// Parses the flat array starting at `text[0]` (`[` scalar `,` scalar ... `]`) into elements of `N` bytes on
/// `workers` threads. Gives the bytes and the length of the array's text, or `None` when the array is not flat, is
/// malformed, or does not hold exactly `count` elements: the caller's one-thread path then says what is wrong.
pub fn parse_flat<const N: usize>(
    text: &[u8],
    count: usize,
    workers: usize,
    parse_one: impl Fn(&[u8]) -> Option<([u8; N], usize)> + Sync,
) -> Option<(Vec<u8>, usize)> {
    if text.first() != Some(&b'[') {
        return None;
    }
    let end = 1 + memchr::memchr(b']', &text[1..])?;
    let inner = &text[1..end];
    if memchr::memchr(b'[', inner).is_some() {
        return None;
    }
    // Cut at commas near equal offsets. A comma inside a string would cut it in two; such an array fails to parse
    // below and is left to the one-thread path.
    let mut ranges = Vec::with_capacity(workers);
    let mut start = 0;
    for k in 1..workers {
        let target = (inner.len() * k / workers).max(start);
        let Some(comma) = memchr::memchr(b',', &inner[target..]).map(|i| target + i) else {
            break;
        };
        ranges.push(start..comma);
        start = comma + 1;
    }
    ranges.push(start..inner.len());
    let parts: Vec<&[u8]> = ranges.into_iter().map(|r| &inner[r]).collect();
    let mut out = Vec::with_capacity(count * N);
    let mut first_ok = false;
    let rest = run_parts(
        &parts,
        |part| first_ok = parse_list_into(&mut out, part, &parse_one).is_some(),
        |part| {
            let mut bytes = Vec::with_capacity(part.len() / 4 * N);
            parse_list_into(&mut bytes, part, &parse_one).map(|()| bytes)
        },
    );
    if !first_ok {
        return None;
    }
    for part in rest {
        out.extend_from_slice(&part?);
    }
    (out.len() == count * N).then_some((out, end + 1))
}

/// Parses `scalar , scalar , ... scalar` (whitespace allowed around each), the whole of `text`, onto `out`.
fn parse_list_into<const N: usize>(
    out: &mut Vec<u8>,
    text: &[u8],
    parse_one: &impl Fn(&[u8]) -> Option<([u8; N], usize)>,
) -> Option<()> {
    let mut pos = skip_ws(text, 0);
    loop {
        let (bytes, len) = parse_one(text.get(pos..).filter(|rest| !rest.is_empty())?)?;
        out.extend_from_slice(&bytes);
        pos = skip_ws(text, pos + len);
        match text.get(pos) {
            None => return Some(()),
            Some(b',') => pos = skip_ws(text, pos + 1),
            Some(_) => return None,
        }
    }
}

fn skip_ws(text: &[u8], mut pos: usize) -> usize {
    while matches!(text.get(pos), Some(b' ' | b'\n' | b'\r' | b'\t')) {
        pos += 1;
    }
    pos
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digit(s: &[u8]) -> Option<([u8; 1], usize)> {
        s.first().filter(|c| c.is_ascii_digit()).map(|c| ([c - b'0'], 1))
    }

    #[test]
    fn flat_arrays_split_at_commas() {
        let text = b"[1, 2,3 ,4,5,6,7,8,9] tail";
        for workers in 1..6 {
            let (bytes, len) = parse_flat(text, 9, workers, digit).unwrap();
            assert_eq!(bytes, [1, 2, 3, 4, 5, 6, 7, 8, 9], "{workers} workers");
            assert_eq!(&text[..len], b"[1, 2,3 ,4,5,6,7,8,9]");
        }
    }

    #[test]
    fn anything_unusual_is_left_to_the_one_thread_path() {
        assert!(parse_flat(b"[[1],[2]]", 2, 2, digit).is_none());
        assert!(parse_flat(b"[1,2,]", 2, 2, digit).is_none());
        assert!(parse_flat(b"[1,,2]", 2, 2, digit).is_none());
        assert!(parse_flat(b"[1 2]", 2, 2, digit).is_none());
        assert!(parse_flat(b"[1,2,3]", 2, 2, digit).is_none());
        assert!(parse_flat(b"[1,x]", 2, 2, digit).is_none());
        assert!(parse_flat(b"[1,2", 2, 2, digit).is_none());
        assert!(parse_flat(b"[]", 0, 2, digit).is_none());
    }

    #[test]
    fn parts_are_written_in_order() {
        let data: Vec<u8> = (0..100).collect();
        for workers in 1..8 {
            let mut out = b"x".to_vec();
            write::<2>(&mut out, &data, workers, |out, part| out.extend_from_slice(part));
            assert_eq!(&out[1..], &data[..], "{workers} workers");
        }
    }

    #[test]
    fn worker_counts() {
        assert_eq!(workers(1000), 1);
        assert!(workers(PARALLEL_MIN_ELEMENTS) >= 1);
        assert!(workers(usize::MAX) <= MAX_WORKERS);
    }
}
