//! What inference streams report: the client streams open, and per public model version the backend streams closed,
//! their messages and their time to a first response.

use std::time::Duration;

use prometheus::IntGauge;

use super::sharded::{CounterVec, HistogramVec};

use super::family::Family;
use super::{Families, Metrics, metric_error, registered};
use crate::error::Result;

/// Inference streams: the client streams open, and per public model version the backend streams closed, their
/// messages and their time to a first response. Labelled when a stream closes, so a model that is never streamed
/// adds no series.
#[derive(Debug)]
pub(super) struct StreamMetrics {
    open: IntGauge,
    closed: Family<CounterVec>,
    messages: Family<CounterVec>,
    first_response: Family<HistogramVec>,
}

impl StreamMetrics {
    pub(super) fn new(families: &Families<'_>) -> Result<StreamMetrics> {
        Ok(StreamMetrics {
            open: registered(
                families.registry,
                IntGauge::new("oipgate_streams_open", "Client inference streams under way.").map_err(metric_error)?,
            )?,
            closed: families.counters(
                "oipgate_streams_total",
                "Backend inference streams closed, by public model and version and result: ok, error or cancelled.",
                &["model", "version", "result"],
            )?,
            messages: families.counters(
                "oipgate_stream_messages_total",
                "Messages carried on inference streams, by public model and version and direction: in (requests) or \
             out (responses).",
                &["model", "version", "direction"],
            )?,
            first_response: families.histograms(
                "oipgate_stream_first_response_seconds",
                "Time from a stream's first request for a model version to its first response, by public model and \
             version.",
                &["model", "version"],
            )?,
        })
    }
}

/// How a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamResult {
    /// Every request was answered and the stream ended cleanly.
    Ok,
    /// It failed (a backend stream or the client's stream broke).
    Error,
    /// The client went away first.
    Cancelled,
}

impl StreamResult {
    pub fn label(self) -> &'static str {
        match self {
            StreamResult::Ok => "ok",
            StreamResult::Error => "error",
            StreamResult::Cancelled => "cancelled",
        }
    }
}

/// What one backend stream (or, for a REST backend, one request of a stream) of a public model version carried.
#[derive(Debug, Clone, Copy)]
pub struct StreamLeg {
    pub result: Option<StreamResult>,
    pub messages_in: u64,
    pub messages_out: u64,
    /// From its first request to its first response, when one came.
    pub first_response: Option<Duration>,
}

impl StreamMetrics {
    /// Keeps the series whose model and version `keep` keeps.
    pub(super) fn retain(&self, keep: &impl Fn(&[String]) -> bool) {
        self.closed.retain(keep);
        self.messages.retain(keep);
        self.first_response.retain(keep);
    }
}

impl Metrics {
    /// The gauge of client streams under way.
    pub fn streams_open(&self) -> &IntGauge {
        &self.streams.open
    }

    /// Records what one backend stream of `model` at `version` carried, once it has closed.
    pub fn stream_leg(&self, model: &str, version: &str, leg: &StreamLeg) {
        if let Some(result) = leg.result {
            self.streams.closed.series(&[model, version, result.label()]).inc();
        }
        for (direction, count) in [("in", leg.messages_in), ("out", leg.messages_out)] {
            self.streams.messages.series(&[model, version, direction]).inc_by(count);
        }
        if let Some(took) = leg.first_response {
            self.streams
                .first_response
                .series(&[model, version])
                .observe(took.as_secs_f64());
        }
    }
}
