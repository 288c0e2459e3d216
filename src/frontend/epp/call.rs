//! One call through the proxy, as its ext_proc stream tells it: the request's headers and body start read, the
//! endpoint picked and named to the proxy, the body relayed back as it comes, and the answer's status and the
//! endpoint that served it recorded when it ends.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;
use prost_types::value::Kind;

use super::answer::AnswerTokens;
use super::read::{self, MOST_READ, Read, Wanted};
use crate::config::BackendProtocol;
use crate::dispatch::{AdmittedCall, CallRequest, Dispatcher, Picked, Taken};
use crate::envoy_api::envoy::config::core::v3 as core;
use crate::envoy_api::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use crate::envoy_api::envoy::service::ext_proc::v3 as ext_proc;
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::live::Gateway;
use crate::routing::VersionRoute;
use crate::telemetry::logging::{self, FinishedPick};
use crate::telemetry::metrics::{NO_BACKEND, UNKNOWN};
use crate::telemetry::traces::Trace;
use ext_proc::processing_request::Request as Message;
use ext_proc::processing_response::Response as Answer;

/// How much the body's start grows between two reads of it while the pick waits for more.
const READ_STEP: usize = 1024;

/// The request header, and the dynamic metadata key in namespace [`LB_NAMESPACE`], that name the picked endpoints.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Where the proxy reports, on the response path, the endpoint that served the call.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The filter metadata namespace and key of the subset hint: the only endpoints the proxy will use.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
pub const LB_NAMESPACE: &str = "envoy.lb";

/// Where the call stands.
#[derive(Debug)]
enum Phase {
    /// The request's headers are awaited.
    Headers,
    /// The body's start is read; its chunks are held until the pick.
    Reading,
    /// Picked: the body's chunks go back to the proxy as they come.
    Relaying,
    /// Refused with an immediate response: what else comes is ignored.
    Refused,
}

/// How a call names the backend's model and version.
enum Renaming {
    /// As the call came.
    None,
    /// A REST call's path, rewritten.
    Path(String),
    /// A gRPC message's new start (frame prefix and leading fields), and how many bytes of the body it replaces.
    Message { start: Bytes, replaced: usize },
}

/// One call's state, from its request's headers to the end of its answer.
pub(super) struct Call {
    gateway: Arc<Gateway>,
    /// Endpoints named after the picked one.
    fallbacks: usize,
    dispatcher: Arc<Dispatcher>,
    phase: Phase,
    began: Instant,
    /// The proxy sends the request's body, and the answer's, in FULL_DUPLEX_STREAMED mode (as its first message
    /// says): chunks come back as streamed mutations, else as plain continues.
    request_duplex: bool,
    response_duplex: bool,
    /// The proxy sends the answer's body (in any mode but NONE), which a token budget is charged by.
    answer_sent: bool,
    /// From the request's headers.
    path: String,
    grpc: bool,
    forward: HeaderMap,
    subset: Option<Vec<String>>,
    wanted: Wanted,
    /// The body's start, copied from its first chunks (at most [`MOST_READ`] and a gRPC frame's prefix), to read
    /// what the call names; the chunks themselves are held as they came and relayed untouched.
    start: Vec<u8>,
    /// How long `start` was when it was last read.
    read_at: usize,
    held: Vec<Bytes>,
    /// The model the call names, once read, and the version routing resolved for it, once admitted.
    model: Option<String>,
    version: Option<String>,
    picked: Option<Picked>,
    /// The call's place among its model's calls under way, held until it ends.
    admitted: Option<AdmittedCall>,
    /// A `generate` call under a token budget: its answer's tokens, as counted so far.
    tokens: Option<AnswerTokens>,
    /// For the access-log line: the endpoints named, the pick's result label, how long the pick took, the status
    /// the client was answered, whether the answer counts as the endpoint's failure, and the endpoint that served.
    endpoints: Option<String>,
    result: &'static str,
    picked_after: Option<Duration>,
    status: u16,
    failed: bool,
    served: Option<String>,
    /// The answer's end was seen and its outcome recorded.
    ended: bool,
}

impl Call {
    pub(super) fn new(gateway: Arc<Gateway>, fallbacks: usize) -> Call {
        let dispatcher = gateway.dispatcher();
        Call {
            gateway,
            fallbacks,
            dispatcher,
            phase: Phase::Headers,
            began: Instant::now(),
            // Until the proxy's first message says otherwise: a call is then picked by its path, bodies continued.
            request_duplex: false,
            response_duplex: false,
            answer_sent: false,
            path: String::new(),
            grpc: false,
            forward: HeaderMap::new(),
            subset: None,
            wanted: Wanted::Any,
            start: Vec::new(),
            read_at: 0,
            held: Vec::new(),
            model: None,
            version: None,
            picked: None,
            admitted: None,
            tokens: None,
            endpoints: None,
            result: "refused",
            picked_after: None,
            status: 0,
            failed: false,
            served: None,
            ended: false,
        }
    }

    /// Answers one message of the proxy's, in order; several answers may go back for one message (the held
    /// chunks after a pick) or none (a chunk held while the body's start is read).
    pub(super) async fn on(
        &mut self,
        request: ext_proc::ProcessingRequest,
        answers: &mut Vec<ext_proc::ProcessingResponse>,
    ) {
        if let Some(config) = &request.protocol_config {
            self.request_duplex = config.request_body_mode == BodySendMode::FullDuplexStreamed as i32;
            self.response_duplex = config.response_body_mode == BodySendMode::FullDuplexStreamed as i32;
            self.answer_sent = config.response_body_mode != BodySendMode::None as i32;
        }
        let Some(message) = request.request else {
            return;
        };
        match message {
            Message::RequestHeaders(headers) => {
                if let Err(error) = self.on_request_headers(&headers, request.metadata_context.as_ref()) {
                    answers.push(self.refuse(&error));
                } else if headers.end_of_stream || !self.request_duplex || !self.wanted.reads_body() {
                    self.pick(true, false, answers).await;
                } else {
                    self.phase = Phase::Reading;
                }
            }
            Message::RequestBody(body) => self.on_request_body(body, answers).await,
            Message::RequestTrailers(_) => {
                if matches!(self.phase, Phase::Reading) {
                    self.pick(true, false, answers).await;
                }
                if !matches!(self.phase, Phase::Refused) {
                    answers.push(answer(Answer::RequestTrailers(ext_proc::TrailersResponse::default())));
                }
            }
            Message::ResponseHeaders(headers) => {
                self.on_response_headers(&headers, request.metadata_context.as_ref());
                answers.push(answer(Answer::ResponseHeaders(ext_proc::HeadersResponse::default())));
                if headers.end_of_stream {
                    self.end();
                }
            }
            Message::ResponseBody(body) => {
                let end = body.end_of_stream;
                if let Some(tokens) = &mut self.tokens {
                    tokens.body(&body.body, end);
                }
                answers.push(answer(Answer::ResponseBody(body_answer(body, self.response_duplex))));
                if end {
                    self.end();
                }
            }
            Message::ResponseTrailers(trailers) => {
                if let Some(status) = trailers
                    .trailers
                    .as_ref()
                    .and_then(|t| header(t, "grpc-status"))
                    .and_then(|s| s.parse::<u32>().ok())
                {
                    self.failed |= grpc_failure(status);
                }
                answers.push(answer(Answer::ResponseTrailers(ext_proc::TrailersResponse::default())));
                self.end();
            }
        }
    }

    /// Reads the request's headers: its path, protocol and end-to-end headers, and the subset hint.
    fn on_request_headers(&mut self, headers: &ext_proc::HttpHeaders, metadata: Option<&core::Metadata>) -> Result<()> {
        let mut content_type = String::new();
        let mut header_length = None;
        for entry in headers.headers.iter().flat_map(|map| &map.headers) {
            let value = value_of(entry);
            match entry.key.as_str() {
                ":path" => self.path = String::from_utf8_lossy(value).into_owned(),
                key if key.starts_with(':') => {}
                key => {
                    if key == "content-type" {
                        content_type = String::from_utf8_lossy(value).into_owned();
                    } else if key == crate::headers::INFERENCE_HEADER_CONTENT_LENGTH.as_str() {
                        header_length = Some(String::from_utf8_lossy(value).into_owned());
                    }
                    if let (Ok(name), Ok(value)) = (HeaderName::try_from(key), HeaderValue::from_bytes(value)) {
                        self.forward.append(name, value);
                    }
                }
            }
        }
        self.grpc = content_type.starts_with("application/grpc");
        self.subset = metadata.and_then(subset_hint);
        let decthings = content_type.starts_with("application/x-decthings");
        self.wanted = read::wanted(&self.path, self.grpc, header_length.as_deref(), decthings)?;
        Ok(())
    }

    async fn on_request_body(&mut self, body: ext_proc::HttpBody, answers: &mut Vec<ext_proc::ProcessingResponse>) {
        match self.phase {
            Phase::Reading => {
                let room = (MOST_READ + 5).saturating_sub(self.start.len());
                // The start is copied (at most MOST_READ bytes and a frame prefix) to be read in one piece; the chunk
                // itself is held as it came.
                self.start.extend_from_slice(&body.body[..body.body.len().min(room)]);
                let end = body.end_of_stream;
                self.held.push(body.body);
                // Read again once the start has doubled or grown by a step (or is full, or the body ended): a body
                // sent a few bytes at a time is not read over from its beginning for each of them.
                let (length, full) = (self.start.len(), self.start.len() >= MOST_READ + 5);
                if end || full || length >= self.read_at.saturating_mul(2).min(self.read_at + READ_STEP) {
                    self.read_at = self.start.len();
                    self.pick(end, end, answers).await;
                }
            }
            Phase::Relaying | Phase::Headers => {
                if self.request_duplex {
                    answers.push(answer(Answer::RequestBody(streamed(body.body, body.end_of_stream))));
                } else {
                    answers.push(answer(Answer::RequestBody(ext_proc::BodyResponse::default())));
                }
            }
            Phase::Refused => {}
        }
    }

    /// Picks once the body's start says enough (`whole`: the body has ended; `body_ended`: with its last chunk, not
    /// trailers), and answers the request's headers with the pick, then the held chunks; or refuses the call.
    async fn pick(&mut self, whole: bool, body_ended: bool, answers: &mut Vec<ext_proc::ProcessingResponse>) {
        let read = if self.wanted.reads_body() && self.request_duplex {
            match self.wanted.read(&self.start, whole) {
                Ok(None) if !whole && self.start.len() < MOST_READ + 5 => return,
                Ok(None) => Err(Error::invalid("the request's body ends before what names its model")),
                Ok(Some(read)) => Ok(Some(read)),
                Err(error) => Err(error),
            }
        } else if matches!(self.wanted, Wanted::Grpc { .. }) {
            Err(Error::new(
                ErrorKind::Unimplemented,
                Origin::Gateway,
                "a gRPC call names its model in its message: the endpoint picker needs the request body \
                 (ext_proc request_body_mode FULL_DUPLEX_STREAMED) to pick for it",
            ))
        } else {
            // Not sent the body (another body mode), or none to read: the call is picked by its path alone.
            Ok(self.wanted.by_path())
        };
        let picked = match read {
            Ok(read) => self.choose(read).await,
            Err(error) => Err(error),
        };
        self.picked_after = Some(self.began.elapsed());
        let (headers_answer, rename) = match picked {
            Ok(picked) => picked,
            Err(error) => {
                answers.push(self.refuse(&error));
                return;
            }
        };
        answers.push(headers_answer);
        self.phase = Phase::Relaying;
        let held = std::mem::take(&mut self.held);
        self.start = Vec::new();
        let ended = body_ended;
        let held = match rename {
            Some(head) => {
                let mut chunks = vec![head.0];
                chunks.extend(read::skip(&held, head.1));
                chunks
            }
            None => held,
        };
        let count = held.len();
        for (index, chunk) in held.into_iter().enumerate() {
            let last = index + 1 == count && ended;
            answers.push(answer(Answer::RequestBody(streamed(chunk, last))));
        }
    }

    /// The pick for what was read (`None`: a call that names no model), as the answer to the request's headers,
    /// and, when the call's gRPC message must name the backend's model, the message's new start and how many bytes
    /// of the held body it replaces.
    async fn choose(&mut self, read: Option<Read>) -> Result<(ext_proc::ProcessingResponse, Option<(Bytes, usize)>)> {
        let dispatcher = self.dispatcher.clone();
        let Some(read) = read else {
            let picked = dispatcher.pick_any(self.subset.as_deref())?;
            let answer = self.picked(picked, None);
            return Ok((answer, None));
        };
        self.model = Some(read.model.clone());
        let principal = dispatcher.guard().authenticate(&self.forward)?;
        let trace = dispatcher.traces().map_or_else(Trace::default, |traces| {
            traces.request(&self.forward, || {
                ("epp pick".into(), vec![KeyValue::new("oip.path", self.path.clone())])
            })
        });
        let call = CallRequest {
            model: &read.model,
            version: read.version.as_deref(),
            forward: &self.forward,
            principal: principal.as_deref(),
            taken: Taken::Nothing,
            generates: self.wanted.generates().is_some(),
            trace: &trace,
        };
        let reserved = read.reserved.clone();
        let (admitted, _) = dispatcher.admit(&call, async move { Ok(((), reserved)) }).await;
        let (admitted, ()) = admitted?;
        self.version = Some(admitted.routed.route.version.clone());
        let route = admitted.routed.route.clone();
        self.carried_as_it_came(&dispatcher, &route)?;
        let (path, head) = match self.backend_names(&dispatcher, &route, &read)? {
            Renaming::None => (None, None),
            Renaming::Path(path) => (Some(path), None),
            Renaming::Message { start, replaced } => (None, Some((start, replaced))),
        };
        let picking = trace.child("pick", SpanKind::Internal, Vec::new);
        let picked = dispatcher
            .pick(&admitted.routed, self.subset.as_deref(), self.fallbacks)
            .await;
        if let Ok(picked) = &picked {
            picking.set("oip.endpoint", picked.picked().to_string());
        }
        drop(picking);
        let picked = picked?;
        self.tokens = self.tokens_counted(&admitted);
        self.admitted = Some(admitted);
        let mut answer = self.picked(picked, path);
        // The renamed message's length changed: a length the client gave no longer holds.
        if head.is_some()
            && let Some(Answer::RequestHeaders(headers)) = &mut answer.response
            && let Some(common) = &mut headers.response
            && let Some(mutation) = &mut common.header_mutation
        {
            mutation.remove_headers.push("content-length".to_owned());
        }
        Ok((answer, head))
    }

    /// Refuses a call of a model served over the other protocol: the proxy carries the call as it came, so nothing
    /// would translate it.
    fn carried_as_it_came(&self, dispatcher: &Dispatcher, route: &VersionRoute) -> Result<()> {
        let served_over = dispatcher.backend_protocol(route);
        if served_over.is_none_or(|protocol| (protocol == BackendProtocol::Grpc) == self.grpc) {
            return Ok(());
        }
        let (asked, served) = if self.grpc { ("gRPC", "REST") } else { ("REST", "gRPC") };
        Err(Error::new(
            ErrorKind::Unimplemented,
            Origin::Gateway,
            format!(
                "model '{}' is served by {served} endpoints, and the proxy carries this {asked} call as it came: call \
                 it over {served}",
                route.model
            ),
        ))
    }

    /// How the call names the backend's model and the version routing chose (a canary split chose it): the REST path
    /// rewritten, or a unary gRPC message's new start and how many bytes of the held body it replaces; neither when
    /// the call names them already. A stream, whose every message names the model, goes on unrenamed where that
    /// changes nothing (the same name, and no version named or the same), and is refused where it would.
    fn backend_names(&self, dispatcher: &Dispatcher, route: &VersionRoute, read: &Read) -> Result<Renaming> {
        let stream = matches!(
            self.wanted,
            Wanted::Grpc {
                method: read::GrpcMethod::StreamInfer
            }
        );
        let backend_version = route.backend_version().unwrap_or("");
        let renamed = route.upstream_name != read.model
            || backend_version != read.version.as_deref().unwrap_or("")
                && !(stream && read.version.is_none() && !dispatcher.splits(&route.model));
        if !renamed {
            return Ok(Renaming::None);
        }
        match (&self.wanted, read.grpc_frame) {
            (
                Wanted::Rest {
                    suffix: Some(suffix), ..
                },
                _,
            ) => {
                let mut path = crate::upstream::rest::model_path(&route.upstream_name, route.backend_version(), suffix);
                if let Some((_, query)) = self.path.split_once('?') {
                    path.push('?');
                    path.push_str(query);
                }
                Ok(Renaming::Path(path))
            }
            (Wanted::Grpc { .. }, Some((length, leading))) if !stream => {
                let (start, replaced) = rename_message(
                    &self.start,
                    length,
                    leading,
                    &route.upstream_name,
                    &route.upstream_version,
                )?;
                Ok(Renaming::Message { start, replaced })
            }
            _ => Err(Error::new(
                ErrorKind::Unimplemented,
                Origin::Gateway,
                format!(
                    "model '{}' version '{}' is served as '{}' version '{}' by its backend, and the endpoint picker \
                     cannot rename it in this call (it renames REST paths and unary gRPC messages; each message of a \
                     stream names the model again)",
                    route.model, route.version, route.upstream_name, route.upstream_version
                ),
            )),
        }
    }

    /// Where a `generate` call's answer is counted, when the call is under a token budget.
    fn tokens_counted(&self, admitted: &AdmittedCall) -> Option<AnswerTokens> {
        let call = self.wanted.generates()?;
        let meter = admitted.admission.token_meter()?.clone();
        if !self.answer_sent {
            static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "the proxy sends the endpoint picker no answer bodies (ext_proc response_body_mode NONE): token \
                     budgets are not charged; send them FULL_DUPLEX_STREAMED"
                );
            }
            return None;
        }
        Some(AnswerTokens::new(meter, call))
    }

    /// Holds the pick and answers the request's headers with it: the endpoints named in the destination header and
    /// in the `envoy.lb` dynamic metadata, and the path renamed when the backend names the model otherwise.
    fn picked(&mut self, picked: Picked, path: Option<String>) -> ext_proc::ProcessingResponse {
        let endpoints = picked.endpoints.iter().map(|e| &**e).collect::<Vec<_>>().join(",");
        let mut set_headers = vec![set_header(DESTINATION, endpoints.as_bytes())];
        if let Some(path) = &path {
            set_headers.push(set_header(":path", path.as_bytes()));
        }
        self.result = "picked";
        self.gateway.metrics().epp_pick(
            self.model.as_deref().unwrap_or(NO_BACKEND),
            self.version.as_deref().unwrap_or(NO_BACKEND),
            picked.picked(),
            "picked",
            self.began.elapsed(),
        );
        self.endpoints = Some(endpoints.clone());
        self.picked = Some(picked);
        let lb = prost_types::Struct {
            fields: [(DESTINATION.to_owned(), string_value(endpoints))]
                .into_iter()
                .collect(),
        };
        ext_proc::ProcessingResponse {
            response: Some(Answer::RequestHeaders(ext_proc::HeadersResponse {
                response: Some(ext_proc::CommonResponse {
                    header_mutation: Some(ext_proc::HeaderMutation {
                        set_headers,
                        // An answer counted for a token budget is asked for uncompressed, so its tokens can be read.
                        remove_headers: match self.tokens {
                            Some(_) => vec!["accept-encoding".to_owned()],
                            None => Vec::new(),
                        },
                    }),
                    // The proxy's route may depend on what was set (the destination header, a renamed path).
                    clear_route_cache: true,
                    ..Default::default()
                }),
            })),
            dynamic_metadata: Some(prost_types::Struct {
                fields: [(
                    LB_NAMESPACE.to_owned(),
                    prost_types::Value {
                        kind: Some(Kind::StructValue(lb)),
                    },
                )]
                .into_iter()
                .collect(),
            }),
            ..Default::default()
        }
    }

    /// Refuses the call with an immediate response: its status and, for a gRPC client, its code; the message as a
    /// REST error body (or a gRPC message).
    fn refuse(&mut self, error: &Error) -> ext_proc::ProcessingResponse {
        self.phase = Phase::Refused;
        self.held.clear();
        self.start = Vec::new();
        self.picked_after.get_or_insert_with(|| self.began.elapsed());
        self.result = match error.kind() {
            // The caller's limits, told apart from the fleet's load.
            ErrorKind::Overloaded if error.origin() == Origin::Client => "rate_limited",
            ErrorKind::Overloaded => "shed",
            ErrorKind::Unavailable => "unavailable",
            _ => "refused",
        };
        let status = error.http_status().as_u16();
        self.status = status;
        // Labelled by what routing resolved, never by what the client wrote: a version not routed is `_unknown`.
        let (model, version) = match (&self.model, &self.version) {
            (Some(model), Some(version)) => (model.as_str(), version.as_str()),
            (Some(model), None) if self.dispatcher.knows(model) => (model.as_str(), UNKNOWN),
            _ => (UNKNOWN, UNKNOWN),
        };
        self.gateway
            .metrics()
            .epp_pick(model, version, NO_BACKEND, self.result, self.began.elapsed());
        let mut set_headers = Vec::new();
        if let Some(seconds) = error.retry_after_seconds() {
            set_headers.push(set_header("retry-after", seconds.to_string().as_bytes()));
        }
        let (body, grpc_status) = if self.grpc {
            (
                Bytes::from(error.message().to_owned()),
                Some(ext_proc::GrpcStatus {
                    status: error.grpc_code() as u32,
                }),
            )
        } else {
            set_headers.push(set_header("content-type", b"application/json"));
            let body = serde_json::json!({ "error": error.message() }).to_string();
            (Bytes::from(body), None)
        };
        answer(Answer::ImmediateResponse(ext_proc::ImmediateResponse {
            status: Some(crate::envoy_api::envoy::r#type::v3::HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(ext_proc::HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            body,
            grpc_status,
            details: format!("oipgate_epp_{}", self.result),
        }))
    }

    fn on_response_headers(&mut self, headers: &ext_proc::HttpHeaders, metadata: Option<&core::Metadata>) {
        if let Some(map) = &headers.headers {
            if let Some(status) = header(map, ":status").and_then(|s| s.parse::<u16>().ok()) {
                self.status = status;
                self.failed |= status >= 500;
            }
            if let Some(tokens) = &mut self.tokens {
                tokens.head(
                    self.status,
                    header(map, "content-type"),
                    header(map, "content-encoding"),
                );
            }
            if let Some(status) = header(map, "grpc-status").and_then(|s| s.parse::<u32>().ok()) {
                self.failed |= grpc_failure(status);
            }
        }
        let served = metadata.and_then(|metadata| {
            let fields = &metadata.filter_metadata.get(LB_NAMESPACE)?.fields;
            match fields.get(SERVED)?.kind.as_ref()? {
                Kind::StringValue(served) => Some(served.clone()),
                _ => None,
            }
        });
        let Some(picked) = &mut self.picked else {
            return;
        };
        match served {
            Some(served) => {
                let as_picked = picked.served(&served);
                let result = if as_picked { "picked" } else { "fallback" };
                self.gateway.metrics().epp_served(picked.serving(), result);
                self.served = Some(served);
            }
            None => self.gateway.metrics().epp_served(picked.serving(), "unreported"),
        }
    }

    /// The answer has ended: the outcome is recorded at the endpoint that served it and the call's places are
    /// given back.
    fn end(&mut self) {
        if self.ended {
            return;
        }
        self.ended = true;
        if let Some(picked) = self.picked.take() {
            picked.finished(self.failed);
        }
        // Counted before the admission goes, whose end charges the budgets.
        if let Some(tokens) = &mut self.tokens {
            tokens.finish();
        }
        self.admitted = None;
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        // The proxy closes the stream when the call is over. Without the answer's body and trailers sent to the
        // picker (the response body mode NONE), that close is the answer's end: its status, when the headers came,
        // counts at the endpoint that served it. A stream that ended before any answer (the client went away, the
        // proxy reset it) gives its places back without counting against the endpoint.
        if self.status != 0 && !matches!(self.phase, Phase::Refused) {
            self.end();
        }
        self.picked = None;
        self.admitted = None;
        if matches!(self.phase, Phase::Headers) {
            return;
        }
        let request_id = self
            .forward
            .get(crate::headers::REQUEST_ID)
            .and_then(|v| v.to_str().ok());
        logging::pick(&FinishedPick {
            request_id,
            protocol: if self.grpc { "grpc" } else { "rest" },
            target: &self.path,
            model: self.model.as_deref(),
            version: self.version.as_deref(),
            endpoints: self.endpoints.as_deref(),
            served: self.served.as_deref(),
            result: self.result,
            status: self.status,
            pick: self.picked_after.unwrap_or_default(),
            duration: self.began.elapsed(),
        });
    }
}

/// The message's new start when its model is renamed: the frame prefix with the new length and the renamed
/// leading fields, and how many bytes of the body (prefix and old leading fields) it replaces.
fn rename_message(start: &[u8], length: usize, leading: usize, name: &str, version: &str) -> Result<(Bytes, usize)> {
    let fields = Bytes::copy_from_slice(&start[5..5 + leading]);
    let renamed = crate::codec::splice::rename(&fields, name, version)?;
    let renamed_length: usize = renamed.iter().map(Bytes::len).sum();
    let new_length = u32::try_from(length - leading + renamed_length)
        .map_err(|_| Error::invalid("the renamed message is longer than gRPC frames allow"))?;
    let mut head = BytesMut::with_capacity(5 + renamed_length);
    head.extend_from_slice(&[0]);
    head.extend_from_slice(&new_length.to_be_bytes());
    for piece in renamed {
        head.extend_from_slice(&piece);
    }
    Ok((head.freeze(), 5 + leading))
}

fn answer(response: Answer) -> ext_proc::ProcessingResponse {
    ext_proc::ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

/// A body chunk given back: as a streamed chunk in full-duplex mode, else let through as it is.
fn body_answer(body: ext_proc::HttpBody, duplex: bool) -> ext_proc::BodyResponse {
    if duplex {
        streamed(body.body, body.end_of_stream)
    } else {
        ext_proc::BodyResponse::default()
    }
}

fn streamed(body: Bytes, end_of_stream: bool) -> ext_proc::BodyResponse {
    ext_proc::BodyResponse {
        response: Some(ext_proc::CommonResponse {
            body_mutation: Some(ext_proc::BodyMutation {
                mutation: Some(ext_proc::body_mutation::Mutation::StreamedResponse(
                    ext_proc::StreamedBodyResponse { body, end_of_stream },
                )),
            }),
            ..Default::default()
        }),
    }
}

fn set_header(name: &str, value: &[u8]) -> core::HeaderValueOption {
    core::HeaderValueOption {
        header: Some(core::HeaderValue {
            key: name.to_owned(),
            value: String::new(),
            raw_value: value.to_vec(),
        }),
        append_action: core::header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn string_value(value: String) -> prost_types::Value {
    prost_types::Value {
        kind: Some(Kind::StringValue(value)),
    }
}

/// A header's value as Envoy sends it: in `raw_value`, or in `value` from older proxies.
fn value_of(entry: &core::HeaderValue) -> &[u8] {
    if entry.raw_value.is_empty() {
        entry.value.as_bytes()
    } else {
        &entry.raw_value
    }
}

fn header<'a>(map: &'a core::HeaderMap, name: &str) -> Option<&'a str> {
    map.headers
        .iter()
        .find(|entry| entry.key == name)
        .and_then(|entry| std::str::from_utf8(value_of(entry)).ok())
}

/// A gRPC status that counts against the endpoint: UNAVAILABLE, or INTERNAL, as a 5xx does.
fn grpc_failure(status: u32) -> bool {
    status == tonic::Code::Unavailable as u32 || status == tonic::Code::Internal as u32
}

/// The subset hint in the request's filter metadata: a list of `ip:port`, or one string of them joined by commas.
fn subset_hint(metadata: &core::Metadata) -> Option<Vec<String>> {
    let value = metadata.filter_metadata.get(SUBSET_NAMESPACE)?.fields.get(SUBSET)?;
    let mut endpoints = Vec::new();
    let mut add = |text: &str| {
        endpoints.extend(
            text.split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(str::to_owned),
        );
    };
    match value.kind.as_ref()? {
        Kind::StringValue(text) => add(text),
        Kind::ListValue(list) => {
            for item in &list.values {
                if let Some(Kind::StringValue(text)) = &item.kind {
                    add(text);
                }
            }
        }
        _ => {}
    }
    Some(endpoints)
}
