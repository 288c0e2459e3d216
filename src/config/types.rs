//! The validated configuration's types: what a running gateway is built from, each holding only values that passed
//! validation (see the parent module).

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// A validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub ready_policy: ReadyPolicy,
    pub listen: Listen,
    pub limits: Limits,
    /// TLS on the front doors.
    pub tls: Option<ServerTls>,
    pub shutdown: Shutdown,
    pub reload: Reload,
    /// Worker threads of each front door.
    pub threads: usize,
    pub backends: Vec<Backend>,
    pub models: Vec<ModelConfig>,
}

/// Certificate and key of the front doors, and the CA callers' certificates must chain to when mTLS is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
    pub rest: bool,
    pub grpc: bool,
}

/// What SIGTERM / SIGINT do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shutdown {
    /// Bound on the wait for in-flight requests.
    pub grace_period: Duration,
    /// Connections are still accepted this long after the signal, while readiness already says no.
    pub drain_delay: Duration,
}

/// Whether and how often the configuration file is watched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reload {
    pub watch: bool,
    pub interval: Duration,
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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listen {
    pub rest: SocketAddr,
    pub grpc: SocketAddr,
    pub metrics: Option<SocketAddr>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// REST body and gRPC message limit, in bytes.
    pub max_request_bytes: u64,
    pub request_timeout: Duration,
    /// How long a REST client may take over a request's head once it has begun (then 408).
    pub header_read_timeout: Duration,
    /// How long an inference stream may pass with no message either way (then DEADLINE_EXCEEDED).
    pub stream_idle_timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendProtocol {
    Rest,
    Grpc,
}

/// Whose inference streams a backend serves: they differ on the wire, and one is never read as the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
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

/// A replica's address: an IP address or a DNS name, and a port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Endpoint {
    /// Parses `host:port` (`[v6]:port` for IPv6); the host is an IP address or a DNS name.
    pub fn parse(text: &str) -> Result<Endpoint, String> {
        if let Ok(addr) = text.parse::<SocketAddr>() {
            return Ok(Endpoint {
                host: addr.ip().to_string(),
                port: addr.port(),
            });
        }
        let (host, port) = text
            .rsplit_once(':')
            .ok_or_else(|| format!("\"{text}\" is not host:port"))?;
        let port: u16 = port.parse().map_err(|_| format!("\"{text}\" has no valid port"))?;
        let valid_name = !host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            });
        if !valid_name || port == 0 {
            return Err(format!(
                "\"{text}\" is not host:port with an IP address or DNS name and a non-zero port"
            ));
        }
        Ok(Endpoint {
            host: host.to_owned(),
            port,
        })
    }
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
}

/// What the gateway's readiness requires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadyPolicy {
    /// Every configured model can be served.
    #[default]
    AllModels,
    /// At least one configured model can be served.
    AnyModel,
}

/// How a backend's endpoints share its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadBalancing {
    #[default]
    RoundRobin,
    /// Power of two choices on calls under way.
    LeastRequest,
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

#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Index into [`Config::backends`].
    pub backend: usize,
    pub upstream_name: String,
    pub upstream_version: String,
    /// Share of unversioned requests, relative to the model's other versions; 0 for none.
    pub weight: u32,
}
