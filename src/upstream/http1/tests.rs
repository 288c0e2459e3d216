//! The backend client against loopback backends that answer as each test scripts them.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Waker};

use bytes::Bytes;
use http::StatusCode;
use http::header::CONTENT_LENGTH;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::answer::{MOST_HEAD, MOST_HEADERS};
use super::*;
use crate::codec::http1::{GATHERED_BODY, MOST_CHUNK_FRAMING, PLACED};

/// A backend answering `ok` to every request; gives its address and how many of its connections are open.
async fn backend() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let open = Arc::new(AtomicUsize::new(0));
    let counted = open.clone();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            counted.fetch_add(1, Ordering::SeqCst);
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 4096];
                while let Ok(read @ 1..) = socket.read(&mut buffer).await {
                    let _ = read;
                    let _ = socket
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                }
                counted.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    (address, open)
}

/// A client of [`backend`], and how many of the backend's connections are open.
async fn upstream_to_backend() -> (crate::upstream::RestUpstream, Arc<AtomicUsize>) {
    let (address, open) = backend().await;
    let endpoint = crate::config::Endpoint {
        host: address.ip().to_string(),
        port: address.port(),
    };
    let upstream = crate::upstream::RestUpstream::new(&endpoint, Duration::from_secs(2), 1024, None);
    (upstream, open)
}

#[tokio::test(flavor = "current_thread")]
async fn a_request_on_a_kept_connection_wakes_its_task_only_when_the_answer_arrives() {
    use http_body_util::BodyExt;
    let (upstream, _) = upstream_to_backend().await;
    let exchange = || async {
        let answer = upstream
            .forward(
                &PathAndQuery::from_static("/v2/models/m/infer"),
                &HeaderMap::new(),
                None,
                OutBody::from(crate::body::ChunksBody::new(vec![Bytes::from_static(b"{}")])),
                crate::upstream::Deadline::after(Duration::from_secs(2)),
            )
            .await
            .unwrap();
        answer.into_body().collect().await.unwrap().to_bytes()
    };
    // The first request makes the connection; the second goes on it, kept.
    assert_eq!(&exchange().await[..], b"ok");
    let count = WakeCount::default();
    assert_eq!(&count.polling(exchange()).await[..], b"ok");
    // Handing the request over and taking the answer and its body from the connection are done within the
    // task's own polls: only the backend's bytes arriving wake it.
    assert_eq!(count.wakes(), 1);
}

#[tokio::test]
async fn connections_idle_too_long_are_closed_by_the_sweep() {
    let (upstream, open) = upstream_to_backend().await;
    let answer = upstream
        .send(Method::GET, "/v2/health/ready", &HeaderMap::new(), Vec::new(), None)
        .await
        .unwrap();
    assert_eq!(&answer.body[..], b"ok");
    assert_eq!(open.load(Ordering::SeqCst), 1, "the connection is kept");
    // Swept now, the connection is young and stays; swept past the idle limit, it is closed.
    crate::upstream::sweep_idle(Instant::now());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(open.load(Ordering::SeqCst), 1);
    crate::upstream::sweep_idle(Instant::now() + IDLE_LIMIT + Duration::from_secs(1));
    for _ in 0..200 {
        if open.load(Ordering::SeqCst) == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the idle connection was not closed");
}
/// How a scripted backend answers the `index`th request on its `connection`th connection: the bytes to send (in
/// pieces of `piece` bytes, 0 for all at once), and whether to close the connection after them.
struct Script {
    answer: Vec<u8>,
    piece: usize,
    close: bool,
    /// Answer after reading only the head, leaving the body unread.
    before_body: bool,
}

fn answer(bytes: &[u8]) -> Script {
    Script {
        answer: bytes.to_vec(),
        piece: 0,
        close: false,
        before_body: false,
    }
}

/// A request as a scripted backend read it: its head, and its body de-chunked.
type Received = Arc<std::sync::Mutex<Vec<(String, Vec<u8>)>>>;

/// Reads one request (its head, then its body by length or chunks) from `socket`; `None` at the end.
async fn read_request(
    socket: &mut tokio::net::TcpStream,
    buffer: &mut Vec<u8>,
    with_body: bool,
) -> Option<(String, Vec<u8>)> {
    async fn more(socket: &mut tokio::net::TcpStream, buffer: &mut Vec<u8>) -> Option<()> {
        let mut chunk = [0u8; 65536];
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => None,
            Ok(read) => {
                buffer.extend_from_slice(&chunk[..read]);
                Some(())
            }
        }
    }
    let end = loop {
        if let Some(end) = memchr::memmem::find(buffer, b"\r\n\r\n") {
            break end + 4;
        }
        more(socket, buffer).await?;
    };
    let head = String::from_utf8_lossy(&buffer[..end]).to_lowercase();
    buffer.drain(..end);
    let mut body = Vec::new();
    if !with_body {
        return Some((head, body));
    }
    if let Some(length) = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length: "))
        .and_then(|length| length.trim().parse::<usize>().ok())
    {
        while buffer.len() < length {
            more(socket, buffer).await?;
        }
        body = buffer.drain(..length).collect();
    } else if head.contains("transfer-encoding: chunked") {
        loop {
            let line = loop {
                if let Some(line) = memchr::memmem::find(buffer, b"\r\n") {
                    break line;
                }
                more(socket, buffer).await?;
            };
            let size = usize::from_str_radix(std::str::from_utf8(&buffer[..line]).unwrap(), 16).unwrap();
            buffer.drain(..line + 2);
            while buffer.len() < size + 2 {
                more(socket, buffer).await?;
            }
            body.extend(buffer.drain(..size));
            buffer.drain(..2);
            if size == 0 {
                break;
            }
        }
    }
    Some((head, body))
}

/// A backend answering as `script` says for each connection and request; gives a client of it, the requests it
/// read, and how many connections it accepted.
async fn scripted(
    script: impl Fn(usize, usize) -> Script + Send + Sync + 'static,
) -> (crate::upstream::RestUpstream, Received, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let received = Received::default();
    let script = Arc::new(script);
    let (counted, noted) = (accepted.clone(), received.clone());
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let connection = counted.fetch_add(1, Ordering::SeqCst);
            let (script, noted) = (script.clone(), noted.clone());
            tokio::spawn(async move {
                let mut buffer = Vec::new();
                for index in 0.. {
                    let step = script(connection, index);
                    let Some(request) = read_request(&mut socket, &mut buffer, !step.before_body).await else {
                        return;
                    };
                    noted.lock().unwrap().push(request);
                    let piece = if step.piece == 0 {
                        step.answer.len().max(1)
                    } else {
                        step.piece
                    };
                    for bytes in step.answer.chunks(piece) {
                        if socket.write_all(bytes).await.is_err() {
                            return;
                        }
                        if step.piece > 0 {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                    if step.close {
                        return;
                    }
                }
            });
        }
    });
    let endpoint = crate::config::Endpoint {
        host: address.ip().to_string(),
        port: address.port(),
    };
    let upstream = crate::upstream::RestUpstream::new(&endpoint, Duration::from_secs(2), 1 << 20, None);
    (upstream, received, accepted)
}

async fn get(
    upstream: &crate::upstream::RestUpstream,
    method: Method,
) -> crate::error::Result<super::super::rest::RestAnswer> {
    upstream
        .send(
            method,
            "/v2/models/m",
            &HeaderMap::new(),
            Vec::new(),
            Some(Duration::from_secs(2)),
        )
        .await
}

#[tokio::test]
async fn an_answer_framed_both_ways_is_read_by_its_chunks_and_its_connection_not_kept() {
    let (upstream, _, accepted) = scripted(|_, _| {
        answer(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 99\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    })
    .await;
    for _ in 0..2 {
        let answered = get(&upstream, Method::GET).await.unwrap();
        assert_eq!(&answered.body[..], b"hello");
        // The length beside the chunks is not passed on as the answer's.
        assert!(answered.headers.get(CONTENT_LENGTH).is_none());
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "RFC 9112 §6.3: the connection is not kept"
    );
}

#[tokio::test]
async fn a_chunked_answer_in_pieces_is_read_whole_and_its_connection_kept() {
    let (upstream, received, accepted) = scripted(|_, _| Script {
        piece: 3,
        ..answer(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
              5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n",
        )
    })
    .await;
    for _ in 0..2 {
        let answered = get(&upstream, Method::GET).await.unwrap();
        assert_eq!(&answered.body[..], b"hello world");
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "the connection is kept between the two"
    );
    let (head, _) = received.lock().unwrap()[0].clone();
    assert!(
        head.starts_with("get /v2/models/m http/1.1\r\nhost: 127.0.0.1:"),
        "{head}"
    );
    assert!(head.contains("user-agent: oipgate/"), "{head}");
    assert!(
        !head.contains("content-length"),
        "a GET without a body says no length: {head}"
    );
}

#[tokio::test]
async fn interim_answers_are_skipped_and_bodiless_answers_end_at_their_head() {
    let (upstream, _, accepted) = scripted(|_, index| match index {
        0 => answer(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
        1 => answer(b"HTTP/1.1 204 No Content\r\n\r\n"),
        _ => answer(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"),
    })
    .await;
    assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"ok");
    let empty = get(&upstream, Method::GET).await.unwrap();
    assert_eq!(empty.status, StatusCode::NO_CONTENT);
    assert!(empty.body.is_empty());
    // A HEAD's answer has no body whatever its length says.
    let head = get(&upstream, Method::HEAD).await.unwrap();
    assert!(head.body.is_empty());
    assert_eq!(head.headers[CONTENT_LENGTH], "5");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_answer_that_closes_its_connection_is_read_and_the_connection_not_kept() {
    let (upstream, _, accepted) = scripted(|connection, _| match connection {
        0 => answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"),
        // No length: the body is what comes until the backend closes.
        _ => Script {
            close: true,
            ..answer(b"HTTP/1.1 200 OK\r\n\r\nall of it")
        },
    })
    .await;
    assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"ok");
    assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"all of it");
    assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"all of it");
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_kept_connection_the_backend_closed_under_a_request_is_replaced() {
    // The first connection answers once, then reads the next request and closes without a word (MLServer after
    // a 500); the request goes again on a new connection.
    let (upstream, received, accepted) = scripted(|connection, index| match (connection, index) {
        (0, 1) => Script {
            close: true,
            ..answer(b"")
        },
        _ => answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
    })
    .await;
    let body = || vec![Bytes::from_static(b"{\"inputs\":[]}")];
    for _ in 0..2 {
        let answered = upstream
            .send(Method::POST, "/v2/models/m/infer", &HeaderMap::new(), body(), None)
            .await
            .unwrap();
        assert_eq!(&answered.body[..], b"ok");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    let received = received.lock().unwrap();
    assert_eq!(received.len(), 3, "the second request was read twice");
    assert!(
        received
            .iter()
            .all(|(head, body)| head.contains("content-length: 13") && body == b"{\"inputs\":[]}")
    );
}

#[tokio::test]
async fn broken_answers_are_errors_naming_what_is_wrong() {
    let cases: [(&[u8], &str); 10] = [
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "malformed answer head"),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok",
            "two different Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
            "invalid Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            "malformed chunked framing",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nokay\r\n",
            "malformed chunked framing",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
            "closed before the answer's end",
        ),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switching protocols"),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            "transfer coding other than chunked",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, chunked\r\n\r\n0\r\n\r\n",
            "chunked more than once",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\nx-trailer: 1\n\r\n",
            "malformed chunked framing",
        ),
    ];
    for (sent, named) in cases {
        let (upstream, _, _) = scripted(move |_, _| Script {
            close: true,
            ..answer(sent)
        })
        .await;
        let error = get(&upstream, Method::GET).await.unwrap_err();
        assert!(
            error.message().contains(named),
            "{:?}: {}",
            String::from_utf8_lossy(sent),
            error.message()
        );
    }
    // Trailers without end, in a line too long to be let through.
    let endless = [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx-long: ".as_slice(),
        &vec![b'a'; MOST_CHUNK_FRAMING],
    ]
    .concat();
    let (upstream, _, _) = scripted(move |_, _| answer(&endless)).await;
    let error = get(&upstream, Method::GET).await.unwrap_err();
    assert!(
        error.message().contains("chunk extensions or trailers"),
        "{}",
        error.message()
    );
    let long_head = [
        b"HTTP/1.1 200 OK\r\nx-long: ".as_slice(),
        &vec![b'a'; MOST_HEAD],
        b"\r\n\r\n",
    ]
    .concat();
    let (upstream, _, _) = scripted(move |_, _| answer(&long_head)).await;
    let error = get(&upstream, Method::GET).await.unwrap_err();
    assert!(error.message().contains("answer head over"), "{}", error.message());
}

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
    let answered = upstream
        .forward(
            &PathAndQuery::from_static("/v2/models/m/infer"),
            &HeaderMap::new(),
            None,
            OutBody::Channel(crate::body::ChannelBody::new(chunks)),
            crate::upstream::Deadline::after(Duration::from_secs(2)),
        )
        .await
        .unwrap();
    assert_eq!(&answered.into_body().collect().await.unwrap().to_bytes()[..], b"ok");
    feeding.await.unwrap();
    let (head, body) = received.lock().unwrap()[0].clone();
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    assert_eq!(body, b"first second third");
}
#[tokio::test]
async fn an_answer_keeps_all_its_headers_up_to_the_limit() {
    let many = |count: usize| {
        let mut head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n".to_vec();
        for index in 1..count {
            head.extend_from_slice(format!("x-header-{index}: value {index}\r\n").as_bytes());
        }
        head.extend_from_slice(b"\r\nok");
        head
    };
    // More than the places noted on the stack: the head is read again for the rest.
    for count in [PLACED, PLACED + 1, MOST_HEADERS] {
        let sent = many(count);
        let (upstream, _, _) = scripted(move |_, _| answer(&sent)).await;
        let answered = get(&upstream, Method::GET).await.unwrap();
        assert_eq!(answered.headers.len(), count);
        assert_eq!(
            answered.headers[format!("x-header-{}", count - 1)],
            format!("value {}", count - 1)
        );
        assert_eq!(&answered.body[..], b"ok");
    }
    let sent = many(MOST_HEADERS + 1);
    let (upstream, _, _) = scripted(move |_, _| answer(&sent)).await;
    let error = get(&upstream, Method::GET).await.unwrap_err();
    assert!(error.message().contains("more than 100 headers"), "{}", error.message());
}

/// Counts the wakes of the task that polls a future through it.
#[derive(Debug, Default, Clone)]
struct WakeCount(Arc<WakeCounter>);

#[derive(Debug, Default)]
struct WakeCounter {
    wakes: AtomicUsize,
    task: std::sync::Mutex<Option<Waker>>,
}

impl std::task::Wake for WakeCounter {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        if let Some(task) = self.task.lock().unwrap().as_ref() {
            task.wake_by_ref();
        }
    }
}

impl WakeCount {
    fn wakes(&self) -> usize {
        self.0.wakes.load(Ordering::SeqCst)
    }

    /// Polls `future` to its end, counting its task's wakes.
    async fn polling<F: Future>(&self, future: F) -> F::Output {
        let mut future = std::pin::pin!(future);
        let waker = Waker::from(self.0.clone());
        std::future::poll_fn(|cx| {
            *self.0.task.lock().unwrap() = Some(cx.waker().clone());
            future.as_mut().poll(&mut Context::from_waker(&waker))
        })
        .await
    }
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
        let answered = upstream
            .forward(
                &PathAndQuery::from_static("/v2/models/m/infer"),
                &HeaderMap::new(),
                None,
                OutBody::Chunks(crate::body::ChunksBody::new(chunks)),
                crate::upstream::Deadline::after(Duration::from_secs(2)),
            )
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
        };
        let small = request(vec![Bytes::from_static(b"ab"), Bytes::from_static(b"cd")]);
        assert_eq!(kept.write_head(&small, Sending::of(&method, &small.body)), 2);
        assert!(kept.head.ends_with(b"content-length: 4\r\n\r\nabcd"));
        let large = request(vec![Bytes::from(vec![b'x'; GATHERED_BODY + 1])]);
        assert_eq!(kept.write_head(&large, Sending::of(&method, &large.body)), 0);
        assert!(kept.head.ends_with(b"\r\n\r\n"));
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
            };
            kept.write_head(&request, Sending::of(&method, &request.body));
            let head = String::from_utf8(kept.head.clone()).unwrap();
            let (head, body) = head.split_once("\r\n\r\n").unwrap();
            assert_eq!(body, "{}");
            let mut lines: Vec<String> = head.split("\r\n").skip(1).map(str::to_owned).collect();
            lines.retain(|line| !line.starts_with("user-agent: "));
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

#[test]
fn an_answer_read_as_lines_passes_back_what_its_filtered_map_would() {
    let heads = [
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n",
        // The gateway's own names, its `Date`, hop-by-hop, framing and gRPC ones, a header twice, names in capitals.
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: Mon, 01 Jan 2024 00:00:00 GMT\r\nServer: s\r\n\
         X-Request-Id: backend\r\nOIP-Model-Version: b\r\nX-Backend: one\r\nx-backend: two\r\nKeep-Alive: 5\r\n\
         Trailer: t\r\ngrpc-status: 0\r\nConnection: close\r\nContent-Length: 2\r\n\r\n",
        // A header named as the connection option is (reserved: RFC 9110), with the option itself.
        "HTTP/1.1 200 OK\r\nconnection: close\r\nclose: x\r\nkeep-alive: 1\r\ncontent-length: 2\r\n\r\n",
        // The binary extension's lengths (one not a length), a coding, a length given as a list.
        "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ninference-header-content-length: 12\r\n\
         inference-header-content-length: 7\r\ncontent-encoding: gzip\r\ncontent-length: 40, 40\r\n\r\n",
        "HTTP/1.1 200 OK\r\ninference-header-content-length: 50\u{a0}\r\ncontent-length: 40\r\n\r\n",
        // Chunked (a length beside the chunks says nothing), an empty coding beside a length (the connection's end
        // frames it), HTTP/1.0 to the connection's end, no body at all.
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\nx-a: 1\r\n\r\n",
        "HTTP/1.1 200 OK\r\ntransfer-encoding: ,\r\ncontent-length: 5\r\n\r\n",
        "HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\nx-a: 1\r\n\r\n",
        "HTTP/1.1 204 No Content\r\ncontent-length: 5\r\nx-a: 1\r\n\r\n",
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 20\r\n\r\n",
    ];
    for head in heads {
        assert!(
            answer::lines_match_map(head.as_bytes(), false),
            "not read as lines: {head}"
        );
    }
    // Read into a map instead: a `Connection` that names a header, more lines to pass back than are kept, more
    // headers than are placed, and the answer to a HEAD request.
    let kept = "x-a: 1\r\n".repeat(crate::codec::http1::KEPT_LINES + 1);
    let placed = "date: d\r\n".repeat(PLACED + 1);
    for (head, asked_head) in [
        (
            "HTTP/1.1 200 OK\r\nconnection: x-a\r\nx-a: 1\r\ncontent-length: 0\r\n\r\n".to_owned(),
            false,
        ),
        (format!("HTTP/1.1 200 OK\r\n{kept}content-length: 0\r\n\r\n"), false),
        (format!("HTTP/1.1 200 OK\r\n{placed}content-length: 0\r\n\r\n"), false),
        ("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n".to_owned(), true),
    ] {
        let Ok(Parsed::Answer(answer)) = read_head(&mut BytesMut::from(head.as_str()), asked_head, true) else {
            panic!("not an answer: {head}");
        };
        assert!(answer.passed.is_none(), "{head}");
        assert!(!answer.headers.is_empty(), "{head}");
    }
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
    let (path, headers) = (PathAndQuery::from_static("/v2/models/m/infer"), HeaderMap::new());
    let exchange = upstream.forward(
        &path,
        &headers,
        None,
        OutBody::from(crate::body::ChunksBody::new(vec![Bytes::from_static(b"{}")])),
        crate::upstream::Deadline::after(Duration::from_secs(2)),
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
