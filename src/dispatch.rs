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
use crate::metrics::{self, BackendMetrics, Metrics, RouteMetrics};
use crate::proto::{
    ModelInferRequest, ModelInferResponse, ModelMetadataRequest, ModelMetadataResponse, ModelReadyRequest,
    ModelReadyResponse,
};
use crate::protocol::{InferRequest, InferResponse, ModelMetadata, ParamValue, ServerMetadata};
use crate::routing::{RouteTable, VersionRoute};
use crate::upstream::{GrpcUpstream, Replied, RestUpstream};

const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";
const MODEL_METADATA: &str = "/inference.GRPCInferenceService/ModelMetadata";
const MODEL_READY: &str = "/inference.GRPCInferenceService/ModelReady";

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
    backends: Vec<BackendClients>,
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
                BackendClients {
                    name: backend.name.clone(),
                    replicas,
                    next: AtomicUsize::new(0),
                    metrics: metrics.backend(&backend.name),
                }
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

    /// The request counters of the route `model` and `version` resolve to; the fixed `_unknown` ones when they
    /// resolve to none, so a client cannot create series.
    pub fn route_metrics(&self, model: &str, version: Option<&str>) -> Arc<RouteMetrics> {
        self.routes
            .resolve(model, version)
            .ok()
            .and_then(|route| self.route_metrics.get(route.id))
            .cloned()
            .unwrap_or_else(|| self.metrics.unknown_route())
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
            .ok_or_else(|| Error::internal(format!("no backend {} for a route", route.backend)))
    }

    /// Where a REST client's inference can be proxied as it is: a REST backend that understands the body
    /// (binary-extension bodies only to backends that speak it). Aliased names are renamed on the way back.
    pub fn rest_passthrough(
        &self,
        model: &str,
        version: Option<&str>,
        binary_body: bool,
    ) -> Result<Option<Passthrough>> {
        let route = self.routes.resolve(model, version)?;
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
            backend_metrics: backend.metrics.clone(),
        }))
    }

    /// Runs an inference given as a decoded request, over whichever protocol the backend speaks, and answers with
    /// the public model name and version, and with the backend's end-to-end headers.
    pub async fn infer(
        &self,
        model: &str,
        version: Option<&str>,
        mut request: InferRequest,
        context: &CallContext,
    ) -> Result<Replied<InferResponse>> {
        let route = self.routes.resolve(model, version)?;
        let backend = self.backend(route)?;
        let deadline = Some(self.deadline(context));
        request.model_name = route.upstream_name.clone();
        request.model_version = Some(route.upstream_version.clone()).filter(|v| !v.is_empty());
        let _call = backend.metrics.call();
        let mut replied = match &backend.replicas {
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
                        &context.forward,
                        deadline,
                    )
                    .await?
            }
            Replicas::Grpc { endpoints } => {
                let endpoint = &endpoints[backend.pick(endpoints)];
                let message = protobuf::encode_request(request);
                let answer = endpoint
                    .unary(MODEL_INFER, message.chunks, deadline, &context.forward)
                    .await?;
                let decoded = ModelInferResponse::decode(answer.value).map_err(|e| bad_answer(&backend.name, e))?;
                Replied {
                    value: protobuf::response_from_proto(decoded).map_err(Error::into_upstream_protocol_error)?,
                    headers: answer.headers,
                }
            }
        };
        replied.value.model_name = route.model.clone();
        replied.value.model_version = Some(route.version.clone());
        Ok(replied)
    }

    /// The gRPC front door's inference: an encoded `ModelInferRequest` in, an encoded `ModelInferResponse` out.
    /// To a gRPC backend it passes through as bytes with only the names spliced; to a REST backend it is translated.
    pub async fn infer_grpc(&self, message: Bytes, context: &CallContext) -> Result<Replied<Vec<Bytes>>> {
        let fields = splice::model_fields(&message)?;
        let route = self.routes.resolve(fields.name, Some(fields.version))?.clone();
        let backend = self.backend(&route)?;
        match &backend.replicas {
            Replicas::Grpc { endpoints } => {
                let endpoint = &endpoints[backend.pick(endpoints)];
                let renamed = splice::rename(&message, &route.upstream_name, &route.upstream_version)?;
                let _call = backend.metrics.call();
                let answer = endpoint
                    .unary(MODEL_INFER, renamed, Some(self.deadline(context)), &context.forward)
                    .await?;
                Ok(Replied {
                    value: splice::rename(&answer.value, &route.model, &route.version)
                        .map_err(Error::into_upstream_protocol_error)?,
                    headers: answer.headers,
                })
            }
            Replicas::Rest { .. } => {
                let decoded = ModelInferRequest::decode(message)
                    .map_err(|e| Error::invalid(format!("invalid ModelInferRequest: {e}")))?;
                let request = protobuf::request_from_proto(decoded)?;
                let replied = self.infer(&route.model, Some(&route.version), request, context).await?;
                Ok(Replied {
                    value: protobuf::encode_response(replied.value).chunks,
                    headers: replied.headers,
                })
            }
        }
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

fn bad_answer(backend: &str, error: prost::DecodeError) -> Error {
    Error::new(
        ErrorKind::BadGateway,
        Origin::Upstream,
        format!("backend {backend} sent an invalid message: {error}"),
    )
}
