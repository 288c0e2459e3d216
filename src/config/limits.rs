//! The `[limits]` section: the sizes and times a client is held to.

use std::time::Duration;

use serde::Deserialize;

use super::{Problems, positive};

/// Default body / message limit: 64 MiB.
pub const DEFAULT_MAX_REQUEST_BYTES: u64 = 64 << 20;
/// Default whole-request deadline.
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 30_000;
/// How long an inference stream may be silent both ways: five minutes (a model may think long between tokens).
pub const DEFAULT_STREAM_IDLE_TIMEOUT_MS: u64 = 300_000;
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// How long a request body may go without bytes: nginx's `client_body_timeout` is 60 s; a tensor upload that
/// pauses half a minute is not uploading.
pub const DEFAULT_BODY_READ_TIMEOUT_MS: u64 = 30_000;
/// How long a whole REST request body may take: a minute, 64 MiB at about 9 Mbit/s. Beside the pause between reads,
/// it bounds how long a body trickled a byte at a time holds its connection and what it was admitted to.
pub const DEFAULT_BODY_TOTAL_TIMEOUT_MS: u64 = 60_000;
/// Streams one HTTP/2 client connection may have open at once.
pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 256;
/// Connections each listener (REST, gRPC, metrics) holds open at once; one past it is closed as it is accepted.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 10_000;
/// Answers one HTTP/2 client connection may hold in the gateway unread: 128 MiB.
pub const DEFAULT_MAX_BUFFERED_ANSWER_BYTES: u64 = 128 << 20;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    /// REST body and gRPC message size limit, in bytes.
    pub max_request_bytes: Option<u64>,
    /// Whole-request deadline, in milliseconds.
    pub request_timeout_ms: Option<u64>,
    /// How long a REST client may take over a request's head once its first byte has arrived, in milliseconds.
    pub header_read_timeout_ms: Option<u64>,
    /// How long an inference stream may pass with no message either way, in milliseconds.
    pub stream_idle_timeout_ms: Option<u64>,
    /// How long a REST request body may go without bytes, in milliseconds (then 408).
    pub body_read_timeout_ms: Option<u64>,
    /// How long a whole REST request body may take to arrive, in milliseconds (then 408).
    pub body_total_timeout_ms: Option<u64>,
    /// Streams one HTTP/2 client connection may have open at once, on both doors.
    pub max_concurrent_streams: Option<u32>,
    /// Connections each listener (REST, gRPC, metrics) holds open at once.
    pub max_connections: Option<u32>,
    /// Bytes of answers one HTTP/2 client connection may hold in the gateway unread, on both doors (past it, 429).
    pub max_buffered_answer_bytes: Option<u64>,
    /// Rate limits and token budgets shared by every replica through Redis; absent, each replica keeps its own.
    pub shared: Option<super::shared_limits::RawSharedLimits>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// REST body and gRPC message limit, in bytes.
    pub max_request_bytes: u64,
    pub request_timeout: Duration,
    /// How long a REST client may take over a request's head once it has begun (then 408).
    pub header_read_timeout: Duration,
    /// How long an inference stream may pass with no message either way (then DEADLINE_EXCEEDED).
    pub stream_idle_timeout: Duration,
    /// How long a REST request body may go without bytes (then 408).
    pub body_read_timeout: Duration,
    /// How long a whole REST request body may take to arrive (then 408).
    pub body_total_timeout: Duration,
    /// Streams one HTTP/2 client connection may have open at once.
    pub max_concurrent_streams: u32,
    /// Connections each listener holds open at once.
    pub max_connections: usize,
    /// Bytes of answers one HTTP/2 client connection may hold in the gateway unread.
    pub max_buffered_answer_bytes: usize,
}

/// The request size and time limits.
pub(super) fn validate_limits(problems: &mut Problems, limits: &RawLimits) -> Limits {
    let max_request_bytes = limits.max_request_bytes.unwrap_or(DEFAULT_MAX_REQUEST_BYTES);
    if max_request_bytes == 0 || max_request_bytes > u64::from(u32::MAX) {
        problems.add(
            "limits.max_request_bytes",
            format!("{max_request_bytes} is outside 1 to {} bytes", u32::MAX),
        );
    }
    let millis = |problems: &mut Problems, key: &str, value: Option<u64>, default: u64| {
        Duration::from_millis(positive(problems, &format!("limits.{key}"), value, default))
    };
    Limits {
        max_request_bytes,
        request_timeout: millis(
            problems,
            "request_timeout_ms",
            limits.request_timeout_ms,
            DEFAULT_REQUEST_TIMEOUT_MS,
        ),
        header_read_timeout: millis(
            problems,
            "header_read_timeout_ms",
            limits.header_read_timeout_ms,
            DEFAULT_HEADER_READ_TIMEOUT_MS,
        ),
        stream_idle_timeout: millis(
            problems,
            "stream_idle_timeout_ms",
            limits.stream_idle_timeout_ms,
            DEFAULT_STREAM_IDLE_TIMEOUT_MS,
        ),
        body_read_timeout: millis(
            problems,
            "body_read_timeout_ms",
            limits.body_read_timeout_ms,
            DEFAULT_BODY_READ_TIMEOUT_MS,
        ),
        body_total_timeout: millis(
            problems,
            "body_total_timeout_ms",
            limits.body_total_timeout_ms,
            DEFAULT_BODY_TOTAL_TIMEOUT_MS,
        ),
        max_concurrent_streams: u32::try_from(positive(
            problems,
            "limits.max_concurrent_streams",
            limits.max_concurrent_streams.map(u64::from),
            u64::from(DEFAULT_MAX_CONCURRENT_STREAMS),
        ))
        .unwrap_or(DEFAULT_MAX_CONCURRENT_STREAMS),
        max_connections: usize::try_from(positive(
            problems,
            "limits.max_connections",
            limits.max_connections.map(u64::from),
            u64::from(DEFAULT_MAX_CONNECTIONS),
        ))
        .unwrap_or(usize::MAX),
        max_buffered_answer_bytes: usize::try_from(positive(
            problems,
            "limits.max_buffered_answer_bytes",
            limits.max_buffered_answer_bytes,
            DEFAULT_MAX_BUFFERED_ANSWER_BYTES,
        ))
        .unwrap_or(usize::MAX),
    }
}

/// A principal's or model's rates as written: `{ per_second = 50.0, burst = 100 }` for its calls,
/// `{ tokens_per_minute = 100000 }` for the tokens its `generate` answers carry, or both.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRate {
    /// Tokens added per second (calls allowed per second, sustained).
    pub per_second: Option<f64>,
    /// The most calls allowed at once after a quiet spell (default: one second's worth, at least 1).
    pub burst: Option<u32>,
    /// Tokens of `generate` and `generate_stream` answers allowed per minute, sustained (a minute's worth at once).
    pub tokens_per_minute: Option<u64>,
}

/// A token bucket: `per_second` calls sustained, up to `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub per_second: f64,
    pub burst: std::num::NonZeroU32,
}

impl Rate {
    /// The time one call's token takes to come back.
    pub fn interval(self) -> Duration {
        Duration::from_secs_f64(1.0 / self.per_second).max(Duration::from_nanos(1))
    }
}

/// A budget of generated tokens: `per_minute` sustained, a minute's worth at once. It is charged when an answer
/// ends, by the tokens the answer carried, and refuses new calls while it is spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRate {
    pub per_minute: std::num::NonZeroU64,
}

impl TokenRate {
    /// The time one token takes to come back.
    pub fn interval(self) -> Duration {
        (Duration::from_secs(60) / u32::try_from(self.per_minute.get()).unwrap_or(u32::MAX))
            .max(Duration::from_nanos(1))
    }
}

/// What a `rate` key sets: a bucket of calls, a budget of tokens, or both.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Rates {
    pub calls: Option<Rate>,
    pub tokens: Option<TokenRate>,
}

/// The fastest rate accepted: one call per nanosecond is what a token bucket's clock can tell apart.
const MAX_PER_SECOND: f64 = 1e9;
/// The largest token budget accepted: what a minute can be divided into, one token per microsecond.
const MAX_TOKENS_PER_MINUTE: u64 = 60_000_000;

/// The rates at `path`: a positive, finite call rate with a burst of at least one call, and a token budget of at
/// least one token a minute; at least one of them.
pub(super) fn validate_rate(problems: &mut Problems, path: &str, rate: &RawRate) -> Rates {
    let tokens = match rate.tokens_per_minute {
        None => None,
        Some(per_minute) if (1..=MAX_TOKENS_PER_MINUTE).contains(&per_minute) => {
            std::num::NonZeroU64::new(per_minute).map(|per_minute| TokenRate { per_minute })
        }
        Some(other) => {
            problems.add(
                format!("{path}.tokens_per_minute"),
                format!("{other} is outside 1 to {MAX_TOKENS_PER_MINUTE}"),
            );
            None
        }
    };
    let calls = match rate.per_second {
        Some(per_second) => validate_calls(problems, path, per_second, rate.burst),
        None if rate.burst.is_some() => {
            problems.add(format!("{path}.burst"), "applies with per_second only");
            None
        }
        None if rate.tokens_per_minute.is_none() => {
            problems.add(
                path,
                "sets neither per_second (calls) nor tokens_per_minute (generated tokens)",
            );
            None
        }
        None => None,
    };
    Rates { calls, tokens }
}

fn validate_calls(problems: &mut Problems, path: &str, per_second: f64, burst: Option<u32>) -> Option<Rate> {
    if !(per_second > 0.0 && per_second <= MAX_PER_SECOND) {
        problems.add(
            format!("{path}.per_second"),
            format!("{per_second} is not above 0 and at most {MAX_PER_SECOND}"),
        );
        return None;
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let one_second = per_second.ceil().min(f64::from(u32::MAX)) as u32;
    let burst = match burst {
        Some(0) => {
            problems.add(format!("{path}.burst"), "must be at least 1");
            return None;
        }
        Some(burst) => burst,
        None => one_second.max(1),
    };
    Some(Rate {
        per_second,
        burst: std::num::NonZeroU32::new(burst)?,
    })
}
