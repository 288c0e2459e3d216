//! Replicas through `oipgate serve`: failover when a replica dies and comes back, traffic kept from a replica whose
//! model is unloaded, admission limits, and immediate refusal when nothing can serve.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::config::{backend, model};
use common::ports::{dead_endpoint, hold_port};
use common::{GatewayProcess, INT32_BODY as BODY, ModelServerProcess, get, http_client, post, send, spread};
use oipgate::proto::RepositoryIndexRequest;

#[tokio::test]
async fn a_dead_replica_loses_at_most_the_request_under_way_is_ejected_and_comes_back() {
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
    // None yet: the series is made at the first retry (and read present below, so its name is the gateway's).
    assert_eq!(gateway.metric_if_present(&retries("rest-pair")).await, None);
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
    let slow = r#"{"parameters":{"delay_ms":5000},"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}]}"#;
    let client = http_client(false);
    let url = gateway.rest_url("/v2/models/slow/infer");
    let first = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { send(&client, "POST", &url, &[], slow).await }
    });
    common::eventually(Duration::from_secs(10), "the first call at the endpoint", || async {
        gateway
            .metric_if_present(r#"oipgate_in_flight{backend="narrow"}"#)
            .await
            == Some(1.0)
    })
    .await;
    // Refused once its 50 ms in the queue are up, while the first call (five seconds) still holds the endpoint:
    // the bounded wait, not a wait for the endpoint to free.
    let second = send(&client, "POST", &url, &[], slow).await;
    assert_eq!(second.status, 429, "{:?}", second.body);
    assert!(
        !first.is_finished(),
        "refused before the first call's five seconds were up"
    );
    assert_eq!(first.await.unwrap().status, 200);

    // Nothing to serve (the one endpoint dead, ejected by its health checks): refused at once, 503 naming why, where
    // trying the dead endpoint would have been a 502 that it cannot be reached.
    common::eventually(Duration::from_secs(10), "the dead endpoint ejected", || async {
        gateway
            .metric_if_present(&format!(
                "oipgate_endpoint_healthy{{backend=\"dead\",endpoint=\"{dead}\"}}"
            ))
            .await
            == Some(0.0)
    })
    .await;
    let refused = send(
        &client,
        "POST",
        &gateway.rest_url("/v2/models/identity/infer"),
        &[],
        BODY,
    )
    .await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert!(
        String::from_utf8_lossy(&refused.body).contains("no endpoint"),
        "{:?}",
        refused.body
    );
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
