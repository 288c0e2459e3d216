//! A request body on the REST door's HTTP/2, taken off hyper's stream as its frames arrive by a task of its own,
//! into buffers bounded by the data it carries. hyper keeps each DATA frame it has read and the door has not, a few
//! hundred bytes of bookkeeping apiece: read only as the door asks (while its backend is slow to take the body, say),
//! a client's one-byte frames would pile up there by the million. Frames shorter than [`SHARED_CHUNK_HTTP2`] are
//! copied together into blocks (a short frame may share hyper's read buffer with other streams' frames); longer ones
//! are kept as hyper read them. Each frame's 9-byte header counts with its data against the body's limit.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

/// HTTP/2 frames at least this long (the protocol's default largest frame) are kept as hyper read them.
pub const SHARED_CHUNK_HTTP2: usize = 16 * 1024;
/// Short frames are copied into blocks of this size.
const COPY_BLOCK: usize = 64 * 1024;
/// An HTTP/2 DATA frame's header, counted with its data against the body's limit.
const FRAME_HEADER: u64 = 9;

/// Why an HTTP/2 body ended before its end.
#[derive(Debug)]
pub enum Http2BodyError {
    /// hyper could not read it (the stream was reset, the connection closed).
    Broken(hyper::Error),
    /// It took more than this many bytes on the wire, its frames' headers counted with its data.
    TooLarge(u64),
}

impl std::fmt::Display for Http2BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Http2BodyError::Broken(error) => error.fmt(f),
            Http2BodyError::TooLarge(limit) => write!(
                f,
                "the request body takes more than the limit of {limit} bytes (limits.max_request_bytes), its \
                 frames' headers counted with its data"
            ),
        }
    }
}

impl std::error::Error for Http2BodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Http2BodyError::Broken(error) => Some(error),
            Http2BodyError::TooLarge(_) => None,
        }
    }
}

/// A request body read off an HTTP/2 stream by its own task.
#[derive(Debug)]
pub struct Http2Body {
    shared: Arc<Mutex<Drained>>,
    /// The body's length as its headers told it, when they did.
    hint: SizeHint,
    /// Bytes handed to the door.
    taken: u64,
}

/// What passes between the task reading a stream and the body the door reads.
#[derive(Debug, Default)]
struct Drained {
    /// Data ready, in order: long frames as they came, and sealed blocks of short ones.
    ready: VecDeque<Bytes>,
    /// Short frames being copied together.
    block: BytesMut,
    /// How the body ended, once it has (its trailers are this hop's, and dropped).
    ended: Option<Result<(), Http2BodyError>>,
    /// The door's task, to wake with data.
    reader: Option<Waker>,
    /// The reading task, to wake when the body is let go.
    drainer: Option<Waker>,
    /// The door has let the body go: the reading stops.
    dropped: bool,
}

impl Drained {
    fn push(&mut self, data: Bytes) {
        if data.len() >= SHARED_CHUNK_HTTP2 {
            self.seal();
            self.ready.push_back(data);
            return;
        }
        if self.block.capacity() - self.block.len() < data.len() {
            self.seal();
            self.block.reserve(COPY_BLOCK);
        }
        self.block.extend_from_slice(&data);
    }

    fn seal(&mut self) {
        if !self.block.is_empty() {
            self.ready.push_back(self.block.split().freeze());
        }
    }

    fn wake_reader(&mut self) -> Option<Waker> {
        self.reader.take()
    }
}

fn lock(shared: &Mutex<Drained>) -> std::sync::MutexGuard<'_, Drained> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Http2Body {
    /// Starts reading `incoming` on a task of its own, within `limit` bytes on the wire.
    pub fn drain(incoming: Incoming, limit: u64) -> Http2Body {
        let hint = incoming.size_hint();
        let shared = Arc::new(Mutex::new(Drained::default()));
        let filled = shared.clone();
        if incoming.is_end_stream() {
            lock(&shared).ended = Some(Ok(()));
            return Http2Body { shared, hint, taken: 0 };
        }
        tokio::spawn(async move {
            let mut incoming = incoming;
            let mut wire = 0u64;
            loop {
                let frame = poll_fn(|cx| {
                    let mut state = lock(&filled);
                    if state.dropped {
                        return Poll::Ready(None);
                    }
                    if !state.drainer.as_ref().is_some_and(|task| task.will_wake(cx.waker())) {
                        state.drainer = Some(cx.waker().clone());
                    }
                    drop(state);
                    Pin::new(&mut incoming).poll_frame(cx).map(Some)
                })
                .await;
                let Some(frame) = frame else { return };
                let mut state = lock(&filled);
                let ended = match frame {
                    None => Some(Ok(())),
                    Some(Err(error)) => Some(Err(Http2BodyError::Broken(error))),
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => {
                            wire += data.len() as u64 + FRAME_HEADER;
                            if wire > limit {
                                Some(Err(Http2BodyError::TooLarge(limit)))
                            } else {
                                state.push(data);
                                None
                            }
                        }
                        Err(_) => None,
                    },
                };
                let done = ended.is_some();
                if let Some(ended) = ended {
                    state.seal();
                    state.ended = Some(ended);
                }
                let reader = state.wake_reader();
                drop(state);
                if let Some(reader) = reader {
                    reader.wake();
                }
                if done {
                    return;
                }
            }
        });
        Http2Body { shared, hint, taken: 0 }
    }
}

impl Body for Http2Body {
    type Data = Bytes;
    type Error = Http2BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Http2BodyError>>> {
        let this = self.get_mut();
        let mut state = lock(&this.shared);
        let data = match state.ready.pop_front() {
            Some(data) => Some(data),
            None if !state.block.is_empty() => Some(state.block.split().freeze()),
            None => None,
        };
        if let Some(data) = data {
            drop(state);
            this.taken += data.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        match state.ended.take() {
            Some(Ok(())) => {
                state.ended = Some(Ok(()));
                return Poll::Ready(None);
            }
            Some(Err(error)) => return Poll::Ready(Some(Err(error))),
            None => {}
        }
        if !state.reader.as_ref().is_some_and(|reader| reader.will_wake(cx.waker())) {
            state.reader = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        let state = lock(&self.shared);
        state.ready.is_empty() && state.block.is_empty() && matches!(state.ended, Some(Ok(())))
    }

    fn size_hint(&self) -> SizeHint {
        match self.hint.exact() {
            Some(length) => SizeHint::with_exact(length.saturating_sub(self.taken)),
            None => SizeHint::default(),
        }
    }
}

impl Drop for Http2Body {
    fn drop(&mut self) {
        let mut state = lock(&self.shared);
        state.dropped = true;
        if let Some(task) = state.drainer.take() {
            drop(state);
            task.wake();
        }
    }
}
