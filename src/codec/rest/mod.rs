//! REST bodies: JSON objects of every endpoint and the binary tensor data extension that follows them.

pub mod data;
pub mod format;
pub mod generate;
pub mod key_scan;
pub mod metadata;
pub mod number;
pub mod parallel;
pub mod params;
pub mod reader;
pub mod rename;
pub mod request;
pub mod response;
pub mod tensor_doc;

use bytes::{Bytes, BytesMut};

use crate::error::{Error, Result};

pub use metadata::{
    decode_error, decode_model_metadata, decode_model_ready, decode_model_statistics, decode_repository_index_request,
    decode_repository_request, decode_server_live, decode_server_metadata, decode_server_ready, encode_error,
    encode_model_metadata, encode_model_ready, encode_model_statistics, encode_repository_index,
    encode_repository_request, encode_server_live, encode_server_metadata, encode_server_ready, rename_model_config,
};
pub use request::{
    BINARY_DATA, BINARY_DATA_OUTPUT, LONGEST_RESERVED_NAME, RestRequest, decode_request, encode_request,
    may_name_shared_memory, mentions_reserved, raw_binary_request, reserved_parameters,
};
pub use response::{decode_response, decode_stream_event, encode_response};
pub use tensor_doc::BINARY_DATA_SIZE;

use crate::headers::INFERENCE_HEADER_CONTENT_LENGTH;

/// The length a header value gives: digits (a leading `+` taken, as `u64`'s parse takes it), with spaces or tabs
/// around them; `None` for anything else (a value of other than visible ASCII among them). The one reading of a
/// length header's value once a message is framed (Content-Length's, already checked by the framing, among them).
pub fn length_value(value: &[u8]) -> Option<u64> {
    if !value.iter().all(|&byte| byte == b'\t' || (b' '..=b'~').contains(&byte)) {
        return None;
    }
    std::str::from_utf8(value.trim_ascii()).ok()?.parse().ok()
}

/// The JSON part's length a binary-extension body declares (`Inference-Header-Content-Length`); `None` when the
/// body is JSON alone.
pub fn inference_header_length(value: Option<&http::HeaderValue>) -> Result<Option<u64>> {
    let Some(value) = value else {
        return Ok(None);
    };
    length_value(value.as_bytes()).map(Some).ok_or_else(|| {
        Error::invalid(format!(
            "{INFERENCE_HEADER_CONTENT_LENGTH} must be a non-negative integer, got {value:?}"
        ))
    })
}

/// Which outputs a REST caller wants as binary data: an output's own `binary_data` wins; when it does not say, the
/// request's `binary_data_output` decides; when neither says, JSON.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BinaryOutputs {
    /// The request's `binary_data_output`.
    pub all: bool,
    /// Outputs whose `binary_data` was given, with its value.
    pub outputs: Vec<(String, bool)>,
}

impl BinaryOutputs {
    pub fn is_binary(&self, output: &str) -> bool {
        self.outputs
            .iter()
            .find(|(name, _)| name == output)
            .map_or(self.all, |(_, binary)| *binary)
    }

    /// Every output binary: what a gateway asks of a backend that speaks the extension.
    pub fn all_binary() -> Self {
        BinaryOutputs {
            all: true,
            outputs: Vec::new(),
        }
    }
}

/// An encoded REST body: the JSON header followed by binary sections that share the tensors' buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedBody {
    /// The JSON header first, then one chunk per binary tensor.
    pub chunks: Vec<Bytes>,
    /// The header's length, for `Inference-Header-Content-Length`; `None` when the body is JSON alone.
    pub header_length: Option<usize>,
}

impl EncodedBody {
    fn new(header: Vec<u8>, sections: Vec<Bytes>) -> Self {
        let header_length = if sections.is_empty() { None } else { Some(header.len()) };
        let mut chunks = Vec::with_capacity(sections.len() + 1);
        chunks.push(Bytes::from(header));
        chunks.extend(sections.into_iter().filter(|s| !s.is_empty()));
        EncodedBody { chunks, header_length }
    }

    /// The body's total length, for `Content-Length`.
    pub fn content_length(&self) -> usize {
        self.chunks.iter().map(Bytes::len).sum()
    }

    /// The `Content-Type` the body should carry.
    pub fn content_type(&self) -> &'static str {
        if self.header_length.is_some() {
            "application/octet-stream"
        } else {
            "application/json"
        }
    }

    /// The whole body in one buffer. This copies; senders should write the chunks instead.
    pub fn to_bytes(&self) -> Bytes {
        if let [only] = self.chunks.as_slice() {
            return only.clone();
        }
        let mut body = BytesMut::with_capacity(self.content_length());
        for chunk in &self.chunks {
            body.extend_from_slice(chunk);
        }
        body.freeze()
    }
}

/// Splits a body at `Inference-Header-Content-Length` into the JSON header and the binary sections.
fn split_body(mut body: Bytes, header_length: Option<u64>) -> Result<(Bytes, Bytes)> {
    match header_length {
        None => Ok((body, Bytes::new())),
        Some(length) => {
            let length = usize::try_from(length)
                .ok()
                .filter(|&l| l <= body.len())
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "Inference-Header-Content-Length {length} is larger than the body ({} bytes)",
                        body.len()
                    ))
                })?;
            let binary = body.split_off(length);
            Ok((body, binary))
        }
    }
}

/// A JSON syntax or shape error, named for the object being read.
fn json_error(what: &str, error: &serde_json::Error) -> Error {
    Error::invalid(format!("invalid {what} JSON: {error}"))
}
