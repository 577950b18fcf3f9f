//! The pause between two rounds under a steady stream of commits (`outbox.linger`), the same for
//! the background worker and outbox-relay.

use std::time::Duration;

/// After a round that published a partial batch, events are arriving one commit at a time: the
/// relay pauses before the next claim so that a round carries several of them. Each round costs
/// two short transactions and a Redis round trip whatever its size (about 0.3 to 1 ms of CPU when
/// it carries a few dozen events of new aggregates), so under a steady stream of small commits
/// one round per commit would take a good part of a core from the application. The pause grows
/// with the last round's size, COALESCE_PER_EVENT per event, from COALESCE_MIN up to
/// `outbox.linger`: at 1,000 events/s rounds carry one or two events and the pause stays at half a
/// millisecond; at a producer's ceiling it reaches `outbox.linger` and the relay runs a few hundred
/// rounds a second instead of thousands. An idle relay is woken at once by the first commit; only
/// the rounds that follow a busy one wait. Why the default is what it is, measured at the
/// producers' ceiling: docs/worker.md, "Coalescing".
pub const COALESCE_MIN: Duration = Duration::from_micros(500);
pub const COALESCE_PER_EVENT: Duration = Duration::from_micros(250);

/// The pause after a round that published `events` and drained its window, `linger` at most.
pub fn coalesce_window(events: usize, linger: Duration) -> Duration {
    COALESCE_PER_EVENT.saturating_mul(events.min(u32::MAX as usize) as u32).clamp(COALESCE_MIN.min(linger), linger)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pause_between_rounds_grows_with_their_size_within_bounds() {
        let linger = Duration::from_millis(10);
        assert_eq!(coalesce_window(1, linger), COALESCE_MIN);
        assert_eq!(coalesce_window(2, linger), COALESCE_MIN);
        assert_eq!(coalesce_window(6, linger), Duration::from_micros(1500));
        assert_eq!(coalesce_window(1000, linger), linger);
        assert_eq!(coalesce_window(usize::MAX, linger), linger);
    }

    #[test]
    fn a_linger_below_the_smallest_pause_is_the_pause() {
        assert_eq!(coalesce_window(1, Duration::from_micros(200)), Duration::from_micros(200));
        assert_eq!(coalesce_window(1000, Duration::ZERO), Duration::ZERO);
    }
}
