//! The order of each aggregate's events as a consumer sees them. outbox_pg numbers an aggregate's
//! events `aggregate_seq` 1, 2, 3, ... gap-free in commit order, so a consumer that remembers
//! which numbers it handled can tell, per event, whether it is the next one, whether earlier ones
//! are missing (a gap), whether it comes late after later ones (a reordering), or whether it was
//! handled before (a duplicate). Pure bookkeeping, no Redis: every rule is unit-tested here.

use std::collections::HashMap;
use std::fmt;
use std::ops::RangeInclusive;

/// Where an event's `aggregate_seq` stands among those [`AggregateSeqs`] saw of its aggregate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeqOrder {
    /// One more than the highest seen: the next event, as expected.
    InOrder,
    /// The first event of its aggregate seen by a check made with [`AggregateSeqs::joining`],
    /// which cannot know what came before it started.
    First,
    /// Higher than the next one: the events numbered `missing` were not seen (yet). They may be
    /// failing and retried, held by another consumer, dead-lettered, or lost.
    Gap {
        /// The `aggregate_seq`s between the highest seen and this one.
        missing: RangeInclusive<i64>,
    },
    /// Lower than the highest seen and not seen before: an earlier event handled after later
    /// ones (a retry, or an entry taken over from a crashed consumer). It fills a gap reported
    /// before.
    Reordered {
        /// The highest `aggregate_seq` seen of the aggregate.
        highest: i64,
    },
    /// Seen before: the same event again, which deduplication did not catch.
    Duplicate,
}

impl SeqOrder {
    /// Whether a consumer should report it: a gap, a reordering or a duplicate.
    pub fn is_anomaly(&self) -> bool {
        !matches!(self, SeqOrder::InOrder | SeqOrder::First)
    }
}

impl fmt::Display for SeqOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SeqOrder::InOrder => write!(f, "in order"),
            SeqOrder::First => write!(f, "the first seen of its aggregate"),
            SeqOrder::Gap { missing } => {
                let count = missing.end() - missing.start() + 1;
                if count == 1 {
                    write!(f, "gap: aggregate_seq {} not seen", missing.start())
                } else {
                    write!(f, "gap: aggregate_seq {} to {} ({count}) not seen", missing.start(), missing.end())
                }
            }
            SeqOrder::Reordered { highest } => write!(f, "reordered: after aggregate_seq {highest}"),
            SeqOrder::Duplicate => write!(f, "duplicate: aggregate_seq seen before"),
        }
    }
}

/// A per-aggregate check of `aggregate_seq`: feed it each event as it is handled, it says where
/// the event stands ([`SeqOrder`]).
///
/// It remembers, per aggregate (`aggregate_type`, `aggregate_id`), the numbers it saw, as ranges:
/// one range in the usual case, a few while gaps are open, so memory grows with the number of
/// aggregates, not of events. It knows only what it was fed since it was made: a consumer
/// that restarts starts over.
///
/// - Observe an event once it was handled: an event whose handler failed and that comes back
///   would otherwise be a [`SeqOrder::Duplicate`].
/// - A replayed entry ([`Event::replay`](crate::Event::replay)) carries its event's original
///   `aggregate_seq`, so it is a `Duplicate` when the original was seen, else `Reordered` (or
///   `First`); either is expected of a replay, which a consumer reports as such, not as an
///   anomaly (`outbox-consume` does not warn about replayed entries).
/// - A consumer group shares a stream's entries among its consumers: each consumer sees gaps
///   where the others handled events. Check where one process sees every event of an aggregate
///   (a single consumer, or a check in a shared store, as the TypeScript and Python examples do
///   in PostgreSQL).
#[derive(Debug, Default, Clone)]
pub struct AggregateSeqs {
    joining: bool,
    seen: HashMap<String, HashMap<String, Vec<RangeInclusive<i64>>>>,
}

impl AggregateSeqs {
    /// A check for a consumer that reads its streams from their start: every aggregate's first
    /// event is expected to be `aggregate_seq` 1, and a higher one is a gap.
    pub fn new() -> AggregateSeqs {
        AggregateSeqs::default()
    }

    /// A check for a consumer that joins streams anywhere (a group created at `$`, a restart, a
    /// trimmed stream): the first event it sees of an aggregate is [`SeqOrder::First`], whatever
    /// its number, and the check goes on from there.
    pub fn joining() -> AggregateSeqs {
        AggregateSeqs { joining: true, ..AggregateSeqs::default() }
    }

    /// Records the event `aggregate_seq` of the aggregate and says where it stands among those
    /// seen before.
    pub fn observe(&mut self, aggregate_type: &str, aggregate_id: &str, aggregate_seq: i64) -> SeqOrder {
        let ids = match self.seen.get_mut(aggregate_type) {
            Some(ids) => ids,
            None => self.seen.entry(aggregate_type.to_owned()).or_default(),
        };
        let Some(ranges) = ids.get_mut(aggregate_id) else {
            ids.insert(aggregate_id.to_owned(), vec![aggregate_seq..=aggregate_seq]);
            return if self.joining {
                SeqOrder::First
            } else if aggregate_seq <= 1 {
                SeqOrder::InOrder
            } else {
                SeqOrder::Gap { missing: 1..=aggregate_seq - 1 }
            };
        };
        let highest = ranges.last().map_or(i64::MIN, |last| *last.end());
        // The first range that ends at or after the number: the one holding it, if any.
        let at = ranges.partition_point(|range| *range.end() < aggregate_seq);
        if ranges.get(at).is_some_and(|range| range.contains(&aggregate_seq)) {
            return SeqOrder::Duplicate;
        }
        insert(ranges, at, aggregate_seq);
        if aggregate_seq > highest {
            if highest.checked_add(1) == Some(aggregate_seq) {
                SeqOrder::InOrder
            } else {
                SeqOrder::Gap { missing: highest + 1..=aggregate_seq - 1 }
            }
        } else {
            SeqOrder::Reordered { highest }
        }
    }

    /// How many aggregates it has seen events of.
    pub fn aggregates(&self) -> usize {
        self.seen.values().map(HashMap::len).sum()
    }
}

/// Puts `seq`, in none of `ranges`, at position `at` (the first range ending after it), joining
/// the ranges it touches so that they stay disjoint, ascending and apart.
fn insert(ranges: &mut Vec<RangeInclusive<i64>>, at: usize, seq: i64) {
    let joins_previous = at > 0 && ranges[at - 1].end().checked_add(1) == Some(seq);
    let joins_next = ranges.get(at).is_some_and(|next| seq.checked_add(1) == Some(*next.start()));
    match (joins_previous, joins_next) {
        (true, true) => {
            let end = *ranges[at].end();
            ranges[at - 1] = *ranges[at - 1].start()..=end;
            ranges.remove(at);
        }
        (true, false) => ranges[at - 1] = *ranges[at - 1].start()..=seq,
        (false, true) => ranges[at] = seq..=*ranges[at].end(),
        (false, false) => ranges.insert(at, seq..=seq),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(check: &mut AggregateSeqs, seqs: &[i64]) -> Vec<SeqOrder> {
        seqs.iter().map(|&seq| check.observe("order", "o-1", seq)).collect()
    }

    #[test]
    fn consecutive_numbers_are_in_order_per_aggregate() {
        let mut check = AggregateSeqs::new();
        assert_eq!(feed(&mut check, &[1, 2, 3]), [SeqOrder::InOrder, SeqOrder::InOrder, SeqOrder::InOrder]);
        // Another aggregate, of the same type or of another with the same id, has its own numbers.
        assert_eq!(check.observe("order", "o-2", 1), SeqOrder::InOrder);
        assert_eq!(check.observe("payment", "o-1", 1), SeqOrder::InOrder);
        assert_eq!(check.observe("order", "o-1", 4), SeqOrder::InOrder);
        assert_eq!(check.aggregates(), 3);
    }

    #[test]
    fn a_gap_names_the_missing_numbers_and_late_ones_fill_it() {
        let mut check = AggregateSeqs::new();
        use SeqOrder::*;
        assert_eq!(
            feed(&mut check, &[1, 2, 5, 3, 6, 4, 7]),
            [
                InOrder,
                InOrder,
                Gap { missing: 3..=4 },
                Reordered { highest: 5 },
                InOrder,
                Reordered { highest: 6 },
                InOrder
            ]
        );
        // Every number seen once: all filled in, any of them again is a duplicate.
        assert_eq!(check.seen["order"]["o-1"], [1..=7]);
        assert_eq!(feed(&mut check, &[4, 1, 7]), [Duplicate, Duplicate, Duplicate]);
    }

    #[test]
    fn a_first_event_above_one_is_a_gap_unless_joining() {
        let mut from_start = AggregateSeqs::new();
        assert_eq!(from_start.observe("order", "o-1", 4), SeqOrder::Gap { missing: 1..=3 });
        assert_eq!(from_start.observe("order", "o-1", 1), SeqOrder::Reordered { highest: 4 });
        assert_eq!(from_start.observe("order", "o-1", 2), SeqOrder::Reordered { highest: 4 });

        let mut joining = AggregateSeqs::joining();
        use SeqOrder::*;
        assert_eq!(feed(&mut joining, &[4, 5, 7, 4]), [First, InOrder, Gap { missing: 6..=6 }, Duplicate]);
        // Below where it joined: not seen, lower than the highest.
        assert_eq!(joining.observe("order", "o-1", 2), Reordered { highest: 7 });
        assert!(!First.is_anomaly() && !InOrder.is_anomaly() && Duplicate.is_anomaly());
    }

    #[test]
    fn ranges_stay_disjoint_and_joined() {
        let mut check = AggregateSeqs::new();
        feed(&mut check, &[1, 10, 5, 3, 7]);
        assert_eq!(check.seen["order"]["o-1"], [1..=1, 3..=3, 5..=5, 7..=7, 10..=10]);
        feed(&mut check, &[2, 4, 6, 9]);
        assert_eq!(check.seen["order"]["o-1"], [1..=7, 9..=10]);
        assert_eq!(check.observe("order", "o-1", 8), SeqOrder::Reordered { highest: 10 });
        assert_eq!(check.seen["order"]["o-1"], [1..=10]);
        // The extremes do not overflow.
        assert_eq!(check.observe("order", "o-1", i64::MAX), SeqOrder::Gap { missing: 11..=i64::MAX - 1 });
        assert_eq!(check.observe("order", "o-1", i64::MAX), SeqOrder::Duplicate);
    }

    #[test]
    fn the_display_says_what_was_found() {
        assert_eq!(SeqOrder::Gap { missing: 4..=4 }.to_string(), "gap: aggregate_seq 4 not seen");
        assert_eq!(SeqOrder::Gap { missing: 2..=4 }.to_string(), "gap: aggregate_seq 2 to 4 (3) not seen");
        assert_eq!(SeqOrder::Reordered { highest: 5 }.to_string(), "reordered: after aggregate_seq 5");
    }
}
