//! What the picker reads of a call's answer: the tokens a `generate` answer carries, counted as its body passes
//! through for the call's token budgets, within bounds on what it holds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::body::held::{Held, HeldPool};
use crate::codec::rest::generate::EventReader;
use crate::guard::TokenMeter;
use crate::protocol::StreamCall;

/// The most of a `generate` answer (or of one event of a `generate_stream` answer) held to count its tokens: past
/// it, the answer is relayed uncounted.
const MOST_COUNTED: usize = 4 << 20;
/// What the picker holds of all its calls' answers to count them: past 64 MiB, answers are relayed uncounted, so
/// many large answers at once cannot grow the picker by more than this.
static HELD_TO_COUNT: HeldPool = HeldPool::new(64 << 20);

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
            held: Held::new(&HELD_TO_COUNT),
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
