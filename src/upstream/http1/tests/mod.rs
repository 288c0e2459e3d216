//! The backend client against loopback backends that answer as each test scripts them: the scripted backends, and
//! the pool's connections; `answers` reads answers, `requests` writes requests.

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
mod answers;
mod requests;

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
        let body = OutBody::from(crate::body::ChunksBody::new(vec![Bytes::from_static(b"{}")]));
        let answer = post(&upstream, body).await.unwrap();
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

/// Posts `body` to the model's infer path through `upstream`, as a passthrough forwards, within two seconds.
async fn post(
    upstream: &crate::upstream::RestUpstream,
    body: OutBody,
) -> crate::error::Result<http::Response<BackendBody>> {
    let (path, headers) = (PathAndQuery::from_static("/v2/models/m/infer"), HeaderMap::new());
    let deadline = crate::upstream::Deadline::after(Duration::from_secs(2));
    upstream.forward(&path, &headers, None, body, deadline).await
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
