//! The shared limits' rates of calls: a bucket a replica takes calls from a lease at a time (refilled ahead, given
//! back when it expires or the bucket goes), and the token principals' buckets, one each.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{KEYED_SWEEP_ABOVE, SharedStore, Step, Unsettled};
use crate::config::Rate;
use crate::guard::gcra::Gcra;
use crate::telemetry::metrics::{SharedDecision as Decided, SharedLimit};

impl SharedStore {
    /// A bucket of calls shared by every replica, at key `scope:name:calls`.
    pub fn bucket(self: &Arc<Self>, scope: &str, name: &str, rate: Rate) -> Arc<SharedBucket> {
        let bucket = Arc::new(SharedBucket {
            store: self.clone(),
            key: self.key(scope, name, "calls"),
            rate,
            lease: Mutex::new(Lease::default()),
            refill: tokio::sync::Mutex::new(()),
            ahead: AtomicBool::new(false),
            local: Gcra::default(),
        });
        if self.config.lease > 0 {
            let mut leased = self.leased.lock().unwrap_or_else(PoisonError::into_inner);
            leased.retain(|bucket| bucket.strong_count() > 0);
            leased.push(Arc::downgrade(&bucket));
        }
        bucket
    }
}

/// Tokens a replica took from Redis and spends locally until they run out or expire.
#[derive(Debug, Default)]
struct Lease {
    tokens: u64,
    expires: Option<Instant>,
    /// Redis said the bucket is empty until then: calls are refused without asking again.
    refused_until: Option<Instant>,
}

/// A bucket of calls shared by every replica.
#[derive(Debug)]
pub struct SharedBucket {
    store: Arc<SharedStore>,
    pub(super) key: String,
    rate: Rate,
    lease: Mutex<Lease>,
    /// One refill of the lease at a time: the calls that find it empty meanwhile wait for that one.
    refill: tokio::sync::Mutex<()>,
    /// A refill ahead of need is under way: the lease ran low, and the next is taken before it runs out.
    ahead: AtomicBool,
    /// The replica's share while Redis is away.
    local: Gcra,
}

impl SharedBucket {
    pub fn rate(&self) -> Rate {
        self.rate
    }

    pub fn store(&self) -> &Arc<SharedStore> {
        &self.store
    }

    /// Takes one call's token: from the lease, else from Redis (a new lease), else as the fallback says. Never
    /// waits on Redis longer than `timeout_ms`. A lease that runs low is refilled in the background, so under the
    /// limit no call waits on Redis at all.
    pub async fn take(self: &Arc<Self>) -> Result<(), Duration> {
        let store = &*self.store;
        let (interval, burst) = (self.rate.interval(), u64::from(self.rate.burst.get()));
        if !store.reachable() {
            return store.fallback(&self.local, interval, burst, 1);
        }
        if let Some(decided) = self.lease_decision() {
            return decided;
        }
        let deadline = tokio::time::Instant::now() + store.config.timeout;
        if store.config.lease == 0 || store.retired() {
            return self.take_one(deadline).await;
        }
        let Ok(_refilling) = tokio::time::timeout_at(deadline, self.refill.lock()).await else {
            return store.fallback(&self.local, interval, burst, 1);
        };
        if let Some(decided) = self.lease_decision() {
            return decided;
        }
        let size = u64::from(store.config.lease).max(1);
        let returned = self.expired_tokens(Instant::now());
        let Some(answer) = store
            .step(Step::Take, &self.key, interval, burst, size, returned, deadline)
            .await
        else {
            return store.fallback(&self.local, interval, burst, 1);
        };
        let now = Instant::now();
        let mut lease = self.lease.lock().unwrap_or_else(PoisonError::into_inner);
        if answer.granted == 0 {
            lease.refused_until = Some(now + answer.wait);
            store.count(SharedLimit::Calls, Decided::Refused);
            return Err(answer.wait);
        }
        lease.tokens = answer.granted - 1;
        lease.expires = Some(now + store.config.lease_time);
        lease.refused_until = None;
        store.count(SharedLimit::Calls, Decided::Allowed);
        Ok(())
    }

    /// `lease = 0`: the call's one token from Redis, asked beside every other call's (on the one connection, in
    /// flight together), not one at a time as leases are refilled.
    async fn take_one(&self, deadline: tokio::time::Instant) -> Result<(), Duration> {
        let store = &*self.store;
        let (interval, burst) = (self.rate.interval(), u64::from(self.rate.burst.get()));
        let Some(answer) = store.step(Step::Take, &self.key, interval, burst, 1, 0, deadline).await else {
            return store.fallback(&self.local, interval, burst, 1);
        };
        if answer.granted == 0 {
            let mut lease = self.lease.lock().unwrap_or_else(PoisonError::into_inner);
            lease.refused_until = Some(Instant::now() + answer.wait);
            store.count(SharedLimit::Calls, Decided::Refused);
            return Err(answer.wait);
        }
        store.count(SharedLimit::Calls, Decided::Allowed);
        Ok(())
    }

    /// The lease's decision, when it can make one: a token it holds, or a refusal Redis gave a moment ago.
    fn lease_decision(self: &Arc<Self>) -> Option<Result<(), Duration>> {
        let now = Instant::now();
        let mut lease = self.lease.lock().unwrap_or_else(PoisonError::into_inner);
        if lease.tokens > 0 && lease.expires.is_some_and(|expires| now < expires) {
            lease.tokens -= 1;
            let low = lease.tokens <= self.low_water();
            drop(lease);
            self.store.count(SharedLimit::Calls, Decided::Leased);
            if low && !self.ahead.swap(true, Ordering::AcqRel) {
                tokio::spawn(self.clone().refill_ahead());
            }
            return Some(Ok(()));
        }
        if let Some(until) = lease.refused_until.filter(|until| now < *until) {
            drop(lease);
            self.store.count(SharedLimit::Calls, Decided::Refused);
            return Some(Err(until - now));
        }
        None
    }

    /// The tokens left in a lease below which the next is taken ahead: half of it, so the next is there before the
    /// calls under way have spent the rest.
    fn low_water(&self) -> u64 {
        u64::from(self.store.config.lease) / 2
    }

    /// Takes the next lease while this one still has tokens, adding them to it (and keeping them the lease's time
    /// from now). A refusal is left for the calls that find the lease empty to learn.
    async fn refill_ahead(self: Arc<Self>) {
        let store = &*self.store;
        let deadline = tokio::time::Instant::now() + store.config.timeout;
        if let Ok(_refilling) = tokio::time::timeout_at(deadline, self.refill.lock()).await {
            let left = self.lease.lock().unwrap_or_else(PoisonError::into_inner).tokens;
            if left <= self.low_water() && store.reachable() && !store.retired() {
                let (interval, burst) = (self.rate.interval(), u64::from(self.rate.burst.get()));
                let size = u64::from(store.config.lease).max(1);
                let answer = store
                    .step(Step::Take, &self.key, interval, burst, size, 0, deadline)
                    .await;
                if let Some(answer) = answer.filter(|answer| answer.granted > 0) {
                    let mut lease = self.lease.lock().unwrap_or_else(PoisonError::into_inner);
                    lease.tokens += answer.granted;
                    lease.expires = Some(Instant::now() + store.config.lease_time);
                    lease.refused_until = None;
                }
            }
        }
        self.ahead.store(false, Ordering::Release);
    }

    /// Takes the tokens of the lease, expired or not (to give them back).
    pub(super) fn unspent_tokens(&self) -> u64 {
        let mut lease = self.lease.lock().unwrap_or_else(PoisonError::into_inner);
        lease.expires = None;
        std::mem::take(&mut lease.tokens)
    }

    /// `tokens` of this bucket to give back to Redis, if any.
    pub(super) fn give_back(&self, tokens: u64) -> Option<Unsettled> {
        (tokens > 0).then(|| Unsettled {
            step: Step::Take,
            key: self.key.clone(),
            interval: self.rate.interval(),
            burst: u64::from(self.rate.burst.get()),
            tokens,
        })
    }

    /// Takes the tokens of a lease that has expired (to give them back).
    pub(super) fn expired_tokens(&self, now: Instant) -> u64 {
        let mut lease = self.lease.lock().unwrap_or_else(PoisonError::into_inner);
        if lease.expires.is_some_and(|expires| now >= expires) {
            lease.expires = None;
            std::mem::take(&mut lease.tokens)
        } else {
            0
        }
    }
}

/// A bucket a reload replaced (its rate changed) gives back the lease it held.
impl Drop for SharedBucket {
    fn drop(&mut self) {
        let unspent = std::mem::take(&mut self.lease.get_mut().unwrap_or_else(PoisonError::into_inner).tokens);
        if let Some(unsettled) = self.give_back(unspent) {
            self.store.owe_for_gone(unsettled);
        }
    }
}

/// The shared buckets of token principals, one per principal, made at its first call.
#[derive(Debug)]
pub struct SharedKeyedBuckets {
    store: Arc<SharedStore>,
    rate: Rate,
    buckets: Mutex<HashMap<String, Arc<SharedBucket>>>,
}

impl SharedKeyedBuckets {
    pub fn new(store: &Arc<SharedStore>, rate: Rate) -> SharedKeyedBuckets {
        SharedKeyedBuckets {
            store: store.clone(),
            rate,
            buckets: Mutex::default(),
        }
    }

    pub fn rate(&self) -> Rate {
        self.rate
    }

    pub fn store(&self) -> &Arc<SharedStore> {
        &self.store
    }

    /// `principal`'s bucket. Past a few thousand principals, those holding no lease and no call are forgotten.
    pub fn bucket(&self, principal: &str) -> Arc<SharedBucket> {
        let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(bucket) = buckets.get(principal) {
            return bucket.clone();
        }
        if buckets.len() >= KEYED_SWEEP_ABOVE {
            buckets.retain(|_, bucket| {
                Arc::strong_count(bucket) > 1 || bucket.lease.lock().unwrap_or_else(PoisonError::into_inner).tokens > 0
            });
        }
        let bucket = self.store.bucket("token_principal", principal, self.rate);
        buckets.insert(principal.to_owned(), bucket.clone());
        bucket
    }
}
