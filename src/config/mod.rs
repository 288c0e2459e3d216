//! Gateway configuration: read raw (TOML plus environment overrides), then validated into types that cannot hold a
//! bad route. Every problem is reported with its key path, all at once.

pub mod raw;
mod types;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use raw::{Problem, RawConfig};
pub use types::*;

/// Default REST front door.
pub const DEFAULT_REST: &str = "127.0.0.1:8000";
/// Default gRPC front door.
pub const DEFAULT_GRPC: &str = "127.0.0.1:8001";
/// Default body / message limit: 64 MiB.
pub const DEFAULT_MAX_REQUEST_BYTES: u64 = 64 << 20;
/// Default whole-request deadline.
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 30_000;
/// How long an inference stream may be silent both ways: five minutes (a model may think long between tokens).
pub const DEFAULT_STREAM_IDLE_TIMEOUT_MS: u64 = 300_000;
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// Default time in-flight requests get after SIGTERM.
pub const DEFAULT_GRACE_PERIOD_MS: u64 = 30_000;
/// Default interval of DNS re-resolution.
pub const DEFAULT_DNS_INTERVAL_MS: u64 = 5_000;
/// Default interval at which the configuration file is looked at.
pub const DEFAULT_WATCH_INTERVAL_MS: u64 = 1_000;

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
        files
    }

    /// One line for logs and `check-config`.
    pub fn summary(&self) -> String {
        let endpoints: usize = self.backends.iter().map(|b| b.endpoints.len()).sum();
        let discovered = self
            .backends
            .iter()
            .filter(|b| matches!(b.discovery, Discovery::Dns { .. }))
            .count();
        let discovered = if discovered > 0 {
            format!(" + {discovered} through DNS")
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

fn address(problems: &mut Problems, path: &str, value: Option<&str>, default: Option<&str>) -> Option<SocketAddr> {
    let text = value.or(default)?;
    match text.parse() {
        Ok(addr) => Some(addr),
        Err(_) => {
            problems.add(path, format!("\"{text}\" is not an address (ip:port)"));
            None
        }
    }
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

/// One backend's settings, checked (its name is checked by the caller, which sees the others).
fn validate_backend(problems: &mut Problems, path: &str, backend: &raw::RawBackend, base: &Path) -> Backend {
    let protocol = match backend.protocol.as_str() {
        "rest" => BackendProtocol::Rest,
        "grpc" => BackendProtocol::Grpc,
        other => {
            problems.add(
                format!("{path}.protocol"),
                format!("\"{other}\" is not \"rest\" or \"grpc\""),
            );
            BackendProtocol::Rest
        }
    };
    let stream = match backend.stream.as_deref() {
        None | Some("triton") => StreamDialect::Triton,
        Some("mlserver") => StreamDialect::Mlserver,
        Some(other) => {
            problems.add(
                format!("{path}.stream"),
                format!("\"{other}\" is not \"triton\" or \"mlserver\""),
            );
            StreamDialect::Triton
        }
    };
    if backend.binary_data && protocol == BackendProtocol::Grpc {
        problems.add(format!("{path}.binary_data"), "applies to REST backends only");
    }
    let discovery = backend_discovery(problems, path, backend);
    let tls = backend_tls(problems, path, backend, base);
    let endpoints = backend_endpoints(problems, path, backend);
    let policy = backend_policy(problems, path, backend);
    Backend {
        name: backend.name.clone(),
        protocol,
        endpoints,
        discovery,
        binary_data: backend.binary_data,
        compression: backend.compression,
        stream,
        policy,
        tls,
    }
}

/// How a backend's endpoints are found: listed, or resolved from `dns` (with its interval and server).
fn backend_discovery(problems: &mut Problems, path: &str, backend: &raw::RawBackend) -> Discovery {
    let discovery = match (&backend.dns, backend.endpoints.is_empty()) {
        (None, true) => {
            problems.add(
                format!("{path}.endpoints"),
                "a backend needs at least one endpoint, or `dns`",
            );
            Discovery::Static
        }
        (None, false) => Discovery::Static,
        (Some(_), false) => {
            problems.add(format!("{path}.dns"), "give either endpoints or dns, not both");
            Discovery::Static
        }
        (Some(name), true) => match Endpoint::parse(name) {
            Ok(Endpoint { host, port }) => Discovery::Dns {
                host,
                port,
                interval: Duration::from_millis(match backend.dns_interval_ms {
                    Some(0) => {
                        problems.add(format!("{path}.dns_interval_ms"), "must be at least 1");
                        DEFAULT_DNS_INTERVAL_MS
                    }
                    value => value.unwrap_or(DEFAULT_DNS_INTERVAL_MS),
                }),
                server: backend
                    .dns_server
                    .as_deref()
                    .and_then(|server| address(problems, &format!("{path}.dns_server"), Some(server), None)),
            },
            Err(message) => {
                problems.add(format!("{path}.dns"), message);
                Discovery::Static
            }
        },
    };
    if backend.dns.is_none() {
        for key in [
            ("dns_interval_ms", backend.dns_interval_ms.is_some()),
            ("dns_server", backend.dns_server.is_some()),
        ]
        .iter()
        .filter(|(_, set)| *set)
        {
            problems.add(format!("{path}.{}", key.0), "applies only with `dns`");
        }
    }
    discovery
}

/// A backend's TLS settings: its CA, client certificate and key (both or neither), and server name.
fn backend_tls(problems: &mut Problems, path: &str, backend: &raw::RawBackend, base: &Path) -> Option<BackendTls> {
    backend.tls.as_ref().map(|tls| {
        let client_cert = match (&tls.cert, &tls.key) {
            (Some(cert), Some(key)) => Some((
                file(problems, &format!("{path}.tls.cert"), cert, base),
                file(problems, &format!("{path}.tls.key"), key, base),
            )),
            (None, None) => None,
            (Some(_), None) => {
                problems.add(format!("{path}.tls.key"), "a client certificate needs its key");
                None
            }
            (None, Some(_)) => {
                problems.add(format!("{path}.tls.cert"), "a client key needs its certificate");
                None
            }
        };
        if let Some(name) = &tls.server_name
            && rustls_pki_types::ServerName::try_from(name.as_str()).is_err()
        {
            problems.add(
                format!("{path}.tls.server_name"),
                format!("\"{name}\" is not a DNS name or IP address"),
            );
        }
        BackendTls {
            ca: tls
                .ca
                .as_ref()
                .map(|ca| file(problems, &format!("{path}.tls.ca"), ca, base)),
            client_cert,
            server_name: tls.server_name.clone(),
        }
    })
}

/// A backend's listed endpoints, each parsed and none twice.
fn backend_endpoints(problems: &mut Problems, path: &str, backend: &raw::RawBackend) -> Vec<Endpoint> {
    let mut endpoints = Vec::with_capacity(backend.endpoints.len());
    for (j, text) in backend.endpoints.iter().enumerate() {
        match Endpoint::parse(text) {
            Ok(endpoint) if endpoints.contains(&endpoint) => {
                problems.add(format!("{path}.endpoints[{j}]"), format!("{endpoint} is listed twice"));
            }
            Ok(endpoint) => endpoints.push(endpoint),
            Err(message) => problems.add(format!("{path}.endpoints[{j}]"), message),
        }
    }
    endpoints
}

/// One model's versions, mirror and stickiness, checked against the backends (its name is checked by the caller).
fn validate_model(
    problems: &mut Problems,
    path: &str,
    model: &raw::RawModel,
    backend_index: &HashMap<&str, usize>,
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
    }
}

/// One version of a model: its names and its backend.
fn validate_version(
    problems: &mut Problems,
    vpath: &str,
    model: &raw::RawModel,
    version: &raw::RawVersion,
    backend_index: &HashMap<&str, usize>,
) -> VersionConfig {
    check_name(problems, &format!("{vpath}.version"), "version", &version.version);
    let backend = backend_index.get(version.backend.as_str()).copied().unwrap_or_else(|| {
        problems.add(
            format!("{vpath}.backend"),
            format!("no backend named \"{}\"", version.backend),
        );
        0
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
    model: &raw::RawModel,
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
fn sticky_header(problems: &mut Problems, path: &str, model: &raw::RawModel) -> Option<http::HeaderName> {
    let name = model.sticky_header.as_ref()?;
    match http::HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()) {
        Ok(header) if crate::headers::is_end_to_end(header.as_str()) => Some(header),
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
    model: &raw::RawModel,
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

/// Turns a raw configuration into a valid one, or every problem with it; relative paths stay as written.
pub fn validate(raw: RawConfig) -> Result<Config, Vec<Problem>> {
    validate_in(raw, Path::new(""))
}

/// A file path from the configuration, relative ones taken from `base`.
fn file(problems: &mut Problems, path: &str, value: &str, base: &Path) -> PathBuf {
    if value.trim().is_empty() {
        problems.add(path, "must name a file");
    }
    base.join(value)
}

/// Turns a raw configuration into a valid one, or every problem with it; relative paths are taken from `base`.
pub fn validate_in(raw: RawConfig, base: &Path) -> Result<Config, Vec<Problem>> {
    let mut problems = Problems::default();
    let (rest, grpc, metrics) = validate_listen(&mut problems, &raw.listen);
    let limits = validate_limits(&mut problems, &raw.limits);
    let (backends, backend_index) = validate_backends(&mut problems, &raw.backends, base);
    let models = validate_models(&mut problems, &raw.models, &backend_index);
    let tls = raw.tls.as_ref().map(|tls| ServerTls {
        cert: file(&mut problems, "tls.cert", &tls.cert, base),
        key: file(&mut problems, "tls.key", &tls.key, base),
        client_ca: tls
            .client_ca
            .as_ref()
            .map(|ca| file(&mut problems, "tls.client_ca", ca, base)),
        rest: tls.rest.unwrap_or(true),
        grpc: tls.grpc.unwrap_or(true),
    });
    let shutdown = Shutdown {
        grace_period: Duration::from_millis(raw.shutdown.grace_period_ms.unwrap_or(DEFAULT_GRACE_PERIOD_MS)),
        drain_delay: Duration::from_millis(raw.shutdown.drain_delay_ms.unwrap_or(0)),
    };
    let reload = validate_reload(&mut problems, &raw.reload);
    let threads = match raw.runtime.threads {
        Some(0) => {
            problems.add("runtime.threads", "must be at least 1");
            1
        }
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(2, usize::from),
    };
    let ready_policy = validate_ready_policy(&mut problems, raw.ready_policy.as_deref());
    if !problems.0.is_empty() {
        return Err(problems.0);
    }
    let (Some(rest), Some(grpc)) = (rest, grpc) else {
        return Err(vec![Problem {
            path: "listen".into(),
            message: "missing addresses".into(),
        }]);
    };
    Ok(Config {
        ready_policy,
        listen: Listen { rest, grpc, metrics },
        limits,
        tls,
        shutdown,
        reload,
        threads,
        backends,
        models,
    })
}

/// The three listening addresses (REST and gRPC have defaults; they may not be the same).
fn validate_listen(
    problems: &mut Problems,
    listen: &raw::RawListen,
) -> (Option<SocketAddr>, Option<SocketAddr>, Option<SocketAddr>) {
    let rest = address(problems, "listen.rest", listen.rest.as_deref(), Some(DEFAULT_REST));
    let grpc = address(problems, "listen.grpc", listen.grpc.as_deref(), Some(DEFAULT_GRPC));
    let metrics = address(problems, "listen.metrics", listen.metrics.as_deref(), None);
    if rest.is_some() && rest == grpc && rest.is_some_and(|a| a.port() != 0) {
        problems.add("listen.grpc", "the gRPC address is the same as the REST address");
    }
    (rest, grpc, metrics)
}

/// The request size and time limits.
fn validate_limits(problems: &mut Problems, limits: &raw::RawLimits) -> Limits {
    let max_request_bytes = limits.max_request_bytes.unwrap_or(DEFAULT_MAX_REQUEST_BYTES);
    if max_request_bytes == 0 || max_request_bytes > u64::from(u32::MAX) {
        problems.add(
            "limits.max_request_bytes",
            format!("{max_request_bytes} is outside 1 to {} bytes", u32::MAX),
        );
    }
    let timeout_ms = limits.request_timeout_ms.unwrap_or(DEFAULT_REQUEST_TIMEOUT_MS);
    if timeout_ms == 0 {
        problems.add("limits.request_timeout_ms", "must be at least 1");
    }
    let header_timeout_ms = limits.header_read_timeout_ms.unwrap_or(DEFAULT_HEADER_READ_TIMEOUT_MS);
    if header_timeout_ms == 0 {
        problems.add("limits.header_read_timeout_ms", "must be at least 1");
    }
    let stream_idle_ms = limits.stream_idle_timeout_ms.unwrap_or(DEFAULT_STREAM_IDLE_TIMEOUT_MS);
    if stream_idle_ms == 0 {
        problems.add("limits.stream_idle_timeout_ms", "must be at least 1");
    }
    Limits {
        max_request_bytes,
        request_timeout: Duration::from_millis(timeout_ms),
        header_read_timeout: Duration::from_millis(header_timeout_ms),
        stream_idle_timeout: Duration::from_millis(stream_idle_ms),
    }
}

/// Every backend, and where each name stands in the list (names must be unique).
fn validate_backends<'a>(
    problems: &mut Problems,
    raw_backends: &'a [raw::RawBackend],
    base: &Path,
) -> (Vec<Backend>, HashMap<&'a str, usize>) {
    let mut backend_index: HashMap<&str, usize> = HashMap::new();
    let mut backends = Vec::with_capacity(raw_backends.len());
    for (i, backend) in raw_backends.iter().enumerate() {
        let path = format!("backends[{i}]");
        check_name(problems, &format!("{path}.name"), "backend name", &backend.name);
        if let Some(first) = backend_index.insert(&backend.name, i) {
            problems.add(
                format!("{path}.name"),
                format!("duplicate backend name \"{}\" (also backends[{first}])", backend.name),
            );
        }
        backends.push(validate_backend(problems, &path, backend, base));
    }
    (backends, backend_index)
}

/// Every model (at least one; names must be unique), checked against the backends.
fn validate_models(
    problems: &mut Problems,
    raw_models: &[raw::RawModel],
    backend_index: &HashMap<&str, usize>,
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

/// The configuration file's watch.
fn validate_reload(problems: &mut Problems, reload: &raw::RawReload) -> Reload {
    let interval = match reload.watch_interval_ms {
        Some(0) => {
            problems.add("reload.watch_interval_ms", "must be at least 1");
            DEFAULT_WATCH_INTERVAL_MS
        }
        value => value.unwrap_or(DEFAULT_WATCH_INTERVAL_MS),
    };
    Reload {
        watch: reload.watch.unwrap_or(true),
        interval: Duration::from_millis(interval),
    }
}

fn validate_ready_policy(problems: &mut Problems, policy: Option<&str>) -> ReadyPolicy {
    match policy {
        None | Some("all_models") => ReadyPolicy::AllModels,
        Some("any_model") => ReadyPolicy::AnyModel,
        Some(other) => {
            problems.add(
                "ready_policy",
                format!("\"{other}\" is not \"all_models\" or \"any_model\""),
            );
            ReadyPolicy::AllModels
        }
    }
}

fn backend_policy(problems: &mut Problems, path: &str, backend: &raw::RawBackend) -> BackendPolicy {
    let defaults = BackendPolicy::default();
    let lb = match backend.lb.as_deref() {
        None | Some("round_robin") => LoadBalancing::RoundRobin,
        Some("least_request") => LoadBalancing::LeastRequest,
        Some("consistent_hash") => LoadBalancing::ConsistentHash,
        Some(other) => {
            problems.add(
                format!("{path}.lb"),
                format!("\"{other}\" is not \"round_robin\", \"least_request\" or \"consistent_hash\""),
            );
            LoadBalancing::RoundRobin
        }
    };
    if backend.max_in_flight == Some(0) {
        problems.add(format!("{path}.max_in_flight"), "must be at least 1");
    }
    let mut positive = |key: &str, value: Option<u64>, default: u64| -> u64 {
        match value {
            Some(0) => {
                problems.add(format!("{path}.{key}"), "must be at least 1");
                default
            }
            Some(value) => value,
            None => default,
        }
    };
    let queue_timeout = positive("queue_timeout_ms", backend.queue_timeout_ms, DEFAULT_QUEUE_TIMEOUT_MS);
    let health = backend.health.as_ref().map(|health| HealthCheck {
        interval: Duration::from_millis(positive("health.interval_ms", health.interval_ms, 1000)),
        timeout: Duration::from_millis(positive("health.timeout_ms", health.timeout_ms, 500)),
        unhealthy_after: u32::try_from(positive(
            "health.unhealthy_after",
            health.unhealthy_after.map(u64::from),
            2,
        ))
        .unwrap_or(2),
        healthy_after: u32::try_from(positive("health.healthy_after", health.healthy_after.map(u64::from), 1))
            .unwrap_or(1),
    });
    let outlier = backend.outlier.as_ref().map_or(defaults.outlier, |outlier| Outlier {
        consecutive_failures: u32::try_from(positive(
            "outlier.consecutive_failures",
            outlier.consecutive_failures.map(u64::from),
            5,
        ))
        .unwrap_or(5),
        base_ejection: Duration::from_millis(positive("outlier.base_ejection_ms", outlier.base_ejection_ms, 1000)),
        max_ejection: Duration::from_millis(positive("outlier.max_ejection_ms", outlier.max_ejection_ms, 60_000)),
    });
    BackendPolicy {
        lb,
        max_in_flight: backend.max_in_flight.filter(|&n| n > 0),
        queue_timeout: Duration::from_millis(queue_timeout),
        retries: backend.retries.unwrap_or(DEFAULT_RETRIES),
        health,
        outlier,
    }
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
