//! The `[limits.shared]` section: the Redis that makes every replica's rate limits and token budgets one budget.

use std::time::Duration;

use serde::Deserialize;

use super::{Problems, positive};

/// Tokens a replica takes from Redis at once, by default.
pub const DEFAULT_LEASE: u32 = 20;
/// How long a replica may hold a lease's unspent tokens before it gives them back.
pub const DEFAULT_LEASE_MS: u64 = 1_000;
/// A Redis call slower than this counts as unreachable for the call that waits on it.
pub const DEFAULT_TIMEOUT_MS: u64 = 20;
pub const DEFAULT_PREFIX: &str = "oipgate:";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSharedLimits {
    /// `redis://[user:password@]host:port/db`, or `rediss://` for TLS.
    pub redis: String,
    /// Prefix of every key the gateway writes, so several gateways can share one Redis.
    pub prefix: Option<String>,
    /// Calls a replica takes from Redis at once and spends locally; 0: one Redis call per call.
    pub lease: Option<u32>,
    /// How long a replica holds a lease's unspent calls before giving them back, in milliseconds.
    pub lease_ms: Option<u64>,
    /// What a replica does while Redis does not answer: `local` (its share of each limit alone), `allow`, `deny`.
    pub when_unreachable: Option<WhenUnreachable>,
    /// A Redis call slower than this, in milliseconds, counts as unreachable for the call that waits on it.
    pub timeout_ms: Option<u64>,
}

/// What the limits do while Redis does not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenUnreachable {
    /// Each replica enforces the limit divided by the replicas seen recently.
    #[default]
    Local,
    /// Every call passes the shared limits (the per-model `max_concurrent` still holds).
    Allow,
    /// Every call a shared limit covers is refused with 429.
    Deny,
}

impl WhenUnreachable {
    pub fn label(self) -> &'static str {
        match self {
            WhenUnreachable::Local => "local",
            WhenUnreachable::Allow => "allow",
            WhenUnreachable::Deny => "deny",
        }
    }
}

/// Limits shared by every replica through one Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedLimits {
    /// The URL as configured; it may carry a password, so it is never logged or shown (see [`Self::shown`]).
    pub redis: String,
    pub prefix: String,
    pub lease: u32,
    pub lease_time: Duration,
    pub when_unreachable: WhenUnreachable,
    pub timeout: Duration,
}

impl SharedLimits {
    /// The Redis URL without its password, for logs and the status page.
    pub fn shown(&self) -> String {
        let Some((scheme, rest)) = self.redis.split_once("://") else {
            return "(not a URL)".to_owned();
        };
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(authority_end);
        match authority.rsplit_once('@') {
            Some((user, host)) => {
                let user = user.split_once(':').map_or(user, |(name, _)| name);
                format!("{scheme}://{user}:***@{host}{path}")
            }
            None => self.redis.clone(),
        }
    }
}

fn redis_url(text: &str) -> Result<redis::ConnectionInfo, redis::RedisError> {
    redis::IntoConnectionInfo::into_connection_info(text)
}

/// `[limits.shared]`: a Redis URL the client can use, a lease of at most 10,000 calls, positive times.
pub(super) fn validate_shared_limits(problems: &mut Problems, raw: &RawSharedLimits) -> SharedLimits {
    let scheme_ok = raw.redis.starts_with("redis://") || raw.redis.starts_with("rediss://");
    if !scheme_ok {
        problems.add("limits.shared.redis", "must be a redis:// or rediss:// URL");
    } else if let Err(why) = redis_url(&raw.redis) {
        problems.add("limits.shared.redis", format!("is not a Redis URL: {why}"));
    }
    let lease = raw.lease.unwrap_or(DEFAULT_LEASE);
    if lease > 10_000 {
        problems.add("limits.shared.lease", format!("{lease} is above 10000"));
    }
    let prefix = raw.prefix.clone().unwrap_or_else(|| DEFAULT_PREFIX.to_owned());
    if prefix.chars().any(char::is_whitespace) {
        problems.add("limits.shared.prefix", "must not hold whitespace");
    }
    SharedLimits {
        redis: raw.redis.clone(),
        prefix,
        lease,
        lease_time: Duration::from_millis(positive(
            problems,
            "limits.shared.lease_ms",
            raw.lease_ms,
            DEFAULT_LEASE_MS,
        )),
        when_unreachable: raw.when_unreachable.unwrap_or_default(),
        timeout: Duration::from_millis(positive(
            problems,
            "limits.shared.timeout_ms",
            raw.timeout_ms,
            DEFAULT_TIMEOUT_MS,
        )),
    }
}
