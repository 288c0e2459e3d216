//! `$inference_response` over REST: JSON, optionally followed by binary sections (binary tensor data extension).

use bytes::Bytes;
use serde::Deserialize;

use super::data::write_json_string;
use super::params::{JsonParameters, write_parameters_field};
use super::tensor_doc::{BinarySections, DataForm, TensorDoc, write_tensor};
use super::{BinaryOutputs, EncodedBody, json_error, split_body};
use crate::error::{Error, Result};
use crate::protocol::InferResponse;

#[derive(Deserialize)]
struct ResponseDoc<'a> {
    model_name: Option<String>,
    model_version: Option<String>,
    id: Option<String>,
    parameters: Option<JsonParameters>,
    #[serde(borrow)]
    outputs: Option<Vec<TensorDoc<'a>>>,
}

/// Decodes a REST inference response body, as a backend sends it. Binary output data is sliced from `body`.
pub fn decode_response(body: Bytes, header_length: Option<u64>) -> Result<InferResponse> {
    if header_length == Some(0) {
        return Err(Error::invalid(
            "a response cannot have an Inference-Header-Content-Length of 0",
        ));
    }
    let (header, binary) = split_body(body, header_length)?;
    let doc: ResponseDoc<'_> = serde_json::from_slice(&header).map_err(|e| json_error("inference response", &e))?;
    let mut sections = BinarySections::new(binary);
    let docs = doc.outputs.unwrap_or_default();
    let mut outputs = Vec::with_capacity(docs.len());
    for (index, output) in docs.into_iter().enumerate() {
        outputs.push(output.into_tensor("output", index, &mut sections)?);
    }
    sections.finish()?;
    Ok(InferResponse {
        model_name: doc.model_name.unwrap_or_default(),
        model_version: doc.model_version.filter(|v| !v.is_empty()),
        id: doc.id,
        parameters: doc.parameters.map(|p| p.0).unwrap_or_default(),
        outputs,
    })
}

/// Encodes a response for a REST caller. Outputs are binary as `binary_outputs` (from the caller's request) says;
/// binary sections are the outputs' own buffers, not copies.
pub fn encode_response(response: &InferResponse, binary_outputs: &BinaryOutputs) -> Result<EncodedBody> {
    let mut out = Vec::with_capacity(256);
    let mut sections = Vec::new();
    out.extend_from_slice(b"{\"model_name\":");
    write_json_string(&mut out, &response.model_name);
    if let Some(version) = &response.model_version {
        out.extend_from_slice(b",\"model_version\":");
        write_json_string(&mut out, version);
    }
    if let Some(id) = &response.id {
        out.extend_from_slice(b",\"id\":");
        write_json_string(&mut out, id);
    }
    write_parameters_field(&mut out, &response.parameters);
    out.extend_from_slice(b",\"outputs\":[");
    for (i, output) in response.outputs.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let form = if binary_outputs.is_binary(&output.name) {
            DataForm::Binary
        } else {
            DataForm::Json
        };
        write_tensor(&mut out, output, form, &mut sections)?;
    }
    out.extend_from_slice(b"]}");
    Ok(EncodedBody::new(out, sections))
}
