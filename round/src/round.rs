//! One round of the relay, over the log: claim shards and read what the round publishes (a short
//! transaction that writes only when shards change hands: src/relay/read.rs), publish to Redis (no
//! transaction open; the publish list and the count of outcomes: src/relay/publish.rs), finish
//! (one short transaction: src/relay/settle.rs); a large round is sent and left in flight while
//! the next one is read (`Flight`). No signal handling and no waiting here: the outcome, and the
//! `RoundState` and `Flight` the loop owns (src/relay/state.rs), decide what the main loop does next. The design
//! is in docs/worker.md, "The log" and "Reading the next round while Redis works".

use std::time::{Duration, Instant};

use crate::db::Database;
use outbox_sink::entry::OutboxEvent;
use outbox_sink::redis::{BrokerError, RedisSink, Sent};

use crate::hooks::{self, hooks};
use crate::publish::{next_pipeline, publish_list, PipelineLimits, PublishList, Source, Tally, PIPELINE_BYTES};
use crate::read::{read_round, Batch, Read};
use crate::readiness::Readiness;
use crate::settle::{finish, Settlement};
use crate::state::RoundState;
use crate::tick_settings::TickSettings;

/// The outcome of one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickOutcome {
    /// A batch was read, published and finished. `published` reached Redis; `rejected` were
    /// refused by Redis because of the event itself and are on the failure path, backing off, of
    /// which `dead_lettered` reached `max_attempts` and are now failed. `more`: more is waiting
    /// (the failure path had a full batch due, or a shard read only up to a recorded snapshot).
    /// `catching_up`: a shard was more than a second behind and read up to a recorded snapshot.
    Worked {
        claimed: usize,
        published: usize,
        rejected: usize,
        dead_lettered: i64,
        last_rejection: Option<String>,
        more: bool,
        catching_up: bool,
        /// A round was sent and is still in flight (see `tick`): the relay comes back at once.
        in_flight: bool,
    },
    /// Nothing was waiting.
    Idle,
    /// A lagging shard's window up to its next recorded snapshot was empty: its cursor stepped
    /// over it without sending anything (so this says nothing about Redis); the next round follows
    /// at once.
    SteppedOver,
    /// The extension is not installed in the relay's database (yet, or any more).
    ExtensionMissing,
    /// The database has another version of the extension than this library (a new library was
    /// installed and the server restarted, and `ALTER EXTENSION outbox_pg UPDATE` has not run yet).
    ExtensionOutdated { installed: String },
    /// The database is a copy of another one's installation (see `Readiness::Copied`); nothing is
    /// published until an admin runs `outbox.adopt_copy()`.
    CopiedInstallation { original: u32 },
    /// Redis failed as a whole; nothing was finished, so the same batch is read again after the
    /// backoff. Some entries may have been published before the failure was noticed.
    BrokerDown { error: BrokerError, published: usize },
    /// The database refused a statement (e.g. during DROP EXTENSION); nothing was lost.
    DatabaseError(String),
}

/// How long each phase of a round took, for `outbox.log_min_duration`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RoundTimings {
    pub claim: Duration,
    pub publish: Duration,
    pub settle: Duration,
    /// How many shards the relay held this round (None: the round did not get that far).
    pub shards_held: Option<usize>,
}

impl RoundTimings {
    pub fn total(&self) -> Duration {
        self.claim + self.publish + self.settle
    }

    /// The line a relay logs for a round that took `threshold` or more (`outbox.log_min_duration`);
    /// None for a faster one, or one that failed (its failure is logged instead).
    pub fn slow_round_line(&self, outcome: &TickOutcome, threshold: Duration) -> Option<String> {
        if self.total() < threshold {
            return None;
        }
        let events = match outcome {
            TickOutcome::Worked { claimed, published, .. } => format!("{claimed} claimed, {published} published"),
            TickOutcome::Idle => "nothing pending".to_string(),
            TickOutcome::SteppedOver => "a lagging shard stepped over an empty window".to_string(),
            TickOutcome::BrokerDown { .. }
            | TickOutcome::ExtensionMissing
            | TickOutcome::ExtensionOutdated { .. }
            | TickOutcome::CopiedInstallation { .. }
            | TickOutcome::DatabaseError(_) => return None,
        };
        let ms = |duration: Duration| format!("{:.1} ms", duration.as_secs_f64() * 1000.0);
        Some(format!(
            "outbox_pg: slow round: {} ({events}): claim {}, publish to Redis {}, settle {}; above outbox.log_min_duration ({})",
            ms(self.total()),
            ms(self.claim),
            ms(self.publish),
            ms(self.settle),
            ms(threshold)
        ))
    }
}

/// Clears what the relay has in flight when the round ends, whichever way.
struct InFlight(usize);

impl Drop for InFlight {
    fn drop(&mut self) {
        (hooks().in_flight_clear)(self.0);
    }
}

/// A round smaller than this is published and finished at once: reading the next round while
/// Redis executes it pays only when Redis has enough to execute (a drain's rounds carry up to
/// 10,000 events), and at a few events a round the extra read would cost more than it hides.
const OVERLAP_MIN: usize = 256;

/// A round sent to Redis whose replies are not read yet: the relay reads the next round while Redis
/// executes this one (`tick`), then lands it (reads the replies and finishes it) before it sends
/// the next. Kept in `RoundState` between the two ticks.
pub struct Flight {
    settings: TickSettings,
    batch: Batch,
    list: PublishList,
    sent: Sent,
    claimed: usize,
    /// What this relay has in flight, cleared when the flight is dropped.
    _in_flight: InFlight,
}

/// One round: read, publish, finish. `timings` receives the time of each phase that ran.
///
/// A large round is *sent* and left in flight (`Flight`): the next tick reads the following round
/// while Redis executes it, then lands it, and sends the next one only after that, so a round
/// never overtakes an earlier one and a failed round is never followed by a later one. The read
/// made meanwhile assumes the landed round finishes cleanly (everything published, nothing held);
/// if it does not, that read is thrown away and made again. A tick that leaves a round in flight
/// says `more`, so the relay comes back at once, and lands it before it waits.
pub fn tick(
    db: &mut impl Database,
    sink: &mut RedisSink,
    settings: &TickSettings,
    state: &mut RoundState,
    flight: &mut Option<Flight>,
    timings: &mut RoundTimings,
) -> TickOutcome {
    let mut landed = None;
    let mut read = None;
    if let Some(landing) = flight.take() {
        let started = Instant::now();
        let next = read_round(db, settings, state, Some(&landing.batch));
        timings.claim += started.elapsed();
        let (outcome, clean) = land(db, landing, sink, state, timings);
        match next {
            Ok(Read::Batch(batch)) if clean => read = Some(Ok(Read::Batch(batch))),
            Ok(Read::Batch(batch)) => batch.give_back(),
            _ => {}
        }
        if !clean {
            return outcome;
        }
        landed = Some(outcome);
    }
    let read = match read {
        Some(read) => read,
        None => {
            let started = Instant::now();
            let read = read_round(db, settings, state, None);
            timings.claim += started.elapsed();
            read
        }
    };
    let outcome = match read {
        Err(error) => TickOutcome::DatabaseError(error),
        Ok(Read::NotReady(Readiness::Outdated(installed))) => TickOutcome::ExtensionOutdated { installed },
        Ok(Read::NotReady(Readiness::Copied(original))) => TickOutcome::CopiedInstallation { original },
        Ok(Read::NotReady(_)) => TickOutcome::ExtensionMissing,
        // Only a read after a round in flight is postponed, and that one was landed above.
        Ok(Read::Postponed) => TickOutcome::Idle,
        Ok(Read::Batch(batch)) => run(db, batch, sink, settings, state, flight, timings),
    };
    match landed {
        Some(landed) => merge(landed, outcome),
        None => outcome,
    }
}

/// Publishes and finishes a round that was read, or sends it and leaves it in flight.
fn run(
    db: &mut impl Database,
    mut batch: Batch,
    sink: &mut RedisSink,
    settings: &TickSettings,
    state: &mut RoundState,
    flight: &mut Option<Flight>,
    timings: &mut RoundTimings,
) -> TickOutcome {
    timings.shards_held = Some(batch.shards.len());
    let claimed = batch.events.len() + batch.held_due.len();
    if claimed == 0 {
        // Idle shards' cursors still move now and then (retention needs them past closed tables).
        if batch.shards.iter().any(|s| s.advance) {
            if let Err(error) = finish(db, Settlement::default(), &batch, settings, state) {
                return TickOutcome::DatabaseError(error);
            }
        }
        if batch.catching_up {
            return TickOutcome::SteppedOver;
        }
        return TickOutcome::Idle;
    }
    (hooks().in_flight_begin)(settings.slot, claimed);
    let in_flight = InFlight(settings.slot);
    let list = publish_list(&mut batch, settings);

    let overlappable = list.settlement.hold.is_empty()
        && list.sources.iter().all(|source| *source == Source::Log)
        && (batch.more || claimed >= OVERLAP_MIN)
        && list.events.iter().map(OutboxEvent::approximate_size).sum::<usize>() <= PIPELINE_BYTES;
    if overlappable {
        let started = Instant::now();
        let sent = sink.publish_begin(&list.events, &settings.entries);
        timings.publish += started.elapsed();
        match sent {
            Ok(sent) => {
                *flight =
                    Some(Flight { settings: settings.clone(), batch, list, sent, claimed, _in_flight: in_flight });
                return TickOutcome::Worked {
                    claimed: 0,
                    published: 0,
                    rejected: 0,
                    dead_lettered: 0,
                    last_rejection: None,
                    more: true,
                    catching_up: false,
                    in_flight: true,
                };
            }
            Err(error) => {
                after_timeout(state, claimed, &error, settings.redis_timeout);
                return TickOutcome::BrokerDown { error, published: 0 };
            }
        }
    }

    let PublishList { sources, events, mut settlement } = list;
    let mut tally = Tally::default();
    // One MULTI/EXEC per pipeline (up to 64 MB): Redis applies it whole or not at all, so a refusal
    // such as OOM leaves nothing half-published to be sent twice. An aggregate that failed in one
    // pipeline sends nothing more this round: its later events wait on the failure path behind the
    // failed one, so Redis never sees them out of order.
    let limits = PipelineLimits { entries: usize::MAX, bytes: PIPELINE_BYTES };
    let mut pending = sources.into_iter().zip(events).peekable();
    let started = Instant::now();
    loop {
        let broken = &tally.broken;
        let waits = |source: &Source, event: &OutboxEvent| {
            settings.in_order
                && *source == Source::Log
                && !broken.is_empty()
                && broken.contains(&(event.aggregate_type.clone(), event.aggregate_id.clone()))
        };
        let (chunk_sources, chunk, waiting) = next_pipeline(&mut pending, limits, waits);
        for event in waiting {
            settlement.hold.push((event.event_id, event.aggregate_seq, None));
        }
        if chunk.is_empty() {
            break;
        }
        let counted = sink
            .publish(&chunk, &settings.entries)
            .and_then(|outcomes| tally.count(&chunk_sources, &chunk, outcomes, settings, &mut settlement));
        if let Err(error) = counted {
            timings.publish += started.elapsed();
            after_timeout(state, claimed, &error, settings.redis_timeout);
            return TickOutcome::BrokerDown { error, published: tally.published };
        }
    }
    timings.publish += started.elapsed();
    state.allowance.landed(Instant::now());
    settle(db, batch, settlement, tally, claimed, settings, sink, state, timings)
}

/// A round of `events` events failed with `error`: if Redis did not answer it in time, the next
/// rounds are smaller (`RoundAllowance`, src/relay/state.rs), said once per halving.
fn after_timeout(state: &mut RoundState, events: usize, error: &BrokerError, redis_timeout: Duration) {
    if !error.is_timeout() {
        return;
    }
    if let Some(limit) = state.allowance.timed_out(events, Instant::now()) {
        hooks::warning(&format!(
            "outbox_pg: Redis did not answer a round of {events} events within outbox.redis_timeout ({} ms); the \
             next rounds take at most {limit} events, more again once Redis answers in time",
            redis_timeout.as_millis()
        ));
    }
}

/// Reads the replies of a round in flight and finishes it; whether it went cleanly: every entry
/// published, nothing held, the finish committed (only then may a round read meanwhile go out).
fn land(
    db: &mut impl Database,
    flight: Flight,
    sink: &mut RedisSink,
    state: &mut RoundState,
    timings: &mut RoundTimings,
) -> (TickOutcome, bool) {
    let Flight { settings, batch, list, sent, claimed, _in_flight } = flight;
    let PublishList { sources, events, mut settlement } = list;
    let mut tally = Tally::default();
    let started = Instant::now();
    let counted = sink
        .publish_end(sent, &events, &settings.entries)
        .and_then(|outcomes| tally.count(&sources, &events, outcomes, &settings, &mut settlement));
    timings.publish += started.elapsed();
    if let Err(error) = counted {
        after_timeout(state, claimed, &error, settings.redis_timeout);
        return (TickOutcome::BrokerDown { error, published: tally.published }, false);
    }
    state.allowance.landed(Instant::now());
    let clean = settlement.hold.is_empty() && tally.rejected == 0;
    timings.shards_held = Some(batch.shards.len());
    let outcome = settle(db, batch, settlement, tally, claimed, &settings, sink, state, timings);
    let clean = clean && matches!(outcome, TickOutcome::Worked { .. });
    (outcome, clean)
}

/// Lands a round left in flight, if any (before the relay waits, pauses or exits), and finishes
/// it; its outcome.
pub fn land_in_flight(
    db: &mut impl Database,
    sink: &mut RedisSink,
    state: &mut RoundState,
    flight: &mut Option<Flight>,
) -> Option<TickOutcome> {
    let landing = flight.take()?;
    Some(land(db, landing, sink, state, &mut RoundTimings::default()).0)
}

/// Finishes a published round: writes its outcome in one transaction.
#[allow(clippy::too_many_arguments)]
fn settle(
    db: &mut impl Database,
    batch: Batch,
    mut settlement: Settlement,
    tally: Tally,
    claimed: usize,
    settings: &TickSettings,
    sink: &mut RedisSink,
    state: &mut RoundState,
    timings: &mut RoundTimings,
) -> TickOutcome {
    (hooks().after_publish)(tally.published);

    // Losses the check found before this round wrote are recorded first (a transaction that
    // commits synchronously): the finish stores marks past them, after which a relay started
    // anew, should this one crash, could no longer find them.
    if let Err(error) = crate::losses::report_found(db, sink, settings.replay_on_loss) {
        return TickOutcome::DatabaseError(error);
    }
    // The marks of what Redis acknowledged go in the finish that marks it published (a crash
    // keeps both or neither): a loss of those entries is then always noticed.
    settlement.marks_target = sink.marks_target();
    settlement.marks = sink.take_dirty_marks();
    let marks = settlement.marks.clone();
    // If finishing fails nothing is finished: the batch is read and published again (duplicates,
    // never a loss).
    let started = Instant::now();
    let finished = finish(db, settlement, &batch, settings, state);
    timings.settle += started.elapsed();
    let dead_lettered = match finished {
        Ok(finished) => {
            (hooks().after_finish)(tally.published);
            (hooks().add_published)(tally.published as i64);
            finished.dead_lettered
        }
        Err(error) => {
            sink.marks_not_stored(marks);
            return TickOutcome::DatabaseError(error);
        }
    };
    TickOutcome::Worked {
        claimed,
        published: tally.published,
        rejected: tally.rejected,
        dead_lettered,
        last_rejection: tally.last_rejection,
        more: batch.more,
        catching_up: batch.catching_up,
        in_flight: false,
    }
}

/// A round landed, then the round read meanwhile (or read after it): one outcome for the tick,
/// with the counts of both and the state of the later; `more` if either says so. The round read
/// meanwhile is no full read (it reads only the shards commits flagged and the windows in parts),
/// so when the landed round had more to read (a lagging shard stepped to a recorded snapshot, a
/// window went on in parts), only a full read at once finds the rest: without it the rest waited
/// for the next full read, a poll interval later (12% of a 100,000-event drain waited a second).
fn merge(landed: TickOutcome, next: TickOutcome) -> TickOutcome {
    match (landed, next) {
        (
            TickOutcome::Worked {
                claimed, published, rejected, dead_lettered, last_rejection, more: landed_more, ..
            },
            TickOutcome::Worked {
                claimed: more_claimed,
                published: more_published,
                rejected: more_rejected,
                dead_lettered: more_dead,
                last_rejection: later_rejection,
                more,
                catching_up,
                in_flight,
            },
        ) => TickOutcome::Worked {
            claimed: claimed + more_claimed,
            published: published + more_published,
            rejected: rejected + more_rejected,
            dead_lettered: dead_lettered + more_dead,
            last_rejection: later_rejection.or(last_rejection),
            more: more || landed_more,
            catching_up,
            in_flight,
        },
        // Nothing more to read on the shards the later read looked at: the landed round is what
        // happened, and says whether more waits elsewhere.
        (
            TickOutcome::Worked {
                claimed, published, rejected, dead_lettered, last_rejection, more, catching_up, ..
            },
            next,
        ) if matches!(next, TickOutcome::Idle | TickOutcome::SteppedOver) => TickOutcome::Worked {
            claimed,
            published,
            rejected,
            dead_lettered,
            last_rejection,
            more: more || matches!(next, TickOutcome::SteppedOver),
            catching_up,
            in_flight: false,
        },
        (_, next) => next,
    }
}

#[cfg(test)]
mod tests {
    use super::{merge, TickOutcome};

    fn worked(claimed: usize, more: bool, in_flight: bool) -> TickOutcome {
        TickOutcome::Worked {
            claimed,
            published: claimed,
            rejected: 0,
            dead_lettered: 0,
            last_rejection: None,
            more,
            catching_up: false,
            in_flight,
        }
    }

    fn more_of(outcome: &TickOutcome) -> bool {
        matches!(outcome, TickOutcome::Worked { more: true, .. })
    }

    #[test]
    fn a_landed_round_with_more_to_read_sends_the_relay_back_at_once() {
        assert!(more_of(&merge(worked(10_000, true, false), TickOutcome::Idle)));
        assert!(more_of(&merge(worked(10_000, true, false), worked(300, false, false))));
        assert!(more_of(&merge(worked(10_000, false, false), TickOutcome::SteppedOver)));
        assert!(more_of(&merge(worked(10_000, false, false), worked(10_000, true, true))));
    }

    #[test]
    fn a_landed_round_that_drained_its_shards_lets_the_relay_wait() {
        assert!(!more_of(&merge(worked(300, false, false), TickOutcome::Idle)));
        assert!(!more_of(&merge(worked(300, false, false), worked(20, false, false))));
        let merged = merge(worked(300, false, false), worked(20, false, false));
        assert!(matches!(merged, TickOutcome::Worked { claimed: 320, published: 320, .. }));
    }
}
