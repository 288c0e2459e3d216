//! REST calls to a backend over HTTP/1.1 keep-alive connections kept per thread: inference bodies go out as their
//! chunks (binary sections are the tensors' own buffers), answers come back decoded, and a backend's error keeps its
//! status and message.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, StatusCode};

use super::BackendAnswer;
use super::http1::{self, BackendBody, Failure};
use crate::body::{ChunksBody, OutBody};
use crate::codec::compression;
use crate::codec::rest::{self, EncodedBody};
use crate::config::Endpoint;
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::headers;
use crate::headers::INFERENCE_HEADER_CONTENT_LENGTH;
use crate::headers::PassedOn;
use crate::protocol::{InferResponse, ModelMetadata, ModelReady, ServerMetadata, ServerReady};
use crate::runtime::ThreadShared;

/// One backend endpoint spoken to over REST. Cheap to clone; clones share their connections.
#[derive(Debug, Clone)]
pub struct RestUpstream {
    clients: super::ThreadClients,
    authority: std::sync::Arc<ThreadShared<str>>,
    /// The endpoint's root (`http://` or, for TLS, `https://` and its address), what connections are made to.
    root: http::Uri,
    /// The `Host` every request says.
    host: HeaderValue,
    max_response_bytes: usize,
    /// The backend's configured headers, added to every request.
    added: std::sync::Arc<HeaderMap>,
}

/// A raw answer: status, headers and the whole body.
#[derive(Debug)]
pub struct RestAnswer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// Percent-encodes a path segment (model names and versions are checked to hold no '/', but may hold anything else).
pub fn path_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// `/v2/models/<model>[/versions/<version>]` followed by `suffix`.
pub fn model_path(model: &str, version: Option<&str>, suffix: &str) -> String {
    match version.filter(|v| !v.is_empty()) {
        Some(version) => format!(
            "/v2/models/{}/versions/{}{suffix}",
            path_segment(model),
            path_segment(version)
        ),
        None => format!("/v2/models/{}{suffix}", path_segment(model)),
    }
}

impl RestUpstream {
    pub fn new(
        endpoint: &Endpoint,
        connect_timeout: Duration,
        max_response_bytes: usize,
        tls: Option<&super::EndpointTls>,
    ) -> RestUpstream {
        let (connector, scheme) = super::connector(connect_timeout, tls, false);
        let authority = endpoint.to_string();
        // An endpoint is a validated host and port, so both parse; the fallbacks only keep this infallible.
        let root = format!("{scheme}://{authority}/").parse().unwrap_or_default();
        let host = HeaderValue::from_str(&authority).unwrap_or(HeaderValue::from_static("localhost"));
        RestUpstream {
            clients: super::ThreadClients::new(connector),
            authority: std::sync::Arc::new(authority.as_str().into()),
            root,
            host,
            max_response_bytes,
            added: std::sync::Arc::default(),
        }
    }

    /// The same endpoint (its connections shared) adding `headers` to every request.
    #[must_use]
    pub fn adding(mut self, headers: &std::sync::Arc<HeaderMap>) -> RestUpstream {
        self.added = headers.clone();
        self
    }

    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// Sends one request and reads the whole answer, within `deadline`.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &HeaderMap,
        body: Vec<Bytes>,
        deadline: Option<Duration>,
    ) -> Result<RestAnswer> {
        super::within(
            deadline.map(super::Deadline::after),
            &self.authority,
            self.exchange(method, path, headers, body),
        )
        .await
    }

    async fn exchange(&self, method: Method, path: &str, headers: &HeaderMap, body: Vec<Bytes>) -> Result<RestAnswer> {
        let path = PathAndQuery::try_from(path)
            .map_err(|e| Error::internal(format!("cannot build a request for {path}: {e}")))?;
        let response = self
            .request(&method, &path, headers, None, ChunksBody::new(body).into(), None)
            .await?;
        let (head, body) = response.into_parts();
        let length = head
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        let (body, _) = super::read_answer(
            body,
            self.max_response_bytes,
            0,
            crate::body::BodyLength::ContentLength(length),
            &self.authority,
        )
        .await?;
        let mut headers = head.headers;
        // A compressed answer (a backend that compresses for the client's Accept-Encoding) is read as its bytes.
        let body = match compression::answer_content_coding(&headers, &self.authority)? {
            None => body,
            Some(coding) => {
                headers.remove(http::header::CONTENT_ENCODING);
                headers.remove(http::header::CONTENT_LENGTH);
                let limit = self.max_response_bytes as u64;
                compression::decompress(coding, &body, limit, "backend answer")
                    .map_err(|error| Error::new(ErrorKind::BadGateway, Origin::Upstream, error.message().to_owned()))?
            }
        };
        Ok(RestAnswer {
            status: head.status,
            headers,
            body,
        })
    }

    /// Sends a proxied request's body as it came (a small one in one buffer, with its head in one write; a large one
    /// relayed as it arrives) and gives the answer's head as soon as it arrives, its body still to be read. Its
    /// headers are `headers`, and a passthrough's `passed` (giving way to those of `headers`).
    pub async fn forward(
        &self,
        path: &PathAndQuery,
        headers: &HeaderMap,
        passed: Option<&PassedOn<'_>>,
        body: OutBody,
        deadline: super::Deadline,
    ) -> Result<http::Response<BackendBody>> {
        super::within(
            Some(deadline),
            &self.authority,
            self.request(&Method::POST, path, headers, passed, body, Some(deadline.began())),
        )
        .await
    }

    /// Sends one request on one of this thread's connections to the endpoint; gives the answer's head, its body
    /// still to be read. A body that can be sent twice is, when a kept connection turns out to have been closed.
    async fn request(
        &self,
        method: &Method,
        path: &PathAndQuery,
        headers: &HeaderMap,
        passed: Option<&PassedOn<'_>>,
        body: OutBody,
        began: Option<Instant>,
    ) -> Result<http::Response<BackendBody>> {
        let request = http1::Request {
            method,
            path,
            host: &self.host,
            headers: [headers, &self.added],
            passed,
            body,
            began,
        };
        http1::send(&self.clients, &self.root, request)
            .await
            .map_err(|failure| self.unreachable(failure))
    }

    /// A request that could not be sent or answered: a bad gateway naming the endpoint, which another endpoint may
    /// take when none of it was sent.
    fn unreachable(&self, failure: Failure) -> Error {
        let failed = |message: String| {
            Error::new(
                ErrorKind::BadGateway,
                Origin::Upstream,
                format!("backend {} unreachable: {message}", self.authority),
            )
        };
        match failure {
            Failure::Connect(error) => failed(format!("cannot connect: {error}"))
                .caused_by(super::ConnectFailure(error))
                .unsent(),
            Failure::Http { error, unsent: true } => failed(error.to_string()).caused_by(error).unsent(),
            Failure::Http { error, unsent: false } => failed(error.to_string()).caused_by(error).with_retryable(false),
            // The client's side: the endpoint is not counted as failing, and the call is not tried again.
            Failure::Body(error) => Error::new(
                ErrorKind::InvalidArgument,
                Origin::Client,
                format!(
                    "the request body could not be sent to backend {}: {error}",
                    self.authority
                ),
            )
            .caused_by(error)
            .with_retryable(false),
        }
    }

    /// The backend's error, when the answer is not a success.
    pub fn check(&self, answer: &RestAnswer) -> Result<()> {
        if answer.status.is_success() {
            return Ok(());
        }
        let message = rest::decode_error(&answer.body);
        let message = if message.is_empty() {
            format!("backend {} answered {}", self.authority, answer.status)
        } else {
            message
        };
        Err(Error::from_upstream_http(answer.status.as_u16(), message))
    }

    /// Runs an inference: `body` is an encoded request (JSON, or binary-extension when the backend speaks it). The
    /// answer comes with the backend's end-to-end headers.
    pub async fn infer(
        &self,
        model: &str,
        version: Option<&str>,
        body: EncodedBody,
        headers: &HeaderMap,
        deadline: Option<Duration>,
    ) -> Result<BackendAnswer<InferResponse>> {
        let mut headers = headers.clone();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(body.content_type()));
        if let Some(length) = body.header_length {
            headers.insert(INFERENCE_HEADER_CONTENT_LENGTH, HeaderValue::from(length));
        }
        let path = model_path(model, version, "/infer");
        let answer = self.send(Method::POST, &path, &headers, body.chunks, deadline).await?;
        self.check(&answer)?;
        let length = rest::inference_header_length(answer.headers.get(INFERENCE_HEADER_CONTENT_LENGTH))
            .map_err(Error::into_upstream_protocol_error)?;
        let response = rest::decode_response(answer.body, length).map_err(Error::into_upstream_protocol_error)?;
        Ok(BackendAnswer {
            value: response,
            headers: headers::end_to_end(&answer.headers),

            endpoint: Some(self.authority.handle()),
        })
    }

    pub async fn model_metadata(
        &self,
        model: &str,
        version: Option<&str>,
        deadline: Option<Duration>,
    ) -> Result<ModelMetadata> {
        let answer = self
            .send(
                Method::GET,
                &model_path(model, version, ""),
                &HeaderMap::new(),
                Vec::new(),
                deadline,
            )
            .await?;
        self.check(&answer)?;
        rest::decode_model_metadata(&answer.body).map_err(Error::into_upstream_protocol_error)
    }

    /// Model readiness; an unknown model is an error, an unready one is `ready: false`.
    pub async fn model_ready(
        &self,
        model: &str,
        version: Option<&str>,
        deadline: Option<Duration>,
    ) -> Result<ModelReady> {
        let path = model_path(model, version, "/ready");
        let answer = self
            .send(Method::GET, &path, &HeaderMap::new(), Vec::new(), deadline)
            .await?;
        if answer.status == StatusCode::NOT_FOUND {
            self.check(&answer)?;
        }
        rest::decode_model_ready(answer.status.is_success(), &answer.body, model)
            .map_err(Error::into_upstream_protocol_error)
    }

    pub async fn server_ready(&self, deadline: Option<Duration>) -> Result<ServerReady> {
        let answer = self
            .send(Method::GET, "/v2/health/ready", &HeaderMap::new(), Vec::new(), deadline)
            .await?;
        rest::decode_server_ready(answer.status.is_success(), &answer.body).map_err(Error::into_upstream_protocol_error)
    }

    pub async fn server_metadata(&self, deadline: Option<Duration>) -> Result<ServerMetadata> {
        let answer = self
            .send(Method::GET, "/v2", &HeaderMap::new(), Vec::new(), deadline)
            .await?;
        self.check(&answer)?;
        rest::decode_server_metadata(&answer.body).map_err(Error::into_upstream_protocol_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_encode_their_segments() {
        assert_eq!(model_path("add_sub", None, "/infer"), "/v2/models/add_sub/infer");
        assert_eq!(
            model_path("a b%", Some("1"), "/ready"),
            "/v2/models/a%20b%25/versions/1/ready"
        );
        assert_eq!(model_path("m", Some(""), ""), "/v2/models/m");
    }
}
