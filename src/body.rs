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
}

impl ChunksBody {
    pub fn new(chunks: Vec<Bytes>) -> Self {
        let remaining = chunks.iter().map(|c| c.len() as u64).sum();
        ChunksBody {
            chunks: chunks.into_iter().filter(|c| !c.is_empty()).collect(),
            remaining,
        }
    }
}

impl Body for ChunksBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.chunks.pop_front().map(|chunk| {
            self.remaining -= chunk.len() as u64;
            Ok(Frame::data(chunk))
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}
