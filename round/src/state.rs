//! What a relay keeps from one round to the next, owned by its loop and passed to every round:
//! the claim it may keep for a while, the shards it held (for the commit flags), when it last
//! checked the installation's version. With the round left in flight (round/src/round.rs,
//! `Flight`, kept beside it by the relay) and what its connection keeps (the plans and the
//! windows published in parts: src/relay/spi.rs), nothing else carries state between rounds.

use std::time::{Duration, Instant};

use crate::window::ROUND_EVENTS;

/// A relay's state between rounds (see the module's header).
#[derive(Default)]
pub struct RoundState {
    /// The last full claim's outcome, while a round may go without one (`kept_claim`).
    kept_claim: Option<KeptClaim>,
    /// The shards this relay held at its last round (one bit each).
    pub held_shards: u32,
    /// The shard the next round's allowance goes to first (src/relay/read.rs, `allowance_order`).
    pub first_shard: i16,
    /// The installation last found at the library's version, and when: the version is read again
    /// at most once a second (an ALTER EXTENSION UPDATE keeps the OID), not every round.
    pub version_checked: Option<(u32, Instant)>,
    /// How many events a round may take: fewer after exchanges that timed out.
    pub allowance: RoundAllowance,
}

/// How many events a round takes: `ROUND_EVENTS`, or fewer while Redis does not answer a whole
/// round within `outbox.redis_timeout`. A round whose exchange timed out is read and sent again
/// after the backoff (Redis may have executed it: at least once); at the same size it would time
/// out again, for good, each attempt adding the whole round to the streams once more (found by
/// attack: a 10 ms timeout and a 9,000-event transaction put 36,000 entries in Redis in 75 s and
/// published nothing). So each timed-out round halves the allowance, down to one event.
///
/// It grows back, doubling, once a limit has held without a timeout for `grow_after`: a second at
/// first, twice as long each time a grown limit times out again (up to `GROW_AFTER_MAX`), so a
/// Redis that stays slow is probed for more rarely and rarely (a second attack: a constant one
/// second made every probe a timed-out round and two WARNINGs, 74 in 46 s).
///
/// Not covered: one event that Redis cannot take and answer within the timeout (a 48 MB payload
/// against 10 ms) is sent again after each backoff, a copy in Redis each time, for as long as the
/// timeout stays that short (docs/worker.md, "A timeout too short for a round").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundAllowance {
    /// The limit below `ROUND_EVENTS`, and since when it holds (None: a full round).
    limit: Option<(usize, Instant)>,
    /// How long a limit holds without a timeout before it doubles.
    grow_after: Duration,
    /// The limit in force was grown (not halved) last.
    grown: bool,
}

/// The longest a limit waits to grow once it has timed out again after growing.
const GROW_AFTER_MAX: Duration = Duration::from_secs(64);

impl Default for RoundAllowance {
    fn default() -> Self {
        RoundAllowance { limit: None, grow_after: Duration::from_secs(1), grown: false }
    }
}

impl RoundAllowance {
    /// At most how many events the next round takes.
    pub fn events(&self) -> usize {
        self.limit.map_or(ROUND_EVENTS, |(limit, _)| limit)
    }

    /// A round of `events` events timed out at `now`: the next rounds take half as many. The new
    /// limit, when this lowered it. A round larger than the limit was read before it was set (the
    /// read made while a round was in flight) and says nothing new.
    pub fn timed_out(&mut self, events: usize, now: Instant) -> Option<usize> {
        if events > self.events() {
            return None;
        }
        if self.grown {
            // A grown limit timed out again: the next growth waits twice as long.
            self.grow_after = (self.grow_after * 2).min(GROW_AFTER_MAX);
            self.grown = false;
        }
        let limit = (events / 2).max(1);
        if limit >= self.events() {
            return None;
        }
        self.limit = Some((limit, now));
        Some(limit)
    }

    /// A round landed at `now`: a limit that has held for `grow_after` doubles (and goes away at
    /// `ROUND_EVENTS`, with `grow_after` back to a second).
    pub fn landed(&mut self, now: Instant) {
        if let Some((limit, since)) = self.limit {
            if now.duration_since(since) >= self.grow_after {
                let doubled = limit.saturating_mul(2);
                self.grown = true;
                if doubled < ROUND_EVENTS {
                    self.limit = Some((doubled, now));
                } else {
                    *self = RoundAllowance::default();
                }
            }
        }
    }
}

/// A full claim that the rounds after it may keep: when, for which installation and share, and
/// the shards it gave this relay.
struct KeptClaim {
    taken: Instant,
    installation: u32,
    share: usize,
    shards: Vec<i16>,
}

/// How long a round may go on a kept claim: the claim statement (its count, its lease renewal, its
/// recorded-snapshot and failure-path probes) was most of a small round's CPU, and under a steady
/// stream of commits most rounds change nothing. At most a tenth of the lease, so that the lease,
/// renewed by the claim after a third of it, never comes near expiring.
pub fn claim_kept_for(lease: Duration) -> Duration {
    (lease / 10).min(Duration::from_millis(100))
}

/// How long the reads made while a round is in flight may go on a kept claim: they cannot claim
/// (the round in flight will still move its shards' cursors, so its shards must stay this relay's
/// until it lands), and a drain that keeps a round in flight all the time would otherwise read
/// every 100 ms with nothing in flight, Redis idle meanwhile. A tenth of the lease still leaves the
/// lease, renewed by the claim after a third of it, far from expiring; what only a claim sees (a
/// shard to take over, events an admin put back on the failure path) waits at most that long
/// during a drain, and a relay that joins changes the share, which ends the kept claim at once.
pub fn claim_kept_behind_flight(lease: Duration) -> Duration {
    lease / 10
}

impl RoundState {
    /// The shards of the last full claim, if this round may keep it instead of claiming: not on a
    /// full read (which also moves idle cursors and probes everything), with the same installation
    /// and share, and within `claim_kept_for`. Only a claim that found nothing on the failure path
    /// is kept (`keep_claim`), and a finish that fails or holds events forgets
    /// it. The round still reads its shards' rows and goes on only if they are exactly the kept
    /// ones: a shard taken over, freed by the reaper or rebased by a restore sends it back to the
    /// claim.
    ///
    /// `behind_flight`: the read is made while a round is in flight, and may keep the claim for
    /// longer (`claim_kept_behind_flight`).
    pub fn kept_claim(
        &self,
        installation: u32,
        share: usize,
        lease: Duration,
        full_read: bool,
        behind_flight: bool,
    ) -> Option<Vec<i16>> {
        if full_read {
            return None;
        }
        let kept_for = if behind_flight { claim_kept_behind_flight(lease) } else { claim_kept_for(lease) };
        self.kept_claim
            .as_ref()
            .filter(|k| k.installation == installation && k.share == share && k.taken.elapsed() < kept_for)
            .map(|k| k.shards.clone())
    }

    /// Keeps a full claim's outcome (its shards) for the rounds that follow, when they may use it:
    /// `keepable` when it found nothing on the failure path (a lagging shard is no reason to claim
    /// again: the kept claim's read finds the recorded snapshot it reads up to, like the claim).
    pub fn keep_claim(&mut self, installation: u32, share: usize, shards: Vec<i16>, keepable: bool) {
        self.kept_claim =
            (keepable && !shards.is_empty()).then(|| KeptClaim { taken: Instant::now(), installation, share, shards });
    }

    /// The next round claims again.
    pub fn forget_kept_claim(&mut self) {
        self.kept_claim = None;
    }
}

#[cfg(test)]
mod tests {
    use super::{claim_kept_behind_flight, claim_kept_for, RoundAllowance};
    use crate::window::ROUND_EVENTS;
    use std::time::{Duration, Instant};

    #[test]
    fn rounds_halve_after_each_timeout_and_double_after_each_quiet_second() {
        let start = Instant::now();
        let mut allowance = RoundAllowance::default();
        assert_eq!(allowance.events(), ROUND_EVENTS);
        // A round of 9,000 events timed out, then one of what was allowed.
        assert_eq!(allowance.timed_out(9_000, start), Some(4_500));
        assert_eq!(allowance.timed_out(4_500, start), Some(2_250));
        // A smaller round than allowed (the backlog's end) halves from its own size.
        assert_eq!(allowance.timed_out(100, start), Some(50));
        // A later timeout of a round larger than allowed (one read before the limit) lowers nothing.
        assert_eq!(allowance.timed_out(9_000, start), None);
        assert_eq!(allowance.events(), 50);
        // Never below one event.
        for _ in 0..10 {
            allowance.timed_out(allowance.events(), start);
        }
        assert_eq!(allowance.events(), 1);
        // Rounds that land within the second change nothing; after it, the limit doubles, once
        // per second.
        allowance.landed(start + Duration::from_millis(999));
        assert_eq!(allowance.events(), 1);
        allowance.landed(start + Duration::from_secs(1));
        assert_eq!(allowance.events(), 2);
        allowance.landed(start + Duration::from_millis(1_500));
        assert_eq!(allowance.events(), 2);
        let mut now = start + Duration::from_secs(1);
        while allowance.events() < ROUND_EVENTS {
            now += Duration::from_secs(1);
            allowance.landed(now);
        }
        // From 1 to the full 10,000 in 14 quiet seconds, and then the limit is gone.
        assert_eq!(now.duration_since(start), Duration::from_secs(14));
        assert_eq!(allowance, RoundAllowance::default());
    }

    #[test]
    fn a_limit_that_times_out_again_after_growing_grows_more_slowly() {
        let start = Instant::now();
        let mut allowance = RoundAllowance::default();
        allowance.timed_out(100, start);
        assert_eq!(allowance.events(), 50);
        // Grown after a second; the grown limit times out again: back to 50, and the next growth
        // waits two seconds, then four.
        allowance.landed(start + Duration::from_secs(1));
        assert_eq!(allowance.events(), 100);
        allowance.timed_out(100, start + Duration::from_secs(1));
        assert_eq!(allowance.events(), 50);
        allowance.landed(start + Duration::from_secs(2));
        assert_eq!(allowance.events(), 50, "grows only after two seconds now");
        allowance.landed(start + Duration::from_secs(3));
        assert_eq!(allowance.events(), 100);
        allowance.timed_out(100, start + Duration::from_secs(3));
        allowance.landed(start + Duration::from_secs(6));
        assert_eq!(allowance.events(), 50, "four seconds now");
        allowance.landed(start + Duration::from_secs(7));
        assert_eq!(allowance.events(), 100);
        // A timeout of a limit that was halved, not grown, does not slow growth further.
        let before = allowance;
        allowance.timed_out(100, start + Duration::from_secs(7));
        allowance.timed_out(50, start + Duration::from_secs(7));
        assert_eq!(allowance.grow_after, before.grow_after * 2);
    }

    #[test]
    fn a_claim_is_kept_for_a_tenth_of_the_lease_and_at_most_100_ms() {
        assert_eq!(claim_kept_for(Duration::from_secs(30)), Duration::from_millis(100));
        // A short lease (the tests' 300 ms): its renewal after a third of it is never skipped.
        assert_eq!(claim_kept_for(Duration::from_millis(300)), Duration::from_millis(30));
        assert_eq!(claim_kept_for(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn behind_a_round_in_flight_a_claim_is_kept_for_a_tenth_of_the_lease() {
        // The default lease: a drain claims every 3 s, not every 100 ms.
        assert_eq!(claim_kept_behind_flight(Duration::from_secs(30)), Duration::from_secs(3));
        // Renewed after a third of the lease, a claim kept this long never lets it expire.
        assert!(claim_kept_behind_flight(Duration::from_millis(300)) * 3 < Duration::from_millis(300));
    }
}
