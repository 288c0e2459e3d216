//! Follows an HTTP/1.1 connection's bytes from one request to the next, to find each head that frames its body both
//! with Content-Length and Transfer-Encoding: hyper reconciles the two silently (it keeps Transfer-Encoding and drops
//! Content-Length), and a pipelined request arrives in the reads hyper makes for the one before, so its head is found
//! only by knowing where the earlier body ends.
//!
//! A head is read for the two names only (and Content-Length's value); a body only as far as its framing: a length
//! is skipped at once, chunks by their size lines. What hyper would refuse (a malformed length or chunk size) stops
//! the scan, since hyper closes the connection on it; so does a head framed both ways, after which hyper takes no
//! further request on the connection.

use crate::codec::chunked::{Chunk, Malformed};

/// Where a connection's bytes have been followed to.
#[derive(Debug)]
pub(super) struct FramingScan {
    part: Part,
    /// Heads read whole on the connection (counted as the connection counts the requests it begins).
    heads: u64,
    /// The ordinal of a head that framed its body both ways, until taken.
    framed_both_ways: Option<u64>,
}

#[derive(Debug)]
enum Part {
    Head(HeadScan),
    /// A Content-Length body, with this many bytes still to come.
    Body(u64),
    Chunked(Chunk),
    /// No longer followed.
    Stopped,
}

/// A head's scan: only the first bytes of each line are looked at, compared with both names at once when the read
/// holds the longer one, else one byte at a time against the name the line's first byte may begin (the two names
/// begin differently).
#[derive(Debug)]
struct HeadScan {
    line: Line,
    /// A byte of the head has arrived.
    begun: bool,
    content_length: Length,
    transfer_encoding: bool,
}

/// What a head's Content-Length lines say.
#[derive(Debug, Clone, Copy)]
enum Length {
    Absent,
    Is(u64),
    /// Not a number, or two different ones: hyper refuses the request.
    Malformed,
}

/// Where the scan is within the head's line being read.
#[derive(Debug, Clone, Copy)]
enum Line {
    /// Before the request line, where empty lines are let go (as hyper does).
    Opening,
    /// At its start.
    Start,
    /// After a carriage return at its start: perhaps the blank line.
    Return,
    /// Its first `matched` bytes are those of `name`, case aside.
    Naming { name: &'static [u8], matched: usize },
    /// Within Content-Length's value: its digits so far, and whether blanks have followed them.
    Length { digits: Option<u64>, ended: bool },
    /// Told apart (or the request line): its end is what is looked for.
    Skipping,
}

const CONTENT_LENGTH: &[u8] = b"content-length:";
const TRANSFER_ENCODING: &[u8] = b"transfer-encoding:";

impl HeadScan {
    fn new() -> HeadScan {
        HeadScan {
            // A head begins with its request line, which names no header.
            line: Line::Opening,
            begun: false,
            content_length: Length::Absent,
            transfer_encoding: false,
        }
    }

    fn named(&mut self, name: &'static [u8]) -> Line {
        if name == CONTENT_LENGTH {
            Line::Length {
                digits: None,
                ended: false,
            }
        } else {
            self.transfer_encoding = true;
            Line::Skipping
        }
    }

    fn length(&mut self, value: Option<u64>) {
        self.content_length = match (self.content_length, value) {
            (Length::Absent, Some(value)) => Length::Is(value),
            (Length::Is(earlier), Some(value)) if earlier == value => Length::Is(value),
            _ => Length::Malformed,
        };
    }

    /// Takes bytes of the head; `true` once its blank line has been read, with `bytes` left at what follows it.
    fn scan(&mut self, bytes: &mut &[u8]) -> bool {
        self.begun |= !bytes.is_empty();
        while let Some(&first) = bytes.first() {
            if matches!(self.line, Line::Skipping) {
                let Some(end) = memchr::memchr(b'\n', bytes) else {
                    *bytes = &[];
                    return false;
                };
                *bytes = &bytes[end + 1..];
                self.line = Line::Start;
                continue;
            }
            if matches!(self.line, Line::Start) && bytes.starts_with(b"\r\n") {
                *bytes = &bytes[2..];
                return true;
            }
            if matches!(self.line, Line::Start) && bytes.len() >= TRANSFER_ENCODING.len() {
                // The longer name is at hand whole (a head mostly comes in one read): compared at once, and any other
                // line let go, but an empty one.
                let first = first.to_ascii_lowercase();
                if first != b'\r' && first != b'\n' {
                    self.line = Line::Skipping;
                    for name in [CONTENT_LENGTH, TRANSFER_ENCODING] {
                        if first == name[0] && bytes[..name.len()].eq_ignore_ascii_case(name) {
                            self.line = self.named(name);
                            *bytes = &bytes[name.len()..];
                            break;
                        }
                    }
                    // A length whose line is at hand whole is read at once too.
                    if matches!(self.line, Line::Length { .. })
                        && let Some(end) = memchr::memchr(b'\n', bytes)
                    {
                        self.length(whole_length(&bytes[..end]));
                        *bytes = &bytes[end + 1..];
                        self.line = Line::Start;
                    }
                    continue;
                }
            }
            let byte = first.to_ascii_lowercase();
            *bytes = &bytes[1..];
            self.line = match (self.line, byte) {
                (Line::Opening, b'\r' | b'\n') => Line::Opening,
                (Line::Opening, _) => Line::Skipping,
                // An empty line ends the head; any other line shorter than either name is let go.
                (Line::Start | Line::Return, b'\n') => return true,
                (Line::Length { digits, .. }, b'\n') => {
                    self.length(digits);
                    Line::Start
                }
                (Line::Length { digits, ended: false }, b'0'..=b'9') => {
                    let digits = digits
                        .unwrap_or(0)
                        .checked_mul(10)
                        .and_then(|value| value.checked_add(u64::from(byte - b'0')));
                    if digits.is_none() {
                        self.content_length = Length::Malformed;
                        Line::Skipping
                    } else {
                        Line::Length { digits, ended: false }
                    }
                }
                (Line::Length { digits, .. }, b' ' | b'\t' | b'\r') => Line::Length {
                    digits,
                    ended: digits.is_some(),
                },
                (Line::Length { .. }, _) => {
                    self.content_length = Length::Malformed;
                    Line::Skipping
                }
                (_, b'\n') => Line::Start,
                (Line::Start, b'\r') => Line::Return,
                (Line::Start, b'c') => Line::Naming {
                    name: CONTENT_LENGTH,
                    matched: 1,
                },
                (Line::Start, b't') => Line::Naming {
                    name: TRANSFER_ENCODING,
                    matched: 1,
                },
                (Line::Naming { name, matched }, byte) if name[matched] == byte => {
                    if matched + 1 < name.len() {
                        Line::Naming {
                            name,
                            matched: matched + 1,
                        }
                    } else {
                        self.named(name)
                    }
                }
                _ => Line::Skipping,
            };
        }
        false
    }
}

impl FramingScan {
    /// A scan of a connection on which `begun` requests have already begun (and whose heads it has no more of).
    pub(super) fn after(begun: u64) -> FramingScan {
        FramingScan {
            part: Part::Head(HeadScan::new()),
            heads: begun,
            framed_both_ways: None,
        }
    }

    /// The ordinal of a head, newly read, that framed its body both ways (the first request is 1).
    pub(super) fn take_framed_both_ways(&mut self) -> Option<u64> {
        self.framed_both_ways.take()
    }

    /// Whether some of a head, and not all of it, has arrived.
    pub(super) fn within_head(&self) -> bool {
        matches!(&self.part, Part::Head(head) if head.begun)
    }

    /// Takes the connection's next bytes.
    pub(super) fn scan(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            self.part = match &mut self.part {
                Part::Stopped => return,
                Part::Head(head) => {
                    if !head.scan(&mut bytes) {
                        return;
                    }
                    self.heads += 1;
                    match (head.content_length, head.transfer_encoding) {
                        (Length::Absent, true) => Part::Chunked(Chunk::Start),
                        (_, true) => {
                            self.framed_both_ways = Some(self.heads);
                            Part::Stopped
                        }
                        (Length::Absent | Length::Is(0), false) => Part::Head(HeadScan::new()),
                        (Length::Is(length), false) => Part::Body(length),
                        (Length::Malformed, false) => Part::Stopped,
                    }
                }
                Part::Body(left) => {
                    *left = skip(&mut bytes, *left);
                    if *left > 0 {
                        return;
                    }
                    Part::Head(HeadScan::new())
                }
                Part::Chunked(chunk) => {
                    if let Some(left) = chunk.data_left() {
                        chunk.took(left - skip(&mut bytes, left));
                        continue;
                    }
                    match chunk.frame(&mut bytes) {
                        Ok(()) if *chunk == Chunk::Done => Part::Head(HeadScan::new()),
                        Ok(()) => continue,
                        Err(Malformed) => Part::Stopped,
                    }
                }
            };
        }
    }
}

/// A Content-Length value read whole (its line's end aside): digits between blanks, or nothing.
fn whole_length(value: &[u8]) -> Option<u64> {
    let blank = |byte: &u8| matches!(byte, b' ' | b'\t' | b'\r');
    let start = value.iter().position(|byte| !blank(byte))?;
    let end = value.iter().rposition(|byte| !blank(byte))? + 1;
    value[start..end].iter().try_fold(0u64, |length, &byte| {
        let digit = byte.checked_sub(b'0').filter(|digit| *digit <= 9)?;
        length.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// Lets go of up to `left` bytes of `bytes`; how many are still to come.
fn skip(bytes: &mut &[u8], left: u64) -> u64 {
    let taken = usize::try_from(left).map_or(bytes.len(), |left| left.min(bytes.len()));
    *bytes = &bytes[taken..];
    left - taken as u64
}

#[cfg(test)]
mod tests {
    use super::{FramingScan, Part};

    /// Scans `stream` in pieces of `size` bytes.
    fn scanned(stream: &[u8], size: usize) -> FramingScan {
        let mut scan = FramingScan::after(0);
        for piece in stream.chunks(size) {
            scan.scan(piece);
        }
        scan
    }

    /// Whether the scan stands at the start of a new head, `heads` heads in.
    fn at_next_head(scan: &FramingScan, heads: u64) -> bool {
        matches!(&scan.part, Part::Head(head) if !head.begun) && scan.heads == heads
    }

    #[test]
    fn both_framing_headers_are_seen_in_any_case_and_across_reads() {
        let head = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTRANSFER-ENCODING: chunked\r\n\r\nbody";
        for size in [head.len(), 1, 3, 17, 20] {
            let mut scan = scanned(head, size);
            assert_eq!(scan.take_framed_both_ways(), Some(1), "in pieces of {size}");
            assert!(matches!(scan.part, Part::Stopped));
        }
    }

    #[test]
    fn names_the_two_only_begin_are_not_taken_for_them() {
        let head = b"POST /x HTTP/1.1\r\nContent-Lengthy: 5\r\ntransfer-encodings: chunked\r\nc: 1\r\nt\r\n\r\n";
        let mut scan = scanned(head, head.len());
        assert_eq!(scan.take_framed_both_ways(), None);
        assert!(at_next_head(&scan, 1), "no body: {:?}", scan.part);
        let unfinished = scanned(b"POST /x HTTP/1.1\r\nContent-Length: 5\r\n\rX\r\n", 64);
        assert!(unfinished.within_head() && unfinished.heads == 0);
    }

    #[test]
    fn empty_lines_before_the_request_line_do_not_end_the_head() {
        let mut opening = FramingScan::after(0);
        opening.scan(b"\r\n\r\n");
        opening.scan(b"\nPOST /x HTTP/1.1\r\n");
        assert!(opening.within_head() && opening.heads == 0);
        let head = scanned(b"\r\n\r\nPOST /x HTTP/1.1\r\ncontent-length: 1\r\n\r\n", 64);
        assert!(matches!(head.part, Part::Body(1)), "{:?}", head.part);
    }

    #[test]
    fn the_body_and_header_values_are_not_taken_for_headers() {
        let head = b"POST /content-length: HTTP/1.1\r\nx-note: transfer-encoding: no\r\ncontent-length: 40\r\n\r\n\
transfer-encoding: chunked\r\n";
        let mut scan = scanned(head, head.len());
        assert_eq!(scan.take_framed_both_ways(), None);
        assert!(matches!(scan.part, Part::Body(12)), "{:?}", scan.part);
    }

    #[test]
    fn a_pipelined_head_framed_both_ways_is_found_behind_bodies_of_every_framing() {
        let stream = b"POST /a HTTP/1.1\r\ncontent-length: 33\r\n\r\n\
transfer-encoding: chunked\r\n\r\n0\r\n\
POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n\
1b;name=value\r\ncontent-length: 5\r\n\r\nabcdef\r\n0\r\nx-trailer: content-length: 1\r\n\r\n\
GET /c HTTP/1.1\r\nhost: x\r\n\r\n\
POST /d HTTP/1.1\r\nContent-Length: 0\r\ncontent-length:  0 \r\n\r\n\
POST /e HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        for size in [stream.len(), 1, 2, 3, 7, 18, 19] {
            let mut scan = scanned(stream, size);
            assert_eq!(scan.take_framed_both_ways(), Some(5), "in pieces of {size}");
        }
        let mut later = FramingScan::after(7);
        later.scan(b"POST /e HTTP/1.1\r\nTransfer-Encoding: chunked\r\ncontent-length: 5\r\n\r\n");
        assert_eq!(later.take_framed_both_ways(), Some(8));
    }

    #[test]
    fn a_length_is_read_alike_whole_and_byte_by_byte() {
        for (value, expected) in [
            ("5", Some(5)),
            ("  17 \t", Some(17)),
            ("0", Some(0)),
            ("18446744073709551615", Some(u64::MAX)),
            ("18446744073709551616", None),
            ("1 2", None),
            ("+2", None),
            ("", None),
            ("1\r2", None),
        ] {
            let head = format!("POST /x HTTP/1.1\r\ncontent-length:{value}\r\n\r\n");
            for size in [head.len(), 1] {
                let scan = scanned(head.as_bytes(), size);
                match expected {
                    Some(0) => assert!(at_next_head(&scan, 1), "{value:?} in pieces of {size}"),
                    Some(length) => assert!(
                        matches!(scan.part, Part::Body(left) if left == length),
                        "{value:?} in pieces of {size}: {:?}",
                        scan.part
                    ),
                    None => assert!(matches!(scan.part, Part::Stopped), "{value:?} in pieces of {size}"),
                }
            }
        }
    }

    #[test]
    fn framing_hyper_refuses_stops_the_scan() {
        for stream in [
            &b"POST /a HTTP/1.1\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n"[..],
            b"POST /a HTTP/1.1\r\ncontent-length: 1 2\r\n\r\n",
            b"POST /a HTTP/1.1\r\ncontent-length: +2\r\n\r\n",
            b"POST /a HTTP/1.1\r\ncontent-length: 99999999999999999999999\r\n\r\n",
            b"POST /a HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            b"POST /a HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n1;a\nb\r\n",
            b"POST /a HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n1\r\nab\r\n",
        ] {
            let scan = scanned(stream, stream.len());
            assert!(
                matches!(scan.part, Part::Stopped),
                "{}",
                String::from_utf8_lossy(stream)
            );
        }
    }
}
