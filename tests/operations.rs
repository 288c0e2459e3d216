//! Operating `oipgate serve`: configuration rewritten under load (file watch and SIGHUP) without a failed request,
//! state kept across reloads, an invalid file refused, graceful shutdown on SIGTERM / SIGINT, access logs and the
//! operations metrics.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::config::{backend, model};
use common::ports::dead_endpoint;
use common::{
    GatewayProcess, INT32_BODY as BODY, Load, ModelServerProcess, eventually, get, grpc_ready, http_client, post, send,
};

/// The configuration of step `step` of the rewrite sequence: weights that move, a model added and removed, a backend
/// removed and brought back.
fn step_config(a: &ModelServerProcess, b: &ModelServerProcess, step: usize) -> String {
    let weight_a = [90, 50, 10, 70, 30][step % 5];
    let with_b = step % 7 != 3;
    let with_echo = step % 4 >= 2;
    let mut config = format!(
        "[reload]\nwatch_interval_ms = 50\n{}binary_data = true\n",
        backend("a", "rest", [a.rest.unwrap()])
    );
    if with_b {
        config += &backend("b", "grpc", [b.grpc.unwrap()]);
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
    let a = ModelServerProcess::named("a");
    let b = ModelServerProcess::named("b");
    let gateway = GatewayProcess::start(&step_config(&a, &b, 0));
    let mut load = Load::default();
    for worker in 0..4 {
        if worker < 2 {
            load.rest_worker(
                http_client(worker % 2 == 0),
                gateway.rest_url("/v2/models/identity/infer"),
                BODY,
            );
        } else {
            load.grpc_identity_worker(gateway.grpc_client().await);
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
            eventually(Duration::from_secs(10), "the invalid file to be refused", || async {
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
            eventually(Duration::from_secs(10), "the rewrite to be applied", || async {
                reloads("ok").await >= target
            })
            .await;
        }
        // The new configuration serves what it names: `echo` exactly while it is configured. (A step that also sent
        // SIGHUP may have been counted twice, so the count can run ahead of the file by one step: the answer is
        // what tells that this step's file is the one served.)
        let with_echo = step != 11 && step % 4 >= 2 || step == 11 && 10 % 4 >= 2;
        let expected = if with_echo { 200 } else { 404 };
        eventually(
            Duration::from_secs(10),
            &format!("step {step} to be served"),
            || async {
                let answer = post(&gateway.rest_url("/v2/models/echo/infer"), BODY).await;
                answer.status == expected
            },
        )
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
    let a = ModelServerProcess::named("a");
    let dead = dead_endpoint();
    let config = |weight_note: &str| {
        format!(
            r#"
            [reload]
            watch = false
            {}
            retries = 1
            outlier = {{ consecutive_failures = 1, base_ejection_ms = 60000 }}
            {}
            # {weight_note}
            "#,
            backend("pair", "rest", [a.rest.unwrap().to_string(), dead.to_string()]),
            model("identity", "pair"),
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
    eventually(Duration::from_secs(10), "the reload", || async {
        gateway
            .metric_if_present("oipgate_config_reloads_total{result=\"ok\"}")
            .await
            .is_some_and(|value| value >= 1.0)
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
    let check = common::check_config(&gateway.config_path());
    assert!(!check.status.success());
    let message = "models[0].versions[0].backend: no backend named \"missing\"";
    assert!(String::from_utf8_lossy(&check.stderr).contains(message));
    gateway.signal("HUP");
    eventually(Duration::from_secs(10), "the refusal", || async {
        gateway
            .metric_if_present("oipgate_config_reloads_total{result=\"error\"}")
            .await
            .is_some_and(|value| value >= 1.0)
    })
    .await;
    // The log line is read from the gateway's stderr by a thread of its own, maybe after the metric counts it.
    eventually(
        Duration::from_secs(5),
        "the log to name the problem as check-config does",
        || async { gateway.log_lines().iter().any(|line| line.contains(message)) },
    )
    .await;
    assert_eq!(send(&client, "POST", &url, &[], BODY).await.status, 200);
}

#[tokio::test]
async fn sigterm_turns_readiness_off_at_once_lets_requests_finish_and_exits_zero() {
    let a = ModelServerProcess::named("a");
    // A drain delay of eight seconds and a grace period of a minute: what happens within each is told apart by
    // events (readiness, a refused connection, the exit), with room to spare on a loaded machine. The three checks
    // made within the drain delay take milliseconds; the slow call outlives the delay, so the listeners close while
    // it runs.
    let mut gateway = GatewayProcess::start(&format!(
        "[shutdown]\ngrace_period_ms = 60000\ndrain_delay_ms = 8000\n{}{}",
        backend("a", "rest", [a.rest.unwrap()]),
        model("slow", "a")
    ));
    assert_eq!(get(&gateway.rest_url("/v2/health/ready")).await.status, 200);
    let url = gateway.rest_url("/v2/models/slow/infer");
    let slow = tokio::spawn(async move {
        let body =
            r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}],"parameters":{"delay_ms":10000}}"#;
        post(&url, body).await
    });
    eventually(Duration::from_secs(10), "the slow call under way", || async {
        gateway.metric_if_present(r#"oipgate_in_flight{backend="a"}"#).await == Some(1.0)
    })
    .await;
    let signalled = Instant::now();
    gateway.signal("TERM");
    // Within the drain delay: not ready, but still accepting (this very check connects). After the delay the
    // listener closes, and readiness cannot be asked.
    eventually(Duration::from_secs(8), "readiness off", || async {
        get(&gateway.rest_url("/v2/health/ready")).await.status == 503
    })
    .await;
    assert_eq!(get(&gateway.rest_url("/v2/health/live")).await.status, 200);
    assert!(!grpc_ready(&mut gateway.grpc_client().await).await);
    // After it the listeners are closed.
    eventually(Duration::from_secs(20), "REST to stop accepting", || async {
        std::net::TcpStream::connect(gateway.rest).is_err()
    })
    .await;
    let answer = slow.await.unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    let status = gateway.wait_exit(Duration::from_secs(50)).expect("exits once drained");
    assert!(status.success(), "{status:?}");
    // The slow call ends about ten seconds after the signal; the grace period, a minute after it.
    assert!(
        signalled.elapsed() < Duration::from_secs(40),
        "exit came when the last request finished, not at the end of the grace period"
    );
}

#[tokio::test]
async fn connections_that_may_still_bring_a_request_at_shutdown_get_it_answered() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let a = ModelServerProcess::named("a");
    let mut gateway = GatewayProcess::start(&format!(
        "[shutdown]\ngrace_period_ms = 10000\ndrain_delay_ms = 0\n{}{}",
        backend("a", "rest", [a.rest.unwrap()]),
        model("identity", "a")
    ));
    let request = format!(
        "POST /v2/models/identity/infer HTTP/1.1\r\nhost: gateway\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    async fn answer(connection: &mut tokio::net::TcpStream, request: &str, whole: bool) -> String {
        connection.write_all(request.as_bytes()).await.unwrap();
        let mut read = Vec::new();
        let mut buffer = [0u8; 4096];
        // Until the connection closes, or (for a kept one) the answer's end.
        while let Ok(count @ 1..) = connection.read(&mut buffer).await {
            read.extend_from_slice(&buffer[..count]);
            if !whole && read.ends_with(b"}") {
                break;
            }
        }
        String::from_utf8_lossy(&read).into_owned()
    }
    // One connection accepted whose first request has not come yet, one kept after a request and quiet since (it
    // waits idle), and one kept after a request just answered (it waits in the state its requests are served in).
    let mut fresh = tokio::net::TcpStream::connect(gateway.rest).await.unwrap();
    let mut quiet = tokio::net::TcpStream::connect(gateway.rest).await.unwrap();
    let mut kept = tokio::net::TcpStream::connect(gateway.rest).await.unwrap();
    assert!(answer(&mut quiet, &request, false).await.starts_with("HTTP/1.1 200"));
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert!(answer(&mut kept, &request, false).await.starts_with("HTTP/1.1 200"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    gateway.signal("TERM");
    // Nothing is under way, but each connection may be carrying a request the client already sent: the process
    // answers it (and says the connection closes) before it exits.
    tokio::time::sleep(Duration::from_millis(150)).await;
    for connection in [&mut fresh, &mut quiet, &mut kept] {
        let answered = answer(connection, &request, true).await;
        assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
        assert!(answered.contains("connection: close"), "{answered}");
    }
    let status = gateway.wait_exit(Duration::from_secs(5)).expect("exits once drained");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn sigint_with_nothing_under_way_exits_zero_at_once() {
    let a = ModelServerProcess::named("a");
    let mut gateway = GatewayProcess::start(&format!(
        "{}{}",
        backend("a", "rest", [a.rest.unwrap()]),
        model("identity", "a")
    ));
    gateway.signal("INT");
    let status = gateway.wait_exit(Duration::from_secs(3)).expect("exits");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn every_request_gets_one_json_access_log_line_and_translation_is_timed() {
    let a = ModelServerProcess::named("a");
    let b = ModelServerProcess::named("b");
    let gateway = GatewayProcess::start_with(
        &format!(
            r#"
            {}
            {}
            [[models]]
            name = "identity"
            versions = [ {{ version = "1", backend = "rest-a" }}, {{ version = "2", backend = "grpc-b", upstream_version = "1" }} ]
            default_version = "1"
            [[models]]
            name = "add_sub"
            versions = [ {{ version = "1", backend = "grpc-b" }} ]
            "#,
            backend("rest-a", "rest", [a.rest.unwrap()]),
            backend("grpc-b", "grpc", [b.grpc.unwrap()]),
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
    // A generate call, translated onto the gRPC backend's inference stream.
    let ones = serde_json::json!({ "INPUT0": vec![1; 16], "INPUT1": vec![1; 16] }).to_string();
    let generated = send(
        &client,
        "POST",
        &gateway.rest_url("/v2/models/add_sub/generate"),
        &[("x-request-id", "req-generate".to_owned())],
        ones,
    )
    .await;
    assert_eq!(generated.status, 200);

    let mut lines: Vec<serde_json::Value> = Vec::new();
    eventually(Duration::from_secs(10), "six access-log lines", || {
        lines = gateway
            .log_lines()
            .iter()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|line| line["target"] == "oipgate::access")
            .collect();
        std::future::ready(lines.len() >= 6)
    })
    .await;
    assert_eq!(lines.len(), 6, "{lines:#?}");
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
    let generate = by_id["req-generate"];
    assert_eq!(generate["backend"], "grpc-b");
    assert_eq!(generate["status"], 200);
    assert_eq!(generate["translated"], true);
    assert_eq!(generate["endpoint"], b.grpc.unwrap().to_string());
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
            gateway
                .metric_if_present(&count)
                .await
                .is_some_and(|value| value >= 2.0),
            "{direction} counted twice: {metrics}"
        );
    }
    // Every family these requests used; those of series made at first use that they did not (retries, mirrors)
    // are exposed once used.
    for family in [
        "oipgate_requests_total",
        "oipgate_request_duration_seconds",
        "oipgate_upstream_duration_seconds",
        "oipgate_translation_duration_seconds",
        "oipgate_in_flight",
        "oipgate_request_bytes_total",
        "oipgate_response_bytes_total",
        "oipgate_endpoint_healthy",
        "oipgate_config_reloads_total",
        "oipgate_build_info",
    ] {
        assert!(metrics.contains(&format!("# TYPE {family} ")), "{family} missing");
    }
}

#[tokio::test]
async fn request_series_are_made_at_first_use_bounded_by_max_series_and_kept_across_reloads_that_keep_their_model() {
    let a = ModelServerProcess::named("a");
    let config = |max_series: usize, models: &[&str]| {
        let mut config = format!(
            "[reload]\nwatch = false\n[metrics]\nmax_series = {max_series}\n{}",
            backend("a", "rest", [a.rest.unwrap()])
        );
        for name in models {
            config += &format!(
                "[[models]]\nname = \"{name}\"\nversions = [ {{ version = \"1\", backend = \"a\", upstream_name = \"identity\" }} ]\n"
            );
        }
        config
    };
    let series = |model: &str| {
        format!(
            "oipgate_requests_total{{backend=\"a\",code=\"200\",model=\"{model}\",principal=\"_other\",protocol=\"rest\",version=\"1\"}}"
        )
    };
    let other = "oipgate_requests_total{backend=\"_other\",code=\"200\",model=\"_other\",principal=\"_other\",\
                 protocol=\"rest\",version=\"_other\"}";
    let dropped = "oipgate_metrics_series_dropped_total{metric=\"oipgate_requests_total\"}";
    let gateway = GatewayProcess::start(&config(3, &["m0", "m1", "m2", "m3", "m4"]));
    let client = http_client(false);
    let infer = |model: &str| {
        let (client, url) = (client.clone(), gateway.rest_url(&format!("/v2/models/{model}/infer")));
        async move { assert_eq!(send(&client, "POST", &url, &[], BODY).await.status, 200) }
    };

    // Nothing is made up front: no request series, no backend series.
    let before = gateway.metrics().await;
    assert!(!before.contains("oipgate_requests_total{"), "{before}");
    assert!(!before.contains("oipgate_upstream_duration_seconds_count{"), "{before}");
    infer("m0").await;
    let after = gateway.metrics().await;
    assert!(after.contains(&format!("{} 1", series("m0"))), "{after}");
    assert!(!after.contains("model=\"m1\""), "{after}");

    // Past three series, a model's requests are counted under _other, and the series not made is counted once.
    infer("m1").await;
    infer("m2").await;
    infer("m3").await;
    infer("m3").await;
    assert!(
        !gateway.metrics().await.contains(&series("m3")),
        "past the bound, m3 has no series of its own"
    );
    assert_eq!(gateway.metric(other).await, 2.0);
    assert_eq!(gateway.metric(dropped).await, 1.0);

    // A reload that keeps m0 keeps its count; a larger bound lets m3 have its own series from now on.
    gateway.rewrite(&config(10, &["m0", "m3"]));
    gateway.signal("HUP");
    eventually(Duration::from_secs(10), "the reload", || async {
        gateway
            .metric_if_present("oipgate_config_reloads_total{result=\"ok\"}")
            .await
            .is_some_and(|value| value >= 1.0)
    })
    .await;
    infer("m0").await;
    infer("m3").await;
    assert_eq!(gateway.metric(&series("m0")).await, 2.0);
    assert_eq!(gateway.metric(&series("m3")).await, 1.0);
    assert_eq!(gateway.metric(other).await, 2.0);
    // The series of models the reload removed are gone with them, and no longer count against the bound.
    let after = gateway.metrics().await;
    assert!(
        !after.contains("model=\"m1\"") && !after.contains("model=\"m2\""),
        "{after}"
    );
}

/// `count` identity requests over REST, eight at a time, with request ids `{prefix}{i}`; every one answered 200.
async fn identity_requests(gateway: &GatewayProcess, prefix: &str, count: usize) {
    let url = gateway.rest_url("/v2/models/identity/infer");
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let (url, prefix) = (url.clone(), prefix.to_owned());
            tokio::spawn(async move {
                let client = http_client(false);
                for i in (task..count).step_by(8) {
                    let answer = send(&client, "POST", &url, &[("x-request-id", format!("{prefix}{i}"))], BODY).await;
                    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
}

/// The request ids of the access-log lines in `text`.
fn logged_request_ids(text: &str) -> Vec<String> {
    text.lines()
        .filter(|line| line.contains(" oipgate::access: request "))
        .filter_map(|line| line.split(" request_id=").nth(1)?.split(' ').next().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_access_line_of_a_load_is_in_the_log_file_after_sigterm_and_none_dropped() {
    let a = ModelServerProcess::named("a");
    let dir = common::unique_temp_dir("oipgate-access-log");
    let file = dir.join("access.log");
    let mut gateway = GatewayProcess::start_with(
        &format!("{}{}", backend("a", "rest", [a.rest.unwrap()]), model("identity", "a")),
        &["--log-file", file.to_str().unwrap()],
        false,
    );
    identity_requests(&gateway, "r", 3000).await;
    assert_eq!(gateway.metric("oipgate_access_log_dropped_total").await, 0.0);
    // The signal comes at once: lines still in the writer's batch are written by the drain.
    gateway.signal("TERM");
    let status = gateway.wait_exit(Duration::from_secs(60)).expect("exits once drained");
    assert!(status.success(), "{status:?}");
    let text = std::fs::read_to_string(&file).unwrap();
    let mut ids = logged_request_ids(&text);
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3000, "every request's line, once");
    assert!(text.contains("drained; exiting"), "the drain's own line is there too");
    // The text format's layout, field by field, as before the log was batched.
    let line = text.lines().find(|line| line.contains("request_id=r0 ")).unwrap();
    let (timestamp, rest) = line.split_once("  INFO oipgate::access: request ").unwrap();
    assert_eq!(timestamp.len(), "2026-11-26T18:58:22.832041Z".len(), "{line}");
    assert!(timestamp.ends_with('Z') && timestamp.as_bytes()[10] == b'T', "{line}");
    let names: Vec<&str> = rest
        .split(' ')
        .filter_map(|field| field.split_once('=').map(|(name, _)| name))
        .collect();
    assert_eq!(
        names,
        [
            "request_id",
            "protocol",
            "path",
            "model",
            "version",
            "backend",
            "endpoint",
            "status",
            "bytes_in",
            "bytes_out",
            "duration_ms",
            "translated",
            "principal"
        ],
        "{line}"
    );
    let expected = format!(
        "request_id=r0 protocol=\"rest\" path=\"/v2/models/identity/infer\" model=identity version=1 backend=a \
         endpoint={} status=200 bytes_in={} ",
        a.rest.unwrap(),
        BODY.len()
    );
    assert!(rest.starts_with(&expected), "{line}");
}

#[tokio::test]
async fn sigusr1_and_sighup_reopen_the_log_file_a_rotation_moved() {
    let a = ModelServerProcess::named("a");
    let dir = common::unique_temp_dir("oipgate-rotate");
    let file = dir.join("access.log");
    let gateway = GatewayProcess::start_with(
        &format!("{}{}", backend("a", "rest", [a.rest.unwrap()]), model("identity", "a")),
        &["--log-file", file.to_str().unwrap()],
        false,
    );
    let read = |path: &std::path::Path| std::fs::read_to_string(path).unwrap_or_default();
    let rounds = [("a-", Some("USR1")), ("b-", Some("HUP")), ("c-", None)];
    for (round, (prefix, signal)) in rounds.into_iter().enumerate() {
        identity_requests(&gateway, prefix, 40).await;
        eventually(Duration::from_secs(10), "the round's lines written", || {
            std::future::ready(logged_request_ids(&read(&file)).len() == 40)
        })
        .await;
        if let Some(signal) = signal {
            std::fs::rename(&file, dir.join(format!("access.log.{round}"))).unwrap();
            gateway.signal(signal);
            // The signal's own line comes first to the new file.
            eventually(Duration::from_secs(10), "the file made again", || {
                std::future::ready(file.exists())
            })
            .await;
        }
    }
    for (path, prefix) in [
        (dir.join("access.log.0"), "a-"),
        (dir.join("access.log.1"), "b-"),
        (file, "c-"),
    ] {
        let ids = logged_request_ids(&read(&path));
        assert_eq!(ids.len(), 40, "{}", path.display());
        assert!(
            ids.iter().all(|id| id.starts_with(prefix)),
            "{}: {ids:?}",
            path.display()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_log_sink_that_stops_reading_drops_counted_lines_and_holds_back_no_request() {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let a = ModelServerProcess::named("a");
    let dir = common::unique_temp_dir("oipgate-stalled-log");
    let fifo = dir.join("log.fifo");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    // The reader is open (so the gateway's open does not wait) but reads nothing until every request is answered.
    let mut reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    let gateway = GatewayProcess::start_with(
        &format!("{}{}", backend("a", "rest", [a.rest.unwrap()]), model("identity", "a")),
        &["--log-file", fifo.to_str().unwrap(), "--log-buffer-bytes", "16384"],
        false,
    );
    const REQUESTS: usize = 2000;
    identity_requests(&gateway, "r", REQUESTS).await;
    let dropped: usize = format!("{}", gateway.metric("oipgate_access_log_dropped_total").await)
        .parse()
        .expect("a whole count");
    // The pipe holds 64 KiB and the batch 16 KiB, some 250 lines of the 2000 between them.
    assert!(dropped > REQUESTS / 2, "dropped {dropped}");
    let mut text = Vec::new();
    let mut chunk = vec![0u8; 1 << 16];
    eventually(Duration::from_secs(20), "every line not dropped", || {
        loop {
            match reader.read(&mut chunk) {
                Ok(0) => break,
                Ok(read) => text.extend_from_slice(&chunk[..read]),
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(error) => panic!("{error}"),
            }
        }
        std::future::ready(logged_request_ids(&String::from_utf8_lossy(&text)).len() + dropped >= REQUESTS)
    })
    .await;
    let mut ids = logged_request_ids(&String::from_utf8_lossy(&text));
    let written = ids.len();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), written, "no line twice");
    assert_eq!(
        written + dropped,
        REQUESTS,
        "each line written or counted, none lost unaccounted"
    );
    // Every line kept is whole.
    let text = String::from_utf8(text).unwrap();
    assert!(
        text.lines()
            .filter(|line| line.contains("oipgate::access"))
            .all(|line| line.ends_with("principal=-"))
    );
}
