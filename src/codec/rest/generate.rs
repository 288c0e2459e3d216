//! Triton's generate extension bodies. A request is one JSON object whose members other than `parameters` are the
//! model's inputs by name, each a scalar or a flat list, its datatype and shape taken from the model's metadata; a
//! response is one object with the outputs as members (a scalar when the output has one element, else a flat list)
//! beside `model_name` and `model_version`.

use std::collections::BTreeMap;

use serde_json::value::RawValue;

use super::data::parse_data;
use super::format::{write_data, write_json_string};
use super::params::{read_parameters, write_parameters};
use super::reader::JsonReader;
use crate::error::{Error, Result};
use crate::protocol::{DataType, InferRequest, InferResponse, ModelMetadata, Parameters, Tensor, TensorMetadata};

/// The request a generate body stands for, its inputs typed and shaped by `model`'s metadata.
pub fn decode_generate(body: &[u8], model: &ModelMetadata) -> Result<InferRequest> {
    let members: BTreeMap<String, &RawValue> = serde_json::from_slice(body).map_err(|e| {
        Error::invalid(format!(
            "a generate body is one JSON object of the model's inputs by name (and `parameters`): {e}"
        ))
    })?;
    let mut request = InferRequest {
        model_name: model.name.clone(),
        ..InferRequest::default()
    };
    for (name, value) in members {
        let text = value.get().as_bytes();
        if name == "parameters" {
            let mut reader = JsonReader::new(text);
            request.parameters = read_parameters(&mut reader)?;
            reader.end()?;
            continue;
        }
        let Some(input) = model.inputs.iter().find(|input| input.name == name) else {
            let names: Vec<&str> = model.inputs.iter().map(|input| input.name.as_str()).collect();
            return Err(Error::invalid(format!(
                "field '{name}' matches no input of model '{}', which takes {}",
                model.name,
                names.join(", ")
            )));
        };
        request.inputs.push(tensor(name, value, input, &model.name)?);
    }
    Ok(request)
}

/// A member of a generate body or answer as the tensor `meta` describes.
fn tensor(name: String, value: &RawValue, meta: &TensorMetadata, model: &str) -> Result<Tensor> {
    let datatype = DataType::parse(&meta.datatype)?;
    let count = element_count(value).map_err(|why| Error::invalid(format!("field '{name}': {why}")))?;
    let shape = shape_for(&meta.shape, count).ok_or_else(|| {
        Error::invalid(format!(
            "field '{name}' holds {count} elements, which do not fit tensor '{name}' of model '{model}' (shape {:?})",
            meta.shape
        ))
    })?;
    let data = parse_data(value.get().as_bytes(), datatype, count)
        .map_err(|e| Error::invalid(format!("field '{name}' is not {datatype}: {}", e.message())))?;
    Tensor::new(name, datatype, shape, data)
}

/// The `parameters` of a streaming call's body (a generate body or an inference request), every other member
/// skipped unread: what routing needs (a sequence) before the body is decoded with the chosen version's metadata, or
/// relayed as it came.
pub fn body_parameters(body: &[u8]) -> Result<Parameters> {
    let mut reader = JsonReader::new(body);
    let mut parameters = Parameters::default();
    let mut members = reader
        .object()
        .map_err(|e| Error::invalid(format!("the body must be one JSON object: {}", e.message())))?;
    while let Some(key) = members.next(&mut reader)? {
        if key.as_ref() == "parameters" {
            parameters = read_parameters(&mut reader)?;
        } else {
            reader.skip_value()?;
        }
    }
    Ok(parameters)
}

/// A generate body for `request`: its inputs as members, flat, and its parameters.
pub fn encode_generate_request(request: &InferRequest) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(64 + request.inputs.iter().map(|t| t.data.len() * 4).sum::<usize>());
    out.push(b'{');
    write_tensors(&mut out, &request.inputs)?;
    if request.parameters.is_empty() {
        if out.last() == Some(&b',') {
            out.pop();
        }
    } else {
        out.extend_from_slice(b"\"parameters\":");
        write_parameters(&mut out, &request.parameters);
    }
    out.push(b'}');
    Ok(out)
}

/// A generate answer (one response, or one event of a stream) read back as the response it stands for, its
/// outputs typed and shaped by `model`'s metadata. An `{"error"}` event is that error.
pub fn decode_generate_response(json: &[u8], model: &ModelMetadata) -> Result<InferResponse> {
    let members: BTreeMap<String, &RawValue> = serde_json::from_slice(json)
        .map_err(|e| Error::invalid(format!("a generate answer is one JSON object: {e}")))?;
    if let Some(error) = members.get("error") {
        let message: String = serde_json::from_str(error.get()).unwrap_or_else(|_| error.get().to_owned());
        return Err(Error::invalid(message));
    }
    let mut response = InferResponse {
        model_name: model.name.clone(),
        ..InferResponse::default()
    };
    for (name, value) in members {
        match name.as_str() {
            "model_name" | "model_version" | "id" | "parameters" => continue,
            _ => {}
        }
        let Some(output) = model.outputs.iter().find(|output| output.name == name) else {
            return Err(Error::invalid(format!(
                "member '{name}' is no output of model '{}'",
                model.name
            )));
        };
        response.outputs.push(tensor(name, value, output, &model.name)?);
    }
    Ok(response)
}

/// The tokens one generate answer (a response, or one event of a stream) carries, for token budgets: the elements of
/// its outputs (a scalar is one, a list its length), or of `output` alone when named; with `holds_count`, that
/// output's value is the number of tokens (Triton's vLLM backend's `num_output_tokens`). Anything that is no
/// object of outputs (an error event, a broken answer) carries none.
pub fn answer_tokens(json: &[u8], output: Option<&str>, holds_count: bool) -> u64 {
    let Ok(members) = serde_json::from_slice::<BTreeMap<String, &RawValue>>(json) else {
        return 0;
    };
    if members.contains_key("error") {
        return 0;
    }
    let counted = members.iter().filter(|(name, _)| match output {
        Some(output) => name.as_str() == output,
        None => !matches!(name.as_str(), "model_name" | "model_version" | "id" | "parameters"),
    });
    counted
        .map(|(_, value)| {
            if holds_count {
                count_value(value)
            } else {
                element_count(value).unwrap_or(1)
            }
        })
        .fold(0, u64::saturating_add)
}

/// A count written as a number or a list of numbers (their sum); anything else counts none.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn count_value(value: &RawValue) -> u64 {
    let as_count = |number: &serde_json::Value| {
        number
            .as_u64()
            .or_else(|| {
                number
                    .as_f64()
                    .filter(|f| f.is_finite() && *f >= 0.0)
                    .map(|f| f.round() as u64)
            })
            .unwrap_or(0)
    };
    match serde_json::from_str::<serde_json::Value>(value.get()) {
        Ok(serde_json::Value::Array(items)) => items.iter().map(as_count).fold(0, u64::saturating_add),
        Ok(number) => as_count(&number),
        Err(_) => 0,
    }
}

/// The most bytes a server-sent event of a generate stream may hold: the bound of a whole `generate` answer.
pub const MOST_EVENT_BYTES: usize = 64 << 20;

/// The server-sent events of a stream, read as its bytes arrive: the data of each event once it is whole, whatever
/// chunks carried it. Each byte is searched once for an event's end, and no event is held past `most` bytes: a
/// longer one stops the reading (`too_long`), as the stream cannot be read on. Events without data (comments,
/// keep-alives) are skipped.
#[derive(Debug)]
pub struct EventReader {
    /// The start of an event still arriving.
    pending: Vec<u8>,
    /// How much of `pending` has been searched for an event's end: all but its last byte, which may be an end's first.
    searched: usize,
    most: usize,
    too_long: bool,
}

impl EventReader {
    pub fn new(most: usize) -> EventReader {
        EventReader {
            pending: Vec::new(),
            searched: 0,
            most,
            too_long: false,
        }
    }

    /// Reads `chunk`: the data of each event it ended, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Vec<u8>> {
        let mut events = Vec::new();
        if self.too_long {
            return events;
        }
        self.pending.extend_from_slice(chunk);
        let mut start = 0;
        while let Some(at) = memchr::memmem::find(&self.pending[self.searched..], b"\n\n") {
            let end = self.searched + at;
            let text = &self.pending[start..end];
            if let Some(data) = text.strip_prefix(b"data: ").or_else(|| text.strip_prefix(b"data:")) {
                events.push(data.to_vec());
            }
            start = end + 2;
            self.searched = start;
        }
        self.pending.drain(..start);
        self.searched = self.pending.len().saturating_sub(1);
        if self.pending.len() > self.most {
            self.too_long = true;
            self.pending = Vec::new();
            self.searched = 0;
        }
        events
    }

    /// Whether an event grew past the bound: nothing more is read.
    pub fn too_long(&self) -> bool {
        self.too_long
    }

    /// The start of an event still arriving.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }
}

/// Tensors as generate members: a scalar for one element, else a flat list; each followed by a comma.
fn write_tensors(out: &mut Vec<u8>, tensors: &[Tensor]) -> Result<()> {
    for tensor in tensors {
        write_json_string(out, &tensor.name);
        out.push(b':');
        let start = out.len();
        write_data(out, tensor.datatype, &tensor.data)?;
        if tensor.element_count()? == 1 {
            // `[x]` becomes `x`.
            out.pop();
            out.remove(start);
        }
        out.push(b',');
    }
    Ok(())
}

/// The elements of a scalar or a flat list; nested lists are refused, as Triton refuses them.
fn element_count(value: &RawValue) -> std::result::Result<u64, String> {
    let text = value.get().trim_start();
    if !text.starts_with('[') {
        return Ok(1);
    }
    let list: Vec<&RawValue> = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if list
        .iter()
        .any(|element| element.get().trim_start().starts_with(['[', '{']))
    {
        return Err("a generate input is a scalar or a flat list".to_owned());
    }
    Ok(list.len() as u64)
}

/// The shape `count` elements take in an input of shape `dims` (`-1` for any size): every variable dimension is 1
/// but the last, which takes what the fixed ones leave.
fn shape_for(dims: &[i64], count: u64) -> Option<Vec<u64>> {
    let fixed: u64 = dims.iter().filter(|&&d| d >= 0).map(|&d| d.unsigned_abs()).product();
    let last_variable = dims.iter().rposition(|&d| d < 0);
    let shape: Vec<u64> = dims
        .iter()
        .enumerate()
        .map(|(i, &d)| match (d >= 0, Some(i) == last_variable) {
            (true, _) => d.unsigned_abs(),
            (false, true) => count.checked_div(fixed).unwrap_or(0),
            (false, false) => 1,
        })
        .collect();
    let total: u64 = shape.iter().product();
    (total == count).then_some(shape)
}

/// One response as Triton's generate writes it; `None` for a response without outputs (a decoupled model's empty
/// final response), which Triton does not send as an event.
pub fn encode_generate(response: &InferResponse) -> Result<Option<Vec<u8>>> {
    if response.outputs.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(64 + response.outputs.iter().map(|t| t.data.len() * 4).sum::<usize>());
    out.push(b'{');
    write_tensors(&mut out, &response.outputs)?;
    out.extend_from_slice(b"\"model_name\":");
    write_json_string(&mut out, &response.model_name);
    out.extend_from_slice(b",\"model_version\":");
    write_json_string(&mut out, response.model_version.as_deref().unwrap_or(""));
    out.push(b'}');
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn an_answers_tokens_are_its_outputs_elements_or_the_count_it_names() {
        let answer = br#"{"model_name":"llm","model_version":"1","id":"7","text_output":"Hello","ids":[5,6,7],"num_output_tokens":3,"parameters":{"x":1}}"#;
        // Every output: one text, three ids, one count.
        assert_eq!(answer_tokens(answer, None, false), 5);
        assert_eq!(answer_tokens(answer, Some("ids"), false), 3);
        assert_eq!(answer_tokens(answer, Some("num_output_tokens"), true), 3);
        assert_eq!(
            answer_tokens(br#"{"num_output_tokens":[2,2.4]}"#, Some("num_output_tokens"), true),
            4
        );
        // An error event, an answer without the output, and what is no object carry none.
        assert_eq!(answer_tokens(br#"{"error":"broken","x":[1,2]}"#, None, false), 0);
        assert_eq!(answer_tokens(answer, Some("absent"), false), 0);
        assert_eq!(answer_tokens(b"[1,2,3]", None, false), 0);
    }

    fn metadata() -> ModelMetadata {
        let tensor = |name: &str, datatype: &str, shape: Vec<i64>| TensorMetadata {
            name: name.into(),
            datatype: datatype.into(),
            shape,
        };
        ModelMetadata {
            name: "m".into(),
            inputs: vec![
                tensor("TEXT", "BYTES", vec![1]),
                tensor("ROWS", "INT32", vec![-1, 4]),
                tensor("N", "INT32", vec![1]),
            ],
            ..ModelMetadata::default()
        }
    }

    #[test]
    fn inputs_take_their_types_and_shapes_from_the_metadata() {
        let body = br#"{"TEXT": "hi", "ROWS": [1, 2, 3, 4, 5, 6, 7, 8], "N": 3, "parameters": {"max_tokens": 5}}"#;
        let request = decode_generate(body, &metadata()).unwrap();
        let by_name = |name: &str| request.inputs.iter().find(|t| t.name == name).unwrap();
        assert_eq!(
            (by_name("TEXT").datatype, &by_name("TEXT").shape),
            (DataType::Bytes, &vec![1])
        );
        assert_eq!(by_name("ROWS").shape, [2, 4]);
        assert_eq!(by_name("N").data, Bytes::from_static(&[3, 0, 0, 0]));
        assert!(request.parameters.contains_key("max_tokens"));
    }

    #[test]
    fn what_does_not_fit_is_named() {
        let error = |body: &[u8]| decode_generate(body, &metadata()).unwrap_err().message().to_owned();
        assert!(
            error(br#"{"NOPE": 1}"#).contains("field 'NOPE' matches no input of model 'm', which takes TEXT, ROWS, N")
        );
        assert!(error(br#"{"N": "three"}"#).contains("field 'N' is not INT32"));
        assert!(error(br#"{"N": 1.5}"#).contains("field 'N' is not INT32"));
        assert!(error(br#"{"ROWS": [1, 2, 3]}"#).contains("do not fit tensor 'ROWS'"));
        assert!(error(br#"{"ROWS": [[1, 2, 3, 4]]}"#).contains("a scalar or a flat list"));
        assert!(error(br#"[1]"#).contains("one JSON object"));
    }

    #[test]
    fn requests_and_answers_go_both_ways() {
        let body = br#"{"ROWS": [1, 2, 3, 4], "N": 3, "parameters": {"max_tokens": 5}}"#;
        let request = decode_generate(body, &metadata()).unwrap();
        let encoded = encode_generate_request(&request).unwrap();
        assert_eq!(decode_generate(&encoded, &metadata()).unwrap(), request);
        // An answer is read with the model's outputs.
        let mut model = metadata();
        model.outputs = model.inputs.clone();
        let response =
            decode_generate_response(br#"{"N": 7, "model_name": "x", "model_version": "1"}"#, &model).unwrap();
        assert_eq!(response.outputs[0].data, Bytes::from_static(&[7, 0, 0, 0]));
        let error = decode_generate_response(br#"{"error": "out of tokens"}"#, &model).unwrap_err();
        assert_eq!(error.message(), "out of tokens");
        assert!(decode_generate_response(br#"{"OTHER": 1}"#, &model).is_err());
        // Events are taken whole, as they complete.
        let mut events = EventReader::new(64);
        assert_eq!(
            events.push(b"data: {\"a\":1}\n\n: keep-alive\n\ndata:{\"b\":2}\n\ndata: {\"c\""),
            [b"{\"a\":1}".to_vec(), b"{\"b\":2}".to_vec()]
        );
        assert_eq!(events.pending(), b"data: {\"c\"");
    }

    #[test]
    fn an_event_is_read_whole_whatever_chunks_carry_it_and_held_to_its_bound() {
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":[1,2]}\n\n: ping\n\n";
        let whole = EventReader::new(64).push(stream);
        assert_eq!(whole.len(), 2);
        // One byte at a time: an end split between two chunks is found, and the same events come.
        let mut bytewise = EventReader::new(64);
        let mut events = Vec::new();
        for byte in stream {
            events.extend(bytewise.push(&[*byte]));
        }
        assert_eq!(events, whole);
        assert!(bytewise.pending().is_empty());
        // An event past the bound stops the reading and lets its bytes go; the events before it come.
        let mut bounded = EventReader::new(16);
        assert_eq!(bounded.push(b"data: 1\n\ndata: ").len(), 1);
        assert!(!bounded.too_long());
        assert!(bounded.push(&[b'x'; 16]).is_empty());
        assert!(bounded.too_long());
        assert!(bounded.pending().is_empty());
        assert!(bounded.push(b"\n\ndata: 2\n\n").is_empty());
    }

    #[test]
    fn responses_put_outputs_beside_the_names() {
        let response = InferResponse {
            model_name: "m".into(),
            model_version: Some("2".into()),
            outputs: vec![
                Tensor::new("ONE", DataType::Int32, vec![1], Bytes::from_static(&[7, 0, 0, 0])).unwrap(),
                Tensor::new(
                    "TWO",
                    DataType::Int32,
                    vec![1, 2],
                    Bytes::from_static(&[1, 0, 0, 0, 2, 0, 0, 0]),
                )
                .unwrap(),
            ],
            ..InferResponse::default()
        };
        let json = encode_generate(&response).unwrap().unwrap();
        assert_eq!(
            String::from_utf8(json).unwrap(),
            r#"{"ONE":7,"TWO":[1,2],"model_name":"m","model_version":"2"}"#
        );
        assert!(encode_generate(&InferResponse::default()).unwrap().is_none());
    }
}
