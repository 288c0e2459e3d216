//! The REST upstream client against the built-in model server: JSON and binary-extension inference, metadata and
//! health, backend errors kept, readiness, a backend that is down.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::ports::dead_endpoint;
use common::{ModelServerProcess, int32s};
use http::{HeaderMap, Method};
use oipgate::body::ChunksBody;
use oipgate::codec::rest::{self, BINARY_DATA_OUTPUT};
use oipgate::protocol::{DataType, InferRequest, ParamValue, Tensor};
use oipgate::upstream::RestUpstream;
use oipgate::{ErrorKind, Origin};

/// A REST-only model server started with `more` arguments, and an upstream client of it.
fn upstream(more: &[&str]) -> (ModelServerProcess, RestUpstream) {
    let server = ModelServerProcess::rest_only(more);
    let endpoint = common::endpoint(server.rest.unwrap());
    let client = RestUpstream::new(&endpoint, Duration::from_secs(2), 1 << 30, None);
    (server, client)
}

fn add_sub() -> InferRequest {
    InferRequest {
        id: Some("q".into()),
        inputs: vec![
            Tensor::new("INPUT0", DataType::Int32, vec![1, 16], int32s(0..16)).unwrap(),
            Tensor::new("INPUT1", DataType::Int32, vec![1, 16], int32s([3; 16])).unwrap(),
        ],
        ..InferRequest::default()
    }
}

#[tokio::test]
async fn inference_as_json_and_as_binary() {
    let (_server, client) = upstream(&[]);
    let json = client
        .infer(
            "add_sub",
            Some("1"),
            rest::encode_request(&add_sub(), false).unwrap(),
            &HeaderMap::new(),
            None,
        )
        .await
        .unwrap()
        .value;
    assert_eq!(json.model_version.as_deref(), Some("1"));
    assert_eq!(json.id.as_deref(), Some("q"));
    assert_eq!(json.outputs[0].data, int32s(3..19));

    let mut binary_request = add_sub();
    binary_request
        .parameters
        .insert(BINARY_DATA_OUTPUT.into(), ParamValue::Bool(true));
    let binary = rest::encode_request(&binary_request, true).unwrap();
    assert!(binary.header_length.is_some());
    let answer = client
        .infer("add_sub", None, binary, &HeaderMap::new(), None)
        .await
        .unwrap()
        .value;
    assert_eq!(answer.model_version.as_deref(), Some("2"));
    assert_eq!(answer.outputs[1].data, int32s(-3..13));
    assert!(
        answer.outputs.iter().all(|o| o.parameters.is_empty()),
        "binary_data_size is consumed"
    );
}

#[tokio::test]
async fn errors_keep_status_and_message() {
    let (_server, client) = upstream(&[]);
    let error = client
        .infer(
            "nope",
            None,
            rest::encode_request(&add_sub(), false).unwrap(),
            &HeaderMap::new(),
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(
        (error.http_status().as_u16(), error.message()),
        (404, "Request for unknown model: 'nope' is not found")
    );
    assert_eq!(error.origin(), Origin::Upstream);
    let mut bad = add_sub();
    bad.inputs[1].shape = vec![16];
    let error = client
        .infer(
            "add_sub",
            None,
            rest::encode_request(&bad, false).unwrap(),
            &HeaderMap::new(),
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(error.grpc_code(), tonic::Code::InvalidArgument);
    assert!(error.message().contains("input 'INPUT1'"), "{}", error.message());
}

#[tokio::test]
async fn metadata_and_readiness() {
    let (_server, client) = upstream(&["--name", "backend-x"]);
    assert_eq!(client.server_metadata(None).await.unwrap().name, "backend-x");
    let metadata = client.model_metadata("add_sub", Some("1"), None).await.unwrap();
    assert_eq!(metadata.versions, ["1", "2"]);
    assert!(client.server_ready(None).await.unwrap().ready);
    assert!(client.model_ready("add_sub", None, None).await.unwrap().ready);
    let unload = client
        .send(
            Method::POST,
            "/v2/repository/models/add_sub/unload",
            &HeaderMap::new(),
            Vec::new(),
            None,
        )
        .await
        .unwrap();
    assert_eq!(unload.status, 200);
    assert!(!client.model_ready("add_sub", Some("2"), None).await.unwrap().ready);
    assert!(!client.server_ready(None).await.unwrap().ready);
    let unknown = client.model_ready("nope", None, None).await.unwrap_err();
    assert_eq!(unknown.http_status().as_u16(), 404);
    let error = client.model_metadata("add_sub", Some("5"), None).await.unwrap_err();
    assert_eq!(error.http_status().as_u16(), 404);
}

#[tokio::test]
async fn deadline_and_a_backend_that_is_down() {
    let (_server, client) = upstream(&[]);
    let mut slow = InferRequest {
        inputs: vec![Tensor::new("x", DataType::Int8, vec![1], Bytes::from_static(&[1])).unwrap()],
        ..InferRequest::default()
    };
    slow.parameters.insert("delay_ms".into(), ParamValue::Int64(5_000));
    // Let run, the call would succeed after its five seconds: the 504 is the deadline's.
    let error = client
        .infer(
            "slow",
            None,
            rest::encode_request(&slow, false).unwrap(),
            &HeaderMap::new(),
            Some(Duration::from_millis(200)),
        )
        .await
        .unwrap_err();
    assert_eq!((error.kind(), error.http_status().as_u16()), (ErrorKind::Timeout, 504));

    let dead = dead_endpoint();
    let down = RestUpstream::new(&dead.endpoint(), Duration::from_secs(1), 1024, None);
    let error = down.server_ready(Some(Duration::from_secs(5))).await.unwrap_err();
    assert_eq!(
        (error.kind(), error.http_status().as_u16()),
        (ErrorKind::BadGateway, 502)
    );
}

/// A backend that answers every request with `ok`. When `drops_first`, it answers the first request of its first
/// connection, then closes that connection when the next request arrives on it, unanswered (as a server that drops
/// a kept-alive connection without saying so). Gives its address and how many connections it accepted.
async fn counting_backend(drops_first: bool) -> (std::net::SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let first = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 && drops_first;
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 4096];
                loop {
                    match socket.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                    socket
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await
                        .unwrap();
                    if first {
                        // The next request is read, then the connection dropped without an answer.
                        let _ = socket.read(&mut buffer).await;
                        return;
                    }
                }
            });
        }
    });
    (address, accepted)
}

#[tokio::test]
async fn a_kept_alive_connection_the_backend_dropped_is_replaced_once() {
    let (address, accepted) = counting_backend(true).await;
    let client = RestUpstream::new(&common::endpoint(address), Duration::from_secs(2), 1 << 20, None);
    for _ in 0..2 {
        let answer = client
            .send(
                Method::POST,
                "/v2/models/m/infer",
                &HeaderMap::new(),
                vec![Bytes::from_static(b"{}")],
                None,
            )
            .await
            .unwrap();
        assert_eq!((answer.status.as_u16(), &answer.body[..]), (200, &b"ok"[..]));
    }
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "the second request went out again"
    );
}

#[tokio::test]
async fn connections_are_kept_and_one_whose_answer_was_not_read_is_not() {
    let (address, accepted) = counting_backend(false).await;
    let client = RestUpstream::new(&common::endpoint(address), Duration::from_secs(2), 1 << 20, None);
    let empty = HeaderMap::new();
    let ask = || {
        client.send(
            Method::POST,
            "/v2/models/m/infer",
            &empty,
            vec![Bytes::from_static(b"{}")],
            None,
        )
    };
    for _ in 0..20 {
        assert_eq!(&ask().await.unwrap().body[..], b"ok");
    }
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one connection for all"
    );
    // An answer let go before its body was read leaves its connection mid-message: it is closed, not kept.
    let path = http::uri::PathAndQuery::from_static("/v2/models/m/infer");
    let head = client
        .forward(
            &path,
            &HeaderMap::new(),
            None,
            ChunksBody::new(vec![Bytes::from_static(b"{}")]).into(),
            oipgate::upstream::Deadline::after(Duration::from_secs(2)),
        )
        .await
        .unwrap();
    drop(head);
    assert_eq!(&ask().await.unwrap().body[..], b"ok");
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
}
