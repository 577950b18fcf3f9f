//! The log's tables as the relays read them, without the executor: the three tables opened under
//! one snapshot, and scans of their `(shard, txid, id)` indexes by transaction, by id and index
//! only. What a window is and in which order it goes out is src/log/window.rs's; this is how rows
//! and index entries are found and turned into events.

use outbox_sink::event::{OutboxEvent, TraceContext};
use pgrx::prelude::*;

use crate::log::batch::{Budget, LogEvent};
use crate::log::columns::{Column, BATCH_INDEXES, COLUMNS, COUNT, INDEX_ID, INDEX_SHARD, INDEX_TXID, TABLES};
use crate::log::datums;

/// Who reads, for the errors.
const READER: &str = "outbox_pg (reading the log)";

/// The attribute numbers (1-based) of a log table's columns, found by name.
struct Columns {
    attnums: [usize; COUNT],
    natts: usize,
}

impl Columns {
    unsafe fn of(heap: pg_sys::Relation) -> Columns {
        // SAFETY: an open relation.
        unsafe {
            Columns {
                attnums: COLUMNS.map(|column| datums::column(heap, column.name())),
                natts: (*(*heap).rd_att).natts as usize,
            }
        }
    }

    fn at(&self, column: Column) -> usize {
        self.attnums[column.index()]
    }
}

/// Which transactions a scan covers.
#[derive(Debug, Clone, Copy)]
pub enum Bound {
    Equal(u64),
    /// From the first, inclusive, to the second, exclusive.
    Range(u64, u64),
}

/// One table of the log, open, with its `(shard, txid, id)` index.
pub struct LogTable {
    heap: pg_sys::Relation,
    index: pg_sys::Relation,
    columns: Columns,
    snapshot: pg_sys::Snapshot,
}

/// The three tables of the log, opened under one snapshot taken now (it sees every transaction any
/// earlier snapshot saw committed), and closed when dropped (their AccessShareLock is kept to the
/// end of the transaction).
pub struct LogTables {
    tables: Vec<LogTable>,
    snapshot: pg_sys::Snapshot,
}

impl LogTables {
    /// Inside a transaction.
    pub fn open() -> LogTables {
        // SAFETY: inside a transaction; every relation opened here is closed in Drop, and the
        // registered snapshot outlives them.
        unsafe {
            let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
            let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
            let tables = TABLES
                .iter()
                .zip(BATCH_INDEXES)
                .map(|(table, index)| {
                    let heap = pg_sys::table_open(datums::outbox_relation(table, READER), lock);
                    let index = pg_sys::index_open(datums::outbox_relation(index, READER), lock);
                    LogTable { heap, index, columns: Columns::of(heap), snapshot }
                })
                .collect();
            LogTables { tables, snapshot }
        }
    }

    /// Calls `each` on every table in turn while it returns true; whether it always did.
    pub fn all(&mut self, each: impl FnMut(&LogTable) -> bool) -> bool {
        self.tables.iter().all(each)
    }
}

impl Drop for LogTables {
    fn drop(&mut self) {
        // SAFETY: opened in `open`; the locks stay until the transaction ends.
        unsafe {
            for table in &self.tables {
                pg_sys::index_close(table.index, pg_sys::NoLock as pg_sys::LOCKMODE);
                pg_sys::table_close(table.heap, pg_sys::NoLock as pg_sys::LOCKMODE);
            }
            pg_sys::UnregisterSnapshot(self.snapshot);
        }
    }
}

/// Whether a transaction the caller saw completed committed (its rows may still be gone: a
/// rolled-back subtransaction's).
pub fn committed(txid: u64) -> bool {
    // SAFETY: a commit-log lookup of a recent transaction (one that no cursor has consumed); the
    // low 32 bits of an xid8 are its TransactionId.
    unsafe { pg_sys::TransactionIdDidCommit(pg_sys::TransactionId::from(txid as u32)) }
}

/// Whether a transaction is known to have rolled back: none of its rows is there, so a read skips
/// it without visiting them.
pub fn rolled_back(txid: u64) -> bool {
    // SAFETY: as in `committed`.
    unsafe { pg_sys::TransactionIdDidAbort(pg_sys::TransactionId::from(txid as u32)) }
}

/// A scan key on column `attno` (of the heap for a systable scan, of the index for an index scan).
pub fn index_key(attno: usize, strategy: u32, procedure: u32, value: pg_sys::Datum) -> pg_sys::ScanKeyData {
    // SAFETY: ScanKeyInit fills every field of a zeroed key.
    unsafe {
        let mut key: pg_sys::ScanKeyData = std::mem::zeroed();
        pg_sys::ScanKeyInit(
            &mut key,
            attno as pg_sys::AttrNumber,
            strategy as pg_sys::StrategyNumber,
            pg_sys::Oid::from(procedure),
            value,
        );
        key
    }
}

impl LogTable {
    /// Scan keys (heap attribute numbers, as systable scans take them) for the rows of `txid` in
    /// `shard` with an id above `after`.
    fn transaction_keys(&self, shard: i16, txid: u64, after: i64) -> Vec<pg_sys::ScanKeyData> {
        let columns = &self.columns;
        let mut keys = vec![
            index_key(
                columns.at(Column::Shard),
                pg_sys::BTEqualStrategyNumber,
                pg_sys::F_INT2EQ,
                pg_sys::Datum::from(shard),
            ),
            index_key(
                columns.at(Column::Txid),
                pg_sys::BTEqualStrategyNumber,
                pg_sys::F_XID8EQ,
                pg_sys::Datum::from(txid),
            ),
        ];
        if after > i64::MIN {
            keys.push(index_key(
                columns.at(Column::Id),
                pg_sys::BTGreaterStrategyNumber,
                pg_sys::F_INT8GT,
                pg_sys::Datum::from(after),
            ));
        }
        keys
    }

    /// Appends to `into` the events of `shard` in `bound` with an id above `after` whose
    /// transaction `keep` accepts, in index order, while `budget` allows (charging it). Whether
    /// it read them all (false: it stopped for the budget).
    pub fn read(
        &self,
        shard: i16,
        bound: Bound,
        after: i64,
        keep: &impl Fn(u64) -> bool,
        budget: &mut Budget,
        into: &mut Vec<LogEvent>,
    ) -> bool {
        let txid = match bound {
            Bound::Equal(txid) => txid,
            // Transaction by transaction, found from the index alone: a transaction the window
            // does not take (one still running, however many rows it has written so far) costs
            // one probe, not a visit to each of its rows.
            Bound::Range(mut from, below) => {
                while let Some(txid) = self.first_txid(shard, from, below) {
                    if keep(txid)
                        && !rolled_back(txid)
                        && !self.read(shard, Bound::Equal(txid), after, keep, budget, into)
                    {
                        return false;
                    }
                    from = txid + 1;
                }
                return true;
            }
        };
        let columns = &self.columns;
        let mut keys = self.transaction_keys(shard, txid, after);
        let mut complete = true;
        // SAFETY: an open relation and index, a registered snapshot; the keys outlive the scan;
        // each row's datums are read (and copied into Rust values) while the scan is on its
        // tuple, in a memory context reset per row.
        unsafe {
            let descriptor = (*self.heap).rd_att;
            let mut values = vec![pg_sys::Datum::from(0usize); columns.natts];
            let mut nulls = vec![false; columns.natts];
            let per_row = pg_sys::AllocSetContextCreateExtended(
                pg_sys::CurrentMemoryContext,
                c"outbox_pg log row".as_ptr(),
                pg_sys::ALLOCSET_DEFAULT_MINSIZE as usize,
                pg_sys::ALLOCSET_DEFAULT_INITSIZE as usize,
                pg_sys::ALLOCSET_DEFAULT_MAXSIZE as usize,
            );
            let scan = pg_sys::systable_beginscan(
                self.heap,
                (*self.index).rd_id,
                true,
                self.snapshot,
                keys.len() as i32,
                keys.as_mut_ptr(),
            );
            loop {
                if budget.exhausted() {
                    complete = false;
                    break;
                }
                let tuple = pg_sys::systable_getnext(scan);
                if tuple.is_null() {
                    break;
                }
                let outer = pg_sys::MemoryContextSwitchTo(per_row);
                pg_sys::heap_deform_tuple(tuple, descriptor, values.as_mut_ptr(), nulls.as_mut_ptr());
                let value = |attno: usize| (!nulls[attno - 1]).then(|| values[attno - 1]);
                let event = keep(txid).then(|| {
                    let text = |attno: usize| value(attno).map(|d| datums::text(d));
                    let json = |attno: usize| value(attno).map(|d| datums::jsonb_text(d));
                    let headers = json(columns.at(Column::Headers));
                    OutboxEvent {
                        id: value(columns.at(Column::Id)).map(|d| d.value() as i64).unwrap_or_default(),
                        event_id: value(columns.at(Column::EventId)).map(|d| datums::uuid_text(d)).unwrap_or_default(),
                        aggregate_type: text(columns.at(Column::AggregateType)).unwrap_or_default(),
                        aggregate_id: text(columns.at(Column::AggregateId)).unwrap_or_default(),
                        aggregate_seq: 0,
                        event_type: text(columns.at(Column::EventType)).unwrap_or_default(),
                        payload: json(columns.at(Column::Payload)).unwrap_or_default(),
                        trace: TraceContext::from_headers(headers.as_deref()),
                        headers,
                        stream: text(columns.at(Column::Stream)),
                        created_at: value(columns.at(Column::CreatedAt))
                            .map(|d| datums::timestamptz_text(d.value() as i64))
                            .unwrap_or_default(),
                        replay: None,
                    }
                });
                pg_sys::MemoryContextSwitchTo(outer);
                pg_sys::MemoryContextReset(per_row);
                if let Some(event) = event {
                    let size = event.approximate_size();
                    if !budget.allows(size) {
                        complete = false;
                        break;
                    }
                    budget.take(size);
                    into.push(LogEvent { txid, txn_max_id: 0, event });
                }
            }
            pg_sys::systable_endscan(scan);
            pg_sys::MemoryContextDelete(per_row);
        }
        complete
    }

    /// The txid of the first index entry of `shard` with a txid in `from..below`, from the index
    /// alone, whatever the row's visibility (the caller checks the transaction).
    pub fn first_txid(&self, shard: i16, from: u64, below: u64) -> Option<u64> {
        let mut keys = [
            index_key(INDEX_SHARD, pg_sys::BTEqualStrategyNumber, pg_sys::F_INT2EQ, pg_sys::Datum::from(shard)),
            index_key(INDEX_TXID, pg_sys::BTGreaterEqualStrategyNumber, pg_sys::F_XID8GE, pg_sys::Datum::from(from)),
            index_key(INDEX_TXID, pg_sys::BTLessStrategyNumber, pg_sys::F_XID8LT, pg_sys::Datum::from(below)),
        ];
        self.index_entries(&mut keys, pg_sys::ScanDirection::ForwardScanDirection, |txid, _, _| Some(txid))
    }

    /// The largest id of the rows transaction `txid` wrote in `shard` and that are there (a row of
    /// a rolled-back subtransaction is not), walking the index backwards.
    pub fn last_id(&self, shard: i16, txid: u64) -> Option<i64> {
        if rolled_back(txid) {
            return None;
        }
        let mut found = None;
        self.rows_of(shard, txid, i64::MIN, pg_sys::ScanDirection::BackwardScanDirection, |id, _| {
            found = Some(id);
            false
        });
        found
    }

    /// Visits the rows of transaction `txid` in `shard` with an id above `after` that are there, in
    /// `direction` of id, as (id, created_at), while `visit` returns true.
    pub fn rows_of(
        &self,
        shard: i16,
        txid: u64,
        after: i64,
        direction: pg_sys::ScanDirection::Type,
        mut visit: impl FnMut(i64, i64) -> bool,
    ) {
        let columns = &self.columns;
        let mut keys = self.transaction_keys(shard, txid, after);
        // SAFETY: an open relation and index and a registered snapshot; the keys (heap attribute
        // numbers, as systable scans take them) outlive the scan; each tuple is read while the
        // scan is on it.
        unsafe {
            let scan = pg_sys::systable_beginscan_ordered(
                self.heap,
                self.index,
                self.snapshot,
                keys.len() as i32,
                keys.as_mut_ptr(),
            );
            let descriptor = (*self.heap).rd_att;
            loop {
                let tuple = pg_sys::systable_getnext_ordered(scan, direction);
                if tuple.is_null() {
                    break;
                }
                let (mut id_null, mut at_null) = (false, false);
                let id = pg_sys::fastgetattr(tuple, columns.at(Column::Id) as i32, descriptor, &mut id_null);
                let at = pg_sys::fastgetattr(tuple, columns.at(Column::CreatedAt) as i32, descriptor, &mut at_null);
                if id_null || at_null || !visit(id.value() as i64, at.value() as i64) {
                    break;
                }
            }
            pg_sys::systable_endscan_ordered(scan);
        }
    }

    /// Visits the index entries matching `keys` (index attribute numbers) in `direction`, as
    /// (txid, id, heap tid), until `visit` returns something, which it returns. Index only: the
    /// heap is not read.
    pub fn index_entries<T>(
        &self,
        keys: &mut [pg_sys::ScanKeyData],
        direction: pg_sys::ScanDirection::Type,
        mut visit: impl FnMut(u64, i64, pg_sys::ItemPointerData) -> Option<T>,
    ) -> Option<T> {
        // SAFETY: an open relation and index and a registered snapshot; the keys outlive the scan;
        // each index tuple is read while the scan is on it.
        unsafe {
            // PostgreSQL 18 added the instrumentation argument.
            #[cfg(feature = "pg18")]
            let scan = pg_sys::index_beginscan(
                self.heap,
                self.index,
                self.snapshot,
                std::ptr::null_mut(),
                keys.len() as i32,
                0,
            );
            #[cfg(not(feature = "pg18"))]
            let scan = pg_sys::index_beginscan(self.heap, self.index, self.snapshot, keys.len() as i32, 0);
            (*scan).xs_want_itup = true;
            pg_sys::index_rescan(scan, keys.as_mut_ptr(), keys.len() as i32, std::ptr::null_mut(), 0);
            let mut values = [pg_sys::Datum::from(0usize); 3];
            let mut nulls = [false; 3];
            let mut found = None;
            loop {
                let tid = pg_sys::index_getnext_tid(scan, direction);
                if tid.is_null() || (*scan).xs_itup.is_null() {
                    break;
                }
                pg_sys::index_deform_tuple(
                    (*scan).xs_itup,
                    (*scan).xs_itupdesc,
                    values.as_mut_ptr(),
                    nulls.as_mut_ptr(),
                );
                let txid = values[INDEX_TXID - 1].value() as u64;
                let id = values[INDEX_ID - 1].value() as i64;
                if let Some(value) = visit(txid, id, *tid) {
                    found = Some(value);
                    break;
                }
            }
            pg_sys::index_endscan(scan);
            found
        }
    }
}
