//! Reading and rewriting the model name (field 1) and version (field 2) of an encoded `ModelInferRequest` or
//! `ModelInferResponse` without decoding anything else: the gRPC passthrough path renames public names to a
//! backend's names and back while the tensors stay untouched bytes.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::{Error, Result};
use crate::protocol::{Parameters, reserved};

const MODEL_NAME: u64 = 1;
const MODEL_VERSION: u64 = 2;
/// `id`, in requests and responses alike.
const REQUEST_ID: u64 = 3;
/// `ModelStreamInferResponse`: `error_message`, then the `ModelInferResponse`.
const STREAM_ERROR_MESSAGE: u64 = 1;
const STREAM_INFER_RESPONSE: u64 = 2;
const PARAMETERS: u64 = 4;
const INPUTS: u64 = 5;
const OUTPUTS: u64 = 6;
/// The parameters field of an input tensor and of a requested output.
const INPUT_PARAMETERS: u64 = 4;
const OUTPUT_PARAMETERS: u64 = 2;
/// The name field of either.
const TENSOR_NAME: u64 = 1;

/// The model name, version and request id of an encoded message. Protobuf lets a field repeat; the last occurrence
/// wins.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelFields<'a> {
    pub name: &'a str,
    pub version: &'a str,
    pub id: &'a str,
}

/// Where a top-level field sits in the message.
struct Field {
    number: u64,
    wire_type: u64,
    /// The whole field: key, length and value.
    start: usize,
    end: usize,
    /// The value of a length-delimited field.
    value_start: usize,
}

#[inline]
fn varint(bytes: &[u8], pos: &mut usize) -> Result<u64> {
    // Nearly every key and length is one byte.
    if let Some(&byte) = bytes.get(*pos)
        && byte < 0x80
    {
        *pos += 1;
        return Ok(u64::from(byte));
    }
    long_varint(bytes, pos)
}

fn long_varint(bytes: &[u8], pos: &mut usize) -> Result<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes
            .get(*pos)
            .ok_or_else(|| Error::invalid("protobuf message ends inside a varint"))?;
        *pos += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(Error::invalid("protobuf varint is longer than 10 bytes"))
}

/// The most bytes of a key, or of a length, that C++ protobuf and upb read (a 32-bit varint's).
const MOST_KEY_BYTES: usize = 5;

/// A field's key read as prost, C++ protobuf and upb all read it, or refused where any of them would read it
/// otherwise or not at all: at most five bytes (C++ and upb stop there; prost reads ten), a value within 32 bits (C++
/// drops the bits above, so a key prost and the gateway once took as field 536870913 is field 1 to Triton), a field
/// number from 1, and a wire type the V2 messages use (no groups, nor 6 and 7, which none of them reads).
#[inline]
pub fn key(bytes: &[u8], pos: &mut usize) -> Result<(u32, u8)> {
    let start = *pos;
    let key = varint(bytes, pos)?;
    if *pos - start > MOST_KEY_BYTES {
        return Err(Error::invalid(format!(
            "a protobuf field key of {} bytes (C++ protobuf reads at most {MOST_KEY_BYTES})",
            *pos - start
        )));
    }
    let key =
        u32::try_from(key).map_err(|_| Error::invalid(format!("a protobuf field key beyond 32 bits ({key:#x})")))?;
    let (number, wire_type) = (key >> 3, (key & 7) as u8);
    if number == 0 {
        return Err(Error::invalid("protobuf field number 0"));
    }
    if !matches!(wire_type, 0 | 1 | 2 | 5) {
        return Err(Error::invalid(format!(
            "protobuf wire type {wire_type} (field {number}) is not supported"
        )));
    }
    Ok((number, wire_type))
}

/// A length-delimited field's length, held to what C++ protobuf reads: at most five bytes, below 2 GiB.
fn length(bytes: &[u8], pos: &mut usize) -> Result<u64> {
    let start = *pos;
    let length = varint(bytes, pos)?;
    if *pos - start > MOST_KEY_BYTES || length > u64::from(i32::MAX.unsigned_abs()) {
        return Err(Error::invalid("a protobuf length C++ protobuf does not read"));
    }
    Ok(length)
}

/// Walks the top-level fields, checking only their framing (keys as every decoder reads them).
fn fields(message: &[u8]) -> impl Iterator<Item = Result<Field>> + '_ {
    let mut pos = 0;
    std::iter::from_fn(move || {
        if pos >= message.len() {
            return None;
        }
        let start = pos;
        let field = (|| {
            let (number, wire_type) = key(message, &mut pos)?;
            let mut value_start = pos;
            match wire_type {
                0 => {
                    varint(message, &mut pos)?;
                }
                1 => pos += 8,
                5 => pos += 4,
                _ => {
                    let length = length(message, &mut pos)?;
                    value_start = pos;
                    pos = usize::try_from(length)
                        .ok()
                        .and_then(|l| pos.checked_add(l))
                        .unwrap_or(usize::MAX);
                }
            }
            if pos > message.len() {
                return Err(Error::invalid("protobuf field runs past the end of the message"));
            }
            Ok(Field {
                number: u64::from(number),
                wire_type: u64::from(wire_type),
                start,
                end: pos,
                value_start,
            })
        })();
        if field.is_err() {
            pos = message.len();
        }
        Some(field)
    })
}

/// The top-level fields of `message` as the gateway reads them: number, wire type and where a length-delimited
/// value lies (for the differential checks of the key reader).
#[cfg(any(test, feature = "fuzzing"))]
pub fn field_places(message: &[u8]) -> Result<Vec<(u32, u8, std::ops::Range<usize>)>> {
    fields(message)
        .map(|field| {
            let field = field?;
            // Numbers and wire types were read as 32-bit keys.
            let number = u32::try_from(field.number).unwrap_or(u32::MAX);
            let wire_type = u8::try_from(field.wire_type).unwrap_or(u8::MAX);
            Ok((number, wire_type, field.value_start..field.end))
        })
        .collect()
}

fn text_of<'a>(message: &'a [u8], field: &Field, what: &str) -> Result<&'a str> {
    if field.wire_type != 2 {
        return Err(Error::invalid(format!("{what} is not encoded as a string")));
    }
    std::str::from_utf8(&message[field.value_start..field.end])
        .map_err(|_| Error::invalid(format!("{what} is not valid UTF-8")))
}

/// Reads the model name and version, checking the framing of every top-level field (not their contents).
pub fn model_fields(message: &[u8]) -> Result<ModelFields<'_>> {
    let mut found = ModelFields::default();
    for field in fields(message) {
        let field = field?;
        match field.number {
            MODEL_NAME => found.name = text_of(message, &field, "model_name")?,
            MODEL_VERSION => found.version = text_of(message, &field, "model_version")?,
            REQUEST_ID => found.id = text_of(message, &field, "id")?,
            _ => {}
        }
    }
    Ok(found)
}

/// The request-level parameters of an encoded `ModelInferRequest`, decoding nothing else (tensors stay bytes).
pub fn parameters(message: &[u8]) -> Result<Parameters> {
    let mut parameters = Parameters::new();
    for field in fields(message) {
        let field = field?;
        if field.number != PARAMETERS {
            continue;
        }
        if field.wire_type != 2 {
            return Err(Error::invalid("parameters is not encoded as a map"));
        }
        let (key, value) = parameter_entry(&message[field.value_start..field.end], "request")?;
        keep_entry(&mut parameters, key, value);
    }
    Ok(parameters)
}

/// One entry of a request's `parameters` map, kept as protobuf decoders keep it: a key given twice keeps its last
/// value; an entry with no value set is dropped.
fn keep_entry(parameters: &mut Parameters, key: &str, value: Option<crate::proto::InferParameter>) {
    match value.and_then(|value| value.parameter_choice) {
        Some(choice) => {
            parameters.insert(key.to_owned(), super::protobuf::value_from_proto(choice));
        }
        None => {
            parameters.shift_remove(key);
        }
    }
}

/// How many bytes of an encoded `ModelInferRequest`'s start hold its leading fields, everything before its tensors
/// (the first field that is not its name, version, id or parameters): `None` while `start` ends inside them and is
/// not the whole message. Encoders write fields in number order, so the tensors come last; a reader that picks an
/// endpoint before the tensors arrive (`oipgate epp`) reads only this much.
pub fn leading_length(start: &[u8], whole: bool) -> Result<Option<usize>> {
    let mut pos = 0;
    while pos < start.len() {
        let field_start = pos;
        let truncated = |error: Error| if whole { Err(error) } else { Ok(None) };
        let (number, wire_type) = match key(start, &mut pos) {
            Ok(key) => key,
            Err(_) if !whole && start.len() - field_start < MOST_KEY_BYTES => return Ok(None),
            Err(error) => return Err(error),
        };
        if !matches!(u64::from(number), MODEL_NAME | MODEL_VERSION | REQUEST_ID | PARAMETERS) {
            return Ok(Some(field_start));
        }
        match wire_type {
            0 => {
                if let Err(error) = varint(start, &mut pos) {
                    return truncated(error);
                }
            }
            1 => pos += 8,
            5 => pos += 4,
            _ => {
                let length = match length(start, &mut pos) {
                    Ok(length) => length,
                    Err(error) if start.len() - pos >= MOST_KEY_BYTES => return Err(error),
                    Err(error) => return truncated(error),
                };
                pos = usize::try_from(length)
                    .ok()
                    .and_then(|l| pos.checked_add(l))
                    .unwrap_or(usize::MAX);
            }
        }
        if pos > start.len() {
            return truncated(Error::invalid("protobuf field runs past the end of the message"));
        }
    }
    Ok(whole.then_some(start.len()))
}

/// One entry of a `parameters` map (`kind` names whose, in errors), its keys read as every decoder reads them: its
/// name (field 1, the last given) and its value (field 2, merged as protobuf merges a message given twice).
fn parameter_entry<'a>(entry: &'a [u8], kind: &str) -> Result<(&'a str, Option<crate::proto::InferParameter>)> {
    let invalid = |what: &dyn std::fmt::Display| Error::invalid(format!("invalid {kind} parameter: {what}"));
    let mut key = "";
    let mut value: Option<crate::proto::InferParameter> = None;
    for field in fields(entry) {
        let field = field.map_err(|error| invalid(&error.message()))?;
        match (field.number, field.wire_type) {
            (1, 2) => key = text_of(entry, &field, "a parameter name").map_err(|e| invalid(&e.message()))?,
            (2, 2) => {
                let bytes = &entry[field.value_start..field.end];
                // The value's own keys, as the entry's.
                for inner in fields(bytes) {
                    inner.map_err(|error| invalid(&error.message()))?;
                }
                let merged = value.get_or_insert_with(Default::default);
                prost::Message::merge(merged, bytes).map_err(|error| invalid(&error))?;
            }
            (1 | 2, _) => return Err(invalid(&"a map entry field with the wrong wire type")),
            _ => {}
        }
    }
    Ok((key, value))
}

/// The request-level parameters of an encoded `ModelInferRequest`, read in the same walk that refuses a request
/// whose inputs, requested outputs or own parameters point at shared memory (of tensors only their names and their
/// parameters' names are read; contents are skipped).
pub fn parameters_refusing_shared_memory(message: &[u8]) -> Result<Parameters> {
    let mut parameters = Parameters::new();
    for field in fields(message) {
        let field = field?;
        let (kind, parameters_field) = match field.number {
            INPUTS => ("input", INPUT_PARAMETERS),
            OUTPUTS => ("output", OUTPUT_PARAMETERS),
            PARAMETERS => {
                if field.wire_type != 2 {
                    return Err(Error::invalid("parameters is not encoded as a map"));
                }
                let (key, value) = parameter_entry(&message[field.value_start..field.end], "request")?;
                // The request's own parameters hold no shared memory either.
                if reserved::SHARED_MEMORY.contains(&key) {
                    return Err(reserved::shared_memory_anywhere(key));
                }
                keep_entry(&mut parameters, key, value);
                continue;
            }
            _ => continue,
        };
        if field.wire_type != 2 {
            return Err(Error::invalid(format!("an {kind} is not encoded as a message")));
        }
        let tensor = &message[field.value_start..field.end];
        let mut name = "";
        let mut shared = None;
        for inner in fields(tensor) {
            let inner = inner?;
            if inner.number == TENSOR_NAME {
                name = text_of(tensor, &inner, "a tensor name")?;
            } else if inner.number == parameters_field && inner.wire_type == 2 {
                let (key, _) = parameter_entry(&tensor[inner.value_start..inner.end], kind)?;
                if reserved::SHARED_MEMORY.contains(&key) {
                    shared = Some(key);
                }
            }
        }
        if let Some(parameter) = shared {
            return Err(reserved::shared_memory_error(kind, name, parameter));
        }
    }
    Ok(parameters)
}

/// An encoded Triton `ModelConfig` with its name (field 1) replaced and every other field kept as it came, whatever
/// it holds.
pub fn rename_model_config(config: &[u8], name: &str) -> Result<Bytes> {
    let mut out = BytesMut::with_capacity(config.len() + name.len() + 8);
    put_string_field(&mut out, MODEL_NAME, name);
    for field in fields(config) {
        let field = field?;
        if field.number != MODEL_NAME {
            out.put_slice(&config[field.start..field.end]);
        }
    }
    Ok(out.freeze())
}

fn put_string_field(out: &mut BytesMut, number: u64, value: &str) {
    if value.is_empty() {
        return;
    }
    prost::encoding::encode_varint(number << 3 | 2, out);
    prost::encoding::encode_varint(value.len() as u64, out);
    out.put_slice(value.as_bytes());
}

/// The message with its model name and version replaced, as chunks: the new fields first, then the rest of the
/// original message as slices of it (tensor bytes are never copied). An empty `version` leaves the field out. A
/// message that already names them is given back as it is.
pub fn rename(message: &Bytes, name: &str, version: &str) -> Result<Vec<Bytes>> {
    // One walk reads the names (as `model_fields` does) and keeps the slices between their fields: encoders write
    // the names first, so for most messages there are none, and nothing is made when the names already match.
    let (mut current_name, mut current_version) = ("", "");
    let mut kept = Vec::new();
    let mut kept_from = 0;
    for field in fields(message) {
        let field = field?;
        match field.number {
            MODEL_NAME => current_name = text_of(message, &field, "model_name")?,
            MODEL_VERSION => current_version = text_of(message, &field, "model_version")?,
            REQUEST_ID => {
                text_of(message, &field, "id")?;
                continue;
            }
            _ => continue,
        }
        if field.start > kept_from {
            kept.push(message.slice(kept_from..field.start));
        }
        kept_from = field.end;
    }
    if current_name == name && current_version == version {
        return Ok(vec![message.clone()]);
    }
    let mut head = BytesMut::with_capacity(name.len() + version.len() + 8);
    put_string_field(&mut head, MODEL_NAME, name);
    put_string_field(&mut head, MODEL_VERSION, version);
    let mut chunks = Vec::with_capacity(kept.len() + 2);
    chunks.push(head.freeze());
    chunks.extend(kept);
    if kept_from < message.len() {
        chunks.push(message.slice(kept_from..));
    }
    Ok(chunks)
}

/// An encoded `ModelStreamInferResponse` of an error message and an encoded `ModelInferResponse` given as chunks,
/// which stay as they are.
pub fn stream_response(error_message: &str, infer_response: Vec<Bytes>) -> Vec<Bytes> {
    let length: usize = infer_response.iter().map(Bytes::len).sum();
    let mut head = BytesMut::with_capacity(error_message.len() + 16);
    put_string_field(&mut head, STREAM_ERROR_MESSAGE, error_message);
    prost::encoding::encode_varint(STREAM_INFER_RESPONSE << 3 | 2, &mut head);
    prost::encoding::encode_varint(length as u64, &mut head);
    let mut chunks = Vec::with_capacity(infer_response.len() + 1);
    chunks.push(head.freeze());
    chunks.extend(infer_response);
    chunks
}

/// An encoded `ModelStreamInferResponse` with its response's model name and version replaced (an empty `version`
/// leaves the field out); tensors are slices of the original. The error message and anything else stay.
pub fn rename_stream_response(message: &Bytes, name: &str, version: &str) -> Result<Vec<Bytes>> {
    let mut error_message = "";
    let mut renamed = None;
    for field in fields(message) {
        let field = field?;
        match field.number {
            STREAM_ERROR_MESSAGE => error_message = text_of(message, &field, "error_message")?,
            STREAM_INFER_RESPONSE if field.wire_type == 2 => {
                let response = message.slice(field.value_start..field.end);
                renamed = Some(rename(&response, name, version)?);
            }
            _ => {}
        }
    }
    Ok(match renamed {
        Some(response) => stream_response(error_message, response),
        None => vec![message.clone()],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{ModelInferRequest, ModelInferResponse};
    use prost::Message;

    fn join(chunks: &[Bytes]) -> Vec<u8> {
        chunks.concat()
    }

    #[test]
    fn stream_responses_are_renamed_inside() {
        use crate::proto::ModelStreamInferResponse;
        let response = ModelInferResponse {
            model_name: "upstream".into(),
            model_version: "3".into(),
            id: "r".into(),
            raw_output_contents: vec![Bytes::from(vec![7u8; 300])],
            ..Default::default()
        };
        let wire = Bytes::from(
            ModelStreamInferResponse {
                error_message: String::new(),
                infer_response: Some(response.clone()),
            }
            .encode_to_vec(),
        );
        let renamed = rename_stream_response(&wire, "public", "1").unwrap();
        let decoded = ModelStreamInferResponse::decode(&join(&renamed)[..]).unwrap();
        let expected = ModelInferResponse {
            model_name: "public".into(),
            model_version: "1".into(),
            ..response
        };
        assert_eq!(decoded.infer_response, Some(expected));
        assert!(
            renamed
                .iter()
                .any(|chunk| chunk.len() >= 300 && wire.as_ptr_range().contains(&chunk.as_ptr())),
            "the tensor is a slice of what came"
        );
        // An error keeps its message and its request's id.
        let failed = stream_response(
            "no such model",
            vec![Bytes::from(
                ModelInferResponse {
                    id: "q".into(),
                    ..Default::default()
                }
                .encode_to_vec(),
            )],
        );
        let decoded = ModelStreamInferResponse::decode(&join(&failed)[..]).unwrap();
        assert_eq!(decoded.error_message, "no such model");
        assert_eq!(decoded.infer_response.unwrap().id, "q");
        assert!(rename_stream_response(&Bytes::from_static(b"\x12\x05ab"), "m", "").is_err());
    }

    #[test]
    fn reads_and_renames_a_request_without_touching_tensors() {
        let request = ModelInferRequest {
            model_name: "public".into(),
            model_version: "1".into(),
            id: "r".into(),
            raw_input_contents: vec![Bytes::from(vec![9u8; 1000])],
            ..Default::default()
        };
        let wire = Bytes::from(request.encode_to_vec());
        assert_eq!(
            model_fields(&wire).unwrap(),
            ModelFields {
                name: "public",
                version: "1",
                id: "r"
            }
        );
        let chunks = rename(&wire, "backend-name", "7").unwrap();
        // The rest of the message is one slice of the original.
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[1].as_ptr(), wire[11..].as_ptr());
        let renamed = ModelInferRequest::decode(&join(&chunks)[..]).unwrap();
        assert_eq!(renamed.model_name, "backend-name");
        assert_eq!(renamed.model_version, "7");
        assert_eq!(renamed.id, "r");
        assert_eq!(renamed.raw_input_contents, request.raw_input_contents);
        let unversioned = ModelInferRequest::decode(&join(&rename(&wire, "x", "").unwrap())[..]).unwrap();
        assert_eq!(unversioned.model_version, "");
        // Already named so: the message itself, untouched.
        let same = rename(&wire, "public", "1").unwrap();
        assert_eq!(same.len(), 1);
        assert_eq!((same[0].as_ptr(), same[0].len()), (wire.as_ptr(), wire.len()));
    }

    #[test]
    fn repeated_and_late_fields_follow_protobuf_rules() {
        // model_name twice, the second after other fields: the last one wins, and both are replaced.
        let mut wire = ModelInferResponse {
            model_name: "first".into(),
            id: "i".into(),
            ..Default::default()
        }
        .encode_to_vec();
        wire.extend_from_slice(
            &ModelInferResponse {
                model_name: "second".into(),
                ..Default::default()
            }
            .encode_to_vec(),
        );
        let wire = Bytes::from(wire);
        assert_eq!(model_fields(&wire).unwrap().name, "second");
        assert_eq!(ModelInferResponse::decode(&wire[..]).unwrap().model_name, "second");
        let renamed = ModelInferResponse::decode(&join(&rename(&wire, "public", "3").unwrap())[..]).unwrap();
        assert_eq!(
            (
                renamed.model_name.as_str(),
                renamed.model_version.as_str(),
                renamed.id.as_str()
            ),
            ("public", "3", "i")
        );
    }

    /// `value` as a varint of exactly `bytes` bytes (padded with continuation bytes), with `extra` bits set above
    /// the 32 a key may have (only where the fifth byte can carry them).
    fn varint_of(value: u64, bytes: usize, extra: u8) -> Vec<u8> {
        let mut out = Vec::new();
        let mut rest = value;
        for index in 0..bytes {
            let mut byte = (rest & 0x7f) as u8;
            rest >>= 7;
            if index == 4 {
                byte |= extra << 4;
            }
            if index + 1 < bytes {
                byte |= 0x80;
            }
            out.push(byte);
        }
        out
    }

    fn with_name_key(key: Vec<u8>, name: &str) -> Vec<u8> {
        let mut message = key;
        message.push(u8::try_from(name.len()).unwrap());
        message.extend_from_slice(name.as_bytes());
        message
    }

    #[test]
    fn field_keys_are_read_as_cpp_protobuf_and_upb_read_them_or_refused() {
        let name_key = 1 << 3 | 2;
        // Padded within five bytes: model_name to every decoder.
        for bytes in 1..=5 {
            let message = with_name_key(varint_of(name_key, bytes, 0), "m");
            assert_eq!(model_fields(&message).unwrap().name, "m", "{bytes} bytes");
            assert_eq!(ModelInferRequest::decode(&message[..]).unwrap().model_name, "m");
        }
        // Longer: prost reads model_name, C++ and upb refuse the message; so does the gateway.
        for bytes in 6..=10 {
            let message = with_name_key(varint_of(name_key, bytes, 0), "m");
            assert_eq!(ModelInferRequest::decode(&message[..]).unwrap().model_name, "m");
            let error = model_fields(&message).unwrap_err();
            assert!(
                error.message().contains("C++ protobuf reads at most 5"),
                "{}",
                error.message()
            );
        }
        // Bits above 32 in the fifth byte: C++ drops them and reads model_name; the old reading took field
        // 536870913 (an unknown field, skipped), so a caller could name one model to the gateway and another to
        // Triton.
        for extra in 1..8 {
            let message = with_name_key(varint_of(name_key, 5, extra), "other");
            let error = model_fields(&message).unwrap_err();
            assert!(error.message().contains("beyond 32 bits"), "{}", error.message());
        }
        // Field number 0 (a key of 2), groups and the wire types no decoder reads.
        for key in [2u64, 1 << 3 | 3, 1 << 3 | 4, 1 << 3 | 6, 1 << 3 | 7] {
            assert!(
                model_fields(&with_name_key(varint_of(key, 1, 0), "m")).is_err(),
                "{key:#x}"
            );
        }
        // A length of six bytes, which C++ does not read.
        let mut message = varint_of(name_key, 1, 0);
        message.extend(varint_of(1, 6, 0));
        message.push(b'm');
        assert!(model_fields(&message).is_err());
    }

    #[test]
    fn shared_memory_in_an_input_is_found_whatever_shape_its_keys_take_or_the_message_is_refused() {
        use crate::proto::model_infer_request::InferInputTensor;
        use crate::proto::{InferParameter, infer_parameter::ParameterChoice};
        let input = InferInputTensor {
            name: "x".into(),
            parameters: [(
                "shared_memory_region".to_owned(),
                InferParameter {
                    parameter_choice: Some(ParameterChoice::StringParam("r".into())),
                },
            )]
            .into_iter()
            .collect(),
            ..Default::default()
        };
        let input = input.encode_to_vec();
        assert!(input.starts_with(&[0x0a]), "the input's name first");
        // The input's parameters field (4) with its key written in five bytes, with and without bits above 32.
        let name_field = &input[..3];
        let parameters_field = &input[3..];
        assert_eq!(parameters_field[0], 4 << 3 | 2);
        for (extra, refused_for) in [(0u8, "sets shared_memory_region"), (1, "beyond 32 bits")] {
            let mut tensor = name_field.to_vec();
            tensor.extend(varint_of(4 << 3 | 2, 5, extra));
            tensor.extend_from_slice(&parameters_field[1..]);
            let mut message = vec![5 << 3 | 2, u8::try_from(tensor.len()).unwrap()];
            message.extend(tensor);
            let error = parameters_refusing_shared_memory(&message).unwrap_err();
            assert!(error.message().contains(refused_for), "{extra}: {}", error.message());
        }
    }

    #[test]
    fn broken_framing_is_an_error() {
        let cases: [&[u8]; 7] = [
            &[0x0a, 0x05, b'a'],
            &[0x0a],
            &[0x80],
            &[0x00, 0x01],
            &[0x0b],
            &[0x0a, 0x01, 0xff],
            &[0x08, 0x01],
        ];
        for bad in cases {
            assert!(model_fields(bad).is_err(), "{bad:?}");
        }
        assert!(rename(&Bytes::from_static(&[0x0a, 0x05, b'a']), "x", "").is_err());
        assert_eq!(model_fields(&[]).unwrap(), ModelFields::default());
    }
}
