//! The one internal call behind both front doors: a request for a public model and version is resolved to a
//! backend, sent over the backend's own protocol (translated when the client spoke the other one), and answered with
//! the public names restored.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;

use crate::codec::compression::Coding;
use crate::config::{BackendProtocol, Config, Discovery, Endpoint, ReadyPolicy};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::guard::Guard;
use crate::protocol::{ModelIndexEntry, ModelState, Sequence, ServerMetadata};
use crate::routing::{Affinity, RouteTable, Routed, VersionRoute};
use crate::runtime::{ThreadArc, ThreadShared};
use crate::telemetry::metrics::{self, Metrics, MirrorResult, RouteMetrics};
use crate::telemetry::payload_log::PayloadLogger;
use crate::telemetry::traces::{Trace, Traces};
use crate::tls::Prepared;

mod admit;
mod backend;
mod config;
pub mod fleet;
mod infer;
mod load;
mod metadata;
mod mirror;
mod passthrough;
mod payload_sink;
mod pick;
mod probe;
mod readiness;
mod repository;
pub(crate) mod statistics;
pub mod status;
mod stream;
mod window;

pub use admit::{AdmittedCall, CallRequest, Taken};
use backend::{BackendClients, Replicas};
use infer::{bad_answer, call_infer, decode_grpc_request};

pub use config::{ConfigForm, ModelConfigAnswer};
use metadata::MetadataCache;
pub use mirror::MirrorPayload;
use mirror::mirror_call;
pub use passthrough::{Outgoing, Passthrough};
pub use pick::Picked;
use probe::probe;
use readiness::AskedReadiness;
pub use repository::RepositoryAction;
pub use stream::{MODEL_STREAM_INFER, StreamAnswer, StreamHold, StreamSummary};

const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";
const MODEL_METADATA: &str = "/inference.GRPCInferenceService/ModelMetadata";
const MODEL_READY: &str = "/inference.GRPCInferenceService/ModelReady";
const SERVER_READY: &str = "/inference.GRPCInferenceService/ServerReady";

/// Mirrored calls allowed under way at once; beyond it, copies are not sent.
const MAX_MIRRORS_IN_FLIGHT: usize = 256;
/// How long a connection attempt to a backend may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on each readiness probe of a backend.
const READY_PROBE_TIMEOUT: Duration = Duration::from_millis(800);

/// What one request carries besides its payload.
#[derive(Debug, Clone, Default)]
pub struct CallContext {
    /// The client's deadline, if it set one; the configured request timeout bounds it.
    pub deadline: Option<Duration>,
    /// The end-to-end headers (or gRPC metadata) to pass on to the backend: `x-request-id`, `traceparent`,
    /// `authorization` and whatever else the client sent that is not about one hop (see [`crate::headers`]).
    pub forward: HeaderMap,
    /// How the client's request came compressed, if it did: a gRPC backend configured with `compression` is sent
    /// the request compressed the same way (clients that do not compress are not made to pay for it).
    pub compressed: Option<Coding>,
    /// Who is calling, when `[auth]` asks: each request of a stream is authorised for the model it names.
    pub principal: Option<Arc<crate::guard::Principal>>,
    /// The span the backend calls are steps of (empty when the call is not traced).
    pub trace: Trace,
    /// The door admitted the call itself, and holds its admission for the call's life (the REST door's translated
    /// calls): a request of it that reaches the inference stream (a translated streaming call's) is routed, not
    /// admitted or sampled again.
    pub admitted_by_door: bool,
    /// Where the door learns the endpoint its call's backend stream opened on (a REST streaming call translated
    /// onto an inference stream, for its access line).
    pub served_by: Option<Arc<std::sync::OnceLock<ThreadArc<str>>>>,
}

/// The gateway's routing and backends, built once from a validated configuration.
#[derive(Debug)]
pub struct Dispatcher {
    routes: RouteTable,
    backends: Vec<Arc<BackendClients>>,
    /// Bounds mirrored calls under way; mirroring is what is dropped first under load.
    mirror_slots: Arc<tokio::sync::Semaphore>,
    request_timeout: Duration,
    stream_idle_timeout: Duration,
    metadata: ServerMetadata,
    /// The kept readiness of the backends that are not health-checked.
    asked: Arc<AskedReadiness>,
    metadata_cache: MetadataCache,
    ready_policy: ReadyPolicy,
    metrics: Arc<Metrics>,
    /// Metric handles by route id, each door thread cloning its own.
    route_metrics: Vec<ThreadShared<RouteMetrics>>,
    /// The fixed `_unknown` route's, for calls of a model or version not configured.
    unknown_route: ThreadShared<RouteMetrics>,
    /// The backend's REST inference path by route id, made once rather than per proxied request.
    /// Each route's inference path at its REST backend (`None` where its names make no path).
    rest_paths: Vec<Option<http::uri::PathAndQuery>>,
    /// Who may call what, and how fast.
    guard: Guard,
    /// Where spans and payloads go, when configured; kept across reloads that leave their sections alone.
    traces: Option<Arc<Traces>>,
    payload_log: Option<Arc<PayloadLogger>>,
}

/// Triton's extensions the gateway serves itself, in Triton's names, as its server metadata reports them: the binary
/// tensor data of REST bodies, sequences kept on their replica, the repository index and model load and unload, the
/// `priority` and `timeout` parameters (`schedule_policy`), models' configuration, statistics, request parameters
/// carried to the backends, and generate. Not the shared-memory extensions (a region is on the client's host),
/// trace, logging or classification (the backend's own, when it has it).
pub const EXTENSIONS: [&str; 8] = [
    "binary_tensor_data",
    "sequence",
    "model_repository",
    "schedule_policy",
    "model_configuration",
    "statistics",
    "parameters",
    "generate",
];

impl Dispatcher {
    /// A dispatcher with metrics of its own (TLS files read now; backends found through DNS start with none).
    pub fn new(config: &Config, name: &str) -> Result<Dispatcher> {
        Dispatcher::with_metrics(config, name, Metrics::new()?)
    }

    /// A dispatcher counting into `metrics`, which outlive it (a reloaded configuration keeps the same registry).
    pub fn with_metrics(config: &Config, name: &str, metrics: Arc<Metrics>) -> Result<Dispatcher> {
        let prepared = Prepared::load(config).map_err(|problems| {
            Error::internal(problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))
        })?;
        Dispatcher::build(config, name, metrics, &prepared, &HashMap::new(), None)
    }

    /// Builds the dispatcher for `config` with its TLS material `prepared` and the endpoints `discovered` through
    /// DNS (by backend name). Endpoints of `previous` that the new configuration keeps as they were (same backend,
    /// protocol, policy and TLS, same address) are carried over with their connections and health state.
    pub fn build(
        config: &Config,
        name: &str,
        metrics: Arc<Metrics>,
        prepared: &Prepared,
        discovered: &HashMap<String, Vec<Endpoint>>,
        previous: Option<&Dispatcher>,
    ) -> Result<Dispatcher> {
        let max_response = usize::try_from(config.limits.max_request_bytes).unwrap_or(usize::MAX);
        metrics.bound_series(config.max_series);
        let backends = config
            .backends()
            .iter()
            .enumerate()
            .map(|(index, backend)| {
                let endpoints: &[Endpoint] = match &backend.discovery {
                    Discovery::Static => &backend.endpoints,
                    Discovery::Dns { .. } | Discovery::File { .. } => {
                        discovered.get(&backend.name).map_or(&[], Vec::as_slice)
                    }
                };
                let tls = prepared.backend_tls.get(index).cloned().flatten();
                let old = previous
                    .and_then(|p| p.backends.iter().find(|b| b.name == backend.name))
                    .filter(|old| old.same_connections(backend, tls.as_ref()));
                if let Some(old) = old
                    && old.endpoints == endpoints
                {
                    return old.clone();
                }
                Arc::new(BackendClients::new(
                    backend,
                    endpoints,
                    tls,
                    max_response,
                    old.map(|b| &**b),
                    &metrics,
                ))
            })
            .collect::<Vec<_>>();
        let routes = RouteTable::new(config)?;
        if let Some(previous) = previous {
            forget_removed(&metrics, previous, &backends, &routes, config);
        }
        let principals = config.auth.as_ref().map_or(0, |auth| auth.api_keys.len());
        let route_metrics = routes
            .routes()
            .iter()
            .map(|route| {
                let backend = backends
                    .get(route.backend.index())
                    .map_or(metrics::NO_BACKEND, |b| b.name.as_str());
                ThreadShared::new(metrics.route(&route.model, &route.version, backend, principals))
            })
            .collect();
        let rest_paths = routes
            .routes()
            .iter()
            .map(|route| {
                let path = crate::upstream::rest::model_path(&route.upstream_name, route.backend_version(), "/infer");
                http::uri::PathAndQuery::try_from(path).ok()
            })
            .collect();
        let jwt_keys = prepared
            .jwt_keys
            .clone()
            .or_else(|| previous.and_then(|p| p.guard.jwt_keys()));
        let asked = Arc::new(AskedReadiness::new(routes.routes(), &backends, READY_PROBE_TIMEOUT));
        let traces = match (&config.tracing, previous.and_then(|p| p.traces.as_ref())) {
            (None, _) => None,
            (Some(config), Some(kept)) if kept.made_from(config) => Some(kept.clone()),
            (Some(config), _) => Some(Arc::new(Traces::start(config, &metrics)?)),
        };
        let payload_log = match (&config.payload_log, previous.and_then(|p| p.payload_log.as_ref())) {
            (None, _) => None,
            (Some(config), Some(kept)) if kept.made_from(config) => Some(kept.clone()),
            (Some(config), _) => {
                let sink = Arc::new(payload_sink::SinkUpstream::new(&config.url)?);
                Some(Arc::new(PayloadLogger::start(config, &metrics, sink)))
            }
        };
        let shared = match (&config.shared_limits, previous.and_then(|p| p.guard.shared())) {
            (None, _) => None,
            (Some(config), Some(kept)) if kept.made_from(config) => Some(kept.clone()),
            (Some(config), _) => Some(crate::guard::shared::SharedStore::start(config, &metrics)?),
        };
        Ok(Dispatcher {
            traces,
            payload_log,
            guard: Guard::new(config, jwt_keys, shared, previous.map(|p| &p.guard), metrics.clone()),
            rest_paths,
            routes,
            mirror_slots: previous.map_or_else(
                || Arc::new(tokio::sync::Semaphore::new(MAX_MIRRORS_IN_FLIGHT)),
                |p| p.mirror_slots.clone(),
            ),
            route_metrics,
            unknown_route: ThreadShared::new(metrics.unknown_route()),
            metrics,
            backends,
            request_timeout: config.limits.request_timeout,
            stream_idle_timeout: config.limits.stream_idle_timeout,
            metadata: ServerMetadata {
                name: name.to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
                extensions: EXTENSIONS.iter().map(|e| (*e).to_owned()).collect(),
            },
            asked,
            metadata_cache: MetadataCache::default(),
            ready_policy: config.ready_policy,
        })
    }

    /// Whether `model`'s calls that name no version are split between versions.
    pub fn splits(&self, model: &str) -> bool {
        self.routes.versions(model).is_some_and(|versions| versions.len() > 1)
    }

    /// Whether the configuration routes `model` (a public name).
    pub fn knows(&self, model: &str) -> bool {
        self.routes.versions(model).is_some()
    }

    /// Who may call what, and how fast.
    pub fn guard(&self) -> &Guard {
        &self.guard
    }

    /// The tracer, when `[tracing]` is configured.
    pub fn traces(&self) -> Option<&Traces> {
        self.traces.as_deref()
    }

    /// The payload log of `route`'s inferences, when `[payload_log]` covers it; sampled here, once per inference.
    fn payload_log(&self, route: &VersionRoute) -> Option<&Arc<PayloadLogger>> {
        self.payload_log
            .as_ref()
            .filter(|log| route.payload_log && log.sampled())
    }

    /// Notes what routing chose on the routing step's span (the backend, its name for the model) and on the
    /// request's (the public model and version).
    fn note_route(&self, routing: &Trace, request: &Trace, route: &VersionRoute) {
        if !routing.is_on() {
            return;
        }
        let backend = self
            .backends
            .get(route.backend.index())
            .map_or(metrics::NO_BACKEND, |b| b.name.as_str());
        routing.set("oip.backend", backend.to_owned());
        routing.set("oip.upstream_model", route.upstream_name.clone());
        request.set("oip.model", route.model.clone());
        request.set("oip.version", route.version.clone());
    }

    /// The protocol of the backend serving `route`.
    pub fn backend_protocol(&self, route: &VersionRoute) -> Option<BackendProtocol> {
        self.backends.get(route.backend.index()).map(|b| match b.replicas {
            Replicas::Rest { .. } => BackendProtocol::Rest,
            Replicas::Grpc { .. } => BackendProtocol::Grpc,
        })
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Routes one inference (see [`RouteTable::route`]) and gives the counters to record it under: the served
    /// version's, or the fixed `_unknown` ones when the model or version is not configured, so a client cannot
    /// create series.
    fn route(
        &self,
        model: &str,
        version: Option<&str>,
        headers: &HeaderMap,
        sequence: Option<Sequence>,
    ) -> (Result<Routed>, ThreadArc<RouteMetrics>) {
        let routed = self.routes.route(model, version, headers, sequence);
        let metrics = routed
            .as_ref()
            .ok()
            .and_then(|routed| self.route_metrics.get(routed.route.id))
            .unwrap_or(&self.unknown_route)
            .handle();
        (routed, metrics)
    }

    /// The counters of calls whose model or version is not configured (or could not be read).
    pub fn unknown_route_metrics(&self) -> ThreadArc<RouteMetrics> {
        self.unknown_route.handle()
    }

    /// Refuses a call of `route` at once (429 / RESOURCE_EXHAUSTED, with `Retry-After`) while every endpoint that
    /// could serve it reports more than the model's `max_queue` of its requests waiting; a call whose `priority`
    /// is kept passes.
    fn shed(&self, route: &VersionRoute, priority: Option<u64>) -> Result<()> {
        let Some(shed) = route.shed else {
            return Ok(());
        };
        if priority.is_some_and(|level| level <= u64::from(shed.keep_priority)) {
            return Ok(());
        }
        let backend = self.backend(route)?;
        let Some(shortest) =
            backend
                .fleet
                .queued_everywhere(&route.upstream_name, &route.upstream_version, f64::from(shed.max_queue))
        else {
            return Ok(());
        };
        self.metrics.rate_limited(crate::guard::Limited::Queue.label());
        let wait = backend
            .fleet
            .policy
            .load
            .as_ref()
            .map_or(Duration::from_secs(1), |load| load.interval);
        Err(Error::new(
            ErrorKind::Overloaded,
            Origin::Gateway,
            format!(
                "model '{}' is shedding load: every endpoint of backend {} reports more than {} requests waiting \
                 (the shortest queue is {shortest})",
                route.model, backend.name, shed.max_queue
            ),
        )
        .with_retry_after(wait))
    }

    pub fn server_metadata(&self) -> &ServerMetadata {
        &self.metadata
    }

    /// How long a call of `route` may take: the route's bound (the model's `timeout_ms`, else the request timeout),
    /// shortened by the client's deadline.
    fn deadline(context: &CallContext, route: &VersionRoute) -> Duration {
        context.deadline.map_or(route.timeout, |d| d.min(route.timeout))
    }

    fn backend(&self, route: &VersionRoute) -> Result<&BackendClients> {
        self.backends
            .get(route.backend.index())
            .map(|backend| &**backend)
            .ok_or_else(|| Error::internal(format!("no backend {} for a route", route.backend.index())))
    }

    /// Sends a copy of a request to the mirror version, fire and forget: the answer is dropped, a failure is only
    /// counted, and when too many mirrored calls are already under way the copy is not sent at all. A sequence's
    /// copies keep to one endpoint of the mirror, as the originals do.
    pub fn mirror(&self, route: &Arc<VersionRoute>, payload: MirrorPayload, forward: &HeaderMap, affinity: &Affinity) {
        let Some(metrics) = self.route_metrics.get(route.id).map(|metrics| metrics.shared().clone()) else {
            return;
        };
        let Ok(permit) = self.mirror_slots.clone().try_acquire_owned() else {
            metrics.mirrored(MirrorResult::Shed);
            return;
        };
        let Some(backend) = self.backends.get(route.backend.index()).cloned() else {
            return;
        };
        let route = route.clone();
        let forward = forward.clone();
        let affinity = affinity.clone();
        let timeout = self.request_timeout;
        tokio::spawn(async move {
            let outcome = mirror_call(&backend, &route, payload, &forward, &affinity, timeout).await;
            drop(permit);
            metrics.mirrored(if outcome.is_ok() {
                MirrorResult::Ok
            } else {
                MirrorResult::Error
            });
        });
    }

    /// Whether some endpoint serving the resolved version has the model ready: from the health checks' last probes
    /// when the backend is checked, otherwise by asking its endpoints (one model's answer is worth a call; the
    /// fleet-wide answers read kept state).
    pub async fn model_ready(&self, model: &str, version: Option<&str>) -> Result<bool> {
        let route = self.routes.resolve(model, version)?;
        let unavailable = match (self.route_known(route, None), self.backend(route)) {
            (Some(known), _) => known,
            (None, Ok(backend)) => {
                readiness::ask(
                    backend,
                    &route.upstream_name,
                    &route.upstream_version,
                    self.request_timeout,
                )
                .await
            }
            (None, Err(error)) => Some(error.message().to_owned()),
        };
        Ok(unavailable.is_none())
    }

    /// The model-repository index over the fleet: every public model version, READY when some endpoint serving it
    /// has it ready (probe state, or the kept answers for backends that are not health-checked), else UNAVAILABLE
    /// with the reason. Only ready ones when `ready_only`.
    pub async fn repository_index(&self, ready_only: bool) -> Vec<ModelIndexEntry> {
        let sweep = self.sweep().await;
        self.routes
            .routes()
            .iter()
            .filter_map(|route| {
                let unavailable = self.route_known(route, sweep.as_deref()).flatten();
                if ready_only && unavailable.is_some() {
                    return None;
                }
                Some(ModelIndexEntry {
                    name: route.model.clone(),
                    version: route.version.clone(),
                    state: if unavailable.is_none() {
                        ModelState::Ready
                    } else {
                        ModelState::Unavailable
                    },
                    reason: unavailable.unwrap_or_default(),
                })
            })
            .collect()
    }

    /// The kept answers for the backends that are not health-checked (none when every backend is).
    async fn sweep(&self) -> Option<Arc<readiness::Sweep>> {
        if self.asked.asks() {
            Some(self.asked.answers(&self.backends).await)
        } else {
            None
        }
    }

    /// Why no endpoint can serve `route` (`Some(None)` when one can), from probe state or `sweep`; `None` when
    /// neither knows.
    fn route_known(&self, route: &VersionRoute, sweep: Option<&readiness::Sweep>) -> Option<Option<String>> {
        let backend = match self.backend(route) {
            Ok(backend) => backend,
            Err(error) => return Some(Some(error.message().to_owned())),
        };
        let (name, version) = (&route.upstream_name, &route.upstream_version);
        if backend.fleet.health_checked() {
            return Some((!backend.fleet.can_serve(name, version)).then(|| {
                format!(
                    "backend {}: {}",
                    backend.name,
                    backend.fleet.why_unavailable(name, version)
                )
            }));
        }
        sweep.map(|sweep| sweep.unavailable(route.backend.index(), name, version))
    }

    /// Probes every endpoint of every health-checked backend at its interval, for as long as the dispatcher lives:
    /// server ready, then the ready check of each distinct backend model routed to the backend; and scrapes the
    /// metrics of every endpoint of a backend with `load`.
    pub async fn run_health_checks(self: Arc<Self>) {
        let mut checks: Vec<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>> = Vec::new();
        for backend in &self.backends {
            if let Some(source) = backend.fleet.policy.load.clone() {
                checks.push(Box::pin(load::scrape_endpoints(
                    backend.clone(),
                    source,
                    self.metrics.clone(),
                )));
            }
        }
        for (index, backend) in self.backends.iter().enumerate() {
            let Some(health) = backend.fleet.policy.health else {
                continue;
            };
            let mut models: Vec<(String, String)> = Vec::new();
            let mut seen = std::collections::HashSet::new();
            for route in self.routes.routes().iter().filter(|r| r.backend.index() == index) {
                let model = (route.upstream_name.clone(), route.upstream_version.clone());
                if seen.insert(model.clone()) {
                    models.push(model);
                }
            }
            let backend = backend.clone();
            checks.push(Box::pin(async move {
                let mut ticker = tokio::time::interval(health.interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticker.tick().await;
                    let probes = (0..backend.fleet.states.len())
                        .map(|endpoint| probe(&backend, endpoint, &models, health.timeout));
                    futures_util::future::join_all(probes).await;
                }
            }));
        }
        futures_util::future::join_all(checks).await;
    }

    /// The gateway is ready when every configured model (or, by `ready_policy`, any) has a version that some
    /// endpoint can serve: from probe state for health-checked backends, otherwise from the kept answers of the
    /// others (see [`readiness`]), so readiness probes cannot flood the backends.
    pub async fn server_ready(&self) -> bool {
        let sweep = self.sweep().await;
        let mut servable = self.routes.models().map(|model| {
            self.routes.model_routes(model).is_ok_and(|routes| {
                routes.iter().any(|route| {
                    self.route_known(route, sweep.as_deref())
                        .is_some_and(|known| known.is_none())
                })
            })
        });
        match self.ready_policy {
            ReadyPolicy::AllModels => servable.all(|ready| ready),
            ReadyPolicy::AnyModel => servable.any(|ready| ready),
        }
    }
}

/// Drops the series of what a rebuild over `previous` removed: endpoints (unless the new configuration has the
/// same one, whose series goes on), model versions and backends.
fn forget_removed(
    metrics: &Metrics,
    previous: &Dispatcher,
    backends: &[Arc<BackendClients>],
    routes: &RouteTable,
    config: &Config,
) {
    for old in &previous.backends {
        for state in &old.fleet.states {
            let kept = backends
                .iter()
                .any(|b| b.name == old.name && b.fleet.states.iter().any(|s| Arc::ptr_eq(s, state)));
            let same_series = backends
                .iter()
                .any(|b| b.name == old.name && b.endpoints.iter().any(|e| e.to_string() == *state.authority));
            if !kept && !same_series {
                metrics.forget_endpoint(&old.name, &state.authority);
            }
        }
    }
    metrics.forget_removed(
        |model, version| routes.resolve(model, Some(version)).is_ok(),
        |backend| config.backends().iter().any(|b| b.name == backend),
    );
}
