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

use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use pingora::server::ShutdownWatch;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::RestDoor;
use crate::frontend::stopping;

/// How long a connection may stay open with no request under way, as nginx's `keepalive_timeout`.
const KEEPALIVE: Duration = Duration::from_secs(60);
/// How long a TLS handshake may take.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// The first bytes of an HTTP/2 connection (RFC 9113, section 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The largest request head (request line and headers) read; beyond it the answer is 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Once shutdown starts, how long an idle HTTP/1.1 connection is kept for a request already on its way (answered
/// with `Connection: close`) before it is closed.
const CLOSE_LINGER: Duration = Duration::from_millis(500);
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
}

impl ConnState {
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Relaxed)
    }

    /// The answer to the latest request has been sent.
    pub(super) fn answered(&self) {
        self.answered.fetch_add(1, Ordering::Relaxed);
    }

    fn begin(&self) {
        self.begun.fetch_add(1, Ordering::Relaxed);
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
        let Some(acceptor) = &self.tls else {
            match first_bytes(&tcp, &shutdown).await {
                Arrival::Closed => {}
                Arrival::Http2 => self.serve_http2(tcp, shutdown).await,
                Arrival::Http1 => self.serve_http1(tcp, shutdown).await,
            }
            return;
        };
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

    async fn serve_http1<S>(self, stream: S, mut shutdown: ShutdownWatch)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let state = Arc::new(ConnState::default());
        let io = Http1Io {
            inner: stream,
            state: state.clone(),
            timer: None,
            timing_head: false,
            requests_seen: 0,
            header_timeout: self.header_timeout,
        };
        let door = self.door;
        let requests = state.clone();
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            requests.begin();
            let door = door.clone();
            let connection = requests.clone();
            async move { Ok::<_, Infallible>(door.answer(request, Some(connection)).await) }
        });
        let mut builder = http1::Builder::new();
        builder.max_buf_size(MAX_HEAD_BYTES);
        let connection = builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(connection);
        tokio::select! {
            _ = connection.as_mut() => return,
            () = stopping(&mut shutdown) => {}
        }
        // From now on each answer closes its connection; a request already on its way to an idle one still gets
        // one, for a moment.
        state.closing.store(true, Ordering::Relaxed);
        if !state.busy() {
            tokio::select! {
                _ = connection.as_mut() => return,
                () = tokio::time::sleep(CLOSE_LINGER) => {}
            }
        }
        connection.as_mut().graceful_shutdown();
        let _ = connection.await;
    }

    async fn serve_http2<S>(self, stream: S, mut shutdown: ShutdownWatch)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let door = self.door;
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            let door = door.clone();
            async move { Ok::<_, Infallible>(door.answer(request, None).await) }
        });
        let mut builder = http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .max_header_list_size(u32::try_from(MAX_HEAD_BYTES).unwrap_or(u32::MAX))
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .keep_alive_interval(Some(KEEPALIVE));
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        tokio::pin!(connection);
        tokio::select! {
            _ = connection.as_mut() => return,
            () = stopping(&mut shutdown) => {}
        }
        // GOAWAY: streams under way finish, new ones go elsewhere.
        connection.as_mut().graceful_shutdown();
        let _ = connection.await;
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
    state: Arc<ConnState>,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Whether `timer` is the head's clock (else the keep-alive one).
    timing_head: bool,
    /// Requests begun when the clock was last set, to tell that a new request has begun since.
    requests_seen: u64,
    header_timeout: Duration,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Http1Io<S> {
    fn set_timer(&mut self, head: bool) {
        let wait = if head { self.header_timeout } else { KEEPALIVE };
        let deadline = tokio::time::Instant::now() + wait;
        match &mut self.timer {
            Some(timer) => timer.as_mut().reset(deadline),
            None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
        }
        self.timing_head = head;
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Http1Io<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let begun = this.state.begun.load(Ordering::Relaxed);
        if begun != this.requests_seen {
            // A request began: whatever clock ran was for the wait before it.
            this.requests_seen = begun;
            this.timer = None;
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if this.state.busy() {
            return polled;
        }
        match polled {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before && !this.timing_head {
                    this.set_timer(true);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                if this.timer.is_none() {
                    this.set_timer(false);
                }
                let expired = this
                    .timer
                    .as_mut()
                    .is_some_and(|timer| timer.as_mut().poll(cx).is_ready());
                if !expired {
                    return Poll::Pending;
                }
                if !this.timing_head {
                    // Idle too long: closed as if by the client, which hyper takes quietly.
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

impl<S: AsyncWrite + Unpin> AsyncWrite for Http1Io<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
