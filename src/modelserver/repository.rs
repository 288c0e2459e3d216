//! The models a model server serves, their versions and readiness, and the inference entry point both protocols use.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;

use super::models::{Model, Sequences};
use crate::dispatch::statistics;
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::proto::{InferStatistics, ModelStatistics, StatisticDuration};
use crate::protocol::reserved::{EMPTY_FINAL_RESPONSE, FINAL_RESPONSE};
use crate::protocol::{InferRequest, InferResponse, ModelIndexEntry, ModelMetadata, ModelState, ParamValue};

/// One served model: its versions and whether it is loaded (ready).
#[derive(Debug)]
struct ServedModel {
    /// Version number -> model, ascending.
    versions: BTreeMap<u32, Model>,
    version_names: Vec<String>,
    ready: AtomicBool,
    /// Inferences under way (or waiting), over its versions: what Triton's `nv_inference_pending_request_count`
    /// reports, and a gateway's `least_load` reads.
    pending: AtomicU64,
}

/// What a model server serves. Readiness flips through load/unload; everything else is fixed at start.
#[derive(Debug)]
pub struct Repository {
    models: BTreeMap<String, ServedModel>,
    /// Model-ready questions answered, over both protocols: what a gateway in front asks of it.
    readiness_asked: AtomicU64,
    /// The `slow` model's delay when a request sets none.
    slow_delay: Duration,
    /// The stateful model's sequences under way.
    sequences: Sequences,
    /// What each model version has done: Triton's statistics, by model name and version.
    statistics: Mutex<BTreeMap<(String, u32), ModelStatistics>>,
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
                ServedModel {
                    versions: served,
                    version_names,
                    ready: AtomicBool::new(true),
                    pending: AtomicU64::new(0),
                },
            );
        }
        if models.is_empty() {
            return Err(Error::invalid("the model selection is empty"));
        }
        Ok(Repository {
            models,
            readiness_asked: AtomicU64::new(0),
            slow_delay: Duration::ZERO,
            sequences: Sequences::default(),
            statistics: Mutex::new(BTreeMap::new()),
        })
    }

    /// Makes the `slow` model sleep `delay` when a request sets no `delay_ms`: a replica made slow on purpose.
    #[must_use]
    pub fn with_slow_delay(mut self, delay: Duration) -> Repository {
        self.slow_delay = delay;
        self
    }

    fn served(&self, name: &str) -> Result<&ServedModel> {
        self.models
            .get(name)
            .ok_or_else(|| Error::not_found(format!("Request for unknown model: '{name}' is not found")))
    }

    /// The model and version a request names; no version means the latest.
    fn resolve(&self, name: &str, version: Option<&str>) -> Result<(&ServedModel, u32, Model)> {
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
                "Request for unknown model: '{name}' version {} is not found",
                version.unwrap_or_default()
            ))
        })?;
        Ok((served, number, model))
    }

    /// Its inferences under way by model, in Prometheus' text format under Triton's name for them.
    pub fn pending_exposition(&self) -> String {
        let mut text = String::from(
            "# HELP nv_inference_pending_request_count Inferences under way or waiting, by model.\n\
             # TYPE nv_inference_pending_request_count gauge\n",
        );
        for (name, served) in &self.models {
            let pending = served.pending.load(Ordering::Relaxed);
            text += &format!("nv_inference_pending_request_count{{model=\"{name}\"}} {pending}\n");
        }
        text
    }

    /// How many model-ready questions it has answered.
    pub fn readiness_asked(&self) -> u64 {
        self.readiness_asked.load(Ordering::Relaxed)
    }

    /// True when every served model is ready: the protocol's server-ready.
    pub fn all_ready(&self) -> bool {
        self.models.values().all(|m| m.ready.load(Ordering::Acquire))
    }

    pub fn model_ready(&self, name: &str, version: Option<&str>) -> Result<bool> {
        self.readiness_asked.fetch_add(1, Ordering::Relaxed);
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

    /// Checks and runs an inference request for model `name`, `version` (or the latest), counted in the model
    /// version's statistics; a call dropped before it is answered (its client went away) counts as failed then.
    pub async fn infer(&self, name: &str, version: Option<&str>, request: InferRequest) -> Result<InferResponse> {
        let (served, number, model) = self.resolve(name, version)?;
        let mut counted = ModelStatisticsUpdate::new(self, served, name, number);
        let answered = self.run(name, served, number, model, request).await;
        counted.succeeded = answered.is_ok();
        answered
    }

    /// Runs a request that arrived on a stream (ModelStreamInfer), sending each response as it is made; stops when
    /// the stream is gone. As Triton does: a decoupled model's responses carry `triton_final_response` false, and an
    /// empty final one (true) follows only when the request sets `triton_enable_empty_final_response`; any other
    /// model gives its one response with the parameter true.
    pub async fn infer_stream(
        &self,
        name: &str,
        version: Option<&str>,
        request: InferRequest,
        responses: mpsc::Sender<InferResponse>,
    ) -> Result<()> {
        let (served, number, model) = self.resolve(name, version)?;
        if !model.decoupled() {
            let mut response = self.infer(name, version, request).await?;
            response
                .parameters
                .insert(FINAL_RESPONSE.to_owned(), ParamValue::Bool(true));
            let _ = responses.send(response).await;
            return Ok(());
        }
        // Counted when it ends, however it ends: a stream whose client went away is dropped mid-request, and that
        // request counts as failed.
        let mut counted = ModelStatisticsUpdate::new(self, served, name, number);
        let ran = self
            .run_decoupled(name, served, number, model, &request, &responses)
            .await;
        counted.succeeded = ran.is_ok();
        ran
    }

    async fn run_decoupled(
        &self,
        name: &str,
        served: &ServedModel,
        number: u32,
        model: Model,
        request: &InferRequest,
        responses: &mpsc::Sender<InferResponse>,
    ) -> Result<()> {
        ready(name, served)?;
        model.check_inputs(name, request)?;
        let response = |outputs, last: bool| InferResponse {
            model_name: name.to_owned(),
            model_version: Some(number.to_string()),
            id: request.id.clone(),
            parameters: [(FINAL_RESPONSE.to_owned(), ParamValue::Bool(last))]
                .into_iter()
                .collect(),
            outputs,
        };
        let open = model
            .run_decoupled(request, responses, |outputs| response(outputs, false))
            .await?;
        let empty_final = request.parameters.get(EMPTY_FINAL_RESPONSE) == Some(&ParamValue::Bool(true));
        if open && empty_final {
            let _ = responses.send(response(Vec::new(), true)).await;
        }
        Ok(())
    }

    /// Adds one inference to a model version's statistics: Triton counts each request as one inference and one
    /// execution, and times it whole (the built-in models have no queue or separate input and output stages).
    fn count(&self, name: &str, version: u32, took: Duration, succeeded: bool) {
        let took = StatisticDuration {
            count: 1,
            ns: u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let one = ModelStatistics {
            last_inference: now,
            inference_count: u64::from(succeeded),
            execution_count: u64::from(succeeded),
            inference_stats: Some(if succeeded {
                InferStatistics {
                    success: Some(took),
                    compute_infer: Some(took),
                    ..Default::default()
                }
            } else {
                InferStatistics {
                    fail: Some(took),
                    ..Default::default()
                }
            }),
            ..Default::default()
        };
        let mut statistics = self
            .statistics
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = statistics
            .entry((name.to_owned(), version))
            .or_insert_with(statistics::empty);
        statistics::add(entry, &one);
    }

    /// The configuration of model `name` at `version` (the latest when `None`), in Triton's terms: the built-in
    /// models take no batch dimension of their own (`max_batch_size` 0), so their shapes are the whole shapes.
    pub fn model_config(&self, name: &str, version: Option<&str>) -> Result<crate::proto::ModelConfig> {
        let (_, _, model) = self.resolve(name, version)?;
        let metadata = model.metadata(name, &[]);
        let datatype = |name: &str| {
            let config_name = if name == "BYTES" {
                "TYPE_STRING".to_owned()
            } else {
                format!("TYPE_{name}")
            };
            crate::proto::DataType::from_str_name(&config_name).unwrap_or(crate::proto::DataType::TypeInvalid) as i32
        };
        Ok(crate::proto::ModelConfig {
            name: name.to_owned(),
            platform: metadata.platform.clone(),
            backend: metadata.platform,
            max_batch_size: 0,
            input: metadata
                .inputs
                .iter()
                .map(|t| crate::proto::ModelInput {
                    name: t.name.clone(),
                    data_type: datatype(&t.datatype),
                    dims: t.shape.clone(),
                    ..Default::default()
                })
                .collect(),
            output: metadata
                .outputs
                .iter()
                .map(|t| crate::proto::ModelOutput {
                    name: t.name.clone(),
                    data_type: datatype(&t.datatype),
                    dims: t.shape.clone(),
                    ..Default::default()
                })
                .collect(),
            // How a client learns it must call the model on a stream.
            model_transaction_policy: model
                .decoupled()
                .then_some(crate::proto::ModelTransactionPolicy { decoupled: true }),
            ..Default::default()
        })
    }

    /// The statistics of model `name` at `version` (every version when `None`), or of every model when `name` is
    /// `None`; zeros for a model version that has served nothing.
    pub fn statistics(&self, name: Option<&str>, version: Option<&str>) -> Result<Vec<ModelStatistics>> {
        let chosen: Vec<(&String, &ServedModel)> = match name {
            Some(name) => vec![
                self.models
                    .get_key_value(name)
                    .ok_or_else(|| Error::not_found(format!("Request for unknown model: '{name}' is not found")))?,
            ],
            None => self.models.iter().collect(),
        };
        let recorded = self
            .statistics
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut entries = Vec::new();
        for (model, served) in chosen {
            let versions: Vec<u32> = match (name, version) {
                (Some(name), Some(_)) => vec![self.resolve(name, version)?.1],
                _ => served.versions.keys().copied().collect(),
            };
            for number in versions {
                let mut entry = recorded
                    .get(&(model.clone(), number))
                    .cloned()
                    .unwrap_or_else(statistics::empty);
                entry.name = model.clone();
                entry.version = number.to_string();
                entries.push(entry);
            }
        }
        Ok(entries)
    }

    async fn run(
        &self,
        name: &str,
        served: &ServedModel,
        number: u32,
        model: Model,
        request: InferRequest,
    ) -> Result<InferResponse> {
        ready(name, served)?;
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

/// One inference that is counted in its model's statistics when dropped.
struct ModelStatisticsUpdate<'a> {
    repository: &'a Repository,
    served: &'a ServedModel,
    name: &'a str,
    number: u32,
    started: Instant,
    succeeded: bool,
}

impl<'a> ModelStatisticsUpdate<'a> {
    /// An inference of `name` at version `number` begun now, failed unless marked otherwise.
    fn new(
        repository: &'a Repository,
        served: &'a ServedModel,
        name: &'a str,
        number: u32,
    ) -> ModelStatisticsUpdate<'a> {
        served.pending.fetch_add(1, Ordering::Relaxed);
        ModelStatisticsUpdate {
            repository,
            served,
            name,
            number,
            started: Instant::now(),
            succeeded: false,
        }
    }
}

impl Drop for ModelStatisticsUpdate<'_> {
    fn drop(&mut self) {
        self.served.pending.fetch_sub(1, Ordering::Relaxed);
        self.repository
            .count(self.name, self.number, self.started.elapsed(), self.succeeded);
    }
}

/// Refuses a model that has been unloaded.
fn ready(name: &str, served: &ServedModel) -> Result<()> {
    if served.ready.load(Ordering::Acquire) {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Unavailable,
        Origin::Upstream,
        format!("Request for unknown model: '{name}' is not at ready state: it has been unloaded"),
    ))
}
