//! The REST door's listener: one accept loop per thread, each on its own single-threaded runtime, so a connection is
//! accepted, read, proxied and answered on one thread, and an idle keep-alive connection holds only its socket.
//!
//! pingora's own listener accepts on one runtime and hands each connection to a runtime chosen at random; the socket
//! stays registered with the accepting runtime's reactor, so every read of half the connections woke another thread.
//! It also serves a keep-alive connection inside one task whose state is sized for a whole proxied request, kept
//! while the connection idles. Here the threads share one listening socket (the kernel wakes a thread that is free to
//! accept), the request pipeline is pingora's (`HttpProxy`), and between requests a connection waits in a small
//! future of its own.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ServerApp};
use pingora::protocols::http::ServerSession;
use pingora::protocols::l4::socket::SocketAddr as PingoraSocketAddr;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream, TimingDigest,
    UniqueID, UniqueIDType,
};
use pingora::proxy::HttpProxy;
use pingora::server::ShutdownWatch;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::RestFrontDoor;
use crate::frontend::stopping;

/// How long a connection may stay open with no request under way, as nginx's `keepalive_timeout` (and pingora's own
/// default).
const KEEPALIVE: Duration = Duration::from_secs(60);
/// How long a TLS handshake may take.
const HANDSHAKE: Duration = Duration::from_secs(60);
/// The first bytes of an HTTP/2 connection (RFC 9113, section 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Writes up to this size are held until the next flush, so an answer's head and a small body leave in one packet.
const COALESCE: usize = 4096;

/// The REST door: pingora's proxy pipeline behind one accept loop per thread.
pub struct RestListener {
    pub address: SocketAddr,
    pub threads: usize,
    pub proxy: Arc<HttpProxy<RestFrontDoor>>,
    /// TLS for the door, when it speaks it (the certificate is read from the live material at each handshake).
    pub tls: Option<Arc<pingora::listeners::tls::Acceptor>>,
    /// Whether cleartext connections may speak HTTP/2 (h2c, with prior knowledge).
    pub h2c: bool,
}

impl RestListener {
    /// Runs the door on `listener` until `shutdown` says stop: then no connection is accepted, idle connections
    /// close, and requests under way finish on their threads (the process ends when they have; see `app::Signals`).
    pub fn run(self: Arc<Self>, listener: &std::net::TcpListener, shutdown: &ShutdownWatch) -> std::io::Result<()> {
        for index in 0..self.threads.max(1) {
            let socket = listener.try_clone()?;
            let door = self.clone();
            let shutdown = shutdown.clone();
            crate::frontend::spawn_door_thread(format!("rest-{index}"), door.accept_loop(socket, shutdown))?;
        }
        Ok(())
    }

    async fn accept_loop(self: Arc<Self>, socket: std::net::TcpListener, mut shutdown: ShutdownWatch) {
        let listener = match tokio::net::TcpListener::from_std(socket) {
            Ok(listener) => listener,
            Err(error) => {
                tracing::error!(%error, "cannot listen for REST");
                std::process::exit(1);
            }
        };
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = stopping(&mut shutdown) => break,
            };
            match accepted {
                Ok((stream, peer)) => {
                    let door = self.clone();
                    let shutdown = shutdown.clone();
                    tokio::spawn(async move { door.serve(stream, peer, shutdown).await });
                }
                Err(error) => {
                    tracing::warn!(%error, "accepting a REST connection failed");
                    // Out of file descriptors: accepting again at once would only spin.
                    if error.raw_os_error() == Some(24) {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        }
        drop(listener);
        // The listening socket is closed; connections still open are served until the process ends.
        std::future::pending::<()>().await;
    }

    async fn serve(self: Arc<Self>, tcp: tokio::net::TcpStream, peer: SocketAddr, shutdown: ShutdownWatch) {
        let _ = tcp.set_nodelay(true);
        let mut connection = Connection::new(tcp, peer);
        let Some(acceptor) = &self.tls else {
            match Box::pin(connection.first_request(self.h2c, &shutdown)).await {
                Arrival::Closed => {}
                Arrival::Http2 => {
                    // pingora cannot peek at this connection, so with h2c on it takes it for HTTP/2 as it is.
                    Box::pin(self.proxy.process_new(Box::new(connection), &shutdown)).await;
                }
                Arrival::Http1 => self.serve_http1(Box::new(connection), shutdown).await,
            }
            return;
        };
        // Boxed, as each step of a connection's life is, so the task keeps only the state of the step it is in.
        match Box::pin(tokio::time::timeout(HANDSHAKE, acceptor.tls_handshake(connection))).await {
            // A TLS stream cannot be peeked at, so the wait between its requests is pingora's own.
            Ok(Ok(tls)) => Box::pin(self.proxy.process_new(Box::new(tls), &shutdown))
                .await
                .map_or((), drop),
            Ok(Err(error)) => tracing::debug!(%error, %peer, "TLS handshake failed"),
            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
        }
    }

    /// Serves HTTP/1.1 requests one after another; between them the connection waits in a small future of its own.
    async fn serve_http1(&self, mut stream: Stream, shutdown: ShutdownWatch) {
        let mut settings: Option<HttpPersistentSettings> = None;
        loop {
            let mut session = ServerSession::new_http1(stream);
            session.set_keepalive((!*shutdown.borrow()).then_some(KEEPALIVE.as_secs()));
            if let Some(settings) = settings.take() {
                settings.apply_to_session(&mut session);
            }
            // Boxed, so the state of a request in flight is held only while one is.
            let Some(reused) = Box::pin(self.proxy.process_new_http(session, &shutdown)).await else {
                return;
            };
            let (next, persistent) = reused.consume();
            settings = persistent;
            let Ok(mut connection) = next.into_any().downcast::<Connection>() else {
                return;
            };
            if !connection.next_request(&shutdown).await {
                return;
            }
            stream = connection;
        }
    }
}

/// What a new connection opened with.
enum Arrival {
    Http1,
    Http2,
    Closed,
}

/// A cleartext client connection as pingora's HTTP sessions use it. Small writes are held until a flush, so an
/// answer's head and a small body leave in one packet (pingora writes them separately); nothing is buffered while the
/// connection idles.
#[derive(Debug)]
struct Connection {
    tcp: tokio::net::TcpStream,
    /// Written, not yet sent.
    pending: Vec<u8>,
    digest: Arc<SocketDigest>,
    established: SystemTime,
}

impl Connection {
    fn new(tcp: tokio::net::TcpStream, peer: SocketAddr) -> Connection {
        let digest = SocketDigest::from_raw_fd(std::os::fd::AsRawFd::as_raw_fd(&tcp));
        let _ = digest.peer_addr.set(Some(PingoraSocketAddr::Inet(peer)));
        Connection {
            tcp,
            pending: Vec::new(),
            digest: Arc::new(digest),
            established: SystemTime::now(),
        }
    }

    /// Waits, within the keep-alive timeout, for the first bytes, and tells HTTP/2's preface (with `h2c`) from an
    /// HTTP/1.1 request.
    async fn first_request(&mut self, h2c: bool, shutdown: &ShutdownWatch) -> Arrival {
        let tcp = &self.tcp;
        let look = async move {
            let mut head = [0u8; H2_PREFACE.len()];
            loop {
                let wanted = if h2c { head.len() } else { 1 };
                let seen = match tcp.peek(&mut head[..wanted]).await {
                    Ok(0) | Err(_) => return Arrival::Closed,
                    Ok(seen) => seen,
                };
                if !h2c || head[..seen] != H2_PREFACE[..seen] {
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

    /// Waits, within the keep-alive timeout, for the next request; `false` when the client closed the connection, the
    /// time ran out or the gateway is shutting down.
    async fn next_request(&mut self, shutdown: &ShutdownWatch) -> bool {
        let mut shutdown = shutdown.clone();
        let mut byte = [0u8; 1];
        tokio::select! {
            biased;
            () = stopping(&mut shutdown) => false,
            peeked = tokio::time::timeout(KEEPALIVE, self.tcp.peek(&mut byte)) => matches!(peeked, Ok(Ok(1..))),
        }
    }

    /// Sends what is pending.
    fn poll_send_pending(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while !self.pending.is_empty() {
            let sent = ready!(Pin::new(&mut self.tcp).poll_write(cx, &self.pending))?;
            if sent == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.pending.drain(..sent);
        }
        // Freed, not kept: an idle connection holds no buffer.
        self.pending = Vec::new();
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for Connection {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Connection {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.pending.len() + buf.len() <= COALESCE {
            if this.pending.is_empty() {
                this.pending.reserve_exact(COALESCE);
            }
            this.pending.extend_from_slice(buf);
            return Poll::Ready(Ok(buf.len()));
        }
        // A large write: what is pending goes with it in one system call, the write itself without a copy.
        while !this.pending.is_empty() {
            let parts = [IoSlice::new(&this.pending), IoSlice::new(buf)];
            let sent = ready!(Pin::new(&mut this.tcp).poll_write_vectored(cx, &parts))?;
            if sent == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            if sent >= this.pending.len() {
                let of_buf = sent - this.pending.len();
                this.pending = Vec::new();
                if of_buf > 0 {
                    return Poll::Ready(Ok(of_buf));
                }
            } else {
                this.pending.drain(..sent);
            }
        }
        Pin::new(&mut this.tcp).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_pending(cx))?;
        Pin::new(&mut this.tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_pending(cx))?;
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for Connection {
    async fn shutdown(&mut self) {
        let _ = tokio::io::AsyncWriteExt::shutdown(self).await;
    }
}

impl UniqueID for Connection {
    fn id(&self) -> UniqueIDType {
        std::os::fd::AsRawFd::as_raw_fd(&self.tcp)
    }
}

impl Ssl for Connection {}

/// Peeking is done before pingora sees the connection; to pingora it is not offered.
#[async_trait]
impl Peek for Connection {}

impl GetTimingDigest for Connection {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        vec![Some(TimingDigest {
            established_ts: self.established,
            establishment_duration: None,
            offload_wait_duration: None,
        })]
    }
}

impl GetProxyDigest for Connection {
    fn get_proxy_digest(&self) -> Option<Arc<pingora::protocols::raw_connect::ProxyDigest>> {
        None
    }
}

impl GetSocketDigest for Connection {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        Some(self.digest.clone())
    }
}

impl std::fmt::Debug for RestListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestListener")
            .field("address", &self.address)
            .field("threads", &self.threads)
            .field("tls", &self.tls.is_some())
            .field("h2c", &self.h2c)
            .finish_non_exhaustive()
    }
}
