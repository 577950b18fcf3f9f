//! `outbox_enqueue`, the one function on the application's path, in Rust: it validates its
//! arguments (each refusal a SQLSTATE, a message naming the bad value, and a hint), checks that a
//! relay will deliver the event, takes the aggregate's order lock, and appends one row to the
//! current table of the log through plans prepared once per session. The SQL declaration, its
//! privileges and its bigint/uuid overloads are in `src/sql/api.sql`.
//!
//! It is `SECURITY DEFINER` (writers have no privilege on the log) without a pinned `search_path`:
//! pinning one costs a GUC save and restore, and a search-path recomputation, on every call. It
//! needs none: every name in its two statements is schema-qualified, operators included, so the
//! caller's `search_path` resolves nothing in them.

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

const GENERATION: &CStr =
    c"SELECT g.generation FROM outbox.generations g WHERE g.state OPERATOR(pg_catalog.=) 'current'::pg_catalog.text";

/// The insert into each log table: one statement per table, so that each keeps its plan.
const INSERTS: [&CStr; 3] = [
    c"INSERT INTO outbox.events_0 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
      VALUES ($1, $2, pg_catalog.nextval('outbox.events_id_seq'::pg_catalog.regclass), $3, $4, $5, $6, $7, $8, $9, pg_catalog.clock_timestamp())",
    c"INSERT INTO outbox.events_1 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
      VALUES ($1, $2, pg_catalog.nextval('outbox.events_id_seq'::pg_catalog.regclass), $3, $4, $5, $6, $7, $8, $9, pg_catalog.clock_timestamp())",
    c"INSERT INTO outbox.events_2 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
      VALUES ($1, $2, pg_catalog.nextval('outbox.events_id_seq'::pg_catalog.regclass), $3, $4, $5, $6, $7, $8, $9, pg_catalog.clock_timestamp())",
];

/// This session's kept plans (`SPI_keepplan`): the generation read, then the three inserts. A
/// kept plan is re-planned by PostgreSQL when what it refers to changes (a `DROP EXTENSION` and
/// `CREATE EXTENSION` in the same session included), so it never goes stale.
#[derive(Clone, Copy)]
struct Plans {
    generation: pg_sys::SPIPlanPtr,
    inserts: [pg_sys::SPIPlanPtr; 3],
}

thread_local! {
    static PLANS: Cell<Option<Plans>> = const { Cell::new(None) };
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

fn plans() -> Plans {
    if let Some(plans) = PLANS.get() {
        return plans;
    }
    let mut insert_types = [
        pg_sys::XID8OID,
        pg_sys::INT2OID,
        pg_sys::UUIDOID,
        pg_sys::TEXTOID,
        pg_sys::TEXTOID,
        pg_sys::TEXTOID,
        pg_sys::JSONBOID,
        pg_sys::JSONBOID,
        pg_sys::TEXTOID,
    ];
    // SAFETY: called inside SPI_connect (see `outbox_enqueue`).
    let plans = unsafe {
        Plans {
            generation: keep(GENERATION, &mut []),
            inserts: [
                keep(INSERTS[0], &mut insert_types),
                keep(INSERTS[1], &mut insert_types),
                keep(INSERTS[2], &mut insert_types),
            ],
        }
    };
    PLANS.set(Some(plans));
    plans
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

/// Calls `with` on a jsonb argument's text form (what is sent to Redis), freed afterwards.
unsafe fn with_jsonb_text<T>(datum: pg_sys::Datum, with: impl FnOnce(&CStr) -> T) -> T {
    // SAFETY: `datum` is a non-NULL jsonb; detoasting gives the whole value, whose root container
    // JsonbToCString renders into a palloc'd, NUL-terminated string, freed once `with` is done.
    unsafe {
        let jsonb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()) as *mut pg_sys::Jsonb;
        let size = pgrx::varlena::varsize_any(jsonb as *const pg_sys::varlena) as i32;
        let text = pg_sys::JsonbToCString(std::ptr::null_mut(), &raw mut (*jsonb).root, size);
        let result = with(CStr::from_ptr(text));
        pg_sys::pfree(text.cast());
        result
    }
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
        let (is_object, text) =
            unsafe { (jsonb_is_object(headers), with_jsonb_text(headers, |text| text.to_string_lossy().into_owned())) };
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
    let payload_bytes = unsafe { with_jsonb_text(payload, |text| text.to_bytes().len()) };
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
    let event_id = uuid::Uuid::now_v7();
    // The transaction id before the generation: a writer that read a generation just before it was
    // switched already had its transaction id then, which is how retention knows when no writer can
    // be left on a closed table (outbox._rotate).
    // SAFETY: inside a transaction; assigns its id if it has none yet.
    let txid = unsafe { pg_sys::GetTopFullTransactionId() }.value;
    let event_id_datum = pgrx::Uuid::from_bytes(*event_id.as_bytes());
    // SAFETY: SPI connected and finished here; the values outlive the calls; the text datums are
    // built in the current memory context, which lives until the function returns.
    unsafe {
        if pg_sys::SPI_connect() != pg_sys::SPI_OK_CONNECT as i32 {
            error!("outbox_enqueue: SPI_connect failed");
        }
        let plans = plans();
        // A fresh snapshot, taken after the transaction id: see above.
        if pg_sys::SPI_execute_plan(plans.generation, std::ptr::null_mut(), std::ptr::null(), false, 1)
            != pg_sys::SPI_OK_SELECT as i32
            || pg_sys::SPI_processed != 1
        {
            error!("outbox_enqueue: outbox.generations has no current table");
        }
        let table = &*pg_sys::SPI_tuptable;
        let mut is_null = false;
        let generation = pg_sys::SPI_getbinval(*table.vals, table.tupdesc, 1, &mut is_null).value() as i16;
        let Some(&insert) = plans.inserts.get(generation as usize) else {
            error!("outbox_enqueue: outbox.generations names table {generation}, not 0, 1 or 2");
        };
        let text = |value: &str| pgrx::IntoDatum::into_datum(value).unwrap_or(pg_sys::Datum::from(0));
        let mut values = [
            pg_sys::Datum::from(txid),
            shard.into_datum().unwrap_or(pg_sys::Datum::from(0)),
            pgrx::IntoDatum::into_datum(event_id_datum).unwrap_or(pg_sys::Datum::from(0)),
            text(aggregate_type),
            text(aggregate_id),
            text(event_type),
            payload,
            headers.unwrap_or(pg_sys::Datum::from(0)),
            stream.map(text).unwrap_or(pg_sys::Datum::from(0)),
        ];
        let nulls: [c_char; 9] = [
            b' ' as c_char,
            b' ' as c_char,
            b' ' as c_char,
            b' ' as c_char,
            b' ' as c_char,
            b' ' as c_char,
            b' ' as c_char,
            if headers.is_some() { b' ' } else { b'n' } as c_char,
            if stream.is_some() { b' ' } else { b'n' } as c_char,
        ];
        if pg_sys::SPI_execute_plan(insert, values.as_mut_ptr(), nulls.as_ptr(), false, 0)
            != pg_sys::SPI_OK_INSERT as i32
        {
            error!("outbox_enqueue: the insert into outbox.events_{generation} failed");
        }
        pg_sys::SPI_finish();
    }
    event_id_datum
}
