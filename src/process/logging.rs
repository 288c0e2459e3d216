//! Logs: `tracing` with `RUST_LOG`-style filtering, as text for people or JSON lines for collectors, and the one
//! access-log line each request gets.

use crate::process::metrics::{Finished, RouteMetrics};

/// The `tracing` target of access-log lines, so they can be filtered on their own (`RUST_LOG=oipgate::access=off`).
pub const ACCESS: &str = "oipgate::access";

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the process's log writer: to stderr, filtered by `RUST_LOG` (default `info`). Calling it again does
/// nothing.
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(true);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(false).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).try_init(),
    };
}

/// Writes the access-log line of one finished inference stream: what it carried and how it ended.
pub fn stream(request_id: Option<&str>, summary: &crate::dispatch::StreamSummary, duration: std::time::Duration) {
    if !tracing::enabled!(target: ACCESS, tracing::Level::INFO) {
        return;
    }
    tracing::info!(
        target: ACCESS,
        request_id = %request_id.filter(|v| !v.is_empty()).unwrap_or("-"),
        protocol = "grpc",
        path = crate::dispatch::MODEL_STREAM_INFER,
        result = summary.result.label(),
        requests = summary.requests,
        responses = summary.responses,
        failed_requests = summary.failed,
        error = ?summary.error.as_ref().map_or("-", |error| error.message()),
        duration_ms = duration.as_secs_f64() * 1000.0,
        "stream"
    );
}

/// Writes the access-log line of one finished request.
pub fn access(route: Option<&RouteMetrics>, request: &Finished<'_>) {
    if !tracing::enabled!(target: ACCESS, tracing::Level::INFO) {
        return;
    }
    fn field(value: Option<&str>) -> &str {
        value.filter(|v| !v.is_empty()).unwrap_or("-")
    }
    tracing::info!(
        target: ACCESS,
        request_id = %field(request.request_id),
        protocol = request.protocol.label(),
        path = request.target,
        model = %field(route.map(|r| r.model.as_str())),
        version = %field(route.map(|r| r.version.as_str())),
        backend = %field(route.map(|r| r.backend.as_str())),
        endpoint = %field(request.endpoint),
        status = request.status,
        bytes_in = request.request_bytes,
        bytes_out = request.response_bytes,
        duration_ms = request.duration.as_secs_f64() * 1000.0,
        translated = request.translated,
        principal = %field(request.principal.map(crate::guard::Principal::name)),
        "request"
    );
}
