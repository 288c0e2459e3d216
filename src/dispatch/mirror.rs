//! Mirrored copies of requests: sent to the mirror version over its backend's protocol, answers dropped.

use bytes::Bytes;
use http::HeaderMap;
use std::time::Duration;

use super::backend::Attempt;
use super::{Affinity, BackendClients, CallContext, Replicas, call_infer, decode_grpc_request};
use crate::codec::{rest, splice};
use crate::error::{Error, Result};
use crate::protocol::InferRequest;
use crate::routing::VersionRoute;
use crate::telemetry::traces::Trace;

/// A request copied for the mirror, in the form the client sent it.
#[derive(Debug)]
pub enum MirrorPayload {
    Decoded(InferRequest),
    /// An encoded `ModelInferRequest`.
    Grpc(Bytes),
    /// A REST body (JSON, or binary extension when `header_length` is set) as it arrived, in chunks.
    Rest {
        body: Vec<Bytes>,
        header_length: Option<u64>,
        content_type: Option<http::HeaderValue>,
    },
}

/// One mirrored call: the copy converted to what the mirror's backend speaks, its answer dropped.
pub(super) async fn mirror_call(
    backend: &BackendClients,
    route: &VersionRoute,
    payload: MirrorPayload,
    forward: &HeaderMap,
    affinity: &Affinity,
    timeout: Duration,
) -> Result<()> {
    let upstream = (route.upstream_name.as_str(), route.upstream_version.as_str());
    let request = match (payload, &backend.replicas) {
        (MirrorPayload::Grpc(message), Replicas::Grpc { .. }) => {
            let renamed = splice::rename(&message, &route.upstream_name, &route.upstream_version)?;
            backend
                .model_infer(route, affinity, timeout, forward, &Trace::default(), renamed, None)
                .await?;
            return Ok(());
        }
        (
            MirrorPayload::Rest {
                body,
                header_length,
                content_type,
            },
            Replicas::Rest { endpoints, binary_data },
        ) if header_length.is_none() || *binary_data => {
            let mut headers = forward.clone();
            if let Some(content_type) = content_type {
                headers.insert(http::header::CONTENT_TYPE, content_type);
            }
            if let Some(length) = header_length {
                headers.insert(crate::headers::INFERENCE_HEADER_CONTENT_LENGTH, length.into());
            }
            let path = crate::upstream::rest::model_path(&route.upstream_name, route.backend_version(), "/infer");
            let answer = backend
                .attempt(
                    upstream,
                    affinity,
                    timeout,
                    &headers,
                    &Trace::default(),
                    |Attempt { index, left, forward }| {
                        let body = body.clone();
                        let path = &path;
                        async move {
                            endpoints[index]
                                .send(http::Method::POST, path, &forward, body, Some(left))
                                .await
                        }
                    },
                )
                .await?;
            return if answer.status.is_success() {
                Ok(())
            } else {
                Err(Error::from_upstream_http(answer.status.as_u16(), "mirror failed"))
            };
        }
        (MirrorPayload::Decoded(request), _) => request,
        (MirrorPayload::Grpc(message), _) => decode_grpc_request(message)?,
        (
            MirrorPayload::Rest {
                body, header_length, ..
            },
            _,
        ) => {
            let joined = Bytes::from(body.concat());
            match rest::decode_request(joined, header_length)? {
                rest::RestRequest::Request { request, .. } => request,
                rest::RestRequest::RawBinary(_) => {
                    return Err(Error::invalid("a raw binary request is not mirrored across protocols"));
                }
            }
        }
    };
    let context = CallContext {
        forward: forward.clone(),
        ..CallContext::default()
    };
    call_infer(backend, route, request, &context, timeout, affinity)
        .await
        .map(drop)
}
