//! Triton's model configuration through the gateway: asked of an endpoint of the resolved version's backend and
//! passed on whole, whatever fields it holds, with the public model name in it.

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use prost::Message;

use super::Dispatcher;
use super::backend::Replicas;
use super::fleet::Affinity;
use crate::codec::{rest, splice};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::proto::{ModelConfigRequest, ModelConfigResponse};

const MODEL_CONFIG: &str = "/inference.GRPCInferenceService/ModelConfig";

/// A model configuration in the form the client's protocol carries it.
#[derive(Debug, Clone)]
pub enum ModelConfigAnswer {
    /// Triton's REST form: the configuration's JSON.
    Json(Vec<u8>),
    /// Triton's gRPC form: an encoded `inference.ModelConfig`.
    Protobuf(Bytes),
}

/// Which form the client wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigForm {
    Json,
    Protobuf,
}

impl Dispatcher {
    /// The configuration of `model` at `version` (its default version when `None`) from an endpoint of its
    /// backend, renamed to the public name. It is carried only in the form the backend gives it: Triton's JSON and
    /// protobuf forms differ in ways only the full schema of every field can translate, so a client asking in the
    /// other form gets 501 / UNIMPLEMENTED saying which protocol to ask over.
    pub async fn model_config(
        &self,
        model: &str,
        version: Option<&str>,
        form: ConfigForm,
    ) -> Result<ModelConfigAnswer> {
        let route = self.routes.resolve(model, version)?.clone();
        let backend = self.backend(&route)?;
        let speaks = match &backend.replicas {
            Replicas::Rest { .. } => ConfigForm::Json,
            Replicas::Grpc { .. } => ConfigForm::Protobuf,
        };
        if speaks != form {
            let (theirs, ask) = match speaks {
                ConfigForm::Json => ("REST", "REST (GET /v2/models/<m>/config)"),
                ConfigForm::Protobuf => ("gRPC", "gRPC (ModelConfig)"),
            };
            return Err(Error::new(
                ErrorKind::Unimplemented,
                Origin::Gateway,
                format!(
                    "model '{model}' is served over {theirs} by backend {}, and a model configuration is passed on only \
                     in the form its backend gives: ask the gateway over {ask}",
                    backend.name
                ),
            ));
        }
        let not_kept = |why: String| {
            Error::new(
                ErrorKind::Unimplemented,
                Origin::Upstream,
                format!("backend {} keeps no model configuration ({why})", backend.name),
            )
        };
        let upstream = (route.upstream_name.as_str(), route.upstream_version.as_str());
        let answer = backend
            .attempt(upstream, &Affinity::None, self.request_timeout, |index, left| {
                let route = &route;
                async move {
                    match &backend.replicas {
                        Replicas::Rest { endpoints, .. } => {
                            let endpoint = &endpoints[index];
                            let path = crate::upstream::rest::model_path(
                                &route.upstream_name,
                                route.backend_version(),
                                "/config",
                            );
                            let answer = endpoint
                                .send(Method::GET, &path, &HeaderMap::new(), Vec::new(), Some(left))
                                .await?;
                            if matches!(answer.status, StatusCode::NOT_FOUND | StatusCode::NOT_IMPLEMENTED) {
                                let why = format!("{} answered {path} with {}", endpoint.authority(), answer.status);
                                return Err(not_kept(why));
                            }
                            endpoint.check(&answer)?;
                            let renamed = rest::rename_model_config(&answer.body, &route.model)
                                .map_err(Error::into_upstream_protocol_error)?;
                            Ok(ModelConfigAnswer::Json(renamed))
                        }
                        Replicas::Grpc { endpoints } => {
                            let endpoint = &endpoints[index];
                            let request = ModelConfigRequest {
                                name: route.upstream_name.clone(),
                                version: route.upstream_version.clone(),
                            };
                            let message = vec![request.encode_to_vec().into()];
                            let answer = endpoint
                                .unary(MODEL_CONFIG, message, Some(left), &HeaderMap::new(), None)
                                .await
                                .map_err(|error| match error.kind() {
                                    ErrorKind::Unimplemented => not_kept(format!(
                                        "{} answered UNIMPLEMENTED: {}",
                                        endpoint.authority(),
                                        error.message()
                                    )),
                                    _ => error,
                                })?;
                            let config = ModelConfigResponse::decode(answer.value)
                                .map_err(|e| Error::invalid(format!("invalid model configuration: {e}")))
                                .and_then(|response| splice::rename_model_config(&response.config, &route.model))
                                .map_err(Error::into_upstream_protocol_error)?;
                            Ok(ModelConfigAnswer::Protobuf(config))
                        }
                    }
                }
            })
            .await?;
        Ok(answer)
    }
}
