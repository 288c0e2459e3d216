//! The replicas of each backend as the gateway sees them: their health (probed and observed), their load, and the
//! choice of one for each call, with admission (bounded wait, then refusal) and the retry budget.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{BackendPolicy, LoadBalancing};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::protocol::Sequence;
use crate::routing::Affinity;
use crate::runtime::{ThreadArc, ThreadShared};
use arc_swap::ArcSwapOption;
use prometheus::IntGauge;
use prometheus::core::Atomic;

use crate::telemetry::metrics::{Counter, PerThreadCount};

/// Retries allowed beyond this share of a backend's calls are refused (plus a small floor so a quiet backend can
/// still retry).
const RETRY_BUDGET_SHARE: f64 = 0.2;
const RETRY_BUDGET_FLOOR: u64 = 10;

/// One replica's observed state.
#[derive(Debug)]
pub struct EndpointState {
    /// `host:port`; shared, as every answer's record names it.
    pub authority: ThreadShared<str>,
    in_flight: AtomicUsize,
    /// Set by active health checks; true when none are configured.
    probe_healthy: AtomicBool,
    good_probes: AtomicU32,
    bad_probes: AtomicU32,
    /// Models (upstream name and version) whose ready check failed at this endpoint.
    not_ready: RwLock<HashSet<(String, String)>>,
    /// `not_ready` holds some: read first, so a call to an endpoint with every model ready takes no lock.
    any_not_ready: AtomicBool,
    consecutive_failures: AtomicU32,
    ejections: AtomicU32,
    /// While set, the endpoint gets no calls: until the instant passes and, with health checks, a probe succeeds.
    ejected_until: Mutex<Option<Instant>>,
    /// `ejected_until` is set (written with it, under its lock): read first, so a call to an endpoint never ejected
    /// takes no lock. Each lock is two atomic read-modify-writes, and several of a call's steps ask.
    ejected: AtomicBool,
    /// Calls allowed under way, when limited, and calls waiting for one.
    slots: Option<Arc<Semaphore>>,
    waiting: AtomicUsize,
    max_in_flight: usize,
    health_checked: bool,
    /// `oipgate_endpoint_healthy` for this endpoint.
    healthy_gauge: IntGauge,
    /// What the endpoint's own metrics said of its queue at the last good scrape (`load`).
    scraped: ArcSwapOption<Scraped>,
    /// Calls sent to it since that scrape and still under way: what the scrape could not count.
    sent_since_scrape: AtomicUsize,
    /// Moved on by each good scrape, so a call sent before one is not taken off the count after it.
    scrape_generation: AtomicU64,
    /// Its calls over the last minute, for the status page.
    window: super::window::Window,
}

/// An endpoint as the status page shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EndpointStatus {
    pub endpoint: String,
    /// It may take calls.
    pub available: bool,
    /// Why not, when it may not.
    pub why: Option<String>,
    pub in_flight: usize,
    /// The queue its metrics last reported (summed over models), and how many milliseconds ago.
    pub queue: Option<f64>,
    pub queue_age_ms: Option<u64>,
    /// That report is too old to balance on.
    pub queue_stale: bool,
    pub last_minute: super::window::Summary,
}

/// One good scrape of an endpoint's metrics.
#[derive(Debug)]
pub struct Scraped {
    pub at: Instant,
    pub reported: crate::codec::exposition::Reported,
}

impl EndpointState {
    pub fn new(authority: String, policy: &BackendPolicy, healthy_gauge: IntGauge) -> EndpointState {
        let max_in_flight = policy.max_in_flight.map_or(usize::MAX, |n| n as usize);
        EndpointState {
            authority: authority.as_str().into(),
            in_flight: AtomicUsize::new(0),
            probe_healthy: AtomicBool::new(true),
            good_probes: AtomicU32::new(0),
            bad_probes: AtomicU32::new(0),
            not_ready: RwLock::new(HashSet::new()),
            any_not_ready: AtomicBool::new(false),
            consecutive_failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejected_until: Mutex::new(None),
            ejected: AtomicBool::new(false),
            slots: policy.max_in_flight.map(|n| Arc::new(Semaphore::new(n as usize))),
            waiting: AtomicUsize::new(0),
            max_in_flight,
            health_checked: policy.health.is_some(),
            healthy_gauge,
            scraped: ArcSwapOption::empty(),
            sent_since_scrape: AtomicUsize::new(0),
            scrape_generation: AtomicU64::new(0),
            window: super::window::Window::default(),
        }
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The ejection, locked.
    fn ejection(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.ejected_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sets or ends the ejection, held locked, and the flag read before the lock.
    fn eject(&self, held: &mut std::sync::MutexGuard<'_, Option<Instant>>, until: Option<Instant>) {
        **held = until;
        self.ejected.store(until.is_some(), Ordering::Release);
    }

    /// What the status page shows of it; a scrape older than `fresh` is stale.
    pub fn status(&self, fresh: std::time::Duration) -> EndpointStatus {
        let available = self.is_available();
        let why = if available {
            None
        } else if !self.probe_healthy.load(Ordering::Relaxed) {
            Some("failing its health checks".to_owned())
        } else {
            let until = *self.ejection();
            let left = until.map_or(0, |until| until.saturating_duration_since(Instant::now()).as_millis());
            Some(format!(
                "ejected after {} failed calls in a row ({left} ms of its cool-down left)",
                self.consecutive_failures.load(Ordering::Relaxed).max(1)
            ))
        };
        let scraped = self.last_scrape();
        EndpointStatus {
            endpoint: self.authority.to_string(),
            available,
            why,
            in_flight: self.in_flight(),
            queue: scraped.as_ref().map(|s| s.reported.total),
            queue_age_ms: scraped
                .as_ref()
                .map(|s| u64::try_from(s.at.elapsed().as_millis()).unwrap_or(u64::MAX)),
            queue_stale: scraped.as_ref().is_some_and(|s| s.at.elapsed() > fresh),
            last_minute: self.window.summary(),
        }
    }

    /// Records a good scrape of its metrics; the calls sent since the previous one are in it now.
    pub fn scraped(&self, reported: crate::codec::exposition::Reported) {
        self.scrape_generation.fetch_add(1, Ordering::AcqRel);
        self.sent_since_scrape.store(0, Ordering::Relaxed);
        self.scraped.store(Some(Arc::new(Scraped {
            at: Instant::now(),
            reported,
        })));
    }

    /// The last good scrape, if any.
    pub fn last_scrape(&self) -> Option<Arc<Scraped>> {
        self.scraped.load_full()
    }

    /// The queue of the backend's model `model` at this endpoint: what its metrics said, plus the calls sent since;
    /// `None` when it has no scrape younger than `fresh`.
    /// With it, the tie-break the metrics reported.
    fn load(&self, model: &str, fresh: std::time::Duration) -> Option<(f64, f64)> {
        let scraped = self.scraped.load();
        let scraped = scraped.as_ref().filter(|s| s.at.elapsed() <= fresh)?;
        #[allow(clippy::cast_precision_loss)]
        let sent = self.sent_since_scrape.load(Ordering::Relaxed) as f64;
        Some((scraped.reported.of(model) + sent, scraped.reported.tie_break))
    }

    /// Healthy by its probes and not ejected (a passed cool-down counts as returned when nothing probes it). Also
    /// refreshes the endpoint's health gauge, so the gauge follows every probe and every choice of endpoint.
    pub fn is_available(&self) -> bool {
        let available = self.probe_healthy.load(Ordering::Relaxed)
            && (!self.ejected.load(Ordering::Acquire)
                || match *self.ejection() {
                    None => true,
                    Some(until) => !self.health_checked && Instant::now() >= until,
                });
        self.healthy_gauge.set(i64::from(available));
        available
    }

    /// Whether the endpoint's last probe found `model` at `version` ready (true until a probe says otherwise).
    pub fn serves(&self, model: &str, version: &str) -> bool {
        if !self.any_not_ready.load(Ordering::Acquire) {
            return true;
        }
        let not_ready = self.not_ready.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        not_ready.is_empty() || !not_ready.contains(&(model.to_owned(), version.to_owned()))
    }

    /// Records one active probe: the server-ready answer and which models were not ready.
    pub fn probed(&self, healthy: bool, not_ready: HashSet<(String, String)>, policy: &BackendPolicy) {
        let Some(health) = policy.health else { return };
        {
            let mut held = self
                .not_ready
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.any_not_ready.store(!not_ready.is_empty(), Ordering::Release);
            *held = not_ready;
        }
        if healthy {
            self.bad_probes.store(0, Ordering::Relaxed);
            let good = self.good_probes.fetch_add(1, Ordering::Relaxed) + 1;
            if good >= health.healthy_after {
                self.probe_healthy.store(true, Ordering::Relaxed);
            }
            // An ejected endpoint returns after its cool-down and a good probe.
            let mut ejected = self.ejection();
            if ejected.is_some_and(|until| Instant::now() >= until) {
                self.eject(&mut ejected, None);
                self.consecutive_failures.store(0, Ordering::Relaxed);
            }
        } else {
            self.good_probes.store(0, Ordering::Relaxed);
            let bad = self.bad_probes.fetch_add(1, Ordering::Relaxed) + 1;
            if bad >= health.unhealthy_after {
                self.probe_healthy.store(false, Ordering::Relaxed);
            }
        }
        self.is_available();
    }

    /// Records a call's outcome for outlier detection; `failed` is a connection failure, 5xx or UNAVAILABLE.
    pub fn observed(&self, failed: bool, policy: &BackendPolicy) {
        if !failed {
            // Read first: a store on every call would take the line from the other threads' cores each time.
            if self.consecutive_failures.load(Ordering::Relaxed) != 0 {
                self.consecutive_failures.store(0, Ordering::Relaxed);
            }
            // A success after the cool-down ends an ejection (calls reach it when nothing probes it).
            if !self.ejected.load(Ordering::Acquire) {
                return;
            }
            let mut ejected = self.ejection();
            if ejected.is_some_and(|until| Instant::now() >= until) {
                self.eject(&mut ejected, None);
                drop(ejected);
                self.is_available();
            }
            return;
        }
        let failures = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= policy.outlier.consecutive_failures {
            let mut ejected = self.ejection();
            if ejected.is_none_or(|until| Instant::now() >= until) {
                let times = self.ejections.fetch_add(1, Ordering::Relaxed).min(16);
                let cool_down = policy
                    .outlier
                    .base_ejection
                    .saturating_mul(1 << times)
                    .min(policy.outlier.max_ejection);
                self.eject(&mut ejected, Some(Instant::now() + cool_down));
                self.consecutive_failures.store(0, Ordering::Relaxed);
                self.healthy_gauge.set(0);
            }
        }
    }
}

/// A call holding its place at an endpoint: counted in flight (and holding a slot when limited) until dropped.
#[derive(Debug)]
pub struct Lease {
    pub index: usize,
    /// Through this thread's handle on it.
    pub state: ThreadArc<EndpointState>,
    _permit: Option<OwnedSemaphorePermit>,
    /// The endpoint's scrape generation when the call was sent.
    generation: u64,
    started: Instant,
}

impl Lease {
    /// When the call at the endpoint began.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Records the call's outcome: for outlier detection (`failed` is a connection failure, 5xx or UNAVAILABLE)
    /// and the endpoint's last minute.
    pub fn observed(&self, failed: bool, policy: &BackendPolicy) {
        self.state.observed(failed, policy);
        let now = Instant::now();
        self.state
            .window
            .record(failed, now.saturating_duration_since(self.started), now);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
        if self.state.scrape_generation.load(Ordering::Acquire) == self.generation {
            let _ = self
                .state
                .sent_since_scrape
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }
}

/// A backend's endpoints and how calls are spread over them.
#[derive(Debug)]
pub struct Endpoints {
    pub states: Vec<Arc<EndpointState>>,
    /// The states as the door threads' calls hold them, in the same order.
    handles: Vec<ThreadShared<EndpointState>>,
    pub policy: BackendPolicy,
    next: AtomicUsize,
    /// Counted on each call's own thread (a count every call writes, read only when a retry is weighed).
    calls: PerThreadCount,
    retries: AtomicU64,
    /// Counts `least_load` choices made on calls under way for want of a recent scrape.
    fallbacks: Option<Counter>,
}

impl Endpoints {
    /// Endpoints with the given states (some carried over from a previous configuration).
    pub fn from_states(
        states: Vec<Arc<EndpointState>>,
        policy: BackendPolicy,
        fallbacks: Option<Counter>,
    ) -> Endpoints {
        Endpoints {
            handles: states.iter().map(|state| ThreadShared::new(state.clone())).collect(),
            states,
            policy,
            next: AtomicUsize::new(0),
            calls: PerThreadCount::new(0),
            retries: AtomicU64::new(0),
            fallbacks,
        }
    }

    pub fn health_checked(&self) -> bool {
        self.policy.health.is_some()
    }

    /// Endpoints that may take a call for `model` at `version` now.
    fn eligible(&self, model: &str, version: &str, tried: &[usize]) -> Vec<usize> {
        (0..self.states.len())
            .filter(|i| !tried.contains(i))
            .filter(|&i| self.states[i].is_available() && self.states[i].serves(model, version))
            .collect()
    }

    /// The endpoints other than `picked` and those `excluded` that may take a call for `model` at `version` now.
    pub fn eligible_except(&self, model: &str, version: &str, excluded: &[usize], picked: usize) -> Vec<usize> {
        let mut eligible = self.eligible(model, version, excluded);
        eligible.retain(|&i| i != picked);
        eligible
    }

    /// An endpoint that may take calls (healthy and not ejected) and is `allowed`, whatever its models: the next in
    /// turn.
    pub fn any_available(&self, allowed: impl Fn(&str) -> bool) -> Option<usize> {
        let available: Vec<usize> = (0..self.states.len())
            .filter(|&i| self.states[i].is_available() && allowed(&self.states[i].authority))
            .collect();
        (!available.is_empty()).then(|| available[self.next.fetch_add(1, Ordering::Relaxed) % available.len()])
    }

    /// Counts a call in flight at endpoint `index` without taking a slot there: a call another proxy already sent
    /// (the endpoint it reported serving a call the gateway picked elsewhere).
    pub fn hold(&self, index: usize) -> Lease {
        let state = self.handles[index].handle();
        state.in_flight.fetch_add(1, Ordering::Relaxed);
        let generation = state.scrape_generation.load(Ordering::Acquire);
        state.sent_since_scrape.fetch_add(1, Ordering::Relaxed);
        Lease {
            index,
            state,
            _permit: None,
            generation,
            started: Instant::now(),
        }
    }

    /// Whether an endpoint other than those `tried` could take a call for `model` at `version`.
    pub fn has_untried(&self, model: &str, version: &str, tried: &[usize]) -> bool {
        !self.eligible(model, version, tried).is_empty()
    }

    /// Whether some endpoint could take a call for `model` at `version`.
    pub fn can_serve(&self, model: &str, version: &str) -> bool {
        !self.eligible(model, version, &[]).is_empty()
    }

    /// The shortest queue of `model` (the backend's name) among the endpoints that may take a call for it at
    /// `version`, when every one of them has a recent scrape reporting more than `max` waiting; `None` otherwise
    /// (one has room, one has not been read lately, or none can serve: refusing is then for others to do).
    pub fn queued_everywhere(&self, model: &str, version: &str, max: f64) -> Option<f64> {
        let fresh = self.policy.load.as_ref()?.interval * 3;
        let mut shortest: Option<f64> = None;
        for index in self.eligible(model, version, &[]) {
            let (queue, _) = self.states[index]
                .load(model, fresh)
                .filter(|(queue, _)| *queue > max)?;
            shortest = Some(shortest.map_or(queue, |s| s.min(queue)));
        }
        shortest
    }

    /// Why no endpoint can serve `model` at `version` now: how many endpoints fail their health checks, are
    /// ejected after failed calls, or do not have the model ready.
    pub fn why_unavailable(&self, model: &str, version: &str) -> String {
        if self.states.is_empty() {
            return "it has no endpoints (a backend found through DNS has none until its name resolves)".to_owned();
        }
        let (mut failing, mut ejected, mut not_ready) = (0, 0, 0);
        for state in &self.states {
            // An endpoint that answers its probes but has the model unloaded says so first: it is the likelier cause
            // (and is what makes a strict-readiness server report itself not ready).
            if !state.serves(model, version) {
                not_ready += 1;
            } else if !state.probe_healthy.load(Ordering::Relaxed) {
                failing += 1;
            } else if !state.is_available() {
                ejected += 1;
            }
        }
        let mut parts = Vec::new();
        if failing > 0 {
            parts.push(format!("{failing} failing health checks"));
        }
        if ejected > 0 {
            parts.push(format!("{ejected} ejected after failed calls"));
        }
        if not_ready > 0 {
            parts.push(format!("{not_ready} without the model ready"));
        }
        if parts.is_empty() {
            return "every endpoint is available".to_owned();
        }
        format!("of {} endpoints, {}", self.states.len(), parts.join(", "))
    }

    /// Chooses an endpoint for a call to `model` at `version` (the backend's names), skipping `tried`, and takes
    /// its place there: waits up to the queue timeout for a full endpoint, then refuses with 429 /
    /// RESOURCE_EXHAUSTED. With no eligible endpoint it fails at once with 503 / UNAVAILABLE. The call starts at
    /// `began` (a reading the caller took a moment ago) unless it waited for its place.
    pub async fn lease(
        &self,
        backend: &str,
        (model, version): (&str, &str),
        affinity: &Affinity,
        tried: &[usize],
        began: Option<Instant>,
    ) -> Result<Lease> {
        let index = match affinity {
            Affinity::Sequence(sequence) => self.sequence_endpoint(backend, model, version, sequence, tried)?,
            Affinity::Sticky(key) => self.choose(
                &self.eligible_or_refuse(backend, model, version, tried)?,
                model,
                Some(*key),
            ),
            Affinity::None => self.choose(&self.eligible_or_refuse(backend, model, version, tried)?, model, None),
        };
        let state = self.handles[index].handle();
        self.calls.inc_by(1);
        let mut began = began;
        let permit = match &state.slots {
            None => None,
            Some(slots) => Some(match slots.clone().try_acquire_owned() {
                Ok(permit) => permit,
                Err(_) => {
                    began = None;
                    // The wait is bounded in time and in waiters: at most as many as the endpoint's limit.
                    if state.waiting.fetch_add(1, Ordering::Relaxed) >= state.max_in_flight {
                        state.waiting.fetch_sub(1, Ordering::Relaxed);
                        return Err(overloaded(backend, &state.authority));
                    }
                    let waited = tokio::time::timeout(self.policy.queue_timeout, slots.clone().acquire_owned()).await;
                    state.waiting.fetch_sub(1, Ordering::Relaxed);
                    match waited {
                        Ok(Ok(permit)) => permit,
                        _ => return Err(overloaded(backend, &state.authority)),
                    }
                }
            }),
        };
        state.in_flight.fetch_add(1, Ordering::Relaxed);
        let generation = state.scrape_generation.load(Ordering::Acquire);
        state.sent_since_scrape.fetch_add(1, Ordering::Relaxed);
        Ok(Lease {
            index,
            state,
            _permit: permit,
            generation,
            started: began.unwrap_or_else(Instant::now),
        })
    }

    /// The endpoints that may take a call now, or the refusal saying why there are none.
    fn eligible_or_refuse(&self, backend: &str, model: &str, version: &str, tried: &[usize]) -> Result<Vec<usize>> {
        let eligible = self.eligible(model, version, tried);
        if !eligible.is_empty() {
            return Ok(eligible);
        }
        let why = if tried.is_empty() {
            self.why_unavailable(model, version)
        } else {
            format!("the {} tried could not be reached", tried.len())
        };
        Err(Error::new(
            ErrorKind::Unavailable,
            Origin::Gateway,
            format!("backend {backend} has no endpoint that can serve model '{model}' version '{version}': {why}"),
        ))
    }

    /// The endpoint of a sequence: the first of the backend's endpoints in the sequence's rendezvous order, chosen
    /// alike by every gateway with this configuration. While it cannot take calls the sequence's requests are
    /// refused, not sent to an endpoint that has none of its state; only a sequence's first request starts it over
    /// on the next endpoint in its order that can.
    fn sequence_endpoint(
        &self,
        backend: &str,
        model: &str,
        version: &str,
        sequence: &Sequence,
        tried: &[usize],
    ) -> Result<usize> {
        let key = sequence.endpoint_key(model, version);
        let mut ranked: Vec<usize> = (0..self.states.len()).collect();
        ranked.sort_by_cached_key(|&i| {
            std::cmp::Reverse(xxhash_rust::xxh3::xxh3_64_with_seed(
                self.states[i].authority.as_bytes(),
                key,
            ))
        });
        let usable =
            |i: usize| !tried.contains(&i) && self.states[i].is_available() && self.states[i].serves(model, version);
        let Some(&owner) = ranked.first() else {
            return Err(Error::new(
                ErrorKind::Unavailable,
                Origin::Gateway,
                format!("backend {backend} has no endpoints"),
            ));
        };
        if usable(owner) {
            return Ok(owner);
        }
        if sequence.start
            && let Some(&next) = ranked.iter().find(|&&i| usable(i))
        {
            return Ok(next);
        }
        let state = &self.states[owner];
        let why = if tried.contains(&owner) {
            "could not be reached"
        } else if !state.serves(model, version) {
            "does not have the model ready"
        } else if !state.probe_healthy.load(Ordering::Relaxed) {
            "is failing its health checks"
        } else {
            "is ejected after failed calls"
        };
        Err(Error::new(
            ErrorKind::Unavailable,
            Origin::Gateway,
            format!(
                "sequence {} of model '{model}' version '{version}' is served by endpoint {} of backend {backend}, \
                 which {why}; the sequence's state is there, so its requests are not sent to another endpoint",
                sequence.id, state.authority
            ),
        ))
    }

    /// Picks one of the `eligible` endpoints for a call to the backend's model `model`.
    fn choose(&self, eligible: &[usize], model: &str, sticky: Option<u64>) -> usize {
        // One to choose from: the turn's counter, which every call would move, is left alone.
        if let [only] = eligible {
            return *only;
        }
        match (self.policy.lb, sticky) {
            (LoadBalancing::ConsistentHash, Some(key)) => {
                // Rendezvous hashing: each key goes to the eligible endpoint scoring highest for it, so losing an
                // endpoint moves only its own keys.
                *eligible
                    .iter()
                    .max_by_key(|&&i| xxhash_rust::xxh3::xxh3_64_with_seed(self.states[i].authority.as_bytes(), key))
                    .unwrap_or(&eligible[0])
            }
            (LoadBalancing::LeastRequest, _) if eligible.len() > 1 => {
                let (a, b) = two_of(eligible);
                self.fewer_in_flight(a, b)
            }
            (LoadBalancing::LeastLoad, _) if eligible.len() > 1 => {
                let (a, b) = two_of(eligible);
                // A scrape missed twice over is stale: the pair is compared on the gateway's own calls instead.
                let fresh = self
                    .policy
                    .load
                    .as_ref()
                    .map_or(std::time::Duration::ZERO, |l| l.interval * 3);
                match (self.states[a].load(model, fresh), self.states[b].load(model, fresh)) {
                    (Some(load_a), Some(load_b)) => {
                        if load_b.partial_cmp(&load_a) == Some(std::cmp::Ordering::Less) {
                            b
                        } else {
                            a
                        }
                    }
                    _ => {
                        if let Some(fallbacks) = &self.fallbacks {
                            fallbacks.inc();
                        }
                        self.fewer_in_flight(a, b)
                    }
                }
            }
            _ => eligible[self.next.fetch_add(1, Ordering::Relaxed) % eligible.len()],
        }
    }

    /// Of two endpoints, the one with fewer calls under way (the first of equals).
    fn fewer_in_flight(&self, a: usize, b: usize) -> usize {
        if self.states[b].in_flight() < self.states[a].in_flight() {
            b
        } else {
            a
        }
    }

    /// Whether one more retry fits the budget; takes it when it does.
    pub fn take_retry(&self) -> bool {
        let calls = self.calls.get();
        let retries = self.retries.load(Ordering::Relaxed);
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let allowed = (calls as f64 * RETRY_BUDGET_SHARE) as u64 + RETRY_BUDGET_FLOOR;
        if retries >= allowed {
            return false;
        }
        self.retries.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Two different endpoints of `eligible` (at least two), chosen at random.
fn two_of(eligible: &[usize]) -> (usize, usize) {
    let a = eligible[fastrand::usize(..eligible.len())];
    let mut b = eligible[fastrand::usize(..eligible.len() - 1)];
    if b == a {
        b = eligible[eligible.len() - 1];
    }
    (a, b)
}

fn overloaded(backend: &str, authority: &str) -> Error {
    Error::new(
        ErrorKind::Overloaded,
        Origin::Gateway,
        format!("backend {backend} endpoint {authority} has too many calls under way"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn endpoint(policy: &BackendPolicy) -> EndpointState {
        EndpointState::new("e:1".into(), policy, IntGauge::new("healthy", "healthy").unwrap())
    }

    /// The flags read before the locks follow what the locks hold: a model a probe found not ready, and an
    /// ejection, both set and both ended.
    #[test]
    fn not_ready_models_and_ejections_are_seen_through_the_flags_read_first() {
        let policy = BackendPolicy {
            health: Some(crate::config::HealthCheck {
                interval: Duration::from_secs(1),
                timeout: Duration::from_secs(1),
                unhealthy_after: 1,
                healthy_after: 1,
            }),
            outlier: crate::config::Outlier {
                consecutive_failures: 2,
                base_ejection: Duration::from_millis(1),
                max_ejection: Duration::from_millis(1),
            },
            ..BackendPolicy::default()
        };
        let state = endpoint(&policy);
        assert!(state.serves("m", "1") && state.is_available());
        state.probed(true, HashSet::from([("m".to_owned(), "1".to_owned())]), &policy);
        assert!(!state.serves("m", "1") && state.serves("m", "2") && state.serves("n", "1"));
        state.probed(true, HashSet::new(), &policy);
        assert!(state.serves("m", "1"));

        state.observed(true, &policy);
        assert!(state.is_available(), "one failure of two");
        state.observed(true, &policy);
        assert!(!state.is_available(), "ejected");
        assert!(state.status(Duration::from_secs(1)).why.unwrap().contains("ejected"));
        // The cool-down passes; with health checks, the endpoint waits for a good probe.
        std::thread::sleep(Duration::from_millis(5));
        assert!(!state.is_available());
        state.probed(true, HashSet::new(), &policy);
        assert!(state.is_available(), "a good probe after the cool-down");
        assert!(!state.ejected.load(Ordering::Relaxed));
    }

    /// The retry budget grows with the calls leased on every thread: its floor at first, then a fifth of the calls
    /// more, each retry taken once.
    #[test]
    fn the_retry_budget_is_its_floor_and_a_share_of_the_calls_every_thread_leased() {
        let policy = BackendPolicy::default();
        let endpoints = Endpoints::from_states(vec![Arc::new(endpoint(&policy))], policy, None);
        let taken = |endpoints: &Endpoints| std::iter::from_fn(|| endpoints.take_retry().then_some(())).count();
        assert_eq!(taken(&endpoints), 10);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
                    for _ in 0..100 {
                        runtime
                            .block_on(endpoints.lease("b", ("m", "1"), &Affinity::None, &[], None))
                            .unwrap();
                    }
                });
            }
        });
        assert_eq!(taken(&endpoints), 80);
        assert!(!endpoints.take_retry());
    }

    /// A call that finds its place at once starts when its caller read the clock; one that waits for its place
    /// starts once it has it.
    #[tokio::test]
    async fn a_lease_starts_at_the_callers_reading_unless_it_waited_for_its_place() {
        let policy = BackendPolicy {
            max_in_flight: Some(1),
            queue_timeout: Duration::from_secs(5),
            ..BackendPolicy::default()
        };
        let endpoints = Endpoints::from_states(vec![Arc::new(endpoint(&policy))], policy, None);
        let began = Instant::now().checked_sub(Duration::from_secs(3)).unwrap();
        let first = endpoints
            .lease("b", ("m", "1"), &Affinity::None, &[], Some(began))
            .await
            .unwrap();
        assert_eq!(first.started(), began);
        let waiting = endpoints.lease("b", ("m", "1"), &Affinity::None, &[], Some(began));
        let (second, ()) = tokio::join!(waiting, async move { drop(first) });
        assert!(second.unwrap().started() > began + Duration::from_secs(2));
    }
}
