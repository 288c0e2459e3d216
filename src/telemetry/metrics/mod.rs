//! The gateway's Prometheus metrics: one registry for the process, series made at first use and kept by the routes
//! and backends that use them (a request increments counters it already holds, no label formatting per request).

mod epp;
mod family;
mod handles;
mod sharded;
mod shared_limits;
mod streams;
use epp::EppMetrics;
pub use shared_limits::{SharedDecision, SharedLimit};
use streams::StreamMetrics;
pub use streams::{StreamLeg, StreamResult};

use handles::{BackendFamilies, BackendSeries};
pub use handles::{BackendMetrics, InFlight, MirrorResult, RouteMetrics};
pub use sharded::{Counter, PerThreadCount};
use sharded::{CounterVec, Histogram, HistogramVec, LevelVec};

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus::{GaugeVec, HistogramOpts, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};

use self::family::{Family, SeriesBound};
use super::{ClientProtocol, Finished, RouteNames};
use crate::error::{Error, Result};
use crate::runtime::ThreadShared;

/// Label value for a model, version or backend a request named that the configuration does not have.
pub const UNKNOWN: &str = "_unknown";
/// Label value for the backend of a request that reached none.
pub const NO_BACKEND: &str = "_none";
/// Label value for the principal of a call made by none that is configured (a JWT's subject, or no one).
pub const OTHER_PRINCIPAL: &str = family::OTHER;

/// HTTP statuses counted under their own `code` label; any other is counted as `other`.
const CODES: [u16; 16] = [
    200, 400, 401, 403, 404, 405, 408, 409, 413, 429, 499, 500, 501, 502, 503, 504,
];
const OTHER_CODE: &str = "other";
/// [`CODES`] as their labels, then [`OTHER_CODE`].
const CODE_LABELS: [&str; 17] = [
    "200", "400", "401", "403", "404", "405", "408", "409", "413", "429", "499", "500", "501", "502", "503", "504",
    OTHER_CODE,
];

/// Seconds, from a tenth of a millisecond (the gateway's own overhead) to a minute (a slow model).
const DURATION_BUCKETS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
];

/// Every metric family of the gateway, registered in one registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Access-log lines the log's writer dropped, as of the last scrape.
    access_log_dropped: Counter,
    /// The bound on series per family, `[metrics] max_series`.
    bound: Arc<SeriesBound>,
    requests: Arc<Family<CounterVec>>,
    auth_denied: CounterVec,
    rate_limited: CounterVec,
    /// Calls under way of each model held to `max_concurrent`, as of the last scrape, and the models it has series
    /// of (one scrape at a time sets them, so another never sees a series missing).
    models_under_way: (IntGaugeVec, std::sync::Mutex<std::collections::HashSet<String>>),
    mirrors: Arc<Family<CounterVec>>,
    backends: Arc<BackendFamilies>,
    protocols: [ProtocolMetrics; 2],
    unknown_route: Arc<RouteMetrics>,
    /// `oipgate_translation_duration_seconds` by [`Direction`].
    translation: [Histogram; 2],
    /// `oipgate_config_reloads_total` for `ok` and `error`.
    reloads: [Counter; 2],
    streams: StreamMetrics,
    /// `oipgate_spans_total` and `oipgate_payload_log_events_total` by result; series made when the sections are
    /// configured.
    spans: CounterVec,
    payload_events: CounterVec,
    /// `oipgate_connections_refused_total` by listener.
    connections_refused: CounterVec,
    /// The endpoint picker's (`oipgate epp`).
    epp: EppMetrics,
    /// The limits shared through Redis.
    shared_limits: shared_limits::SharedLimitMetrics,
}

/// Which way a message was translated between the protocols.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From a REST body (JSON or binary extension) to a gRPC message.
    RestToGrpc,
    /// From a gRPC message to a REST body.
    GrpcToRest,
}

impl Direction {
    const ALL: [Direction; 2] = [Direction::RestToGrpc, Direction::GrpcToRest];

    fn label(self) -> &'static str {
        match self {
            Direction::RestToGrpc => "rest_to_grpc",
            Direction::GrpcToRest => "grpc_to_rest",
        }
    }

    fn index(self) -> usize {
        match self {
            Direction::RestToGrpc => 0,
            Direction::GrpcToRest => 1,
        }
    }
}

/// Per client protocol: whole-request duration and bytes.
#[derive(Debug, Clone)]
struct ProtocolMetrics {
    duration: Histogram,
    request_bytes: Counter,
    response_bytes: Counter,
}

fn registered<M: prometheus::core::Collector + Clone + 'static>(registry: &Registry, metric: M) -> Result<M> {
    registry
        .register(Box::new(metric.clone()))
        .map_err(|e| Error::internal(format!("cannot register a metric: {e}")))?;
    Ok(metric)
}

/// Counters named `name`, by `labels`, registered in `registry`.
fn counters(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> Result<CounterVec> {
    registered(
        registry,
        CounterVec::new(Opts::new(name, help), labels).map_err(metric_error)?,
    )
}

/// Gauges named `name`, by `labels`, registered in `registry`.
fn gauges(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> Result<IntGaugeVec> {
    registered(
        registry,
        IntGaugeVec::new(Opts::new(name, help), labels).map_err(metric_error)?,
    )
}

/// Duration histograms named `name`, by `labels`, registered in `registry`.
fn histograms(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> Result<HistogramVec> {
    let options = HistogramOpts::new(name, help).buckets(DURATION_BUCKETS.to_vec());
    registered(registry, sharded::histogram_vec(options, labels).map_err(metric_error)?)
}

/// `oipgate_build_info`: the running version, always 1.
fn register_build_info(registry: &Registry) -> Result<()> {
    let build_info = gauges(
        registry,
        "oipgate_build_info",
        "The running oipgate's version; always 1.",
        &["version"],
    )?;
    build_info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
    Ok(())
}

fn metric_error(error: prometheus::Error) -> Error {
    Error::internal(format!("cannot create a metric: {error}"))
}

/// Labels with few values, kept as they are past the bound on series; every other label becomes `_other` there.
const FEW_VALUED_LABELS: [&str; 4] = ["protocol", "code", "result", "direction"];

/// Registers bounded families, each counting its dropped series under its own name.
struct Families<'a> {
    registry: &'a Registry,
    bound: Arc<SeriesBound>,
    dropped: CounterVec,
}

impl<'a> Families<'a> {
    /// Families in `registry`, bounded to the default `[metrics] max_series` until a configuration says otherwise.
    fn new(registry: &'a Registry) -> Result<Families<'a>> {
        Ok(Families {
            registry,
            bound: SeriesBound::new(usize::try_from(crate::config::DEFAULT_MAX_SERIES).unwrap_or(usize::MAX)),
            dropped: counters(
                registry,
                "oipgate_metrics_series_dropped_total",
                "Series not made because their metric had [metrics] max_series already; what they would have counted \
                 is counted under _other labels.",
                &["metric"],
            )?,
        })
    }

    fn family<V: family::Vector>(&self, name: &str, vec: V, labels: &[&str]) -> Family<V> {
        let kept: Vec<bool> = labels.iter().map(|label| FEW_VALUED_LABELS.contains(label)).collect();
        Family::new(vec, &kept, self.bound.clone(), self.dropped.with_label_values(&[name]))
    }

    fn counters(&self, name: &str, help: &str, labels: &[&str]) -> Result<Family<CounterVec>> {
        Ok(self.family(name, counters(self.registry, name, help, labels)?, labels))
    }

    fn gauges(&self, name: &str, help: &str, labels: &[&str]) -> Result<Family<IntGaugeVec>> {
        Ok(self.family(name, gauges(self.registry, name, help, labels)?, labels))
    }

    /// Gauges moved up and down on a request's path, never set.
    fn levels(&self, name: &str, help: &str, labels: &[&str]) -> Result<Family<LevelVec>> {
        let vec = LevelVec::new(Opts::new(name, help), labels).map_err(metric_error)?;
        Ok(self.family(name, registered(self.registry, vec)?, labels))
    }

    /// Gauges of fractional values.
    fn real_gauges(&self, name: &str, help: &str, labels: &[&str]) -> Result<Family<GaugeVec>> {
        let vec = GaugeVec::new(Opts::new(name, help), labels).map_err(metric_error)?;
        Ok(self.family(name, registered(self.registry, vec)?, labels))
    }

    fn histograms(&self, name: &str, help: &str, labels: &[&str]) -> Result<Family<HistogramVec>> {
        Ok(self.family(name, histograms(self.registry, name, help, labels)?, labels))
    }

    /// The families of per-backend and per-endpoint series.
    fn backends(&self) -> Result<BackendFamilies> {
        Ok(BackendFamilies {
            upstream_duration: self.histograms(
                "oipgate_upstream_duration_seconds",
                "Backend calls, from sending to the whole answer, by backend.",
                &["backend"],
            )?,
            in_flight: self.levels(
                "oipgate_in_flight",
                "Backend calls under way, by backend.",
                &["backend"],
            )?,
            retries: self.counters(
                "oipgate_retries_total",
                "Calls sent again to another endpoint of a backend because the first could not be reached.",
                &["backend"],
            )?,
            endpoint_healthy: self.gauges(
                "oipgate_endpoint_healthy",
                "1 when a backend endpoint may take calls (passing its health checks, not ejected), else 0.",
                &["backend", "endpoint"],
            )?,
            load_scrapes: self.counters(
                "oipgate_load_scrapes_total",
                "Scrapes of backend endpoints' own metrics (a backend's `load`), by result: ok or error (no answer \
                 in time, too large, not the exposition format).",
                &["backend", "result"],
            )?,
            endpoint_queue: self.real_gauges(
                "oipgate_endpoint_queue",
                "The queue an endpoint's own metrics reported at its last good scrape, summed over its models.",
                &["backend", "endpoint"],
            )?,
            load_fallbacks: self.counters(
                "oipgate_load_fallbacks_total",
                "least_load choices made on the gateway's own calls under way, for want of a recent scrape.",
                &["backend"],
            )?,
        })
    }
}

impl ProtocolMetrics {
    /// Whole-request duration and bytes, for each client protocol.
    fn all(registry: &Registry) -> Result<[ProtocolMetrics; 2]> {
        let duration = histograms(
            registry,
            "oipgate_request_duration_seconds",
            "Whole requests, from the first byte read to the last written, by client protocol.",
            &["protocol"],
        )?;
        let request_bytes = counters(
            registry,
            "oipgate_request_bytes_total",
            "Request body bytes received, by client protocol.",
            &["protocol"],
        )?;
        let response_bytes = counters(
            registry,
            "oipgate_response_bytes_total",
            "Response body bytes sent, by client protocol.",
            &["protocol"],
        )?;
        Ok(ClientProtocol::ALL.map(|protocol| ProtocolMetrics {
            duration: duration.with_label_values(&[protocol.label()]),
            request_bytes: request_bytes.with_label_values(&[protocol.label()]),
            response_bytes: response_bytes.with_label_values(&[protocol.label()]),
        }))
    }
}

impl Metrics {
    /// The process's metrics, bounded to the default `[metrics] max_series` until a configuration says
    /// otherwise ([`Metrics::bound_series`]).
    pub fn new() -> Result<Arc<Metrics>> {
        let registry = Registry::new();
        register_build_info(&registry)?;
        let families = Families::new(&registry)?;
        let requests = Arc::new(families.counters(
            "oipgate_requests_total",
            "Inference requests by public model and version, client protocol, backend, HTTP status and principal \
             (a configured API key's name, else _other).",
            &["model", "version", "protocol", "backend", "code", "principal"],
        )?);
        let mirrors = Arc::new(families.counters(
            "oipgate_mirror_requests_total",
            "Copies of requests mirrored to a version, by result: ok, error, or shed (not sent, too many under way).",
            &["model", "version", "result"],
        )?);
        let auth_denied = counters(
            &registry,
            "oipgate_auth_denied_total",
            "Calls refused for their credential: missing, invalid, or forbidden (a model or admin call not allowed).",
            &["reason"],
        )?;
        let rate_limited = counters(
            &registry,
            "oipgate_rate_limited_total",
            "Calls refused with 429 by scope: a principal's or a model's rate limit, a principal's or a model's \
             spent token budget (principal_tokens, model_tokens), a model's max_concurrent, or its max_queue (queue).",
            &["scope"],
        )?;
        let models_under_way = gauges(
            &registry,
            "oipgate_model_calls_under_way",
            "Calls under way of each public model held to a max_concurrent, read as the metrics are scraped: a call \
             holds its place from its admission until it ends.",
            &["model"],
        )?;
        let translation = histograms(
            &registry,
            "oipgate_translation_duration_seconds",
            "Time spent translating one message between REST (JSON or binary extension) and gRPC, by direction.",
            &["direction"],
        )?;
        let reloads = counters(
            &registry,
            "oipgate_config_reloads_total",
            "Configuration reloads, by result: ok (applied) or error (refused; the running configuration stays).",
            &["result"],
        )?;
        let spans = counters(
            &registry,
            "oipgate_spans_total",
            "Finished trace spans, by result: exported, failed (the collector refused or could not be reached) or \
             dropped (the export queue, [tracing] max_queue, was full).",
            &["result"],
        )?;
        let payload_events = counters(
            &registry,
            "oipgate_payload_log_events_total",
            "Inference payload events for [payload_log]'s sink, by result: sent, failed (after its retries), dropped \
             (the queue, [payload_log] max_queue, was full) or too_large (a stream's answer whose events passed what \
             is gathered for the log: 4 MiB a stream, 64 MiB across streams).",
            &["result"],
        )?;
        let connections_refused = counters(
            &registry,
            "oipgate_connections_refused_total",
            "Connections closed as they were accepted, by listener (rest, grpc, metrics): the listener already held \
             [limits] max_connections.",
            &["listener"],
        )?;
        let access_log_dropped = registered(
            &registry,
            Counter::new(
                "oipgate_access_log_dropped_total",
                "Access-log lines dropped because the lines waiting for the log's writer already filled \
                 --log-buffer-bytes (the log's file or stderr was slower than the requests).",
            )
            .map_err(metric_error)?,
        )?;
        Ok(Arc::new(Metrics {
            bound: families.bound.clone(),
            access_log_dropped,
            spans,
            payload_events,
            connections_refused,
            unknown_route: RouteMetrics::new(&requests, &mirrors, [UNKNOWN, UNKNOWN, NO_BACKEND], 0),
            requests,
            auth_denied,
            rate_limited,
            models_under_way: (models_under_way, std::sync::Mutex::default()),
            mirrors,
            backends: Arc::new(families.backends()?),
            protocols: ProtocolMetrics::all(&registry)?,
            translation: Direction::ALL.map(|direction| translation.with_label_values(&[direction.label()])),
            reloads: ["ok", "error"].map(|result| reloads.with_label_values(&[result])),
            streams: StreamMetrics::new(&families)?,
            epp: EppMetrics::new(&families)?,
            shared_limits: shared_limits::SharedLimitMetrics::new(&registry)?,
            registry,
        }))
    }

    /// Bounds every family to `max` series (a configuration's `[metrics] max_series`); series made already stay.
    pub fn bound_series(&self, max: usize) {
        self.bound.set(max);
    }

    /// The handles for one public model version served by `backend`; its series are made at first use.
    /// `principals` is how many configured principals are counted under their own names.
    pub fn route(&self, model: &str, version: &str, backend: &str, principals: usize) -> Arc<RouteMetrics> {
        RouteMetrics::new(&self.requests, &self.mirrors, [model, version, backend], principals)
    }

    /// The handles for requests that named no configured model or version.
    pub fn unknown_route(&self) -> Arc<RouteMetrics> {
        self.unknown_route.clone()
    }

    /// The handles for one backend; its series are made at its first call.
    pub fn backend(&self, name: &str) -> BackendMetrics {
        BackendMetrics(ThreadShared::new(Arc::new(BackendSeries {
            name: name.to_owned(),
            families: self.backends.clone(),
            in_flight: OnceLock::new(),
            retries: OnceLock::new(),
        })))
    }

    /// `oipgate_spans_total` of spans exported and of spans that failed to be.
    pub fn spans_exported(&self) -> (Counter, Counter) {
        (
            self.spans.with_label_values(&["exported"]),
            self.spans.with_label_values(&["failed"]),
        )
    }

    /// `oipgate_spans_total` of spans dropped, the export queue full.
    pub fn spans_dropped(&self) -> Counter {
        self.spans.with_label_values(&["dropped"])
    }

    /// `oipgate_connections_refused_total` of `listener`.
    pub fn connections_refused(&self, listener: &str) -> Counter {
        self.connections_refused.with_label_values(&[listener])
    }

    /// `oipgate_payload_log_events_total` for `result`: sent, failed, dropped or too_large.
    pub fn payload_events(&self, result: &str) -> Counter {
        self.payload_events.with_label_values(&[result])
    }

    /// `oipgate_load_fallbacks_total` of `backend`.
    pub fn load_fallbacks(&self, backend: &str) -> Counter {
        self.backends.load_fallbacks.series(&[backend])
    }

    /// Records a scrape of an endpoint's metrics: the queue it reported, or a failure.
    pub fn scraped(&self, backend: &str, endpoint: &str, queue: Option<f64>) {
        let result = if queue.is_some() { "ok" } else { "error" };
        self.backends.load_scrapes.series(&[backend, result]).inc();
        if let Some(queue) = queue {
            self.backends.endpoint_queue.series(&[backend, endpoint]).set(queue);
        }
    }

    /// The health gauge of one endpoint of `backend`, set to 1 (an endpoint starts healthy).
    pub fn endpoint_healthy(&self, backend: &str, endpoint: &str) -> IntGauge {
        let gauge = self.backends.endpoint_healthy.series(&[backend, endpoint]);
        gauge.set(1);
        gauge
    }

    /// Records a finished request and writes its access-log line; `route` is `None` for requests that were not
    /// inferences.
    pub fn finished(&self, route: Option<&RouteMetrics>, request: &Finished<'_>) {
        let protocol = &self.protocols[request.protocol.index()];
        protocol.duration.observe(request.duration.as_secs_f64());
        protocol.request_bytes.inc_by(request.request_bytes);
        protocol.response_bytes.inc_by(request.response_bytes);
        if let Some(route) = route {
            route.count(request.protocol, request.status, request.principal);
        }
        crate::telemetry::logging::access(
            route.map(|route| RouteNames {
                model: &route.model,
                version: &route.version,
                backend: &route.backend,
            }),
            request,
        );
    }

    /// Counts a call refused for its credential.
    pub fn auth_denied(&self, reason: &str) {
        self.auth_denied.with_label_values(&[reason]).inc();
    }

    /// Counts a call refused by a rate limit or a bound on calls under way.
    pub fn rate_limited(&self, limit: &str) {
        self.rate_limited.with_label_values(&[limit]).inc();
    }

    /// Sets the gauges of calls under way to `counts`, by model; a model not among them (no longer held to a
    /// `max_concurrent`) loses its series.
    pub fn models_under_way<'a>(&self, counts: impl Iterator<Item = (&'a str, u32)>) {
        let (gauges, published) = &self.models_under_way;
        let mut published = published.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = std::mem::take(&mut *published);
        for (model, count) in counts {
            gauges.with_label_values(&[model]).set(i64::from(count));
            published.insert(model.to_owned());
        }
        // A set: ten thousand bounded models are looked up once each, not against each other.
        for gone in before.iter().filter(|model| !published.contains(*model)) {
            let _ = gauges.remove_label_values(&[gone]);
        }
    }

    /// Records one message translated between the protocols.
    pub fn translated(&self, direction: Direction, took: Duration) {
        self.translation[direction.index()].observe(took.as_secs_f64());
    }

    /// Counts one decision of a shared limit.
    pub fn shared_limit_call(&self, limit: SharedLimit, decided: SharedDecision) {
        self.shared_limits.call(limit, decided);
    }

    /// Records how long Redis took to answer one of the shared limits' calls.
    pub fn shared_limit_redis(&self, operation: &str, took: Duration) {
        self.shared_limits.redis(operation, took);
    }

    /// Counts one of the shared limits' calls to Redis that failed or was not answered in time.
    pub fn shared_limit_redis_unanswered(&self, operation: &str) {
        self.shared_limits.unanswered(operation);
    }

    /// Whether the shared limits reach Redis (else they fall back to `when_unreachable`), and the replicas seen.
    pub fn shared_limits_state(&self, when_unreachable: &str, reachable: bool, replicas: u32) {
        self.shared_limits.state(when_unreachable, reachable, replicas);
    }

    /// Counts a configuration reload, applied or refused.
    pub fn reloaded(&self, ok: bool) {
        self.reloads[usize::from(!ok)].inc();
    }

    /// Drops the series of model versions and backends a new configuration no longer has, so that a fleet whose
    /// models come and go does not fill `max_series` with series nothing counts any more. The `_other` and
    /// `_unknown` series stay.
    pub fn forget_removed(&self, serves: impl Fn(&str, &str) -> bool, has_backend: impl Fn(&str) -> bool) {
        let fixed = |value: &str| value == family::OTHER || value == UNKNOWN || value == NO_BACKEND;
        let model_version = |values: &[String]| fixed(&values[0]) || serves(&values[0], &values[1]);
        // oipgate_requests_total: model, version, protocol, backend, code, principal.
        self.requests
            .retain(|values| model_version(values) && (fixed(&values[3]) || has_backend(&values[3])));
        self.mirrors.retain(model_version);
        self.streams.retain(&model_version);
        self.epp.retain(&model_version);
        let backend = |values: &[String]| fixed(&values[0]) || has_backend(&values[0]);
        let families = &self.backends;
        families.in_flight.retain(backend);
        families.upstream_duration.retain(backend);
        families.retries.retain(backend);
        families.load_scrapes.retain(backend);
        families.load_fallbacks.retain(backend);
    }

    /// Drops the health series of an endpoint no longer configured or discovered.
    pub fn forget_endpoint(&self, backend: &str, endpoint: &str) {
        self.backends.endpoint_healthy.forget(&[backend, endpoint]);
        self.backends.endpoint_queue.forget(&[backend, endpoint]);
    }

    /// The registry in Prometheus' text exposition format.
    pub fn render(&self) -> String {
        // The writer counts for the whole process; the counter catches up with it as it is read, one reader at a
        // time so none adds what another just did.
        static CATCHING_UP: std::sync::Mutex<()> = std::sync::Mutex::new(());
        {
            let _one = CATCHING_UP.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let dropped = crate::telemetry::log_writer::dropped();
            self.access_log_dropped
                .inc_by(dropped.saturating_sub(self.access_log_dropped.get()));
        }
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_else(|e| format!("# metrics could not be encoded: {e}\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_under_way_keep_series_of_the_models_published_last() {
        let metrics = Metrics::new().unwrap();
        metrics.models_under_way([("a", 2), ("b", 0)].into_iter());
        let text = metrics.render();
        assert!(text.contains(r#"oipgate_model_calls_under_way{model="a"} 2"#), "{text}");
        assert!(text.contains(r#"oipgate_model_calls_under_way{model="b"} 0"#), "{text}");
        metrics.models_under_way([("b", 1)].into_iter());
        let text = metrics.render();
        assert!(!text.contains(r#"model="a""#), "{text}");
        assert!(text.contains(r#"oipgate_model_calls_under_way{model="b"} 1"#), "{text}");
    }

    #[test]
    fn handles_count_under_configured_labels_only() {
        let metrics = Metrics::new().unwrap();
        let route = metrics.route("add_sub", "1", "fleet-a", 0);
        let finished = |status| Finished {
            protocol: ClientProtocol::Grpc,
            status,
            duration: Duration::from_millis(3),
            ended: std::time::Instant::now(),
            request_bytes: 10,
            response_bytes: 20,
            target: "ModelInfer",
            request_id: None,
            endpoint: None,
            translated: false,
            principal: None,
        };
        metrics.finished(Some(&route), &finished(200));
        metrics.finished(Some(&route), &finished(200));
        metrics.finished(Some(&route), &finished(418));
        metrics.finished(Some(&metrics.unknown_route()), &finished(404));
        let text = metrics.render();
        for line in [
            r#"oipgate_requests_total{backend="fleet-a",code="200",model="add_sub",principal="_other",protocol="grpc",version="1"} 2"#,
            r#"oipgate_requests_total{backend="fleet-a",code="other",model="add_sub",principal="_other",protocol="grpc",version="1"} 1"#,
            r#"oipgate_requests_total{backend="_none",code="404",model="_unknown",principal="_other",protocol="grpc",version="_unknown"} 1"#,
            r#"oipgate_request_bytes_total{protocol="grpc"} 40"#,
            r#"oipgate_request_duration_seconds_count{protocol="grpc"} 4"#,
            r#"oipgate_build_info{version=""#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        let backend = metrics.backend("fleet-a");
        let call = backend.call();
        assert!(metrics.render().contains(r#"oipgate_in_flight{backend="fleet-a"} 1"#));
        drop(call);
        assert!(metrics.render().contains(r#"oipgate_in_flight{backend="fleet-a"} 0"#));
    }

    /// A call ended at a reading its caller shares records the time up to that reading, once, and the record ended
    /// at the same reading reports the same end.
    #[test]
    fn a_call_and_a_request_ended_at_one_reading_time_up_to_it() {
        let metrics = Metrics::new().unwrap();
        let call = metrics.backend("fleet-a").call();
        let before = std::time::Instant::now();
        let mut record = crate::telemetry::record::RequestRecord::open(
            crate::runtime::ThreadArc::new(metrics.clone()),
            ClientProtocol::Rest,
            crate::telemetry::record::Target::Unknown,
        );
        let after = std::time::Instant::now();
        let ended = call.started() + Duration::from_millis(250);
        call.end_at(ended);
        // Two seconds after the record began: its duration is that, where a record that read the clock itself would
        // report next to nothing. Its start lies between `before` and `after`, so its duration between these.
        let end = after + Duration::from_secs(2);
        record.end_at(end);
        drop(record);
        let (least, most) = ((end - after).as_secs_f64(), (end - before).as_secs_f64());
        let text = metrics.render();
        for line in [
            r#"oipgate_upstream_duration_seconds_sum{backend="fleet-a"} 0.25"#,
            r#"oipgate_upstream_duration_seconds_count{backend="fleet-a"} 1"#,
            r#"oipgate_in_flight{backend="fleet-a"} 0"#,
            r#"oipgate_request_duration_seconds_count{protocol="rest"} 1"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        let sum = text
            .lines()
            .find_map(|line| line.strip_prefix(r#"oipgate_request_duration_seconds_sum{protocol="rest"} "#))
            .and_then(|sum| sum.parse::<f64>().ok())
            .expect("the request's duration");
        // The rendered sum is rounded to f64's shortest form: a nanosecond either way.
        assert!(
            least - 1e-9 <= sum && sum <= most + 1e-9,
            "{sum} not within {least}..={most}"
        );
    }
}
