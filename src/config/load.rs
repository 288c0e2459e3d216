//! A backend's `load` table: where each of its endpoints reports its own queue (its Prometheus metrics), which the
//! `least_load` balancing reads.

use std::time::Duration;

use serde::Deserialize;

use super::endpoint::Endpoint;
use super::{Problems, positive};

/// Default time between two scrapes of an endpoint, in milliseconds.
pub const DEFAULT_LOAD_INTERVAL_MS: u64 = 500;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLoad {
    /// A server's usual queue metrics: "triton", "mlserver", "vllm" or "sglang".
    pub preset: Option<String>,
    /// The metrics port on each endpoint's host (default: the endpoint's own port).
    pub port: Option<u16>,
    /// Default `/metrics`.
    pub path: Option<String>,
    /// The metric, or metrics summed, that count an endpoint's waiting requests (instead of the preset's).
    pub metric: Option<RawMetricNames>,
    /// Time between scrapes, and each scrape's bound, in milliseconds.
    pub interval_ms: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RawMetricNames {
    One(String),
    Many(Vec<String>),
}

/// Where and what to read of each endpoint's metrics.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LoadSource {
    /// The metrics port on an endpoint's host when it names no metrics address of its own; `None`: its port.
    pub port: Option<u16>,
    pub path: String,
    /// Summed; a sample with a `model` label counts for that model only.
    pub metrics: Vec<String>,
    /// Of two endpoints with equal queues, the one reporting less of this wins (the `vllm` preset's KV-cache use).
    pub tie_break: Option<String>,
    pub interval: Duration,
    /// Endpoints that name their own metrics address (several replicas on one host), with it.
    pub addresses: Vec<(Endpoint, Endpoint)>,
}

impl LoadSource {
    /// Where `endpoint`'s metrics are read.
    pub fn address(&self, endpoint: &Endpoint) -> Endpoint {
        if let Some((_, metrics)) = self.addresses.iter().find(|(e, _)| e == endpoint) {
            return metrics.clone();
        }
        Endpoint {
            host: endpoint.host.clone(),
            port: self.port.unwrap_or(endpoint.port),
        }
    }
}

/// The tie-break metric of the servers that have one.
fn preset_tie_break(name: &str) -> Option<&'static str> {
    (name == "vllm").then_some("vllm:kv_cache_usage_perc")
}

/// The queue metrics of the servers oipgate knows by name.
fn preset(name: &str) -> Option<&'static [&'static str]> {
    Some(match name {
        "triton" => &["nv_inference_pending_request_count"],
        "mlserver" => &["parallel_request_queue", "batch_request_queue"],
        "vllm" => &["vllm:num_requests_waiting"],
        "sglang" => &["sglang:num_queue_reqs"],
        _ => return None,
    })
}

/// The `load` table of the backend at `path`, with the metrics addresses its endpoints named.
pub(super) fn validate_load(
    problems: &mut Problems,
    path: &str,
    load: &RawLoad,
    addresses: Vec<(Endpoint, Endpoint)>,
) -> LoadSource {
    let named = match &load.metric {
        Some(RawMetricNames::One(name)) => vec![name.clone()],
        Some(RawMetricNames::Many(names)) => names.clone(),
        None => Vec::new(),
    };
    let metrics = match (&load.preset, named.is_empty()) {
        (_, false) => named,
        (Some(name), true) => match preset(name) {
            Some(metrics) => metrics.iter().map(|m| (*m).to_owned()).collect(),
            None => {
                problems.add(
                    format!("{path}.load.preset"),
                    format!("\"{name}\" is not \"triton\", \"mlserver\", \"vllm\" or \"sglang\""),
                );
                Vec::new()
            }
        },
        (None, true) => {
            problems.add(format!("{path}.load"), "needs a preset or a metric");
            Vec::new()
        }
    };
    for (i, metric) in metrics.iter().enumerate() {
        let valid = !metric.is_empty()
            && metric
                .chars()
                .enumerate()
                .all(|(j, c)| c.is_ascii_alphabetic() || c == '_' || c == ':' || (j > 0 && c.is_ascii_digit()));
        if !valid {
            problems.add(
                format!("{path}.load.metric[{i}]"),
                format!("\"{metric}\" is not a metric name"),
            );
        }
    }
    let metrics_path = load.path.clone().unwrap_or_else(|| "/metrics".to_owned());
    if !metrics_path.starts_with('/') {
        problems.add(format!("{path}.load.path"), "must start with /");
    }
    if load.port == Some(0) {
        problems.add(format!("{path}.load.port"), "must be at least 1");
    }
    let interval = positive(
        problems,
        &format!("{path}.load.interval_ms"),
        load.interval_ms,
        DEFAULT_LOAD_INTERVAL_MS,
    );
    LoadSource {
        port: load.port,
        path: metrics_path,
        metrics,
        tie_break: load.preset.as_deref().and_then(preset_tie_break).map(str::to_owned),
        interval: Duration::from_millis(interval),
        addresses,
    }
}
