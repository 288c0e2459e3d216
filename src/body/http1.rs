//! A request body as an HTTP/1.1 connection hands it to the door: whole when it came with its head (a small request
//! costs nothing more), else fed by the connection a piece at a time as the door asks for it, which is also what
//! tells the connection to send `100 Continue` and keeps a client's bytes in the kernel until they are wanted.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// Why a fed body ended before its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Http1BodyError {
    /// The client closed its connection (or it failed) before the body's end.
    Closed,
    /// The chunked framing is malformed or has no end.
    Framing(crate::codec::http1::BadFraming),
    /// The answer was sent before the body was read: the rest of it is not.
    Abandoned,
    /// The body took more than this many bytes on the wire, its framing counted with its data.
    TooLarge(u64),
}

impl std::fmt::Display for Http1BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Http1BodyError::Closed => f.write_str("the connection closed before the body's end"),
            Http1BodyError::Framing(bad) => write!(f, "the body's {bad}"),
            Http1BodyError::Abandoned => f.write_str("the body was not read before the answer"),
            Http1BodyError::TooLarge(limit) => write!(
                f,
                "the request body takes more than the limit of {limit} bytes (limits.max_request_bytes), its chunks' \
                 framing counted with its data"
            ),
        }
    }
}

impl std::error::Error for Http1BodyError {}

/// A request body read from an HTTP/1.1 connection.
#[derive(Debug)]
pub struct Http1Body {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    /// All of it, read with the head (none once taken).
    Whole(Option<Bytes>),
    Fed(Arc<Feed>),
}

impl Http1Body {
    pub(crate) fn whole(bytes: Bytes) -> Http1Body {
        Http1Body {
            kind: Kind::Whole((!bytes.is_empty()).then_some(bytes)),
        }
    }

    pub(crate) fn fed(feed: Arc<Feed>) -> Http1Body {
        Http1Body { kind: Kind::Fed(feed) }
    }
}

/// What passes between a connection and the body it feeds: one piece at a time, asked for by the body.
#[derive(Debug, Default)]
pub(crate) struct Feed {
    state: Mutex<FeedState>,
}

#[derive(Debug, Default)]
struct FeedState {
    piece: Option<Bytes>,
    /// The body waits for a piece.
    wanted: bool,
    /// How it ended, once it has.
    ended: Option<Result<(), Http1BodyError>>,
    /// The bytes still to come when the body's length is known.
    left: Option<u64>,
    /// The body's reader, to wake with a piece.
    reader: Option<Waker>,
    /// The connection's task, woken when the body asks for more from another task, or is let go.
    connection: Option<Waker>,
    /// The body has been let go.
    dropped: bool,
}

impl Feed {
    pub(crate) fn new(left: Option<u64>) -> Feed {
        Feed {
            state: Mutex::new(FeedState {
                left,
                ..FeedState::default()
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FeedState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the body waits for a piece (registering the connection's task to be woken when it does).
    pub(crate) fn wanted(&self, cx: &Context<'_>) -> bool {
        let mut state = self.state();
        if !state.connection.as_ref().is_some_and(|task| task.will_wake(cx.waker())) {
            state.connection = Some(cx.waker().clone());
        }
        state.wanted && state.piece.is_none() && !state.dropped
    }

    pub(crate) fn push(&self, piece: Bytes) {
        let mut state = self.state();
        state.wanted = false;
        state.piece = Some(piece);
        if let Some(reader) = state.reader.take() {
            drop(state);
            reader.wake();
        }
    }

    pub(crate) fn end(&self, how: Result<(), Http1BodyError>) {
        let mut state = self.state();
        state.ended.get_or_insert(how);
        if let Some(reader) = state.reader.take() {
            drop(state);
            reader.wake();
        }
    }
}

impl Body for Http1Body {
    type Data = Bytes;
    type Error = Http1BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Http1BodyError>>> {
        let feed = match &mut self.get_mut().kind {
            Kind::Whole(bytes) => return Poll::Ready(bytes.take().map(|bytes| Ok(Frame::data(bytes)))),
            Kind::Fed(feed) => feed,
        };
        let mut state = feed.state();
        if let Some(piece) = state.piece.take() {
            if let Some(left) = &mut state.left {
                *left = left.saturating_sub(piece.len() as u64);
            }
            return Poll::Ready(Some(Ok(Frame::data(piece))));
        }
        match state.ended {
            Some(Ok(())) => return Poll::Ready(None),
            Some(Err(error)) => return Poll::Ready(Some(Err(error))),
            None => {}
        }
        state.wanted = true;
        if !state.reader.as_ref().is_some_and(|reader| reader.will_wake(cx.waker())) {
            state.reader = Some(cx.waker().clone());
        }
        // Read in the connection's own task (as the door reads it), the connection looks for the want as soon as
        // this poll returns; from another task it is woken.
        if let Some(task) = &state.connection
            && !task.will_wake(cx.waker())
        {
            task.wake_by_ref();
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Whole(bytes) => bytes.is_none(),
            Kind::Fed(feed) => {
                let state = feed.state();
                state.piece.is_none() && matches!(state.ended, Some(Ok(())))
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Whole(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |bytes| bytes.len() as u64)),
            Kind::Fed(feed) => feed.state().left.map_or_else(SizeHint::default, SizeHint::with_exact),
        }
    }
}

impl Drop for Http1Body {
    fn drop(&mut self) {
        if let Kind::Fed(feed) = &self.kind {
            let mut state = feed.state();
            state.dropped = true;
            if let Some(task) = state.connection.take() {
                drop(state);
                task.wake();
            }
        }
    }
}
