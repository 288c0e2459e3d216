//! `$inference_response` over REST: JSON, optionally followed by binary sections (binary tensor data extension).

use super::format::write_json_string;
use super::params::{read_parameters, write_parameters_field};
use super::reader::JsonReader;
use super::request::optional_string;
use super::tensor_doc::{BinarySections, DataForm, read_tensor, write_tensor};
use super::{BinaryOutputs, EncodedBody, split_body};
use crate::error::{Error, Result};
use crate::protocol::InferResponse;
use bytes::Bytes;

/// Decodes a REST inference response body, as a backend sends it. Binary output data is sliced from `body`.
pub fn decode_response(body: Bytes, header_length: Option<u64>) -> Result<InferResponse> {
    if header_length == Some(0) {
        return Err(Error::invalid(
            "a response cannot have an Inference-Header-Content-Length of 0",
        ));
    }
    let (header, binary) = split_body(body, header_length)?;
    let mut sections = BinarySections::new(binary);
    let mut reader = JsonReader::new(&header);
    let mut response = InferResponse::default();
    let mut members = reader.object()?;
    while let Some(key) = members.next(&mut reader)? {
        match key.as_ref() {
            "id" => response.id = optional_string(&mut reader)?,
            "model_name" => response.model_name = optional_string(&mut reader)?.unwrap_or_default(),
            "model_version" => response.model_version = optional_string(&mut reader)?.filter(|v| !v.is_empty()),
            "parameters" => response.parameters = read_parameters(&mut reader)?,
            "outputs" => {
                let mut elements = reader.array()?;
                while elements.next(&mut reader)? {
                    let index = response.outputs.len();
                    response
                        .outputs
                        .push(read_tensor(&mut reader, "output", index, &mut sections)?);
                }
            }
            _ => reader.skip_value()?,
        }
    }
    reader.end()?;
    sections.finish()?;
    Ok(response)
}

/// Decodes one event of MLServer's `infer_stream`: an inference response whose `headers` parameter (the HTTP headers
/// MLServer files among a response's parameters, which its events do not take out as its unary answers do) is
/// dropped, not refused as a parameter value that is an object.
pub fn decode_stream_event(json: &[u8]) -> Result<InferResponse> {
    let mut event: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(json)
        .map_err(|e| Error::invalid(format!("a stream event is not a JSON object: {e}")))?;
    if let Some(serde_json::Value::Object(parameters)) = event.get_mut("parameters") {
        parameters.remove("headers");
    }
    let json = serde_json::to_vec(&event).map_err(|e| Error::internal(format!("a stream event: {e}")))?;
    decode_response(Bytes::from(json), None)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlserver_stream_events_lose_their_headers_parameter_only() {
        let event = br#"{"model_name":"count","id":"r1","parameters":{"headers":{"Ce-Id":"r1"},"kept":3},
            "outputs":[{"name":"OUTPUT0","shape":[1,1],"datatype":"INT32","data":[2]}]}"#;
        let response = decode_stream_event(event).unwrap();
        assert_eq!(
            (response.model_name.as_str(), response.id.as_deref()),
            ("count", Some("r1"))
        );
        assert_eq!(response.parameters.len(), 1);
        assert!(response.parameters.contains_key("kept"));
        assert_eq!(response.outputs[0].shape, vec![1, 1]);
        assert!(decode_stream_event(b"data").is_err());
        assert!(
            decode_response(Bytes::from_static(event), None).is_err(),
            "an object is no parameter value"
        );
    }
}
