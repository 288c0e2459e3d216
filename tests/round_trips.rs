//! Property tests: every datatype survives every codec bit for bit (NaN payloads aside where JSON is involved, and
//! FP16/BF16 widening to f32 in Decthings, as documented).

use bytes::Bytes;
use half::{bf16, f16};
use oipgate::codec::rest::{self, BinaryOutputs, RestRequest};
use oipgate::codec::{decthings, protobuf};
use oipgate::proto::{ModelInferRequest, ModelInferResponse};
use oipgate::protocol::{DataType, InferRequest, InferResponse, ParamValue, Parameters, RequestedOutput, Tensor};
use proptest::prelude::*;
use prost::Message;

fn parameter_value() -> impl Strategy<Value = ParamValue> {
    prop_oneof![
        any::<bool>().prop_map(ParamValue::Bool),
        any::<i64>().prop_map(ParamValue::Int64),
        ((i64::MAX as u64 + 1)..=u64::MAX).prop_map(ParamValue::Uint64),
        (prop::num::f64::NORMAL | prop::num::f64::SUBNORMAL | prop::num::f64::ZERO).prop_map(ParamValue::Double),
        "\\PC{0,8}".prop_map(ParamValue::String),
    ]
}

fn parameters() -> impl Strategy<Value = Parameters> {
    prop::collection::vec(("[a-z]{1,6}", parameter_value()), 0..3).prop_map(|entries| entries.into_iter().collect())
}

fn shape() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0u64..4, 0..4)
}

/// A valid tensor of any datatype; BYTES elements are UTF-8 when `utf8` (JSON can carry nothing else).
fn tensor(name: String, utf8: bool) -> impl Strategy<Value = Tensor> {
    (prop::sample::select(DataType::ALL.to_vec()), shape(), parameters()).prop_flat_map(
        move |(datatype, shape, parameters)| {
            let count = usize::try_from(shape.iter().product::<u64>()).unwrap();
            let name = name.clone();
            let data: BoxedStrategy<Bytes> = match datatype {
                DataType::Bytes if utf8 => prop::collection::vec("\\PC{0,6}", count)
                    .prop_map(|elements| {
                        let tensor = Tensor::from_bytes_elements(
                            "t",
                            vec![elements.len() as u64],
                            elements.iter().map(|s| s.as_bytes()),
                        )
                        .unwrap();
                        tensor.data
                    })
                    .boxed(),
                DataType::Bytes => prop::collection::vec(prop::collection::vec(any::<u8>(), 0..6), count)
                    .prop_map(|elements| {
                        Tensor::from_bytes_elements(
                            "t",
                            vec![elements.len() as u64],
                            elements.iter().map(Vec::as_slice),
                        )
                        .unwrap()
                        .data
                    })
                    .boxed(),
                DataType::Bool => prop::collection::vec(0u8..=1, count).prop_map(Bytes::from).boxed(),
                fixed => prop::collection::vec(any::<u8>(), count * fixed.element_size().unwrap())
                    .prop_map(Bytes::from)
                    .boxed(),
            };
            data.prop_map(move |data| Tensor {
                name: name.clone(),
                datatype,
                shape: shape.clone(),
                parameters: parameters.clone(),
                data,
            })
        },
    )
}

fn tensors(utf8: bool) -> impl Strategy<Value = Vec<Tensor>> {
    (0usize..4).prop_flat_map(move |n| (0..n).map(|i| tensor(format!("t{i}"), utf8)).collect::<Vec<_>>())
}

fn request(utf8: bool) -> impl Strategy<Value = InferRequest> {
    (
        tensors(utf8),
        parameters(),
        prop::option::of("[a-z0-9-]{1,8}"),
        prop::collection::vec("[a-z]{1,4}", 0..3),
    )
        .prop_map(|(inputs, parameters, id, outputs)| {
            let mut outputs: Vec<String> = outputs;
            outputs.sort();
            outputs.dedup();
            InferRequest {
                model_name: String::new(),
                model_version: None,
                id,
                parameters,
                inputs,
                outputs: outputs.into_iter().map(RequestedOutput::new).collect(),
            }
        })
}

fn response(utf8: bool) -> impl Strategy<Value = InferResponse> {
    (
        tensors(utf8),
        parameters(),
        prop::option::of("[a-z0-9]{1,8}"),
        prop::option::of("[0-9]{1,3}"),
    )
        .prop_map(|(outputs, parameters, id, model_version)| InferResponse {
            model_name: "model".into(),
            model_version,
            id,
            parameters,
            outputs,
        })
}

/// Replaces every NaN element with the datatype's canonical NaN: JSON carries NaN as `null`, without payload bits.
fn canonical_nans(tensor: &Tensor) -> Tensor {
    let data: Vec<u8> = match tensor.datatype {
        DataType::Fp16 => tensor
            .data
            .chunks_exact(2)
            .flat_map(|c| {
                let v = f16::from_le_bytes([c[0], c[1]]);
                if v.is_nan() { f16::NAN } else { v }.to_le_bytes()
            })
            .collect(),
        DataType::Bf16 => tensor
            .data
            .chunks_exact(2)
            .flat_map(|c| {
                let v = bf16::from_le_bytes([c[0], c[1]]);
                if v.is_nan() { bf16::NAN } else { v }.to_le_bytes()
            })
            .collect(),
        DataType::Fp32 => tensor
            .data
            .chunks_exact(4)
            .flat_map(|c| {
                let v = f32::from_le_bytes(c.try_into().unwrap());
                if v.is_nan() { f32::NAN } else { v }.to_le_bytes()
            })
            .collect(),
        DataType::Fp64 => tensor
            .data
            .chunks_exact(8)
            .flat_map(|c| {
                let v = f64::from_le_bytes(c.try_into().unwrap());
                if v.is_nan() { f64::NAN } else { v }.to_le_bytes()
            })
            .collect(),
        _ => return tensor.clone(),
    };
    Tensor {
        data: Bytes::from(data),
        ..tensor.clone()
    }
}

fn canonical(tensors: &[Tensor]) -> Vec<Tensor> {
    tensors.iter().map(canonical_nans).collect()
}

fn decode_rest(body: &rest::EncodedBody) -> (InferRequest, BinaryOutputs) {
    match rest::decode_request(body.to_bytes(), body.header_length.map(|l| l as u64)).unwrap() {
        RestRequest::Request {
            request,
            binary_outputs,
        } => (request, binary_outputs),
        RestRequest::RawBinary(_) => panic!("not a raw binary request"),
    }
}

/// Decthings carries no name or parameters beyond its own mapping, and widens FP16/BF16 to FP32.
fn through_decthings(tensor: &Tensor) -> Tensor {
    let encoded = decthings::encode(tensor).unwrap();
    let mut back = decthings::decode(&encoded, &tensor.name).unwrap();
    if matches!(tensor.datatype, DataType::Fp16 | DataType::Bf16) {
        let narrow: Vec<u8> = back
            .data
            .chunks_exact(4)
            .flat_map(|c| {
                let v = f32::from_le_bytes(c.try_into().unwrap());
                if tensor.datatype == DataType::Fp16 {
                    f16::from_f32(v).to_le_bytes()
                } else {
                    bf16::from_f32(v).to_le_bytes()
                }
            })
            .collect();
        back.data = Bytes::from(narrow);
        back.datatype = tensor.datatype;
    }
    back.parameters = tensor.parameters.clone();
    back
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn json_request(request in request(true)) {
        let (back, policy) = decode_rest(&rest::encode_request(&request, false).unwrap());
        prop_assert_eq!(policy, BinaryOutputs::default());
        prop_assert_eq!(canonical(&back.inputs), canonical(&request.inputs));
        prop_assert_eq!(&back.parameters, &request.parameters);
        prop_assert_eq!(&back.outputs, &request.outputs);
        prop_assert_eq!(&back.id, &request.id);
    }

    #[test]
    fn binary_extension_request_is_bit_exact(request in request(false)) {
        let (back, _) = decode_rest(&rest::encode_request(&request, true).unwrap());
        prop_assert_eq!(back, request);
    }

    #[test]
    fn rest_response_json_and_binary(response in response(true), binary in any::<bool>()) {
        let policy = BinaryOutputs { all: binary, outputs: vec![] };
        let body = rest::encode_response(&response, &policy).unwrap();
        let back = rest::decode_response(body.to_bytes(), body.header_length.map(|l| l as u64)).unwrap();
        if binary {
            prop_assert_eq!(back, response);
        } else {
            prop_assert_eq!(canonical(&back.outputs), canonical(&response.outputs));
            prop_assert_eq!(back.parameters, response.parameters);
        }
    }

    #[test]
    fn protobuf_is_bit_exact(request in request(false), response in response(false)) {
        let wire = Bytes::from(protobuf::request_to_proto(request.clone()).encode_to_vec());
        let back = protobuf::request_from_proto(ModelInferRequest::decode(wire).unwrap()).unwrap();
        prop_assert_eq!(back, request);
        let wire = Bytes::from(protobuf::response_to_proto(response.clone()).encode_to_vec());
        let back = protobuf::response_from_proto(ModelInferResponse::decode(wire).unwrap()).unwrap();
        prop_assert_eq!(back, response);
    }

    #[test]
    fn splice_renames_only_the_names(request in request(false), name in "[a-z_]{1,12}", version in "[0-9]{0,3}") {
        let wire = Bytes::from(protobuf::request_to_proto(request.clone()).encode_to_vec());
        let fields = oipgate::codec::splice::model_fields(&wire).unwrap();
        prop_assert_eq!((fields.name, fields.version), ("", ""));
        let renamed: Vec<u8> = oipgate::codec::splice::rename(&wire, &name, &version).unwrap().concat();
        let back = protobuf::request_from_proto(ModelInferRequest::decode(&renamed[..]).unwrap()).unwrap();
        prop_assert_eq!(&back.model_name, &name);
        prop_assert_eq!(back.model_version.as_deref().unwrap_or(""), version.as_str());
        prop_assert_eq!(InferRequest { model_name: String::new(), model_version: None, ..back }, request);
    }

    #[test]
    fn decthings_round_trip(tensor in tensor("d".into(), false)) {
        prop_assert_eq!(canonical_nans(&through_decthings(&tensor)), canonical_nans(&tensor));
    }

    /// JSON -> model -> protobuf -> binary extension -> Decthings, and the tensors are still the same.
    #[test]
    fn every_codec_in_a_chain(request in request(true)) {
        let (from_json, _) = decode_rest(&rest::encode_request(&request, false).unwrap());
        let wire = Bytes::from(protobuf::request_to_proto(from_json).encode_to_vec());
        let from_proto = protobuf::request_from_proto(ModelInferRequest::decode(wire).unwrap()).unwrap();
        let (from_binary, _) = decode_rest(&rest::encode_request(&from_proto, true).unwrap());
        let from_decthings: Vec<Tensor> = from_binary.inputs.iter().map(through_decthings).collect();
        prop_assert_eq!(canonical(&from_decthings), canonical(&request.inputs));
    }
}
