//! `$inference_request` over REST: JSON, optionally followed by binary sections (binary tensor data extension).

use std::collections::HashSet;
use std::sync::LazyLock;

use super::params::{read_parameters, write_parameters_field};
use super::reader::JsonReader;
use super::tensor_doc::{BinarySections, DataForm, read_tensor, write_tensor};
use super::{BinaryOutputs, EncodedBody, split_body};
use crate::error::{Error, Result};
use crate::protocol::reserved;
use crate::protocol::{DataType, InferRequest, ParamValue, Parameters, RequestedOutput, Tensor, TensorMetadata};
use bytes::Bytes;

/// Request-level parameter: return every output as binary data unless the output says otherwise.
pub const BINARY_DATA_OUTPUT: &str = "binary_data_output";
/// Requested-output parameter: return this output as binary data.
pub const BINARY_DATA: &str = "binary_data";

/// A decoded REST inference request.
#[derive(Debug, Clone, PartialEq)]
pub enum RestRequest {
    /// A JSON header, with or without binary sections. The binary extension's own parameters have been taken out of
    /// the request and are in `binary_outputs`.
    Request {
        request: InferRequest,
        binary_outputs: BinaryOutputs,
    },
    /// `Inference-Header-Content-Length: 0`: Triton's raw binary request, whose whole body is the data of the model's
    /// only input; complete it with [`raw_binary_request`] once the model's metadata is known.
    RawBinary(Bytes),
}

/// The names [`reserved_parameters`] looks for, each with the quote that opens it as a JSON key; shared memory's
/// first (its tensors are refused).
const RESERVED_KEYS: [&[u8]; 4] = [b"\"shared_memory_", b"\"sequence_id", b"\"timeout\"", b"\"priority\""];
/// The key the reserved names are found under, with its quotes.
const PARAMETERS_KEY: &[u8] = b"\"parameters\"";
/// The longest of those names: a name split across two chunks lies within this many bytes of their seam.
pub const LONGEST_RESERVED_NAME: usize = 16;

/// Up to this length a body's quotes are found eight bytes at a time in a plain loop: between a small request's quotes
/// lie a few bytes, fewer than a vectored search's set-up costs (about 45 instructions a quote).
const SHORT_TEXT: usize = 512;

/// Calls `each` with the place of every quote in `text`.
fn each_quote(text: &[u8], mut each: impl FnMut(usize)) {
    if text.len() > SHORT_TEXT {
        memchr::memchr_iter(b'"', text).for_each(each);
        return;
    }
    const ONES: u64 = u64::from_le_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_le_bytes([0x80; 8]);
    const QUOTES: u64 = u64::from_le_bytes([b'"'; 8]);
    let mut words = text.chunks_exact(8);
    let mut at = 0;
    for word in &mut words {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(word);
        // A zero byte of `x` is a quote; the high bit of each such byte is set in `found` (and, past a quote, of a
        // byte that is one more than a quote: each is checked).
        let x = u64::from_le_bytes(bytes) ^ QUOTES;
        let mut found = x.wrapping_sub(ONES) & !x & HIGHS;
        while found != 0 {
            let place = at + found.trailing_zeros() as usize / 8;
            if word[place - at] == b'"' {
                each(place);
            }
            found &= found - 1;
        }
        at += 8;
    }
    for (offset, &byte) in words.remainder().iter().enumerate() {
        if byte == b'"' {
            each(at + offset);
        }
    }
}

/// Which of [`RESERVED_KEYS`] `text` mentions, as keys: one pass over its quotes rather than a search for each name
/// (most requests mention none, and a body's start has few quotes). A text with a backslash may spell a key with
/// escapes (`"\u0073equence_id"` is `"sequence_id"` to every JSON reader): it is taken to mention them all.
fn reserved_keys(text: &[u8]) -> [bool; RESERVED_KEYS.len()] {
    if memchr::memchr(b'\\', text).is_some() {
        return [true; RESERVED_KEYS.len()];
    }
    let mut found = [false; RESERVED_KEYS.len()];
    each_quote(text, |quote| {
        let after = &text[quote..];
        // Most quotes open a name or value none of the keys begins with.
        if !matches!(after.get(1), Some(b's' | b't' | b'p')) {
            return;
        }
        for (key, found) in RESERVED_KEYS.iter().zip(&mut found) {
            *found |= after.starts_with(key);
        }
    });
    found
}

/// Whether a JSON `text` may name a shared-memory parameter as a key: it holds the name, or escapes that could spell
/// it. Two searches that run at memory speed, where reading the keys steps through every byte.
pub fn may_name_shared_memory(text: &[u8]) -> bool {
    static SHARED_MEMORY: LazyLock<memchr::memmem::Finder<'static>> =
        LazyLock::new(|| memchr::memmem::Finder::new(reserved::SHARED_MEMORY_PREFIX.as_bytes()));
    memchr::memchr(b'\\', text).is_some() || SHARED_MEMORY.find(text).is_some()
}

/// Whether `text` mentions a name [`reserved_parameters`] looks for (most requests mention none).
pub fn mentions_reserved(text: &[u8]) -> bool {
    reserved_keys(text).contains(&true)
}

/// The request-level `parameters` of a JSON request header, read without decoding the rest (a proxied body goes on
/// as it came), with its tensors refused when they point at shared memory. Looked at only when the text mentions
/// `sequence_id`, `"timeout"`, `"priority"` or `shared_memory_` as keys (most requests mention none): else, and when the
/// header has no `parameters`, `None`. When `whole` is false only the start of the header is at hand, and what lies
/// beyond it is not seen; a header at hand whole that is not a JSON object is refused.
pub fn reserved_parameters(json: &[u8], whole: bool) -> Result<Option<Parameters>> {
    // Every reserved name is a key of a `parameters` object, the request's or a tensor's: a text without one (most
    // requests) is not searched further, unless it has escapes, which could spell it otherwise.
    // The searcher is made once: making it costs more than a small request's search.
    static PARAMETERS: LazyLock<memchr::memmem::Finder<'static>> =
        LazyLock::new(|| memchr::memmem::Finder::new(PARAMETERS_KEY));
    if PARAMETERS.find(json).is_none() && memchr::memchr(b'\\', json).is_none() {
        return Ok(None);
    }
    let mentioned = reserved_keys(json);
    if !mentioned.contains(&true) {
        return Ok(None);
    }
    let shared_memory = mentioned[0];
    let mut reader = JsonReader::new(json);
    let mut found = None;
    // A refusal is the answer; a syntax error is one only in a header at hand whole.
    let scanned = (|| {
        let mut members = reader.object()?;
        while let Some(key) = members.next(&mut reader)? {
            let refusal = match key.as_ref() {
                "parameters" => {
                    found = Some(read_parameters(&mut reader)?);
                    None
                }
                "inputs" if shared_memory => shared_memory_refusal(&mut reader, "input")?,
                "outputs" if shared_memory => shared_memory_refusal(&mut reader, "output")?,
                _ => {
                    reader.skip_value()?;
                    None
                }
            };
            if refusal.is_some() {
                return Ok(refusal);
            }
        }
        Ok(None)
    })();
    match scanned {
        Ok(Some(refusal)) => Err(refusal),
        Err(error) if whole => Err(error),
        Ok(None) | Err(_) => Ok(found),
    }
}

/// Reads a tensor list: the refusal of the first tensor whose parameters point at shared memory, if any.
fn shared_memory_refusal(reader: &mut JsonReader<'_>, kind: &str) -> Result<Option<Error>> {
    let mut elements = reader.array()?;
    while elements.next(reader)? {
        let (mut name, mut parameters) = (String::new(), Parameters::new());
        let mut members = reader.object()?;
        while let Some(key) = members.next(reader)? {
            match key.as_ref() {
                "name" => name = reader.string()?.into_owned(),
                "parameters" => parameters = read_parameters(reader)?,
                _ => reader.skip_value()?,
            }
        }
        if let Err(refusal) = reserved::refuse_shared_memory(kind, &name, parameters.keys().map(String::as_str)) {
            return Ok(Some(refusal));
        }
    }
    Ok(None)
}

/// Decodes a REST inference request body. `header_length` is the `Inference-Header-Content-Length` header, if any.
/// Binary input data is sliced from `body`, never copied.
pub fn decode_request(body: Bytes, header_length: Option<u64>) -> Result<RestRequest> {
    if header_length == Some(0) {
        return Ok(RestRequest::RawBinary(body));
    }
    let (header, binary) = split_body(body, header_length)?;
    let mut sections = BinarySections::new(binary);
    let mut reader = JsonReader::new(&header);
    let mut request = InferRequest::default();
    let mut inputs_seen = false;
    let mut parameters_seen = false;
    let mut requested: Vec<RequestedOutput> = Vec::new();
    let mut members = reader.object()?;
    while let Some(key) = members.next(&mut reader)? {
        match key.as_ref() {
            "id" => request.id = optional_string(&mut reader)?,
            "model_name" => request.model_name = optional_string(&mut reader)?.unwrap_or_default(),
            "model_version" => request.model_version = optional_string(&mut reader)?.filter(|v| !v.is_empty()),
            "parameters" => {
                // Backends read the first or the last of two: the gateway takes neither.
                if parameters_seen {
                    return Err(Error::invalid("\"parameters\" is given twice"));
                }
                parameters_seen = true;
                request.parameters = read_parameters(&mut reader)?;
            }
            "inputs" => {
                if inputs_seen {
                    return Err(Error::invalid("\"inputs\" is given twice"));
                }
                inputs_seen = true;
                let mut names = HashSet::new();
                let mut elements = reader.array()?;
                while elements.next(&mut reader)? {
                    let tensor = read_tensor(&mut reader, "input", request.inputs.len(), &mut sections)?;
                    if !names.insert(tensor.name.clone()) {
                        return Err(Error::invalid(format!(
                            "input name '{}' is used more than once",
                            tensor.name
                        )));
                    }
                    request.inputs.push(tensor);
                }
            }
            "outputs" => {
                let mut elements = reader.array()?;
                while elements.next(&mut reader)? {
                    requested.push(read_requested_output(&mut reader, requested.len())?);
                }
            }
            _ => reader.skip_value()?,
        }
    }
    reader.end()?;
    if !inputs_seen {
        return Err(Error::invalid("inference request has no \"inputs\""));
    }
    sections.finish()?;

    let mut binary_outputs = BinaryOutputs {
        all: take_bool(&mut request.parameters, BINARY_DATA_OUTPUT, "request")?.unwrap_or(false),
        outputs: Vec::new(),
    };
    let mut output_names = HashSet::with_capacity(requested.len());
    for output in &mut requested {
        if !output_names.insert(output.name.clone()) {
            return Err(Error::invalid(format!(
                "output '{}' is requested more than once",
                output.name
            )));
        }
        if let Some(binary) = take_bool(
            &mut output.parameters,
            BINARY_DATA,
            &format!("output '{}'", output.name),
        )? {
            binary_outputs.outputs.push((output.name.clone(), binary));
        }
    }
    request.outputs = requested;
    Ok(RestRequest::Request {
        request,
        binary_outputs,
    })
}

/// A string member that may also be `null`.
pub(super) fn optional_string(reader: &mut JsonReader<'_>) -> Result<Option<String>> {
    if reader.null() {
        Ok(None)
    } else {
        Ok(Some(reader.string()?.into_owned()))
    }
}

fn read_requested_output(reader: &mut JsonReader<'_>, index: usize) -> Result<RequestedOutput> {
    let mut name = None;
    let mut parameters = Parameters::new();
    let mut members = reader.object()?;
    while let Some(key) = members.next(reader)? {
        match key.as_ref() {
            "name" => name = Some(reader.string()?.into_owned()),
            "parameters" => parameters = read_parameters(reader)?,
            _ => reader.skip_value()?,
        }
    }
    let name = name.ok_or_else(|| Error::invalid(format!("requested output {index} has no \"name\"")))?;
    Ok(RequestedOutput { name, parameters })
}

fn take_bool(parameters: &mut Parameters, name: &str, owner: &str) -> Result<Option<bool>> {
    match parameters.shift_remove(name) {
        None => Ok(None),
        Some(ParamValue::Bool(v)) => Ok(Some(v)),
        Some(other) => Err(Error::invalid(format!(
            "{owner}: parameter {name} must be a bool, got {}",
            other.type_name()
        ))),
    }
}

/// Completes a raw binary request (header length 0) for a model whose only input is `input`: the body is that
/// input's data, its shape comes from the metadata (one variable dimension is inferred from the body's size), and
/// every output is returned binary, as Triton does.
pub fn raw_binary_request(body: Bytes, input: &TensorMetadata) -> Result<(InferRequest, BinaryOutputs)> {
    let what = format!("raw binary request for input '{}'", input.name);
    let datatype = DataType::parse(&input.datatype).map_err(|e| e.context(&what))?;
    let variable = input.shape.iter().filter(|&&d| d < 0).count();
    if variable > 1 {
        return Err(Error::invalid(format!(
            "{what}: the input's shape {:?} has more than one variable dimension, so the body's size cannot fix it",
            input.shape
        )));
    }
    let fixed: u64 = input
        .shape
        .iter()
        .filter(|&&d| d >= 0)
        .map(|&d| d.unsigned_abs())
        .product();
    let shape: Vec<u64> = if variable == 0 {
        input.shape.iter().map(|&d| d.unsigned_abs()).collect()
    } else {
        let total = match datatype.element_size() {
            Some(size) => (body.len() / size) as u64,
            None => crate::protocol::tensor::count_bytes_elements(&body).map_err(|e| e.context(&what))?,
        };
        let inferred = total.checked_div(fixed).unwrap_or(0);
        input
            .shape
            .iter()
            .map(|&d| if d < 0 { inferred } else { d.unsigned_abs() })
            .collect()
    };
    let tensor = Tensor::new(input.name.clone(), datatype, shape, body).map_err(|e| e.context(&what))?;
    let request = InferRequest {
        inputs: vec![tensor],
        ..InferRequest::default()
    };
    Ok((
        request,
        BinaryOutputs {
            all: true,
            outputs: Vec::new(),
        },
    ))
}

/// Encodes a request for a REST backend. With `binary_inputs` (the backend speaks the binary extension) every input
/// travels as a binary section that shares the tensor's buffer; otherwise all data is JSON. Parameters are written as
/// they are, so a caller that wants binary outputs sets `binary_data_output` / `binary_data` itself.
pub fn encode_request(request: &InferRequest, binary_inputs: bool) -> Result<EncodedBody> {
    let form = if binary_inputs {
        DataForm::Binary
    } else {
        DataForm::Json
    };
    let mut out = Vec::with_capacity(256);
    let mut sections = Vec::with_capacity(if binary_inputs { request.inputs.len() } else { 0 });
    out.push(b'{');
    if let Some(id) = &request.id {
        out.extend_from_slice(b"\"id\":");
        super::format::write_json_string(&mut out, id);
        out.push(b',');
    }
    out.extend_from_slice(b"\"inputs\":[");
    for (i, input) in request.inputs.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_tensor(&mut out, input, form, &mut sections)?;
    }
    out.push(b']');
    if !request.outputs.is_empty() {
        out.extend_from_slice(b",\"outputs\":[");
        for (i, output) in request.outputs.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(b"{\"name\":");
            super::format::write_json_string(&mut out, &output.name);
            write_parameters_field(&mut out, &output.parameters);
            out.push(b'}');
        }
        out.push(b']');
    }
    write_parameters_field(&mut out, &request.parameters);
    out.push(b'}');
    Ok(EncodedBody::new(out, sections))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::sequence::SEQUENCE_ID;

    #[test]
    fn the_reserved_keys_are_the_reserved_names_quoted() {
        let quoted = |name: &str| format!("\"{name}");
        assert!(RESERVED_KEYS.iter().all(|key| matches!(key[1], b's' | b't' | b'p')));
        assert_eq!(RESERVED_KEYS[0], quoted(reserved::SHARED_MEMORY_PREFIX).as_bytes());
        assert_eq!(RESERVED_KEYS[1], quoted(SEQUENCE_ID).as_bytes());
        assert!(RESERVED_KEYS.iter().all(|key| key.len() <= LONGEST_RESERVED_NAME));
    }

    #[test]
    fn reserved_names_spelled_with_escapes_are_read() {
        // Without escapes and without a `parameters` key, nothing is read: no name can matter.
        assert_eq!(
            reserved_parameters(br#"{"sequence_id":7,"inputs":[]}"#, true).unwrap(),
            None
        );
        assert_eq!(reserved_keys(br#"{"inputs":[{"name":"x"}]}"#), [false; 4]);
        // A backslash anywhere may spell any name: the header is read, and its escaped names are what they say.
        assert_eq!(reserved_keys(br#"{"inputs":[{"name":"x\n"}]}"#), [true; 4]);
        let escaped = br#"{"param\u0065ters":{"\u0073equence_id":7}}"#;
        let parameters = reserved_parameters(escaped, true).unwrap().expect("its parameters");
        assert!(parameters.contains_key("sequence_id"), "{parameters:?}");
        let shared = br#"{"inputs":[{"name":"x","param\u0065ters":{"\u0073hared_memory_region":"r"}}]}"#;
        assert!(reserved_parameters(shared, true).is_err());
    }

    #[test]
    fn reserved_keys_are_found_as_keys_only() {
        let text =
            br#"{"inputs":[{"name":"x","parameters":{"shared_memory_region":"r"}}],"parameters":{"priority":2}}"#;
        assert_eq!(reserved_keys(text), [true, false, false, true]);
        assert!(mentions_reserved(br#"{"parameters":{"sequence_id":7,"timeout":10}}"#));
        assert_eq!(
            reserved_keys(br#"{"parameters":{"sequence_id":7,"timeout":10}}"#),
            [false, true, true, false]
        );
        // A name that is not a key's whole name, or in a value without its quote, is not one.
        assert!(!mentions_reserved(
            br#"{"id":"my_sequence_id","x_timeout":1,"priority_class":"a"}"#
        ));
        assert!(!mentions_reserved(b""));
        // Every quote is found, wherever it lies in a word, and nothing else (a `#` just past a quote included).
        for text in [
            &b"\"\"\"#\"##\"\"x\"#"[..],
            b"#\"\"",
            b"abcdefg\"",
            b"abcdefgh\"",
            b"\"#######\"#",
        ] {
            let mut quotes = Vec::new();
            each_quote(text, |at| quotes.push(at));
            let expected: Vec<usize> = (0..text.len()).filter(|&at| text[at] == b'"').collect();
            assert_eq!(quotes, expected, "{}", String::from_utf8_lossy(text));
        }
        // Every text of up to 10 bytes made of a quote and its two neighbours.
        for length in 0..=10u32 {
            for mut code in 0..3usize.pow(length) {
                let text: Vec<u8> = (0..length)
                    .map(|_| {
                        let byte = [b'!', b'"', b'#'][code % 3];
                        code /= 3;
                        byte
                    })
                    .collect();
                let mut quotes = Vec::new();
                each_quote(&text, |at| quotes.push(at));
                assert_eq!(
                    quotes,
                    (0..text.len()).filter(|&at| text[at] == b'"').collect::<Vec<_>>()
                );
            }
        }
        // Past the length searched byte by byte, the same keys are found the same way.
        let padding = format!(r#""pad":"{}","#, "x".repeat(SHORT_TEXT));
        let long = format!(
            r#"{{{padding}"inputs":[{{"parameters":{{"shared_memory_region":"r"}}}}],"parameters":{{"priority":2}}}}"#
        );
        assert!(long.len() > SHORT_TEXT);
        assert_eq!(reserved_keys(long.as_bytes()), [true, false, false, true]);
        assert!(!mentions_reserved(
            format!(r#"{{{padding}"id":"my_sequence_id"}}"#).as_bytes()
        ));
    }
}
