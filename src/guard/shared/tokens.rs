//! The shared limits' budgets of generated tokens: checked in Redis as a generate call begins (a refusal kept until
//! Redis said), charged in the background when its answer ends, owed while Redis is away.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{SharedStore, Step, Unsettled};
use crate::config::TokenRate;
use crate::guard::gcra::Gcra;
use crate::telemetry::metrics::{SharedDecision as Decided, SharedLimit};

/// A budget of generated tokens shared by every replica: checked as a call begins, charged when its answer ends.
#[derive(Debug)]
pub struct SharedTokens {
    store: Arc<SharedStore>,
    key: String,
    rate: TokenRate,
    /// Tokens charged that Redis has not taken yet: charged while it was away, or in a charge it did not answer.
    pub(super) owed: AtomicU64,
    /// Redis said the budget is spent until then: calls are refused without asking again (charges only push that
    /// time later; nothing gives tokens back to a budget).
    refused_until: Mutex<Option<Instant>>,
}

impl SharedTokens {
    pub fn new(store: &Arc<SharedStore>, scope: &str, name: &str, rate: TokenRate) -> SharedTokens {
        SharedTokens {
            store: store.clone(),
            key: store.token_key(scope, name),
            rate,
            owed: AtomicU64::new(0),
            refused_until: Mutex::new(None),
        }
    }

    pub fn store(&self) -> &Arc<SharedStore> {
        &self.store
    }

    /// Whether the budget has a token left, by Redis, or by the fallback with `local` (this replica's own charges).
    pub async fn check(&self, local: &Gcra) -> Result<(), Duration> {
        let store = &*self.store;
        let (interval, burst) = (self.rate.interval(), self.rate.per_minute.get());
        if store.reachable() {
            let now = Instant::now();
            let refused = *self.refused_until.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(until) = refused.filter(|until| now < *until) {
                store.count(SharedLimit::Tokens, Decided::Refused);
                return Err(until - now);
            }
            let deadline = tokio::time::Instant::now() + store.config.timeout;
            if let Some(answer) = store
                .step(Step::Check, &self.key, interval, burst, 1, 0, deadline)
                .await
            {
                if answer.granted == 0 {
                    *self.refused_until.lock().unwrap_or_else(PoisonError::into_inner) =
                        Some(Instant::now() + answer.wait);
                }
                let decided = if answer.granted > 0 { Ok(()) } else { Err(answer.wait) };
                store.count(
                    SharedLimit::Tokens,
                    if decided.is_ok() {
                        Decided::Allowed
                    } else {
                        Decided::Refused
                    },
                );
                return decided;
            }
        }
        store.fallback_with(SharedLimit::Tokens, |replicas| {
            local.check(interval * replicas, (burst / u64::from(replicas)).max(1))
        })
    }

    /// Charges `tokens` to the budget in Redis, in the background (the answer has ended; nothing waits on it), with
    /// whatever is owed, and to `local` as this replica's share, for the fallback. While Redis is away they are owed,
    /// and paid once it answers.
    pub fn charge(self: &Arc<Self>, local: &Gcra, tokens: u64) {
        local.charge(tokens, self.rate.interval() * self.store.replicas());
        if !self.store.reachable() {
            self.owe(tokens);
            return;
        }
        let shared = self.clone();
        tokio::spawn(async move {
            let tokens = tokens + shared.owed.swap(0, Ordering::AcqRel);
            shared.send_charge(tokens).await;
        });
    }

    /// One charge sent to Redis; owed again when it does not answer in time.
    pub(super) async fn send_charge(self: &Arc<Self>, tokens: u64) {
        let deadline = tokio::time::Instant::now() + self.store.config.timeout;
        let (interval, burst) = (self.rate.interval(), self.rate.per_minute.get());
        let charged = self
            .store
            .step(Step::Charge, &self.key, interval, burst, tokens, 0, deadline)
            .await;
        if charged.is_none() {
            self.owe(tokens);
        }
    }

    /// `tokens` to charge this budget in Redis, if any.
    pub(super) fn to_charge(&self, tokens: u64) -> Option<Unsettled> {
        (tokens > 0).then(|| Unsettled {
            step: Step::Charge,
            key: self.key.clone(),
            interval: self.rate.interval(),
            burst: self.rate.per_minute.get(),
            tokens,
        })
    }

    /// Adds to what is owed; a budget that owed nothing is listed with the store, which pays it once Redis answers.
    fn owe(self: &Arc<Self>, tokens: u64) {
        if self.owed.fetch_add(tokens, Ordering::AcqRel) == 0 {
            let mut owing = self.store.owing.lock().unwrap_or_else(PoisonError::into_inner);
            owing.retain(|tokens| tokens.strong_count() > 0);
            owing.push(Arc::downgrade(self));
        }
    }
}

/// A budget a reload replaced (its rate changed) leaves what it owed to be charged.
impl Drop for SharedTokens {
    fn drop(&mut self) {
        let owed = std::mem::take(self.owed.get_mut());
        if let Some(unsettled) = self.to_charge(owed) {
            self.store.owe_for_gone(unsettled);
        }
    }
}
