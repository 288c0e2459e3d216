//! What the endpoint picker (`oipgate epp`) reports: its picks, how long each took, and the endpoints the proxy
//! reported serving.

use std::time::Duration;

use prometheus::HistogramOpts;

use super::sharded::{CounterVec, Histogram, histogram_vec};

use super::family::Family;
use super::{DURATION_BUCKETS, Families, Metrics, metric_error, registered};
use crate::error::Result;

/// What the endpoint picker reports: its picks, how long each took, and the endpoints the proxy reported serving.
#[derive(Debug)]
pub(super) struct EppMetrics {
    picks: Family<CounterVec>,
    pick_duration: Histogram,
    served: Family<CounterVec>,
}

impl EppMetrics {
    pub(super) fn new(families: &Families<'_>) -> Result<EppMetrics> {
        Ok(EppMetrics {
            picks: families.counters(
                "oipgate_epp_picks_total",
                "Endpoint picks for the proxy, by public model and version, the endpoint picked (_none when refused) \
                 and result: picked, shed (429, max_queue or an endpoint's bound on calls under way), rate_limited \
                 (429, a rate, token budget or max_concurrent of the principal or model), unavailable (503, no \
                 eligible endpoint) or refused (another error: an unknown model, a malformed request).",
                &["model", "version", "endpoint", "result"],
            )?,
            pick_duration: registered(
                families.registry,
                histogram_vec(
                    HistogramOpts::new(
                        "oipgate_epp_pick_duration_seconds",
                        "Time from the request's headers reaching the picker to its pick (or refusal), the body's \
                         start read included.",
                    )
                    .buckets(DURATION_BUCKETS.to_vec()),
                    &[],
                )
                .map_err(metric_error)?,
            )?
            .with_label_values::<&str>(&[]),
            served: families.counters(
                "oipgate_epp_served_total",
                "Calls the proxy reported served (envoy.lb x-gateway-destination-endpoint-served), by endpoint and \
                 whether it was the one picked: picked, fallback (another of the list) or unreported.",
                &["endpoint", "result"],
            )?,
        })
    }
}

impl EppMetrics {
    /// Keeps the picks' series whose model and version `keep` keeps.
    pub(super) fn retain(&self, keep: &impl Fn(&[String]) -> bool) {
        self.picks.retain(keep);
    }
}

impl Metrics {
    /// Counts one pick of the endpoint picker (`endpoint` is `_none` for a refusal) and the time it took.
    pub fn epp_pick(&self, model: &str, version: &str, endpoint: &str, result: &str, took: Duration) {
        self.epp.picks.series(&[model, version, endpoint, result]).inc();
        self.epp.pick_duration.observe(took.as_secs_f64());
    }

    /// Counts a call the proxy reported served by `endpoint` (`result`: picked, fallback or unreported).
    pub fn epp_served(&self, endpoint: &str, result: &str) {
        self.epp.served.series(&[endpoint, result]).inc();
    }
}
