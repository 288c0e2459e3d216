//! Calls to backends: the REST and gRPC clients the data paths use, with what they share (connecting, deadlines,
//! bounded answers).

pub mod grpc;
pub mod rest;

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
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
fn unreachable(authority: &str, error: &hyper_util::client::legacy::Error) -> Error {
    let failure = Error::new(
        ErrorKind::BadGateway,
        Origin::Upstream,
        format!("backend {authority} unreachable: {error}"),
    );
    if error.is_connect() {
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

/// Reads a backend's whole answer, up to `limit` bytes of payload plus `framing` bytes of protocol framing; gives the
/// body and its trailers.
async fn read_answer<B>(
    body: B,
    limit: usize,
    framing: usize,
    authority: &str,
) -> Result<(Bytes, Option<http::HeaderMap>)>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let collected = Limited::new(body, limit.saturating_add(framing))
        .collect()
        .await
        .map_err(|e| {
            let message = if e.is::<http_body_util::LengthLimitError>() {
                format!("backend {authority} answered more than the limit of {limit} bytes")
            } else {
                format!("backend {authority} broke off its answer: {e}")
            };
            Error::new(ErrorKind::BadGateway, Origin::Upstream, message).with_retryable(false)
        })?;
    let trailers = collected.trailers().cloned();
    Ok((collected.to_bytes(), trailers))
}
