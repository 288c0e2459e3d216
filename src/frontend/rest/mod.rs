//! The REST front door on pingora (HTTP/1.1 and h2c on one port): health and metadata answered by the gateway,
//! inference proxied untouched to REST backends that need no translation, and decoded, dispatched and re-encoded for
//! everything else (gRPC backends, aliased names, Decthings bodies).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use http::{HeaderValue, StatusCode};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::HttpPeer;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::{ErrorType, OkOrErr, OrErr};

mod answer;
mod listener;
mod whole;

pub use listener::RestListener;
use whole::{AS_SENT, WHOLE_BODY_LIMIT, missing_content_type};

use answer::{
    Rename, client_gone, discard_body, health_status, pingora_failure, respond_encoded, respond_error, respond_json,
    write,
};

use super::REQUEST_ID;
use super::paths::{Route, route};
use crate::codec::decthings;
use crate::codec::rest::{self, BinaryOutputs, RestRequest};
use crate::config::BackendProtocol;
use crate::dispatch::{CallContext, Dispatcher, MirrorPayload, Passthrough};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::fleet::Lease;
use crate::headers;
use crate::live::{Active, Gateway};
use crate::metrics::{ClientProtocol, Direction, Finished, InFlight, RouteMetrics};
use crate::protocol::{InferRequest, ModelReady, ServerLive, ServerReady};

/// Content type of Decthings request and response bodies.
pub const DECTHINGS_CONTENT_TYPE: &str = "application/x-decthings-tensors";
/// How long a refused body is read and dropped so the client can read the refusal.
const LINGER: Duration = Duration::from_secs(5);
/// How long connecting to a backend may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The REST front door's logic.
#[derive(Debug)]
pub struct RestFrontDoor {
    gateway: Arc<Gateway>,
    max_request_bytes: u64,
}

/// Per-request state.
#[derive(Debug)]
pub struct RestContext {
    /// The configuration the request is served by, from its start to its end.
    dispatcher: Arc<Dispatcher>,
    /// Counts the request as under way, for shutdown's drain.
    _active: Active,
    started: Instant,
    /// Whether the request was translated (not proxied as it was).
    translated: bool,
    /// The request counters of the model and version an inference named.
    route_metrics: Option<Arc<RouteMetrics>>,
    /// A proxied call to a backend, counted in flight until the request ends.
    in_flight: Option<InFlight>,
    /// The endpoint a proxied request holds a place at, and the endpoints it could not connect to.
    lease: Option<Lease>,
    tried: Vec<usize>,
    passthrough: Option<Passthrough>,
    request_id: Option<HeaderValue>,
    received: u64,
    rename: Option<Rename>,
    /// The backend's end-to-end headers, added to a translated answer.
    reply_headers: http::HeaderMap,
    /// A proxied request's body, gathered (as shared chunks, not copied) for its mirror.
    mirror: Option<MirrorCopy>,
    /// The backend endpoint that answered.
    endpoint: Option<Arc<str>>,
}

#[derive(Debug)]
struct MirrorCopy {
    route: Arc<crate::routing::VersionRoute>,
    body: Vec<Bytes>,
    header_length: Option<u64>,
    content_type: Option<HeaderValue>,
    forward: http::HeaderMap,
}

impl RestFrontDoor {
    pub fn new(gateway: Arc<Gateway>, max_request_bytes: u64) -> Self {
        RestFrontDoor {
            gateway,
            max_request_bytes,
        }
    }

    fn too_large(&self) -> Error {
        Error::new(
            ErrorKind::PayloadTooLarge,
            Origin::Client,
            format!(
                "request body is larger than the limit of {} bytes",
                self.max_request_bytes
            ),
        )
    }

    /// Answers the request unless it is to be proxied; `Ok(true)` when an answer was written.
    async fn handle(&self, session: &mut Session, context: &mut RestContext) -> Result<bool> {
        let header = session.req_header();
        let path = header.uri.path().to_owned();
        let method = header.method.clone();
        let route = route(&path).ok_or_else(|| Error::not_found(format!("no endpoint at {path}")))?;
        if method != route.method() {
            return Err(Error::new(
                ErrorKind::MethodNotAllowed,
                Origin::Client,
                format!("{path} answers {} only, not {method}", route.method()),
            ));
        }
        let dispatcher = context.dispatcher.clone();
        match route {
            Route::ServerMetadata => {
                respond_json(
                    session,
                    context,
                    StatusCode::OK,
                    rest::encode_server_metadata(dispatcher.server_metadata()),
                )
                .await?
            }
            Route::Live => {
                respond_json(
                    session,
                    context,
                    StatusCode::OK,
                    rest::encode_server_live(ServerLive { live: true }),
                )
                .await?
            }
            Route::Ready => {
                let ready = !self.gateway.is_draining() && dispatcher.server_ready().await;
                respond_json(
                    session,
                    context,
                    health_status(ready),
                    rest::encode_server_ready(ServerReady { ready }),
                )
                .await?
            }
            Route::ModelMetadata(model, version) => {
                let metadata = dispatcher.model_metadata(model, version).await?;
                respond_json(session, context, StatusCode::OK, rest::encode_model_metadata(&metadata)).await?
            }
            Route::ModelReady(model, version) => {
                let ready = dispatcher.model_ready(model, version).await?;
                let body = rest::encode_model_ready(&ModelReady {
                    name: model.to_owned(),
                    ready,
                });
                respond_json(session, context, health_status(ready), body).await?
            }
            Route::RepositoryIndex => {
                let body = self.read_body(session).await?;
                let ready_only = rest::decode_repository_index_request(&body)?;
                let entries = dispatcher.repository_index(ready_only).await;
                respond_json(
                    session,
                    context,
                    StatusCode::OK,
                    rest::encode_repository_index(&entries),
                )
                .await?
            }
            Route::RepositoryLoad(_) | Route::RepositoryUnload(_) => {
                return Err(Error::new(
                    ErrorKind::Unimplemented,
                    Origin::Gateway,
                    "the gateway does not load or unload models; ask the backends' own repository endpoints",
                ));
            }
            Route::Infer(model, version) => {
                return self
                    .infer(session, context, model.to_owned(), version.map(str::to_owned))
                    .await;
            }
        }
        Ok(true)
    }

    async fn infer(
        &self,
        session: &mut Session,
        context: &mut RestContext,
        model: String,
        version: Option<String>,
    ) -> Result<bool> {
        let header = session.req_header();
        let declared = header
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|length| length > self.max_request_bytes) {
            return Err(self.too_large());
        }
        let header_length = rest::inference_header_length(&header.headers)?;
        let content_type = header
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let decthings_in = content_type.starts_with(DECTHINGS_CONTENT_TYPE);
        let decthings_out = header
            .headers
            .get(http::header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|accept| accept.contains(DECTHINGS_CONTENT_TYPE));
        let deadline = header
            .headers
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(super::grpc::parse_grpc_timeout);
        let forward = headers::for_backend(&header.headers);
        context.request_id = forward.get(REQUEST_ID).cloned();
        let dispatcher = context.dispatcher.clone();
        let (routed, route_metrics) = dispatcher.route(&model, version.as_deref(), &forward);
        context.route_metrics = Some(route_metrics);
        let routed = routed?;

        if !decthings_in
            && !decthings_out
            && let Some(target) = dispatcher.rest_passthrough(&routed, header_length.is_some())?
        {
            context.in_flight = Some(target.backend_metrics.call());
            if declared.is_some_and(|length| length <= WHOLE_BODY_LIMIT) {
                let mut send = forward.clone();
                for name in AS_SENT {
                    if let Some(value) = header.headers.get(&name) {
                        send.insert(name, value.clone());
                    }
                }
                if let Some(content_type) = missing_content_type(&send) {
                    send.insert(http::header::CONTENT_TYPE, content_type);
                }
                let body = self.read_body(session).await?;
                if let Some(route) = routed.mirror {
                    context.dispatcher.mirror(
                        &route,
                        MirrorPayload::Rest {
                            body: vec![body.clone()],
                            header_length,
                            content_type: send.get(http::header::CONTENT_TYPE).cloned(),
                        },
                        &forward,
                    );
                }
                self.forward_whole(session, context, target, &send, body).await?;
                return Ok(true);
            }
            context.passthrough = Some(target);
            if let Some(route) = routed.mirror {
                context.mirror = Some(MirrorCopy {
                    route,
                    body: Vec::new(),
                    header_length,
                    content_type: header.headers.get(http::header::CONTENT_TYPE).cloned(),
                    forward,
                });
            }
            return Ok(false);
        }

        context.translated = true;
        // Only a crossing to a gRPC backend is a translation between the protocols; the rest is re-encoding.
        let crossing = dispatcher.backend_protocol(&routed.route) == Some(BackendProtocol::Grpc);
        let body = self.read_body(session).await?;
        let call = CallContext { deadline, forward };
        let decoding = Instant::now();
        let (request, binary_outputs) = if decthings_in {
            let inputs = decthings::decode_entries(&body)?;
            (
                InferRequest {
                    inputs,
                    ..InferRequest::default()
                },
                BinaryOutputs::default(),
            )
        } else {
            match rest::decode_request(body, header_length)? {
                RestRequest::Request {
                    request,
                    binary_outputs,
                } => (request, binary_outputs),
                RestRequest::RawBinary(body) => {
                    let metadata = dispatcher.model_metadata(&model, version.as_deref()).await?;
                    let [input] = metadata.inputs.as_slice() else {
                        return Err(Error::invalid(format!(
                            "a raw binary request (Inference-Header-Content-Length: 0) needs a model with exactly one input; \
                             '{model}' has {}",
                            metadata.inputs.len()
                        )));
                    };
                    rest::raw_binary_request(body, input)?
                }
            }
        };
        if crossing {
            dispatcher
                .metrics()
                .translated(Direction::RestToGrpc, decoding.elapsed());
        }
        // A client that goes away cancels the backend call: dropping it resets the backend's stream or connection.
        let call = dispatcher.infer_routed(&routed, request, &call);
        let replied = tokio::select! {
            replied = call => replied?,
            () = client_gone(session) => {
                return Err(Error::new(
                    ErrorKind::Cancelled,
                    Origin::Client,
                    "the client closed the connection before the answer",
                ));
            }
        };
        context.reply_headers = replied.headers;
        context.endpoint = replied.endpoint;
        let response = replied.value;
        let encoding = Instant::now();
        if decthings_out {
            let mut answer = ResponseHeader::build(StatusCode::OK, Some(6)).map_err(pingora_failure)?;
            answer
                .insert_header(http::header::CONTENT_TYPE, DECTHINGS_CONTENT_TYPE)
                .map_err(pingora_failure)?;
            answer
                .insert_header("model-name", response.model_name.as_str())
                .map_err(pingora_failure)?;
            if let Some(version) = &response.model_version {
                answer
                    .insert_header("model-version", version.as_str())
                    .map_err(pingora_failure)?;
            }
            if let Some(id) = &response.id {
                answer
                    .insert_header("inference-id", id.as_str())
                    .map_err(pingora_failure)?;
            }
            let body = decthings::encode_entries(&response.outputs)?;
            if crossing {
                dispatcher
                    .metrics()
                    .translated(Direction::GrpcToRest, encoding.elapsed());
            }
            write(session, context, answer, vec![body]).await?;
        } else {
            let encoded = rest::encode_response(&response, &binary_outputs)?;
            if crossing {
                dispatcher
                    .metrics()
                    .translated(Direction::GrpcToRest, encoding.elapsed());
            }
            respond_encoded(session, context, encoded).await?;
        }
        Ok(true)
    }

    /// Reads the whole body, refusing it as soon as it passes the limit.
    async fn read_body(&self, session: &mut Session) -> Result<Bytes> {
        let mut body = BytesMut::new();
        let mut first: Option<Bytes> = None;
        while let Some(chunk) = session
            .read_request_body()
            .await
            .map_err(|e| Error::invalid(format!("could not read the request body: {e}")))?
        {
            if (body.len() + first.as_ref().map_or(0, Bytes::len) + chunk.len()) as u64 > self.max_request_bytes {
                return Err(self.too_large());
            }
            // One chunk is kept as it is; only a body in several pieces is joined, into one buffer of the declared
            // length (no growth by doubling, which would copy a large tensor several times over).
            match first.take() {
                None if body.is_empty() => first = Some(chunk),
                Some(previous) => {
                    let declared = session
                        .req_header()
                        .headers
                        .get(http::header::CONTENT_LENGTH)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok())
                        .filter(|&length| length <= self.max_request_bytes)
                        .and_then(|length| usize::try_from(length).ok())
                        .unwrap_or(0);
                    body.reserve(declared.max(previous.len() + chunk.len()));
                    body.extend_from_slice(&previous);
                    body.extend_from_slice(&chunk);
                }
                None => body.extend_from_slice(&chunk),
            }
        }
        Ok(first.unwrap_or_else(|| body.freeze()))
    }
}

#[async_trait]
impl ProxyHttp for RestFrontDoor {
    type CTX = RestContext;

    fn new_ctx(&self) -> RestContext {
        RestContext {
            dispatcher: self.gateway.dispatcher(),
            _active: self.gateway.begin(),
            translated: false,
            endpoint: None,
            started: Instant::now(),
            route_metrics: None,
            in_flight: None,
            lease: None,
            tried: Vec::new(),
            passthrough: None,
            request_id: None,
            received: 0,
            rename: None,
            reply_headers: http::HeaderMap::new(),
            mirror: None,
        }
    }

    async fn request_filter(&self, session: &mut Session, context: &mut RestContext) -> pingora::Result<bool> {
        match self.handle(session, context).await {
            Ok(handled) => Ok(handled),
            Err(error) if session.response_written().is_some() => {
                // The answer's head is out: all the client can be told is that the connection ends here.
                tracing::warn!(error = %error.message(), "proxied answer broken off");
                session.set_keepalive(None);
                Ok(true)
            }
            Err(error) => {
                respond_error(session, context, &error).await;
                if error.kind() == ErrorKind::PayloadTooLarge {
                    discard_body(session).await;
                }
                Ok(true)
            }
        }
    }

    async fn upstream_peer(&self, _session: &mut Session, context: &mut RestContext) -> pingora::Result<Box<HttpPeer>> {
        let target = context
            .passthrough
            .as_ref()
            .or_err(ErrorType::InternalError, "no backend chosen")?;
        let lease = match context.dispatcher.lease_passthrough(target, &context.tried).await {
            Ok(lease) => lease,
            Err(error) => {
                return Err(pingora::Error::explain(
                    ErrorType::HTTPStatus(error.http_status().as_u16()),
                    error.message().to_owned(),
                ));
            }
        };
        let mut peer = match &target.tls {
            None => HttpPeer::new(lease.state.authority.as_str(), false, String::new()),
            Some(tls) => {
                let host = tls.server_name.clone().unwrap_or_else(|| {
                    lease
                        .state
                        .authority
                        .rsplit_once(':')
                        .map_or("", |(host, _)| host)
                        .trim_matches(['[', ']'])
                        .to_owned()
                });
                let mut peer = HttpPeer::new(lease.state.authority.as_str(), true, host);
                peer.options.ca.clone_from(&tls.ca);
                peer.client_cert_key.clone_from(&tls.client_cert);
                peer
            }
        };
        context.endpoint = Some(lease.state.authority.as_str().into());
        context.lease = Some(lease);
        peer.options.connection_timeout = Some(CONNECT_TIMEOUT);
        peer.options.read_timeout = Some(target.timeout);
        peer.options.write_timeout = Some(target.timeout);
        // Hop-by-hop headers, those `Connection` names, and upgrade handshakes stay on the client's hop.
        peer.options.http_upstream_request_policy =
            pingora::upstreams::peer::HttpUpstreamRequestPolicy::deny_upgrades();
        Ok(Box::new(peer))
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream_request: &mut RequestHeader,
        context: &mut RestContext,
    ) -> pingora::Result<()> {
        if let Some(target) = &context.passthrough {
            let uri: http::Uri = target.path.parse().or_err(ErrorType::InternalError, "backend path")?;
            upstream_request.set_uri(uri);
            if let Some(content_type) = missing_content_type(&upstream_request.headers) {
                upstream_request.insert_header(http::header::CONTENT_TYPE, content_type)?;
            }
        }
        if let Some(id) = &context.request_id {
            upstream_request.insert_header(REQUEST_ID, id.clone())?;
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        context: &mut RestContext,
    ) -> pingora::Result<()> {
        context.received += body.as_ref().map_or(0, |b| b.len() as u64);
        if context.received > self.max_request_bytes {
            return Err(pingora::Error::explain(
                ErrorType::HTTPStatus(413),
                "request body is larger than the limit",
            ));
        }
        if let Some(copy) = &mut context.mirror {
            copy.body.extend(body.iter().cloned());
        }
        if end_of_stream && let Some(copy) = context.mirror.take() {
            context.dispatcher.mirror(
                &copy.route,
                MirrorPayload::Rest {
                    body: copy.body,
                    header_length: copy.header_length,
                    content_type: copy.content_type,
                },
                &copy.forward,
            );
        }
        Ok(())
    }

    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        response: &mut ResponseHeader,
        context: &mut RestContext,
    ) -> pingora::Result<()> {
        if let (Some(lease), Some(target)) = (&context.lease, &context.passthrough) {
            context
                .dispatcher
                .passthrough_observed(target, lease, response.status.is_server_error());
        }
        if let Some((name, version)) = context.passthrough.as_ref().and_then(|p| p.rename.clone()) {
            context.rename = Rename::prepare(response, name, version)?;
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        context: &mut RestContext,
    ) -> pingora::Result<Option<Duration>> {
        if let Some(rename) = &mut context.rename {
            *body = rename.take(body.take(), end_of_stream).map_err(|e| {
                pingora::Error::explain(
                    ErrorType::HTTPStatus(502),
                    format!("cannot restore the public model name: {e}"),
                )
            })?;
        }
        Ok(None)
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        response: &mut ResponseHeader,
        context: &mut RestContext,
    ) -> pingora::Result<()> {
        if let Some(id) = &context.request_id {
            response.insert_header(REQUEST_ID, id.clone())?;
        }
        if let Some(target) = &context.passthrough {
            response.insert_header(headers::OIP_MODEL_VERSION, target.version.as_str())?;
        }
        Ok(())
    }

    async fn logging(&self, session: &mut Session, _error: Option<&pingora::Error>, context: &mut RestContext) {
        context.in_flight = None;
        context.lease = None;
        // No answer written means the client left first.
        let status = session
            .response_written()
            .map_or(crate::error::CLIENT_CLOSED_REQUEST, |answer| answer.status.as_u16());
        let request_id = context
            .request_id
            .as_ref()
            .or_else(|| session.req_header().headers.get(REQUEST_ID))
            .and_then(|id| id.to_str().ok());
        // Only inferences are counted by model (route_metrics); every request is timed and logged.
        context.dispatcher.metrics().finished(
            context.route_metrics.as_deref(),
            &Finished {
                protocol: ClientProtocol::Rest,
                status,
                duration: context.started.elapsed(),
                request_bytes: session.body_bytes_read() as u64,
                response_bytes: session.body_bytes_sent() as u64,
                target: session.req_header().uri.path(),
                request_id,
                endpoint: context.endpoint.as_deref(),
                translated: context.translated,
            },
        );
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        context: &mut RestContext,
        mut error: Box<pingora::Error>,
    ) -> Box<pingora::Error> {
        // Nothing reached this endpoint: count it against the endpoint and, within the budget, try another.
        if let (Some(lease), Some(target)) = (context.lease.take(), &context.passthrough) {
            context.dispatcher.passthrough_observed(target, &lease, true);
            context.tried.push(lease.index);
            if context.dispatcher.may_retry_passthrough(target, &context.tried) {
                error.set_retry(true);
            }
        }
        error
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        error: &pingora::Error,
        context: &mut RestContext,
    ) -> FailToProxy {
        let (kind, message) = match error.etype() {
            ErrorType::HTTPStatus(413) => (
                ErrorKind::PayloadTooLarge,
                format!(
                    "request body is larger than the limit of {} bytes",
                    self.max_request_bytes
                ),
            ),
            ErrorType::ConnectTimedout | ErrorType::ReadTimedout | ErrorType::WriteTimedout => {
                (ErrorKind::Timeout, format!("backend did not answer in time: {error}"))
            }
            ErrorType::HTTPStatus(status) => (
                ErrorKind::from_http_status(*status),
                error
                    .context
                    .as_ref()
                    .map_or_else(|| error.to_string(), |context| context.as_str().to_owned()),
            ),
            _ => match error.esource() {
                pingora::ErrorSource::Downstream => (
                    ErrorKind::InvalidArgument,
                    format!("the request could not be read: {error}"),
                ),
                _ => (
                    ErrorKind::BadGateway,
                    format!("backend unreachable or broke off: {error}"),
                ),
            },
        };
        let failure = Error::new(kind, Origin::Upstream, message);
        let code = failure.http_status().as_u16();
        respond_error(session, context, &failure).await;
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }
}
