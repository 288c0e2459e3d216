//! The configuration as written: serde types that refuse unknown keys, read from a TOML file with
//! `OIPGATE__SECTION__KEY` environment overrides on top.

use std::path::Path;

use serde::Deserialize;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// "all_models" (default) or "any_model": what the gateway's readiness requires.
    pub ready_policy: Option<String>,
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
    pub backends: Vec<RawBackend>,
    #[serde(default)]
    pub models: Vec<RawModel>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawListen {
    /// REST front door, HTTP/1.1 and h2c on one port.
    pub rest: Option<String>,
    /// gRPC front door.
    pub grpc: Option<String>,
    /// Prometheus metrics.
    pub metrics: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    /// REST body and gRPC message size limit, in bytes.
    pub max_request_bytes: Option<u64>,
    /// Whole-request deadline, in milliseconds.
    pub request_timeout_ms: Option<u64>,
    /// How long a REST client may take over a request's head once its first byte has arrived, in milliseconds.
    pub header_read_timeout_ms: Option<u64>,
    /// How long an inference stream may pass with no message either way, in milliseconds.
    pub stream_idle_timeout_ms: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServerTls {
    /// PEM certificate chain, leaf first.
    pub cert: String,
    /// PEM private key.
    pub key: String,
    /// PEM CA bundle: when set, callers must present a certificate it signed (mTLS).
    pub client_ca: Option<String>,
    /// Whether the REST door speaks TLS (default true).
    pub rest: Option<bool>,
    /// Whether the gRPC door speaks TLS (default true).
    pub grpc: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawShutdown {
    /// How long in-flight requests get to finish after SIGTERM / SIGINT, in milliseconds.
    pub grace_period_ms: Option<u64>,
    /// How long, after the signal, connections are still accepted while readiness already answers 503.
    pub drain_delay_ms: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawReload {
    /// Whether the configuration file (and the TLS files it names) are watched for changes.
    pub watch: Option<bool>,
    /// How often they are looked at, in milliseconds.
    pub watch_interval_ms: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRuntime {
    /// Worker threads of each front door (default: one per core).
    pub threads: Option<usize>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBackendTls {
    /// PEM CA bundle the backend's certificate must chain to (default: the system's roots).
    pub ca: Option<String>,
    /// PEM client certificate chain, for backends that require mTLS.
    pub cert: Option<String>,
    /// PEM private key of the client certificate.
    pub key: Option<String>,
    /// The name sent as SNI and verified in the backend's certificate (default: the endpoint's or DNS host).
    pub server_name: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBackend {
    pub name: String,
    /// "rest" or "grpc".
    pub protocol: String,
    /// Replicas, as `host:port`.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// Instead of endpoints: `host:port` whose every A/AAAA record is a replica, re-resolved at an interval.
    pub dns: Option<String>,
    /// How often `dns` is re-resolved, in milliseconds.
    pub dns_interval_ms: Option<u64>,
    /// The DNS server (`ip:port`) asked for `dns`, instead of the system's resolver configuration.
    pub dns_server: Option<String>,
    /// TLS to the backend.
    pub tls: Option<RawBackendTls>,
    /// A REST backend that speaks the binary tensor data extension.
    #[serde(default)]
    pub binary_data: bool,
    /// A backend that reads compressed requests (Triton does). REST: a gzip or deflate body is proxied to it
    /// compressed instead of decompressed. gRPC: an inference whose request came compressed is sent to it
    /// compressed the same way, asking for a compressed answer.
    #[serde(default)]
    pub compression: bool,
    /// Whose inference streams it serves: "triton" (default: gRPC answers wrapped in `ModelStreamInferResponse`,
    /// REST `generate_stream` with fields by name) or "mlserver" (bare `ModelInferResponse`s, REST `infer_stream`
    /// with inference requests and responses).
    pub stream: Option<String>,
    /// "round_robin" (default), "least_request" or "consistent_hash".
    pub lb: Option<String>,
    /// Calls one endpoint may have under way; more wait briefly, then are refused.
    pub max_in_flight: Option<u32>,
    /// How long a call waits for a full endpoint, in milliseconds.
    pub queue_timeout_ms: Option<u64>,
    /// Further endpoints tried for a call that never reached its first one.
    pub retries: Option<u32>,
    /// Active health checks.
    pub health: Option<RawHealth>,
    /// Passive outlier detection.
    pub outlier: Option<RawOutlier>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealth {
    pub interval_ms: Option<u64>,
    pub timeout_ms: Option<u64>,
    pub unhealthy_after: Option<u32>,
    pub healthy_after: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOutlier {
    pub consecutive_failures: Option<u32>,
    pub base_ejection_ms: Option<u64>,
    pub max_ejection_ms: Option<u64>,
}

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
