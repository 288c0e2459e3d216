//! The gRPC front door: `inference.GRPCInferenceService` (ModelInfer passes through as bytes, everything else is
//! typed), `grpc.health.v1.Health` and server reflection, on tonic.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::Either;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tonic::codec::CompressionEncoding;
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

use crate::codec::compression::Coding;
use crate::codec::protobuf;
use crate::dispatch::{CallContext, ConfigForm, Dispatcher, MODEL_STREAM_INFER, ModelConfigAnswer, RepositoryAction};
use crate::error::{Error, Result};
use crate::frontend::budget::AnswerBudget;
use crate::frontend::flood::{self, ResetWatch};
use crate::frontend::preface;
use crate::guard::Principal;
use crate::headers;
use crate::headers::{GRPC_ACCEPT_ENCODING, GRPC_ENCODING, GRPC_MESSAGE, GRPC_STATUS, GRPC_TIMEOUT};
use crate::live::{Gateway, Serving};
use crate::proto::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use crate::proto::{
    ModelConfigRequest, ModelConfigResponse, ModelInferRequest, ModelInferResponse, ModelMetadataRequest,
    ModelMetadataResponse, ModelReadyRequest, ModelReadyResponse, ModelStatisticsRequest, ModelStatisticsResponse,
    RepositoryIndexRequest, RepositoryIndexResponse, RepositoryModelLoadRequest, RepositoryModelLoadResponse,
    RepositoryModelUnloadRequest, RepositoryModelUnloadResponse, ServerLiveRequest, ServerLiveResponse,
    ServerMetadataRequest, ServerMetadataResponse, ServerReadyRequest, ServerReadyResponse,
};
use crate::protocol::reserved;
use crate::telemetry::record::{RequestRecord, Target};
use crate::telemetry::traces::{Trace, Traces};
use crate::telemetry::{ClientProtocol, ReportedPrincipal};
use opentelemetry::KeyValue;

mod infer;
mod stream;
use stream::infer_stream;

const SERVICE: &str = "inference.GRPCInferenceService";
const MODEL_INFER_PATH: &str = "/inference.GRPCInferenceService/ModelInfer";
/// How often the health service's status is refreshed from the backends.
const HEALTH_REFRESH: Duration = Duration::from_secs(1);

/// Parses a `grpc-timeout` value: up to eight digits and a unit (H, M, S, m, u, n).
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

fn context<T>(request: &Request<T>) -> CallContext {
    let mut context = context_of(&request.metadata().clone().into_headers());
    context.principal = caller(request).cloned();
    context
}

/// Who made a typed call, when `[auth]` asks (see [`authenticate`]).
fn caller<T>(request: &Request<T>) -> Option<&Arc<Principal>> {
    request
        .extensions()
        .get::<Caller>()
        .and_then(|caller| caller.0.as_ref())
}

/// The calls probes make, open without a credential like `grpc.health.v1`.
const PROBES: [&str; 2] = [
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
];

/// The principal of a call, carried to the typed RPCs in the request's extensions.
#[derive(Debug, Clone)]
struct Caller(Option<Arc<Principal>>);

/// Names the caller of a call when `[auth]` asks for one (probes need none) and keeps its credential from the
/// backend unless the configuration forwards it.
fn authenticate(
    dispatcher: &Dispatcher,
    path: &str,
    headers: &mut http::HeaderMap,
) -> Result<Option<Arc<Principal>>, Status> {
    Ok(dispatcher.guard().caller(headers, PROBES.contains(&path))?)
}

fn context_of(headers: &http::HeaderMap) -> CallContext {
    CallContext {
        principal: None,
        trace: Trace::default(),
        deadline: headers
            .get(GRPC_TIMEOUT)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout),
        forward: headers::for_backend(headers),
        compressed: match headers.get(GRPC_ENCODING).map(http::HeaderValue::as_bytes) {
            Some(b"gzip") => Some(Coding::Gzip),
            Some(b"deflate") => Some(Coding::Deflate),
            _ => None,
        },
        // Each request of a stream is admitted as it comes.
        admitted_by_door: false,
        served_by: None,
    }
}

/// The span of a call at the door, named for its method (`inference.GRPCInferenceService/ModelInfer`).
fn call_span(traces: &Traces, path: &str, headers: &http::HeaderMap) -> Trace {
    traces.request(headers, || {
        let name = path.trim_start_matches('/');
        let (service, method) = name.split_once('/').unwrap_or(("", name));
        let attributes = vec![
            KeyValue::new("rpc.system", "grpc"),
            KeyValue::new("rpc.service", service.to_owned()),
            KeyValue::new("rpc.method", method.to_owned()),
            KeyValue::new("oip.protocol", "grpc"),
        ];
        (name.to_owned().into(), attributes)
    })
}

/// The typed RPCs.
#[derive(Debug, Clone)]
struct TypedRpcs {
    gateway: Arc<Gateway>,
}

fn version(text: &str) -> Option<&str> {
    Some(text).filter(|v| !v.is_empty())
}

#[tonic::async_trait]
impl GrpcInferenceService for TypedRpcs {
    async fn server_live(&self, _: Request<ServerLiveRequest>) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(&self, _: Request<ServerReadyRequest>) -> Result<Response<ServerReadyResponse>, Status> {
        Ok(Response::new(ServerReadyResponse {
            ready: self.gateway.server_ready().await,
        }))
    }

    async fn model_ready(&self, request: Request<ModelReadyRequest>) -> Result<Response<ModelReadyResponse>, Status> {
        let dispatcher = self.gateway.dispatcher();
        dispatcher
            .guard()
            .authorize(caller(&request).map(|p| &**p), &request.get_ref().name)?;
        let request = request.into_inner();
        let ready = dispatcher.model_ready(&request.name, version(&request.version)).await?;
        Ok(Response::new(ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(protobuf::server_metadata_to_proto(
            self.gateway.dispatcher().server_metadata().clone(),
        )))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let dispatcher = self.gateway.dispatcher();
        dispatcher
            .guard()
            .authorize(caller(&request).map(|p| &**p), &request.get_ref().name)?;
        let request = request.into_inner();
        let metadata = dispatcher
            .model_metadata(&request.name, version(&request.version))
            .await?;
        Ok(Response::new(protobuf::model_metadata_to_proto(metadata)))
    }

    type ModelStreamInferStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<crate::proto::ModelStreamInferResponse, Status>> + Send>>;

    async fn model_stream_infer(
        &self,
        _: Request<tonic::Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        // Not reached: the router sends ModelStreamInfer to the raw path.
        Err(Status::unimplemented("ModelStreamInfer is served on the raw path"))
    }

    async fn model_infer(&self, _: Request<ModelInferRequest>) -> Result<Response<ModelInferResponse>, Status> {
        // Not reached: the door sends ModelInfer to its raw path, the one way an inference is served.
        Err(Status::unimplemented("ModelInfer is served on the raw path"))
    }

    crate::no_shared_memory_rpcs!(reserved::shared_memory_registration_refused);

    async fn repository_index(
        &self,
        request: Request<RepositoryIndexRequest>,
    ) -> Result<Response<RepositoryIndexResponse>, Status> {
        let dispatcher = self.gateway.dispatcher();
        let principal = caller(&request).cloned();
        let mut entries = dispatcher.repository_index(request.into_inner().ready).await;
        entries.retain(|entry| dispatcher.guard().shows(principal.as_deref(), &entry.name));
        Ok(Response::new(protobuf::repository_index_to_proto(entries)))
    }

    async fn model_config(
        &self,
        request: Request<ModelConfigRequest>,
    ) -> Result<Response<ModelConfigResponse>, Status> {
        let dispatcher = self.gateway.dispatcher();
        dispatcher
            .guard()
            .authorize(caller(&request).map(|p| &**p), &request.get_ref().name)?;
        let request = request.into_inner();
        let config = dispatcher
            .model_config(&request.name, version(&request.version), ConfigForm::Protobuf)
            .await?;
        match config {
            ModelConfigAnswer::Protobuf(config) => Ok(Response::new(ModelConfigResponse { config })),
            ModelConfigAnswer::Json(_) => Err(Status::internal("a model configuration in JSON form")),
        }
    }

    async fn model_statistics(
        &self,
        request: Request<ModelStatisticsRequest>,
    ) -> Result<Response<ModelStatisticsResponse>, Status> {
        let dispatcher = self.gateway.dispatcher();
        let principal = caller(&request).cloned();
        let request = request.into_inner();
        let model = Some(request.name.as_str()).filter(|name| !name.is_empty());
        if let Some(model) = model {
            dispatcher.guard().authorize(principal.as_deref(), model)?;
        }
        let mut model_stats = dispatcher.model_statistics(model, version(&request.version)).await?;
        model_stats.retain(|entry| dispatcher.guard().shows(principal.as_deref(), &entry.name));
        Ok(Response::new(ModelStatisticsResponse { model_stats }))
    }

    async fn repository_model_load(
        &self,
        request: Request<RepositoryModelLoadRequest>,
    ) -> Result<Response<RepositoryModelLoadResponse>, Status> {
        let context = context(&request);
        let request = request.into_inner();
        self.repository_change(
            &context,
            &request.model_name,
            RepositoryAction::Load,
            request.parameters,
        )
        .await?;
        Ok(Response::new(RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        request: Request<RepositoryModelUnloadRequest>,
    ) -> Result<Response<RepositoryModelUnloadResponse>, Status> {
        let context = context(&request);
        let request = request.into_inner();
        self.repository_change(
            &context,
            &request.model_name,
            RepositoryAction::Unload,
            request.parameters,
        )
        .await?;
        Ok(Response::new(RepositoryModelUnloadResponse {}))
    }
}

impl TypedRpcs {
    /// Loads or unloads `model` on every replica, for a principal with admin scope.
    async fn repository_change(
        &self,
        context: &CallContext,
        model: &str,
        action: RepositoryAction,
        parameters: std::collections::BTreeMap<String, crate::proto::ModelRepositoryParameter>,
    ) -> Result<(), Status> {
        let dispatcher = self.gateway.dispatcher();
        repository_allowed(&dispatcher, context.principal.as_deref(), model)?;
        let parameters = protobuf::repository_parameters_from_proto(parameters);
        dispatcher
            .repository_change(model, action, &parameters, &context.forward)
            .await?;
        Ok(())
    }
}

/// Whether `principal` may load and unload `model`: admin, and the model in its scope.
fn repository_allowed(dispatcher: &Dispatcher, principal: Option<&Principal>, model: &str) -> Result<(), Status> {
    dispatcher.guard().authorize(principal, model)?;
    dispatcher
        .guard()
        .authorize_admin(principal, "loading and unloading models")?;
    Ok(())
}

/// `inference.GRPCInferenceService`: ModelInfer on the raw path, the rest typed.
#[derive(Debug, Clone)]
pub struct InferenceService {
    typed: GrpcInferenceServiceServer<TypedRpcs>,
    max_message_bytes: usize,
    gateway: Arc<Gateway>,
}

impl InferenceService {
    pub fn new(gateway: Arc<Gateway>, max_message_bytes: usize) -> Self {
        let typed = GrpcInferenceServiceServer::new(TypedRpcs {
            gateway: gateway.clone(),
        })
        .accept_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Deflate)
        .max_decoding_message_size(max_message_bytes)
        .max_encoding_message_size(usize::MAX);
        InferenceService {
            typed,
            max_message_bytes,
            gateway,
        }
    }
}

impl NamedService for InferenceService {
    const NAME: &'static str = SERVICE;
}

impl<B> tower_service::Service<http::Request<B>> for InferenceService
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let limit = self.max_message_bytes;
        if request.uri().path() == MODEL_INFER_PATH {
            // Counted, logged and readied for the wire on its own path.
            return Box::pin(infer::model_infer(self.gateway.serving(), request, limit, None).map(Ok));
        }
        let Serving {
            dispatcher,
            metrics,
            active,
        } = self.gateway.serving();
        let path = request.uri().path().to_owned();
        let authenticated = authenticate(&dispatcher, &path, request.headers_mut());
        let principal = authenticated.as_ref().ok().cloned().flatten();
        // Streams are logged with their model and backend on their own path; every other call is recorded here.
        let log_here = request.uri().path() != MODEL_STREAM_INFER;
        let mut record = log_here.then(|| {
            let mut record = RequestRecord::open(metrics, ClientProtocol::Grpc, Target::Path(path.clone()));
            record.request_id = request.headers().get(super::REQUEST_ID).cloned();
            record.principal = principal
                .clone()
                .map(|principal| principal as Arc<dyn ReportedPrincipal>);
            record
        });
        let trace = match dispatcher.traces() {
            Some(traces) if log_here => call_span(traces, &path, request.headers()),
            _ => Trace::default(),
        };
        let answer: Self::Future = match authenticated {
            Err(status) => Box::pin(std::future::ready(Ok(status.into_http()))),
            Ok(principal) if path == MODEL_STREAM_INFER => {
                let gateway = self.gateway.clone();
                Box::pin(async move { Ok(infer_stream(gateway, request, limit, principal)) })
            }
            Ok(principal) => {
                request.extensions_mut().insert(Caller(principal));
                self.typed.call(request)
            }
        };
        Box::pin(async move {
            let mut response = answer.await?;
            // The request counts as under way until its answer's body is sent or dropped, so a shutdown waits for
            // a large answer still streaming.
            finish_answer(&mut response, limit, active);
            let code = || {
                response
                    .headers()
                    .get(GRPC_STATUS)
                    .and_then(|c| c.to_str().ok())
                    .and_then(|c| c.parse::<i32>().ok())
                    .map_or(tonic::Code::Ok, tonic::Code::from_i32)
            };
            if trace.is_on() {
                trace.set("rpc.grpc.status_code", code() as i64);
            }
            if let Some(record) = &mut record {
                let code = code();
                let status = if code == tonic::Code::Ok {
                    200
                } else {
                    Error::new(
                        crate::error::ErrorKind::from_grpc_code(code),
                        crate::error::Origin::Gateway,
                        "",
                    )
                    .http_status()
                    .as_u16()
                };
                record.answered(status, 0);
            }
            Ok(response)
        })
    }
}

/// The compression of an inference's answer: the client's own, when it compressed its request with gzip or deflate
/// and accepts the same back (many clients list every encoding they can read without wanting tensors compressed).
fn answer_coding(headers: &http::HeaderMap) -> Option<Coding> {
    let coding = match headers.get(GRPC_ENCODING).map(http::HeaderValue::as_bytes) {
        Some(b"gzip") => Coding::Gzip,
        Some(b"deflate") => Coding::Deflate,
        _ => return None,
    };
    let accepted = headers
        .get_all(GRPC_ACCEPT_ENCODING)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|name| name.trim() == coding.name());
    accepted.then_some(coding)
}

/// The compression of a client's messages, from `grpc-encoding`; an encoding the gateway does not read is refused.
fn message_encoding(headers: &http::HeaderMap) -> Result<Option<CompressionEncoding>, Status> {
    match headers.get(GRPC_ENCODING).map(http::HeaderValue::as_bytes) {
        None | Some(b"identity") => Ok(None),
        Some(b"gzip") => Ok(Some(CompressionEncoding::Gzip)),
        Some(b"deflate") => Ok(Some(CompressionEncoding::Deflate)),
        Some(other) => Err(Status::unimplemented(format!(
            "messages compressed with `{}` are not supported; gzip, deflate or identity are",
            String::from_utf8_lossy(other)
        ))),
    }
}

/// Readies an answer for the wire: the request stays counted as under way (`active`) until its body is sent or
/// dropped; and an oversized request's status is corrected. tonic refuses an oversized message from its length
/// prefix, before reading it, but says OUT_OF_RANGE; the protocol's table (and the REST door's 413) says
/// RESOURCE_EXHAUSTED. The status may come in the headers (trailers-only) or in the trailers.
fn finish_answer(response: &mut http::Response<tonic::body::Body>, limit: usize, active: crate::live::Active) {
    let rewritten = rewrite_size_status(response.headers_mut(), limit);
    if rewritten && response.extensions().get::<Status>().is_some() {
        // tonic keeps the status here too, and writes it from here on the wire.
        response
            .extensions_mut()
            .insert(Status::resource_exhausted(size_message(limit)));
    }
    let body = std::mem::replace(response.body_mut(), tonic::body::Body::empty());
    let body = http_body_util::BodyExt::map_frame(body, move |frame| {
        // Owned by the body, so dropped with it.
        let _under_way = &active;
        match frame.into_trailers() {
            Ok(mut trailers) => {
                let _ = rewrite_size_status(&mut trailers, limit);
                http_body::Frame::trailers(trailers)
            }
            Err(frame) => frame,
        }
    });
    *response.body_mut() = tonic::body::Body::new(body);
}

fn size_message(limit: usize) -> String {
    format!("request message is larger than the limit of {limit} bytes")
}

/// Rewrites the status in `headers`; true when it did.
fn rewrite_size_status(headers: &mut http::HeaderMap, limit: usize) -> bool {
    let out_of_range = headers.get(GRPC_STATUS).is_some_and(|s| s == "11");
    let is_size_limit = headers
        .get(GRPC_MESSAGE)
        .and_then(|m| m.to_str().ok())
        // grpc-message is percent-encoded on the wire.
        .is_some_and(|m| m.replace("%20", " ").contains("decoded message length too large"));
    if out_of_range && is_size_limit {
        headers.insert(GRPC_STATUS, http::HeaderValue::from_static("8"));
        if let Ok(value) = http::HeaderValue::from_str(&size_message(limit)) {
            headers.insert(GRPC_MESSAGE, value);
        }
    }
    out_of_range && is_size_limit
}

/// HTTP/2 windows large enough that a multi-megabyte tensor is not throttled by flow control.
const STREAM_WINDOW: u32 = 8 << 20;
const CONNECTION_WINDOW: u32 = 32 << 20;
/// How long a client may take over its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the gRPC door holds its clients to.
#[derive(Debug, Clone, Copy)]
pub struct GrpcLimits {
    pub max_message_bytes: usize,
    /// Streams (calls) one client connection may have open at once.
    pub max_concurrent_streams: u32,
    /// Bytes of inference answers one client connection may hold in the gateway unread.
    pub max_buffered_answer_bytes: usize,
    /// How long a client may take over the HTTP/2 preface once its first byte has arrived.
    pub header_timeout: Duration,
}

/// How long a new connection may wait before its first byte, as a REST connection may idle.
const IDLE_OPENING: Duration = Duration::from_secs(60);

/// Serves the gRPC front door on `listener` until `shutdown` resolves, then lets open calls finish.
///
/// Connections are served by hyper directly rather than by tonic's server, whose deadline layer answers an expired
/// `grpc-timeout` with CANCELLED; the gateway enforces the deadline itself and answers DEADLINE_EXCEEDED, as the
/// gRPC specification says.
pub async fn serve(
    seat: super::DoorThread,
    gateway: Arc<Gateway>,
    limits: GrpcLimits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let max_message_bytes = limits.max_message_bytes;
    let (reporter, health) = tonic_health::server::health_reporter();
    let watched = gateway.clone();
    let health_task = tokio::spawn(async move {
        loop {
            let status = if watched.server_ready().await {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            reporter.set_service_status(SERVICE, status).await;
            reporter.set_service_status("", status).await;
            tokio::time::sleep(HEALTH_REFRESH).await;
        }
    });
    let infer_gateway = gateway.clone();
    let mut routes = tonic::service::Routes::new(InferenceService::new(gateway, max_message_bytes)).add_service(health);
    match tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
    {
        Ok(reflection) => routes = routes.add_service(reflection),
        Err(error) => tracing::warn!(%error, "gRPC reflection is unavailable"),
    }
    let routes = routes.prepare();

    let mut builder = http2::Builder::new(TokioExecutor::new());
    super::http2_limits(&mut builder, limits.max_concurrent_streams);
    builder
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        // gRPC answers carry no Date; writing one is work on every call.
        .auto_date_header(false);
    // Each connection holds a sender: once the door stops, every one of them has ended when the channel closes.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let (open, mut all_closed) = tokio::sync::mpsc::channel::<()>(1);
    super::accept_loop(seat, "grpc", shutdown, |stream, _peer, occupied| {
        let _ = stream.set_nodelay(true);
        let routes = routes.clone();
        let gateway = infer_gateway.clone();
        let watch = ResetWatch::new();
        let calls = watch.clone();
        let budget = AnswerBudget::new(limits.max_buffered_answer_bytes);
        // ModelInfer, nearly every call, goes straight to its own path; the router serves the rest.
        let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
            let call = calls.call();
            let answer = if request.uri().path() == MODEL_INFER_PATH {
                // Boxed: the call's state is large, and hyper moves the future it is given several times over.
                let call = infer::model_infer(gateway.serving(), request, max_message_bytes, Some(budget.clone()));
                Either::Left(Box::pin(call).map(Ok))
            } else {
                let mut routes = routes.clone();
                Either::Right(tower_service::Service::call(&mut routes, request))
            };
            answer.map(move |answer: Result<http::Response<tonic::body::Body>, Infallible>| {
                if let Ok(response) = &answer {
                    call.finish(response.headers().get(GRPC_STATUS).is_some_and(|status| status == "1"));
                }
                answer
            })
        });
        let builder = builder.clone();
        let acceptor = tls.clone();
        let mut stopped = stopped.clone();
        let open = open.clone();
        // A TLS handshake runs on the connection's own task, so a slow or silent client holds up no one.
        tokio::spawn(async move {
            let _held = (open, occupied);
            let stop = async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            };
            // hyper waits for a preface without end: the gateway reads it, on the time limits of a REST head.
            match acceptor {
                None => {
                    if let Some(stream) = preface::after_preface(stream, IDLE_OPENING, limits.header_timeout).await {
                        let connection = builder.serve_connection(TokioIo::new(stream), service);
                        flood::serve(connection, &watch, stop).await;
                    }
                }
                Some(acceptor) => {
                    let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(error)) => return tracing::debug!(%error, "gRPC TLS handshake failed"),
                        Err(_) => return,
                    };
                    if let Some(stream) = preface::after_preface(stream, IDLE_OPENING, limits.header_timeout).await {
                        let connection = builder.serve_connection(TokioIo::new(stream), service);
                        flood::serve(connection, &watch, stop).await;
                    }
                }
            }
        });
    })
    .await;
    health_task.abort();
    let _ = stop.send(true);
    drop(open);
    let _ = tokio::time::timeout(super::DRAIN_TIMEOUT, all_closed.recv()).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts() {
        assert_eq!(parse_grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("5000u"), Some(Duration::from_millis(5)));
        assert_eq!(parse_grpc_timeout("123456789m"), None);
        assert_eq!(parse_grpc_timeout("m"), None);
        assert_eq!(parse_grpc_timeout(""), None);
        assert_eq!(parse_grpc_timeout("10x"), None);
    }
}
