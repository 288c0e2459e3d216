//! Operating `oipgate serve`: configuration rewritten under load (file watch and SIGHUP) without a failed request,
//! state kept across reloads, an invalid file refused, graceful shutdown on SIGTERM / SIGINT, access logs and the
//! operations metrics.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{GatewayProcess, Load, ModelServerProcess, answered_ok, eventually, get, http_client, send};

const BODY: &str = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[7,8]}]}"#;

fn replica(name: &str) -> ModelServerProcess {
    ModelServerProcess::start(&["--rest", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--name", name])
}

/// The configuration of step `step` of the rewrite sequence: weights that move, a model added and removed, a backend
/// removed and brought back.
fn step_config(a: &ModelServerProcess, b: &ModelServerProcess, step: usize) -> String {
    let weight_a = [90, 50, 10, 70, 30][step % 5];
    let with_b = step % 7 != 3;
    let with_echo = step % 4 >= 2;
    let mut config = format!(
        r#"
        [reload]
        watch_interval_ms = 50
        [[backends]]
        name = "a"
        protocol = "rest"
        binary_data = true
        endpoints = ["{}"]
        "#,
        a.rest.unwrap()
    );
    if with_b {
        config += &format!(
            r#"
        [[backends]]
        name = "b"
        protocol = "grpc"
        endpoints = ["{}"]
        "#,
            b.grpc.unwrap()
        );
    }
    config += "[[models]]\nname = \"identity\"\n";
    if with_b {
        config += &format!(
            "versions = [ {{ version = \"1\", backend = \"a\", weight = {weight_a} }}, {{ version = \"2\", backend = \"b\", upstream_version = \"1\", weight = {} }} ]\n",
            100 - weight_a
        );
    } else {
        config += "versions = [ { version = \"1\", backend = \"a\" } ]\n";
    }
    if with_echo {
        config += "[[models]]\nname = \"echo\"\nversions = [ { version = \"1\", backend = \"a\", upstream_name = \"identity\" } ]\n";
    }
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_rewrites_under_steady_load_fail_no_request() {
    let a = replica("a");
    let b = replica("b");
    let gateway = GatewayProcess::start(&step_config(&a, &b, 0));
    let mut load = Load::default();
    for worker in 0..4 {
        if worker < 2 {
            let client = http_client(worker % 2 == 0);
            let url = gateway.rest_url("/v2/models/identity/infer");
            load.worker(move || {
                let (client, url) = (client.clone(), url.clone());
                async move { answered_ok(&send(&client, "POST", &url, &[], BODY).await) }
            });
        } else {
            let grpc = gateway.grpc_client().await;
            load.worker(move || {
                let mut grpc = grpc.clone();
                async move {
                    grpc.model_infer(common::grpc_int32_request("identity", ""))
                        .await
                        .map(drop)
                        .map_err(|status| format!("gRPC {status:?}"))
                }
            });
        }
    }
    let reloads = |result: &'static str| {
        let gateway = &gateway;
        async move {
            gateway
                .metric(&format!("oipgate_config_reloads_total{{result=\"{result}\"}}"))
                .await
        }
    };
    let mut expected_ok = 0.0;
    for step in 1..=20 {
        if step == 11 {
            // A backend named by a version but not configured: refused, the running configuration stays.
            gateway.rewrite(&step_config(&a, &b, step).replace("backend = \"a\"", "backend = \"nowhere\""));
            eventually(Duration::from_secs(5), "the invalid file to be refused", || async {
                reloads("error").await >= 1.0
            })
            .await;
        } else {
            gateway.rewrite(&step_config(&a, &b, step));
            if step % 5 == 0 {
                // SIGHUP also reloads (the watch may get there first; either way one reload applies it).
                gateway.signal("HUP");
            }
            expected_ok += 1.0;
            let target = expected_ok;
            eventually(Duration::from_secs(5), "the rewrite to be applied", || async {
                reloads("ok").await >= target
            })
            .await;
        }
        // The new configuration serves what it names: `echo` exactly while it is configured. (A step that also sent
        // SIGHUP may have been counted twice, so the count can run ahead of the file by one step: the answer is
        // what tells that this step's file is the one served.)
        let with_echo = step != 11 && step % 4 >= 2 || step == 11 && 10 % 4 >= 2;
        let expected = if with_echo { 200 } else { 404 };
        eventually(Duration::from_secs(5), &format!("step {step} to be served"), || async {
            let answer = send(
                &http_client(false),
                "POST",
                &gateway.rest_url("/v2/models/echo/infer"),
                &[],
                BODY,
            )
            .await;
            answer.status == expected
        })
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let served = load.served();
    load.stop().await;
    assert!(served > 200, "the load kept going");
    assert_eq!(reloads("error").await, 1.0);
    assert!(reloads("ok").await >= expected_ok);
}

#[tokio::test]
async fn a_reload_keeps_the_state_of_unchanged_backends_and_refuses_an_invalid_file_as_check_config_does() {
    let a = replica("a");
    let dead = common::dead_address();
    let config = |weight_note: &str| {
        format!(
            r#"
            [reload]
            watch = false
            [[backends]]
            name = "pair"
            protocol = "rest"
            endpoints = ["{}", "{dead}"]
            retries = 1
            outlier = {{ consecutive_failures = 1, base_ejection_ms = 60000 }}
            [[models]]
            name = "identity"
            versions = [ {{ version = "1", backend = "pair" }} ]
            # {weight_note}
            "#,
            a.rest.unwrap()
        )
    };
    let gateway = GatewayProcess::start_with(&config("first"), &[], true);
    let healthy = format!("oipgate_endpoint_healthy{{backend=\"pair\",endpoint=\"{dead}\"}}");
    let client = http_client(false);
    let url = gateway.rest_url("/v2/models/identity/infer");
    for _ in 0..4 {
        assert_eq!(send(&client, "POST", &url, &[], BODY).await.status, 200);
    }
    assert_eq!(gateway.metric(&healthy).await, 0.0, "the dead endpoint is ejected");
    let retries = gateway.metric("oipgate_retries_total{backend=\"pair\"}").await;

    // A reload that leaves the backend as it was keeps its endpoints' state: still ejected, no new retries.
    gateway.rewrite(&config("second"));
    gateway.signal("HUP");
    eventually(Duration::from_secs(5), "the reload", || async {
        gateway.metric("oipgate_config_reloads_total{result=\"ok\"}").await >= 1.0
    })
    .await;
    for _ in 0..6 {
        assert_eq!(send(&client, "POST", &url, &[], BODY).await.status, 200);
    }
    assert_eq!(gateway.metric(&healthy).await, 0.0, "still ejected after the reload");
    assert_eq!(gateway.metric("oipgate_retries_total{backend=\"pair\"}").await, retries);

    // An invalid file: refused with check-config's own message, counted, and the running configuration serves on.
    let invalid = config("third").replace("backend = \"pair\"", "backend = \"missing\"");
    gateway.rewrite(&invalid);
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_oipgate"))
        .arg("check-config")
        .arg(gateway.config_path())
        .output()
        .unwrap();
    assert!(!check.status.success());
    let message = "models[0].versions[0].backend: no backend named \"missing\"";
    assert!(String::from_utf8_lossy(&check.stderr).contains(message));
    gateway.signal("HUP");
    eventually(Duration::from_secs(5), "the refusal", || async {
        gateway.metric("oipgate_config_reloads_total{result=\"error\"}").await >= 1.0
    })
    .await;
    assert!(
        gateway.log_lines().iter().any(|line| line.contains(message)),
        "the log names the problem as check-config does"
    );
    assert_eq!(send(&client, "POST", &url, &[], BODY).await.status, 200);
}

#[tokio::test]
async fn sigterm_turns_readiness_off_at_once_lets_requests_finish_and_exits_zero() {
    let a = replica("a");
    let mut gateway = GatewayProcess::start(&format!(
        r#"
        [shutdown]
        grace_period_ms = 10000
        drain_delay_ms = 600
        [[backends]]
        name = "a"
        protocol = "rest"
        endpoints = ["{}"]
        [[models]]
        name = "slow"
        versions = [ {{ version = "1", backend = "a" }} ]
        "#,
        a.rest.unwrap()
    ));
    assert_eq!(get(&gateway.rest_url("/v2/health/ready")).await.status, 200);
    let url = gateway.rest_url("/v2/models/slow/infer");
    let slow = tokio::spawn(async move {
        let body =
            r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}],"parameters":{"delay_ms":1500}}"#;
        send(&http_client(false), "POST", &url, &[], body).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let signalled = Instant::now();
    gateway.signal("TERM");
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Within the drain delay: still accepting, but not ready.
    let ready = get(&gateway.rest_url("/v2/health/ready")).await;
    assert_eq!(ready.status, 503);
    assert_eq!(get(&gateway.rest_url("/v2/health/live")).await.status, 200);
    let mut grpc = gateway.grpc_client().await;
    let ready = grpc
        .server_ready(oipgate::proto::ServerReadyRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!ready.ready);
    // After it the listeners are closed.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        std::net::TcpStream::connect(gateway.rest).is_err(),
        "REST stopped accepting"
    );
    let answer = slow.await.unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    let status = gateway.wait_exit(Duration::from_secs(5)).expect("exits once drained");
    assert!(status.success(), "{status:?}");
    assert!(
        signalled.elapsed() < Duration::from_secs(6),
        "exit came when the last request finished, not at the end of the grace period"
    );
}

#[tokio::test]
async fn sigint_with_nothing_under_way_exits_zero_at_once() {
    let a = replica("a");
    let mut gateway = GatewayProcess::start(&format!(
        r#"
        [[backends]]
        name = "a"
        protocol = "rest"
        endpoints = ["{}"]
        [[models]]
        name = "identity"
        versions = [ {{ version = "1", backend = "a" }} ]
        "#,
        a.rest.unwrap()
    ));
    gateway.signal("INT");
    let status = gateway.wait_exit(Duration::from_secs(3)).expect("exits");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn every_request_gets_one_json_access_log_line_and_translation_is_timed() {
    let a = replica("a");
    let b = replica("b");
    let gateway = GatewayProcess::start_with(
        &format!(
            r#"
            [[backends]]
            name = "rest-a"
            protocol = "rest"
            endpoints = ["{}"]
            [[backends]]
            name = "grpc-b"
            protocol = "grpc"
            endpoints = ["{}"]
            [[models]]
            name = "identity"
            versions = [ {{ version = "1", backend = "rest-a" }}, {{ version = "2", backend = "grpc-b", upstream_version = "1" }} ]
            default_version = "1"
            "#,
            a.rest.unwrap(),
            b.grpc.unwrap()
        ),
        &["--log-format", "json"],
        true,
    );
    let client = http_client(false);
    let passthrough = send(
        &client,
        "POST",
        &gateway.rest_url("/v2/models/identity/versions/1/infer"),
        &[("x-request-id", "req-pass".to_owned())],
        BODY,
    )
    .await;
    assert_eq!(passthrough.status, 200);
    let translated = send(
        &client,
        "POST",
        &gateway.rest_url("/v2/models/identity/versions/2/infer"),
        &[("x-request-id", "req-trans".to_owned())],
        BODY,
    )
    .await;
    assert_eq!(translated.status, 200);
    let unknown = send(&client, "POST", &gateway.rest_url("/v2/models/nope/infer"), &[], BODY).await;
    assert_eq!(unknown.status, 404);
    assert_eq!(get(&gateway.rest_url("/v2/health/live")).await.status, 200);
    let mut grpc = gateway.grpc_client().await;
    let mut request = tonic::Request::new(common::grpc_int32_request("identity", ""));
    request
        .metadata_mut()
        .insert("x-request-id", "req-grpc".parse().unwrap());
    grpc.model_infer(request).await.unwrap();

    let mut lines: Vec<serde_json::Value> = Vec::new();
    eventually(Duration::from_secs(3), "five access-log lines", || {
        lines = gateway
            .log_lines()
            .iter()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|line| line["target"] == "oipgate::access")
            .collect();
        std::future::ready(lines.len() >= 5)
    })
    .await;
    assert_eq!(lines.len(), 5, "{lines:#?}");
    let by_id: HashMap<String, &serde_json::Value> = lines
        .iter()
        .map(|line| (line["request_id"].as_str().unwrap().to_owned(), line))
        .collect();
    let pass = by_id["req-pass"];
    assert_eq!(pass["protocol"], "rest");
    assert_eq!(pass["model"], "identity");
    assert_eq!(pass["version"], "1");
    assert_eq!(pass["backend"], "rest-a");
    assert_eq!(pass["endpoint"], a.rest.unwrap().to_string());
    assert_eq!(pass["status"], 200);
    assert_eq!(pass["translated"], false);
    assert!(pass["bytes_in"].as_u64().unwrap() == BODY.len() as u64);
    assert!(pass["bytes_out"].as_u64().unwrap() > 0);
    assert!(pass["duration_ms"].as_f64().unwrap() > 0.0);
    let trans = by_id["req-trans"];
    assert_eq!(trans["backend"], "grpc-b");
    assert_eq!(trans["endpoint"], b.grpc.unwrap().to_string());
    assert_eq!(trans["translated"], true);
    let via_grpc = by_id["req-grpc"];
    assert_eq!(via_grpc["protocol"], "grpc");
    assert_eq!(via_grpc["backend"], "rest-a");
    assert_eq!(via_grpc["translated"], true);
    assert!(lines.iter().any(|l| l["status"] == 404 && l["model"] == "_unknown"));
    assert!(
        lines
            .iter()
            .any(|l| l["path"] == "/v2/health/live" && l["model"] == "-")
    );

    let metrics = gateway.metrics().await;
    for direction in ["rest_to_grpc", "grpc_to_rest"] {
        let count = format!("oipgate_translation_duration_seconds_count{{direction=\"{direction}\"}}");
        assert!(
            gateway.metric(&count).await >= 2.0,
            "{direction} counted twice: {metrics}"
        );
    }
    for family in [
        "oipgate_requests_total",
        "oipgate_request_duration_seconds",
        "oipgate_upstream_duration_seconds",
        "oipgate_translation_duration_seconds",
        "oipgate_in_flight",
        "oipgate_request_bytes_total",
        "oipgate_response_bytes_total",
        "oipgate_endpoint_healthy",
        "oipgate_retries_total",
        "oipgate_mirror_requests_total",
        "oipgate_config_reloads_total",
        "oipgate_build_info",
    ] {
        assert!(metrics.contains(&format!("# TYPE {family} ")), "{family} missing");
    }
}
