//! The per-aggregate counters (`outbox.aggregates`): the last `aggregate_seq` each aggregate was
//! given. The relays read them with one primary-key probe per aggregate, straight from the index,
//! not through a statement: a planned join of the batch's aggregates with the counters depends on
//! the statistics, and a generic plan made while the table was empty (a fresh install, or right
//! after an ANALYZE of it) joined every counter with every aggregate of the batch: 8.5 s for a
//! round of 22,000 events (docs/performance.md). They are advanced by `outbox._advance` when a
//! batch is finished.

use pgrx::prelude::*;

use crate::log::datums;

/// Who reads, for the errors.
const READER: &str = "outbox_pg (reading the counters)";

/// The last `aggregate_seq` of each of these (aggregate_type, aggregate_id), None for an aggregate
/// that has no counter yet (the finish then inserts one rather than updating it). Inside a
/// transaction, under a snapshot taken now.
pub fn last_seqs<'a>(aggregates: impl ExactSizeIterator<Item = (&'a str, &'a str)>) -> Vec<Option<i64>> {
    let mut found = Vec::with_capacity(aggregates.len());
    // SAFETY: inside a transaction; the relation is opened and closed here, the registered
    // snapshot outlives the probes, the key datums outlive each probe (a per-probe memory context
    // holds them) and each tuple is read while its scan is on it.
    unsafe {
        let heap = pg_sys::table_open(
            datums::outbox_relation(c"aggregates", READER),
            pg_sys::AccessShareLock as pg_sys::LOCKMODE,
        );
        let index = datums::outbox_relation(c"aggregates_pkey", READER);
        let (type_column, id_column, seq_column) = (
            datums::column(heap, "aggregate_type"),
            datums::column(heap, "aggregate_id"),
            datums::column(heap, "last_seq"),
        );
        let descriptor = (*heap).rd_att;
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let per_probe = pg_sys::AllocSetContextCreateExtended(
            pg_sys::CurrentMemoryContext,
            c"outbox_pg counter probe".as_ptr(),
            pg_sys::ALLOCSET_SMALL_MINSIZE as usize,
            pg_sys::ALLOCSET_SMALL_INITSIZE as usize,
            pg_sys::ALLOCSET_SMALL_MAXSIZE as usize,
        );
        for (aggregate_type, aggregate_id) in aggregates {
            let outer = pg_sys::MemoryContextSwitchTo(per_probe);
            let mut keys: [pg_sys::ScanKeyData; 2] = std::mem::zeroed();
            for (key, (column, value)) in
                keys.iter_mut().zip([(type_column, aggregate_type), (id_column, aggregate_id)])
            {
                // ScanKeyInit compares with the C collation, the columns' own (src/sql/schema.sql).
                pg_sys::ScanKeyInit(
                    key,
                    column as pg_sys::AttrNumber,
                    pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
                    pg_sys::Oid::from(pg_sys::F_TEXTEQ),
                    value.into_datum().unwrap_or_else(|| error!("{READER}: a text key could not be made")),
                );
            }
            let scan = pg_sys::systable_beginscan(heap, index, true, snapshot, 2, keys.as_mut_ptr());
            let tuple = pg_sys::systable_getnext(scan);
            let mut last_seq = None;
            if !tuple.is_null() {
                let mut null = false;
                let value = pg_sys::fastgetattr(tuple, seq_column as i32, descriptor, &mut null);
                // last_seq is NOT NULL; a row is a counter whatever it holds.
                last_seq = Some(if null { 0 } else { value.value() as i64 });
            }
            pg_sys::systable_endscan(scan);
            pg_sys::MemoryContextSwitchTo(outer);
            pg_sys::MemoryContextReset(per_probe);
            found.push(last_seq);
        }
        pg_sys::MemoryContextDelete(per_probe);
        pg_sys::UnregisterSnapshot(snapshot);
        pg_sys::table_close(heap, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
    }
    found
}

/// `tests.counters` (src/sql/test_helpers.sql, test build only): the counters as the relays read
/// them: the 1-based position and last `aggregate_seq` of each aggregate that has one.
#[cfg(any(test, feature = "pg_test"))]
#[pg_extern(sql = false)]
fn counters(
    aggregate_types: Array<&str>,
    aggregate_ids: Array<&str>,
) -> TableIterator<'static, (name!(ordinal, i64), name!(last_seq, i64))> {
    if aggregate_types.len() != aggregate_ids.len()
        || aggregate_types.contains_nulls()
        || aggregate_ids.contains_nulls()
    {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!(
                "tests.counters: {} aggregate types and {} aggregate ids (with NULLs: {})",
                aggregate_types.len(),
                aggregate_ids.len(),
                aggregate_types.contains_nulls() || aggregate_ids.contains_nulls()
            ),
            "Pass two arrays of the same length, without NULLs: aggregate_types[n] and aggregate_ids[n] name one aggregate."
        );
    }
    let pairs: Vec<(&str, &str)> = aggregate_types.iter().flatten().zip(aggregate_ids.iter().flatten()).collect();
    let seqs = last_seqs(pairs.into_iter());
    TableIterator::new(
        seqs.into_iter().enumerate().filter_map(|(n, seq)| Some((n as i64 + 1, seq?))).collect::<Vec<_>>(),
    )
}
