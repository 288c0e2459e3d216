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
}

/// A TCP connector for backends: no Nagle delay, bounded connect time.
fn connector(connect_timeout: Duration) -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector
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
