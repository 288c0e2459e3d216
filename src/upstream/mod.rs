//! Calls to backends: the REST and gRPC clients the data paths use, with what they share (connecting, deadlines,
//! bounded answers).

pub mod grpc;
pub mod rest;

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use hyper_util::client::legacy::connect::HttpConnector;

use crate::body::{BodyLength, Gathered};
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

/// One backend endpoint's clients, one set per thread: for REST an HTTP/1.1 client with its own connection pool;
/// for gRPC the thread's HTTP/2 connections, one for unary calls and one for streams. Cheap to clone; clones share
/// the clients.
///
/// A connection is served by a task on the runtime that opened it, and the gateway runs one single-threaded runtime
/// per thread: a pool shared between them would make every request it lends across threads wake the other thread
/// twice (request out, answer back).
#[derive(Debug, Clone)]
struct ThreadClients {
    connector: Connector,
    /// Identifies this endpoint's clients in each thread's table; they are dropped once every clone is.
    token: std::sync::Arc<()>,
}

/// What one thread holds for one endpoint.
#[derive(Default)]
struct ThreadEndpoint {
    client: Option<HttpClient>,
    connections: [Option<h2::client::SendRequest<Bytes>>; 2],
}

/// What a gRPC connection carries: unary calls, whose whole messages are at hand, or streams, which bound what a
/// slow reader leaves buffered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Channel {
    Unary = 0,
    Streams = 1,
}

impl ThreadClients {
    fn new(connector: Connector) -> ThreadClients {
        ThreadClients {
            connector,
            token: std::sync::Arc::new(()),
        }
    }

    /// This thread's HTTP/1.1 client, made with `build` the first time.
    fn get(&self, build: fn(Connector) -> HttpClient) -> HttpClient {
        self.with_endpoint(|endpoint| {
            endpoint
                .client
                .get_or_insert_with(|| build(self.connector.clone()))
                .clone()
        })
    }

    /// This thread's HTTP/2 connection for `channel`, if one was made.
    fn connection(&self, channel: Channel) -> Option<h2::client::SendRequest<Bytes>> {
        self.with_endpoint(|endpoint| endpoint.connections[channel as usize].clone())
    }

    /// Keeps `connection` as this thread's for `channel`; `None` forgets a failed one.
    fn set_connection(&self, channel: Channel, connection: Option<h2::client::SendRequest<Bytes>>) {
        self.with_endpoint(|endpoint| endpoint.connections[channel as usize] = connection);
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
            let mut endpoint = ThreadEndpoint::default();
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

/// Runs `call` within `deadline`, failing with a timeout that names the backend. Not an `async fn`: one would hold
/// `call` twice over (as its argument and inside the timeout), and calls' futures are large.
fn within<T, F>(deadline: Option<Duration>, authority: &str, call: F) -> impl Future<Output = Result<T>>
where
    F: Future<Output = Result<T>>,
{
    use futures_util::FutureExt;
    match deadline {
        None => futures_util::future::Either::Left(call),
        Some(limit) => futures_util::future::Either::Right(tokio::time::timeout(limit, call).map(move |answer| {
            answer.unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::Timeout,
                    Origin::Upstream,
                    format!("backend {authority} did not answer within {} ms", limit.as_millis()),
                ))
            })
        })),
    }
}

/// Reads a backend's whole answer, up to `limit` bytes of payload plus `framing` bytes of protocol framing; gives the
/// body and its trailers (see [`crate::body::gather`]).
async fn read_answer<B>(
    body: B,
    limit: usize,
    framing: usize,
    sized: BodyLength,
    authority: &str,
) -> Result<(Bytes, Option<http::HeaderMap>)>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    crate::body::gather(body, limit.saturating_add(framing), sized)
        .await
        .map_err(|error| {
            let message = match error {
                Gathered::TooLarge => format!("backend {authority} answered more than the limit of {limit} bytes"),
                Gathered::Broken(e) => format!("backend {authority} broke off its answer: {}", e.into()),
            };
            Error::new(ErrorKind::BadGateway, Origin::Upstream, message).with_retryable(false)
        })
}
