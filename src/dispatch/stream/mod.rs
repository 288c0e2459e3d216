//! Triton's inference stream (ModelStreamInfer) through the gateway: each request of a client's stream is routed on
//! its own. To a gRPC backend it goes on a stream opened to one endpoint for the request's route (the first request
//! chooses the endpoint, by its sequence when it has one), passed through as bytes with the names spliced; to a REST
//! backend it is one unary inference, translated. Responses are merged onto the client's stream as they come; a
//! request that fails is one response carrying its error and its id, and the stream goes on. Here the client's
//! side; the backend's side in `leg`; streams to REST backends in `rest`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::backend::{BackendClients, Replicas};
use super::{AdmittedCall, CallContext, Dispatcher, decode_grpc_request};
use crate::codec::splice;
use crate::config::StreamDialect;
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::protocol::Reserved;
use crate::telemetry::logging::FinishedStream;
use crate::telemetry::metrics::StreamResult;
use crate::telemetry::traces::Trace;

mod leg;
mod rest;

pub use rest::StreamHold;

use leg::{BackendLeg, LegRecord, open_leg, relay, unary_over_rest};

pub const MODEL_STREAM_INFER: &str = "/inference.GRPCInferenceService/ModelStreamInfer";

/// The version each model that a stream's requests named without one was routed to: canary weights choose once
/// per stream, as stickiness would.
type ChosenVersions = HashMap<(String, String), String>;

/// A stream's sequences on REST backends, each request sent only once the one before it in its sequence has been
/// answered: separate HTTP requests reach a replica in any order, and Triton refuses a sequence whose START comes
/// second. Each sequence keeps the signal its last request gives when answered; other requests go side by side.
#[derive(Default)]
struct SequenceOrder {
    last: HashMap<(String, crate::protocol::SequenceId), tokio::sync::oneshot::Receiver<()>>,
}

impl SequenceOrder {
    /// For a request of `model` in `affinity`'s sequence: what to wait for before sending it (the previous request's
    /// answer), and what to signal once it is answered.
    fn place(
        &mut self,
        model: &str,
        affinity: &crate::routing::Affinity,
    ) -> (
        Option<tokio::sync::oneshot::Receiver<()>>,
        Option<tokio::sync::oneshot::Sender<()>>,
    ) {
        let crate::routing::Affinity::Sequence(sequence) = affinity else {
            return (None, None);
        };
        let key = (model.to_owned(), sequence.id.clone());
        let previous = self.last.remove(&key);
        let (answered, next) = tokio::sync::oneshot::channel();
        // The sequence's last request: nothing comes after it to wait.
        if !sequence.end {
            self.last.insert(key, next);
        }
        (previous, Some(answered))
    }
}

/// Most of a backend's error body read for its message.
pub(super) const ERROR_BODY_BYTES: usize = 64 << 10;

/// What a client's stream is sent: an encoded `ModelStreamInferResponse` as chunks, or the error that ends it.
pub type StreamAnswer = Result<Vec<Bytes>>;

/// What a client's stream carried, for its access-log line.
#[derive(Debug, Clone)]
pub struct StreamSummary {
    pub requests: u64,
    pub responses: u64,
    /// Responses that carried a request's error.
    pub failed: u64,
    pub result: StreamResult,
    /// The error that ended the stream, if one did.
    pub error: Option<Error>,
}

impl StreamSummary {
    /// Writes the stream's access-log line.
    pub fn log(&self, request_id: Option<&str>, duration: Duration) {
        crate::telemetry::logging::stream(&FinishedStream {
            request_id,
            path: MODEL_STREAM_INFER,
            result: self.result.label(),
            requests: self.requests,
            responses: self.responses,
            failed: self.failed,
            error: self.error.as_ref().map(Error::message),
            duration,
        });
    }
}

/// The client's side of a stream: where its answers go, counted, and when a message last passed either way.
#[derive(Debug, Clone)]
pub(super) struct Answers {
    sender: mpsc::Sender<StreamAnswer>,
    responses: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    opened: Instant,
    /// Milliseconds from `opened` to the last message either way.
    last_active: Arc<AtomicU64>,
    /// The stream's span, which notes each message passing.
    trace: Trace,
}

impl Answers {
    fn new(sender: mpsc::Sender<StreamAnswer>, trace: Trace) -> Answers {
        Answers {
            sender,
            trace,
            responses: Arc::default(),
            failed: Arc::default(),
            opened: Instant::now(),
            last_active: Arc::default(),
        }
    }

    /// Notes a message passing.
    fn active(&self) {
        let now = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_active.fetch_max(now, Ordering::Relaxed);
    }

    /// How long since a message last passed either way.
    fn quiet_for(&self) -> Duration {
        self.opened
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_active.load(Ordering::Relaxed)))
    }

    /// Sends a response; false once the client is gone.
    async fn respond(&self, response: Vec<Bytes>) -> bool {
        let count = self.responses.fetch_add(1, Ordering::Relaxed) + 1;
        if self.trace.is_on() {
            let bytes: usize = response.iter().map(Bytes::len).sum();
            self.trace.event("response", message_attributes(count, bytes));
        }
        let sent = self.sender.send(Ok(response)).await.is_ok();
        self.active();
        sent
    }

    /// Answers request `id` with `error`, as Triton does on a stream; false once the client is gone.
    async fn fail(&self, id: &str, error: &Error) -> bool {
        self.failed.fetch_add(1, Ordering::Relaxed);
        self.respond(failed_response(id, error)).await
    }

    async fn closed(&self) {
        self.sender.closed().await;
    }
}

impl Dispatcher {
    /// Carries one client stream: reads `requests` (encoded `ModelInferRequest`s) until they end, then waits for
    /// every response. Ends early, with the error sent last, when the client's stream fails or a backend's stream
    /// fails as a whole; a client that goes away (`answers` closed) stops everything under way, resetting the
    /// backends' streams. When `ending` resolves (a shutdown's grace period is over) the stream ends with
    /// UNAVAILABLE.
    pub async fn infer_stream(
        self: Arc<Self>,
        requests: impl futures_util::Stream<Item = Result<Bytes>> + Unpin,
        context: CallContext,
        answers: mpsc::Sender<StreamAnswer>,
        ending: impl Future<Output = ()>,
    ) -> StreamSummary {
        let answers = Answers::new(answers, context.trace.clone());
        let received = Arc::new(AtomicU64::new(0));
        let (result, error) = self.carry_stream(requests, &context, &answers, &received, ending).await;
        StreamSummary {
            requests: received.load(Ordering::Relaxed),
            responses: answers.responses.load(Ordering::Relaxed),
            failed: answers.failed.load(Ordering::Relaxed),
            result,
            error,
        }
    }

    async fn carry_stream(
        self: &Arc<Self>,
        mut requests: impl futures_util::Stream<Item = Result<Bytes>> + Unpin,
        context: &CallContext,
        answers: &Answers,
        received: &AtomicU64,
        ending: impl Future<Output = ()>,
    ) -> (StreamResult, Option<Error>) {
        use futures_util::StreamExt;

        let mut legs: HashMap<usize, BackendLeg> = HashMap::new();
        let mut chosen = ChosenVersions::new();
        let mut order = SequenceOrder::default();
        let mut running: JoinSet<Result<()>> = JoinSet::new();
        let mut reading = true;
        let idle_limit = self.stream_idle_timeout;
        let idle = tokio::time::sleep(idle_limit);
        // The client's deadline bounds the whole stream; without one, only idleness does.
        let deadline = tokio::time::sleep(context.deadline.unwrap_or(Duration::MAX / 4));
        tokio::pin!(idle, deadline, ending);
        let failure = loop {
            tokio::select! {
                next = requests.next(), if reading => match next {
                    Some(Ok(message)) => {
                        let count = received.fetch_add(1, Ordering::Relaxed) + 1;
                        if context.trace.is_on() {
                            context.trace.event("request", message_attributes(count, message.len()));
                        }
                        answers.active();
                        // Sending can wait (a backend that reads slowly, or holds its stream's headers until its
                        // first response): the client going away, the deadline and a shutdown still count.
                        let sent = tokio::select! {
                            sent = self.stream_request(message, context, (&mut chosen, &mut order), &mut legs, &mut running, answers) => sent,
                            () = answers.closed() => return (StreamResult::Cancelled, None),
                            () = &mut deadline => break past_deadline(context),
                            () = &mut ending => break shutting_down(),
                        };
                        if let Err(error) = sent {
                            break error;
                        }
                    }
                    Some(Err(error)) => break error,
                    None => {
                        // The client has sent everything: the backends' streams are told so, and their last
                        // responses awaited.
                        reading = false;
                        legs.clear();
                        if running.is_empty() {
                            return (StreamResult::Ok, None);
                        }
                    }
                },
                Some(done) = running.join_next() => {
                    if let Some(error) = finished(done) {
                        break error;
                    }
                    if !reading && running.is_empty() {
                        return (StreamResult::Ok, None);
                    }
                }
                () = &mut idle => {
                    let quiet = answers.quiet_for();
                    if quiet >= idle_limit {
                        break Error::new(
                            ErrorKind::Timeout,
                            Origin::Gateway,
                            format!(
                                "the stream passed {} ms with no message either way (limits.stream_idle_timeout_ms)",
                                idle_limit.as_millis()
                            ),
                        );
                    }
                    idle.as_mut().reset(tokio::time::Instant::now() + (idle_limit - quiet));
                }
                () = &mut deadline => break past_deadline(context),
                () = &mut ending => break shutting_down(),
                () = answers.closed() => return (StreamResult::Cancelled, None),
            }
        };
        let _ = answers.sender.send(Err(failure.clone())).await;
        (StreamResult::Error, Some(failure))
    }

    /// Routes one request of a stream and sends it on; a request that cannot be routed or sent is answered with its
    /// error. An error returned ends the client's stream.
    async fn stream_request(
        self: &Arc<Self>,
        message: Bytes,
        context: &CallContext,
        (chosen, order): (&mut ChosenVersions, &mut SequenceOrder),
        legs: &mut HashMap<usize, BackendLeg>,
        running: &mut JoinSet<Result<()>>,
        answers: &Answers,
    ) -> Result<()> {
        // A message that is not a request ends the stream, as a malformed unary request fails its call.
        let fields = splice::model_fields(&message)?;
        let id = fields.id.to_owned();
        let sent = async {
            let (admitted, backend) = self.route_in_stream(&message, &fields, context, chosen).await?;
            let AdmittedCall {
                routed,
                admission,
                payload_log,
                ..
            } = admitted;
            let route = routed.route.clone();
            if let Some(logger) = payload_log {
                logger.log_stream_request(&id, &route, message.clone());
            }
            match &backend.replicas {
                Replicas::Grpc { .. } => {
                    let renamed = splice::rename(&message, &route.upstream_name, &route.upstream_version)?;
                    if let Some(leg) = legs.get_mut(&route.id) {
                        // Sent on an open backend stream, which holds its place among the model's calls under way:
                        // this request's own admission, having taken its rates, is given back.
                        leg.sent.fetch_add(1, Ordering::Relaxed);
                        match leg.requests.send(renamed.clone()).await {
                            Ok(()) => return Ok(()),
                            // An MLServer stream ends at its first failed request: the next opens another.
                            Err(_) if backend.config.stream == StreamDialect::Mlserver => {
                                legs.remove(&route.id);
                            }
                            Err(error) => return Err(error),
                        }
                    }
                    let (upstream, lease) = open_leg(&backend, &routed, renamed, context).await?;
                    if let Some(served_by) = &context.served_by {
                        let _ = served_by.set(lease.state.authority.handle());
                    }
                    let sent = Arc::new(AtomicU64::new(1));
                    let record = LegRecord::new(&self.metrics, &route, sent.clone(), Some(StreamResult::Cancelled))
                        .holding(admission);
                    legs.insert(
                        route.id,
                        BackendLeg {
                            requests: upstream.requests,
                            sent,
                        },
                    );
                    running.spawn(relay(
                        upstream.answers,
                        lease,
                        backend.clone(),
                        Arc::clone(&route),
                        (answers.clone(), id.clone()),
                        record,
                    ));
                    Ok(())
                }
                Replicas::Rest { .. } if route.decoupled => {
                    let request = decode_grpc_request(message.clone())?;
                    let this = self.clone();
                    let context = context.clone();
                    let answers = answers.clone();
                    let (previous, answered) = order.place(fields.name, &routed.affinity);
                    running.spawn(async move {
                        if let Some(previous) = previous {
                            let _ = previous.await;
                        }
                        let done = this.decoupled_over_rest(routed, request, context, answers).await;
                        drop((answered, admission));
                        done
                    });
                    Ok(())
                }
                Replicas::Rest { .. } => {
                    let request = decode_grpc_request(message.clone())?;
                    let record =
                        LegRecord::new(&self.metrics, &route, Arc::new(AtomicU64::new(1)), None).holding(admission);
                    let call = (Self::deadline(context, &route), context.clone());
                    let (previous, answered) = order.place(fields.name, &routed.affinity);
                    let unary = unary_over_rest(backend, routed, request, call, answers.clone(), id.clone(), record);
                    running.spawn(async move {
                        if let Some(previous) = previous {
                            let _ = previous.await;
                        }
                        let done = unary.await;
                        drop(answered);
                        done
                    });
                    Ok(())
                }
            }
        };
        match sent.await {
            Ok(()) => Ok(()),
            Err(_) if answers.sender.is_closed() => Err(gone()),
            Err(error) => match answers.fail(&id, &error).await {
                true => Ok(()),
                false => Err(gone()),
            },
        }
    }
}

impl Dispatcher {
    /// Where one request of a stream goes, and its backend, admitted as a unary call is: shared memory refused, its
    /// sequence read, and a request that names no version given the version the stream's first such request got.
    async fn route_in_stream(
        &self,
        message: &[u8],
        fields: &splice::ModelFields<'_>,
        context: &CallContext,
        chosen: &mut ChosenVersions,
    ) -> Result<(AdmittedCall, Arc<BackendClients>)> {
        let key = (fields.name.to_owned(), fields.version.to_owned());
        let version = match chosen.get(&key) {
            Some(version) if fields.version.is_empty() => version.as_str(),
            _ => fields.version,
        };
        let reserved = splice::parameters_refusing_shared_memory(message)
            .and_then(|parameters| Reserved::from_parameters(&parameters));
        // A refused request is answered with its error, and the stream goes on.
        let admitted = self.admit_with(fields.name, Some(version), context, reserved).await?;
        chosen
            .entry(key)
            .or_insert_with(|| admitted.routed.route.version.clone());
        let backend = self
            .backends
            .get(admitted.routed.route.backend.index())
            .cloned()
            .ok_or_else(|| {
                Error::internal(format!(
                    "no backend {} for a route",
                    admitted.routed.route.backend.index()
                ))
            })?;
        Ok((admitted, backend))
    }
}

/// A stream span's event for its `count`th message one way, of `bytes`.
fn message_attributes(count: u64, bytes: usize) -> Vec<opentelemetry::KeyValue> {
    vec![
        opentelemetry::KeyValue::new("oip.message", i64::try_from(count).unwrap_or(i64::MAX)),
        opentelemetry::KeyValue::new("oip.bytes", i64::try_from(bytes).unwrap_or(i64::MAX)),
    ]
}

fn past_deadline(context: &CallContext) -> Error {
    Error::new(
        ErrorKind::Timeout,
        Origin::Gateway,
        format!(
            "the stream's deadline of {} ms (grpc-timeout) passed",
            context.deadline.unwrap_or_default().as_millis()
        ),
    )
}

fn shutting_down() -> Error {
    Error::new(
        ErrorKind::Unavailable,
        Origin::Gateway,
        "the gateway is shutting down and its grace period is over: open the stream again",
    )
}

fn gone() -> Error {
    Error::new(ErrorKind::Cancelled, Origin::Client, "the client went away")
}

/// The error a finished task of a stream ends the stream with, if any.
fn finished(done: std::result::Result<Result<()>, tokio::task::JoinError>) -> Option<Error> {
    match done {
        Ok(Ok(())) => None,
        Ok(Err(error)) => Some(error),
        Err(error) => Some(Error::internal(format!("a stream's task failed: {error}"))),
    }
}

/// The response Triton gives a request of a stream that failed: its error message, and its id.
fn failed_response(id: &str, error: &Error) -> Vec<Bytes> {
    let response = crate::proto::ModelInferResponse {
        id: id.to_owned(),
        ..Default::default()
    };
    splice::stream_response(
        error.message(),
        vec![Bytes::from(prost::Message::encode_to_vec(&response))],
    )
}
