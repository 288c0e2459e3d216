//! Triton's reserved parameters through the gateway, on both doors and every path: `timeout` bounds the backend call,
//! and tensors in shared memory are refused before any backend sees them.

mod common;

use common::config::fleet_backends;
use common::{GatewayProcess, ModelServerProcess, grpc_int32_request, http_client, send};
use oipgate::proto::InferParameter;
use oipgate::proto::infer_parameter::ParameterChoice;
use oipgate::proto::model_infer_request::InferRequestedOutputTensor;

/// `slow` and `identity` at version 1 on the REST backend (proxied as they are from REST) and version 2 on the gRPC
/// one (translated from REST), both on one model server.
fn gateway(server: &ModelServerProcess) -> GatewayProcess {
    let mut config = fleet_backends(server.rest.unwrap(), server.grpc.unwrap());
    for model in ["slow", "identity"] {
        config.push_str(&format!(
            r#"
            [[models]]
            name = "{model}"
            versions = [ {{ version = "1", backend = "fleet-a" }},
                         {{ version = "2", backend = "fleet-b", upstream_version = "1" }} ]
            default_version = "1"
            "#
        ));
    }
    GatewayProcess::start(&config)
}

fn parameter(choice: ParameterChoice) -> InferParameter {
    InferParameter {
        parameter_choice: Some(choice),
    }
}

#[tokio::test]
async fn a_timeout_parameter_bounds_the_backend_call_on_every_path() {
    let server = ModelServerProcess::both();
    let gateway = gateway(&server);
    let client = http_client(false);
    // The model sleeps 5 s; the request allows 300 ms (300000 us). A call let run to its end would be answered 200:
    // the 504 / DEADLINE_EXCEEDED is the bound's, however long the machine takes to give it.
    let body = r#"{"parameters":{"delay_ms":5000,"timeout":300000},"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}]}"#;
    for version in ["1", "2"] {
        let url = gateway.rest_url(&format!("/v2/models/slow/versions/{version}/infer"));
        let answer = send(&client, "POST", &url, &[], body).await;
        assert_eq!(answer.status, 504, "version {version}: {:?}", answer.body);
    }
    let mut grpc = gateway.grpc_client().await;
    for version in ["1", "2"] {
        let mut request = grpc_int32_request("slow", version);
        request
            .parameters
            .insert("delay_ms".into(), parameter(ParameterChoice::Int64Param(5000)));
        request
            .parameters
            .insert("timeout".into(), parameter(ParameterChoice::Int64Param(300_000)));
        let refused = grpc.model_infer(request).await.unwrap_err();
        assert_eq!(
            refused.code(),
            tonic::Code::DeadlineExceeded,
            "version {version}: {refused:?}"
        );
    }
    // A timeout that is not a number of microseconds is refused.
    let bad = r#"{"parameters":{"timeout":-5},"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}]}"#;
    let answer = send(
        &client,
        "POST",
        &gateway.rest_url("/v2/models/identity/infer"),
        &[],
        bad,
    )
    .await;
    assert_eq!(answer.status, 400);
    assert!(String::from_utf8_lossy(&answer.body).contains("parameter timeout must be a number of microseconds"));
    // Within its timeout a request is answered as usual.
    let quick =
        r#"{"parameters":{"timeout":5000000},"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}]}"#;
    answered(&gateway, quick).await;
}

/// Sends `body` to `identity` through the REST door, and checks that it was answered.
async fn answered(gateway: &GatewayProcess, body: &'static str) {
    let answer = common::post(&gateway.rest_url("/v2/models/identity/infer"), body).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
}

#[tokio::test]
async fn tensors_in_shared_memory_are_refused_on_both_doors() {
    let server = ModelServerProcess::both();
    let gateway = gateway(&server);
    let client = http_client(false);
    let input = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[1],"parameters":{"shared_memory_region":"r0","shared_memory_byte_size":4}}]}"#;
    let output = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}],"outputs":[{"name":"x","parameters":{"shared_memory_region":"r1","shared_memory_byte_size":4}}]}"#;
    // The same names spelled with JSON escapes, which every JSON reader (the backend's among them) reads as they are.
    let escaped = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[1],"param\u0065ters":{"\u0073hared_memory_region":"r0","\u0073hared_memory_byte_size":4}}]}"#;
    for version in ["1", "2"] {
        let url = gateway.rest_url(&format!("/v2/models/identity/versions/{version}/infer"));
        for (body, says) in [
            (input, "input 'x' sets shared_memory_"),
            (output, "output 'x' sets shared_memory_"),
            (escaped, "input 'x' sets shared_memory_"),
        ] {
            let answer = send(&client, "POST", &url, &[], body).await;
            let text = String::from_utf8_lossy(&answer.body);
            assert_eq!(answer.status, 400, "version {version}: {text}");
            assert!(
                text.contains(says) && text.contains("shared memory cannot cross a gateway"),
                "{text}"
            );
        }
    }
    // Refused by the gateway itself: no backend was called, until a request without shared memory.
    let called = |metrics: &str| metrics.contains("oipgate_upstream_duration_seconds_count{");
    let metrics = gateway.metrics().await;
    assert!(!called(&metrics), "a refused request reached a backend: {metrics}");
    let plain = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}]}"#;
    answered(&gateway, plain).await;
    assert!(called(&gateway.metrics().await));
    let mut grpc = gateway.grpc_client().await;
    for version in ["1", "2"] {
        let mut request = grpc_int32_request("identity", version);
        request.inputs[0].parameters.insert(
            "shared_memory_region".into(),
            parameter(ParameterChoice::StringParam("r0".into())),
        );
        let refused = grpc.model_infer(request).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("input 'x' sets shared_memory_region"),
            "{}",
            refused.message()
        );
        let mut request = grpc_int32_request("identity", version);
        request.outputs.push(InferRequestedOutputTensor {
            name: "x".into(),
            parameters: [(
                "shared_memory_offset".to_owned(),
                parameter(ParameterChoice::Int64Param(0)),
            )]
            .into_iter()
            .collect(),
        });
        let refused = grpc.model_infer(request).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("output 'x' sets shared_memory_offset"),
            "{}",
            refused.message()
        );
    }
}
