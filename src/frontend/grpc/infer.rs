//! The gRPC door's `ModelInfer`, served on raw bytes straight from the HTTP/2 connection (no router or codec layers
//! on the way): routed by the message's leading name and version fields, and answered with the answer's own chunks.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use tonic::Status;

use super::{answer_coding, context_of, message_encoding, size_message};
use crate::body::{BodyLength, ChunksBody, GatherError};
use crate::codec::compression::{self, Coding};
use crate::codec::splice;
use crate::dispatch::{CallRequest, Dispatcher, Taken};
use crate::error::Result;
use crate::frontend::budget::AnswerBudget;
use crate::guard::Principal;
use crate::headers::{GRPC_ENCODING, GRPC_STATUS};
use crate::live::{Active, Serving};
use crate::protocol::Reserved;
use crate::runtime::ThreadArc;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::payload_log::{Capture, Form};
use crate::telemetry::record::{RequestRecord, Target};
use crate::telemetry::traces::Trace;
use crate::telemetry::{ClientProtocol, ReportedPrincipal};

/// The gRPC message-frame header: a compression flag and a big-endian length.
const FRAME_HEADER: usize = 5;

/// Serves one `ModelInfer` call. The call counts as under way until its answer's body is sent or dropped, so a
/// shutdown waits for a large answer still streaming.
pub(super) async fn model_infer<B>(
    serving: Serving,
    request: http::Request<B>,
    limit: usize,
    budget: Option<Arc<AnswerBudget>>,
) -> http::Response<tonic::body::Body>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    let Serving {
        dispatcher,
        metrics,
        active,
    } = serving;
    let coding = answer_coding(request.headers());
    let (parts, body) = request.into_parts();
    let mut headers = parts.headers;
    let trace = dispatcher.traces().map_or_else(Trace::default, |traces| {
        super::call_span(traces, super::MODEL_INFER_PATH, &headers)
    });
    // The caller, and its rate, are settled before its message is read; its model is named inside the message.
    let principal = match super::authenticate(&dispatcher, super::MODEL_INFER_PATH, &mut headers) {
        Ok(principal) => principal,
        Err(status) => return status.into_http(),
    };
    if let Err(error) = dispatcher.guard().admit_principal(principal.as_deref()).await {
        return Status::from(error).into_http();
    }
    let message = match read_message(&headers, body, limit).await {
        Ok((message, trailers)) => {
            // Trailers sent with the request join its metadata, as tonic's unary calls have it: without credentials,
            // as its headers went on.
            if let Some(mut trailers) = trailers {
                dispatcher.guard().strip_credentials(&mut trailers);
                headers.extend(trailers);
            }
            message
        }
        Err(status) => {
            trace.set("rpc.grpc.status_code", status.code() as i64);
            return status.into_http();
        }
    };
    let answered = infer(&dispatcher, metrics, &headers, message, principal, &trace).await;
    if trace.is_on() {
        let code = answered.as_ref().err().map_or(tonic::Code::Ok, Status::code);
        trace.set("rpc.grpc.status_code", code as i64);
    }
    match answered {
        Ok((chunks, metadata)) => framed_answer(chunks, metadata, coding, active, budget.as_ref()),
        Err(status) => status.into_http(),
    }
}

/// Reads a unary call's one message, within `limit` once decompressed: a gzip or deflate message is decompressed,
/// other encodings are refused, and so is a second message.
async fn read_message<B>(headers: &HeaderMap, body: B, limit: usize) -> Result<(Bytes, Option<HeaderMap>), Status>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let encoding = message_encoding(headers)?;
    let (mut framed, trailers) = crate::body::gather(body, limit.saturating_add(FRAME_HEADER), BodyLength::GrpcFrame)
        .await
        .map_err(|error| match error {
            GatherError::TooLarge => Status::resource_exhausted(size_message(limit)),
            GatherError::Broken(error) => Status::cancelled(format!("the request broke off: {}", error.into())),
        })?;
    if framed.is_empty() {
        return Err(Status::internal("Missing request message."));
    }
    if framed.len() < FRAME_HEADER {
        return Err(Status::internal("the request ends inside a message's 5-byte header"));
    }
    let flag = framed[0];
    let length = u32::from_be_bytes([framed[1], framed[2], framed[3], framed[4]]) as usize;
    let carried = framed.len() - FRAME_HEADER;
    if carried < length {
        return Err(Status::internal(format!(
            "the request ends inside its message: {carried} of {length} bytes"
        )));
    }
    if carried > length {
        return Err(Status::internal("a unary call carries one message, this one more"));
    }
    let message = framed.split_off(FRAME_HEADER);
    let coding = match (flag, encoding) {
        (0, _) => return Ok((message, trailers)),
        (1, Some(tonic::codec::CompressionEncoding::Gzip)) => Coding::Gzip,
        (1, Some(tonic::codec::CompressionEncoding::Deflate)) => Coding::Deflate,
        (1, _) => {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ));
        }
        (other, _) => {
            return Err(Status::internal(format!(
                "protocol error: received message with invalid compression flag: {other} (valid flags are 0 and 1)"
            )));
        }
    };
    compression::decompress(coding, &message, limit as u64, "request message")
        .map(|message| (message, trailers))
        .map_err(|error| error.to_grpc_status())
}

/// What an encoded request's reserved parameters ask; a tensor in shared memory is refused.
fn reserved(message: &[u8]) -> Result<Reserved> {
    Reserved::from_parameters(&splice::parameters_refusing_shared_memory(message)?)
}

/// Routes and sends one inference given as its encoded message; gives the answer's message as chunks, with the
/// metadata to answer with (the backend's end-to-end metadata and the request id). Counted and logged here, under
/// the model it named.
async fn infer(
    dispatcher: &Dispatcher,
    metrics: ThreadArc<Metrics>,
    headers: &HeaderMap,
    message: Bytes,
    principal: Option<Arc<Principal>>,
    trace: &Trace,
) -> Result<(Vec<Bytes>, HeaderMap), Status> {
    let mut context = context_of(headers);
    context.trace = trace.clone();
    context.principal = principal.clone();
    let request_id = context.forward.get(super::super::REQUEST_ID).cloned();
    let fields = splice::model_fields(&message);
    let (admitted, route) = match &fields {
        Ok(fields) => {
            let call = CallRequest {
                model: fields.name,
                version: Some(fields.version),
                forward: &context.forward,
                principal: principal.as_deref(),
                taken: Taken::PrincipalRate,
                generates: false,
                trace,
            };
            dispatcher
                .admit(&call, async { reserved(&message).map(|reserved| ((), reserved)) })
                .await
        }
        Err(error) => (Err(error.clone()), dispatcher.unknown_route_metrics()),
    };
    let mut record = RequestRecord::open(metrics, ClientProtocol::Grpc, Target::Method("ModelInfer"));
    record.route = Some(route);
    record.request_bytes = message.len() as u64;
    record.request_id = request_id.clone();
    record.principal = principal.map(|principal| principal as Arc<dyn ReportedPrincipal>);
    record.trace = trace.clone();
    let answer = match (admitted, &fields) {
        (Ok((admitted, ())), Ok(named)) => {
            if let Some(limit) = admitted.reserved.timeout {
                context.deadline = Some(context.deadline.map_or(limit, |deadline| deadline.min(limit)));
            }
            let route = &admitted.routed.route;
            if let Some(logger) = admitted.payload_log {
                let mut capture = Capture::new(logger, route, Form::GrpcRequest);
                capture.request(message.clone());
                record.capture = Some(Box::new(capture));
            }
            record.translated = dispatcher.backend_protocol(route) == Some(crate::config::BackendProtocol::Rest);
            dispatcher
                .infer_grpc_routed(&admitted.routed, &message, named, &context)
                .await
        }
        (Err(error), _) => Err(error),
        // Admitted only once the names were read.
        (Ok(_), Err(error)) => Err(error.clone()),
    };
    match answer {
        Ok(replied) => {
            let length: usize = replied.value.iter().map(Bytes::len).sum();
            record.endpoint = replied.endpoint.clone();
            if let Some(capture) = &mut record.capture {
                capture.response_as(replied.value.clone(), Form::GrpcResponse);
            }
            record.answered(200, length as u64);
            let mut metadata = replied.headers;
            if let Some(id) = request_id {
                metadata.insert(super::super::REQUEST_ID, id);
            }
            Ok((replied.value, metadata))
        }
        Err(error) => {
            record.answered(error.http_status().as_u16(), 0);
            Err(error.to_grpc_status())
        }
    }
}

/// A successful unary answer on the wire: the metadata as headers, one length-prefixed message made of the answer's
/// own chunks (compressed with `coding` when the client asked), and `grpc-status: 0` in the trailers.
fn framed_answer(
    chunks: Vec<Bytes>,
    metadata: HeaderMap,
    coding: Option<Coding>,
    active: Active,
    budget: Option<&Arc<AnswerBudget>>,
) -> http::Response<tonic::body::Body> {
    let chunks = match coding {
        Some(coding) => compression::compress(coding, &chunks),
        None => chunks,
    };
    let frames = match crate::body::grpc_message(chunks, coding.is_some()) {
        Ok(frames) => frames,
        Err(length) => {
            return Status::resource_exhausted(format!(
                "the answer is {length} bytes, more than a gRPC message can hold"
            ))
            .into_http();
        }
    };
    // An answer past the connection's budget of unread answers is let go at once.
    let frames = match budget {
        None => frames,
        Some(budget) => match budget.hold(frames) {
            Ok(held) => held,
            Err(error) => return error.to_grpc_status().into_http(),
        },
    };
    let mut trailers = HeaderMap::with_capacity(1);
    trailers.insert(GRPC_STATUS, HeaderValue::from_static("0"));
    let body = crate::body::Holding::new(ChunksBody::with_trailers(frames, trailers), active);
    let mut response = http::Response::new(tonic::body::Body::new(body));
    *response.headers_mut() = metadata;
    if let Some(coding) = coding {
        response
            .headers_mut()
            .insert(GRPC_ENCODING, HeaderValue::from_static(coding.name()));
    }
    response
        .headers_mut()
        .insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    response
}
