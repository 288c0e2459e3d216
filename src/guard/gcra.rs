//! A generic cell rate algorithm in memory, for the limits governor cannot keep: a token budget charged after the
//! fact (it may run into debt) and a shared limit's local share while Redis is away, whose rate changes with the
//! replicas seen. The same arithmetic runs in Redis for the shared limits (`limit.lua`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One bucket's theoretical arrival time: when it would be full again, in nanoseconds from `origin`.
#[derive(Debug)]
pub struct Gcra {
    origin: Instant,
    tat: AtomicU64,
}

impl Default for Gcra {
    fn default() -> Self {
        Gcra {
            origin: Instant::now(),
            tat: AtomicU64::new(0),
        }
    }
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

impl Gcra {
    fn now(&self) -> u64 {
        nanos(self.origin.elapsed())
    }

    /// Takes `n` tokens if they fit in a bucket of `burst` tokens refilled one per `interval`, or says how long until
    /// they would.
    pub fn take(&self, n: u64, interval: Duration, burst: u64) -> Result<(), Duration> {
        let (interval, tolerance) = (nanos(interval), nanos(interval).saturating_mul(burst));
        let now = self.now();
        let mut wait = 0;
        let updated = self.tat.fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
            let next = tat.max(now).saturating_add(interval.saturating_mul(n));
            if next - now <= tolerance {
                Some(next)
            } else {
                wait = next - now - tolerance;
                None
            }
        });
        updated.map(|_| ()).map_err(|_| Duration::from_nanos(wait))
    }

    /// Whether one token would fit, taking nothing: a budget is spent once it would not.
    pub fn check(&self, interval: Duration, burst: u64) -> Result<(), Duration> {
        let (interval, tolerance) = (nanos(interval), nanos(interval).saturating_mul(burst));
        let now = self.now();
        let next = self.tat.load(Ordering::Acquire).max(now).saturating_add(interval);
        if next - now <= tolerance {
            Ok(())
        } else {
            Err(Duration::from_nanos(next - now - tolerance))
        }
    }

    /// Charges `n` tokens whether or not they fit: a budget spent past its end stays spent until it has refilled.
    pub fn charge(&self, n: u64, interval: Duration) {
        let now = self.now();
        let cost = nanos(interval).saturating_mul(n);
        let _ = self.tat.fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
            Some(tat.max(now).saturating_add(cost))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn a_burst_then_refusal_with_the_wait() {
        let bucket = Gcra::default();
        for _ in 0..5 {
            bucket.take(1, SECOND, 5).unwrap();
        }
        let wait = bucket.take(1, SECOND, 5).unwrap_err();
        assert!(wait > Duration::from_millis(900) && wait <= SECOND, "{wait:?}");
        assert!(bucket.take(6, SECOND, 5).is_err(), "more than the burst never fits");
    }

    #[test]
    fn a_charge_runs_into_debt_and_the_budget_stays_spent() {
        let budget = Gcra::default();
        budget.check(SECOND, 10).unwrap();
        budget.charge(25, SECOND);
        let wait = budget.check(SECOND, 10).unwrap_err();
        // 25 charged against 10: 15 seconds of debt, and one more token's time before one fits.
        assert!(
            wait > Duration::from_secs(15) && wait <= Duration::from_secs(16),
            "{wait:?}"
        );
    }
}
