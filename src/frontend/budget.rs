//! What one client connection may hold of answers the gateway has made and its client has not yet read. An HTTP/2
//! client may have many calls under way and read none of their answers; past the cap, an answer is let go at once
//! and the call refused (429 / RESOURCE_EXHAUSTED), instead of waiting in memory for a reader that never comes.
//! Each chunk of a held answer carries its part of the charge, so it is given back when the connection has written
//! the chunk and let it go (HTTP/2 takes a body's chunks into its own send buffer long before they are written).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;

use crate::error::{Error, ErrorKind, Origin};

/// One connection's answers held and not yet sent.
#[derive(Debug)]
pub struct AnswerBudget {
    held: AtomicUsize,
    cap: usize,
}

/// A chunk's place in its connection's budget, given back when the chunk has been written or dropped.
#[derive(Debug)]
struct Charge {
    budget: Arc<AnswerBudget>,
    bytes: usize,
}

/// A chunk of a held answer, with its charge.
struct HeldChunk {
    chunk: Bytes,
    _charge: Charge,
}

impl AsRef<[u8]> for HeldChunk {
    fn as_ref(&self) -> &[u8] {
        &self.chunk
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl AnswerBudget {
    pub fn new(cap: usize) -> Arc<AnswerBudget> {
        Arc::new(AnswerBudget {
            held: AtomicUsize::new(0),
            cap,
        })
    }

    /// Charges an answer made of `chunks`, and gives them back each carrying its part of the charge (the bytes are
    /// not copied). Refused when the connection already holds answers and this one would take it past the cap (one
    /// answer, however large, always goes: its size is bounded by the message limit).
    pub fn hold(self: &Arc<AnswerBudget>, chunks: Vec<Bytes>) -> Result<Vec<Bytes>, Error> {
        self.reserve(chunks.iter().map(Bytes::len).sum())?;
        Ok(chunks
            .into_iter()
            .map(|chunk| {
                let bytes = chunk.len();
                Bytes::from_owner(HeldChunk {
                    chunk,
                    _charge: Charge {
                        budget: self.clone(),
                        bytes,
                    },
                })
            })
            .collect())
    }

    fn reserve(&self, bytes: usize) -> Result<(), Error> {
        let mut held = self.held.load(Ordering::Acquire);
        loop {
            if held > 0 && held.saturating_add(bytes) > self.cap {
                return Err(Error::new(
                    ErrorKind::Overloaded,
                    Origin::Client,
                    format!(
                        "this connection holds {held} bytes of answers its client has not read, and this answer's \
                         {bytes} would pass the limit of {} (limits.max_buffered_answer_bytes)",
                        self.cap
                    ),
                ));
            }
            match self
                .held
                .compare_exchange_weak(held, held + bytes, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(now) => held = now,
            }
        }
    }
}
