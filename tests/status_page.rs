//! The fleet status page (`GET /status` on the metrics listener) rendered by headless Chromium as a person would see
//! it, its JSON (`GET /status.json`), and a replica killed during the test shown as out within the health interval.
//! The screenshot is kept at target/test-artifacts/status-page.png.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::config::backend;
use common::{GatewayProcess, INT32_BODY as BODY, ModelServerProcess, eventually, get, grpc_client, http_client, send};

/// The page as Chromium draws it at 1280x800, after its script has read /status.json: the DOM, and a screenshot
/// at `screenshot`.
fn render(url: &str, screenshot: &Path) -> String {
    let run = |what: &str| {
        let output = Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1280,800",
                "--virtual-time-budget=3000",
                what,
                url,
            ])
            .output()
            .expect("chromium runs (scripts/setup --tests installs Debian's chromium)");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap()
    };
    run(&format!("--screenshot={}", screenshot.display()));
    run("--dump-dom")
}

/// The cells of the endpoints table's row for `endpoint`, as text.
fn endpoint_row(dom: &str, endpoint: &str) -> String {
    let start = dom
        .find(&format!("<td>{endpoint}</td>"))
        .unwrap_or_else(|| panic!("{endpoint} not shown:\n{dom}"));
    let end = dom[start..].find("</tr>").map_or(dom.len(), |end| start + end);
    dom[start..end].to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_models_and_endpoints_and_a_killed_replica_goes_out() {
    let a = ModelServerProcess::named("a");
    let mut b = Some(ModelServerProcess::named("b"));
    let b_ref = b.as_ref().unwrap();
    let (a_rest, a_grpc, b_rest, b_grpc) = (
        a.rest.unwrap(),
        a.grpc.unwrap(),
        b_ref.rest.unwrap(),
        b_ref.grpc.unwrap(),
    );
    let health = "health = { interval_ms = 200, timeout_ms = 150, unhealthy_after = 2, healthy_after = 1 }\n";
    let gateway = GatewayProcess::start(&format!(
        r#"{}lb = "least_load"
load = {{ preset = "triton", interval_ms = 200 }}
{health}{}{health}
[[models]]
name = "identity"
versions = [ {{ version = "1", backend = "replicas-rest", weight = 100 }}, {{ version = "2", backend = "replicas-grpc", upstream_version = "1", weight = 0 }} ]
[[models]]
name = "add_sub"
versions = [ {{ version = "1", backend = "replicas-grpc" }} ]
[[models]]
name = "slow"
versions = [ {{ version = "1", backend = "replicas-rest" }} ]
max_concurrent = 2
"#,
        backend("replicas-rest", "rest", [a_rest, b_rest]),
        backend("replicas-grpc", "grpc", [a_grpc, b_grpc]),
    ));
    let client = http_client(false);
    for _ in 0..10 {
        let answer = send(
            &client,
            "POST",
            &gateway.rest_url("/v2/models/identity/infer"),
            &[],
            BODY,
        )
        .await;
        assert_eq!(answer.status, 200);
    }
    let mut grpc = grpc_client(gateway.grpc).await;
    grpc.model_infer(common::grpc_add_sub_request("1", 1, 2)).await.unwrap();

    // The JSON: every version with its weight and backend, every endpoint with its last minute.
    let status = get(&format!("http://{}/status.json", gateway.metrics)).await;
    assert_eq!(status.status, 200);
    let json = status.json();
    assert_eq!(json["generation"], 1);
    assert_eq!(
        json["limits"]["shared"], false,
        "no [limits.shared]: each replica's own"
    );
    assert_eq!(
        json["limits"]["under_way"],
        serde_json::json!([{"model": "slow", "calls": 0, "max_concurrent": 2}]),
        "only slow is held to a max_concurrent"
    );
    assert_eq!(json["models"].as_array().unwrap().len(), 4, "{json}");
    assert_eq!(
        (json["versions_total"].as_u64(), json["versions_unavailable"].as_u64()),
        (Some(4), Some(0))
    );
    assert_eq!(json["models"][1]["weight"], 0);
    assert_eq!(json["models"][1]["backend"], "replicas-grpc");
    let endpoints: Vec<&serde_json::Value> = json["backends"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|b| b["endpoints"].as_array().unwrap())
        .collect();
    assert_eq!(endpoints.len(), 4);
    let calls: u64 = endpoints
        .iter()
        .map(|e| e["last_minute"]["calls"].as_u64().unwrap())
        .sum();
    assert!(calls >= 11, "{json}");

    // The page, drawn.
    let artefacts = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("../test-artifacts");
    std::fs::create_dir_all(&artefacts).unwrap();
    let url = format!("http://{}/status", gateway.metrics);
    let dom = render(&url, &artefacts.join("status-page.png"));
    for text in [
        "oipgate fleet status",
        "generation 1",
        "no reload since start",
        "ready",
        "add_sub",
        "slow",
        "4 versions, 0 unavailable",
        "limits: each replica's own · calls under way (max_concurrent): slow 0/2",
    ] {
        assert!(dom.contains(text), "{text} missing:\n{dom}");
    }
    for endpoint in [a_rest, b_rest, a_grpc, b_grpc] {
        assert!(endpoint_row(&dom, &endpoint.to_string()).contains(r#"<td class="in">in</td>"#));
    }
    let height: u32 = dom
        .split("data-height=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .and_then(|height| height.parse().ok())
        .unwrap_or_else(|| panic!("the page did not render:\n{dom}"));
    assert!(
        height <= 800,
        "3 models x 4 endpoints need scrolling at 1280x800: {height} px"
    );

    // Replica b killed: within the health interval both its endpoints show as out, with why.
    drop(b.take());
    let status_url = format!("http://{}/status.json", gateway.metrics);
    eventually(Duration::from_secs(10), "b's endpoints to be out", || async {
        let json = get(&status_url).await.json();
        json["backends"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|b| b["endpoints"].as_array().unwrap().clone())
            .filter(|e| e["available"] == false)
            .count()
            == 2
    })
    .await;
    let dom = render(&url, &artefacts.join("status-page-replica-out.png"));
    for endpoint in [b_rest, b_grpc] {
        let row = endpoint_row(&dom, &endpoint.to_string());
        assert!(
            row.contains(r#"<td class="out">out</td>"#) && row.contains("failing its health checks"),
            "{row}"
        );
    }
    for endpoint in [a_rest, a_grpc] {
        assert!(endpoint_row(&dom, &endpoint.to_string()).contains(r#"<td class="in">in</td>"#));
    }
}
