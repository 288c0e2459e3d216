//! Writing requests to a backend: bodies with and after the head, chunked, passthrough headers, the head's buffer.

use super::*;

#[tokio::test]
async fn an_answer_before_the_whole_body_is_taken_and_the_rest_not_sent() {
    // The backend answers 413 on reading the head, and never reads the 32 MiB body: the request would block
    // for ever were the answer only read after the body was written.
    let (upstream, _, accepted) = scripted(|_, _| Script {
        before_body: true,
        ..answer(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 8\r\n\r\ntoo long")
    })
    .await;
    let body = vec![Bytes::from(vec![b'x'; 32 << 20])];
    let answered = upstream
        .send(
            Method::POST,
            "/v2/models/m/infer",
            &HeaderMap::new(),
            body,
            Some(Duration::from_secs(10)),
        )
        .await
        .unwrap();
    assert_eq!(answered.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(&answered.body[..], b"too long");
    // The connection is mid-request: the next request takes a new one.
    assert_eq!(
        get(&upstream, Method::GET).await.unwrap().status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_body_of_unknown_length_goes_chunked() {
    use http_body_util::BodyExt;
    let (upstream, received, _) = scripted(|_, _| answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")).await;
    let (sender, chunks) = tokio::sync::mpsc::channel(4);
    let feeding = tokio::spawn(async move {
        for part in [&b"first "[..], b"second ", b"third"] {
            sender.send(Bytes::from_static(part)).await.unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let answered = post(&upstream, OutBody::Channel(crate::body::ChannelBody::new(chunks)))
        .await
        .unwrap();
    assert_eq!(&answered.into_body().collect().await.unwrap().to_bytes()[..], b"ok");
    feeding.await.unwrap();
    let (head, body) = received.lock().unwrap()[0].clone();
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    assert_eq!(body, b"first second third");
}

#[tokio::test]
async fn a_small_body_goes_with_its_head_and_a_larger_one_after_it() {
    let (upstream, received, _) = scripted(|_, _| answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")).await;
    let large = vec![b'x'; GATHERED_BODY + 1];
    for chunks in [
        vec![Bytes::from_static(b"{\"inputs\":"), Bytes::from_static(b"[]}")],
        vec![
            Bytes::copy_from_slice(&large[..100]),
            Bytes::copy_from_slice(&large[100..]),
        ],
    ] {
        let sent: Vec<u8> = chunks.concat();
        let answered = post(&upstream, OutBody::Chunks(crate::body::ChunksBody::new(chunks)))
            .await
            .unwrap();
        assert_eq!(answered.status(), StatusCode::OK);
        let (head, body) = received.lock().unwrap().pop().unwrap();
        assert!(head.contains(&format!("content-length: {}", sent.len())), "{head}");
        assert_eq!(body, sent);
    }
}

#[test]
fn a_body_within_the_gathered_size_is_written_into_the_head() {
    writing_heads(|kept| {
        let (method, path, host) = (
            Method::POST,
            PathAndQuery::from_static("/p"),
            HeaderValue::from_static("h"),
        );
        let headers = HeaderMap::new();
        let request = |chunks: Vec<Bytes>| Request {
            method: &method,
            path: &path,
            host: &host,
            headers: [&headers, &headers],
            passed: None,
            body: OutBody::Chunks(crate::body::ChunksBody::new(chunks)),
            began: None,
        };
        let small = request(vec![Bytes::from_static(b"ab"), Bytes::from_static(b"cd")]);
        assert_eq!(kept.write_head(&small, Sending::of(&method, &small.body)), 2);
        assert!(kept.head.ends_with(b"content-length: 4\r\n\r\nabcd"));
        let large = request(vec![Bytes::from(vec![b'x'; GATHERED_BODY + 1])]);
        assert_eq!(kept.write_head(&large, Sending::of(&method, &large.body)), 0);
        assert!(kept.head.ends_with(b"\r\n\r\n"));
    });
}

/// A request's `user-agent` is the client's, passed on; a passthrough from a client that named none carries none, as
/// through any proxy; a request the gateway writes itself names the gateway, unless it carries a name.
#[test]
fn the_user_agent_is_the_clients_or_the_gateways_own_calls() {
    writing_heads(|kept| {
        let (method, path, host) = (
            Method::POST,
            PathAndQuery::from_static("/p"),
            HeaderValue::from_static("h"),
        );
        let mut agent = |client: &HeaderMap, passthrough: bool| {
            let read = crate::headers::RequestHeaders::read(client);
            let passed = read.passed_on();
            let empty = HeaderMap::new();
            let request = Request {
                method: &method,
                path: &path,
                host: &host,
                headers: [if passthrough { &empty } else { client }, &empty],
                passed: passthrough.then_some(&passed),
                body: OutBody::Chunks(crate::body::ChunksBody::new(vec![Bytes::from_static(b"{}")])),
                began: None,
            };
            kept.write_head(&request, Sending::of(&method, &request.body));
            let head = String::from_utf8(kept.head.clone()).unwrap();
            let agents: Vec<String> = head
                .split("\r\n")
                .filter_map(|line| line.strip_prefix("user-agent: "))
                .map(str::to_owned)
                .collect();
            agents
        };
        let mut named = HeaderMap::new();
        named.insert("user-agent", HeaderValue::from_static("tritonclient/2.51"));
        let unnamed = HeaderMap::new();
        let own = concat!("oipgate/", env!("CARGO_PKG_VERSION"));
        assert_eq!(agent(&named, true), ["tritonclient/2.51"]);
        assert!(agent(&unnamed, true).is_empty());
        assert_eq!(agent(&named, false), ["tritonclient/2.51"]);
        assert_eq!(agent(&unnamed, false), [own]);
    });
}

/// Runs `write` with a connection whose buffer its heads are written into (its peer, a listener, never reads them).
fn writing_heads(write: impl FnOnce(&mut PooledConnection)) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let io = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        write(&mut PooledConnection::new(Io::Plain(io)));
    });
}

/// A passthrough's headers are written from the client's: its end-to-end ones and the gateway's own, each giving way
/// to the try's trace context and to the operator's headers of the same name.
#[test]
fn a_passthrough_writes_the_clients_headers_under_the_gateways() {
    writing_heads(|kept| {
        let (method, path, host) = (
            Method::POST,
            PathAndQuery::from_static("/p"),
            HeaderValue::from_static("h"),
        );
        let mut client = HeaderMap::new();
        for (name, value) in [
            ("host", "client.example"),
            ("connection", "x-hop"),
            ("x-hop", "1"),
            ("traceparent", "00-client"),
            ("x-tenant", "client"),
            ("authorization", "Bearer t"),
            ("user-agent", "tritonclient/2.51"),
            ("content-type", "application/json"),
            ("content-length", "2"),
            ("grpc-timeout", "1S"),
        ] {
            client.append(name, HeaderValue::from_static(value));
        }
        let read = crate::headers::RequestHeaders::read(&client);
        let json = HeaderValue::from_static("application/json");
        let passed = read.passed_on().about_body([Some(&json), None, None, None, None]);
        let mut carried = HeaderMap::new();
        carried.insert("traceparent", HeaderValue::from_static("00-gateway"));
        let mut added = HeaderMap::new();
        added.insert("x-tenant", HeaderValue::from_static("operator"));
        let mut write = |added: &HeaderMap| {
            let request = Request {
                method: &method,
                path: &path,
                host: &host,
                headers: [&carried, added],
                passed: Some(&passed),
                body: OutBody::Chunks(crate::body::ChunksBody::new(vec![Bytes::from_static(b"{}")])),
                began: None,
            };
            kept.write_head(&request, Sending::of(&method, &request.body));
            let head = String::from_utf8(kept.head.clone()).unwrap();
            let (head, body) = head.split_once("\r\n\r\n").unwrap();
            assert_eq!(body, "{}");
            let mut lines: Vec<String> = head.split("\r\n").skip(1).map(str::to_owned).collect();
            lines.sort_unstable();
            lines
        };
        let made = format!("x-request-id: {}", read.request_id.to_str().unwrap());
        let expected = |id: &str| {
            let mut lines: Vec<String> = [
                "authorization: Bearer t",
                "content-length: 2",
                "content-type: application/json",
                "host: h",
                "traceparent: 00-gateway",
                "user-agent: tritonclient/2.51",
                "x-tenant: operator",
                id,
            ]
            .map(str::to_owned)
            .into();
            lines.sort_unstable();
            lines
        };
        assert_eq!(write(&added), expected(&made));
        // The operator's request id takes the place of the one the gateway made.
        added.insert("x-request-id", HeaderValue::from_static("operator-id"));
        assert_eq!(write(&added), expected("x-request-id: operator-id"));
    });
}

#[tokio::test(flavor = "current_thread")]
async fn a_written_head_gives_its_buffer_back_to_the_thread_before_the_answer_comes() {
    use crate::codec::http1::scratch;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (read_tx, read_rx) = tokio::sync::oneshot::channel();
    let (answer_tx, answer_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut buffer = vec![0u8; 4096];
        let mut read = 0;
        while !buffer[..read].ends_with(b"{}") {
            read += socket.read(&mut buffer[read..]).await.unwrap();
        }
        read_tx.send(()).unwrap();
        answer_rx.await.unwrap();
        socket
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .await
            .unwrap();
    });
    let endpoint = crate::config::Endpoint {
        host: address.ip().to_string(),
        port: address.port(),
    };
    let upstream = crate::upstream::RestUpstream::new(&endpoint, Duration::from_secs(2), 1024, None);
    // The thread's buffer, which the request's head is written in.
    let thread_buffer = scratch::take();
    let place = thread_buffer.as_ptr();
    scratch::give(thread_buffer);
    let exchange = post(
        &upstream,
        OutBody::from(crate::body::ChunksBody::new(vec![Bytes::from_static(b"{}")])),
    );
    let mut exchange = std::pin::pin!(exchange);
    tokio::select! {
        _ = exchange.as_mut() => panic!("answered before the backend was told to"),
        read = read_rx => read.unwrap(),
    }
    // The request is written and its answer not yet come: the buffer is the thread's again, for another head.
    let again = scratch::take();
    assert_eq!(again.as_ptr(), place, "the head's buffer is back before the answer");
    let capacity = again.capacity();
    scratch::give(again);
    answer_tx.send(()).unwrap();
    let answer = exchange.await.unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    // Given back once only: the thread's buffer is still the one it had (were it freed, this would likely be given
    // its place).
    let decoy: Vec<u8> = Vec::with_capacity(capacity);
    let kept = scratch::take();
    assert_eq!(kept.as_ptr(), place);
    drop(decoy);
}
