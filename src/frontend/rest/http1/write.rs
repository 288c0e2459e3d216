//! An answer written to an HTTP/1.1 connection: its head encoded into a buffer, a small body copied after it, a
//! larger one's pieces written after it in the same `writev` (shared, not copied), framed by its length or in chunks;
//! a client that will not take its answer is given as long as an idle connection is kept.

use std::cell::RefCell;
use std::future::poll_fn;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures_util::FutureExt as _;
use http::header::{CONNECTION, CONTENT_LENGTH, DATE, TRANSFER_ENCODING};
use http::{Response, StatusCode};
use http_body::Body;
use tokio::io::AsyncWrite;

use crate::codec::http1::{GATHERED_BODY, content_length, poll_write_slices};

/// How long a client may leave its answer unread before the connection is closed (nginx's `send_timeout`).
pub(super) const SEND_TIMEOUT: Duration = Duration::from_secs(60);
/// The most pieces of a body written in one call.
const PIECES: usize = 16;
/// The most bytes gathered for one call before it is made.
const GATHER: usize = 1 << 20;

/// How an answer goes out on its connection.
#[derive(Debug, Clone, Copy)]
pub(super) struct How {
    /// The answer says `Connection: close`.
    pub close: bool,
    /// An HTTP/1.0 client: told that its connection is kept, and given a body of unknown length until the close.
    pub keep_alive_10: bool,
    pub http10: bool,
    /// The answer to a HEAD request: its head only.
    pub head_only: bool,
}

/// How the answer's body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Out {
    /// No body may follow this status.
    None,
    Length(u64),
    Chunked,
    /// Until the connection closes (an HTTP/1.0 client and a body of unknown length).
    UntilClose,
}

/// Writes `response` to `io` (its head encoded into `head`, a buffer the connection reuses); `true` when it went out
/// whole as framed, so the connection may carry another request.
pub(super) async fn write_answer<S, B>(
    io: &mut S,
    head: &mut Vec<u8>,
    response: Response<B>,
    mut how: How,
) -> io::Result<bool>
where
    S: AsyncWrite + Unpin,
    B: Body<Data = Bytes> + Unpin,
{
    let (parts, mut body) = response.into_parts();
    let status = parts.status;
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|value| content_length(value.as_bytes()));
    let out = if status.is_informational() || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        Out::None
    } else if let Some(length) = declared {
        Out::Length(length)
    } else if body.is_end_stream() {
        Out::Length(0)
    } else if let Some(length) = body.size_hint().exact() {
        Out::Length(length)
    } else if how.http10 {
        how.close = true;
        Out::UntilClose
    } else {
        Out::Chunked
    };
    encode_head(head, &parts, out, declared.is_some(), how);
    let mut head_left = head.len();
    let mut left = match out {
        Out::Length(length) if !how.head_only => length,
        _ => 0,
    };
    let bodiless = how.head_only || out == Out::None;
    let mut pieces: [Bytes; PIECES] = Default::default();
    let mut sizes = [[0u8; 20]; PIECES];
    let mut ended = bodiless;
    let mut failed = false;
    loop {
        // What the body has at hand, up to a call's worth; when nothing is left to write, what was written goes out
        // and the body is waited for.
        let mut count = 0;
        let mut gathered = 0;
        while !ended && count < PIECES && gathered < GATHER {
            let frame = if count == 0 && head_left == 0 {
                flush(io).await?;
                poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
            } else {
                match poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await {
                    Poll::Ready(frame) => frame,
                    Poll::Pending => break,
                }
            };
            let mut data = match frame {
                None => {
                    ended = true;
                    continue;
                }
                Some(Err(_)) => {
                    (ended, failed) = (true, true);
                    continue;
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => data,
                    _ => continue,
                },
            };
            if let Out::Length(_) = out {
                // Never more than the head said: the rest would be taken for the next answer.
                let room = usize::try_from(left).unwrap_or(usize::MAX);
                if data.len() > room {
                    data.truncate(room);
                    (ended, failed) = (true, true);
                }
                left -= data.len() as u64;
            }
            gathered += data.len();
            pieces[count] = data;
            count += 1;
        }
        let last = ended && out == Out::Chunked && !failed;
        if head_left == head.len() && out != Out::Chunked && count > 0 && gathered <= GATHERED_BODY {
            // A small body goes in the head's buffer: the two leave in one `send`.
            for piece in &mut pieces[..count] {
                head.extend_from_slice(piece);
                *piece = Bytes::new();
            }
            head_left = head.len();
            count = 0;
        }
        if head_left > 0 || count > 0 || last {
            let mut slices: [IoSlice<'_>; 2 * PIECES + 2] = [IoSlice::new(&[]); 2 * PIECES + 2];
            let mut used = 0;
            let mut push = |slice| {
                slices[used] = IoSlice::new(slice);
                used += 1;
            };
            push(&head[head.len() - head_left..]);
            for (piece, size) in pieces[..count].iter().zip(sizes.iter_mut()) {
                if out == Out::Chunked {
                    push(chunk_size_line(size, piece.len()));
                }
                push(piece);
                if out == Out::Chunked {
                    push(b"\r\n");
                }
            }
            if last {
                push(b"0\r\n\r\n");
            }
            write_all(io, &mut slices[..used]).await?;
            head_left = 0;
            for piece in &mut pieces[..count] {
                *piece = Bytes::new();
            }
        }
        if ended {
            flush(io).await?;
            return Ok(!failed && left == 0 && !how.close && out != Out::UntilClose);
        }
    }
}

/// A chunk's size line (`<hex>\r\n`) written into `room`.
fn chunk_size_line(room: &mut [u8; 20], size: usize) -> &[u8] {
    let digits = (usize::BITS - size.leading_zeros()).div_ceil(4).max(1) as usize;
    for (index, slot) in room[..digits].iter_mut().enumerate() {
        let nibble = (size >> (4 * (digits - 1 - index))) & 0xf;
        *slot = b"0123456789abcdef"[nibble];
    }
    room[digits..digits + 2].copy_from_slice(b"\r\n");
    &room[..digits + 2]
}

fn encode_head(head: &mut Vec<u8>, parts: &http::response::Parts, out: Out, declared: bool, how: How) {
    head.clear();
    let status = parts.status;
    head.extend_from_slice(b"HTTP/1.1 ");
    head.extend_from_slice(status.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    head.extend_from_slice(b"\r\n");
    for (name, value) in &parts.headers {
        // The framing and the connection are this hop's, said below.
        if name == TRANSFER_ENCODING || name == CONNECTION || (name == CONTENT_LENGTH && out == Out::None) {
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    match out {
        Out::Length(length) if !declared => {
            head.extend_from_slice(b"content-length: ");
            head.extend_from_slice(itoa::Buffer::new().format(length).as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        Out::Chunked => head.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        _ => {}
    }
    if !parts.headers.contains_key(DATE) {
        head.extend_from_slice(b"date: ");
        DATE_NOW.with_borrow_mut(|date| head.extend_from_slice(date.now()));
        head.extend_from_slice(b"\r\n");
    }
    if how.close {
        head.extend_from_slice(b"connection: close\r\n");
    } else if how.keep_alive_10 {
        head.extend_from_slice(b"connection: keep-alive\r\n");
    }
    head.extend_from_slice(b"\r\n");
}

/// The `Date` header's value, made once a second on each thread.
struct CachedDate {
    second: u64,
    text: String,
}

impl CachedDate {
    fn now(&mut self) -> &[u8] {
        let now = SystemTime::now();
        let second = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        if second != self.second || self.text.is_empty() {
            self.second = second;
            self.text = httpdate::fmt_http_date(now);
        }
        self.text.as_bytes()
    }
}

thread_local! {
    static DATE_NOW: RefCell<CachedDate> = const { RefCell::new(CachedDate { second: 0, text: String::new() }) };
}

/// Writes all of `slices`; a client that takes none of it for [`SEND_TIMEOUT`] is given up on.
pub(super) async fn write_all<S: AsyncWrite + Unpin>(io: &mut S, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        let written = {
            let mut write = poll_fn(|cx| poll_write_slices(Pin::new(&mut *io), cx, slices));
            match (&mut write).now_or_never() {
                Some(written) => written,
                None => tokio::time::timeout(SEND_TIMEOUT, write)
                    .await
                    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the client did not read its answer"))?,
            }
        }?;
        if written == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, written);
    }
    Ok(())
}

/// Flushes what is written (TLS holds it otherwise); timed only when it has to wait, as a plain connection's never
/// does.
async fn flush<S: AsyncWrite + Unpin>(io: &mut S) -> io::Result<()> {
    let mut flush = poll_fn(|cx| Pin::new(&mut *io).poll_flush(cx));
    match (&mut flush).now_or_never() {
        Some(flushed) => flushed,
        None => tokio::time::timeout(SEND_TIMEOUT, flush)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the client did not read its answer"))?,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection that notes each write: the bytes of a plain one, or of each buffer of a vectored one.
    #[derive(Default)]
    struct Noted {
        writes: Vec<Vec<Vec<u8>>>,
    }

    impl AsyncWrite for Noted {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            bytes: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.writes.push(vec![bytes.to_vec()]);
            Poll::Ready(Ok(bytes.len()))
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            slices: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            self.writes.push(slices.iter().map(|slice| slice.to_vec()).collect());
            Poll::Ready(Ok(slices.iter().map(|slice| slice.len()).sum()))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut std::task::Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut std::task::Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_small_answer_leaves_in_one_buffer_and_a_larger_one_with_its_body_beside_its_head() {
        let how = How {
            close: false,
            keep_alive_10: false,
            http10: false,
            head_only: false,
        };
        for (size, buffers) in [(300, 1), (GATHERED_BODY, 1), (GATHERED_BODY + 1, 2)] {
            let body = vec![b'x'; size];
            let mut noted = Noted::default();
            let answer = Response::new(http_body_util::Full::new(Bytes::from(body.clone())));
            assert!(write_answer(&mut noted, &mut Vec::new(), answer, how).await.unwrap());
            assert_eq!(noted.writes.len(), 1, "{size} bytes: one write");
            let write = &noted.writes[0];
            assert_eq!(write.len(), buffers, "{size} bytes");
            let sent = write.concat();
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {size}\r\ndate: ");
            assert!(sent.starts_with(head.as_bytes()), "{}", String::from_utf8_lossy(&sent));
            assert!(sent.ends_with(&body));
            if buffers == 2 {
                // Beside the head, shared rather than copied.
                assert_eq!(write[1], body);
            }
        }
    }

    #[test]
    fn chunk_size_lines_are_lower_hex() {
        let mut room = [0u8; 20];
        for (size, line) in [
            (0usize, "0\r\n"),
            (1, "1\r\n"),
            (15, "f\r\n"),
            (16, "10\r\n"),
            (0xabcdef, "abcdef\r\n"),
        ] {
            assert_eq!(chunk_size_line(&mut room, size), line.as_bytes());
        }
        assert_eq!(chunk_size_line(&mut room, usize::MAX).len(), 16 + 2);
    }
}
