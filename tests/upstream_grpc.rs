//! The gRPC upstream client against the built-in model server: messages as chunks out, a slice back, errors with
//! their codes, deadlines, a backend that is down, and the response size limit.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::ModelServerProcess;
use http::HeaderMap;
use oipgate::codec::protobuf;
use oipgate::config::Endpoint;
use oipgate::proto::ModelInferResponse;
use oipgate::protocol::{DataType, InferRequest, ParamValue, Tensor};
use oipgate::upstream::GrpcUpstream;
use oipgate::{ErrorKind, Origin};
use prost::Message;
use tonic::Code;

const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";

fn upstream(server: &ModelServerProcess, max_response_bytes: usize) -> GrpcUpstream {
    let addr = server.grpc.unwrap();
    let endpoint = Endpoint {
        host: addr.ip().to_string(),
        port: addr.port(),
    };
    GrpcUpstream::new(&endpoint, Duration::from_secs(2), max_response_bytes, None)
}

fn request(model: &str, inputs: Vec<Tensor>) -> InferRequest {
    InferRequest {
        model_name: model.into(),
        id: Some("u1".into()),
        inputs,
        ..InferRequest::default()
    }
}

fn int32s(values: impl IntoIterator<Item = i32>) -> Bytes {
    values
        .into_iter()
        .flat_map(i32::to_le_bytes)
        .collect::<Vec<u8>>()
        .into()
}

#[tokio::test]
async fn infer_with_chunks_and_large_tensors() {
    let server = ModelServerProcess::start(&["--grpc", "127.0.0.1:0"]);
    let client = upstream(&server, 1 << 30);
    let add_sub = request(
        "add_sub",
        vec![
            Tensor::new("INPUT0", DataType::Int32, vec![1, 16], int32s(0..16)).unwrap(),
            Tensor::new("INPUT1", DataType::Int32, vec![1, 16], int32s([2; 16])).unwrap(),
        ],
    );
    let answer = client
        .unary(
            MODEL_INFER,
            protobuf::encode_request(add_sub).chunks,
            None,
            &HeaderMap::new(),
        )
        .await
        .unwrap();
    let response = protobuf::response_from_proto(ModelInferResponse::decode(answer.value).unwrap()).unwrap();
    assert_eq!(response.id.as_deref(), Some("u1"));
    assert_eq!(response.outputs[0].data, int32s(2..18));

    let big = Bytes::from(vec![3u8; 48 << 20]);
    let identity = request(
        "identity",
        vec![Tensor::new("big", DataType::Uint8, vec![48 << 20], big.clone()).unwrap()],
    );
    let answer = client
        .unary(
            MODEL_INFER,
            protobuf::encode_request(identity).chunks,
            None,
            &HeaderMap::new(),
        )
        .await
        .unwrap();
    let response = protobuf::response_from_proto(ModelInferResponse::decode(answer.value).unwrap()).unwrap();
    assert_eq!(response.outputs[0].data, big);
}

#[tokio::test]
async fn backend_errors_keep_their_codes_and_messages() {
    let server = ModelServerProcess::start(&["--grpc", "127.0.0.1:0"]);
    let client = upstream(&server, 1 << 20);
    let unknown = request("nope", vec![]);
    let error = client
        .unary(
            MODEL_INFER,
            protobuf::encode_request(unknown).chunks,
            None,
            &HeaderMap::new(),
        )
        .await
        .unwrap_err();
    assert_eq!((error.grpc_code(), error.http_status().as_u16()), (Code::NotFound, 404));
    assert_eq!(error.message(), "unknown model 'nope'");
    assert_eq!(error.origin(), Origin::Upstream);

    let mut flaky = request(
        "flaky",
        vec![Tensor::new("x", DataType::Int8, vec![1], Bytes::from_static(&[1])).unwrap()],
    );
    flaky.parameters.insert("fail".into(), ParamValue::Bool(true));
    let error = client
        .unary(
            MODEL_INFER,
            protobuf::encode_request(flaky).chunks,
            None,
            &HeaderMap::new(),
        )
        .await
        .unwrap_err();
    assert_eq!(error.grpc_code(), Code::Internal);
    assert!(error.message().contains("fail=true"), "{}", error.message());
}

#[tokio::test]
async fn a_deadline_cuts_the_call() {
    let server = ModelServerProcess::start(&["--grpc", "127.0.0.1:0"]);
    let client = upstream(&server, 1 << 20);
    let mut slow = request(
        "slow",
        vec![Tensor::new("x", DataType::Int8, vec![1], Bytes::from_static(&[1])).unwrap()],
    );
    slow.parameters.insert("delay_ms".into(), ParamValue::Int64(5_000));
    let started = Instant::now();
    let error = client
        .unary(
            MODEL_INFER,
            protobuf::encode_request(slow).chunks,
            Some(Duration::from_millis(200)),
            &HeaderMap::new(),
        )
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Timeout);
    assert_eq!(error.grpc_code(), Code::DeadlineExceeded);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the call was not cut at its deadline"
    );
}

#[tokio::test]
async fn a_backend_that_is_down_is_a_quick_bad_gateway() {
    let (host, port) = common::dead_endpoint();
    let client = GrpcUpstream::new(&Endpoint { host, port }, Duration::from_secs(1), 1024, None);
    let started = Instant::now();
    let error = client
        .unary(
            MODEL_INFER,
            vec![Bytes::new()],
            Some(Duration::from_secs(5)),
            &HeaderMap::new(),
        )
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::BadGateway);
    assert_eq!(error.grpc_code(), Code::Unavailable);
    assert!(error.is_retryable());
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn answers_beyond_the_limit_are_refused() {
    let server = ModelServerProcess::start(&["--grpc", "127.0.0.1:0"]);
    let client = upstream(&server, 1000);
    let identity = request(
        "identity",
        vec![Tensor::new("x", DataType::Uint8, vec![4096], Bytes::from(vec![0u8; 4096])).unwrap()],
    );
    let error = client
        .unary(
            MODEL_INFER,
            protobuf::encode_request(identity).chunks,
            None,
            &HeaderMap::new(),
        )
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::BadGateway);
    assert!(
        error.message().contains("more than the limit of 1000 bytes"),
        "{}",
        error.message()
    );
}
