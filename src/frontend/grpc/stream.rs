//! The gRPC door's inference streams (ModelStreamInfer): the client's messages read as they come and handed to the
//! dispatcher's stream engine on a task of its own, its answers framed onto the response as they come.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use tonic::Status;

use super::{answer_coding, context_of, message_encoding};
use crate::codec::compression::{self, Coding};
use crate::codec::protobuf::RawDecoder;
use crate::dispatch::{MODEL_STREAM_INFER, StreamAnswer};
use crate::error::Error;
use crate::headers::{GRPC_ENCODING, GRPC_MESSAGE, GRPC_STATUS};
use crate::live::Gateway;

/// ModelStreamInfer: the client's messages are read as they come (framing, size limit and decompression by tonic's
/// decoder) and carried by the dispatcher on its own task; its answers are framed onto the response as they come,
/// compressed like the client's own messages when it accepts that. A client that goes away drops the response, which
/// stops the dispatcher's task and with it the backends' streams.
pub(super) fn infer_stream<B>(
    gateway: Arc<Gateway>,
    request: http::Request<B>,
    limit: usize,
    principal: Option<Arc<crate::guard::Principal>>,
) -> http::Response<tonic::body::Body>
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    let encoding = match message_encoding(request.headers()) {
        Ok(encoding) => encoding,
        Err(status) => return status.into_http(),
    };
    let mut context = context_of(request.headers());
    context.principal = principal;
    let dispatcher = gateway.dispatcher();
    if let Some(traces) = dispatcher.traces() {
        context.trace = super::call_span(traces, MODEL_STREAM_INFER, request.headers());
    }
    let trace = context.trace.clone();
    let coding = answer_coding(request.headers());
    let (_, body) = request.into_parts();
    let requests = futures_util::StreamExt::map(
        tonic::codec::Streaming::new_request(RawDecoder, body, encoding, Some(limit)),
        |message| {
            message.map_err(|status| {
                Error::new(
                    crate::error::ErrorKind::from_grpc_code(status.code()),
                    crate::error::Origin::Client,
                    status.message(),
                )
            })
        },
    );
    let (answers, receiver) = tokio::sync::mpsc::channel(STREAM_ANSWERS);
    let request_id = context
        .forward
        .get(crate::frontend::REQUEST_ID)
        .and_then(|id| id.to_str().ok())
        .map(str::to_owned);
    let metrics = dispatcher.metrics().clone();
    let started = Instant::now();
    tokio::spawn(async move {
        metrics.streams_open().inc();
        let summary = dispatcher
            .infer_stream(requests, context, answers, gateway.streams_ending())
            .await;
        metrics.streams_open().dec();
        summary.log(request_id.as_deref(), started.elapsed());
        if trace.is_on() {
            trace.set("oip.requests", i64::try_from(summary.requests).unwrap_or(i64::MAX));
            trace.set("oip.responses", i64::try_from(summary.responses).unwrap_or(i64::MAX));
            let code = summary.error.as_ref().map_or(tonic::Code::Ok, Error::grpc_code);
            trace.set("rpc.grpc.status_code", code as i64);
            if let Some(error) = &summary.error {
                trace.failed(error);
            }
        }
    });
    let mut response = http::Response::new(tonic::body::Body::new(StreamBody {
        answers: receiver,
        frames: std::collections::VecDeque::new(),
        coding,
        ended: false,
    }));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    if let Some(coding) = coding {
        response
            .headers_mut()
            .insert(GRPC_ENCODING, http::HeaderValue::from_static(coding.name()));
    }
    response
}

/// Answers a stream holds for a client that is slow to read them; past this its backends wait.
const STREAM_ANSWERS: usize = 16;

/// A stream's answers on the wire: each message framed as it comes, then the status in the trailers (OK when the
/// dispatcher finished, the error that ended the stream otherwise).
struct StreamBody {
    answers: tokio::sync::mpsc::Receiver<StreamAnswer>,
    frames: std::collections::VecDeque<Bytes>,
    coding: Option<Coding>,
    ended: bool,
}

impl http_body::Body for StreamBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        loop {
            if let Some(frame) = self.frames.pop_front() {
                return Poll::Ready(Some(Ok(http_body::Frame::data(frame))));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            let status = match std::task::ready!(self.answers.poll_recv(cx)) {
                Some(Ok(chunks)) => {
                    let chunks = match self.coding {
                        Some(coding) => compression::compress(coding, &chunks),
                        None => chunks,
                    };
                    match crate::body::grpc_message(chunks, self.coding.is_some()) {
                        Ok(frames) => {
                            self.frames.extend(frames);
                            continue;
                        }
                        Err(length) => Status::resource_exhausted(format!(
                            "an answer of {length} bytes is more than a gRPC message can hold"
                        )),
                    }
                }
                Some(Err(error)) => error.to_grpc_status(),
                None => Status::ok(""),
            };
            self.ended = true;
            let mut trailers = http::HeaderMap::new();
            trailers.insert(GRPC_STATUS, http::HeaderValue::from(status.code() as i32));
            if !status.message().is_empty() {
                let message = percent_encode(status.message());
                if let Ok(value) = http::HeaderValue::from_str(&message) {
                    trailers.insert(GRPC_MESSAGE, value);
                }
            }
            return Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))));
        }
    }
}

/// `grpc-message` is percent-encoded: every byte outside printable ASCII, and `%` itself.
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..0x7f).contains(&byte) && byte != b'%' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}
