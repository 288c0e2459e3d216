//! Replicas through `oipgate serve`: failover when a replica dies and comes back, traffic kept from a replica whose
//! model is unloaded, admission limits, and immediate refusal when nothing can serve.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::config::{backend, model};
use common::ports::{dead_endpoint, hold_port};
use common::{GatewayProcess, INT32_BODY as BODY, ModelServerProcess, get, http_client, post, send};
use futures_util::StreamExt;
use oipgate::proto::RepositoryIndexRequest;

/// Sends `count` identity requests, 8 at a time, over `path`; gives how many each replica answered (by name), with
/// `failed` for those that did not get a 200.
async fn spread(gateway: &GatewayProcess, path: &str, count: usize) -> HashMap<String, usize> {
    let client = http_client(false);
    let url = gateway.rest_url(path);
    let answers: Vec<String> = futures_util::stream::iter(0..count)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let answer = send(&client, "POST", &url, &[("x-echo-probe", "1".to_owned())], BODY).await;
                if answer.status == 200 {
                    answer.header("x-echo-server").unwrap_or("unnamed").to_owned()
                } else {
                    format!("failed {} {}", answer.status, String::from_utf8_lossy(&answer.body))
                }
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let mut counts = HashMap::new();
    for answer in answers {
        *counts.entry(answer).or_insert(0) += 1;
    }
    counts
}

#[tokio::test]
async fn a_dead_replica_loses_no_request_is_ejected_and_comes_back() {
    // Replica b is stopped and started again on the same ports, which are held for it meanwhile.
    let (b_rest, b_grpc) = (hold_port(), hold_port());
    let start_b = || ModelServerProcess::named_at("b", b_rest.address(), Some(b_grpc.address()));
    let a = ModelServerProcess::named("a");
    let mut b = Some(start_b());
    let (a_rest, a_grpc) = (a.rest.unwrap(), a.grpc.unwrap());
    let health = "health = { interval_ms = 100, timeout_ms = 300, unhealthy_after = 1, healthy_after = 1 }\n";
    let gateway = GatewayProcess::start(&format!(
        r#"
        {}{health}
        {}{health}
        [[models]]
        name = "identity"
        versions = [ {{ version = "1", backend = "rest-fleet" }},
                     {{ version = "2", backend = "grpc-fleet", upstream_version = "1" }} ]
        default_version = "1"
        {}
        "#,
        backend("rest-fleet", "rest", [a_rest, b_rest.address()]),
        backend("grpc-fleet", "grpc", [a_grpc, b_grpc.address()]),
        model("flaky", "rest-fleet"),
    ));
    let paths = [
        "/v2/models/identity/versions/1/infer",
        "/v2/models/identity/versions/2/infer",
    ];
    for path in paths {
        let counts = spread(&gateway, path, 40).await;
        assert_eq!(
            (counts.get("a"), counts.get("b")),
            (Some(&20), Some(&20)),
            "{path}: {counts:?}"
        );
    }

    // Killed under load: requests that found it gone are retried on the other replica.
    let load = {
        let gateway_rest = gateway.rest;
        tokio::spawn(async move {
            let client = http_client(false);
            let mut failures = Vec::new();
            let start = Instant::now();
            while start.elapsed() < Duration::from_millis(1500) {
                for version in ["1", "2"] {
                    let url = format!("http://{gateway_rest}/v2/models/identity/versions/{version}/infer");
                    let answer = send(&client, "POST", &url, &[], BODY).await;
                    if answer.status != 200 {
                        failures.push((
                            version,
                            answer.status,
                            String::from_utf8_lossy(&answer.body).into_owned(),
                        ));
                    }
                }
            }
            failures
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(b.take());
    let failures = load.await.unwrap();
    // The load sends one request at a time: only the one under way at the kill may be lost; every later request
    // that found the replica gone was sent to the other.
    assert!(failures.len() <= 1, "{failures:?}");
    for path in paths {
        let counts = spread(&gateway, path, 20).await;
        assert_eq!(
            counts.get("a"),
            Some(&20),
            "{path}: the dead replica gets nothing: {counts:?}"
        );
    }

    let healthy = |backend: &str, endpoint: std::net::SocketAddr| {
        format!("oipgate_endpoint_healthy{{backend=\"{backend}\",endpoint=\"{endpoint}\"}}")
    };
    assert_eq!(gateway.metric(&healthy("rest-fleet", b_rest.address())).await, 0.0);
    assert_eq!(gateway.metric(&healthy("grpc-fleet", b_grpc.address())).await, 0.0);
    assert_eq!(gateway.metric(&healthy("rest-fleet", a_rest)).await, 1.0);

    // Restarted on the same ports, it is probed healthy and gets traffic again.
    let _b = start_b();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(gateway.metric(&healthy("rest-fleet", b_rest.address())).await, 1.0);
    assert_eq!(gateway.metric(&healthy("grpc-fleet", b_grpc.address())).await, 1.0);
    for path in paths {
        let counts = spread(&gateway, path, 40).await;
        assert!(counts.get("b").is_some_and(|&n| n >= 10), "{path}: {counts:?}");
        assert_eq!(counts.values().sum::<usize>(), 40);
    }

    // A replica whose model is unloaded stops getting that model's traffic.
    let unload = post(&a.rest_url("/v2/repository/models/identity/unload"), "").await;
    assert_eq!(unload.status, 200);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let counts = spread(&gateway, paths[0], 30).await;
    assert_eq!(counts.get("b"), Some(&30), "{counts:?}");
    // Its other models keep both replicas, though a strict-readiness server reports itself not ready.
    let others = spread(&gateway, "/v2/models/flaky/infer", 30).await;
    assert_eq!((others.get("a"), others.get("b")), (Some(&15), Some(&15)), "{others:?}");
    assert_eq!(index(&gateway).await[0], entry("identity", "1", "READY", ""));

    // Unloaded on both replicas, the repository index says so, with the reason, on both front doors.
    let unload = post(
        &format!("http://{}/v2/repository/models/identity/unload", b_rest.address()),
        "",
    )
    .await;
    assert_eq!(unload.status, 200);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let rest_index = index(&gateway).await;
    assert_eq!(
        rest_index,
        [
            entry(
                "identity",
                "1",
                "UNAVAILABLE",
                "backend rest-fleet: of 2 endpoints, 2 without the model ready"
            ),
            entry(
                "identity",
                "2",
                "UNAVAILABLE",
                "backend grpc-fleet: of 2 endpoints, 2 without the model ready"
            ),
            entry("flaky", "1", "READY", ""),
        ]
    );
    let grpc_index = gateway
        .grpc_client()
        .await
        .repository_index(RepositoryIndexRequest::default())
        .await
        .unwrap()
        .into_inner();
    let grpc_listed: Vec<_> = grpc_index
        .models
        .iter()
        .map(|m| entry(&m.name, &m.version, &m.state, &m.reason))
        .collect();
    assert_eq!(grpc_listed, rest_index);
    let ready_only = gateway
        .grpc_client()
        .await
        .repository_index(RepositoryIndexRequest {
            ready: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ready_only.models.len(), 1, "{ready_only:?}");
    assert_eq!(ready_only.models[0].name, "flaky");
    let ready = get(&gateway.rest_url("/v2/health/ready")).await;
    assert_eq!(ready.status, 503);
}

type IndexEntry = (String, String, String, String);

fn entry(name: &str, version: &str, state: &str, reason: &str) -> IndexEntry {
    (name.to_owned(), version.to_owned(), state.to_owned(), reason.to_owned())
}

/// The gateway's repository index as (name, version, state, reason).
async fn index(gateway: &GatewayProcess) -> Vec<IndexEntry> {
    let answer = post(&gateway.rest_url("/v2/repository/index"), "").await;
    assert_eq!(answer.status, 200);
    let text = |value: &serde_json::Value| value.as_str().unwrap().to_owned();
    answer
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                text(&e["name"]),
                text(&e["version"]),
                text(&e["state"]),
                text(&e["reason"]),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_call_that_cannot_reach_an_endpoint_is_retried_on_another_and_counted() {
    let live = ModelServerProcess::both();
    let (dead_rest, dead_grpc) = (dead_endpoint(), dead_endpoint());
    // No health checks: only the calls themselves find the dead endpoints.
    let gateway = GatewayProcess::start(&format!(
        r#"
        {}
        {}
        [[models]]
        name = "identity"
        versions = [ {{ version = "1", backend = "rest-pair" }},
                     {{ version = "2", backend = "grpc-pair", upstream_version = "1" }} ]
        default_version = "1"
        "#,
        backend("rest-pair", "rest", [dead_rest.address(), live.rest.unwrap()]),
        backend("grpc-pair", "grpc", [dead_grpc.address(), live.grpc.unwrap()]),
    ));
    let retries = |backend: &str| format!("oipgate_retries_total{{backend=\"{backend}\"}}");
    assert_eq!(gateway.metric(&retries("rest-pair")).await, 0.0);
    // REST passthrough, REST translated to gRPC, and gRPC passthrough: round robin sends the first or second call of
    // each to the dead endpoint, which refuses the connection before anything is sent, so it is retried.
    for version in ["1", "2"] {
        for _ in 0..4 {
            let answer = post(
                &gateway.rest_url(&format!("/v2/models/identity/versions/{version}/infer")),
                BODY,
            )
            .await;
            assert_eq!(answer.status, 200, "{:?}", answer.body);
        }
    }
    let mut client = gateway.grpc_client().await;
    for _ in 0..4 {
        client
            .model_infer(common::grpc_int32_request("identity", "2"))
            .await
            .unwrap();
    }
    let rest_retries = gateway.metric(&retries("rest-pair")).await;
    let grpc_retries = gateway.metric(&retries("grpc-pair")).await;
    assert!((1.0..=4.0).contains(&rest_retries), "{rest_retries}");
    assert!((2.0..=8.0).contains(&grpc_retries), "{grpc_retries}");
}

#[tokio::test]
async fn least_request_sends_less_to_a_slow_replica_than_round_robin() {
    let fast = ModelServerProcess::grpc_only(&["--name", "fast"]);
    let slow = ModelServerProcess::grpc_only(&["--name", "slow", "--slow-delay-ms", "40"]);
    let endpoints = format!(r#"["{}", "{}"]"#, fast.grpc.unwrap(), slow.grpc.unwrap());
    let gateway = GatewayProcess::start(&format!(
        r#"
        [[backends]]
        name = "least"
        protocol = "grpc"
        endpoints = {endpoints}
        lb = "least_request"
        [[backends]]
        name = "rotating"
        protocol = "grpc"
        endpoints = {endpoints}
        lb = "round_robin"
        [[models]]
        name = "slow"
        versions = [ {{ version = "least", backend = "least", upstream_version = "1" }},
                     {{ version = "rotating", backend = "rotating", upstream_version = "1" }} ]
        default_version = "least"
        "#
    ));
    let share_of_slow = |counts: &HashMap<String, usize>| {
        let total: usize = counts.values().sum();
        assert_eq!(total, 400, "{counts:?}");
        #[allow(clippy::cast_precision_loss)]
        let share = *counts.get("slow").unwrap_or(&0) as f64 / total as f64;
        share
    };
    let rotating = share_of_slow(&spread(&gateway, "/v2/models/slow/versions/rotating/infer", 400).await);
    assert!((0.45..=0.55).contains(&rotating), "round robin: {rotating}");
    // Eight calls at a time: the slow replica holds its calls 40 ms, so it nearly always has more under way than the
    // fast one, and power of two choices picks the fast one (about a fifth of the calls on an idle machine; the
    // bound leaves room for a loaded one, still far from round robin's half).
    let least = share_of_slow(&spread(&gateway, "/v2/models/slow/versions/least/infer", 400).await);
    assert!(least < 0.35, "least request: {least}");
}

#[tokio::test]
async fn a_full_endpoint_refuses_after_a_bounded_wait_and_nothing_to_serve_is_refused_at_once() {
    let narrow = ModelServerProcess::both();
    let dead = dead_endpoint();
    let gateway = GatewayProcess::start(&format!(
        r#"
        {}
        max_in_flight = 1
        queue_timeout_ms = 50
        {}
        health = {{ interval_ms = 100, timeout_ms = 200, unhealthy_after = 1, healthy_after = 1 }}
        {}
        {}
        "#,
        backend("narrow", "grpc", [narrow.grpc.unwrap()]),
        backend("dead", "rest", [&dead]),
        model("slow", "narrow"),
        model("identity", "dead"),
    ));
    let slow = r#"{"parameters":{"delay_ms":800},"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}]}"#;
    let client = http_client(false);
    let url = gateway.rest_url("/v2/models/slow/infer");
    let first = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { send(&client, "POST", &url, &[], slow).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let start = Instant::now();
    let second = send(&client, "POST", &url, &[], slow).await;
    assert_eq!(second.status, 429, "{:?}", second.body);
    assert!(start.elapsed() < Duration::from_millis(500));
    assert_eq!(first.await.unwrap().status, 200);

    tokio::time::sleep(Duration::from_millis(300)).await;
    let start = Instant::now();
    let refused = send(
        &client,
        "POST",
        &gateway.rest_url("/v2/models/identity/infer"),
        &[],
        BODY,
    )
    .await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert!(start.elapsed() < Duration::from_millis(200));
    let ready = send(&client, "GET", &gateway.rest_url("/v2/health/ready"), &[], "").await;
    assert_eq!(ready.status, 503);
}

#[tokio::test]
async fn repository_load_and_unload_reach_every_replica_and_name_those_that_failed() {
    let (a, b) = (ModelServerProcess::named("a"), ModelServerProcess::named("b"));
    let down = dead_endpoint();
    let gateway = GatewayProcess::start(&format!(
        r#"
        {}
        {}
        {}
        [[models]]
        name = "identity"
        versions = [ {{ version = "1", backend = "rest-pair" }},
                     {{ version = "2", backend = "grpc-pair", upstream_version = "1" }} ]
        default_version = "1"
        [[models]]
        name = "echo"
        versions = [ {{ version = "1", backend = "rest-pair", upstream_name = "identity" }},
                     {{ version = "2", backend = "down", upstream_name = "identity" }} ]
        default_version = "1"
        "#,
        backend("rest-pair", "rest", [a.rest.unwrap(), b.rest.unwrap()]),
        backend("grpc-pair", "grpc", [a.grpc.unwrap(), b.grpc.unwrap()]),
        backend("down", "grpc", [down.address()]),
    ));
    let ready_on = |server: &ModelServerProcess| {
        let url = server.rest_url("/v2/models/identity/ready");
        async move { get(&url).await.status == 200 }
    };
    // Over REST, to both replicas of both backends (as the backends name the model).
    let answer = post(&gateway.rest_url("/v2/repository/models/identity/unload"), "").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert!(!ready_on(&a).await && !ready_on(&b).await);
    // Over gRPC, with a parameter, the same.
    let mut grpc = gateway.grpc_client().await;
    let load = oipgate::proto::RepositoryModelLoadRequest {
        model_name: "identity".into(),
        parameters: [(
            "config".to_owned(),
            oipgate::proto::ModelRepositoryParameter {
                parameter_choice: Some(
                    oipgate::proto::model_repository_parameter::ParameterChoice::StringParam("{}".into()),
                ),
            },
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    };
    grpc.repository_model_load(load).await.unwrap();
    assert!(ready_on(&a).await && ready_on(&b).await);

    // One endpoint that cannot be reached fails the call, named; the others did it all the same.
    let answer = post(
        &gateway.rest_url("/v2/repository/models/echo/unload"),
        r#"{"parameters":{"unload_dependents":false}}"#,
    )
    .await;
    let message = answer.json()["error"].as_str().unwrap().to_owned();
    assert_eq!(answer.status, 502, "{message}");
    assert!(
        message.contains("unload of model 'echo' failed at 1 of 3 endpoints")
            && message.contains(&format!("{} of backend down", down.address())),
        "{message}"
    );
    assert!(!ready_on(&a).await && !ready_on(&b).await);
    let refused = grpc
        .repository_model_load(oipgate::proto::RepositoryModelLoadRequest {
            model_name: "echo".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(ready_on(&a).await && ready_on(&b).await);

    // A model the gateway does not route is not found; a malformed body is refused before any backend sees it.
    let answer = post(&gateway.rest_url("/v2/repository/models/nothing/load"), "").await;
    assert_eq!(answer.status, 404);
    let answer = post(
        &gateway.rest_url("/v2/repository/models/identity/load"),
        r#"{"parameters":{"config":[1]}}"#,
    )
    .await;
    assert_eq!(answer.status, 400);
    assert!(
        answer.json()["error"]
            .as_str()
            .unwrap()
            .contains("repository parameter \"config\"")
    );
}

#[tokio::test]
async fn model_statistics_are_the_sum_over_replicas_under_the_public_names() {
    let (a, b) = (ModelServerProcess::named("a"), ModelServerProcess::named("b"));
    let gateway = GatewayProcess::start(&format!(
        r#"
        {}
        {}
        [[models]]
        name = "echo"
        versions = [ {{ version = "7", backend = "rest-pair", upstream_name = "identity", upstream_version = "1" }},
                     {{ version = "8", backend = "grpc-pair", upstream_name = "identity", upstream_version = "1" }} ]
        default_version = "7"
        "#,
        backend("rest-pair", "rest", [a.rest.unwrap(), b.rest.unwrap()]),
        backend("grpc-pair", "grpc", [a.grpc.unwrap(), b.grpc.unwrap()]),
    ));
    let client = http_client(false);
    for version in ["7", "8"] {
        let url = gateway.rest_url(&format!("/v2/models/echo/versions/{version}/infer"));
        for _ in 0..5 {
            assert_eq!(send(&client, "POST", &url, &[], BODY).await.status, 200);
        }
    }
    // What the replicas report themselves (both protocols of one replica share a model server).
    let direct = |server: &ModelServerProcess| {
        let url = server.rest_url("/v2/models/identity/versions/1/stats");
        async move { get(&url).await.json()["model_stats"][0].clone() }
    };
    let (on_a, on_b) = (direct(&a).await, direct(&b).await);
    let count = |stats: &serde_json::Value, field: &str| stats["inference_stats"][field]["count"].as_u64().unwrap();
    assert_eq!(count(&on_a, "success") + count(&on_b, "success"), 10);
    assert!(
        count(&on_a, "success") > 0 && count(&on_b, "success") > 0,
        "round robin reaches both"
    );

    let through = get(&gateway.rest_url("/v2/models/echo/versions/7/stats")).await;
    assert_eq!(through.status, 200, "{:?}", through.body);
    let entries = through.json()["model_stats"].as_array().unwrap().clone();
    assert_eq!(entries.len(), 1);
    let summed = &entries[0];
    assert_eq!(
        (summed["name"].as_str(), summed["version"].as_str()),
        (Some("echo"), Some("7"))
    );
    // Every request reached one replica; both versions share the replicas' one identity model.
    for field in ["success", "compute_infer"] {
        assert_eq!(
            count(summed, field),
            count(&on_a, field) + count(&on_b, field),
            "{field}"
        );
        let ns = |s: &serde_json::Value| s["inference_stats"][field]["ns"].as_u64().unwrap();
        assert_eq!(ns(summed), ns(&on_a) + ns(&on_b), "{field}");
    }
    assert_eq!(
        summed["inference_count"].as_u64(),
        Some(on_a["inference_count"].as_u64().unwrap() + on_b["inference_count"].as_u64().unwrap())
    );
    assert_eq!(
        summed["last_inference"].as_u64(),
        on_a["last_inference"].as_u64().max(on_b["last_inference"].as_u64())
    );
    // Every version of the model, every model, and the same over gRPC from the gRPC backend.
    let versions: Vec<String> = get(&gateway.rest_url("/v2/models/echo/stats")).await.json()["model_stats"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["version"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(versions, ["7", "8"]);
    assert_eq!(
        get(&gateway.rest_url("/v2/models/stats")).await.json()["model_stats"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    let mut grpc = gateway.grpc_client().await;
    let answer = grpc
        .model_statistics(oipgate::proto::ModelStatisticsRequest {
            name: "echo".into(),
            version: "8".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let entry = &answer.model_stats[0];
    assert_eq!((entry.name.as_str(), entry.version.as_str()), ("echo", "8"));
    let success = entry.inference_stats.as_ref().unwrap().success.as_ref().unwrap();
    assert_eq!(success.count, count(&on_a, "success") + count(&on_b, "success"));
    // A model or version the gateway does not route is not found.
    assert_eq!(get(&gateway.rest_url("/v2/models/nope/stats")).await.status, 404);
    assert_eq!(
        get(&gateway.rest_url("/v2/models/echo/versions/9/stats")).await.status,
        404
    );
}

#[tokio::test]
async fn a_model_configuration_reaches_both_doors_under_the_public_name_from_both_backends() {
    let server = ModelServerProcess::both();
    let gateway = GatewayProcess::start(&format!(
        r#"
        {}
        {}
        [[models]]
        name = "words"
        versions = [ {{ version = "7", backend = "rest", upstream_name = "simple_string", upstream_version = "1" }},
                     {{ version = "8", backend = "grpc", upstream_name = "simple_string", upstream_version = "1" }} ]
        default_version = "7"
        "#,
        backend("rest", "rest", [server.rest.unwrap()]),
        backend("grpc", "grpc", [server.grpc.unwrap()]),
    ));
    let direct = get(&server.rest_url("/v2/models/simple_string/versions/1/config"))
        .await
        .json();
    let mut expected = direct.clone();
    expected["name"] = serde_json::json!("words");
    let mut grpc = gateway.grpc_client().await;
    // Version 7 from the REST backend, 8 from the gRPC one: passed through in the backend's own form, translated
    // into the other, the same configuration every way.
    for version in ["7", "8"] {
        let through = get(&gateway.rest_url(&format!("/v2/models/words/versions/{version}/config"))).await;
        assert_eq!(through.status, 200, "version {version}: {:?}", through.body);
        assert_eq!(through.json(), expected, "version {version} over REST");

        let answer = grpc
            .model_config(oipgate::proto::ModelConfigRequest {
                name: "words".into(),
                version: version.into(),
            })
            .await
            .unwrap_or_else(|status| panic!("version {version}: {status:?}"))
            .into_inner();
        let config = <oipgate::proto::ModelConfig as prost::Message>::decode(answer.config).unwrap();
        assert_eq!(config.name, "words", "version {version} over gRPC");
        assert_eq!(config.input[0].name, "INPUT0");
        assert_eq!(config.input[0].data_type, oipgate::proto::DataType::TypeString as i32);
        assert_eq!(config.input[0].dims, [-1]);
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&oipgate::codec::model_config::json(&config)).unwrap(),
            expected,
            "version {version} over gRPC"
        );
    }
    assert_eq!(get(&gateway.rest_url("/v2/models/nope/config")).await.status, 404);
}

#[tokio::test]
async fn least_load_follows_the_queue_each_replica_reports_in_its_own_metrics() {
    let a = ModelServerProcess::rest_only(&["--name", "a"]);
    let b = ModelServerProcess::rest_only(&["--name", "b"]);
    let gateway = GatewayProcess::start(&format!(
        "{}lb = \"least_load\"\nload = {{ preset = \"triton\", interval_ms = 50 }}\n{}",
        backend("pair", "rest", [a.rest.unwrap(), b.rest.unwrap()]),
        model("slow", "pair"),
    ));
    let share_of_a = |counts: &HashMap<String, usize>, total: usize| {
        assert_eq!(counts.values().sum::<usize>(), total, "{counts:?}");
        #[allow(clippy::cast_precision_loss)]
        let share = *counts.get("a").unwrap_or(&0) as f64 / total as f64;
        share
    };
    let queue = |replica: &ModelServerProcess| {
        format!(
            "oipgate_endpoint_queue{{backend=\"pair\",endpoint=\"{}\"}}",
            replica.rest.unwrap()
        )
    };

    // Both idle: an even split.
    let idle = share_of_a(&spread(&gateway, "/v2/models/slow/infer", 200).await, 200);
    assert!((0.4..=0.6).contains(&idle), "idle: {idle}");

    // A client that bypasses the gateway keeps 32 calls waiting at replica a: the gateway's calls go to b.
    let client = http_client(false);
    let held =
        r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[7,8]}],"parameters":{"delay_ms":10000}}"#;
    let bypass: Vec<_> = (0..32)
        .map(|_| {
            let (client, url) = (client.clone(), a.rest_url("/v2/models/slow/infer"));
            tokio::spawn(async move { send(&client, "POST", &url, &[], held).await })
        })
        .collect();
    common::eventually(Duration::from_secs(5), "replica a's queue to be scraped", || async {
        gateway.metric(&queue(&a)).await >= 32.0
    })
    .await;
    let loaded = share_of_a(&spread(&gateway, "/v2/models/slow/infer", 100).await, 100);
    assert!(loaded <= 0.1, "with a's queue at 32: {loaded}");
    assert!(
        gateway
            .metric("oipgate_load_scrapes_total{backend=\"pair\",result=\"ok\"}")
            .await
            >= 2.0
    );
    for call in bypass {
        call.abort();
    }
}

/// A metrics address answering as `behaviour` says: "garbage" (200 with a body that is not the exposition format),
/// "huge" (200 with a 50 MB body) or "silent" (accepts and never answers).
async fn bad_metrics(behaviour: &'static str) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                let _ = stream.read(&mut request).await;
                match behaviour {
                    "garbage" => {
                        let body = "<html>not metrics</html>\n";
                        let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
                        let _ = stream.write_all((head + body).as_bytes()).await;
                    }
                    "huge" => {
                        let size = 50 << 20;
                        let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {size}\r\n\r\n");
                        let _ = stream.write_all(head.as_bytes()).await;
                        let line = "nv_inference_pending_request_count 1\n".repeat(1000);
                        let mut sent = 0;
                        while sent < size && stream.write_all(line.as_bytes()).await.is_ok() {
                            sent += line.len();
                        }
                    }
                    _ => tokio::time::sleep(Duration::from_secs(60)).await,
                }
            });
        }
    });
    address
}

#[tokio::test]
async fn metrics_that_are_garbage_huge_or_silent_are_failed_scrapes_and_calls_go_on() {
    let replica = ModelServerProcess::rest_only(&["--name", "a"]);
    let other = ModelServerProcess::rest_only(&["--name", "b"]);
    let (garbage, huge, silent) = (
        bad_metrics("garbage").await,
        bad_metrics("huge").await,
        bad_metrics("silent").await,
    );
    let (a, b) = (replica.rest.unwrap(), other.rest.unwrap());
    let gateway = GatewayProcess::start(&format!(
        r#"
        [[backends]]
        name = "pair"
        protocol = "rest"
        endpoints = [ {{ address = "{a}", metrics = "{garbage}" }}, {{ address = "{b}", metrics = "{huge}" }} ]
        lb = "least_load"
        load = {{ preset = "triton", interval_ms = 100 }}
        [[backends]]
        name = "solo"
        protocol = "rest"
        endpoints = [ {{ address = "{a}", metrics = "{silent}" }} ]
        lb = "least_load"
        load = {{ preset = "triton", interval_ms = 100 }}
        {}{}"#,
        model("slow", "pair"),
        model("identity", "solo"),
    ));
    let failed = |backend: &str| format!("oipgate_load_scrapes_total{{backend=\"{backend}\",result=\"error\"}}");
    common::eventually(Duration::from_secs(10), "failed scrapes to be counted", || async {
        gateway.metric(&failed("pair")).await >= 4.0 && gateway.metric(&failed("solo")).await >= 2.0
    })
    .await;
    let spread_pair = spread(&gateway, "/v2/models/slow/infer", 40).await;
    assert_eq!(spread_pair.values().sum::<usize>(), 40);
    assert!(
        spread_pair.keys().all(|name| name == "a" || name == "b"),
        "{spread_pair:?}"
    );
    let solo = spread(&gateway, "/v2/models/identity/infer", 10).await;
    assert_eq!(solo.get("a"), Some(&10), "{solo:?}");
    assert_eq!(
        gateway
            .metric("oipgate_load_scrapes_total{backend=\"pair\",result=\"ok\"}")
            .await,
        0.0
    );
    assert!(gateway.metric("oipgate_load_fallbacks_total{backend=\"pair\"}").await >= 1.0);
}

#[tokio::test]
async fn with_every_replica_over_max_queue_calls_are_refused_at_once_but_high_priority_ones() {
    let a = ModelServerProcess::rest_only(&["--name", "a"]);
    let b = ModelServerProcess::rest_only(&["--name", "b"]);
    let gateway = GatewayProcess::start_with(
        &format!(
            "{}lb = \"least_load\"\nload = {{ preset = \"triton\", interval_ms = 50 }}\n{}max_queue = 4\nshed_priority_below = 2\n",
            backend("pair", "rest", [a.rest.unwrap(), b.rest.unwrap()]),
            model("slow", "pair"),
        ),
        &[],
        true,
    );
    let client = http_client(false);
    let pending = |replica: &ModelServerProcess| {
        let (client, url) = (client.clone(), replica.rest_url("/metrics"));
        async move {
            let text = String::from_utf8(send(&client, "GET", &url, &[], "").await.body.to_vec()).unwrap();
            text.lines()
                .find_map(|line| line.strip_prefix("nv_inference_pending_request_count{model=\"slow\"} "))
                .map(|value| value.trim().parse::<u32>().unwrap())
                .unwrap()
        }
    };
    let body = |parameters: &str| {
        format!(
            r#"{{"inputs":[{{"name":"x","datatype":"INT32","shape":[2],"data":[7,8]}}],"parameters":{{{parameters}}}}}"#
        )
    };

    // Under the bound, calls pass.
    let url = gateway.rest_url("/v2/models/slow/infer");
    assert_eq!(send(&client, "POST", &url, &[], body("")).await.status, 200);

    // Clients that bypass the gateway keep 6 calls waiting at each replica.
    let held = body(r#""delay_ms":10000"#);
    let bypass: Vec<_> = [&a, &a, &a, &a, &a, &a, &b, &b, &b, &b, &b, &b]
        .iter()
        .map(|replica| {
            let (client, url, held) = (client.clone(), replica.rest_url("/v2/models/slow/infer"), held.clone());
            tokio::spawn(async move { send(&client, "POST", &url, &[], held).await })
        })
        .collect();
    for replica in [&a, &b] {
        let queue = format!(
            "oipgate_endpoint_queue{{backend=\"pair\",endpoint=\"{}\"}}",
            replica.rest.unwrap()
        );
        common::eventually(Duration::from_secs(5), "both queues to be scraped", || async {
            gateway.metric(&queue).await >= 6.0
        })
        .await;
    }

    // Every replica over 4: refused at once, with Retry-After, and nothing more reaches the replicas.
    for _ in 0..20 {
        let answer = send(&client, "POST", &url, &[("x-request-id", "shed".to_owned())], body("")).await;
        assert_eq!(answer.status, 429, "{}", String::from_utf8_lossy(&answer.body));
        assert!(String::from_utf8_lossy(&answer.body).contains("shedding load"));
        assert!(answer.header("retry-after").is_some());
    }
    assert_eq!((pending(&a).await, pending(&b).await), (6, 6));
    assert_eq!(
        gateway.metric("oipgate_rate_limited_total{scope=\"queue\"}").await,
        20.0
    );
    // The refusals take the gateway no time to speak of: their median is under a millisecond.
    let mut durations: Vec<f64> = gateway
        .log_lines()
        .iter()
        .filter(|line| line.contains("request_id=shed"))
        .filter_map(|line| {
            line.split("duration_ms=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    durations.sort_by(f64::total_cmp);
    assert_eq!(durations.len(), 20);
    assert!(durations[10] < 1.0, "{durations:?}");

    // Priority 1 and 2 pass; 3 is shed like the rest.
    for (priority, status) in [(1, 200), (2, 200), (3, 429)] {
        let answer = send(&client, "POST", &url, &[], body(&format!(r#""priority":{priority}"#))).await;
        assert_eq!(answer.status, status, "priority {priority}");
    }
    // A priority that is no number is refused as such.
    let answer = send(&client, "POST", &url, &[], body(r#""priority":"high""#)).await;
    assert_eq!(answer.status, 400);
    for call in bypass {
        call.abort();
    }
}
