//! One inference from routed call to answer: a decoded request or an encoded gRPC message sent over the backend's
//! protocol (passed through with its names spliced, or translated), mirrored first when its route says so, and
//! answered under the public names.

use std::time::{Duration, Instant};

use bytes::Bytes;
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;
use prost::Message;

use super::backend::{Attempt, BackendClients, Replicas};
use super::{CallContext, Dispatcher, MirrorPayload};
use crate::codec::rest::{self, BINARY_DATA, BINARY_DATA_OUTPUT};
use crate::codec::{protobuf, splice};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::proto::{ModelInferRequest, ModelInferResponse};
use crate::protocol::{InferRequest, InferResponse, ParamValue, Reserved};
use crate::routing::{Affinity, Routed, VersionRoute};
use crate::telemetry::metrics::Direction;
use crate::upstream::BackendAnswer;

impl Dispatcher {
    /// Runs an inference for `model` at `version`, admitted and routed here: the convenience form of
    /// [`Self::admit`] and [`Self::infer_routed`].
    pub async fn infer(
        &self,
        model: &str,
        version: Option<&str>,
        request: InferRequest,
        context: &CallContext,
    ) -> Result<BackendAnswer<InferResponse>> {
        let reserved = Reserved::from_parameters(&request.parameters);
        let admitted = self.admit_with(model, version, context, reserved).await?;
        self.infer_routed(&admitted.routed, request, context).await
    }

    /// Sends a copy of the call to its route's mirror, when it has one (`payload` made only then), and gives the
    /// backend the call itself goes to.
    fn mirrored(
        &self,
        routed: &Routed,
        context: &CallContext,
        payload: impl FnOnce() -> MirrorPayload,
    ) -> Result<&BackendClients> {
        if let Some(mirror) = &routed.mirror {
            self.mirror(mirror, payload(), &context.forward, &routed.affinity);
        }
        self.backend(&routed.route)
    }

    /// Runs a routed inference given as a decoded request, over whichever protocol the backend speaks, and answers
    /// with the public model name and version, and with the backend's end-to-end headers plus `oip-model-version`.
    /// A mirrored request is copied (tensor buffers shared, not copied) to the mirror first.
    pub async fn infer_routed(
        &self,
        routed: &Routed,
        request: InferRequest,
        context: &CallContext,
    ) -> Result<BackendAnswer<InferResponse>> {
        let backend = self.mirrored(routed, context, || MirrorPayload::Decoded(request.clone()))?;
        let route = &routed.route;
        let mut replied = call_routed(backend, routed, request, context).await?;
        route.name_served_version(&mut replied.headers);
        Ok(replied)
    }

    /// The gRPC front door's inference, routed here: the convenience form of [`Self::infer_grpc_routed`].
    pub async fn infer_grpc(&self, message: Bytes, context: &CallContext) -> Result<BackendAnswer<Vec<Bytes>>> {
        let fields = splice::model_fields(&message)?;
        let reserved = splice::parameters_refusing_shared_memory(&message)
            .and_then(|parameters| Reserved::from_parameters(&parameters));
        let admitted = self
            .admit_with(fields.name, Some(fields.version), context, reserved)
            .await?;
        self.infer_grpc_routed(&admitted.routed, &message, &fields, context)
            .await
    }

    /// The gRPC front door's inference: an encoded `ModelInferRequest` in, an encoded `ModelInferResponse` out.
    /// To a gRPC backend it passes through as bytes with only the names spliced; to a REST backend it is translated.
    /// `named` is what the door read of the message's names, to route it.
    pub async fn infer_grpc_routed(
        &self,
        routed: &Routed,
        message: &Bytes,
        named: &splice::ModelFields<'_>,
        context: &CallContext,
    ) -> Result<BackendAnswer<Vec<Bytes>>> {
        let backend = self.mirrored(routed, context, || MirrorPayload::Grpc(message.clone()))?;
        let route = &routed.route;
        let mut replied = match &backend.replicas {
            Replicas::Grpc { .. } => {
                // A message that already names the backend's model and version (most do) goes as it came, without
                // the rename's walk of its fields: the door's reading was the same walk.
                let renamed = if named.name == route.upstream_name && named.version == route.upstream_version {
                    vec![message.clone()]
                } else {
                    splice::rename(message, &route.upstream_name, &route.upstream_version)?
                };
                let coding = context.compressed.filter(|_| backend.config.compression);
                let answer = backend
                    .model_infer(
                        route,
                        &routed.affinity,
                        Self::deadline(context, route),
                        &context.forward,
                        &context.trace,
                        renamed,
                        coding,
                    )
                    .await?;
                BackendAnswer {
                    value: splice::rename(&answer.value, &route.model, &route.version)
                        .map_err(Error::into_upstream_protocol_error)?,
                    headers: answer.headers,
                    endpoint: answer.endpoint,
                }
            }
            Replicas::Rest { .. } => {
                let started = Instant::now();
                let step = context.trace.child("decode", SpanKind::Internal, || {
                    vec![KeyValue::new(
                        "oip.bytes",
                        i64::try_from(message.len()).unwrap_or(i64::MAX),
                    )]
                });
                let request = decode_grpc_request(message.clone());
                step.outcome(&request);
                drop(step);
                let request = request?;
                self.metrics.translated(Direction::GrpcToRest, started.elapsed());
                // Boxed: the translated call's state is large, and would otherwise be part of every passthrough
                // call's too.
                let replied = Box::pin(call_routed(backend, routed, request, context)).await?;
                let started = Instant::now();
                let step = context.trace.child("encode", SpanKind::Internal, Vec::new);
                let value = protobuf::encode_response(replied.value).chunks;
                if step.is_on() {
                    let bytes: usize = value.iter().map(Bytes::len).sum();
                    step.set("oip.bytes", i64::try_from(bytes).unwrap_or(i64::MAX));
                }
                drop(step);
                self.metrics.translated(Direction::RestToGrpc, started.elapsed());
                BackendAnswer {
                    value,
                    headers: replied.headers,
                    endpoint: replied.endpoint,
                }
            }
        };
        route.name_served_version(&mut replied.headers);
        Ok(replied)
    }
}

pub(super) fn decode_grpc_request(message: Bytes) -> Result<InferRequest> {
    let decoded =
        ModelInferRequest::decode(message).map_err(|e| Error::invalid(format!("invalid ModelInferRequest: {e}")))?;
    protobuf::request_from_proto(decoded)
}

/// [`call_infer`] for a routed call: the route's deadline (the client's, when shorter) and its affinity.
async fn call_routed(
    backend: &BackendClients,
    routed: &Routed,
    request: InferRequest,
    context: &CallContext,
) -> Result<BackendAnswer<InferResponse>> {
    let route = &routed.route;
    call_infer(
        backend,
        route,
        request,
        context,
        Dispatcher::deadline(context, route),
        &routed.affinity,
    )
    .await
}

/// Runs a decoded inference on `route`'s backend, over its protocol, with the backend's own names, and answers with
/// the public ones; encoded once, sent again (the same buffers) only to another endpoint when the first could not be
/// reached.
pub(super) async fn call_infer(
    backend: &BackendClients,
    route: &VersionRoute,
    mut request: InferRequest,
    context: &CallContext,
    deadline: Duration,
    affinity: &Affinity,
) -> Result<BackendAnswer<InferResponse>> {
    let (forward, trace) = (&context.forward, &context.trace);
    request.model_name = route.upstream_name.clone();
    request.model_version = route.backend_version().map(str::to_owned);
    let upstream = (route.upstream_name.as_str(), route.upstream_version.as_str());
    let mut replied = match &backend.replicas {
        Replicas::Rest { endpoints, binary_data } => {
            if *binary_data {
                // The backend answers in binary: no floats printed and parsed on the way back.
                // Triton and KServe apply the request-level flag only to outputs the request does not list; each
                // listed one is asked for by its own `binary_data`.
                request
                    .parameters
                    .insert(BINARY_DATA_OUTPUT.to_owned(), ParamValue::Bool(true));
                for output in &mut request.outputs {
                    output.parameters.insert(BINARY_DATA.to_owned(), ParamValue::Bool(true));
                }
            }
            let body = rest::encode_request(&request, *binary_data)?;
            let version = request.model_version.as_deref();
            backend
                .attempt(
                    upstream,
                    affinity,
                    deadline,
                    forward,
                    trace,
                    |Attempt { index, left, forward }| {
                        let body = body.clone();
                        async move {
                            endpoints[index]
                                .infer(&route.upstream_name, version, body, &forward, Some(left))
                                .await
                        }
                    },
                )
                .await?
        }
        Replicas::Grpc { .. } => {
            let message = protobuf::encode_request(request).chunks;
            let coding = context.compressed.filter(|_| backend.config.compression);
            let answer = backend
                .model_infer(route, affinity, deadline, forward, trace, message, coding)
                .await?;
            let decoded = ModelInferResponse::decode(answer.value).map_err(|e| bad_answer(&backend.name, e))?;
            BackendAnswer {
                value: protobuf::response_from_proto(decoded).map_err(Error::into_upstream_protocol_error)?,
                headers: answer.headers,
                endpoint: answer.endpoint,
            }
        }
    };
    replied.value.model_name = route.model.clone();
    replied.value.model_version = Some(route.version.clone());
    Ok(replied)
}

pub(super) fn bad_answer(backend: &str, error: prost::DecodeError) -> Error {
    Error::new(
        ErrorKind::BadGateway,
        Origin::Upstream,
        format!("backend {backend} sent an invalid message: {error}"),
    )
}
