//! Calls to backends: the REST and gRPC clients the data paths use, with what they share (connecting, deadlines,
//! bounded answers).

pub mod grpc;
pub mod rest;

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use bytes::BytesMut;
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;

use crate::error::{Error, ErrorKind, Origin, Result};

pub use grpc::GrpcUpstream;
pub use rest::RestUpstream;

/// A backend's answer with the end-to-end headers (and, from gRPC, trailers) that came with it.
#[derive(Debug, Clone)]
pub struct Replied<T> {
    pub value: T,
    pub headers: http::HeaderMap,
    /// The endpoint that answered.
    pub endpoint: Option<std::sync::Arc<str>>,
}

/// How backend connections are made: TCP, with TLS for `https` URIs.
pub type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

/// The HTTP client of one backend endpoint on one thread.
type HttpClient = hyper_util::client::legacy::Client<Connector, crate::body::OutBody>;

/// One backend endpoint's HTTP clients, one per thread, each with its own connection pool, and (for gRPC) the
/// thread's HTTP/2 connection for backend streams. Cheap to clone; clones share the clients.
///
/// A connection is served by a task on the runtime that opened it, and the gateway runs one single-threaded runtime
/// per thread: a pool shared between them would make every request it lends across threads wake the other thread
/// twice (request out, answer back).
#[derive(Debug, Clone)]
struct ThreadClients {
    connector: Connector,
    build: fn(Connector) -> HttpClient,
    /// Identifies this endpoint's clients in each thread's table; they are dropped once every clone is.
    token: std::sync::Arc<()>,
}

/// What one thread holds for one endpoint.
struct ThreadEndpoint {
    client: HttpClient,
    streams: Option<h2::client::SendRequest<Bytes>>,
}

impl ThreadClients {
    fn new(connector: Connector, build: fn(Connector) -> HttpClient) -> ThreadClients {
        ThreadClients {
            connector,
            build,
            token: std::sync::Arc::new(()),
        }
    }

    /// This thread's client.
    fn get(&self) -> HttpClient {
        self.with_endpoint(|endpoint| endpoint.client.clone())
    }

    /// This thread's connection for streams, if one was made.
    fn streams(&self) -> Option<h2::client::SendRequest<Bytes>> {
        self.with_endpoint(|endpoint| endpoint.streams.clone())
    }

    fn set_streams(&self, connection: h2::client::SendRequest<Bytes>) {
        self.with_endpoint(|endpoint| endpoint.streams = Some(connection));
    }

    fn with_endpoint<T>(&self, use_endpoint: impl FnOnce(&mut ThreadEndpoint) -> T) -> T {
        thread_local! {
            static ENDPOINTS: std::cell::RefCell<Vec<(std::sync::Weak<()>, ThreadEndpoint)>> =
                const { std::cell::RefCell::new(Vec::new()) };
        }
        ENDPOINTS.with_borrow_mut(|endpoints| {
            // A live `Weak` keeps its allocation, so the address cannot be taken by another endpoint's token.
            let key = std::sync::Arc::as_ptr(&self.token);
            if let Some((_, endpoint)) = endpoints.iter_mut().find(|(token, _)| token.as_ptr() == key) {
                return use_endpoint(endpoint);
            }
            endpoints.retain(|(token, _)| token.strong_count() > 0);
            let mut endpoint = ThreadEndpoint {
                client: (self.build)(self.connector.clone()),
                streams: None,
            };
            let used = use_endpoint(&mut endpoint);
            endpoints.push((std::sync::Arc::downgrade(&self.token), endpoint));
            used
        })
    }
}

/// TLS to one backend endpoint: the backend's material and the name to verify (and send as SNI).
#[derive(Debug, Clone)]
pub struct EndpointTls {
    pub material: crate::tls::BackendMaterial,
    /// The configured server name, or the DNS name the endpoint was found under; `None` verifies the endpoint's
    /// own host.
    pub server_name: Option<String>,
}

/// A connector for backends: no Nagle delay, bounded connect time, TLS with `tls` offering HTTP/2 (ALPN `h2`) when
/// `http2`, else HTTP/1.1; gives the URI scheme to call it with.
fn connector(connect_timeout: Duration, tls: Option<&EndpointTls>, http2: bool) -> (Connector, &'static str) {
    let mut tcp = HttpConnector::new();
    tcp.set_nodelay(true);
    tcp.set_connect_timeout(Some(connect_timeout));
    tcp.enforce_http(false);
    let Some(tls) = tls else {
        // Plain calls never reach the TLS layer (their URIs say http); its configuration is only a placeholder.
        static PLAIN: std::sync::OnceLock<rustls::ClientConfig> = std::sync::OnceLock::new();
        let config = PLAIN.get_or_init(|| {
            rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map(|b| {
                    b.with_root_certificates(rustls::RootCertStore::empty())
                        .with_no_client_auth()
                })
                .unwrap_or_else(|_| {
                    rustls::ClientConfig::builder()
                        .with_root_certificates(rustls::RootCertStore::empty())
                        .with_no_client_auth()
                })
        });
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(config.clone())
            .https_or_http()
            .enable_http1()
            .wrap_connector(tcp);
        return (connector, "http");
    };
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls.material.client_config(&[]))
        .https_only();
    let builder = match tls
        .server_name
        .as_deref()
        .and_then(|name| rustls_pki_types::ServerName::try_from(name.to_owned()).ok())
    {
        Some(name) => builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name)),
        None => builder,
    };
    let connector = if http2 {
        builder.enable_http2().wrap_connector(tcp)
    } else {
        builder.enable_http1().wrap_connector(tcp)
    };
    (connector, "https")
}

/// A request the HTTP client could not complete: only a failed connection is known not to have delivered any of
/// it, so only that may be sent to another endpoint.
/// Whether a request failed because its connection closed before any of the answer came: a kept-alive connection
/// the backend dropped as the request went out (MLServer's REST server closes its connection after a 500 without
/// saying so). Sent again once on a new connection, as curl does; a backend that dies with the request is rare, and
/// its endpoint then refuses the new connection.
fn closed_before_answer(error: &hyper_util::client::legacy::Error) -> bool {
    std::error::Error::source(error).is_some_and(crate::error::is_closed_connection)
}

/// Sends `request` on `client`, once more on a new connection when the first closed before any answer and the
/// body can be sent again.
async fn send_request(
    client: &HttpClient,
    request: http::Request<crate::body::OutBody>,
) -> std::result::Result<http::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error> {
    let again = request.body().again().map(|body| {
        let mut copy = http::Request::new(body);
        *copy.method_mut() = request.method().clone();
        *copy.uri_mut() = request.uri().clone();
        *copy.headers_mut() = request.headers().clone();
        *copy.version_mut() = request.version();
        copy
    });
    match (client.request(request).await, again) {
        (Err(error), Some(again)) if closed_before_answer(&error) => client.request(again).await,
        (answer, _) => answer,
    }
}

fn unreachable(authority: &str, error: hyper_util::client::legacy::Error) -> Error {
    let connect = error.is_connect();
    let failure = Error::new(
        ErrorKind::BadGateway,
        Origin::Upstream,
        format!("backend {authority} unreachable: {error}"),
    )
    .caused_by(error);
    if connect {
        failure.unsent()
    } else {
        failure.with_retryable(false)
    }
}

/// Runs `call` within `deadline`, failing with a timeout that names the backend.
async fn within<T>(deadline: Option<Duration>, authority: &str, call: impl Future<Output = Result<T>>) -> Result<T> {
    match deadline {
        None => call.await,
        Some(limit) => tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
            Err(Error::new(
                ErrorKind::Timeout,
                Origin::Upstream,
                format!("backend {authority} did not answer within {} ms", limit.as_millis()),
            ))
        }),
    }
}

/// How an answer's length is known ahead of its bytes, so it can be gathered into one buffer allocated once.
#[derive(Debug, Clone, Copy)]
enum Sized {
    /// A REST answer's Content-Length, when given.
    ContentLength(Option<usize>),
    /// A gRPC message: its length is in the 5-byte frame header.
    GrpcFrame,
}

/// Reads a backend's whole answer, up to `limit` bytes of payload plus `framing` bytes of protocol framing; gives the
/// body and its trailers. An answer that arrives as one frame is kept as it is; one in many frames is gathered into a
/// single buffer sized from its announced length (no growth by doubling, no second buffer to join into), each frame
/// freed as it is copied.
async fn read_answer<B>(
    body: B,
    limit: usize,
    framing: usize,
    sized: Sized,
    authority: &str,
) -> Result<(Bytes, Option<http::HeaderMap>)>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let cap = limit.saturating_add(framing);
    let too_large = || {
        Error::new(
            ErrorKind::BadGateway,
            Origin::Upstream,
            format!("backend {authority} answered more than the limit of {limit} bytes"),
        )
        .with_retryable(false)
    };
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut gathered = BytesMut::new();
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            Error::new(
                ErrorKind::BadGateway,
                Origin::Upstream,
                format!("backend {authority} broke off its answer: {}", e.into()),
            )
            .with_retryable(false)
        })?;
        let data = match frame.into_data() {
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
            return Err(too_large());
        }
        if first.is_none() && gathered.is_empty() {
            first = Some(data);
            continue;
        }
        if let Some(previous) = first.take() {
            let expected = match sized {
                Sized::ContentLength(length) => length,
                Sized::GrpcFrame => {
                    let mut header = [0u8; 5];
                    let head = previous.iter().chain(data.iter()).take(5).copied().collect::<Vec<_>>();
                    header[..head.len()].copy_from_slice(&head);
                    (head.len() == 5)
                        .then(|| 5 + u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize)
                }
            };
            gathered.reserve(expected.unwrap_or(0).min(cap).max(previous.len() + data.len()));
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
