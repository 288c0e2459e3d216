//! What an endpoint's calls did over the last minute: how many, how many failed, and their latency's median and
//! 99th percentile, for the fleet status page. Sixty one-second slots of atomic counters, written by every call
//! without a lock: a set of them for each of a few threads (allocated at its first call to the endpoint), so that
//! calls on different threads write no cache line in common, summed when read.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::runtime::{THREAD_SLOTS, thread_slot};

const SLOTS: usize = 60;
/// Upper bounds of the latency buckets, in milliseconds (the last catches the rest).
const BOUNDS_MS: [f64; 20] = [
    0.25,
    0.5,
    1.0,
    2.0,
    4.0,
    8.0,
    16.0,
    32.0,
    64.0,
    128.0,
    256.0,
    512.0,
    1024.0,
    2048.0,
    4096.0,
    8192.0,
    16384.0,
    32768.0,
    65536.0,
    f64::INFINITY,
];

#[derive(Debug, Default)]
struct Slot {
    /// The second (since the window's start) the counts are of, plus one; 0 for none yet.
    second: AtomicU64,
    calls: AtomicU32,
    failures: AtomicU32,
    latency: [AtomicU32; BOUNDS_MS.len()],
}

/// One endpoint's last minute.
#[derive(Debug, Default)]
pub struct Window {
    shards: [Shard; THREAD_SLOTS],
}

/// One thread's slots (or a few threads'), with the moment its seconds count from.
#[derive(Debug, Default)]
struct Shard {
    slots: OnceLock<(Instant, Box<[Slot]>)>,
}

/// A minute summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Summary {
    pub calls: u64,
    pub failures: u64,
    /// Bucket bounds, in milliseconds: the latency is at most this.
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

impl Window {
    /// Records one call's outcome and how long it took, `now` being when it ended (read once by the caller, which
    /// timed the call with it).
    pub fn record(&self, failed: bool, took: Duration, now: Instant) {
        self.shards[thread_slot()].record(failed, took, now);
    }

    /// The last sixty seconds.
    pub fn summary(&self) -> Summary {
        let mut summary = Summary::default();
        let mut latency = [0u64; BOUNDS_MS.len()];
        for shard in &self.shards {
            shard.add_to(&mut summary, &mut latency);
        }
        let counted: u64 = latency.iter().sum();
        let quantile = |q: f64| {
            #[allow(
                clippy::cast_precision_loss,
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss
            )]
            let rank = ((counted as f64) * q).ceil().max(1.0) as u64;
            let mut seen = 0;
            latency.iter().zip(BOUNDS_MS).find_map(|(count, bound)| {
                seen += count;
                (seen >= rank).then_some(if bound.is_finite() {
                    bound
                } else {
                    BOUNDS_MS[BOUNDS_MS.len() - 2]
                })
            })
        };
        if counted > 0 {
            summary.p50_ms = quantile(0.5);
            summary.p99_ms = quantile(0.99);
        }
        summary
    }
}

impl Shard {
    fn record(&self, failed: bool, took: Duration, now: Instant) {
        let (start, slots) = self
            .slots
            .get_or_init(|| (now, (0..SLOTS).map(|_| Slot::default()).collect()));
        let second = now.saturating_duration_since(*start).as_secs() + 1;
        let slot = &slots[usize::try_from(second).unwrap_or(0) % SLOTS];
        let seen = slot.second.load(Ordering::Acquire);
        if seen != second
            && slot
                .second
                .compare_exchange(seen, second, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            // This call opens the slot's new second: what it held is a minute old. A call racing this reset may be
            // lost; the page shows rates, not accounts.
            slot.calls.store(0, Ordering::Relaxed);
            slot.failures.store(0, Ordering::Relaxed);
            for bucket in &slot.latency {
                bucket.store(0, Ordering::Relaxed);
            }
        }
        slot.calls.fetch_add(1, Ordering::Relaxed);
        if failed {
            slot.failures.fetch_add(1, Ordering::Relaxed);
        }
        let millis = took.as_secs_f64() * 1000.0;
        let bucket = BOUNDS_MS
            .iter()
            .position(|bound| millis <= *bound)
            .unwrap_or(BOUNDS_MS.len() - 1);
        slot.latency[bucket].fetch_add(1, Ordering::Relaxed);
    }

    /// Adds this shard's last sixty seconds of calls to `summary` and its latency counts to `latency`.
    fn add_to(&self, summary: &mut Summary, latency: &mut [u64; BOUNDS_MS.len()]) {
        let Some((start, slots)) = self.slots.get() else {
            return;
        };
        let now = start.elapsed().as_secs() + 1;
        for slot in slots.iter() {
            let second = slot.second.load(Ordering::Acquire);
            if second == 0 || now - second >= SLOTS as u64 {
                continue;
            }
            summary.calls += u64::from(slot.calls.load(Ordering::Relaxed));
            summary.failures += u64::from(slot.failures.load(Ordering::Relaxed));
            for (total, bucket) in latency.iter_mut().zip(&slot.latency) {
                *total += u64::from(bucket.load(Ordering::Relaxed));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minute_of_calls_is_summed_with_its_quantiles() {
        let window = Window::default();
        assert_eq!(window.summary(), Summary::default());
        for _ in 0..98 {
            window.record(false, Duration::from_micros(700), Instant::now());
        }
        window.record(true, Duration::from_millis(30), Instant::now());
        window.record(true, Duration::from_millis(3000), Instant::now());
        let summary = window.summary();
        assert_eq!((summary.calls, summary.failures), (100, 2));
        assert_eq!(summary.p50_ms, Some(1.0));
        assert_eq!(summary.p99_ms, Some(32.0));
    }

    /// Calls recorded on many threads (more than the window's sets of slots) are all summed, each once.
    #[test]
    fn calls_on_many_threads_are_summed_across_their_slots() {
        let window = Window::default();
        std::thread::scope(|scope| {
            for thread in 0..(THREAD_SLOTS + 3) {
                let window = &window;
                scope.spawn(move || {
                    for call in 0..1000 {
                        let took = Duration::from_micros(if call < 20 { 3_000 } else { 100 });
                        window.record(call % 100 == thread % 100, took, Instant::now());
                    }
                });
            }
        });
        let summary = window.summary();
        assert_eq!((summary.calls, summary.failures), (11_000, 110));
        assert_eq!(summary.p50_ms, Some(0.25));
        assert_eq!(summary.p99_ms, Some(4.0));
    }
}
