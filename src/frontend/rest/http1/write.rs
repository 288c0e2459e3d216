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
use http_body::{Body, Frame};
use smallvec::SmallVec;
use tokio::io::AsyncWrite;

use crate::codec::http1::{GATHERED_BODY, HeaderLines, content_length, poll_write_slices, scratch};

/// How long a client may leave its answer unread before the connection is closed (nginx's `send_timeout`).
pub(super) const SEND_TIMEOUT: Duration = Duration::from_secs(60);
/// The most pieces of a body written in one call.
const PIECES: usize = 16;
/// The most bytes gathered for one call before it is made.
const GATHER: usize = 1 << 20;

/// How an answer goes out on its connection.
#[derive(Debug, Clone, Copy)]
pub(super) struct AnswerPlan {
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
enum AnswerFraming {
    /// No body may follow this status.
    None,
    Length(u64),
    Chunked,
    /// Until the connection closes (an HTTP/1.0 client and a body of unknown length).
    UntilClose,
}

/// Writes `response` to `io`, its head encoded into the thread's buffer for heads; `true` when it went out whole as
/// framed, so the connection may carry another request. The answer is written where it lies, not moved into the
/// writer's state. `lines`, a backend answer's header lines passed back as they came, follow the map's headers.
pub(super) async fn write_answer<S, B>(
    io: &mut S,
    response: &mut Response<B>,
    lines: Option<&HeaderLines>,
    how: AnswerPlan,
) -> io::Result<bool>
where
    S: AsyncWrite + Unpin,
    B: Body<Data = Bytes> + Unpin,
{
    let mut head = scratch::take();
    let written = write_with_head(io, &mut head, response, lines, how).await;
    scratch::give(head);
    written
}

async fn write_with_head<S, B>(
    io: &mut S,
    head: &mut Vec<u8>,
    response: &mut Response<B>,
    lines: Option<&HeaderLines>,
    mut how: AnswerPlan,
) -> io::Result<bool>
where
    S: AsyncWrite + Unpin,
    B: Body<Data = Bytes> + Unpin,
{
    let declared = response
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|value| content_length(value.as_bytes()));
    let out = framing(response.status(), declared, response.body(), &mut how);
    encode_head(
        head,
        response.status(),
        (response.headers(), lines),
        out,
        declared.is_some(),
        how,
    );
    let body = response.body_mut();
    let mut sent = BodyProgress::new(out, how);
    let mut batch = Batch::default();
    let mut head_left = head.len();
    loop {
        sent.take(io, body, &mut batch, head_left == 0).await?;
        if head_left == head.len() && batch.gather_into(head, out) {
            head_left = head.len();
        }
        let last = sent.ended && out == AnswerFraming::Chunked && !sent.failed;
        if head_left > 0 || batch.count() > 0 || last {
            write_batch(io, &head[head.len() - head_left..], &mut batch, out, last).await?;
            head_left = 0;
        }
        if sent.ended {
            flush(io).await?;
            return Ok(!sent.failed && sent.left == 0 && !how.close && out != AnswerFraming::UntilClose);
        }
    }
}

/// How an answer's body goes on the wire: by the length its head declares or its body knows, in chunks, until the
/// connection closes (an HTTP/1.0 client, which is then told so), or not at all for a status that has none.
fn framing<B: Body>(status: StatusCode, declared: Option<u64>, body: &B, how: &mut AnswerPlan) -> AnswerFraming {
    if status.is_informational() || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        AnswerFraming::None
    } else if let Some(length) = declared {
        AnswerFraming::Length(length)
    } else if body.is_end_stream() {
        AnswerFraming::Length(0)
    } else if let Some(length) = body.size_hint().exact() {
        AnswerFraming::Length(length)
    } else if how.http10 {
        how.close = true;
        AnswerFraming::UntilClose
    } else {
        AnswerFraming::Chunked
    }
}

/// How much of an answer's body is taken, and how it ended.
struct BodyProgress {
    out: AnswerFraming,
    /// Bytes the head declared that have not been taken yet.
    left: u64,
    ended: bool,
    /// The body broke off, or was longer than its head said.
    failed: bool,
}

impl BodyProgress {
    fn new(out: AnswerFraming, how: AnswerPlan) -> BodyProgress {
        BodyProgress {
            out,
            left: match out {
                AnswerFraming::Length(length) if !how.head_only => length,
                _ => 0,
            },
            ended: how.head_only || out == AnswerFraming::None,
            failed: false,
        }
    }

    /// Takes what the body has at hand into `batch`, up to a call's worth; when nothing is left to write
    /// (`written_all`), what was written goes out and the body is waited for.
    async fn take<S, B>(&mut self, io: &mut S, body: &mut B, batch: &mut Batch, written_all: bool) -> io::Result<()>
    where
        S: AsyncWrite + Unpin,
        B: Body<Data = Bytes> + Unpin,
    {
        while !self.ended && batch.count() < PIECES && batch.gathered < GATHER {
            let frame = if batch.count() == 0 && written_all {
                flush(io).await?;
                poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await
            } else {
                match poll_fn(|cx| Poll::Ready(Pin::new(&mut *body).poll_frame(cx))).await {
                    Poll::Ready(frame) => frame,
                    Poll::Pending => break,
                }
            };
            if let Some(data) = self.data(frame) {
                batch.push(data);
            }
        }
        Ok(())
    }

    /// The data of a frame, if any, never more than the head said (the rest would be taken for the next answer).
    fn data<E>(&mut self, frame: Option<Result<Frame<Bytes>, E>>) -> Option<Bytes> {
        let mut data = match frame {
            None => {
                self.ended = true;
                return None;
            }
            Some(Err(_)) => {
                (self.ended, self.failed) = (true, true);
                return None;
            }
            Some(Ok(frame)) => frame.into_data().ok().filter(|data| !data.is_empty())?,
        };
        if let AnswerFraming::Length(_) = self.out {
            let room = usize::try_from(self.left).unwrap_or(usize::MAX);
            if data.len() > room {
                data.truncate(room);
                (self.ended, self.failed) = (true, true);
            }
            self.left -= data.len() as u64;
        }
        Some(data)
    }
}

/// The pieces of a body taken for one write. Its room is not written until used: most answers leave as a head with
/// the body gathered into it, and each line of a request's state that is written is one it may miss in cache.
#[derive(Default)]
struct Batch {
    pieces: SmallVec<[Bytes; PIECES]>,
    gathered: usize,
}

impl Batch {
    fn count(&self) -> usize {
        self.pieces.len()
    }

    fn push(&mut self, data: Bytes) {
        self.gathered += data.len();
        self.pieces.push(data);
    }

    /// Copies a small body framed by its length after the head in `head`, so the two leave in one `send`; whether it
    /// did.
    fn gather_into(&mut self, head: &mut Vec<u8>, out: AnswerFraming) -> bool {
        if out == AnswerFraming::Chunked || self.pieces.is_empty() || self.gathered > GATHERED_BODY {
            return false;
        }
        for piece in &self.pieces {
            head.extend_from_slice(piece);
        }
        self.clear();
        true
    }

    fn clear(&mut self) {
        self.pieces.clear();
        self.gathered = 0;
    }
}

/// Writes what is left of the head, the batch's pieces (framed as chunks when `out` says so) and, when `last`, the
/// chunked body's end, in one vectored write where the connection takes it whole.
async fn write_batch<S: AsyncWrite + Unpin>(
    io: &mut S,
    head: &[u8],
    batch: &mut Batch,
    out: AnswerFraming,
    last: bool,
) -> io::Result<()> {
    let chunked = out == AnswerFraming::Chunked;
    let mut sizes: SmallVec<[[u8; 20]; PIECES]> = SmallVec::new();
    if chunked {
        sizes.extend(batch.pieces.iter().map(|_| [0u8; 20]));
    }
    let mut slices: SmallVec<[IoSlice<'_>; 2 * PIECES + 2]> = SmallVec::new();
    slices.push(IoSlice::new(head));
    let mut sizes = sizes.iter_mut();
    for piece in &batch.pieces {
        if let Some(size) = sizes.next() {
            slices.push(IoSlice::new(chunk_size_line(size, piece.len())));
        }
        slices.push(IoSlice::new(piece));
        if chunked {
            slices.push(IoSlice::new(b"\r\n"));
        }
    }
    if last {
        slices.push(IoSlice::new(b"0\r\n\r\n"));
    }
    write_all(io, &mut slices).await?;
    drop(slices);
    batch.clear();
    Ok(())
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

fn encode_head(
    head: &mut Vec<u8>,
    status: StatusCode,
    (headers, lines): (&http::HeaderMap, Option<&HeaderLines>),
    out: AnswerFraming,
    declared: bool,
    how: AnswerPlan,
) {
    head.clear();
    head.extend_from_slice(b"HTTP/1.1 ");
    head.extend_from_slice(status.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    head.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        // The framing and the connection are this hop's, said below.
        if name == TRANSFER_ENCODING || name == CONNECTION || (name == CONTENT_LENGTH && out == AnswerFraming::None) {
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    if let Some(lines) = lines {
        // Framing and connection lines are not among them (see `PassedAnswer`); names go out lower-cased, as a
        // map's do.
        lines.each(|name, value| {
            let start = head.len();
            head.extend_from_slice(name);
            head[start..].make_ascii_lowercase();
            head.extend_from_slice(b": ");
            head.extend_from_slice(value);
            head.extend_from_slice(b"\r\n");
        });
    }
    match out {
        AnswerFraming::Length(length) if !declared => {
            head.extend_from_slice(b"content-length: ");
            head.extend_from_slice(itoa::Buffer::new().format(length).as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        AnswerFraming::Chunked => head.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        _ => {}
    }
    // No answer's headers hold a Date: a backend's is never passed on (each hop dates what it sends), and the
    // gateway's own answers name none. Looked up in every answer's map, it would be a hash and a probe each.
    debug_assert!(!headers.contains_key(DATE), "an answer with its own Date");
    head.extend_from_slice(b"date: ");
    DATE_NOW.with_borrow_mut(|date| head.extend_from_slice(date.now()));
    head.extend_from_slice(b"\r\n");
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
    struct RecordingStream {
        writes: Vec<Vec<Vec<u8>>>,
    }

    impl AsyncWrite for RecordingStream {
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
        let how = AnswerPlan {
            close: false,
            keep_alive_10: false,
            http10: false,
            head_only: false,
        };
        for (size, buffers) in [(300, 1), (GATHERED_BODY, 1), (GATHERED_BODY + 1, 2)] {
            let body = vec![b'x'; size];
            let mut noted = RecordingStream::default();
            let mut answer = Response::new(http_body_util::Full::new(Bytes::from(body.clone())));
            assert!(write_answer(&mut noted, &mut answer, None, how).await.unwrap());
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
