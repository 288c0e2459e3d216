//! Model metadata as the gateway answers it: fetched from an endpoint of the resolved version under the public name,
//! and kept (fresh for a while, then served while a newer one is fetched in the background).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::HeaderMap;

use super::Dispatcher;
use super::backend::{Attempt, BackendClients};
use super::probe::endpoint_model_metadata;
use crate::error::Result;
use crate::protocol::ModelMetadata;
use crate::routing::Affinity;
use crate::routing::VersionRoute;
use crate::telemetry::traces::Trace;

/// How long model metadata is used without fetching it again.
const METADATA_FRESH: Duration = Duration::from_secs(5);
/// How long model metadata may be used while a newer one is fetched in the background.
const METADATA_STALE: Duration = Duration::from_secs(60);

impl Dispatcher {
    /// Model metadata from a healthy endpoint of the resolved version, with the public name and the versions the
    /// gateway routes for the model. Kept: an answer younger than [`METADATA_FRESH`] is used as it is; an older one,
    /// until [`METADATA_STALE`], is used while it is fetched again in the background.
    pub async fn model_metadata(&self, model: &str, version: Option<&str>) -> Result<ModelMetadata> {
        let route = self.routes.resolve(model, version)?;
        let backend = self.backend(route)?;
        let versions = self.routes.versions(model).map(<[String]>::to_vec).unwrap_or_default();
        let kept = self
            .metadata_cache
            .lock()
            .ok()
            .and_then(|cache| cache.get(&route.id).cloned());
        if let Some(kept) = kept {
            let age = kept.at.elapsed();
            if age < METADATA_FRESH {
                return Ok(kept.metadata);
            }
            if age < METADATA_STALE {
                if !kept.refreshing.swap(true, std::sync::atomic::Ordering::Relaxed)
                    && let Some(backend) = self.backends.get(route.backend.index()).cloned()
                {
                    let (cache, route) = (self.metadata_cache.clone(), route.clone());
                    let timeout = self.request_timeout;
                    tokio::spawn(async move {
                        let _ = fetch_metadata(&cache, &backend, &route, versions, timeout).await;
                    });
                }
                return Ok(kept.metadata);
            }
        }
        fetch_metadata(&self.metadata_cache, backend, route, versions, self.request_timeout).await
    }
}

/// Model metadata as it was last fetched, for one route.
#[derive(Debug, Clone)]
pub(super) struct KeptMetadata {
    at: Instant,
    metadata: ModelMetadata,
    /// Set once a background fetch of a newer one has started.
    refreshing: Arc<std::sync::atomic::AtomicBool>,
}

pub(super) type MetadataCache = Arc<Mutex<HashMap<usize, KeptMetadata>>>;

/// Fetches `route`'s metadata from an endpoint of `backend`, under its public name and `versions`, and keeps it.
async fn fetch_metadata(
    cache: &MetadataCache,
    backend: &BackendClients,
    route: &VersionRoute,
    versions: Vec<String>,
    timeout: Duration,
) -> Result<ModelMetadata> {
    let mut metadata = backend
        .attempt(
            (&route.upstream_name, &route.upstream_version),
            &Affinity::None,
            timeout,
            &HeaderMap::new(),
            &Trace::default(),
            |Attempt { index, left, .. }| endpoint_model_metadata(backend, index, route, left),
        )
        .await?;
    metadata.name = route.model.clone();
    metadata.versions = versions;
    if let Ok(mut cache) = cache.lock() {
        let kept = KeptMetadata {
            at: Instant::now(),
            metadata: metadata.clone(),
            refreshing: Arc::default(),
        };
        cache.insert(route.id, kept);
    }
    Ok(metadata)
}
