//! `oipgate serve` as a user runs it, in front of `oipgate model-server` processes: every endpoint on both front
//! doors, the four protocol paths compared with calling the backend directly, and the failure cases.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::config::{ADD_SUB_ON_BOTH, backend, fleet_backends, model};
use common::ports::{DeadEndpoint, dead_endpoint};
use common::{
    GatewayProcess, ModelServerProcess, add_sub_json, binary_request, get, grpc_model_ready, grpc_ready, http_client,
    int32s, post, post_with_headers, send,
};
use oipgate::codec::decthings;
use oipgate::codec::rest::{self};
use oipgate::proto::model_infer_request::InferInputTensor;
use oipgate::proto::{ModelInferRequest, ModelMetadataRequest};
use oipgate::protocol::{DataType, InferRequest, Tensor};
use serde_json::json;
use tonic::Code;

struct Setup {
    rest_backend: ModelServerProcess,
    grpc_backend: ModelServerProcess,
    _down: DeadEndpoint,
    gateway: GatewayProcess,
}

fn setup(extra: &str) -> Setup {
    let rest_backend = ModelServerProcess::rest_only(&[]);
    let grpc_backend = ModelServerProcess::grpc_only(&[]);
    let down = dead_endpoint();
    let config = format!(
        r#"
        [limits]
        max_request_bytes = 1048576
        {extra}
        {}
        {}
        {ADD_SUB_ON_BOTH}
        [[models]]
        name = "classifier"
        versions = [ {{ version = "3", backend = "fleet-b", upstream_name = "add_sub", upstream_version = "1" }},
                     {{ version = "4", backend = "fleet-a", upstream_name = "add_sub", upstream_version = "1" }} ]
        [[models]]
        name = "identity"
        versions = [ {{ version = "rest", backend = "fleet-a", upstream_version = "1" }},
                     {{ version = "1", backend = "fleet-a" }},
                     {{ version = "grpc", backend = "fleet-b", upstream_version = "1" }} ]
        default_version = "1"
        [[models]]
        name = "slow"
        versions = [ {{ version = "rest", backend = "fleet-a", upstream_version = "1" }},
                     {{ version = "grpc", backend = "fleet-b", upstream_version = "1" }} ]
        default_version = "rest"
        {}
        "#,
        fleet_backends(rest_backend.rest.unwrap(), grpc_backend.grpc.unwrap()),
        backend("down", "rest", [&down]),
        model("gone", "down"),
    );
    let gateway = GatewayProcess::start(&config);
    Setup {
        rest_backend,
        grpc_backend,
        _down: down,
        gateway,
    }
}

/// The answer with the request-specific parts taken out, for comparing paths.
fn outputs(body: &[u8]) -> serde_json::Value {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap();
    value["outputs"].clone()
}

#[tokio::test]
async fn rest_endpoints_and_errors() {
    let setup = setup("");
    let gateway = &setup.gateway;
    assert_eq!(
        get(&gateway.rest_url("/v2/health/live")).await.json(),
        json!({"live": true})
    );
    let ready = get(&gateway.rest_url("/v2/health/ready")).await;
    assert_eq!(
        (ready.status, ready.json()),
        (503, json!({"ready": false})),
        "model 'gone' has no live backend"
    );
    let metadata = get(&gateway.rest_url("/v2")).await.json();
    assert_eq!(metadata["name"], "oipgate");
    assert_eq!(
        metadata["extensions"],
        json!([
            "binary_tensor_data",
            "sequence",
            "model_repository",
            "schedule_policy",
            "model_configuration",
            "statistics",
            "parameters",
            "generate"
        ])
    );
    let model = get(&gateway.rest_url("/v2/models/classifier/versions/3")).await.json();
    assert_eq!(
        (model["name"].clone(), model["versions"].clone()),
        (json!("classifier"), json!(["3", "4"]))
    );
    let model_ready = get(&gateway.rest_url("/v2/models/add_sub/versions/2/ready")).await;
    assert_eq!(
        (model_ready.status, model_ready.json()),
        (200, json!({"name": "add_sub", "ready": true}))
    );
    for (path, status) in [
        ("/v2/models/nope", 404),
        ("/v2/models/add_sub/versions/9", 404),
        ("/v2/nowhere", 404),
        ("/v2/repository/models/nope/load", 404),
    ] {
        let method = if path.contains("repository") { "POST" } else { "GET" };
        let answer = send(&http_client(false), method, &gateway.rest_url(path), &[], Bytes::new()).await;
        assert_eq!(answer.status, status, "{path}");
        assert!(answer.json()["error"].is_string(), "{path}");
    }
    // The repository index over the fleet: every public model version, in configuration order, with the reason
    // for each one that cannot be served.
    let index = post(&gateway.rest_url("/v2/repository/index"), "").await;
    assert_eq!(index.status, 200);
    let entries = index.json();
    let listed: Vec<(&str, &str, &str)> = entries
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap(),
                e["version"].as_str().unwrap(),
                e["state"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("add_sub", "1", "READY"),
            ("add_sub", "2", "READY"),
            ("classifier", "3", "READY"),
            ("classifier", "4", "READY"),
            ("identity", "rest", "READY"),
            ("identity", "1", "READY"),
            ("identity", "grpc", "READY"),
            ("slow", "rest", "READY"),
            ("slow", "grpc", "READY"),
            ("gone", "1", "UNAVAILABLE"),
        ]
    );
    assert_eq!(entries[0]["reason"], "");
    let reason = entries[9]["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("backend down: ") && reason.contains("unreachable"),
        "{reason}"
    );
    let ready_only = post(&gateway.rest_url("/v2/repository/index"), r#"{"ready": true}"#)
        .await
        .json();
    assert_eq!(ready_only.as_array().unwrap().len(), 9);
    let bad_index = post(&gateway.rest_url("/v2/repository/index"), r#"{"ready": 3}"#).await;
    assert_eq!(bad_index.status, 400);
    assert!(bad_index.json()["error"].as_str().unwrap().contains("repository index"));

    let wrong = get(&gateway.rest_url("/v2/models/add_sub/infer")).await;
    assert_eq!((wrong.status, wrong.header("allow")), (405, Some("POST")));
    let malformed = post(
        &gateway.rest_url("/v2/models/add_sub/versions/2/infer"),
        "{\"inputs\": [",
    )
    .await;
    assert_eq!(malformed.status, 400);
    assert!(malformed.json()["error"].as_str().unwrap().contains("invalid JSON"));
    let down = post(&gateway.rest_url("/v2/models/gone/infer"), add_sub_json("INT32")).await;
    assert_eq!(down.status, 502, "{:?}", down.body);
    assert!(down.json()["error"].is_string());

    // Names a client makes up are counted under fixed labels, never as new series.
    let made_up = post(
        &gateway.rest_url("/v2/models/made-up-name/infer"),
        add_sub_json("INT32"),
    )
    .await;
    assert_eq!(made_up.status, 404);
    let metrics = gateway.metrics().await;
    assert!(!metrics.contains("made-up-name"), "{metrics}");
    for series in [
        r#"oipgate_requests_total{backend="_none",code="404",model="_unknown",principal="_other",protocol="rest",version="_unknown"} 1"#,
        r#"oipgate_requests_total{backend="down",code="502",model="gone",principal="_other",protocol="rest",version="1"} 1"#,
        r#"oipgate_requests_total{backend="fleet-b",code="400",model="add_sub",principal="_other",protocol="rest",version="2"} 1"#,
    ] {
        assert!(metrics.contains(series), "{series} missing from\n{metrics}");
    }
}

#[tokio::test]
async fn every_rest_path_equals_the_direct_answer() {
    let setup = setup("");
    let direct = post(
        &setup.rest_backend.rest_url("/v2/models/add_sub/versions/1/infer"),
        add_sub_json("INT32"),
    )
    .await;
    assert_eq!(direct.status, 200);
    for (path, version, name) in [
        ("/v2/models/add_sub/infer", "1", "add_sub"),
        ("/v2/models/add_sub/versions/1/infer", "1", "add_sub"),
        ("/v2/models/classifier/versions/3/infer", "3", "classifier"),
        ("/v2/models/classifier/versions/4/infer", "4", "classifier"),
    ] {
        let answer = post(&setup.gateway.rest_url(path), add_sub_json("INT32")).await;
        assert_eq!(answer.status, 200, "{path}: {:?}", answer.body);
        let body = answer.json();
        assert_eq!(
            (
                body["model_name"].clone(),
                body["model_version"].clone(),
                body["id"].clone()
            ),
            (json!(name), json!(version), json!("r1")),
            "{path}"
        );
        assert_eq!(outputs(&answer.body), outputs(&direct.body), "{path}");
        if version == "4" {
            // A REST alias is proxied, its JSON header renamed in place and padded to the length announced upfront.
            assert!(
                answer.body.ends_with(b" "),
                "{path} was not renamed on the passthrough path"
            );
        }
        assert!(answer.header("x-request-id").is_some_and(|id| !id.is_empty()));
    }
    let v2 = post(
        &setup.gateway.rest_url("/v2/models/add_sub/versions/2/infer"),
        add_sub_json("INT32"),
    )
    .await
    .json();
    assert_eq!(v2["outputs"][0], outputs(&direct.body)[0]);
    let mine = post_with_headers(
        &setup.gateway.rest_url("/v2/models/add_sub/infer"),
        &[("x-request-id", "abc-1".into())],
        add_sub_json("INT32"),
    )
    .await;
    assert_eq!(mine.header("x-request-id"), Some("abc-1"));
}

#[tokio::test]
async fn binary_extension_and_every_datatype_on_both_rest_paths() {
    let setup = setup("");
    let mut inputs = Vec::new();
    for (i, datatype) in DataType::ALL.into_iter().enumerate() {
        let tensor = match datatype.element_size() {
            Some(size) => Tensor::new(
                format!("t{i}"),
                datatype,
                vec![2],
                Bytes::from(vec![u8::from(datatype != DataType::Bool); 2 * size]),
            )
            .unwrap(),
            None => Tensor::from_bytes_elements(format!("t{i}"), vec![2], [&b"\xff\xfe"[..], b"ok"]).unwrap(),
        };
        inputs.push(tensor);
    }
    let (body, headers) = binary_request(inputs.clone());
    for version in ["1", "grpc", "rest"] {
        let url = setup
            .gateway
            .rest_url(&format!("/v2/models/identity/versions/{version}/infer"));
        let answer = post_with_headers(&url, &headers, body.to_bytes()).await;
        assert_eq!(answer.status, 200, "{version}: {:?}", answer.body);
        let length = answer
            .header("inference-header-content-length")
            .map(|l| l.parse().unwrap());
        let response = rest::decode_response(answer.body, length).unwrap();
        assert_eq!(response.outputs, inputs, "identity via {version}");
        assert_eq!(response.model_version.as_deref(), Some(version));
    }
}

#[tokio::test]
async fn grpc_paths_equal_the_direct_answer() {
    let setup = setup("");
    let request = |model: &str, version: &str| ModelInferRequest {
        model_name: model.into(),
        model_version: version.into(),
        id: "g".into(),
        inputs: ["INPUT0", "INPUT1"]
            .map(|n| InferInputTensor {
                name: n.into(),
                datatype: "INT32".into(),
                shape: vec![1, 16],
                ..Default::default()
            })
            .to_vec(),
        raw_input_contents: vec![int32s(0..16), int32s([7; 16])],
        ..Default::default()
    };
    let mut direct_client = setup.grpc_backend.grpc_client().await;
    let direct = direct_client
        .model_infer(request("add_sub", "1"))
        .await
        .unwrap()
        .into_inner();
    let mut client = setup.gateway.grpc_client().await;
    for (model, version, public) in [
        ("add_sub", "2", "2"),
        ("add_sub", "1", "1"),
        ("add_sub", "", "1"),
        ("classifier", "3", "3"),
        ("classifier", "4", "4"),
    ] {
        let response = client.model_infer(request(model, version)).await.unwrap().into_inner();
        assert_eq!(
            (
                response.model_name.as_str(),
                response.model_version.as_str(),
                response.id.as_str()
            ),
            (model, public, "g")
        );
        assert_eq!(
            response.raw_output_contents[..2],
            direct.raw_output_contents[..2],
            "{model} {version}"
        );
    }
    assert!(!grpc_ready(&mut client).await);
    assert!(grpc_model_ready(&mut client, "add_sub", "1").await.unwrap());
    let metadata = client
        .model_metadata(ModelMetadataRequest {
            name: "classifier".into(),
            version: "4".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(metadata.name, "classifier");
    let down = client.model_infer(request("gone", "")).await.unwrap_err();
    assert_eq!(down.code(), Code::Unavailable);
    let unknown = client.model_infer(request("nope", "")).await.unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
}

#[tokio::test]
async fn every_datatype_through_the_grpc_door_on_both_paths() {
    use oipgate::codec::protobuf;
    let setup = setup("");
    let mut inputs = Vec::new();
    for (i, datatype) in DataType::ALL.into_iter().enumerate() {
        let tensor = match datatype.element_size() {
            Some(size) => {
                let data: Vec<u8> = (0..3 * size)
                    .map(|b| {
                        if datatype == DataType::Bool {
                            u8::from(b % 2 == 0)
                        } else {
                            b.to_le_bytes()[0] ^ 0x5a
                        }
                    })
                    .collect();
                Tensor::new(format!("t{i}"), datatype, vec![3], Bytes::from(data)).unwrap()
            }
            None => Tensor::from_bytes_elements(format!("t{i}"), vec![2], [&b"\x00\xff"[..], b"text"]).unwrap(),
        };
        inputs.push(tensor);
    }
    let mut client = setup.gateway.grpc_client().await;
    for version in ["1", "grpc"] {
        let request = InferRequest {
            model_name: "identity".into(),
            model_version: Some(version.into()),
            inputs: inputs.clone(),
            ..InferRequest::default()
        };
        let response = client
            .model_infer(protobuf::request_to_proto(request))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            response.raw_output_contents.len(),
            inputs.len(),
            "raw contents for every output ({version})"
        );
        let response = protobuf::response_from_proto(response).unwrap();
        assert_eq!(
            response.outputs, inputs,
            "identity through the gRPC door, version {version}"
        );
    }
}

#[tokio::test]
async fn decthings_bodies_in_and_out() {
    let setup = setup("");
    let inputs = vec![
        Tensor::new("INPUT0", DataType::Int32, vec![1, 16], int32s(0..16)).unwrap(),
        Tensor::new("INPUT1", DataType::Int32, vec![1, 16], int32s([2; 16])).unwrap(),
    ];
    let body = decthings::encode_entries(&inputs).unwrap();
    let content_type = ("content-type", "application/x-decthings-tensors".to_owned());
    let json_answer = post_with_headers(
        &setup.gateway.rest_url("/v2/models/add_sub/infer"),
        std::slice::from_ref(&content_type),
        body.clone(),
    )
    .await;
    assert_eq!(json_answer.status, 200, "{:?}", json_answer.body);
    assert_eq!(json_answer.json()["outputs"][0]["data"][0], 2);
    let headers = [content_type, ("accept", "application/x-decthings-tensors".to_owned())];
    let answer = post_with_headers(
        &setup.gateway.rest_url("/v2/models/add_sub/versions/2/infer"),
        &headers,
        body,
    )
    .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("content-type"), Some("application/x-decthings-tensors"));
    assert_eq!(
        (answer.header("model-name"), answer.header("model-version")),
        (Some("add_sub"), Some("2"))
    );
    let outputs = decthings::decode_entries(&answer.body).unwrap();
    assert_eq!(
        outputs.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
        ["OUTPUT0", "OUTPUT1", "VERSION"]
    );
    let bad = post_with_headers(
        &setup.gateway.rest_url("/v2/models/add_sub/infer"),
        &[("content-type", "application/x-decthings-tensors".into())],
        Bytes::from_static(b"\x05ab"),
    )
    .await;
    assert_eq!(bad.status, 400);
}

#[tokio::test]
async fn bodies_over_the_limit_are_refused_on_every_path() {
    let setup = setup("");
    let big = vec![b' '; 2 << 20];
    for path in [
        "/v2/models/add_sub/versions/1/infer",
        "/v2/models/add_sub/versions/2/infer",
    ] {
        let answer = post(&setup.gateway.rest_url(path), big.clone()).await;
        assert_eq!(answer.status, 413, "{path}");
        assert!(answer.json()["error"].as_str().unwrap().contains("limit"));
    }
}

#[tokio::test]
async fn grpc_messages_over_the_limit_are_resource_exhausted() {
    let setup = setup("");
    let mut client = setup.gateway.grpc_client().await;
    let request = ModelInferRequest {
        model_name: "identity".into(),
        inputs: vec![InferInputTensor {
            name: "x".into(),
            datatype: "UINT8".into(),
            shape: vec![2 << 20],
            ..Default::default()
        }],
        raw_input_contents: vec![Bytes::from(vec![0u8; 2 << 20])],
        ..Default::default()
    };
    let status = client.model_infer(request).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("limit of 1048576 bytes"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn startup_problems_are_clear() {
    let dir = common::unique_temp_dir("oipgate-bad");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, model("m", "x")).unwrap();
    let output = common::serve_once(&bad);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("models[0].versions[0].backend: no backend named \"x\""));
    // REST on a port another socket listens on (kept until the end), the others on any port.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let good = dir.join("busy.toml");
    std::fs::write(
        &good,
        format!(
            "[listen]\nrest = \"{}\"\ngrpc = \"127.0.0.1:0\"\n{}{}",
            busy.local_addr().unwrap(),
            backend("b", "rest", ["127.0.0.1:1"]),
            model("m", "b")
        ),
    )
    .unwrap();
    let started = Instant::now();
    let output = common::serve_once(&good);
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("cannot listen for REST"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    drop(busy);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Names listed in the backend's `x-echo-received` answer header (metadata).
fn received(value: Option<&str>) -> Vec<String> {
    value
        .unwrap_or_else(|| panic!("the backend did not list what it received"))
        .split(',')
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn end_to_end_headers_cross_every_path_and_hop_by_hop_ones_never_do() {
    let setup = setup("");
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let sent = [
        ("x-request-id", "rid-7".to_owned()),
        ("x-echo-tenant", "blue".to_owned()),
        ("authorization", "Bearer abc".to_owned()),
        ("traceparent", traceparent.to_owned()),
        ("tracestate", "vendor=1".to_owned()),
        ("connection", "keep-alive, x-private".to_owned()),
        ("x-private", "secret".to_owned()),
        ("keep-alive", "timeout=5".to_owned()),
        ("proxy-authorization", "Basic eA==".to_owned()),
    ];
    // add_sub 1: REST passthrough; identity rest: passthrough with a rename; add_sub 2 and classifier 3: REST to gRPC.
    for path in [
        "/v2/models/add_sub/versions/1/infer",
        "/v2/models/identity/versions/rest/infer",
        "/v2/models/add_sub/versions/2/infer",
        "/v2/models/classifier/versions/3/infer",
    ] {
        let answer = post_with_headers(&setup.gateway.rest_url(path), &sent, add_sub_json("INT32")).await;
        assert_eq!(answer.status, 200, "{path}: {:?}", answer.body);
        assert_eq!(answer.header("x-request-id"), Some("rid-7"), "{path}");
        assert_eq!(answer.header("x-echo-tenant"), Some("blue"), "{path}");
        let names = received(answer.header("x-echo-received"));
        for name in [
            "authorization",
            "traceparent",
            "tracestate",
            "x-echo-tenant",
            "x-request-id",
        ] {
            assert!(
                names.iter().any(|n| n == name),
                "{path}: {name} did not reach the backend: {names:?}"
            );
        }
        for name in ["x-private", "keep-alive", "proxy-authorization"] {
            assert!(
                !names.iter().any(|n| n == name),
                "{path}: {name} reached the backend: {names:?}"
            );
        }
    }

    // gRPC metadata: to the REST backend (translated) and the gRPC backend (passed through).
    let mut client = setup.gateway.grpc_client().await;
    for version in ["1", "2"] {
        let upstream_version = if version == "1" { "rest" } else { "grpc" };
        let mut request = tonic::Request::new(one_int32_grpc_request("identity", upstream_version));
        let metadata = request.metadata_mut();
        metadata.insert("x-echo-tenant", "green".parse().unwrap());
        metadata.insert("authorization", "Bearer xyz".parse().unwrap());
        metadata.insert("traceparent", traceparent.parse().unwrap());
        let answer = client.model_infer(request).await.unwrap();
        let metadata = answer.metadata();
        assert_eq!(metadata.get("x-echo-tenant").unwrap(), "green", "{version}");
        assert!(
            metadata.get("x-request-id").is_some(),
            "a request id is made and echoed"
        );
        let names = received(metadata.get("x-echo-received").and_then(|v| v.to_str().ok()));
        for name in ["authorization", "traceparent", "x-echo-tenant", "x-request-id"] {
            assert!(
                names.iter().any(|n| n == name),
                "{version}: {name} did not reach the backend: {names:?}"
            );
        }
        if version == "1" {
            // gRPC's own headers stay on the gRPC hop.
            for name in ["te", "grpc-timeout", "grpc-accept-encoding"] {
                assert!(
                    !names.iter().any(|n| n == name),
                    "{name} reached the REST backend: {names:?}"
                );
            }
        }
    }
}

/// The slow model's delay: a minute, so a call the gateway does not end early is seen waiting for it, whatever the
/// machine's load (ended calls are cancelled: no test waits it out).
const SLOW_MS: u64 = 60_000;

/// A gRPC request for `model` at `version` with one INT32 input, x = [1], in raw contents.
fn one_int32_grpc_request(model: &str, version: &str) -> ModelInferRequest {
    ModelInferRequest {
        model_name: model.into(),
        model_version: version.into(),
        inputs: vec![InferInputTensor {
            name: "x".into(),
            datatype: "INT32".into(),
            shape: vec![1],
            ..Default::default()
        }],
        raw_input_contents: vec![int32s([1])],
        ..Default::default()
    }
}

/// A gRPC request for the `slow` model at `version`, asking it to take `SLOW_MS`.
fn slow_grpc_request(version: &str) -> ModelInferRequest {
    let mut request = one_int32_grpc_request("slow", version);
    request.parameters.insert(
        "delay_ms".to_owned(),
        oipgate::proto::InferParameter {
            parameter_choice: Some(oipgate::proto::infer_parameter::ParameterChoice::Int64Param(
                i64::try_from(SLOW_MS).unwrap(),
            )),
        },
    );
    request
}

/// Waits until `series` reads `value`, for at most `limit`; gives how long it took.
async fn until_metric(gateway: &GatewayProcess, series: &str, value: f64, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        // A series made at its first event is waited for as well as its value.
        let current = gateway.metric_if_present(series).await;
        if current.is_some_and(|current| (current - value).abs() < f64::EPSILON) {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "{series} stayed at {current:?}, not {value}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_client_that_closes_its_connection_mid_body_is_counted_as_gone_not_as_bad_input() {
    use std::io::Write;
    let setup = setup("");
    let gateway = &setup.gateway;
    let mut stream = std::net::TcpStream::connect(gateway.rest).unwrap();
    write!(
        stream,
        "POST /v2/models/slow/versions/grpc/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{{\"inputs\":"
    )
    .unwrap();
    stream.flush().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    drop(stream);
    let gone = r#"oipgate_requests_total{backend="fleet-b",code="499",model="slow",principal="_other",protocol="rest",version="grpc"}"#;
    until_metric(gateway, gone, 1.0, Duration::from_secs(2)).await;
}

#[tokio::test]
async fn a_client_that_goes_away_cancels_the_backend_call() {
    use std::io::Write;
    let setup = setup("");
    let gateway = &setup.gateway;
    let body = format!(
        r#"{{"parameters":{{"delay_ms":{SLOW_MS}}},"inputs":[{{"name":"x","datatype":"INT32","shape":[1],"data":[1]}}]}}"#
    );
    let wait = Duration::from_millis(SLOW_MS / 2);

    // REST clients: translated to the gRPC backend, and proxied to the REST backend as they are.
    for (version, backend) in [("grpc", "fleet-b"), ("rest", "fleet-a")] {
        let in_flight = format!(r#"oipgate_in_flight{{backend="{backend}"}}"#);
        let mut stream = std::net::TcpStream::connect(gateway.rest).unwrap();
        write!(
            stream,
            "POST /v2/models/slow/versions/{version}/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        until_metric(gateway, &in_flight, 1.0, wait).await;
        drop(stream);
        let took = until_metric(gateway, &in_flight, 0.0, wait).await;
        assert!(
            took < wait,
            "{version}: the backend call outlived its client by {took:?}"
        );
    }
    let closed = r#"oipgate_requests_total{backend="fleet-b",code="499",model="slow",principal="_other",protocol="rest",version="grpc"}"#;
    until_metric(gateway, closed, 1.0, wait).await;

    // gRPC clients: passed through to the gRPC backend, and translated to the REST backend.
    for (version, backend) in [("grpc", "fleet-b"), ("rest", "fleet-a")] {
        let in_flight = format!(r#"oipgate_in_flight{{backend="{backend}"}}"#);
        let mut client = gateway.grpc_client().await;
        let request = slow_grpc_request(version);
        let call = tokio::spawn(async move { client.model_infer(request).await });
        until_metric(gateway, &in_flight, 1.0, wait).await;
        call.abort();
        let took = until_metric(gateway, &in_flight, 0.0, wait).await;
        assert!(
            took < wait,
            "{version}: the backend call outlived its client by {took:?}"
        );
    }
}

#[tokio::test]
async fn a_client_deadline_bounds_the_backend_call_on_every_path() {
    let setup = setup("");
    let gateway = &setup.gateway;
    let deadline = Duration::from_millis(300);
    // tonic's client enforces its own deadline too, so the call is made by hand to see what the gateway answers.
    let client = http_client(true);
    for version in ["grpc", "rest"] {
        let framed = common::grpc_frame(&prost::Message::encode_to_vec(&slow_grpc_request(version)), false);
        let request = http::Request::post(format!(
            "http://{}/inference.GRPCInferenceService/ModelInfer",
            gateway.grpc
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", format!("{}m", deadline.as_millis()))
        .body(http_body_util::Full::new(Bytes::from(framed)))
        .unwrap();
        let start = Instant::now();
        let response = client.request(request).await.unwrap();
        let headers = response.headers().clone();
        let collected = http_body_util::BodyExt::collect(response.into_body()).await.unwrap();
        let trailers = collected.trailers().cloned().unwrap_or(headers);
        assert_eq!(
            trailers.get("grpc-status").map(|v| v.to_str().unwrap().to_owned()),
            Some((Code::DeadlineExceeded as i32).to_string()),
            "{version}: {trailers:?}"
        );
        assert!(start.elapsed() < Duration::from_millis(SLOW_MS / 2), "{version}");
    }
    // A REST client may give the same deadline in a grpc-timeout header.
    let body = format!(
        r#"{{"parameters":{{"delay_ms":{SLOW_MS}}},"inputs":[{{"name":"x","datatype":"INT32","shape":[1],"data":[1]}}]}}"#
    );
    let start = Instant::now();
    let answer = post_with_headers(
        &gateway.rest_url("/v2/models/slow/versions/grpc/infer"),
        &[("grpc-timeout", "300m".to_owned())],
        body,
    )
    .await;
    assert_eq!(answer.status, 504, "{:?}", answer.body);
    assert!(start.elapsed() < Duration::from_millis(SLOW_MS / 2));
}

/// Sends `parts` over a fresh connection, pausing between them, and gives everything the gateway answered (the
/// request asks the connection to close after it).
async fn raw_exchange(address: std::net::SocketAddr, parts: &[&[u8]]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    for part in parts {
        stream.write_all(part).await.unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("the gateway answered and closed")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn proxied_bodies_of_every_length_and_framing_arrive_whole_and_renamed() {
    let setup = setup("");
    // Small bodies are read whole and sent with their head; long ones, and those of unknown length, stream through.
    for elements in [4u64, 100_000] {
        let values: Vec<u8> = (0..elements * 4).map(|i| (i % 251) as u8).collect();
        let inputs = vec![Tensor::new("INPUT0", DataType::Fp32, vec![elements], Bytes::from(values)).unwrap()];
        let (body, headers) = binary_request(inputs.clone());
        // Version "rest" is an alias of the backend's version 1: the answer's version is put back on both paths.
        let url = setup.gateway.rest_url("/v2/models/identity/versions/rest/infer");
        let answer = post_with_headers(&url, &headers, body.to_bytes()).await;
        assert_eq!(answer.status, 200, "{elements}: {:?}", answer.body);
        assert_eq!(answer.header("oip-model-version"), Some("rest"));
        let length = answer
            .header("inference-header-content-length")
            .map(|l| l.parse().unwrap());
        assert_eq!(
            answer.header("content-length").map(|l| l.parse::<usize>().unwrap()),
            Some(answer.body.len())
        );
        let response = rest::decode_response(answer.body, length).unwrap();
        assert_eq!(response.outputs, inputs, "{elements} elements");
        assert_eq!(response.model_version.as_deref(), Some("rest"));
    }

    let address = setup.gateway.rest;
    let json = add_sub_json("INT32");
    let (first, rest_of_it) = json.split_at(json.len() / 2);
    let chunked = format!(
        "POST /v2/models/classifier/versions/4/infer HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n{:x}\r\n{first}\r\n{:x}\r\n{rest_of_it}\r\n0\r\n\r\n",
        first.len(),
        rest_of_it.len()
    );
    let answer = raw_exchange(address, &[chunked.as_bytes()]).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#""model_name":"classifier""#), "{answer}");

    // A client that sends its request a byte at a time at first is told from HTTP/2's preface, which also starts
    // with 'P', as soon as its second byte differs.
    let request = format!(
        "POST /v2/models/add_sub/infer HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{json}",
        json.len()
    );
    let (p, tail) = request.as_bytes().split_at(1);
    let (o, tail) = tail.split_at(1);
    let answer = raw_exchange(address, &[p, o, tail]).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#""model_name":"add_sub""#), "{answer}");
}

#[tokio::test]
async fn keep_alive_connections_serve_request_after_request_and_h2c_shares_the_port() {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let setup = setup("");
    let json = add_sub_json("INT32");
    // HTTP/1.1: one connection carries every request, answered in turn (pauses between some).
    let stream = tokio::net::TcpStream::connect(setup.gateway.rest).await.unwrap();
    let mut stream = tokio::io::BufReader::new(stream);
    for round in 0..20 {
        let request = format!(
            "POST /v2/models/add_sub/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{json}",
            json.len()
        );
        stream.get_mut().write_all(request.as_bytes()).await.unwrap();
        let mut status = String::new();
        stream.read_line(&mut status).await.unwrap();
        assert!(status.starts_with("HTTP/1.1 200"), "round {round}: {status:?}");
        let mut length = 0;
        loop {
            let mut line = String::new();
            stream.read_line(&mut line).await.unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = value.trim().parse().unwrap();
            }
        }
        let mut body = vec![0u8; length];
        stream.read_exact(&mut body).await.unwrap();
        assert!(
            String::from_utf8_lossy(&body).contains("\"model_name\":\"add_sub\""),
            "round {round}"
        );
        tokio::time::sleep(Duration::from_millis(if round % 5 == 0 { 50 } else { 0 })).await;
    }
    // h2c on the same port: one HTTP/2 connection's streams carry every request.
    let tcp = tokio::net::TcpStream::connect(setup.gateway.rest).await.unwrap();
    let (mut client, connection) = h2::client::handshake(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    for round in 0..20 {
        let request = http::Request::post("http://x/v2/models/add_sub/infer")
            .header("content-type", "application/json")
            .body(())
            .unwrap();
        let (answer, mut sending) = client.send_request(request, false).unwrap();
        sending.send_data(Bytes::from(json.clone()), true).unwrap();
        let answer = answer.await.unwrap();
        assert_eq!(answer.status(), 200, "h2c round {round}");
        let mut body = answer.into_body();
        while let Some(data) = body.data().await {
            let data = data.unwrap();
            let _ = body.flow_control().release_capacity(data.len());
        }
        tokio::time::sleep(Duration::from_millis(if round % 5 == 0 { 50 } else { 0 })).await;
    }
    assert!(!connection.is_finished(), "the one HTTP/2 connection is still open");
}
