//! Model-repository load and unload, fanned out: a public model is loaded or unloaded on every endpoint of every
//! backend that serves one of its versions (under the backend's own name for it), and the call succeeds only when
//! every endpoint did it.

use futures_util::future::join_all;
use http::HeaderMap;
use prost::Message;

use super::Dispatcher;
use super::backend::Replicas;
use crate::codec::{protobuf, rest};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::proto::{RepositoryModelLoadRequest, RepositoryModelUnloadRequest};
use crate::protocol::RepositoryParameters;

const REPOSITORY_MODEL_LOAD: &str = "/inference.GRPCInferenceService/RepositoryModelLoad";
const REPOSITORY_MODEL_UNLOAD: &str = "/inference.GRPCInferenceService/RepositoryModelUnload";

/// Which repository call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepositoryAction {
    Load,
    Unload,
}

impl RepositoryAction {
    fn verb(self) -> &'static str {
        match self {
            RepositoryAction::Load => "load",
            RepositoryAction::Unload => "unload",
        }
    }
}

impl Dispatcher {
    /// Loads or unloads the public `model` on every endpoint of each backend serving one of its versions, all at
    /// once. Fails, naming each endpoint that failed and why, unless every one succeeded.
    pub async fn repository_change(
        &self,
        model: &str,
        action: RepositoryAction,
        parameters: &RepositoryParameters,
        forward: &HeaderMap,
    ) -> Result<()> {
        let mut targets: Vec<(crate::config::BackendId, String)> = Vec::new();
        for route in self.routes.model_routes(model)? {
            let target = (route.backend, route.upstream_name.clone());
            if !targets.contains(&target) {
                targets.push(target);
            }
        }
        let mut calls = Vec::new();
        for (backend_index, upstream) in &targets {
            let backend = self
                .backends
                .get(backend_index.index())
                .ok_or_else(|| Error::internal("no backend for a route"))?;
            for (index, state) in backend.fleet.states.iter().enumerate() {
                let call = self.repository_call(&backend.replicas, index, upstream, action, parameters, forward);
                calls.push(async move {
                    call.await
                        .map_err(|error| (format!("{} of backend {}", state.authority, backend.name), error))
                });
            }
        }
        let total = calls.len();
        let answers = join_all(calls).await;
        // What the backends have ready changed: fleet answers ask again.
        self.asked.invalidate();
        let failures: Vec<(String, Error)> = answers.into_iter().filter_map(Result::err).collect();
        if failures.is_empty() {
            return Ok(());
        }
        // One kind of failure everywhere keeps its class (a model no endpoint knows is NOT_FOUND); mixed ones are a
        // bad gateway.
        let kind = failures[0].1.kind();
        let kind = if failures.iter().all(|(_, error)| error.kind() == kind) {
            kind
        } else {
            ErrorKind::BadGateway
        };
        let named: Vec<String> = failures
            .iter()
            .map(|(endpoint, error)| format!("{endpoint}: {}", error.message()))
            .collect();
        Err(Error::new(
            kind,
            Origin::Upstream,
            format!(
                "{} of model '{model}' failed at {} of {total} endpoints: {}",
                action.verb(),
                failures.len(),
                named.join("; ")
            ),
        ))
    }

    /// One endpoint's load or unload of `upstream`, over its backend's protocol.
    async fn repository_call(
        &self,
        replicas: &Replicas,
        index: usize,
        upstream: &str,
        action: RepositoryAction,
        parameters: &RepositoryParameters,
        forward: &HeaderMap,
    ) -> Result<()> {
        let deadline = Some(self.request_timeout);
        match replicas {
            Replicas::Rest { endpoints, .. } => {
                let endpoint = endpoints
                    .get(index)
                    .ok_or_else(|| Error::internal("no such endpoint"))?;
                let path = format!(
                    "/v2/repository/models/{}/{}",
                    crate::upstream::rest::path_segment(upstream),
                    action.verb()
                );
                let mut headers = forward.clone();
                headers.insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/json"),
                );
                let body = rest::encode_repository_request(parameters);
                let answer = endpoint
                    .send(http::Method::POST, &path, &headers, vec![body.into()], deadline)
                    .await?;
                endpoint.check(&answer)
            }
            Replicas::Grpc { endpoints } => {
                let endpoint = endpoints
                    .get(index)
                    .ok_or_else(|| Error::internal("no such endpoint"))?;
                let parameters = protobuf::repository_parameters_to_proto(parameters);
                let (method, message) = match action {
                    RepositoryAction::Load => (
                        REPOSITORY_MODEL_LOAD,
                        RepositoryModelLoadRequest {
                            repository_name: String::new(),
                            model_name: upstream.to_owned(),
                            parameters,
                        }
                        .encode_to_vec(),
                    ),
                    RepositoryAction::Unload => (
                        REPOSITORY_MODEL_UNLOAD,
                        RepositoryModelUnloadRequest {
                            repository_name: String::new(),
                            model_name: upstream.to_owned(),
                            parameters,
                        }
                        .encode_to_vec(),
                    ),
                };
                endpoint
                    .unary(method, vec![message.into()], deadline, forward, None)
                    .await
                    .map(drop)
            }
        }
    }
}
