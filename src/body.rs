//! A body made of shared buffers, sent one after another without being joined: how tensors leave the process
//! without a copy.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

#[derive(Debug, Default)]
pub struct ChunksBody {
    chunks: VecDeque<Bytes>,
    remaining: u64,
    /// Sent after the last chunk (a gRPC answer's status).
    trailers: Option<http::HeaderMap>,
}

impl ChunksBody {
    pub fn new(chunks: Vec<Bytes>) -> Self {
        let remaining = chunks.iter().map(|c| c.len() as u64).sum();
        ChunksBody {
            chunks: chunks.into_iter().filter(|c| !c.is_empty()).collect(),
            remaining,
            trailers: None,
        }
    }

    /// The chunks, then `trailers`.
    pub fn with_trailers(chunks: Vec<Bytes>, trailers: http::HeaderMap) -> Self {
        ChunksBody {
            trailers: Some(trailers),
            ..ChunksBody::new(chunks)
        }
    }
}

impl Body for ChunksBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(chunk) = self.chunks.pop_front() {
            self.remaining -= chunk.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        Poll::Ready(self.trailers.take().map(|trailers| Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}
