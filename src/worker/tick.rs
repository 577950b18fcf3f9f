//! One round of the relay: claim a batch (a reading transaction that records the claim in shared
//! memory), publish it to Redis (no transaction open), settle the rows (one short transaction that
//! writes each row once), release the claim. No signal handling and no waiting here, so that the
//! outcome alone decides what the main loop does next.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use pgrx::prelude::*;

use crate::claims;
use crate::entry::OutboxEvent;
use crate::guc::FaultInjection;
use crate::shmem;
use crate::sink::redis::{BrokerError, EntryOutcome, RedisSink};
use crate::worker::txn;

/// What the relay needs to know for one round; read from the settings before each round.
#[derive(Debug, Clone)]
pub struct TickSettings {
    /// This relay's slot: where its claim is recorded.
    pub slot: usize,
    /// Claims of other relays older than this are ignored (`outbox.lease`).
    pub lease: Duration,
    pub batch_size: usize,
    pub stream_template: String,
    pub stream_maxlen: Option<u64>,
    /// Claim in per-aggregate order (`outbox.ordering = aggregate`).
    pub in_order: bool,
    pub max_attempts: i32,
    pub retry_delay_ms: i32,
    pub fault: FaultInjection,
}

/// The outcome of one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickOutcome {
    /// A batch was claimed and settled. `published` reached Redis; `rejected` were refused by
    /// Redis because of the entry itself and went back to pending (backing off) with their error,
    /// of which `dead_lettered` reached `max_attempts` and are now failed.
    Worked { claimed: usize, published: usize, rejected: usize, dead_lettered: i64, last_rejection: Option<String> },
    /// Nothing was pending.
    Idle,
    /// The extension is not installed in the relay's database (yet, or any more).
    ExtensionMissing,
    /// Redis failed as a whole; the claimed rows stay pending. Some rows may have been
    /// published before the failure was noticed.
    BrokerDown { error: BrokerError, published: usize },
    /// The database refused a statement (e.g. during DROP EXTENSION); nothing was lost.
    DatabaseError(String),
    /// The relay was asked to stop while waiting for the claim lock; nothing was claimed.
    Stopping,
}

const EXTENSION_INSTALLED: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'outbox_pg')";
const CLAIM: &str = "SELECT id, event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, payload, headers, \
                     stream, created_at FROM outbox._relay_batch($1, $2)";
const WAITING: &str = "SELECT outbox._relay_waiting($1, $2, $3)";
const MARK_PUBLISHED: &str = "SELECT outbox._mark_published($1)";
const RELEASE: &str = "SELECT outbox._release($1, $2)";
const REJECT: &str = "SELECT outbox._reject($1, $2, $3, $4)";
const REAP: &str = "SELECT outbox._reap_expired($1)";

/// What the relay's periodic housekeeping found.
#[derive(Debug, Clone, PartialEq)]
pub struct Housekeeping {
    /// Claims returned to pending (lease expired or claimer exited).
    pub reaped: i64,
    /// Age of the oldest undelivered event, if any.
    pub oldest_pending_age: Option<std::time::Duration>,
}

const OLDEST_PENDING_AGE_MS: &str = "SELECT (extract(epoch FROM outbox.oldest_pending_age()) * 1000)::float8";
const PURGE_BATCH: &str = "SELECT outbox._purge_batch($1, $2)";

/// Returns expired or orphaned claims to pending and measures the oldest pending event, in one
/// short transaction. `Ok(None)` when the extension is not installed.
pub fn housekeeping(lease_ms: i32) -> Result<Option<Housekeeping>, String> {
    txn::run(move || -> Result<Option<Housekeeping>, pgrx::spi::Error> {
        if !extension_installed()? {
            return Ok(None);
        }
        let reaped = Spi::get_one_with_args::<i64>(REAP, &[lease_ms.into()])?.unwrap_or(0);
        let oldest_pending_age = Spi::get_one::<f64>(OLDEST_PENDING_AGE_MS)?
            .map(|ms| std::time::Duration::from_secs_f64(ms.max(0.0) / 1000.0));
        Ok(Some(Housekeeping { reaped, oldest_pending_age }))
    })
}

/// Deletes one batch of published events older than the retention; returns how many.
pub fn purge_batch(retention_s: i32, batch_size: i32) -> Result<i64, String> {
    txn::run(move || Spi::get_one_with_args::<i64>(PURGE_BATCH, &[retention_s.into(), batch_size.into()]))
        .map(|n| n.unwrap_or(0))
}

fn extension_installed() -> Result<bool, pgrx::spi::Error> {
    Ok(Spi::get_one::<bool>(EXTENSION_INSTALLED)?.unwrap_or(false))
}

/// Claims up to `batch_size` pending events for the relay in `settings.slot`. `Ok(None)` when the
/// extension is not installed: that is only looked up after the claim failed, so the common round
/// costs one statement.
fn claim(settings: &TickSettings, stop_requested: &dyn Fn() -> bool) -> Result<Option<Claimed>, String> {
    match claim_rows(settings, stop_requested) {
        Ok(claimed) => Ok(Some(claimed)),
        Err(error) => {
            // The claim may have been recorded before the commit failed.
            claims::clear(settings.slot);
            match txn::run(extension_installed) {
                Ok(false) => Ok(None),
                _ => Err(error),
            }
        }
    }
}

/// The claim writes nothing to the table: under the claim lock, it reads which rows the other
/// relays hold, then (with a snapshot taken after that) the oldest claimable rows, drops those held
/// elsewhere, and records the rest in this relay's slot before committing. See src/claims.rs for
/// why that cannot hand a row to two relays, and `outbox._claim_batch` for how per-aggregate order
/// is checked in two steps.
fn claim_rows(settings: &TickSettings, stop_requested: &dyn Fn() -> bool) -> Result<Claimed, String> {
    let (slot, lease, batch_size, in_order) = (settings.slot, settings.lease, settings.batch_size, settings.in_order);
    let stop_requested = std::panic::AssertUnwindSafe(stop_requested);
    txn::run(move || -> Result<Claimed, pgrx::spi::Error> {
        // Moved whole, so that the closure captures the unwind-safe wrapper, not its field.
        let stop_requested = stop_requested;
        if claims::lock_for_claim(|| (stop_requested.0)()) == claims::ClaimLock::Stopping {
            return Ok(Claimed::Stopping);
        }
        let installation = installation();
        let held_elsewhere = claims::in_flight_elsewhere(Some(slot), lease);
        // Rows held elsewhere may come back (they are pending): ask for that many more.
        let limit = (batch_size + held_elsewhere.len()).min(i32::MAX as usize) as i32;
        let mut events = Spi::connect_mut(|client| {
            // `update` (not `select`): the statement must take a fresh snapshot, after the read
            // of the other relays' claims above.
            let rows = client.update(CLAIM, None, &[limit.into(), in_order.into()])?;
            let mut events = Vec::with_capacity(rows.len());
            for row in rows {
                events.push(OutboxEvent {
                    id: row.get::<i64>(1)?.unwrap_or_default(),
                    event_id: row.get::<String>(2)?.unwrap_or_default(),
                    aggregate_type: row.get::<String>(3)?.unwrap_or_default(),
                    aggregate_id: row.get::<String>(4)?.unwrap_or_default(),
                    aggregate_seq: row.get::<i64>(5)?.unwrap_or_default(),
                    event_type: row.get::<String>(6)?.unwrap_or_default(),
                    payload: row.get::<String>(7)?.unwrap_or_default(),
                    headers: row.get::<String>(8)?,
                    stream: row.get::<String>(9)?,
                    created_at: row.get::<String>(10)?.unwrap_or_default(),
                });
            }
            Ok::<_, pgrx::spi::Error>(events)
        })?;
        // Oldest first (the function returns them so; this does not rely on it).
        events.sort_unstable_by_key(|event| event.id);
        let mut events = drop_held_elsewhere(events, &held_elsewhere, in_order);
        if in_order {
            events = cut_runs_at_gaps(events);
            let waiting = aggregates_waiting(&events)?;
            // Usually nobody waits: skip the per-event key copies the lookup needs.
            if !waiting.is_empty() {
                events.retain(|event| !waiting.contains(&(event.aggregate_type.clone(), event.aggregate_id.clone())));
            }
        }
        // Oldest first; each aggregate's events are a prefix of its run, so cutting here keeps order.
        events.truncate(batch_size);
        events.truncate(within_batch_bytes(&events, BATCH_BYTES));
        if !events.is_empty() {
            let ids: Vec<i64> = events.iter().map(|event| event.id).collect();
            claims::register(slot, &ids);
        }
        Ok(Claimed::Events { events, installation })
    })
}

/// What a claim took.
enum Claimed {
    /// These events, from the installation of the extension whose OID is given.
    Events { events: Vec<OutboxEvent>, installation: pg_sys::Oid },
    /// Nothing: the relay is stopping.
    Stopping,
}

/// The most bytes of events one round sends. Redis closes the connection of a client whose
/// unread input passes `client-query-buffer-limit` (1 GB by default); a batch above it would fail
/// as a whole, round after round, and stall the outbox. 64 MB keeps well below it and still
/// carries thousands of ordinary events.
const BATCH_BYTES: usize = 64 * 1024 * 1024;

/// How many of `events` (oldest first) fit in `budget` bytes; always at least one, so that an event
/// larger than the budget still goes (alone).
pub fn within_batch_bytes(events: &[OutboxEvent], budget: usize) -> usize {
    let mut total = 0usize;
    for (index, event) in events.iter().enumerate() {
        total = total.saturating_add(event.approximate_size());
        if total > budget {
            return index.max(1);
        }
    }
    events.len()
}

/// The OID of the installed extension: which installation's rows a claim read. A settle checks it
/// is unchanged, because `DROP EXTENSION` and `CREATE EXTENSION` between a claim and its settle
/// start the ids again at 1, and marking rows by id would then mark other events, never
/// delivered, as published.
fn installation() -> pg_sys::Oid {
    // SAFETY: a catalog lookup inside a transaction; missing_ok, so it returns InvalidOid rather
    // than raising.
    unsafe { pg_sys::get_extension_oid(c"outbox_pg".as_ptr(), true) }
}

/// Step 2 of the per-aggregate order check, in the database: the aggregates of `events` that have
/// an event below their first one in the batch still undelivered (`outbox._relay_waiting`).
fn aggregates_waiting(events: &[OutboxEvent]) -> Result<HashSet<(String, String)>, pgrx::spi::Error> {
    let heads = first_of_each_aggregate(events);
    if heads.is_empty() {
        return Ok(HashSet::new());
    }
    let types: Vec<String> = heads.iter().map(|e| e.aggregate_type.clone()).collect();
    let ids: Vec<String> = heads.iter().map(|e| e.aggregate_id.clone()).collect();
    let seqs: Vec<i64> = heads.iter().map(|e| e.aggregate_seq).collect();
    Spi::connect_mut(|client| {
        let rows = client.update(WAITING, None, &[types.into(), ids.into(), seqs.into()])?;
        let mut waiting = HashSet::new();
        for row in rows {
            if let Some(position) = row.get::<i64>(1)? {
                let head = heads[(position - 1) as usize];
                waiting.insert((head.aggregate_type.clone(), head.aggregate_id.clone()));
            }
        }
        Ok(waiting)
    })
}

/// Drops the events another relay holds and, in per-aggregate order, every later event of their
/// aggregates (they must wait for the held one). `events` are in id order.
pub fn drop_held_elsewhere(
    events: Vec<OutboxEvent>,
    held_elsewhere: &HashSet<i64>,
    in_order: bool,
) -> Vec<OutboxEvent> {
    if held_elsewhere.is_empty() {
        return events;
    }
    let mut waiting: HashSet<(String, String)> = HashSet::new();
    let mut kept = Vec::with_capacity(events.len());
    for event in events {
        let held = held_elsewhere.contains(&event.id);
        if in_order {
            let aggregate = (event.aggregate_type.clone(), event.aggregate_id.clone());
            if held || waiting.contains(&aggregate) {
                waiting.insert(aggregate);
                continue;
            }
        } else if held {
            continue;
        }
        kept.push(event);
    }
    kept
}

/// Step 2 of the per-aggregate order check, in memory. `events` are in id order. Each aggregate's
/// events are put in `aggregate_seq` order (in the places its events held, so the batch stays
/// oldest first) and cut at the first gap in the sequence: an event whose predecessor is not in
/// the batch waits for it. Ids follow `aggregate_seq` within an aggregate whenever ids are handed
/// out in order (the identity's default), so the reordering is only a safeguard.
pub fn cut_runs_at_gaps(events: Vec<OutboxEvent>) -> Vec<OutboxEvent> {
    let mut by_aggregate: HashMap<(&str, &str), Vec<usize>> = HashMap::new();
    for (index, event) in events.iter().enumerate() {
        by_aggregate.entry((event.aggregate_type.as_str(), event.aggregate_id.as_str())).or_default().push(index);
    }
    // For each place in the batch, which event goes there (None: its aggregate's run was cut).
    let mut placed: Vec<Option<usize>> = vec![None; events.len()];
    for places in by_aggregate.values() {
        let mut by_seq = places.clone();
        by_seq.sort_unstable_by_key(|&index| events[index].aggregate_seq);
        let first_seq = events[by_seq[0]].aggregate_seq;
        for (offset, (&place, &index)) in places.iter().zip(&by_seq).enumerate() {
            if events[index].aggregate_seq != first_seq + offset as i64 {
                break;
            }
            placed[place] = Some(index);
        }
    }
    let mut slots: Vec<Option<OutboxEvent>> = events.into_iter().map(Some).collect();
    placed.into_iter().flatten().filter_map(|index| slots[index].take()).collect()
}

/// The first event of each aggregate in `events` (its lowest `aggregate_seq` after
/// `cut_runs_at_gaps`, which puts it first).
fn first_of_each_aggregate(events: &[OutboxEvent]) -> Vec<&OutboxEvent> {
    let mut seen = HashSet::new();
    events.iter().filter(|event| seen.insert((event.aggregate_type.as_str(), event.aggregate_id.as_str()))).collect()
}

/// How a claimed batch is settled.
#[derive(Default)]
struct Settlement {
    /// Redis stored these.
    published: Vec<i64>,
    /// Redis refused these because of the entries themselves, grouped by error.
    rejected: BTreeMap<String, Vec<i64>>,
    /// Redis failed as a whole for these, grouped by error: they stay pending, with the error.
    released: BTreeMap<String, Vec<i64>>,
}

/// What a settle wrote.
#[derive(Debug, Clone, Copy, Default)]
struct Settled {
    /// Rows marked published.
    published: i64,
    /// Rows that reached `outbox.max_attempts` and became failed.
    dead_lettered: i64,
}

/// Writes the batch's outcome in one transaction, if the rows still belong to the installation
/// they were claimed from (`installation`).
fn settle(settlement: Settlement, settings: &TickSettings, claimed_from: pg_sys::Oid) -> Result<Settled, String> {
    let (max_attempts, retry_delay_ms) = (settings.max_attempts, settings.retry_delay_ms);
    txn::run(move || -> Result<Settled, String> {
        let mut settled = Settled::default();
        settle_rows(settlement, max_attempts, retry_delay_ms, &mut settled).map_err(|e| e.to_string())?;
        // Checked after the writes, in their transaction: the rows they touched stay locked until
        // it ends, so a DROP EXTENSION cannot slip in between this check and the commit, and one
        // that committed before the writes shows here as another OID (or none).
        if installation() != claimed_from {
            return Err("outbox_pg was dropped and created again while this batch was being published; \
                        its rows are gone, so nothing was settled"
                .to_string());
        }
        Ok(settled)
    })
}

fn settle_rows(
    settlement: Settlement,
    max_attempts: i32,
    retry_delay_ms: i32,
    settled: &mut Settled,
) -> Result<(), pgrx::spi::Error> {
    {
        if !settlement.published.is_empty() {
            settled.published =
                Spi::get_one_with_args::<i64>(MARK_PUBLISHED, &[settlement.published.into()])?.unwrap_or(0);
        }
        for (error, ids) in settlement.rejected {
            settled.dead_lettered += Spi::get_one_with_args::<i64>(
                REJECT,
                &[ids.into(), error.into(), max_attempts.into(), retry_delay_ms.into()],
            )?
            .unwrap_or(0);
        }
        for (error, ids) in settlement.released {
            Spi::get_one_with_args::<i64>(RELEASE, &[ids.into(), error.into()])?;
        }
        Ok(())
    }
}

/// How long each phase of a round took, for `outbox.log_min_duration`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RoundTimings {
    pub claim: Duration,
    pub publish: Duration,
    pub settle: Duration,
}

impl RoundTimings {
    pub fn total(&self) -> Duration {
        self.claim + self.publish + self.settle
    }
}

/// Releases the relay's claim when the round ends, whichever way: after the settling transaction
/// committed, or after a failure (the unsettled rows are pending and will be claimed again).
struct HeldClaim(usize);

impl Drop for HeldClaim {
    fn drop(&mut self) {
        claims::clear(self.0);
    }
}

/// One round: claim, publish, settle. `timings` receives the time of each phase that ran.
pub fn tick(
    sink: &mut RedisSink,
    settings: &TickSettings,
    timings: &mut RoundTimings,
    stop_requested: &dyn Fn() -> bool,
) -> TickOutcome {
    let started = Instant::now();
    let claimed_events = claim(settings, stop_requested);
    timings.claim = started.elapsed();
    let _held = HeldClaim(settings.slot);
    let (events, installation) = match claimed_events {
        Err(error) => return TickOutcome::DatabaseError(error),
        Ok(None) => return TickOutcome::ExtensionMissing,
        Ok(Some(Claimed::Stopping)) => return TickOutcome::Stopping,
        Ok(Some(Claimed::Events { events, .. })) if events.is_empty() => return TickOutcome::Idle,
        Ok(Some(Claimed::Events { events, installation })) => (events, installation),
    };
    let claimed = events.len();
    let mut settlement = Settlement::default();
    // Events held back from this round stay pending and need no write: the claim never wrote.
    let events = if settings.in_order { split_runs(events, &settings.stream_template).0 } else { events };

    let mut broker_error = None;
    let mut last_rejection = None;
    let started = Instant::now();
    let sent = sink.publish(&events, &settings.stream_template, settings.stream_maxlen);
    timings.publish = started.elapsed();
    match sent {
        Ok(outcomes) => {
            for (event, outcome) in events.iter().zip(outcomes) {
                match outcome {
                    EntryOutcome::Published => settlement.published.push(event.id),
                    EntryOutcome::Rejected(error) => {
                        last_rejection = Some(error.clone());
                        settlement.rejected.entry(error).or_default().push(event.id);
                    }
                    EntryOutcome::BrokerRefused(error) => {
                        broker_error.get_or_insert_with(|| BrokerError(error.clone()));
                        settlement.released.entry(error).or_default().push(event.id);
                    }
                    // Left pending; claimed again next round.
                    EntryOutcome::NotSent => {}
                }
            }
        }
        Err(error) => {
            settlement.released.insert(error.0.clone(), events.iter().map(|event| event.id).collect());
            broker_error = Some(error);
        }
    }

    if settings.fault == FaultInjection::CrashAfterPublish && !settlement.published.is_empty() {
        crash_after_publish(settlement.published.len());
    }

    let published = settlement.published.len();
    let rejected = settlement.rejected.values().map(Vec::len).sum();
    // If settling fails the rows stay pending and are published again once the claim is
    // released: a duplicate, never a loss.
    let started = Instant::now();
    let settled = settle(settlement, settings, installation);
    timings.settle = started.elapsed();
    let dead_lettered = match settled {
        Ok(settled) => {
            shmem::add_published(settled.published);
            settled.dead_lettered
        }
        Err(error) => return TickOutcome::DatabaseError(error),
    };
    match broker_error {
        Some(error) => TickOutcome::BrokerDown { error, published },
        None => TickOutcome::Worked { claimed, published, rejected, dead_lettered, last_rejection },
    }
}

/// In per-aggregate order, a batch may hold several consecutive events of one aggregate. Redis
/// rejects an entry because of its stream key (e.g. WRONGTYPE), so events to the same key share
/// their fate: if the first is rejected, so are the later ones, and order holds. An event bound for
/// a *different* key than its aggregate's earlier events in the batch could succeed where they
/// fail, so it and the rest of its aggregate's run wait for the next round. Events are in id order,
/// which within an aggregate is `aggregate_seq` order.
pub fn split_runs(events: Vec<OutboxEvent>, stream_template: &str) -> (Vec<OutboxEvent>, Vec<i64>) {
    let mut run_key: HashMap<(String, String), Option<String>> = HashMap::new();
    let mut sent = Vec::with_capacity(events.len());
    let mut deferred = Vec::new();
    for event in events {
        let key = event.stream_key(stream_template);
        let slot =
            run_key.entry((event.aggregate_type.clone(), event.aggregate_id.clone())).or_insert(Some(key.clone()));
        if slot.as_deref() == Some(key.as_str()) {
            sent.push(event);
        } else {
            // Once a run is cut, every later event of the aggregate waits too.
            *slot = None;
            deferred.push(event.id);
        }
    }
    (sent, deferred)
}

/// `outbox.fault_injection = crash_after_publish`: exit between a successful XADD and the mark, as
/// a crash would, once per arming (setting it to `none` re-arms it). The launcher starts a new
/// relay, which publishes this one's events again (its claim in shared memory is released when it
/// exits).
fn crash_after_publish(published: usize) {
    if shmem::fault_fired() {
        return;
    }
    shmem::set_fault_fired(true);
    log!("outbox_pg: outbox.fault_injection = crash_after_publish: exiting after publishing {published} events, before marking them published");
    // SAFETY: ends the process the way PostgreSQL expects; no transaction is open.
    unsafe { pg_sys::proc_exit(1) };
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::{cut_runs_at_gaps, drop_held_elsewhere, first_of_each_aggregate, split_runs};
    use crate::entry::OutboxEvent;

    fn event(id: i64, aggregate_id: &str, stream: Option<&str>) -> OutboxEvent {
        OutboxEvent {
            id,
            event_id: format!("e{id}"),
            aggregate_type: "acct".into(),
            aggregate_id: aggregate_id.into(),
            aggregate_seq: id,
            event_type: "t".into(),
            payload: "{}".into(),
            headers: None,
            stream: stream.map(str::to_string),
            created_at: String::new(),
        }
    }

    #[test]
    fn a_run_is_cut_where_its_stream_key_changes() {
        let events = vec![
            event(1, "a", None),
            event(2, "b", Some("other")),
            event(3, "a", None),
            event(4, "a", Some("elsewhere")),
            event(5, "a", None),
            event(6, "b", Some("other")),
        ];
        let (sent, deferred) = split_runs(events, "outbox:{aggregate_type}");
        assert_eq!(sent.iter().map(|e| e.id).collect::<Vec<_>>(), [1, 2, 3, 6]);
        // Event 5 goes to the run's key again, but after a cut its aggregate waits.
        assert_eq!(deferred, [4, 5]);
    }

    #[test]
    fn events_held_by_another_relay_hold_back_their_aggregate_only() {
        let events = vec![event(1, "a", None), event(2, "b", None), event(3, "a", None), event(4, "c", None)];
        let held = HashSet::from([1]);
        let kept = drop_held_elsewhere(events.clone(), &held, true);
        // 3 waits for 1 (held elsewhere); b and c are unaffected.
        assert_eq!(ids(&kept), [2, 4]);
        // Without per-aggregate order only the held event itself is dropped.
        let kept = drop_held_elsewhere(events.clone(), &held, false);
        assert_eq!(ids(&kept), [2, 3, 4]);
        let kept = drop_held_elsewhere(events, &HashSet::new(), true);
        assert_eq!(ids(&kept), [1, 2, 3, 4]);
    }

    fn ids(events: &[OutboxEvent]) -> Vec<i64> {
        events.iter().map(|e| e.id).collect()
    }

    fn seq_event(id: i64, aggregate_id: &str, seq: i64) -> OutboxEvent {
        OutboxEvent { aggregate_seq: seq, ..event(id, aggregate_id, None) }
    }

    #[test]
    fn a_run_without_gaps_is_kept_whole() {
        let events = vec![seq_event(1, "a", 7), seq_event(2, "b", 1), seq_event(3, "a", 8), seq_event(4, "a", 9)];
        assert_eq!(ids(&cut_runs_at_gaps(events)), [1, 2, 3, 4]);
    }

    #[test]
    fn a_run_is_cut_at_the_first_gap_in_its_sequence() {
        // a#4 is missing (delivered out of order earlier, or not in the batch): a#5 and a#6 wait.
        let events = vec![
            seq_event(1, "a", 2),
            seq_event(2, "a", 3),
            seq_event(3, "b", 1),
            seq_event(5, "a", 5),
            seq_event(6, "a", 6),
        ];
        assert_eq!(ids(&cut_runs_at_gaps(events)), [1, 2, 3]);
    }

    #[test]
    fn events_of_an_aggregate_go_out_in_sequence_order_even_if_ids_do_not_follow_it() {
        // Ids handed out out of order (a sequence cache, say): a#1 has the higher id.
        let events = vec![seq_event(10, "a", 2), seq_event(11, "b", 1), seq_event(12, "a", 1)];
        let kept = cut_runs_at_gaps(events);
        assert_eq!(
            kept.iter().map(|e| (e.aggregate_id.as_str(), e.aggregate_seq)).collect::<Vec<_>>(),
            [("a", 1), ("b", 1), ("a", 2)]
        );
    }

    #[test]
    fn the_first_event_of_each_aggregate_is_its_head() {
        let events = vec![seq_event(1, "a", 3), seq_event(2, "b", 9), seq_event(3, "a", 4)];
        let heads = first_of_each_aggregate(&events);
        assert_eq!(heads.iter().map(|e| e.id).collect::<Vec<_>>(), [1, 2]);
    }
}
