//! Readiness and metadata asked of one endpoint, over its backend's protocol, and the health probe built on them.

use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use prost::Message;

use super::{BackendClients, MODEL_METADATA, MODEL_READY, Replicas, SERVER_READY, bad_answer};
use crate::codec::protobuf;
use crate::error::Result;
use crate::proto::{
    ModelMetadataRequest, ModelMetadataResponse, ModelReadyRequest, ModelReadyResponse, ServerReadyRequest,
    ServerReadyResponse,
};
use crate::protocol::ModelMetadata;
use crate::routing::VersionRoute;
use crate::upstream::GrpcUpstream;

/// One typed unary call to a gRPC endpoint.
async fn grpc_call<Answer: Message + Default>(
    backend: &BackendClients,
    endpoint: &GrpcUpstream,
    method: &'static str,
    request: &impl Message,
    deadline: Duration,
) -> Result<Answer> {
    let answer = endpoint
        .unary(
            method,
            vec![Bytes::from(request.encode_to_vec())],
            Some(deadline),
            &HeaderMap::new(),
            None,
        )
        .await?;
    Answer::decode(answer.value).map_err(|e| bad_answer(&backend.name, e))
}

/// One probe of one endpoint: server ready, then each routed model's ready; the outcome goes to its state. An
/// endpoint is healthy when it answers and is ready or has one of its routed models ready: Triton's strict readiness
/// (and the built-in model server) report the server not ready while any model is unloaded, which must take that
/// model's traffic away from the endpoint, not every model's.
pub(super) async fn probe(backend: &BackendClients, endpoint: usize, models: &[(String, String)], timeout: Duration) {
    let server = endpoint_server_ready(backend, endpoint, timeout).await;
    let mut not_ready = std::collections::HashSet::new();
    let mut any_model_ready = false;
    if server.is_ok() {
        for (name, version) in models {
            if endpoint_model_ready(backend, endpoint, name, version, timeout)
                .await
                .unwrap_or(false)
            {
                any_model_ready = true;
            } else {
                not_ready.insert((name.clone(), version.clone()));
            }
        }
    }
    let healthy = match server {
        Ok(ready) => ready || any_model_ready || models.is_empty(),
        Err(_) => false,
    };
    if let Some(state) = backend.fleet.states.get(endpoint) {
        state.probed(healthy, not_ready, &backend.fleet.policy);
    }
}

pub(super) async fn endpoint_server_ready(
    backend: &BackendClients,
    endpoint: usize,
    deadline: Duration,
) -> Result<bool> {
    match &backend.replicas {
        Replicas::Rest { endpoints, .. } => Ok(endpoints[endpoint].server_ready(Some(deadline)).await?.ready),
        Replicas::Grpc { endpoints } => {
            let answer: ServerReadyResponse = grpc_call(
                backend,
                &endpoints[endpoint],
                SERVER_READY,
                &ServerReadyRequest {},
                deadline,
            )
            .await?;
            Ok(answer.ready)
        }
    }
}

/// Whether the endpoint has the backend's model `name` at `version` (empty: its default) ready.
pub(super) async fn endpoint_model_ready(
    backend: &BackendClients,
    endpoint: usize,
    name: &str,
    version: &str,
    deadline: Duration,
) -> Result<bool> {
    match &backend.replicas {
        Replicas::Rest { endpoints, .. } => Ok(endpoints[endpoint]
            .model_ready(name, Some(version).filter(|v| !v.is_empty()), Some(deadline))
            .await?
            .ready),
        Replicas::Grpc { endpoints } => {
            let request = ModelReadyRequest {
                name: name.to_owned(),
                version: version.to_owned(),
            };
            let answer: ModelReadyResponse =
                grpc_call(backend, &endpoints[endpoint], MODEL_READY, &request, deadline).await?;
            Ok(answer.ready)
        }
    }
}

pub(super) async fn endpoint_model_metadata(
    backend: &BackendClients,
    endpoint: usize,
    route: &VersionRoute,
    deadline: Duration,
) -> Result<ModelMetadata> {
    match &backend.replicas {
        Replicas::Rest { endpoints, .. } => {
            endpoints[endpoint]
                .model_metadata(&route.upstream_name, route.backend_version(), Some(deadline))
                .await
        }
        Replicas::Grpc { endpoints } => {
            let request = ModelMetadataRequest {
                name: route.upstream_name.clone(),
                version: route.upstream_version.clone(),
            };
            let answer: ModelMetadataResponse =
                grpc_call(backend, &endpoints[endpoint], MODEL_METADATA, &request, deadline).await?;
            Ok(protobuf::model_metadata_from_proto(answer))
        }
    }
}
