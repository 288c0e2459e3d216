//! Protobuf messages of `package inference` <-> the protocol model. Raw contents pass through as shared buffers;
//! typed contents are range-checked and packed into little-endian bytes. Encoding always uses raw contents, one per
//! tensor, because Triton's Python client reads only those.

use std::collections::{BTreeMap, HashSet};

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;

use super::rest::{BINARY_DATA, BINARY_DATA_OUTPUT, BINARY_DATA_SIZE};
use crate::error::{Error, Result};
use crate::proto::infer_parameter::ParameterChoice;
use crate::proto::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use crate::proto::model_infer_response::InferOutputTensor;
use crate::proto::model_metadata_response::TensorMetadata as ProtoTensorMetadata;
use crate::proto::{
    InferParameter, InferTensorContents, ModelInferRequest, ModelInferResponse, ModelMetadataResponse,
    RepositoryIndexResponse, ServerMetadataResponse,
};
use crate::protocol::tensor::{check_data, put_bytes_element};
use crate::protocol::{
    DataType, InferRequest, InferResponse, ModelIndexEntry, ModelMetadata, ParamValue, Parameters, RequestedOutput,
    ServerMetadata, Tensor, TensorMetadata, element_count,
};

type ProtoParameters = BTreeMap<String, InferParameter>;

/// Reads protobuf parameters, sorted by name (protobuf maps carry no order). A parameter with no value set is
/// dropped, as a JSON `null` is.
pub fn parameters_from_proto(parameters: ProtoParameters) -> Parameters {
    parameters
        .into_iter()
        .filter_map(|(name, value)| Some((name, value_from_proto(value.parameter_choice?))))
        .collect()
}

/// One parameter's value.
pub fn value_from_proto(choice: ParameterChoice) -> ParamValue {
    match choice {
        ParameterChoice::BoolParam(v) => ParamValue::Bool(v),
        ParameterChoice::Int64Param(v) => ParamValue::Int64(v),
        ParameterChoice::StringParam(v) => ParamValue::String(v),
        ParameterChoice::DoubleParam(v) => ParamValue::Double(v),
        ParameterChoice::Uint64Param(v) => ParamValue::Uint64(v),
    }
}

/// Writes parameters, leaving out the binary extension's HTTP-only ones named in `http_only`.
pub fn parameters_to_proto(parameters: Parameters, http_only: &str) -> ProtoParameters {
    parameters
        .into_iter()
        .filter(|(name, _)| name != http_only)
        .map(|(name, value)| {
            let choice = match value {
                ParamValue::Bool(v) => ParameterChoice::BoolParam(v),
                ParamValue::Int64(v) => ParameterChoice::Int64Param(v),
                ParamValue::Uint64(v) => ParameterChoice::Uint64Param(v),
                ParamValue::Double(v) => ParameterChoice::DoubleParam(v),
                ParamValue::String(v) => ParameterChoice::StringParam(v),
            };
            (
                name,
                InferParameter {
                    parameter_choice: Some(choice),
                },
            )
        })
        .collect()
}

/// The parts of an input or output tensor message, which differ only in their Rust types.
struct TensorParts {
    name: String,
    datatype: String,
    shape: Vec<i64>,
    parameters: ProtoParameters,
    contents: Option<InferTensorContents>,
}

/// Input and output tensors hold the same fields under the same names.
macro_rules! tensor_parts_from {
    ($($tensor:ident),*) => {$(
        impl From<$tensor> for TensorParts {
            fn from(t: $tensor) -> Self {
                TensorParts {
                    name: t.name,
                    datatype: t.datatype,
                    shape: t.shape,
                    parameters: t.parameters,
                    contents: t.contents,
                }
            }
        }
    )*};
}

tensor_parts_from!(InferInputTensor, InferOutputTensor);

impl From<TensorParts> for InferInputTensor {
    fn from(t: TensorParts) -> Self {
        InferInputTensor {
            name: t.name,
            datatype: t.datatype,
            shape: t.shape,
            parameters: t.parameters,
            contents: t.contents,
        }
    }
}

impl From<TensorParts> for InferOutputTensor {
    fn from(t: TensorParts) -> Self {
        InferOutputTensor {
            name: t.name,
            datatype: t.datatype,
            shape: t.shape,
            parameters: t.parameters,
            contents: t.contents,
        }
    }
}

/// Splits tensors into their messages (without contents) and their data, for the raw contents field.
fn tensors_to_proto<T: From<TensorParts>>(tensors: Vec<Tensor>) -> (Vec<T>, Vec<Bytes>) {
    let mut raw = Vec::with_capacity(tensors.len());
    let messages = tensors
        .into_iter()
        .map(|t| {
            raw.push(t.data);
            T::from(TensorParts {
                name: t.name,
                datatype: t.datatype.as_str().to_owned(),
                shape: shape_to_proto(&t.shape),
                parameters: parameters_to_proto(t.parameters, BINARY_DATA_SIZE),
                contents: None,
            })
        })
        .collect();
    (messages, raw)
}

/// Reads tensors with their raw contents (if any), checking every rule of the protocol.
fn tensors_from_proto(parts: Vec<TensorParts>, raw: Vec<Bytes>, kind: &str, raw_field: &str) -> Result<Vec<Tensor>> {
    if !raw.is_empty() && raw.len() != parts.len() {
        return Err(Error::invalid(format!(
            "{raw_field} has {} entries for {} {kind}s; it needs exactly one per {kind}",
            raw.len(),
            parts.len()
        )));
    }
    let mut raw = raw.into_iter();
    let mut names = HashSet::with_capacity(parts.len());
    let mut tensors = Vec::with_capacity(parts.len());
    for part in parts {
        let what = format!("{kind} '{}'", part.name);
        if !names.insert(part.name.clone()) {
            return Err(Error::invalid(format!(
                "{kind} name '{}' is used more than once",
                part.name
            )));
        }
        let datatype = DataType::parse(&part.datatype).map_err(|e| e.context(&what))?;
        let shape = part
            .shape
            .iter()
            .map(|&d| u64::try_from(d).map_err(|_| Error::invalid(format!("{what}: shape dimension {d} is negative"))))
            .collect::<Result<Vec<u64>>>()?;
        let typed = part.contents.filter(|c| !contents_empty(c));
        let data = match (raw.next(), typed) {
            (Some(_), Some(_)) => {
                return Err(Error::invalid(format!(
                    "{what} has typed contents but the message also has {raw_field}; use one or the other"
                )));
            }
            (Some(bytes), None) => {
                check_data(datatype, &shape, &bytes).map_err(|e| e.context(format_args!("{what} ({raw_field})")))?;
                bytes
            }
            (None, Some(contents)) => {
                let count = element_count(&shape).map_err(|e| e.context(&what))?;
                typed_to_bytes(contents, datatype, count).map_err(|e| e.context(&what))?
            }
            (None, None) => {
                // Empty typed contents are omitted on the wire, so a tensor with no elements arrives with none.
                check_data(datatype, &shape, &[])
                    .map_err(|_| Error::invalid(format!("{what} has no contents and no {raw_field} entry")))?;
                Bytes::new()
            }
        };
        let parameters = parameters_from_proto(part.parameters);
        tensors.push(Tensor {
            name: part.name,
            datatype,
            shape,
            parameters,
            data,
        });
    }
    Ok(tensors)
}

fn contents_empty(c: &InferTensorContents) -> bool {
    c.bool_contents.is_empty()
        && c.int_contents.is_empty()
        && c.int64_contents.is_empty()
        && c.uint_contents.is_empty()
        && c.uint64_contents.is_empty()
        && c.fp32_contents.is_empty()
        && c.fp64_contents.is_empty()
        && c.bytes_contents.is_empty()
}

/// Names of the typed fields that hold something.
fn filled_fields(c: &InferTensorContents) -> Vec<&'static str> {
    let fields = [
        ("bool_contents", c.bool_contents.is_empty()),
        ("int_contents", c.int_contents.is_empty()),
        ("int64_contents", c.int64_contents.is_empty()),
        ("uint_contents", c.uint_contents.is_empty()),
        ("uint64_contents", c.uint64_contents.is_empty()),
        ("fp32_contents", c.fp32_contents.is_empty()),
        ("fp64_contents", c.fp64_contents.is_empty()),
        ("bytes_contents", c.bytes_contents.is_empty()),
    ];
    fields
        .into_iter()
        .filter(|(_, empty)| !empty)
        .map(|(name, _)| name)
        .collect()
}

/// The typed field that carries `datatype`, or `None` for FP16/BF16, which travel only raw.
fn typed_field(datatype: DataType) -> Option<&'static str> {
    Some(match datatype {
        DataType::Bool => "bool_contents",
        DataType::Int8 | DataType::Int16 | DataType::Int32 => "int_contents",
        DataType::Int64 => "int64_contents",
        DataType::Uint8 | DataType::Uint16 | DataType::Uint32 => "uint_contents",
        DataType::Uint64 => "uint64_contents",
        DataType::Fp32 => "fp32_contents",
        DataType::Fp64 => "fp64_contents",
        DataType::Bytes => "bytes_contents",
        DataType::Fp16 | DataType::Bf16 => return None,
    })
}

fn typed_to_bytes(contents: InferTensorContents, datatype: DataType, count: u64) -> Result<Bytes> {
    let Some(expected_field) = typed_field(datatype) else {
        return Err(Error::invalid(format!(
            "{datatype} data can only be sent as raw contents"
        )));
    };
    let filled = filled_fields(&contents);
    if filled != [expected_field] {
        return Err(Error::invalid(format!(
            "{datatype} data must be in contents.{expected_field}, got contents.{}",
            filled.join(", contents.")
        )));
    }
    let got = match datatype {
        DataType::Bool => contents.bool_contents.len(),
        DataType::Int8 | DataType::Int16 | DataType::Int32 => contents.int_contents.len(),
        DataType::Int64 => contents.int64_contents.len(),
        DataType::Uint8 | DataType::Uint16 | DataType::Uint32 => contents.uint_contents.len(),
        DataType::Uint64 => contents.uint64_contents.len(),
        DataType::Fp32 => contents.fp32_contents.len(),
        DataType::Fp64 => contents.fp64_contents.len(),
        DataType::Bytes => contents.bytes_contents.len(),
        DataType::Fp16 | DataType::Bf16 => 0,
    };
    if got as u64 != count {
        return Err(Error::invalid(format!(
            "expected {count} elements (the product of the shape) in contents.{expected_field}, got {got}"
        )));
    }
    let size = datatype.element_size().unwrap_or(0);
    let mut out = BytesMut::with_capacity(got * size);
    match datatype {
        DataType::Bool => out.extend(contents.bool_contents.iter().map(|&b| u8::from(b))),
        DataType::Int8 => put_checked(&mut out, &contents.int_contents, |v| {
            i8::try_from(v).map(i8::to_le_bytes)
        })?,
        DataType::Int16 => put_checked(&mut out, &contents.int_contents, |v| {
            i16::try_from(v).map(i16::to_le_bytes)
        })?,
        DataType::Int32 => contents.int_contents.iter().for_each(|v| out.put_i32_le(*v)),
        DataType::Int64 => contents.int64_contents.iter().for_each(|v| out.put_i64_le(*v)),
        DataType::Uint8 => put_checked(&mut out, &contents.uint_contents, |v| {
            u8::try_from(v).map(u8::to_le_bytes)
        })?,
        DataType::Uint16 => {
            put_checked(&mut out, &contents.uint_contents, |v| {
                u16::try_from(v).map(u16::to_le_bytes)
            })?;
        }
        DataType::Uint32 => contents.uint_contents.iter().for_each(|v| out.put_u32_le(*v)),
        DataType::Uint64 => contents.uint64_contents.iter().for_each(|v| out.put_u64_le(*v)),
        DataType::Fp32 => contents.fp32_contents.iter().for_each(|v| out.put_f32_le(*v)),
        DataType::Fp64 => contents.fp64_contents.iter().for_each(|v| out.put_f64_le(*v)),
        DataType::Bytes => {
            for element in &contents.bytes_contents {
                put_bytes_element(&mut out, element)?;
            }
        }
        DataType::Fp16 | DataType::Bf16 => {}
    }
    Ok(out.freeze())
}

/// Packs values that must fit a narrower type, naming the first that does not.
fn put_checked<V: Copy + std::fmt::Display, const N: usize, E>(
    out: &mut BytesMut,
    values: &[V],
    narrow: impl Fn(V) -> std::result::Result<[u8; N], E>,
) -> Result<()> {
    for (index, &value) in values.iter().enumerate() {
        let bytes = narrow(value)
            .map_err(|_| Error::invalid(format!("element {index}: {value} does not fit the tensor's datatype")))?;
        out.put_slice(&bytes);
    }
    Ok(())
}

/// Reads a `ModelInferRequest`. Raw contents stay slices of the buffer the message was decoded from.
pub fn request_from_proto(message: ModelInferRequest) -> Result<InferRequest> {
    let parts = message.inputs.into_iter().map(TensorParts::from).collect();
    let inputs = tensors_from_proto(parts, message.raw_input_contents, "input", "raw_input_contents")?;
    let mut output_names = HashSet::with_capacity(message.outputs.len());
    let mut outputs = Vec::with_capacity(message.outputs.len());
    for output in message.outputs {
        if !output_names.insert(output.name.clone()) {
            return Err(Error::invalid(format!(
                "output '{}' is requested more than once",
                output.name
            )));
        }
        outputs.push(RequestedOutput {
            name: output.name,
            parameters: parameters_from_proto(output.parameters),
        });
    }
    Ok(InferRequest {
        model_name: message.model_name,
        model_version: Some(message.model_version).filter(|v| !v.is_empty()),
        id: Some(message.id).filter(|v| !v.is_empty()),
        parameters: parameters_from_proto(message.parameters),
        inputs,
        outputs,
    })
}

/// Writes a `ModelInferRequest` with raw contents; the binary extension's HTTP-only parameters are left out.
pub fn request_to_proto(request: InferRequest) -> ModelInferRequest {
    let (inputs, raw) = tensors_to_proto(request.inputs);
    let outputs = request
        .outputs
        .into_iter()
        .map(|o| InferRequestedOutputTensor {
            name: o.name,
            parameters: parameters_to_proto(o.parameters, BINARY_DATA),
        })
        .collect();
    ModelInferRequest {
        model_name: request.model_name,
        model_version: request.model_version.unwrap_or_default(),
        id: request.id.unwrap_or_default(),
        parameters: parameters_to_proto(request.parameters, BINARY_DATA_OUTPUT),
        inputs,
        outputs,
        raw_input_contents: raw,
    }
}

/// Reads a `ModelInferResponse`, with raw or typed output contents.
pub fn response_from_proto(message: ModelInferResponse) -> Result<InferResponse> {
    let parts = message.outputs.into_iter().map(TensorParts::from).collect();
    let outputs = tensors_from_proto(parts, message.raw_output_contents, "output", "raw_output_contents")?;
    Ok(InferResponse {
        model_name: message.model_name,
        model_version: Some(message.model_version).filter(|v| !v.is_empty()),
        id: Some(message.id).filter(|v| !v.is_empty()),
        parameters: parameters_from_proto(message.parameters),
        outputs,
    })
}

/// Writes a `ModelInferResponse` with one raw content per output, empty outputs included.
pub fn response_to_proto(response: InferResponse) -> ModelInferResponse {
    let (outputs, raw) = tensors_to_proto(response.outputs);
    ModelInferResponse {
        model_name: response.model_name,
        model_version: response.model_version.unwrap_or_default(),
        id: response.id.unwrap_or_default(),
        parameters: parameters_to_proto(response.parameters, BINARY_DATA_OUTPUT),
        outputs,
        raw_output_contents: raw,
    }
}

/// A protobuf message as a list of buffers: the message without its raw contents, then each raw content's field
/// header and the tensor buffer itself. Raw contents are the highest-numbered field of both messages, so this is
/// exactly the encoding prost would produce, without copying tensor bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodedMessage {
    pub chunks: Vec<Bytes>,
}

impl EncodedMessage {
    fn new(head: Vec<u8>, field: u32, raw: Vec<Bytes>) -> Self {
        let mut chunks = Vec::with_capacity(1 + 2 * raw.len());
        let mut header = BytesMut::from(&head[..]);
        for content in raw {
            prost::encoding::encode_key(field, prost::encoding::WireType::LengthDelimited, &mut header);
            prost::encoding::encode_varint(content.len() as u64, &mut header);
            if !content.is_empty() {
                chunks.push(header.split().freeze());
                chunks.push(content);
            }
        }
        if !header.is_empty() {
            chunks.push(header.freeze());
        }
        EncodedMessage { chunks }
    }

    /// The encoded length, for a gRPC frame header.
    pub fn len(&self) -> usize {
        self.chunks.iter().map(Bytes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole message in one buffer. This copies; senders should write the chunks instead.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.len());
        for chunk in &self.chunks {
            out.extend_from_slice(chunk);
        }
        out.freeze()
    }
}

/// Field numbers of the raw contents.
const RAW_INPUT_CONTENTS: u32 = 7;
const RAW_OUTPUT_CONTENTS: u32 = 6;

/// Encodes a request as a `ModelInferRequest` whose raw input contents are the tensors' own buffers.
pub fn encode_request(request: InferRequest) -> EncodedMessage {
    let mut message = request_to_proto(request);
    let raw = std::mem::take(&mut message.raw_input_contents);
    EncodedMessage::new(message.encode_to_vec(), RAW_INPUT_CONTENTS, raw)
}

/// Encodes a response as a `ModelInferResponse` whose raw output contents are the tensors' own buffers.
pub fn encode_response(response: InferResponse) -> EncodedMessage {
    let mut message = response_to_proto(response);
    let raw = std::mem::take(&mut message.raw_output_contents);
    EncodedMessage::new(message.encode_to_vec(), RAW_OUTPUT_CONTENTS, raw)
}

/// Dimensions beyond `i64::MAX` cannot be written; they saturate, and the receiver's size check then fails loudly.
fn shape_to_proto(shape: &[u64]) -> Vec<i64> {
    shape.iter().map(|&d| i64::try_from(d).unwrap_or(i64::MAX)).collect()
}

/// Moves a model's metadata between its two forms, which hold the same fields under the same names.
macro_rules! model_metadata {
    ($source:expr, $metadata:ident, $from_tensor:ident => $tensor:ident) => {{
        let source = $source;
        let tensors = |ts: Vec<$from_tensor>| {
            ts.into_iter()
                .map(|t| $tensor {
                    name: t.name,
                    datatype: t.datatype,
                    shape: t.shape,
                })
                .collect()
        };
        $metadata {
            name: source.name,
            versions: source.versions,
            platform: source.platform,
            inputs: tensors(source.inputs),
            outputs: tensors(source.outputs),
        }
    }};
}

pub fn model_metadata_to_proto(metadata: ModelMetadata) -> ModelMetadataResponse {
    model_metadata!(metadata, ModelMetadataResponse, TensorMetadata => ProtoTensorMetadata)
}

pub fn model_metadata_from_proto(message: ModelMetadataResponse) -> ModelMetadata {
    model_metadata!(message, ModelMetadata, ProtoTensorMetadata => TensorMetadata)
}

pub fn repository_index_to_proto(entries: Vec<ModelIndexEntry>) -> RepositoryIndexResponse {
    RepositoryIndexResponse {
        models: entries
            .into_iter()
            .map(|e| crate::proto::repository_index_response::ModelIndex {
                name: e.name,
                version: e.version,
                state: e.state.as_str().to_owned(),
                reason: e.reason,
            })
            .collect(),
    }
}

pub fn server_metadata_to_proto(metadata: ServerMetadata) -> ServerMetadataResponse {
    ServerMetadataResponse {
        name: metadata.name,
        version: metadata.version,
        extensions: metadata.extensions,
    }
}

pub fn server_metadata_from_proto(message: ServerMetadataResponse) -> ServerMetadata {
    ServerMetadata {
        name: message.name,
        version: message.version,
        extensions: message.extensions,
    }
}

/// A repository load or unload request's parameters, from protobuf.
pub fn repository_parameters_from_proto(
    parameters: BTreeMap<String, crate::proto::ModelRepositoryParameter>,
) -> crate::protocol::RepositoryParameters {
    use crate::proto::model_repository_parameter::ParameterChoice as Choice;
    use crate::protocol::RepositoryValue;
    parameters
        .into_iter()
        .filter_map(|(name, value)| {
            let value = match value.parameter_choice? {
                Choice::BoolParam(v) => RepositoryValue::Bool(v),
                Choice::Int64Param(v) => RepositoryValue::Int64(v),
                Choice::StringParam(v) => RepositoryValue::String(v),
                Choice::BytesParam(v) => RepositoryValue::Bytes(v),
            };
            Some((name, value))
        })
        .collect()
}

/// A repository load or unload request's parameters, to protobuf.
pub fn repository_parameters_to_proto(
    parameters: &crate::protocol::RepositoryParameters,
) -> BTreeMap<String, crate::proto::ModelRepositoryParameter> {
    use crate::proto::model_repository_parameter::ParameterChoice as Choice;
    use crate::protocol::RepositoryValue;
    parameters
        .iter()
        .map(|(name, value)| {
            let choice = match value {
                RepositoryValue::Bool(v) => Choice::BoolParam(*v),
                RepositoryValue::Int64(v) => Choice::Int64Param(*v),
                RepositoryValue::String(v) => Choice::StringParam(v.clone()),
                RepositoryValue::Bytes(v) => Choice::BytesParam(v.clone()),
            };
            let parameter = crate::proto::ModelRepositoryParameter {
                parameter_choice: Some(choice),
            };
            (name.clone(), parameter)
        })
        .collect()
}

/// A gRPC message as bytes, for tonic's framing and decompression: decoding slices the received buffer.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawDecoder;

impl tonic::codec::Decoder for RawDecoder {
    type Item = Bytes;
    type Error = tonic::Status;

    fn decode(&mut self, buf: &mut tonic::codec::DecodeBuf<'_>) -> std::result::Result<Option<Bytes>, tonic::Status> {
        let length = bytes::Buf::remaining(buf);
        Ok(Some(bytes::Buf::copy_to_bytes(buf, length)))
    }
}
