//! The protocol's data model: datatypes, tensors, parameters, the messages of every endpoint and the REST paths
//! that name them.

pub mod datatype;
pub mod messages;
pub mod parameters;
pub mod paths;
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

/// A map keyed by the names requests spell (models, versions), looked up by every request. foldhash, seeded per
/// process, hashes a short name in about a tenth of SipHash's instructions; names come from the configuration (or a
/// signed token's claims) and requests only look them up, so no client can fill a bucket.
pub type ByName<V> = std::collections::HashMap<String, V, foldhash::fast::RandomState>;

/// A set of such names, as [`ByName`] holds them.
pub type NameSet = std::collections::HashSet<String, foldhash::fast::RandomState>;

/// The REST calls that answer a stream of inference responses: Triton's generate extension and MLServer's
/// inference stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamCall {
    /// `generate`: fields by name in, one response's fields out.
    Generate,
    /// `generate_stream`: fields by name in, each response's fields as a server-sent event.
    GenerateStream,
    /// MLServer's `infer_stream`: an inference request in, each inference response as a server-sent event.
    InferStream,
}

impl StreamCall {
    /// The last segment of its path.
    pub fn path_segment(self) -> &'static str {
        match self {
            StreamCall::Generate => "generate",
            StreamCall::GenerateStream => "generate_stream",
            StreamCall::InferStream => "infer_stream",
        }
    }

    /// Whether it answers with events rather than one object.
    pub fn streams(self) -> bool {
        self != StreamCall::Generate
    }
}
