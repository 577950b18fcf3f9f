//! The W3C trace context an event is enqueued in, captured at enqueue: the relay publishes later,
//! in no trace. It comes from the event's headers (keys `traceparent`, `tracestate`) when they
//! carry one, or else from `outbox.traceparent` and `outbox.tracestate`, which the application (or
//! its driver's hook) sets with `SET LOCAL` in the enqueuing transaction. Either way it is checked
//! (a bad one refuses the event with 22023, never drops it) and kept in the event's headers, where
//! the relay finds it (sink/src/entry.rs) and writes it as entry fields of their own: the log needs
//! no column for it.

use outbox_protocol::entry::{TRACEPARENT, TRACESTATE};
use outbox_protocol::trace::{check_traceparent, check_tracestate, TRACEPARENT_HINT, TRACESTATE_HINT};
use pgrx::pg_sys;
use pgrx::prelude::*;

use super::refuse;
use crate::guc;

/// The headers to store for an event enqueued with `headers`: the same datum when they carry a
/// trace context or none is set, else the headers (or a new object) with `outbox.traceparent` and
/// `outbox.tracestate` added. Refuses a trace context that is not valid W3C.
///
/// # Safety
/// `headers` is NULL or a jsonb datum whose root is an object.
pub unsafe fn with_trace_context(headers: Option<pg_sys::Datum>) -> Option<pg_sys::Datum> {
    if let Some(datum) = headers {
        // SAFETY: per the contract above.
        let (traceparent, tracestate) =
            unsafe { (string_member(datum, TRACEPARENT), string_member(datum, TRACESTATE)) };
        match (traceparent, tracestate) {
            (Some(traceparent), tracestate) => {
                check("headers' traceparent", &traceparent, check_traceparent(&traceparent), TRACEPARENT_HINT);
                if let Some(tracestate) = tracestate {
                    check("headers' tracestate", &tracestate, check_tracestate(&tracestate), TRACESTATE_HINT);
                }
                return headers;
            }
            (None, Some(tracestate)) => refuse(
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                format!("outbox_enqueue: headers carry a tracestate ({}) but no traceparent", shown(&tracestate)),
                "A tracestate belongs to the traceparent it came with: add that traceparent to the headers, or leave \
                 the tracestate out.",
            ),
            (None, None) => {}
        }
    }
    let tracestate = guc::tracestate();
    let Some(traceparent) = guc::traceparent() else {
        if let Some(tracestate) = tracestate {
            refuse(
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                format!(
                    "outbox_enqueue: outbox.tracestate is set ({}) but outbox.traceparent is not",
                    shown(&tracestate)
                ),
                "Set both in the enqueuing transaction (SET LOCAL outbox.traceparent = '00-...'), or RESET \
                 outbox.tracestate.",
            );
        }
        return headers;
    };
    // The settings' check hooks refused bad values already; these hold if one got past them.
    check("outbox.traceparent", &traceparent, check_traceparent(&traceparent), TRACEPARENT_HINT);
    let mut trace = serde_json::Map::new();
    trace.insert(TRACEPARENT.into(), traceparent.into());
    if let Some(tracestate) = tracestate {
        check("outbox.tracestate", &tracestate, check_tracestate(&tracestate), TRACESTATE_HINT);
        trace.insert(TRACESTATE.into(), tracestate.into());
    }
    let trace = pgrx::JsonB(serde_json::Value::Object(trace)).into_datum();
    match headers {
        None => trace,
        // SAFETY: two jsonb objects; jsonb_concat (`||`) merges them into a new one.
        Some(headers) => unsafe {
            pgrx::fcinfo::direct_function_call_as_datum(pg_sys::jsonb_concat, &[Some(headers), trace])
        },
    }
}

/// Refuses the event when `checked` says `value` (from `what`) is not valid.
fn check(what: &str, value: &str, checked: Result<(), String>, hint: &str) {
    if let Err(reason) = checked {
        refuse(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("outbox_enqueue: {what} {} is not valid: {reason}", shown(value)),
            hint,
        );
    }
}

/// A value as the messages show it: quoted, at most 100 characters.
fn shown(value: &str) -> String {
    let start: String = value.chars().take(100).collect();
    let more = if start.len() < value.len() { "..." } else { "" };
    format!("'{}'{more}", start.replace('\'', "''"))
}

/// The top-level member `key` of a jsonb object, when there is one; refuses one that is not a
/// string.
///
/// # Safety
/// `datum` is a jsonb datum whose root is an object.
unsafe fn string_member(datum: pg_sys::Datum, key: &str) -> Option<String> {
    // SAFETY: a detoasted jsonb's root container; getKeyJsonValueFromContainer looks the key up in
    // an object and returns a palloc'd value or NULL, whose string points into the container.
    let found = unsafe {
        let jsonb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()) as *mut pg_sys::Jsonb;
        let value = pg_sys::getKeyJsonValueFromContainer(
            &raw mut (*jsonb).root,
            key.as_ptr().cast(),
            key.len() as i32,
            std::ptr::null_mut(),
        );
        if value.is_null() {
            return None;
        }
        if (*value).type_ == pg_sys::jbvType::jbvString {
            let string = (*value).val.string;
            let bytes = std::slice::from_raw_parts(string.val.cast::<u8>(), string.len as usize);
            Ok(String::from_utf8_lossy(bytes).into_owned())
        } else {
            Err((*value).type_)
        }
    };
    match found {
        Ok(string) => Some(string),
        Err(kind) => refuse(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("outbox_enqueue: headers' {key} must be a JSON string, got a JSON {}", json_kind(kind)),
            if key == TRACEPARENT { TRACEPARENT_HINT } else { TRACESTATE_HINT },
        ),
    }
}

fn json_kind(kind: pg_sys::jbvType::Type) -> &'static str {
    match kind {
        pg_sys::jbvType::jbvNull => "null",
        pg_sys::jbvType::jbvNumeric => "number",
        pg_sys::jbvType::jbvBool => "boolean",
        _ => "array or object",
    }
}
