//! The built-in models: what each accepts, what it computes, and the metadata it reports.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::sync::mpsc;

use crate::error::{Error, ErrorKind, Origin, Result};
use crate::protocol::{
    CONTENT_TYPE, DataType, InferRequest, InferResponse, ModelMetadata, ParamValue, Parameters, Sequence, SequenceId,
    Tensor, TensorMetadata,
};

/// Longest `delay_ms` the `slow` and `count` models accept: ten minutes.
const MAX_DELAY_MS: i64 = 600_000;
/// Most responses the `count` model gives one request.
const MAX_COUNT: i32 = 1_000_000;

/// A built-in model. Each version of a served model is one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Model {
    /// `OUTPUT0 = INPUT0 + INPUT1`, `OUTPUT1 = INPUT0 - INPUT1` (INT32 or FP32, shape [-1, 16]); version 2 also
    /// returns `VERSION` = 2.
    AddSub { version: u32 },
    /// Every input back as an output of the same name, parameters included.
    Identity,
    /// Reverses each UTF-8 element of BYTES `INPUT0` into `OUTPUT0`.
    SimpleString,
    /// Identity after sleeping `delay_ms` (request parameter; the server's `--slow-delay-ms` when absent).
    Slow,
    /// Identity, but fails with INTERNAL when request parameter `fail` is true.
    Flaky,
    /// A stateful sequence model, as Triton's sequence batcher runs one: `OUTPUT0` (INT32 [1]) is the running sum of
    /// `INPUT0` (INT32 [1]) over the requests of one sequence (parameter `sequence_id`), started over by
    /// `sequence_start`, forgotten after `sequence_end`. A request of a sequence this server never saw start fails,
    /// as Triton's does.
    Accumulate,
    /// A decoupled model, as Triton runs one: a request with `INPUT0` (INT32 [1]) = N is answered with N responses,
    /// `OUTPUT0` (INT32 [1]) = 0, 1, ..., N-1, `delay_ms` (request parameter, default 0) apart. Only a stream can
    /// call it; unary inference of it is refused, as Triton refuses it.
    Count,
}

impl Model {
    pub const NAMES: [&'static str; 7] = [
        "add_sub",
        "identity",
        "simple_string",
        "slow",
        "flaky",
        "accumulate",
        "count",
    ];

    /// The model called `name` at `version`, if it exists.
    pub fn find(name: &str, version: u32) -> Option<Model> {
        match (name, version) {
            ("add_sub", 1 | 2) => Some(Model::AddSub { version }),
            ("identity", 1) => Some(Model::Identity),
            ("simple_string", 1) => Some(Model::SimpleString),
            ("slow", 1) => Some(Model::Slow),
            ("flaky", 1) => Some(Model::Flaky),
            ("accumulate", 1) => Some(Model::Accumulate),
            ("count", 1) => Some(Model::Count),
            _ => None,
        }
    }

    /// Every version of the model called `name`.
    pub fn versions(name: &str) -> &'static [u32] {
        match name {
            "add_sub" => &[1, 2],
            "identity" | "simple_string" | "slow" | "flaky" | "accumulate" | "count" => &[1],
            _ => &[],
        }
    }

    pub fn inputs(self) -> Vec<TensorMetadata> {
        match self {
            Model::AddSub { .. } => vec![add_sub_tensor("INPUT0"), add_sub_tensor("INPUT1")],
            Model::SimpleString => vec![string_tensor("INPUT0")],
            Model::Accumulate | Model::Count => vec![scalar_tensor("INPUT0")],
            Model::Identity | Model::Slow | Model::Flaky => Vec::new(),
        }
    }

    /// Whether the model answers a request with any number of responses (Triton's decoupled transaction policy).
    pub fn decoupled(self) -> bool {
        self == Model::Count
    }

    pub fn outputs(self) -> Vec<TensorMetadata> {
        match self {
            Model::AddSub { version } => {
                let mut outputs = vec![add_sub_tensor("OUTPUT0"), add_sub_tensor("OUTPUT1")];
                if version >= 2 {
                    outputs.push(TensorMetadata {
                        name: "VERSION".into(),
                        datatype: "INT32".into(),
                        shape: vec![1],
                    });
                }
                outputs
            }
            Model::SimpleString => vec![string_tensor("OUTPUT0")],
            Model::Accumulate | Model::Count => vec![scalar_tensor("OUTPUT0")],
            Model::Identity | Model::Slow | Model::Flaky => Vec::new(),
        }
    }

    pub fn metadata(self, name: &str, versions: &[String]) -> ModelMetadata {
        ModelMetadata {
            name: name.to_owned(),
            versions: versions.to_vec(),
            platform: "oipgate".to_owned(),
            inputs: self.inputs(),
            outputs: self.outputs(),
        }
    }

    /// Runs the model on a request whose inputs have been checked by [`Model::check_inputs`]; `slow_delay` is the
    /// `slow` model's delay when the request sets none; `sequences` is the state of the sequences under way.
    pub async fn run(self, request: &InferRequest, slow_delay: Duration, sequences: &Sequences) -> Result<Vec<Tensor>> {
        match self {
            Model::Count => Err(Error::new(
                ErrorKind::Unimplemented,
                Origin::Upstream,
                "model 'count' is decoupled (any number of responses per request): call it on a stream \
                 (ModelStreamInfer)",
            )),
            Model::Accumulate => sequences.accumulate(request),
            Model::AddSub { version } => add_sub(request, version),
            Model::Identity => Ok(request.inputs.clone()),
            Model::SimpleString => simple_string(request),
            Model::Slow => {
                tokio::time::sleep(delay(request, slow_delay)?).await;
                Ok(request.inputs.clone())
            }
            Model::Flaky => match request.parameters.get("fail") {
                Some(ParamValue::Bool(true)) => Err(Error::new(
                    ErrorKind::Internal,
                    Origin::Upstream,
                    "model 'flaky' failed because the request asked it to (parameter fail=true)",
                )),
                Some(ParamValue::Bool(false)) | None => Ok(request.inputs.clone()),
                Some(other) => Err(Error::invalid(format!("parameter fail must be a bool, got {other:?}"))),
            },
        }
    }

    /// Runs a decoupled model on a request whose inputs have been checked, each response (its outputs made into
    /// one by `response`) sent as it is made; stops early, answering false, when the stream is gone.
    pub async fn run_decoupled(
        self,
        request: &InferRequest,
        responses: &mpsc::Sender<InferResponse>,
        response: impl Fn(Vec<Tensor>) -> InferResponse,
    ) -> Result<bool> {
        let count = input(request, "INPUT0")?
            .data
            .get(..4)
            .map_or(0, |bytes| i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]));
        if !(0..=MAX_COUNT).contains(&count) {
            return Err(Error::invalid(format!(
                "model 'count' answers 0 to {MAX_COUNT} responses, was asked for {count}"
            )));
        }
        let pause = delay(request, Duration::ZERO)?;
        for step in 0..count {
            if step > 0 && !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            let output = Tensor::new(
                "OUTPUT0",
                DataType::Int32,
                vec![1],
                Bytes::copy_from_slice(&step.to_le_bytes()),
            )?;
            if responses.send(response(vec![output])).await.is_err() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Checks the request's inputs against what the model takes, naming the first offending input.
    pub fn check_inputs(self, name: &str, request: &InferRequest) -> Result<()> {
        let expected = self.inputs();
        if expected.is_empty() {
            return Ok(());
        }
        for input in &request.inputs {
            let Some(meta) = expected.iter().find(|m| m.name == input.name) else {
                let names: Vec<&str> = expected.iter().map(|m| m.name.as_str()).collect();
                return Err(Error::invalid(format!(
                    "unknown input '{}' for model '{name}', which takes {}",
                    input.name,
                    names.join(", ")
                )));
            };
            let allowed: &[DataType] = match self {
                Model::AddSub { .. } => &[DataType::Int32, DataType::Fp32],
                Model::Accumulate | Model::Count => &[DataType::Int32],
                _ => &[DataType::Bytes],
            };
            if !allowed.contains(&input.datatype) {
                let names: Vec<&str> = allowed.iter().map(|d| d.as_str()).collect();
                return Err(Error::invalid(format!(
                    "input '{}' of model '{name}' must be {}, got {}",
                    input.name,
                    names.join(" or "),
                    input.datatype
                )));
            }
            let fits = input.shape.len() == meta.shape.len()
                && input
                    .shape
                    .iter()
                    .zip(&meta.shape)
                    .all(|(&got, &want)| want < 0 || got == want.unsigned_abs());
            if !fits {
                return Err(Error::invalid(format!(
                    "input '{}' of model '{name}' has shape {:?}, expected {:?} (-1: any size)",
                    input.name, input.shape, meta.shape
                )));
            }
        }
        for meta in &expected {
            if !request.inputs.iter().any(|i| i.name == meta.name) {
                return Err(Error::invalid(format!(
                    "model '{name}' needs input '{}', which is missing",
                    meta.name
                )));
            }
        }
        Ok(())
    }
}

/// The request's `delay_ms` parameter, or `default`.
fn delay(request: &InferRequest, default: Duration) -> Result<Duration> {
    let millis = match request.parameters.get("delay_ms") {
        None => return Ok(default.min(Duration::from_millis(MAX_DELAY_MS.unsigned_abs()))),
        Some(value) => value
            .as_i64()
            .filter(|ms| (0..=MAX_DELAY_MS).contains(ms))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "parameter delay_ms must be an integer from 0 to {MAX_DELAY_MS}, got {value:?}"
                ))
            })?,
    };
    Ok(Duration::from_millis(millis.unsigned_abs()))
}

fn add_sub_tensor(name: &str) -> TensorMetadata {
    TensorMetadata {
        name: name.into(),
        datatype: "INT32".into(),
        shape: vec![-1, 16],
    }
}

fn scalar_tensor(name: &str) -> TensorMetadata {
    TensorMetadata {
        name: name.into(),
        datatype: "INT32".into(),
        shape: vec![1],
    }
}

fn string_tensor(name: &str) -> TensorMetadata {
    TensorMetadata {
        name: name.into(),
        datatype: "BYTES".into(),
        shape: vec![-1],
    }
}

fn input<'a>(request: &'a InferRequest, name: &str) -> Result<&'a Tensor> {
    request
        .inputs
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| Error::invalid(format!("missing input '{name}'")))
}

fn add_sub(request: &InferRequest, version: u32) -> Result<Vec<Tensor>> {
    let a = input(request, "INPUT0")?;
    let b = input(request, "INPUT1")?;
    if a.datatype != b.datatype || a.shape != b.shape {
        return Err(Error::invalid(format!(
            "INPUT0 ({} {:?}) and INPUT1 ({} {:?}) must have the same datatype and shape",
            a.datatype, a.shape, b.datatype, b.shape
        )));
    }
    let mut sum = BytesMut::with_capacity(a.data.len());
    let mut difference = BytesMut::with_capacity(a.data.len());
    let pairs = a.data.chunks_exact(4).zip(b.data.chunks_exact(4));
    match a.datatype {
        DataType::Int32 => {
            for (x, y) in pairs {
                let (x, y) = (i32::from_le_bytes(word(x)), i32::from_le_bytes(word(y)));
                sum.put_i32_le(x.wrapping_add(y));
                difference.put_i32_le(x.wrapping_sub(y));
            }
        }
        _ => {
            for (x, y) in pairs {
                let (x, y) = (f32::from_le_bytes(word(x)), f32::from_le_bytes(word(y)));
                sum.put_f32_le(x + y);
                difference.put_f32_le(x - y);
            }
        }
    }
    let output = |name: &str, data: BytesMut| Tensor {
        name: name.to_owned(),
        datatype: a.datatype,
        shape: a.shape.clone(),
        parameters: Parameters::new(),
        data: data.freeze(),
    };
    let mut outputs = vec![output("OUTPUT0", sum), output("OUTPUT1", difference)];
    if version >= 2 {
        let value = i32::try_from(version).unwrap_or(i32::MAX);
        outputs.push(Tensor {
            name: "VERSION".into(),
            datatype: DataType::Int32,
            shape: vec![1],
            parameters: Parameters::new(),
            data: Bytes::copy_from_slice(&value.to_le_bytes()),
        });
    }
    Ok(outputs)
}

fn word(bytes: &[u8]) -> [u8; 4] {
    bytes.try_into().unwrap_or_default()
}

fn simple_string(request: &InferRequest) -> Result<Vec<Tensor>> {
    let text = input(request, "INPUT0")?;
    let mut reversed = Vec::with_capacity(text.element_count().unwrap_or(0).min(1 << 20) as usize);
    for (index, element) in text.bytes_elements().enumerate() {
        let element = std::str::from_utf8(element)
            .map_err(|_| Error::invalid(format!("element {index} of INPUT0 is not valid UTF-8")))?;
        reversed.push(element.chars().rev().collect::<String>());
    }
    let mut output = Tensor::from_bytes_elements("OUTPUT0", text.shape.clone(), reversed.iter().map(String::as_bytes))?;
    if let Some(content_type) = text.parameters.get(CONTENT_TYPE) {
        output.parameters.insert(CONTENT_TYPE.to_owned(), content_type.clone());
    }
    Ok(vec![output])
}

/// Most sequences one server keeps under way; a start beyond it is refused until others end.
const MAX_SEQUENCES: usize = 65_536;

/// The running sums of the `accumulate` model's sequences under way, by sequence id.
#[derive(Debug, Default)]
pub struct Sequences {
    sums: std::sync::Mutex<std::collections::HashMap<SequenceId, i32>>,
}

impl Sequences {
    fn accumulate(&self, request: &InferRequest) -> Result<Vec<Tensor>> {
        let sequence = Sequence::from_parameters(&request.parameters)?.ok_or_else(|| {
            Error::invalid("model 'accumulate' is stateful: each request needs a non-zero sequence_id parameter")
        })?;
        let value = input(request, "INPUT0")?;
        let value = i32::from_le_bytes(word(value.data.get(..4).unwrap_or_default()));
        let mut sums = self.sums.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let sum = if sequence.start {
            if sums.len() >= MAX_SEQUENCES && !sums.contains_key(&sequence.id) {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    Origin::Upstream,
                    format!("model 'accumulate' has {MAX_SEQUENCES} sequences under way; end some first"),
                ));
            }
            value
        } else {
            let Some(sum) = sums.get(&sequence.id) else {
                return Err(Error::invalid(format!(
                    "inference request for sequence {} to model 'accumulate' must specify the START flag on the \
                     first request of the sequence",
                    sequence.id
                )));
            };
            sum.wrapping_add(value)
        };
        if sequence.end {
            sums.remove(&sequence.id);
        } else {
            sums.insert(sequence.id, sum);
        }
        Ok(vec![Tensor {
            name: "OUTPUT0".into(),
            datatype: DataType::Int32,
            shape: vec![1],
            parameters: Parameters::new(),
            data: Bytes::copy_from_slice(&sum.to_le_bytes()),
        }])
    }
}
