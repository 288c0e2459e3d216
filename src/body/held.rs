//! Bytes calls hold beside what they pass on (an answer kept to count its tokens, a stream's events kept for the
//! payload log), each purpose within one bound across every call of the process.

use std::sync::atomic::{AtomicUsize, Ordering};

/// What all the calls holding for one purpose hold, and the most they may.
#[derive(Debug)]
pub struct HeldPool {
    held: AtomicUsize,
    most: usize,
}

impl HeldPool {
    pub const fn new(most: usize) -> HeldPool {
        HeldPool {
            held: AtomicUsize::new(0),
            most,
        }
    }

    /// The bytes held now, across calls.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

/// The bytes one call holds from its pool; let go when dropped.
#[derive(Debug)]
pub struct Held {
    pool: &'static HeldPool,
    bytes: usize,
}

impl Held {
    pub fn new(pool: &'static HeldPool) -> Held {
        Held { pool, bytes: 0 }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Holds `bytes` now (more or fewer than before); `false`, holding none, when that would pass the pool's bound.
    pub fn resize(&mut self, bytes: usize) -> bool {
        if bytes > self.bytes {
            let more = bytes - self.bytes;
            let most = self.pool.most;
            let taken = self
                .pool
                .held
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                    (held + more <= most).then_some(held + more)
                });
            if taken.is_err() {
                self.resize(0);
                return false;
            }
        } else {
            self.pool.held.fetch_sub(self.bytes - bytes, Ordering::AcqRel);
        }
        self.bytes = bytes;
        true
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.resize(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_calls_hold_stays_within_their_pools_bound_and_is_let_go() {
        static POOL: HeldPool = HeldPool::new(4 << 20);
        let mut one = Held::new(&POOL);
        assert!(one.resize(1 << 20));
        assert!(one.resize(3 << 20));
        assert!(one.resize(2 << 20), "fewer bytes always fit");
        // Another call that would pass the bound across all of them is refused, and holds nothing.
        let mut other = Held::new(&POOL);
        assert!(!other.resize(3 << 20));
        assert_eq!(other.bytes(), 0);
        assert!(other.resize(2 << 20), "up to the bound");
        assert_eq!(POOL.held(), 4 << 20);
        drop(other);
        drop(one);
        assert_eq!(POOL.held(), 0, "what was held is let go");
    }
}
