//! The `convert` command: one inference request from one wire form to another, for inspecting and debugging.

use bytes::Bytes;
use prost::Message;

use crate::codec::rest::{self, BINARY_DATA_OUTPUT, RestRequest};
use crate::codec::{decthings, protobuf};
use crate::error::{Error, Result};
use crate::proto::ModelInferRequest;
use crate::protocol::{InferRequest, ParamValue};

/// Wire forms of an inference request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Form {
    /// REST JSON (`$inference_request`).
    Json,
    /// REST with the binary tensor data extension; the JSON header's length is given with --header-length or, when
    /// writing, printed on stderr.
    Binary,
    /// A serialized `inference.ModelInferRequest`.
    Protobuf,
    /// The request's inputs as Decthings tensors, one after another (writing only).
    Decthings,
}

/// A converted body and, for the binary form, the header length to send as `Inference-Header-Content-Length`.
#[derive(Debug)]
pub struct Converted {
    pub body: Bytes,
    pub header_length: Option<usize>,
}

pub fn read_request(input: Bytes, from: Form, header_length: Option<u64>) -> Result<InferRequest> {
    match from {
        Form::Json | Form::Binary => match rest::decode_request(input, header_length)? {
            RestRequest::Request {
                mut request,
                binary_outputs,
            } => {
                // Keep the caller's output preference visible in the other forms.
                if binary_outputs.all {
                    request
                        .parameters
                        .insert(BINARY_DATA_OUTPUT.to_owned(), ParamValue::Bool(true));
                }
                Ok(request)
            }
            RestRequest::RawBinary(_) => Err(Error::invalid(
                "a raw binary request (header length 0) needs the model's metadata to convert",
            )),
        },
        Form::Protobuf => {
            let message = ModelInferRequest::decode(input)
                .map_err(|e| Error::invalid(format!("not a ModelInferRequest: {e}")))?;
            protobuf::request_from_proto(message)
        }
        Form::Decthings => Err(Error::invalid(
            "Decthings carries tensors, not requests; it can only be written",
        )),
    }
}

pub fn write_request(request: InferRequest, to: Form) -> Result<Converted> {
    match to {
        Form::Json | Form::Binary => {
            let body = rest::encode_request(&request, to == Form::Binary)?;
            Ok(Converted {
                body: body.to_bytes(),
                header_length: body.header_length,
            })
        }
        Form::Protobuf => Ok(Converted {
            body: protobuf::request_to_proto(request).encode_to_vec().into(),
            header_length: None,
        }),
        Form::Decthings => {
            let mut out = Vec::new();
            for input in &request.inputs {
                out.extend_from_slice(&decthings::encode(input)?);
            }
            Ok(Converted {
                body: out.into(),
                header_length: None,
            })
        }
    }
}

pub fn convert(input: Bytes, from: Form, to: Form, header_length: Option<u64>) -> Result<Converted> {
    write_request(read_request(input, from, header_length)?, to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_to_protobuf_and_back() {
        let json = br#"{"id":"7","inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[1,2]}]}"#;
        let proto = convert(Bytes::from_static(json), Form::Json, Form::Protobuf, None).unwrap();
        let back = convert(proto.body, Form::Protobuf, Form::Json, None).unwrap();
        assert_eq!(&back.body[..], &json[..]);
        let binary = convert(Bytes::from_static(json), Form::Json, Form::Binary, None).unwrap();
        assert_eq!(binary.header_length, Some(binary.body.len() - 8));
        assert!(convert(Bytes::from_static(b"{}"), Form::Decthings, Form::Json, None).is_err());
    }
}
