//! `outbox_enqueue`, the one function on the application's path, in Rust: it validates its
//! arguments (each refusal a SQLSTATE, a message naming the bad value, and a hint), checks that a
//! relay will deliver the event, takes the aggregate's order lock, and appends one row to the
//! current table of the log. The SQL declaration, its privileges and its bigint/uuid overloads are
//! in `src/sql/api.sql`.
//!
//! The row is inserted the way PostgreSQL inserts catalog rows (`CatalogTupleInsert`: the heap,
//! then each index), not through an INSERT statement: on this path an executor start-up per
//! statement cost more than the insert itself (docs/performance.md). That holds as long as the
//! table is as the extension made it; a table someone changed (a trigger, an expression index)
//! gets a kept INSERT plan instead, which honours everything the executor does.
//!
//! It is `SECURITY DEFINER` (writers have no privilege on the log) without a pinned `search_path`:
//! pinning one costs a GUC save and restore on every call. It needs none: it looks up its objects
//! by schema and name, and its INSERT statements qualify every name.

use std::cell::Cell;
use std::ffi::{c_char, CStr};

use pgrx::datum::Internal;
use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::{guc, order, wake};

/// The longest `aggregate_type` and `event_type`, and `aggregate_id`, `stream`, `headers`.
const NAME_LIMIT: usize = 255;
const ID_LIMIT: usize = 1024;
const STREAM_LIMIT: usize = 512;
const HEADERS_LIMIT: usize = 65536;

/// The insert into each log table, for the executor path (see `insert`): one statement per table,
/// so that each keeps its plan.
const INSERTS: [&CStr; 3] = [
    c"INSERT INTO outbox.events_0 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
      VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    c"INSERT INTO outbox.events_1 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
      VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    c"INSERT INTO outbox.events_2 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
      VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
];
const TABLES: [&CStr; 3] = [c"events_0", c"events_1", c"events_2"];

/// The log tables' columns, in order, as src/sql/schema.sql makes them.
const COLUMN_TYPES: [pg_sys::Oid; 11] = [
    pg_sys::XID8OID,
    pg_sys::INT2OID,
    pg_sys::INT8OID,
    pg_sys::UUIDOID,
    pg_sys::TEXTOID,
    pg_sys::TEXTOID,
    pg_sys::TEXTOID,
    pg_sys::JSONBOID,
    pg_sys::JSONBOID,
    pg_sys::TEXTOID,
    pg_sys::TIMESTAMPTZOID,
];

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
unsafe fn outbox_schema() -> pg_sys::Oid {
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
/// retention knows when no writer can be left on a closed table (outbox._rotate). Read through the
/// index holding only the current row, not by a statement (an executor start-up costs more than
/// the read) nor a heap scan (which asks the kernel for the table's size every time).
unsafe fn current_generation(schema: pg_sys::Oid) -> i16 {
    // SAFETY: inside a transaction; the relation is opened and closed here, the registered
    // snapshot outlives the scan, and each tuple is read only while the scan is on it.
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let relation = pg_sys::table_open(crate::datums::relation_in(schema, c"generations", "outbox_enqueue"), lock);
        let current_index = crate::datums::relation_in(schema, c"generations_one_current", "outbox_enqueue");
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
            || descriptor.natts != COLUMN_TYPES.len() as i32
            || (!descriptor.constr.is_null() && (*descriptor.constr).num_check > 0)
        {
            return false;
        }
        let attributes = descriptor.attrs.as_slice(COLUMN_TYPES.len());
        if attributes.iter().zip(COLUMN_TYPES).any(|(attribute, expected)| {
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

/// Appends the row (`values`, in the columns' order) to log table `generation`: directly when the
/// table is as the extension made it, else through the executor with a kept plan.
unsafe fn insert(schema: pg_sys::Oid, generation: i16, values: &mut [pg_sys::Datum; 11], nulls: &mut [bool; 11]) {
    // SAFETY: inside a transaction, as the function's owner (SECURITY DEFINER). The relation and
    // its indexes are opened and closed here; the lock is kept to the end of the transaction, as
    // an INSERT keeps it.
    unsafe {
        let table = crate::datums::relation_in(schema, TABLES[generation as usize], "outbox_enqueue");
        if pg_sys::pg_class_aclcheck(table, pg_sys::GetUserId(), pg_sys::ACL_INSERT as pg_sys::AclMode)
            != pg_sys::AclResult::ACLCHECK_OK
        {
            error!("outbox_enqueue: the function's owner may not insert into outbox.events_{generation}");
        }
        let relation = pg_sys::table_open(table, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE);
        let indexes = pg_sys::CatalogOpenIndexes(relation);
        let direct = insertable_directly(relation, indexes);
        if direct {
            let tuple = pg_sys::heap_form_tuple((*relation).rd_att, values.as_mut_ptr(), nulls.as_mut_ptr());
            pg_sys::CatalogTupleInsertWithInfo(relation, tuple, indexes);
            pg_sys::heap_freetuple(tuple);
        }
        pg_sys::CatalogCloseIndexes(indexes);
        pg_sys::table_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
        if !direct {
            insert_with_executor(generation, values, nulls);
        }
    }
}

/// The executor path of `insert`: the same row through a kept plan.
unsafe fn insert_with_executor(generation: i16, values: &mut [pg_sys::Datum; 11], nulls: &[bool; 11]) {
    // SAFETY: SPI connected and finished here; the values outlive the call.
    unsafe {
        if pg_sys::SPI_connect() != pg_sys::SPI_OK_CONNECT as i32 {
            error!("outbox_enqueue: SPI_connect failed");
        }
        let plans = match PLANS.get() {
            Some(plans) => plans,
            None => {
                let mut types = COLUMN_TYPES;
                let plans = [keep(INSERTS[0], &mut types), keep(INSERTS[1], &mut types), keep(INSERTS[2], &mut types)];
                PLANS.set(Some(plans));
                plans
            }
        };
        let flags: Vec<c_char> = nulls.iter().map(|&null| if null { b'n' } else { b' ' } as c_char).collect();
        if pg_sys::SPI_execute_plan(plans[generation as usize], values.as_mut_ptr(), flags.as_ptr(), false, 0)
            != pg_sys::SPI_OK_INSERT as i32
        {
            error!("outbox_enqueue: the insert into outbox.events_{generation} failed");
        }
        pg_sys::SPI_finish();
    }
}

/// A UUIDv7 for a new event: the Unix time in milliseconds, then 74 random bits from a generator
/// seeded once per session from the operating system's randomness (drawing from the operating
/// system for every event was a system call on the application's path). Time-ordered, so the
/// `event_id` index grows at its right edge.
fn new_event_id() -> uuid::Uuid {
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            let seed = uuid::Uuid::now_v7();
            let bytes = seed.as_bytes();
            u64::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11], bytes[12], bytes[13], bytes[14], bytes[15]])
                ^ (std::process::id() as u64).rotate_left(40)
        });
    }
    // splitmix64: every state gives a distinct output, and sessions start from unrelated states.
    let next = || {
        let state = STATE.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
        STATE.set(state);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let (high, low) = (next().to_le_bytes(), next().to_le_bytes());
    let random = [high[0], high[1], high[2], high[3], high[4], high[5], high[6], high[7], low[0], low[1]];
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64);
    uuid::Builder::from_unix_timestamp_millis(millis, &random).into_uuid()
}

/// Raises an error with a SQLSTATE, a message and a hint.
fn refuse(code: PgSqlErrorCode, message: String, hint: &str) -> ! {
    ErrorReport::new(code, message, "outbox_enqueue").set_hint(hint).report(PgLogLevel::ERROR);
    unreachable!("ERROR does not return")
}

/// `quote_literal(left(value, 40))`, as the messages show a value that is too long.
fn quoted_start(value: &str) -> String {
    let start: String = value.chars().take(40).collect();
    let escaped = start.replace('\'', "''");
    if escaped.contains('\\') {
        format!("E'{}'", escaped.replace('\\', "\\\\"))
    } else {
        format!("'{escaped}'")
    }
}

/// A required name: its limit in bytes, and the hints for a missing and an overlong value.
struct Rule {
    name: &'static str,
    limit: usize,
    missing: &'static str,
    too_long: &'static str,
}

const AGGREGATE_TYPE: Rule = Rule {
    name: "aggregate_type",
    limit: NAME_LIMIT,
    missing: "Pass the kind of entity the event is about, e.g. 'payment'.",
    too_long: "aggregate_type names a kind of entity, e.g. 'payment'; put data in the payload.",
};
const AGGREGATE_ID: Rule = Rule {
    name: "aggregate_id",
    limit: ID_LIMIT,
    missing: "Pass the id of the entity the event is about (text, bigint or uuid).",
    too_long: "Pass the id of the entity the event is about (text, bigint or uuid); put data in the payload.",
};
const EVENT_TYPE: Rule = Rule {
    name: "event_type",
    limit: NAME_LIMIT,
    missing: "Pass what happened, e.g. 'payment.created'.",
    too_long: "event_type names what happened, e.g. 'payment.created'; put data in the payload.",
};

/// Checks a required name: not NULL, not empty, at most `rule.limit` bytes.
fn required<'a>(rule: &Rule, value: Option<&'a str>) -> &'a str {
    let Rule { name, limit, .. } = *rule;
    let Some(value) = value else {
        refuse(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            format!("outbox_enqueue: {name} must not be NULL"),
            rule.missing,
        )
    };
    if value.is_empty() {
        refuse(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("outbox_enqueue: {name} must not be empty (got '')"),
            rule.missing,
        );
    }
    if value.len() > limit {
        refuse(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!(
                "outbox_enqueue: {name} is {} bytes long (starts with {}), the limit is {limit} bytes",
                value.len(),
                quoted_start(value)
            ),
            rule.too_long,
        );
    }
    value
}

/// Whether a jsonb's root is an object (not an array or a scalar).
unsafe fn jsonb_is_object(datum: pg_sys::Datum) -> bool {
    // SAFETY: as in `jsonb_text`; the root container's header carries the flags.
    unsafe {
        let jsonb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()) as *mut pg_sys::Jsonb;
        (*jsonb).root.header & pg_sys::JB_FOBJECT != 0
    }
}

/// The name of a jsonb value's type, for the message refusing headers that are not an object.
fn jsonb_type_of(text: &str) -> &'static str {
    match text.trim_start().as_bytes().first() {
        Some(b'[') => "array",
        Some(b'"') => "string",
        Some(b't') | Some(b'f') => "boolean",
        Some(b'n') => "null",
        _ => "number",
    }
}

/// `outbox_enqueue(aggregate_type, aggregate_id, event_type, payload, headers, stream)`, declared
/// in `src/sql/api.sql`. `payload` and `headers` arrive as jsonb datums, passed on to the insert
/// untouched.
#[pg_extern(sql = false, volatile, parallel_unsafe)]
fn outbox_enqueue(
    aggregate_type: Option<&str>,
    aggregate_id: Option<&str>,
    event_type: Option<&str>,
    payload: Internal,
    headers: Internal,
    stream: Option<&str>,
) -> pgrx::Uuid {
    // What an INSERT would refuse on a standby or in a read-only transaction (25006), before
    // anything else: the row is written beside the executor, which would have checked.
    // SAFETY: plain checks of the transaction's state; they raise the standard errors.
    unsafe {
        pg_sys::PreventCommandIfReadOnly(c"outbox_enqueue()".as_ptr());
        pg_sys::PreventCommandDuringRecovery(c"outbox_enqueue()".as_ptr());
    }
    let aggregate_type = required(&AGGREGATE_TYPE, aggregate_type);
    let aggregate_id = required(&AGGREGATE_ID, aggregate_id);
    let event_type = required(&EVENT_TYPE, event_type);
    let Some(payload) = payload.unwrap() else {
        refuse(
            PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            "outbox_enqueue: payload must not be NULL".into(),
            "Pass a jsonb value; use 'null'::jsonb for an event without a body.",
        )
    };
    let headers = headers.unwrap();
    if let Some(headers) = headers {
        // SAFETY: a non-NULL jsonb argument.
        let (is_object, text) = unsafe { (jsonb_is_object(headers), crate::datums::jsonb_text(headers)) };
        if !is_object {
            let start: String = text.chars().take(100).collect();
            refuse(
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                format!("outbox_enqueue: headers must be a JSON object, got a JSON {}: {start}", jsonb_type_of(&text)),
                "Pass e.g. '{\"trace_id\": \"abc\"}'::jsonb, or NULL for no headers.",
            );
        }
        if text.len() > HEADERS_LIMIT {
            let start: String = text.chars().take(40).collect();
            refuse(
                PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
                format!(
                    "outbox_enqueue: headers are {} bytes as JSON text (starts with {start}), the limit is {HEADERS_LIMIT} bytes",
                    text.len()
                ),
                "Headers carry small metadata such as trace ids; put data in the payload.",
            );
        }
    }
    if let Some(stream) = stream {
        let hint = "Pass NULL to use the outbox.stream template, or a Redis key of 1 to 512 bytes.";
        if stream.is_empty() {
            refuse(
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                "outbox_enqueue: stream must not be empty (got '')".into(),
                hint,
            );
        }
        if stream.len() > STREAM_LIMIT {
            refuse(
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                format!(
                    "outbox_enqueue: stream is {} bytes long (starts with {}), the limit is {STREAM_LIMIT} bytes",
                    stream.len(),
                    quoted_start(stream)
                ),
                hint,
            );
        }
    }
    crate::api::check_relayed_database();
    crate::api::check_allowed_stream(aggregate_type, event_type, stream);

    // The limit applies to what is sent to Redis: the payload's JSON text.
    // SAFETY: a non-NULL jsonb argument.
    let payload_bytes = unsafe { crate::datums::with_jsonb_text(payload, |text| text.to_bytes().len()) };
    let payload_limit = guc::max_payload_size() as usize;
    if payload_bytes > payload_limit {
        refuse(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!("outbox_enqueue: payload is {payload_bytes} bytes, larger than outbox.max_payload_size ({payload_limit} bytes)"),
            "Put large documents elsewhere and send a reference in the event, or have a superuser raise outbox.max_payload_size.",
        );
    }

    // Right before the id is drawn: enqueues of one aggregate take turns until commit, so that
    // within an aggregate the id follows commit order (src/order.rs).
    order::lock_aggregate(aggregate_type, aggregate_id);
    let shard = order::shard_of(aggregate_type, aggregate_id);
    wake::arm(shard);
    let event_id = new_event_id();
    // The transaction id before the generation (see `current_generation`).
    // SAFETY: inside a transaction; assigns its id if it has none yet.
    let txid = unsafe { pg_sys::GetTopFullTransactionId() }.value;
    let event_id_datum = pgrx::Uuid::from_bytes(*event_id.as_bytes());
    // SAFETY: the datums are built in the current memory context, which lives until the function
    // returns; the sequence and the tables belong to the installed extension.
    unsafe {
        let schema = outbox_schema();
        let generation = current_generation(schema);
        let sequence = crate::datums::relation_in(schema, c"events_id_seq", "outbox_enqueue");
        let id =
            pg_sys::OidFunctionCall1Coll(pg_sys::Oid::from(pg_sys::F_NEXTVAL), pg_sys::InvalidOid, sequence.into());
        let text = |value: &str| value.into_datum().unwrap_or(pg_sys::Datum::from(0));
        let null = pg_sys::Datum::from(0);
        let mut values = [
            pg_sys::Datum::from(txid),
            shard.into_datum().unwrap_or(null),
            id,
            event_id_datum.into_datum().unwrap_or(null),
            text(aggregate_type),
            text(aggregate_id),
            text(event_type),
            payload,
            headers.unwrap_or(null),
            stream.map(text).unwrap_or(null),
            pg_sys::Datum::from(pg_sys::GetCurrentTimestamp()),
        ];
        let mut nulls = [false; 11];
        nulls[8] = headers.is_none();
        nulls[9] = stream.is_none();
        insert(schema, generation, &mut values, &mut nulls);
    }
    event_id_datum
}
