//! Gateway configuration: read raw (TOML plus environment overrides), then validated into types that cannot hold a
//! bad route. Each section has its module, with its raw keys, its validated type and its validator; this one puts
//! them together. Every problem is reported with its key path; a value of the wrong kind (a number for a string, a
//! word that is no choice of its key) stops reading at that key.

pub mod auth;
pub mod backends;
pub mod endpoint;
pub mod endpoints_file;
pub mod limits;
pub mod listen;
pub mod load;
pub mod models;
pub mod process;
pub mod raw;
pub mod shared_limits;
pub mod telemetry;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

pub use auth::{ApiKey, Auth, Jwt, ModelScope};
pub use backends::*;
pub use endpoint::Endpoint;
pub use limits::*;
pub use listen::*;
pub use load::{LoadSource, RawLoad};
pub use models::*;
pub use process::*;
pub use raw::{Problem, RawConfig};
pub use shared_limits::{SharedLimits, WhenUnreachable};
pub use telemetry::{LogMode, LoggedTensors, PayloadLog, Tracing};

/// The metrics label standing for every series past its bound and for calls by no configured principal: no
/// configured name may take it.
pub const OTHER_LABEL: &str = "_other";

/// A validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub ready_policy: ReadyPolicy,
    pub listen: Listen,
    pub limits: Limits,
    /// Rate limits and token budgets shared through Redis; `None`: each replica keeps its own.
    pub shared_limits: Option<SharedLimits>,
    /// TLS on the front doors.
    pub tls: Option<ServerTls>,
    pub shutdown: Shutdown,
    pub reload: Reload,
    /// Worker threads of each front door.
    pub threads: usize,
    /// Series each metric may have (`[metrics] max_series`).
    pub max_series: usize,
    /// Who may call what; `None`: anyone, anything.
    pub auth: Option<Auth>,
    /// Traces sent to an OTLP collector; `None`: no spans are made.
    pub tracing: Option<Tracing>,
    /// Inference payloads sent to a CloudEvents sink; `None`: none are.
    pub payload_log: Option<PayloadLog>,
    /// Private, with the models: a model's version names its backend by a [`BackendId`] into this list, which
    /// nothing outside validation can change.
    backends: Vec<Backend>,
    models: Vec<ModelConfig>,
}

impl Config {
    /// Loads, layers environment overrides and validates; every problem is returned.
    /// Relative file paths in it (certificates, keys) are taken from the file's directory.
    pub fn load(path: &Path, environment: &[(String, String)]) -> Result<Config, Vec<Problem>> {
        let base = path.parent().unwrap_or_else(|| Path::new("."));
        validate_in(raw::load(path, environment).map_err(|p| vec![p])?, base)
    }

    /// Every file the configuration names (certificates, keys, CA bundles), for watching.
    pub fn files(&self) -> Vec<PathBuf> {
        let mut files = Vec::new();
        if let Some(tls) = &self.tls {
            files.extend([tls.cert.clone(), tls.key.clone()]);
            files.extend(tls.client_ca.clone());
        }
        for backend in &self.backends {
            if let Some(tls) = &backend.tls {
                files.extend(tls.ca.clone());
                if let Some((cert, key)) = &tls.client_cert {
                    files.extend([cert.clone(), key.clone()]);
                }
            }
        }
        files.extend(
            self.auth
                .iter()
                .flat_map(|auth| &auth.jwt)
                .map(|jwt| jwt.jwks_file.clone()),
        );
        files
    }

    /// The backend a model's version is served by.
    pub fn backend(&self, id: BackendId) -> &Backend {
        &self.backends[id.index()]
    }

    pub fn backends(&self) -> &[Backend] {
        &self.backends
    }

    pub fn models(&self) -> &[ModelConfig] {
        &self.models
    }

    /// One line for logs and `check-config`.
    pub fn summary(&self) -> String {
        let endpoints: usize = self.backends.iter().map(|b| b.endpoints.len()).sum();
        let discovered = self
            .backends
            .iter()
            .filter(|b| matches!(b.discovery, Discovery::Dns { .. } | Discovery::File { .. }))
            .count();
        let discovered = if discovered > 0 {
            format!(" + {discovered} discovered")
        } else {
            String::new()
        };
        let versions: usize = self.models.iter().map(|m| m.versions.len()).sum();
        let tls = |on: bool| if self.tls.is_some() && on { " (TLS)" } else { "" };
        format!(
            "{} backends ({endpoints} endpoints{discovered}), {} models ({versions} versions); REST {}{}, gRPC {}{}",
            self.backends.len(),
            self.models.len(),
            self.listen.rest,
            tls(self.tls.as_ref().is_some_and(|t| t.rest)),
            self.listen.grpc,
            tls(self.tls.as_ref().is_some_and(|t| t.grpc)),
        )
    }
}

/// The environment's `OIPGATE__...` overrides.
pub fn environment_overrides() -> Vec<(String, String)> {
    std::env::vars()
        .filter(|(key, _)| key.starts_with("OIPGATE__"))
        .collect()
}

/// Collects problems with their key paths.
#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }
}

/// The choice a word names among `choices` (word, value), or a message listing them.
fn choice<T: Copy>(word: &str, choices: &[(&str, T)]) -> Result<T, String> {
    choices
        .iter()
        .find(|(name, _)| *name == word)
        .map(|(_, value)| *value)
        .ok_or_else(|| {
            let names: Vec<String> = choices.iter().map(|(name, _)| format!("\"{name}\"")).collect();
            match names.split_last() {
                Some((last, others)) if !others.is_empty() => {
                    format!("\"{word}\" is not {} or {last}", others.join(", "))
                }
                _ => format!("\"{word}\" is not {}", names.join("")),
            }
        })
}

/// A name that can stand in a URL path segment.
fn check_name(problems: &mut Problems, path: &str, what: &str, name: &str) {
    if name.is_empty() {
        problems.add(path, format!("{what} must not be empty"));
    } else if name.contains(['/', '?', '#']) || name.chars().any(char::is_whitespace) {
        problems.add(
            path,
            format!("{what} \"{name}\" must not contain '/', '?', '#' or whitespace"),
        );
    }
}

/// A count or a time in milliseconds that must be at least 1: the value, else `default`.
fn positive(problems: &mut Problems, path: &str, value: Option<u64>, default: u64) -> u64 {
    match value {
        Some(0) => {
            problems.add(path, "must be at least 1");
            default
        }
        Some(value) => value,
        None => default,
    }
}

/// A file path from the configuration, relative ones taken from `base`.
fn file(problems: &mut Problems, path: &str, value: &str, base: &Path) -> PathBuf {
    if value.trim().is_empty() {
        problems.add(path, "must name a file");
    }
    base.join(value)
}

/// Turns a raw configuration into a valid one, or every problem with it; relative paths stay as written.
pub fn validate(raw: RawConfig) -> Result<Config, Vec<Problem>> {
    validate_in(raw, Path::new(""))
}

/// Turns a raw configuration into a valid one, or every problem with it; relative paths are taken from `base`.
pub fn validate_in(raw: RawConfig, base: &Path) -> Result<Config, Vec<Problem>> {
    let mut problems = Problems::default();
    let listen = validate_listen(&mut problems, &raw.listen);
    let limits = validate_limits(&mut problems, &raw.limits);
    let shared_limits = raw
        .limits
        .shared
        .as_ref()
        .map(|shared| shared_limits::validate_shared_limits(&mut problems, shared));
    let (backends, backend_index) = validate_backends(&mut problems, &raw.backends, base);
    let models = validate_models(&mut problems, &raw.models, &backend_index);
    for (i, model) in models.iter().enumerate() {
        if model.limits.shed.is_none() {
            continue;
        }
        for version in &model.versions {
            if let Some(backend) = backends.get(version.backend.index())
                && backend.policy.load.is_none()
            {
                problems.add(
                    format!("models[{i}].max_queue"),
                    format!("needs the queues of backend \"{}\": it has no `load`", backend.name),
                );
            }
        }
    }
    let model_names: HashSet<&str> = raw.models.iter().map(|m| m.name.as_str()).collect();
    let auth = raw
        .auth
        .as_ref()
        .map(|auth| auth::validate_auth(&mut problems, auth, &model_names, base));
    let tls = validate_tls(&mut problems, raw.tls.as_ref(), base);
    let shutdown = validate_shutdown(&raw.shutdown);
    let reload = validate_reload(&mut problems, &raw.reload);
    let threads = validate_threads(&mut problems, &raw.runtime);
    let max_series = validate_metrics(&mut problems, &raw.metrics);
    let tracing = raw
        .tracing
        .as_ref()
        .and_then(|tracing| telemetry::validate_tracing(&mut problems, tracing));
    let payload_log = raw
        .payload_log
        .as_ref()
        .and_then(|log| telemetry::validate_payload_log(&mut problems, log, &model_names));
    let mut models = models;
    for model in &mut models {
        model.payload_log &= payload_log.as_ref().is_some_and(|log| log.covers(&model.name));
    }
    match listen {
        Some(listen) if problems.0.is_empty() => Ok(Config {
            ready_policy: raw.ready_policy,
            listen,
            limits,
            shared_limits,
            tls,
            shutdown,
            reload,
            threads,
            max_series,
            auth,
            tracing,
            payload_log,
            backends,
            models,
        }),
        _ => Err(problems.0),
    }
}
