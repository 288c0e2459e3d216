//! The REST door's connections: HTTP/1.1 (the door's own, `super::http1`), h2c (told by its preface, served by
//! hyper) and TLS (HTTP/2 or HTTP/1.1 by ALPN), each on the thread that accepted it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use pingora::server::ShutdownWatch;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::RestDoor;
use super::http1::{CLOSE_LINGER, Http1, KEEPALIVE, Peek};
use crate::body::ClientBody;
use crate::body::http2::Http2Body;
use crate::frontend::budget::AnswerBudget;
use crate::frontend::flood::{self, ResetWatch};
use crate::frontend::preface::{self, Opening, Rewound};
use crate::frontend::stopping;
use crate::live::{Active, Gateway};

/// How long a TLS handshake may take.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// HTTP/2 windows large enough that a multi-megabyte tensor is not throttled by flow control.
const STREAM_WINDOW: u32 = 8 << 20;
const CONNECTION_WINDOW: u32 = 32 << 20;

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

impl RestConnections {
    /// Serves one accepted connection until it closes.
    pub async fn serve(self, mut tcp: TcpStream, peer: SocketAddr, shutdown: ShutdownWatch) {
        let _ = tcp.set_nodelay(true);
        // A connection's task lives as long as the connection, idle or not, and a future is as large as its largest
        // state: HTTP/2 and TLS (large states of their own) are boxed so an idle plain HTTP/1.1 connection stays small.
        if self.tls.is_some() {
            return Box::pin(self.serve_tls(tcp, peer, shutdown)).await;
        }
        match first_bytes(&mut tcp, &shutdown, self.door.gateway(), self.header_timeout).await {
            (Arrival::Closed, _) => {}
            (Arrival::Http2, _) => {
                Box::pin(self.serve_http2(Rewound::after_preface(tcp), shutdown)).await;
            }
            (Arrival::Http1(first), held) => self.serve_http1(tcp, first, shutdown, held).await,
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
            if let Some(tls) = preface::after_preface(tls, KEEPALIVE, self.header_timeout).await {
                self.serve_http2(tls, shutdown).await;
            }
        } else {
            self.serve_http1(tls, BytesMut::new(), shutdown, None).await;
        }
    }

    /// Serves HTTP/1.1 requests on `stream`, whose `first` bytes were read already; `held` counts it as under way
    /// until its first request is answered.
    async fn serve_http1<S>(self, stream: S, first: BytesMut, shutdown: ShutdownWatch, held: Option<Active>)
    where
        S: AsyncRead + AsyncWrite + Peek + Unpin + Send + 'static,
    {
        Http1::new(stream, first, self.door, self.header_timeout, shutdown, held)
            .serve()
            .await;
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
                let (parts, body) = request.into_parts();
                let body = ClientBody::Http2(Http2Body::drain(body, door.max_request_bytes()));
                let arrived = std::time::Instant::now();
                let answer = door.answer(Box::new(parts), body, Some(&budget), arrived).await;
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

/// What a new connection opened with.
enum Arrival {
    /// An HTTP/1.1 request's first bytes, read off the socket.
    Http1(BytesMut),
    /// HTTP/2's whole preface, read off the socket.
    Http2,
    Closed,
}

/// Waits, within the keep-alive timeout, for a new connection's first bytes, and tells HTTP/2's preface from an
/// HTTP/1.1 request (the rest of a preface within the head's time limit). Once shutdown has begun, a connection
/// whose bytes are not here yet is given as long as an idle one, counted as under way so the process waits for it:
/// it was accepted before the listener closed (or the sockets went to a new process), and its client may have sent
/// its request already; closing it unanswered would fail that request.
async fn first_bytes(
    tcp: &mut TcpStream,
    shutdown: &ShutdownWatch,
    gateway: &Arc<Gateway>,
    header_timeout: Duration,
) -> (Arrival, Option<Active>) {
    let arrival = |opened| match opened {
        Opening::Preface => Arrival::Http2,
        Opening::Other(first) => Arrival::Http1(first),
        Opening::Closed => Arrival::Closed,
    };
    let mut shutdown = shutdown.clone();
    let mut look = std::pin::pin!(preface::opening(tcp, KEEPALIVE, header_timeout));
    tokio::select! {
        biased;
        opened = &mut look => (arrival(opened), None),
        () = stopping(&mut shutdown) => {
            let held = gateway.begin();
            let opened = tokio::time::timeout(CLOSE_LINGER, look).await;
            (opened.map_or(Arrival::Closed, arrival), Some(held))
        }
    }
}
