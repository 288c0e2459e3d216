//! The front door against an attacker's bytes, on the built gateway: connections that begin a preface and stop,
//! bodies framed to cost the gateway more than the data they carry, protobuf keys that decoders read differently,
//! reserved parameters placed where a prefix check would not look, bodies trickled to hold an admission, framing
//! that RFC 9112 refuses, headers a client sends in the operator's place, and listeners without a cap. Each class
//! is refused or bounded as docs/SECURITY.md says.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::config::backend;
use common::{GatewayProcess, ModelServerProcess};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A gateway with a short head time limit in front of one model server: `identity` over REST and, as version 2,
/// over gRPC.
struct Setup {
    server: ModelServerProcess,
    gateway: GatewayProcess,
}

fn setup(extra_limits: &str) -> Setup {
    let server = ModelServerProcess::both();
    let gateway = GatewayProcess::start(&format!(
        r#"
[limits]
header_read_timeout_ms = 1000
{extra_limits}
{}binary_data = true
{}
[[models]]
name = "identity"
versions = [ {{ version = "1", backend = "rest" }}, {{ version = "2", backend = "grpc", upstream_version = "1" }} ]
default_version = "1"
"#,
        backend("rest", "rest", [server.rest.unwrap()]),
        backend("grpc", "grpc", [server.grpc.unwrap()]),
    ));
    Setup { server, gateway }
}

/// The times the gateway's threads have been switched off a core, all of them together: a thread that waits on a
/// timer every millisecond is switched a thousand times a second, one that waits on readiness not at all.
fn context_switches(pid: u32) -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        for line in status.lines() {
            if let Some(count) = line
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                total += count.trim().parse::<u64>().unwrap();
            }
        }
    }
    total
}

/// Reads until the gateway closes the connection, within `limit`; what came.
async fn read_until_closed(stream: &mut tokio::net::TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut answer = Vec::new();
    tokio::time::timeout(limit, stream.read_to_end(&mut answer))
        .await
        .ok()?
        .ok()?;
    Some(answer)
}

async fn connections_with_half_a_preface(address: SocketAddr, count: usize) -> Vec<tokio::net::TcpStream> {
    let mut opened = Vec::new();
    for _ in 0..count {
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        stream.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        opened.push(stream);
    }
    opened
}

#[tokio::test]
async fn a_half_sent_preface_is_waited_for_without_polling_and_closed_at_the_head_time_limit_on_both_doors() {
    let setup = setup("");
    let pid = setup.gateway.pid();
    for address in [setup.gateway.rest, setup.gateway.grpc] {
        let mut waiting = connections_with_half_a_preface(address, 100).await;
        // Let the gateway see them all, then count its switches over a second of their waiting. Polled every
        // millisecond, as they once were, each door thread is switched about a thousand times in it.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let before = context_switches(pid);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let switched = context_switches(pid) - before;
        assert!(
            switched < 200,
            "{switched} context switches in half a second with 100 connections waiting for their preface ({address})"
        );
        // The head time limit (1 s) closes them; the idle one (60 s) would not within the test's patience.
        for stream in &mut waiting {
            let closed = read_until_closed(stream, Duration::from_secs(20)).await;
            assert!(
                closed.is_some(),
                "a half-sent preface kept its connection past the head time limit ({address})"
            );
        }
    }
    // The doors still serve.
    let answer = common::post(&setup.gateway.rest_url("/v2/models/identity/infer"), common::INT32_BODY).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let mut client = setup.gateway.grpc_client().await;
    client
        .model_infer(common::grpc_int32_request("identity", "2"))
        .await
        .unwrap();
    drop(setup.server);
}
