//! Replicas through `oipgate serve`: failover when a replica dies and comes back, traffic kept from a replica whose
//! model is unloaded, admission limits, and immediate refusal when nothing can serve.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{GatewayProcess, ModelServerProcess, free_port, http_client, send};
use futures_util::StreamExt;

const BODY: &str = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[7,8]}]}"#;

fn replica(name: &str, rest: u16, grpc: u16) -> ModelServerProcess {
    ModelServerProcess::start(&[
        "--rest",
        &format!("127.0.0.1:{rest}"),
        "--grpc",
        &format!("127.0.0.1:{grpc}"),
        "--name",
        name,
    ])
}

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
    let ports: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let a = replica("a", ports[0], ports[1]);
    let mut b = Some(replica("b", ports[2], ports[3]));
    let gateway = GatewayProcess::start(&format!(
        r#"
        [[backends]]
        name = "rest-fleet"
        protocol = "rest"
        endpoints = ["127.0.0.1:{}", "127.0.0.1:{}"]
        health = {{ interval_ms = 100, timeout_ms = 300, unhealthy_after = 1, healthy_after = 1 }}
        [[backends]]
        name = "grpc-fleet"
        protocol = "grpc"
        endpoints = ["127.0.0.1:{}", "127.0.0.1:{}"]
        health = {{ interval_ms = 100, timeout_ms = 300, unhealthy_after = 1, healthy_after = 1 }}
        [[models]]
        name = "identity"
        versions = [ {{ version = "1", backend = "rest-fleet" }},
                     {{ version = "2", backend = "grpc-fleet", upstream_version = "1" }} ]
        default_version = "1"
        "#,
        ports[0], ports[2], ports[1], ports[3]
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

    // Restarted on the same ports, it is probed healthy and gets traffic again.
    let _b = replica("b", ports[2], ports[3]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for path in paths {
        let counts = spread(&gateway, path, 40).await;
        assert!(counts.get("b").is_some_and(|&n| n >= 10), "{path}: {counts:?}");
        assert_eq!(counts.values().sum::<usize>(), 40);
    }

    // A replica whose model is unloaded stops getting that model's traffic.
    let unload = send(
        &http_client(false),
        "POST",
        &a.rest_url("/v2/repository/models/identity/unload"),
        &[],
        "",
    )
    .await;
    assert_eq!(unload.status, 200);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let counts = spread(&gateway, paths[0], 30).await;
    assert_eq!(counts.get("b"), Some(&30), "{counts:?}");
}

#[tokio::test]
async fn a_full_endpoint_refuses_after_a_bounded_wait_and_nothing_to_serve_is_refused_at_once() {
    let backend = ModelServerProcess::both();
    let gateway = GatewayProcess::start(&format!(
        r#"
        [[backends]]
        name = "narrow"
        protocol = "grpc"
        endpoints = ["{}"]
        max_in_flight = 1
        queue_timeout_ms = 50
        [[backends]]
        name = "dead"
        protocol = "rest"
        endpoints = ["127.0.0.1:{}"]
        health = {{ interval_ms = 100, timeout_ms = 200, unhealthy_after = 1, healthy_after = 1 }}
        [[models]]
        name = "slow"
        versions = [ {{ version = "1", backend = "narrow" }} ]
        [[models]]
        name = "identity"
        versions = [ {{ version = "1", backend = "dead" }} ]
        "#,
        backend.grpc.unwrap(),
        free_port()
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
