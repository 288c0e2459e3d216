//! The REST door's connections: HTTP/1.1, h2c (told by its preface) and TLS (HTTP/2 or HTTP/1.1 by ALPN), each
//! served by hyper on the thread that accepted it; the time a client may take over a request's head (408) apart
//! from the time an idle keep-alive connection may wait; and a shutdown that loses no request.

use std::convert::Infallible;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use pingora::server::ShutdownWatch;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::RestDoor;
use super::framing::FramingScan;
use crate::frontend::budget::AnswerBudget;
use crate::frontend::flood::{self, ResetWatch};
use crate::frontend::{MAX_HEAD_BYTES, stopping};
use crate::wake::LocalWake;

/// How long a connection may stay open with no request under way, as nginx's `keepalive_timeout`.
const KEEPALIVE: Duration = Duration::from_secs(60);
/// How long a TLS handshake may take.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// The first bytes of an HTTP/2 connection (RFC 9113, section 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The most header fields a request head may carry (Apache's `LimitRequestFields`); beyond it the answer is 431.
const MAX_HEADERS: usize = 100;
/// How long an idle HTTP/1.1 connection keeps hyper's state (its buffers) before it waits for its next request with
/// only its socket: long enough that a connection under load never pays for setting hyper up again.
const IDLE_HANDOFF: Duration = Duration::from_millis(200);
/// Once shutdown starts, how long an idle HTTP/1.1 connection is kept for a request already on its way (answered
/// with `Connection: close`) before it is closed.
const CLOSE_LINGER: Duration = Duration::from_millis(500);
/// How often a connection whose request body was abandoned looks whether its answer has been sent.
const ABANDON_CHECK: Duration = Duration::from_millis(10);
/// HTTP/2 windows large enough that a multi-megabyte tensor is not throttled by flow control.
const STREAM_WINDOW: u32 = 8 << 20;
const CONNECTION_WINDOW: u32 = 32 << 20;
/// What a client too slow with its request head is told before the connection closes.
const TIMED_OUT: &[u8] = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: 58\r\n\
connection: close\r\n\r\n{\"error\":\"the request head did not arrive in time (408)\"}\n";

/// The REST door on one thread: how its connections are served.
#[derive(Clone)]
pub struct RestConnections {
    pub door: Arc<RestDoor>,
    /// TLS for the door, when it speaks it (the certificate is read from the live material at each handshake).
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// How long a client may take to send a request's head once it has begun.
    pub header_timeout: Duration,
    /// Streams an HTTP/2 client may have open at once.
    pub max_concurrent_streams: u32,
    /// Bytes of answers an HTTP/2 client may leave unread in the gateway.
    pub max_buffered_answer_bytes: usize,
}

impl std::fmt::Debug for RestConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestConnections")
            .field("tls", &self.tls.is_some())
            .field("header_timeout", &self.header_timeout)
            .finish_non_exhaustive()
    }
}

/// One HTTP/1.1 connection's state, shared between its reads and the requests it carries.
#[derive(Debug, Default)]
pub struct ConnState {
    /// Requests begun on the connection.
    begun: AtomicU64,
    /// Requests whose answers have been sent.
    answered: AtomicU64,
    /// Shutdown has begun: answers say `Connection: close`.
    closing: AtomicBool,
    /// The ordinal of a request (the first begun is 1) whose head named both a Content-Length and a
    /// Transfer-Encoding (hyper keeps only the latter, so the door cannot see it in the headers); 0 for none.
    framed_both_ways_at: AtomicU64,
    /// A request's body was left unread: the connection closes once its answer is sent.
    abandoned: AtomicBool,
    /// The connection's task, woken when a body is let go by the task that drained it.
    abandoning: futures_util::task::AtomicWaker,
}

impl ConnState {
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Relaxed)
    }

    /// The answer to the latest request has been sent.
    pub(super) fn answered(&self) {
        self.answered.fetch_add(1, Ordering::Relaxed);
    }

    /// A request body was left unread and has been let go: the connection is closed once the answer is sent.
    pub(super) fn abandon(&self) {
        self.abandoned.store(true, Ordering::Release);
        self.abandoning.wake();
    }

    fn is_abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Acquire)
    }

    /// Until a request's body has been let go. Polled at each of the connection's wake-ups, so it costs a flag's
    /// load and a waker's check, where a `Notify` took a lock.
    fn abandoned(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(|cx| {
            if !self.is_abandoned() {
                self.abandoning.register(cx.waker());
                if !self.is_abandoned() {
                    return Poll::Pending;
                }
            }
            Poll::Ready(())
        })
    }

    fn begin(&self) {
        self.begun.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether the request just begun framed its body both ways.
    pub fn framed_both_ways(&self) -> bool {
        let at = self.framed_both_ways_at.load(Ordering::Relaxed);
        at != 0 && at == self.begun.load(Ordering::Relaxed)
    }

    /// Whether a request is under way (begun and not yet answered).
    fn busy(&self) -> bool {
        self.begun.load(Ordering::Relaxed) != self.answered.load(Ordering::Relaxed)
    }
}

impl RestConnections {
    /// Serves one accepted connection until it closes.
    pub async fn serve(self, tcp: TcpStream, peer: SocketAddr, shutdown: ShutdownWatch) {
        let _ = tcp.set_nodelay(true);
        // A connection's task lives as long as the connection, idle or not, and a future is as large as its largest
        // state: HTTP/2 and TLS (large states of their own) are boxed so an idle plain HTTP/1.1 connection stays small.
        if self.tls.is_some() {
            return Box::pin(self.serve_tls(tcp, peer, shutdown)).await;
        }
        match first_bytes(&tcp, &shutdown).await {
            Arrival::Closed => {}
            Arrival::Http2 => Box::pin(self.serve_http2(tcp, shutdown)).await,
            Arrival::Http1 => self.serve_http1(tcp, shutdown).await,
        }
    }

    async fn serve_tls(self, tcp: TcpStream, peer: SocketAddr, shutdown: ShutdownWatch) {
        let Some(acceptor) = &self.tls else { return };
        let tls = match tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(error)) => return tracing::debug!(%error, %peer, "TLS handshake failed"),
            Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
        };
        if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
            self.serve_http2(tls, shutdown).await;
        } else {
            self.serve_http1(tls, shutdown).await;
        }
    }

    /// Serves HTTP/1.1 requests on `stream`. On a plain connection hyper's state is held only while requests come:
    /// once the connection has idled for [`IDLE_HANDOFF`], hyper lets it go and it waits for its next request in a
    /// small future of its own (its socket and nothing else); a TLS connection stays with hyper.
    async fn serve_http1<S>(self, mut stream: S, mut shutdown: ShutdownWatch)
    where
        S: AsyncRead + AsyncWrite + Peek + Unpin + Send + 'static,
    {
        let state = Arc::new(ConnState::default());
        let door = self.door;
        let requests = state.clone();
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            requests.begin();
            let door = door.clone();
            let connection = requests.clone();
            async move { Ok::<_, Infallible>(door.answer(request, Some(connection), None).await) }
        });
        let mut builder = http1::Builder::new();
        builder.max_header_size(MAX_HEAD_BYTES).max_headers(MAX_HEADERS);
        let mut unread = Bytes::new();
        loop {
            // hyper's part runs in a future of its own, boxed: everything it holds is freed once it ends, and the
            // connection's task, which lives as long as the connection, keeps only what waiting needs.
            let served = Box::pin(async {
                let io = Http1Io {
                    inner: stream,
                    unread,
                    state: state.clone(),
                    timer: None,
                    clock: Clock::Off,
                    requests_seen: state.begun.load(Ordering::Relaxed),
                    header_timeout: self.header_timeout,
                    framing: FramingScan::after(state.begun.load(Ordering::Relaxed)),
                    hands_off: S::CAN_PEEK,
                    handed_off: false,
                    blocked_since: None,
                };
                let mut hyper = std::pin::pin!(
                    builder
                        .serve_connection(TokioIo::new(io), service.clone())
                        .without_shutdown()
                );
                // The request handler reads its body from hyper, which it runs under: hyper's wake for the body's
                // next bytes is taken on the spot (see `crate::wake`).
                let wake = LocalWake::default();
                let mut connection =
                    std::pin::pin!(std::future::poll_fn(|cx| wake.poll(cx, |cx| hyper.as_mut().poll(cx))));
                // Biased: the connection is polled first at every wake-up, with no random pick.
                let served = tokio::select! {
                    biased;
                    served = connection.as_mut() => served,
                    () = state.abandoned() => {
                        loop {
                            tokio::select! {
                                served = connection.as_mut() => break served,
                                () = tokio::time::sleep(ABANDON_CHECK) => if !state.busy() {
                                    return None;
                                },
                            }
                        }
                    }
                    () = stopping(&mut shutdown) => {
                        // From now on each answer closes its connection; a request already on its way to an idle one
                        // still gets one, for a moment.
                        state.closing.store(true, Ordering::Relaxed);
                        loop {
                            tokio::select! {
                                served = connection.as_mut() => break served,
                                () = tokio::time::sleep(CLOSE_LINGER) => if !state.busy() {
                                    return None;
                                },
                            }
                        }
                    }
                };
                let Ok(parts) = served else { return None };
                let io = parts.io.into_inner();
                if !io.handed_off || state.is_closing() || state.is_abandoned() {
                    return None;
                }
                // What hyper had read and not used, then what it had not read of the last hand-off's bytes.
                // An empty view still holds hyper's whole read buffer, so it is not kept.
                let unread = match (parts.read_buf.is_empty(), io.unread.is_empty()) {
                    (true, true) => Bytes::new(),
                    (false, true) => parts.read_buf,
                    (true, false) => io.unread,
                    (false, false) => Bytes::from([parts.read_buf, io.unread].concat()),
                };
                Some((io.inner, unread))
            })
            .await;
            let Some(served) = served else { return };
            (stream, unread) = served;
            if unread.is_empty() {
                let next = tokio::select! {
                    next = next_request(&stream, &shutdown) => next,
                    () = state.abandoned() => false,
                };
                if !next || state.is_abandoned() {
                    return;
                }
            }
        }
    }

    async fn serve_http2<S>(self, stream: S, mut shutdown: ShutdownWatch)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let door = self.door;
        let watch = ResetWatch::new();
        let calls = watch.clone();
        let budget = AnswerBudget::new(self.max_buffered_answer_bytes);
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            let door = door.clone();
            let call = calls.call();
            let budget = budget.clone();
            async move {
                let answer = door.answer(request, None, Some(&budget)).await;
                call.finish(answer.status().as_u16() == crate::error::CLIENT_CLOSED_REQUEST);
                Ok::<_, Infallible>(answer)
            }
        });
        let mut builder = http2::Builder::new(TokioExecutor::new());
        crate::frontend::http2_limits(&mut builder, self.max_concurrent_streams);
        builder
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW);
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        // On shutdown, GOAWAY: streams under way finish, new ones go elsewhere.
        flood::serve(connection, &watch, stopping(&mut shutdown)).await;
    }
}

/// Waits, within the keep-alive timeout, for an idle connection's next request; `false` when the client closed the
/// connection, the time ran out or the gateway is shutting down.
async fn next_request<S: Peek>(stream: &S, shutdown: &ShutdownWatch) -> bool {
    let mut shutdown = shutdown.clone();
    tokio::select! {
        biased;
        () = stopping(&mut shutdown) => false,
        arrived = tokio::time::timeout(KEEPALIVE, stream.peek_byte()) => matches!(arrived, Ok(true)),
    }
}

/// A stream whose next bytes can be waited for without reading them (plain TCP; TLS cannot).
pub trait Peek {
    const CAN_PEEK: bool;
    /// Waits until a byte can be read; `false` at the end of the stream or on an error.
    fn peek_byte(&self) -> impl Future<Output = bool> + Send;
}

impl Peek for TcpStream {
    const CAN_PEEK: bool = true;
    async fn peek_byte(&self) -> bool {
        let mut byte = [0u8; 1];
        matches!(self.peek(&mut byte).await, Ok(1..))
    }
}

impl<S: Send + Sync> Peek for tokio_rustls::server::TlsStream<S> {
    const CAN_PEEK: bool = false;
    async fn peek_byte(&self) -> bool {
        false
    }
}

/// What a new connection opened with.
enum Arrival {
    Http1,
    Http2,
    Closed,
}

/// Waits, within the keep-alive timeout, for a new connection's first bytes, and tells HTTP/2's preface from an
/// HTTP/1.1 request.
async fn first_bytes(tcp: &TcpStream, shutdown: &ShutdownWatch) -> Arrival {
    let look = async move {
        let mut head = [0u8; H2_PREFACE.len()];
        loop {
            let seen = match tcp.peek(&mut head).await {
                Ok(0) | Err(_) => return Arrival::Closed,
                Ok(seen) => seen,
            };
            if head[..seen] != H2_PREFACE[..seen] {
                return Arrival::Http1;
            }
            if seen == H2_PREFACE.len() {
                return Arrival::Http2;
            }
            // So far a part of the preface: the rest is on its way.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    let mut shutdown = shutdown.clone();
    tokio::select! {
        biased;
        () = stopping(&mut shutdown) => Arrival::Closed,
        arrival = tokio::time::timeout(KEEPALIVE, look) => arrival.unwrap_or(Arrival::Closed),
    }
}

/// An HTTP/1.1 connection's stream as hyper reads it, keeping two clocks hyper does not: between requests, the
/// keep-alive wait (the connection closes quietly when it runs out), and once a request's first bytes arrive, the
/// time its head may take (the client is told 408 when it runs out).
struct Http1Io<S> {
    inner: S,
    /// Bytes read from `inner` by an earlier hyper connection and not used by it, read first.
    unread: Bytes,
    state: Arc<ConnState>,
    /// Made at the first wait and reset for each later one: a request's waits cost no allocation, and a deadline
    /// moved later costs tokio's timer wheel nothing.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// What `timer` times now.
    clock: Clock,
    /// Requests begun when the clock was last set, to tell that a new request has begun since.
    requests_seen: u64,
    header_timeout: Duration,
    /// Where the connection's bytes are, from request to request.
    framing: FramingScan,
    /// Whether an idle connection is handed back by hyper (ends as if closed) after [`IDLE_HANDOFF`].
    hands_off: bool,
    /// It was.
    handed_off: bool,
    /// Since when the answer's bytes have waited for the client to read (hyper keeps writing after the answer's body
    /// has ended, so an answer "sent" may still be on its way): an idle clock must not cut it short.
    blocked_since: Option<std::time::Instant>,
}

/// The wait an HTTP/1.1 connection's timer times.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Clock {
    /// None: a request is under way and hyper is not waiting to read.
    Off,
    /// The wait for a request's first bytes (keep-alive, or until an idle connection is handed off).
    Idle,
    /// The time a request's head may take once it has begun to arrive.
    Head,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Http1Io<S> {
    /// Keeps [`Self::blocked_since`]: set when a write or flush must wait for the client, cleared when one goes
    /// through (hyper writes until its queue is empty or the socket is full, so after its last write it has nothing
    /// left; a TLS stream may still hold bytes, which its flush reports).
    fn note_write<T>(&mut self, written: &Poll<std::io::Result<T>>) {
        match written {
            Poll::Pending => {
                if self.blocked_since.is_none() {
                    self.blocked_since = Some(std::time::Instant::now());
                }
            }
            Poll::Ready(_) => self.blocked_since = None,
        }
    }

    fn set_timer(&mut self, head: bool) {
        let wait = match (head, self.hands_off) {
            (true, _) => self.header_timeout,
            (false, true) => IDLE_HANDOFF,
            (false, false) => KEEPALIVE,
        };
        let deadline = tokio::time::Instant::now() + wait;
        match &mut self.timer {
            Some(timer) => timer.as_mut().reset(deadline),
            None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
        }
        self.clock = if head { Clock::Head } else { Clock::Idle };
    }

    /// Whether the running clock has run out (registering for its end when not).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        self.clock != Clock::Off
            && self
                .timer
                .as_mut()
                .is_some_and(|timer| timer.as_mut().poll(cx).is_ready())
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Http1Io<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let begun = this.state.begun.load(Ordering::Relaxed);
        if begun != this.requests_seen {
            // A request began: whatever clock ran was for the wait before it.
            this.requests_seen = begun;
            this.clock = Clock::Off;
        }
        let before = buf.filled().len();
        let polled = if this.unread.is_empty() {
            Pin::new(&mut this.inner).poll_read(cx, buf)
        } else {
            let taken = this.unread.len().min(buf.remaining());
            buf.put_slice(&this.unread.split_to(taken));
            Poll::Ready(Ok(()))
        };
        if let Poll::Ready(Ok(())) = polled {
            // Every byte, a request under way or not: a pipelined request's head comes in the reads of the one before.
            this.framing.scan(&buf.filled()[before..]);
            if let Some(at) = this.framing.take_framed_both_ways() {
                this.state.framed_both_ways_at.store(at, Ordering::Relaxed);
            }
        }
        if this.state.busy() {
            // hyper may not read again once the answer is out (it is already waiting for the socket), so the idle
            // clock is kept running from here: it wakes this read to find the connection idle.
            if polled.is_pending() && this.hands_off {
                if this.clock != Clock::Idle {
                    this.set_timer(false);
                }
                if this.expired(cx) {
                    this.set_timer(false);
                    let _ = this.expired(cx);
                }
            }
            return polled;
        }
        match polled {
            Poll::Ready(Ok(())) => {
                // A head that arrived whole in one read needs no clock of its own.
                if buf.filled().len() > before && this.framing.within_head() && this.clock != Clock::Head {
                    this.set_timer(true);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                // A head already begun (pipelined behind the last request, perhaps while it was under way) is timed
                // as a head, once the last answer is out; else the wait is idle.
                let head = this.framing.within_head() && this.blocked_since.is_none();
                if this.clock == Clock::Off || (head && this.clock == Clock::Idle) {
                    this.set_timer(head);
                }
                if !this.expired(cx) {
                    return Poll::Pending;
                }
                if this.clock == Clock::Idle
                    && let Some(since) = this.blocked_since
                {
                    // Not idle: the last answer is still being written. The client is given as long to take its
                    // next bytes as an idle connection is kept (nginx's send_timeout).
                    if since.elapsed() >= KEEPALIVE {
                        return Poll::Ready(Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "the client did not read the answer in time",
                        )));
                    }
                    this.set_timer(false);
                    let _ = this.expired(cx);
                    return Poll::Pending;
                }
                if this.clock == Clock::Idle {
                    // Idle: hyper takes the end of the stream quietly, and lets the connection go (to wait in a
                    // smaller future, when it can be peeked at) or closes it.
                    this.handed_off = this.hands_off;
                    return Poll::Ready(Ok(()));
                }
                // Best effort: a short answer into an empty send buffer goes at once; if not, the close says it.
                let _ = Pin::new(&mut this.inner).poll_write(cx, TIMED_OUT);
                let _ = Pin::new(&mut this.inner).poll_flush(cx);
                Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the request head did not arrive in time",
                )))
            }
            error => error,
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Http1Io<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.note_write(&written);
        written
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.note_write(&written);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let flushed = Pin::new(&mut this.inner).poll_flush(cx);
        this.note_write(&flushed);
        flushed
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
