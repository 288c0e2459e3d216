//! The buckets a principal's or model's `rate` makes: calls taken from a token bucket (this replica's own, or one
//! shared through Redis) and generated tokens charged to a budget once an answer ends. Each is kept across reloads
//! that keep its rate, so its tokens carry over.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{Quota, RateLimiter};

use super::gcra::Gcra;
use super::shared::{SharedBucket, SharedKeyedBuckets, SharedStore, SharedTokens};
use crate::config::{Rate, TokenCount, TokenRate};

type Limiter = RateLimiter<
    governor::state::NotKeyed,
    governor::state::InMemoryState,
    DefaultClock,
    governor::middleware::NoOpMiddleware<<DefaultClock as Clock>::Instant>,
>;

/// One token bucket per token principal, keyed by the principal's name.
type KeyedLimiter = RateLimiter<
    String,
    governor::state::keyed::HashMapStateStore<String>,
    DefaultClock,
    governor::middleware::NoOpMiddleware<<DefaultClock as Clock>::Instant>,
>;

/// How many checks of the token principals' buckets pass between two sweeps of the buckets that are full again.
const PRINCIPAL_SWEEP_EVERY: u32 = 4096;
/// Token principals' budgets kept before the full ones are forgotten.
const BUDGETS_SWEEP_ABOVE: usize = 4096;

/// The quota of `rate`: one token every 1/per_second, `burst` at most.
fn quota(rate: Rate) -> Quota {
    Quota::with_period(rate.interval())
        .unwrap_or_else(|| Quota::per_second(NonZeroU32::MIN))
        .allow_burst(rate.burst)
}

/// Whether `store` is the one a kept bucket was made with (both none, or the same store).
fn same_store(kept: Option<&Arc<SharedStore>>, store: Option<&Arc<SharedStore>>) -> bool {
    match (kept, store) {
        (None, None) => true,
        (Some(kept), Some(store)) => Arc::ptr_eq(kept, store),
        _ => false,
    }
}

/// A bucket of calls: this replica's, or one shared by every replica through Redis.
#[derive(Debug)]
pub(super) enum Bucket {
    Local { rate: Rate, limiter: Limiter },
    Shared(Arc<SharedBucket>),
}

/// What a bucket is: its rate, and the store when shared.
#[derive(Debug, Clone, Copy)]
pub(super) struct BucketOf<'a> {
    pub rate: Rate,
    pub store: Option<&'a Arc<SharedStore>>,
    /// Where it is in the store: `principal` or `model`, and the name.
    pub scope: &'static str,
    pub name: &'a str,
}

impl Bucket {
    fn new(of: BucketOf<'_>, clock: &DefaultClock) -> Arc<Bucket> {
        Arc::new(match of.store {
            Some(store) => Bucket::Shared(store.bucket(of.scope, of.name, of.rate)),
            None => Bucket::Local {
                rate: of.rate,
                limiter: RateLimiter::direct_with_clock(quota(of.rate), clock.clone()),
            },
        })
    }

    /// The bucket for `of`: the previous one when it is the same (its tokens carry over), else a new one.
    pub(super) fn kept(of: BucketOf<'_>, previous: Option<&Arc<Bucket>>, clock: &DefaultClock) -> Arc<Bucket> {
        match previous {
            Some(bucket) if bucket.is(of) => bucket.clone(),
            _ => Bucket::new(of, clock),
        }
    }

    fn is(&self, of: BucketOf<'_>) -> bool {
        match self {
            Bucket::Local { rate, .. } => *rate == of.rate && of.store.is_none(),
            Bucket::Shared(bucket) => bucket.rate() == of.rate && same_store(Some(bucket.store()), of.store),
        }
    }

    /// Takes a token, or says how long until one is there.
    pub(super) async fn take(&self, clock: &DefaultClock) -> Result<(), Duration> {
        match self {
            Bucket::Local { limiter, .. } => limiter
                .check()
                .map_err(|not_until| not_until.wait_time_from(clock.now())),
            Bucket::Shared(bucket) => bucket.take().await,
        }
    }
}

/// A bucket of `[auth.jwt] rate` for each principal the tokens name, made at its first call. Local buckets that
/// have filled up again are forgotten now and then (a forgotten bucket is a full one), so the table holds the recent
/// callers only.
#[derive(Debug)]
pub(super) enum PrincipalBuckets {
    Local {
        rate: Rate,
        limiter: KeyedLimiter,
        checks: AtomicU32,
    },
    Shared(SharedKeyedBuckets),
}

impl PrincipalBuckets {
    pub(super) fn kept(
        rate: Rate,
        store: Option<&Arc<SharedStore>>,
        previous: Option<&Arc<PrincipalBuckets>>,
        clock: &DefaultClock,
    ) -> Arc<PrincipalBuckets> {
        let same = |buckets: &PrincipalBuckets| match buckets {
            PrincipalBuckets::Local { rate: kept, .. } => *kept == rate && store.is_none(),
            PrincipalBuckets::Shared(shared) => shared.rate() == rate && same_store(Some(shared.store()), store),
        };
        match previous {
            Some(buckets) if same(buckets) => buckets.clone(),
            _ => Arc::new(match store {
                Some(store) => PrincipalBuckets::Shared(SharedKeyedBuckets::new(store, rate)),
                None => PrincipalBuckets::Local {
                    rate,
                    limiter: RateLimiter::hashmap_with_clock(quota(rate), clock.clone()),
                    checks: AtomicU32::new(0),
                },
            }),
        }
    }

    /// Takes a token from `principal`'s bucket, or says how long until one is there.
    pub(super) async fn take(&self, principal: &str, clock: &DefaultClock) -> Result<(), Duration> {
        match self {
            PrincipalBuckets::Local { limiter, checks, .. } => {
                if checks.fetch_add(1, Ordering::Relaxed) % PRINCIPAL_SWEEP_EVERY == PRINCIPAL_SWEEP_EVERY - 1 {
                    limiter.retain_recent();
                }
                limiter
                    .check_key(&principal.to_owned())
                    .map_err(|not_until| not_until.wait_time_from(clock.now()))
            }
            PrincipalBuckets::Shared(shared) => shared.bucket(principal).take().await,
        }
    }
}

/// A budget of generated tokens: this replica's own, or shared through Redis (with this replica's own charges kept
/// beside, for while Redis is away).
#[derive(Debug)]
pub(super) struct TokenBudget {
    rate: TokenRate,
    local: Gcra,
    shared: Option<Arc<SharedTokens>>,
}

impl TokenBudget {
    pub(super) fn kept(
        rate: TokenRate,
        store: Option<&Arc<SharedStore>>,
        scope: &str,
        name: &str,
        previous: Option<&Arc<TokenBudget>>,
    ) -> Arc<TokenBudget> {
        match previous {
            Some(budget)
                if budget.rate == rate && same_store(budget.shared.as_ref().map(|shared| shared.store()), store) =>
            {
                budget.clone()
            }
            _ => Arc::new(TokenBudget {
                rate,
                local: Gcra::default(),
                shared: store.map(|store| Arc::new(SharedTokens::new(store, scope, name, rate))),
            }),
        }
    }

    /// Whether a token is left: a spent budget refuses new calls until it has refilled.
    pub(super) async fn check(&self) -> Result<(), Duration> {
        match &self.shared {
            Some(shared) => shared.check(&self.local).await,
            None => self.local.check(self.rate.interval(), self.rate.per_minute.get()),
        }
    }

    fn charge(&self, tokens: u64) {
        match &self.shared {
            Some(shared) => shared.charge(&self.local, tokens),
            None => self.local.charge(tokens, self.rate.interval()),
        }
    }
}

/// Each token principal's budget of `[auth.jwt] rate`, made at its first call.
#[derive(Debug)]
pub(super) struct PrincipalBudgets {
    rate: TokenRate,
    store: Option<Arc<SharedStore>>,
    budgets: Mutex<HashMap<String, Arc<TokenBudget>>>,
}

impl PrincipalBudgets {
    pub(super) fn kept(
        rate: TokenRate,
        store: Option<&Arc<SharedStore>>,
        previous: Option<&Arc<PrincipalBudgets>>,
    ) -> Arc<PrincipalBudgets> {
        match previous {
            Some(budgets) if budgets.rate == rate && same_store(budgets.store.as_ref(), store) => budgets.clone(),
            _ => Arc::new(PrincipalBudgets {
                rate,
                store: store.cloned(),
                budgets: Mutex::default(),
            }),
        }
    }

    /// `principal`'s budget. Past a few thousand principals, the ones no call holds and that are not spent are
    /// forgotten (a forgotten budget is a full one).
    pub(super) fn budget(&self, principal: &str) -> Arc<TokenBudget> {
        let mut budgets = self.budgets.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(budget) = budgets.get(principal) {
            return budget.clone();
        }
        if budgets.len() >= BUDGETS_SWEEP_ABOVE {
            budgets.retain(|_, budget| {
                Arc::strong_count(budget) > 1
                    || budget
                        .local
                        .check(budget.rate.interval(), budget.rate.per_minute.get())
                        .is_err()
            });
        }
        let budget = TokenBudget::kept(self.rate, self.store.as_ref(), "token_principal", principal, None);
        budgets.insert(principal.to_owned(), budget.clone());
        budget
    }
}

/// The tokens one `generate` answer carried so far, counted as its events pass.
#[derive(Debug, Clone)]
pub struct TokenMeter {
    tokens: Arc<AtomicU64>,
    count: Arc<TokenCount>,
}

impl TokenMeter {
    /// Counts the tokens of one answer (or one event of a stream): a JSON object of outputs by name.
    pub fn add(&self, json: &[u8]) {
        let count = &*self.count;
        let holds_count = count.holds == crate::config::TokensHeld::Count;
        let tokens = crate::codec::rest::generate::answer_tokens(json, count.output.as_deref(), holds_count);
        self.tokens.fetch_add(tokens, Ordering::Relaxed);
    }

    pub fn tokens(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }
}

/// The token budgets a `generate` call is charged to, when its answer ends (when this is dropped).
#[derive(Debug)]
pub(super) struct TokenCharge {
    pub(super) budgets: Vec<Arc<TokenBudget>>,
    pub(super) meter: TokenMeter,
}

impl TokenCharge {
    pub(super) fn new(budgets: Vec<Arc<TokenBudget>>, count: Arc<TokenCount>) -> TokenCharge {
        TokenCharge {
            budgets,
            meter: TokenMeter {
                tokens: Arc::default(),
                count,
            },
        }
    }
}

impl Drop for TokenCharge {
    fn drop(&mut self) {
        let tokens = self.meter.tokens();
        if tokens > 0 {
            for budget in &self.budgets {
                budget.charge(tokens);
            }
        }
    }
}
