//! Payload logging, wire-compatible with KServe's inference logger: each sampled inference's request and answer as
//! a CloudEvent in HTTP binary mode (`Ce-Id` the request id, `Ce-Type` `org.kubeflow.serving.inference.request` or
//! `.response`, `Ce-Inferenceservicename` the public model, `Ce-Endpoint` its version), POSTed to the configured sink
//! from a bounded queue by a task on the telemetry thread, with retries. A full queue drops the event (counted);
//! nothing here ever slows or fails a request. Bodies are shared buffers, never copied on a request's path; their
//! translation to JSON, when asked, happens on the telemetry thread.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use prost::Message;
use tokio::sync::{Semaphore, mpsc};

use crate::codec::protobuf;
use crate::codec::rest::{self, BinaryOutputs, RestRequest};
use crate::config::{LoggedTensors, PayloadLog};
use crate::headers::INFERENCE_HEADER_CONTENT_LENGTH;
use crate::routing::VersionRoute;
use crate::telemetry::metrics::{Counter, Metrics};

/// How often the queue is sent: the sending task sleeps rather than waits on the queue, so a request that queues
/// an event never wakes another thread.
const SEND_INTERVAL: Duration = Duration::from_millis(50);
/// Deliveries under way at once.
const DELIVERIES: usize = 32;
/// The first retry's wait; each further one waits twice as long.
const FIRST_RETRY: Duration = Duration::from_millis(100);

pub const CE_REQUEST: &str = "org.kubeflow.serving.inference.request";
pub const CE_RESPONSE: &str = "org.kubeflow.serving.inference.response";

/// Where the events go: one POST of an event's headers and body to the configured URL, within `timeout`, giving
/// the sink's status or why there is none. The gateway's own HTTP/1.1 client is the one (dispatch provides it).
pub trait EventSink: Send + Sync + std::fmt::Debug + 'static {
    fn post(
        &self,
        headers: HeaderMap,
        body: Bytes,
        timeout: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<StatusCode, String>> + Send + '_>>;
}

/// The payload log of one `[payload_log]` configuration, kept across reloads that leave the section as it was.
#[derive(Debug)]
pub struct PayloadLogger {
    config: PayloadLog,
    queue: mpsc::Sender<Event>,
    dropped: Counter,
    /// Answers not logged for their size (a stream's events past the bound the door gathers).
    too_large: Counter,
}

/// A body as it crossed the door: its buffers, and what they are.
#[derive(Debug, Clone)]
pub struct Logged {
    pub chunks: Vec<Bytes>,
    pub form: Form,
}

#[derive(Debug, Clone)]
pub enum Form {
    /// JSON.
    Json,
    /// The binary tensor extension: a JSON header of this many bytes, then the tensors.
    Binary(u64),
    /// An encoded `ModelInferRequest`.
    GrpcRequest,
    /// An encoded `ModelInferResponse`.
    GrpcResponse,
    /// Anything else (Decthings tensors, a raw binary body), sent as it is with its content type.
    Other(Option<HeaderValue>),
}

/// One inference's events: its request, and its answer once there is one that succeeded.
#[derive(Debug)]
pub struct Inference {
    pub id: HeaderValue,
    /// The public model and version that served it.
    pub route: Arc<VersionRoute>,
    pub request: Option<Logged>,
    pub response: Option<Logged>,
}

#[derive(Debug)]
struct Event {
    kind: &'static str,
    id: HeaderValue,
    route: Arc<VersionRoute>,
    body: Logged,
    time: SystemTime,
}

/// An inference's request and answer on their way to the payload log, sent when the request is reported: the
/// buffers the door sent on, shared, never copied.
#[derive(Debug)]
pub struct Capture {
    logger: Arc<PayloadLogger>,
    route: Arc<VersionRoute>,
    request: Option<Logged>,
    /// A relayed request's chunks, set once the whole body has passed.
    pub relayed: Arc<std::sync::OnceLock<Vec<Bytes>>>,
    request_form: Form,
    response: Option<Logged>,
}

impl Capture {
    pub fn new(logger: Arc<PayloadLogger>, route: &Arc<VersionRoute>, request_form: Form) -> Capture {
        Capture {
            logger,
            route: route.clone(),
            request: None,
            relayed: Arc::default(),
            request_form,
            response: None,
        }
    }

    /// Whether the request is logged (`mode` is not "response"): its body is kept only then.
    pub fn wants_request(&self) -> bool {
        self.logger.logs_requests()
    }

    /// Whether the answer is logged (`mode` is not "request"): its body is kept only then.
    pub fn wants_response(&self) -> bool {
        self.logger.logs_responses()
    }

    /// The request's whole body, as it went on.
    pub fn request(&mut self, body: Bytes) {
        if !self.wants_request() {
            return;
        }
        self.request = Some(Logged {
            chunks: vec![body],
            form: self.request_form.clone(),
        });
    }

    /// The answer's body (before it is compressed for the client), and its form read from its `headers`.
    pub fn response(&mut self, chunks: Vec<Bytes>, headers: &HeaderMap) {
        if !self.wants_response() {
            return;
        }
        self.response = Some(Logged {
            chunks,
            form: form_of(headers),
        });
    }

    /// The answer outgrew what is gathered of it for the log: it is not logged, and counted.
    pub fn response_too_large(&self) {
        self.logger.too_large.inc();
    }

    /// The answer's body in a form the caller names.
    pub fn response_as(&mut self, chunks: Vec<Bytes>, form: Form) {
        if self.wants_response() {
            self.response = Some(Logged { chunks, form });
        }
    }

    /// Sends the events: the request's, and the answer's when it succeeded; under a request id of their own when
    /// the request had none.
    pub(super) fn send(self, id: Option<&HeaderValue>, status: u16) {
        let id = id.cloned().unwrap_or_else(crate::headers::new_request_id);
        let request = self.request.or_else(|| {
            self.relayed.get().map(|chunks| Logged {
                chunks: chunks.clone(),
                form: self.request_form.clone(),
            })
        });
        self.logger.log(Inference {
            id,
            route: self.route,
            request,
            response: self.response.filter(|_| status == 200),
        });
    }
}

/// What a body is, from its headers: the binary extension's when it says its JSON header's length, JSON when it
/// says so or says nothing, else what its content type says.
pub fn form_of(headers: &HeaderMap) -> Form {
    let header_length = headers
        .get(INFERENCE_HEADER_CONTENT_LENGTH)
        .and_then(|value| rest::length_value(value.as_bytes()));
    let content_type = headers.get(http::header::CONTENT_TYPE);
    match header_length {
        Some(length) if length > 0 => Form::Binary(length),
        Some(_) => Form::Other(content_type.cloned()),
        None if content_type.is_none_or(|t| t.as_bytes().starts_with(b"application/json")) => Form::Json,
        None => Form::Other(content_type.cloned()),
    }
}

impl PayloadLogger {
    /// Starts the sending task on the telemetry thread.
    pub fn start(config: &PayloadLog, metrics: &Metrics, sink: Arc<dyn EventSink>) -> PayloadLogger {
        let (queue, events) = mpsc::channel(config.max_queue);
        let runtime = crate::runtime::telemetry_runtime();
        let _entered = runtime.enter();
        runtime.spawn(send(
            config.clone(),
            sink,
            events,
            (metrics.payload_events("sent"), metrics.payload_events("failed")),
        ));
        PayloadLogger {
            config: config.clone(),
            queue,
            dropped: metrics.payload_events("dropped"),
            too_large: metrics.payload_events("too_large"),
        }
    }

    /// Whether this logger was made from `config`.
    pub fn made_from(&self, config: &PayloadLog) -> bool {
        self.config == *config
    }

    /// Whether the next inference is logged: the configured share of them, decided once per inference.
    pub fn sampled(&self) -> bool {
        self.config.sample_ratio >= 1.0 || fastrand::f64() < self.config.sample_ratio
    }

    /// Whether requests, and answers, are logged.
    pub fn logs_requests(&self) -> bool {
        self.config.mode.requests()
    }

    pub fn logs_responses(&self) -> bool {
        self.config.mode.responses()
    }

    /// Queues the request event of one inference on a gRPC inference stream, `message` as the client sent it, under
    /// the message's `id` (a new one when it has none): a stream's answers are not gathered for the log, being many
    /// for one request of a decoupled model and matched to theirs only by an id the client may leave out.
    pub fn log_stream_request(&self, id: &str, route: &Arc<VersionRoute>, message: Bytes) {
        if !self.logs_requests() {
            return;
        }
        let id = (!id.is_empty())
            .then(|| HeaderValue::from_str(id).ok())
            .flatten()
            .unwrap_or_else(crate::headers::new_request_id);
        self.log(Inference {
            id,
            route: route.clone(),
            request: Some(Logged {
                chunks: vec![message],
                form: Form::GrpcRequest,
            }),
            response: None,
        });
    }

    /// Queues an inference's events; those that do not fit are dropped and counted. The doors keep only the bodies
    /// the mode logs ([`Self::logs_requests`], [`Self::logs_responses`]), so nothing is held that is not sent.
    pub fn log(&self, inference: Inference) {
        let time = SystemTime::now();
        let kinds = [(CE_REQUEST, inference.request), (CE_RESPONSE, inference.response)];
        for (kind, body) in kinds {
            let Some(body) = body else { continue };
            let event = Event {
                kind,
                id: inference.id.clone(),
                route: inference.route.clone(),
                body,
                time,
            };
            if self.queue.try_send(event).is_err() {
                self.dropped.inc();
            }
        }
    }
}

/// Sends the queued events until the queue's sender is gone, each in its own delivery, at most [`DELIVERIES`] at
/// once.
async fn send(
    config: PayloadLog,
    sink: Arc<dyn EventSink>,
    mut events: mpsc::Receiver<Event>,
    counted: (Counter, Counter),
) {
    let config = Arc::new(config);
    let slots = Arc::new(Semaphore::new(DELIVERIES));
    loop {
        tokio::time::sleep(SEND_INTERVAL).await;
        loop {
            let event = match events.try_recv() {
                Ok(event) => event,
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => return,
            };
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            let (sink, config, (sent, failed)) = (sink.clone(), config.clone(), counted.clone());
            tokio::spawn(async move {
                let _slot = slot;
                if deliver(&*sink, &config, event).await {
                    sent.inc();
                } else {
                    failed.inc();
                }
            });
        }
    }
}

/// Delivers one event, retrying a failed delivery (no answer, or a 5xx or 429) up to the configured retries;
/// whether the sink took it.
async fn deliver(sink: &dyn EventSink, config: &PayloadLog, event: Event) -> bool {
    let Some((content_type, header_length, body)) = event_body(&event.body, config.tensors) else {
        return false;
    };
    // CloudEvents' `time`: RFC 3339, in UTC.
    let time = humantime::format_rfc3339_micros(event.time).to_string();
    let mut wait = FIRST_RETRY;
    for attempt in 0..=config.retries {
        if attempt > 0 {
            tokio::time::sleep(wait).await;
            wait *= 2;
        }
        let mut headers = HeaderMap::with_capacity(12);
        let mut add = |name: &'static str, value: &str| {
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(HeaderName::from_static(name), value);
            }
        };
        add("ce-specversion", "1.0");
        add("ce-type", event.kind);
        add("ce-source", config.source.as_str());
        add("ce-time", time.as_str());
        add("ce-inferenceservicename", event.route.model.as_str());
        add("ce-namespace", config.namespace.as_str());
        add("ce-component", "predictor");
        add("ce-endpoint", event.route.version.as_str());
        add("ce-metadata", "{}");
        headers.insert(HeaderName::from_static("ce-id"), event.id.clone());
        headers.insert(http::header::CONTENT_TYPE, content_type.clone());
        if let Some(length) = header_length {
            headers.insert(INFERENCE_HEADER_CONTENT_LENGTH, HeaderValue::from(length));
        }
        match sink.post(headers, body.clone(), config.timeout).await {
            Ok(status) if status.is_success() => return true,
            Ok(status) if !retried(status) => {
                tracing::debug!(%status, "the payload log's sink refused an event");
                return false;
            }
            Ok(_) | Err(_) => {}
        }
    }
    false
}

fn retried(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}

/// The event's content type, its `Inference-Header-Content-Length` when it keeps the binary extension, and its
/// body; `None` for a body that cannot be read as it claims to be.
fn event_body(logged: &Logged, tensors: LoggedTensors) -> Option<(HeaderValue, Option<u64>, Bytes)> {
    let joined = || match logged.chunks.as_slice() {
        [one] => one.clone(),
        chunks => Bytes::from(chunks.concat()),
    };
    let json = HeaderValue::from_static("application/json");
    let as_json = |encoded: rest::EncodedBody| Some((json.clone(), None, Bytes::from(encoded.chunks.concat())));
    match (&logged.form, tensors) {
        (Form::Json, _) => Some((json, None, joined())),
        (Form::Other(content_type), _) => Some((
            content_type
                .clone()
                .unwrap_or(HeaderValue::from_static("application/octet-stream")),
            None,
            joined(),
        )),
        (Form::Binary(length), LoggedTensors::AsSent) => Some((
            HeaderValue::from_static("application/octet-stream"),
            Some(*length),
            joined(),
        )),
        (Form::GrpcRequest | Form::GrpcResponse, LoggedTensors::AsSent) => {
            Some((HeaderValue::from_static("application/x-protobuf"), None, joined()))
        }
        (Form::Binary(length), LoggedTensors::Json) => {
            // A request and an answer are told apart by what they decode as: only an answer has no `inputs`.
            let body = joined();
            match rest::decode_request(body.clone(), Some(*length)) {
                Ok(RestRequest::Request { request, .. }) if !request.inputs.is_empty() => {
                    as_json(rest::encode_request(&request, false).ok()?)
                }
                _ => {
                    let response = rest::decode_response(body, Some(*length)).ok()?;
                    as_json(rest::encode_response(&response, &BinaryOutputs::default()).ok()?)
                }
            }
        }
        (Form::GrpcRequest, LoggedTensors::Json) => {
            let message = crate::proto::ModelInferRequest::decode(joined()).ok()?;
            as_json(rest::encode_request(&protobuf::request_from_proto(message).ok()?, false).ok()?)
        }
        (Form::GrpcResponse, LoggedTensors::Json) => {
            let message = crate::proto::ModelInferResponse::decode(joined()).ok()?;
            let response = protobuf::response_from_proto(message).ok()?;
            as_json(rest::encode_response(&response, &BinaryOutputs::default()).ok()?)
        }
    }
}
