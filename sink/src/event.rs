//! An event as the relay reads it from the log and sends it: shared by the log (which reads it),
//! the relay (which numbers and routes it) and the sink (which writes it as a stream entry), so
//! that none of them depends on another for it.

use outbox_protocol::entry as fields;
use outbox_protocol::trace;

/// One claimed row, with every value already in the text form it is sent in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    pub id: i64,
    pub event_id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// Position of the event within its aggregate: 1, 2, 3, ...
    pub aggregate_seq: i64,
    pub event_type: String,
    /// The payload's JSON text.
    pub payload: String,
    /// The headers' JSON text, when the event has headers.
    pub headers: Option<String>,
    /// The trace context the headers carry (`TraceContext::from_headers`), written as fields of
    /// their own.
    pub trace: Option<TraceContext>,
    /// The stream given at enqueue, if any; otherwise the template decides.
    pub stream: Option<String>,
    /// RFC 3339 with microseconds, UTC.
    pub created_at: String,
    /// The replay (`outbox.replays.id`) that sends this event again, for an entry that is a
    /// replay; None for its first publication.
    pub replay: Option<i64>,
}

/// The W3C trace context an event was enqueued in. `outbox_enqueue` keeps it in the event's
/// headers, under the keys `traceparent` and `tracestate`, so that the log needs no column of its
/// own for it and the headers a consumer reads carry it too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    pub traceparent: String,
    /// None when empty.
    pub tracestate: Option<String>,
}

impl TraceContext {
    /// The trace context in an event's headers (JSON text): a valid `traceparent`, and the
    /// `tracestate` with it when that is valid and not empty. `outbox_enqueue` refuses invalid
    /// ones, so the checks only keep out what an older version let through.
    pub fn from_headers(headers: Option<&str>) -> Option<TraceContext> {
        let headers = headers?;
        // Most headers carry no trace context: no parse for them.
        if !headers.contains(fields::TRACEPARENT) {
            return None;
        }
        let serde_json::Value::Object(headers) = serde_json::from_str(headers).ok()? else { return None };
        let traceparent = headers.get(fields::TRACEPARENT)?.as_str()?;
        trace::check_traceparent(traceparent).ok()?;
        let tracestate = headers
            .get(fields::TRACESTATE)
            .and_then(serde_json::Value::as_str)
            .filter(|state| !state.is_empty() && trace::check_tracestate(state).is_ok());
        Some(TraceContext { traceparent: traceparent.to_string(), tracestate: tracestate.map(str::to_string) })
    }
}
