//! deploy/grafana/oipgate.json, the Grafana dashboard: every metric it queries is one the gateway exposes, checked
//! against `/metrics` of a gateway whose traffic makes every such family appear (series are made at first use).

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::config::backend;
use common::ports::dead_endpoint;
use common::{GatewayProcess, INT32_BODY as BODY, ModelServerProcess, add_sub_json, eventually, http_client, send};

/// Every `oipgate_*` name in the dashboard's queries.
fn queried_metrics() -> BTreeSet<String> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/oipgate.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut names = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("a query");
            let mut rest = expr;
            while let Some(start) = rest.find("oipgate_") {
                let name: String = rest[start..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[start + name.len()..];
                names.insert(name);
            }
        }
    }
    names
}

#[tokio::test]
async fn every_metric_the_dashboard_queries_is_exposed() {
    let queried = queried_metrics();
    assert!(queried.len() >= 12, "{queried:?}");
    let replica = ModelServerProcess::named("a");
    let dead = dead_endpoint();
    let digest = common::sha256_hex("grafana-key");
    // Traces and payloads go to a dead endpoint: their counters are made when the sections are configured.
    let gateway = GatewayProcess::start(&format!(
        r#"[tracing]
otlp_endpoint = "http://{dead}"
[payload_log]
url = "http://{dead}/"
[auth]
[[auth.api_keys]]
name = "grafana"
sha256 = "{digest}"
models = ["*"]
{}retries = 1
lb = "least_load"
load = {{ preset = "triton", interval_ms = 50 }}
{}
{}retries = 1
[[models]]
name = "identity"
versions = [ {{ version = "1", backend = "pair" }} ]
[[models]]
name = "retried"
versions = [ {{ version = "1", backend = "retrying", upstream_name = "identity" }} ]
[[models]]
name = "add_sub"
versions = [ {{ version = "1", backend = "grpc" }} ]
[[models]]
name = "metered"
versions = [ {{ version = "1", backend = "pair", upstream_name = "identity" }} ]
rate = {{ per_second = 0.001, burst = 1 }}
max_concurrent = 4
"#,
        backend("pair", "rest", [replica.rest.unwrap().to_string(), dead.to_string()]),
        backend("grpc", "grpc", [replica.grpc.unwrap()]),
        // Taken in turn (least_load may keep off the dead endpoint from the first call on): one of two calls meets
        // the dead endpoint and is retried.
        backend(
            "retrying",
            "rest",
            [dead.to_string(), replica.rest.unwrap().to_string()]
        ),
    ));
    let client = http_client(false);
    let key = [("x-api-key", "grafana-key".to_owned())];
    // Calls over both endpoints (one dead), retried, translated to gRPC, refused for want of a key, and past a
    // model's rate (a model held to max_concurrent has its gauge from the first scrape).
    for (model, calls) in [("identity", 8), ("retried", 2)] {
        for _ in 0..calls {
            let path = format!("/v2/models/{model}/infer");
            let answer = send(&client, "POST", &gateway.rest_url(&path), &key, BODY).await;
            assert_eq!(answer.status, 200, "{model}: {}", String::from_utf8_lossy(&answer.body));
        }
    }
    let add_sub = add_sub_json("INT32");
    let answer = send(
        &client,
        "POST",
        &gateway.rest_url("/v2/models/add_sub/infer"),
        &key,
        add_sub,
    )
    .await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        send(
            &client,
            "POST",
            &gateway.rest_url("/v2/models/identity/infer"),
            &[],
            BODY
        )
        .await
        .status,
        401
    );
    let metered = gateway.rest_url("/v2/models/metered/infer");
    assert_eq!(send(&client, "POST", &metered, &key, BODY).await.status, 200);
    assert_eq!(send(&client, "POST", &metered, &key, BODY).await.status, 429);
    gateway.signal("HUP");
    eventually(
        Duration::from_secs(5),
        "a scrape of the replica and a reload",
        || async {
            let text = gateway.metrics().await;
            text.contains("oipgate_endpoint_queue{") && text.contains("oipgate_config_reloads_total{result=\"ok\"} 1")
        },
    )
    .await;

    let exposed = gateway.metrics().await;
    let missing: Vec<&String> = queried
        .iter()
        .filter(|name| {
            !exposed.lines().any(|line| {
                line.strip_prefix(name.as_str())
                    .is_some_and(|rest| rest.starts_with(['{', ' ']))
            })
        })
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries {missing:?}, which /metrics does not expose:\n{exposed}"
    );
}
