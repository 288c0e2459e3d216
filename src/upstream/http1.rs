//! HTTP/1.1 connections to REST backends, spoken by the request itself: each thread keeps its own idle connections
//! per endpoint, and a request writes its head and body and reads its answer on one of them from its own task (no
//! connection task, no channel between tasks, no pool shared between threads), giving it back to the thread once its
//! answer has been read to the end. An answer's head is read with httparse; its body is framed by its length, its
//! chunks, or the connection's end.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING, USER_AGENT};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite};

use super::ThreadClients;
use crate::body::OutBody;
use crate::codec::chunked::{Chunk, Malformed};

/// How long a kept connection may sit idle before it is closed rather than used: backends commonly close theirs
/// after 60 to 120 seconds, and a request sent on a connection the backend is closing fails.
const IDLE_LIMIT: Duration = Duration::from_secs(90);

/// The most idle connections a thread keeps per endpoint; a connection given back beyond them is closed.
const MOST_IDLE: usize = 256;

/// How often a thread closes its connections idle for longer than [`IDLE_LIMIT`]: those of an endpoint that gets no
/// more requests would otherwise stay open (the backend's side of them closed) until it does.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// The most bytes an answer's head (status line and headers) may take; a longer one is a broken answer.
const MOST_HEAD: usize = 128 * 1024;

/// The most headers an answer may have (hyper's limit for a client).
const MOST_HEADERS: usize = 100;

/// What a read asks for first; reads of a long body grow to [`READ_MOST`] while they fill what they are given.
const READ_FIRST: usize = 8 * 1024;

/// The most one read asks for.
const READ_MOST: usize = 512 * 1024;

/// The most bytes of framing a chunked answer may send between two pieces of data (size lines with their extensions,
/// and the trailers after the last chunk, which are read and dropped: they are this hop's).
const MOST_CHUNK_FRAMING: usize = 64 * 1024;

/// The most buffers one vectored write hands the kernel.
const MOST_SLICES: usize = 16;

/// How the gateway names itself to backends.
const AGENT: HeaderValue = HeaderValue::from_static(concat!("oipgate/", env!("CARGO_PKG_VERSION")));

/// A TLS connection's stream, whatever its layers.
trait Transport: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> Transport for T {}

/// A backend connection's transport: TCP, or TLS over it for `https` endpoints.
enum Io {
    Plain(tokio::net::TcpStream),
    Tls(Box<dyn Transport>),
}

impl Io {
    fn from_connected(connected: hyper_rustls::MaybeHttpsStream<hyper_util::rt::TokioIo<tokio::net::TcpStream>>) -> Io {
        match connected {
            hyper_rustls::MaybeHttpsStream::Http(tcp) => Io::Plain(tcp.into_inner()),
            hyper_rustls::MaybeHttpsStream::Https(tls) => Io::Tls(Box::new(tls.into_inner())),
        }
    }

    /// Reads into `buffer`'s spare room (which the caller makes), giving how many bytes came: 0 at the end.
    fn poll_read(&mut self, cx: &mut Context<'_>, buffer: &mut BytesMut) -> Poll<io::Result<usize>> {
        match self {
            Io::Plain(tcp) => tokio_util::io::poll_read_buf(Pin::new(tcp), cx, buffer),
            Io::Tls(tls) => tokio_util::io::poll_read_buf(Pin::new(&mut **tls), cx, buffer),
        }
    }

    fn poll_write_vectored(&mut self, cx: &mut Context<'_>, slices: &[IoSlice<'_>]) -> Poll<io::Result<usize>> {
        match self {
            Io::Plain(tcp) => Pin::new(tcp).poll_write_vectored(cx, slices),
            Io::Tls(tls) => Pin::new(&mut **tls).poll_write_vectored(cx, slices),
        }
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Io::Plain(_) => Poll::Ready(Ok(())),
            Io::Tls(tls) => Pin::new(&mut **tls).poll_flush(cx),
        }
    }
}

/// One HTTP/1.1 connection, used by one request at a time.
pub(super) struct Kept {
    io: Io,
    /// What the backend sent that has not been handed on yet.
    read: BytesMut,
    /// The request head being written; its allocation serves request after request.
    head: Vec<u8>,
    /// How much the next read of a body asks for.
    read_size: usize,
    /// The connection cannot carry another request (closed, failed, mid-message, or the backend said so).
    ended: bool,
    /// When it was last given back.
    idle_since: Instant,
    /// The thread that made it: its socket is registered with that thread's reactor.
    thread: usize,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kept").field("ended", &self.ended).finish()
    }
}

/// This thread's mark, to tell whether a connection is given back on the thread that made it.
fn this_thread() -> usize {
    thread_local! {
        static MARK: u8 = const { 0 };
    }
    MARK.with(|mark| std::ptr::from_ref(mark) as usize)
}

fn broken(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

fn closed(message: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, message)
}

impl Kept {
    /// Whether it has ended or been idle too long at `now`, and is not to be used.
    pub(super) fn aged(&self, now: Instant) -> bool {
        self.ended || now.saturating_duration_since(self.idle_since) > IDLE_LIMIT
    }

    /// Whether an idle connection can take a request: the backend has neither closed it nor sent anything on it.
    /// The socket's readiness is as the reactor last saw it, so an open connection costs no read to check.
    fn poll_open(&mut self, cx: &mut Context<'_>) -> bool {
        if self.ended || !self.read.is_empty() {
            return false;
        }
        self.read.reserve(READ_FIRST);
        self.io.poll_read(cx, &mut self.read).is_pending()
    }

    /// Reads what the backend sends next into the buffer, asking for up to `want` bytes (at least a first read's
    /// worth); `Ok(0)` when the backend has closed the connection.
    fn poll_fill(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>> {
        let asked = want.clamp(READ_FIRST, READ_MOST);
        if self.read.capacity() - self.read.len() < asked {
            self.read.reserve(asked);
        }
        let room = self.read.capacity() - self.read.len();
        let read = ready!(self.io.poll_read(cx, &mut self.read));
        match &read {
            Ok(0) | Err(_) => self.ended = true,
            // A read that filled its room asks for more next time (a long body comes in fewer reads).
            Ok(count) if *count == room => self.read_size = (self.read_size * 2).min(READ_MOST),
            Ok(_) => {}
        }
        Poll::Ready(read)
    }

    /// Writes the head of a request: its line, `host`, the headers of each map (a framing or naming header among them
    /// left out: this hop sets its own), the gateway's name and the body's framing.
    fn write_head(&mut self, request: &Request<'_>, framing: Sending) {
        let head = &mut self.head;
        head.clear();
        head.extend_from_slice(request.method.as_str().as_bytes());
        head.push(b' ');
        head.extend_from_slice(request.path.as_str().as_bytes());
        head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        head.extend_from_slice(request.host.as_bytes());
        head.extend_from_slice(b"\r\n");
        for headers in request.headers {
            for (name, value) in headers {
                if [&HOST, &USER_AGENT, &CONTENT_LENGTH, &TRANSFER_ENCODING, &CONNECTION].contains(&name) {
                    continue;
                }
                head.extend_from_slice(name.as_str().as_bytes());
                head.extend_from_slice(b": ");
                head.extend_from_slice(value.as_bytes());
                head.extend_from_slice(b"\r\n");
            }
        }
        head.extend_from_slice(b"user-agent: ");
        head.extend_from_slice(AGENT.as_bytes());
        head.extend_from_slice(b"\r\n");
        match framing {
            Sending::Length(length) => {
                head.extend_from_slice(b"content-length: ");
                head.extend_from_slice(itoa::Buffer::new().format(length).as_bytes());
                head.extend_from_slice(b"\r\n");
            }
            Sending::Chunked => head.extend_from_slice(b"transfer-encoding: chunked\r\n"),
            Sending::Nothing => {}
        }
        head.extend_from_slice(b"\r\n");
    }

    /// Writes the request and reads its answer's head, at once: a backend may answer (an error, as a rule) before it
    /// has read the whole body, and it is not sent the rest.
    fn poll_exchange(
        &mut self,
        cx: &mut Context<'_>,
        writing: &mut Writing,
        body: &mut OutBody,
        asked_head: bool,
    ) -> Poll<io::Result<AnswerHead>> {
        if !writing.done {
            match writing.poll_write(cx, &mut self.io, &self.head, body) {
                Poll::Ready(Ok(())) => writing.done = true,
                Poll::Ready(Err(error)) if writing.body_failed => {
                    self.ended = true;
                    return Poll::Ready(Err(error));
                }
                Poll::Ready(Err(error)) => {
                    // The backend may have answered before it closed: its answer is read all the same.
                    self.ended = true;
                    writing.done = true;
                    writing.failed = Some(error);
                }
                Poll::Pending => {}
            }
        }
        loop {
            if !self.read.is_empty() {
                match read_head(&mut self.read, asked_head)? {
                    Parsed::Answer(head) => {
                        // An answer before the whole request was sent leaves the connection mid-message.
                        if !writing.done || !head.reusable {
                            self.ended = true;
                        }
                        return Poll::Ready(Ok(head));
                    }
                    Parsed::Interim => continue,
                    Parsed::Partial => {}
                }
            }
            match ready!(self.poll_fill(cx, READ_FIRST)) {
                Ok(0) if writing.answer_begun => return Poll::Ready(Err(closed("the connection closed mid-head"))),
                Ok(0) => {
                    return Poll::Ready(Err(writing
                        .failed
                        .take()
                        .unwrap_or_else(|| closed("the connection closed before an answer"))));
                }
                Ok(_) => writing.answer_begun = true,
                Err(error) => return Poll::Ready(Err(writing.failed.take().unwrap_or(error))),
            }
        }
    }
}

/// A request for a backend: the method, the path, and the headers of each map in turn (the request's, then those
/// the endpoint adds).
pub(super) struct Request<'a> {
    pub method: &'a Method,
    pub path: &'a PathAndQuery,
    pub host: &'a HeaderValue,
    pub headers: [&'a HeaderMap; 2],
    pub body: OutBody,
}

/// How a request's body is framed.
#[derive(Debug, Clone, Copy)]
enum Sending {
    Length(u64),
    Chunked,
    /// No body, and a method that takes none.
    Nothing,
}

impl Sending {
    fn of(method: &Method, body: &OutBody) -> Sending {
        match body.size_hint().exact() {
            Some(0) if matches!(*method, Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS) => {
                Sending::Nothing
            }
            Some(length) => Sending::Length(length),
            None => Sending::Chunked,
        }
    }
}

/// Where the writing of a request stands.
struct Writing {
    framing: Sending,
    /// Bytes of the head written.
    head_at: usize,
    /// A body at hand: its next chunk to write, and how much of that is written.
    chunk: usize,
    chunk_at: usize,
    /// A streamed body: what is to be written of its current piece (a chunk with its framing when chunked).
    piece: Vec<Bytes>,
    /// A streamed body has ended (its last chunk, when chunked, is in `piece`).
    streamed_all: bool,
    /// Body bytes taken from a streamed body.
    taken: u64,
    /// The whole request is written.
    done: bool,
    /// Some of it reached the connection.
    wrote: bool,
    /// A frame was taken from a streamed body: it cannot be sent again.
    consumed: bool,
    /// The body itself failed (the client's went away or stalled): the request is abandoned.
    body_failed: bool,
    /// Some of the answer has arrived.
    answer_begun: bool,
    /// Writing failed; reported unless an answer arrives all the same.
    failed: Option<io::Error>,
}

impl Writing {
    fn new(framing: Sending) -> Writing {
        Writing {
            framing,
            head_at: 0,
            chunk: 0,
            chunk_at: 0,
            piece: Vec::new(),
            streamed_all: false,
            taken: 0,
            done: false,
            wrote: false,
            consumed: false,
            body_failed: false,
            answer_begun: false,
            failed: None,
        }
    }

    /// Writes what it can of the head and the body; ready once all is written and flushed.
    fn poll_write(
        &mut self,
        cx: &mut Context<'_>,
        io: &mut Io,
        head: &[u8],
        body: &mut OutBody,
    ) -> Poll<io::Result<()>> {
        loop {
            let streamed = !matches!(body, OutBody::Chunks(_));
            let mut waiting = false;
            if streamed && self.piece.is_empty() && !self.streamed_all {
                match self.poll_piece(cx, body) {
                    Poll::Ready(Ok(())) => {}
                    Poll::Ready(Err(error)) => {
                        self.body_failed = true;
                        return Poll::Ready(Err(error));
                    }
                    Poll::Pending => waiting = true,
                }
            }
            let mut slices = [IoSlice::new(&[]); MOST_SLICES];
            let mut count = 0;
            if self.head_at < head.len() {
                slices[0] = IoSlice::new(&head[self.head_at..]);
                count = 1;
            }
            match body {
                OutBody::Chunks(chunks) => {
                    for (index, chunk) in chunks
                        .chunks()
                        .iter()
                        .enumerate()
                        .skip(self.chunk)
                        .take(MOST_SLICES - count)
                    {
                        let from = if index == self.chunk { self.chunk_at } else { 0 };
                        slices[count] = IoSlice::new(&chunk[from..]);
                        count += 1;
                    }
                }
                _ => {
                    for part in self.piece.iter().take(MOST_SLICES - count) {
                        slices[count] = IoSlice::new(part);
                        count += 1;
                    }
                }
            }
            if count == 0 {
                // What is written goes out (TLS holds it otherwise) before waiting on the body for more.
                ready!(io.poll_flush(cx))?;
                return if waiting { Poll::Pending } else { Poll::Ready(Ok(())) };
            }
            let written = ready!(io.poll_write_vectored(cx, &slices[..count]))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.wrote = true;
            self.advance(written, head.len(), body);
        }
    }

    /// Takes the streamed body's next frame as the piece to write, framed as the request says.
    fn poll_piece(&mut self, cx: &mut Context<'_>, body: &mut OutBody) -> Poll<io::Result<()>> {
        loop {
            let frame = ready!(Pin::new(&mut *body).poll_frame(cx));
            self.consumed = true;
            let data = match frame {
                None => {
                    self.streamed_all = true;
                    return Poll::Ready(match self.framing {
                        Sending::Chunked => {
                            self.piece.push(Bytes::from_static(b"0\r\n\r\n"));
                            Ok(())
                        }
                        Sending::Length(length) if self.taken != length => Err(io::Error::other(format!(
                            "the request body ended after {} of its {length} bytes",
                            self.taken
                        ))),
                        _ => Ok(()),
                    });
                }
                Some(Err(error)) => return Poll::Ready(Err(io::Error::other(error))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => data,
                    // Trailers stay on the client's hop.
                    _ => continue,
                },
            };
            self.taken += data.len() as u64;
            match self.framing {
                Sending::Chunked => {
                    self.piece.push(Bytes::from(format!("{:x}\r\n", data.len())));
                    self.piece.push(data);
                    self.piece.push(Bytes::from_static(b"\r\n"));
                }
                Sending::Length(length) if self.taken > length => {
                    return Poll::Ready(Err(io::Error::other(format!(
                        "the request body is longer than its {length} bytes"
                    ))));
                }
                Sending::Length(_) => self.piece.push(data),
                Sending::Nothing => {
                    return Poll::Ready(Err(io::Error::other("a request body where none was declared")));
                }
            }
            return Poll::Ready(Ok(()));
        }
    }

    /// Notes `written` more bytes written, head first.
    fn advance(&mut self, mut written: usize, head: usize, body: &OutBody) {
        let of_head = written.min(head - self.head_at);
        self.head_at += of_head;
        written -= of_head;
        match body {
            OutBody::Chunks(chunks) => {
                let chunks = chunks.chunks();
                while written > 0 {
                    let left = chunks[self.chunk].len() - self.chunk_at;
                    if written < left {
                        self.chunk_at += written;
                        return;
                    }
                    written -= left;
                    self.chunk += 1;
                    self.chunk_at = 0;
                }
            }
            _ => {
                while written > 0 {
                    let part = &mut self.piece[0];
                    if written < part.len() {
                        part.advance(written);
                        return;
                    }
                    written -= part.len();
                    self.piece.remove(0);
                }
            }
        }
    }
}

/// An answer's head, read.
struct AnswerHead {
    status: StatusCode,
    version: Version,
    headers: HeaderMap,
    framing: Framing,
    /// The connection may carry another request once the body is read.
    reusable: bool,
}

/// What the bytes at hand hold of an answer's head.
enum Parsed {
    Answer(AnswerHead),
    /// An interim answer (100 Continue and the like), now dropped: the answer follows.
    Interim,
    Partial,
}

/// How many headers' places a head's read notes on the stack; a head with more is read a second time.
const PLACED: usize = 16;

/// Reads an answer's head from the start of `read`, taking it off the buffer when whole. The header values are the
/// head's own bytes, shared, not copied.
fn read_head(read: &mut BytesMut, asked_head: bool) -> io::Result<Parsed> {
    let mut slots = [const { std::mem::MaybeUninit::uninit() }; MOST_HEADERS];
    let mut answer = httparse::Response::new(&mut []);
    let length =
        match httparse::ParserConfig::default().parse_response_with_uninit_headers(&mut answer, read, &mut slots) {
            Ok(httparse::Status::Complete(length)) if length <= MOST_HEAD => length,
            Ok(httparse::Status::Partial) if read.len() <= MOST_HEAD => return Ok(Parsed::Partial),
            Ok(_) => return Err(broken(format!("an answer head over {MOST_HEAD} bytes"))),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(broken(format!("an answer with more than {MOST_HEADERS} headers")));
            }
            Err(error) => return Err(broken(format!("a malformed answer head ({error})"))),
        };
    let code = answer.code.unwrap_or_default();
    let status = StatusCode::from_u16(code).map_err(|_| broken(format!("an answer with status {code}")))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(broken("an answer switching protocols, which no request asked for"));
    }
    if status.is_informational() {
        read.advance(length);
        return Ok(Parsed::Interim);
    }
    let version = if answer.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    // Where each header lies in the head, noted while the parse borrows the buffer, so that the values can be
    // slices of the head once it is split off.
    let count = answer.headers.len();
    let base = read.as_ptr() as usize;
    let mut places: [_; PLACED] = std::array::from_fn(|_| (0..0, 0..0));
    for (place, header) in places.iter_mut().zip(answer.headers.iter()) {
        let at = |bytes: &[u8]| {
            let start = bytes.as_ptr() as usize - base;
            start..start + bytes.len()
        };
        *place = (at(header.name.as_bytes()), at(header.value));
    }
    let head = read.split_to(length).freeze();
    let mut said = Said::new(version, count);
    if count <= PLACED {
        for (name, value) in places.into_iter().take(count) {
            said.note(&head[name], head.slice(value))?;
        }
    } else {
        let mut slots = [const { std::mem::MaybeUninit::uninit() }; MOST_HEADERS];
        let mut again = httparse::Response::new(&mut []);
        httparse::ParserConfig::default()
            .parse_response_with_uninit_headers(&mut again, &head, &mut slots)
            .map_err(|error| broken(format!("a malformed answer head ({error})")))?;
        for header in again.headers.iter() {
            said.note(header.name.as_bytes(), head.slice_ref(header.value))?;
        }
    }
    Ok(Parsed::Answer(said.into_head(status, asked_head)))
}

/// What an answer's headers say of its framing and its connection, gathered with the headers.
struct Said {
    version: Version,
    headers: HeaderMap,
    length: Option<u64>,
    coded: bool,
    chunked: bool,
    close: bool,
}

impl Said {
    fn new(version: Version, count: usize) -> Said {
        Said {
            version,
            headers: HeaderMap::with_capacity(count),
            length: None,
            coded: false,
            chunked: false,
            close: version == Version::HTTP_10,
        }
    }

    fn note(&mut self, name: &[u8], value: Bytes) -> io::Result<()> {
        let name = HeaderName::from_bytes(name).map_err(|_| broken("an answer header with an invalid name"))?;
        let value = HeaderValue::from_maybe_shared(value)
            .map_err(|_| broken(format!("an invalid value of the answer's {name} header")))?;
        if name == CONTENT_LENGTH {
            let said =
                content_length(value.as_bytes()).ok_or_else(|| broken("an answer with an invalid Content-Length"))?;
            if self.length.is_some_and(|before| before != said) {
                return Err(broken("an answer with two different Content-Length values"));
            }
            self.length = Some(said);
        } else if name == TRANSFER_ENCODING {
            self.coded = true;
            self.chunked = value
                .as_bytes()
                .rsplit(|&byte| byte == b',')
                .next()
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name == CONNECTION {
            for token in value.as_bytes().split(|&byte| byte == b',').map(<[u8]>::trim_ascii) {
                if token.eq_ignore_ascii_case(b"close") {
                    self.close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") && self.version == Version::HTTP_10 {
                    self.close = false;
                }
            }
        }
        self.headers.append(name, value);
        Ok(())
    }

    /// The head, its body framed as the headers say (RFC 9112 §6.3).
    fn into_head(mut self, status: StatusCode, asked_head: bool) -> AnswerHead {
        let framing = if asked_head || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            Framing::Length(0)
        } else if self.chunked {
            // A length beside the chunks says nothing true about the body.
            self.headers.remove(CONTENT_LENGTH);
            Framing::Chunked(Chunk::Start, 0)
        } else if self.coded {
            Framing::UntilClose
        } else {
            self.length.map_or(Framing::UntilClose, Framing::Length)
        };
        AnswerHead {
            status,
            version: self.version,
            reusable: !self.close && !matches!(framing, Framing::UntilClose),
            headers: self.headers,
            framing,
        }
    }
}

/// A Content-Length value: digits, or a list of the same digits repeated.
fn content_length(value: &[u8]) -> Option<u64> {
    let mut said = None;
    for item in value.split(|&byte| byte == b',').map(<[u8]>::trim_ascii) {
        if item.is_empty() || item.len() > 19 || !item.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let length = item.iter().fold(0u64, |sum, digit| sum * 10 + u64::from(digit - b'0'));
        if said.is_some_and(|before| before != length) {
            return None;
        }
        said = Some(length);
    }
    said
}

/// How an answer's body is framed, and how much of it is left.
#[derive(Debug, Clone, Copy)]
enum Framing {
    Length(u64),
    /// Where the chunks' reading stands, and the framing bytes read since the last data (bounded: a backend that
    /// sends extensions or trailers without end is refused).
    Chunked(Chunk, usize),
    /// Until the backend closes the connection.
    UntilClose,
}

impl Framing {
    fn is_done(&self) -> bool {
        matches!(self, Framing::Length(0) | Framing::Chunked(Chunk::Done, _))
    }
}

/// Why a request could not be sent or answered.
#[derive(Debug)]
pub(super) enum Failure {
    /// No connection could be made: nothing was sent.
    Connect(Box<dyn std::error::Error + Send + Sync>),
    /// The exchange failed; `unsent` when none of the request reached the connection.
    Http { error: io::Error, unsent: bool },
}

/// Sends `request` on one of this thread's idle connections to the endpoint, or a new one. A request that could
/// not be written to a kept connection goes on a new one; so does one whose kept connection closed before any of
/// its answer came, while its body can be sent again (a backend closing an idle connection as the request went out:
/// MLServer's REST server closes its connection after a 500 without saying so), as curl does.
pub(super) async fn send(
    clients: &ThreadClients,
    uri: &http::Uri,
    mut request: Request<'_>,
) -> Result<http::Response<BackendBody>, Failure> {
    let framing = Sending::of(request.method, &request.body);
    let asked_head = *request.method == Method::HEAD;
    loop {
        let (mut kept, reused) = match idle(clients).await {
            Some(kept) => (kept, true),
            // Boxed: connecting is rare, and its state (resolving, connecting, TLS) would otherwise be part of every
            // request's.
            None => (Box::pin(connect(clients, uri)).await?, false),
        };
        kept.write_head(&request, framing);
        let mut writing = Writing::new(framing);
        let body = &mut request.body;
        let exchanged = std::future::poll_fn(|cx| kept.poll_exchange(cx, &mut writing, body, asked_head)).await;
        match exchanged {
            Ok(head) => {
                let mut response = http::Response::new(BackendBody {
                    framing: head.framing,
                    kept: Some(kept),
                    token: clients.token.clone(),
                });
                *response.status_mut() = head.status;
                *response.version_mut() = head.version;
                *response.headers_mut() = head.headers;
                return Ok(response);
            }
            Err(error) => {
                let again = reused
                    && !writing.body_failed
                    && !writing.answer_begun
                    && (!writing.wrote || (!writing.consumed && crate::error::is_closed_connection(&error)));
                if !again {
                    return Err(Failure::Http {
                        error,
                        unsent: !writing.wrote,
                    });
                }
                if writing.wrote {
                    // The other idle connections may have been closed alike.
                    drop_idle(clients);
                }
            }
        }
    }
}

/// The most recently used of this thread's idle connections to the endpoint that is still open; those idle too
/// long or closed by the backend are dropped on the way.
async fn idle(clients: &ThreadClients) -> Option<Box<Kept>> {
    loop {
        let mut kept = super::with_endpoint(&clients.token, |endpoint| endpoint.idle.pop())?;
        if kept.aged(Instant::now()) {
            continue;
        }
        if std::future::poll_fn(|cx| Poll::Ready(kept.poll_open(cx))).await {
            return Some(kept);
        }
    }
}

/// Forgets this thread's idle connections to the endpoint.
fn drop_idle(clients: &ThreadClients) {
    let idle = super::with_endpoint(&clients.token, |endpoint| std::mem::take(&mut endpoint.idle));
    drop(idle);
}

/// A new connection to the endpoint (TCP, and TLS for `https`).
async fn connect(clients: &ThreadClients, uri: &http::Uri) -> Result<Box<Kept>, Failure> {
    keep_swept();
    let mut connector = clients.connector.clone();
    let connected = tower_service::Service::call(&mut connector, uri.clone())
        .await
        .map_err(Failure::Connect)?;
    Ok(Box::new(Kept {
        io: Io::from_connected(connected),
        read: BytesMut::new(),
        head: Vec::new(),
        read_size: READ_FIRST,
        ended: false,
        idle_since: Instant::now(),
        thread: this_thread(),
    }))
}

/// Starts this thread's sweep of its idle connections, once. Only on a single-threaded runtime: its tasks run on
/// this thread, whose connections are the ones to sweep (the door threads' runtimes are all single-threaded).
fn keep_swept() {
    thread_local! {
        static SWEPT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if SWEPT.get() {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
        return;
    }
    SWEPT.set(true);
    runtime.spawn(async {
        loop {
            tokio::time::sleep(SWEEP_EVERY).await;
            super::sweep_idle(Instant::now());
        }
    });
}

/// A REST backend's answer body, read from the connection it came on; once it has been read to the end the
/// connection goes back to its thread's idle ones.
#[derive(Debug)]
pub struct BackendBody {
    framing: Framing,
    /// Boxed: a connection moves with the request at every step.
    kept: Option<Box<Kept>>,
    /// The endpoint's entry in each thread's table.
    token: Arc<()>,
}

impl BackendBody {
    /// The next piece of the body from the connection.
    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        let Some(kept) = self.kept.as_deref_mut() else {
            return Poll::Ready(None);
        };
        loop {
            match &mut self.framing {
                Framing::Length(0) | Framing::Chunked(Chunk::Done, _) => return Poll::Ready(None),
                Framing::Length(left) => {
                    if !kept.read.is_empty() {
                        let taken = kept.read.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
                        *left -= taken as u64;
                        return Poll::Ready(Some(Ok(kept.read.split_to(taken).freeze())));
                    }
                    let want = usize::try_from(*left)
                        .unwrap_or(usize::MAX)
                        .min(kept.read_size.max(READ_FIRST));
                    if ready!(kept.poll_fill(cx, want))? == 0 {
                        return Poll::Ready(Some(Err(closed("the connection closed before the answer's end"))));
                    }
                }
                Framing::UntilClose => {
                    if !kept.read.is_empty() {
                        return Poll::Ready(Some(Ok(kept.read.split().freeze())));
                    }
                    if ready!(kept.poll_fill(cx, kept.read_size))? == 0 {
                        self.framing = Framing::Length(0);
                    }
                }
                Framing::Chunked(chunk, framing) => {
                    if let Some(data) = next_chunk(chunk, framing, &mut kept.read)? {
                        return Poll::Ready(Some(Ok(data)));
                    }
                    if *chunk == Chunk::Done {
                        continue;
                    }
                    let want = chunk
                        .data_left()
                        .map_or(READ_FIRST, |left| usize::try_from(left).unwrap_or(usize::MAX));
                    if ready!(kept.poll_fill(cx, want.min(kept.read_size.max(READ_FIRST))))? == 0 {
                        return Poll::Ready(Some(Err(closed(
                            "the connection closed before the answer's last chunk",
                        ))));
                    }
                }
            }
        }
    }
}

/// Reads what it can of a chunked body from `read`: a chunk's data when some is at hand, `None` when more bytes are
/// needed (or the body has ended: `chunk` is then `Done`). `framing` counts the framing bytes since the last data.
fn next_chunk(chunk: &mut Chunk, framing: &mut usize, read: &mut BytesMut) -> io::Result<Option<Bytes>> {
    loop {
        if let Some(left) = chunk.data_left() {
            if read.is_empty() {
                return Ok(None);
            }
            let taken = read.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            chunk.took(taken as u64);
            *framing = 0;
            return Ok(Some(read.split_to(taken).freeze()));
        }
        if *chunk == Chunk::Done || read.is_empty() {
            return Ok(None);
        }
        let mut bytes = &read[..];
        chunk
            .frame(&mut bytes)
            .map_err(|Malformed| broken("an answer with malformed chunked framing"))?;
        let used = read.len() - bytes.len();
        read.advance(used);
        *framing += used;
        if *framing > MOST_CHUNK_FRAMING {
            return Err(broken(format!(
                "an answer with over {MOST_CHUNK_FRAMING} bytes of chunk extensions or trailers"
            )));
        }
    }
}

impl Body for BackendBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        let polled = this.poll_data(cx);
        if let Poll::Ready(Some(Err(_))) = &polled
            && let Some(kept) = &mut this.kept
        {
            kept.ended = true;
        }
        polled.map(|data| data.map(|data| data.map(Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        self.framing.is_done()
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(left) => SizeHint::with_exact(left),
            _ => SizeHint::default(),
        }
    }
}

impl Drop for BackendBody {
    fn drop(&mut self) {
        // An answer not read to its end leaves the connection mid-message: it is closed, not kept. So is one after
        // which the backend sent more than it was asked for.
        let Some(mut kept) = self.kept.take() else {
            return;
        };
        if kept.ended || !self.framing.is_done() || !kept.read.is_empty() || kept.thread != this_thread() {
            return;
        }
        kept.idle_since = Instant::now();
        super::with_endpoint(&self.token, move |endpoint| {
            if endpoint.idle.len() < MOST_IDLE {
                endpoint.idle.push(kept);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A backend answering `ok` to every request; gives its address and how many of its connections are open.
    async fn backend() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let counted = open.clone();
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                counted.fetch_add(1, Ordering::SeqCst);
                let counted = counted.clone();
                tokio::spawn(async move {
                    let mut buffer = vec![0u8; 4096];
                    while let Ok(read @ 1..) = socket.read(&mut buffer).await {
                        let _ = read;
                        let _ = socket
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                            .await;
                    }
                    counted.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        (address, open)
    }

    /// A client of [`backend`], and how many of the backend's connections are open.
    async fn upstream_to_backend() -> (crate::upstream::RestUpstream, Arc<AtomicUsize>) {
        let (address, open) = backend().await;
        let endpoint = crate::config::Endpoint {
            host: address.ip().to_string(),
            port: address.port(),
        };
        let upstream = crate::upstream::RestUpstream::new(&endpoint, Duration::from_secs(2), 1024, None);
        (upstream, open)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_request_on_a_kept_connection_wakes_its_task_only_when_the_answer_arrives() {
        use http_body_util::BodyExt;
        let (upstream, _) = upstream_to_backend().await;
        let exchange = || async {
            let answer = upstream
                .forward(
                    &PathAndQuery::from_static("/v2/models/m/infer"),
                    &HeaderMap::new(),
                    OutBody::from(crate::body::ChunksBody::new(vec![Bytes::from_static(b"{}")])),
                    crate::upstream::Deadline::after(Duration::from_secs(2)),
                )
                .await
                .unwrap();
            answer.into_body().collect().await.unwrap().to_bytes()
        };
        // The first request makes the connection; the second goes on it, kept.
        assert_eq!(&exchange().await[..], b"ok");
        let count = crate::wake::WakeCount::default();
        assert_eq!(&count.polling(exchange()).await[..], b"ok");
        // Handing the request over and taking the answer and its body from the connection are done within the
        // task's own polls: only the backend's bytes arriving wake it.
        assert_eq!(count.wakes(), 1);
    }

    #[tokio::test]
    async fn connections_idle_too_long_are_closed_by_the_sweep() {
        let (upstream, open) = upstream_to_backend().await;
        let answer = upstream
            .send(Method::GET, "/v2/health/ready", &HeaderMap::new(), Vec::new(), None)
            .await
            .unwrap();
        assert_eq!(&answer.body[..], b"ok");
        assert_eq!(open.load(Ordering::SeqCst), 1, "the connection is kept");
        // Swept now, the connection is young and stays; swept past the idle limit, it is closed.
        crate::upstream::sweep_idle(Instant::now());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(open.load(Ordering::SeqCst), 1);
        crate::upstream::sweep_idle(Instant::now() + IDLE_LIMIT + Duration::from_secs(1));
        for _ in 0..200 {
            if open.load(Ordering::SeqCst) == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the idle connection was not closed");
    }
    /// How a scripted backend answers the `index`th request on its `connection`th connection: the bytes to send (in
    /// pieces of `piece` bytes, 0 for all at once), and whether to close the connection after them.
    struct Script {
        answer: Vec<u8>,
        piece: usize,
        close: bool,
        /// Answer after reading only the head, leaving the body unread.
        before_body: bool,
    }

    fn answer(bytes: &[u8]) -> Script {
        Script {
            answer: bytes.to_vec(),
            piece: 0,
            close: false,
            before_body: false,
        }
    }

    /// A request as a scripted backend read it: its head, and its body de-chunked.
    type Received = Arc<std::sync::Mutex<Vec<(String, Vec<u8>)>>>;

    /// Reads one request (its head, then its body by length or chunks) from `socket`; `None` at the end.
    async fn read_request(
        socket: &mut tokio::net::TcpStream,
        buffer: &mut Vec<u8>,
        with_body: bool,
    ) -> Option<(String, Vec<u8>)> {
        async fn more(socket: &mut tokio::net::TcpStream, buffer: &mut Vec<u8>) -> Option<()> {
            let mut chunk = [0u8; 65536];
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => None,
                Ok(read) => {
                    buffer.extend_from_slice(&chunk[..read]);
                    Some(())
                }
            }
        }
        let end = loop {
            if let Some(end) = memchr::memmem::find(buffer, b"\r\n\r\n") {
                break end + 4;
            }
            more(socket, buffer).await?;
        };
        let head = String::from_utf8_lossy(&buffer[..end]).to_lowercase();
        buffer.drain(..end);
        let mut body = Vec::new();
        if !with_body {
            return Some((head, body));
        }
        if let Some(length) = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length: "))
            .and_then(|length| length.trim().parse::<usize>().ok())
        {
            while buffer.len() < length {
                more(socket, buffer).await?;
            }
            body = buffer.drain(..length).collect();
        } else if head.contains("transfer-encoding: chunked") {
            loop {
                let line = loop {
                    if let Some(line) = memchr::memmem::find(buffer, b"\r\n") {
                        break line;
                    }
                    more(socket, buffer).await?;
                };
                let size = usize::from_str_radix(std::str::from_utf8(&buffer[..line]).unwrap(), 16).unwrap();
                buffer.drain(..line + 2);
                while buffer.len() < size + 2 {
                    more(socket, buffer).await?;
                }
                body.extend(buffer.drain(..size));
                buffer.drain(..2);
                if size == 0 {
                    break;
                }
            }
        }
        Some((head, body))
    }

    /// A backend answering as `script` says for each connection and request; gives a client of it, the requests it
    /// read, and how many connections it accepted.
    async fn scripted(
        script: impl Fn(usize, usize) -> Script + Send + Sync + 'static,
    ) -> (crate::upstream::RestUpstream, Received, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let received = Received::default();
        let script = Arc::new(script);
        let (counted, noted) = (accepted.clone(), received.clone());
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                let connection = counted.fetch_add(1, Ordering::SeqCst);
                let (script, noted) = (script.clone(), noted.clone());
                tokio::spawn(async move {
                    let mut buffer = Vec::new();
                    for index in 0.. {
                        let step = script(connection, index);
                        let Some(request) = read_request(&mut socket, &mut buffer, !step.before_body).await else {
                            return;
                        };
                        noted.lock().unwrap().push(request);
                        let piece = if step.piece == 0 {
                            step.answer.len().max(1)
                        } else {
                            step.piece
                        };
                        for bytes in step.answer.chunks(piece) {
                            if socket.write_all(bytes).await.is_err() {
                                return;
                            }
                            if step.piece > 0 {
                                tokio::time::sleep(Duration::from_millis(1)).await;
                            }
                        }
                        if step.close {
                            return;
                        }
                    }
                });
            }
        });
        let endpoint = crate::config::Endpoint {
            host: address.ip().to_string(),
            port: address.port(),
        };
        let upstream = crate::upstream::RestUpstream::new(&endpoint, Duration::from_secs(2), 1 << 20, None);
        (upstream, received, accepted)
    }

    async fn get(
        upstream: &crate::upstream::RestUpstream,
        method: Method,
    ) -> crate::error::Result<super::super::rest::RestAnswer> {
        upstream
            .send(
                method,
                "/v2/models/m",
                &HeaderMap::new(),
                Vec::new(),
                Some(Duration::from_secs(2)),
            )
            .await
    }

    #[tokio::test]
    async fn a_chunked_answer_in_pieces_is_read_whole_and_its_connection_kept() {
        let (upstream, received, accepted) = scripted(|_, _| Script {
            piece: 3,
            ..answer(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 99\r\n\r\n\
                  5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n",
            )
        })
        .await;
        for _ in 0..2 {
            let answered = get(&upstream, Method::GET).await.unwrap();
            assert_eq!(&answered.body[..], b"hello world");
            // The length beside the chunks is not passed on as the answer's.
            assert!(answered.headers.get(CONTENT_LENGTH).is_none());
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the connection is kept between the two"
        );
        let (head, _) = received.lock().unwrap()[0].clone();
        assert!(
            head.starts_with("get /v2/models/m http/1.1\r\nhost: 127.0.0.1:"),
            "{head}"
        );
        assert!(head.contains("user-agent: oipgate/"), "{head}");
        assert!(
            !head.contains("content-length"),
            "a GET without a body says no length: {head}"
        );
    }

    #[tokio::test]
    async fn interim_answers_are_skipped_and_bodiless_answers_end_at_their_head() {
        let (upstream, _, accepted) = scripted(|_, index| match index {
            0 => answer(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
            1 => answer(b"HTTP/1.1 204 No Content\r\n\r\n"),
            _ => answer(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"),
        })
        .await;
        assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"ok");
        let empty = get(&upstream, Method::GET).await.unwrap();
        assert_eq!(empty.status, StatusCode::NO_CONTENT);
        assert!(empty.body.is_empty());
        // A HEAD's answer has no body whatever its length says.
        let head = get(&upstream, Method::HEAD).await.unwrap();
        assert!(head.body.is_empty());
        assert_eq!(head.headers[CONTENT_LENGTH], "5");
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_answer_that_closes_its_connection_is_read_and_the_connection_not_kept() {
        let (upstream, _, accepted) = scripted(|connection, _| match connection {
            0 => answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"),
            // No length: the body is what comes until the backend closes.
            _ => Script {
                close: true,
                ..answer(b"HTTP/1.1 200 OK\r\n\r\nall of it")
            },
        })
        .await;
        assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"ok");
        assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"all of it");
        assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"all of it");
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_kept_connection_the_backend_closed_under_a_request_is_replaced() {
        // The first connection answers once, then reads the next request and closes without a word (MLServer after
        // a 500); the request goes again on a new connection.
        let (upstream, received, accepted) = scripted(|connection, index| match (connection, index) {
            (0, 1) => Script {
                close: true,
                ..answer(b"")
            },
            _ => answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
        })
        .await;
        let body = || vec![Bytes::from_static(b"{\"inputs\":[]}")];
        for _ in 0..2 {
            let answered = upstream
                .send(Method::POST, "/v2/models/m/infer", &HeaderMap::new(), body(), None)
                .await
                .unwrap();
            assert_eq!(&answered.body[..], b"ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        let received = received.lock().unwrap();
        assert_eq!(received.len(), 3, "the second request was read twice");
        assert!(
            received
                .iter()
                .all(|(head, body)| head.contains("content-length: 13") && body == b"{\"inputs\":[]}")
        );
    }

    #[tokio::test]
    async fn broken_answers_are_errors_naming_what_is_wrong() {
        let cases: [(&[u8], &str); 7] = [
            (b"HTTP/1.1 2x0 OK\r\n\r\n", "malformed answer head"),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok",
                "two different Content-Length",
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
                "invalid Content-Length",
            ),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
                "malformed chunked framing",
            ),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nokay\r\n",
                "malformed chunked framing",
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
                "closed before the answer's end",
            ),
            (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switching protocols"),
        ];
        for (sent, named) in cases {
            let (upstream, _, _) = scripted(move |_, _| Script {
                close: true,
                ..answer(sent)
            })
            .await;
            let error = get(&upstream, Method::GET).await.unwrap_err();
            assert!(
                error.message().contains(named),
                "{:?}: {}",
                String::from_utf8_lossy(sent),
                error.message()
            );
        }
        // Trailers without end, in a line too long to be let through.
        let endless = [
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx-long: ".as_slice(),
            &vec![b'a'; MOST_CHUNK_FRAMING],
        ]
        .concat();
        let (upstream, _, _) = scripted(move |_, _| answer(&endless)).await;
        let error = get(&upstream, Method::GET).await.unwrap_err();
        assert!(
            error.message().contains("chunk extensions or trailers"),
            "{}",
            error.message()
        );
        let long_head = [
            b"HTTP/1.1 200 OK\r\nx-long: ".as_slice(),
            &vec![b'a'; MOST_HEAD],
            b"\r\n\r\n",
        ]
        .concat();
        let (upstream, _, _) = scripted(move |_, _| answer(&long_head)).await;
        let error = get(&upstream, Method::GET).await.unwrap_err();
        assert!(error.message().contains("answer head over"), "{}", error.message());
    }

    #[tokio::test]
    async fn an_answer_before_the_whole_body_is_taken_and_the_rest_not_sent() {
        // The backend answers 413 on reading the head, and never reads the 32 MiB body: the request would block
        // for ever were the answer only read after the body was written.
        let (upstream, _, accepted) = scripted(|_, _| Script {
            before_body: true,
            ..answer(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 8\r\n\r\ntoo long")
        })
        .await;
        let body = vec![Bytes::from(vec![b'x'; 32 << 20])];
        let answered = upstream
            .send(
                Method::POST,
                "/v2/models/m/infer",
                &HeaderMap::new(),
                body,
                Some(Duration::from_secs(10)),
            )
            .await
            .unwrap();
        assert_eq!(answered.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(&answered.body[..], b"too long");
        // The connection is mid-request: the next request takes a new one.
        assert_eq!(
            get(&upstream, Method::GET).await.unwrap().status,
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_body_of_unknown_length_goes_chunked() {
        use http_body_util::BodyExt;
        let (upstream, received, _) = scripted(|_, _| answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")).await;
        let (sender, chunks) = tokio::sync::mpsc::channel(4);
        let feeding = tokio::spawn(async move {
            for part in [&b"first "[..], b"second ", b"third"] {
                sender.send(Bytes::from_static(part)).await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        let answered = upstream
            .forward(
                &PathAndQuery::from_static("/v2/models/m/infer"),
                &HeaderMap::new(),
                OutBody::Channel(crate::body::ChannelBody::new(chunks)),
                crate::upstream::Deadline::after(Duration::from_secs(2)),
            )
            .await
            .unwrap();
        assert_eq!(&answered.into_body().collect().await.unwrap().to_bytes()[..], b"ok");
        feeding.await.unwrap();
        let (head, body) = received.lock().unwrap()[0].clone();
        assert!(head.contains("transfer-encoding: chunked"), "{head}");
        assert_eq!(body, b"first second third");
    }
    #[tokio::test]
    async fn an_answer_keeps_all_its_headers_up_to_the_limit() {
        let many = |count: usize| {
            let mut head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n".to_vec();
            for index in 1..count {
                head.extend_from_slice(format!("x-header-{index}: value {index}\r\n").as_bytes());
            }
            head.extend_from_slice(b"\r\nok");
            head
        };
        // More than the places noted on the stack: the head is read again for the rest.
        for count in [PLACED, PLACED + 1, MOST_HEADERS] {
            let sent = many(count);
            let (upstream, _, _) = scripted(move |_, _| answer(&sent)).await;
            let answered = get(&upstream, Method::GET).await.unwrap();
            assert_eq!(answered.headers.len(), count);
            assert_eq!(
                answered.headers[format!("x-header-{}", count - 1)],
                format!("value {}", count - 1)
            );
            assert_eq!(&answered.body[..], b"ok");
        }
        let sent = many(MOST_HEADERS + 1);
        let (upstream, _, _) = scripted(move |_, _| answer(&sent)).await;
        let error = get(&upstream, Method::GET).await.unwrap_err();
        assert!(error.message().contains("more than 100 headers"), "{}", error.message());
    }
}
