//! The model server's gRPC service: the six core RPCs, Triton's repository, statistics and configuration RPCs, and
//! its inference stream.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::ModelServerState;
use crate::codec::protobuf;
use crate::proto::grpc_inference_service_server::GrpcInferenceService;
use crate::proto::{
    ModelConfigRequest, ModelConfigResponse, ModelInferRequest, ModelInferResponse, ModelMetadataRequest,
    ModelMetadataResponse, ModelReadyRequest, ModelReadyResponse, ModelStatisticsRequest, ModelStatisticsResponse,
    ModelStreamInferResponse, RepositoryIndexRequest, RepositoryIndexResponse, RepositoryModelLoadRequest,
    RepositoryModelLoadResponse, RepositoryModelUnloadRequest, RepositoryModelUnloadResponse, ServerLiveRequest,
    ServerLiveResponse, ServerMetadataRequest, ServerMetadataResponse, ServerReadyRequest, ServerReadyResponse,
};

#[derive(Debug, Clone)]
pub struct GrpcModelServer {
    pub state: Arc<ModelServerState>,
}

fn version(text: &str) -> Option<&str> {
    Some(text).filter(|v| !v.is_empty())
}

/// Responses a stream holds for a client that is slow to read them; past this the models wait (flow control).
const STREAM_BUFFER: usize = 16;

type StreamAnswer = Result<ModelStreamInferResponse, Status>;

/// Reads a stream's requests, running each as it arrives, side by side, its responses sent as they are made. The
/// stream ends when the client has finished sending and every request is answered; a client that goes away stops
/// every request still running.
async fn serve_stream(
    state: Arc<ModelServerState>,
    mut requests: Streaming<ModelInferRequest>,
    answers: mpsc::Sender<StreamAnswer>,
) {
    let mut running = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            next = requests.message() => match next {
                Ok(Some(message)) => {
                    running.spawn(answer_on_stream(state.clone(), message, answers.clone()));
                }
                Ok(None) => break,
                Err(status) => {
                    let _ = answers.send(Err(status)).await;
                    return;
                }
            },
            () = answers.closed() => return,
        }
    }
    tokio::select! {
        () = async { while running.join_next().await.is_some() {} } => {}
        () = answers.closed() => {}
    }
}

/// One request of a stream: its responses, or one response carrying its error and its id (the stream goes on).
async fn answer_on_stream(
    state: Arc<ModelServerState>,
    message: ModelInferRequest,
    answers: mpsc::Sender<StreamAnswer>,
) {
    let id = message.id.clone();
    let model = message.model_name.clone();
    let model_version = message.model_version.clone();
    let (responses, mut made) = mpsc::channel(1);
    let run = async {
        let request = protobuf::request_from_proto(message)?;
        state
            .repository
            .infer_stream(&model, version(&model_version), request, responses)
            .await
    };
    let forwarded = answers.clone();
    let forward = async move {
        while let Some(response) = made.recv().await {
            let response = ModelStreamInferResponse {
                error_message: String::new(),
                infer_response: Some(protobuf::response_to_proto(response)),
            };
            if forwarded.send(Ok(response)).await.is_err() {
                // The client is gone: dropping `made` stops the model.
                return;
            }
        }
    };
    let (ran, ()) = tokio::join!(run, forward);
    if let Err(error) = ran {
        let failed = ModelStreamInferResponse {
            error_message: error.message().to_owned(),
            infer_response: Some(ModelInferResponse {
                id,
                ..Default::default()
            }),
        };
        let _ = answers.send(Ok(failed)).await;
    }
}

/// The built-in model server's refusal of a shared-memory region: it reads tensors from requests only.
pub(super) fn no_shared_memory(kind: &str, name: &str) -> crate::error::Error {
    crate::error::Error::new(
        crate::error::ErrorKind::Unimplemented,
        crate::error::Origin::Gateway,
        format!("{kind} shared-memory region '{name}': the built-in model server reads tensors from requests only"),
    )
}

#[tonic::async_trait]
impl GrpcInferenceService for GrpcModelServer {
    crate::no_shared_memory_rpcs!(no_shared_memory);

    async fn server_live(&self, _: Request<ServerLiveRequest>) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(&self, _: Request<ServerReadyRequest>) -> Result<Response<ServerReadyResponse>, Status> {
        Ok(Response::new(ServerReadyResponse {
            ready: self.state.repository.all_ready(),
        }))
    }

    async fn model_ready(&self, request: Request<ModelReadyRequest>) -> Result<Response<ModelReadyResponse>, Status> {
        let request = request.into_inner();
        let ready = self
            .state
            .repository
            .model_ready(&request.name, version(&request.version))?;
        Ok(Response::new(ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(protobuf::server_metadata_to_proto(
            self.state.metadata.clone(),
        )))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let request = request.into_inner();
        let metadata = self
            .state
            .repository
            .metadata(&request.name, version(&request.version))?;
        Ok(Response::new(protobuf::model_metadata_to_proto(metadata)))
    }

    type ModelStreamInferStream = Pin<Box<dyn tokio_stream::Stream<Item = StreamAnswer> + Send>>;

    async fn model_stream_infer(
        &self,
        request: Request<Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        self.state.saw(request.metadata().as_ref());
        let (answers, receiver) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(serve_stream(self.state.clone(), request.into_inner(), answers));
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }

    async fn model_infer(&self, request: Request<ModelInferRequest>) -> Result<Response<ModelInferResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        self.state.saw(metadata.as_ref());
        let model = message.model_name.clone();
        let model_version = message.model_version.clone();
        let request = protobuf::request_from_proto(message)?;
        let response = self
            .state
            .repository
            .infer(&model, version(&model_version), request)
            .await?;
        // Like Triton, and like the gateway's own door: the answer is compressed only for a request that came
        // compressed (and accepts it back), not for every client that merely lists codings it reads.
        let compressed = metadata
            .get("grpc-encoding")
            .is_some_and(|coding| coding.as_bytes() != b"identity");
        let mut echoed = http::HeaderMap::new();
        super::Echo::of(&metadata.into_headers(), &self.state.metadata.name).onto(&mut echoed);
        let mut answer = Response::from_parts(
            tonic::metadata::MetadataMap::from_headers(echoed),
            protobuf::response_to_proto(response),
            tonic::Extensions::default(),
        );
        if !compressed {
            answer.disable_compression();
        }
        Ok(answer)
    }

    async fn repository_index(
        &self,
        request: Request<RepositoryIndexRequest>,
    ) -> Result<Response<RepositoryIndexResponse>, Status> {
        let entries = self.state.repository.index(request.into_inner().ready);
        Ok(Response::new(protobuf::repository_index_to_proto(entries)))
    }

    async fn model_config(
        &self,
        request: Request<ModelConfigRequest>,
    ) -> Result<Response<ModelConfigResponse>, Status> {
        let request = request.into_inner();
        let config = self
            .state
            .repository
            .model_config(&request.name, Some(request.version.as_str()))?;
        Ok(Response::new(ModelConfigResponse {
            config: prost::Message::encode_to_vec(&config).into(),
        }))
    }

    async fn model_statistics(
        &self,
        request: Request<ModelStatisticsRequest>,
    ) -> Result<Response<ModelStatisticsResponse>, Status> {
        let request = request.into_inner();
        let model_stats = self.state.repository.statistics(
            Some(request.name.as_str()).filter(|name| !name.is_empty()),
            Some(request.version.as_str()).filter(|version| !version.is_empty()),
        )?;
        Ok(Response::new(ModelStatisticsResponse { model_stats }))
    }

    async fn repository_model_load(
        &self,
        request: Request<RepositoryModelLoadRequest>,
    ) -> Result<Response<RepositoryModelLoadResponse>, Status> {
        self.state
            .repository
            .set_ready(&request.into_inner().model_name, true)?;
        Ok(Response::new(RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        request: Request<RepositoryModelUnloadRequest>,
    ) -> Result<Response<RepositoryModelUnloadResponse>, Status> {
        self.state
            .repository
            .set_ready(&request.into_inner().model_name, false)?;
        Ok(Response::new(RepositoryModelUnloadResponse {}))
    }
}
