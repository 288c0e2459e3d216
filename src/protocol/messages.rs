//! Requests, responses, metadata and health messages of every endpoint, independent of the wire form.

use super::parameters::Parameters;
use super::tensor::Tensor;

/// An output the caller asks for, with its parameters (for example the binary extension's `binary_data`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestedOutput {
    pub name: String,
    pub parameters: Parameters,
}

impl RequestedOutput {
    pub fn new(name: impl Into<String>) -> Self {
        RequestedOutput {
            name: name.into(),
            parameters: Parameters::new(),
        }
    }
}

/// `$inference_request` / `ModelInferRequest`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InferRequest {
    pub model_name: String,
    pub model_version: Option<String>,
    pub id: Option<String>,
    pub parameters: Parameters,
    pub inputs: Vec<Tensor>,
    pub outputs: Vec<RequestedOutput>,
}

impl InferRequest {
    /// Refuses the request when a shared-memory parameter stands anywhere in it: its own parameters, an input's or a
    /// requested output's (the gateway never sends one on).
    pub fn refuse_shared_memory(&self) -> crate::error::Result<()> {
        use super::reserved;
        if let Some(name) = self
            .parameters
            .keys()
            .find(|key| reserved::SHARED_MEMORY.contains(&key.as_str()))
        {
            return Err(reserved::shared_memory_anywhere(name));
        }
        for input in &self.inputs {
            reserved::refuse_shared_memory("input", &input.name, input.parameters.keys().map(String::as_str))?;
        }
        for output in &self.outputs {
            reserved::refuse_shared_memory("output", &output.name, output.parameters.keys().map(String::as_str))?;
        }
        Ok(())
    }
}

/// `$inference_response` / `ModelInferResponse`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InferResponse {
    pub model_name: String,
    pub model_version: Option<String>,
    pub id: Option<String>,
    pub parameters: Parameters,
    pub outputs: Vec<Tensor>,
}

/// `$metadata_tensor` / `TensorMetadata`. The datatype stays a string: metadata is relayed from backends, which may
/// describe types this gateway never has to decode.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TensorMetadata {
    pub name: String,
    pub datatype: String,
    /// Dimensions; -1 marks a variable-size dimension.
    pub shape: Vec<i64>,
}

/// `$metadata_model_response` / `ModelMetadataResponse`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelMetadata {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: String,
    pub inputs: Vec<TensorMetadata>,
    pub outputs: Vec<TensorMetadata>,
}

/// `$metadata_server_response` / `ServerMetadataResponse`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServerMetadata {
    pub name: String,
    pub version: String,
    pub extensions: Vec<String>,
}

/// `$live_server_response` / `ServerLiveResponse`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLive {
    pub live: bool,
}

/// `$ready_server_response` / `ServerReadyResponse`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerReady {
    pub ready: bool,
}

/// `$ready_model_response` / `ModelReadyResponse` (the protobuf form carries no name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelReady {
    pub name: String,
    pub ready: bool,
}

/// A model version's state in a repository index: Triton's `READY` and `UNAVAILABLE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelState {
    Ready,
    Unavailable,
}

impl ModelState {
    pub fn as_str(self) -> &'static str {
        match self {
            ModelState::Ready => "READY",
            ModelState::Unavailable => "UNAVAILABLE",
        }
    }
}

/// One entry of the model-repository extension's index (`POST /v2/repository/index`, `RepositoryIndex`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIndexEntry {
    pub name: String,
    pub version: String,
    pub state: ModelState,
    /// Why the model is not ready; empty when it is.
    pub reason: String,
}

/// A value of a model-repository load or unload parameter: Triton's `config` (a JSON model configuration),
/// `file:<path>` (a file's bytes) and others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RepositoryValue {
    Bool(bool),
    Int64(i64),
    String(String),
    Bytes(bytes::Bytes),
}

/// A model-repository load or unload request's parameters, in the order given.
pub type RepositoryParameters = indexmap::IndexMap<String, RepositoryValue>;
