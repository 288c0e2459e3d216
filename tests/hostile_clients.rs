//! Clients that attack the doors rather than use them, on the built gateway: slowloris (hundreds of connections
//! trickling their heads), a body that stalls, header bombs, HTTP/2 rapid reset and PING / SETTINGS floods on both
//! HTTP/2 ports, and clients that never read their large answers. Each is cut off or bounded; meanwhile the gateway
//! stays up, its memory stays bounded, and well-behaved clients are served.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::config::{backend, model};
use common::{GatewayProcess, ModelServerProcess, post};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BODY: &str = common::INT32_BODY;

/// A gateway with short client timeouts in front of one model server: `identity` version 1 over REST, version 2
/// over gRPC.
struct Setup {
    server: ModelServerProcess,
    gateway: GatewayProcess,
}

fn setup() -> Setup {
    let server = ModelServerProcess::both();
    let grpc = backend("grpc", "grpc", [server.grpc.unwrap()]);
    let gateway = GatewayProcess::start(&format!(
        r#"
[limits]
header_read_timeout_ms = 1000
body_read_timeout_ms = 500
{}binary_data = true
{grpc}
[[models]]
name = "identity"
versions = [ {{ version = "1", backend = "rest" }}, {{ version = "2", backend = "grpc", upstream_version = "1" }} ]
default_version = "1"
{}"#,
        backend("rest", "rest", [server.rest.unwrap()]),
        model("add_sub", "rest"),
    ));
    Setup { server, gateway }
}

/// Whether a well-behaved client is served on both doors, promptly.
async fn served(setup: &Setup) {
    let started = Instant::now();
    let answer = post(&setup.gateway.rest_url("/v2/models/identity/infer"), BODY).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let mut client = setup.gateway.grpc_client().await;
    client
        .model_infer(common::grpc_int32_request("identity", "2"))
        .await
        .expect("a gRPC call is served");
    // Starved, a call would wait on the attackers for as long as they go on (longer than any test's patience).
    assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
}

/// The model server's count of `identity` inferences (every outcome).
async fn identity_calls(server: &ModelServerProcess) -> u64 {
    let answer = common::get(&server.rest_url("/v2/models/identity/stats")).await;
    let json = answer.json();
    let count = |value: &serde_json::Value| {
        value["count"]
            .as_u64()
            .or_else(|| value["count"].as_str().and_then(|c| c.parse().ok()))
            .unwrap_or(0)
    };
    json["model_stats"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| {
            let stats = &entry["inference_stats"];
            count(&stats["success"]) + count(&stats["fail"])
        })
        .sum()
}

/// Reads until the gateway closes the connection; gives what came. Fails when `limit` passes first.
async fn read_until_closed(stream: &mut tokio::net::TcpStream, limit: Duration) -> String {
    let mut answer = Vec::new();
    let read = tokio::time::timeout(limit, stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(read.is_ok(), "still open after {limit:?}, having sent {answer:?}");
    answer
}

#[tokio::test]
async fn slowloris_connections_are_all_closed_by_the_head_timeout_while_others_are_served() {
    let setup = setup();
    let address = setup.gateway.rest;
    let mut trickling = Vec::new();
    for _ in 0..500 {
        trickling.push(tokio::spawn(async move {
            let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
            stream
                .write_all(b"POST /v2/models/identity/infer HTTP/1.1\r\nhost: x\r\n")
                .await
                .unwrap();
            let started = Instant::now();
            let (mut reader, mut writer) = stream.into_split();
            let trickle = tokio::spawn(async move {
                while writer.write_all(b"x-a: b\r\n").await.is_ok() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            });
            let mut answer = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(10), reader.read_to_end(&mut answer)).await;
            trickle.abort();
            (
                read.is_ok(),
                String::from_utf8_lossy(&answer).into_owned(),
                started.elapsed(),
            )
        }));
    }
    // While they trickle, others are served.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..5 {
        served(&setup).await;
    }
    for connection in trickling {
        let (closed, answer, took) = connection.await.unwrap();
        assert!(closed, "a trickling connection was never closed");
        // Closed by the head's time limit: the trickle itself never ends.
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer} after {took:?}");
    }
    served(&setup).await;
}

#[tokio::test]
async fn a_stalled_body_gets_408_and_does_not_hold_the_backend() {
    let setup = setup();
    let before = identity_calls(&setup.server).await;
    // A small body, read whole before the backend is called: the backend never hears of it.
    let mut stream = tokio::net::TcpStream::connect(setup.gateway.rest).await.unwrap();
    stream
        .write_all(b"POST /v2/models/identity/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"inputs\":")
        .await
        .unwrap();
    let answer = read_until_closed(&mut stream, Duration::from_secs(15)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    // The pause between reads ended it (the message names which bound), not the body's end, which never comes.
    assert!(answer.contains("body_read_timeout_ms"), "{answer}");
    // A large body, relayed to the backend as it comes: its call is cut off when the client stalls.
    let mut stream = tokio::net::TcpStream::connect(setup.gateway.rest).await.unwrap();
    stream
        .write_all(b"POST /v2/models/identity/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 2000000\r\n\r\n")
        .await
        .unwrap();
    stream.write_all(&vec![b' '; 400_000]).await.unwrap();
    let answer = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert_eq!(
        identity_calls(&setup.server).await,
        before,
        "a stalled request was answered by the backend"
    );
    served(&setup).await;
}

#[tokio::test]
async fn header_bombs_are_refused_with_431_on_both_protocols() {
    let setup = setup();
    // HTTP/1.1: too many fields, each small.
    let mut head = String::from("GET /v2/health/ready HTTP/1.1\r\nhost: x\r\n");
    for i in 0..150 {
        head.push_str(&format!("x-field-{i}: {i}\r\n"));
    }
    head.push_str("\r\n");
    let mut stream = tokio::net::TcpStream::connect(setup.gateway.rest).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let answer = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    // HTTP/2 on both ports: a header list over 64 KiB is refused, and the connection's other streams go on.
    for (port, path) in [
        (setup.gateway.rest, "/v2/models/identity/infer"),
        (setup.gateway.grpc, "/inference.GRPCInferenceService/ModelInfer"),
    ] {
        let mut client = h2_client(port).await;
        let mut request = http::Request::post(format!("http://{port}{path}"));
        for i in 0..40 {
            request = request.header(format!("x-bomb-{i}"), "b".repeat(2048));
        }
        let (answer, _) = client.send_request(request.body(()).unwrap(), true).unwrap();
        match answer.await {
            Ok(response) => assert_eq!(response.status(), 431, "{port}"),
            Err(error) => assert!(error.is_reset() || error.is_go_away(), "{port}: {error}"),
        }
    }
    served(&setup).await;
}

/// An HTTP/2 client of `address` with the h2 crate itself, its connection driven on a task of its own; its result
/// is what the connection ended with.
async fn h2_client(address: SocketAddr) -> h2::client::SendRequest<Bytes> {
    let (client, _) = h2_connection(address).await;
    client
}

async fn h2_connection(
    address: SocketAddr,
) -> (
    h2::client::SendRequest<Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = tokio::net::TcpStream::connect(address).await.unwrap();
    // A large connection window, so one stream's unread answer does not hold up the others' (each stream keeps
    // HTTP/2's default window of 64 KiB).
    let (client, connection) = h2::client::Builder::new()
        .max_concurrent_reset_streams(100_000)
        .initial_connection_window_size(64 << 20)
        .handshake(tcp)
        .await
        .unwrap();
    (client, tokio::spawn(connection))
}

/// Opens streams on one connection and cancels each `pause` after its HEADERS went out, until the gateway ends the
/// connection; gives how many were opened and how the connection ended.
async fn reset_flood(port: SocketAddr, path: &str, content_type: &str, pause: Duration) -> (usize, h2::Error) {
    let (mut client, connection) = h2_connection(port).await;
    let mut opened = 0;
    let ended = loop {
        if opened == 50_000 {
            break None;
        }
        client = match client.ready().await {
            Ok(client) => client,
            Err(error) => break Some(error),
        };
        let request = http::Request::post(format!("http://{port}{path}"))
            .header("content-type", content_type)
            .body(())
            .unwrap();
        match client.send_request(request, false) {
            Ok((_, mut stream)) => {
                // The request's HEADERS go out before its reset (a stream reset before they are written is never
                // sent at all).
                tokio::task::yield_now().await;
                tokio::time::sleep(pause).await;
                stream.send_reset(h2::Reason::CANCEL);
            }
            Err(error) => break Some(error),
        }
        opened += 1;
    };
    let ended = match ended {
        Some(error) => error,
        None => tokio::time::timeout(Duration::from_secs(30), connection)
            .await
            .expect("the connection is closed")
            .unwrap()
            .expect_err("the connection ends in an error"),
    };
    (opened, ended)
}

#[tokio::test]
async fn a_rapid_reset_flood_closes_its_connection_on_both_http2_ports() {
    let setup = setup();
    let before = setup.gateway.rss() >> 20;
    for (port, path, content_type) in [
        (setup.gateway.rest, "/v2/models/identity/infer", "application/json"),
        (
            setup.gateway.grpc,
            "/inference.GRPCInferenceService/ModelInfer",
            "application/grpc",
        ),
    ] {
        // Reset as soon as sent (h2 counts streams reset before the door takes them up), and reset once the door
        // has begun each call (the door counts calls its client cancelled).
        for pause in [Duration::ZERO, Duration::from_millis(2)] {
            let (opened, ended) = reset_flood(port, path, content_type, pause).await;
            assert!(ended.is_go_away() || ended.is_io(), "{port}, {pause:?}: {ended}");
            assert!(
                opened < 5_000,
                "{port}, {pause:?}: {opened} streams opened and reset before the connection closed"
            );
            served(&setup).await;
        }
    }
    let after = setup.gateway.rss() >> 20;
    assert!(after < before + 100, "RSS went from {before} to {after} MiB");
}

/// An HTTP/2 frame: its 9-byte header (length, type, flags, stream 0) and `payload`.
fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    let length = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut frame = vec![length[1], length[2], length[3], kind, flags, 0, 0, 0, 0];
    frame.extend_from_slice(payload);
    frame
}

#[tokio::test]
async fn ping_and_settings_floods_hold_no_memory_and_stop_no_one() {
    let setup = setup();
    // Warmed by a call on each door, so their first buffers are in the baseline.
    served(&setup).await;
    let before = setup.gateway.peak_rss() >> 20;
    const PING: u8 = 6;
    const SETTINGS: u8 = 4;
    for port in [setup.gateway.rest, setup.gateway.grpc] {
        for flood in [frame(PING, 0, &[7; 8]), frame(SETTINGS, 0, &[0, 3, 0, 0, 0, 100])] {
            let mut stream = tokio::net::TcpStream::connect(port).await.unwrap();
            let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
            bytes.extend(frame(SETTINGS, 0, &[]));
            // Never read: the acknowledgements pile up on the gateway's side, if anywhere.
            // About 17 MiB of frames: their acknowledgements, kept, would be as much.
            let flood: Vec<u8> = std::iter::repeat_n(flood, 1_000_000).flatten().collect();
            bytes.extend(flood);
            let _ = tokio::time::timeout(Duration::from_secs(3), stream.write_all(&bytes)).await;
            served(&setup).await;
        }
    }
    // The peak, not the end: memory held for a flood and let go with its connection counts.
    let after = setup.gateway.peak_rss() >> 20;
    assert!(
        after < before + 8,
        "peak memory went from {before} to {after} MiB for floods of 17 MiB each"
    );
}

/// A binary-extension request for `identity` of `values` INT32 ones, asking for its answer in binary: its body and
/// its JSON header's length.
fn int32_binary_body(values: usize) -> (Bytes, String) {
    let tensor = oipgate::protocol::Tensor::new(
        "x",
        oipgate::protocol::DataType::Int32,
        vec![values as u64],
        Bytes::from(vec![1u8; 4 * values]),
    )
    .unwrap();
    let (body, headers) = common::binary_request(vec![tensor]);
    let [(_, header_length)] = headers;
    (Bytes::from(body.chunks.concat()), header_length)
}

#[tokio::test]
async fn clients_that_never_read_their_answers_hold_one_answer_each() {
    let setup = setup();
    // 32 MiB of INT32 in and out, over the gRPC backend: the gateway makes each answer whole before sending it.
    let (body, header_length) = int32_binary_body(8 << 20);
    let mut request = format!(
        "POST /v2/models/identity/versions/2/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n\
         inference-header-content-length: {header_length}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let before_calls = identity_calls(&setup.server).await;
    let before = setup.gateway.rss() >> 20;
    let mut idle = Vec::new();
    for _ in 0..3 {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        socket.connect(&setup.gateway.rest.into()).unwrap();
        socket.set_nonblocking(true).unwrap();
        let mut stream = tokio::net::TcpStream::from_std(socket.into()).unwrap();
        let pipelined = [request.clone(), request.clone(), request.clone()].concat();
        // Three requests pipelined, none of the answers read.
        idle.push(tokio::spawn(async move {
            let _ = stream.write_all(&pipelined).await;
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(stream);
        }));
    }
    common::eventually(
        Duration::from_secs(20),
        "the first request of each to be answered",
        || async { identity_calls(&setup.server).await >= before_calls + 3 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // One answer per connection, waiting for its reader: the requests behind it are not taken up.
    assert_eq!(identity_calls(&setup.server).await, before_calls + 3);
    let after = setup.gateway.rss() >> 20;
    assert!(after < before + 3 * 160, "RSS went from {before} to {after} MiB");
    served(&setup).await;
    for connection in idle {
        connection.abort();
    }
}

/// Sends a binary-extension `identity` request (see [`int32_binary_body`]) on an HTTP/2 connection of the REST
/// door; gives its answer to come.
async fn send_identity(
    client: &mut h2::client::SendRequest<Bytes>,
    rest: SocketAddr,
    header_length: &str,
    body: Bytes,
) -> h2::client::ResponseFuture {
    *client = client.clone().ready().await.unwrap();
    let request = http::Request::post(format!("http://{rest}/v2/models/identity/infer"))
        .header("content-type", "application/octet-stream")
        .header("inference-header-content-length", header_length)
        .body(())
        .unwrap();
    let (answer, mut stream) = client.send_request(request, false).unwrap();
    stream.send_data(body, true).unwrap();
    answer
}

#[tokio::test]
async fn an_http2_client_that_reads_no_answers_holds_no_more_than_its_budget() {
    let server = ModelServerProcess::both();
    let gateway = GatewayProcess::start(&format!(
        "[limits]\nmax_buffered_answer_bytes = 20000000\n{}\n[[models]]\nname = \"identity\"\nversions = [ {{ version = \"1\", backend = \"grpc\" }} ]\n",
        backend("grpc", "grpc", [server.grpc.unwrap()]),
    ));
    // 8 MB answers, made whole by the gateway (translated from the gRPC backend), none of them read: two fit in
    // the budget, the rest are refused.
    let values: usize = 2_000_000;
    let (body, header_length) = int32_binary_body(values);
    let mut client = h2_client(gateway.rest).await;
    let mut answers = Vec::new();
    for _ in 0..6 {
        answers.push(send_identity(&mut client, gateway.rest, &header_length, body.clone()).await);
    }
    let mut held = Vec::new();
    let mut refused = 0;
    for answer in answers {
        let response = tokio::time::timeout(Duration::from_secs(30), answer)
            .await
            .unwrap()
            .unwrap();
        match response.status().as_u16() {
            // Kept, its body never read.
            200 => held.push(response),
            429 => refused += 1,
            other => panic!("status {other}"),
        }
    }
    assert_eq!((held.len(), refused), (2, 4));
    // Reading one answer gives its place back.
    let mut read = held.pop().unwrap().into_body();
    while let Some(chunk) = read.data().await {
        let chunk = chunk.unwrap();
        let _ = read.flow_control().release_capacity(chunk.len());
    }
    let answer = send_identity(&mut client, gateway.rest, &header_length, body).await;
    assert_eq!(answer.await.unwrap().status(), 200);

    // The gRPC door: the same, an answer refused past the budget being a trailers-only RESOURCE_EXHAUSTED.
    let mut request = common::grpc_int32_request("identity", "1");
    request.inputs[0].shape = vec![values as i64];
    request.inputs[0].contents = None;
    request.raw_input_contents = vec![Bytes::from(vec![1u8; 4 * values])];
    let message = prost::Message::encode_to_vec(&request);
    let mut framed = vec![0u8];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(&message);
    let framed = Bytes::from(framed);
    let mut client = h2_client(gateway.grpc).await;
    let mut answers = Vec::new();
    for _ in 0..6 {
        client = client.ready().await.unwrap();
        let request = http::Request::post(format!(
            "http://{}/inference.GRPCInferenceService/ModelInfer",
            gateway.grpc
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
        let (answer, mut stream) = client.send_request(request, false).unwrap();
        stream.send_data(framed.clone(), true).unwrap();
        answers.push(answer);
    }
    let mut statuses = Vec::new();
    let mut held = Vec::new();
    for answer in answers {
        let response = tokio::time::timeout(Duration::from_secs(30), answer)
            .await
            .unwrap()
            .unwrap();
        match response.headers().get("grpc-status") {
            Some(status) => statuses.push(status.to_str().unwrap().to_owned()),
            None => held.push(response),
        }
    }
    assert_eq!((held.len(), statuses), (2, vec!["8".to_owned(); 4]));
}
