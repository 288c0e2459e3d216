//! Bodies that leave the process: shared buffers sent one after another without being joined (how tensors leave
//! without a copy), a client's body held to its pace, and bodies read whole, within a bound. The client's request
//! bodies as each front-door protocol hands them over are `http1` and `http2`; one relayed to a backend as it
//! arrives is `relay`'s.

pub mod held;
pub mod http1;
pub mod http2;
mod relay;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use http1::{Http1Body, Http1BodyError};
use http2::{Http2Body, Http2BodyError};
pub use relay::{RelayError, RelaySource, Relayed, Tap};

/// A gRPC message this long or shorter, with its prefix, leaves as one buffer: HTTP/2 sends each buffer it is given
/// as a DATA frame of its own, which costs each side far more than copying what one frame of the default size
/// (16 KiB) holds. Longer messages leave as their own chunks, shared and not copied, behind the prefix.
pub const JOINED_GRPC_MESSAGE_BYTES: usize = 16 << 10;

/// One gRPC message made of `message`'s chunks, behind its 5-byte prefix (whether the chunks are compressed, then
/// the length): one buffer when short (see [`JOINED_GRPC_MESSAGE_BYTES`]); the message's length when it is more
/// than the prefix can say.
pub fn grpc_message(message: Vec<Bytes>, compressed: bool) -> Result<Vec<Bytes>, usize> {
    let length: usize = message.iter().map(Bytes::len).sum();
    let prefixed = u32::try_from(length).map_err(|_| length)?;
    let joined = length + 5 <= JOINED_GRPC_MESSAGE_BYTES;
    let mut prefix = Vec::with_capacity(if joined { length + 5 } else { 5 });
    prefix.push(u8::from(compressed));
    prefix.extend_from_slice(&prefixed.to_be_bytes());
    if joined {
        for chunk in &message {
            prefix.extend_from_slice(chunk);
        }
        return Ok(vec![Bytes::from(prefix)]);
    }
    let mut chunks = Vec::with_capacity(message.len() + 1);
    chunks.push(Bytes::from(prefix));
    chunks.extend(message);
    Ok(chunks)
}

/// How a body's length is known ahead of its bytes, so it can be gathered into one buffer allocated once.
#[derive(Debug, Clone, Copy)]
pub enum BodyLength {
    /// A REST body's Content-Length, when given.
    ContentLength(Option<usize>),
    /// A gRPC message: its length is in the 5-byte frame header.
    GrpcFrame,
}

/// Why a body could not be gathered.
#[derive(Debug)]
pub enum GatherError<E> {
    /// It is (or says it will be) longer than the bound.
    TooLarge,
    /// It broke off.
    Broken(E),
}

/// Reads a whole body of at most `cap` bytes; gives it and its trailers. A body that arrives as one frame is kept as
/// it is; one in many frames is gathered into a single buffer sized from its announced length (no growth by
/// doubling, no second buffer to join into), each frame freed as it is copied. One that announces more than `cap`
/// is refused before more of it is read.
pub async fn gather<B>(
    body: B,
    cap: usize,
    sized: BodyLength,
) -> Result<(Bytes, Option<http::HeaderMap>), GatherError<B::Error>>
where
    B: Body<Data = Bytes>,
{
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut gathered = BytesMut::new();
    let mut trailers = None;
    let mut announced = match sized {
        BodyLength::ContentLength(length) => length,
        BodyLength::GrpcFrame => None,
    };
    if announced.is_some_and(|length| length > cap) {
        return Err(GatherError::TooLarge);
    }
    while let Some(frame) = body.frame().await {
        let data = match frame.map_err(GatherError::Broken)?.into_data() {
            Ok(data) => data,
            Err(frame) => {
                if let Ok(map) = frame.into_trailers() {
                    trailers = Some(map);
                }
                continue;
            }
        };
        let so_far = first.as_ref().map_or(0, Bytes::len) + gathered.len();
        if so_far + data.len() > cap {
            return Err(GatherError::TooLarge);
        }
        if announced.is_none() && matches!(sized, BodyLength::GrpcFrame) {
            let mut header = [0u8; 5];
            let known = first.iter().chain(Some(&data)).flat_map(|b| b.iter()).take(5);
            let mut count = 0;
            for (slot, byte) in header.iter_mut().zip(known) {
                *slot = *byte;
                count += 1;
            }
            if count == 5 {
                let length = 5 + u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
                if length > cap {
                    return Err(GatherError::TooLarge);
                }
                announced = Some(length);
            }
        }
        if first.is_none() && gathered.is_empty() {
            first = Some(data);
            continue;
        }
        if let Some(previous) = first.take() {
            gathered.reserve(announced.unwrap_or(0).max(previous.len() + data.len()));
            gathered.extend_from_slice(&previous);
        }
        gathered.extend_from_slice(&data);
    }
    let body = match first {
        Some(only) => only,
        None => gathered.freeze(),
    };
    Ok((body, trailers))
}

/// Chunks at least this long are kept as they came (shared): the bookkeeping of one is under 1% of its bytes.
pub const SHARED_CHUNK: usize = 4096;
/// Runs of shorter chunks are copied into blocks of this size.
const COPY_BLOCK: usize = 64 * 1024;

/// A body's chunks kept as they pass (what is read before routing, what the mirror and the payload log are handed):
/// chunks of at least [`SHARED_CHUNK`] bytes as they came, shared, and runs of shorter ones copied together into
/// blocks, so what is kept is bounded by the data it holds however finely a client cut it (a chunk of one byte
/// would otherwise cost a 32-byte handle, and hold the buffer it was read into).
#[derive(Debug, Default)]
pub struct KeptChunks {
    chunks: Vec<Bytes>,
    /// The run of short chunks being copied, in the block they are copied into.
    block: BytesMut,
    length: usize,
}

impl KeptChunks {
    pub fn push(&mut self, chunk: Bytes) {
        self.length += chunk.len();
        if chunk.len() >= SHARED_CHUNK {
            self.seal();
            self.chunks.push(chunk);
            return;
        }
        if self.block.capacity() - self.block.len() < chunk.len() {
            self.seal();
            self.block.reserve(COPY_BLOCK);
        }
        self.block.extend_from_slice(&chunk);
    }

    /// Ends the run being copied: it is kept as it is, the rest of its block for the next run.
    fn seal(&mut self) {
        if !self.block.is_empty() {
            self.chunks.push(self.block.split().freeze());
        }
    }

    /// The bytes kept.
    pub fn len(&self) -> usize {
        self.length
    }

    pub fn is_empty(&self) -> bool {
        self.length == 0
    }

    /// The chunks kept, in order.
    pub fn into_chunks(mut self) -> Vec<Bytes> {
        self.seal();
        self.chunks
    }
}

#[derive(Debug, Default, Clone)]
pub struct ChunksBody {
    chunks: VecDeque<Bytes>,
    remaining: u64,
    /// Sent after the last chunk (a gRPC answer's status). Boxed: most bodies have none, and a body is moved with its
    /// request or answer.
    trailers: Option<Box<http::HeaderMap>>,
}

impl ChunksBody {
    pub fn new(chunks: Vec<Bytes>) -> Self {
        let remaining = chunks.iter().map(|c| c.len() as u64).sum();
        ChunksBody {
            chunks: chunks.into_iter().filter(|c| !c.is_empty()).collect(),
            remaining,
            trailers: None,
        }
    }

    /// The chunks not yet taken, to be written where they are without taking them (so the body can be sent again).
    pub fn chunks(&self) -> &VecDeque<Bytes> {
        &self.chunks
    }

    /// The chunks, then `trailers`.
    pub fn with_trailers(chunks: Vec<Bytes>, trailers: http::HeaderMap) -> Self {
        ChunksBody {
            trailers: Some(Box::new(trailers)),
            ..ChunksBody::new(chunks)
        }
    }
}

impl Body for ChunksBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(chunk) = self.chunks.pop_front() {
            self.remaining -= chunk.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        Poll::Ready(self.trailers.take().map(|trailers| Ok(Frame::trailers(*trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// A body that keeps `T` alive until it is dropped (a request's place among those under way, until its answer is
/// sent).
#[derive(Debug)]
pub struct Holding<B, T> {
    body: B,
    _held: T,
}

impl<B, T> Holding<B, T> {
    pub fn new(body: B, held: T) -> Self {
        Holding { body, _held: held }
    }
}

impl<B: Body + Unpin, T: Unpin> Body for Holding<B, T> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A body sent to a backend: buffers at hand, or a client's body relayed as it arrives.
#[derive(Debug)]
pub enum OutBody {
    Chunks(ChunksBody),
    /// Boxed: an attempt's view of a client's body is large, and most bodies are at hand whole.
    Relayed(Box<Relayed>),
    /// The requests of a stream, as they come.
    Channel(ChannelBody),
}

/// A body sent as its chunks arrive on a bounded channel (a stream's framed messages), ended when the sender is
/// dropped. The channel's bound is the backpressure: a backend that stops reading stalls the sender.
#[derive(Debug)]
pub struct ChannelBody {
    chunks: tokio::sync::mpsc::Receiver<Bytes>,
}

impl ChannelBody {
    pub fn new(chunks: tokio::sync::mpsc::Receiver<Bytes>) -> ChannelBody {
        ChannelBody { chunks }
    }
}

impl From<ChunksBody> for OutBody {
    fn from(body: ChunksBody) -> Self {
        OutBody::Chunks(body)
    }
}

impl Body for OutBody {
    type Data = Bytes;
    type Error = RelayError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, RelayError>>> {
        match self.get_mut() {
            OutBody::Chunks(body) => Pin::new(body).poll_frame(cx).map_err(|never| match never {}),
            OutBody::Relayed(body) => Pin::new(&mut **body).poll_frame(cx),
            OutBody::Channel(body) => body.chunks.poll_recv(cx).map(|chunk| chunk.map(|c| Ok(Frame::data(c)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            OutBody::Chunks(body) => body.is_end_stream(),
            OutBody::Relayed(body) => body.is_end_stream(),
            OutBody::Channel(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            OutBody::Chunks(body) => body.size_hint(),
            OutBody::Relayed(body) => body.size_hint(),
            OutBody::Channel(_) => SizeHint::default(),
        }
    }
}

/// A client's request body held to a pace: a frame must arrive within `stall` of the previous one (or of the first
/// read), and the whole body within `total` of its first wait; so a client that trickles its body, or stops, gives
/// up its connection (and whatever it was admitted to) instead of holding it. (Its bytes on the wire, framing with
/// data, are bounded by the door's reader of each protocol.)
#[derive(Debug)]
pub struct RequestBody {
    body: ClientBody,
    limits: BodyLimits,
    /// Armed while the body waits for bytes.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// When the whole body must have come, set at its first wait (a body at hand at once never waits).
    due: Option<tokio::time::Instant>,
}

/// A body's next frame, its end, or why it failed.
type PolledFrame = Option<Result<Frame<Bytes>, RequestBodyError>>;

/// What a request body is held to.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    /// The longest it may go without bytes (`limits.body_read_timeout_ms`).
    pub stall: std::time::Duration,
    /// The longest it may take whole (`limits.body_total_timeout_ms`).
    pub total: std::time::Duration,
    /// The most bytes it may take on the wire (`limits.max_request_bytes`), read by the door's protocol readers.
    pub bytes: u64,
}

impl RequestBody {
    pub fn new(body: ClientBody, limits: BodyLimits) -> RequestBody {
        RequestBody {
            body,
            limits,
            timer: None,
            due: None,
        }
    }

    /// The next frame from the door's body.
    fn poll_inner(&mut self, cx: &mut Context<'_>) -> Poll<PolledFrame> {
        match &mut self.body {
            ClientBody::Http1(body) => Pin::new(body)
                .poll_frame(cx)
                .map(|frame| frame.map(|frame| frame.map_err(RequestBodyError::Http1))),
            ClientBody::Http2(body) => Pin::new(body).poll_frame(cx).map(|frame| {
                frame.map(|frame| {
                    frame.map_err(|error| match error {
                        Http2BodyError::Broken(error) => RequestBodyError::Broken(error),
                        Http2BodyError::TooLarge(limit) => RequestBodyError::TooLarge(limit),
                    })
                })
            }),
        }
    }
}

/// A client's body as its door reads it: from the REST door's own HTTP/1.1 connection, or from hyper's HTTP/2.
#[derive(Debug)]
pub enum ClientBody {
    Http1(Http1Body),
    Http2(Http2Body),
}

/// Why a request body could not be read.
#[derive(Debug)]
pub enum RequestBodyError {
    /// No bytes came for this long.
    Stalled(std::time::Duration),
    /// The whole body did not come within this long.
    Overdue(std::time::Duration),
    /// It took more than this many bytes on the wire.
    TooLarge(u64),
    /// An HTTP/1.1 body broke off (its connection closed, its chunks malformed).
    Http1(Http1BodyError),
    /// hyper could not read an HTTP/2 body (the stream reset, the connection closed).
    Broken(hyper::Error),
}

impl std::fmt::Display for RequestBodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RequestBodyError::Stalled(stall) => write!(
                f,
                "the request body stalled: no bytes for {} ms (limits.body_read_timeout_ms)",
                stall.as_millis()
            ),
            RequestBodyError::Overdue(total) => write!(
                f,
                "the request body did not arrive whole within {} ms (limits.body_total_timeout_ms)",
                total.as_millis()
            ),
            RequestBodyError::TooLarge(limit) => write!(
                f,
                "the request body takes more than the limit of {limit} bytes (limits.max_request_bytes), its frames' \
                 headers counted with its data"
            ),
            RequestBodyError::Http1(error) => error.fmt(f),
            RequestBodyError::Broken(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for RequestBodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RequestBodyError::Stalled(_) | RequestBodyError::Overdue(_) | RequestBodyError::TooLarge(_) => None,
            RequestBodyError::Http1(error) => Some(error),
            RequestBodyError::Broken(error) => Some(error),
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = RequestBodyError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match this.poll_inner(cx) {
            Poll::Ready(frame) => {
                this.timer = None;
                if let Some(due) = this.due
                    && matches!(frame, Some(Ok(_)))
                    && tokio::time::Instant::now() > due
                {
                    return Poll::Ready(Some(Err(RequestBodyError::Overdue(this.limits.total))));
                }
                Poll::Ready(frame)
            }
            Poll::Pending => {
                let (stall, total) = (this.limits.stall, this.limits.total);
                let now = tokio::time::Instant::now();
                let due = *this.due.get_or_insert(now + total);
                // One timer for both bounds, set at the wait's start: the nearer of the next byte's and the whole
                // body's.
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until((now + stall).min(due))));
                ready!(timer.as_mut().poll(cx));
                this.timer = None;
                Poll::Ready(Some(Err(if tokio::time::Instant::now() >= due {
                    RequestBodyError::Overdue(total)
                } else {
                    RequestBodyError::Stalled(stall)
                })))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.body {
            ClientBody::Http1(body) => body.is_end_stream(),
            ClientBody::Http2(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.body {
            ClientBody::Http1(body) => body.size_hint(),
            ClientBody::Http2(body) => body.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_grpc_message_is_one_buffer_and_a_long_one_its_prefix_then_its_own_chunks() {
        let message = vec![Bytes::from_static(b"abc"), Bytes::from_static(b"de")];
        let framed = grpc_message(message, true).unwrap();
        assert_eq!(
            framed,
            [Bytes::from_static(&[1, 0, 0, 0, 5, b'a', b'b', b'c', b'd', b'e'])]
        );
        // Exactly the bound, with its prefix, is still one buffer.
        let whole = vec![Bytes::from(vec![7; JOINED_GRPC_MESSAGE_BYTES - 5])];
        assert_eq!(grpc_message(whole, false).unwrap().len(), 1);

        static TENSOR: [u8; JOINED_GRPC_MESSAGE_BYTES] = [9; JOINED_GRPC_MESSAGE_BYTES];
        let message = vec![Bytes::from_static(b"head"), Bytes::from_static(&TENSOR)];
        let framed = grpc_message(message.clone(), false).unwrap();
        let length = u32::try_from(JOINED_GRPC_MESSAGE_BYTES + 4).unwrap().to_be_bytes();
        assert_eq!(framed[0].as_ref(), [0, length[0], length[1], length[2], length[3]]);
        assert_eq!(framed[1..], message);
        assert_eq!(
            framed[2].as_ptr(),
            TENSOR.as_ptr(),
            "the chunks of a long message are shared, not copied"
        );
    }

    #[test]
    fn a_grpc_message_beyond_four_gibibytes_is_refused() {
        static MEBIBYTE: [u8; 1 << 20] = [0; 1 << 20];
        let message = vec![Bytes::from_static(&MEBIBYTE); 4096 + 1];
        assert_eq!(grpc_message(message, false).unwrap_err(), (4096 + 1) << 20);
    }
}
