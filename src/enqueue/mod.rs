//! `outbox_enqueue`, the one function on the application's path, in Rust: it validates its
//! arguments (each refusal a SQLSTATE, a message naming the bad value, and a hint), checks that a
//! relay will deliver the event, captures the trace context it runs in (`trace`), takes the
//! aggregate's order lock, and appends one row to the current table of the log
//! (src/log/append.rs). The SQL declaration, its privileges and its
//! bigint/uuid overloads are in `src/sql/enqueue.sql`.
//!
//! It is `SECURITY DEFINER` (writers have no privilege on the log) without a pinned `search_path`
//! clause: pinning one costs a GUC save and restore on every call. The direct path needs none: it
//! looks up its objects by schema and name and runs no user code. The executor path, which runs
//! what a DBA attached to the table (a trigger) with the owner's rights, pins `search_path` itself
//! for the insert.

use std::cell::Cell;

use pgrx::datum::Internal;
use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::guc;
use crate::log::append;
use crate::log::columns::{Column, Row};

pub mod checks;
pub mod order;
pub mod trace;
pub mod wake;

/// The longest `aggregate_type` and `event_type`, and `aggregate_id`, `stream`, `headers`.
const NAME_LIMIT: usize = 255;
const ID_LIMIT: usize = 1024;
const STREAM_LIMIT: usize = 512;
const HEADERS_LIMIT: usize = 65536;

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
pub(crate) fn refuse(code: PgSqlErrorCode, message: String, hint: &str) -> ! {
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

/// Refuses headers whose JSON text is longer than `HEADERS_LIMIT`; `merged`: with the trace
/// context of outbox.traceparent/outbox.tracestate merged in.
fn check_headers_size(text: &str, merged: bool) {
    if text.len() > HEADERS_LIMIT {
        let start: String = text.chars().take(40).collect();
        let with =
            if merged { " with the trace context (outbox.traceparent, outbox.tracestate) merged in" } else { "" };
        refuse(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!(
                "outbox_enqueue: headers are {} bytes as JSON text{with} (starts with {start}), the limit is {HEADERS_LIMIT} bytes",
                text.len()
            ),
            "Headers carry small metadata such as trace ids; put data in the payload.",
        );
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
/// in `src/sql/enqueue.sql`. `payload` and `headers` arrive as jsonb datums, passed on to the insert
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
        let (is_object, text) = unsafe { (jsonb_is_object(headers), crate::log::datums::jsonb_text(headers)) };
        if !is_object {
            let start: String = text.chars().take(100).collect();
            refuse(
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                format!("outbox_enqueue: headers must be a JSON object, got a JSON {}: {start}", jsonb_type_of(&text)),
                "Pass e.g. '{\"trace_id\": \"abc\"}'::jsonb, or NULL for no headers.",
            );
        }
        check_headers_size(&text, false);
    }
    if let Some(stream) = stream {
        let hint = "Pass NULL to use the outbox.stream template, or a Redis key of 1 to 512 bytes.";
        if stream.trim().is_empty() {
            refuse(
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                format!("outbox_enqueue: stream must not be empty or blank (got '{stream}')"),
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
    checks::check_relayed_database();
    checks::check_allowed_stream(aggregate_type, event_type, stream);

    // The limit applies to what is sent to Redis: the payload's JSON text.
    // SAFETY: a non-NULL jsonb argument.
    let payload_bytes = unsafe { crate::log::datums::with_jsonb_text(payload, |text| text.to_bytes().len()) };
    let payload_limit = guc::max_payload_size() as usize;
    if payload_bytes > payload_limit {
        refuse(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!("outbox_enqueue: payload is {payload_bytes} bytes, larger than outbox.max_payload_size ({payload_limit} bytes)"),
            "Put large documents elsewhere and send a reference in the event, or have a superuser raise outbox.max_payload_size.",
        );
    }

    // SAFETY: headers are NULL or a jsonb object (checked above).
    let given = headers;
    let headers = unsafe { trace::with_trace_context(headers) };
    if let Some(merged) = headers.filter(|_| headers != given) {
        // The limit holds for what is stored and sent: the headers with the trace context merged
        // in (outbox.traceparent, outbox.tracestate), not only the argument.
        // SAFETY: a jsonb datum built by with_trace_context.
        check_headers_size(&unsafe { crate::log::datums::jsonb_text(merged) }, true);
    }

    // Right before the id is drawn: enqueues of one aggregate take turns until commit, so that
    // within an aggregate the id follows commit order (src/enqueue/order.rs).
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
        let schema = append::outbox_schema();
        let generation = append::current_generation(schema);
        let text = |value: &str| value.into_datum();
        let mut row = Row::new();
        row.set(Column::Txid, Some(pg_sys::Datum::from(txid)));
        row.set(Column::Shard, shard.into_datum());
        row.set(Column::Id, Some(append::next_id(schema)));
        row.set(Column::EventId, event_id_datum.into_datum());
        row.set(Column::AggregateType, text(aggregate_type));
        row.set(Column::AggregateId, text(aggregate_id));
        row.set(Column::EventType, text(event_type));
        row.set(Column::Payload, Some(payload));
        row.set(Column::Headers, headers);
        row.set(Column::Stream, stream.and_then(text));
        row.set(Column::CreatedAt, Some(pg_sys::Datum::from(pg_sys::GetCurrentTimestamp())));
        append::insert(schema, generation, &mut row);
    }
    event_id_datum
}
