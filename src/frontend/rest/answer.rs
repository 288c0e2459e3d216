//! What the REST door answers with: the answer's body (the gateway's own buffers, or a backend's answer streamed
//! through, its model name restored for aliased models), the request's record that reports it to the metrics and
//! the access log once the body is sent, and the answers the door builds itself.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};

use crate::body::held::{Held, HeldPool};
use crate::body::{ChunksBody, RelaySource};
use crate::codec::compression::{self, Coding, Compressor, MIN_COMPRESSED_BYTES};
use crate::codec::rest::{self, EncodedBody};
use crate::dispatch::Dispatcher;
use crate::dispatch::fleet::Lease;
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::frontend::REQUEST_ID;
use crate::guard::{Admission, Principal};
use crate::headers::INFERENCE_HEADER_CONTENT_LENGTH;
use crate::live::{Active, Gateway, Serving};
use crate::runtime::ThreadArc;
use crate::telemetry::ClientProtocol;
use crate::telemetry::metrics::InFlight;
use crate::telemetry::payload_log::{Form, form_of};
use crate::telemetry::record::{RequestRecord, Target};

/// One request on its way through the door; reported to the metrics and the access log when dropped, which is when
/// its answer's body has been sent (or the client left: then its status is 499).
#[derive(Debug)]
pub(super) struct Record {
    /// What is reported of the request (declared first: it reports before the request stops counting as under way).
    pub(super) report: RequestRecord,
    dispatcher: ThreadArc<Dispatcher>,
    /// Counts the request as under way, for shutdown's drain.
    _active: Active,
    /// A proxied call, counted in flight, and the place it holds at its endpoint, until the answer is sent.
    pub(super) in_flight: Option<InFlight>,
    pub(super) lease: Option<Lease>,
    /// A relayed body, which counts its own bytes.
    pub(super) relayed: Option<Arc<RelaySource>>,
    /// The coding the client accepts its answer in, if any.
    pub(super) answer_coding: Option<Coding>,
    /// The door writes a passed-back answer's header lines itself (HTTP/1.x); over HTTP/2, hyper writes an answer
    /// from its map alone.
    pub(super) writes_lines: bool,
    /// Who is calling, when `[auth]` asks.
    pub(super) principal: Option<Arc<Principal>>,
    /// The call's place among its model's calls under way, held until the answer is sent.
    pub(super) admission: Option<Admission>,
}

impl std::ops::Deref for Record {
    type Target = RequestRecord;

    fn deref(&self) -> &RequestRecord {
        &self.report
    }
}

impl std::ops::DerefMut for Record {
    fn deref_mut(&mut self) -> &mut RequestRecord {
        &mut self.report
    }
}

impl Record {
    /// Boxed: a record travels with its answer, which is moved from the door to the connection's writer, and a box
    /// of a size every request asks for is one the thread has just freed, still in cache.
    /// `arrived`: when the request's head had come whole.
    pub(super) fn new(serving: Serving, uri: Option<http::Uri>, arrived: Instant) -> Box<Record> {
        let target = uri.map_or(Target::Unknown, Target::Uri);
        Box::new(Record {
            report: RequestRecord::begun(serving.metrics, ClientProtocol::Rest, target, arrived),
            dispatcher: serving.dispatcher,
            _active: serving.active,
            in_flight: None,
            lease: None,
            relayed: None,
            answer_coding: None,
            writes_lines: false,
            principal: None,
            admission: None,
        })
    }

    /// A head the connection refused before it made a request (431, 414, 400, 408), answered with `body_bytes` of
    /// error: reported, when dropped, as a request of unknown target, so that hostile or broken clients show in the
    /// metrics and the access log as every other refusal does.
    pub(super) fn refused(gateway: &Arc<Gateway>, status: StatusCode, body_bytes: usize) -> Box<Record> {
        let mut record = Record::new(gateway.serving(), None, Instant::now());
        record.status = Some(status.as_u16());
        record.response_bytes = body_bytes as u64;
        record
    }

    /// The request's dispatcher; a clone of it is the thread's handle, whose count no other door thread writes.
    pub(super) fn dispatcher(&self) -> &ThreadArc<Dispatcher> {
        &self.dispatcher
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        // The places the call held are given back before it is reported. One reading of the clock ends the
        // backend call and the request.
        let now = Instant::now();
        if let Some(in_flight) = self.in_flight.take() {
            in_flight.end_at(now);
        }
        self.report.end_at(now);
        self.lease = None;
        self.admission = None;
        if let Some(relayed) = &self.relayed {
            self.report.request_bytes = relayed.received();
        }
    }
}

/// An answer's body; it carries the request's record, so the request is reported once the body is sent.
#[derive(Debug)]
pub struct AnswerBody {
    source: Source,
    record: Option<Box<Record>>,
}

#[derive(Debug)]
enum Source {
    Chunks(ChunksBody),
    Proxied(Box<Proxied>),
    /// Server-sent events as they come; the stream ends when the sender is dropped.
    Events(EventStream),
}

/// The most of a stream's events gathered for the payload log: past it the answer is not logged (counted
/// `too_large`), so a long stream holds no more than this for the log.
const MOST_LOGGED_EVENT_BYTES: usize = 4 << 20;
/// What every stream holds for the payload log together: past 64 MiB, a stream's answer is not logged either, so
/// many sampled streams at once cannot grow the gateway by more than this.
static LOGGED_EVENTS: HeldPool = HeldPool::new(64 << 20);

/// What a stream of server-sent events says it is.
const EVENT_STREAM: HeaderValue = HeaderValue::from_static("text/event-stream; charset=utf-8");

/// Server-sent events on their way to the client.
#[derive(Debug)]
struct EventStream {
    events: tokio::sync::mpsc::Receiver<Bytes>,
    /// The events sent so far and their bytes, when the answer's payload is logged (let go past
    /// [`MOST_LOGGED_EVENT_BYTES`], or past [`LOGGED_EVENTS`]'s bound).
    tee: Option<(Vec<Bytes>, Held)>,
    /// The stream ended (rather than the client leaving it): every event was sent.
    ended: bool,
}

impl EventStream {
    /// Keeps `event` for the log, while the stream's events are within the bound; whether they just outgrew it.
    fn gather(&mut self, event: &Bytes) -> bool {
        let Some((events, held)) = &mut self.tee else {
            return false;
        };
        let bytes = held.bytes() + event.len();
        if bytes > MOST_LOGGED_EVENT_BYTES || !held.resize(bytes) {
            self.tee = None;
            return true;
        }
        events.push(event.clone());
        false
    }
}

/// A backend's answer on its way to the client.
#[derive(Debug)]
struct Proxied {
    body: crate::upstream::BackendBody,
    rename: Option<Rename>,
    /// The end of the backend's time to answer.
    deadline: Instant,
    /// The timer for `deadline`, made the first time the body is not at hand: most answers come whole with their
    /// head, and a timer is a registration with the runtime's clock.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The renamed header is out and the body ended: nothing more to send.
    finished: bool,
    /// Compresses the answer for the client, when the backend did not.
    compressor: Option<Compressor>,
    /// The answer's chunks as they passed (before compression), when its payload is logged, and their form.
    tee: Option<(Vec<Bytes>, Form)>,
}

impl AnswerBody {
    /// A backend answer's headers as lines in its head, to be written after the head's map, when it is passed back
    /// with them.
    pub(super) fn take_passed(&mut self) -> Option<Box<crate::upstream::PassedAnswer>> {
        match &mut self.source {
            Source::Proxied(proxied) => proxied.body.take_passed(),
            Source::Chunks(_) | Source::Events(_) => None,
        }
    }

    /// Reports the request: a proxied answer that was read to its end goes to the payload log first.
    fn report(&mut self) {
        if let (Source::Proxied(proxied), Some(record)) = (&mut self.source, &mut self.record)
            // Read to its end: hyper stops asking for more of an answer whose length it knows once it has it all.
            && (proxied.finished || (proxied.rename.is_none() && proxied.body.is_end_stream()))
            && let (Some((chunks, form)), Some(capture)) = (proxied.tee.take(), &mut record.capture)
        {
            capture.response_as(chunks, form);
        }
        if let (Source::Events(stream), Some(record)) = (&mut self.source, &mut self.record)
            && stream.ended
            && let (Some((events, _)), Some(capture)) = (stream.tee.take(), &mut record.capture)
        {
            capture.response_as(events, Form::Other(Some(EVENT_STREAM)));
        }
        self.record = None;
    }
}

impl Drop for AnswerBody {
    fn drop(&mut self) {
        // hyper lets go of a body without polling it again once it says it has ended.
        self.report();
    }
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>>>> {
        let this = &mut *self;
        let frame = match &mut this.source {
            Source::Chunks(chunks) => {
                ready!(Pin::new(chunks).poll_frame(cx)).map(|frame| frame.map_err(|never| match never {}))
            }
            Source::Proxied(proxied) => {
                let authority = this.record.as_ref().and_then(|record| record.endpoint.as_deref());
                ready!(proxied.poll_chunk(cx, authority.map_or("", |authority| authority)))
                    .map(|chunk| chunk.map(Frame::data))
            }
            Source::Events(stream) => match ready!(stream.events.poll_recv(cx)) {
                Some(event) => {
                    if stream.gather(&event)
                        && let Some(capture) = this.record.as_ref().and_then(|record| record.capture.as_ref())
                    {
                        capture.response_too_large();
                    }
                    Some(Ok(Frame::data(event)))
                }
                None => {
                    stream.ended = true;
                    None
                }
            },
        };
        match &frame {
            Some(Ok(frame)) => {
                if let (Some(data), Some(record)) = (frame.data_ref(), &mut this.record) {
                    record.response_bytes += data.len() as u64;
                }
            }
            Some(Err(error)) => tracing::warn!(error = %error.message(), "proxied answer broken off"),
            None => {
                // Sent: the request is reported now rather than when hyper lets go of the body.
                this.report();
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        match &self.source {
            Source::Chunks(chunks) => chunks.is_end_stream(),
            Source::Proxied(proxied) => proxied.finished && proxied.compressor.is_none(),
            Source::Events(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.source {
            Source::Chunks(chunks) => chunks.size_hint(),
            // An aliased answer's length is in its head, renamed.
            Source::Proxied(proxied) if proxied.rename.is_none() && proxied.compressor.is_none() => {
                proxied.body.size_hint()
            }
            Source::Proxied(_) | Source::Events(_) => SizeHint::default(),
        }
    }
}

impl Proxied {
    /// The next chunk for the client: the backend's, renamed, and compressed when the client asked for it.
    /// `authority`: the endpoint answering, as errors name it.
    fn poll_chunk(&mut self, cx: &mut Context<'_>, authority: &str) -> Poll<Option<Result<Bytes>>> {
        let Some(mut compressor) = self.compressor.take() else {
            return self.poll_plain(cx, authority);
        };
        loop {
            match self.poll_plain(cx, authority) {
                Poll::Pending => {
                    self.compressor = Some(compressor);
                    return Poll::Pending;
                }
                Poll::Ready(Some(Ok(chunk))) => {
                    let out = compressor.push(&chunk);
                    if !out.is_empty() {
                        self.compressor = Some(compressor);
                        return Poll::Ready(Some(Ok(out)));
                    }
                }
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error))),
                Poll::Ready(None) => return Poll::Ready(Some(Ok(compressor.finish()))),
            }
        }
    }

    fn poll_plain(&mut self, cx: &mut Context<'_>, authority: &str) -> Poll<Option<Result<Bytes>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        loop {
            let frame = match Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Ready(frame) => frame,
                Poll::Pending => {
                    let deadline = self.deadline;
                    let timer = self
                        .timer
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline.into())));
                    if timer.as_mut().poll(cx).is_ready() {
                        self.finished = true;
                        self.tee = None;
                        return Poll::Ready(Some(Err(broken_answer(format!(
                            "backend {authority} did not finish its answer in time"
                        )))));
                    }
                    return Poll::Pending;
                }
            };
            match frame {
                None => {
                    self.finished = true;
                    let last = match &mut self.rename {
                        Some(rename) => rename.take(None, true).transpose(),
                        None => None,
                    };
                    if let (Some((tee, _)), Some(Ok(chunk))) = (&mut self.tee, &last) {
                        tee.push(chunk.clone());
                    }
                    return Poll::Ready(last);
                }
                Some(Err(error)) => {
                    self.finished = true;
                    self.tee = None;
                    return Poll::Ready(Some(Err(broken_answer(format!(
                        "backend {authority} broke off its answer: {error}"
                    )))));
                }
                Some(Ok(frame)) => {
                    let Ok(chunk) = frame.into_data() else { continue };
                    let chunk = match &mut self.rename {
                        Some(rename) => match rename.take(Some(chunk), false) {
                            Ok(Some(chunk)) => chunk,
                            Ok(None) => continue,
                            Err(error) => {
                                self.finished = true;
                                self.tee = None;
                                return Poll::Ready(Some(Err(error)));
                            }
                        },
                        None => chunk,
                    };
                    if let Some((tee, _)) = &mut self.tee {
                        tee.push(chunk.clone());
                    }
                    return Poll::Ready(Some(Ok(chunk)));
                }
            }
        }
    }
}

/// A proxied answer that failed after its head was sent.
fn broken_answer(message: String) -> Error {
    Error::new(ErrorKind::BadGateway, Origin::Upstream, message)
}

/// A stream of server-sent events (`text/event-stream`), each sent as it comes and never compressed, so none waits
/// for the next.
pub(super) fn events(events: tokio::sync::mpsc::Receiver<Bytes>, mut record: Box<Record>) -> Response<AnswerBody> {
    let mut headers = HeaderMap::new();
    if let Some(id) = &record.request_id {
        headers.insert(REQUEST_ID, id.clone());
    }
    headers.insert(http::header::CONTENT_TYPE, EVENT_STREAM);
    headers.insert(http::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    record.status = Some(StatusCode::OK.as_u16());
    let tee = record
        .capture
        .as_ref()
        .filter(|capture| capture.wants_response())
        .map(|_| (Vec::new(), Held::new(&LOGGED_EVENTS)));
    let mut response = Response::new(AnswerBody {
        source: Source::Events(EventStream {
            events,
            tee,
            ended: false,
        }),
        record: Some(record),
    });
    *response.headers_mut() = headers;
    response
}

/// An answer whose whole body is at hand: `chunks`, with the record's request id and a Content-Length.
pub(super) fn buffered(
    status: StatusCode,
    mut headers: HeaderMap,
    chunks: Vec<Bytes>,
    mut record: Box<Record>,
) -> Response<AnswerBody> {
    if let Some(id) = &record.request_id {
        headers.insert(REQUEST_ID, id.clone());
    }
    record.status = Some(status.as_u16());
    if let Some(capture) = &mut record.capture {
        capture.response(chunks.clone(), &headers);
    }
    let length: usize = chunks.iter().map(Bytes::len).sum();
    let chunks = match record.answer_coding {
        Some(coding) if length >= MIN_COMPRESSED_BYTES && !headers.contains_key(http::header::CONTENT_ENCODING) => {
            let mut compressor = Compressor::new(coding);
            let mut compressed: Vec<Bytes> = chunks.iter().map(|chunk| compressor.push(chunk)).collect();
            compressed.push(compressor.finish());
            compressed.retain(|chunk| !chunk.is_empty());
            mark_compressed(&mut headers, coding);
            compressed
        }
        _ => chunks,
    };
    let mut response = Response::new(AnswerBody {
        source: Source::Chunks(ChunksBody::new(chunks)),
        record: Some(record),
    });
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// A backend's answer streamed through: `head` is the answer's head as it goes to the client (renamed when
/// `rename` is set), the body follows until `deadline`.
pub(super) fn proxied(
    mut head: http::response::Parts,
    mut body: crate::upstream::BackendBody,
    rename: Option<Rename>,
    deadline: Instant,
    mut record: Box<Record>,
) -> Response<AnswerBody> {
    if let Some(id) = &record.request_id {
        match body.passed() {
            Some(passed) => passed.lines.set_request_id(id.clone()),
            None => {
                head.headers.insert(REQUEST_ID, id.clone());
            }
        }
    }
    record.status = Some(head.status.as_u16());
    // A backend that compressed its answer (it got the client's Accept-Encoding) is passed on as it is; one that
    // did not is compressed here, unless it is too short to gain. An answer going back as its lines says its length
    // and coding beside them (its length is not among them).
    let (length, coded) = match body.passed() {
        Some(passed) => (passed.length, passed.coded),
        None => (
            head.headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| rest::length_value(v.as_bytes())),
            head.headers.contains_key(http::header::CONTENT_ENCODING),
        ),
    };
    let short = length.is_some_and(|length| length < MIN_COMPRESSED_BYTES as u64);
    let compressor = match record.answer_coding {
        Some(coding) if !short && !coded => {
            head.headers.remove(http::header::CONTENT_LENGTH);
            mark_compressed(&mut head.headers, coding);
            Some(Compressor::new(coding))
        }
        _ => None,
    };
    let tee = record
        .capture
        .as_ref()
        .filter(|capture| capture.wants_response())
        .map(|_| (Vec::new(), form_of(&head.headers)));
    Response::from_parts(
        head,
        AnswerBody {
            source: Source::Proxied(Box::new(Proxied {
                body,
                rename,
                deadline,
                timer: None,
                finished: false,
                compressor,
                tee,
            })),
            record: Some(record),
        },
    )
}

/// Says an answer's coding, and that it depends on the client's Accept-Encoding (for caches).
fn mark_compressed(headers: &mut HeaderMap, coding: Coding) {
    headers.insert(http::header::CONTENT_ENCODING, HeaderValue::from_static(coding.name()));
    headers.append(http::header::VARY, HeaderValue::from_static("accept-encoding"));
}

pub(super) fn json(status: StatusCode, body: Vec<u8>, record: Box<Record>) -> Response<AnswerBody> {
    let mut headers = HeaderMap::with_capacity(2);
    headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    buffered(status, headers, vec![Bytes::from(body)], record)
}

/// An encoded inference answer, with the backend's end-to-end headers.
pub(super) fn encoded(body: EncodedBody, mut headers: HeaderMap, record: Box<Record>) -> Response<AnswerBody> {
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(body.content_type()),
    );
    if let Some(length) = body.header_length {
        headers.insert(INFERENCE_HEADER_CONTENT_LENGTH, HeaderValue::from(length));
    }
    buffered(StatusCode::OK, headers, body.chunks, record)
}

/// The protocol's error answer: the error's status and `{"error": "<message>"}`.
pub(super) fn error(error: &Error, method: &Method, record: Box<Record>) -> Response<AnswerBody> {
    let mut headers = HeaderMap::with_capacity(3);
    headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if error.kind() == ErrorKind::UnsupportedEncoding {
        headers.insert(
            http::header::ACCEPT_ENCODING,
            HeaderValue::from_static(compression::ACCEPTED),
        );
    }
    if error.kind() == ErrorKind::MethodNotAllowed {
        let allow = if method == Method::GET { "POST" } else { "GET" };
        headers.insert(http::header::ALLOW, HeaderValue::from_static(allow));
    }
    if error.kind() == ErrorKind::Unauthenticated {
        headers.insert(http::header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if let Some(seconds) = error.retry_after_seconds() {
        headers.insert(http::header::RETRY_AFTER, seconds.into());
    }
    buffered(
        error.http_status(),
        headers,
        vec![Bytes::from(rest::encode_error(error.message()))],
        record,
    )
}

pub(super) fn health_status(healthy: bool) -> StatusCode {
    if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// An aliased answer on its way through: its JSON header is held back until complete, then renamed.
#[derive(Debug)]
pub(super) struct Rename {
    name: String,
    version: String,
    /// The backend's JSON header length; `None` for a JSON-only answer of unknown length.
    header_length: Option<usize>,
    /// The length announced downstream.
    renamed_length: Option<usize>,
    held: BytesMut,
    done: bool,
}

impl Rename {
    /// Readies a proxied answer to have its model name and version restored: its lengths are fixed up in
    /// `headers`. Only successful, uncompressed answers carry names to restore; for others, `None`. The backend's
    /// lengths are checked, not trusted: a JSON header said to be longer than the body is refused.
    pub(super) fn prepare(
        status: StatusCode,
        headers: &mut HeaderMap,
        name: String,
        version: String,
        authority: &str,
    ) -> Result<Option<Rename>> {
        if status != StatusCode::OK || headers.contains_key(http::header::CONTENT_ENCODING) {
            return Ok(None);
        }
        let number = |name: http::HeaderName| {
            headers
                .get(name)
                .and_then(|v| rest::length_value(v.as_bytes()))
                .and_then(|length| usize::try_from(length).ok())
        };
        let content_length = number(http::header::CONTENT_LENGTH);
        let header_length = number(INFERENCE_HEADER_CONTENT_LENGTH).or(content_length);
        let untrusted = || {
            broken_answer(format!(
                "backend {authority} sent an answer whose lengths do not add up (Inference-Header-Content-Length \
                 {header_length:?}, Content-Length {content_length:?})"
            ))
        };
        if let (Some(header), Some(total)) = (header_length, content_length)
            && header > total
        {
            return Err(untrusted());
        }
        let renamed_length = match header_length {
            Some(length) => Some(rest::rename::renamed_length(length, &name, &version).ok_or_else(untrusted)?),
            None => None,
        };
        match (header_length, renamed_length) {
            (Some(old), Some(new)) => {
                if headers.contains_key(INFERENCE_HEADER_CONTENT_LENGTH) {
                    headers.insert(INFERENCE_HEADER_CONTENT_LENGTH, HeaderValue::from(new));
                }
                if let Some(total) = content_length {
                    let total = (total - old).checked_add(new).ok_or_else(untrusted)?;
                    headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(total));
                }
            }
            _ => {
                headers.remove(http::header::CONTENT_LENGTH);
            }
        }
        Ok(Some(Rename {
            name,
            version,
            header_length,
            renamed_length,
            held: BytesMut::new(),
            done: false,
        }))
    }

    /// Takes a body chunk; gives what can go downstream now.
    fn take(&mut self, chunk: Option<Bytes>, end_of_stream: bool) -> Result<Option<Bytes>> {
        if self.done {
            return Ok(chunk);
        }
        if let Some(chunk) = chunk {
            self.held.extend_from_slice(&chunk);
        }
        let complete = match self.header_length {
            Some(length) => self.held.len() >= length,
            None => end_of_stream,
        };
        if !complete {
            if end_of_stream {
                return Err(broken_answer(
                    "backend's answer ended inside its JSON header".to_owned(),
                ));
            }
            return Ok(None);
        }
        let length = self.header_length.unwrap_or(self.held.len());
        let target = match self.renamed_length {
            Some(target) => target,
            None => rest::rename::renamed_length(length, &self.name, &self.version)
                .ok_or_else(|| broken_answer("backend's answer is too long to rename".to_owned()))?,
        };
        // The JSON header is joined from the chunks it arrived in; so is whatever followed it in its last chunk
        // (one read's worth at most). Every later chunk, tensor bytes included, passes through uncopied.
        let held = self.held.split().freeze();
        let mut out = rest::rename::rename_header(&held[..length], &self.name, &self.version, target)
            .map_err(Error::into_upstream_protocol_error)?;
        out.extend_from_slice(&held[length..]);
        self.done = true;
        Ok(Some(Bytes::from(out)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_gathers_its_events_for_the_log_up_to_the_bound_then_lets_them_go() {
        let (_sender, events) = tokio::sync::mpsc::channel(1);
        let mut stream = EventStream {
            events,
            tee: Some((Vec::new(), Held::new(&LOGGED_EVENTS))),
            ended: false,
        };
        let event = Bytes::from(vec![b'x'; MOST_LOGGED_EVENT_BYTES / 4]);
        for _ in 0..4 {
            assert!(!stream.gather(&event), "within the bound");
        }
        assert_eq!(
            stream.tee.as_ref().map(|(events, held)| (events.len(), held.bytes())),
            Some((4, MOST_LOGGED_EVENT_BYTES))
        );
        assert!(stream.gather(&Bytes::from_static(b"y")), "one byte past it");
        assert!(stream.tee.is_none(), "nothing held past the bound");
        assert!(!stream.gather(&event), "said once");
    }
}
