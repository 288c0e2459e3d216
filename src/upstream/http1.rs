//! HTTP/1.1 connections to REST backends: each thread keeps its own idle ones per endpoint, and a request drives the
//! connection it uses from its own task (no connection task to wake, no pool shared between threads, no channel hop
//! between tasks), giving it back to the thread once its answer has been read to the end.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1;

use super::ThreadClients;
use crate::body::OutBody;
use crate::wake::LocalWake;

/// A backend connection's transport: TCP, with TLS for `https` endpoints.
type Io = hyper_rustls::MaybeHttpsStream<hyper_util::rt::TokioIo<tokio::net::TcpStream>>;

/// How long a kept connection may sit idle before it is closed rather than used: backends commonly close theirs
/// after 60 to 120 seconds, and a request sent on a connection the backend is closing fails.
const IDLE_LIMIT: Duration = Duration::from_secs(90);

/// The most idle connections a thread keeps per endpoint; a connection given back beyond them is closed.
const MOST_IDLE: usize = 256;

/// How often a thread closes its connections idle for longer than [`IDLE_LIMIT`]: those of an endpoint that gets no
/// more requests would otherwise stay open (the backend's side of them closed) until it does.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// One HTTP/1.1 connection and its sending half, polled only by the task of the request using it.
pub(super) struct Kept {
    sender: http1::SendRequest<OutBody>,
    connection: http1::Connection<Io, OutBody>,
    /// The connection's waker: the request that drives it is the task that waits on it.
    wake: LocalWake,
    /// The connection has ended (closed by the backend, or failed): it is never polled again.
    ended: bool,
    /// When it was last given back.
    idle_since: Instant,
    /// The thread that made it: its socket is registered with that thread's reactor.
    thread: usize,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kept").field("ended", &self.ended).finish()
    }
}

/// This thread's mark, to tell whether a connection is given back on the thread that made it.
fn this_thread() -> usize {
    thread_local! {
        static MARK: u8 = const { 0 };
    }
    MARK.with(|mark| std::ptr::from_ref(mark) as usize)
}

impl Kept {
    /// Whether it has ended or been idle too long at `now`, and is not to be used.
    pub(super) fn aged(&self, now: Instant) -> bool {
        self.ended || now.saturating_duration_since(self.idle_since) > IDLE_LIMIT
    }

    /// Drives the connection's reading and writing; notes when it has ended.
    fn drive(&mut self, cx: &mut Context<'_>) {
        if !self.ended && Pin::new(&mut self.connection).poll(cx).is_ready() {
            self.ended = true;
        }
    }

    /// Runs `poll` (which drives the connection first) for the task of `cx`, with the connection's own waker.
    fn polled<T>(
        &mut self,
        cx: &mut Context<'_>,
        mut poll: impl FnMut(&mut Kept, &mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        let wake = self.wake.clone();
        wake.poll(cx, |cx| poll(self, cx))
    }

    /// Hands `request` to the connection: hyper's channel wakes the connection at once, and it is polled next
    /// anyway.
    fn hand_over(
        &mut self,
        request: http::Request<OutBody>,
    ) -> impl Future<
        Output = Result<http::Response<Incoming>, hyper::client::conn::TrySendError<http::Request<OutBody>>>,
    > + use<> {
        let sender = &mut self.sender;
        self.wake.before_poll(|| sender.try_send_request(request))
    }

    /// Ready to take a request, once the connection has finished with the previous one; `false` when it has ended
    /// (its sending half is then never ready, as the connection still holds the other half).
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        self.polled(cx, |kept, cx| {
            kept.drive(cx);
            if kept.ended {
                return Poll::Ready(false);
            }
            kept.sender.poll_ready(cx).map(|ready| ready.is_ok())
        })
    }
}

/// Why a request could not be sent or answered.
#[derive(Debug)]
pub(super) enum Failure {
    /// No connection could be made: nothing was sent.
    Connect(Box<dyn std::error::Error + Send + Sync>),
    /// The connection failed; `unsent` when none of the request reached the backend.
    Http { error: hyper::Error, unsent: bool },
    /// The connection ended without an answer or an error for the request.
    Closed,
}

/// Sends `request` on one of this thread's idle connections to the endpoint, or a new one. A request a kept
/// connection could not take goes on a new connection; one whose kept connection closed before any answer came
/// (a backend closing an idle connection as the request went out: MLServer's REST server closes its connection
/// after a 500 without saying so) is sent once more on a new connection when `again` can make it anew, as curl
/// does.
pub(super) async fn send(
    clients: &ThreadClients,
    uri: &http::Uri,
    mut request: http::Request<OutBody>,
    again: impl FnOnce() -> Option<http::Request<OutBody>>,
) -> Result<http::Response<BackendBody>, Failure> {
    let mut again = Some(again);
    loop {
        let (mut kept, reused) = match idle(clients).await {
            Some(kept) => (kept, true),
            // Boxed: connecting is rare, and its state (resolving, connecting, TLS, the handshake) would otherwise
            // be part of every request's.
            None => (Box::pin(connect(clients, uri)).await?, false),
        };
        let mut sent = std::pin::pin!(kept.hand_over(request));
        let answered = std::future::poll_fn(|cx| {
            kept.polled(cx, |kept, cx| {
                kept.drive(cx);
                match sent.as_mut().poll(cx) {
                    // An ended connection has given its request an answer or an error; were it to give neither, the
                    // request would wait for ever.
                    Poll::Pending if kept.ended => Poll::Ready(None),
                    polled => polled.map(Some),
                }
            })
        })
        .await;
        match answered.ok_or(Failure::Closed)? {
            Ok(response) => {
                let token = clients.token.clone();
                return Ok(response.map(|body| BackendBody {
                    body,
                    kept: Some(kept),
                    token,
                }));
            }
            Err(mut failed) => match failed.take_message() {
                Some(unsent) if reused => request = unsent,
                Some(_) => {
                    return Err(Failure::Http {
                        error: failed.into_error(),
                        unsent: true,
                    });
                }
                None => {
                    let error = failed.into_error();
                    match again.take().and_then(|again| again()) {
                        Some(anew) if reused && crate::error::is_closed_connection(&error) => {
                            // A new connection: the other idle ones may have been closed alike.
                            drop_idle(clients);
                            request = anew;
                        }
                        _ => return Err(Failure::Http { error, unsent: false }),
                    }
                }
            },
        }
    }
}

/// The most recently used of this thread's idle connections to the endpoint that is still open and ready; those
/// idle too long or closed by the backend are dropped on the way.
async fn idle(clients: &ThreadClients) -> Option<Box<Kept>> {
    loop {
        let mut kept = super::with_endpoint(&clients.token, |endpoint| endpoint.idle.pop())?;
        if kept.aged(Instant::now()) {
            continue;
        }
        if std::future::poll_fn(|cx| kept.poll_ready(cx)).await {
            return Some(kept);
        }
    }
}

/// Forgets this thread's idle connections to the endpoint.
fn drop_idle(clients: &ThreadClients) {
    let idle = super::with_endpoint(&clients.token, |endpoint| std::mem::take(&mut endpoint.idle));
    drop(idle);
}

/// A new connection to the endpoint (TCP, TLS for `https`, the HTTP/1.1 handshake).
async fn connect(clients: &ThreadClients, uri: &http::Uri) -> Result<Box<Kept>, Failure> {
    keep_swept();
    let mut connector = clients.connector.clone();
    let io = tower_service::Service::call(&mut connector, uri.clone())
        .await
        .map_err(Failure::Connect)?;
    let (sender, connection) = http1::Builder::new()
        .handshake(io)
        .await
        .map_err(|error| Failure::Http { error, unsent: true })?;
    Ok(Box::new(Kept {
        sender,
        connection,
        wake: LocalWake::default(),
        ended: false,
        idle_since: Instant::now(),
        thread: this_thread(),
    }))
}

/// Starts this thread's sweep of its idle connections, once. Only on a single-threaded runtime: its tasks run on
/// this thread, whose connections are the ones to sweep (the door threads' runtimes are all single-threaded).
fn keep_swept() {
    thread_local! {
        static SWEPT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if SWEPT.get() {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
        return;
    }
    SWEPT.set(true);
    runtime.spawn(async {
        loop {
            tokio::time::sleep(SWEEP_EVERY).await;
            super::sweep_idle(Instant::now());
        }
    });
}

/// A REST backend's answer body, read through the connection it came on: reading it drives the connection, and
/// once it has been read to the end the connection goes back to its thread's idle ones.
#[derive(Debug)]
pub struct BackendBody {
    body: Incoming,
    /// Boxed: a connection's state is large, and moves with the request at every step.
    kept: Option<Box<Kept>>,
    /// The endpoint's entry in each thread's table.
    token: Arc<()>,
}

impl Body for BackendBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let body = &mut this.body;
        match &mut this.kept {
            Some(kept) => kept.polled(cx, |kept, cx| {
                kept.drive(cx);
                Pin::new(&mut *body).poll_frame(cx)
            }),
            None => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for BackendBody {
    fn drop(&mut self) {
        // An answer not read to its end leaves the connection mid-message: it is closed, not kept.
        let Some(mut kept) = self.kept.take() else {
            return;
        };
        if kept.ended || !self.body.is_end_stream() || kept.thread != this_thread() {
            return;
        }
        kept.idle_since = Instant::now();
        super::with_endpoint(&self.token, move |endpoint| {
            if endpoint.idle.len() < MOST_IDLE {
                endpoint.idle.push(kept);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

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
                    &http::uri::PathAndQuery::from_static("/v2/models/m/infer"),
                    &http::HeaderMap::new(),
                    OutBody::from(crate::body::ChunksBody::new(vec![Bytes::from_static(b"{}")])),
                    crate::upstream::Deadline::after(Duration::from_secs(2)),
                )
                .await
                .unwrap();
            answer.into_body().collect().await.unwrap().to_bytes()
        };
        // The first request makes the connection; the second goes on it, kept.
        assert_eq!(&exchange().await[..], b"ok");
        let count = crate::wake::WakeCount::default();
        assert_eq!(&count.polling(exchange()).await[..], b"ok");
        // Handing the request over and taking the answer and its body from the connection are done within the
        // task's own polls: only the backend's bytes arriving wake it.
        assert_eq!(count.wakes(), 1);
    }

    #[tokio::test]
    async fn connections_idle_too_long_are_closed_by_the_sweep() {
        let (upstream, open) = upstream_to_backend().await;
        let answer = upstream
            .send(
                http::Method::GET,
                "/v2/health/ready",
                &http::HeaderMap::new(),
                Vec::new(),
                None,
            )
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
}
