//! The REST door's HTTP/1.1: a connection's requests read, handed to the door and answered on the door's own thread,
//! one after another (pipelined ones in order) in one state while they keep coming; the body fed as the door asks
//! for it; a client that leaves cancelling its request; the head's time limit (408), keep-alive, lingering close and
//! drain on shutdown.

mod head;
mod write;

use std::future::{Future, poll_fn};
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Method, Response, Version};
use pingora::server::ShutdownWatch;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, Sleep};

use crate::body::http1::{Feed, Http1Body, Http1BodyError};

/// The door's reading of the request head at the start of `read` (taken off it when whole), for the fuzz targets:
/// its body's framing, `None` while partial, or the status it is refused with.
#[cfg(feature = "fuzzing")]
pub fn read_request_head(read: &mut BytesMut) -> Result<Option<Framing>, http::StatusCode> {
    head::read_head(read)
        .map(|head| head.map(|head| head.framing))
        .map_err(|refusal| refusal.status)
}
use head::{Refusal, RequestHead};
use write::{AnswerPlan, write_answer};

use super::RestDoor;
use super::answer::Record;
use crate::body::{ClientBody, SHARED_CHUNK};
use crate::codec::http1::Framing;
use crate::frontend::{MAX_HEAD_BYTES, stopping};
use crate::live::Active;

/// How long a connection may stay open with no request under way, as nginx's `keepalive_timeout`.
pub(super) const KEEPALIVE: Duration = Duration::from_secs(60);
/// How long a connection that has served a request waits for its next in the state its requests are served in,
/// before it lets that state go and waits small: a client sending request after request is served in one state,
/// made once, not made and moved for each of its requests.
const QUIET: Duration = Duration::from_secs(1);
/// Once shutdown starts, how long an idle connection is kept for a request already on its way (answered with
/// `Connection: close`) before it is closed.
pub(super) const CLOSE_LINGER: Duration = Duration::from_millis(500);
/// How long a body that will not be used is read and dropped once its answer is sent, so that a client still sending
/// it reads the answer instead of a reset connection (nginx's lingering close).
const LINGER: Duration = Duration::from_secs(5);
/// The first read of a request: most heads, and most small bodies with them, fit.
const READ_SIZE: usize = 4096;
/// The largest read of a body: a large tensor arrives in pieces of this size.
const BODY_READ: usize = 256 * 1024;
/// While an answer is under way the client is only watched for leaving (what it sends meanwhile is the next
/// request's): the room the request's read left in the buffer is read into while there is this much of it, rather
/// than a buffer of [`READ_SIZE`] made for each request only to wait in.
const WATCH_ROOM: usize = 512;
/// What a client waiting to send its body is told once the door reads it.
const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// One HTTP/1.1 connection of the REST door.
pub(super) struct Http1<S> {
    wire: BufferedStream<S>,
    door: Arc<RestDoor>,
    header_timeout: Duration,
    shutdown: ShutdownWatch,
    /// Shutdown began while the connection was idle: the request on its way is its last.
    closing: bool,
    /// When the last request's head was read, from which the keep-alive time counts.
    last_request: Instant,
    /// Times the waits for a request, busy and idle (made at the first, moved only when it runs out or a busy wait
    /// needs it sooner: a request costs it nothing).
    keepalive: Option<Pin<Box<Sleep>>>,
    /// Waits for shutdown across the waits for a request (made at the first).
    stop: Option<StopWait>,
    /// Once shutdown began, a connection that may still bring a request counts as under way (the process waits for
    /// it) until that request is answered or the connection closes.
    held: Option<Active>,
}

/// A connection's wait for shutdown, kept across its waits for a request: one made afresh each time would subscribe
/// to the shutdown's watch and leave it again, several atomic read-modify-writes a request.
struct StopWait {
    stopping: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Whether `stopping` has been polled: it then waits in the watch's list with the task's waker, and is polled
    /// again only once the watch has changed (each poll of it takes the list's lock).
    listening: bool,
}

impl StopWait {
    fn new(shutdown: &ShutdownWatch) -> StopWait {
        let mut watch = shutdown.clone();
        StopWait {
            stopping: Box::pin(async move { stopping(&mut watch).await }),
            listening: false,
        }
    }

    /// Ready once the gateway is shutting down; `shutdown` is the watch it was made from.
    fn poll(&mut self, shutdown: &ShutdownWatch, cx: &mut Context<'_>) -> Poll<()> {
        if self.listening && !shutdown.has_changed().unwrap_or(true) {
            return Poll::Pending;
        }
        self.listening = true;
        self.stopping.as_mut().poll(cx)
    }
}

/// How a connection waits for its next request.
#[derive(Clone, Copy)]
enum Waiting {
    /// Small, up to the keep-alive time.
    Idle,
    /// In the state its requests are served in, up to [`QUIET`].
    Busy,
}

/// What came of waiting for a request.
#[derive(Debug, PartialEq, Eq)]
enum Waited {
    /// Its first bytes.
    Arrived,
    /// Nothing within [`QUIET`]: the connection goes on waiting, idle.
    Quiet,
    /// The connection is to close.
    Gone,
}

/// The connection's stream and the bytes read from it not yet used.
struct BufferedStream<S> {
    io: S,
    read: BytesMut,
    /// `read` is a buffer made for one piece of a body's data, and sized to it: the pieces split off it share it
    /// with nothing but more of that data, so they are handed on as they are. Any other buffer holds heads or
    /// framing beside its data, whose pieces are copied out rather than keep it all.
    pure: bool,
}

impl<S> Http1<S>
where
    S: AsyncRead + AsyncWrite + Peek + Unpin + Send,
{
    pub(super) fn new(
        io: S,
        first: BytesMut,
        door: Arc<RestDoor>,
        header_timeout: Duration,
        shutdown: ShutdownWatch,
        held: Option<Active>,
    ) -> Self {
        Http1 {
            wire: BufferedStream {
                io,
                read: first,
                pure: false,
            },
            door,
            header_timeout,
            shutdown,
            closing: false,
            last_request: Instant::now(),
            keepalive: None,
            stop: None,
            held,
        }
    }

    /// Serves requests until the connection closes.
    pub(super) async fn serve(mut self) {
        loop {
            if self.wire.read.is_empty() && self.wait_for_request(Waiting::Idle).await != Waited::Arrived {
                return;
            }
            // Boxed: the state requests are served in (the door's future among it) is large, and the connection's
            // task, which lives as long as the connection, keeps only what waiting idle needs.
            if !Box::pin(self.serve_requests()).await {
                return;
            }
        }
    }

    /// Serves requests for as long as they keep coming, one after another in this one state; `true` when the
    /// connection has gone quiet (its next request is waited for small), `false` once it is closed.
    async fn serve_requests(&mut self) -> bool {
        loop {
            let head = match self.read_head().await {
                Ok(Some(head)) => head,
                Ok(None) => return false,
                Err(refusal) => {
                    self.refuse(refusal).await;
                    return false;
                }
            };
            if !self.exchange(head).await {
                self.wire.close().await;
                return false;
            }
            self.held = None;
            if self.wire.read.is_empty() {
                match self.wait_for_request(Waiting::Busy).await {
                    Waited::Arrived => {}
                    Waited::Gone => return false,
                    Waited::Quiet => return true,
                }
            }
        }
    }

    /// Waits for the next request's first bytes: within the keep-alive time when idle, within [`QUIET`] when busy.
    /// Gone when the client closed the connection, the keep-alive time ran out or the gateway is shutting down.
    async fn wait_for_request(&mut self, waiting: Waiting) -> Waited {
        let Http1 {
            wire,
            door,
            shutdown,
            closing,
            last_request,
            keepalive,
            stop,
            held,
            ..
        } = self;
        // At once, when the next request is already here.
        match poll_fn(|cx| Poll::Ready(wire.poll_fill(cx, READ_SIZE))).await {
            Poll::Ready(Ok(0) | Err(_)) => return Waited::Gone,
            Poll::Ready(Ok(_)) => return Waited::Arrived,
            Poll::Pending => {}
        }
        let patience = match waiting {
            Waiting::Busy => QUIET,
            Waiting::Idle => {
                // A plain connection waits idle with its socket only; its read buffer is made again when bytes come.
                if S::CAN_PEEK || wire.read.capacity() > 4 * READ_SIZE {
                    wire.read = BytesMut::new();
                }
                KEEPALIVE
            }
        };
        // One timer for all the waits: moved only when it runs out, or when a busy wait needs it sooner.
        let due = *last_request + patience;
        let timer = keepalive.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        if timer.deadline() > due && !*closing {
            timer.as_mut().reset(due);
        }
        let stop = stop.get_or_insert_with(|| StopWait::new(shutdown));
        loop {
            tokio::select! {
                biased;
                arrived = wire.arrival() => return if matches!(arrived, Ok(1..)) { Waited::Arrived } else { Waited::Gone },
                () = poll_fn(|cx| stop.poll(shutdown, cx)), if !*closing => {
                    *closing = true;
                    *held = Some(door.gateway().begin());
                    timer.as_mut().reset(Instant::now() + CLOSE_LINGER);
                }
                () = timer.as_mut() => {
                    if *closing {
                        return Waited::Gone;
                    }
                    let due = *last_request + patience;
                    if due <= Instant::now() {
                        return match waiting {
                            Waiting::Busy => Waited::Quiet,
                            Waiting::Idle => Waited::Gone,
                        };
                    }
                    timer.as_mut().reset(due);
                }
            }
        }
    }

    /// Reads a request's head, which must come whole within the head's time limit once it has begun.
    async fn read_head(&mut self) -> Result<Option<RequestHead>, Refusal> {
        let mut deadline = None;
        loop {
            if let Some(head) = head::read_head(&mut self.wire.read)? {
                // The std clock, read without the runtime's clock lock: the request's record begins at it too.
                self.last_request = Instant::from_std(std::time::Instant::now());
                return Ok(Some(head));
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + self.header_timeout);
            let wire = &mut self.wire;
            match tokio::time::timeout_at(deadline, poll_fn(|cx| wire.poll_fill(cx, READ_SIZE))).await {
                Err(_) => return Err(Refusal::timed_out()),
                Ok(Ok(0) | Err(_)) => return Ok(None),
                Ok(Ok(_)) => {}
            }
        }
    }

    /// Answers a head that cannot be taken, reports it as a request, and closes the connection.
    async fn refuse(&mut self, refusal: Refusal) {
        let json = crate::codec::rest::encode_error(&refusal.message);
        let record = Record::refused(self.door.gateway(), refusal.status, json.len());
        let mut answer = Response::new(http_body_util::Full::new(Bytes::from(json)));
        *answer.status_mut() = refusal.status;
        answer.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        let how = AnswerPlan {
            close: true,
            keep_alive_10: false,
            http10: false,
            head_only: false,
        };
        let written = write_answer(&mut self.wire.io, &mut answer, None, how).await;
        drop(answer);
        drop(record);
        if written.is_ok() {
            // What the client still sends of the refused request is read and dropped for a while.
            self.wire.linger().await;
        }
    }

    /// Carries one request: its body fed to the door as asked for, its answer written. `true` when the connection may
    /// carry another.
    async fn exchange(&mut self, head: RequestHead) -> bool {
        let RequestHead {
            parts,
            framing,
            close,
            keep_alive_10,
            expects_continue,
        } = head;
        let http10 = parts.version == Version::HTTP_10;
        let head_only = parts.method == Method::HEAD;
        let wire = &mut self.wire;
        let mut feeder = None;
        let whole = framing
            .left()
            .and_then(|length| usize::try_from(length).ok())
            .filter(|length| *length <= wire.read.len());
        let body = match whole {
            Some(length) => Http1Body::whole(wire.read.split_to(length).freeze()),
            None => {
                let left = framing.left();
                let feed = Arc::new(Feed::new(left));
                feeder = Some(Feeder {
                    feed: feed.clone(),
                    framing,
                    failed: false,
                    continue_sent: if expects_continue { 0 } else { CONTINUE.len() },
                    wire: 0,
                    limit: self.door.max_request_bytes(),
                });
                Http1Body::fed(feed)
            }
        };
        // The door's future ends here, before the answer is written: the two never take room at once.
        let response = {
            let arrived = self.last_request.into_std();
            let mut answer = pin!(self.door.answer(parts, ClientBody::Http1(body), None, arrived));
            poll_fn(|cx| wire.poll_answer(cx, answer.as_mut(), feeder.as_mut())).await
        };
        let Some(mut response) = response else {
            // The client left: the request is dropped with its backend call.
            return false;
        };
        let body_read = feeder.as_ref().is_none_or(Feeder::read_whole);
        if let Some(feeder) = &feeder
            && !feeder.finished()
        {
            feeder.feed.end(Err(Http1BodyError::Abandoned));
        }
        let how = AnswerPlan {
            // Whether shutdown began: its watch's version read, where its value would be read under a lock.
            close: close || !body_read || self.closing || self.shutdown.has_changed().unwrap_or(true),
            keep_alive_10,
            http10,
            head_only,
        };
        let passed = response.body_mut().take_passed();
        let lines = passed.as_deref().map(|passed| &passed.lines);
        let written = write_answer(&mut wire.io, &mut response, lines, how).await;
        // Reported now that it is sent, not after a linger.
        drop(response);
        if written.is_ok() && !body_read {
            wire.linger().await;
        }
        matches!(written, Ok(true))
    }
}

impl<S: AsyncRead + AsyncWrite + Peek + Unpin> BufferedStream<S> {
    /// Reads into the buffer, asking for up to `want` bytes when it has little room left; the bytes read (0 at the
    /// stream's end).
    fn poll_fill(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>> {
        if self.read.capacity() - self.read.len() < want.min(READ_SIZE) {
            self.read.reserve(want.max(READ_SIZE));
            self.pure = false;
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.read)
    }

    /// Reads more of a body framed by `framing`: into a buffer of its own, sized to the data left (of the body, or of
    /// its chunk), when nothing else is at hand and that data is long; else as [`Self::poll_fill`] does.
    fn poll_fill_body(&mut self, cx: &mut Context<'_>, framing: &Framing) -> Poll<io::Result<usize>> {
        let want = framing.want(BODY_READ);
        let data_left = framing.data_left();
        if self.read.is_empty()
            && self.read.capacity() == 0
            && data_left.is_some_and(|left| left >= SHARED_CHUNK as u64)
        {
            self.read = BytesMut::with_capacity(want);
            self.pure = true;
        } else if self.read.capacity() - self.read.len() < want.min(READ_SIZE) || data_left.is_none() {
            // Framing, or a short piece of data: read with whatever follows it, into a buffer of mixed bytes.
            if self.read.capacity() - self.read.len() < READ_SIZE.min(want) {
                self.read.reserve(READ_SIZE);
            }
            self.pure = false;
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.read)
    }

    /// Waits for an idle connection's next bytes and reads them.
    async fn arrival(&mut self) -> io::Result<usize> {
        if S::CAN_PEEK {
            poll_fn(|cx| self.io.poll_readable(cx)).await?;
        }
        poll_fn(|cx| self.poll_fill(cx, READ_SIZE)).await
    }

    /// Drives the door's answer: feeds the body as it is asked for, and once the body is all here watches for the
    /// client leaving (its bytes beyond are the next request's). `None` when the client left.
    fn poll_answer<F: Future>(
        &mut self,
        cx: &mut Context<'_>,
        mut answer: Pin<&mut F>,
        mut feeder: Option<&mut Feeder>,
    ) -> Poll<Option<F::Output>> {
        loop {
            if let Poll::Ready(response) = answer.as_mut().poll(cx) {
                return Poll::Ready(Some(response));
            }
            match feeder.as_deref_mut() {
                Some(feeder) if !feeder.finished() => {
                    if !feeder.feed.wanted(cx) {
                        return Poll::Pending;
                    }
                    std::task::ready!(feeder.poll_feed(cx, self));
                }
                _ => {
                    std::task::ready!(self.poll_left(cx));
                    return Poll::Ready(None);
                }
            }
        }
    }

    /// Ready when the client has closed the connection (or it failed); what it sends meanwhile is kept for the next
    /// request, up to a head's worth.
    fn poll_left(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        while self.read.len() < MAX_HEAD_BYTES {
            match std::task::ready!(self.poll_fill(cx, WATCH_ROOM)) {
                Ok(0) | Err(_) => return Poll::Ready(()),
                Ok(_) => {}
            }
        }
        Poll::Pending
    }

    /// Reads and drops what the client still sends, until it closes, stops for a while, or [`LINGER`] has passed;
    /// then the connection closes.
    async fn linger(&mut self) {
        let _ = poll_fn(|cx| Pin::new(&mut self.io).poll_shutdown(cx)).await;
        let drain = async {
            loop {
                self.read.clear();
                match poll_fn(|cx| self.poll_fill(cx, BODY_READ)).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        };
        let _ = tokio::time::timeout(LINGER, drain).await;
    }

    /// Closes the connection, telling the client so (a FIN, or TLS's close_notify).
    async fn close(&mut self) {
        let _ = tokio::time::timeout(
            write::SEND_TIMEOUT,
            poll_fn(|cx| Pin::new(&mut self.io).poll_shutdown(cx)),
        )
        .await;
    }
}

/// Feeds a request's body from the connection to the door, a piece at a time as the door asks for it: each piece all
/// the data the connection has read, however many chunks it came in.
struct Feeder {
    feed: Arc<Feed>,
    framing: Framing,
    failed: bool,
    /// Bytes of `100 Continue` written (all of it when none is due).
    continue_sent: usize,
    /// The body's bytes on the wire so far, its framing's with its data's.
    wire: u64,
    /// The most the body may take on the wire (`limits.max_request_bytes`): framing counts as data does.
    limit: u64,
}

impl Feeder {
    fn finished(&self) -> bool {
        self.failed || self.framing.is_done()
    }

    fn read_whole(&self) -> bool {
        !self.failed && self.framing.is_done()
    }

    /// Gives the body its next piece (or its end); ready once it has one.
    fn poll_feed<S: AsyncRead + AsyncWrite + Peek + Unpin>(
        &mut self,
        cx: &mut Context<'_>,
        wire: &mut BufferedStream<S>,
    ) -> Poll<()> {
        // A client waiting for leave to send is given it before its body is waited for.
        while self.continue_sent < CONTINUE.len() {
            match std::task::ready!(Pin::new(&mut wire.io).poll_write(cx, &CONTINUE[self.continue_sent..])) {
                Ok(written) if written > 0 => self.continue_sent += written,
                _ => return self.fail(Http1BodyError::Closed),
            }
        }
        loop {
            match self.take_run(&mut wire.read, wire.pure) {
                Err(error) => return self.fail(error),
                Ok(Some(piece)) => {
                    self.feed.push(piece);
                    if self.framing.is_done() {
                        self.feed.end(Ok(()));
                    }
                    return Poll::Ready(());
                }
                Ok(None) if self.framing.is_done() => {
                    self.feed.end(Ok(()));
                    return Poll::Ready(());
                }
                Ok(None) => match std::task::ready!(wire.poll_fill_body(cx, &self.framing)) {
                    Ok(0) | Err(_) => return self.fail(Http1BodyError::Closed),
                    Ok(_) => {}
                },
            }
        }
    }

    /// Takes all the body's data `read` holds, as one piece: from a buffer of its own (`pure`), as it lies; else
    /// copied out, every chunk of it into one piece, so no piece holds a buffer of framing and heads for a few bytes
    /// of data, and a body sent in tiny chunks costs one piece a read, not one a chunk.
    fn take_run(&mut self, read: &mut BytesMut, pure: bool) -> Result<Option<Bytes>, Http1BodyError> {
        let before = read.len();
        let mut run: Option<BytesMut> = None;
        let taken = loop {
            match self.framing.take(read) {
                Err(bad) => break Err(Http1BodyError::Framing(bad)),
                Ok(Some(piece)) if pure && run.is_none() => break Ok(Some(piece)),
                Ok(Some(piece)) => run
                    .get_or_insert_with(|| BytesMut::with_capacity(before))
                    .extend_from_slice(&piece),
                Ok(None) => break Ok(run.take().map(BytesMut::freeze)),
            }
            if self.framing.is_done() {
                break Ok(run.take().map(BytesMut::freeze));
            }
        };
        self.wire += (before - read.len()) as u64;
        if self.wire > self.limit {
            return Err(Http1BodyError::TooLarge(self.limit));
        }
        taken
    }

    fn fail(&mut self, error: Http1BodyError) -> Poll<()> {
        self.failed = true;
        self.feed.end(Err(error));
        Poll::Ready(())
    }
}

/// A stream whose next bytes can be waited for without reading them (plain TCP; TLS cannot), so an idle connection
/// holds no read buffer.
pub trait Peek {
    const CAN_PEEK: bool;
    /// Ready when the stream can be read (never, for a stream that cannot tell).
    fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
}

impl Peek for tokio::net::TcpStream {
    const CAN_PEEK: bool = true;
    /// Through the socket's one reader slot, the one its reads wait in: `readable()` would add a waiter to its list
    /// and take it out again, each a lock of the socket's waiters.
    fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_read_ready(cx)
    }
}

impl<S: Send + Sync> Peek for tokio_rustls::server::TlsStream<S> {
    const CAN_PEEK: bool = false;
    fn poll_readable(&self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Pending
    }
}
