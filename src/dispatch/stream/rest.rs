//! Streams to REST backends: a REST client's generate_stream or infer_stream relayed as it came, and a decoupled
//! model's request of a gRPC stream sent to its REST backend's event stream, its events translated back.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use bytes::Bytes;

use super::leg::LegRecord;
use super::{Answers, ERROR_BODY_BYTES};
use crate::codec::rest::generate as rest_generate;
use crate::codec::{protobuf, splice};
use crate::config::StreamDialect;
use crate::dispatch::backend::{Attempt, Replicas, Tries};
use crate::dispatch::fleet::Lease;
use crate::dispatch::{CallContext, Dispatcher};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::protocol::reserved::{EMPTY_FINAL_RESPONSE, FINAL_RESPONSE};
use crate::protocol::{ParamValue, StreamCall};
use crate::telemetry::metrics::{InFlight, StreamResult};
use crate::telemetry::traces::Trace;

/// The place a stream holds at the endpoint serving it, and its count in flight, until it is dropped when the
/// stream ends: a stream is a call under way for as long as it runs, for balancing by load and for the metrics.
#[derive(Debug)]
pub struct StreamHold {
    pub lease: Lease,
    _in_flight: InFlight,
}

impl Dispatcher {
    /// A streaming call's body sent as it came to `route`'s REST backend, at the call's path: the answer's head
    /// as soon as it arrives, its body still to be read. The endpoint is chosen as for an inference
    /// (another one when the first cannot be reached); the request timeout bounds the wait for the head only.
    pub async fn rest_stream_call(
        &self,
        routed: &crate::routing::Routed,
        call: StreamCall,
        body: Bytes,
        forward: &http::HeaderMap,
        trace: &Trace,
    ) -> Result<(http::Response<crate::upstream::BackendBody>, StreamHold)> {
        let route = &routed.route;
        let backend = self.backend(route)?;
        let Replicas::Rest { endpoints, .. } = &backend.replicas else {
            return Err(Error::internal("a REST stream call to a gRPC backend"));
        };
        if call == StreamCall::InferStream && backend.config.stream == StreamDialect::Triton {
            return Err(Error::invalid(format!(
                "model '{}' is served by backend {}, whose streams are Triton's: it has generate_stream, not \
                 infer_stream",
                route.model, backend.name
            )));
        }
        let suffix = format!("/{}", call.path_segment());
        let path = crate::upstream::rest::model_path(&route.upstream_name, route.backend_version(), &suffix);
        let path = http::uri::PathAndQuery::try_from(path)
            .map_err(|e| Error::internal(format!("no REST path for model '{}': {e}", route.model)))?;
        let mut headers = forward.clone();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        let in_flight = backend.metrics.call();
        let tries = Tries {
            upstream: (&route.upstream_name, &route.upstream_version),
            affinity: &routed.affinity,
            until: in_flight.started() + route.timeout,
            began: Some(in_flight.started()),
            forward: &headers,
            trace,
        };
        let (answer, lease) = backend
            .attempt_holding(
                tries,
                || true,
                |Attempt { index, left, forward }| {
                    let body = crate::body::OutBody::from(crate::body::ChunksBody::new(vec![body.clone()]));
                    let path = &path;
                    async move {
                        endpoints[index]
                            .forward(path, &forward, None, body, crate::upstream::Deadline::after(left))
                            .await
                    }
                },
                |answer, span| {
                    span.set("http.response.status_code", i64::from(answer.status().as_u16()));
                    answer.status().is_server_error()
                },
            )
            .await?;
        Ok((
            answer,
            StreamHold {
                lease,
                _in_flight: in_flight,
            },
        ))
    }

    /// A decoupled model's request sent to its REST backend's stream, in the backend's dialect: the answer's body
    /// once its head says success (a failure is the backend's error), and the metadata its events are read with
    /// (Triton's fields by name need it; MLServer's inference responses carry their own types).
    async fn open_rest_stream(
        &self,
        routed: &crate::routing::Routed,
        request: &crate::protocol::InferRequest,
        context: &CallContext,
    ) -> Result<(
        crate::upstream::BackendBody,
        Option<crate::protocol::ModelMetadata>,
        StreamHold,
    )> {
        use http_body_util::BodyExt;

        let route = &routed.route;
        let (call, body, metadata) = match self.backend(route)?.config.stream {
            StreamDialect::Triton => {
                let metadata = self.model_metadata(&route.model, Some(&route.version)).await?;
                let body = rest_generate::encode_generate_request(request)?;
                (StreamCall::GenerateStream, body, Some(metadata))
            }
            StreamDialect::Mlserver => {
                let body = crate::codec::rest::encode_request(request, false)?.chunks.concat();
                (StreamCall::InferStream, body, None)
            }
        };
        let (answer, hold) = self
            .rest_stream_call(routed, call, Bytes::from(body), &context.forward, &context.trace)
            .await?;
        let (head, mut body) = answer.into_parts();
        if head.status.is_success() {
            return Ok((body, metadata, hold));
        }
        let mut error = Vec::new();
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(chunk) = frame.into_data()
                && error.len() < ERROR_BODY_BYTES
            {
                error.extend_from_slice(&chunk);
            }
        }
        let message = crate::codec::rest::decode_error(&error);
        Err(Error::from_upstream_http(head.status.as_u16(), message))
    }

    /// One request of a stream for a decoupled model behind a REST backend: sent to the backend's
    /// `generate_stream` (MLServer's: `infer_stream`, the request as an inference request), whose events become the
    /// request's responses on the stream, flagged not final as Triton flags a decoupled model's (an empty final one
    /// follows when the request asked for it). A failure is the request's error response; the stream goes on.
    pub(super) async fn decoupled_over_rest(
        self: Arc<Self>,
        routed: crate::routing::Routed,
        request: crate::protocol::InferRequest,
        context: CallContext,
        answers: Answers,
    ) -> Result<()> {
        use http_body_util::BodyExt;

        let route = routed.route.clone();
        let id = request.id.clone().unwrap_or_default();
        let mut record = LegRecord::new(
            &self.metrics,
            &route,
            Arc::new(AtomicU64::new(1)),
            Some(StreamResult::Cancelled),
        );
        let respond = |mut response: crate::protocol::InferResponse, last: bool| {
            response.model_name = route.model.clone();
            response.model_version = Some(route.version.clone());
            response.id = Some(id.clone());
            response
                .parameters
                .insert(FINAL_RESPONSE.to_owned(), ParamValue::Bool(last));
            splice::stream_response("", protobuf::encode_response(response).chunks)
        };
        let outcome: Result<bool> = async {
            let empty_final = request.parameters.get(EMPTY_FINAL_RESPONSE) == Some(&ParamValue::Bool(true));
            // Held while the events come: the stream is under way at its endpoint.
            let (mut body, metadata, _hold) = self.open_rest_stream(&routed, &request, &context).await?;
            let mut reader = rest_generate::EventReader::new(rest_generate::MOST_EVENT_BYTES);
            loop {
                let frame = match tokio::time::timeout(self.stream_idle_timeout, body.frame()).await {
                    Ok(Some(frame)) => frame.map_err(|e| {
                        Error::new(
                            ErrorKind::BadGateway,
                            Origin::Upstream,
                            format!("the backend broke off its stream: {e}"),
                        )
                    })?,
                    Ok(None) => break,
                    Err(_) => {
                        return Err(Error::new(
                            ErrorKind::Timeout,
                            Origin::Upstream,
                            "the backend's stream went silent (limits.stream_idle_timeout_ms)",
                        ));
                    }
                };
                let Ok(chunk) = frame.into_data() else { continue };
                for json in reader.push(&chunk) {
                    let response = match &metadata {
                        Some(metadata) => rest_generate::decode_generate_response(&json, metadata),
                        None => crate::codec::rest::decode_stream_event(&json),
                    }
                    .map_err(Error::into_upstream_protocol_error);
                    let answer = match response {
                        Ok(response) => {
                            record.responded();
                            answers.respond(respond(response, false)).await
                        }
                        Err(error) => answers.fail(&id, &error).await,
                    };
                    if !answer {
                        return Ok(false);
                    }
                }
                if reader.too_long() {
                    return Err(Error::new(
                        ErrorKind::BadGateway,
                        Origin::Upstream,
                        format!(
                            "the backend's stream sent an event longer than {} bytes",
                            rest_generate::MOST_EVENT_BYTES
                        ),
                    ));
                }
            }
            if empty_final {
                let response = crate::protocol::InferResponse::default();
                return Ok(answers.respond(respond(response, true)).await);
            }
            Ok(true)
        }
        .await;
        record.leg.result = Some(match &outcome {
            Ok(true) => StreamResult::Ok,
            Ok(false) => StreamResult::Cancelled,
            Err(_) => StreamResult::Error,
        });
        if let Err(error) = outcome {
            answers.fail(&id, &error).await;
        }
        Ok(())
    }

    /// How long a stream may pass with no message either way.
    pub fn stream_idle_timeout(&self) -> Duration {
        self.stream_idle_timeout
    }
}
