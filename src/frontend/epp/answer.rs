//! What the picker reads of a call's answer: the tokens a `generate` answer carries, counted as its body passes
//! through for the call's token budgets, within bounds on what it holds.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use crate::codec::rest::generate::EventReader;
use crate::guard::TokenMeter;
use crate::protocol::StreamCall;

/// The most of a `generate` answer (or of one event of a `generate_stream` answer) held to count its tokens: past
/// it, the answer is relayed uncounted.
const MOST_COUNTED: usize = 4 << 20;
/// The most the picker holds of all its calls' answers to count them: past it, answers are relayed uncounted, so
/// many large answers at once cannot grow the picker by more than this.
const MOST_COUNTED_IN_ALL: usize = 64 << 20;
/// Bytes of answers held to count their tokens, across the picker's calls.
static HELD_TO_COUNT: AtomicUsize = AtomicUsize::new(0);

/// The bytes one answer holds to count them, within [`MOST_COUNTED_IN_ALL`]; let go when dropped.
#[derive(Default)]
struct Held(usize);

impl Held {
    /// Holds `bytes` now (more or fewer than before); `false`, holding none, when that would pass the bound.
    fn resize(&mut self, bytes: usize) -> bool {
        if bytes > self.0 {
            let more = bytes - self.0;
            let taken = HELD_TO_COUNT.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held + more <= MOST_COUNTED_IN_ALL).then_some(held + more)
            });
            if taken.is_err() {
                self.resize(0);
                return false;
            }
        } else {
            HELD_TO_COUNT.fetch_sub(self.0 - bytes, Ordering::AcqRel);
        }
        self.0 = bytes;
        true
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.resize(0);
    }
}

/// Why an answer goes uncounted, each said at most once a minute (many calls may share the reason).
#[derive(Debug, Clone, Copy)]
enum Uncounted {
    Compressed,
    TooLong,
    TooMuchHeld,
}

impl Uncounted {
    fn warn(self) {
        static LAST: [AtomicU64; 3] = [const { AtomicU64::new(0) }; 3];
        static SINCE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        let now = SINCE.get_or_init(Instant::now).elapsed().as_secs() + 60;
        let last = &LAST[self as usize];
        let said = last.load(Ordering::Relaxed);
        if now < said + 60
            || last
                .compare_exchange(said, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let why = match self {
            Uncounted::Compressed => "it came compressed though asked for without Accept-Encoding",
            Uncounted::TooLong => "it (or one of its events) is longer than the 4 MiB the picker holds to count",
            Uncounted::TooMuchHeld => "the picker holds 64 MiB of answers to count already",
        };
        tracing::warn!("a generate answer is relayed without its tokens counted against its token budget: {why}");
    }
}

/// A `generate` answer's tokens, counted as its body passes for the call's token budgets (charged when the call
/// ends).
pub(super) struct AnswerTokens {
    meter: TokenMeter,
    read: AnswerRead,
    held: Held,
}

/// How far the answer's counting has come.
enum AnswerRead {
    /// The answer's headers are awaited: `generate` or `generate_stream`.
    Headers(StreamCall),
    /// A `generate` answer (or a stream answered with one body), gathered whole.
    Whole(Vec<u8>),
    /// A `generate_stream` answer, event by event.
    Events(EventReader),
    /// Counted, or not to be counted (an error, a compressed or an oversized answer).
    Done,
}

impl AnswerTokens {
    /// The counting of a `call` (`generate` or `generate_stream`) answer, into `meter`.
    pub(super) fn new(meter: TokenMeter, call: StreamCall) -> AnswerTokens {
        AnswerTokens {
            meter,
            read: AnswerRead::Headers(call),
            held: Held::default(),
        }
    }

    /// Reads the answer's head (its status, Content-Type and Content-Encoding): what follows is counted only for a
    /// success the picker can read.
    pub(super) fn head(&mut self, status: u16, content_type: Option<&str>, coding: Option<&str>) {
        let AnswerRead::Headers(call) = self.read else {
            return;
        };
        let events = content_type.is_some_and(|kind| kind.starts_with("text/event-stream"));
        self.read = if !(200..300).contains(&status) {
            AnswerRead::Done
        } else if coding.is_some_and(|coding| coding != "identity") {
            self.uncounted(Uncounted::Compressed);
            AnswerRead::Done
        } else if call == StreamCall::GenerateStream && events {
            AnswerRead::Events(EventReader::new(MOST_COUNTED))
        } else {
            AnswerRead::Whole(Vec::new())
        };
    }

    /// Counts what one chunk of the answer's body completes.
    pub(super) fn body(&mut self, chunk: &[u8], end: bool) {
        match &mut self.read {
            AnswerRead::Whole(whole) => {
                let length = whole.len() + chunk.len();
                if length > MOST_COUNTED {
                    return self.uncounted(Uncounted::TooLong);
                }
                if !self.held.resize(length) {
                    return self.uncounted(Uncounted::TooMuchHeld);
                }
                whole.extend_from_slice(chunk);
                if end {
                    self.finish();
                }
            }
            AnswerRead::Events(reader) => {
                if !self.held.resize(reader.pending().len() + chunk.len()) {
                    return self.uncounted(Uncounted::TooMuchHeld);
                }
                for json in reader.push(chunk) {
                    self.meter.add(&json);
                }
                if reader.too_long() {
                    return self.uncounted(Uncounted::TooLong);
                }
                self.held.resize(reader.pending().len());
            }
            AnswerRead::Headers(_) | AnswerRead::Done => {}
        }
    }

    /// The answer has ended (its last chunk, its trailers, or the stream's close): a whole answer is counted.
    pub(super) fn finish(&mut self) {
        if let AnswerRead::Whole(whole) = &self.read {
            self.meter.add(whole);
        }
        self.read = AnswerRead::Done;
        self.held.resize(0);
    }

    fn uncounted(&mut self, why: Uncounted) {
        why.warn();
        self.read = AnswerRead::Done;
        self.held.resize(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_held_to_count_stay_within_the_pickers_bound_and_are_let_go() {
        let before = HELD_TO_COUNT.load(Ordering::Acquire);
        let mut one = Held::default();
        assert!(one.resize(1 << 20));
        assert!(one.resize(3 << 20));
        assert!(one.resize(2 << 20), "fewer bytes always fit");
        // Another answer that would pass the bound across all calls is refused, and holds nothing.
        let mut other = Held::default();
        assert!(!other.resize(MOST_COUNTED_IN_ALL));
        assert_eq!(other.0, 0);
        drop(other);
        drop(one);
        assert_eq!(HELD_TO_COUNT.load(Ordering::Acquire), before, "what was held is let go");
    }
}
