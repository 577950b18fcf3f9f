//! Capped exponential backoff with jitter, for retrying a Redis (or database) that failed as a
//! whole. Jitter spreads the retries of several relays (or several clusters sharing one Redis).

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    failures: u32,
    rng: u64,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration, seed: u64) -> Self {
        Backoff { base, cap, failures: 0, rng: seed | 1 }
    }

    /// Consecutive failures since the last success.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// Records one more failure and returns how long to wait before the next try: the capped
    /// exponential delay, of which the upper half is randomised ("equal jitter", never below half).
    pub fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let exponent = self.failures.saturating_sub(1).min(30);
        let ceiling = self.base.saturating_mul(1u32 << exponent).min(self.cap);
        let half = ceiling / 2;
        let jitter_nanos = (half.as_nanos() as u64).checked_add(1).map_or(0, |span| self.next_random() % span);
        half + Duration::from_nanos(jitter_nanos)
    }

    /// xorshift64: enough randomness for jitter without pulling in a crate.
    fn next_random(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_exponentially_within_jitter_and_stays_capped() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(10);
        let mut backoff = Backoff::new(base, cap, 42);
        for attempt in 0..40u32 {
            let ceiling = base.saturating_mul(1u32 << attempt.min(30)).min(cap);
            let delay = backoff.next_delay();
            assert!(delay >= ceiling / 2 && delay <= ceiling, "attempt {attempt}: {delay:?} vs {ceiling:?}");
        }
        assert_eq!(backoff.failures(), 40);
        backoff.reset();
        assert_eq!(backoff.failures(), 0);
        assert!(backoff.next_delay() <= base);
    }

    #[test]
    fn jitter_differs_between_seeds() {
        let delays = |seed| {
            let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(10), seed);
            (0..8).map(|_| b.next_delay()).collect::<Vec<_>>()
        };
        assert_ne!(delays(1), delays(2));
    }
}
