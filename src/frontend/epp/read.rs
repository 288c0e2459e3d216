//! What the endpoint picker reads of a request before it picks: the model and version its REST path or its gRPC
//! message's leading fields name, and the parameters that steer routing (sequence, `priority`) from the body's start,
//! reading no more of the body than holds them.

use bytes::Bytes;

use crate::codec::{rest, splice};
use crate::error::{Error, Result};
use crate::protocol::paths::{self, Route};
use crate::protocol::{Reserved, StreamCall};

/// The most bytes of a body's start read before picking: a JSON header's start, a binary-extension header, or a
/// gRPC message's leading fields. Clients write the parameters that steer routing ahead of the tensors.
pub(super) const MOST_READ: usize = 64 * 1024;

/// gRPC's inference service, whose methods name a model in their message's leading fields.
const INFERENCE_SERVICE: &str = "/inference.GRPCInferenceService/";

/// The request as its headers describe it.
#[derive(Debug)]
pub(super) enum Wanted {
    /// A REST call of a model: its name and version from the path, and how much of the body to read.
    Rest {
        model: String,
        version: Option<String>,
        /// The path's last part after the model (`/infer`, `/ready`, ...), to name the backend's model in its stead;
        /// `None` for a path the picker cannot rename.
        suffix: Option<String>,
        body: BodyRead,
        /// `generate` or `generate_stream`: a call whose answer's tokens its token budgets are charged.
        generates: Option<StreamCall>,
    },
    /// A gRPC call of the inference service whose message names a model.
    Grpc { method: GrpcMethod },
    /// A call that names no model (health, server metadata, the repository index): any endpoint can answer it.
    Any,
}

/// Which of the inference service's methods that name a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GrpcMethod {
    /// `ModelInfer`: one message, its parameters read.
    Infer,
    /// `ModelStreamInfer`: its first message read; each later one names the model again.
    StreamInfer,
    /// `ModelMetadata`, `ModelReady`, `ModelConfig`, `ModelStatistics`: a name and a version.
    Describe,
}

/// How much of a REST body is read before picking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyRead {
    /// None (a call without parameters that steer routing, or a Decthings body).
    Nothing,
    /// A JSON body's start, up to its `inputs`.
    Json,
    /// A binary-extension body's JSON header, this long.
    Header(usize),
}

/// What was read: the model and version named, and what the call's parameters ask.
#[derive(Debug)]
pub(super) struct Read {
    pub model: String,
    pub version: Option<String>,
    pub reserved: Reserved,
    /// A gRPC message's length and its leading fields' length: what a rename of its model rewrites.
    pub grpc_frame: Option<(usize, usize)>,
}

/// Reads a request's headers: `path` is `:path`, `content_type` and `header_length`
/// (`Inference-Header-Content-Length`) as sent.
pub(super) fn wanted(path: &str, grpc: bool, header_length: Option<&str>, decthings: bool) -> Result<Wanted> {
    if grpc {
        let Some(method) = path.strip_prefix(INFERENCE_SERVICE) else {
            return Ok(Wanted::Any);
        };
        let method = match method {
            "ModelInfer" => GrpcMethod::Infer,
            "ModelStreamInfer" => GrpcMethod::StreamInfer,
            "ModelMetadata" | "ModelReady" | "ModelConfig" | "ModelStatistics" => GrpcMethod::Describe,
            _ => return Ok(Wanted::Any),
        };
        return Ok(Wanted::Grpc { method });
    }
    let path = path.split_once('?').map_or(path, |(path, _)| path);
    let Some(route) = paths::route(path) else {
        return Ok(Wanted::Any);
    };
    let Some(model) = route.model() else {
        return Ok(Wanted::Any);
    };
    let generates = match route {
        Route::Generate(_, _, call @ (StreamCall::Generate | StreamCall::GenerateStream)) => Some(call),
        _ => None,
    };
    let (version, suffix, steers) = match route {
        Route::Infer(_, version) => (version, Some("/infer"), true),
        Route::Generate(_, version, call) => (
            version,
            Some(match call {
                StreamCall::Generate => "/generate",
                StreamCall::GenerateStream => "/generate_stream",
                StreamCall::InferStream => "/infer_stream",
            }),
            true,
        ),
        Route::ModelMetadata(_, version) => (version, Some(""), false),
        Route::ModelReady(_, version) => (version, Some("/ready"), false),
        Route::ModelConfig(_, version) => (version, Some("/config"), false),
        Route::ModelStatistics(_, version) => (version, Some("/stats"), false),
        _ => (None, None, false),
    };
    let body = match (steers, header_length) {
        (false, _) => BodyRead::Nothing,
        (true, _) if decthings => BodyRead::Nothing,
        (true, None) => BodyRead::Json,
        (true, Some(length)) => match length.trim().parse::<usize>() {
            Ok(0) => BodyRead::Nothing,
            Ok(length) if length <= MOST_READ => BodyRead::Header(length),
            Ok(length) => {
                return Err(Error::invalid(format!(
                    "the binary extension's JSON header is {length} bytes; the endpoint picker reads at most \
                     {MOST_READ} before picking"
                )));
            }
            Err(_) => {
                return Err(Error::invalid(format!(
                    "Inference-Header-Content-Length '{length}' is not a byte count"
                )));
            }
        },
    };
    Ok(Wanted::Rest {
        model: model.to_owned(),
        version: version.map(str::to_owned),
        suffix: suffix.map(str::to_owned),
        body,
        generates,
    })
}

impl Wanted {
    /// Whether the body's start must be read before picking.
    pub(super) fn reads_body(&self) -> bool {
        matches!(
            self,
            Wanted::Rest {
                body: BodyRead::Json | BodyRead::Header(_),
                ..
            } | Wanted::Grpc { .. }
        )
    }

    /// `generate` or `generate_stream`, whose answers carry tokens; `None` for any other call.
    pub(super) fn generates(&self) -> Option<StreamCall> {
        match self {
            Wanted::Rest { generates, .. } => *generates,
            Wanted::Grpc { .. } | Wanted::Any => None,
        }
    }

    /// What a REST call names by its path alone, its parameters unread; `None` for any other call.
    pub(super) fn by_path(&self) -> Option<Read> {
        match self {
            Wanted::Rest { model, version, .. } => Some(Read {
                model: model.clone(),
                version: version.clone(),
                reserved: Reserved::default(),
                grpc_frame: None,
            }),
            Wanted::Grpc { .. } | Wanted::Any => None,
        }
    }

    /// What the call names and asks, from the body's `start` (copied from the first chunks, at most [`MOST_READ`]
    /// bytes and a gRPC frame's prefix); `None` while more is needed. `whole`: the body has ended.
    pub(super) fn read(&self, start: &[u8], whole: bool) -> Result<Option<Read>> {
        match self {
            Wanted::Any => Ok(None),
            Wanted::Rest {
                model, version, body, ..
            } => {
                let json = match *body {
                    BodyRead::Nothing => Some((&start[..0], true)),
                    BodyRead::Header(length) if start.len() >= length => Some((&start[..length], true)),
                    BodyRead::Header(_) if whole => {
                        return Err(Error::invalid(
                            "the body ends before the length Inference-Header-Content-Length gives",
                        ));
                    }
                    BodyRead::Header(_) => None,
                    // A start of the most read bytes is a start, even of a body that has ended beyond them.
                    BodyRead::Json if start.len() >= MOST_READ => Some((start, false)),
                    BodyRead::Json if whole => Some((start, true)),
                    // The request's own parameters stand ahead of its tensors where clients write them: once the
                    // inputs begin, a start that names no routing parameter has none to give.
                    BodyRead::Json if !rest::mentions_reserved(start) && begins_inputs(start) => Some((start, false)),
                    BodyRead::Json => None,
                };
                let Some((json, whole)) = json else {
                    return Ok(None);
                };
                let reserved = if json.is_empty() {
                    Reserved::default()
                } else {
                    match rest::reserved_parameters(json, whole)? {
                        Some(parameters) => Reserved::from_parameters(&parameters)?,
                        None => Reserved::default(),
                    }
                };
                Ok(Some(Read {
                    model: model.clone(),
                    version: version.clone(),
                    reserved,
                    grpc_frame: None,
                }))
            }
            Wanted::Grpc { method } => read_grpc(*method, start, whole),
        }
    }
}

/// Whether a JSON body's start has reached its `inputs` key.
fn begins_inputs(start: &[u8]) -> bool {
    memchr::memmem::find(start, b"\"inputs\"").is_some()
}

/// A gRPC call's first message: its frame's prefix (compression flag and length), then its leading fields.
fn read_grpc(method: GrpcMethod, start: &[u8], whole: bool) -> Result<Option<Read>> {
    if start.len() < 5 {
        return if whole {
            Err(Error::invalid("the gRPC request ends before its first message"))
        } else {
            Ok(None)
        };
    }
    if start[0] != 0 {
        return Err(Error::new(
            crate::error::ErrorKind::Unimplemented,
            crate::error::Origin::Gateway,
            "the endpoint picker reads the model from a request's first message, which came compressed: send it \
             uncompressed (grpc-encoding identity)",
        ));
    }
    let length = u32::from_be_bytes([start[1], start[2], start[3], start[4]]) as usize;
    let message = &start[5..];
    let complete = message.len() >= length;
    let message = &message[..message.len().min(length)];
    let Some(leading) = splice::leading_length(message, complete)? else {
        if message.len() >= MOST_READ {
            return Err(Error::invalid(format!(
                "the message's model name, version, id and parameters take more than {MOST_READ} bytes"
            )));
        }
        if whole {
            return Err(Error::invalid("the gRPC request ends inside its first message"));
        }
        return Ok(None);
    };
    let fields = &message[..leading];
    let named = splice::model_fields(fields)?;
    if named.name.is_empty() {
        return Err(Error::invalid("the request names no model (model_name is empty)"));
    }
    let reserved = match method {
        GrpcMethod::Describe => Reserved::default(),
        GrpcMethod::Infer | GrpcMethod::StreamInfer => Reserved::from_parameters(&splice::parameters(fields)?)?,
    };
    Ok(Some(Read {
        model: named.name.to_owned(),
        version: Some(named.version).filter(|v| !v.is_empty()).map(str::to_owned),
        reserved,
        grpc_frame: Some((length, leading)),
    }))
}

/// The body's chunks with the first `skip` bytes left out, sliced, not copied.
pub(super) fn skip(chunks: &[Bytes], mut skip: usize) -> Vec<Bytes> {
    let mut kept = Vec::with_capacity(chunks.len());
    for chunk in chunks {
        if skip >= chunk.len() {
            skip -= chunk.len();
            continue;
        }
        kept.push(chunk.slice(skip..));
        skip = 0;
    }
    kept
}
