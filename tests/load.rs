//! Balancing on the queue each replica reports in its own metrics (`least_load`), scrapes that fail (garbage, too
//! large, no answer), and shedding a model's calls while every replica's queue is over its `max_queue`.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::config::{backend, model};
use common::{GatewayProcess, ModelServerProcess, http_client, send, spread};

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

    // Both idle: both serve. Not an exact half: each replica's scraped queue counts the gateway's own calls under way
    // (eight at a time here), so between two scrapes the calls lean to whichever was scraped emptier, and on a busy
    // machine the scrapes come unevenly.
    let idle = share_of_a(&spread(&gateway, "/v2/models/slow/infer", 200).await, 200);
    assert!((0.3..=0.7).contains(&idle), "idle: {idle}");

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
    common::eventually(Duration::from_secs(10), "replica a's queue to be scraped", || async {
        gateway
            .metric_if_present(&queue(&a))
            .await
            .is_some_and(|value| value >= 32.0)
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
        gateway
            .metric_if_present(&failed("pair"))
            .await
            .is_some_and(|value| value >= 4.0)
            && gateway
                .metric_if_present(&failed("solo"))
                .await
                .is_some_and(|value| value >= 2.0)
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
    // No scrape of the pair succeeded: its series was never made (its family's name is read present above).
    assert_eq!(
        gateway
            .metric_if_present("oipgate_load_scrapes_total{backend=\"pair\",result=\"ok\"}")
            .await,
        None
    );
    assert!(
        gateway
            .metric_if_present("oipgate_load_fallbacks_total{backend=\"pair\"}")
            .await
            .is_some_and(|value| value >= 1.0)
    );
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
        common::eventually(Duration::from_secs(10), "both queues to be scraped", || async {
            gateway
                .metric_if_present(&queue)
                .await
                .is_some_and(|value| value >= 6.0)
        })
        .await;
    }

    // Every replica over 4: refused at once, with Retry-After, and nothing more reaches the replicas.
    for _ in 0..20 {
        let answer = send(&client, "POST", &url, &[("x-request-id", "shed".to_owned())], body("")).await;
        assert_eq!(answer.status, 429, "{}", String::from_utf8_lossy(&answer.body));
        assert!(String::from_utf8_lossy(&answer.body).contains("shedding load"));
        assert!(
            answer
                .header("retry-after")
                .and_then(|seconds| seconds.parse::<u64>().ok())
                .is_some_and(|seconds| seconds >= 1)
        );
    }
    assert_eq!((pending(&a).await, pending(&b).await), (6, 6));
    assert_eq!(
        gateway.metric("oipgate_rate_limited_total{scope=\"queue\"}").await,
        20.0
    );
    // Refused at once: every one came while the calls holding the queues (ten seconds each) still waited, none of
    // them waiting for a place.
    assert!(
        bypass.iter().all(|held| !held.is_finished()),
        "a refusal waited for the replicas' queues to drain"
    );
    let shed = |lines: &[String]| lines.iter().filter(|line| line.contains("request_id=shed")).count();
    let lines = gateway.logged("the refusals' lines", |lines| shed(lines) >= 20).await;
    assert_eq!(shed(&lines), 20, "each refusal is logged, once");

    // Priority 1 and 2 pass; 3 is shed like the rest.
    for (priority, status) in [(1, 200), (2, 200), (3, 429)] {
        let answer = send(&client, "POST", &url, &[], body(&format!(r#""priority":{priority}"#))).await;
        assert_eq!(answer.status, status, "priority {priority}");
    }
    // A priority that is no number is refused as such.
    let answer = send(&client, "POST", &url, &[], body(r#""priority":"high""#)).await;
    assert_eq!(answer.status, 400);
    // A stream's requests are shed one by one: the refused one is answered with its error, the stream goes on.
    let mut grpc = gateway.grpc_client().await;
    let mut urgent = common::grpc_int32_request("slow", "");
    urgent.parameters.insert(
        "priority".into(),
        oipgate::proto::InferParameter {
            parameter_choice: Some(oipgate::proto::infer_parameter::ParameterChoice::Int64Param(1)),
        },
    );
    let requests = [common::grpc_int32_request("slow", ""), urgent];
    let mut answers = grpc
        .model_stream_infer(tokio_stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    let shed = answers.message().await.unwrap().unwrap();
    assert!(shed.error_message.contains("shedding load"), "{shed:?}");
    let passed = answers.message().await.unwrap().unwrap();
    assert!(passed.error_message.is_empty(), "{passed:?}");
    // And so are generate calls.
    let generate = gateway.rest_url("/v2/models/slow/generate");
    let answer = send(&client, "POST", &generate, &[], r#"{"x": [7, 8]}"#).await;
    assert_eq!(answer.status, 429, "{}", String::from_utf8_lossy(&answer.body));
    for call in bypass {
        call.abort();
    }
}
