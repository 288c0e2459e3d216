//! HTTP/1.1 connections to REST backends, spoken by the request itself: each thread keeps its own idle connections
//! per endpoint, and a request writes its head and body and reads its answer on one of them from its own task (no
//! connection task, no channel between tasks, no pool shared between threads), giving it back to the thread once its
//! answer has been read to the end. An answer's head is read with httparse; its body is framed by its length, its
//! chunks, or the connection's end.

mod answer;
mod request;

#[cfg(test)]
mod tests;

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method};
use tokio::io::{AsyncRead, AsyncWrite};

use super::ThreadClients;
use crate::body::OutBody;
use crate::codec::http1::{poll_write_slices, scratch};
use answer::{AnswerHead, Parsed, read_head};
pub use answer::{BackendBody, BodySaid, PassedAnswer, keep_passed_back};
use request::{Sending, Writing};

/// The backend client's reading of the answer head at the start of `read` (taken off it when whole; interim answers
/// skipped), for the fuzz targets: its status, its body's framing and whether its connection may be kept, `None`
/// while partial, or why it is a broken answer. Asked `as_lines`, the headers are left as lines where they can be,
/// as for a passthrough.
#[cfg(feature = "fuzzing")]
pub fn read_answer_head(
    read: &mut BytesMut,
    asked_head: bool,
    as_lines: bool,
) -> io::Result<Option<(http::StatusCode, crate::codec::http1::Framing, bool)>> {
    loop {
        match read_head(read, asked_head, as_lines)? {
            Parsed::Answer(head) => return Ok(Some(head.described())),
            Parsed::Interim => {}
            Parsed::Partial => return Ok(None),
        }
    }
}

/// Reads the answer head at the start of `bytes` with its headers left as lines and into a map, and checks that the
/// two agree in all a passthrough writes and checks; `false` when it is not read as lines.
#[cfg(feature = "fuzzing")]
pub fn answer_lines_match_map(bytes: &[u8], asked_head: bool) -> bool {
    answer::lines_match_map(bytes, asked_head)
}

/// How long a kept connection may sit idle before it is closed rather than used: backends commonly close theirs
/// after 60 to 120 seconds, and a request sent on a connection the backend is closing fails.
const IDLE_LIMIT: Duration = Duration::from_secs(90);

/// The most idle connections a thread keeps per endpoint; a connection given back beyond them is closed.
const MOST_IDLE: usize = 256;

/// How often a thread closes its connections idle for longer than [`IDLE_LIMIT`]: those of an endpoint that gets no
/// more requests would otherwise stay open (the backend's side of them closed) until it does.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// What a read asks for first; reads of a long body grow to [`READ_MOST`] while they fill what they are given.
const READ_FIRST: usize = 8 * 1024;

/// The most one read asks for.
const READ_MOST: usize = 512 * 1024;

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
            Io::Plain(tcp) => poll_write_slices(Pin::new(tcp), cx, slices),
            Io::Tls(tls) => poll_write_slices(Pin::new(&mut **tls), cx, slices),
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
pub(super) struct PooledConnection {
    io: Io,
    /// What the backend sent that has not been handed on yet.
    read: BytesMut,
    /// The request head being written: the thread's buffer for heads (`scratch`) while it is.
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

impl PooledConnection {
    /// A connection just made, on this thread.
    fn new(io: Io) -> PooledConnection {
        PooledConnection {
            io,
            read: BytesMut::new(),
            head: Vec::new(),
            read_size: READ_FIRST,
            ended: false,
            idle_since: Instant::now(),
            thread: this_thread(),
        }
    }
}

impl std::fmt::Debug for PooledConnection {
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

impl PooledConnection {
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

    /// Writes the request and reads its answer's head, at once: a backend may answer (an error, as a rule) before it
    /// has read the whole body, and it is not sent the rest.
    fn poll_exchange(
        &mut self,
        cx: &mut Context<'_>,
        writing: &mut Writing,
        body: &mut OutBody,
        asked: Asked,
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
            if writing.done {
                // The head is written: its buffer goes back to the thread now, for the heads of the requests and
                // answers its other connections write while this one waits for its answer.
                scratch::give(std::mem::take(&mut self.head));
            }
        }
        loop {
            if !self.read.is_empty() {
                match read_head(&mut self.read, asked.head, asked.lines)? {
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
    /// A passthrough's headers, written from the client's where they stand; those of the maps take their place.
    pub passed: Option<&'a crate::headers::PassedOn<'a>>,
    pub body: OutBody,
    /// When the call began, when the caller read the clock for it: idle connections are aged against it.
    pub began: Option<Instant>,
}

/// How a request's answer is read: to a HEAD request, its body is not sent; `lines`, its headers are left as lines
/// in its head where they can be (a passthrough's).
#[derive(Debug, Clone, Copy)]
pub(super) struct Asked {
    head: bool,
    lines: bool,
}

/// Why a request could not be sent or answered.
#[derive(Debug)]
pub(super) enum Failure {
    /// No connection could be made: nothing was sent.
    Connect(Box<dyn std::error::Error + Send + Sync>),
    /// The exchange failed; `unsent` when none of the request reached the connection.
    Http { error: io::Error, unsent: bool },
    /// The request's own body failed (its client went away, stalled, or sent what the gateway refuses): the
    /// backend is not at fault.
    Body(io::Error),
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
    let asked = Asked {
        head: *request.method == Method::HEAD,
        lines: request.passed.is_some_and(|passed| passed.answers_as_lines()),
    };
    loop {
        let (mut kept, reused) = match idle(clients, request.began.unwrap_or_else(Instant::now)).await {
            Some(kept) => (kept, true),
            // Boxed: connecting is rare, and its state (resolving, connecting, TLS) would otherwise be part of every
            // request's.
            None => (Box::pin(connect(clients, uri)).await?, false),
        };
        kept.head = scratch::take();
        let gathered = kept.write_head(&request, framing);
        let mut writing = Writing::new(framing, gathered);
        let body = &mut request.body;
        let exchanged = std::future::poll_fn(|cx| kept.poll_exchange(cx, &mut writing, body, asked)).await;
        // Written, or no longer to be: the answer's head has come.
        scratch::give(std::mem::take(&mut kept.head));
        match exchanged {
            Ok(head) => return Ok(head.into_response(kept, clients.token.handle())),
            Err(error) if writing.body_failed => return Err(Failure::Body(error)),
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
/// long at `now` or closed by the backend are dropped on the way.
async fn idle(clients: &ThreadClients, now: Instant) -> Option<Box<PooledConnection>> {
    loop {
        let mut kept = super::with_endpoint(clients.token.shared(), |endpoint| endpoint.idle.pop())?;
        if kept.aged(now) {
            continue;
        }
        if std::future::poll_fn(|cx| Poll::Ready(kept.poll_open(cx))).await {
            return Some(kept);
        }
    }
}

/// Forgets this thread's idle connections to the endpoint.
fn drop_idle(clients: &ThreadClients) {
    let idle = super::with_endpoint(clients.token.shared(), |endpoint| std::mem::take(&mut endpoint.idle));
    drop(idle);
}

/// A new connection to the endpoint (TCP, and TLS for `https`).
async fn connect(clients: &ThreadClients, uri: &http::Uri) -> Result<Box<PooledConnection>, Failure> {
    keep_swept();
    let mut connector = clients.connector.clone();
    let connected = tower_service::Service::call(&mut connector, uri.clone())
        .await
        .map_err(Failure::Connect)?;
    Ok(Box::new(PooledConnection::new(Io::from_connected(connected))))
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
