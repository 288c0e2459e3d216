//! The protobuf codec: typed and raw contents, every rejection, and zero-copy raw contents.

use std::collections::BTreeMap;

use bytes::Bytes;
use oipgate::codec::protobuf::{request_from_proto, request_to_proto, response_from_proto, response_to_proto};
use oipgate::codec::rest::{self, BinaryOutputs};
use oipgate::proto::infer_parameter::ParameterChoice;
use oipgate::proto::model_infer_request::InferInputTensor;
use oipgate::proto::model_infer_response::InferOutputTensor;
use oipgate::proto::{InferParameter, InferTensorContents, ModelInferRequest, ModelInferResponse};
use oipgate::protocol::{DataType, InferRequest, ParamValue, RequestedOutput, Tensor};
use prost::Message;

fn input(name: &str, datatype: &str, shape: &[i64], contents: Option<InferTensorContents>) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape: shape.to_vec(),
        parameters: BTreeMap::new(),
        contents,
    }
}

fn with_inputs(inputs: Vec<InferInputTensor>, raw: Vec<Bytes>) -> ModelInferRequest {
    ModelInferRequest {
        model_name: "m".into(),
        inputs,
        raw_input_contents: raw,
        ..Default::default()
    }
}

fn rejected(message: ModelInferRequest, expected: &str) {
    let error = request_from_proto(message).unwrap_err().to_string();
    assert!(error.contains(expected), "expected {expected:?} in {error:?}");
}

#[test]
fn typed_contents_of_every_field() {
    let cases: Vec<(&str, InferTensorContents, Vec<u8>)> = vec![
        (
            "BOOL",
            InferTensorContents {
                bool_contents: vec![true, false],
                ..Default::default()
            },
            vec![1, 0],
        ),
        (
            "INT8",
            InferTensorContents {
                int_contents: vec![-1, 2],
                ..Default::default()
            },
            vec![255, 2],
        ),
        (
            "INT16",
            InferTensorContents {
                int_contents: vec![-2, 3],
                ..Default::default()
            },
            vec![254, 255, 3, 0],
        ),
        (
            "INT32",
            InferTensorContents {
                int_contents: vec![1, -1],
                ..Default::default()
            },
            [1i32, -1].iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (
            "INT64",
            InferTensorContents {
                int64_contents: vec![i64::MIN, 7],
                ..Default::default()
            },
            [i64::MIN, 7].iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (
            "UINT8",
            InferTensorContents {
                uint_contents: vec![255, 0],
                ..Default::default()
            },
            vec![255, 0],
        ),
        (
            "UINT16",
            InferTensorContents {
                uint_contents: vec![65535, 1],
                ..Default::default()
            },
            vec![255, 255, 1, 0],
        ),
        (
            "UINT32",
            InferTensorContents {
                uint_contents: vec![u32::MAX, 1],
                ..Default::default()
            },
            [u32::MAX, 1].iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (
            "UINT64",
            InferTensorContents {
                uint64_contents: vec![u64::MAX, 1],
                ..Default::default()
            },
            [u64::MAX, 1].iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (
            "FP32",
            InferTensorContents {
                fp32_contents: vec![0.5, -1.0],
                ..Default::default()
            },
            [0.5f32, -1.0].iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (
            "FP64",
            InferTensorContents {
                fp64_contents: vec![0.25, 1e300],
                ..Default::default()
            },
            [0.25f64, 1e300].iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (
            "BYTES",
            InferTensorContents {
                bytes_contents: vec![Bytes::from_static(b"ab"), Bytes::new()],
                ..Default::default()
            },
            b"\x02\0\0\0ab\0\0\0\0".to_vec(),
        ),
    ];
    for (datatype, contents, expected) in cases {
        let request = request_from_proto(with_inputs(vec![input("x", datatype, &[2], Some(contents))], vec![]))
            .unwrap_or_else(|e| panic!("{datatype}: {e}"));
        assert_eq!(&request.inputs[0].data[..], &expected[..], "{datatype}");
        // Encoding always writes raw contents.
        let encoded = request_to_proto(request);
        assert_eq!(&encoded.raw_input_contents[0][..], &expected[..]);
        assert!(encoded.inputs[0].contents.is_none());
    }
}

#[test]
fn typed_contents_are_range_and_type_checked() {
    let ints = |v: Vec<i32>| {
        Some(InferTensorContents {
            int_contents: v,
            ..Default::default()
        })
    };
    let uints = |v: Vec<u32>| {
        Some(InferTensorContents {
            uint_contents: v,
            ..Default::default()
        })
    };
    rejected(
        with_inputs(vec![input("x", "INT8", &[1], ints(vec![200]))], vec![]),
        "200 does not fit",
    );
    rejected(
        with_inputs(vec![input("x", "INT16", &[1], ints(vec![40000]))], vec![]),
        "40000 does not fit",
    );
    rejected(
        with_inputs(vec![input("x", "UINT8", &[1], uints(vec![256]))], vec![]),
        "256 does not fit",
    );
    rejected(
        with_inputs(vec![input("x", "UINT16", &[1], uints(vec![70000]))], vec![]),
        "70000 does not fit",
    );
    rejected(
        with_inputs(vec![input("x", "FP32", &[1], ints(vec![1]))], vec![]),
        "FP32 data must be in contents.fp32_contents, got contents.int_contents",
    );
    let both = InferTensorContents {
        fp32_contents: vec![1.0],
        int_contents: vec![1],
        ..Default::default()
    };
    rejected(
        with_inputs(vec![input("x", "FP32", &[1], Some(both))], vec![]),
        "int_contents, contents.fp32",
    );
    rejected(
        with_inputs(vec![input("x", "FP16", &[1], ints(vec![1]))], vec![]),
        "FP16 data can only be sent as raw",
    );
    rejected(
        with_inputs(vec![input("x", "INT32", &[3], ints(vec![1, 2]))], vec![]),
        "expected 3 elements",
    );
    rejected(
        with_inputs(vec![input("x", "INT32", &[-1], ints(vec![1]))], vec![]),
        "shape dimension -1 is negative",
    );
    rejected(
        with_inputs(vec![input("x", "int32", &[1], ints(vec![1]))], vec![]),
        "unknown datatype \"int32\"",
    );
    rejected(
        with_inputs(vec![input("x", "INT32", &[1], None)], vec![]),
        "input 'x' has no contents",
    );
}

#[test]
fn raw_contents_rules() {
    let raw = |n: usize| Bytes::from(vec![0u8; n]);
    // Raw and typed contents together are invalid.
    let typed = Some(InferTensorContents {
        int_contents: vec![1],
        ..Default::default()
    });
    rejected(
        with_inputs(vec![input("x", "INT32", &[1], typed)], vec![raw(4)]),
        "also has raw_input_contents",
    );
    rejected(
        with_inputs(
            vec![input("x", "INT32", &[1], None), input("y", "INT32", &[1], None)],
            vec![raw(4)],
        ),
        "raw_input_contents has 1 entries for 2 inputs",
    );
    rejected(
        with_inputs(vec![input("x", "FP32", &[2], None)], vec![raw(4)]),
        "expected 2 FP32 elements (8 bytes)",
    );
    rejected(
        with_inputs(vec![input("x", "BYTES", &[1], None)], vec![raw(3)]),
        "truncated length prefix",
    );
    rejected(
        with_inputs(
            vec![input("x", "FP32", &[1], None), input("x", "FP32", &[1], None)],
            vec![raw(4), raw(4)],
        ),
        "used more than once",
    );
    rejected(
        with_inputs(vec![input("x", "FP32", &[1 << 40], None)], vec![raw(10)]),
        "got 10 bytes",
    );
    // A tensor with no elements needs no contents at all.
    let empty = request_from_proto(with_inputs(vec![input("x", "FP32", &[0, 3], None)], vec![])).unwrap();
    assert!(empty.inputs[0].data.is_empty());
}

#[test]
fn decoded_raw_contents_share_the_received_buffer() {
    let payload = Bytes::from(vec![7u8; 1 << 16]);
    let message = with_inputs(vec![input("x", "UINT8", &[1 << 16], None)], vec![payload]);
    let wire = Bytes::from(message.encode_to_vec());
    let decoded = request_from_proto(ModelInferRequest::decode(wire.clone()).unwrap()).unwrap();
    let data = &decoded.inputs[0].data;
    let wire_range = wire.as_ptr() as usize..wire.as_ptr() as usize + wire.len();
    assert!(
        wire_range.contains(&(data.as_ptr() as usize)),
        "raw contents were copied out of the message buffer"
    );
}

#[test]
fn http_only_parameters_never_reach_protobuf() {
    let mut tensor = Tensor::new("x", DataType::Int8, vec![1], Bytes::from_static(&[1])).unwrap();
    tensor
        .parameters
        .insert("binary_data_size".into(), ParamValue::Int64(1));
    tensor
        .parameters
        .insert("content_type".into(), ParamValue::String("np".into()));
    let mut output = RequestedOutput::new("y");
    output.parameters.insert("binary_data".into(), ParamValue::Bool(true));
    let mut request = InferRequest {
        inputs: vec![tensor],
        outputs: vec![output],
        ..InferRequest::default()
    };
    request
        .parameters
        .insert("binary_data_output".into(), ParamValue::Bool(true));
    request
        .parameters
        .insert("priority".into(), ParamValue::Uint64(u64::MAX));
    let message = request_to_proto(request);
    assert!(!message.parameters.contains_key("binary_data_output"));
    assert_eq!(
        message.parameters["priority"].parameter_choice,
        Some(ParameterChoice::Uint64Param(u64::MAX))
    );
    assert!(!message.inputs[0].parameters.contains_key("binary_data_size"));
    assert!(message.inputs[0].parameters.contains_key("content_type"));
    assert!(message.outputs[0].parameters.is_empty());
}

#[test]
fn triton_superset_parameters_are_read() {
    let mut message = with_inputs(vec![], vec![]);
    message.parameters.insert(
        "d".into(),
        InferParameter {
            parameter_choice: Some(ParameterChoice::DoubleParam(0.5)),
        },
    );
    message.parameters.insert(
        "u".into(),
        InferParameter {
            parameter_choice: Some(ParameterChoice::Uint64Param(9)),
        },
    );
    message
        .parameters
        .insert("none".into(), InferParameter { parameter_choice: None });
    let request = request_from_proto(message).unwrap();
    assert_eq!(request.parameters.keys().collect::<Vec<_>>(), ["d", "u"]);
    assert_eq!(request.parameters["d"], ParamValue::Double(0.5));
    assert_eq!(request.parameters["u"], ParamValue::Uint64(9));
}

#[test]
fn responses_with_typed_outputs_are_read_and_raw_ones_written() {
    let message = ModelInferResponse {
        model_name: "m".into(),
        model_version: "2".into(),
        outputs: vec![InferOutputTensor {
            name: "o".into(),
            datatype: "FP32".into(),
            shape: vec![2],
            contents: Some(InferTensorContents {
                fp32_contents: vec![1.5, 2.5],
                ..Default::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    };
    let response = response_from_proto(message).unwrap();
    assert_eq!(response.model_version.as_deref(), Some("2"));
    let back = response_to_proto(response.clone());
    assert_eq!(back.raw_output_contents.len(), 1);
    assert_eq!(response_from_proto(back).unwrap(), response);
}

/// The benchmark's zero-copy promise: a 64 MiB raw output becomes a binary-extension chunk without a copy.
#[test]
fn raw_output_to_binary_extension_chunks_without_copy() {
    let payload = Bytes::from(vec![1u8; 64 << 20]);
    let message = ModelInferResponse {
        model_name: "m".into(),
        outputs: vec![InferOutputTensor {
            name: "o".into(),
            datatype: "FP32".into(),
            shape: vec![16 << 20],
            ..Default::default()
        }],
        raw_output_contents: vec![payload.clone()],
        ..Default::default()
    };
    let response = response_from_proto(message).unwrap();
    let body = rest::encode_response(&response, &BinaryOutputs::all_binary()).unwrap();
    assert_eq!(body.chunks.len(), 2);
    assert_eq!(body.chunks[1].as_ptr(), payload.as_ptr());
    assert_eq!(body.chunks[1].len(), payload.len());
}

#[test]
fn chunked_encoding_is_prosts_encoding_without_copies() {
    let mut request = request_from_proto(with_inputs(
        vec![
            input("a", "FP32", &[2], None),
            input("empty", "UINT8", &[0], None),
            input("b", "BYTES", &[1], None),
        ],
        vec![
            Bytes::from(vec![0u8; 8]),
            Bytes::new(),
            Bytes::from_static(b"\x01\0\0\0z"),
        ],
    ))
    .unwrap();
    request.parameters.insert("z".into(), ParamValue::Int64(1));
    request.parameters.insert("a".into(), ParamValue::String("s".into()));
    let encoded = oipgate::codec::protobuf::encode_request(request.clone());
    assert_eq!(
        encoded.to_bytes(),
        Bytes::from(request_to_proto(request.clone()).encode_to_vec())
    );
    let a = encoded
        .chunks
        .iter()
        .find(|c| c.as_ptr() == request.inputs[0].data.as_ptr());
    assert!(a.is_some(), "the tensor buffer is one of the chunks");
    let decoded = request_from_proto(ModelInferRequest::decode(encoded.to_bytes()).unwrap()).unwrap();
    assert_eq!(decoded, request);

    let response = oipgate::protocol::InferResponse {
        model_name: "m".into(),
        outputs: request.inputs.clone(),
        ..Default::default()
    };
    let encoded = oipgate::codec::protobuf::encode_response(response.clone());
    assert_eq!(
        encoded.to_bytes(),
        Bytes::from(response_to_proto(response).encode_to_vec())
    );
}
