//! The zero-downtime binary upgrade: a second process started with `--upgrade` takes the listening sockets of the
//! running one (pingora's handover on SIGQUIT) while REST keep-alive and gRPC clients keep sending, and no request
//! fails.

mod common;

use std::time::Duration;

use common::config::{backend, model};
use common::{GatewayProcess, Load, ModelServerProcess, add_sub_json, http_client, post};

/// A gRPC client that, as gRPC's own clients do (transparent retry, gRFC A6), sends a call again on a new
/// connection when its connection closed before the call was sent (as after an HTTP/2 GOAWAY); tonic's channel
/// would fail such a call.
fn retrying_grpc_client(
    address: std::net::SocketAddr,
) -> oipgate::proto::grpc_inference_service_client::GrpcInferenceServiceClient<
    hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, tonic::body::Body>,
> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let origin = format!("http://{address}").parse().unwrap();
    oipgate::proto::grpc_inference_service_client::GrpcInferenceServiceClient::with_origin(client, origin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upgrade_under_load_on_both_doors_fails_no_request() {
    let backend_server = ModelServerProcess::both();
    let socket = std::env::temp_dir().join(format!("oipgate-upgrade-{}.sock", std::process::id()));
    let socket_arg = socket.to_string_lossy().into_owned();
    let config = format!(
        "[shutdown]\ndrain_delay_ms = 0\ngrace_period_ms = 10000\n{}{}{}{}",
        backend("rest", "rest", [backend_server.rest.unwrap()]),
        backend("grpc", "grpc", [backend_server.grpc.unwrap()]),
        model("add_sub", "rest"),
        model("identity", "grpc"),
    );
    let mut old = GatewayProcess::start_with(&config, &["--upgrade-socket", &socket_arg], false);

    let mut load = Load::default();
    for worker in 0..4 {
        if worker < 2 {
            // Each REST worker keeps its keep-alive connections for the whole run.
            load.rest_worker(
                http_client(false),
                old.rest_url("/v2/models/add_sub/infer"),
                add_sub_json("INT32"),
            );
        } else {
            load.grpc_identity_worker(retrying_grpc_client(old.grpc));
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(load.served() > 0, "the load is under way before the upgrade");

    let new = tokio::task::block_in_place(|| old.upgrade(&["--upgrade-socket", &socket_arg], || old.signal("QUIT")));
    let old_pid = old.pid();
    // The old process hands over, stops accepting, finishes what it has and exits on its own.
    let status = tokio::task::block_in_place(|| old.wait_exit(Duration::from_secs(30)));
    assert!(
        status.is_some_and(|s| s.success()),
        "the old process exits cleanly: {status:?}"
    );
    let at_exit = load.served();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let served = load.served();
    load.stop().await;
    assert!(
        served > at_exit,
        "requests are answered after the old process ({old_pid}) is gone"
    );

    // The new process answers on the same ports, and its own access log shows the requests it served.
    let answer = post(&new.rest_url("/v2/models/add_sub/infer"), add_sub_json("INT32")).await;
    assert_eq!(answer.status, 200);
    let mut grpc = new.grpc_client().await;
    grpc.model_infer(common::grpc_int32_request("identity", ""))
        .await
        .unwrap();
    // Every request answered once the old process was gone was the new one's, and is in its log, besides the two
    // just sent: at least that many inference lines.
    let after_old = served - at_exit;
    let inferences = |lines: &[String]| {
        lines
            .iter()
            .filter(|line| {
                line.contains("oipgate::access")
                    && (line.contains("path=\"/v2/models/add_sub/infer\"") || line.contains("path=\"ModelInfer\""))
            })
            .count()
    };
    // Waited for until the count is reached (the log is written in batches); the assertion below names a shortfall.
    let lines = new
        .logged("the new process's inference lines", |lines| {
            inferences(lines) >= after_old + 2
        })
        .await;
    let served_by_new = inferences(&lines);
    assert!(
        served_by_new >= after_old + 2,
        "the new process ({}) logged {served_by_new} inferences; it served at least {after_old} and the 2 probes",
        new.pid()
    );
    assert_ne!(new.pid(), old_pid);
    let _ = std::fs::remove_file(&socket);
}
