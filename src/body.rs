//! A body made of shared buffers, sent one after another without being joined: how tensors leave the process
//! without a copy.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// One gRPC message made of `message`'s chunks, behind its 5-byte prefix (not compressed, then the length); the
/// message's length when it is more than the prefix can say.
pub fn grpc_message(message: Vec<Bytes>) -> Result<Vec<Bytes>, usize> {
    let length: usize = message.iter().map(Bytes::len).sum();
    let prefixed = u32::try_from(length).map_err(|_| length)?;
    let mut prefix = Vec::with_capacity(5);
    prefix.push(0);
    prefix.extend_from_slice(&prefixed.to_be_bytes());
    let mut chunks = Vec::with_capacity(message.len() + 1);
    chunks.push(Bytes::from(prefix));
    chunks.extend(message);
    Ok(chunks)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_message_is_its_prefix_then_its_own_chunks() {
        let message = vec![Bytes::from_static(b"abc"), Bytes::from_static(b"de")];
        let framed = grpc_message(message.clone()).unwrap();
        assert_eq!(framed[0].as_ref(), [0, 0, 0, 0, 5]);
        assert_eq!(framed[1..], message);
        assert_eq!(
            framed[1].as_ptr(),
            message[0].as_ptr(),
            "the chunks are shared, not copied"
        );
    }

    #[test]
    fn a_grpc_message_beyond_four_gibibytes_is_refused() {
        static MEBIBYTE: [u8; 1 << 20] = [0; 1 << 20];
        let message = vec![Bytes::from_static(&MEBIBYTE); 4096 + 1];
        assert_eq!(grpc_message(message).unwrap_err(), (4096 + 1) << 20);
    }
}
