//! The models a model server serves, their versions and readiness, and the inference entry point both protocols use.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::models::{Model, Sequences};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::protocol::{InferRequest, InferResponse, ModelIndexEntry, ModelMetadata, ModelState};

/// One served model: its versions and whether it is loaded (ready).
#[derive(Debug)]
struct Served {
    /// Version number -> model, ascending.
    versions: BTreeMap<u32, Model>,
    version_names: Vec<String>,
    ready: AtomicBool,
}

/// What a model server serves. Readiness flips through load/unload; everything else is fixed at start.
#[derive(Debug)]
pub struct Repository {
    models: BTreeMap<String, Served>,
    /// The `slow` model's delay when a request sets none.
    slow_delay: Duration,
    /// The stateful model's sequences under way.
    sequences: Sequences,
}

impl Repository {
    /// Parses a selection such as `add_sub:1,2 identity simple_string` (space or comma separated models, each with
    /// optional `:versions`). Every model, every version, when `selection` is `None`.
    pub fn new(selection: Option<&str>) -> Result<Repository> {
        let mut models = BTreeMap::new();
        let items: Vec<String> = match selection {
            None => Model::NAMES.iter().map(|n| (*n).to_owned()).collect(),
            Some(text) => text.split_whitespace().map(str::to_owned).collect(),
        };
        for item in items {
            let (name, versions) = match item.split_once(':') {
                Some((name, versions)) => {
                    let parsed = versions
                        .split(',')
                        .map(|v| {
                            v.trim().parse::<u32>().map_err(|_| {
                                Error::invalid(format!("model selection '{item}': version '{v}' is not a number"))
                            })
                        })
                        .collect::<Result<Vec<u32>>>()?;
                    (name, parsed)
                }
                None => (item.as_str(), Model::versions(&item).to_vec()),
            };
            if Model::versions(name).is_empty() {
                return Err(Error::invalid(format!(
                    "unknown model '{name}' (built-in models: {})",
                    Model::NAMES.join(", ")
                )));
            }
            let mut served = BTreeMap::new();
            for version in versions {
                let model = Model::find(name, version).ok_or_else(|| {
                    Error::invalid(format!(
                        "model '{name}' has no version {version} (it has {:?})",
                        Model::versions(name)
                    ))
                })?;
                served.insert(version, model);
            }
            let version_names = served.keys().map(u32::to_string).collect();
            models.insert(
                name.to_owned(),
                Served {
                    versions: served,
                    version_names,
                    ready: AtomicBool::new(true),
                },
            );
        }
        if models.is_empty() {
            return Err(Error::invalid("the model selection is empty"));
        }
        Ok(Repository {
            models,
            slow_delay: Duration::ZERO,
            sequences: Sequences::default(),
        })
    }

    /// Makes the `slow` model sleep `delay` when a request sets no `delay_ms`: a replica made slow on purpose.
    #[must_use]
    pub fn with_slow_delay(mut self, delay: Duration) -> Repository {
        self.slow_delay = delay;
        self
    }

    fn served(&self, name: &str) -> Result<&Served> {
        self.models
            .get(name)
            .ok_or_else(|| Error::not_found(format!("unknown model '{name}'")))
    }

    /// The model and version a request names; no version means the latest.
    fn resolve(&self, name: &str, version: Option<&str>) -> Result<(&Served, u32, Model)> {
        let served = self.served(name)?;
        let (number, model) = match version.filter(|v| !v.is_empty()) {
            None => served.versions.iter().next_back().map(|(v, m)| (*v, *m)),
            Some(text) => text
                .parse::<u32>()
                .ok()
                .and_then(|v| served.versions.get(&v).map(|m| (v, *m))),
        }
        .ok_or_else(|| {
            Error::not_found(format!(
                "unknown version '{}' of model '{name}'",
                version.unwrap_or_default()
            ))
        })?;
        Ok((served, number, model))
    }

    /// True when every served model is ready: the protocol's server-ready.
    pub fn all_ready(&self) -> bool {
        self.models.values().all(|m| m.ready.load(Ordering::Acquire))
    }

    pub fn model_ready(&self, name: &str, version: Option<&str>) -> Result<bool> {
        let (served, _, _) = self.resolve(name, version)?;
        Ok(served.ready.load(Ordering::Acquire))
    }

    pub fn metadata(&self, name: &str, version: Option<&str>) -> Result<ModelMetadata> {
        let (served, _, model) = self.resolve(name, version)?;
        Ok(model.metadata(name, &served.version_names))
    }

    /// Makes a model ready (`load`) or unready (`unload`).
    pub fn set_ready(&self, name: &str, ready: bool) -> Result<()> {
        self.served(name)?.ready.store(ready, Ordering::Release);
        Ok(())
    }

    /// One entry per model version; only ready ones when `ready_only`.
    pub fn index(&self, ready_only: bool) -> Vec<ModelIndexEntry> {
        let mut entries = Vec::new();
        for (name, served) in &self.models {
            let ready = served.ready.load(Ordering::Acquire);
            if ready_only && !ready {
                continue;
            }
            for version in &served.version_names {
                entries.push(ModelIndexEntry {
                    name: name.clone(),
                    version: version.clone(),
                    state: if ready {
                        ModelState::Ready
                    } else {
                        ModelState::Unavailable
                    },
                    reason: if ready { String::new() } else { "unloaded".to_owned() },
                });
            }
        }
        entries
    }

    /// Checks and runs an inference request for model `name`, `version` (or the latest).
    pub async fn infer(&self, name: &str, version: Option<&str>, request: InferRequest) -> Result<InferResponse> {
        let (served, number, model) = self.resolve(name, version)?;
        if !served.ready.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::Unavailable,
                Origin::Upstream,
                format!("model '{name}' is not ready: it has been unloaded"),
            ));
        }
        model.check_inputs(name, &request)?;
        let mut outputs = model.run(&request, self.slow_delay, &self.sequences).await?;
        if !request.outputs.is_empty() {
            for wanted in &request.outputs {
                if !outputs.iter().any(|o| o.name == wanted.name) {
                    return Err(Error::invalid(format!(
                        "model '{name}' has no output '{}' for this request",
                        wanted.name
                    )));
                }
            }
            outputs.retain(|o| request.outputs.iter().any(|w| w.name == o.name));
        }
        Ok(InferResponse {
            model_name: name.to_owned(),
            model_version: Some(number.to_string()),
            id: request.id,
            parameters: Default::default(),
            outputs,
        })
    }
}
