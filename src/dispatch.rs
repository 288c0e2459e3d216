//! The one internal call behind both front doors: a request for a public model and version is resolved to a
//! backend, sent over the backend's own protocol (translated when the client spoke the other one), and answered with
//! the public names restored.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::HeaderMap;
use prost::Message;

use crate::codec::rest::{self, BINARY_DATA_OUTPUT};
use crate::codec::{protobuf, splice};
use crate::config::{BackendProtocol, Config};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::metrics::{self, BackendMetrics, Metrics, MirrorResult, RouteMetrics};
use crate::proto::{
    ModelInferRequest, ModelInferResponse, ModelMetadataRequest, ModelMetadataResponse, ModelReadyRequest,
    ModelReadyResponse,
};
use crate::protocol::{InferRequest, InferResponse, ModelMetadata, ParamValue, ServerMetadata};
use crate::routing::{RouteTable, Routed, VersionRoute};
use crate::upstream::{GrpcUpstream, Replied, RestUpstream};

const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";
const MODEL_METADATA: &str = "/inference.GRPCInferenceService/ModelMetadata";
const MODEL_READY: &str = "/inference.GRPCInferenceService/ModelReady";

/// Mirrored calls allowed under way at once; beyond it, copies are not sent.
const MAX_MIRRORS_IN_FLIGHT: usize = 256;
/// How long a connection attempt to a backend may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a server-ready answer is reused.
const READY_CACHE: Duration = Duration::from_secs(1);
/// Bound on each readiness probe of a backend.
const READY_PROBE_TIMEOUT: Duration = Duration::from_millis(800);

/// A REST request proxied to a backend unchanged but for its path.
#[derive(Debug, Clone)]
pub struct Passthrough {
    /// `host:port` of the chosen replica.
    pub authority: String,
    /// The backend's path for the model and version.
    pub path: String,
    /// Bound on the backend's answer.
    pub timeout: Duration,
    /// The public model name and version to put back into the answer, when the backend's differ.
    pub rename: Option<(String, String)>,
    /// The public version that serves the request.
    pub version: String,
    /// The backend's metric handles, for the proxied call's in-flight count and latency.
    pub backend_metrics: BackendMetrics,
}

/// What one request carries besides its payload.
#[derive(Debug, Clone, Default)]
pub struct CallContext {
    /// The client's deadline, if it set one; the configured request timeout bounds it.
    pub deadline: Option<Duration>,
    /// The end-to-end headers (or gRPC metadata) to pass on to the backend: `x-request-id`, `traceparent`,
    /// `authorization` and whatever else the client sent that is not about one hop (see [`crate::headers`]).
    pub forward: HeaderMap,
}

/// A backend's replicas, spoken to over its protocol.
#[derive(Debug)]
enum Replicas {
    Rest {
        endpoints: Vec<RestUpstream>,
        binary_data: bool,
    },
    Grpc {
        endpoints: Vec<GrpcUpstream>,
    },
}

#[derive(Debug)]
struct BackendClients {
    name: String,
    replicas: Replicas,
    next: AtomicUsize,
    metrics: BackendMetrics,
}

impl BackendClients {
    /// The next replica, round robin.
    fn pick<T>(&self, endpoints: &[T]) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % endpoints.len().max(1)
    }
}

/// The gateway's routing and backends, built once from a validated configuration.
#[derive(Debug)]
pub struct Dispatcher {
    routes: RouteTable,
    backends: Vec<Arc<BackendClients>>,
    /// Bounds mirrored calls under way; mirroring is what is dropped first under load.
    mirror_slots: Arc<tokio::sync::Semaphore>,
    request_timeout: Duration,
    metadata: ServerMetadata,
    ready_cache: Mutex<Option<(Instant, bool)>>,
    metrics: Arc<Metrics>,
    /// Metric handles by route id.
    route_metrics: Vec<Arc<RouteMetrics>>,
}

/// Extensions the gateway supports, as its server metadata reports them.
pub const EXTENSIONS: [&str; 1] = ["binary_tensor_data"];

impl Dispatcher {
    /// A dispatcher with metrics of its own.
    pub fn new(config: &Config, name: &str) -> Result<Dispatcher> {
        Dispatcher::with_metrics(config, name, Metrics::new()?)
    }

    /// A dispatcher counting into `metrics`, which outlive it (a reloaded configuration keeps the same registry).
    pub fn with_metrics(config: &Config, name: &str, metrics: Arc<Metrics>) -> Result<Dispatcher> {
        let max_response = usize::try_from(config.limits.max_request_bytes).unwrap_or(usize::MAX);
        let backends = config
            .backends
            .iter()
            .map(|backend| {
                let replicas = match backend.protocol {
                    BackendProtocol::Rest => Replicas::Rest {
                        endpoints: backend
                            .endpoints
                            .iter()
                            .map(|e| RestUpstream::new(e, CONNECT_TIMEOUT, max_response))
                            .collect(),
                        binary_data: backend.binary_data,
                    },
                    BackendProtocol::Grpc => Replicas::Grpc {
                        endpoints: backend
                            .endpoints
                            .iter()
                            .map(|e| GrpcUpstream::new(e, CONNECT_TIMEOUT, max_response))
                            .collect(),
                    },
                };
                Arc::new(BackendClients {
                    name: backend.name.clone(),
                    replicas,
                    next: AtomicUsize::new(0),
                    metrics: metrics.backend(&backend.name),
                })
            })
            .collect::<Vec<_>>();
        let routes = RouteTable::new(config)?;
        let route_metrics = routes
            .routes()
            .iter()
            .map(|route| {
                let backend = backends
                    .get(route.backend)
                    .map_or(metrics::NO_BACKEND, |b| b.name.as_str());
                metrics.route(&route.model, &route.version, backend)
            })
            .collect();
        Ok(Dispatcher {
            routes,
            mirror_slots: Arc::new(tokio::sync::Semaphore::new(MAX_MIRRORS_IN_FLIGHT)),
            route_metrics,
            metrics,
            backends,
            request_timeout: config.limits.request_timeout,
            metadata: ServerMetadata {
                name: name.to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
                extensions: EXTENSIONS.iter().map(|e| (*e).to_owned()).collect(),
            },
            ready_cache: Mutex::new(None),
        })
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Routes one inference (see [`RouteTable::route`]) and gives the counters to record it under: the served
    /// version's, or the fixed `_unknown` ones when the model or version is not configured, so a client cannot
    /// create series.
    pub fn route(
        &self,
        model: &str,
        version: Option<&str>,
        headers: &HeaderMap,
    ) -> (Result<Routed>, Arc<RouteMetrics>) {
        let routed = self.routes.route(model, version, headers);
        let metrics = routed
            .as_ref()
            .ok()
            .and_then(|routed| self.route_metrics.get(routed.route.id))
            .cloned()
            .unwrap_or_else(|| self.metrics.unknown_route());
        (routed, metrics)
    }

    pub fn server_metadata(&self) -> &ServerMetadata {
        &self.metadata
    }

    fn deadline(&self, context: &CallContext) -> Duration {
        context
            .deadline
            .map_or(self.request_timeout, |d| d.min(self.request_timeout))
    }

    fn backend(&self, route: &VersionRoute) -> Result<&BackendClients> {
        self.backends
            .get(route.backend)
            .map(|backend| &**backend)
            .ok_or_else(|| Error::internal(format!("no backend {} for a route", route.backend)))
    }

    /// Where a REST client's inference can be proxied as it is: a REST backend that understands the body
    /// (binary-extension bodies only to backends that speak it). Aliased names are renamed on the way back.
    pub fn rest_passthrough(&self, routed: &Routed, binary_body: bool) -> Result<Option<Passthrough>> {
        let route = &routed.route;
        let backend = self.backend(route)?;
        let Replicas::Rest { endpoints, binary_data } = &backend.replicas else {
            return Ok(None);
        };
        if binary_body && !binary_data {
            return Ok(None);
        }
        let aliased = route.upstream_name != route.model || route.upstream_version != route.version;
        let endpoint = &endpoints[backend.pick(endpoints)];
        Ok(Some(Passthrough {
            authority: endpoint.authority().to_owned(),
            path: crate::upstream::rest::model_path(&route.upstream_name, Some(&route.upstream_version), "/infer"),
            timeout: self.request_timeout,
            rename: aliased.then(|| (route.model.clone(), route.version.clone())),
            version: route.version.clone(),
            backend_metrics: backend.metrics.clone(),
        }))
    }

    /// Runs an inference for `model` at `version` (routed here): the convenience form of [`Self::infer_routed`].
    pub async fn infer(
        &self,
        model: &str,
        version: Option<&str>,
        request: InferRequest,
        context: &CallContext,
    ) -> Result<Replied<InferResponse>> {
        let routed = self.route(model, version, &context.forward).0?;
        self.infer_routed(&routed, request, context).await
    }

    /// Runs a routed inference given as a decoded request, over whichever protocol the backend speaks, and answers
    /// with the public model name and version, and with the backend's end-to-end headers plus `oip-model-version`.
    /// A mirrored request is copied (tensor buffers shared, not copied) to the mirror first.
    pub async fn infer_routed(
        &self,
        routed: &Routed,
        request: InferRequest,
        context: &CallContext,
    ) -> Result<Replied<InferResponse>> {
        if let Some(mirror) = &routed.mirror {
            self.mirror(mirror, MirrorPayload::Decoded(request.clone()), &context.forward);
        }
        let route = &routed.route;
        let backend = self.backend(route)?;
        let mut replied = call_infer(backend, route, request, &context.forward, self.deadline(context)).await?;
        replied.value.model_name = route.model.clone();
        replied.value.model_version = Some(route.version.clone());
        served_version(&mut replied.headers, route);
        Ok(replied)
    }

    /// The gRPC front door's inference, routed here: the convenience form of [`Self::infer_grpc_routed`].
    pub async fn infer_grpc(&self, message: Bytes, context: &CallContext) -> Result<Replied<Vec<Bytes>>> {
        let fields = splice::model_fields(&message)?;
        let routed = self.route(fields.name, Some(fields.version), &context.forward).0?;
        self.infer_grpc_routed(&routed, message, context).await
    }

    /// The gRPC front door's inference: an encoded `ModelInferRequest` in, an encoded `ModelInferResponse` out.
    /// To a gRPC backend it passes through as bytes with only the names spliced; to a REST backend it is translated.
    pub async fn infer_grpc_routed(
        &self,
        routed: &Routed,
        message: Bytes,
        context: &CallContext,
    ) -> Result<Replied<Vec<Bytes>>> {
        if let Some(mirror) = &routed.mirror {
            self.mirror(mirror, MirrorPayload::Grpc(message.clone()), &context.forward);
        }
        let route = &routed.route;
        let backend = self.backend(route)?;
        let mut replied = match &backend.replicas {
            Replicas::Grpc { endpoints } => {
                let endpoint = &endpoints[backend.pick(endpoints)];
                let renamed = splice::rename(&message, &route.upstream_name, &route.upstream_version)?;
                let _call = backend.metrics.call();
                let answer = endpoint
                    .unary(MODEL_INFER, renamed, Some(self.deadline(context)), &context.forward)
                    .await?;
                Replied {
                    value: splice::rename(&answer.value, &route.model, &route.version)
                        .map_err(Error::into_upstream_protocol_error)?,
                    headers: answer.headers,
                }
            }
            Replicas::Rest { .. } => {
                let request = decode_grpc_request(message)?;
                let mut replied = call_infer(backend, route, request, &context.forward, self.deadline(context)).await?;
                replied.value.model_name = route.model.clone();
                replied.value.model_version = Some(route.version.clone());
                Replied {
                    value: protobuf::encode_response(replied.value).chunks,
                    headers: replied.headers,
                }
            }
        };
        served_version(&mut replied.headers, route);
        Ok(replied)
    }

    /// Sends a copy of a request to the mirror version, fire and forget: the answer is dropped, a failure is only
    /// counted, and when too many mirrored calls are already under way the copy is not sent at all.
    pub fn mirror(&self, route: &Arc<VersionRoute>, payload: MirrorPayload, forward: &HeaderMap) {
        let Some(metrics) = self.route_metrics.get(route.id).cloned() else {
            return;
        };
        let Ok(permit) = self.mirror_slots.clone().try_acquire_owned() else {
            metrics.mirrored(MirrorResult::Shed);
            return;
        };
        let Some(backend) = self.backends.get(route.backend).cloned() else {
            return;
        };
        let route = route.clone();
        let forward = forward.clone();
        let timeout = self.request_timeout;
        tokio::spawn(async move {
            let outcome = mirror_call(&backend, &route, payload, &forward, timeout).await;
            drop(permit);
            metrics.mirrored(if outcome.is_ok() {
                MirrorResult::Ok
            } else {
                MirrorResult::Error
            });
        });
    }

    /// Model metadata from the backend serving the resolved version, with the public name and versions.
    pub async fn model_metadata(&self, model: &str, version: Option<&str>) -> Result<ModelMetadata> {
        let route = self.routes.resolve(model, version)?;
        let backend = self.backend(route)?;
        let deadline = Some(self.request_timeout);
        let upstream_version = Some(route.upstream_version.as_str()).filter(|v| !v.is_empty());
        let _call = backend.metrics.call();
        let mut metadata = match &backend.replicas {
            Replicas::Rest { endpoints, .. } => {
                endpoints[backend.pick(endpoints)]
                    .model_metadata(&route.upstream_name, upstream_version, deadline)
                    .await?
            }
            Replicas::Grpc { endpoints } => {
                let request = ModelMetadataRequest {
                    name: route.upstream_name.clone(),
                    version: route.upstream_version.clone(),
                };
                let answer = endpoints[backend.pick(endpoints)]
                    .unary(
                        MODEL_METADATA,
                        vec![Bytes::from(request.encode_to_vec())],
                        deadline,
                        &HeaderMap::new(),
                    )
                    .await?;
                let decoded = ModelMetadataResponse::decode(answer.value).map_err(|e| bad_answer(&backend.name, e))?;
                protobuf::model_metadata_from_proto(decoded)
            }
        };
        metadata.name = route.model.clone();
        metadata.versions = self.routes.versions(model).map(<[String]>::to_vec).unwrap_or_default();
        Ok(metadata)
    }

    /// Whether the backend serving the resolved version says the model is ready.
    pub async fn model_ready(&self, model: &str, version: Option<&str>) -> Result<bool> {
        self.route_ready(self.routes.resolve(model, version)?, self.request_timeout)
            .await
    }

    async fn route_ready(&self, route: &VersionRoute, deadline: Duration) -> Result<bool> {
        let backend = self.backend(route)?;
        let upstream_version = Some(route.upstream_version.as_str()).filter(|v| !v.is_empty());
        let _call = backend.metrics.call();
        match &backend.replicas {
            Replicas::Rest { endpoints, .. } => Ok(endpoints[backend.pick(endpoints)]
                .model_ready(&route.upstream_name, upstream_version, Some(deadline))
                .await?
                .ready),
            Replicas::Grpc { endpoints } => {
                let request = ModelReadyRequest {
                    name: route.upstream_name.clone(),
                    version: route.upstream_version.clone(),
                };
                let answer = endpoints[backend.pick(endpoints)]
                    .unary(
                        MODEL_READY,
                        vec![Bytes::from(request.encode_to_vec())],
                        Some(deadline),
                        &HeaderMap::new(),
                    )
                    .await?;
                Ok(ModelReadyResponse::decode(answer.value)
                    .map_err(|e| bad_answer(&backend.name, e))?
                    .ready)
            }
        }
    }

    /// The gateway is ready when every configured model's default version is ready at its backend. Answers are
    /// reused for up to a second so probes cannot flood the backends.
    pub async fn server_ready(&self) -> bool {
        if let Ok(cache) = self.ready_cache.lock()
            && let Some((at, ready)) = *cache
            && at.elapsed() < READY_CACHE
        {
            return ready;
        }
        let checks = self
            .routes
            .models()
            .filter_map(|model| self.routes.resolve(model, None).ok())
            .map(|route| async move { self.route_ready(route, READY_PROBE_TIMEOUT).await.unwrap_or(false) });
        let ready = futures_util::future::join_all(checks)
            .await
            .into_iter()
            .all(|ready| ready);
        if let Ok(mut cache) = self.ready_cache.lock() {
            *cache = Some((Instant::now(), ready));
        }
        ready
    }
}

/// A request copied for the mirror, in the form the client sent it.
#[derive(Debug)]
pub enum MirrorPayload {
    Decoded(InferRequest),
    /// An encoded `ModelInferRequest`.
    Grpc(Bytes),
    /// A REST body (JSON, or binary extension when `header_length` is set) as it arrived, in chunks.
    Rest {
        body: Vec<Bytes>,
        header_length: Option<u64>,
        content_type: Option<http::HeaderValue>,
    },
}

/// Marks which public version served an answer.
fn served_version(headers: &mut HeaderMap, route: &VersionRoute) {
    if let Ok(value) = http::HeaderValue::from_str(&route.version) {
        headers.insert(crate::headers::OIP_MODEL_VERSION, value);
    }
}

fn decode_grpc_request(message: Bytes) -> Result<InferRequest> {
    let decoded =
        ModelInferRequest::decode(message).map_err(|e| Error::invalid(format!("invalid ModelInferRequest: {e}")))?;
    protobuf::request_from_proto(decoded)
}

/// Runs a decoded inference on `route`'s backend, over its protocol, with the backend's own names.
async fn call_infer(
    backend: &BackendClients,
    route: &VersionRoute,
    mut request: InferRequest,
    forward: &HeaderMap,
    deadline: Duration,
) -> Result<Replied<InferResponse>> {
    request.model_name = route.upstream_name.clone();
    request.model_version = Some(route.upstream_version.clone()).filter(|v| !v.is_empty());
    let deadline = Some(deadline);
    let _call = backend.metrics.call();
    match &backend.replicas {
        Replicas::Rest { endpoints, binary_data } => {
            let endpoint = &endpoints[backend.pick(endpoints)];
            if *binary_data {
                // The backend answers in binary: no floats printed and parsed on the way back.
                request
                    .parameters
                    .insert(BINARY_DATA_OUTPUT.to_owned(), ParamValue::Bool(true));
            }
            let body = rest::encode_request(&request, *binary_data)?;
            endpoint
                .infer(
                    &route.upstream_name,
                    request.model_version.as_deref(),
                    body,
                    forward,
                    deadline,
                )
                .await
        }
        Replicas::Grpc { endpoints } => {
            let endpoint = &endpoints[backend.pick(endpoints)];
            let message = protobuf::encode_request(request);
            let answer = endpoint.unary(MODEL_INFER, message.chunks, deadline, forward).await?;
            let decoded = ModelInferResponse::decode(answer.value).map_err(|e| bad_answer(&backend.name, e))?;
            Ok(Replied {
                value: protobuf::response_from_proto(decoded).map_err(Error::into_upstream_protocol_error)?,
                headers: answer.headers,
            })
        }
    }
}

/// One mirrored call: the copy converted to what the mirror's backend speaks, its answer dropped.
async fn mirror_call(
    backend: &BackendClients,
    route: &VersionRoute,
    payload: MirrorPayload,
    forward: &HeaderMap,
    timeout: Duration,
) -> Result<()> {
    let request = match (payload, &backend.replicas) {
        (MirrorPayload::Grpc(message), Replicas::Grpc { endpoints }) => {
            let renamed = splice::rename(&message, &route.upstream_name, &route.upstream_version)?;
            let _call = backend.metrics.call();
            endpoints[backend.pick(endpoints)]
                .unary(MODEL_INFER, renamed, Some(timeout), forward)
                .await?;
            return Ok(());
        }
        (
            MirrorPayload::Rest {
                body,
                header_length,
                content_type,
            },
            Replicas::Rest { endpoints, binary_data },
        ) if header_length.is_none() || *binary_data => {
            let mut headers = forward.clone();
            if let Some(content_type) = content_type {
                headers.insert(http::header::CONTENT_TYPE, content_type);
            }
            if let Some(length) = header_length {
                headers.insert(crate::upstream::rest::INFERENCE_HEADER_CONTENT_LENGTH, length.into());
            }
            let path = crate::upstream::rest::model_path(&route.upstream_name, Some(&route.upstream_version), "/infer");
            let _call = backend.metrics.call();
            let answer = endpoints[backend.pick(endpoints)]
                .send(http::Method::POST, &path, &headers, body, Some(timeout))
                .await?;
            return if answer.status.is_success() {
                Ok(())
            } else {
                Err(Error::from_upstream_http(answer.status.as_u16(), "mirror failed"))
            };
        }
        (MirrorPayload::Decoded(request), _) => request,
        (MirrorPayload::Grpc(message), _) => decode_grpc_request(message)?,
        (
            MirrorPayload::Rest {
                body, header_length, ..
            },
            _,
        ) => {
            let joined = Bytes::from(body.concat());
            match rest::decode_request(joined, header_length)? {
                rest::RestRequest::Request { request, .. } => request,
                rest::RestRequest::RawBinary(_) => {
                    return Err(Error::invalid("a raw binary request is not mirrored across protocols"));
                }
            }
        }
    };
    call_infer(backend, route, request, forward, timeout).await.map(drop)
}

fn bad_answer(backend: &str, error: prost::DecodeError) -> Error {
    Error::new(
        ErrorKind::BadGateway,
        Origin::Upstream,
        format!("backend {backend} sent an invalid message: {error}"),
    )
}
