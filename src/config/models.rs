//! The `[[models]]` section: each public model's versions, the backend each is served by and under which names,
//! and its weights, stickiness and mirroring.

use std::collections::HashMap;

use serde::Deserialize;

use super::backends::BackendId;
use super::limits::{Rates, RawRate, validate_rate};
use super::{Problems, check_name, positive};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    /// The public name clients use.
    pub name: String,
    pub versions: Vec<RawVersion>,
    /// The version a request that names none gets (the same as weight 100 on it and 0 on the others).
    pub default_version: Option<String>,
    /// Requests carrying the same value of this header (gRPC metadata) get the same version while weights hold.
    pub sticky_header: Option<String>,
    /// A share of the model's requests also sent, fire and forget, to another version.
    pub mirror: Option<RawMirror>,
    /// A decoupled model (any number of responses per request): on an inference stream, its requests to a REST
    /// backend go to the backend's `generate_stream`, whose events become the stream's responses.
    #[serde(default)]
    pub decoupled: bool,
    /// A token bucket for the model's calls and a budget of its generated tokens, across all callers.
    pub rate: Option<RawRate>,
    /// The output a `generate` answer's tokens are counted from (default: every output).
    pub tokens_output: Option<String>,
    /// What that output holds: `elements` (each element is a token, the default) or `count` (its value is the
    /// number of tokens, as Triton's vLLM backend's `num_output_tokens`).
    pub tokens_output_holds: Option<TokensHeld>,
    /// Calls under way at once; more are refused at once.
    pub max_concurrent: Option<u32>,
    /// Bound on each of the model's backend calls, in milliseconds (a client's deadline can only shorten it).
    pub timeout_ms: Option<u64>,
    /// When every endpoint serving the model reports more than this many of its requests waiting (its backend's
    /// `load`), new calls are refused at once (429 / RESOURCE_EXHAUSTED).
    pub max_queue: Option<u32>,
    /// Calls whose `priority` parameter is 1 (the highest) to this are never refused by `max_queue`.
    pub shed_priority_below: Option<u32>,
    /// `false`: the model's payloads are never sent to `[payload_log]`'s sink (private data).
    pub payload_log: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMirror {
    pub version: String,
    /// Share of requests mirrored, 0 to 100.
    pub percent: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawVersion {
    pub version: String,
    pub backend: String,
    /// The backend's name for the model, when it differs from the public one.
    pub upstream_name: Option<String>,
    /// The backend's version, when it differs from the public one.
    pub upstream_version: Option<String>,
    /// Share of the requests that name no version (relative to the other versions' weights).
    pub weight: Option<u32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Public name.
    pub name: String,
    pub versions: Vec<VersionConfig>,
    /// The version with the largest weight (the first of equals): what model metadata and readiness report when a
    /// request names no version.
    pub default_version: String,
    /// Header (lower case) whose value keeps a client on one version.
    pub sticky_header: Option<http::HeaderName>,
    pub mirror: Option<MirrorConfig>,
    /// It answers any number of responses per request (Triton's decoupled transaction policy).
    pub decoupled: bool,
    /// How fast, how many at once and for how long the model is called.
    pub limits: ModelLimits,
    /// How the tokens of its `generate` answers are counted, for token budgets.
    pub tokens: TokenCount,
    /// Its inferences are sent to `[payload_log]`'s sink: the section is configured and covers it, and the model
    /// does not opt out.
    pub payload_log: bool,
}

/// A model's own limits, across all callers.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelLimits {
    pub rate: Rates,
    pub max_concurrent: Option<std::num::NonZeroU32>,
    pub timeout: Option<std::time::Duration>,
    pub shed: Option<Shed>,
}

/// What a counted output holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokensHeld {
    /// Each element is one token (token ids, or one text piece per streamed token).
    #[default]
    Elements,
    /// Its value is the number of tokens.
    Count,
}

/// Where a `generate` answer's tokens are read: one output, or (`None`) the elements of every output.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TokenCount {
    pub output: Option<String>,
    pub holds: TokensHeld,
}

/// Refusing a model's calls while every endpoint serving it reports a long queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shed {
    /// Requests waiting at an endpoint (for the model) above which it counts as full.
    pub max_queue: u32,
    /// Calls of `priority` 1 to this pass regardless; 0: none.
    pub keep_priority: u32,
}

/// Mirroring of a model's requests to one of its versions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorConfig {
    /// Index into [`ModelConfig::versions`].
    pub version: usize,
    /// Share of requests mirrored, in millionths (1 to 1,000,000).
    pub per_million: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionConfig {
    /// Public version.
    pub version: String,
    pub backend: BackendId,
    pub upstream_name: String,
    pub upstream_version: String,
    /// Share of unversioned requests, relative to the model's other versions; 0 for none.
    pub weight: u32,
}

/// Every model (at least one; names must be unique), checked against the backends.
pub(super) fn validate_models(
    problems: &mut Problems,
    raw_models: &[RawModel],
    backend_index: &HashMap<&str, BackendId>,
) -> Vec<ModelConfig> {
    if raw_models.is_empty() {
        problems.add("models", "no models are configured");
    }
    let mut model_index: HashMap<&str, usize> = HashMap::new();
    let mut models = Vec::with_capacity(raw_models.len());
    for (i, model) in raw_models.iter().enumerate() {
        let path = format!("models[{i}]");
        check_name(problems, &format!("{path}.name"), "model name", &model.name);
        if let Some(first) = model_index.insert(&model.name, i) {
            problems.add(
                format!("{path}.name"),
                format!("duplicate model name \"{}\" (also models[{first}])", model.name),
            );
        }
        models.push(validate_model(problems, &path, model, backend_index));
    }
    models
}

/// One model's versions, mirror and stickiness, checked against the backends (its name is checked by the caller).
fn validate_model(
    problems: &mut Problems,
    path: &str,
    model: &RawModel,
    backend_index: &HashMap<&str, BackendId>,
) -> ModelConfig {
    if model.versions.is_empty() {
        problems.add(format!("{path}.versions"), "a model needs at least one version");
    }
    let mut versions: Vec<VersionConfig> = Vec::with_capacity(model.versions.len());
    for (j, version) in model.versions.iter().enumerate() {
        let checked = validate_version(
            problems,
            &format!("{path}.versions[{j}]"),
            model,
            version,
            backend_index,
        );
        if versions.iter().any(|v| v.version == checked.version) {
            problems.add(
                format!("{path}.versions[{j}].version"),
                format!("version \"{}\" is listed twice", version.version),
            );
        }
        versions.push(checked);
    }
    let known: Vec<String> = versions.iter().map(|v| v.version.clone()).collect();
    settle_weights(problems, path, model, &mut versions, &known);
    let default_version = versions
        .iter()
        .fold(None::<&VersionConfig>, |best, v| match best {
            Some(b) if b.weight >= v.weight => Some(b),
            _ => Some(v),
        })
        .map(|v| v.version.clone())
        .unwrap_or_default();
    ModelConfig {
        name: model.name.clone(),
        default_version,
        sticky_header: sticky_header(problems, path, model),
        mirror: mirror(problems, path, model, &versions, &known),
        versions,
        decoupled: model.decoupled,
        limits: model_limits(problems, path, model),
        tokens: token_count(problems, path, model),
        payload_log: model.payload_log.unwrap_or(true),
    }
}

/// A model's rate, concurrency and time limits.
fn model_limits(problems: &mut Problems, path: &str, model: &RawModel) -> ModelLimits {
    if model.max_concurrent == Some(0) {
        problems.add(format!("{path}.max_concurrent"), "must be at least 1");
    }
    ModelLimits {
        rate: model
            .rate
            .as_ref()
            .map(|rate| validate_rate(problems, &format!("{path}.rate"), rate))
            .unwrap_or_default(),
        max_concurrent: model.max_concurrent.and_then(std::num::NonZeroU32::new),
        timeout: model
            .timeout_ms
            .map(|ms| std::time::Duration::from_millis(positive(problems, &format!("{path}.timeout_ms"), Some(ms), 1))),
        shed: match (model.max_queue, model.shed_priority_below) {
            (Some(max_queue), keep) => Some(Shed {
                max_queue,
                keep_priority: keep.unwrap_or(0),
            }),
            (None, Some(_)) => {
                problems.add(format!("{path}.shed_priority_below"), "applies with max_queue only");
                None
            }
            (None, None) => None,
        },
    }
}

/// How the model's generated tokens are counted: `tokens_output_holds` needs the output it speaks of.
fn token_count(problems: &mut Problems, path: &str, model: &RawModel) -> TokenCount {
    if model.tokens_output.is_none() && model.tokens_output_holds.is_some() {
        problems.add(format!("{path}.tokens_output_holds"), "applies with tokens_output only");
    }
    if model.tokens_output.as_deref().is_some_and(str::is_empty) {
        problems.add(format!("{path}.tokens_output"), "must name an output");
    }
    TokenCount {
        output: model.tokens_output.clone(),
        holds: model.tokens_output_holds.unwrap_or_default(),
    }
}

/// One version of a model: its names and its backend.
fn validate_version(
    problems: &mut Problems,
    vpath: &str,
    model: &RawModel,
    version: &RawVersion,
    backend_index: &HashMap<&str, BackendId>,
) -> VersionConfig {
    check_name(problems, &format!("{vpath}.version"), "version", &version.version);
    let backend = backend_index.get(version.backend.as_str()).copied().unwrap_or_else(|| {
        problems.add(
            format!("{vpath}.backend"),
            format!("no backend named \"{}\"", version.backend),
        );
        BackendId::UNRESOLVED
    });
    let upstream_name = version.upstream_name.clone().unwrap_or_else(|| model.name.clone());
    let upstream_version = version
        .upstream_version
        .clone()
        .unwrap_or_else(|| version.version.clone());
    check_name(
        problems,
        &format!("{vpath}.upstream_name"),
        "upstream name",
        &upstream_name,
    );
    // An empty upstream version calls the backend's model without one: its default version.
    if !upstream_version.is_empty() {
        check_name(
            problems,
            &format!("{vpath}.upstream_version"),
            "upstream version",
            &upstream_version,
        );
    }
    VersionConfig {
        version: version.version.clone(),
        backend,
        upstream_name,
        upstream_version,
        weight: version.weight.unwrap_or(0),
    }
}

/// Where requests that name no version go: the weights given, else all to `default_version`, else all to the
/// latest version.
fn settle_weights(
    problems: &mut Problems,
    path: &str,
    model: &RawModel,
    versions: &mut [VersionConfig],
    known: &[String],
) {
    let weighted = model.versions.iter().any(|v| v.weight.is_some());
    match (&model.default_version, weighted) {
        (Some(_), true) => problems.add(
            format!("{path}.default_version"),
            "give either default_version or weights on the versions, not both",
        ),
        (Some(default), false) => match versions.iter_mut().find(|v| &v.version == default) {
            Some(version) => version.weight = 100,
            None => problems.add(
                format!("{path}.default_version"),
                format!("\"{default}\" is not one of the model's versions {known:?}"),
            ),
        },
        (None, false) => {
            let latest = latest(versions);
            if let Some(version) = versions.iter_mut().find(|v| Some(&v.version) == latest.as_ref()) {
                version.weight = 100;
            }
        }
        (None, true) => {
            let total: u64 = versions.iter().map(|v| u64::from(v.weight)).sum();
            if total == 0 && !versions.is_empty() {
                problems.add(
                    format!("{path}.versions"),
                    "every weight is 0: requests that name no version would have nowhere to go",
                );
            }
        }
    }
}

/// The header whose value keeps a client on one version, when it is one a client can send end to end.
fn sticky_header(problems: &mut Problems, path: &str, model: &RawModel) -> Option<http::HeaderName> {
    let name = model.sticky_header.as_ref()?;
    match http::HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()) {
        Ok(header) if crate::headers::is_end_to_end(&header) => Some(header),
        _ => {
            problems.add(
                format!("{path}.sticky_header"),
                format!("\"{name}\" is not a header name a client can send end to end"),
            );
            None
        }
    }
}

/// The version requests are copied to, and how many of them.
fn mirror(
    problems: &mut Problems,
    path: &str,
    model: &RawModel,
    versions: &[VersionConfig],
    known: &[String],
) -> Option<MirrorConfig> {
    let mirror = model.mirror.as_ref()?;
    let index = versions.iter().position(|v| v.version == mirror.version);
    if index.is_none() {
        problems.add(
            format!("{path}.mirror.version"),
            format!("\"{}\" is not one of the model's versions {known:?}", mirror.version),
        );
    }
    if !(mirror.percent > 0.0 && mirror.percent <= 100.0) {
        problems.add(
            format!("{path}.mirror.percent"),
            format!("{} is not above 0 and at most 100", mirror.percent),
        );
        return None;
    }
    let per_million = per_million(mirror.percent);
    index.map(|version| MirrorConfig { version, per_million })
}

/// A percentage in (0, 100] as millionths.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn per_million(percent: f64) -> u32 {
    // Clamped into 1..=1,000,000 first, so the cast neither truncates nor loses a sign.
    (percent * 10_000.0).round().clamp(1.0, 1_000_000.0) as u32
}

/// With no `default_version`: the highest numeric version, as model servers choose; the last listed when versions are
/// not all numbers.
fn latest(versions: &[VersionConfig]) -> Option<String> {
    let numeric: Option<Vec<(u64, &str)>> = versions
        .iter()
        .map(|v| v.version.parse::<u64>().ok().map(|n| (n, v.version.as_str())))
        .collect();
    match numeric {
        Some(numbers) => numbers.into_iter().max_by_key(|(n, _)| *n).map(|(_, v)| v.to_owned()),
        None => versions.last().map(|v| v.version.clone()),
    }
}
