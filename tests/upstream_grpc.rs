//! The gRPC upstream client against the built-in model server: messages as chunks out, a slice back, errors with
//! their codes, deadlines, a backend that is down, and the response size limit.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::ports::dead_endpoint;
use common::{ModelServerProcess, int32s};
use http::HeaderMap;
use oipgate::codec::compression::Coding;
use oipgate::codec::protobuf;
use oipgate::proto::ModelInferResponse;
use oipgate::protocol::{DataType, InferRequest, InferResponse, ParamValue, Tensor};
use oipgate::upstream::GrpcUpstream;
use oipgate::{ErrorKind, Origin};
use prost::Message;
use tonic::Code;

const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";

/// A gRPC-only model server and an upstream client of it.
fn upstream(max_response_bytes: usize) -> (ModelServerProcess, GrpcUpstream) {
    let server = ModelServerProcess::grpc_only(&[]);
    let endpoint = common::endpoint(server.grpc.unwrap());
    let client = GrpcUpstream::new(&endpoint, Duration::from_secs(2), max_response_bytes, None);
    (server, client)
}

/// `request` sent as a ModelInfer call, within `deadline` when given.
async fn model_infer(
    client: &GrpcUpstream,
    request: InferRequest,
    deadline: Option<Duration>,
) -> oipgate::Result<InferResponse> {
    compressed_model_infer(client, request, deadline, None).await
}

/// `request` sent as a ModelInfer call, compressed with `coding` when given.
async fn compressed_model_infer(
    client: &GrpcUpstream,
    request: InferRequest,
    deadline: Option<Duration>,
    coding: Option<Coding>,
) -> oipgate::Result<InferResponse> {
    let chunks = protobuf::encode_request(request).chunks;
    let answer = client
        .unary(MODEL_INFER, chunks, deadline, &HeaderMap::new(), coding)
        .await?;
    Ok(protobuf::response_from_proto(ModelInferResponse::decode(answer.value).unwrap()).unwrap())
}

fn request(model: &str, inputs: Vec<Tensor>) -> InferRequest {
    InferRequest {
        model_name: model.into(),
        id: Some("u1".into()),
        inputs,
        ..InferRequest::default()
    }
}

#[tokio::test]
async fn infer_with_chunks_and_large_tensors() {
    let (_server, client) = upstream(1 << 30);
    let add_sub = request(
        "add_sub",
        vec![
            Tensor::new("INPUT0", DataType::Int32, vec![1, 16], int32s(0..16)).unwrap(),
            Tensor::new("INPUT1", DataType::Int32, vec![1, 16], int32s([2; 16])).unwrap(),
        ],
    );
    let response = model_infer(&client, add_sub, None).await.unwrap();
    assert_eq!(response.id.as_deref(), Some("u1"));
    assert_eq!(response.outputs[0].data, int32s(2..18));

    let big = Bytes::from(vec![3u8; 48 << 20]);
    let identity = request(
        "identity",
        vec![Tensor::new("big", DataType::Uint8, vec![48 << 20], big.clone()).unwrap()],
    );
    let response = model_infer(&client, identity, None).await.unwrap();
    assert_eq!(response.outputs[0].data, big);
}

#[tokio::test]
async fn backend_errors_keep_their_codes_and_messages() {
    let (_server, client) = upstream(1 << 20);
    let unknown = request("nope", vec![]);
    let error = model_infer(&client, unknown, None).await.unwrap_err();
    assert_eq!((error.grpc_code(), error.http_status().as_u16()), (Code::NotFound, 404));
    assert_eq!(error.message(), "Request for unknown model: 'nope' is not found");
    assert_eq!(error.origin(), Origin::Upstream);

    let mut flaky = request(
        "flaky",
        vec![Tensor::new("x", DataType::Int8, vec![1], Bytes::from_static(&[1])).unwrap()],
    );
    flaky.parameters.insert("fail".into(), ParamValue::Bool(true));
    let error = model_infer(&client, flaky, None).await.unwrap_err();
    assert_eq!(error.grpc_code(), Code::Internal);
    assert!(error.message().contains("fail=true"), "{}", error.message());
}

#[tokio::test]
async fn a_deadline_cuts_the_call() {
    let (_server, client) = upstream(1 << 20);
    let mut slow = request(
        "slow",
        vec![Tensor::new("x", DataType::Int8, vec![1], Bytes::from_static(&[1])).unwrap()],
    );
    slow.parameters.insert("delay_ms".into(), ParamValue::Int64(5_000));
    // Let run, the call would succeed after its five seconds: the timeout is the deadline's.
    let error = model_infer(&client, slow, Some(Duration::from_millis(200)))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Timeout);
    assert_eq!(error.grpc_code(), Code::DeadlineExceeded);
}

#[tokio::test]
async fn a_backend_that_is_down_is_a_quick_bad_gateway() {
    let down = dead_endpoint();
    let client = GrpcUpstream::new(&down.endpoint(), Duration::from_secs(1), 1024, None);
    let error = client
        .unary(
            MODEL_INFER,
            vec![Bytes::new()],
            Some(Duration::from_secs(5)),
            &HeaderMap::new(),
            None,
        )
        .await
        .unwrap_err();
    // A bad gateway, told by the refused connection: waiting out the call's five seconds would have been a timeout.
    assert_eq!(error.kind(), ErrorKind::BadGateway);
    assert_eq!(error.grpc_code(), Code::Unavailable);
    assert!(error.is_retryable());
}

#[tokio::test]
async fn a_backend_restarted_on_its_port_is_called_on_a_new_connection() {
    let held = common::ports::hold_port();
    let start = || ModelServerProcess::start(&["--grpc", &held.to_string()]);
    let client = GrpcUpstream::new(&common::endpoint(held.address()), Duration::from_secs(2), 1 << 20, None);
    let inputs = || {
        vec![
            Tensor::new("INPUT0", DataType::Int32, vec![1, 16], int32s(0..16)).unwrap(),
            Tensor::new("INPUT1", DataType::Int32, vec![1, 16], int32s([2; 16])).unwrap(),
        ]
    };
    let call = || model_infer(&client, request("add_sub", inputs()), Some(Duration::from_secs(5)));
    let first = start();
    call().await.expect("the first call");
    drop(first);
    let _second = start();
    // The kept connection died with the first server: the call is sent again on a new one, not failed.
    let answer = call().await.expect("a call after the restart");
    assert_eq!(answer.outputs[0].data, int32s(2..18));
}

#[tokio::test]
async fn answers_beyond_the_limit_are_refused() {
    let (_server, client) = upstream(1000);
    let identity = request(
        "identity",
        vec![Tensor::new("x", DataType::Uint8, vec![4096], Bytes::from(vec![0u8; 4096])).unwrap()],
    );
    let error = model_infer(&client, identity, None).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::BadGateway);
    assert!(
        error.message().contains("more than the limit of 1000 bytes"),
        "{}",
        error.message()
    );
}

#[tokio::test]
async fn compressed_calls_get_compressed_answers_read_within_the_limit() {
    let (_server, client) = upstream(1 << 20);
    // Zeros compress to almost nothing; what arrives is read whole, decompressed.
    let zeros = Bytes::from(vec![0u8; 512 << 10]);
    let identity = |data: Bytes| {
        let length = data.len();
        request(
            "identity",
            vec![Tensor::new("x", DataType::Uint8, vec![length as u64], data).unwrap()],
        )
    };
    for coding in [Coding::Gzip, Coding::Deflate] {
        let response = compressed_model_infer(&client, identity(zeros.clone()), None, Some(coding))
            .await
            .unwrap_or_else(|error| panic!("{coding:?}: {error}"));
        assert_eq!(response.outputs[0].data, zeros, "{coding:?}");
    }
    // The limit is on the answer as decompressed, not as it travelled.
    let twice = Bytes::from(vec![0u8; 2 << 20]);
    let error = compressed_model_infer(&client, identity(twice), None, Some(Coding::Gzip))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::BadGateway);
    assert!(
        error.message().contains("decompresses to more than the limit"),
        "{}",
        error.message()
    );
}

/// A gRPC backend on bare HTTP/2 that answers every stream with `messages` tiny messages, each in a DATA frame of its
/// own (as servers that write each response as it is made do), then an OK status.
async fn tiny_frames_backend(messages: usize) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        let mut connection = h2::server::handshake(socket).await.unwrap();
        while let Some(Ok((_request, mut respond))) = connection.accept().await {
            tokio::spawn(async move {
                let head = http::Response::builder()
                    .header("content-type", "application/grpc")
                    .body(())
                    .unwrap();
                let mut send = respond.send_response(head, false).unwrap();
                // A 20-byte message behind its 5-byte header.
                let message = Bytes::from_static(b"\0\0\0\0\x14twenty bytes of text");
                for _ in 0..messages {
                    send.reserve_capacity(message.len());
                    while send.capacity() < message.len() {
                        match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
                            Some(Ok(_)) => {}
                            _ => return,
                        }
                    }
                    if send.send_data(message.clone(), false).is_err() {
                        return;
                    }
                    // Written out before the next is made, each in its own frame.
                    tokio::task::yield_now().await;
                }
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                let _ = send.send_trailers(trailers);
            });
        }
    });
    address
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_tiny_frames_read_after_a_pause_arrives_whole() {
    // Enough small frames to fill the stream window many times over, and more than h2's default budget for small
    // frames allows a connection to buffer.
    const MESSAGES: usize = 150_000;
    let address = tiny_frames_backend(MESSAGES).await;
    let client = GrpcUpstream::new(&common::endpoint(address), Duration::from_secs(2), 1 << 20, None);
    let mut stream = client
        .open_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            vec![Bytes::from_static(b"")],
            None,
            &HeaderMap::new(),
            None,
        )
        .await
        .unwrap();
    stream.answers.message().await.unwrap().unwrap();
    // The reader pauses while the backend fills every window it is given.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut received = 1;
    while let Some(message) = stream.answers.message().await.unwrap() {
        assert_eq!(&message[..], b"twenty bytes of text");
        received += 1;
    }
    assert_eq!(received, MESSAGES);
}
