//! What the gateway reports: Prometheus metrics (`metrics`), the access and event log (`logging`, written by
//! `log_writer`), OpenTelemetry traces (`traces`) and the payload log (`payload_log`). Every layer above reports here;
//! nothing here knows the doors, dispatch or the process's wiring.

pub mod log_writer;
pub mod logging;
pub mod metrics;
pub mod payload_log;
pub mod record;
pub mod traces;

use std::time::Duration;

/// The protocol a client spoke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientProtocol {
    Rest,
    Grpc,
}

impl ClientProtocol {
    pub(crate) const ALL: [ClientProtocol; 2] = [ClientProtocol::Rest, ClientProtocol::Grpc];

    pub fn label(self) -> &'static str {
        match self {
            ClientProtocol::Rest => "rest",
            ClientProtocol::Grpc => "grpc",
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            ClientProtocol::Rest => 0,
            ClientProtocol::Grpc => 1,
        }
    }
}

/// Who made a request, as the metrics and the access log name it (the guard's principals).
pub trait ReportedPrincipal: std::fmt::Debug + Send + Sync {
    /// The name the access log gives.
    fn name(&self) -> &str;
    /// Its position among the configured principals, when its requests are counted under its own name; the rest are
    /// counted under one label.
    fn counted(&self) -> Option<usize>;
}

/// Where a request was routed, as the metrics label it and the access log names it.
#[derive(Debug, Clone, Copy)]
pub struct RouteNames<'a> {
    pub model: &'a str,
    pub version: &'a str,
    pub backend: &'a str,
}

/// What one finished request reports, to the metrics and the access log.
#[derive(Debug, Clone, Copy)]
pub struct Finished<'a> {
    pub protocol: ClientProtocol,
    /// HTTP status (a gRPC answer's status is its code's HTTP equivalent).
    pub status: u16,
    pub duration: Duration,
    /// When it ended: the access line's time.
    pub ended: std::time::Instant,
    pub request_bytes: u64,
    pub response_bytes: u64,
    /// The REST path or gRPC method.
    pub target: &'a str,
    pub request_id: Option<&'a str>,
    /// The backend endpoint that answered.
    pub endpoint: Option<&'a str>,
    /// Whether the request crossed between REST and gRPC (or was re-encoded) on its way.
    pub translated: bool,
    /// Who made it, when `[auth]` asked.
    pub principal: Option<&'a dyn ReportedPrincipal>,
}
