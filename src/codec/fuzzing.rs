//! Entry points for the fuzz targets in fuzz/ (and the fuzz smoke tests): each feeds arbitrary bytes to a decoder
//! and checks that whatever it accepts is valid and survives re-encoding. None may panic.

use bytes::Bytes;
use prost::Message;

use super::rest::{self, RestRequest};
use super::{decthings, protobuf};
use crate::proto::ModelInferRequest;

/// The JSON request decoder.
pub fn json_request(data: &[u8]) {
    if let Ok(RestRequest::Request { request, .. }) = rest::decode_request(Bytes::copy_from_slice(data), None) {
        for input in &request.inputs {
            assert!(input.validate().is_ok(), "accepted an invalid tensor");
        }
        // Whatever was accepted encodes and decodes again.
        if let Ok(body) = rest::encode_request(&request, true) {
            let again = rest::decode_request(body.to_bytes(), body.header_length.map(|l| l as u64));
            assert!(again.is_ok(), "re-encoded request was rejected: {:?}", again.err());
        }
    }
}

/// The binary-extension parser: the first two bytes choose the header length.
pub fn binary_request(data: &[u8]) {
    let Some((prefix, body)) = data.split_first_chunk::<2>() else {
        return;
    };
    let header_length = u64::from(u16::from_le_bytes(*prefix)) % (body.len() as u64 + 2);
    let body = Bytes::copy_from_slice(body);
    if let Ok(RestRequest::Request {
        request,
        binary_outputs,
    }) = rest::decode_request(body, Some(header_length))
    {
        for input in &request.inputs {
            assert!(input.validate().is_ok(), "accepted an invalid tensor");
        }
        let response = crate::protocol::InferResponse {
            outputs: request.inputs,
            ..Default::default()
        };
        let encoded = rest::encode_response(&response, &binary_outputs);
        if let Ok(body) = encoded {
            let back = rest::decode_response(body.to_bytes(), body.header_length.map(|l| l as u64));
            assert!(back.is_ok(), "re-encoded response was rejected: {:?}", back.err());
        }
    }
}

/// The protobuf conversion.
pub fn protobuf_request(data: &[u8]) {
    let Ok(message) = ModelInferRequest::decode(Bytes::copy_from_slice(data)) else {
        return;
    };
    if let Ok(request) = protobuf::request_from_proto(message) {
        for input in &request.inputs {
            assert!(input.validate().is_ok(), "accepted an invalid tensor");
        }
        let again = protobuf::request_from_proto(protobuf::request_to_proto(request.clone()));
        assert_eq!(
            again.ok().as_ref(),
            Some(&request),
            "protobuf round trip changed the request"
        );
    }
}

/// The Decthings decoder.
pub fn decthings(data: &[u8]) {
    let bytes = Bytes::copy_from_slice(data);
    if let Ok(tensor) = decthings::decode(&bytes, "t") {
        assert!(tensor.validate().is_ok(), "accepted an invalid tensor");
        // Non-minimal varints decode but re-encode minimally, so compare tensors, not bytes.
        let encoded = decthings::encode(&tensor).expect("a decoded tensor encodes");
        let again = decthings::decode(&encoded, "t").expect("a re-encoded tensor decodes");
        assert_eq!(again, tensor, "Decthings round trip changed the tensor");
    }
    if let Ok(tensors) = decthings::decode_entries(&bytes) {
        let encoded = decthings::encode_entries(&tensors).expect("decoded entries encode");
        let again = decthings::decode_entries(&encoded).expect("re-encoded entries decode");
        assert_eq!(again, tensors, "Decthings entries round trip changed the tensors");
    }
}

/// The passthrough splicer: on canonically encoded messages (what real clients send) it agrees with prost, and a
/// renamed message decodes to the original with only the names changed. On anything else it must only not panic:
/// prost accepts some malformed framing (a map field with the wrong wire type) that the splicer reads by the spec.
pub fn splice(data: &[u8]) {
    use super::splice;
    let bytes = Bytes::copy_from_slice(data);
    let canonical = ModelInferRequest::decode(bytes.clone())
        .ok()
        .filter(|m| m.encode_to_vec() == data);
    let Ok(fields) = splice::model_fields(&bytes) else {
        assert!(canonical.is_none(), "the splicer rejected a canonical message");
        return;
    };
    let renamed = splice::rename(&bytes, "renamed", "9").expect("framing was already checked");
    let Some(mut original) = canonical else { return };
    assert_eq!(
        (fields.name, fields.version),
        (original.model_name.as_str(), original.model_version.as_str())
    );
    let renamed: Vec<u8> = renamed.concat();
    let mut again = ModelInferRequest::decode(&renamed[..]).expect("a renamed valid message decodes");
    original.model_name = "renamed".into();
    original.model_version = "9".into();
    again.model_name = "renamed".into();
    assert_eq!(again, original, "renaming changed more than the names");
}

/// Renaming a backend's JSON header on the passthrough path: never panics, always fills exactly the announced
/// length, and what it accepts stays valid JSON with the new names.
pub fn rename(data: &[u8]) {
    use super::rest::rename::{rename_header, renamed_length};
    let Some(length) = renamed_length(data.len(), "public", "7") else {
        return;
    };
    if let Ok(renamed) = rename_header(data, "public", "7", length) {
        assert_eq!(
            renamed.len(),
            length,
            "the renamed header does not fill the announced length"
        );
        if serde_json::from_slice::<serde_json::Value>(data).is_ok() {
            let value: serde_json::Value = serde_json::from_slice(&renamed).expect("renamed JSON stays JSON");
            assert_eq!(value["model_name"], "public");
            assert_eq!(value["model_version"], "7");
        }
    }
}
