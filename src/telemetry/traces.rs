//! OpenTelemetry traces: the tracer a configuration's `[tracing]` makes, the span a request carries through the
//! gateway ([`Trace`]), the W3C `traceparent` read from clients and written to backends, and the export of finished
//! spans over OTLP from a bounded queue that never holds a request up (spans past it are dropped and counted).

use std::borrow::Cow;
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider, SpanData, SpanExporter, SpanProcessor};
use tokio::sync::mpsc;

use crate::config::Tracing;
use crate::error::{Error, Result};
use crate::telemetry::metrics::{Counter, Metrics};

/// How often the queue of finished spans is sent: the export task sleeps rather than waits on the queue, so a
/// request that finishes a span never wakes another thread.
const EXPORT_INTERVAL: Duration = Duration::from_millis(200);
/// The W3C trace context header.
const TRACEPARENT: &str = "traceparent";
/// Spans in one export.
const EXPORT_BATCH: usize = 512;

/// The tracer of one `[tracing]` configuration, kept across reloads that leave the section as it was.
///
/// Replaced by a reload that changes the section, it lets the spans of requests still under way finish: the
/// provider lives as long as their spans, and its export task sends what is queued once the last of them is gone.
#[derive(Debug)]
pub struct Traces {
    config: Tracing,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
}

impl Traces {
    /// Starts the tracer and its exporter (on the telemetry thread); the collector is connected to when the first
    /// spans are sent.
    pub fn start(config: &Tracing, metrics: &Metrics) -> Result<Traces> {
        let runtime = crate::runtime::telemetry_runtime();
        let _entered = runtime.enter();
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(config.otlp_endpoint.clone())
            .with_timeout(config.timeout)
            .build()
            .map_err(|error| Error::internal(format!("cannot make the OTLP exporter: {error}")))?;
        // The SDK hands the resource to its own processors; spans queued by the gateway's reach the exporter, which
        // is told it here, or every span would leave with no service.
        let resource = resource(config);
        exporter.set_resource(&resource);
        let (sender, spans) = mpsc::channel(config.max_queue);
        runtime.spawn(export(exporter, spans, metrics.spans_exported()));
        let provider = SdkTracerProvider::builder()
            .with_span_processor(QueuedSpans {
                sender,
                dropped: metrics.spans_dropped(),
            })
            // A trace begun here has been sampled already (see `request`): the SDK decides only for a client's.
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("oipgate");
        Ok(Traces {
            config: config.clone(),
            tracer,
            propagator: TraceContextPropagator::new(),
        })
    }

    /// Whether a new trace is kept: `sample_ratio` of them.
    fn draw(&self) -> bool {
        self.config.sample_ratio >= 1.0 || fastrand::f64() < self.config.sample_ratio
    }

    /// Whether these traces were made from `config`.
    pub fn made_from(&self, config: &Tracing) -> bool {
        self.config == *config
    }

    /// The span of a request that came to a door with `headers`: a child of the client's `traceparent` when it
    /// sent one (its sampling decision followed), else a new trace sampled at the configured ratio. A span not
    /// sampled costs nothing further: it is not recorded, and its children are not made.
    ///
    /// A new trace is sampled here, with one random draw, before the SDK is asked for anything: building a span the
    /// SDK then drops (ids drawn, a builder and a span made) cost more than the 1% of traces kept at 0.01. The
    /// draw is the ratio sampler's own decision in distribution, as a new trace's id is random. The span's name and
    /// attributes (`describe`) are made only for a span that may be recorded.
    pub fn request(&self, headers: &HeaderMap, describe: impl FnOnce() -> (Cow<'static, str>, Vec<KeyValue>)) -> Trace {
        if !headers.contains_key(TRACEPARENT) && !self.draw() {
            return Trace::default();
        }
        let (name, attributes) = describe();
        let parent = self.propagator.extract(&Headers(headers));
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &parent);
        if !span.is_recording() {
            return Trace::default();
        }
        Trace(Some(Recording {
            context: Context::new().with_span(span),
            tracer: self.tracer.clone(),
        }))
    }
}

/// The span a request, or one of its steps, is recorded in; empty when tracing is off or the trace is not sampled.
/// It ends when the last of its clones is dropped.
#[derive(Debug, Clone, Default)]
pub struct Trace(Option<Recording>);

#[derive(Debug, Clone)]
struct Recording {
    context: Context,
    tracer: SdkTracer,
}

impl Trace {
    /// Whether anything is recorded.
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// A step of this span: a child span, begun now, with the `attributes` made only when it is recorded.
    pub fn child(&self, name: &'static str, kind: SpanKind, attributes: impl FnOnce() -> Vec<KeyValue>) -> Trace {
        let Some(recording) = &self.0 else {
            return Trace::default();
        };
        let attributes = attributes();
        let span = recording
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(&recording.tracer, &recording.context);
        Trace(Some(Recording {
            context: Context::new().with_span(span),
            tracer: recording.tracer.clone(),
        }))
    }

    pub fn set(&self, key: &'static str, value: impl Into<Value>) {
        if let Some(recording) = &self.0 {
            recording.context.span().set_attribute(KeyValue::new(key, value));
        }
    }

    pub fn event(&self, name: &'static str, attributes: Vec<KeyValue>) {
        if let Some(recording) = &self.0 {
            recording.context.span().add_event(name, attributes);
        }
    }

    /// Marks the span failed with `message`.
    pub fn fail(&self, message: impl Into<Cow<'static, str>>) {
        if let Some(recording) = &self.0 {
            recording.context.span().set_status(Status::error(message));
        }
    }

    /// Records an outcome: an error's status and message as the span's failure.
    pub fn outcome<T>(&self, outcome: &Result<T>) {
        if let Err(error) = outcome {
            self.failed(error);
        }
    }

    pub fn failed(&self, error: &Error) {
        if self.is_on() {
            self.set("oip.status", i64::from(error.http_status().as_u16()));
            self.fail(error.message().to_owned());
        }
    }

    /// The end-to-end headers to send a backend with this span as their `traceparent` (and `tracestate`): `forward`
    /// itself when nothing is recorded.
    pub fn carried<'a>(&self, forward: &'a HeaderMap) -> Cow<'a, HeaderMap> {
        let Some(recording) = &self.0 else {
            return Cow::Borrowed(forward);
        };
        let mut headers = forward.clone();
        TraceContextPropagator::new().inject_context(&recording.context, &mut HeadersMut(&mut headers));
        Cow::Owned(headers)
    }
}

/// What the spans come from: the configured service's name, the gateway's version, and the host it runs on.
fn resource(config: &Tracing) -> opentelemetry_sdk::Resource {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".to_owned());
    opentelemetry_sdk::Resource::builder()
        .with_service_name(config.service_name.clone())
        .with_attributes([
            KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
            KeyValue::new("service.instance.id", host),
        ])
        .build()
}

/// Finished spans into the export queue; one that does not fit is dropped and counted, never waited for.
#[derive(Debug)]
struct QueuedSpans {
    sender: mpsc::Sender<SpanData>,
    dropped: Counter,
}

impl SpanProcessor for QueuedSpans {
    fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &Context) {}

    fn on_end(&self, span: SpanData) {
        if self.sender.try_send(span).is_err() {
            self.dropped.inc();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Sends the queued spans in batches until the queue's sender is gone, then what is left.
async fn export(
    exporter: opentelemetry_otlp::SpanExporter,
    mut spans: mpsc::Receiver<SpanData>,
    counted: (Counter, Counter),
) {
    let (exported, failed) = counted;
    let mut open = true;
    while open {
        tokio::time::sleep(EXPORT_INTERVAL).await;
        loop {
            let mut batch = Vec::new();
            while batch.len() < EXPORT_BATCH {
                match spans.try_recv() {
                    Ok(span) => batch.push(span),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            if batch.is_empty() {
                break;
            }
            let count = batch.len() as u64;
            match exporter.export(batch).await {
                Ok(()) => exported.inc_by(count),
                Err(error) => {
                    failed.inc_by(count);
                    tracing::debug!(%error, spans = count, "could not export spans");
                }
            }
        }
    }
}

/// A request's headers as the propagator reads them.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Outgoing headers as the propagator writes them.
struct HeadersMut<'a>(&'a mut HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(key.as_bytes()), HeaderValue::from_str(&value)) {
            self.0.insert(name, value);
        }
    }
}
