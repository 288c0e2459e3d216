//! The process's own sections: `ready_policy`, `[shutdown]`, `[reload]` and `[runtime]`.

use std::time::Duration;

use serde::Deserialize;

use super::{Problems, choice, positive};

/// Default time in-flight requests get after SIGTERM.
pub const DEFAULT_GRACE_PERIOD_MS: u64 = 30_000;
/// Default interval at which the configuration file is looked at.
pub const DEFAULT_WATCH_INTERVAL_MS: u64 = 1_000;

/// What the gateway's readiness requires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum ReadyPolicy {
    /// Every configured model can be served.
    #[default]
    AllModels,
    /// At least one configured model can be served.
    AnyModel,
}

impl TryFrom<String> for ReadyPolicy {
    type Error = String;
    fn try_from(word: String) -> Result<Self, String> {
        choice(
            &word,
            &[
                ("all_models", ReadyPolicy::AllModels),
                ("any_model", ReadyPolicy::AnyModel),
            ],
        )
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawShutdown {
    /// How long in-flight requests get to finish after SIGTERM / SIGINT, in milliseconds.
    pub grace_period_ms: Option<u64>,
    /// How long, after the signal, connections are still accepted while readiness already answers 503.
    pub drain_delay_ms: Option<u64>,
}

/// What SIGTERM / SIGINT do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shutdown {
    /// Bound on the wait for in-flight requests.
    pub grace_period: Duration,
    /// Connections are still accepted this long after the signal, while readiness already says no.
    pub drain_delay: Duration,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawReload {
    /// Whether the configuration file (and the files it names) are watched for changes.
    pub watch: Option<bool>,
    /// How often they are looked at, in milliseconds.
    pub watch_interval_ms: Option<u64>,
}

/// Whether and how often the configuration file is watched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reload {
    pub watch: bool,
    pub interval: Duration,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRuntime {
    /// Worker threads of each front door (default: one per core).
    pub threads: Option<usize>,
}

/// Series per metric unless `[metrics] max_series` says otherwise.
pub const DEFAULT_MAX_SERIES: u64 = 50_000;

/// The `[metrics]` section.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    /// Series each metric may have; past it new combinations of labels are counted under `_other` (default 50,000).
    pub max_series: Option<u64>,
}

/// Series each metric may have.
pub(super) fn validate_metrics(problems: &mut Problems, metrics: &RawMetrics) -> usize {
    let max = positive(problems, "metrics.max_series", metrics.max_series, DEFAULT_MAX_SERIES);
    usize::try_from(max).unwrap_or(usize::MAX)
}

pub(super) fn validate_shutdown(shutdown: &RawShutdown) -> Shutdown {
    Shutdown {
        grace_period: Duration::from_millis(shutdown.grace_period_ms.unwrap_or(DEFAULT_GRACE_PERIOD_MS)),
        drain_delay: Duration::from_millis(shutdown.drain_delay_ms.unwrap_or(0)),
    }
}

/// The configuration file's watch.
pub(super) fn validate_reload(problems: &mut Problems, reload: &RawReload) -> Reload {
    let interval = positive(
        problems,
        "reload.watch_interval_ms",
        reload.watch_interval_ms,
        DEFAULT_WATCH_INTERVAL_MS,
    );
    Reload {
        watch: reload.watch.unwrap_or(true),
        interval: Duration::from_millis(interval),
    }
}

/// Worker threads of each front door: as configured, else one per core.
pub(super) fn validate_threads(problems: &mut Problems, runtime: &RawRuntime) -> usize {
    match runtime.threads {
        Some(0) => {
            problems.add("runtime.threads", "must be at least 1");
            1
        }
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(2, usize::from),
    }
}
