//! The payload log's sink, reached over the gateway's own HTTP/1.1 client as the backends are (TLS with the
//! system's roots for an `https` URL).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};

use super::CONNECT_TIMEOUT;
use crate::config::{BackendTls, Endpoint};
use crate::error::{Error, Result};
use crate::telemetry::payload_log::EventSink;
use crate::tls::BackendMaterial;
use crate::upstream::{EndpointTls, RestUpstream};

/// The most of a sink's answer read: its status is what counts.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// The configured sink: its endpoint's connections and the URL's path.
#[derive(Debug)]
pub(super) struct SinkUpstream {
    upstream: RestUpstream,
    path: String,
}

impl SinkUpstream {
    pub(super) fn new(url: &http::Uri) -> Result<SinkUpstream> {
        let https = url.scheme_str() == Some("https");
        let host = url
            .host()
            .ok_or_else(|| Error::internal(format!("the payload log's URL {url} names no host")))?;
        let endpoint = Endpoint {
            host: host.trim_start_matches('[').trim_end_matches(']').to_owned(),
            port: url.port_u16().unwrap_or(if https { 443 } else { 80 }),
        };
        let tls = if https {
            let system_roots = BackendTls {
                ca: None,
                client_cert: None,
                server_name: None,
            };
            let material = BackendMaterial::load(&system_roots, 0)
                .map_err(|problem| Error::internal(format!("the payload log's TLS: {}", problem.message)))?;
            Some(EndpointTls {
                material,
                server_name: None,
            })
        } else {
            None
        };
        Ok(SinkUpstream {
            upstream: RestUpstream::new(&endpoint, CONNECT_TIMEOUT, MAX_ANSWER_BYTES, tls.as_ref()),
            path: url.path_and_query().map_or("/", |path| path.as_str()).to_owned(),
        })
    }
}

impl EventSink for SinkUpstream {
    fn post(
        &self,
        headers: HeaderMap,
        body: Bytes,
        timeout: Duration,
    ) -> Pin<Box<dyn Future<Output = std::result::Result<StatusCode, String>> + Send + '_>> {
        Box::pin(async move {
            self.upstream
                .send(Method::POST, &self.path, &headers, vec![body], Some(timeout))
                .await
                .map(|answer| answer.status)
                .map_err(|error| error.message().to_owned())
        })
    }
}
