//! The handles a route and a backend keep: their series, each made at its first use and kept, so a request
//! increments a counter it already holds.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use prometheus::{GaugeVec, IntGaugeVec};

use super::sharded::{Counter, CounterVec, Histogram, HistogramVec, Level, LevelVec};

use super::family::Family;
use super::{CODE_LABELS, CODES, OTHER_PRINCIPAL};
use crate::runtime::{ThreadArc, ThreadShared};
use crate::telemetry::{ClientProtocol, ReportedPrincipal};

/// `oipgate_requests_total` and `oipgate_mirror_requests_total` for one public model version and its backend. The
/// series are made when first used (a route never called adds none), then kept here, so a request's count is one
/// increment with no label formatting or lookup.
#[derive(Debug)]
pub struct RouteMetrics {
    /// The public model, version and backend, for access logs and the series' labels.
    pub model: String,
    pub version: String,
    pub backend: String,
    pub(super) requests: Arc<Family<CounterVec>>,
    pub(super) mirrors: Arc<Family<CounterVec>>,
    /// Allocated at the route's first request: most routes of a large fleet are never called.
    pub(super) series: OnceLock<Box<RouteSeries>>,
    /// How many configured principals (API keys) are counted under their own names.
    pub(super) principals: usize,
}

/// Request counters by client protocol, then by [`CODE_LABELS`] position.
pub(super) type RequestSeries = [[OnceLock<Counter>; CODE_LABELS.len()]; 2];

/// A route's series, each made on first use.
#[derive(Debug, Default)]
pub(super) struct RouteSeries {
    /// Requests of no configured principal.
    pub(super) requests: RequestSeries,
    /// By [`MirrorResult`] position.
    pub(super) mirrors: [OnceLock<Counter>; 3],
    /// Requests of each configured principal, by its key's position; allocated at the first of them.
    pub(super) principals: OnceLock<Box<[OnceLock<Box<RequestSeries>>]>>,
}

/// What became of a mirrored copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorResult {
    Ok,
    Error,
    /// Not sent: too many mirrored calls were under way.
    Shed,
}

impl MirrorResult {
    const ALL: [MirrorResult; 3] = [MirrorResult::Ok, MirrorResult::Error, MirrorResult::Shed];

    fn label(self) -> &'static str {
        match self {
            MirrorResult::Ok => "ok",
            MirrorResult::Error => "error",
            MirrorResult::Shed => "shed",
        }
    }
}

impl RouteMetrics {
    /// The handles of the public `[model, version, backend]`, none made yet; `principals` configured principals are
    /// counted under their own names.
    pub(super) fn new(
        requests: &Arc<Family<CounterVec>>,
        mirrors: &Arc<Family<CounterVec>>,
        [model, version, backend]: [&str; 3],
        principals: usize,
    ) -> Arc<RouteMetrics> {
        Arc::new(RouteMetrics {
            model: model.to_owned(),
            version: version.to_owned(),
            backend: backend.to_owned(),
            requests: requests.clone(),
            mirrors: mirrors.clone(),
            series: OnceLock::new(),
            principals,
        })
    }

    fn series(&self) -> &RouteSeries {
        self.series.get_or_init(Box::default)
    }

    /// Counts a copy mirrored to this version.
    pub fn mirrored(&self, result: MirrorResult) {
        let index = MirrorResult::ALL.iter().position(|&r| r == result).unwrap_or(0);
        self.series().mirrors[index]
            .get_or_init(|| self.mirrors.series(&[&self.model, &self.version, result.label()]))
            .inc();
    }

    /// Counts a request of `protocol` answered with `status`, under `principal` when it is a configured one.
    pub(super) fn count(&self, protocol: ClientProtocol, status: u16, principal: Option<&dyn ReportedPrincipal>) {
        let index = CODES.iter().position(|&code| code == status).unwrap_or(CODES.len());
        let make = |name: &str| {
            self.requests.series(&[
                &self.model,
                &self.version,
                protocol.label(),
                &self.backend,
                CODE_LABELS[index],
                name,
            ])
        };
        let series = self.series();
        let Some(principal) = principal.filter(|p| p.counted().is_some()) else {
            series.requests[protocol.index()][index]
                .get_or_init(|| make(OTHER_PRINCIPAL))
                .inc();
            return;
        };
        let slots = series
            .principals
            .get_or_init(|| (0..self.principals).map(|_| OnceLock::new()).collect());
        match principal.counted().and_then(|position| slots.get(position)) {
            Some(slot) => slot.get_or_init(Box::default)[protocol.index()][index]
                .get_or_init(|| make(principal.name()))
                .inc(),
            // The route of an unknown model, or a principal of another configuration than the route's: found by its
            // labels.
            None => make(principal.name()).inc(),
        }
    }
}

/// A backend's in-flight gauge, upstream latency and retries, made at its first call; a call holds the series
/// through its thread's handle.
#[derive(Debug)]
pub struct BackendMetrics(pub(super) ThreadShared<BackendSeries>);

#[derive(Debug)]
pub(super) struct BackendSeries {
    pub(super) name: String,
    pub(super) families: Arc<BackendFamilies>,
    pub(super) in_flight: OnceLock<(Level, Histogram)>,
    pub(super) retries: OnceLock<Counter>,
}

/// The families of per-backend series.
#[derive(Debug)]
pub(super) struct BackendFamilies {
    pub(super) in_flight: Family<LevelVec>,
    pub(super) upstream_duration: Family<HistogramVec>,
    pub(super) retries: Family<CounterVec>,
    pub(super) endpoint_healthy: Family<IntGaugeVec>,
    /// `least_load`: scrapes of endpoints' metrics by result, the queue each last reported, and the choices made
    /// without a recent scrape.
    pub(super) load_scrapes: Family<CounterVec>,
    pub(super) endpoint_queue: Family<GaugeVec>,
    pub(super) load_fallbacks: Family<CounterVec>,
}

impl BackendMetrics {
    /// Counts a call sent again to another endpoint after the first could not be reached.
    pub fn retried(&self) {
        let series = &self.0;
        series
            .retries
            .get_or_init(|| series.families.retries.series(&[&series.name]))
            .inc();
    }

    /// Counts a call as in flight until the returned guard is dropped (answered, failed or cancelled).
    pub fn call(&self) -> InFlight {
        let series = &self.0;
        let (gauge, _) = series.in_flight();
        gauge.inc();
        InFlight {
            // The backend's series whole, not its gauge and histogram: one reference counted, not two.
            series: series.handle(),
            started: Instant::now(),
            ended: false,
        }
    }
}

impl BackendSeries {
    /// The in-flight gauge and the upstream latency, made at the first call.
    fn in_flight(&self) -> &(Level, Histogram) {
        self.in_flight.get_or_init(|| {
            (
                self.families.in_flight.series(&[&self.name]),
                self.families.upstream_duration.series(&[&self.name]),
            )
        })
    }
}

/// One backend call in flight; its end is recorded when dropped.
#[derive(Debug)]
pub struct InFlight {
    pub(super) series: ThreadArc<BackendSeries>,
    pub(super) started: Instant,
    /// Recorded already, by [`InFlight::end_at`].
    pub(super) ended: bool,
}

impl InFlight {
    /// When the call began.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Ends the call at `at`, a clock reading the caller shares with the request's other ends (dropped, it reads
    /// the clock itself).
    pub fn end_at(mut self, at: Instant) {
        self.record(at);
        self.ended = true;
    }

    fn record(&self, at: Instant) {
        let (gauge, duration) = self.series.in_flight();
        gauge.dec();
        duration.observe(at.saturating_duration_since(self.started).as_secs_f64());
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.ended {
            self.record(Instant::now());
        }
    }
}
