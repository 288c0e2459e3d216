//! The protocol's data model: datatypes, tensors, parameters and the messages of every endpoint.

pub mod datatype;
pub mod messages;
pub mod parameters;
pub mod reserved;
pub mod sequence;
pub mod tensor;

pub use datatype::{DataType, element_count};
pub use messages::{
    InferRequest, InferResponse, ModelIndexEntry, ModelMetadata, ModelReady, ModelState, RepositoryParameters,
    RepositoryValue, RequestedOutput, ServerLive, ServerMetadata, ServerReady, TensorMetadata,
};
pub use parameters::{CONTENT_TYPE, ParamValue, Parameters};
pub use reserved::Reserved;
pub use sequence::{Sequence, SequenceId};
pub use tensor::{BytesElements, Tensor};
