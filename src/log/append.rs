//! Appending to the log, for `outbox_enqueue` (src/enqueue/mod.rs): which table is current, the
//! next id, and the insert of one row.
//!
//! The row is inserted the way PostgreSQL inserts catalog rows (`CatalogTupleInsert`: the heap,
//! then each index), not through an INSERT statement: on this path an executor start-up per
//! statement cost more than the insert itself (docs/performance.md). That holds as long as the
//! table is as the extension made it (src/log/columns.rs); a table someone changed (a trigger, an
//! expression index) gets a kept INSERT plan instead, which honours everything the executor does.

use std::cell::Cell;
use std::ffi::{c_char, CStr};

use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::log::columns::{column_types, Row, COUNT, INSERTS, TABLES};
use crate::log::datums::relation_in;

thread_local! {
    /// This session's kept plans of the three inserts (`SPI_keepplan`), prepared the first time
    /// the executor path is taken. A kept plan is re-planned by PostgreSQL when what it refers to
    /// changes, so it never goes stale.
    static PLANS: Cell<Option<[pg_sys::SPIPlanPtr; 3]>> = const { Cell::new(None) };
}

/// Prepares and keeps one statement; inside an SPI connection.
unsafe fn keep(query: &CStr, types: &mut [pg_sys::Oid]) -> pg_sys::SPIPlanPtr {
    // SAFETY: inside SPI_connect; the query and types outlive the call; SPI_keepplan moves the
    // plan out of the SPI procedure's memory so that it lives for the session.
    unsafe {
        let plan = pg_sys::SPI_prepare(query.as_ptr(), types.len() as i32, types.as_mut_ptr());
        if plan.is_null() || pg_sys::SPI_keepplan(plan) != 0 {
            let code = pg_sys::SPI_result;
            error!("outbox_enqueue: could not prepare its statements (SPI error {code})");
        }
        plan
    }
}

/// The `outbox` schema's OID; an error naming the problem when the extension is not installed.
pub unsafe fn outbox_schema() -> pg_sys::Oid {
    // SAFETY: a syscache lookup; missing_ok, so it returns InvalidOid rather than raising.
    let schema = unsafe { pg_sys::get_namespace_oid(c"outbox".as_ptr(), true) };
    if schema == pg_sys::InvalidOid {
        refuse(
            PgSqlErrorCode::ERRCODE_INVALID_SCHEMA_NAME,
            "outbox_enqueue: schema \"outbox\" does not exist".into(),
            "Run CREATE EXTENSION outbox_pg in this database.",
        );
    }
    schema
}

/// Which log table is current, read from `outbox.generations` with a snapshot taken now, after
/// the transaction id was assigned (whatever the caller's isolation level): a writer that read a
/// generation just before it was switched already had its transaction id then, which is how
/// retention knows when no writer can be left on a closed table (outbox._retention). Read through the
/// index holding only the current row, not by a statement (an executor start-up costs more than
/// the read) nor a heap scan (which asks the kernel for the table's size every time).
pub unsafe fn current_generation(schema: pg_sys::Oid) -> i16 {
    // SAFETY: inside a transaction; the relation is opened and closed here, the registered
    // snapshot outlives the scan, and each tuple is read only while the scan is on it.
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let relation = pg_sys::table_open(relation_in(schema, c"generations", "outbox_enqueue"), lock);
        let current_index = relation_in(schema, c"generations_one_current", "outbox_enqueue");
        let descriptor = (*relation).rd_att;
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
        let scan = pg_sys::systable_beginscan(relation, current_index, true, snapshot, 0, std::ptr::null_mut());
        let mut current = None;
        loop {
            let tuple = pg_sys::systable_getnext(scan);
            if tuple.is_null() {
                break;
            }
            let (mut generation_null, mut state_null) = (false, false);
            let generation = pg_sys::fastgetattr(tuple, 1, descriptor, &mut generation_null);
            let state = pg_sys::fastgetattr(tuple, 2, descriptor, &mut state_null);
            if !generation_null && !state_null && text_equals(state, b"current") {
                current = Some(generation.value() as i16);
                break;
            }
        }
        pg_sys::systable_endscan(scan);
        pg_sys::UnregisterSnapshot(snapshot);
        pg_sys::table_close(relation, lock);
        match current {
            Some(generation @ 0..=2) => generation,
            _ => error!("outbox_enqueue: outbox.generations names no current table 0, 1 or 2"),
        }
    }
}

/// Whether a text datum holds exactly `expected`.
unsafe fn text_equals(datum: pg_sys::Datum, expected: &[u8]) -> bool {
    // SAFETY: a non-NULL text datum; detoasted (a copy only if it was toasted) and read in place.
    unsafe {
        let text = pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr());
        let len = pgrx::varlena::varsize_any_exhdr(text);
        std::slice::from_raw_parts(pgrx::varlena::vardata_any(text) as *const u8, len) == expected
    }
}

/// Whether a log table is still as src/sql/schema.sql made it (its columns, no trigger, rule,
/// row security or CHECK constraint, and plain-column indexes only): then a row is inserted
/// directly, as `CatalogTupleInsert` does. Anything else (a DBA's audit trigger, an expression
/// index) goes through the executor, which knows how to honour it.
unsafe fn insertable_directly(relation: pg_sys::Relation, indexes: pg_sys::CatalogIndexState) -> bool {
    // SAFETY: an open relation and its open indexes.
    unsafe {
        let rel = &*relation;
        let form = &*rel.rd_rel;
        let descriptor = &*rel.rd_att;
        if form.relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char
            || !rel.trigdesc.is_null()
            || !rel.rd_rules.is_null()
            || form.relrowsecurity
            || descriptor.natts != COUNT as i32
            || (!descriptor.constr.is_null() && (*descriptor.constr).num_check > 0)
        {
            return false;
        }
        let attributes = crate::log::datums::attributes(descriptor);
        if attributes.iter().zip(column_types()).any(|(attribute, expected)| {
            attribute.attisdropped || attribute.atttypid != expected || attribute.attgenerated != 0
        }) {
            return false;
        }
        let state = &*indexes;
        (0..state.ri_NumIndices as usize).all(|n| {
            let info = &**state.ri_IndexRelationInfo.add(n);
            let index = &**state.ri_IndexRelationDescs.add(n);
            info.ii_Expressions.is_null()
                && info.ii_Predicate.is_null()
                && info.ii_ExclusionOps.is_null()
                && (*index.rd_index).indimmediate
        })
    }
}

/// Appends `row` to log table `generation`: directly when the table is as the extension made it,
/// else through the executor with a kept plan.
pub unsafe fn insert(schema: pg_sys::Oid, generation: i16, row: &mut Row) {
    // SAFETY: inside a transaction, as the function's owner (SECURITY DEFINER). The relation and
    // its indexes are opened and closed here; the lock is kept to the end of the transaction, as
    // an INSERT keeps it.
    unsafe {
        let table = relation_in(schema, TABLES[generation as usize], "outbox_enqueue");
        if pg_sys::pg_class_aclcheck(table, pg_sys::GetUserId(), pg_sys::ACL_INSERT as pg_sys::AclMode)
            != pg_sys::AclResult::ACLCHECK_OK
        {
            error!("outbox_enqueue: the function's owner may not insert into outbox.events_{generation}");
        }
        let relation = pg_sys::table_open(table, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE);
        let indexes = pg_sys::CatalogOpenIndexes(relation);
        let direct = insertable_directly(relation, indexes);
        if direct {
            let tuple = pg_sys::heap_form_tuple((*relation).rd_att, row.values.as_mut_ptr(), row.nulls.as_mut_ptr());
            pg_sys::CatalogTupleInsertWithInfo(relation, tuple, indexes);
            pg_sys::heap_freetuple(tuple);
        }
        pg_sys::CatalogCloseIndexes(indexes);
        pg_sys::table_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
        if !direct {
            insert_with_executor(generation, row);
        }
    }
}

/// The executor path of `insert`: the same row through a kept plan. What the executor runs for a
/// changed table (a DBA's trigger, a CHECK constraint, a rule) runs with the owner's rights
/// (SECURITY DEFINER), so it runs under `search_path = pg_catalog, pg_temp`, as a `SET
/// search_path` clause would pin it: the caller's `search_path` must not choose which functions
/// and operators code with the owner's rights calls. (The direct path calls no user code.)
unsafe fn insert_with_executor(generation: i16, row: &mut Row) {
    // SAFETY: SPI connected and finished here; the values outlive the call. The GUC nest level is
    // popped here, or by the transaction's abort if the insert raises.
    unsafe {
        let nest_level = pg_sys::NewGUCNestLevel();
        pg_sys::set_config_option(
            c"search_path".as_ptr(),
            c"pg_catalog, pg_temp".as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SAVE,
            true,
            0,
            false,
        );
        if pg_sys::SPI_connect() != pg_sys::SPI_OK_CONNECT as i32 {
            error!("outbox_enqueue: SPI_connect failed");
        }
        let plans = match PLANS.get() {
            Some(plans) => plans,
            None => {
                let mut types = column_types();
                let plans = [keep(INSERTS[0], &mut types), keep(INSERTS[1], &mut types), keep(INSERTS[2], &mut types)];
                PLANS.set(Some(plans));
                plans
            }
        };
        let flags: Vec<c_char> = row.nulls.iter().map(|&null| if null { b'n' } else { b' ' } as c_char).collect();
        if pg_sys::SPI_execute_plan(plans[generation as usize], row.values.as_mut_ptr(), flags.as_ptr(), false, 0)
            != pg_sys::SPI_OK_INSERT as i32
        {
            error!("outbox_enqueue: the insert into outbox.events_{generation} failed");
        }
        pg_sys::SPI_finish();
        pg_sys::AtEOXact_GUC(true, nest_level);
    }
}

/// The next event id (`nextval('outbox.events_id_seq')`).
pub unsafe fn next_id(schema: pg_sys::Oid) -> pg_sys::Datum {
    // SAFETY: inside a transaction; the sequence belongs to the installed extension.
    unsafe {
        let sequence = relation_in(schema, c"events_id_seq", "outbox_enqueue");
        pg_sys::OidFunctionCall1Coll(pg_sys::Oid::from(pg_sys::F_NEXTVAL), pg_sys::InvalidOid, sequence.into())
    }
}

/// Raises an error with a SQLSTATE, a message and a hint.
fn refuse(code: PgSqlErrorCode, message: String, hint: &str) -> ! {
    ErrorReport::new(code, message, "outbox_enqueue").set_hint(hint).report(PgLogLevel::ERROR);
    unreachable!("ERROR does not return")
}
