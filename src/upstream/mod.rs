//! Calls to backends: the REST and gRPC clients the data paths use, with what they share (connecting, deadlines,
//! bounded answers).

pub mod grpc;
mod http1;
#[cfg(feature = "fuzzing")]
pub use http1::{answer_lines_match_map, read_answer_head};
pub mod rest;

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper_util::client::legacy::connect::HttpConnector;

use crate::body::{BodyLength, GatherError};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::runtime::ThreadShared;

pub use grpc::GrpcUpstream;
pub use http1::{BackendBody, BodySaid, PassedAnswer, keep_passed_back};
pub use rest::RestUpstream;

/// A backend's answer with the end-to-end headers (and, from gRPC, trailers) that came with it.
#[derive(Debug, Clone)]
pub struct BackendAnswer<T> {
    pub value: T,
    pub headers: http::HeaderMap,
    /// The endpoint that answered.
    pub endpoint: Option<crate::runtime::ThreadArc<str>>,
}

/// How backend connections are made: TCP, with TLS for `https` URIs.
pub type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

/// One backend endpoint's connections, one set per thread: for REST the thread's idle HTTP/1.1 connections; for gRPC
/// the thread's HTTP/2 connections, one for unary calls and one for streams. Cheap to clone; clones share the
/// connections.
///
/// A connection's socket is registered with the runtime that opened it, and the gateway runs one single-threaded
/// runtime per thread: a pool shared between them would make every request it lends across threads wake the other
/// thread twice (request out, answer back).
#[derive(Debug, Clone)]
struct ThreadClients {
    connector: Connector,
    /// Identifies this endpoint's clients in each thread's table; they are dropped once every clone is. An answer
    /// holds it through its thread's handle.
    token: std::sync::Arc<ThreadShared<()>>,
}

/// What one thread holds for one endpoint.
#[derive(Default)]
struct ThreadEndpoint {
    /// Boxed, as each is taken out for a request and given back after it, and a connection's state is large.
    #[allow(clippy::vec_box)]
    idle: Vec<Box<http1::PooledConnection>>,
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
            token: std::sync::Arc::new(ThreadShared::new(std::sync::Arc::new(()))),
        }
    }

    /// This thread's HTTP/2 connection for `channel`, if one was made.
    fn connection(&self, channel: Channel) -> Option<h2::client::SendRequest<Bytes>> {
        with_endpoint(self.token.shared(), |endpoint| {
            endpoint.connections[channel as usize].clone()
        })
    }

    /// Keeps `connection` as this thread's for `channel`; `None` forgets a failed one.
    fn set_connection(&self, channel: Channel, connection: Option<h2::client::SendRequest<Bytes>>) {
        with_endpoint(self.token.shared(), |endpoint| {
            endpoint.connections[channel as usize] = connection
        });
    }
}

thread_local! {
    /// What this thread holds for each endpoint, by the endpoint's token.
    static ENDPOINTS: std::cell::RefCell<Vec<(std::sync::Weak<()>, ThreadEndpoint)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// What this thread holds for the endpoint `token` stands for.
fn with_endpoint<T>(token: &std::sync::Arc<()>, use_endpoint: impl FnOnce(&mut ThreadEndpoint) -> T) -> T {
    // What an endpoint holds is dropped outside the table's borrow: dropping a connection may run code that reaches
    // the table again.
    let (used, forgotten) = ENDPOINTS.with_borrow_mut(|endpoints| {
        // A live `Weak` keeps its allocation, so the address cannot be taken by another endpoint's token.
        let key = std::sync::Arc::as_ptr(token);
        if let Some((_, endpoint)) = endpoints.iter_mut().find(|(token, _)| token.as_ptr() == key) {
            return (use_endpoint(endpoint), Vec::new());
        }
        let forgotten = forget_unused(endpoints);
        let mut endpoint = ThreadEndpoint::default();
        let used = use_endpoint(&mut endpoint);
        endpoints.push((std::sync::Arc::downgrade(token), endpoint));
        (used, forgotten)
    });
    drop(forgotten);
    used
}

/// Takes out of this thread's table the endpoints no longer in use (every clone of their token dropped); gives what
/// it held for them, to be dropped outside the table's borrow.
fn forget_unused(
    endpoints: &mut Vec<(std::sync::Weak<()>, ThreadEndpoint)>,
) -> Vec<(std::sync::Weak<()>, ThreadEndpoint)> {
    let (live, forgotten) = std::mem::take(endpoints)
        .into_iter()
        .partition(|(token, _)| token.strong_count() > 0);
    *endpoints = live;
    forgotten
}

/// Closes this thread's REST connections that have been idle too long at `now`, and forgets the endpoints no longer
/// in use, with what it held for them.
fn sweep_idle(now: Instant) {
    let swept = ENDPOINTS.with_borrow_mut(|endpoints| {
        let forgotten = forget_unused(endpoints);
        let mut aged = Vec::new();
        for (_, endpoint) in endpoints.iter_mut() {
            let (fresh, old): (Vec<_>, Vec<_>) = std::mem::take(&mut endpoint.idle)
                .into_iter()
                .partition(|kept| !kept.aged(now));
            endpoint.idle = fresh;
            aged.extend(old);
        }
        (forgotten, aged)
    });
    // Dropped outside the table's borrow, as in `with_endpoint`.
    drop(swept);
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

/// A connection that could not be made, as an error's cause.
#[derive(Debug)]
struct ConnectFailure(Box<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for ConnectFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ConnectFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// When a call must have answered by, and the time it was given (which the error on running out names).
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    pub until: Instant,
    pub given: Duration,
}

impl Deadline {
    /// When the call began: `given` before `until`.
    pub fn began(&self) -> Instant {
        self.until.checked_sub(self.given).unwrap_or(self.until)
    }

    /// `given` from now.
    pub fn after(given: Duration) -> Deadline {
        Deadline {
            until: Instant::now() + given,
            given,
        }
    }
}

/// Runs `call` until `deadline`, failing with a timeout that names the backend. Not an `async fn`: one would hold
/// `call` twice over (as its argument and inside the timeout), and calls' futures are large.
fn within<T, F>(deadline: Option<Deadline>, authority: &str, call: F) -> impl Future<Output = Result<T>>
where
    F: Future<Output = Result<T>>,
{
    use futures_util::FutureExt;
    match deadline {
        None => futures_util::future::Either::Left(call),
        Some(Deadline { until, given }) => {
            futures_util::future::Either::Right(crate::deadlines::timeout_at(until.into(), call).map(move |answer| {
                answer.unwrap_or_else(|_| {
                    Err(Error::new(
                        ErrorKind::Timeout,
                        Origin::Upstream,
                        format!("backend {authority} did not answer within {} ms", given.as_millis()),
                    ))
                })
            }))
        }
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
                GatherError::TooLarge => format!("backend {authority} answered more than the limit of {limit} bytes"),
                GatherError::Broken(e) => format!("backend {authority} broke off its answer: {}", e.into()),
            };
            Error::new(ErrorKind::BadGateway, Origin::Upstream, message).with_retryable(false)
        })
}
