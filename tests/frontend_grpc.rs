//! The gRPC front door in front of real model servers, driven by generated clients: passthrough and translated
//! inference, the typed RPCs, request ids, health checking and server reflection.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use bytes::Bytes;
use common::config::{ADD_SUB_ON_BOTH, fleet_backends, model};
use common::{grpc_client, grpc_live, grpc_model_ready, grpc_ready, http_client, int32s};
use oipgate::config::{raw, validate};
use oipgate::frontend::grpc;
use oipgate::modelserver::RunningModelServer;
use oipgate::proto::model_infer_request::InferInputTensor;
use oipgate::proto::{
    ModelInferRequest, ModelMetadataRequest, ModelStatisticsRequest, RepositoryIndexRequest,
    RepositoryModelLoadRequest, ServerMetadataRequest,
};
use tonic::Code;
use tonic::transport::Channel;

struct Gateway {
    _backends: (RunningModelServer, RunningModelServer),
    addr: SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn gateway() -> Gateway {
    let (rest, grpc_backend) = common::in_process_backends().await;
    let text = format!(
        r#"
        [limits]
        max_request_bytes = 67108864
        {}
        {ADD_SUB_ON_BOTH}
        [[models]]
        name = "classifier"
        versions = [ {{ version = "3", backend = "fleet-b", upstream_name = "add_sub", upstream_version = "1" }} ]
        {}
        "#,
        fleet_backends(rest.rest_addr.unwrap(), grpc_backend.grpc_addr.unwrap()),
        model("identity", "fleet-b"),
    );
    let config = validate(raw::parse(&text, &[]).unwrap()).unwrap();
    let live = oipgate::live::Gateway::new(
        config,
        "oipgate-test",
        None,
        oipgate::telemetry::metrics::Metrics::new().unwrap(),
    )
    .unwrap();
    let listener = oipgate::frontend::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let seat = oipgate::frontend::DoorThread::all(&listener, 1, oipgate::frontend::ConnectionCap::none())
        .unwrap()
        .remove(0);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let limits = grpc::GrpcLimits {
        max_message_bytes: 64 << 20,
        max_concurrent_streams: 256,
        max_buffered_answer_bytes: 128 << 20,
        header_timeout: std::time::Duration::from_secs(10),
    };
    tokio::spawn(grpc::serve(seat, live, limits, None, async move {
        let _ = stopped.await;
    }));
    Gateway {
        _backends: (rest, grpc_backend),
        addr,
        _stop: stop,
    }
}

fn add_sub(model: &str, version: &str) -> ModelInferRequest {
    let tensor = |name: &str| InferInputTensor {
        name: name.into(),
        datatype: "INT32".into(),
        shape: vec![1, 16],
        ..Default::default()
    };
    ModelInferRequest {
        model_name: model.into(),
        model_version: version.into(),
        id: "front-1".into(),
        inputs: vec![tensor("INPUT0"), tensor("INPUT1")],
        raw_input_contents: vec![int32s(0..16), int32s([10; 16])],
        ..Default::default()
    }
}

#[tokio::test]
async fn inference_through_both_paths() {
    let gateway = gateway().await;
    let mut client = grpc_client(gateway.addr).await;
    for (model, version, public) in [
        ("add_sub", "2", "2"),
        ("add_sub", "1", "1"),
        ("add_sub", "", "1"),
        ("classifier", "3", "3"),
    ] {
        let response = client.model_infer(add_sub(model, version)).await.unwrap();
        let request_id = response
            .metadata()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_owned());
        assert!(
            request_id.is_some_and(|id| !id.is_empty()),
            "a request id is generated and echoed"
        );
        let response = response.into_inner();
        assert_eq!(
            (response.model_name.as_str(), response.model_version.as_str()),
            (model, public)
        );
        assert_eq!(response.id, "front-1");
        assert_eq!(response.raw_output_contents.len(), response.outputs.len());
        assert_eq!(response.raw_output_contents[0], int32s(10..26), "{model} {version}");
    }
    let mut with_id = tonic::Request::new(add_sub("add_sub", "2"));
    with_id
        .metadata_mut()
        .insert("x-request-id", "mine-42".parse().unwrap());
    let response = client.model_infer(with_id).await.unwrap();
    assert_eq!(response.metadata().get("x-request-id").unwrap(), "mine-42");
}

/// One ModelInfer call over a bare HTTP/2 connection: the answer's head, its whole body and its trailers.
async fn raw_model_infer(
    addr: SocketAddr,
    message: &ModelInferRequest,
    compressed: bool,
) -> (http::response::Parts, Bytes, Option<http::HeaderMap>) {
    use prost::Message;

    let framed = common::grpc_frame(&message.encode_to_vec(), compressed);
    // gzip and deflate are read (tests/compression.rs); this one is not.
    raw_call(addr, framed, compressed.then_some("snappy")).await
}

/// A ModelInfer call whose body is `body` as it is, over a bare HTTP/2 connection.
async fn raw_call(
    addr: SocketAddr,
    body: Vec<u8>,
    encoding: Option<&str>,
) -> (http::response::Parts, Bytes, Option<http::HeaderMap>) {
    use http_body_util::BodyExt;

    let mut request = http::Request::post(format!("http://{addr}/inference.GRPCInferenceService/ModelInfer"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(encoding) = encoding {
        request = request.header("grpc-encoding", encoding);
    }
    let request = request.body(http_body_util::Full::new(Bytes::from(body))).unwrap();
    let (parts, body) = http_client(true).request(request).await.unwrap().into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    (parts, collected.to_bytes(), trailers)
}

#[tokio::test]
async fn model_infer_refuses_broken_framing_before_any_backend() {
    use prost::Message;

    let gateway = gateway().await;
    let counted = || async {
        let statistics = grpc_client(gateway.addr)
            .await
            .model_statistics(ModelStatisticsRequest {
                name: "add_sub".into(),
                version: "2".into(),
            })
            .await
            .unwrap()
            .into_inner();
        statistics
            .model_stats
            .iter()
            .map(|model| model.inference_count)
            .sum::<u64>()
    };
    let before = counted().await;
    let message = add_sub("add_sub", "2").encode_to_vec();
    let frame = |flag: u8, length: usize, payload: &[u8]| {
        let mut framed = vec![flag];
        framed.extend_from_slice(&u32::try_from(length).unwrap().to_be_bytes());
        framed.extend_from_slice(payload);
        framed
    };
    let whole = frame(0, message.len(), &message);
    // Each is INTERNAL, as gRPC servers answer a broken frame.
    let cases = [
        ("no message", Vec::new(), None, "Missing request message"),
        ("half a header", whole[..3].to_vec(), None, "5-byte header"),
        (
            "cut short",
            whole[..whole.len() - 4].to_vec(),
            None,
            "ends inside its message",
        ),
        (
            "two messages",
            [whole.clone(), whole.clone()].concat(),
            None,
            "one message",
        ),
        (
            "compressed, no encoding",
            frame(1, message.len(), &message),
            None,
            "compressed-flag",
        ),
        (
            "an unknown flag",
            frame(7, message.len(), &message),
            Some("gzip"),
            "compression flag",
        ),
    ];
    for (what, body, encoding, said) in cases {
        let (head, body, _) = raw_call(gateway.addr, body, encoding).await;
        assert!(body.is_empty(), "{what}: trailers-only answer");
        assert_eq!(head.headers["grpc-status"], "13", "{what}: {:?}", head.headers);
        let message = head.headers["grpc-message"].to_str().unwrap().replace("%20", " ");
        assert!(message.contains(said), "{what}: {message}");
    }
    // A message announced larger than the limit is refused from its prefix, its bytes never awaited.
    let (head, _, _) = raw_call(gateway.addr, frame(0, 1 << 30, b"abc"), None).await;
    assert_eq!(
        head.headers["grpc-status"], "8",
        "RESOURCE_EXHAUSTED: {:?}",
        head.headers
    );
    let message = head.headers["grpc-message"].to_str().unwrap().replace("%20", " ");
    assert!(message.contains("larger than the limit of 67108864 bytes"), "{message}");
    assert_eq!(counted().await, before, "none of them reached the backend");
    let (head, _, trailers) = raw_call(gateway.addr, whole, None).await;
    assert_eq!(head.status, http::StatusCode::OK);
    assert_eq!(trailers.unwrap()["grpc-status"], "0");
    assert_eq!(counted().await, before + 1, "the well-framed call did");
}

#[tokio::test]
async fn model_infer_answers_one_framed_message_and_refuses_an_unknown_compression() {
    use prost::Message;

    let gateway = gateway().await;
    for (model, version) in [("add_sub", "2"), ("add_sub", "1")] {
        let (head, body, trailers) = raw_model_infer(gateway.addr, &add_sub(model, version), false).await;
        assert_eq!(head.status, http::StatusCode::OK);
        assert_eq!(head.headers["content-type"], "application/grpc");
        assert!(head.headers.contains_key("x-request-id"), "{:?}", head.headers);
        assert_eq!(body[0], 0, "the answer is not compressed");
        let length = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
        assert_eq!(length, body.len() - 5, "exactly one message, its length prefix exact");
        let answer = oipgate::proto::ModelInferResponse::decode(&body[5..]).unwrap();
        assert_eq!(answer.raw_output_contents[0], int32s(10..26), "{model} {version}");
        let trailers = trailers.expect("a successful answer ends with trailers");
        assert_eq!(trailers["grpc-status"], "0");
    }

    let (head, body, _) = raw_model_infer(gateway.addr, &add_sub("add_sub", "2"), true).await;
    assert!(body.is_empty(), "trailers-only answer");
    assert_eq!(head.headers["grpc-status"], "12", "UNIMPLEMENTED: {:?}", head.headers);
    let message = head.headers["grpc-message"].to_str().unwrap();
    assert!(message.contains("snappy"), "{message}");
}

#[tokio::test]
async fn typed_rpcs_and_errors() {
    let gateway = gateway().await;
    let mut client = grpc_client(gateway.addr).await;
    assert!(grpc_live(&mut client).await);
    assert!(grpc_ready(&mut client).await);
    assert_eq!(
        client
            .server_metadata(ServerMetadataRequest {})
            .await
            .unwrap()
            .into_inner()
            .name,
        "oipgate-test"
    );
    let metadata = client
        .model_metadata(ModelMetadataRequest {
            name: "classifier".into(),
            version: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (metadata.name.as_str(), metadata.versions.clone()),
        ("classifier", vec!["3".to_owned()])
    );
    assert!(grpc_model_ready(&mut client, "add_sub", "1").await.unwrap());
    let unknown = client.model_infer(add_sub("nope", "")).await.unwrap_err();
    assert_eq!(
        (unknown.code(), unknown.message()),
        (Code::NotFound, "Request for unknown model: 'nope' is not found")
    );
    let mut bad = add_sub("add_sub", "1");
    bad.inputs[1].shape = vec![16];
    assert_eq!(client.model_infer(bad).await.unwrap_err().code(), Code::InvalidArgument);
    let index = client
        .repository_index(RepositoryIndexRequest::default())
        .await
        .unwrap()
        .into_inner();
    let listed: Vec<(&str, &str, &str, &str)> = index
        .models
        .iter()
        .map(|m| (m.name.as_str(), m.version.as_str(), m.state.as_str(), m.reason.as_str()))
        .collect();
    assert_eq!(
        listed,
        [
            ("add_sub", "1", "READY", ""),
            ("add_sub", "2", "READY", ""),
            ("classifier", "3", "READY", ""),
            ("identity", "1", "READY", ""),
        ]
    );
    // Loading goes to the backends serving the model; a model the gateway does not route is not found.
    client
        .repository_model_load(RepositoryModelLoadRequest {
            model_name: "add_sub".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let load = client
        .repository_model_load(RepositoryModelLoadRequest {
            model_name: "nope".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(load.code(), Code::NotFound);
}

#[tokio::test]
async fn messages_beyond_four_mebibytes_pass() {
    let gateway = gateway().await;
    let mut client = grpc_client(gateway.addr).await;
    let payload = Bytes::from(vec![5u8; 20 << 20]);
    let request = ModelInferRequest {
        model_name: "identity".into(),
        inputs: vec![InferInputTensor {
            name: "big".into(),
            datatype: "UINT8".into(),
            shape: vec![20 << 20],
            parameters: BTreeMap::new(),
            contents: None,
        }],
        raw_input_contents: vec![payload.clone()],
        ..Default::default()
    };
    let response = client.model_infer(request).await.unwrap().into_inner();
    assert_eq!(response.raw_output_contents[0], payload);
}

#[tokio::test]
async fn health_checking_and_reflection() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let gateway = gateway().await;
    let channel = Channel::from_shared(format!("http://{}", gateway.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel.clone());
    let mut status = ServingStatus::Unknown;
    for _ in 0..50 {
        let answer = health
            .check(HealthCheckRequest {
                service: "inference.GRPCInferenceService".into(),
            })
            .await;
        if let Ok(answer) = answer {
            status = answer.into_inner().status();
            if status == ServingStatus::Serving {
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(status, ServingStatus::Serving);

    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter(vec![request]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("no service list")
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"inference.GRPCInferenceService".to_owned()),
        "{names:?}"
    );
    assert!(names.contains(&"grpc.health.v1.Health".to_owned()), "{names:?}");

    // A model configuration is described as Triton's message, so reflection-driven tools print it field by field.
    // Like them, ask for the file that holds the response, then for the file it imports.
    let requests = [
        MessageRequest::FileByFilename("model_config.proto".into()),
        MessageRequest::FileContainingSymbol("inference.ModelConfigResponse".into()),
    ]
    .map(|message| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(message),
    });
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    let mut pool = prost_reflect::DescriptorPool::new();
    while let Some(answer) = answers.message().await.unwrap() {
        let Some(MessageResponse::FileDescriptorResponse(files)) = answer.message_response else {
            panic!("no file descriptors: {answer:?}")
        };
        for file in &files.file_descriptor_proto {
            pool.decode_file_descriptor_proto(file.as_slice()).unwrap();
        }
    }
    let config = pool
        .get_message_by_name("inference.ModelConfigResponse")
        .and_then(|message| message.get_field_by_name("config"))
        .unwrap();
    let prost_reflect::Kind::Message(described) = config.kind() else {
        panic!("config is described as {:?}", config.kind())
    };
    assert_eq!(described.full_name(), "inference.ModelConfig");
    assert!(described.get_field_by_name("sequence_batching").is_some());
}
