//! The `[[backends]]` section: each backend's protocol, endpoints or DNS name, TLS and call policy, and the typed id
//! a model's version names it by.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::endpoint::Endpoint;
use super::listen::address;
use super::{Problems, check_name, choice, file, positive};

/// Default interval of DNS re-resolution.
pub const DEFAULT_DNS_INTERVAL_MS: u64 = 5_000;
/// How often an `endpoints_file` is read again.
pub const DEFAULT_ENDPOINTS_FILE_INTERVAL_MS: u64 = 1_000;

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
    pub protocol: BackendProtocol,
    /// Replicas, as `host:port`, or `{ address = "host:port", metrics = "host:port" }` for one whose metrics
    /// (read by `load`) are served at an address of their own.
    #[serde(default)]
    pub endpoints: Vec<RawEndpoint>,
    /// Instead of endpoints: `host:port` whose every A/AAAA record is a replica, re-resolved at an interval.
    pub dns: Option<String>,
    /// How often `dns` is re-resolved, in milliseconds.
    pub dns_interval_ms: Option<u64>,
    /// The DNS server (`ip:port`) asked for `dns`, instead of the system's resolver configuration.
    pub dns_server: Option<String>,
    /// Instead of endpoints: a file listing them (YAML or JSON, `endpoints: [{ name, address, port }]`, the shape
    /// llm-d's file discovery reads), read again at an interval; relative to the configuration's directory.
    pub endpoints_file: Option<String>,
    /// How often `endpoints_file` is read again, in milliseconds.
    pub endpoints_file_interval_ms: Option<u64>,
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
    #[serde(default)]
    pub stream: StreamDialect,
    /// "round_robin" (default), "least_request", "least_load" (needs `load`) or "consistent_hash".
    #[serde(default)]
    pub lb: LoadBalancing,
    /// Where each endpoint reports its own queue.
    pub load: Option<super::load::RawLoad>,
    /// Calls one endpoint may have under way; more wait briefly, then are refused.
    pub max_in_flight: Option<u32>,
    /// How long a call waits for a full endpoint, in milliseconds.
    pub queue_timeout_ms: Option<u64>,
    /// Further endpoints tried for a call that never reached its first one.
    pub retries: Option<u32>,
    /// Headers added to every call to this backend (REST headers, gRPC metadata), such as an access token.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// Active health checks.
    pub health: Option<RawHealth>,
    /// Passive outlier detection.
    pub outlier: Option<RawOutlier>,
}

/// An endpoint as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RawEndpoint {
    Address(String),
    WithMetrics { address: String, metrics: String },
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

/// TLS to a backend's endpoints.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BackendTls {
    /// CA bundle; the system's roots when absent.
    pub ca: Option<PathBuf>,
    /// Client certificate chain and key, for mTLS.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// SNI and the name verified, when not the endpoint's host.
    pub server_name: Option<String>,
}

/// Where a backend's endpoints come from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Discovery {
    /// The listed endpoints.
    Static,
    /// Every address `host` resolves to, at `port`, re-resolved every `interval`.
    Dns {
        host: String,
        port: u16,
        interval: Duration,
        /// The DNS server asked, instead of the system's configuration.
        server: Option<SocketAddr>,
    },
    /// The endpoints `path` lists, read again every `interval`.
    File { path: PathBuf, interval: Duration },
}

impl Discovery {
    /// How often a discovered backend's endpoints are looked up again; `None` for listed ones.
    pub fn interval(&self) -> Option<Duration> {
        match self {
            Discovery::Static => None,
            Discovery::Dns { interval, .. } | Discovery::File { interval, .. } => Some(*interval),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(try_from = "String")]
pub enum BackendProtocol {
    Rest,
    Grpc,
}

/// Whose inference streams a backend serves: they differ on the wire, and one is never read as the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum StreamDialect {
    /// Triton: gRPC `ModelStreamInfer` answers `ModelStreamInferResponse` (an error message or a response, a
    /// decoupled model's last flagged `triton_final_response`); REST `generate_stream` takes and answers fields by
    /// name.
    #[default]
    Triton,
    /// MLServer: gRPC `ModelStreamInfer` answers bare `ModelInferResponse`s and ends on a request's error with its
    /// status; REST `infer_stream` takes an inference request and answers each response as an event.
    Mlserver,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backend {
    pub name: String,
    pub protocol: BackendProtocol,
    /// The configured endpoints; empty for a backend discovered through DNS.
    pub endpoints: Vec<Endpoint>,
    pub discovery: Discovery,
    /// REST backends only: it speaks the binary tensor data extension.
    pub binary_data: bool,
    /// It reads compressed requests: REST bodies and gRPC messages that came compressed go to it compressed.
    pub compression: bool,
    /// Whose inference streams it serves.
    pub stream: StreamDialect,
    pub policy: BackendPolicy,
    pub tls: Option<BackendTls>,
    /// Added to every call to it.
    pub headers: http::HeaderMap,
}

/// How a backend's endpoints share its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum LoadBalancing {
    #[default]
    RoundRobin,
    /// Power of two choices on calls under way.
    LeastRequest,
    /// Power of two choices on each endpoint's own queue (its metrics, scraped) plus the calls sent since.
    LeastLoad,
    /// By the model's sticky key; round robin for calls without one.
    ConsistentHash,
}

/// How the gateway spreads, limits, checks and retries a backend's calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendPolicy {
    pub lb: LoadBalancing,
    pub max_in_flight: Option<u32>,
    pub queue_timeout: Duration,
    pub retries: u32,
    pub health: Option<HealthCheck>,
    pub outlier: Outlier,
    /// Where each endpoint's own queue is read, for `least_load`.
    pub load: Option<super::load::LoadSource>,
}

impl Default for BackendPolicy {
    fn default() -> Self {
        BackendPolicy {
            lb: LoadBalancing::RoundRobin,
            max_in_flight: None,
            queue_timeout: Duration::from_millis(DEFAULT_QUEUE_TIMEOUT_MS),
            retries: DEFAULT_RETRIES,
            health: None,
            outlier: Outlier::default(),
            load: None,
        }
    }
}

/// Active health checking of each endpoint: server ready, and each routed model's ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthCheck {
    pub interval: Duration,
    pub timeout: Duration,
    /// Consecutive failed probes after which an endpoint gets no traffic.
    pub unhealthy_after: u32,
    /// Consecutive good probes after which it gets traffic again.
    pub healthy_after: u32,
}

/// Passive outlier detection: consecutive failed calls eject an endpoint for a cool-down that doubles each time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outlier {
    pub consecutive_failures: u32,
    pub base_ejection: Duration,
    pub max_ejection: Duration,
}

impl Default for Outlier {
    fn default() -> Self {
        Outlier {
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(1),
            max_ejection: Duration::from_secs(60),
        }
    }
}

/// Default wait for a full endpoint.
pub const DEFAULT_QUEUE_TIMEOUT_MS: u64 = 100;
/// Default further endpoints tried for a call that never reached one.
pub const DEFAULT_RETRIES: u32 = 2;

impl TryFrom<String> for BackendProtocol {
    type Error = String;
    fn try_from(word: String) -> Result<Self, String> {
        choice(
            &word,
            &[("rest", BackendProtocol::Rest), ("grpc", BackendProtocol::Grpc)],
        )
    }
}

impl TryFrom<String> for StreamDialect {
    type Error = String;
    fn try_from(word: String) -> Result<Self, String> {
        choice(
            &word,
            &[("triton", StreamDialect::Triton), ("mlserver", StreamDialect::Mlserver)],
        )
    }
}

impl TryFrom<String> for LoadBalancing {
    type Error = String;
    fn try_from(word: String) -> Result<Self, String> {
        choice(
            &word,
            &[
                ("round_robin", LoadBalancing::RoundRobin),
                ("least_request", LoadBalancing::LeastRequest),
                ("least_load", LoadBalancing::LeastLoad),
                ("consistent_hash", LoadBalancing::ConsistentHash),
            ],
        )
    }
}

/// A backend as a model's version names it: its place in [`super::Config::backends`]. Only validation makes one,
/// from a name it found there, so it never points past the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BackendId(usize);

impl BackendId {
    /// Stands in for a name that names no backend; the problem recorded with it keeps the configuration from
    /// being used.
    pub(super) const UNRESOLVED: BackendId = BackendId(usize::MAX);

    /// The backend's place in the configuration's list (and in every list built from it in the same order).
    pub fn index(self) -> usize {
        self.0
    }
}

/// Every backend, and where each name stands in the list (names must be unique).
pub(super) fn validate_backends<'a>(
    problems: &mut Problems,
    raw_backends: &'a [RawBackend],
    base: &Path,
) -> (Vec<Backend>, HashMap<&'a str, BackendId>) {
    let mut backend_index: HashMap<&str, BackendId> = HashMap::new();
    let mut backends = Vec::with_capacity(raw_backends.len());
    for (i, backend) in raw_backends.iter().enumerate() {
        let path = format!("backends[{i}]");
        check_name(problems, &format!("{path}.name"), "backend name", &backend.name);
        if let Some(first) = backend_index.insert(&backend.name, BackendId(i)) {
            problems.add(
                format!("{path}.name"),
                format!(
                    "duplicate backend name \"{}\" (also backends[{}])",
                    backend.name, first.0
                ),
            );
        }
        backends.push(validate_backend(problems, &path, backend, base));
    }
    (backends, backend_index)
}

/// One backend's settings, checked (its name is checked by the caller, which sees the others).
fn validate_backend(problems: &mut Problems, path: &str, backend: &RawBackend, base: &Path) -> Backend {
    let protocol = backend.protocol;
    if backend.binary_data && protocol == BackendProtocol::Grpc {
        problems.add(format!("{path}.binary_data"), "applies to REST backends only");
    }
    let discovery = backend_discovery(problems, path, backend, base);
    let tls = backend_tls(problems, path, backend, base);
    let (endpoints, metrics_addresses) = backend_endpoints(problems, path, backend);
    let mut policy = backend_policy(problems, path, backend);
    policy.load = backend
        .load
        .as_ref()
        .map(|load| super::load::validate_load(problems, path, load, metrics_addresses.clone()));
    if policy.load.is_none() {
        if policy.lb == LoadBalancing::LeastLoad {
            problems.add(
                format!("{path}.lb"),
                "\"least_load\" needs `load`: where the endpoints' queues are read",
            );
        }
        if !metrics_addresses.is_empty() {
            problems.add(
                format!("{path}.endpoints"),
                "a metrics address is read by `load`, which is not set",
            );
        }
    }
    Backend {
        name: backend.name.clone(),
        protocol,
        endpoints,
        discovery,
        binary_data: backend.binary_data,
        compression: backend.compression,
        stream: backend.stream,
        policy,
        tls,
        headers: backend_headers(problems, path, backend),
    }
}

/// The headers added to a backend's calls: names a client could send end to end, values that are valid header
/// values. Marked sensitive, so they are never indexed by HPACK (they are often secrets).
fn backend_headers(problems: &mut Problems, path: &str, backend: &RawBackend) -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    for (name, value) in &backend.headers {
        let header = http::HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes())
            .ok()
            .filter(|header| crate::headers::is_end_to_end(header) && !header.as_str().starts_with("grpc-"));
        let Some(header) = header else {
            problems.add(
                format!("{path}.headers.{name}"),
                format!("\"{name}\" is not a header name the gateway may send end to end"),
            );
            continue;
        };
        match http::HeaderValue::from_str(value) {
            Ok(mut value) => {
                value.set_sensitive(true);
                headers.insert(header, value);
            }
            Err(_) => problems.add(format!("{path}.headers.{name}"), "is not a valid header value"),
        }
    }
    headers
}

/// How a backend's endpoints are found: listed, resolved from `dns` (with its interval and server), or read from
/// `endpoints_file`.
fn backend_discovery(problems: &mut Problems, path: &str, backend: &RawBackend, base: &Path) -> Discovery {
    let given = usize::from(!backend.endpoints.is_empty())
        + usize::from(backend.dns.is_some())
        + usize::from(backend.endpoints_file.is_some());
    if given > 1 {
        problems.add(
            format!("{path}.endpoints"),
            "give one of endpoints, dns and endpoints_file, not more",
        );
    }
    let discovery = match (&backend.dns, &backend.endpoints_file, backend.endpoints.is_empty()) {
        (None, None, true) => {
            problems.add(
                format!("{path}.endpoints"),
                "a backend needs at least one endpoint, or `dns`, or `endpoints_file`",
            );
            Discovery::Static
        }
        (_, _, false) => Discovery::Static,
        (Some(name), _, true) => match Endpoint::parse(name) {
            Ok(Endpoint { host, port }) => Discovery::Dns {
                host,
                port,
                interval: Duration::from_millis(positive(
                    problems,
                    &format!("{path}.dns_interval_ms"),
                    backend.dns_interval_ms,
                    DEFAULT_DNS_INTERVAL_MS,
                )),
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
        (None, Some(endpoints_file), true) => Discovery::File {
            path: file(problems, &format!("{path}.endpoints_file"), endpoints_file, base),
            interval: Duration::from_millis(positive(
                problems,
                &format!("{path}.endpoints_file_interval_ms"),
                backend.endpoints_file_interval_ms,
                DEFAULT_ENDPOINTS_FILE_INTERVAL_MS,
            )),
        },
    };
    if backend.endpoints_file.is_none() && backend.endpoints_file_interval_ms.is_some() {
        problems.add(
            format!("{path}.endpoints_file_interval_ms"),
            "applies only with `endpoints_file`",
        );
    }
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
fn backend_tls(problems: &mut Problems, path: &str, backend: &RawBackend, base: &Path) -> Option<BackendTls> {
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

/// A backend's listed endpoints, each parsed and none twice, and the metrics addresses some of them name.
fn backend_endpoints(
    problems: &mut Problems,
    path: &str,
    backend: &RawBackend,
) -> (Vec<Endpoint>, Vec<(Endpoint, Endpoint)>) {
    let mut endpoints = Vec::with_capacity(backend.endpoints.len());
    let mut metrics_addresses = Vec::new();
    for (j, raw) in backend.endpoints.iter().enumerate() {
        let (text, metrics) = match raw {
            RawEndpoint::Address(text) => (text, None),
            RawEndpoint::WithMetrics { address, metrics } => (address, Some(metrics)),
        };
        match Endpoint::parse(text) {
            Ok(endpoint) if endpoints.contains(&endpoint) => {
                problems.add(format!("{path}.endpoints[{j}]"), format!("{endpoint} is listed twice"));
            }
            Ok(endpoint) => {
                match metrics.map(|metrics| Endpoint::parse(metrics)) {
                    Some(Ok(metrics)) => metrics_addresses.push((endpoint.clone(), metrics)),
                    Some(Err(message)) => problems.add(format!("{path}.endpoints[{j}].metrics"), message),
                    None => {}
                }
                endpoints.push(endpoint);
            }
            Err(message) => problems.add(format!("{path}.endpoints[{j}]"), message),
        }
    }
    (endpoints, metrics_addresses)
}

fn backend_policy(problems: &mut Problems, path: &str, backend: &RawBackend) -> BackendPolicy {
    let defaults = BackendPolicy::default();
    if backend.max_in_flight == Some(0) {
        problems.add(format!("{path}.max_in_flight"), "must be at least 1");
    }
    let mut positive =
        |key: &str, value: Option<u64>, default: u64| positive(problems, &format!("{path}.{key}"), value, default);
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
        lb: backend.lb,
        max_in_flight: backend.max_in_flight.filter(|&n| n > 0),
        queue_timeout: Duration::from_millis(queue_timeout),
        retries: backend.retries.unwrap_or(DEFAULT_RETRIES),
        health,
        outlier,
        load: None,
    }
}
