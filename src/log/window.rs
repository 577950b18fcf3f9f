//! The batch rule, in one place: which events of a shard a round publishes, and in which order.
//! A shard's window is the events of the transactions visible in its `upto` snapshot and not in
//! its cursor (PgQ's rule; docs/worker.md, "The log"): the transactions the cursor saw as running
//! (its in-progress list) and those from the cursor's xmax on, so that a long transaction never
//! makes a window rescan what was consumed after it began.
//!
//! **Order.** Within an aggregate, `id` order is commit order: two transactions with events of one
//! aggregate took its order lock in turn (src/enqueue/order.rs). A window that fits in a round is
//! published in `id` order. A window published in parts (below) goes transaction by transaction,
//! in the order of each transaction's largest `id` in the shard, each transaction's events in `id`
//! order: commit order for every aggregate too, since every `id` of an aggregate the first of two
//! such transactions drew is below every `id` of it the second drew after the first had committed,
//! hence below the second's largest.
//!
//! **Bounded rounds.** A round takes at most `ROUND_EVENTS` events and about `ROUND_BYTES` bytes,
//! whatever one transaction enqueued. A window that fits is read whole, in one pass. One that does
//! not is published in parts: its transactions are listed with their largest ids from the index
//! alone, and each round reads on from a *position* (a transaction's largest id and the last id
//! published of it), which the finish stores with the cursor (`outbox.shards.window_upto`,
//! `window_max_id`, `window_last_id`). The transaction-by-transaction order makes the position a
//! plain cut: everything at or before it is consumed; and a transaction of any size can be cut.
//!
//! The relays read the three log tables' `(shard, txid, id)` indexes directly, without the
//! executor (src/log/tables.rs): a statement materialised every row into a tuplestore, copied it
//! again into SPI's table and formatted `created_at` with `to_char`, which was most of a relay's
//! time per event (docs/performance.md). `tests.read_shard` (the test build) runs this same code for
//! diagnosis.

use std::collections::HashMap;

#[cfg(any(test, feature = "pg_test"))]
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

pub use crate::log::batch::{Budget, LogEvent, Position, WindowRead};
pub use crate::log::snapshot::Snapshot;
use crate::log::tables::{Bound, LogTables};

/// The transactions of each window being published in parts (by shard), with their largest ids,
/// in publish order. Listing them reads only the index; a relay keeps the list for the rounds
/// that follow (one that takes the shard over lists it again).
#[derive(Debug, Default)]
pub struct WindowPlans {
    plans: HashMap<i16, WindowPlan>,
}

/// A window (cursor, upto) and its transactions as (txid, largest id), in publish order.
type WindowPlan = (Snapshot, Snapshot, Vec<(u64, i64)>);

impl WindowPlans {
    fn get(&mut self, shard: i16, cursor: &Snapshot, upto: &Snapshot) -> Vec<(u64, i64)> {
        let stale = self.plans.get(&shard).is_none_or(|(c, u, _)| c != cursor || u != upto);
        if stale {
            let plan = window_transactions(shard, cursor, upto);
            self.plans.insert(shard, (cursor.clone(), upto.clone(), plan));
        }
        self.plans[&shard].2.clone()
    }

    /// Forgets the plan of `shard` (its window is done, or the shard is not this relay's).
    pub fn forget(&mut self, shard: i16) {
        self.plans.remove(&shard);
    }
}

/// Reads what this round takes of `shard`'s window between `cursor` and `upto`: the whole window
/// when nothing of it was published yet (`from` None) and it fits in `budget`; else the events
/// after `from` in publish order, as many as `budget` allows. `budget` is charged for them.
/// Inside a transaction; holds AccessShareLock on the three log tables until it ends (as any
/// reader does: retention's TRUNCATE waits for it, at most 100 ms).
pub fn read_shard(
    shard: i16,
    cursor: &Snapshot,
    upto: &Snapshot,
    from: Option<Position>,
    budget: &mut Budget,
    plans: &mut WindowPlans,
) -> WindowRead {
    if budget.exhausted() {
        return WindowRead { events: Vec::new(), complete: false, position: from };
    }
    if from.is_none() {
        if let Some(mut events) = read_whole(shard, cursor, upto, *budget) {
            order_whole(&mut events);
            for event in &events {
                budget.take(event.event.approximate_size());
            }
            plans.forget(shard);
            return WindowRead { events, complete: true, position: None };
        }
    }
    let start = from.unwrap_or((i64::MIN, i64::MIN));
    let mut read = WindowRead { events: Vec::new(), complete: true, position: from };
    for (txid, max_id) in plans.get(shard, cursor, upto).into_iter().filter(|&(_, max_id)| max_id >= start.0) {
        if budget.exhausted() {
            read.complete = false;
            break;
        }
        let after = if max_id == start.0 { start.1 } else { i64::MIN };
        let (rows, exhausted) = read_transaction(shard, txid, max_id, after, budget);
        if let Some(last) = rows.last() {
            read.position = Some(last.position());
        }
        read.events.extend(rows);
        if !exhausted {
            read.complete = false;
            break;
        }
    }
    if read.complete {
        read.position = None;
        plans.forget(shard);
    }
    read
}

/// Sorts a whole window into publish order: id order.
fn order_whole(events: &mut [LogEvent]) {
    for event in events.iter_mut() {
        event.txn_max_id = event.event.id;
    }
    events.sort_unstable_by_key(LogEvent::position);
}

/// The whole window of `shard` between `cursor` and `upto` (not yet in publish order), if it fits
/// in `budget`; None as soon as it does not.
fn read_whole(shard: i16, cursor: &Snapshot, upto: &Snapshot, budget: Budget) -> Option<Vec<LogEvent>> {
    let mut events = Vec::new();
    let mut left = budget;
    let fits = LogTables::open().all(|table| {
        cursor.xip.iter().filter(|&&txid| upto.sees(txid)).all(|&txid| {
            table.read(shard, Bound::Equal(txid), i64::MIN, &|txid| upto.sees(txid), &mut left, &mut events)
        }) && (cursor.xmax >= upto.xmax
            || table.read(
                shard,
                Bound::Range(cursor.xmax, upto.xmax),
                i64::MIN,
                &|txid| upto.sees(txid),
                &mut left,
                &mut events,
            ))
    });
    fits.then_some(events)
}

/// The events of `txid` in `shard` after id `after`, in id order, as many as `budget` allows (it
/// is charged for them), each marked with the transaction's largest id `max_id`; and whether they
/// are all it has left.
fn read_transaction(shard: i16, txid: u64, max_id: i64, after: i64, budget: &mut Budget) -> (Vec<LogEvent>, bool) {
    // A transaction may span two tables (a generation switched while it ran): each is read within
    // the budget, and of the rows read only those below the first table's cut are sure to come
    // next in id order.
    let mut rows = Vec::new();
    let mut cut: Option<i64> = None;
    let mut tables = LogTables::open();
    tables.all(|table| {
        let mut left = *budget;
        let before = rows.len();
        let complete = table.read(shard, Bound::Equal(txid), after, &|_| true, &mut left, &mut rows);
        if !complete {
            let last = rows[before..].last().map_or(after, |row: &LogEvent| row.event.id);
            cut = Some(cut.map_or(last, |cut| cut.min(last)));
        }
        true
    });
    rows.sort_unstable_by_key(|row| row.event.id);
    let mut exhausted = cut.is_none();
    let mut kept = Vec::with_capacity(rows.len());
    for mut row in rows {
        let size = row.event.approximate_size();
        if cut.is_some_and(|cut| row.event.id > cut) || !budget.allows(size) {
            exhausted = false;
            break;
        }
        budget.take(size);
        row.txn_max_id = max_id;
        kept.push(row);
    }
    (kept, exhausted)
}

/// The transactions of `shard`'s window between `cursor` and `upto`, with their largest ids, in
/// publish order. From the `(shard, txid, id)` indexes alone: a probe for the first entry of each
/// transaction and one for its last, however many events it has; a transaction the window does
/// not take (running or rolled back when `upto` was taken) costs one probe.
fn window_transactions(shard: i16, cursor: &Snapshot, upto: &Snapshot) -> Vec<(u64, i64)> {
    let mut largest: HashMap<u64, i64> = HashMap::new();
    let mut note = |txid: u64, id: i64| {
        let entry = largest.entry(txid).or_insert(id);
        *entry = (*entry).max(id);
    };
    LogTables::open().all(|table| {
        for &txid in cursor.xip.iter().filter(|&&txid| upto.sees(txid)) {
            if let Some(id) = table.last_id(shard, txid) {
                note(txid, id);
            }
        }
        let mut from = cursor.xmax;
        while from < upto.xmax {
            let Some(txid) = table.first_txid(shard, from, upto.xmax) else { break };
            if upto.sees(txid) {
                if let Some(id) = table.last_id(shard, txid) {
                    note(txid, id);
                }
            }
            from = txid + 1;
        }
        true
    });
    let mut plan: Vec<(u64, i64)> = largest.into_iter().collect();
    plan.sort_unstable_by_key(|&(_, max_id)| max_id);
    plan
}

/// Makes sure the commits of these transactions are on disk before their events are published. A
/// writer that commits with `synchronous_commit = off` is acknowledged before its commit record is
/// flushed; published then, its event could reach Redis and the transaction be lost in an
/// operating-system crash, leaving an entry whose event never existed and whose `aggregate_seq` the
/// aggregate's next event gets again. The commit log keeps, for asynchronous commits, the LSN to
/// flush up to (`TransactionIdGetCommitLSN`, per group of transactions); synchronous commits are
/// on disk already and need nothing, so a relay serving only those never flushes.
pub fn flush_commits(txids: &mut dyn Iterator<Item = u64>) {
    let mut upto: pg_sys::XLogRecPtr = 0;
    let mut last = None;
    for txid in txids {
        if last == Some(txid) {
            continue;
        }
        last = Some(txid);
        // SAFETY: a commit-log lookup of a transaction this relay saw committed in its snapshot;
        // the low 32 bits of an xid8 are its TransactionId.
        upto = upto.max(unsafe { pg_sys::TransactionIdGetCommitLSN(pg_sys::TransactionId::from(txid as u32)) });
    }
    if upto != 0 {
        // SAFETY: flushing WAL already written is what every committing backend does; it returns
        // at once when it is on disk already.
        unsafe { pg_sys::XLogFlush(upto) };
    }
}

/// `tests.read_log` (called by `tests.read_shard`; src/sql/test_helpers.sql, test build only):
/// what a round with an allowance of `max_events` events would read of one shard's window, in
/// publish order.
#[cfg(any(test, feature = "pg_test"))]
#[pg_extern(sql = false)]
#[allow(clippy::type_complexity)]
fn read_log(
    the_shard: i16,
    cursor: &str,
    upto: &str,
    max_events: i32,
) -> TableIterator<
    'static,
    (
        name!(txid, i64),
        name!(id, i64),
        name!(event_id, String),
        name!(aggregate_type, String),
        name!(aggregate_id, String),
        name!(event_type, String),
        name!(payload, String),
        name!(headers, Option<String>),
        name!(stream, Option<String>),
        name!(created_at, String),
    ),
> {
    let refuse = |message: String, hint: &str| -> ! {
        ErrorReport::new(PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, message, "tests.read_log")
            .set_hint(hint)
            .report(PgLogLevel::ERROR);
        unreachable!("ERROR does not return")
    };
    let snapshot = |name: &str, text: &str| {
        Snapshot::parse(text).unwrap_or_else(|| {
            refuse(
                format!("tests.read_log: {name} {text:?} is not a pg_snapshot"),
                "Pass a snapshot such as pg_current_snapshot() or a shard's cursor from outbox.shards.",
            )
        })
    };
    let (cursor, upto) = (snapshot("cursor", cursor), snapshot("upto", upto));
    if max_events < 0 {
        refuse(
            format!("tests.read_log: max_events {max_events} is negative"),
            "Pass how many events a round may take, 0 or more.",
        );
    }
    let mut budget = Budget { events: max_events as usize, bytes: usize::MAX, taken: 0 };
    let read = read_shard(the_shard, &cursor, &upto, None, &mut budget, &mut WindowPlans::default());
    TableIterator::new(read.events.into_iter().map(|LogEvent { txid, event, .. }| {
        (
            txid as i64,
            event.id,
            event.event_id,
            event.aggregate_type,
            event.aggregate_id,
            event.event_type,
            event.payload,
            event.headers,
            event.stream,
            event.created_at,
        )
    }))
}

/// A row of `tests.read_window`: an event, or (every event column None) the read's outcome.
#[cfg(any(test, feature = "pg_test"))]
type WindowRow = (
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<bool>,
    Option<i64>,
    Option<i64>,
);

/// `tests.read_window` (src/sql/test_helpers.sql, test build only): `read_shard` with every input
/// of a round (the position, the allowance) and every output (the events with their `txn_max_id`
/// and size, then whether the window is complete and the position), in the shape of
/// `outbox._read_window` (src/sql/relay/read.sql), which tests/relay_sql.rs compares with it.
#[cfg(any(test, feature = "pg_test"))]
#[pg_extern(sql = false)]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn read_window(
    the_shard: i16,
    cursor: &str,
    upto: &str,
    window_max_id: Option<i64>,
    window_last_id: Option<i64>,
    max_events: i32,
    max_bytes: i64,
    taken: i32,
) -> TableIterator<
    'static,
    (
        name!(txid, Option<i64>),
        name!(txn_max_id, Option<i64>),
        name!(id, Option<i64>),
        name!(event_id, Option<String>),
        name!(aggregate_type, Option<String>),
        name!(aggregate_id, Option<String>),
        name!(event_type, Option<String>),
        name!(payload, Option<String>),
        name!(headers, Option<String>),
        name!(stream, Option<String>),
        name!(created_at, Option<String>),
        name!(traceparent, Option<String>),
        name!(tracestate, Option<String>),
        name!(size, Option<i64>),
        name!(complete, Option<bool>),
        name!(position_max_id, Option<i64>),
        name!(position_last_id, Option<i64>),
    ),
> {
    let (Some(cursor), Some(upto)) = (Snapshot::parse(cursor), Snapshot::parse(upto)) else {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("tests.read_window: {cursor:?} or {upto:?} is not a pg_snapshot"),
            "Pass snapshots such as pg_current_snapshot()::text."
        );
    };
    let from = window_max_id.zip(window_last_id);
    let mut budget =
        Budget { events: max_events.max(0) as usize, bytes: max_bytes.max(0) as usize, taken: taken.max(0) as usize };
    let read = read_shard(the_shard, &cursor, &upto, from, &mut budget, &mut WindowPlans::default());
    let mut rows: Vec<WindowRow> = read
        .events
        .into_iter()
        .map(|LogEvent { txid, txn_max_id, event }| {
            let size = event.approximate_size() as i64;
            let (traceparent, tracestate) =
                event.trace.map_or((None, None), |trace| (Some(trace.traceparent), trace.tracestate));
            (
                Some(txid as i64),
                Some(txn_max_id),
                Some(event.id),
                Some(event.event_id),
                Some(event.aggregate_type),
                Some(event.aggregate_id),
                Some(event.event_type),
                Some(event.payload),
                event.headers,
                event.stream,
                Some(event.created_at),
                traceparent,
                tracestate,
                Some(size),
                None,
                None,
                None,
            )
        })
        .collect();
    let position = read.position;
    rows.push((
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        Some(read.complete),
        position.map(|p| p.0),
        position.map(|p| p.1),
    ));
    TableIterator::new(rows)
}

#[cfg(test)]
mod tests {
    use super::Budget;

    #[test]
    fn a_round_takes_its_first_event_whatever_its_size_and_then_what_fits() {
        let mut budget = Budget { events: 3, bytes: 100, taken: 0 };
        assert!(budget.allows(1_000), "the first event goes, however large");
        budget.take(60);
        assert!(!budget.allows(1_000));
        assert!(budget.allows(40) && !budget.allows(41));
        budget.take(40);
        assert!(budget.exhausted());
        let mut budget = Budget { events: 1, bytes: 100, taken: 0 };
        budget.take(1);
        assert!(budget.exhausted() && !budget.allows(1));
    }
}
