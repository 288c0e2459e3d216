//! A client's body on its way to a backend: relayed as it arrives, shared between the attempts to send it, held to
//! the door's limits, with a tap for the copies the mirror and the payload log keep, and why it stopped.

use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::http1::Http1BodyError;
use super::{KeptChunks, RequestBody, RequestBodyError};
use crate::codec::rest::key_scan::KeyScan;

/// Why a relayed body stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayError {
    /// The client sent more than the limit.
    TooLarge,
    /// The client's body could not be read (a malformed chunk, a connection closed early).
    Unreadable,
    /// The client stopped sending its body for longer than the limit between reads.
    Stalled,
    /// The client's body did not come whole within its limit.
    Overdue,
    /// The client closed its connection before the body's end.
    Gone,
    /// The body holds what the gateway refuses (a key read as it passed): [`RelaySource::refusal`] says what.
    Refused,
}

impl std::fmt::Display for RelayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RelayError::TooLarge => "the request body is larger than the limit",
            RelayError::Unreadable => "the request body could not be read",
            RelayError::Stalled => "the request body stalled",
            RelayError::Overdue => "the request body did not arrive whole in time",
            RelayError::Gone => "the client went away before sending the whole body",
            RelayError::Refused => "the request body holds what the gateway refuses",
        })
    }
}

impl std::error::Error for RelayError {}

/// A client's body on its way to a backend, shared between the attempts to send it: until the first of them reads
/// from it, a later attempt may take it (so a request whose endpoint could not be reached goes to another), and
/// afterwards it tells how much was read and why it stopped.
#[derive(Debug)]
pub struct RelaySource {
    /// The body, until an attempt takes it.
    body: Mutex<Option<Unsent>>,
    limit: u64,
    received: AtomicU64,
    /// 0 while fine; else 1 + the `RelayError`'s position.
    failure: AtomicU8,
    /// Why the body was refused, when it was.
    refusal: Mutex<Option<crate::error::Error>>,
    /// Length declared by the client, when it declared one.
    declared: Option<u64>,
}

/// Chunks kept as they pass ([`KeptChunks`]), handed to `then` at the end of the body: the mirror's and the payload
/// log's copy.
pub struct Tap {
    chunks: KeptChunks,
    then: Box<dyn FnOnce(Vec<Bytes>) + Send>,
}

impl Tap {
    pub fn new(then: Box<dyn FnOnce(Vec<Bytes>) + Send>) -> Tap {
        Tap {
            chunks: KeptChunks::default(),
            then,
        }
    }
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap")
            .field("chunks", &self.chunks.len())
            .finish_non_exhaustive()
    }
}

impl RelaySource {
    /// `read` is what was already read of `body`, counted against `limit`; what follows passes through `tap`, and
    /// through `scan` (which has read `read`), whose refusal stops it.
    pub fn new(
        read: Vec<Bytes>,
        body: RequestBody,
        limit: u64,
        tap: Option<Tap>,
        scan: Option<KeyScan>,
    ) -> RelaySource {
        let already: u64 = read.iter().map(|chunk| chunk.len() as u64).sum();
        let declared = body.size_hint().exact().map(|rest| rest + already);
        RelaySource {
            body: Mutex::new(Some(Unsent {
                read,
                body,
                tap,
                scan: scan.map(Box::new),
            })),
            limit,
            received: AtomicU64::new(already),
            failure: AtomicU8::new(0),
            refusal: Mutex::new(None),
            declared,
        }
    }

    /// What the body was refused for, when a key read as it passed stopped it.
    pub fn refusal(&self) -> Option<crate::error::Error> {
        self.refusal.lock().ok().and_then(|refusal| refusal.clone())
    }

    /// Bytes read from the client so far.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Why the body stopped early, if it did.
    pub fn failure(&self) -> Option<RelayError> {
        match self.failure.load(Ordering::Relaxed) {
            1 => Some(RelayError::TooLarge),
            2 => Some(RelayError::Unreadable),
            3 => Some(RelayError::Stalled),
            4 => Some(RelayError::Gone),
            5 => Some(RelayError::Refused),
            6 => Some(RelayError::Overdue),
            _ => None,
        }
    }

    /// Whether no attempt has read from the body yet.
    pub fn untouched(&self) -> bool {
        self.body.lock().is_ok_and(|body| body.is_some())
    }

    fn fail(&self, error: RelayError) -> RelayError {
        let code = match error {
            RelayError::TooLarge => 1,
            RelayError::Unreadable => 2,
            RelayError::Stalled => 3,
            RelayError::Gone => 4,
            RelayError::Refused => 5,
            RelayError::Overdue => 6,
        };
        self.failure.store(code, Ordering::Relaxed);
        error
    }
}

/// A relayed body before any attempt has taken it: the chunks already read (sent first), the rest of the body, the
/// tap its chunks go through, and the scan that reads its keys as they pass.
#[derive(Debug)]
struct Unsent {
    read: Vec<Bytes>,
    body: RequestBody,
    tap: Option<Tap>,
    /// Boxed: most bodies pass unscanned.
    scan: Option<Box<KeyScan>>,
}

/// One attempt's view of a [`RelaySource`].
#[derive(Debug)]
pub struct Relayed {
    source: std::sync::Arc<RelaySource>,
    /// Chunks read before the relay began, sent first (in reverse order, the next one last).
    read: Vec<Bytes>,
    body: Option<RequestBody>,
    tap: Option<Tap>,
    scan: Option<Box<KeyScan>>,
    done: bool,
}

impl Relayed {
    pub fn new(source: std::sync::Arc<RelaySource>) -> Relayed {
        Relayed {
            source,
            read: Vec::new(),
            body: None,
            tap: None,
            scan: None,
            done: false,
        }
    }
}

impl Body for Relayed {
    type Data = Bytes;
    type Error = RelayError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, RelayError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if this.body.is_none() {
            let Some(Unsent {
                mut read,
                body,
                mut tap,
                scan,
            }) = this.source.body.lock().ok().and_then(|mut body| body.take())
            else {
                // Another attempt read it first.
                this.done = true;
                return Poll::Ready(Some(Err(RelayError::Unreadable)));
            };
            if let Some(tap) = &mut tap {
                for chunk in &read {
                    tap.chunks.push(chunk.clone());
                }
            }
            read.reverse();
            this.read = read;
            this.body = Some(body);
            this.tap = tap;
            this.scan = scan;
        }
        if let Some(chunk) = this.read.pop() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        let Some(body) = this.body.as_mut() else {
            return Poll::Ready(None);
        };
        loop {
            match ready!(Pin::new(&mut *body).poll_frame(cx)) {
                None => {
                    this.done = true;
                    if let Some(tap) = this.tap.take() {
                        (tap.then)(tap.chunks.into_chunks());
                    }
                    return Poll::Ready(None);
                }
                Some(Err(RequestBodyError::Stalled(_))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(this.source.fail(RelayError::Stalled))));
                }
                Some(Err(RequestBodyError::Overdue(_))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(this.source.fail(RelayError::Overdue))));
                }
                Some(Err(RequestBodyError::TooLarge(_) | RequestBodyError::Http1(Http1BodyError::TooLarge(_)))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(this.source.fail(RelayError::TooLarge))));
                }
                Some(Err(RequestBodyError::Http1(Http1BodyError::Closed))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(this.source.fail(RelayError::Gone))));
                }
                Some(Err(RequestBodyError::Broken(_) | RequestBodyError::Http1(_))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(this.source.fail(RelayError::Unreadable))));
                }
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        // Request trailers stay on the client's hop.
                        continue;
                    };
                    let received =
                        this.source.received.fetch_add(data.len() as u64, Ordering::Relaxed) + data.len() as u64;
                    if received > this.source.limit {
                        this.done = true;
                        return Poll::Ready(Some(Err(this.source.fail(RelayError::TooLarge))));
                    }
                    // A key the gateway refuses stops the body before its chunk leaves: the backend is sent a body
                    // cut short, which it never serves.
                    if let Some(scan) = &mut this.scan
                        && let Err(refusal) = scan.feed(&data)
                    {
                        this.done = true;
                        if let Ok(mut slot) = this.source.refusal.lock() {
                            *slot = Some(refusal);
                        }
                        return Poll::Ready(Some(Err(this.source.fail(RelayError::Refused))));
                    }
                    if let Some(tap) = &mut this.tap {
                        tap.chunks.push(data.clone());
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.source.declared == Some(0)
    }

    fn size_hint(&self) -> SizeHint {
        match self.source.declared {
            Some(length) => SizeHint::with_exact(length),
            None => SizeHint::default(),
        }
    }
}
