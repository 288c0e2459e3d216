//! Traffic management through `oipgate serve`: canary weights, sticky routing, and mirroring, against built-in model
//! server processes. Statistical checks use bounds many standard deviations wide, or deterministic sticky keys.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::config::{self, fleet_backends};
use common::ports::{DeadEndpoint, dead_endpoint};
use common::{GatewayProcess, ModelServerProcess, add_sub_json, grpc_add_sub_request, http_client, post, send};
use futures_util::StreamExt;

struct Fleet {
    backend: ModelServerProcess,
    _down: DeadEndpoint,
    gateway: GatewayProcess,
}

/// A gateway over one model server (REST and gRPC), with add_sub split `v1`/`v2` and sticky on `x-session-id`.
fn fleet(v1: u32, v2: u32) -> Fleet {
    let backend = ModelServerProcess::both();
    let down = dead_endpoint();
    let config = format!(
        r#"
        {}
        {}
        [[models]]
        name = "add_sub"
        versions = [ {{ version = "1", backend = "fleet-a", weight = {v1} }},
                     {{ version = "2", backend = "fleet-b", weight = {v2} }} ]
        sticky_header = "x-session-id"
        [[models]]
        name = "identity"
        versions = [ {{ version = "1", backend = "fleet-a", weight = 100 }},
                     {{ version = "2", backend = "fleet-b", upstream_version = "1", weight = 0 }} ]
        mirror = {{ version = "2", percent = 50 }}
        [[models]]
        name = "identity_b"
        versions = [ {{ version = "1", backend = "fleet-b", upstream_name = "identity" }},
                     {{ version = "2", backend = "fleet-a", upstream_name = "identity", upstream_version = "1" }} ]
        default_version = "1"
        mirror = {{ version = "2", percent = 100 }}
        [[models]]
        name = "identity_lost"
        versions = [ {{ version = "1", backend = "fleet-a", upstream_name = "identity" }},
                     {{ version = "2", backend = "down", upstream_name = "identity", upstream_version = "1" }} ]
        default_version = "1"
        mirror = {{ version = "2", percent = 100 }}
        "#,
        fleet_backends(backend.rest.unwrap(), backend.grpc.unwrap()),
        config::backend("down", "grpc", [&down]),
    );
    let gateway = GatewayProcess::start(&config);
    Fleet {
        backend,
        _down: down,
        gateway,
    }
}

/// POSTs `body` to `path` `count` times, `concurrency` at a time; gives each answer's `oip-model-version` with the
/// body's `model_version`, which must agree.
async fn versions_served(
    gateway: &GatewayProcess,
    path: &str,
    body: &str,
    headers: Vec<(&'static str, String)>,
    count: usize,
) -> Vec<String> {
    let client = http_client(false);
    let url = gateway.rest_url(path);
    futures_util::stream::iter(0..count)
        .map(|_| {
            let (client, url, headers) = (client.clone(), url.clone(), headers.clone());
            let body = body.to_owned();
            async move {
                let answer = send(&client, "POST", &url, &headers, body).await;
                assert_eq!(answer.status, 200, "{:?}", answer.body);
                let header = answer
                    .header("oip-model-version")
                    .expect("oip-model-version")
                    .to_owned();
                assert_eq!(answer.json()["model_version"], header.as_str());
                header
            }
        })
        .buffer_unordered(32)
        .collect()
        .await
}

#[tokio::test]
async fn unversioned_requests_split_by_weight() {
    let fleet = fleet(90, 10);
    let served = versions_served(
        &fleet.gateway,
        "/v2/models/add_sub/infer",
        &add_sub_json("INT32"),
        Vec::new(),
        10_000,
    )
    .await;
    let on_v1 = served.iter().filter(|v| *v == "1").count();
    let on_v2 = served.iter().filter(|v| *v == "2").count();
    assert_eq!(on_v1 + on_v2, 10_000);
    // One standard deviation is 30 requests; the bounds are more than six away.
    assert!((8_800..=9_200).contains(&on_v1), "{on_v1} of 10,000 on version 1");

    // A named version is that version, always; an unknown one is 404.
    let named = versions_served(
        &fleet.gateway,
        "/v2/models/add_sub/versions/2/infer",
        &add_sub_json("INT32"),
        Vec::new(),
        50,
    )
    .await;
    assert!(named.iter().all(|v| v == "2"));
    let unknown = post(
        &fleet.gateway.rest_url("/v2/models/add_sub/versions/3/infer"),
        add_sub_json("INT32"),
    )
    .await;
    assert_eq!(unknown.status, 404);
    drop(fleet.backend);
}

/// The version each sticky key gets, over REST, asked `times` times (all must agree).
async fn sticky_versions(gateway: &GatewayProcess, keys: &[String], times: usize) -> HashMap<String, String> {
    let mut chosen = HashMap::new();
    for key in keys {
        let served = versions_served(
            gateway,
            "/v2/models/add_sub/infer",
            &add_sub_json("INT32"),
            vec![("x-session-id", key.clone())],
            times,
        )
        .await;
        assert!(served.iter().all(|v| *v == served[0]), "key {key} got {served:?}");
        chosen.insert(key.clone(), served[0].clone());
    }
    chosen
}

#[tokio::test]
async fn a_sequence_keeps_the_version_the_weights_gave_it() {
    let fleet = fleet(50, 50);
    let mut chosen = HashMap::new();
    for id in 1..=60 {
        // The request's sequence, not a header, is the key; add_sub itself takes no notice of it.
        let body = add_sub_json("INT32").replacen('{', &format!(r#"{{"parameters":{{"sequence_id":{id}}},"#), 1);
        let served = versions_served(&fleet.gateway, "/v2/models/add_sub/infer", &body, Vec::new(), 4).await;
        assert!(served.iter().all(|v| *v == served[0]), "sequence {id} got {served:?}");
        chosen.insert(id, served[0].clone());
    }
    let on_v2 = chosen.values().filter(|v| *v == "2").count();
    assert!(
        (10..=50).contains(&on_v2),
        "{on_v2} of 60 sequences on version 2 at 50/50"
    );
}

#[tokio::test]
async fn sticky_keys_keep_their_version_and_a_weight_change_moves_only_what_it_must() {
    let keys: Vec<String> = (0..400).map(|i| format!("session-{i}")).collect();
    let before = {
        let fleet = fleet(90, 10);
        let chosen = sticky_versions(&fleet.gateway, &keys, 3).await;
        // gRPC clients carry the key as metadata and get the same version.
        let mut client = fleet.gateway.grpc_client().await;
        for key in keys.iter().take(40) {
            let mut request = tonic::Request::new(grpc_add_sub_request("", 0, 0));
            request.metadata_mut().insert("x-session-id", key.parse().unwrap());
            let answer = client.model_infer(request).await.unwrap();
            let header = answer
                .metadata()
                .get("oip-model-version")
                .unwrap()
                .to_str()
                .unwrap()
                .to_owned();
            assert_eq!(answer.into_inner().model_version, header);
            assert_eq!(header, chosen[key], "key {key} over gRPC");
        }
        chosen
    };
    let on_v2 = before.values().filter(|v| *v == "2").count();
    assert!((8..=72).contains(&on_v2), "{on_v2} of 400 keys on version 2 at 90/10");

    let after = {
        let fleet = fleet(80, 20);
        sticky_versions(&fleet.gateway, &keys, 1).await
    };
    let moved: Vec<&String> = keys.iter().filter(|k| before[*k] != after[*k]).collect();
    assert!(
        moved.iter().all(|k| before[*k] == "1" && after[*k] == "2"),
        "going from 90/10 to 80/20 only moves keys from version 1 to version 2"
    );
    let now_on_v2 = after.values().filter(|v| *v == "2").count();
    assert_eq!(now_on_v2, on_v2 + moved.len());
    // 10% of the keys must move; far fewer or more means keys were reshuffled.
    assert!((16..=64).contains(&moved.len()), "{} of 400 keys moved", moved.len());
}

/// Waits until the mirrored copies of `model` version 2 (ok + error + shed) add up to `total`.
async fn mirror_counts(gateway: &GatewayProcess, model: &str, total: f64) -> HashMap<&'static str, f64> {
    let start = Instant::now();
    loop {
        let mut counts = HashMap::new();
        for result in ["ok", "error", "shed"] {
            let series = format!(r#"oipgate_mirror_requests_total{{model="{model}",result="{result}",version="2"}}"#);
            // Each result's series is made at its first copy: absent is none of that result, and the sum below reads
            // them present.
            counts.insert(result, gateway.metric_if_present(&series).await.unwrap_or(0.0));
        }
        if counts.values().sum::<f64>() >= total || start.elapsed() > Duration::from_secs(10) {
            return counts;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn mirrored_copies_reach_the_mirror_and_never_the_client() {
    let fleet = fleet(90, 10);
    let gateway = &fleet.gateway;
    let body = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[7,8]}]}"#;

    // REST passthrough to the REST backend, half of it copied to the gRPC backend.
    let served = versions_served(gateway, "/v2/models/identity/infer", body, Vec::new(), 400).await;
    assert!(
        served.iter().all(|v| v == "1"),
        "the client only sees the primary's answers"
    );
    let counts = mirror_counts(gateway, "identity", 400.0).await;
    // Half of 400 is 200, with a standard deviation of 10.
    assert!(
        (140.0..=260.0).contains(&counts["ok"]),
        "{counts:?}: about half of the requests are mirrored"
    );
    assert_eq!(counts["error"], 0.0, "{counts:?}");

    // Translated to the gRPC backend and mirrored to the REST one; gRPC clients passed through and mirrored across.
    let served = versions_served(gateway, "/v2/models/identity_b/infer", body, Vec::new(), 20).await;
    assert!(served.iter().all(|v| v == "1"));
    let mut client = gateway.grpc_client().await;
    for _ in 0..20 {
        let mut request = grpc_add_sub_request("", 0, 0);
        request.model_name = "identity_b".into();
        let answer = client.model_infer(request).await.unwrap().into_inner();
        assert_eq!(answer.model_version, "1");
    }
    let counts = mirror_counts(gateway, "identity_b", 40.0).await;
    assert_eq!(counts["ok"], 40.0, "{counts:?}");

    // A mirror that is down fails on its own; every client still gets its answer.
    let served = versions_served(gateway, "/v2/models/identity_lost/infer", body, Vec::new(), 30).await;
    assert_eq!(served.len(), 30);
    let counts = mirror_counts(gateway, "identity_lost", 30.0).await;
    assert_eq!(counts["ok"], 0.0, "{counts:?}");
    assert_eq!(counts["error"] + counts["shed"], 30.0, "{counts:?}");
}
