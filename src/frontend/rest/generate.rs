//! The REST door's streaming calls: Triton's generate extension and MLServer's `infer_stream`. `generate` answers one
//! JSON object; `generate_stream` and `infer_stream` answer server-sent events, one per response (`data: <json>` and
//! a blank line; no event names, no end marker: the stream ends when the body does). To a REST backend the request
//! goes as it came and the answer comes back event by event as it arrives, renamed for an alias. To a gRPC backend it
//! is translated into one inference on the inference stream (ModelStreamInfer), a generate body with the model's
//! metadata, an `infer_stream` body as the inference request it is; each response comes back as the call writes it
//! (fields by name, or an inference response). A response that fails before the first event makes the answer's
//! status; one after it is an event `{"error": "..."}`.

use bytes::Bytes;
use http::StatusCode;
use http_body_util::BodyExt;
use prost::Message;
use tokio::sync::mpsc;

use super::{PendingAnswer, RestDoor};
use crate::body::RequestBody;
use crate::codec::compression;
use crate::codec::protobuf;
use crate::codec::rest::generate::{EventReader, MOST_EVENT_BYTES, body_parameters, decode_generate, encode_generate};
use crate::codec::rest::{self as rest_codec, RestRequest};
use crate::config::BackendProtocol;
use crate::dispatch::{CallContext, CallRequest, Dispatcher, StreamAnswer, StreamHold, Taken};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::guard::TokenMeter;
use crate::proto::ModelStreamInferResponse;
use crate::protocol::{InferRequest, InferResponse, Reserved, StreamCall};
use crate::routing::{Routed, VersionRoute};
use crate::telemetry::payload_log::{Capture, form_of};
use std::time::Duration;

use super::answer::Record;

/// Events a stream holds for a client that is slow to read them; past this the backend's stream waits.
const EVENTS: usize = 16;

/// Triton's words for a `generate` whose model answered more than once.
const NOT_ONE_RESPONSE: &str = "generate expects model to produce exactly 1 response, use generate stream for model that generates various \
     number of responses";

/// The call a streaming request names: its model, version and kind.
#[derive(Clone, Copy)]
struct Asked<'a> {
    model: &'a str,
    version: Option<&'a str>,
    call: StreamCall,
}

/// What one answer on the inference stream is for a generate client.
enum Generated {
    /// A response's JSON, or `None` for one without outputs (a decoupled model's empty final response).
    Response(Option<Vec<u8>>),
    /// A request's error.
    Failed(String),
}

impl RestDoor {
    /// A streaming call: admitted and routed with its body read, then relayed to a REST backend, or translated onto
    /// the inference stream of a gRPC one and answered as its responses come.
    pub(super) async fn generate(
        &self,
        parts: &http::request::Parts,
        body: &mut Option<RequestBody>,
        record: &mut Record,
        model: &str,
        version: Option<&str>,
        call: StreamCall,
    ) -> Result<PendingAnswer> {
        // The dispatcher itself, not the thread's handle: the backend stream's task owns it.
        let dispatcher = std::sync::Arc::clone(record.dispatcher());
        let forward = crate::headers::for_backend(&parts.headers);
        // The call's id (the client's, or the one made for it) goes to the backend, the answer and the logs.
        record.request_id = forward.get(crate::headers::REQUEST_ID).cloned();
        let asked = Asked { model, version, call };
        let (routed, raw) = self.admit_generate(parts, body, record, &forward, asked).await?;
        // The tokens the answer carries, counted as it passes, are charged to the call's budgets when it ends.
        let meter = record
            .admission
            .as_ref()
            .and_then(|admission| admission.token_meter().cloned());
        if dispatcher.backend_protocol(&routed.route) == Some(BackendProtocol::Rest) {
            let (answer, hold) = dispatcher
                .rest_stream_call(&routed, call, raw, &forward, &record.trace)
                .await?;
            record.endpoint = Some(hold.lease.state.authority.handle());
            let relayed = Relayed {
                stream: call.streams(),
                idle: dispatcher.stream_idle_timeout(),
                meter,
                hold,
            };
            return relay(answer, &routed.route, relayed).await;
        }
        let route = routed.route;
        record.translated = true;
        let mut request = translated_request(&dispatcher, parts, call, raw, model, &route).await?;
        request.model_name = model.to_owned();
        request.model_version = Some(route.version.clone());
        let message = Bytes::from(protobuf::encode_request(request).chunks.concat());
        let served_by = std::sync::Arc::new(std::sync::OnceLock::new());
        let context = CallContext {
            deadline: None,
            forward,
            compressed: None,
            principal: record.principal.clone(),
            trace: record.trace.clone(),
            admitted_by_door: true,
            served_by: Some(served_by.clone()),
        };
        let (answers, mut received) = mpsc::channel(EVENTS);
        let gateway = self.gateway.clone();
        tokio::spawn(async move {
            let requests = futures_util::stream::iter([Ok(message)]);
            dispatcher
                .infer_stream(requests, context, answers, gateway.streams_ending())
                .await
        });
        let answer = if call.streams() {
            events_of(received, call, meter).await
        } else {
            one_response(&mut received, call, meter.as_ref()).await
        };
        // Its first answer has come (or none will): the backend stream was opened, where it was.
        record.endpoint = served_by.get().cloned();
        answer
    }

    /// Admits and routes the call, its body read whole once it is let in: the version is chosen by routing (canary
    /// weights), so the inputs are read with that version's metadata, and a sequence's requests reach the replica
    /// holding its state, relayed or translated. Gives the route and the body as it came (decompressed).
    async fn admit_generate(
        &self,
        parts: &http::request::Parts,
        body: &mut Option<RequestBody>,
        record: &mut Record,
        forward: &http::HeaderMap,
        asked: Asked<'_>,
    ) -> Result<(Routed, Bytes)> {
        let Asked { model, version, call } = asked;
        let dispatcher = record.dispatcher().clone();
        let principal = record.principal.clone();
        let request = CallRequest {
            model,
            version,
            forward,
            principal: principal.as_deref(),
            taken: Taken::Nothing,
            generates: call != StreamCall::InferStream,
            trace: &record.trace,
        };
        let read_bytes = std::sync::atomic::AtomicU64::new(0);
        let (admitted, route_metrics) = {
            let start = std::pin::pin!(async {
                let declared = self.declared_length(parts.headers.get(http::header::CONTENT_LENGTH))?;
                let mut raw = self.read_body(body, declared, Vec::new()).await?;
                if let Some(coding) = compression::request_coding(&parts.headers)? {
                    raw = compression::decompress(coding, &raw, self.max_request_bytes, "request body")?;
                }
                read_bytes.store(raw.len() as u64, std::sync::atomic::Ordering::Relaxed);
                let reserved = Reserved::from_parameters(&body_parameters(&raw)?)?;
                Ok((raw, reserved))
            });
            dispatcher.admit(&request, start).await
        };
        record.route = Some(route_metrics);
        // Counted whether or not the call goes on, as the access log reports a refused call's body too.
        record.request_bytes = read_bytes.into_inner();
        let (admitted, raw) = admitted?;
        record.admission = Some(admitted.admission);
        // A sampled call's request is logged as it came; its answer as the client gets it (a stream's events
        // gathered as they are sent, within a bound).
        record.capture = admitted.payload_log.map(|logger| {
            let mut capture = Capture::new(logger, &admitted.routed.route, form_of(&parts.headers));
            capture.request(raw.clone());
            Box::new(capture)
        });
        Ok((admitted.routed, raw))
    }
}

/// The inference a streaming call asks of a gRPC backend: `infer_stream`'s body is one; a generate body's fields are
/// read by name with the routed version's metadata.
async fn translated_request(
    dispatcher: &Dispatcher,
    parts: &http::request::Parts,
    call: StreamCall,
    raw: Bytes,
    model: &str,
    route: &VersionRoute,
) -> Result<InferRequest> {
    match call {
        StreamCall::InferStream => {
            let header_length = rest_codec::inference_header_length(
                parts.headers.get(crate::headers::INFERENCE_HEADER_CONTENT_LENGTH),
            )?;
            match rest_codec::decode_request(raw, header_length)? {
                RestRequest::Request { request, .. } => Ok(request),
                RestRequest::RawBinary(_) => Err(Error::invalid(
                    "infer_stream takes an inference request, not raw binary data (Inference-Header-Content-Length: 0)",
                )),
            }
        }
        StreamCall::Generate | StreamCall::GenerateStream => {
            let metadata = dispatcher.model_metadata(model, Some(&route.version)).await?;
            decode_generate(&raw, &metadata)
        }
    }
}

/// `generate_stream` and `infer_stream`: each response as an event. The first decides the status: an error before
/// it is the answer; one after it is an error event.
async fn events_of(
    mut received: mpsc::Receiver<StreamAnswer>,
    call: StreamCall,
    meter: Option<TokenMeter>,
) -> Result<PendingAnswer> {
    let first = loop {
        match received.recv().await {
            None => break None,
            Some(answer) => match generated(answer, call)? {
                Generated::Failed(message) => return Err(Error::invalid(message)),
                Generated::Response(None) => continue,
                Generated::Response(Some(json)) => break Some(json),
            },
        }
    };
    if let (Some(meter), Some(json)) = (&meter, &first) {
        meter.add(json);
    }
    let (events, sent) = mpsc::channel(EVENTS);
    tokio::spawn(async move {
        if let Some(json) = first
            && events.send(event(&json)).await.is_err()
        {
            return;
        }
        while let Some(answer) = received.recv().await {
            let json = match generated(answer, call) {
                Ok(Generated::Response(Some(json))) => {
                    if let Some(meter) = &meter {
                        meter.add(&json);
                    }
                    json
                }
                Ok(Generated::Response(None)) => continue,
                Ok(Generated::Failed(message)) => rest_codec::encode_error(&message),
                Err(error) => rest_codec::encode_error(error.message()),
            };
            if events.send(event(&json)).await.is_err() {
                return;
            }
        }
    });
    Ok(PendingAnswer::Events(sent))
}

/// `generate`: the stream's one response, as JSON.
async fn one_response(
    received: &mut mpsc::Receiver<StreamAnswer>,
    call: StreamCall,
    meter: Option<&TokenMeter>,
) -> Result<PendingAnswer> {
    let mut only = None;
    while let Some(answer) = received.recv().await {
        match generated(answer, call)? {
            Generated::Failed(message) => return Err(Error::invalid(message)),
            Generated::Response(None) => {}
            Generated::Response(Some(json)) => {
                if only.replace(json).is_some() {
                    return Err(Error::invalid(NOT_ONE_RESPONSE));
                }
            }
        }
    }
    let json = only.ok_or_else(|| Error::invalid(NOT_ONE_RESPONSE))?;
    if let Some(meter) = meter {
        meter.add(&json);
    }
    Ok(PendingAnswer::Json(StatusCode::OK, json))
}

/// One answer of the inference stream, read for a generate client (or, for `infer_stream`, as an inference
/// response); an error that ended the stream is returned.
fn generated(answer: StreamAnswer, call: StreamCall) -> Result<Generated> {
    let message = answer?.concat();
    let decoded = ModelStreamInferResponse::decode(message.as_slice())
        .map_err(|e| Error::internal(format!("an inference stream's answer does not decode: {e}")))?;
    if !decoded.error_message.is_empty() {
        return Ok(Generated::Failed(decoded.error_message));
    }
    let response: InferResponse = match decoded.infer_response {
        Some(response) => protobuf::response_from_proto(response).map_err(Error::into_upstream_protocol_error)?,
        None => return Ok(Generated::Response(None)),
    };
    if call == StreamCall::InferStream {
        if response.outputs.is_empty() {
            return Ok(Generated::Response(None));
        }
        let json = rest_codec::encode_response(&response, &rest_codec::BinaryOutputs::default())?;
        return Ok(Generated::Response(Some(json.chunks.concat())));
    }
    Ok(Generated::Response(encode_generate(&response)?))
}

/// One server-sent event carrying `json`.
fn event(json: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(json.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(json);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// Largest `generate` answer read from a REST backend.
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// How a REST backend's generate answer is relayed.
struct Relayed {
    /// The client asked for a stream (`generate_stream`).
    stream: bool,
    /// How long the backend may send nothing.
    idle: Duration,
    /// Where the answer's tokens are counted, when the call is under a token budget.
    meter: Option<TokenMeter>,
    /// The call's place at its endpoint, held until its answer has been read.
    hold: StreamHold,
}

/// A REST backend's generate answer for the client: an error or a `generate` answer read whole (renamed for an
/// alias); a `generate_stream` answer relayed event by event as it arrives.
async fn relay(
    answer: http::Response<crate::upstream::BackendBody>,
    route: &VersionRoute,
    relayed: Relayed,
) -> Result<PendingAnswer> {
    let Relayed {
        stream,
        idle,
        meter,
        hold,
    } = relayed;
    let (head, mut body) = answer.into_parts();
    let is_events = head
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("text/event-stream"));
    if !stream || !head.status.is_success() || !is_events {
        let whole = read_whole(&mut body, idle).await?;
        let json = if head.status.is_success() {
            if let Some(meter) = &meter {
                meter.add(&whole);
            }
            rename(&whole, route)
        } else {
            whole.to_vec()
        };
        let mut headers = http::HeaderMap::new();
        if let Some(kind) = head.headers.get(http::header::CONTENT_TYPE) {
            headers.insert(http::header::CONTENT_TYPE, kind.clone());
        }
        return Ok(PendingAnswer::Buffered(head.status, headers, vec![Bytes::from(json)]));
    }
    let (events, sent) = mpsc::channel(EVENTS);
    let route = route.clone();
    tokio::spawn(async move {
        let _hold = hold;
        let mut reader = EventReader::new(MOST_EVENT_BYTES);
        loop {
            let frame = match tokio::time::timeout(idle, body.frame()).await {
                Ok(Some(Ok(frame))) => frame,
                Ok(None) => return,
                Ok(Some(Err(error))) => {
                    let _ = events
                        .send(event(&rest_codec::encode_error(&format!(
                            "the backend broke off its stream: {error}"
                        ))))
                        .await;
                    return;
                }
                Err(_) => {
                    let why = format!(
                        "the backend sent nothing for {} ms (limits.stream_idle_timeout_ms)",
                        idle.as_millis()
                    );
                    let _ = events.send(event(&rest_codec::encode_error(&why))).await;
                    return;
                }
            };
            let Ok(chunk) = frame.into_data() else { continue };
            // Each complete event goes on as soon as it is whole.
            for json in reader.push(&chunk) {
                if let Some(meter) = &meter {
                    meter.add(&json);
                }
                if events.send(event(&rename(&json, &route))).await.is_err() {
                    return;
                }
            }
            if reader.too_long() {
                let why = format!("the backend sent an event longer than {MOST_EVENT_BYTES} bytes");
                let _ = events.send(event(&rest_codec::encode_error(&why))).await;
                return;
            }
        }
    });
    Ok(PendingAnswer::Events(sent))
}

/// A response object with the public model name and version; anything else (an error event) as it came.
fn rename(json: &[u8], route: &VersionRoute) -> Vec<u8> {
    let Ok(mut object) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(json) else {
        return json.to_vec();
    };
    if object.contains_key("model_name") {
        object.insert("model_name".to_owned(), route.model.clone().into());
        object.insert("model_version".to_owned(), route.version.clone().into());
    }
    serde_json::to_vec(&object).unwrap_or_else(|_| json.to_vec())
}

/// A backend's answer body read whole, within a bound and the idle limit.
async fn read_whole(body: &mut crate::upstream::BackendBody, idle: Duration) -> Result<Bytes> {
    let mut whole = Vec::new();
    loop {
        let frame = tokio::time::timeout(idle, body.frame()).await.map_err(|_| {
            Error::new(
                ErrorKind::Timeout,
                Origin::Upstream,
                "the backend did not finish its answer",
            )
        })?;
        let Some(frame) = frame else {
            return Ok(Bytes::from(whole));
        };
        let frame = frame.map_err(|e| {
            Error::new(
                ErrorKind::BadGateway,
                Origin::Upstream,
                format!("the backend broke off its answer: {e}"),
            )
        })?;
        if let Ok(chunk) = frame.into_data() {
            if whole.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(Error::new(
                    ErrorKind::BadGateway,
                    Origin::Upstream,
                    "the backend's generate answer is too large",
                ));
            }
            whole.extend_from_slice(&chunk);
        }
    }
}
