//! Stateful sequences through the gateway: every request of a sequence reaches the replica holding its state, on all
//! four paths and across gateway processes, and a sequence whose replica is out is refused rather than sent to one
//! without its state.

mod common;

use std::time::Duration;

use common::config::backend;
use common::{GatewayProcess, ModelServerProcess, eventually, grpc_client, http_client, send};
use oipgate::proto::infer_parameter::ParameterChoice;
use oipgate::proto::model_infer_request::InferInputTensor;
use oipgate::proto::{InferParameter, InferTensorContents, ModelInferRequest};

const SEQUENCES: u64 = 8;
const STEPS: i32 = 6;

/// `accumulate` on two replicas balanced round robin: version 1 on their REST listeners, version 2 on their gRPC
/// ones, so each door reaches one backend protocol as it is and the other translated.
fn two_replicas(a: &ModelServerProcess, b: &ModelServerProcess, extra: &str) -> String {
    format!(
        r#"
        {}{extra}
        {}{extra}
        [[models]]
        name = "accumulate"
        versions = [ {{ version = "1", backend = "rest-pair" }},
                     {{ version = "2", backend = "grpc-pair", upstream_version = "1" }} ]
        default_version = "1"
        "#,
        backend("rest-pair", "rest", [a.rest.unwrap(), b.rest.unwrap()]),
        backend("grpc-pair", "grpc", [a.grpc.unwrap(), b.grpc.unwrap()]),
    )
}

/// A sequence's id as its JSON parameter: a number, or a string when `text`.
fn json_id(id: u64, text: bool) -> String {
    if text { format!("\"s{id}\"") } else { id.to_string() }
}

fn rest_body(id: &str, start: bool, value: i32) -> String {
    format!(
        r#"{{"parameters":{{"sequence_id":{id},"sequence_start":{start}}},"inputs":[{{"name":"INPUT0","datatype":"INT32","shape":[1],"data":[{value}]}}]}}"#
    )
}

/// One step over REST: the running sum answered, or the status and body of a refusal.
async fn rest_step(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
    url: &str,
    id: &str,
    start: bool,
    value: i32,
) -> Result<i64, (u16, String)> {
    let answer = send(
        client,
        "POST",
        url,
        &[("x-echo-probe", "1".into())],
        rest_body(id, start, value),
    )
    .await;
    if answer.status != 200 {
        return Err((answer.status, String::from_utf8_lossy(&answer.body).into_owned()));
    }
    Ok(answer.json()["outputs"][0]["data"][0].as_i64().unwrap())
}

fn grpc_request(version: &str, id: u64, text: bool, start: bool, value: i32) -> ModelInferRequest {
    let id = if text {
        ParameterChoice::StringParam(format!("s{id}"))
    } else {
        ParameterChoice::Uint64Param(id)
    };
    let parameter = |choice| InferParameter {
        parameter_choice: Some(choice),
    };
    ModelInferRequest {
        model_name: "accumulate".into(),
        model_version: version.into(),
        parameters: [
            ("sequence_id".to_owned(), parameter(id)),
            (
                "sequence_start".to_owned(),
                parameter(ParameterChoice::BoolParam(start)),
            ),
        ]
        .into_iter()
        .collect(),
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "INT32".into(),
            shape: vec![1],
            contents: Some(InferTensorContents {
                int_contents: vec![value],
                ..Default::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The INT32 a gRPC answer carries in its first output, raw or typed.
fn grpc_sum(answer: &oipgate::proto::ModelInferResponse) -> i64 {
    match answer.raw_output_contents.first() {
        Some(raw) => i64::from(i32::from_le_bytes(raw[..4].try_into().unwrap())),
        None => i64::from(answer.outputs[0].contents.as_ref().unwrap().int_contents[0]),
    }
}

/// Runs `SEQUENCES` sequences of `STEPS` steps at once, each step sent through the next of `gateways` in turn, over
/// REST or gRPC to `version`; ids start at `first_id`. Every answer must be the sequence's running sum.
async fn run_sequences(gateways: &[&GatewayProcess], grpc: bool, version: &str, first_id: u64, text: bool) {
    let mut tasks = Vec::new();
    for sequence in 0..SEQUENCES {
        let id = first_id + sequence;
        let rest_urls: Vec<String> = gateways
            .iter()
            .map(|g| g.rest_url(&format!("/v2/models/accumulate/versions/{version}/infer")))
            .collect();
        let grpc_addresses: Vec<_> = gateways.iter().map(|g| g.grpc).collect();
        let version = version.to_owned();
        tasks.push(tokio::spawn(async move {
            let client = http_client(false);
            let mut grpc_clients = Vec::new();
            for address in &grpc_addresses {
                grpc_clients.push(grpc_client(*address).await);
            }
            let mut expected = 0i64;
            for step in 0..STEPS {
                let value = i32::try_from(id).unwrap() * 10 + step;
                expected += i64::from(value);
                let turn = usize::try_from(step).unwrap() % rest_urls.len();
                let sum = if grpc {
                    let request = grpc_request(&version, id, text, step == 0, value);
                    let answer = grpc_clients[turn].model_infer(request).await;
                    grpc_sum(
                        &answer
                            .unwrap_or_else(|status| panic!("sequence {id} step {step}: {status:?}"))
                            .into_inner(),
                    )
                } else {
                    rest_step(&client, &rest_urls[turn], &json_id(id, text), step == 0, value)
                        .await
                        .unwrap_or_else(|refused| panic!("sequence {id} step {step}: {refused:?}"))
                };
                assert_eq!(
                    sum, expected,
                    "sequence {id} step {step} (grpc: {grpc}, version {version})"
                );
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

#[tokio::test]
async fn every_request_of_a_sequence_reaches_its_replica_on_all_four_paths_and_through_either_gateway() {
    let (a, b) = (ModelServerProcess::named("a"), ModelServerProcess::named("b"));
    let config = two_replicas(&a, &b, "");
    let first = GatewayProcess::start(&config);
    // Without affinity, round robin would send every other step to the replica without the sequence's state.
    // REST as it is, REST to gRPC, gRPC as it is, gRPC to REST; numeric and string ids.
    run_sequences(&[&first], false, "1", 100, false).await;
    run_sequences(&[&first], false, "2", 200, true).await;
    run_sequences(&[&first], true, "2", 300, false).await;
    run_sequences(&[&first], true, "1", 400, true).await;
    // A second gateway with the same configuration agrees on every sequence's replica, with nothing shared.
    let second = GatewayProcess::start(&config);
    run_sequences(&[&first, &second], false, "1", 500, false).await;
    run_sequences(&[&first, &second], true, "2", 600, false).await;
    run_sequences(&[&second, &first], true, "1", 700, true).await;
}

#[tokio::test]
async fn generate_reaches_a_sequences_replica_relayed_and_translated() {
    let (a, b) = (ModelServerProcess::named("a"), ModelServerProcess::named("b"));
    let gateway = GatewayProcess::start(&two_replicas(&a, &b, ""));
    // A sequence's generate steps, relayed to the REST pair (version 1) and translated onto the gRPC pair's stream
    // (version 2): round robin would send every other step to the replica without the sequence's running sum.
    for (version, first_id) in [("1", 800), ("2", 900)] {
        let url = gateway.rest_url(&format!("/v2/models/accumulate/versions/{version}/generate"));
        for id in first_id..first_id + 4 {
            let mut expected = 0;
            for step in 0..STEPS {
                let value = step + 1;
                expected += value;
                let body = format!(
                    r#"{{"INPUT0": {value}, "parameters": {{"sequence_id": {id}, "sequence_start": {}}}}}"#,
                    step == 0
                );
                let answer = common::post(&url, body).await;
                assert_eq!(answer.status, 200, "version {version}: {:?}", answer.body);
                assert_eq!(
                    answer.json()["OUTPUT0"],
                    expected,
                    "version {version} sequence {id} step {step}"
                );
            }
        }
    }
    // A malformed sequence id is refused before anything is sent.
    let url = gateway.rest_url("/v2/models/accumulate/generate");
    let answer = common::post(&url, r#"{"INPUT0": 1, "parameters": {"sequence_id": 1.5}}"#).await;
    assert_eq!(answer.status, 400, "{:?}", answer.body);
}

#[tokio::test]
async fn a_sequence_whose_replica_is_out_is_refused_and_only_a_start_moves_it() {
    let a = ModelServerProcess::named("a");
    let mut b = Some(ModelServerProcess::named("b"));
    let health = "health = { interval_ms = 100, timeout_ms = 300, unhealthy_after = 1, healthy_after = 1 }\n";
    let gateway = GatewayProcess::start(&two_replicas(&a, b.as_ref().unwrap(), health));
    let url = gateway.rest_url("/v2/models/accumulate/versions/1/infer");
    let client = http_client(false);
    // Which replica each sequence lives on, from the server that answered its start.
    let mut on_b = Vec::new();
    let mut on_a = Vec::new();
    for id in 1..=24u64 {
        let answer = send(
            &client,
            "POST",
            &url,
            &[("x-echo-probe", "1".into())],
            rest_body(&id.to_string(), true, 1),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
        match answer.header("x-echo-server") {
            Some("b") => on_b.push(id),
            Some("a") => on_a.push(id),
            other => panic!("answered by {other:?}"),
        }
    }
    assert!(!on_a.is_empty() && !on_b.is_empty(), "a: {on_a:?}, b: {on_b:?}");

    drop(b.take());
    let probe = on_b[0];
    eventually(Duration::from_secs(10), "replica b to be seen out", || {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let refused = rest_step(&client, &url, &probe.to_string(), false, 1).await;
            matches!(refused, Err((503, _)))
        }
    })
    .await;
    for &id in &on_b {
        let (status, message) = rest_step(&client, &url, &id.to_string(), false, 1).await.unwrap_err();
        assert_eq!(status, 503);
        assert!(message.contains(&format!("sequence {id} ")), "{message}");
        let mut grpc = gateway.grpc_client().await;
        let refused = grpc
            .model_infer(grpc_request("1", id, false, false, 1))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
        assert!(
            refused.message().contains(&format!("sequence {id} ")),
            "{}",
            refused.message()
        );
    }
    // Sequences on the live replica go on; a start moves a sequence of the one that is out to the next in its order.
    for &id in &on_a {
        assert_eq!(rest_step(&client, &url, &id.to_string(), false, 5).await, Ok(6));
    }
    let moved = on_b[0];
    let answer = send(
        &client,
        "POST",
        &url,
        &[("x-echo-probe", "1".into())],
        rest_body(&moved.to_string(), true, 3),
    )
    .await;
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!(answer.header("x-echo-server"), Some("a"));
}

#[tokio::test]
async fn a_malformed_sequence_id_is_refused_on_both_doors() {
    let (a, b) = (ModelServerProcess::named("a"), ModelServerProcess::named("b"));
    let gateway = GatewayProcess::start(&two_replicas(&a, &b, ""));
    let client = http_client(false);
    for version in ["1", "2"] {
        let url = gateway.rest_url(&format!("/v2/models/accumulate/versions/{version}/infer"));
        for (id, says) in [
            ("1.5", "not a double"),
            ("-3", "negative number -3"),
            ("{\"a\":1}", "must be a bool, number or string"),
            ("true", "not a bool"),
        ] {
            let (status, message) = rest_step(&client, &url, id, true, 1).await.unwrap_err();
            assert_eq!(status, 400, "{version} {id}: {message}");
            assert!(
                message.contains("sequence_id") && message.contains(says),
                "{version} {id}: {message}"
            );
        }
        let start = r#"{"parameters":{"sequence_id":4,"sequence_start":"yes"},"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[1],"data":[1]}]}"#;
        let answer = send(&client, "POST", &url, &[], start).await;
        assert_eq!(answer.status, 400);
        assert!(String::from_utf8_lossy(&answer.body).contains("sequence_start must be a bool"));
    }
    let mut grpc = gateway.grpc_client().await;
    for version in ["1", "2"] {
        let mut request = grpc_request(version, 1, false, true, 1);
        request.parameters.insert(
            "sequence_id".into(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::DoubleParam(1.5)),
            },
        );
        let refused = grpc.model_infer(request).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains("sequence_id"), "{}", refused.message());
    }
}

#[tokio::test]
async fn a_streams_sequences_reach_rest_replicas_in_order_while_its_other_requests_go_side_by_side() {
    let (a, b) = (ModelServerProcess::both(), ModelServerProcess::both());
    let gateway = GatewayProcess::start(&two_replicas(&a, &b, ""));
    // Many sequences, their steps interleaved and sent back to back on one stream to the REST backend: sent side by
    // side, a sequence's START could reach its replica after its second step, which is then refused.
    const STREAM_SEQUENCES: u64 = 40;
    const STREAM_STEPS: i32 = 5;
    let mut messages = Vec::new();
    for step in 0..STREAM_STEPS {
        for sequence in 0..STREAM_SEQUENCES {
            let mut request = grpc_request("1", 5000 + sequence, false, step == 0, step + 1);
            request.id = format!("{sequence}-{step}");
            if step == STREAM_STEPS - 1 {
                request.parameters.insert(
                    "sequence_end".to_owned(),
                    InferParameter {
                        parameter_choice: Some(ParameterChoice::BoolParam(true)),
                    },
                );
            }
            messages.push(request);
        }
    }
    let total = messages.len();
    let mut client = grpc_client(gateway.grpc).await;
    let mut answers = client
        .model_stream_infer(tokio_stream::iter(messages))
        .await
        .unwrap()
        .into_inner();
    let mut sums = std::collections::HashMap::new();
    for _ in 0..total {
        let answer = tokio::time::timeout(Duration::from_secs(30), answers.message())
            .await
            .expect("every request answered")
            .unwrap()
            .expect("the stream goes on");
        assert!(answer.error_message.is_empty(), "{}", answer.error_message);
        let response = answer.infer_response.unwrap();
        let (sequence, step) = response.id.split_once('-').unwrap();
        let step: i64 = step.parse().unwrap();
        sums.insert((sequence.to_owned(), step), grpc_sum(&response));
    }
    for sequence in 0..STREAM_SEQUENCES {
        for step in 0..i64::from(STREAM_STEPS) {
            // The running sum of 1, 2, ... step + 1: every step reached the replica holding the sequence, in order.
            assert_eq!(
                sums[&(sequence.to_string(), step)],
                (step + 1) * (step + 2) / 2,
                "sequence {sequence} step {step}"
            );
        }
    }
}
