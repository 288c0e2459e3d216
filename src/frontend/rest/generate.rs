//! Triton's generate extension on the REST door: `generate` answers one JSON object, `generate_stream` server-sent
//! events, one per response (`data: <json>` and a blank line; no event names, no end marker: the stream ends when the
//! body does). The request is translated with the model's metadata into one inference on Triton's stream
//! (ModelStreamInfer) to a gRPC backend, and each response back. A response that fails before the first event makes
//! the answer's status; one after it is an event `{"error": "..."}`.

use bytes::Bytes;
use http::StatusCode;
use prost::Message;
use tokio::sync::mpsc;

use super::{Reply, RestDoor};
use crate::codec::compression;
use crate::codec::protobuf;
use crate::codec::rest::generate::{decode_generate, encode_generate};
use crate::codec::rest::{self as rest_codec};
use crate::config::BackendProtocol;
use crate::dispatch::{CallContext, StreamAnswer};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::proto::ModelStreamInferResponse;
use crate::protocol::{InferResponse, Sequence};

use super::answer::Record;

/// Events a stream holds for a client that is slow to read them; past this the backend's stream waits.
const EVENTS: usize = 16;

/// Triton's words for a `generate` whose model answered more than once.
const NOT_ONE_RESPONSE: &str = "generate expects model to produce exactly 1 response, use generate stream for model that generates various \
     number of responses";

/// What one answer on the inference stream is for a generate client.
enum Generated {
    /// A response's JSON, or `None` for one without outputs (a decoupled model's empty final response).
    Response(Option<Vec<u8>>),
    /// A request's error.
    Failed(String),
}

impl RestDoor {
    pub(super) async fn generate(
        &self,
        parts: &http::request::Parts,
        body: &mut Option<hyper::body::Incoming>,
        record: &mut Record,
        model: &str,
        version: Option<&str>,
        stream: bool,
    ) -> Result<Reply> {
        let declared = self.declared_length(&parts.headers)?;
        let mut raw = self.read_body(body, declared, Vec::new()).await?;
        if let Some(coding) = compression::request_coding(&parts.headers)? {
            raw = compression::decompress(coding, &raw, self.max_request_bytes, "request body")?;
        }
        record.request_bytes = raw.len() as u64;
        let dispatcher = record.dispatcher().clone();
        let forward = crate::headers::for_backend(&parts.headers);
        // The version is chosen here (canary weights), so the inputs are read with that version's metadata.
        let (routed, _) = dispatcher.route(model, version, &forward, None::<Sequence>);
        let route = routed?.route;
        if dispatcher.backend_protocol(&route) != Some(BackendProtocol::Grpc) {
            return Err(Error::new(
                ErrorKind::Unimplemented,
                Origin::Gateway,
                format!(
                    "model '{model}' version '{}' is served by a REST backend, and the gateway carries generate to \
                     gRPC backends only (through ModelStreamInfer)",
                    route.version
                ),
            ));
        }
        let metadata = dispatcher.model_metadata(model, Some(&route.version)).await?;
        let mut request = decode_generate(&raw, &metadata)?;
        request.model_name = model.to_owned();
        request.model_version = Some(route.version.clone());
        let message = Bytes::from(protobuf::encode_request(request).chunks.concat());
        let context = CallContext {
            deadline: None,
            forward,
            compressed: None,
        };
        let (answers, mut received) = mpsc::channel(EVENTS);
        let gateway = self.gateway.clone();
        tokio::spawn(async move {
            let requests = futures_util::stream::iter([Ok(message)]);
            dispatcher
                .infer_stream(requests, context, answers, gateway.streams_ending())
                .await
        });
        if !stream {
            return one_response(&mut received).await;
        }
        // The first event decides the status: an error before it is the answer.
        let first = loop {
            match received.recv().await {
                None => break None,
                Some(answer) => match generated(answer)? {
                    Generated::Failed(message) => return Err(Error::invalid(message)),
                    Generated::Response(None) => continue,
                    Generated::Response(Some(json)) => break Some(json),
                },
            }
        };
        let (events, sent) = mpsc::channel(EVENTS);
        tokio::spawn(async move {
            if let Some(json) = first
                && events.send(event(&json)).await.is_err()
            {
                return;
            }
            while let Some(answer) = received.recv().await {
                let json = match generated(answer) {
                    Ok(Generated::Response(Some(json))) => json,
                    Ok(Generated::Response(None)) => continue,
                    Ok(Generated::Failed(message)) => rest_codec::encode_error(&message),
                    Err(error) => rest_codec::encode_error(error.message()),
                };
                if events.send(event(&json)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Reply::Events(sent))
    }
}

/// `generate`: the stream's one response, as JSON.
async fn one_response(received: &mut mpsc::Receiver<StreamAnswer>) -> Result<Reply> {
    let mut only = None;
    while let Some(answer) = received.recv().await {
        match generated(answer)? {
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
    Ok(Reply::Json(StatusCode::OK, json))
}

/// One answer of the inference stream, read for a generate client; an error that ended the stream is returned.
fn generated(answer: StreamAnswer) -> Result<Generated> {
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
