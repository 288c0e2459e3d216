//! One request's record, the same for both doors: what was asked and how it ended, reported once, when the record
//! is dropped: the request counters and latency, the access-log line, the request span's outcome and the payload
//! log's events.

use std::sync::Arc;
use std::time::Instant;

use http::HeaderValue;

use super::metrics::{Metrics, RouteMetrics};
use super::payload_log::Capture;
use super::traces::Trace;
use super::{ClientProtocol, Finished, ReportedPrincipal};
use crate::runtime::ThreadArc;

/// What a request named, as the access log writes it.
#[derive(Debug)]
pub enum Target {
    /// A head refused before it made a request.
    Unknown,
    /// A REST request's target (its path is written).
    Uri(http::Uri),
    /// A gRPC method the door names itself.
    Method(&'static str),
    /// A gRPC method as the client's path named it.
    Path(String),
}

impl Target {
    fn as_str(&self) -> &str {
        match self {
            Target::Unknown => "-",
            Target::Uri(uri) => uri.path(),
            Target::Method(method) => method,
            Target::Path(path) => path,
        }
    }
}

/// One request as it goes; the doors fill in what they learn, and dropping it reports the request.
#[derive(Debug)]
pub struct RequestRecord {
    metrics: ThreadArc<Metrics>,
    protocol: ClientProtocol,
    started: Instant,
    /// When it ended, when the door read the clock for its other ends too (else it is read when reported).
    ended: Option<Instant>,
    pub target: Target,
    /// The counters of the model and version an inference named; none for other calls.
    pub route: Option<ThreadArc<RouteMetrics>>,
    /// The answer's status (a gRPC code's HTTP equivalent); none until answered, which reports the client as gone.
    pub status: Option<u16>,
    pub request_bytes: u64,
    pub response_bytes: u64,
    pub request_id: Option<HeaderValue>,
    /// The backend endpoint that answered.
    pub endpoint: Option<ThreadArc<str>>,
    /// Whether the request crossed between REST and gRPC (or was re-encoded) on its way.
    pub translated: bool,
    pub principal: Option<Arc<dyn ReportedPrincipal>>,
    /// The request's span at the door; it ends with the record.
    pub trace: Trace,
    /// The inference's payloads, when they are logged (boxed: most requests are not, and a record is moved with its
    /// answer).
    pub capture: Option<Box<Capture>>,
}

impl RequestRecord {
    /// A record of a request of `protocol` to `target`, begun now.
    pub fn open(metrics: ThreadArc<Metrics>, protocol: ClientProtocol, target: Target) -> RequestRecord {
        RequestRecord::begun(metrics, protocol, target, Instant::now())
    }

    /// A record of a request of `protocol` to `target` that began at `started`, a clock reading its door took as
    /// the request came (and keeps for the connection's own time limits).
    pub fn begun(
        metrics: ThreadArc<Metrics>,
        protocol: ClientProtocol,
        target: Target,
        started: Instant,
    ) -> RequestRecord {
        RequestRecord {
            metrics,
            protocol,
            started,
            ended: None,
            target,
            route: None,
            status: None,
            request_bytes: 0,
            response_bytes: 0,
            request_id: None,
            endpoint: None,
            translated: false,
            principal: None,
            trace: Trace::default(),
            capture: None,
        }
    }

    /// The request ended at `at`, a clock reading its door shares with the call's other ends.
    pub fn end_at(&mut self, at: Instant) {
        self.ended = Some(at);
    }

    /// The request was answered with `status` and `response_bytes` of body.
    pub fn answered(&mut self, status: u16, response_bytes: u64) {
        self.status = Some(status);
        self.response_bytes = response_bytes;
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        let status = self.status.unwrap_or(crate::error::CLIENT_CLOSED_REQUEST);
        if let Some(capture) = self.capture.take() {
            capture.send(self.request_id.as_ref(), status);
        }
        if self.trace.is_on() {
            if self.protocol == ClientProtocol::Rest {
                self.trace.set("http.response.status_code", i64::from(status));
                if status >= 500 {
                    self.trace.fail(format!("answered {status}"));
                }
            }
            self.trace.set(
                "oip.request_bytes",
                i64::try_from(self.request_bytes).unwrap_or(i64::MAX),
            );
            self.trace.set(
                "oip.response_bytes",
                i64::try_from(self.response_bytes).unwrap_or(i64::MAX),
            );
            if let Some(endpoint) = &self.endpoint {
                self.trace.set("oip.endpoint", endpoint.to_string());
            }
        }
        // Only inferences are counted by model; every request is timed and logged.
        let ended = self.ended.unwrap_or_else(Instant::now);
        self.metrics.finished(
            self.route.as_deref().map(|route| &**route),
            &Finished {
                protocol: self.protocol,
                status,
                duration: ended.saturating_duration_since(self.started),
                ended,
                request_bytes: self.request_bytes,
                response_bytes: self.response_bytes,
                target: self.target.as_str(),
                request_id: self.request_id.as_ref().and_then(|id| id.to_str().ok()),
                endpoint: self.endpoint.as_deref().map(|endpoint| &**endpoint),
                translated: self.translated,
                principal: self.principal.as_deref(),
            },
        );
    }
}
