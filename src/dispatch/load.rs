//! The `load` scrapes: every endpoint of a backend that has `load` has its own metrics read at the backend's
//! interval, for `least_load` to choose on. A scrape is bounded in time (the interval) and size; one that fails
//! leaves the endpoint's last good one to go stale, and is counted.

use std::sync::Arc;

use http::{HeaderMap, Method};

use super::CONNECT_TIMEOUT;
use super::backend::BackendClients;
use crate::codec::exposition::{self, Reported};
use crate::config::LoadSource;
use crate::telemetry::metrics::Metrics;
use crate::upstream::RestUpstream;

/// The most a scrape reads: a server's whole metrics are tens of KiB; a larger answer is a failed scrape.
const MAX_SCRAPE_BYTES: usize = 4 << 20;

/// Scrapes every endpoint of `backend` each `source.interval`, for as long as the caller polls it.
pub(super) async fn scrape_endpoints(backend: Arc<BackendClients>, source: LoadSource, metrics: Arc<Metrics>) {
    // Read over the gateway's own HTTP/1.1 client, as the backends' inferences are.
    let targets: Vec<(String, RestUpstream)> = backend
        .endpoints
        .iter()
        .map(|endpoint| {
            let metrics = RestUpstream::new(&source.address(endpoint), CONNECT_TIMEOUT, MAX_SCRAPE_BYTES, None);
            (endpoint.to_string(), metrics)
        })
        .collect();
    let mut ticker = tokio::time::interval(source.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let scrapes = targets.iter().enumerate().map(|(index, (endpoint, upstream))| {
            let (source, metrics, backend) = (&source, &metrics, &backend);
            async move {
                let scraped = scrape(upstream, source).await;
                match scraped {
                    Ok(reported) => {
                        metrics.scraped(&backend.name, endpoint, Some(reported.total));
                        if let Some(state) = backend.fleet.states.get(index) {
                            state.scraped(reported);
                        }
                    }
                    Err(why) => {
                        tracing::debug!(backend = %backend.name, %endpoint, %why, "load scrape failed");
                        metrics.scraped(&backend.name, endpoint, None);
                    }
                }
            }
        });
        futures_util::future::join_all(scrapes).await;
    }
}

/// One scrape: the endpoint's metrics, read whole (up to the bound) within the interval, and summed.
async fn scrape(upstream: &RestUpstream, source: &LoadSource) -> Result<Reported, String> {
    let answer = upstream
        .send(
            Method::GET,
            &source.path,
            &HeaderMap::new(),
            Vec::new(),
            Some(source.interval),
        )
        .await
        .map_err(|error| error.message().to_owned())?;
    if !answer.status.is_success() {
        return Err(format!("answered {}", answer.status));
    }
    let text = std::str::from_utf8(&answer.body).map_err(|_| "the metrics are not UTF-8".to_owned())?;
    exposition::read(text, &source.metrics, source.tie_break.as_deref())
}
