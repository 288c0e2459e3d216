//! The REST codec (JSON and binary tensor data extension) against the examples of the specs and every rejection.

use bytes::Bytes;
use half::f16;
use oipgate::codec::rest::{
    self, BinaryOutputs, EncodedBody, RestRequest, decode_request, decode_response, encode_request, encode_response,
};
use oipgate::protocol::{DataType, InferRequest, InferResponse, ParamValue, Tensor, TensorMetadata};

fn request(body: &str) -> Result<(InferRequest, BinaryOutputs), String> {
    request_with_binary(body.as_bytes(), &[], false)
}

fn request_with_binary(
    header: &[u8],
    binary: &[u8],
    with_length: bool,
) -> Result<(InferRequest, BinaryOutputs), String> {
    let body = Bytes::from([header, binary].concat());
    let length = with_length.then_some(header.len() as u64);
    match decode_request(body, length).map_err(|e| e.to_string())? {
        RestRequest::Request {
            request,
            binary_outputs,
        } => Ok((request, binary_outputs)),
        RestRequest::RawBinary(_) => Err("raw binary".into()),
    }
}

fn rejected(body: &str, message: &str) {
    let error = request(body).unwrap_err();
    assert!(
        error.contains(message),
        "expected an error containing {message:?}, got {error:?}"
    );
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The binary extension's first example request. Its text gives input0 (FP16, shape [2, 2]) a binary_data_size of
/// 16, but four FP16 elements are 8 bytes: the example as printed is inconsistent, and is rejected.
const SPEC_BINARY_REQUEST: &str = r#"{
  "model_name" : "mymodel",
  "inputs" : [
    { "name" : "input0", "shape" : [ 2, 2 ], "datatype" : "FP16", "parameters" : { "binary_data_size" : 16 } },
    { "name" : "input1", "shape" : [ 2, 2 ], "datatype" : "UINT32", "data": [[1, 2], [3, 4]] },
    { "name" : "input2", "shape" : [ 3 ], "datatype" : "BOOL", "parameters" : { "binary_data_size" : 3 } }
  ],
  "outputs" : [
    { "name" : "output0", "parameters" : { "binary_data" : true } },
    { "name" : "output1" }
  ]
}"#;

#[test]
fn spec_binary_request_as_printed_is_inconsistent_and_rejected() {
    let binary = [0u8; 19];
    let error = request_with_binary(SPEC_BINARY_REQUEST.as_bytes(), &binary, true).unwrap_err();
    assert!(error.contains("input 'input0' (binary_data_size 16)"), "{error}");
    assert!(
        error.contains("expected 4 FP16 elements (8 bytes)") && error.contains("got 16 bytes"),
        "{error}"
    );
}

#[test]
fn spec_binary_request_with_consistent_sizes() {
    let header = SPEC_BINARY_REQUEST.replace("\"binary_data_size\" : 16", "\"binary_data_size\" : 8");
    let fp16: Vec<u8> = [1.0f32, 2.5, -3.0, 0.5]
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect();
    let binary = [&fp16[..], &[1, 0, 1]].concat();
    let body = Bytes::from([header.as_bytes(), &binary].concat());
    let RestRequest::Request {
        request,
        binary_outputs,
    } = decode_request(body.clone(), Some(header.len() as u64)).unwrap()
    else {
        panic!("not a raw binary request")
    };
    assert_eq!(request.model_name, "mymodel");
    let [input0, input1, input2] = &request.inputs[..] else {
        panic!("three inputs")
    };
    assert_eq!((input0.datatype, &input0.shape[..]), (DataType::Fp16, &[2, 2][..]));
    assert_eq!(&input0.data[..], &fp16[..]);
    // Binary sections are slices of the received body, not copies.
    assert_eq!(input0.data.as_ptr(), body[header.len()..].as_ptr());
    assert_eq!(input2.data.as_ptr(), body[header.len() + 8..].as_ptr());
    assert_eq!(&input1.data[..], &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0]);
    assert_eq!(&input2.data[..], &[1, 0, 1]);
    // The extension's own parameters are consumed, never passed on.
    assert!(input0.parameters.is_empty() && input2.parameters.is_empty());
    assert!(request.outputs.iter().all(|o| o.parameters.is_empty()));
    assert!(binary_outputs.is_binary("output0"));
    assert!(!binary_outputs.is_binary("output1"));
}

/// The binary extension's first example response: output0 binary (FP16 [3, 2]), output1 JSON (FP32 [2, 2]). Its
/// text says 16 bytes for output0; six FP16 elements are 12.
#[test]
fn spec_binary_response() {
    let fp16: Vec<u8> = (0..6).flat_map(|i| f16::from_f32(i as f32).to_le_bytes()).collect();
    let fp32: Vec<u8> = [1.203f32, 5.403, 3.434, 34.234]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let output0 = Tensor::new("output0", DataType::Fp16, vec![3, 2], Bytes::from(fp16.clone())).unwrap();
    let response = InferResponse {
        model_name: "mymodel".into(),
        outputs: vec![
            output0,
            Tensor::new("output1", DataType::Fp32, vec![2, 2], Bytes::from(fp32)).unwrap(),
        ],
        ..InferResponse::default()
    };
    let policy = BinaryOutputs {
        all: false,
        outputs: vec![("output0".into(), true)],
    };
    let body = encode_response(&response, &policy).unwrap();
    let header = r#"{"model_name":"mymodel","outputs":[{"name":"output0","datatype":"FP16","shape":[3,2],"parameters":{"binary_data_size":12}},{"name":"output1","datatype":"FP32","shape":[2,2],"data":[1.203,5.403,3.434,34.234]}]}"#;
    assert_eq!(std::str::from_utf8(&body.chunks[0]).unwrap(), header);
    assert_eq!(body.header_length, Some(header.len()));
    assert_eq!(body.content_length(), header.len() + 12);
    assert_eq!(body.content_type(), "application/octet-stream");
    // The binary chunk is the output's own buffer.
    assert_eq!(body.chunks[1].as_ptr(), response.outputs[0].data.as_ptr());
    let back = decode_response(body.to_bytes(), body.header_length.map(|l| l as u64)).unwrap();
    assert_eq!(back, response);
}

/// The second example: `binary_data_output: true` makes every output binary (FP32 [2, 2] is 16 bytes; the text
/// says 32).
#[test]
fn spec_binary_data_output_example() {
    let (request, policy) = request(
        r#"{"model_name": "my_model", "inputs": [{"name": "input_tensor", "datatype": "FP32", "shape": [1, 2],
            "data": [[32.045, 399.043]]}], "parameters": {"binary_data_output": true}}"#,
    )
    .unwrap();
    assert!(request.parameters.is_empty(), "binary_data_output is consumed");
    assert_eq!(f32s(&request.inputs[0]), [32.045, 399.043]);
    let response = InferResponse {
        model_name: "my_model".into(),
        outputs: vec![
            Tensor::new("output_tensor0", DataType::Fp16, vec![3, 2], Bytes::from(vec![0u8; 12])).unwrap(),
            Tensor::new("output_tensor1", DataType::Fp32, vec![2, 2], Bytes::from(vec![0u8; 16])).unwrap(),
        ],
        ..InferResponse::default()
    };
    let body = encode_response(&response, &policy).unwrap();
    assert_eq!(body.chunks.len(), 3);
    assert_eq!(body.content_length(), body.header_length.unwrap() + 28);
    let text = std::str::from_utf8(&body.chunks[0]).unwrap();
    assert!(
        text.contains(r#""binary_data_size":12"#) && text.contains(r#""binary_data_size":16"#),
        "{text}"
    );
    // An output's own binary_data: false overrides the request-level setting.
    let policy = BinaryOutputs {
        all: true,
        outputs: vec![("output_tensor1".into(), false)],
    };
    let body = encode_response(&response, &policy).unwrap();
    assert_eq!(body.chunks.len(), 2);
    assert!(
        std::str::from_utf8(&body.chunks[0])
            .unwrap()
            .contains(r#""data":[0.0,0.0,0.0,0.0]"#)
    );
}

/// The protocol's JSON example request: input1 (BOOL, shape [3]) carries one value, so as printed it is rejected.
#[test]
fn oip_example_request_and_response() {
    let example = r#"{
      "id" : "42",
      "inputs" : [
        { "name" : "input0", "shape" : [ 2, 2 ], "datatype" : "UINT32", "data" : [ 1, 2, 3, 4 ] },
        { "name" : "input1", "shape" : [ 3 ], "datatype" : "BOOL", "data" : [ true ] }
      ],
      "outputs" : [ { "name" : "output0" } ]
    }"#;
    let error = request(example).unwrap_err();
    assert!(error.contains("input 'input1'") && error.contains("expected 3 elements") && error.contains("got 1"));
    let (decoded, _) = request(&example.replace("[ true ]", "[ true, false, true ]")).unwrap();
    assert_eq!(decoded.id.as_deref(), Some("42"));
    assert_eq!(&decoded.inputs[1].data[..], &[1, 0, 1]);
    assert_eq!(decoded.outputs[0].name, "output0");

    let values = [1.0f32, 1.1, 2.0, 2.1, 3.0, 3.1];
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let response = InferResponse {
        model_name: "mymodel".into(),
        id: Some("42".into()),
        outputs: vec![Tensor::new("output0", DataType::Fp32, vec![3, 2], Bytes::from(data)).unwrap()],
        ..InferResponse::default()
    };
    let body = encode_response(&response, &BinaryOutputs::default()).unwrap();
    assert_eq!(body.header_length, None);
    assert_eq!(body.content_type(), "application/json");
    assert_eq!(
        std::str::from_utf8(&body.to_bytes()).unwrap(),
        r#"{"model_name":"mymodel","id":"42","outputs":[{"name":"output0","datatype":"FP32","shape":[3,2],"data":[1.0,1.1,2.0,2.1,3.0,3.1]}]}"#
    );
}

#[test]
fn mlserver_content_types_and_nan_pass_through() {
    let (request, _) = request(
        r#"{"parameters": {"content_type": "pd"}, "inputs": [
            {"name": "foo", "parameters": {"content_type": "np"}, "data": [1.2, 2.3, null, 4.5],
             "datatype": "FP64", "shape": [2, 2]},
            {"name": "s", "parameters": {"content_type": "str"}, "data": ["bar", "bar2"], "datatype": "BYTES",
             "shape": [2]}]}"#,
    )
    .unwrap();
    assert_eq!(request.parameters["content_type"], ParamValue::String("pd".into()));
    assert_eq!(
        request.inputs[0].parameters["content_type"],
        ParamValue::String("np".into())
    );
    let third = f64::from_le_bytes(request.inputs[0].data[16..24].try_into().unwrap());
    assert!(third.is_nan());
    let encoded = encode_request(&request, false).unwrap();
    let text = std::str::from_utf8(&encoded.chunks[0]).unwrap();
    assert!(text.contains(r#""data":[1.2,2.3,null,4.5]"#), "{text}");
    assert!(
        text.contains(r#""parameters":{"content_type":"str"},"data":["bar","bar2"]"#),
        "{text}"
    );
}

#[test]
fn missing_fields_are_named() {
    rejected(
        r#"{"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}"#,
        "input 0 has no \"name\"",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "shape": [1], "data": [1]}]}"#,
        "input 'x' has no \"datatype\"",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "FP32", "data": [1]}]}"#,
        "input 'x' has no \"shape\"",
    );
    rejected(r#"{"id": "1"}"#, "no \"inputs\"");
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}"#,
        "neither \"data\" nor binary",
    );
    rejected(
        r#"{"inputs": [], "outputs": [{"parameters": {}}]}"#,
        "requested output 0 has no \"name\"",
    );
}

#[test]
fn bad_datatypes_shapes_and_values() {
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "fp32", "shape": [1], "data": [1]}]}"#,
        "unknown datatype \"fp32\"",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}]}"#,
        "dimension -1",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1.5], "data": [1]}]}"#,
        "dimension 1.5",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [300]}]}"#,
        "300 is out of range",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "UINT32", "shape": [1], "data": [-1]}]}"#,
        "-1 is out of range",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [1.5]}]}"#,
        "non-integer `1.5`",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}]}"#,
        "got the string",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": [1]}]}"#,
        "expected a string",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "INT8", "shape": [2], "data": [1]}]}"#,
        "input 'x': expected 2",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "data": [1]},
                      {"name": "x", "datatype": "INT8", "shape": [1], "data": [2]}]}"#,
        "input name 'x' is used more than once",
    );
    rejected(
        r#"{"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "data": [1]}], "parameters": {"binary_data_output": 1}}"#,
        "must be a bool",
    );
}

#[test]
fn malformed_json_and_deep_nesting_fail_cleanly() {
    rejected("{", "invalid JSON at byte 1");
    rejected("[]", "expected '{'");
    rejected("", "invalid JSON at byte 0");
    let deep = format!(
        r#"{{"inputs": [{{"name": "x", "datatype": "INT8", "shape": [1], "data": {}1{}}}]}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    rejected(&deep, "deeper than 128 levels");
    let ok = format!(
        r#"{{"inputs": [{{"name": "x", "datatype": "INT8", "shape": [1], "data": {}1{}}}]}}"#,
        "[".repeat(64),
        "]".repeat(64)
    );
    let (nested, _) = request(&ok).unwrap();
    assert_eq!(nested.inputs[0].data.as_ref(), [1u8]);
}

fn binary_input(datatype: &str, shape: &str, size: usize) -> String {
    format!(
        r#"{{"inputs": [{{"name": "b", "datatype": "{datatype}", "shape": {shape}, "parameters": {{"binary_data_size": {size}}}}}]}}"#
    )
}

#[test]
fn binary_section_rejections() {
    let header = binary_input("FP32", "[2]", 8);
    let error = decode_request(Bytes::from(header.clone()), Some(header.len() as u64 + 1)).unwrap_err();
    assert!(error.to_string().contains("larger than the body"), "{error}");
    let short = request_with_binary(header.as_bytes(), &[0; 4], true).unwrap_err();
    assert!(
        short.contains("declares binary_data_size 8 but only 4 bytes"),
        "{short}"
    );
    let long = request_with_binary(header.as_bytes(), &[0; 12], true).unwrap_err();
    assert!(long.contains("4 bytes of binary data are left over"), "{long}");
    let wrong = binary_input("FP32", "[3]", 8);
    let mismatch = request_with_binary(wrong.as_bytes(), &[0; 8], true).unwrap_err();
    assert!(mismatch.contains("expected 3 FP32 elements (12 bytes)"), "{mismatch}");
    let strings = binary_input("BYTES", "[2]", 7);
    let truncated = request_with_binary(strings.as_bytes(), b"\x01\0\0\0a\x01\0", true).unwrap_err();
    assert!(truncated.contains("truncated length prefix"), "{truncated}");
    let strings = binary_input("BYTES", "[2]", 5);
    let count = request_with_binary(strings.as_bytes(), b"\x01\0\0\0a", true).unwrap_err();
    assert!(
        count.contains("expected 2 BYTES elements") && count.contains("got 1"),
        "{count}"
    );
    let both = r#"{"inputs": [{"name": "b", "datatype": "INT8", "shape": [1], "data": [1], "parameters": {"binary_data_size": 1}}]}"#;
    assert!(
        request_with_binary(both.as_bytes(), &[1], true)
            .unwrap_err()
            .contains("both \"data\" and binary")
    );
    let negative = binary_input("INT8", "[1]", 0).replace(": 0", ": -1");
    assert!(
        request_with_binary(negative.as_bytes(), &[], true)
            .unwrap_err()
            .contains("non-negative integer")
    );
    // Without Inference-Header-Content-Length there is no binary section to read.
    assert!(
        request(&binary_input("INT8", "[1]", 1))
            .unwrap_err()
            .contains("only 0 bytes")
    );
    // A huge declared shape on a small body is an error, not an allocation.
    let huge = binary_input("FP32", "[1099511627776]", 8);
    let error = request_with_binary(huge.as_bytes(), &[0; 8], true).unwrap_err();
    assert!(
        error.contains("expected 1099511627776 FP32 elements") && error.contains("got 8 bytes"),
        "{error}"
    );
    let huge_json = r#"{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1099511627776], "data": [1]}]}"#;
    assert!(request(huge_json).unwrap_err().contains("at most"));
}

#[test]
fn raw_binary_request_fills_the_only_input() {
    let body = Bytes::from(vec![0u8; 24]);
    let RestRequest::RawBinary(raw) = decode_request(body.clone(), Some(0)).unwrap() else {
        panic!("header length 0 is a raw binary request")
    };
    let metadata = TensorMetadata {
        name: "INPUT0".into(),
        datatype: "FP32".into(),
        shape: vec![-1, 3],
    };
    let (request, policy) = rest::raw_binary_request(raw, &metadata).unwrap();
    assert_eq!(request.inputs[0].shape, vec![2, 3]);
    assert_eq!(request.inputs[0].data.as_ptr(), body.as_ptr());
    assert!(policy.is_binary("anything"));
    let odd = rest::raw_binary_request(Bytes::from(vec![0u8; 10]), &metadata).unwrap_err();
    assert!(
        odd.to_string().contains("raw binary request for input 'INPUT0'"),
        "{odd}"
    );
    let two_variable = TensorMetadata {
        shape: vec![-1, -1],
        ..metadata
    };
    let error = rest::raw_binary_request(Bytes::new(), &two_variable).unwrap_err();
    assert!(
        error.to_string().contains("more than one variable dimension"),
        "{error}"
    );
}

#[test]
fn request_encoding_for_rest_backends() {
    let input = Tensor::new("x", DataType::Int16, vec![2], Bytes::from_static(&[1, 0, 255, 255])).unwrap();
    let mut request = InferRequest {
        model_name: "m".into(),
        id: Some("r1".into()),
        inputs: vec![input],
        outputs: vec![oipgate::protocol::RequestedOutput::new("y")],
        ..InferRequest::default()
    };
    request
        .parameters
        .insert("binary_data_output".into(), ParamValue::Bool(true));
    let json = encode_request(&request, false).unwrap();
    assert_eq!(
        std::str::from_utf8(&json.to_bytes()).unwrap(),
        r#"{"id":"r1","inputs":[{"name":"x","datatype":"INT16","shape":[2],"data":[1,-1]}],"outputs":[{"name":"y"}],"parameters":{"binary_data_output":true}}"#
    );
    let binary: EncodedBody = encode_request(&request, true).unwrap();
    assert_eq!(binary.chunks[1].as_ptr(), request.inputs[0].data.as_ptr());
    let RestRequest::Request {
        request: back,
        binary_outputs,
    } = decode_request(binary.to_bytes(), binary.header_length.map(|l| l as u64)).unwrap()
    else {
        panic!()
    };
    assert!(binary_outputs.all);
    request.parameters.clear();
    request.model_name.clear();
    assert_eq!(back, request);
}

#[test]
fn responses_with_problems_are_rejected() {
    assert!(
        decode_response(Bytes::from_static(b"{\"outputs\":[{}]}"), None)
            .unwrap_err()
            .to_string()
            .contains("output 0")
    );
    let error = decode_response(Bytes::from_static(b"{}"), Some(0)).unwrap_err();
    assert!(
        error.to_string().contains("Inference-Header-Content-Length of 0"),
        "{error}"
    );
    let non_utf8 = InferResponse {
        outputs: vec![Tensor::from_bytes_elements("o", vec![1], [&b"\xff"[..]]).unwrap()],
        ..InferResponse::default()
    };
    let error = encode_response(&non_utf8, &BinaryOutputs::default())
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("tensor 'o'") && error.contains("not valid UTF-8"),
        "{error}"
    );
    let binary = encode_response(&non_utf8, &BinaryOutputs::all_binary()).unwrap();
    assert!(
        binary.to_bytes().ends_with(b"\x01\x00\x00\x00\xff"),
        "the element travels as bytes, length first"
    );
}
