//! The REST front door on hyper (HTTP/1.1 and h2c on one port; over TLS, HTTP/2 or HTTP/1.1 by ALPN): health and
//! metadata answered by the gateway, inference proxied untouched to REST backends that need no translation (an
//! aliased answer renamed on its way back), and decoded, dispatched and re-encoded for everything else (gRPC
//! backends, Decthings bodies).

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode};
use http_body::Body as _;
use http_body_util::BodyExt;

mod answer;
pub mod connection;
mod generate;
mod http1;
mod infer;

pub use answer::AnswerBody;
use answer::{Record, Rename};
#[cfg(feature = "fuzzing")]
pub use http1::read_request_head;

use super::budget::AnswerBudget;
use crate::body::http1::Http1BodyError;
use crate::body::{BodyLimits, ClientBody, RequestBody, RequestBodyError};
use crate::codec::rest::{self, EncodedBody};
use crate::dispatch::{ConfigForm, ModelConfigAnswer, RepositoryAction};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::live::Gateway;
use crate::protocol::paths::{Route, route};
use crate::protocol::{ModelReady, ServerLive, ServerReady};
use crate::telemetry::traces::Trace;
use crate::upstream::BackendBody;
use opentelemetry::KeyValue;

/// Content type of Decthings request and response bodies.
pub const DECTHINGS_CONTENT_TYPE: &str = "application/x-decthings-tensors";
/// How long a body that will not be used is read and dropped, so a client still sending it can read the answer
/// instead of a reset connection (nginx's lingering close).
const LINGER: Duration = Duration::from_secs(5);
/// The longest request target (path and query) accepted, as nginx's default header buffer allows.
pub const MAX_TARGET_BYTES: usize = 8 * 1024;

/// The REST front door's request handling.
#[derive(Debug)]
pub struct RestDoor {
    gateway: Arc<Gateway>,
    max_request_bytes: u64,
    /// What a request body is held to: its pace, its whole time, its bytes on the wire.
    body_limits: BodyLimits,
}

/// What a request is answered with, before the answer's head is made.
enum PendingAnswer {
    Json(StatusCode, Vec<u8>),
    /// An inference answer encoded by the gateway, with the backend's end-to-end headers.
    Encoded(EncodedBody, HeaderMap),
    /// An answer made of `chunks`, with these headers.
    Buffered(StatusCode, HeaderMap, Vec<Bytes>),
    /// A backend's answer streamed through until the deadline.
    Proxied(
        Box<http::response::Parts>,
        BackendBody,
        Option<Rename>,
        std::time::Instant,
    ),
    /// Server-sent events, each sent as it comes.
    Events(tokio::sync::mpsc::Receiver<Bytes>),
}

impl RestDoor {
    pub fn new(gateway: Arc<Gateway>, body_limits: BodyLimits) -> Self {
        RestDoor {
            gateway,
            max_request_bytes: body_limits.bytes,
            body_limits,
        }
    }

    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    /// The most bytes a request body may take (`limits.max_request_bytes`).
    pub fn max_request_bytes(&self) -> u64 {
        self.max_request_bytes
    }

    /// Answers one request, whose head had come whole at `arrived`; `budget` is an HTTP/2 connection's bound on the
    /// answers it holds unread.
    pub async fn answer(
        &self,
        mut parts: Box<http::request::Parts>,
        body: ClientBody,
        budget: Option<&Arc<AnswerBudget>>,
        arrived: std::time::Instant,
    ) -> Response<AnswerBody> {
        let uri = Some(parts.uri.clone());
        let mut record = Record::new(self.gateway.serving(), uri, arrived);
        record.answer_coding = crate::codec::compression::answer_coding(&parts.headers);
        record.writes_lines = parts.version < http::Version::HTTP_2;
        if let Some(traces) = record.dispatcher().traces() {
            record.trace = request_span(traces, &parts);
        }
        let mut body = Some(RequestBody::new(body, self.body_limits));
        let reply = match authenticate(&mut parts, &mut record) {
            Ok(()) => self.handle(&parts, &mut body, &mut record).await,
            Err(error) => Err(error),
        };
        let reply = match (reply, budget) {
            (Ok(reply), Some(budget)) => hold(reply, budget),
            (reply, _) => reply,
        };
        let response = match reply {
            Ok(PendingAnswer::Json(status, json)) => answer::json(status, json, record),
            Ok(PendingAnswer::Encoded(encoded, headers)) => answer::encoded(encoded, headers, record),
            Ok(PendingAnswer::Buffered(status, headers, chunks)) => answer::buffered(status, headers, chunks, record),
            Ok(PendingAnswer::Proxied(head, answer_body, rename, until)) => {
                answer::proxied(*head, answer_body, rename, until, record)
            }
            Ok(PendingAnswer::Events(events)) => answer::events(events, record),
            Err(error) => answer::error(&error, &parts.method, record),
        };
        // An HTTP/2 body left unread is read and dropped for a while, so the client can finish sending it; an
        // HTTP/1.1 connection does the same with what it has not read, and then closes.
        if let Some(body) = body
            && parts.version == http::Version::HTTP_2
            && !body.is_end_stream()
        {
            tokio::spawn(discard(body));
        }
        response
    }

    async fn handle(
        &self,
        parts: &http::request::Parts,
        body: &mut Option<RequestBody>,
        record: &mut Record,
    ) -> Result<PendingAnswer> {
        if parts.uri.path_and_query().map_or(0, |target| target.as_str().len()) > MAX_TARGET_BYTES {
            return Err(Error::new(
                ErrorKind::UriTooLong,
                Origin::Client,
                format!("the request target is longer than {MAX_TARGET_BYTES} bytes"),
            ));
        }
        let path = parts.uri.path();
        let route = route(path).ok_or_else(|| Error::not_found(format!("no endpoint at {path}")))?;
        let method = &parts.method;
        // HEAD is GET without the body (RFC 9110 §9.3.2): the answer's writer leaves the body out.
        let answered_as = if *method == Method::HEAD {
            Method::GET
        } else {
            method.clone()
        };
        if answered_as != route.method() {
            return Err(Error::new(
                ErrorKind::MethodNotAllowed,
                Origin::Client,
                format!("{path} answers {} only, not {method}", route.method()),
            ));
        }
        // An inference is authorised, let in and routed in dispatch's one step; every other call naming a model is
        // authorised for it here.
        match route {
            Route::Infer(model, version) => return self.infer(parts, body, record, model, version).await,
            Route::Generate(model, version, call) => {
                return Box::pin(self.generate(parts, body, record, model, version, call)).await;
            }
            _ => {}
        }
        if let Some(model) = route.model() {
            let dispatcher = record.dispatcher().clone();
            dispatcher.guard().authorize(record.principal.as_deref(), model)?;
        }
        // Boxed: every other endpoint is rare next to inference, and some have large states of their own, which an
        // inference's future (moved as each request is taken up) would otherwise be as large as.
        Box::pin(self.other(route, parts, body, record)).await
    }

    /// Answers the endpoints other than inference.
    async fn other(
        &self,
        route: Route<'_>,
        parts: &http::request::Parts,
        body: &mut Option<RequestBody>,
        record: &mut Record,
    ) -> Result<PendingAnswer> {
        let dispatcher = record.dispatcher().clone();
        let guard = dispatcher.guard();
        let principal = record.principal.clone();
        let principal = principal.as_deref();
        Ok(match route {
            Route::ServerMetadata => PendingAnswer::Json(
                StatusCode::OK,
                rest::encode_server_metadata(dispatcher.server_metadata()),
            ),
            Route::Live => PendingAnswer::Json(StatusCode::OK, rest::encode_server_live(ServerLive { live: true })),
            Route::Ready => {
                let ready = !self.gateway.is_draining() && dispatcher.server_ready().await;
                PendingAnswer::Json(
                    answer::health_status(ready),
                    rest::encode_server_ready(ServerReady { ready }),
                )
            }
            Route::ModelMetadata(model, version) => {
                let metadata = dispatcher.model_metadata(model, version).await?;
                PendingAnswer::Json(StatusCode::OK, rest::encode_model_metadata(&metadata))
            }
            Route::ModelReady(model, version) => {
                let ready = dispatcher.model_ready(model, version).await?;
                let body = rest::encode_model_ready(&ModelReady {
                    name: model.to_owned(),
                    ready,
                });
                PendingAnswer::Json(answer::health_status(ready), body)
            }
            Route::ModelConfig(model, version) => {
                match dispatcher.model_config(model, version, ConfigForm::Json).await? {
                    ModelConfigAnswer::Json(config) => PendingAnswer::Json(StatusCode::OK, config),
                    ModelConfigAnswer::Protobuf(_) => {
                        return Err(Error::internal("a model configuration in protobuf form"));
                    }
                }
            }
            Route::ModelStatistics(model, version) => {
                let mut statistics = dispatcher.model_statistics(model, version).await?;
                statistics.retain(|entry| guard.shows(principal, &entry.name));
                PendingAnswer::Json(StatusCode::OK, rest::encode_model_statistics(statistics))
            }
            Route::RepositoryIndex => {
                let declared = self.declared_length(parts.headers.get(http::header::CONTENT_LENGTH))?;
                let body = self.read_body(body, declared, Vec::new()).await?;
                let ready_only = rest::decode_repository_index_request(&body)?;
                let mut entries = dispatcher.repository_index(ready_only).await;
                entries.retain(|entry| guard.shows(principal, &entry.name));
                PendingAnswer::Json(StatusCode::OK, rest::encode_repository_index(&entries))
            }
            Route::RepositoryLoad(model) | Route::RepositoryUnload(model) => {
                let action = match route {
                    Route::RepositoryLoad(_) => RepositoryAction::Load,
                    _ => RepositoryAction::Unload,
                };
                guard.authorize_admin(principal, "loading and unloading models")?;
                let declared = self.declared_length(parts.headers.get(http::header::CONTENT_LENGTH))?;
                let body = self.read_body(body, declared, Vec::new()).await?;
                let parameters = rest::decode_repository_request(&body)?;
                let forward = crate::headers::for_backend(&parts.headers);
                dispatcher
                    .repository_change(model, action, &parameters, &forward)
                    .await?;
                PendingAnswer::Buffered(StatusCode::OK, HeaderMap::new(), Vec::new())
            }
            // A region is memory on the client's host: the gateway holds none, lets a client's clean-up succeed, and
            // refuses to register one.
            Route::SharedMemoryStatus(_) => PendingAnswer::Json(StatusCode::OK, b"[]".to_vec()),
            Route::SharedMemoryUnregister(_) => PendingAnswer::Buffered(StatusCode::OK, HeaderMap::new(), Vec::new()),
            Route::SharedMemoryRegister(memory, region) => {
                return Err(crate::protocol::reserved::shared_memory_registration_refused(
                    memory.kind(),
                    region,
                ));
            }
            Route::Infer(..) | Route::Generate(..) => {
                return Err(Error::internal("an inference taken for another endpoint"));
            }
        })
    }

    fn too_large(&self) -> Error {
        Error::new(
            ErrorKind::PayloadTooLarge,
            Origin::Client,
            format!(
                "request body is larger than the limit of {} bytes",
                self.max_request_bytes
            ),
        )
    }

    /// The body's declared length, refused when over the limit (before any of it is read).
    fn declared_length(&self, content_length: Option<&HeaderValue>) -> Result<Option<u64>> {
        let declared = content_length.and_then(|value| crate::codec::http1::content_length(value.as_bytes()));
        if declared.is_some_and(|length| length > self.max_request_bytes) {
            return Err(self.too_large());
        }
        Ok(declared)
    }

    /// Reads the rest of the body after the chunks `read` so far, refusing it as soon as it passes the limit. One
    /// chunk is kept as it is; a body in several is joined into one buffer of its `declared` length as they arrive
    /// (no growth by doubling, which would copy a large tensor several times over, and no chunk kept once copied).
    /// A body refused for its size is left in `body`, partly read, for the caller to discard.
    async fn read_body(
        &self,
        body: &mut Option<RequestBody>,
        declared: Option<u64>,
        read: Vec<Bytes>,
    ) -> Result<Bytes> {
        let mut joined = JoinedBody::new(declared);
        for chunk in read {
            joined.push(chunk);
        }
        let Some(reading) = body.as_mut() else {
            return Ok(joined.finish());
        };
        while let Some(frame) = reading.frame().await {
            let frame = frame.map_err(body_error)?;
            let Ok(chunk) = frame.into_data() else { continue };
            if (joined.len() + chunk.len()) as u64 > self.max_request_bytes {
                return Err(self.too_large());
            }
            joined.push(chunk);
        }
        *body = None;
        Ok(joined.finish())
    }
}

/// A body's chunks joined into one buffer as they arrive: the first kept as it is until a second comes, then one
/// buffer of the declared length.
struct JoinedBody {
    declared: usize,
    first: Option<Bytes>,
    joined: BytesMut,
}

impl JoinedBody {
    fn new(declared: Option<u64>) -> JoinedBody {
        JoinedBody {
            declared: declared.and_then(|length| usize::try_from(length).ok()).unwrap_or(0),
            first: None,
            joined: BytesMut::new(),
        }
    }

    fn len(&self) -> usize {
        self.joined.len() + self.first.as_ref().map_or(0, Bytes::len)
    }

    fn push(&mut self, chunk: Bytes) {
        match self.first.take() {
            None if self.joined.is_empty() => self.first = Some(chunk),
            Some(previous) => {
                self.joined.reserve(self.declared.max(previous.len() + chunk.len()));
                self.joined.extend_from_slice(&previous);
                self.joined.extend_from_slice(&chunk);
            }
            None => self.joined.extend_from_slice(&chunk),
        }
    }

    fn finish(self) -> Bytes {
        self.first.unwrap_or_else(|| self.joined.freeze())
    }
}

/// The span of a request at the door, named for its endpoint.
fn request_span(traces: &crate::telemetry::traces::Traces, parts: &http::request::Parts) -> Trace {
    traces.request(&parts.headers, || {
        let name = route(parts.uri.path()).map_or("unknown endpoint", |route| route.template());
        let attributes = vec![
            KeyValue::new("http.request.method", parts.method.to_string()),
            KeyValue::new("url.path", parts.uri.path().to_owned()),
            KeyValue::new("oip.protocol", "rest"),
        ];
        (name.into(), attributes)
    })
}

/// What a client's body that could not be read is answered with: 408 for a stall, 499 for a client that went away
/// (its connection closed, or its HTTP/2 stream cancelled), else 400.
fn body_error(error: RequestBodyError) -> Error {
    if let RequestBodyError::Http1(Http1BodyError::Framing(bad)) = error {
        return Error::invalid(format!("could not read the request body: its {bad}"));
    }
    let cancelled = |cause: &(dyn std::error::Error + 'static)| {
        crate::error::is_closed_connection(cause)
            || std::iter::successors(Some(cause), |cause| cause.source())
                .filter_map(|cause| cause.downcast_ref::<h2::Error>())
                .any(|h2| h2.is_reset() && h2.is_remote())
    };
    match error {
        RequestBodyError::Stalled(_) | RequestBodyError::Overdue(_) => {
            Error::new(ErrorKind::RequestTimeout, Origin::Client, error.to_string())
        }
        RequestBodyError::TooLarge(_) | RequestBodyError::Http1(Http1BodyError::TooLarge(_)) => {
            Error::new(ErrorKind::PayloadTooLarge, Origin::Client, error.to_string())
        }
        RequestBodyError::Http1(_) => Error::new(
            ErrorKind::Cancelled,
            Origin::Client,
            "the client went away before sending the whole body",
        ),
        _ if cancelled(&error) => Error::new(
            ErrorKind::Cancelled,
            Origin::Client,
            "the client went away before sending the whole body",
        ),
        _ => Error::invalid(format!("could not read the request body: {error}")).caused_by(error),
    }
}

/// Charges an answer made whole to its HTTP/2 connection's budget (answers relayed as they come are held back by
/// flow control instead, and small JSON answers are not counted); one past the budget is let go and the call
/// refused.
fn hold(reply: PendingAnswer, budget: &Arc<AnswerBudget>) -> Result<PendingAnswer> {
    Ok(match reply {
        PendingAnswer::Encoded(mut encoded, headers) => {
            encoded.chunks = budget.hold(std::mem::take(&mut encoded.chunks))?;
            PendingAnswer::Encoded(encoded, headers)
        }
        PendingAnswer::Buffered(status, headers, chunks) => {
            PendingAnswer::Buffered(status, headers, budget.hold(chunks)?)
        }
        other => other,
    })
}

/// Names the caller when `[auth]` asks for one (health probes need none), and keeps the credential from the
/// backend unless the configuration forwards it.
fn authenticate(parts: &mut http::request::Parts, record: &mut Record) -> Result<()> {
    let probe = matches!(parts.uri.path(), "/v2/health/live" | "/v2/health/ready");
    let principal = record.dispatcher().guard().caller(&mut parts.headers, probe)?;
    record.report.principal = principal
        .clone()
        .map(|principal| principal as Arc<dyn crate::telemetry::ReportedPrincipal>);
    record.principal = principal;
    Ok(())
}

/// Reads and drops an HTTP/2 body nobody will use, for a bounded time (ended early by a stall); nothing is kept.
async fn discard(mut body: RequestBody) {
    let drain = async { while let Some(Ok(_)) = body.frame().await {} };
    let _ = tokio::time::timeout(LINGER, drain).await;
}
