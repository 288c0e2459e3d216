//! `oipgate model-server` over gRPC, as a client sees it.

mod common;

use std::collections::BTreeMap;

use bytes::Bytes;
use common::{ModelServerProcess, count_request, grpc_live, grpc_model_ready, grpc_ready, int32s};
use oipgate::proto::infer_parameter::ParameterChoice;
use oipgate::proto::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use oipgate::proto::{
    InferParameter, InferTensorContents, ModelInferRequest, ModelMetadataRequest, RepositoryIndexRequest,
    RepositoryModelLoadRequest, RepositoryModelUnloadRequest, ServerMetadataRequest,
};
use tonic::Code;

fn add_sub_request(version: &str, raw: bool) -> ModelInferRequest {
    let tensor = |name: &str, values: Vec<i32>| InferInputTensor {
        name: name.into(),
        datatype: "INT32".into(),
        shape: vec![1, 16],
        parameters: BTreeMap::new(),
        contents: (!raw).then(|| InferTensorContents {
            int_contents: values,
            ..Default::default()
        }),
    };
    ModelInferRequest {
        model_name: "add_sub".into(),
        model_version: version.into(),
        id: "g1".into(),
        inputs: vec![tensor("INPUT0", (0..16).collect()), tensor("INPUT1", vec![1; 16])],
        raw_input_contents: if raw {
            vec![int32s(0..16), int32s([1; 16])]
        } else {
            vec![]
        },
        ..Default::default()
    }
}

fn decode_int32s(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[tokio::test]
async fn health_and_metadata() {
    let server = ModelServerProcess::grpc_only(&["--name", "grpc-unit"]);
    assert!(server.rest.is_none(), "only gRPC was asked for");
    let mut client = server.grpc_client().await;
    assert!(grpc_live(&mut client).await);
    assert!(grpc_ready(&mut client).await);
    let metadata = client
        .server_metadata(ServerMetadataRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(metadata.name, "grpc-unit");
    let model = client
        .model_metadata(ModelMetadataRequest {
            name: "add_sub".into(),
            version: "1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(model.versions, ["1", "2"]);
    assert_eq!(model.inputs[0].shape, [-1, 16]);
    assert!(grpc_model_ready(&mut client, "identity", "").await.unwrap());
    let unknown = grpc_model_ready(&mut client, "nope", "").await;
    assert_eq!(unknown.unwrap_err().code(), Code::NotFound);
    let unknown = client
        .model_metadata(ModelMetadataRequest {
            name: "add_sub".into(),
            version: "7".into(),
        })
        .await;
    assert_eq!(unknown.unwrap_err().code(), Code::NotFound);
}

#[tokio::test]
async fn add_sub_with_raw_and_typed_inputs_answers_raw() {
    let server = ModelServerProcess::grpc_only(&[]);
    let mut client = server.grpc_client().await;
    for (version, raw) in [("1", true), ("2", false), ("", true)] {
        let response = client
            .model_infer(add_sub_request(version, raw))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(response.model_version, if version == "1" { "1" } else { "2" });
        assert_eq!(response.id, "g1");
        assert_eq!(
            response.raw_output_contents.len(),
            response.outputs.len(),
            "one raw content per output"
        );
        assert!(response.outputs.iter().all(|o| o.contents.is_none()));
        assert_eq!(
            decode_int32s(&response.raw_output_contents[0]),
            (1..17).collect::<Vec<_>>()
        );
        assert_eq!(
            decode_int32s(&response.raw_output_contents[1]),
            (-1..15).collect::<Vec<_>>()
        );
        if response.model_version == "2" {
            assert_eq!(response.outputs[2].name, "VERSION");
            assert_eq!(decode_int32s(&response.raw_output_contents[2]), [2]);
        }
    }
    let mut only_sum = add_sub_request("1", true);
    only_sum.outputs = vec![InferRequestedOutputTensor {
        name: "OUTPUT1".into(),
        parameters: BTreeMap::new(),
    }];
    let response = client.model_infer(only_sum).await.unwrap().into_inner();
    assert_eq!(response.outputs.len(), 1);
    assert_eq!(response.outputs[0].name, "OUTPUT1");
}

#[tokio::test]
async fn errors_carry_their_grpc_codes() {
    let server = ModelServerProcess::grpc_only(&[]);
    let mut client = server.grpc_client().await;
    let mut unknown = add_sub_request("1", true);
    unknown.model_name = "nope".into();
    assert_eq!(client.model_infer(unknown).await.unwrap_err().code(), Code::NotFound);
    let mut bad_shape = add_sub_request("1", true);
    bad_shape.inputs[1].shape = vec![16];
    let status = client.model_infer(bad_shape).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("input 'INPUT1'"), "{}", status.message());
    let mut mixed = add_sub_request("1", true);
    mixed.inputs[0].contents = Some(InferTensorContents {
        int_contents: vec![0; 16],
        ..Default::default()
    });
    assert_eq!(
        client.model_infer(mixed).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    let flaky = ModelInferRequest {
        model_name: "flaky".into(),
        parameters: BTreeMap::from([(
            "fail".to_owned(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::BoolParam(true)),
            },
        )]),
        inputs: vec![InferInputTensor {
            name: "x".into(),
            datatype: "INT32".into(),
            shape: vec![1],
            ..Default::default()
        }],
        raw_input_contents: vec![int32s([5])],
        ..Default::default()
    };
    let status = client.model_infer(flaky).await.unwrap_err();
    assert_eq!(status.code(), Code::Internal);
    assert!(status.message().contains("fail=true"));
}

#[tokio::test]
async fn readiness_flips_with_repository_rpcs() {
    let server = ModelServerProcess::both();
    let mut client = server.grpc_client().await;
    let index = client
        .repository_index(RepositoryIndexRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(
        index
            .models
            .iter()
            .any(|m| m.name == "add_sub" && m.version == "1" && m.state == "READY")
    );
    client
        .repository_model_unload(RepositoryModelUnloadRequest {
            model_name: "add_sub".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(!grpc_model_ready(&mut client, "add_sub", "1").await.unwrap());
    assert!(!grpc_ready(&mut client).await);
    assert_eq!(
        client.model_infer(add_sub_request("1", true)).await.unwrap_err().code(),
        Code::Unavailable
    );
    // The REST side sees the same state.
    assert_eq!(
        common::get(&server.rest_url("/v2/models/add_sub/ready")).await.status,
        503
    );
    let ready_only = client
        .repository_index(RepositoryIndexRequest {
            ready: true,
            ..Default::default()
        })
        .await;
    assert!(
        ready_only
            .unwrap()
            .into_inner()
            .models
            .iter()
            .all(|m| m.name != "add_sub")
    );
    client
        .repository_model_load(RepositoryModelLoadRequest {
            model_name: "add_sub".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let reloaded = client
        .model_infer(add_sub_request("1", true))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        decode_int32s(&reloaded.raw_output_contents[0]),
        (1..17).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn large_messages_pass_the_default_size_limit() {
    let server = ModelServerProcess::grpc_only(&["--models", "identity"]);
    let mut client = server.grpc_client().await;
    let payload = Bytes::from(vec![7u8; 16 << 20]);
    let request = ModelInferRequest {
        model_name: "identity".into(),
        inputs: vec![InferInputTensor {
            name: "big".into(),
            datatype: "UINT8".into(),
            shape: vec![16 << 20],
            ..Default::default()
        }],
        raw_input_contents: vec![payload.clone()],
        ..Default::default()
    };
    let response = client.model_infer(request).await.unwrap().into_inner();
    assert_eq!(response.raw_output_contents[0], payload);
}

#[tokio::test]
async fn simple_string_with_typed_bytes_and_slow() {
    let server = ModelServerProcess::grpc_only(&[]);
    let mut client = server.grpc_client().await;
    let strings = ModelInferRequest {
        model_name: "simple_string".into(),
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "BYTES".into(),
            shape: vec![2],
            parameters: BTreeMap::from([(
                "content_type".to_owned(),
                InferParameter {
                    parameter_choice: Some(ParameterChoice::StringParam("str".into())),
                },
            )]),
            contents: Some(InferTensorContents {
                bytes_contents: vec![Bytes::from_static(b"abc"), Bytes::from_static("ñu".as_bytes())],
                ..Default::default()
            }),
        }],
        ..Default::default()
    };
    let response = client.model_infer(strings).await.unwrap().into_inner();
    assert_eq!(
        &response.raw_output_contents[0][..],
        b"\x03\0\0\0cba\x03\0\0\0u\xc3\xb1"
    );
    assert!(response.outputs[0].parameters.contains_key("content_type"));

    let slow = ModelInferRequest {
        model_name: "slow".into(),
        parameters: BTreeMap::from([(
            "delay_ms".to_owned(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::Int64Param(100)),
            },
        )]),
        inputs: vec![InferInputTensor {
            name: "x".into(),
            datatype: "INT32".into(),
            shape: vec![1],
            ..Default::default()
        }],
        raw_input_contents: vec![int32s([9])],
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let response = client.model_infer(slow).await.unwrap().into_inner();
    // A lower bound: load only lengthens the call.
    assert!(started.elapsed() >= std::time::Duration::from_millis(100));
    assert_eq!(decode_int32s(&response.raw_output_contents[0]), [9]);
}

/// One response of a stream as a test compares it: the error message, the final flag, the raw outputs.
type StreamAnswer = (String, Option<bool>, Vec<Bytes>);

fn final_flag(response: &oipgate::proto::ModelInferResponse) -> Option<bool> {
    match response.parameters.get("triton_final_response")?.parameter_choice {
        Some(ParameterChoice::BoolParam(last)) => Some(last),
        _ => None,
    }
}

#[tokio::test]
async fn a_stream_answers_each_request_as_triton_does() {
    let server = ModelServerProcess::grpc_only(&[]);
    let mut client = server.grpc_client().await;
    let mut unknown = count_request("count", "c", 1, &[]);
    unknown.model_name = "nope".into();
    let requests = vec![
        count_request("count", "a", 3, &[]),
        count_request(
            "count",
            "b",
            0,
            &[("triton_enable_empty_final_response", ParameterChoice::BoolParam(true))],
        ),
        unknown,
        add_sub_request("1", true),
        count_request("count", "e", -1, &[]),
    ];
    let mut answers = client
        .model_stream_infer(tokio_stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    let mut by_id: BTreeMap<String, Vec<StreamAnswer>> = BTreeMap::new();
    while let Some(answer) = answers.message().await.unwrap() {
        let response = answer.infer_response.unwrap();
        by_id.entry(response.id.clone()).or_default().push((
            answer.error_message,
            final_flag(&response),
            response.raw_output_contents,
        ));
    }
    // A decoupled model: one response per step, none of them final (Triton sends no empty final response unless
    // asked), in order.
    let steps: Vec<_> = (0..3)
        .map(|n| (String::new(), Some(false), vec![int32s([n])]))
        .collect();
    assert_eq!(by_id["a"], steps);
    // Asked for the empty final response: that alone, for zero steps.
    assert_eq!(by_id["b"], [(String::new(), Some(true), vec![])]);
    // A failed request is one response with its error and its id, and the stream goes on.
    assert_eq!(by_id["c"].len(), 1);
    assert!(by_id["c"][0].0.contains("'nope'"), "{:?}", by_id["c"]);
    assert!(by_id["e"][0].0.contains("was asked for -1"), "{:?}", by_id["e"]);
    // Any other model answers once, final.
    assert_eq!(by_id["g1"].len(), 1);
    assert_eq!((by_id["g1"][0].0.as_str(), by_id["g1"][0].1), ("", Some(true)));
    assert_eq!(by_id["g1"][0].2[0], int32s(1..17));

    // Unary inference cannot call a decoupled model.
    let refused = client
        .model_infer(count_request("count", "u", 1, &[]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unimplemented);
    assert!(refused.message().contains("decoupled"), "{}", refused.message());
    // Which a client reads in the model's configuration.
    let config = client
        .model_config(oipgate::proto::ModelConfigRequest {
            name: "count".into(),
            version: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let config = <oipgate::proto::ModelConfig as prost::Message>::decode(config.config).unwrap();
    assert_eq!(
        config.model_transaction_policy,
        Some(oipgate::proto::ModelTransactionPolicy { decoupled: true })
    );
}

#[tokio::test]
async fn a_client_that_goes_away_stops_its_stream() {
    let server = ModelServerProcess::grpc_only(&[]);
    let mut client = server.grpc_client().await;
    // A hundred thousand responses 10 ms apart: a quarter of an hour, unless the stream is stopped.
    let long = count_request(
        "count",
        "long",
        100_000,
        &[("delay_ms", ParameterChoice::Int64Param(10))],
    );
    let mut answers = client
        .model_stream_infer(tokio_stream::iter(vec![long]))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..2 {
        answers.message().await.unwrap().unwrap();
    }
    // Dropped with its requests all sent, the call is cancelled (the HTTP/2 stream reset), as a client that goes
    // away cancels it.
    drop(answers);
    // The request is counted once it has stopped running: as failed, cut short.
    let started = std::time::Instant::now();
    loop {
        let statistics = client
            .model_statistics(oipgate::proto::ModelStatisticsRequest {
                name: "count".into(),
                version: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        let failed = statistics.model_stats[0]
            .inference_stats
            .as_ref()
            .and_then(|s| s.fail.as_ref());
        if failed.is_some_and(|fail| fail.count == 1) {
            assert_eq!(statistics.model_stats[0].inference_count, 0);
            break;
        }
        // Far short of the quarter of an hour the model would go on for, whatever the machine's load.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the model went on after its client went away"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
