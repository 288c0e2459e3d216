//! gRPC calls to a backend, framed by hand over HTTP/2 so a message given as chunks (tensor buffers among them) is
//! written without being copied into one buffer, and the answer's message is a slice of what arrived.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, TE, USER_AGENT};
use http::{HeaderMap, HeaderValue, Method, Request};
use hyper_util::rt::TokioIo;
use tonic::Code;

use super::{BackendAnswer, Channel};
use crate::codec::compression::{self, Coding};
use crate::config::Endpoint;
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::headers;
use crate::headers::{GATEWAY_AGENT, GRPC_ACCEPT_ENCODING, GRPC_ENCODING, GRPC_MESSAGE, GRPC_STATUS, GRPC_TIMEOUT};
use crate::runtime::ThreadShared;

mod stream;

use stream::ReceivedBody;
pub use stream::{StreamRequests, UpstreamStream};

/// The gRPC message-frame header: a compression flag and a big-endian length.
const FRAME_HEADER: usize = 5;

/// How close to its deadline a call must be for a CANCELLED answer to be taken as the deadline expiring.
const DEADLINE_SLACK: Duration = Duration::from_millis(20);

/// Unary calls' HTTP/2 windows: large enough that a multi-megabyte tensor is not throttled by flow control (an
/// answer is read whole as it arrives, so nothing waits unread in them).
const UNARY_STREAM_WINDOW: u32 = 8 << 20;
const UNARY_CONNECTION_WINDOW: u32 = 32 << 20;
/// Streams' windows: what one backend stream may hold unread (a stream mostly carries small messages, and a client
/// that stops reading leaves its stream window full in the gateway), and what all of a connection's may.
const STREAMS_STREAM_WINDOW: u32 = 2 << 20;
const STREAMS_CONNECTION_WINDOW: u32 = 16 << 20;
/// h2 charges each DATA frame it buffers that is smaller than this as if it were this big.
const SMALL_FRAME: usize = 256;

/// One backend endpoint spoken to over gRPC, on HTTP/2 connections made with h2 itself, one per thread for unary
/// calls and one for streams. Cheap to clone; clones share the connections.
#[derive(Debug, Clone)]
pub struct GrpcUpstream {
    clients: super::ThreadClients,
    authority: std::sync::Arc<ThreadShared<str>>,
    /// The endpoint's address and scheme (`http`, or `https` for TLS) as the URIs of its calls hold them; no
    /// authority when the address makes none.
    uri_authority: Option<http::uri::Authority>,
    scheme: http::uri::Scheme,
    max_response_bytes: usize,
    /// The backend's configured metadata, added to every call.
    added: std::sync::Arc<HeaderMap>,
}

impl GrpcUpstream {
    pub fn new(
        endpoint: &Endpoint,
        connect_timeout: Duration,
        max_response_bytes: usize,
        tls: Option<&super::EndpointTls>,
    ) -> GrpcUpstream {
        let (connector, scheme) = super::connector(connect_timeout, tls, true);
        GrpcUpstream {
            clients: super::ThreadClients::new(connector),
            authority: std::sync::Arc::new(endpoint.to_string().as_str().into()),
            uri_authority: endpoint.to_string().parse().ok(),
            scheme: if scheme == "https" {
                http::uri::Scheme::HTTPS
            } else {
                http::uri::Scheme::HTTP
            },
            max_response_bytes,
            added: std::sync::Arc::default(),
        }
    }

    /// The same endpoint (its connections shared) adding `metadata` to every call.
    #[must_use]
    pub fn adding(mut self, metadata: &std::sync::Arc<HeaderMap>) -> GrpcUpstream {
        self.added = metadata.clone();
        self
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
        method: &'static str,
        message: Vec<Bytes>,
        deadline: Option<Duration>,
        metadata: &HeaderMap,
        coding: Option<Coding>,
    ) -> Result<BackendAnswer<Bytes>> {
        let started = std::time::Instant::now();
        let answer = super::within(
            deadline.map(super::Deadline::after),
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
        method: &'static str,
        message: Vec<Bytes>,
        deadline: Option<Duration>,
        metadata: &HeaderMap,
        coding: Option<Coding>,
    ) -> Result<BackendAnswer<Bytes>> {
        let chunks = frame(message, coding)?;
        let request = || self.request(method, (), deadline, metadata, coding);
        let response = match self.send(Channel::Unary, request()?, &chunks).await {
            Ok(response) => response,
            // A kept connection that could not take the call (it had closed, or the backend refused the stream
            // unprocessed): sent once more on a new connection, as a pooling client would. A connection that
            // closes under a call before any answer is taken as one that had closed, as the REST client does (see
            // `upstream::send_request`).
            Err(Unanswered { again: true, .. }) => {
                self.clients.set_connection(Channel::Unary, None);
                self.send(Channel::Unary, request()?, &chunks)
                    .await
                    .map_err(|unanswered| unanswered.error)?
            }
            Err(unanswered) => return Err(unanswered.error),
        };
        self.check_status(&response)?;
        let (parts, body) = response.into_parts();
        let mut answer_metadata = headers::end_to_end(&parts.headers);
        let (body, trailers) = super::read_answer(
            ReceivedBody::new(body),
            self.max_response_bytes,
            FRAME_HEADER,
            crate::body::BodyLength::GrpcFrame,
            &self.authority,
        )
        .await?;
        let trailers = trailers.unwrap_or_default();
        if let Some(error) = status_error(&trailers) {
            return Err(error);
        }
        if trailers.get(GRPC_STATUS).is_none() {
            return Err(Error::new(
                ErrorKind::BadGateway,
                Origin::Upstream,
                format!("backend {} ended its answer without a grpc-status", self.authority),
            ));
        }
        for (name, value) in &headers::end_to_end(&trailers) {
            answer_metadata.append(name, value.clone());
        }
        let answer_coding = parts.headers.get(GRPC_ENCODING).map(HeaderValue::as_bytes);
        let message = single_message(body, answer_coding, self.max_response_bytes)
            .map_err(|e| e.into_upstream_protocol_error())?;
        Ok(BackendAnswer {
            value: message,
            headers: answer_metadata,

            endpoint: Some(self.authority.handle()),
        })
    }

    /// Sends a unary call's whole request on this thread's connection for `channel` and waits for the answer's
    /// head. The message is handed to h2 at once, which sends it as the backend's window allows: it is in memory
    /// already, and dropping the call resets the stream and frees it.
    async fn send(
        &self,
        channel: Channel,
        request: Request<()>,
        chunks: &[Bytes],
    ) -> std::result::Result<http::Response<h2::RecvStream>, Unanswered> {
        let (mut connection, kept) = self
            .connection(channel)
            .await
            .map_err(|error| Unanswered { error, again: false })?;
        let failed = |error: Error, unanswered: bool| Unanswered {
            error,
            again: kept && unanswered,
        };
        let (response, mut sending) = connection
            .send_request(request, false)
            .map_err(|e| failed(self.connection_failure(e, true), true))?;
        hand_over(&mut sending, chunks.iter().cloned(), true)
            .map_err(|e| failed(self.connection_failure(e, false), true))?;
        response.await.map_err(|e| {
            let refused = e.reason() == Some(h2::Reason::REFUSED_STREAM);
            let closed = e.get_io().is_some_and(|io| crate::error::is_closed_connection(io));
            failed(self.connection_failure(e, refused), refused || closed)
        })
    }

    /// This thread's connection to the endpoint for `channel`, ready for a new stream, and whether it was kept
    /// from earlier calls; made anew when there is none or the last one failed.
    async fn connection(&self, channel: Channel) -> Result<(h2::client::SendRequest<Bytes>, bool)> {
        if let Some(connection) = self.clients.connection(channel)
            && let Ok(ready) = connection.ready().await
        {
            return Ok((ready, true));
        }
        // Boxed: connecting is rare, and its state (resolving, connecting, TLS, the handshake) would otherwise be
        // part of every call's.
        Box::pin(self.connect(channel))
            .await
            .map(|connection| (connection, false))
    }

    /// Makes this thread's connection to the endpoint for `channel`.
    async fn connect(&self, channel: Channel) -> Result<h2::client::SendRequest<Bytes>> {
        let uri = self.uri("/")?;
        let mut connector = self.clients.connector.clone();
        let io = tower_service::Service::call(&mut connector, uri)
            .await
            .map_err(|e| self.connection_failure(super::ConnectFailure(e), true))?;
        let (stream_window, connection_window) = match channel {
            Channel::Unary => (UNARY_STREAM_WINDOW, UNARY_CONNECTION_WINDOW),
            Channel::Streams => (STREAMS_STREAM_WINDOW, STREAMS_CONNECTION_WINDOW),
        };
        let (connection, driver) = h2::client::Builder::new()
            .initial_window_size(stream_window)
            .initial_connection_window_size(connection_window)
            // h2 closes a connection whose buffered small frames cost more than its budget (by default half the
            // connection window, which ~50-byte messages unread by one client exceed). This budget lets the whole
            // connection window be held as the smallest gRPC messages (an empty one behind its 5-byte header):
            // only a backend that splits messages into smaller frames can spend it.
            .data_frame_budget(connection_window as usize / FRAME_HEADER * SMALL_FRAME)
            .handshake::<_, Bytes>(TokioIo::new(io))
            .await
            .map_err(|e| self.connection_failure(e, true))?;
        tokio::spawn(async move {
            if let Err(error) = driver.await {
                tracing::debug!(%error, "backend connection ended");
            }
        });
        self.clients.set_connection(channel, Some(connection.clone()));
        connection.ready().await.map_err(|e| self.connection_failure(e, true))
    }

    /// A call or stream that failed on its connection; `unsent` when nothing of it reached the backend.
    fn connection_failure(&self, error: impl std::error::Error + Send + Sync + 'static, unsent: bool) -> Error {
        let failure = Error::new(
            ErrorKind::BadGateway,
            Origin::Upstream,
            format!("backend {} unreachable: {error}", self.authority),
        )
        .caused_by(error);
        if unsent {
            failure.unsent()
        } else {
            failure.with_retryable(false)
        }
    }
}

/// Hands `chunks` to h2 at once, without waiting for the backend's window: they are in memory already, and h2 sends
/// them as the window allows (a stream not yet open included). With `end`, the last one ends the request.
fn hand_over(
    sending: &mut h2::SendStream<Bytes>,
    chunks: impl IntoIterator<Item = Bytes>,
    end: bool,
) -> std::result::Result<(), h2::Error> {
    let mut chunks = chunks.into_iter().filter(|chunk| !chunk.is_empty()).peekable();
    let mut ended = false;
    while let Some(chunk) = chunks.next() {
        ended = end && chunks.peek().is_none();
        sending.send_data(chunk, ended)?;
    }
    if end && !ended {
        sending.send_data(Bytes::new(), true)?;
    }
    Ok(())
}

/// A unary call that got no answer, and whether it may be sent again on a new connection.
struct Unanswered {
    error: Error,
    again: bool,
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
        method: &'static str,
        body: B,
        deadline: Option<Duration>,
        metadata: &HeaderMap,
        coding: Option<Coding>,
    ) -> Result<Request<B>> {
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(self.uri(method)?)
            .body(body)
            .map_err(|e| Error::internal(format!("cannot build a gRPC request for {method}: {e}")))?;
        let headers = request.headers_mut();
        // The operator's metadata takes the place of a client's of the same name.
        for (name, value) in metadata.iter().filter(|(name, _)| !self.added.contains_key(*name)) {
            headers.append(name, value.clone());
        }
        for (name, value) in self.added.iter() {
            headers.append(name, value.clone());
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(TE, HeaderValue::from_static("trailers"));
        // The client's user agent passes on; a call the gateway makes for itself names the gateway.
        headers.entry(USER_AGENT).or_insert(GATEWAY_AGENT);
        if let Some(coding) = coding {
            headers.insert(GRPC_ENCODING, HeaderValue::from_static(coding.name()));
            headers.insert(GRPC_ACCEPT_ENCODING, HeaderValue::from_static(compression::ACCEPTED));
        }
        if let Some(deadline) = deadline {
            // grpc-timeout allows at most eight digits.
            let millis = deadline.as_millis().clamp(1, 99_999_999);
            let mut value = HeaderValue::from_str(&format!("{millis}m")).unwrap_or(HeaderValue::from_static("1m"));
            // Nearly every call's timeout differs: never indexed by HPACK (see `headers::new_request_id`).
            value.set_sensitive(true);
            headers.insert(GRPC_TIMEOUT, value);
        }
        Ok(request)
    }

    /// The URI of `path` at the endpoint.
    fn uri(&self, path: &'static str) -> Result<http::Uri> {
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(self.scheme.clone());
        uri.authority =
            Some(self.uri_authority.clone().ok_or_else(|| {
                Error::internal(format!("backend address {} is not a URI authority", self.authority))
            })?);
        uri.path_and_query = Some(http::uri::PathAndQuery::from_static(path));
        http::Uri::from_parts(uri).map_err(|e| Error::internal(format!("backend address {}: {e}", self.authority)))
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
    let status = headers.get(GRPC_STATUS)?.to_str().ok()?.trim().parse::<i32>().ok()?;
    if status == 0 {
        return None;
    }
    let message = headers
        .get(GRPC_MESSAGE)
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

    /// A call carries its client's `user-agent`, or the backend's configured one in its place; one the gateway makes
    /// with neither names the gateway.
    #[test]
    fn a_call_names_its_client_or_the_gateway() {
        let endpoint = Endpoint::parse("127.0.0.1:1").unwrap();
        let plain = GrpcUpstream::new(&endpoint, Duration::from_secs(1), 1 << 20, None);
        let mut configured = HeaderMap::new();
        configured.insert(USER_AGENT, HeaderValue::from_static("operator/1"));
        let operated = GrpcUpstream::new(&endpoint, Duration::from_secs(1), 1 << 20, None)
            .adding(&std::sync::Arc::new(configured));
        let mut client = HeaderMap::new();
        client.insert(USER_AGENT, HeaderValue::from_static("grpc-python/1.66"));
        let agents = |upstream: &GrpcUpstream, metadata: &HeaderMap| -> Vec<String> {
            let request = upstream.request("/p", (), None, metadata, None).unwrap();
            let agents = request.headers().get_all(USER_AGENT).iter();
            agents.map(|value| value.to_str().unwrap().to_owned()).collect()
        };
        assert_eq!(agents(&plain, &client), ["grpc-python/1.66"]);
        assert_eq!(
            agents(&plain, &HeaderMap::new()),
            [concat!("oipgate/", env!("CARGO_PKG_VERSION"))]
        );
        assert_eq!(agents(&operated, &client), ["operator/1"]);
    }
}
