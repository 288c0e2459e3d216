//! The route table: a public model name and version resolved to a backend and the backend's own names. Built once
//! from a validated configuration, read by every request without locks or string formatting.

use std::sync::Arc;

use crate::config::{Config, ModelConfig};
use crate::error::{Error, Result};
use crate::protocol::{ByName, Sequence};
use crate::runtime::{ThreadArc, ThreadShared};

/// Where one public model version goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionRoute {
    /// Position in [`RouteTable::routes`], for state kept per route (metric handles).
    pub id: usize,
    pub model: String,
    pub version: String,
    /// Index into the configuration's backends.
    pub backend: crate::config::BackendId,
    /// Bound on each backend call for it: the model's `timeout_ms`, else the request timeout.
    pub timeout: std::time::Duration,
    pub upstream_name: String,
    /// Empty when the backend's model is called without a version (the backend's default).
    pub upstream_version: String,
    /// The model answers any number of responses per request (configured `decoupled`).
    pub decoupled: bool,
    /// Calls refused while every endpoint reports a long queue (the model's `max_queue`).
    pub shed: Option<crate::config::Shed>,
    /// Its share of the model's requests that name no version.
    pub weight: u32,
    /// Its inferences are sent to the payload log's sink.
    pub payload_log: bool,
    /// `version` as the header value every answer names it with, made once.
    served_as: Option<http::HeaderValue>,
}

impl VersionRoute {
    /// The version to name to the backend, if any.
    pub fn backend_version(&self) -> Option<&str> {
        Some(self.upstream_version.as_str()).filter(|v| !v.is_empty())
    }

    /// Marks an answer with the public version that served it.
    pub fn name_served_version(&self, headers: &mut http::HeaderMap) {
        if let Some(version) = self.served_as() {
            headers.insert(crate::headers::OIP_MODEL_VERSION, version.clone());
        }
    }

    /// The version an answer names as the one that served it, when it names one.
    pub fn served_as(&self) -> Option<&http::HeaderValue> {
        self.served_as.as_ref()
    }
}

#[derive(Debug)]
struct ModelRoutes {
    versions: ByName<Arc<VersionRoute>>,
    default_version: Arc<VersionRoute>,
    /// Public versions in configured order, for messages and metadata.
    names: Vec<String>,
    /// Versions with weight > 0, each with the end of its range in `[0, total)`, in configured order.
    split: Vec<(u64, Arc<VersionRoute>)>,
    total_weight: u64,
    sticky_header: Option<http::HeaderName>,
    mirror: Option<(Arc<VersionRoute>, u32)>,
}

/// Where one request goes: the version that serves it, and the version it is mirrored to, if any.
#[derive(Debug, Clone)]
pub struct Routed {
    /// This thread's handle on the version (its count written by no other door thread).
    pub route: ThreadArc<VersionRoute>,
    pub mirror: Option<Arc<VersionRoute>>,
    /// What ties the request to an endpoint: its sequence, or the hash of the model's sticky header when the request
    /// carries it (the consistent-hash key).
    pub affinity: Affinity,
}

/// Every model's routes.
#[derive(Debug, Default)]
pub struct RouteTable {
    models: ByName<ModelRoutes>,
    /// Every route, by id.
    routes: Vec<Arc<VersionRoute>>,
    /// Every route by id, as the door threads' requests hold it.
    handles: Vec<ThreadShared<VersionRoute>>,
}

impl RouteTable {
    /// Builds the table; fails only on a configuration that did not come from [`crate::config::validate`].
    pub fn new(config: &Config) -> Result<RouteTable> {
        let mut all = Vec::new();
        let models = config
            .models()
            .iter()
            .map(|model| {
                let timeout = model.limits.timeout.unwrap_or(config.limits.request_timeout);
                Ok((model.name.clone(), routes(model, timeout, &mut all)?))
            })
            .collect::<Result<_>>()?;
        let handles = all.iter().map(|route| ThreadShared::new(route.clone())).collect();
        Ok(RouteTable {
            models,
            routes: all,
            handles,
        })
    }

    /// The route for `model` at `version`, or its default version when the request names none.
    pub fn resolve(&self, model: &str, version: Option<&str>) -> Result<&Arc<VersionRoute>> {
        let routes = self.model(model)?;
        match version.filter(|v| !v.is_empty()) {
            None => Ok(&routes.default_version),
            Some(version) => routes.named(model, version),
        }
    }

    fn model(&self, model: &str) -> Result<&ModelRoutes> {
        self.models
            .get(model)
            // Triton's wording: clients and tools match on it.
            .ok_or_else(|| Error::not_found(format!("Request for unknown model: '{model}' is not found")))
    }

    /// Routes one request: a named version is that version; otherwise the weights split requests, by the
    /// request's sequence when it is in one (so a sequence keeps its version), else by the sticky header's value
    /// when the model has one and the request carries it, at random otherwise. The mirror is chosen at random with
    /// the model's mirror share.
    pub fn route(
        &self,
        model: &str,
        version: Option<&str>,
        headers: &http::HeaderMap,
        sequence: Option<Sequence>,
    ) -> Result<Routed> {
        let routes = self.model(model)?;
        let sticky = routes
            .sticky_header
            .as_ref()
            .and_then(|name| headers.get(name))
            .map(|value| xxhash_rust::xxh3::xxh3_64(value.as_bytes()));
        let split_key = sequence.as_ref().map(|s| s.version_key(model)).or(sticky);
        let route = match version.filter(|v| !v.is_empty()) {
            Some(version) => routes.named(model, version)?,
            None => routes.split_point(split_key.unwrap_or_else(|| fastrand::u64(..))),
        };
        let route = self
            .handles
            .get(route.id)
            .map_or_else(|| ThreadArc::new(route.clone()), ThreadShared::handle);
        let mirror = routes
            .mirror
            .as_ref()
            .filter(|(_, per_million)| fastrand::u32(..1_000_000) < *per_million)
            .map(|(mirror, _)| mirror.clone());
        let affinity = match (sequence, sticky) {
            (Some(sequence), _) => Affinity::Sequence(Arc::new(sequence)),
            (None, Some(key)) => Affinity::Sticky(key),
            (None, None) => Affinity::None,
        };
        Ok(Routed {
            route,
            mirror,
            affinity,
        })
    }

    /// Every version route of `model`, in configured order.
    pub fn model_routes(&self, model: &str) -> Result<Vec<Arc<VersionRoute>>> {
        let routes = self.model(model)?;
        Ok(routes
            .names
            .iter()
            .filter_map(|name| routes.versions.get(name).cloned())
            .collect())
    }

    /// The public versions of `model`, in configured order.
    pub fn versions(&self, model: &str) -> Option<&[String]> {
        self.models.get(model).map(|routes| routes.names.as_slice())
    }

    /// Every route, in configuration order; a route's `id` is its position.
    pub fn routes(&self) -> &[Arc<VersionRoute>] {
        &self.routes
    }

    /// Public model names.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.models.keys().map(String::as_str)
    }
}

impl ModelRoutes {
    fn named(&self, model: &str, version: &str) -> Result<&Arc<VersionRoute>> {
        self.versions.get(version).ok_or_else(|| {
            Error::not_found(format!(
                "Request for unknown model: '{model}' version {version} is not found (it has {})",
                self.names.join(", ")
            ))
        })
    }

    /// The version whose weight range holds `point`, a uniformly spread 64-bit number scaled into `[0, total)`: a
    /// change of weights moves only the points between the old and the new range ends.
    fn split_point(&self, point: u64) -> &Arc<VersionRoute> {
        let scaled = u64::try_from((u128::from(point) * u128::from(self.total_weight)) >> 64).unwrap_or(0);
        self.split
            .iter()
            .find(|(end, _)| scaled < *end)
            .or(self.split.last())
            .map_or(&self.default_version, |(_, route)| route)
    }
}

fn routes(model: &ModelConfig, timeout: std::time::Duration, all: &mut Vec<Arc<VersionRoute>>) -> Result<ModelRoutes> {
    let versions: ByName<Arc<VersionRoute>> = model
        .versions
        .iter()
        .map(|v| {
            let route = Arc::new(VersionRoute {
                id: all.len(),
                model: model.name.clone(),
                version: v.version.clone(),
                backend: v.backend,
                timeout,
                upstream_name: v.upstream_name.clone(),
                upstream_version: v.upstream_version.clone(),
                decoupled: model.decoupled,
                shed: model.limits.shed,
                weight: v.weight,
                payload_log: model.payload_log,
                served_as: http::HeaderValue::from_str(&v.version).ok(),
            });
            all.push(route.clone());
            (v.version.clone(), route)
        })
        .collect();
    let default_version = versions.get(&model.default_version).cloned().ok_or_else(|| {
        Error::internal(format!(
            "model '{}': default version '{}' is not one of its versions",
            model.name, model.default_version
        ))
    })?;
    let mut total_weight = 0;
    let mut split = Vec::new();
    for version in &model.versions {
        if version.weight > 0
            && let Some(route) = versions.get(&version.version)
        {
            total_weight += u64::from(version.weight);
            split.push((total_weight, route.clone()));
        }
    }
    let mirror = model.mirror.as_ref().and_then(|mirror| {
        let route = versions.get(&model.versions.get(mirror.version)?.version)?;
        Some((route.clone(), mirror.per_million))
    });
    Ok(ModelRoutes {
        versions,
        default_version,
        names: model.versions.iter().map(|v| v.version.clone()).collect(),
        split,
        total_weight,
        sticky_header: model.sticky_header.clone(),
        mirror,
    })
}

/// What ties a call to an endpoint.
#[derive(Debug, Clone, Default)]
pub enum Affinity {
    /// Nothing: the backend's load balancing spreads calls.
    #[default]
    None,
    /// The hash of the model's sticky header: the key of a backend balanced by consistent hashing.
    Sticky(u64),
    /// A request of a stateful sequence: it goes to the sequence's own endpoint, whatever the load balancing.
    Sequence(Arc<Sequence>),
}
