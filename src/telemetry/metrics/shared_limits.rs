//! What the limits shared through Redis report: how each call was decided, how long Redis took, whether the limits
//! are falling back and how many replicas share them. Series are made at first use, so a gateway without
//! `[limits.shared]` shows none.

use std::sync::OnceLock;
use std::time::Duration;

use prometheus::{HistogramOpts, IntGaugeVec, Opts, Registry};

use super::sharded::{Counter, CounterVec, HistogramVec};

use super::{metric_error, registered};
use crate::error::Result;

/// Which shared limit decided a call, as `oipgate_shared_limit_calls_total{limit}` tells them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedLimit {
    /// A rate of calls (`rate.calls`): one token a call.
    Calls,
    /// A budget of generated tokens (`rate.tokens`): checked as a generate call starts.
    Tokens,
}

impl SharedLimit {
    pub fn label(self) -> &'static str {
        match self {
            SharedLimit::Calls => "calls",
            SharedLimit::Tokens => "tokens",
        }
    }
}

/// How a shared limit decided one call, as `oipgate_shared_limit_calls_total{result}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedDecision {
    /// Spent from the replica's lease: no network.
    Leased,
    /// Redis let it in.
    Allowed,
    /// Redis said the budget is spent (or said so a moment ago).
    Refused,
    /// Redis was away; the fallback let it in.
    FallbackAllowed,
    /// Redis was away; the fallback refused it.
    FallbackRefused,
}

impl SharedDecision {
    pub const ALL: [SharedDecision; 5] = [
        SharedDecision::Leased,
        SharedDecision::Allowed,
        SharedDecision::Refused,
        SharedDecision::FallbackAllowed,
        SharedDecision::FallbackRefused,
    ];

    pub fn label(self) -> &'static str {
        match self {
            SharedDecision::Leased => "leased",
            SharedDecision::Allowed => "allowed",
            SharedDecision::Refused => "refused",
            SharedDecision::FallbackAllowed => "fallback_allowed",
            SharedDecision::FallbackRefused => "fallback_refused",
        }
    }
}

/// Seconds, from 50 µs (a Redis call on the same host) to a tenth of a second (far past any `timeout_ms` worth
/// setting).
const REDIS_BUCKETS: [f64; 11] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
];

#[derive(Debug)]
pub(super) struct SharedLimitMetrics {
    calls: CounterVec,
    /// `calls` by [`SharedLimit`] and [`SharedDecision`], made at first use: a call counts with no label lookup.
    decided: [[OnceLock<Counter>; SharedDecision::ALL.len()]; 2],
    redis: HistogramVec,
    unanswered: CounterVec,
    fallback: IntGaugeVec,
    replicas: IntGaugeVec,
}

impl SharedLimitMetrics {
    pub(super) fn new(registry: &Registry) -> Result<SharedLimitMetrics> {
        let calls = CounterVec::new(
            Opts::new(
                "oipgate_shared_limit_calls_total",
                "Decisions of limits shared through Redis ([limits.shared]), by limit (calls: a rate of calls; \
                 tokens: a budget of generated tokens, checked as a generate call starts) and by result: leased \
                 (spent from this replica's lease, no network), allowed or refused (by Redis), fallback_allowed or \
                 fallback_refused (Redis did not answer within timeout_ms; when_unreachable decided).",
            ),
            &["limit", "result"],
        )
        .map_err(metric_error)?;
        let redis = super::sharded::histogram_vec(
            HistogramOpts::new(
                "oipgate_shared_limit_redis_duration_seconds",
                "Time Redis took to answer the shared limits' calls that it answered in time, by operation: take (a \
                 lease or one call), check and charge (token budgets), heartbeat.",
            )
            .buckets(REDIS_BUCKETS.to_vec()),
            &["operation"],
        )
        .map_err(metric_error)?;
        let unanswered = CounterVec::new(
            Opts::new(
                "oipgate_shared_limit_redis_unanswered_total",
                "The shared limits' calls to Redis that failed or got no answer within timeout_ms, by operation (as \
                 oipgate_shared_limit_redis_duration_seconds): each marks Redis away until a heartbeat is answered; \
                 while it is away only the heartbeat asks.",
            ),
            &["operation"],
        )
        .map_err(metric_error)?;
        let fallback = IntGaugeVec::new(
            Opts::new(
                "oipgate_shared_limits_fallback",
                "1 while Redis does not answer and the shared limits fall back to when_unreachable (the label), else 0.",
            ),
            &["when_unreachable"],
        )
        .map_err(metric_error)?;
        let replicas = IntGaugeVec::new(
            Opts::new(
                "oipgate_shared_limits_replicas",
                "Replicas that said they were alive in Redis in the last 3 seconds, this one included: the share of \
                 each limit a replica takes alone while Redis is away is 1/this.",
            ),
            &[],
        )
        .map_err(metric_error)?;
        Ok(SharedLimitMetrics {
            calls: registered(registry, calls)?,
            decided: Default::default(),
            redis: registered(registry, redis)?,
            unanswered: registered(registry, unanswered)?,
            fallback: registered(registry, fallback)?,
            replicas: registered(registry, replicas)?,
        })
    }

    pub(super) fn call(&self, limit: SharedLimit, decided: SharedDecision) {
        let index = SharedDecision::ALL.iter().position(|d| *d == decided).unwrap_or(0);
        self.decided[limit as usize][index]
            .get_or_init(|| self.calls.with_label_values(&[limit.label(), decided.label()]))
            .inc();
    }

    pub(super) fn redis(&self, operation: &str, took: Duration) {
        self.redis.with_label_values(&[operation]).observe(took.as_secs_f64());
    }

    pub(super) fn unanswered(&self, operation: &str) {
        self.unanswered.with_label_values(&[operation]).inc();
    }

    pub(super) fn state(&self, when_unreachable: &str, reachable: bool, replicas: u32) {
        self.fallback
            .with_label_values(&[when_unreachable])
            .set(i64::from(!reachable));
        self.replicas.with_label_values::<&str>(&[]).set(i64::from(replicas));
    }
}
