//! The configuration as written: the top-level table of sections (each section's own keys are in its module), read
//! from a TOML file with `OIPGATE__SECTION__KEY` environment overrides on top.

use std::path::Path;

use serde::Deserialize;

use super::auth::RawAuth;
use super::backends::RawBackend;
use super::limits::RawLimits;
use super::listen::{RawListen, RawServerTls};
use super::models::RawModel;
use super::process::{RawMetrics, RawReload, RawRuntime, RawShutdown, ReadyPolicy};
use super::telemetry::{RawPayloadLog, RawTracing};

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// What the gateway's readiness requires: every model (default) or any.
    #[serde(default)]
    pub ready_policy: ReadyPolicy,
    #[serde(default)]
    pub listen: RawListen,
    #[serde(default)]
    pub limits: RawLimits,
    /// TLS on the front doors.
    pub tls: Option<RawServerTls>,
    #[serde(default)]
    pub shutdown: RawShutdown,
    #[serde(default)]
    pub reload: RawReload,
    #[serde(default)]
    pub runtime: RawRuntime,
    #[serde(default)]
    pub metrics: RawMetrics,
    /// Who may call what; absent, anyone who reaches a door may call anything.
    pub auth: Option<RawAuth>,
    /// OpenTelemetry traces; absent, none are made.
    pub tracing: Option<RawTracing>,
    /// Inference payloads sent as CloudEvents; absent, none are.
    pub payload_log: Option<RawPayloadLog>,
    #[serde(default)]
    pub backends: Vec<RawBackend>,
    #[serde(default)]
    pub models: Vec<RawModel>,
}

/// A problem found while loading or validating, with the key it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Key path such as `models[2].versions[0].backend`; empty for the file as a whole.
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Reads `path` (TOML) with environment overrides (`OIPGATE__LIMITS__MAX_REQUEST_BYTES=...`) from `environment`.
pub fn load(path: &Path, environment: &[(String, String)]) -> Result<RawConfig, Problem> {
    let text = std::fs::read_to_string(path).map_err(|e| Problem {
        path: String::new(),
        message: format!("cannot read {}: {e}", path.display()),
    })?;
    parse(&text, environment)
}

/// Parses TOML text with environment overrides.
pub fn parse(text: &str, environment: &[(String, String)]) -> Result<RawConfig, Problem> {
    let overrides: config::Map<String, String> = environment.iter().cloned().collect();
    let layered = config::Config::builder()
        .add_source(config::File::from_str(text, config::FileFormat::Toml))
        .add_source(
            config::Environment::with_prefix("OIPGATE")
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true)
                .source(Some(overrides)),
        )
        .build()
        .map_err(|e| Problem {
            path: String::new(),
            message: e.to_string(),
        })?;
    serde_path_to_error::deserialize(layered).map_err(|e| {
        let message = e.inner().to_string();
        // The config crate appends the key it was at; the path already says so.
        let message = match message.rfind(" for key `") {
            Some(at) if message.ends_with('`') => message[..at].to_owned(),
            _ => message,
        };
        Problem {
            path: e.path().to_string().trim_start_matches('.').replace('?', ""),
            message,
        }
    })
}
