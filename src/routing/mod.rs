//! The route table: a public model name and version resolved to a backend and the backend's own names. Built once
//! from a validated configuration, read by every request without locks or string formatting.

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::{Config, ModelConfig};
use crate::error::{Error, Result};

/// Where one public model version goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionRoute {
    /// Position in [`RouteTable::routes`], for state kept per route (metric handles).
    pub id: usize,
    pub model: String,
    pub version: String,
    /// Index into the configuration's backends.
    pub backend: usize,
    pub upstream_name: String,
    pub upstream_version: String,
}

#[derive(Debug)]
struct ModelRoutes {
    versions: HashMap<String, Arc<VersionRoute>>,
    default_version: Arc<VersionRoute>,
    /// Public versions in configured order, for messages and metadata.
    names: Vec<String>,
}

/// Every model's routes.
#[derive(Debug, Default)]
pub struct RouteTable {
    models: HashMap<String, ModelRoutes>,
    /// Every route, by id.
    routes: Vec<Arc<VersionRoute>>,
}

impl RouteTable {
    /// Builds the table; fails only on a configuration that did not come from [`crate::config::validate`].
    pub fn new(config: &Config) -> Result<RouteTable> {
        let mut all = Vec::new();
        let models = config
            .models
            .iter()
            .map(|model| Ok((model.name.clone(), routes(model, &mut all)?)))
            .collect::<Result<_>>()?;
        Ok(RouteTable { models, routes: all })
    }

    /// The route for `model` at `version`, or its default version when the request names none.
    pub fn resolve(&self, model: &str, version: Option<&str>) -> Result<&Arc<VersionRoute>> {
        let routes = self
            .models
            .get(model)
            .ok_or_else(|| Error::not_found(format!("unknown model '{model}'")))?;
        match version.filter(|v| !v.is_empty()) {
            None => Ok(&routes.default_version),
            Some(version) => routes.versions.get(version).ok_or_else(|| {
                Error::not_found(format!(
                    "unknown version '{version}' of model '{model}' (it has {})",
                    routes.names.join(", ")
                ))
            }),
        }
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

fn routes(model: &ModelConfig, all: &mut Vec<Arc<VersionRoute>>) -> Result<ModelRoutes> {
    let versions: HashMap<String, Arc<VersionRoute>> = model
        .versions
        .iter()
        .map(|v| {
            let route = Arc::new(VersionRoute {
                id: all.len(),
                model: model.name.clone(),
                version: v.version.clone(),
                backend: v.backend,
                upstream_name: v.upstream_name.clone(),
                upstream_version: v.upstream_version.clone(),
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
    Ok(ModelRoutes {
        versions,
        default_version,
        names: model.versions.iter().map(|v| v.version.clone()).collect(),
    })
}
