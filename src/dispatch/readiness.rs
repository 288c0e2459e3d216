//! What the fleet has ready, kept for the fleet answers (the repository index, server and model readiness) so that
//! an answer reads state instead of asking every backend: health-checked backends are read from their probes; for
//! the others the gateway keeps the answers of its last sweep over their endpoints, one call per endpoint and
//! distinct backend model (however many public names alias it), all at once.
//!
//! A sweep younger than [`FRESH`] is used as it is. An older one is still used, while a new sweep runs in the
//! background, until it is [`STALE`]; past that (or at the first call, or after a load or unload through the
//! gateway) the caller waits for the sweep.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use futures_util::StreamExt;

use super::backend::BackendClients;
use super::probe::endpoint_model_ready;
use crate::routing::VersionRoute;

/// Answers this young are used without a new sweep.
const FRESH: Duration = Duration::from_secs(1);
/// Answers this old are not used: the caller waits for a sweep.
const STALE: Duration = Duration::from_secs(10);
/// Readiness calls under way at once in a sweep.
const SWEEP_CONCURRENCY: usize = 256;

/// A backend model: the backend's index, and its name and version there.
type Key = (usize, String, String);

/// Why no endpoint has a backend model ready; `None` when one has.
pub(super) type Unavailable = Option<String>;

/// One sweep's answers.
#[derive(Debug)]
pub(super) struct Sweep {
    at: Instant,
    answers: HashMap<Key, Unavailable>,
}

/// The last sweep over the backends that are not health-checked.
#[derive(Debug)]
pub(super) struct AskedReadiness {
    /// Every distinct backend model routed to a backend that is not health-checked.
    keys: Vec<Key>,
    last: RwLock<Option<Arc<Sweep>>>,
    /// Held while a sweep runs, so concurrent callers share one.
    sweeping: tokio::sync::Mutex<()>,
    /// Moved on by each invalidation: a sweep that began before one does not keep its answers.
    generation: AtomicU64,
    timeout: Duration,
}

impl AskedReadiness {
    pub(super) fn new(routes: &[Arc<VersionRoute>], backends: &[Arc<BackendClients>], timeout: Duration) -> Self {
        let mut seen = std::collections::HashSet::new();
        let keys = routes
            .iter()
            .filter(|route| {
                backends
                    .get(route.backend.index())
                    .is_some_and(|backend| !backend.fleet.health_checked())
            })
            .map(|route| {
                (
                    route.backend.index(),
                    route.upstream_name.clone(),
                    route.upstream_version.clone(),
                )
            })
            .filter(|key| seen.insert(key.clone()))
            .collect();
        AskedReadiness {
            keys,
            last: RwLock::new(None),
            sweeping: tokio::sync::Mutex::new(()),
            generation: AtomicU64::new(0),
            timeout,
        }
    }

    /// Whether there is anything to ask (some backend is not health-checked).
    pub(super) fn asks(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Forgets the last sweep, so the next answer waits for a new one (the gateway just loaded or unloaded a model).
    pub(super) fn invalidate(&self) {
        let mut last = self.last.write().unwrap_or_else(PoisonError::into_inner);
        self.generation.fetch_add(1, Ordering::AcqRel);
        *last = None;
    }

    fn last(&self) -> Option<Arc<Sweep>> {
        self.last.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Starts a sweep in the background, unless one is under way.
    fn refresh(self: &Arc<Self>, backends: &[Arc<BackendClients>]) {
        if self.sweeping.try_lock().is_ok() {
            let this = self.clone();
            let backends = backends.to_vec();
            tokio::spawn(async move { this.sweep_unless_fresh(&backends).await });
        }
    }

    /// The answers to use now, sweeping first or in the background as their age says.
    pub(super) async fn answers(self: &Arc<Self>, backends: &[Arc<BackendClients>]) -> Arc<Sweep> {
        if let Some(last) = self.last() {
            let age = last.at.elapsed();
            if age < FRESH {
                return last;
            }
            if age < STALE {
                self.refresh(backends);
                return last;
            }
        }
        self.sweep_unless_fresh(backends).await
    }

    /// Sweeps, unless a sweep that ended while this one waited its turn is fresh.
    async fn sweep_unless_fresh(&self, backends: &[Arc<BackendClients>]) -> Arc<Sweep> {
        let _turn = self.sweeping.lock().await;
        if let Some(last) = self.last()
            && last.at.elapsed() < FRESH
        {
            return last;
        }
        let at = Instant::now();
        let generation = self.generation.load(Ordering::Acquire);
        // The calls are made up front (not by a closure over the keys), which keeps the future `Send` for every
        // lifetime the front doors' tasks need.
        let calls: Vec<_> = self
            .keys
            .iter()
            .map(|key| ask_key(backends, key, self.timeout))
            .collect();
        let answers = futures_util::stream::iter(calls)
            .buffer_unordered(SWEEP_CONCURRENCY)
            .collect::<HashMap<_, _>>()
            .await;
        let sweep = Arc::new(Sweep { at, answers });
        let mut last = self.last.write().unwrap_or_else(PoisonError::into_inner);
        if self.generation.load(Ordering::Acquire) == generation {
            *last = Some(sweep.clone());
        }
        sweep
    }
}

impl Sweep {
    /// Why no endpoint of `backend` has `name` at `version` ready (`None` when one has), as the sweep found.
    pub(super) fn unavailable(&self, backend: usize, name: &str, version: &str) -> Unavailable {
        // A key outside the sweep cannot happen (every route's is in it); not knowing, it is not called ready.
        self.answers
            .get(&(backend, name.to_owned(), version.to_owned()))
            .cloned()
            .unwrap_or_else(|| Some(format!("model '{name}' version '{version}' was not asked")))
    }
}

async fn ask_key(backends: &[Arc<BackendClients>], key: &Key, timeout: Duration) -> (Key, Unavailable) {
    let unavailable = match backends.get(key.0) {
        Some(backend) => ask(backend, &key.1, &key.2, timeout).await,
        None => Some("no such backend".to_owned()),
    };
    (key.clone(), unavailable)
}

/// Asks every endpoint of `backend` at once whether it has `name` at `version` ready.
pub(super) async fn ask(backend: &BackendClients, name: &str, version: &str, timeout: Duration) -> Unavailable {
    let answers = futures_util::future::join_all(
        (0..backend.fleet.states.len()).map(|index| endpoint_model_ready(backend, index, name, version, timeout)),
    )
    .await;
    if answers.iter().any(|answer| matches!(answer, Ok(true))) {
        return None;
    }
    Some(match answers.into_iter().find_map(Result::err) {
        Some(error) => format!("backend {}: {}", backend.name, error.message()),
        None => format!(
            "backend {}: no endpoint has model '{name}' version '{version}' ready",
            backend.name
        ),
    })
}
