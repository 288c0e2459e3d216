//! Limits shared by every replica through one Redis: each principal's and model's bucket is a key there, stepped by
//! one Lua script (a generic cell rate algorithm on Redis's clock), taken a lease at a time so most calls touch no
//! network; a heartbeat that counts the replicas and notices when Redis is away, and what the limits do then.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::gcra::Gcra;
use crate::config::{SharedLimits, WhenUnreachable};
use crate::error::{Error, Result};
use crate::telemetry::metrics::{Metrics, SharedDecision as Decided, SharedLimit};

mod calls;
mod tokens;

pub use calls::{SharedBucket, SharedKeyedBuckets};
pub use tokens::SharedTokens;

/// How often a replica says it is alive while Redis answers.
const HEARTBEAT: Duration = Duration::from_millis(500);
/// How often a replica asks again while Redis does not answer: sharing resumes this soon after it is back.
const PROBE: Duration = Duration::from_millis(100);
/// How long a replica counts as alive after its last heartbeat, in milliseconds.
const SEEN_FOR_MS: u64 = 3_000;
/// When `deny` refuses a call for Redis being away, the client is told to come back after this.
const DENIED_RETRY: Duration = Duration::from_secs(1);
/// Token principals' buckets kept before the idle ones are forgotten.
const KEYED_SWEEP_ABOVE: usize = 4096;
/// The longest a replica that exits waits for Redis to take back its leases and owed charges (at least its
/// `timeout_ms` three times: the give-backs, the charges and the heartbeat's removal).
const RETIRE_AT_LEAST: Duration = Duration::from_secs(1);
/// Give-backs and charges of buckets and budgets that are gone, sent to Redis together (on one connection, in flight
/// at once) rather than one round trip each.
const SETTLED_AT_ONCE: usize = 64;

/// What one script step does (`limit.lua`'s modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Take,
    Check,
    Charge,
}

impl Step {
    fn mode(self) -> &'static str {
        match self {
            Step::Take => "take",
            Step::Check => "check",
            Step::Charge => "charge",
        }
    }
}

/// What Redis is still owed for a bucket or budget that is gone (replaced by a reload, or its store retired): a
/// lease's unspent tokens to give back (`Take`), or generated tokens to charge (`Charge`).
#[derive(Debug)]
struct Unsettled {
    step: Step,
    key: String,
    interval: Duration,
    burst: u64,
    tokens: u64,
}

/// Redis's answer to a step: tokens granted, or how long until one fits.
#[derive(Debug, Clone, Copy)]
struct Answer {
    granted: u64,
    wait: Duration,
}

/// The Redis the limits are shared through, and what this replica knows of it.
pub struct SharedStore {
    config: SharedLimits,
    client: redis::Client,
    manager: ConnectionManagerConfig,
    /// The heartbeat's connection, on the limits' own thread.
    connection: ConnectionManager,
    limit: redis::Script,
    heartbeat: redis::Script,
    /// Whether Redis answered the last call within `timeout`; while not, every limit uses its fallback.
    reachable: AtomicBool,
    /// Whether Redis has answered at all yet (the status page says `connecting` until it has).
    heard: AtomicBool,
    /// Replicas that said they were alive recently, this one included.
    replicas: AtomicU32,
    /// The count held after a heartbeat found the set without this replica, and until when (see [`Self::recount`]).
    held_count: Mutex<Option<(u32, Instant)>>,
    /// This replica's name in the heartbeat set.
    id: String,
    metrics: Arc<Metrics>,
    /// Every bucket holding (or able to hold) a lease, for giving back the ones that expire unspent.
    leased: Mutex<Vec<Weak<SharedBucket>>>,
    /// The token budgets owed charges Redis has not taken (made while it was away, or not answered): paid once it
    /// answers again.
    owing: Mutex<Vec<Weak<SharedTokens>>>,
    /// Leases and charges of buckets and budgets that are gone, settled by the next sweep.
    unsettled: Mutex<Vec<Unsettled>>,
    /// Replaced by a reload, or the process exits: its leases and owed charges were handed back, its place in the
    /// heartbeat set given up, and its buckets take a call's token at a time (holding no lease).
    retired: AtomicBool,
    /// Lives as long as the store: a thread's connection made for it is let go once it has gone.
    alive: Arc<()>,
    /// Counts Redis's returns: a thread's connection made before the last one is made anew (the old one may be to
    /// a Redis that was restarted since, and would fail the first call sent on it).
    returns: AtomicU64,
}

impl std::fmt::Debug for SharedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedStore")
            .field("redis", &self.config.shown())
            .field("reachable", &self.reachable())
            .field("replicas", &self.replicas())
            .finish_non_exhaustive()
    }
}

impl SharedStore {
    /// The store for `config`: the connection is made on first use and remade whenever it breaks; the heartbeat
    /// runs while the store lives.
    pub fn start(config: &SharedLimits, metrics: &Arc<Metrics>) -> Result<Arc<SharedStore>> {
        let runtime = crate::runtime::limits_runtime();
        let _entered = runtime.enter();
        let client = redis::Client::open(config.redis.as_str())
            .map_err(|e| Error::internal(format!("limits.shared.redis: {e}")))?;
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.timeout.max(Duration::from_millis(200))))
            .set_response_timeout(Some(config.timeout))
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(PROBE)
            // Calls beyond these wait for a place rather than pile up on a Redis that is slow.
            .set_concurrency_limit(1024);
        let connection = ConnectionManager::new_lazy_with_config(client.clone(), manager.clone())
            .map_err(|e| Error::internal(format!("limits.shared.redis: {e}")))?;
        let store = Arc::new(SharedStore {
            config: config.clone(),
            client,
            manager,
            connection,
            limit: redis::Script::new(include_str!("limit.lua")),
            heartbeat: redis::Script::new(include_str!("heartbeat.lua")),
            reachable: AtomicBool::new(true),
            heard: AtomicBool::new(false),
            replicas: AtomicU32::new(1),
            held_count: Mutex::default(),
            id: format!("{}-{:016x}", std::process::id(), fastrand::u64(..)),
            metrics: metrics.clone(),
            leased: Mutex::default(),
            owing: Mutex::default(),
            unsettled: Mutex::default(),
            retired: AtomicBool::new(false),
            alive: Arc::new(()),
            returns: AtomicU64::new(0),
        });
        metrics.shared_limits_state(config.when_unreachable.label(), true, 1);
        runtime.spawn(maintain(Arc::downgrade(&store)));
        Ok(store)
    }

    /// Hands back what this replica holds of the fleet's budgets, once no configuration uses this store any more
    /// (a reload changed `[limits.shared]`, or the process exits): every lease's unspent tokens, every charge owed,
    /// and its place among the replicas (the others' local shares grow at once, not when it is forgotten). What Redis
    /// does not take meanwhile (it is away) is lost, as a replica's leases are when it dies.
    pub async fn retire(&self) {
        if self.retired.swap(true, Ordering::AcqRel) {
            return;
        }
        let buckets: Vec<Arc<SharedBucket>> = {
            let leased = self.leased.lock().unwrap_or_else(PoisonError::into_inner);
            leased.iter().filter_map(Weak::upgrade).collect()
        };
        let owing: Vec<Arc<SharedTokens>> = {
            let mut owing = self.owing.lock().unwrap_or_else(PoisonError::into_inner);
            owing.drain(..).filter_map(|tokens| tokens.upgrade()).collect()
        };
        {
            let mut unsettled = self.unsettled.lock().unwrap_or_else(PoisonError::into_inner);
            unsettled.extend(
                buckets
                    .iter()
                    .filter_map(|bucket| bucket.give_back(bucket.unspent_tokens())),
            );
            unsettled.extend(
                owing
                    .iter()
                    .filter_map(|tokens| tokens.to_charge(tokens.owed.swap(0, Ordering::AcqRel))),
            );
        }
        if self.reachable() {
            // Out of the replicas counted first: the others' shares grow even if the give-backs run out of time.
            let mut connection = self.connection.clone();
            let replicas = format!("{}replicas", self.config.prefix);
            let _ = tokio::time::timeout(
                self.config.timeout,
                redis::cmd("ZREM")
                    .arg(replicas)
                    .arg(&self.id)
                    .query_async::<u32>(&mut connection),
            )
            .await;
            self.settle().await;
        }
    }

    /// [`SharedStore::retire`], for a process on its way out: waits, on this thread, until it is done or its time
    /// is up.
    pub fn retire_before_exit(self: &Arc<Self>) {
        let bound = RETIRE_AT_LEAST.max(self.config.timeout * 3);
        let (done, finished) = std::sync::mpsc::channel();
        let store = self.clone();
        crate::runtime::limits_runtime().spawn(async move {
            let _ = tokio::time::timeout(bound, store.retire()).await;
            let _ = done.send(());
        });
        let _ = finished.recv_timeout(bound + PROBE);
    }

    pub fn retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Notes what Redis is owed for a bucket or budget that is gone; a retired store (whose sweeps have stopped)
    /// settles it at once.
    fn owe_for_gone(self: &Arc<Self>, unsettled: Unsettled) {
        self.unsettled
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(unsettled);
        if self.retired() {
            let store = self.clone();
            crate::runtime::limits_runtime().spawn(async move { store.settle().await });
        }
    }

    /// Sends Redis what it is owed for the buckets and budgets that are gone, [`SETTLED_AT_ONCE`] in flight at a
    /// time. A charge Redis does not take stays owed; a give-back is not sent again (Redis may have applied one whose
    /// answer was lost, and crediting it twice would admit beyond the limit: a lost lease only refuses early).
    async fn settle(&self) {
        use futures_util::StreamExt;
        let pending = std::mem::take(&mut *self.unsettled.lock().unwrap_or_else(PoisonError::into_inner));
        if pending.is_empty() {
            return;
        }
        let sent = futures_util::stream::iter(pending)
            .map(|owed| async move {
                // Redis went away meanwhile: the rest wait for its return rather than a timeout each.
                if !self.reachable() {
                    return Some(owed);
                }
                let (n, returned) = match owed.step {
                    Step::Charge => (owed.tokens, 0),
                    Step::Take | Step::Check => (0, owed.tokens),
                };
                let deadline = tokio::time::Instant::now() + self.config.timeout;
                let answered = self
                    .step(owed.step, &owed.key, owed.interval, owed.burst, n, returned, deadline)
                    .await;
                answered.is_none().then_some(owed)
            })
            .buffer_unordered(SETTLED_AT_ONCE)
            .filter_map(|unsent| std::future::ready(unsent.filter(|owed| owed.step == Step::Charge)))
            .collect::<Vec<Unsettled>>()
            .await;
        if !sent.is_empty() {
            self.unsettled
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(sent);
        }
    }

    /// Whether this store serves `config` (a reload that keeps the section keeps the store and its leases).
    pub fn made_from(&self, config: &SharedLimits) -> bool {
        self.config == *config
    }

    pub fn config(&self) -> &SharedLimits {
        &self.config
    }

    /// Whether Redis answered the last call in time.
    pub fn reachable(&self) -> bool {
        self.reachable.load(Ordering::Acquire)
    }

    /// `connecting` until Redis first answers, then `reachable` or `unreachable`.
    pub fn state(&self) -> &'static str {
        match (self.heard.load(Ordering::Acquire), self.reachable()) {
            (false, _) => "connecting",
            (true, true) => "reachable",
            (true, false) => "unreachable",
        }
    }

    /// Replicas seen recently, this one included.
    pub fn replicas(&self) -> u32 {
        self.replicas.load(Ordering::Acquire).max(1)
    }

    /// The key of one limit: `{prefix}{scope}:{name}:{what}`.
    fn key(&self, scope: &str, name: &str, what: &str) -> String {
        format!("{}{scope}:{name}:{what}", self.config.prefix)
    }

    /// A token budget shared by every replica, at key `scope:name:tokens`.
    pub fn token_key(&self, scope: &str, name: &str) -> String {
        self.key(scope, name, "tokens")
    }

    /// One step of `limit.lua`, within `deadline`; `None` when Redis did not answer in time (it is then taken as
    /// away until the heartbeat hears it again).
    #[allow(clippy::too_many_arguments)]
    async fn step(
        &self,
        step: Step,
        key: &str,
        interval: Duration,
        burst: u64,
        n: u64,
        returned: u64,
        deadline: tokio::time::Instant,
    ) -> Option<Answer> {
        let interval_us = interval.as_secs_f64() * 1e6;
        let mut invocation = self.limit.key(key);
        invocation
            .arg(step.mode())
            .arg(interval_us)
            .arg(interval_us * burst as f64)
            .arg(n)
            .arg(returned);
        let mut connection = self.thread_connection();
        let started = Instant::now();
        let answered = tokio::time::timeout_at(deadline, invocation.invoke_async::<(u64, u64)>(&mut connection)).await;
        match answered {
            Ok(Ok((granted, wait_us))) => {
                self.metrics.shared_limit_redis(step.mode(), started.elapsed());
                self.heard.store(true, Ordering::Release);
                Some(Answer {
                    granted,
                    wait: Duration::from_micros(wait_us),
                })
            }
            Ok(Err(error)) => {
                self.metrics.shared_limit_redis_unanswered(step.mode());
                self.drop_thread_connection();
                self.away(&error.to_string());
                None
            }
            Err(_) => {
                self.metrics.shared_limit_redis_unanswered(step.mode());
                self.away(&format!("no answer within {} ms", self.config.timeout.as_millis()));
                None
            }
        }
    }

    /// This thread's connection to Redis, made at its first call: a door thread's calls go out and come back on
    /// the thread itself, with no hop to another thread and back (which cost more than the call). A pool of one
    /// multiplexed connection per door thread.
    fn thread_connection(&self) -> ConnectionManager {
        let this: *const SharedStore = self;
        let returns = self.returns.load(Ordering::Acquire);
        THREAD_CONNECTIONS.with_borrow_mut(|connections| {
            if let Some(entry) = connections
                .iter()
                .find(|entry| entry.store == this && entry.alive.strong_count() > 0 && entry.returns == returns)
            {
                return entry.connection.clone();
            }
            // Made lazily on this thread's runtime; the ones of stores since replaced, or made before Redis last
            // came back, are let go.
            connections.retain(|entry| entry.alive.strong_count() > 0 && entry.store != this);
            match ConnectionManager::new_lazy_with_config(self.client.clone(), self.manager.clone()) {
                Ok(connection) => {
                    connections.push(ThreadConnection {
                        store: this,
                        alive: Arc::downgrade(&self.alive),
                        returns,
                        connection: connection.clone(),
                    });
                    connection
                }
                Err(_) => self.connection.clone(),
            }
        })
    }

    /// Lets go of this thread's connection after it failed, so the next call makes a new one.
    fn drop_thread_connection(&self) {
        let this: *const SharedStore = self;
        THREAD_CONNECTIONS.with_borrow_mut(|connections| connections.retain(|entry| entry.store != this));
    }

    /// Redis did not answer: the limits fall back until the heartbeat hears it again. Logged once per outage.
    fn away(&self, why: &str) {
        if self.reachable.swap(false, Ordering::AcqRel) {
            self.metrics
                .shared_limits_state(self.config.when_unreachable.label(), false, self.replicas());
            tracing::warn!(
                redis = %self.config.shown(),
                error = why,
                fallback = self.config.when_unreachable.label(),
                replicas = self.replicas(),
                "shared limits: Redis is unreachable; each limit falls back until it answers"
            );
        }
    }

    /// Redis answered the heartbeat: shared again.
    fn back(&self, replicas: u32) {
        self.replicas.store(replicas.max(1), Ordering::Release);
        self.heard.store(true, Ordering::Release);
        if !self.reachable.swap(true, Ordering::AcqRel) {
            self.returns.fetch_add(1, Ordering::AcqRel);
            tracing::info!(redis = %self.config.shown(), replicas, "shared limits: Redis answers again; limits are shared");
        }
        self.metrics
            .shared_limits_state(self.config.when_unreachable.label(), true, replicas.max(1));
    }

    /// The replicas to reckon with, from a heartbeat's count. A heartbeat that had to add this replica to the set it
    /// was already in finds the set lost (Redis restarted or flushed) or itself forgotten (away longer than
    /// [`SEEN_FOR_MS`]): the others are counted again only as each next beats, within that time, so until then the
    /// count this replica held stands, rather than the one or few that beat first (should Redis go away again
    /// meanwhile, each would take the whole budget for its own share).
    fn recount(&self, added: bool, counted: u32) -> u32 {
        let now = Instant::now();
        let mut held = self.held_count.lock().unwrap_or_else(PoisonError::into_inner);
        if added && self.heard.load(Ordering::Acquire) {
            *held = Some((self.replicas(), now + Duration::from_millis(SEEN_FOR_MS)));
        }
        match *held {
            Some((count, until)) if now < until => counted.max(count),
            _ => {
                *held = None;
                counted
            }
        }
    }

    /// Says this replica is alive and counts the replicas; marks Redis away or back.
    async fn beat(&self) {
        let mut invocation = self.heartbeat.key(format!("{}replicas", self.config.prefix));
        invocation.arg(&self.id).arg(SEEN_FOR_MS);
        let mut connection = self.connection.clone();
        let started = Instant::now();
        match tokio::time::timeout(
            self.config.timeout,
            invocation.invoke_async::<(u32, u32)>(&mut connection),
        )
        .await
        {
            Ok(Ok((added, counted))) => {
                self.metrics.shared_limit_redis("heartbeat", started.elapsed());
                let replicas = self.recount(added == 1, counted);
                self.back(replicas);
            }
            Ok(Err(error)) => {
                self.metrics.shared_limit_redis_unanswered("heartbeat");
                self.away(&error.to_string());
            }
            Err(_) => {
                self.metrics.shared_limit_redis_unanswered("heartbeat");
                self.away(&format!("no answer within {} ms", self.config.timeout.as_millis()));
            }
        }
    }

    /// Gives back the tokens of leases that expired unspent, so an idle replica does not sit on the budget.
    async fn give_back_expired(&self) {
        let buckets: Vec<Arc<SharedBucket>> = {
            let mut leased = self.leased.lock().unwrap_or_else(PoisonError::into_inner);
            leased.retain(|bucket| bucket.strong_count() > 0);
            leased.iter().filter_map(Weak::upgrade).collect()
        };
        let now = Instant::now();
        for bucket in buckets {
            // Redis went away during the sweep: the rest wait for the next one rather than a timeout each.
            if !self.reachable() {
                return;
            }
            let unspent = bucket.expired_tokens(now);
            if unspent > 0 {
                let deadline = tokio::time::Instant::now() + self.config.timeout;
                let (interval, burst) = (bucket.rate().interval(), u64::from(bucket.rate().burst.get()));
                self.step(Step::Take, &bucket.key, interval, burst, 0, unspent, deadline)
                    .await;
            }
        }
    }

    /// Charges the token budgets what they owe: the charges made while Redis was away, so an outage spends the
    /// fleet's budget late rather than never.
    async fn pay_owed(&self) {
        let owing: Vec<Arc<SharedTokens>> = {
            let mut owing = self.owing.lock().unwrap_or_else(PoisonError::into_inner);
            owing.drain(..).filter_map(|tokens| tokens.upgrade()).collect()
        };
        let mut owing = owing.into_iter();
        for tokens in owing.by_ref() {
            let owed = tokens.owed.swap(0, Ordering::AcqRel);
            if owed > 0 {
                tokens.send_charge(owed).await;
            }
            // Redis went away again: the rest stay owed, for its return, rather than wait a timeout each.
            if !self.reachable() {
                break;
            }
        }
        let unpaid: Vec<Weak<SharedTokens>> = owing.map(|tokens| Arc::downgrade(&tokens)).collect();
        if !unpaid.is_empty() {
            self.owing.lock().unwrap_or_else(PoisonError::into_inner).extend(unpaid);
        }
    }

    /// The fallback's decision while Redis is away: the local share of `burst` refilled one per `interval`.
    fn fallback(&self, local: &Gcra, interval: Duration, burst: u64, n: u64) -> Result<(), Duration> {
        self.fallback_with(SharedLimit::Calls, |replicas| {
            local.take(n, interval * replicas, (burst / u64::from(replicas)).max(1))
        })
    }

    /// The fallback's decision while Redis is away, counted: `local_share` decides with the replicas seen.
    fn fallback_with(
        &self,
        limit: SharedLimit,
        local_share: impl FnOnce(u32) -> Result<(), Duration>,
    ) -> Result<(), Duration> {
        let decided = match self.config.when_unreachable {
            WhenUnreachable::Allow => Ok(()),
            WhenUnreachable::Deny => Err(DENIED_RETRY),
            WhenUnreachable::Local => local_share(self.replicas()),
        };
        self.count(
            limit,
            if decided.is_ok() {
                Decided::FallbackAllowed
            } else {
                Decided::FallbackRefused
            },
        );
        decided
    }

    fn count(&self, limit: SharedLimit, decided: Decided) {
        self.metrics.shared_limit_call(limit, decided);
    }
}

/// A door thread's connection to one store's Redis.
struct ThreadConnection {
    store: *const SharedStore,
    alive: Weak<()>,
    /// The store's count of Redis's returns when it was made.
    returns: u64,
    connection: ConnectionManager,
}

thread_local! {
    static THREAD_CONNECTIONS: std::cell::RefCell<Vec<ThreadConnection>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Heartbeats and lease returns, while the store lives.
async fn maintain(store: Weak<SharedStore>) {
    loop {
        let Some(store) = store.upgrade() else { return };
        if store.retired() {
            return;
        }
        store.beat().await;
        if store.reachable() {
            store.give_back_expired().await;
            store.pay_owed().await;
            store.settle().await;
        }
        let every = if store.reachable() { HEARTBEAT } else { PROBE };
        drop(store);
        tokio::time::sleep(every).await;
    }
}
