//! The dispatch layer in front of real model servers: every protocol path gives the same outputs, public names are
//! restored on aliases, errors keep their meaning, metadata and readiness come from the serving backend.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::config::{ADD_SUB_ON_BOTH, backend, fleet_backends, model};
use common::int32s;
use common::ports::{DeadEndpoint, dead_endpoint};
use oipgate::codec::protobuf;
use oipgate::config::{Config, raw, validate};
use oipgate::dispatch::{CallContext, Dispatcher};
use oipgate::modelserver::RunningModelServer;
use oipgate::proto::ModelInferResponse;
use oipgate::protocol::{DataType, InferRequest, InferResponse, ParamValue, Tensor};
use oipgate::{ErrorKind, Origin};
use prost::Message;
use tonic::Code;

struct Fleet {
    rest: RunningModelServer,
    grpc: RunningModelServer,
    _down: DeadEndpoint,
    dispatcher: Dispatcher,
}

async fn fleet() -> Fleet {
    let (rest, grpc) = common::in_process_backends().await;
    let down = dead_endpoint();
    let (rest_address, grpc_address) = (rest.rest_addr.unwrap(), grpc.grpc_addr.unwrap());
    let text = format!(
        r#"
        {}
        {}
        {}
        {ADD_SUB_ON_BOTH}
        [[models]]
        name = "classifier"
        versions = [ {{ version = "3", backend = "fleet-b", upstream_name = "add_sub", upstream_version = "1" }},
                     {{ version = "4", backend = "rest-json", upstream_name = "add_sub", upstream_version = "1" }} ]
        [[models]]
        name = "identity"
        versions = [ {{ version = "binary", backend = "fleet-a", upstream_version = "1" }},
                     {{ version = "json", backend = "rest-json", upstream_version = "1" }},
                     {{ version = "grpc", backend = "fleet-b", upstream_version = "1" }} ]
        default_version = "grpc"
        [[models]]
        name = "flaky"
        versions = [ {{ version = "1", backend = "rest-json" }}, {{ version = "2", backend = "fleet-b", upstream_version = "1" }} ]
        [[models]]
        name = "slow"
        versions = [ {{ version = "1", backend = "rest-json" }}, {{ version = "2", backend = "fleet-b", upstream_version = "1" }} ]
        {}
        "#,
        fleet_backends(rest_address, grpc_address),
        backend("rest-json", "rest", [rest_address]),
        backend("down", "grpc", [&down]),
        model("gone", "down"),
    );
    let config: Config = validate(raw::parse(&text, &[]).unwrap()).unwrap();
    let dispatcher = Dispatcher::new(&config, "gateway-under-test").unwrap();
    Fleet {
        rest,
        grpc,
        _down: down,
        dispatcher,
    }
}

fn add_sub() -> InferRequest {
    InferRequest {
        id: Some("d1".into()),
        inputs: vec![
            Tensor::new("INPUT0", DataType::Int32, vec![1, 16], int32s(0..16)).unwrap(),
            Tensor::new("INPUT1", DataType::Int32, vec![1, 16], int32s([5; 16])).unwrap(),
        ],
        ..InferRequest::default()
    }
}

fn output<'a>(response: &'a InferResponse, name: &str) -> &'a Tensor {
    response
        .outputs
        .iter()
        .find(|o| o.name == name)
        .unwrap_or_else(|| panic!("no output {name}"))
}

#[tokio::test]
async fn versions_on_different_protocols_give_the_same_answer() {
    let fleet = fleet().await;
    let context = CallContext::default();
    let v1 = fleet
        .dispatcher
        .infer("add_sub", None, add_sub(), &context)
        .await
        .unwrap()
        .value;
    let v2 = fleet
        .dispatcher
        .infer("add_sub", Some("2"), add_sub(), &context)
        .await
        .unwrap()
        .value;
    assert_eq!(
        (v1.model_name.as_str(), v1.model_version.as_deref()),
        ("add_sub", Some("1"))
    );
    assert_eq!(v2.model_version.as_deref(), Some("2"));
    assert_eq!((v1.id.as_deref(), v2.id.as_deref()), (Some("d1"), Some("d1")));
    for name in ["OUTPUT0", "OUTPUT1"] {
        assert_eq!(output(&v1, name), output(&v2, name));
    }
    assert_eq!(output(&v1, "OUTPUT0").data, int32s(5..21));
    assert_eq!(output(&v2, "VERSION").data, int32s([2]));
}

#[tokio::test]
async fn aliases_are_renamed_both_ways() {
    let fleet = fleet().await;
    for version in ["3", "4"] {
        let response = fleet
            .dispatcher
            .infer("classifier", Some(version), add_sub(), &CallContext::default())
            .await
            .unwrap()
            .value;
        assert_eq!(
            (response.model_name.as_str(), response.model_version.as_deref()),
            ("classifier", Some(version))
        );
        assert!(
            response.outputs.iter().all(|o| o.name != "VERSION"),
            "upstream version 1 has no VERSION output"
        );
    }
}

#[tokio::test]
async fn every_datatype_through_every_backend_kind() {
    let fleet = fleet().await;
    let mut inputs = Vec::new();
    for (i, datatype) in DataType::ALL.into_iter().enumerate() {
        let tensor = match datatype.element_size() {
            Some(size) => {
                // Finite, non-NaN bit patterns, so JSON carries them exactly too.
                let data: Vec<u8> = (0..2 * size)
                    .map(|b| {
                        if datatype == DataType::Bool {
                            u8::from(b % 2 == 1)
                        } else {
                            0x10 + (b % 7).to_le_bytes()[0]
                        }
                    })
                    .collect();
                Tensor::new(format!("t{i}"), datatype, vec![2], Bytes::from(data)).unwrap()
            }
            None => Tensor::from_bytes_elements(format!("t{i}"), vec![2], [&b"x"[..], "é".as_bytes()]).unwrap(),
        };
        inputs.push(tensor.with_parameters([("k".to_owned(), ParamValue::Int64(i as i64))].into_iter().collect()));
    }
    let request = InferRequest {
        inputs: inputs.clone(),
        ..InferRequest::default()
    };
    for version in ["binary", "json", "grpc"] {
        let response = fleet
            .dispatcher
            .infer("identity", Some(version), request.clone(), &CallContext::default())
            .await
            .unwrap()
            .value;
        assert_eq!(response.outputs, inputs, "through the {version} backend");
    }
}

#[tokio::test]
async fn grpc_front_door_passes_through_or_translates() {
    let fleet = fleet().await;
    for (model, version, public_version) in [
        ("add_sub", "2", "2"),
        ("classifier", "3", "3"),
        ("add_sub", "1", "1"),
        ("add_sub", "", "1"),
    ] {
        let mut request = add_sub();
        request.model_name = model.into();
        request.model_version = Some(version.to_owned()).filter(|v| !v.is_empty());
        let message = Bytes::from(protobuf::request_to_proto(request).encode_to_vec());
        let chunks = fleet
            .dispatcher
            .infer_grpc(message, &CallContext::default())
            .await
            .unwrap();
        let response =
            protobuf::response_from_proto(ModelInferResponse::decode(&chunks.value.concat()[..]).unwrap()).unwrap();
        assert_eq!(
            (response.model_name.as_str(), response.model_version.as_deref()),
            (model, Some(public_version))
        );
        assert_eq!(output(&response, "OUTPUT0").data, int32s(5..21), "{model} {version}");
        assert_eq!(response.id.as_deref(), Some("d1"));
    }
}

#[tokio::test]
async fn errors_keep_their_meaning_on_every_path() {
    let fleet = fleet().await;
    let context = CallContext::default();
    let unknown = fleet
        .dispatcher
        .infer("nope", None, add_sub(), &context)
        .await
        .unwrap_err();
    assert_eq!(
        (unknown.kind(), unknown.origin()),
        (ErrorKind::NotFound, Origin::Client)
    );
    let version = fleet
        .dispatcher
        .infer("add_sub", Some("7"), add_sub(), &context)
        .await
        .unwrap_err();
    assert_eq!(version.grpc_code(), Code::NotFound);
    let down = fleet
        .dispatcher
        .infer("gone", None, add_sub(), &context)
        .await
        .unwrap_err();
    assert_eq!((down.kind(), down.http_status().as_u16()), (ErrorKind::BadGateway, 502));
    for version in ["1", "2"] {
        let mut flaky = InferRequest {
            inputs: vec![Tensor::new("x", DataType::Int8, vec![1], Bytes::from_static(&[1])).unwrap()],
            ..InferRequest::default()
        };
        flaky.parameters.insert("fail".into(), ParamValue::Bool(true));
        let error = fleet
            .dispatcher
            .infer("flaky", Some(version), flaky, &context)
            .await
            .unwrap_err();
        assert_eq!(
            (error.http_status().as_u16(), error.grpc_code()),
            (500, Code::Internal),
            "flaky {version}"
        );
        assert!(error.message().contains("fail=true"));
    }
    let mut bad = add_sub();
    bad.inputs[0].shape = vec![16];
    let rest = fleet
        .dispatcher
        .infer("add_sub", Some("1"), bad.clone(), &context)
        .await
        .unwrap_err();
    let grpc = fleet
        .dispatcher
        .infer("add_sub", Some("2"), bad, &context)
        .await
        .unwrap_err();
    assert_eq!(
        (rest.http_status(), rest.grpc_code()),
        (grpc.http_status(), grpc.grpc_code())
    );
    let garbage = fleet
        .dispatcher
        .infer_grpc(Bytes::from_static(&[0x0a, 0x09, b'x']), &context)
        .await
        .unwrap_err();
    assert_eq!(garbage.kind(), ErrorKind::InvalidArgument);
}

#[tokio::test]
async fn deadlines_bound_the_call() {
    let fleet = fleet().await;
    for version in ["1", "2"] {
        let mut slow = InferRequest {
            inputs: vec![Tensor::new("x", DataType::Int8, vec![1], Bytes::from_static(&[1])).unwrap()],
            ..InferRequest::default()
        };
        // A minute at the backend: a deadline not kept would be seen waiting for it, whatever the machine's load.
        slow.parameters.insert("delay_ms".into(), ParamValue::Int64(60_000));
        let context = CallContext {
            deadline: Some(Duration::from_millis(150)),
            ..Default::default()
        };
        let started = std::time::Instant::now();
        let error = fleet
            .dispatcher
            .infer("slow", Some(version), slow, &context)
            .await
            .unwrap_err();
        assert_eq!(
            (error.kind(), error.grpc_code()),
            (ErrorKind::Timeout, Code::DeadlineExceeded),
            "slow {version}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "slow {version} ran past its deadline"
        );
    }
}

#[tokio::test]
async fn metadata_and_readiness_from_the_serving_backend() {
    let fleet = fleet().await;
    let metadata = fleet.dispatcher.model_metadata("classifier", Some("3")).await.unwrap();
    assert_eq!(metadata.name, "classifier");
    assert_eq!(metadata.versions, ["3", "4"]);
    assert_eq!(metadata.inputs[0].name, "INPUT0");
    let rest_metadata = fleet.dispatcher.model_metadata("add_sub", None).await.unwrap();
    assert_eq!(rest_metadata.versions, ["1", "2"]);
    assert!(fleet.dispatcher.model_ready("add_sub", Some("2")).await.unwrap());
    assert!(
        !fleet.dispatcher.server_ready().await,
        "model 'gone' has no reachable backend"
    );
    assert_eq!(fleet.dispatcher.server_metadata().name, "gateway-under-test");

    fleet.rest.state.repository.set_ready("add_sub", false).unwrap();
    assert!(!fleet.dispatcher.model_ready("add_sub", Some("1")).await.unwrap());
    assert!(
        fleet.dispatcher.model_ready("add_sub", Some("2")).await.unwrap(),
        "the gRPC backend still has it"
    );
    fleet.grpc.state.repository.set_ready("add_sub", false).unwrap();
    assert!(!fleet.dispatcher.model_ready("classifier", Some("3")).await.unwrap());
}

#[tokio::test]
async fn fleet_answers_read_kept_state_asking_once_per_backend_model_not_per_call_or_alias() {
    let (rest, grpc) = common::in_process_backends().await;
    let mut text = format!(
        "{}{}",
        backend("r", "rest", [rest.rest_addr.unwrap()]),
        backend("g", "grpc", [grpc.grpc_addr.unwrap()])
    );
    // A hundred public names for two backend models on each backend: four distinct questions in all.
    for index in 0..100 {
        let (backend, upstream) = (["r", "g"][index % 2], ["identity", "add_sub"][index / 2 % 2]);
        text += &format!(
            "[[models]]\nname = \"m{index}\"\nversions = [ {{ version = \"1\", backend = \"{backend}\", upstream_name = \"{upstream}\" }} ]\n"
        );
    }
    let config: Config = validate(raw::parse(&text, &[]).unwrap()).unwrap();
    let dispatcher = Dispatcher::new(&config, "gateway-under-test").unwrap();
    let asked = || rest.state.repository.readiness_asked() + grpc.state.repository.readiness_asked();

    let index = dispatcher.repository_index(false).await;
    assert_eq!(index.len(), 100);
    assert!(index.iter().all(|entry| entry.reason.is_empty()), "{index:?}");
    assert_eq!(asked(), 4, "one question per endpoint and backend model");
    for _ in 0..10 {
        assert_eq!(dispatcher.repository_index(true).await.len(), 100);
        assert!(dispatcher.server_ready().await);
    }
    assert_eq!(asked(), 4, "answers within a second read what was kept");

    // A change made through the gateway is seen by the next answer.
    dispatcher
        .repository_change(
            "m0",
            oipgate::dispatch::RepositoryAction::Unload,
            &Default::default(),
            &http::HeaderMap::new(),
        )
        .await
        .unwrap();
    let index = dispatcher.repository_index(false).await;
    let unavailable: Vec<&str> = index
        .iter()
        .filter(|entry| !entry.reason.is_empty())
        .map(|entry| entry.name.as_str())
        .collect();
    // m0 is identity on r, as every fourth name is.
    assert_eq!(unavailable.len(), 25, "{unavailable:?}");
    assert!(unavailable.contains(&"m0") && unavailable.contains(&"m4"));
    assert!(!dispatcher.server_ready().await);
}

#[tokio::test]
async fn the_status_lists_unavailable_versions_first_and_caps_the_list_with_its_totals() {
    let (rest, _grpc) = common::in_process_backends().await;
    let dead = dead_endpoint();
    let mut text = format!(
        "{}{}",
        backend("live", "rest", [rest.rest_addr.unwrap()]),
        backend("gone", "rest", [dead.to_string()])
    );
    // 300 versions: every hundredth on the dead backend, listed late in the configuration.
    for index in 0..300 {
        let backend = if index % 100 == 99 { "gone" } else { "live" };
        text += &format!(
            "[[models]]\nname = \"m{index}\"\nversions = [ {{ version = \"1\", backend = \"{backend}\", upstream_name = \"identity\" }} ]\n"
        );
    }
    let config: Config = validate(raw::parse(&text, &[]).unwrap()).unwrap();
    let dispatcher = Dispatcher::new(&config, "gateway-under-test").unwrap();
    let status = dispatcher.fleet_status().await;
    assert_eq!((status.versions_total, status.versions_unavailable), (300, 3));
    assert_eq!(status.models.len(), oipgate::dispatch::status::LISTED_VERSIONS);
    let first: Vec<(&str, &str)> = status.models[..4]
        .iter()
        .map(|version| (version.model.as_str(), version.state))
        .collect();
    assert_eq!(
        first,
        [
            ("m99", "UNAVAILABLE"),
            ("m199", "UNAVAILABLE"),
            ("m299", "UNAVAILABLE"),
            ("m0", "READY")
        ],
        "unavailable first, each state in configured order"
    );
}
