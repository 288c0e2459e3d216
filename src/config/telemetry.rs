//! The sections that join the platform's observability: `[tracing]` (OpenTelemetry traces sent over OTLP) and
//! `[payload_log]` (each inference's request and answer sent as a CloudEvent, as KServe's logger does).

use std::time::Duration;

use serde::Deserialize;

use super::{Problems, choice, positive};

/// Spans kept for export unless `[tracing] max_queue` says otherwise; past it, new spans are dropped and counted.
pub const DEFAULT_SPAN_QUEUE: u64 = 4096;
/// Events kept for sending unless `[payload_log] max_queue` says otherwise.
pub const DEFAULT_EVENT_QUEUE: u64 = 1000;
/// Bound on one export of spans, or one delivery of an event, in milliseconds.
pub const DEFAULT_EXPORT_TIMEOUT_MS: u64 = 5_000;
/// Deliveries of one event after its first fails.
pub const DEFAULT_EVENT_RETRIES: u32 = 2;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTracing {
    /// The OTLP/gRPC collector, `http://collector:4317`.
    pub otlp_endpoint: String,
    /// Share of the traces begun here that are kept, 0 to 1 (default 0.01); a trace the client sampled is always
    /// followed.
    pub sample_ratio: Option<f64>,
    /// The `service.name` the spans carry (default `oipgate`).
    pub service_name: Option<String>,
    /// Finished spans waiting for export; past it, spans are dropped and counted.
    pub max_queue: Option<u64>,
    /// Bound on one export, in milliseconds.
    pub timeout_ms: Option<u64>,
}

/// Traces sent to an OTLP collector.
#[derive(Debug, Clone, PartialEq)]
pub struct Tracing {
    pub otlp_endpoint: String,
    pub sample_ratio: f64,
    pub service_name: String,
    pub max_queue: usize,
    pub timeout: Duration,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPayloadLog {
    /// The sink the CloudEvents are POSTed to, `http://sink:8080`.
    pub url: String,
    /// "all" (default), "request" or "response".
    pub mode: Option<String>,
    /// Share of inferences logged, 0 to 1 (default 1).
    pub sample_ratio: Option<f64>,
    /// The public models logged; `["*"]` (default): every model that does not opt out with `payload_log = false`.
    pub models: Option<Vec<String>>,
    /// Events waiting to be sent; past it, events are dropped and counted.
    pub max_queue: Option<u64>,
    /// How a body in the binary tensor extension, or a gRPC message, is sent: "json" (default: translated to the
    /// V2 JSON form, which every consumer reads) or "as_sent" (the bytes as the client sent or received them).
    pub tensors: Option<String>,
    /// The events' `Ce-Source` (default `oipgate`).
    pub source: Option<String>,
    /// The events' `Ce-Namespace` (default empty, or `POD_NAMESPACE` when set).
    pub namespace: Option<String>,
    /// Bound on one delivery, in milliseconds.
    pub timeout_ms: Option<u64>,
    /// Deliveries of an event after its first fails (default 2).
    pub retries: Option<u32>,
}

/// Which of an inference's two events are logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogMode {
    All,
    Request,
    Response,
}

impl LogMode {
    pub fn requests(self) -> bool {
        self != LogMode::Response
    }

    pub fn responses(self) -> bool {
        self != LogMode::Request
    }
}

/// How bodies that are not JSON as sent reach the sink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoggedTensors {
    /// Translated to the V2 JSON form.
    Json,
    /// As the client sent or received them, with their content type (and `Inference-Header-Content-Length`).
    AsSent,
}

/// Inference payloads sent to a CloudEvents sink.
#[derive(Debug, Clone, PartialEq)]
pub struct PayloadLog {
    pub url: http::Uri,
    pub mode: LogMode,
    pub sample_ratio: f64,
    /// `None`: every model; else the public names listed.
    pub models: Option<Vec<String>>,
    pub max_queue: usize,
    pub tensors: LoggedTensors,
    pub source: String,
    pub namespace: String,
    pub timeout: Duration,
    pub retries: u32,
}

impl PayloadLog {
    /// Whether the section covers `model` (a model's own `payload_log = false` is applied on top).
    pub fn covers(&self, model: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|models| models.iter().any(|m| m == model))
    }
}

/// A share between 0 and 1.
fn ratio(problems: &mut Problems, path: &str, value: Option<f64>, default: f64) -> f64 {
    match value {
        Some(value) if (0.0..=1.0).contains(&value) => value,
        Some(value) => {
            problems.add(path, format!("{value} is not a share between 0 and 1"));
            default
        }
        None => default,
    }
}

/// An `http://` or `https://` URL with a host.
fn http_url(problems: &mut Problems, path: &str, text: &str) -> Option<http::Uri> {
    match text.parse::<http::Uri>() {
        Ok(uri)
            if matches!(uri.scheme_str(), Some("http" | "https"))
                && uri.host().is_some_and(|host| !host.is_empty()) =>
        {
            Some(uri)
        }
        _ => {
            problems.add(
                path,
                format!("\"{text}\" is not an http:// or https:// URL with a host"),
            );
            None
        }
    }
}

fn bounded(problems: &mut Problems, path: &str, value: Option<u64>, default: u64) -> usize {
    usize::try_from(positive(problems, path, value, default)).unwrap_or(usize::MAX)
}

pub(super) fn validate_tracing(problems: &mut Problems, raw: &RawTracing) -> Option<Tracing> {
    let endpoint = http_url(problems, "tracing.otlp_endpoint", &raw.otlp_endpoint);
    let service_name = raw.service_name.clone().unwrap_or_else(|| "oipgate".to_owned());
    if service_name.trim().is_empty() {
        problems.add("tracing.service_name", "must not be empty");
    }
    let tracing = Tracing {
        otlp_endpoint: raw.otlp_endpoint.trim_end_matches('/').to_owned(),
        sample_ratio: ratio(problems, "tracing.sample_ratio", raw.sample_ratio, 0.01),
        service_name,
        max_queue: bounded(problems, "tracing.max_queue", raw.max_queue, DEFAULT_SPAN_QUEUE),
        timeout: Duration::from_millis(positive(
            problems,
            "tracing.timeout_ms",
            raw.timeout_ms,
            DEFAULT_EXPORT_TIMEOUT_MS,
        )),
    };
    endpoint.map(|_| tracing)
}

/// The `[payload_log]` section; `models` are the configured public names, which its `models` list must name.
pub(super) fn validate_payload_log(
    problems: &mut Problems,
    raw: &RawPayloadLog,
    models: &std::collections::HashSet<&str>,
) -> Option<PayloadLog> {
    let url = http_url(problems, "payload_log.url", &raw.url);
    let mode = match raw.mode.as_deref() {
        None => LogMode::All,
        Some(word) => choice(
            word,
            &[
                ("all", LogMode::All),
                ("request", LogMode::Request),
                ("response", LogMode::Response),
            ],
        )
        .unwrap_or_else(|message| {
            problems.add("payload_log.mode", message);
            LogMode::All
        }),
    };
    let tensors = match raw.tensors.as_deref() {
        None => LoggedTensors::Json,
        Some(word) => choice(
            word,
            &[("json", LoggedTensors::Json), ("as_sent", LoggedTensors::AsSent)],
        )
        .unwrap_or_else(|message| {
            problems.add("payload_log.tensors", message);
            LoggedTensors::Json
        }),
    };
    let listed = raw.models.clone().unwrap_or_else(|| vec!["*".to_owned()]);
    for (i, name) in listed.iter().enumerate() {
        if name != "*" && !models.contains(name.as_str()) {
            problems.add(
                format!("payload_log.models[{i}]"),
                format!("\"{name}\" is not a configured model"),
            );
        }
    }
    let source = raw.source.clone().unwrap_or_else(|| "oipgate".to_owned());
    if source.trim().is_empty() || http::HeaderValue::from_str(&source).is_err() {
        problems.add("payload_log.source", "must be a non-empty URI reference");
    }
    let namespace = raw
        .namespace
        .clone()
        .or_else(|| std::env::var("POD_NAMESPACE").ok())
        .unwrap_or_default();
    if http::HeaderValue::from_str(&namespace).is_err() {
        problems.add("payload_log.namespace", "must be printable text");
    }
    let log = PayloadLog {
        url: url.clone().unwrap_or_default(),
        mode,
        sample_ratio: ratio(problems, "payload_log.sample_ratio", raw.sample_ratio, 1.0),
        models: (!listed.iter().any(|name| name == "*")).then_some(listed),
        max_queue: bounded(problems, "payload_log.max_queue", raw.max_queue, DEFAULT_EVENT_QUEUE),
        tensors,
        source,
        namespace,
        timeout: Duration::from_millis(positive(
            problems,
            "payload_log.timeout_ms",
            raw.timeout_ms,
            DEFAULT_EXPORT_TIMEOUT_MS,
        )),
        retries: raw.retries.unwrap_or(DEFAULT_EVENT_RETRIES),
    };
    url.map(|_| log)
}
