//! The batch rule, in one place: which events of a shard a round publishes. A shard's window is
//! the events of the transactions visible in its `upto` snapshot and not in its cursor (PgQ's
//! rule; docs/worker.md, "The log"): the transactions the cursor saw as running (its in-progress
//! list, one index probe each) and those from the cursor's xmax on (one index range), so that a
//! long transaction never makes a window rescan what was consumed after it began.
//!
//! The relays read the three log tables' `(shard, txid)` indexes directly, without the executor:
//! a statement materialised every row into a tuplestore, copied it again into SPI's table and
//! formatted `created_at` with `to_char`, which was most of a relay's time per event
//! (docs/performance.md). `outbox._read_shard` runs this same code for tests and diagnosis.

use std::ffi::CStr;

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::datums;
use crate::entry::OutboxEvent;

/// A `pg_snapshot` as its text form spells it (`xmin:xmax:xip,...`): which transactions it sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    xmin: u64,
    xmax: u64,
    /// Running when the snapshot was taken, ascending.
    xip: Vec<u64>,
}

impl Snapshot {
    /// Parses the text form of a `pg_snapshot`; `None` when it is not one.
    pub fn parse(text: &str) -> Option<Snapshot> {
        let mut parts = text.trim().splitn(3, ':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let list = parts.next()?;
        let mut xip = if list.is_empty() {
            Vec::new()
        } else {
            list.split(',').map(|x| x.parse().ok()).collect::<Option<Vec<u64>>>()?
        };
        if xmin > xmax || xip.iter().any(|&x| x < xmin || x >= xmax) {
            return None;
        }
        xip.sort_unstable();
        xip.dedup();
        Some(Snapshot { xmin, xmax, xip })
    }

    /// Whether a transaction is visible in (had completed before) this snapshot, as
    /// `pg_visible_in_snapshot` answers it.
    pub fn sees(&self, txid: u64) -> bool {
        txid < self.xmin || (txid < self.xmax && self.xip.binary_search(&txid).is_err())
    }
}

/// An event of a window, with the transaction that wrote it.
#[derive(Debug, Clone)]
pub struct LogEvent {
    pub txid: u64,
    /// `aggregate_seq` is 0: the relay assigns it (src/worker/tick.rs).
    pub event: OutboxEvent,
}

/// The window of `shard` between `cursor` and `upto`: its events, the in-progress part first,
/// then the range part in txid order, cut after `max_events` rows of the range part. Inside a
/// transaction; holds AccessShareLock on the three log tables until it ends (as any reader does:
/// retention's TRUNCATE waits for it, at most 100 ms).
pub fn read_window(shard: i16, cursor: &Snapshot, upto: &Snapshot, max_events: usize) -> Vec<LogEvent> {
    // SAFETY: inside a transaction; every relation opened here is closed here, the registered
    // snapshot outlives the scans, and tuples are read only while their scan is on them.
    unsafe {
        // Taken now: it sees every transaction `upto` shows as completed (upto was taken before).
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let mut in_progress = Vec::new();
        let mut range = Vec::new();
        for (table, index) in LOG_TABLES {
            let heap =
                pg_sys::table_open(datums::outbox_relation(table, READER), pg_sys::AccessShareLock as pg_sys::LOCKMODE);
            let index = datums::outbox_relation(index, READER);
            let columns = Columns::of(heap);
            for &txid in cursor.xip.iter().filter(|&&txid| upto.sees(txid)) {
                scan(
                    heap,
                    index,
                    &columns,
                    snapshot,
                    shard,
                    Bound::Equal(txid),
                    |txid| upto.sees(txid),
                    &mut in_progress,
                );
            }
            if cursor.xmax < upto.xmax {
                let bound = Bound::Range(cursor.xmax, upto.xmax);
                scan(heap, index, &columns, snapshot, shard, bound, |txid| upto.sees(txid), &mut range);
            }
            pg_sys::table_close(heap, pg_sys::NoLock as pg_sys::LOCKMODE);
        }
        pg_sys::UnregisterSnapshot(snapshot);
        // Each table's rows came in txid order; the three tables' are merged, and within a
        // transaction its events are in id order (a transaction may span two tables when a
        // generation switched while it ran).
        range.sort_by_key(|event: &LogEvent| (event.txid, event.event.id));
        range.truncate(max_events);
        in_progress.extend(range);
        in_progress
    }
}

/// Who reads, for the errors.
const READER: &str = "outbox_pg (reading the log)";

/// The three generations of the log and their `(shard, txid)` indexes (src/sql/schema.sql).
const LOG_TABLES: [(&CStr, &CStr); 3] =
    [(c"events_0", c"events_0_batch_idx"), (c"events_1", c"events_1_batch_idx"), (c"events_2", c"events_2_batch_idx")];

/// The attribute numbers (1-based) of a log table's columns.
struct Columns {
    txid: usize,
    shard: usize,
    id: usize,
    event_id: usize,
    aggregate_type: usize,
    aggregate_id: usize,
    event_type: usize,
    payload: usize,
    headers: usize,
    stream: usize,
    created_at: usize,
    natts: usize,
}

impl Columns {
    unsafe fn of(heap: pg_sys::Relation) -> Columns {
        // SAFETY: an open relation.
        unsafe {
            let find = |name| datums::column(heap, name);
            Columns {
                txid: find("txid"),
                shard: find("shard"),
                id: find("id"),
                event_id: find("event_id"),
                aggregate_type: find("aggregate_type"),
                aggregate_id: find("aggregate_id"),
                event_type: find("event_type"),
                payload: find("payload"),
                headers: find("headers"),
                stream: find("stream"),
                created_at: find("created_at"),
                natts: (*(*heap).rd_att).natts as usize,
            }
        }
    }
}

/// Which transactions an index scan covers.
#[derive(Debug, Clone, Copy)]
enum Bound {
    Equal(u64),
    /// From the first, inclusive, to the second, exclusive.
    Range(u64, u64),
}

/// Appends to `into` the events of `shard` in `bound` whose transaction `keep` accepts, walking the
/// `(shard, txid)` index in order.
#[allow(clippy::too_many_arguments)]
unsafe fn scan(
    heap: pg_sys::Relation,
    index: pg_sys::Oid,
    columns: &Columns,
    snapshot: pg_sys::Snapshot,
    shard: i16,
    bound: Bound,
    keep: impl Fn(u64) -> bool,
    into: &mut Vec<LogEvent>,
) {
    // SAFETY: as in read_window; the scan keys outlive the scan; each row's datums are read (and
    // copied into Rust values) while the scan is on its tuple, in a memory context reset per row.
    unsafe {
        let mut keys: [pg_sys::ScanKeyData; 3] = std::mem::zeroed();
        let key = |keys: &mut [pg_sys::ScanKeyData; 3], n: usize, attno: usize, strategy: u32, procedure, value| {
            pg_sys::ScanKeyInit(
                &mut keys[n],
                attno as pg_sys::AttrNumber,
                strategy as pg_sys::StrategyNumber,
                procedure,
                value,
            )
        };
        key(
            &mut keys,
            0,
            columns.shard,
            pg_sys::BTEqualStrategyNumber,
            pg_sys::Oid::from(pg_sys::F_INT2EQ),
            pg_sys::Datum::from(shard),
        );
        let nkeys = match bound {
            Bound::Equal(txid) => {
                key(
                    &mut keys,
                    1,
                    columns.txid,
                    pg_sys::BTEqualStrategyNumber,
                    pg_sys::Oid::from(pg_sys::F_XID8EQ),
                    pg_sys::Datum::from(txid),
                );
                2
            }
            Bound::Range(from, below) => {
                key(
                    &mut keys,
                    1,
                    columns.txid,
                    pg_sys::BTGreaterEqualStrategyNumber,
                    pg_sys::Oid::from(pg_sys::F_XID8GE),
                    pg_sys::Datum::from(from),
                );
                key(
                    &mut keys,
                    2,
                    columns.txid,
                    pg_sys::BTLessStrategyNumber,
                    pg_sys::Oid::from(pg_sys::F_XID8LT),
                    pg_sys::Datum::from(below),
                );
                3
            }
        };
        let descriptor = (*heap).rd_att;
        let mut values = vec![pg_sys::Datum::from(0usize); columns.natts];
        let mut nulls = vec![false; columns.natts];
        let per_row = pg_sys::AllocSetContextCreateExtended(
            pg_sys::CurrentMemoryContext,
            c"outbox_pg log row".as_ptr(),
            pg_sys::ALLOCSET_DEFAULT_MINSIZE as usize,
            pg_sys::ALLOCSET_DEFAULT_INITSIZE as usize,
            pg_sys::ALLOCSET_DEFAULT_MAXSIZE as usize,
        );
        let scan = pg_sys::systable_beginscan(heap, index, true, snapshot, nkeys, keys.as_mut_ptr());
        loop {
            let tuple = pg_sys::systable_getnext(scan);
            if tuple.is_null() {
                break;
            }
            let outer = pg_sys::MemoryContextSwitchTo(per_row);
            pg_sys::heap_deform_tuple(tuple, descriptor, values.as_mut_ptr(), nulls.as_mut_ptr());
            let value = |attno: usize| (!nulls[attno - 1]).then(|| values[attno - 1]);
            let txid = value(columns.txid).map(|d| d.value() as u64).unwrap_or_default();
            if keep(txid) {
                let text = |attno: usize| value(attno).map(|d| datums::text(d));
                let json = |attno: usize| value(attno).map(|d| datums::jsonb_text(d));
                into.push(LogEvent {
                    txid,
                    event: OutboxEvent {
                        id: value(columns.id).map(|d| d.value() as i64).unwrap_or_default(),
                        event_id: value(columns.event_id).map(|d| datums::uuid_text(d)).unwrap_or_default(),
                        aggregate_type: text(columns.aggregate_type).unwrap_or_default(),
                        aggregate_id: text(columns.aggregate_id).unwrap_or_default(),
                        aggregate_seq: 0,
                        event_type: text(columns.event_type).unwrap_or_default(),
                        payload: json(columns.payload).unwrap_or_default(),
                        headers: json(columns.headers),
                        stream: text(columns.stream),
                        created_at: value(columns.created_at)
                            .map(|d| datums::timestamptz_text(d.value() as i64))
                            .unwrap_or_default(),
                    },
                });
            }
            pg_sys::MemoryContextSwitchTo(outer);
            pg_sys::MemoryContextReset(per_row);
        }
        pg_sys::systable_endscan(scan);
        pg_sys::MemoryContextDelete(per_row);
    }
}

/// `outbox._read_log` (called by `outbox._read_shard`): one shard's window as the relays read it,
/// for tests and diagnosis.
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
        ErrorReport::new(PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, message, "outbox._read_log")
            .set_hint(hint)
            .report(PgLogLevel::ERROR);
        unreachable!("ERROR does not return")
    };
    let snapshot = |name: &str, text: &str| {
        Snapshot::parse(text).unwrap_or_else(|| {
            refuse(
                format!("outbox._read_log: {name} {text:?} is not a pg_snapshot"),
                "Pass a snapshot such as pg_current_snapshot() or a shard's cursor from outbox.shards.",
            )
        })
    };
    let (cursor, upto) = (snapshot("cursor", cursor), snapshot("upto", upto));
    if max_events < 0 {
        refuse(
            format!("outbox._read_log: max_events {max_events} is negative"),
            "Pass how many events of the range part to read at most, 0 or more.",
        );
    }
    let rows = read_window(the_shard, &cursor, &upto, max_events as usize);
    TableIterator::new(rows.into_iter().map(|LogEvent { txid, event }| {
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

#[cfg(test)]
mod tests {
    use super::Snapshot;

    #[test]
    fn a_snapshot_sees_what_completed_before_it() {
        let snapshot = Snapshot::parse("10:20:15,12").unwrap();
        assert!(snapshot.sees(9));
        assert!(snapshot.sees(10) && snapshot.sees(14) && snapshot.sees(19));
        assert!(!snapshot.sees(12) && !snapshot.sees(15));
        assert!(!snapshot.sees(20) && !snapshot.sees(21));
        assert_eq!(Snapshot::parse("5:5:").unwrap(), Snapshot { xmin: 5, xmax: 5, xip: vec![] });
    }

    #[test]
    fn what_is_not_a_snapshot_is_refused() {
        for text in ["", "1", "1:2", "2:1:", "1:5:7", "1:5:0", "a:b:", "1:5:2,x"] {
            assert_eq!(Snapshot::parse(text), None, "{text:?}");
        }
    }
}
