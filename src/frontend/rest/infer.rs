//! The REST door's inference: proxied as it came to a REST backend that understands it, or decoded, dispatched and
//! encoded again.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body_util::BodyExt;

use super::answer::{Record, Rename};
use super::{DECTHINGS_CONTENT_TYPE, PendingAnswer, RestDoor};
use crate::body::{KeptChunks, RelayError, RelaySource, RequestBody, Tap};
use crate::codec::compression::{self, Coding};
use crate::codec::decthings;
use crate::codec::rest::key_scan::KeyScan;
use crate::codec::rest::{self, BinaryOutputs, RestRequest};
use crate::config::BackendProtocol;
use crate::dispatch::{
    AdmittedCall, CallContext, CallRequest, Dispatcher, MirrorPayload, Outgoing, Passthrough, Taken,
};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::headers::INFERENCE_HEADER_CONTENT_LENGTH;
use crate::headers::{self, RequestHeaders};
use crate::protocol::{InferRequest, InferResponse, Reserved};
use crate::routing::Affinity;
use crate::routing::{Routed, VersionRoute};
use crate::telemetry::metrics::Direction;
use crate::telemetry::payload_log::{Capture, form_of};
use crate::upstream::Deadline;
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;

/// A proxied request whose declared body is at most this long is read whole and sent with its head in one write;
/// a longer one, or one of unknown length, is relayed as it arrives.
const WHOLE_BODY_LIMIT: u64 = 256 * 1024;

/// What the request asked for, read from its head.
struct InferHead<'a> {
    declared: Option<u64>,
    /// The body's content coding, when compressed.
    coding: Option<Coding>,
    header_length: Option<u64>,
    decthings_in: bool,
    decthings_out: bool,
    /// Its headers: those carried to the backend, and those about the body.
    headers: RequestHeaders<'a>,
}

impl RestDoor {
    pub(super) async fn infer(
        &self,
        parts: &http::request::Parts,
        body: &mut Option<RequestBody>,
        record: &mut Record,
        model: &str,
        version: Option<&str>,
    ) -> Result<PendingAnswer> {
        let headers = &parts.headers;
        let read = RequestHeaders::read(headers);
        record.request_id = Some(read.request_id.clone());
        // The record's dispatcher and principal are borrowed, not shared again: each share is an atomic count up
        // and down.
        let call = CallRequest {
            model,
            version,
            forward: headers,
            principal: record.principal.as_deref(),
            taken: Taken::Nothing,
            generates: false,
            trace: &record.trace,
        };
        // What the head says of the body is read now but refused only once the call is let in (a refusal of the
        // principal comes first), and the body's start is read before the call is routed: the sequence its
        // parameters name decides where it goes. Both stay where they stand (the body's reading pinned): handed
        // over by value, they would be copied into the admission's state and back.
        let asked = self.infer_head(headers, read);
        let (admitted, route_metrics) = {
            let start = std::pin::pin!(async {
                let asked = asked.as_ref().map_err(Error::clone)?;
                let start = self.body_start(body, asked).await?;
                let (reserved, scan) = request_reserved(&start, asked)?;
                Ok(((start, scan), reserved))
            });
            record.dispatcher().admit(&call, start).await
        };
        record.route = Some(route_metrics);
        let (admitted, (start, scan)) = admitted?;
        let asked = asked?;
        let AdmittedCall {
            routed,
            admission,
            reserved,
            payload_log,
        } = admitted;
        record.admission = Some(admission);
        record.capture = payload_log.map(|logger| Box::new(Capture::new(logger, &routed.route, form_of(headers))));
        // Bound before the test: a temporary of the condition would live on through the passthrough's future.
        let passthrough = if asked.decthings_in || asked.decthings_out {
            None
        } else {
            record
                .dispatcher()
                .rest_passthrough(&routed, asked.header_length.is_some())?
        };
        if let Some(target) = passthrough {
            // The request's own `timeout` shortens the backend's time to answer.
            let mut target = target;
            target.timeout = reserved
                .timeout
                .map_or(target.timeout, |limit| limit.min(target.timeout));
            return self
                .pass_through(body, record, target, routed, asked, (start, scan))
                .await;
        }
        // Boxed: decoding, dispatching over another protocol and encoding make a large state, which the passthrough's
        // future would otherwise be as large as.
        Box::pin(self.translate(parts, body, record, routed, (asked, start, reserved), (model, version))).await
    }

    /// What the request's head says of its body and answer.
    fn infer_head<'a>(&self, headers: &'a HeaderMap, read: RequestHeaders<'a>) -> Result<InferHead<'a>> {
        fn text(value: Option<&HeaderValue>) -> Option<&str> {
            value.and_then(|v| v.to_str().ok())
        }
        Ok(InferHead {
            declared: self.declared_length(read.content_length)?,
            coding: match read.content_encoding {
                Some(_) => compression::request_coding(headers)?,
                None => None,
            },
            header_length: rest::inference_header_length(read.inference_header_length)?,
            decthings_in: text(read.content_type).is_some_and(|t| t.starts_with(DECTHINGS_CONTENT_TYPE)),
            decthings_out: text(read.accept).is_some_and(|accept| accept.contains(DECTHINGS_CONTENT_TYPE)),
            headers: read,
        })
    }

    /// Decodes the request, dispatches it to the backend over its protocol, and encodes the answer: each a step of
    /// the request's span, the crossing between the protocols timed.
    async fn translate(
        &self,
        parts: &http::request::Parts,
        body: &mut Option<RequestBody>,
        record: &mut Record,
        routed: Routed,
        (asked, start, reserved): (InferHead<'_>, BodyStart, Reserved),
        (model, version): (&str, Option<&str>),
    ) -> Result<PendingAnswer> {
        record.translated = true;
        let dispatcher = record.dispatcher().clone();
        let deadline = parts
            .headers
            .get(http::header::HeaderName::from_static("grpc-timeout"))
            .and_then(|v| v.to_str().ok())
            .and_then(crate::frontend::grpc::parse_grpc_timeout);
        let deadline = match (deadline, reserved.timeout) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let payload = match start {
            BodyStart::Whole(whole) | BodyStart::Decompressed { body: whole, .. } => whole,
            BodyStart::Partial(read) => self.read_body(body, asked.declared, read).await?,
        };
        record.request_bytes = payload.len() as u64;
        if let Some(capture) = &mut record.capture {
            capture.request(payload.clone());
        }
        // Only a crossing to a gRPC backend is a translation between the protocols; the rest is re-encoding.
        let crossing = dispatcher.backend_protocol(&routed.route) == Some(BackendProtocol::Grpc);
        let decoding = Instant::now();
        let step = record.trace.child("decode", SpanKind::Internal, || {
            vec![KeyValue::new(
                "oip.bytes",
                i64::try_from(payload.len()).unwrap_or(i64::MAX),
            )]
        });
        let decoded = self.decode(payload, &asked, model, version, record).await;
        step.outcome(&decoded);
        drop(step);
        let (request, binary_outputs) = decoded?;
        // Read whole, the request is held to what its start was routed by: a routing parameter past that start, or a
        // shared-memory one anywhere, is refused.
        request.refuse_shared_memory()?;
        if Reserved::from_parameters(&request.parameters)? != reserved {
            return Err(Error::invalid(format!(
                "the request's parameters lie past the first {WHOLE_BODY_LIMIT} bytes of its body, which the gateway \
                 reads to route it; send \"parameters\" ahead of \"inputs\""
            )));
        }
        if crossing {
            dispatcher
                .metrics()
                .translated(Direction::RestToGrpc, decoding.elapsed());
        }
        // A client that goes away drops this future, and with it the backend call (its stream or connection reset).
        let call = CallContext {
            deadline,
            forward: asked.headers.forward(),
            compressed: asked.coding,
            principal: record.principal.clone(),
            trace: record.trace.clone(),
            admitted_by_door: true,
            served_by: None,
        };
        let replied = dispatcher.infer_routed(&routed, request, &call).await?;
        record.endpoint = replied.endpoint;
        let encoding = Instant::now();
        let step = record.trace.child("encode", SpanKind::Internal, Vec::new);
        let reply = encode_answer(&replied.value, replied.headers, asked.decthings_out, &binary_outputs)?;
        if step.is_on() {
            let bytes = match &reply {
                PendingAnswer::Encoded(body, _) => body.chunks.iter().map(Bytes::len).sum(),
                PendingAnswer::Buffered(_, _, chunks) => chunks.iter().map(Bytes::len).sum(),
                _ => 0,
            };
            step.set("oip.bytes", i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        drop(step);
        if crossing {
            dispatcher
                .metrics()
                .translated(Direction::GrpcToRest, encoding.elapsed());
        }
        Ok(reply)
    }

    /// Decodes a request body: Decthings, JSON, the binary extension, or a raw binary body for a one-input model.
    async fn decode(
        &self,
        payload: Bytes,
        asked: &InferHead<'_>,
        model: &str,
        version: Option<&str>,
        record: &Record,
    ) -> Result<(InferRequest, BinaryOutputs)> {
        if asked.decthings_in {
            let inputs = decthings::decode_entries(&payload)?;
            return Ok((
                InferRequest {
                    inputs,
                    ..InferRequest::default()
                },
                BinaryOutputs::default(),
            ));
        }
        match rest::decode_request(payload, asked.header_length)? {
            RestRequest::Request {
                request,
                binary_outputs,
            } => Ok((request, binary_outputs)),
            RestRequest::RawBinary(payload) => {
                let metadata = record.dispatcher().model_metadata(model, version).await?;
                let [input] = metadata.inputs.as_slice() else {
                    return Err(Error::invalid(format!(
                        "a raw binary request (Inference-Header-Content-Length: 0) needs a model with exactly one \
                         input; '{model}' has {}",
                        metadata.inputs.len()
                    )));
                };
                rest::raw_binary_request(payload, input)
            }
        }
    }

    /// Proxies the request to the backend as it came but for its path: a small body whole, a large one relayed as
    /// it arrives; the answer streams back, renamed for an aliased model.
    async fn pass_through(
        &self,
        body: &mut Option<RequestBody>,
        record: &mut Record,
        target: Passthrough,
        routed: Routed,
        asked: InferHead<'_>,
        (start, scan): (BodyStart, Option<KeyScan>),
    ) -> Result<PendingAnswer> {
        let in_flight = record.dispatcher().passthrough_in_flight(&routed.route)?;
        // The backend's time to answer runs from the moment the call counts in flight: one reading of the clock.
        let deadline = Deadline {
            until: in_flight.started() + target.timeout,
            given: target.timeout,
        };
        record.in_flight = Some(in_flight);
        // A compressed body goes on compressed only to a backend that reads it; an aliased model's answer is asked
        // for uncompressed, as its name is restored in it (the gateway compresses it for the client).
        let keep_compressed = asked.coding.is_some() && target.compression;
        // An answer whose payload is logged is asked for uncompressed too: the log gets it as the client reads it.
        let coded = BodyCodings {
            body: asked.coding.is_none() || keep_compressed,
            answer: !target.aliased && record.capture.is_none(),
        };
        // An answer passed back as it came (not renamed or logged) to an HTTP/1.x client keeps its headers as lines,
        // which the door writes.
        let as_lines = coded.answer && record.writes_lines;
        let send = headers_to_send(&asked.headers, coded).answer_as_lines(as_lines);
        let Routed {
            route,
            mirror,
            affinity,
        } = routed;
        let mirror = mirror.map(|mirror| Mirror {
            route: mirror,
            header_length: asked.header_length,
            content_type: Some(content_type(&asked.headers).clone()),
            forward: asked.headers.forward(),
            affinity: affinity.clone(),
        });
        let outgoing = self.outgoing((start, scan), keep_compressed, body, record, mirror)?;
        let sent = record
            .dispatcher()
            .passthrough_send((&route, &affinity), &send, &outgoing, deadline, &record.trace)
            .await;
        let (response, lease) = match sent {
            Ok(sent) => sent,
            Err(error) => return Err(self.relay_failure(&outgoing).unwrap_or(error)),
        };
        record.endpoint = Some(lease.state.authority.handle());
        record.lease = Some(lease);
        let authority = record.endpoint.as_ref().map_or("", |endpoint| &**endpoint);
        let (head, mut answer) = response.into_parts();
        if target.aliased && head.status == StatusCode::OK && head.headers.contains_key(http::header::CONTENT_ENCODING)
        {
            // Renamed on its decoded bytes: a backend that compressed though it was not asked to.
            return Box::pin(self.rename_compressed(head, answer, &route, authority)).await;
        }
        let (head, rename) = answer_head(head, &mut answer, (&route, target.aliased), authority)?;
        Ok(PendingAnswer::Proxied(Box::new(head), answer, rename, deadline.until))
    }

    /// A compressed answer of an aliased model, read whole and decompressed within the limit, its names restored.
    async fn rename_compressed(
        &self,
        mut head: http::response::Parts,
        answer: crate::upstream::BackendBody,
        route: &VersionRoute,
        authority: &str,
    ) -> Result<PendingAnswer> {
        let broken = |message: String| Error::new(ErrorKind::BadGateway, Origin::Upstream, message);
        let limit = usize::try_from(self.max_request_bytes).unwrap_or(usize::MAX);
        let (body, _) = crate::body::gather(answer, limit, crate::body::BodyLength::ContentLength(None))
            .await
            .map_err(|_| {
                broken(format!(
                    "backend {authority} answered more than {limit} bytes, or broke off"
                ))
            })?;
        let coding = compression::answer_content_coding(&head.headers, authority)?;
        let body = match coding {
            Some(coding) => compression::decompress(coding, &body, self.max_request_bytes, "backend answer")
                .map_err(|error| broken(error.message().to_owned()))?,
            None => body,
        };
        let mut passed = std::mem::take(&mut head.headers);
        // Its coding and length, of the compressed body, are dropped below; the JSON header's length is checked
        // against the decompressed body.
        crate::upstream::keep_passed_back(&mut passed);
        passed.remove(http::header::CONTENT_ENCODING);
        passed.remove(http::header::CONTENT_LENGTH);
        let header_length = rest::inference_header_length(passed.get(INFERENCE_HEADER_CONTENT_LENGTH))
            .map_err(Error::into_upstream_protocol_error)?
            .map_or(body.len(), |length| usize::try_from(length).unwrap_or(usize::MAX));
        if header_length > body.len() {
            return Err(broken(format!(
                "backend {authority} answered with Inference-Header-Content-Length {header_length}, longer than its \
                 whole decompressed body ({} bytes)",
                body.len()
            )));
        }
        let (name, version) = (&route.model, &route.version);
        let renamed_length = rest::rename::renamed_length(header_length, name, version)
            .ok_or_else(|| broken(format!("backend {authority} sent a JSON header too long to rename")))?;
        let renamed = rest::rename::rename_header(&body[..header_length], name, version, renamed_length)
            .map_err(Error::into_upstream_protocol_error)?;
        if passed.contains_key(INFERENCE_HEADER_CONTENT_LENGTH) {
            passed.insert(INFERENCE_HEADER_CONTENT_LENGTH, HeaderValue::from(renamed_length));
        }
        route.name_served_version(&mut passed);
        Ok(PendingAnswer::Buffered(
            head.status,
            passed,
            vec![Bytes::from(renamed), body.slice(header_length..)],
        ))
    }

    /// Reads the start of the body: all of it when it is small (a body of unknown length is read up to that size,
    /// so a small one is checked to its end before any of it leaves), else enough to hold the start of its JSON
    /// header (the binary extension's whole header, or the first `WHOLE_BODY_LIMIT` bytes of a JSON body), where a
    /// request names its sequence.
    async fn body_start(&self, body: &mut Option<RequestBody>, asked: &InferHead<'_>) -> Result<BodyStart> {
        if let Some(coding) = asked.coding {
            // A compressed body is read whole and decompressed within the same limit: what it expands to is what
            // the limit bounds.
            let compressed = self.read_body(body, asked.declared, Vec::new()).await?;
            let decompressed = compression::decompress(coding, &compressed, self.max_request_bytes, "request body")?;
            return Ok(BodyStart::Decompressed {
                body: decompressed,
                compressed,
            });
        }
        if asked.declared.is_some_and(|length| length <= WHOLE_BODY_LIMIT) {
            return Ok(BodyStart::Whole(
                self.read_body(body, asked.declared, Vec::new()).await?,
            ));
        }
        let wanted = match asked.header_length {
            _ if asked.decthings_in => 0,
            Some(length) => length,
            None => WHOLE_BODY_LIMIT,
        };
        let Some(incoming) = body.as_mut() else {
            return Ok(BodyStart::Whole(Bytes::new()));
        };
        let mut read = KeptChunks::default();
        let mut length = 0;
        // A body of unknown length is read until it ends or passes the limit of a whole one.
        while length < wanted || (asked.declared.is_none() && length <= WHOLE_BODY_LIMIT) {
            match incoming.frame().await {
                Some(Ok(frame)) => {
                    let Ok(chunk) = frame.into_data() else { continue };
                    length += chunk.len() as u64;
                    read.push(chunk);
                    if length > self.max_request_bytes {
                        return Err(self.too_large());
                    }
                }
                Some(Err(error)) => return Err(super::body_error(error)),
                None => {
                    *body = None;
                    let mut read = read.into_chunks();
                    return Ok(BodyStart::Whole(match read.len() {
                        1 => read.pop().unwrap_or_default(),
                        _ => Bytes::from(read.concat()),
                    }));
                }
            }
        }
        Ok(BodyStart::Partial(read.into_chunks()))
    }

    /// The body to send: whole when all of it is at hand, else relayed as it arrives after what was read. The
    /// mirror gets the same chunks.
    fn outgoing(
        &self,
        (start, scan): (BodyStart, Option<KeyScan>),
        keep_compressed: bool,
        body: &mut Option<RequestBody>,
        record: &mut Record,
        mirror: Option<Mirror>,
    ) -> Result<Outgoing> {
        let read = match start {
            BodyStart::Whole(whole) => {
                record.request_bytes = whole.len() as u64;
                if let Some(capture) = &mut record.capture {
                    capture.request(whole.clone());
                }
                if let Some(mirror) = mirror {
                    mirror.send(record.dispatcher(), vec![whole.clone()]);
                }
                return Ok(Outgoing::Whole(whole));
            }
            BodyStart::Decompressed { body, compressed } => {
                record.request_bytes = compressed.len() as u64;
                if let Some(capture) = &mut record.capture {
                    capture.request(body.clone());
                }
                if let Some(mirror) = mirror {
                    mirror.send(record.dispatcher(), vec![body.clone()]);
                }
                return Ok(Outgoing::Whole(if keep_compressed { compressed } else { body }));
            }
            BodyStart::Partial(read) => read,
        };
        let Some(incoming) = body.take() else {
            return Err(Error::internal("the request body was already read"));
        };
        // The mirror and the payload log get the relayed body's chunks once all of them have passed.
        let logged = record
            .capture
            .as_ref()
            .filter(|capture| capture.wants_request())
            .map(|capture| capture.relayed.clone());
        let tap = (mirror.is_some() || logged.is_some()).then(|| {
            let dispatcher = record.dispatcher().clone();
            Tap::new(Box::new(move |chunks: Vec<Bytes>| {
                if let Some(logged) = logged {
                    let _ = logged.set(chunks.clone());
                }
                if let Some(mirror) = mirror {
                    mirror.send(&dispatcher, chunks);
                }
            }))
        });
        let source = Arc::new(RelaySource::new(read, incoming, self.max_request_bytes, tap, scan));
        record.relayed = Some(source.clone());
        Ok(Outgoing::Relayed(source))
    }

    /// The client's side of a relayed body that stopped: too large, or unreadable.
    fn relay_failure(&self, outgoing: &Outgoing) -> Option<Error> {
        let Outgoing::Relayed(source) = outgoing else {
            return None;
        };
        match source.failure()? {
            RelayError::TooLarge => Some(self.too_large()),
            RelayError::Unreadable => Some(Error::invalid("could not read the request body")),
            RelayError::Gone => Some(Error::new(
                ErrorKind::Cancelled,
                Origin::Client,
                "the client went away before sending the whole body",
            )),
            RelayError::Stalled => Some(Error::new(
                ErrorKind::RequestTimeout,
                Origin::Client,
                "the request body stalled (limits.body_read_timeout_ms)",
            )),
            RelayError::Refused => source.refusal(),
            RelayError::Overdue => Some(Error::new(
                ErrorKind::RequestTimeout,
                Origin::Client,
                "the request body did not arrive whole in time (limits.body_total_timeout_ms)",
            )),
        }
    }
}

/// An answer for the client: Decthings tensors with the names in headers when it asked for them, else JSON or the
/// binary extension as its request asked.
fn encode_answer(
    response: &InferResponse,
    mut headers: HeaderMap,
    decthings_out: bool,
    binary_outputs: &BinaryOutputs,
) -> Result<PendingAnswer> {
    if !decthings_out {
        return Ok(PendingAnswer::Encoded(
            rest::encode_response(response, binary_outputs)?,
            headers,
        ));
    }
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(DECTHINGS_CONTENT_TYPE),
    );
    let named = |value: &str| HeaderValue::from_str(value).map_err(|_| Error::internal("an unsendable name"));
    headers.insert("model-name", named(&response.model_name)?);
    if let Some(version) = &response.model_version {
        headers.insert("model-version", named(version)?);
    }
    if let Some(id) = &response.id {
        headers.insert("inference-id", named(id)?);
    }
    Ok(PendingAnswer::Buffered(
        StatusCode::OK,
        headers,
        vec![decthings::encode_entries(&response.outputs)?],
    ))
}

/// The start of a request's body, read before the request is routed.
enum BodyStart {
    /// All of it.
    Whole(Bytes),
    /// All of it, decompressed, with the body as it came.
    Decompressed { body: Bytes, compressed: Bytes },
    /// Its first chunks; the rest is still to come from the client.
    Partial(Vec<Bytes>),
}

/// What a request's reserved parameters ask (its sequence, its timeout), from the start of its JSON header, and the
/// scan that reads the rest of a JSON body as it passes; a Decthings or raw binary body has none. A JSON header at
/// hand whole is read whole: its shared-memory parameters refused wherever they stand. In a JSON body too long to be
/// read whole before it is sent, `parameters` counts only when it is in the first `WHOLE_BODY_LIMIT` bytes, where the
/// clients that send sequences write it (ahead of the inputs): the scan refuses a routing parameter past them.
fn request_reserved(start: &BodyStart, asked: &InferHead<'_>) -> Result<(Reserved, Option<KeyScan>)> {
    if asked.decthings_in || asked.header_length == Some(0) {
        return Ok((Reserved::default(), None));
    }
    let joined;
    let (bytes, whole, read): (&[u8], bool, &[Bytes]) = match start {
        BodyStart::Whole(whole) | BodyStart::Decompressed { body: whole, .. } => (whole, true, &[]),
        BodyStart::Partial(read) if read.len() == 1 => (&read[0], false, read),
        // Joined only when a reserved name is there to read: the chunks and their seams are searched first, so the
        // start of a large body is not copied for nothing.
        BodyStart::Partial(read) if !partial_mentions_reserved(read) => (&[], false, read),
        BodyStart::Partial(read) => {
            joined = read.concat();
            (&joined, false, read)
        }
    };
    let (json, whole) = match asked
        .header_length
        .map(|length| usize::try_from(length).unwrap_or(usize::MAX))
    {
        Some(length) if length <= bytes.len() => (&bytes[..length], true),
        // The binary extension's header is read whole before routing; a start not searched holds none.
        Some(_) => (bytes, false),
        None => (bytes, whole),
    };
    let reserved = match rest::reserved_parameters(json, whole)? {
        Some(parameters) => Reserved::from_parameters(&parameters)?,
        None => Reserved::default(),
    };
    if whole {
        // A shared-memory key is spelled with its name or with escapes; a header with neither holds none.
        if rest::may_name_shared_memory(json) {
            KeyScan::new(None, u64::MAX).feed(json)?;
        }
        return Ok((reserved, None));
    }
    // A JSON body sent on before its end: its start scanned now, the rest as it passes.
    let routed = read.iter().map(|chunk| chunk.len() as u64).sum();
    let mut scan = KeyScan::new(None, routed);
    for chunk in read {
        scan.feed(chunk)?;
    }
    Ok((reserved, Some(scan)))
}

/// Whether chunks read in a row mention a reserved parameter's name, within a chunk or across the seams between
/// them (the last bytes seen, however many chunks they came in, joined to the next chunk's first).
fn partial_mentions_reserved(read: &[Bytes]) -> bool {
    let span = rest::LONGEST_RESERVED_NAME;
    let mut tail: Vec<u8> = Vec::with_capacity(2 * span);
    for chunk in read {
        if rest::mentions_reserved(chunk) {
            return true;
        }
        tail.extend_from_slice(&chunk[..chunk.len().min(span)]);
        if rest::mentions_reserved(&tail) {
            return true;
        }
        if chunk.len() >= span {
            tail.clear();
            tail.extend_from_slice(&chunk[chunk.len() - span..]);
        } else {
            let keep = tail.len().saturating_sub(span);
            tail.drain(..keep);
        }
    }
    false
}

/// A copy of a proxied request for the mirror version, sent once its body is at hand.
struct Mirror {
    route: Arc<VersionRoute>,
    header_length: Option<u64>,
    content_type: Option<HeaderValue>,
    forward: HeaderMap,
    affinity: Affinity,
}

impl Mirror {
    fn send(self, dispatcher: &Dispatcher, body: Vec<Bytes>) {
        let payload = MirrorPayload::Rest {
            body,
            header_length: self.header_length,
            content_type: self.content_type,
        };
        dispatcher.mirror(&self.route, payload, &self.forward, &self.affinity);
    }
}

/// Whether a proxied request's headers say how its body and answer are compressed, as the client sent them.
#[derive(Debug, Clone, Copy)]
struct BodyCodings {
    /// Content-Encoding: the body goes on as it came.
    body: bool,
    /// Accept-Encoding: the answer comes back as the backend makes it.
    answer: bool,
}

/// The headers a proxied request goes with: its end-to-end ones and those about its body as the client sent them
/// (the body is not re-encoded), with a Content-Type said when the client sent none.
fn headers_to_send<'a>(read: &'a RequestHeaders<'_>, coded: BodyCodings) -> headers::PassedOn<'a> {
    read.passed_on().about_body([
        Some(content_type(read)),
        read.content_encoding.filter(|_| coded.body),
        read.accept,
        read.accept_encoding.filter(|_| coded.answer),
        read.inference_header_length,
    ])
}

/// The head a proxied answer goes to the client with: the backend's end-to-end headers and those about the body,
/// the serving version, lengths checked, and renamed for an aliased model. An answer going back as its lines keeps
/// them, checked by what was noted beside them.
fn answer_head(
    mut head: http::response::Parts,
    answer: &mut crate::upstream::BackendBody,
    (route, aliased): (&VersionRoute, bool),
    authority: &str,
) -> Result<(http::response::Parts, Option<Rename>)> {
    head.version = http::Version::HTTP_11;
    if let Some(lines) = answer.passed() {
        // Never asked for an aliased model's answer, which is renamed in its map.
        debug_assert!(!aliased, "an aliased model's answer as lines");
        if !lines.coded {
            check_lengths(lines.header_length, lines.length, authority)?;
        }
        if let Some(version) = route.served_as() {
            lines.lines.set_served_version(version.clone());
        }
        return Ok((head, None));
    }
    let mut passed = std::mem::take(&mut head.headers);
    let said = crate::upstream::keep_passed_back(&mut passed);
    // The JSON header's length is of the decoded body: a compressed answer's length says nothing of it.
    if !said.coded {
        check_lengths(said.header_length, said.length, authority)?;
    }
    route.name_served_version(&mut passed);
    let rename = if aliased {
        let (name, version) = (route.model.clone(), route.version.clone());
        Rename::prepare(head.status, &mut passed, name, version, authority)?
    } else {
        None
    };
    head.headers = passed;
    Ok((head, rename))
}

/// A backend's answer whose JSON header is said to be longer than the whole body is refused: its lengths are not
/// trusted.
fn check_lengths(header: Option<u64>, total: Option<u64>, authority: &str) -> Result<()> {
    match (header, total) {
        (Some(header), Some(total)) if header > total => Err(Error::new(
            ErrorKind::BadGateway,
            Origin::Upstream,
            format!(
                "backend {authority} answered with Inference-Header-Content-Length {header}, longer than its whole \
                 body ({total} bytes)"
            ),
        )),
        _ => Ok(()),
    }
}

/// The Content-Type a proxied request goes to its backend with: the client's, or when it sent none, its body's form
/// as the binary extension's header tells it. tritonclient sends none; KServe's server reads a body without one as
/// binary and refuses it.
fn content_type<'a>(read: &RequestHeaders<'a>) -> &'a HeaderValue {
    static BINARY: HeaderValue = HeaderValue::from_static("application/octet-stream");
    static JSON: HeaderValue = HeaderValue::from_static("application/json");
    match (read.content_type, read.inference_header_length) {
        (Some(sent), _) => sent,
        (None, Some(_)) => &BINARY,
        (None, None) => &JSON,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reserved_name_is_found_across_chunk_seams() {
        let chunks = |parts: &[&'static str]| {
            parts
                .iter()
                .map(|p| Bytes::from_static(p.as_bytes()))
                .collect::<Vec<_>>()
        };
        assert!(!partial_mentions_reserved(&chunks(&[
            r#"{"inputs":[{"name":"x","#,
            r#""data":[1,2,3]}]"#
        ])));
        assert!(partial_mentions_reserved(&chunks(&[
            r#"{"parameters":{"seque"#,
            r#"nce_id":5},"inputs":[]"#
        ])));
        // Split over three chunks, the middle one shorter than the name.
        assert!(partial_mentions_reserved(&chunks(&[
            r#"{"parameters":{"sequ"#,
            "enc",
            r#"e_id":5}}"#
        ])));
        assert!(partial_mentions_reserved(&chunks(&[
            r#"{"inputs":[{"name":"x","parameters":{"shared_"#,
            "memory_region\":\"r\"}}]"
        ])));
    }
}
