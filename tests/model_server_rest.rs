//! `oipgate model-server` over REST, as a client sees it: every endpoint, every model, every rejection.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{ModelServerProcess, add_sub_json, binary_request, get, http_client, post, post_with_headers, send};
use oipgate::codec::rest;
use oipgate::protocol::{DataType, InferRequest, ParamValue, RequestedOutput, Tensor};
use serde_json::json;

#[tokio::test]
async fn health_and_metadata() {
    let server = ModelServerProcess::rest_only(&["--name", "unit"]);
    let metadata = get(&server.rest_url("/v2")).await;
    assert_eq!(metadata.status, 200);
    assert_eq!(metadata.json()["name"], "unit");
    assert_eq!(
        metadata.json()["extensions"],
        json!(["binary_tensor_data", "model_repository", "statistics"])
    );
    assert_eq!(
        get(&server.rest_url("/v2/health/live")).await.json(),
        json!({"live": true})
    );
    assert_eq!(
        get(&server.rest_url("/v2/health/ready")).await.json(),
        json!({"ready": true})
    );
    let model = get(&server.rest_url("/v2/models/add_sub")).await.json();
    assert_eq!(model["versions"], json!(["1", "2"]));
    assert_eq!(
        model["inputs"][0],
        json!({"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]})
    );
    assert_eq!(
        model["outputs"].as_array().unwrap().len(),
        3,
        "version 2 (the latest) has VERSION"
    );
    let v1 = get(&server.rest_url("/v2/models/add_sub/versions/1")).await.json();
    assert_eq!(v1["outputs"].as_array().unwrap().len(), 2);
    let ready = get(&server.rest_url("/v2/models/add_sub/versions/1/ready")).await;
    assert_eq!(
        (ready.status, ready.json()),
        (200, json!({"name": "add_sub", "ready": true}))
    );
}

#[tokio::test]
async fn unknown_things_and_wrong_methods() {
    let server = ModelServerProcess::rest_only(&[]);
    for path in [
        "/v2/models/nope",
        "/v2/models/add_sub/versions/3",
        "/v2/models/nope/ready",
        "/v2/nowhere",
        "/",
    ] {
        let answer = get(&server.rest_url(path)).await;
        assert_eq!(answer.status, 404, "{path}");
        assert!(answer.json()["error"].as_str().is_some(), "{path}: {:?}", answer.body);
    }
    let infer = post(&server.rest_url("/v2/models/nope/infer"), add_sub_json("INT32")).await;
    assert_eq!(infer.status, 404);
    assert!(
        infer.json()["error"]
            .as_str()
            .unwrap()
            .contains("Request for unknown model: 'nope' is not found")
    );
    let version = post(
        &server.rest_url("/v2/models/add_sub/versions/9/infer"),
        add_sub_json("INT32"),
    )
    .await;
    assert_eq!(version.status, 404);
    assert!(
        version.json()["error"]
            .as_str()
            .unwrap()
            .contains("Request for unknown model: 'add_sub' version 9 is not found")
    );
    let wrong = get(&server.rest_url("/v2/models/add_sub/infer")).await;
    assert_eq!((wrong.status, wrong.header("allow")), (405, Some("POST")));
    let error = wrong.json()["error"].as_str().unwrap_or_default().to_owned();
    assert!(
        error.contains("/v2/models/add_sub/infer answers POST only, not GET"),
        "{error}"
    );
    let wrong = post(&server.rest_url("/v2/health/ready"), "").await;
    assert_eq!((wrong.status, wrong.header("allow")), (405, Some("GET")));
}

#[tokio::test]
async fn add_sub_over_json_every_version() {
    let server = ModelServerProcess::rest_only(&[]);
    for (path, version) in [
        ("/v2/models/add_sub/infer", "2"),
        ("/v2/models/add_sub/versions/1/infer", "1"),
    ] {
        let answer = post(&server.rest_url(path), add_sub_json("INT32")).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        let body = answer.json();
        assert_eq!(body["model_name"], "add_sub");
        assert_eq!(body["model_version"], version);
        assert_eq!(body["id"], "r1");
        let sum: Vec<i64> = (1..17).collect();
        let difference: Vec<i64> = (-1..15).collect();
        assert_eq!(
            body["outputs"][0],
            json!({"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16], "data": sum})
        );
        assert_eq!(body["outputs"][1]["data"], json!(difference));
        let version_output = body["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["name"] == "VERSION")
            .cloned();
        assert_eq!(
            version_output.map(|o| o["data"].clone()),
            (version == "2").then(|| json!([2]))
        );
    }
    let fp32 = post(&server.rest_url("/v2/models/add_sub/infer"), add_sub_json("FP32"))
        .await
        .json();
    assert_eq!(fp32["outputs"][0]["datatype"], "FP32");
    assert_eq!(fp32["outputs"][0]["data"][3], json!(4.0));
}

#[tokio::test]
async fn binary_extension_both_ways_and_h2c() {
    let server = ModelServerProcess::rest_only(&[]);
    let a: Vec<u8> = (0..16i32).flat_map(|v| v.to_le_bytes()).collect();
    let b: Vec<u8> = (0..16i32).flat_map(|v| (v * 10).to_le_bytes()).collect();
    let mut request = InferRequest {
        inputs: vec![
            Tensor::new("INPUT0", DataType::Int32, vec![1, 16], Bytes::from(a)).unwrap(),
            Tensor::new("INPUT1", DataType::Int32, vec![1, 16], Bytes::from(b)).unwrap(),
        ],
        outputs: vec![RequestedOutput::new("OUTPUT0"), RequestedOutput::new("OUTPUT1")],
        ..InferRequest::default()
    };
    request.outputs[0]
        .parameters
        .insert("binary_data".into(), ParamValue::Bool(true));
    let body = rest::encode_request(&request, true).unwrap();
    let header = [(
        "inference-header-content-length",
        body.header_length.unwrap().to_string(),
    )];
    for h2c in [false, true] {
        let client = http_client(h2c);
        let answer = send(
            &client,
            "POST",
            &server.rest_url("/v2/models/add_sub/versions/1/infer"),
            &header,
            body.to_bytes(),
        )
        .await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        let json_length: usize = answer
            .header("inference-header-content-length")
            .unwrap()
            .parse()
            .unwrap();
        let (head, binary) = answer.body.split_at(json_length);
        let head: serde_json::Value = serde_json::from_slice(head).unwrap();
        assert_eq!(head["outputs"][0]["parameters"]["binary_data_size"], 64);
        assert!(
            head["outputs"][1]["data"].is_array(),
            "OUTPUT1 did not ask for binary: {head}"
        );
        let sums: Vec<i32> = binary
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(sums, (0..16).map(|v| v * 11).collect::<Vec<_>>());
        assert_eq!(
            head["outputs"].as_array().unwrap().len(),
            2,
            "only the requested outputs"
        );
    }
}

#[tokio::test]
async fn identity_returns_every_datatype_unchanged() {
    let server = ModelServerProcess::rest_only(&["--models", "identity"]);
    let mut inputs = Vec::new();
    for (i, datatype) in DataType::ALL.into_iter().enumerate() {
        let mut tensor = match datatype.element_size() {
            Some(size) => {
                let data: Vec<u8> = (0..3 * size)
                    .map(|b| {
                        if datatype == DataType::Bool {
                            u8::from(b % 2 == 1)
                        } else {
                            b.to_le_bytes()[0]
                        }
                    })
                    .collect();
                Tensor::new(format!("in{i}"), datatype, vec![3], Bytes::from(data)).unwrap()
            }
            None => Tensor::from_bytes_elements(format!("in{i}"), vec![2], [&b"\xff\x00"[..], b"ok"]).unwrap(),
        };
        tensor.parameters.insert("tag".into(), ParamValue::Int64(i as i64));
        inputs.push(tensor);
    }
    let (body, header) = binary_request(inputs.clone());
    let answer = post_with_headers(&server.rest_url("/v2/models/identity/infer"), &header, body.to_bytes()).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let length = answer
        .header("inference-header-content-length")
        .map(|l| l.parse().unwrap());
    let response = rest::decode_response(answer.body, length).unwrap();
    assert_eq!(
        response.outputs, inputs,
        "outputs are the inputs, bit for bit, parameters included"
    );
    // The server holds no add_sub.
    assert_eq!(
        post(&server.rest_url("/v2/models/add_sub/infer"), add_sub_json("INT32"))
            .await
            .status,
        404
    );
}

#[tokio::test]
async fn simple_string_slow_and_flaky() {
    let server = ModelServerProcess::rest_only(&[]);
    let strings = r#"{"inputs":[{"name":"INPUT0","datatype":"BYTES","shape":[2],"parameters":{"content_type":"str"},"data":["héllo","ab"]}]}"#;
    let answer = post(&server.rest_url("/v2/models/simple_string/infer"), strings)
        .await
        .json();
    assert_eq!(answer["outputs"][0]["data"], json!(["olléh", "ba"]));
    assert_eq!(answer["outputs"][0]["parameters"], json!({"content_type": "str"}));

    let identity = |params: &str| {
        format!(r#"{{"parameters":{params},"inputs":[{{"name":"x","datatype":"FP32","shape":[2],"data":[1.5,2]}}]}}"#)
    };
    let started = Instant::now();
    let slow = post(
        &server.rest_url("/v2/models/slow/infer"),
        identity(r#"{"delay_ms":300}"#),
    )
    .await;
    assert_eq!(slow.status, 200);
    // A lower bound: load only lengthens the call.
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "slow answered before its delay"
    );
    assert_eq!(slow.json()["outputs"][0]["data"], json!([1.5, 2.0]));
    let bad_delay = post(
        &server.rest_url("/v2/models/slow/infer"),
        identity(r#"{"delay_ms":-5}"#),
    )
    .await;
    assert_eq!(bad_delay.status, 400);

    let failed = post(&server.rest_url("/v2/models/flaky/infer"), identity(r#"{"fail":true}"#)).await;
    assert_eq!(failed.status, 500);
    assert!(failed.json()["error"].as_str().unwrap().contains("fail=true"));
    let fine = post(
        &server.rest_url("/v2/models/flaky/infer"),
        identity(r#"{"fail":false}"#),
    )
    .await;
    assert_eq!(fine.status, 200);
}

#[tokio::test]
async fn inputs_are_checked_like_a_real_server() {
    let server = ModelServerProcess::rest_only(&["--max-request-bytes", "4096"]);
    let url = server.rest_url("/v2/models/add_sub/infer");
    let cases = [
        (add_sub_json("INT32").replace("INPUT1", "INPUT9"), "unknown input 'INPUT9'"),
        (add_sub_json("INT32").replace(r#""INPUT1","datatype":"INT32""#, r#""INPUT1","datatype":"INT64""#), "input 'INPUT1' of model 'add_sub' must be INT32 or FP32, got INT64"),
        (
            r#"{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[16],"data":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]}]}"#.to_owned(),
            "input 'INPUT0' of model 'add_sub' has shape [16], expected [-1, 16]",
        ),
        (
            r#"{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[1,16],"data":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]}]}"#.to_owned(),
            "needs input 'INPUT1', which is missing",
        ),
        (add_sub_json("INT32").replace(r#""data":[0,"#, r#""data":[0.5,"#), "input 'INPUT0'"),
        (add_sub_json("INT32").replacen("}]}", r#"}],"outputs":[{"name":"NOPE"}]}"#, 1), "no output 'NOPE'"),
    ];
    for (body, message) in cases {
        let answer = post(&url, body).await;
        assert_eq!(answer.status, 400, "{message}: {:?}", answer.body);
        let error = answer.json()["error"].as_str().unwrap().to_owned();
        assert!(error.contains(message), "expected {message:?} in {error:?}");
    }
    let too_big = post(&url, vec![b' '; 5000]).await;
    assert_eq!(too_big.status, 413);
    let bad_header = post_with_headers(&url, &[("inference-header-content-length", "x".into())], "{}").await;
    assert_eq!(bad_header.status, 400);
    // A raw binary request needs a model with exactly one input.
    let raw = post_with_headers(&url, &[("inference-header-content-length", "0".into())], vec![0u8; 64]).await;
    assert_eq!(raw.status, 400);
    assert!(raw.json()["error"].as_str().unwrap().contains("exactly one input"));
}

#[tokio::test]
async fn raw_binary_request_to_a_one_input_model() {
    let server = ModelServerProcess::rest_only(&[]);
    let body = Tensor::from_bytes_elements("x", vec![2], [&b"abc"[..], b"de"])
        .unwrap()
        .data;
    let answer = post_with_headers(
        &server.rest_url("/v2/models/simple_string/infer"),
        &[("inference-header-content-length", "0".into())],
        body,
    )
    .await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let length = answer
        .header("inference-header-content-length")
        .map(|l| l.parse().unwrap());
    assert!(length.is_some(), "every output of a raw binary request is binary");
    let response = rest::decode_response(answer.body, length).unwrap();
    assert_eq!(
        response.outputs[0].bytes_elements().collect::<Vec<_>>(),
        vec![&b"cba"[..], b"ed"]
    );
}

#[tokio::test]
async fn readiness_flips_with_the_repository_extension() {
    let server = ModelServerProcess::rest_only(&[]);
    let index = post(&server.rest_url("/v2/repository/index"), "").await.json();
    assert!(
        index
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e == &json!({"name": "add_sub", "version": "2", "state": "READY", "reason": ""}))
    );
    let unload = post(&server.rest_url("/v2/repository/models/add_sub/unload"), "").await;
    assert_eq!(unload.status, 200);
    let ready = get(&server.rest_url("/v2/models/add_sub/ready")).await;
    assert_eq!((ready.status, ready.json()["ready"].clone()), (503, json!(false)));
    assert_eq!(get(&server.rest_url("/v2/health/ready")).await.status, 503);
    let infer = post(&server.rest_url("/v2/models/add_sub/infer"), add_sub_json("INT32")).await;
    assert_eq!(infer.status, 503);
    assert!(
        infer.json()["error"]
            .as_str()
            .unwrap()
            .contains("is not at ready state")
    );
    let ready_only = post(&server.rest_url("/v2/repository/index"), r#"{"ready": true}"#)
        .await
        .json();
    assert!(ready_only.as_array().unwrap().iter().all(|e| e["name"] != "add_sub"));
    // Other models are unaffected.
    assert_eq!(get(&server.rest_url("/v2/models/identity/ready")).await.status, 200);
    assert_eq!(
        post(&server.rest_url("/v2/repository/models/add_sub/load"), "")
            .await
            .status,
        200
    );
    assert_eq!(
        post(&server.rest_url("/v2/models/add_sub/infer"), add_sub_json("INT32"))
            .await
            .status,
        200
    );
    assert_eq!(get(&server.rest_url("/v2/health/ready")).await.status, 200);
    assert_eq!(
        post(&server.rest_url("/v2/repository/models/nope/load"), "")
            .await
            .status,
        404
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_are_not_serialised() {
    let server = ModelServerProcess::rest_only(&[]);
    let url = server.rest_url("/v2/models/slow/infer");
    let body = r#"{"parameters":{"delay_ms":500},"inputs":[{"name":"x","datatype":"INT8","shape":[1],"data":[1]}]}"#;
    let started = Instant::now();
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..40 {
        let url = url.clone();
        requests.spawn(async move { post(&url, body).await.status });
    }
    let statuses = requests.join_all().await;
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    // Forty half-second requests one after another would take 20 s.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "requests were serialised: {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn in_process_start_and_shutdown() {
    let config = oipgate::modelserver::ModelServerConfig {
        rest: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    };
    let server = oipgate::modelserver::start(config).await.unwrap();
    let url = format!("http://{}/v2/health/live", server.rest_addr.unwrap());
    assert_eq!(get(&url).await.status, 200);
    server.shutdown().await;
    let refused = http_client(false).get(url.parse().unwrap()).await;
    assert!(refused.is_err(), "still serving after shutdown");
}

#[test]
fn bad_selection_is_a_clear_startup_error() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_oipgate"))
        .args(["model-server", "--rest", "127.0.0.1:0", "--models", "add_sub:3"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("model 'add_sub' has no version 3"), "{stderr}");
}
