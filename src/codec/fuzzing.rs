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
    let again = ModelInferRequest::decode(&renamed[..]).expect("a renamed valid message decodes");
    assert_eq!(
        (again.model_name.as_str(), again.model_version.as_str()),
        ("renamed", "9"),
        "the names asked for"
    );
    original.model_name = "renamed".into();
    original.model_version = "9".into();
    assert_eq!(again, original, "renaming changed more than the names");
}

/// A message's top-level fields as C++ protobuf reads them (`ReadTag`, `ReadSize` and `VarintParse` of its
/// parse_context.h): a key of at most five bytes whose bits above 32 are dropped, a length of at most five bytes
/// below 2 GiB, a varint of at most ten bytes; `None` where it refuses the message.
fn cpp_fields(message: &[u8]) -> Option<Vec<(u32, u8, std::ops::Range<usize>)>> {
    fn varint(bytes: &[u8], pos: &mut usize, most: u32) -> Option<u64> {
        let mut value = 0u64;
        for index in 0..most {
            let byte = *bytes.get(*pos)?;
            *pos += 1;
            value |= u64::from(byte & 0x7f).checked_shl(7 * index).unwrap_or(0);
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }
    let mut fields = Vec::new();
    let mut pos = 0;
    while pos < message.len() {
        // The bits above 32 dropped, as C++ drops them.
        let tag = u32::try_from(varint(message, &mut pos, 5)? & u64::from(u32::MAX)).ok()?;
        let (number, wire) = (tag >> 3, (tag & 7) as u8);
        if number == 0 {
            return None;
        }
        let mut start = pos;
        match wire {
            0 => {
                varint(message, &mut pos, 10)?;
            }
            1 => pos += 8,
            5 => pos += 4,
            2 => {
                let length = varint(message, &mut pos, 5)?;
                if length > u64::from(i32::MAX.unsigned_abs()) {
                    return None;
                }
                start = pos;
                pos = pos.checked_add(usize::try_from(length).ok()?)?;
            }
            // Groups are read by C++; the gateway refuses them, so they are never compared.
            _ => return None,
        }
        if pos > message.len() {
            return None;
        }
        fields.push((number, wire, start..pos));
    }
    Some(fields)
}

/// Whether C++ protobuf reads the fields of `message` where the gateway does, from the top level down through
/// the messages whose names and parameters the gateway reads (tensors, their parameters, map entries).
fn read_as_cpp_reads(message: &[u8], depth: u8) -> bool {
    use super::splice::field_places;
    let Ok(ours) = field_places(message) else {
        // The gateway refuses it: nothing of it reaches a backend.
        return true;
    };
    let Some(theirs) = cpp_fields(message) else {
        // C++ refuses it: the backend answers an error.
        return true;
    };
    if ours != theirs {
        return false;
    }
    // Down into the messages the gateway looks inside: top-level inputs (5) and outputs (6), their parameters
    // (4 and 2), each map entry's value (2).
    let inside: &[u32] = match depth {
        0 => &[4, 5, 6],
        1 => &[2, 4],
        _ => &[],
    };
    ours.iter()
        .filter(|(number, wire, _)| *wire == 2 && inside.contains(number))
        .all(|(_, _, value)| read_as_cpp_reads(&message[value.clone()], depth + 1))
}

/// The protobuf key reader against C++ protobuf's reading of keys and against prost: every field the gateway reads
/// where C++ reads one is the same field to both, and whatever message the gateway reads (names, request parameters,
/// shared memory refused), prost, where it decodes the message too, reads the same names and parameters and finds no
/// shared-memory parameter the gateway let through. (The real upb decoder of the `protobuf` Python package is held to
/// the same in the interop suite, scripts/interop.)
pub fn protobuf_keys(data: &[u8]) {
    use super::splice;
    use crate::protocol::reserved::SHARED_MEMORY;
    assert!(
        read_as_cpp_reads(data, 0),
        "the gateway reads fields where C++ protobuf reads others"
    );
    let (Ok(fields), Ok(parameters), Ok(())) = (
        splice::model_fields(data),
        splice::parameters(data),
        splice::refuse_shared_memory(data),
    ) else {
        return;
    };
    let Ok(decoded) = ModelInferRequest::decode(data) else {
        return;
    };
    assert_eq!(
        (fields.name, fields.version, fields.id),
        (
            decoded.model_name.as_str(),
            decoded.model_version.as_str(),
            decoded.id.as_str()
        ),
        "the gateway and prost read different names"
    );
    let theirs: crate::protocol::Parameters = decoded
        .parameters
        .into_iter()
        .filter_map(|(key, value)| Some((key, protobuf::value_from_proto(value.parameter_choice?))))
        .collect();
    let mut ours = parameters;
    ours.sort_keys();
    let mut theirs = theirs;
    theirs.sort_keys();
    // Compared as written out: a NaN parameter is the same parameter, though not equal to itself.
    assert_eq!(
        format!("{ours:?}"),
        format!("{theirs:?}"),
        "the gateway and prost read different request parameters"
    );
    let tensor_parameters = decoded
        .inputs
        .iter()
        .flat_map(|input| input.parameters.keys())
        .chain(decoded.outputs.iter().flat_map(|output| output.parameters.keys()));
    for key in tensor_parameters {
        assert!(
            !SHARED_MEMORY.contains(&key.as_str()),
            "prost reads {key} in a tensor the gateway let through"
        );
    }
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
