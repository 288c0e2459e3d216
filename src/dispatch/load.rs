//! The `load` scrapes: every endpoint of a backend that has `load` has its own metrics read at the backend's
//! interval, for `least_load` to choose on. A scrape is bounded in time (the interval) and size; one that fails
//! leaves the endpoint's last good one to go stale, and is counted.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::backend::BackendClients;
use crate::codec::exposition::{self, Reported};
use crate::config::LoadSource;
use crate::telemetry::metrics::Metrics;

/// The most a scrape reads: a server's whole metrics are tens of KiB; a larger answer is a failed scrape.
const MAX_SCRAPE_BYTES: usize = 4 << 20;

type ScrapeClient = Client<HttpConnector, Empty<Bytes>>;

/// Scrapes every endpoint of `backend` each `source.interval`, for as long as the caller polls it.
pub(super) async fn scrape_endpoints(backend: Arc<BackendClients>, source: LoadSource, metrics: Arc<Metrics>) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: ScrapeClient = Client::builder(TokioExecutor::new()).build(connector);
    let targets: Vec<(String, Option<http::Uri>)> = backend
        .endpoints
        .iter()
        .map(|endpoint| {
            let uri = format!("http://{}{}", source.address(endpoint), source.path)
                .parse()
                .ok();
            (endpoint.to_string(), uri)
        })
        .collect();
    let mut ticker = tokio::time::interval(source.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let scrapes = targets.iter().enumerate().map(|(index, (endpoint, uri))| {
            let (client, source, metrics, backend) = (&client, &source, &metrics, &backend);
            async move {
                let scraped = match uri {
                    Some(uri) => tokio::time::timeout(source.interval, scrape(client, uri.clone(), source))
                        .await
                        .unwrap_or_else(|_| Err("no answer within the interval".to_owned())),
                    None => Err("the metrics address is not a URI".to_owned()),
                };
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

/// One scrape: the metrics at `uri`, read whole (up to the bound) and summed.
async fn scrape(client: &ScrapeClient, uri: http::Uri, source: &LoadSource) -> Result<Reported, String> {
    let answer = client.get(uri).await.map_err(|e| e.to_string())?;
    if !answer.status().is_success() {
        return Err(format!("answered {}", answer.status()));
    }
    let body = Limited::new(answer.into_body(), MAX_SCRAPE_BYTES)
        .collect()
        .await
        .map_err(|e| format!("cannot read the metrics (more than {MAX_SCRAPE_BYTES} bytes?): {e}"))?
        .to_bytes();
    let text = std::str::from_utf8(&body).map_err(|_| "the metrics are not UTF-8".to_owned())?;
    exposition::read(text, &source.metrics, source.tie_break.as_deref())
}
