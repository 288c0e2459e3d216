//! Triton's model configuration through the gateway: asked of an endpoint of the resolved version's backend, with
//! the public model name in it; passed on whole when the client asks in the form the backend gives (whatever fields
//! it holds), translated between protobuf and JSON when not.

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use prost::Message;

use super::Dispatcher;
use super::backend::{Attempt, Replicas};
use crate::codec::{model_config, rest, splice};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::proto::{ModelConfigRequest, ModelConfigResponse};
use crate::routing::Affinity;
use crate::telemetry::traces::Trace;

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
    /// backend, renamed to the public name, in the client's form.
    pub async fn model_config(
        &self,
        model: &str,
        version: Option<&str>,
        form: ConfigForm,
    ) -> Result<ModelConfigAnswer> {
        let route = self.routes.resolve(model, version)?.clone();
        let backend = self.backend(&route)?;
        let not_kept = |why: String| {
            Error::new(
                ErrorKind::Unimplemented,
                Origin::Upstream,
                format!("backend {} keeps no model configuration ({why})", backend.name),
            )
        };
        let upstream = (route.upstream_name.as_str(), route.upstream_version.as_str());
        let no_headers = HeaderMap::new();
        let answer = backend
            .attempt(
                upstream,
                &Affinity::None,
                self.request_timeout,
                &no_headers,
                &Trace::default(),
                |Attempt { index, left, .. }| {
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
                                    let why =
                                        format!("{} answered {path} with {}", endpoint.authority(), answer.status);
                                    return Err(not_kept(why));
                                }
                                endpoint.check(&answer)?;
                                match form {
                                    ConfigForm::Json => rest::rename_model_config(&answer.body, &route.model)
                                        .map(ModelConfigAnswer::Json),
                                    ConfigForm::Protobuf => {
                                        model_config::protobuf_from_json(&answer.body, &route.model)
                                            .map(ModelConfigAnswer::Protobuf)
                                    }
                                }
                                .map_err(Error::into_upstream_protocol_error)
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
                                ModelConfigResponse::decode(answer.value)
                                    .map_err(|e| Error::invalid(format!("invalid model configuration: {e}")))
                                    .and_then(|response| match form {
                                        ConfigForm::Protobuf => {
                                            splice::rename_model_config(&response.config, &route.model)
                                                .map(ModelConfigAnswer::Protobuf)
                                        }
                                        ConfigForm::Json => {
                                            model_config::json_from_protobuf(&response.config, &route.model)
                                                .map(ModelConfigAnswer::Json)
                                        }
                                    })
                                    .map_err(Error::into_upstream_protocol_error)
                            }
                        }
                    }
                },
            )
            .await?;
        Ok(answer)
    }
}
