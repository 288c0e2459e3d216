//! gRPC calls to a backend, framed by hand over HTTP/2 so a message given as chunks (tensor buffers among them) is
//! written without being copied into one buffer, and the answer's message is a slice of what arrived.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, TE, USER_AGENT};
use http::{HeaderMap, HeaderValue, Method, Request};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tonic::Code;

use super::Replied;
use crate::body::ChunksBody;
use crate::codec::compression::{self, Coding};
use crate::config::Endpoint;
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::headers;

mod stream;

pub use stream::{StreamRequests, UpstreamStream};

/// The gRPC message-frame header: a compression flag and a big-endian length.
const FRAME_HEADER: usize = 5;

/// How close to its deadline a call must be for a CANCELLED answer to be taken as the deadline expiring.
const DEADLINE_SLACK: Duration = Duration::from_millis(20);

/// HTTP/2 windows large enough that a multi-megabyte tensor is not throttled by flow control.
const STREAM_WINDOW: u32 = 8 << 20;
const CONNECTION_WINDOW: u32 = 32 << 20;

/// One backend endpoint spoken to over gRPC. Cheap to clone; connections are pooled and shared.
#[derive(Debug, Clone)]
pub struct GrpcUpstream {
    clients: super::ThreadClients,
    authority: std::sync::Arc<str>,
    /// `http`, or `https` for TLS.
    scheme: &'static str,
    max_response_bytes: usize,
}

impl GrpcUpstream {
    pub fn new(
        endpoint: &Endpoint,
        connect_timeout: Duration,
        max_response_bytes: usize,
        tls: Option<&super::EndpointTls>,
    ) -> GrpcUpstream {
        let (connector, scheme) = super::connector(connect_timeout, tls, true);
        let build = |connector| {
            Client::builder(TokioExecutor::new())
                .http2_only(true)
                .http2_initial_stream_window_size(STREAM_WINDOW)
                .http2_initial_connection_window_size(CONNECTION_WINDOW)
                .pool_idle_timeout(Duration::from_secs(90))
                .build(connector)
        };
        GrpcUpstream {
            clients: super::ThreadClients::new(connector, build),
            authority: endpoint.to_string().into(),
            scheme,
            max_response_bytes,
        }
    }

    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// Calls `method` (a full path such as `/inference.GRPCInferenceService/ModelInfer`) with one request message
    /// given as chunks, and gives the response message. `deadline` bounds the whole call and is passed on as
    /// `grpc-timeout`; `metadata` is added to the request headers. With a `coding` the message is sent compressed
    /// and compressed answers are asked for too. The answer comes with the backend's end-to-end metadata, from its
    /// headers and trailers; a compressed answer is decompressed (within the answer size limit) whether or not it
    /// was asked for.
    pub async fn unary(
        &self,
        method: &str,
        message: Vec<Bytes>,
        deadline: Option<Duration>,
        metadata: &HeaderMap,
        coding: Option<Coding>,
    ) -> Result<Replied<Bytes>> {
        let started = std::time::Instant::now();
        let answer = super::within(
            deadline,
            &self.authority,
            self.call(method, message, deadline, metadata, coding),
        )
        .await;
        match (answer, deadline) {
            // Some servers (tonic's among them) answer CANCELLED when the deadline passed on to them expires, and
            // theirs can fire before ours: what the client is owed is DEADLINE_EXCEEDED.
            (Err(error), Some(deadline))
                if error.grpc_code() == Code::Cancelled && started.elapsed() + DEADLINE_SLACK >= deadline =>
            {
                Err(Error::new(
                    ErrorKind::Timeout,
                    Origin::Upstream,
                    format!(
                        "backend {} did not answer within {} ms",
                        self.authority,
                        deadline.as_millis()
                    ),
                ))
            }
            (answer, _) => answer,
        }
    }

    async fn call(
        &self,
        method: &str,
        message: Vec<Bytes>,
        deadline: Option<Duration>,
        metadata: &HeaderMap,
        coding: Option<Coding>,
    ) -> Result<Replied<Bytes>> {
        let chunks = frame(message, coding)?;
        let request = self.request(method, ChunksBody::new(chunks).into(), deadline, metadata, coding)?;
        let response = self
            .clients
            .get()
            .request(request)
            .await
            .map_err(|e| super::unreachable(&self.authority, e))?;
        self.check_status(&response)?;
        let (parts, body) = response.into_parts();
        let answer_coding = parts
            .headers
            .get("grpc-encoding")
            .map(|value| value.as_bytes().to_vec());
        let mut answer_metadata = headers::end_to_end(&parts.headers);
        let (body, trailers) = super::read_answer(
            body,
            self.max_response_bytes,
            FRAME_HEADER,
            super::Sized::GrpcFrame,
            &self.authority,
        )
        .await?;
        let trailers = trailers.unwrap_or_default();
        if let Some(error) = status_error(&trailers) {
            return Err(error);
        }
        if trailers.get("grpc-status").is_none() {
            return Err(Error::new(
                ErrorKind::BadGateway,
                Origin::Upstream,
                format!("backend {} ended its answer without a grpc-status", self.authority),
            ));
        }
        for (name, value) in &headers::end_to_end(&trailers) {
            answer_metadata.append(name, value.clone());
        }
        let message = single_message(body, answer_coding.as_deref(), self.max_response_bytes)
            .map_err(|e| e.into_upstream_protocol_error())?;
        Ok(Replied {
            value: message,
            headers: answer_metadata,

            endpoint: Some(self.authority.clone()),
        })
    }
}

/// One gRPC message on the wire: compressed with `coding` when given, behind its length prefix.
fn frame(message: Vec<Bytes>, coding: Option<Coding>) -> Result<Vec<Bytes>> {
    let message = match coding {
        Some(coding) => compression::compress(coding, &message),
        None => message,
    };
    crate::body::grpc_message(message, coding.is_some()).map_err(|length| {
        Error::invalid(format!(
            "a gRPC message of {length} bytes exceeds the 4 GiB frame limit"
        ))
    })
}

impl GrpcUpstream {
    /// A call's request: `body` with the gRPC headers, the deadline as `grpc-timeout` and `metadata`.
    fn request<B>(
        &self,
        method: &str,
        body: B,
        deadline: Option<Duration>,
        metadata: &HeaderMap,
        coding: Option<Coding>,
    ) -> Result<Request<B>> {
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(format!("{}://{}{method}", self.scheme, self.authority))
            .body(body)
            .map_err(|e| Error::internal(format!("cannot build a gRPC request for {method}: {e}")))?;
        let headers = request.headers_mut();
        for (name, value) in metadata {
            headers.append(name, value.clone());
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(TE, HeaderValue::from_static("trailers"));
        headers.insert(
            USER_AGENT,
            HeaderValue::from_static(concat!("oipgate/", env!("CARGO_PKG_VERSION"))),
        );
        if let Some(coding) = coding {
            headers.insert("grpc-encoding", HeaderValue::from_static(coding.name()));
            headers.insert("grpc-accept-encoding", HeaderValue::from_static(compression::ACCEPTED));
        }
        if let Some(deadline) = deadline {
            // grpc-timeout allows at most eight digits.
            let millis = deadline.as_millis().clamp(1, 99_999_999);
            let value = format!("{millis}m");
            headers.insert(
                "grpc-timeout",
                HeaderValue::from_str(&value).unwrap_or(HeaderValue::from_static("1m")),
            );
        }
        Ok(request)
    }

    /// Refuses an answer that is not a gRPC one, or that is a trailers-only error.
    fn check_status<B>(&self, response: &http::Response<B>) -> Result<()> {
        if response.status() != http::StatusCode::OK {
            return Err(Error::new(
                ErrorKind::BadGateway,
                Origin::Upstream,
                format!(
                    "backend {} answered HTTP {} to a gRPC call",
                    self.authority,
                    response.status()
                ),
            ));
        }
        match status_error(response.headers()) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

/// The error a `grpc-status` other than OK stands for, with its `grpc-message`.
fn status_error(headers: &HeaderMap) -> Option<Error> {
    let status = headers.get("grpc-status")?.to_str().ok()?.trim().parse::<i32>().ok()?;
    if status == 0 {
        return None;
    }
    let message = headers
        .get("grpc-message")
        .map(|m| percent_decode(m.as_bytes()))
        .unwrap_or_default();
    Some(Error::from_upstream_grpc(Code::from_i32(status), message))
}

/// gRPC percent-encodes `grpc-message`.
fn percent_decode(text: &[u8]) -> String {
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            text[i],
            text.get(i + 1).and_then(|&b| hex(b)),
            text.get(i + 2).and_then(|&b| hex(b)),
        ) {
            (b'%', Some(high), Some(low)) => {
                out.push(u8::try_from(high * 16 + low).unwrap_or(b'?'));
                i += 3;
            }
            (byte, _, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The one message of a unary answer, as a slice of the body; a compressed one decompressed per the answer's
/// `grpc-encoding`, within `limit`.
fn single_message(mut body: Bytes, coding: Option<&[u8]>, limit: usize) -> Result<Bytes> {
    if body.len() < FRAME_HEADER {
        return Err(Error::invalid(format!(
            "answer of {} bytes holds no gRPC message",
            body.len()
        )));
    }
    let compressed = body[0] != 0;
    let length = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if body.len() - FRAME_HEADER != length {
        return Err(Error::invalid(format!(
            "answer frames a {length}-byte message but carries {} bytes",
            body.len() - FRAME_HEADER
        )));
    }
    let message = body.split_off(FRAME_HEADER);
    if !compressed {
        return Ok(message);
    }
    let coding = match coding {
        Some(b"gzip") => Coding::Gzip,
        Some(b"deflate") => Coding::Deflate,
        other => {
            return Err(Error::invalid(format!(
                "answer is compressed with {}, which is not gzip or deflate",
                other.map_or("no grpc-encoding".into(), String::from_utf8_lossy)
            )));
        }
    };
    compression::decompress(coding, &message, limit as u64, "answer message")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_statuses() {
        let message = |body: &'static [u8], coding: Option<&[u8]>| single_message(Bytes::from_static(body), coding, 64);
        assert_eq!(message(b"\0\0\0\0\x02ab", None).unwrap(), Bytes::from_static(b"ab"));
        assert!(message(b"\0\0\0\0\x03ab", None).is_err());
        assert!(message(b"\0\0", None).is_err());
        let framed = |message: &[u8]| -> &'static [u8] {
            let chunks = compression::compress(Coding::Gzip, &[Bytes::copy_from_slice(message)]);
            crate::body::grpc_message(chunks, true).unwrap().concat().leak()
        };
        let ab = framed(b"ab");
        assert_eq!(message(ab, Some(b"gzip")).unwrap(), Bytes::from_static(b"ab"));
        assert!(message(ab, None).unwrap_err().message().contains("no grpc-encoding"));
        assert!(message(ab, Some(b"snappy")).unwrap_err().message().contains("snappy"));
        assert!(message(ab, Some(b"deflate")).is_err(), "gzip bytes are not zlib");
        let expanding = framed(&[0u8; 1000]);
        assert_eq!(
            message(expanding, Some(b"gzip")).unwrap_err().http_status(),
            413,
            "past the limit"
        );
        assert_eq!(percent_decode(b"model %27x%27 not found%"), "model 'x' not found%");
        let mut headers = HeaderMap::new();
        headers.insert("grpc-status", HeaderValue::from_static("5"));
        headers.insert("grpc-message", HeaderValue::from_static("unknown%20model"));
        let error = status_error(&headers).unwrap();
        assert_eq!((error.grpc_code(), error.message()), (Code::NotFound, "unknown model"));
        headers.insert("grpc-status", HeaderValue::from_static("0"));
        assert!(status_error(&headers).is_none());
    }
}
