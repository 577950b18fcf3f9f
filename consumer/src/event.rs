//! The typed form of one stream entry written by outbox_pg, in either entry format (native or
//! CloudEvents, told apart by `specversion`), and how it is parsed.
//!
//! Parsing is pure (no Redis), so every rule is unit-tested here. A field that is missing or
//! invalid yields an [`EventParseError`] naming the field; the consumer dead-letters such entries
//! instead of handing them to the handler, because no retry can make them valid.

use std::fmt;

use serde_json::Value;

/// One event as relayed by outbox_pg, plus where it was read from.
///
/// `event_id` is stable across redeliveries (the same event can appear more than once in a stream)
/// and is the deduplication key; `entry_id` is the stream entry ID and differs between copies.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The event's UUID, the same for every copy of the event.
    pub event_id: String,
    /// The row id in `outbox.messages`.
    pub outbox_id: i64,
    /// Kind of aggregate the event belongs to, e.g. `order`.
    pub aggregate_type: String,
    /// Identity of the aggregate within its type.
    pub aggregate_id: String,
    /// Position of the event within its aggregate: 1, 2, 3, ...
    pub aggregate_seq: i64,
    /// What happened, e.g. `order.created`.
    pub event_type: String,
    /// The event's payload, parsed from the entry's JSON text.
    pub payload: Value,
    /// The event's headers: a JSON object, or `None` when the entry has no `headers` field.
    pub headers: Option<Value>,
    /// When the event was enqueued, RFC 3339 in UTC, as written by outbox_pg.
    pub created_at: String,
    /// The W3C `traceparent` of the transaction that enqueued the event, when it ran in a trace:
    /// continue the trace from it (as the parent of the handler's span, or a link to it). An entry
    /// whose `traceparent` is not valid W3C has none, as the specification says to treat it.
    pub traceparent: Option<String>,
    /// The W3C `tracestate` that goes with `traceparent`, when there is one.
    pub tracestate: Option<String>,
    /// For an entry `outbox.replay` sent again: the replay's id. The event's other fields,
    /// `event_id` and `aggregate_seq` included, are those of its first publication.
    pub replay: Option<i64>,
    /// For a CloudEvents entry (`outbox.entry_format = cloudevents`): its `source` attribute;
    /// `None` for a native entry.
    pub source: Option<String>,
    /// The stream key the entry was read from.
    pub stream: String,
    /// The stream entry ID, e.g. `1764446400123-0`.
    pub entry_id: String,
}

/// Why a stream entry is not a valid [`Event`]. Every variant names the offending field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventParseError {
    /// A required field is absent from the entry.
    MissingField {
        /// The field's name.
        field: &'static str,
    },
    /// A field is present but its value is unusable.
    InvalidField {
        /// The field's name.
        field: &'static str,
        /// What is wrong with the value.
        reason: String,
    },
}

impl EventParseError {
    /// The name of the field that made the entry invalid.
    pub fn field(&self) -> &'static str {
        match self {
            EventParseError::MissingField { field } | EventParseError::InvalidField { field, .. } => field,
        }
    }

    fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        EventParseError::InvalidField { field, reason: reason.into() }
    }
}

impl fmt::Display for EventParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventParseError::MissingField { field } => write!(f, "missing field `{field}`"),
            EventParseError::InvalidField { field, reason } => write!(f, "invalid field `{field}`: {reason}"),
        }
    }
}

impl std::error::Error for EventParseError {}

/// The fields an outbox_pg entry carries in each format, as the relay writes them (defined once,
/// in outbox-protocol). Unknown fields are ignored so that producers can add fields without
/// breaking older consumers.
use outbox_protocol::entry::{self as fields, cloudevents as ce, Format, CLOUDEVENTS};
use outbox_protocol::trace;

/// The most fields of any format.
const MOST_FIELDS: usize = CLOUDEVENTS.len();

impl Event {
    /// Parses an entry's field/value pairs (as read from the stream, in any order) into an event.
    /// A CloudEvents entry (one with `specversion`) is read through its attributes; an error then
    /// names the attribute (`aggregateseq`, not `aggregate_seq`).
    ///
    /// `stream` and `entry_id` say where the entry came from and are copied into the event.
    /// A field that appears twice is rejected, since it is ambiguous which value is meant.
    pub fn from_fields<'a, I>(stream: &str, entry_id: &str, entry_fields: I) -> Result<Event, EventParseError>
    where
        I: IntoIterator<Item = (&'a [u8], &'a [u8])>,
    {
        let pairs: Vec<(&'a [u8], &'a [u8])> = entry_fields.into_iter().collect();
        let format = Format::of(pairs.iter().map(|(name, _)| *name));
        let mut values: [Option<&'a [u8]>; MOST_FIELDS] = [None; MOST_FIELDS];
        for (name, value) in pairs {
            // Non-UTF-8 names cannot be one of ours; they fall through as unknown fields.
            let Some(index) = format.position(name) else {
                continue;
            };
            if values[index].is_some() {
                return Err(EventParseError::invalid(format.fields()[index].name, "appears more than once"));
            }
            values[index] = Some(value);
        }
        let text = |index: usize| -> Result<Option<&'a str>, EventParseError> {
            let name = format.fields()[index].name;
            match values[index] {
                None => Ok(None),
                Some(bytes) => {
                    std::str::from_utf8(bytes).map(Some).map_err(|_| EventParseError::invalid(name, "not valid UTF-8"))
                }
            }
        };
        // The field carrying the native field `native`: its name in this format and its value.
        let get = |native: &'static str| -> Result<(&'static str, Option<&'a str>), EventParseError> {
            let (index, field) = format.carrying(native).ok_or(EventParseError::MissingField { field: native })?;
            Ok((field.name, text(index)?))
        };
        let require = |native: &'static str| -> Result<(&'static str, &'a str), EventParseError> {
            let (name, value) = get(native)?;
            Ok((name, value.ok_or(EventParseError::MissingField { field: name })?))
        };
        // A field of the format's own (CloudEvents' specversion, source, datacontenttype).
        let own = |name: &'static str| -> Result<&'a str, EventParseError> {
            let index = format.position(name.as_bytes()).ok_or(EventParseError::MissingField { field: name })?;
            text(index)?.ok_or(EventParseError::MissingField { field: name })
        };

        let source = match format {
            Format::Native => None,
            Format::CloudEvents => {
                let specversion = own(ce::SPECVERSION)?;
                if specversion != ce::SPECVERSION_VALUE {
                    return Err(EventParseError::invalid(
                        ce::SPECVERSION,
                        format!("only CloudEvents {} is read, got {}", ce::SPECVERSION_VALUE, quote(specversion)),
                    ));
                }
                let content_type = own(ce::DATACONTENTTYPE)?;
                if content_type != ce::DATACONTENTTYPE_VALUE {
                    return Err(EventParseError::invalid(
                        ce::DATACONTENTTYPE,
                        format!("must be {}, got {}", ce::DATACONTENTTYPE_VALUE, quote(content_type)),
                    ));
                }
                Some(non_empty(ce::SOURCE, own(ce::SOURCE)?)?.to_owned())
            }
        };
        let (name, event_id) = require(fields::EVENT_ID)?;
        if !is_uuid(event_id) {
            return Err(EventParseError::invalid(name, format!("not a UUID: {}", quote(event_id))));
        }
        let (name, outbox_id) = require(fields::OUTBOX_ID)?;
        let outbox_id = parse_int(name, outbox_id)?;
        let (name, aggregate_type) = require(fields::AGGREGATE_TYPE)?;
        let aggregate_type = non_empty(name, aggregate_type)?;
        let (name, aggregate_id) = require(fields::AGGREGATE_ID)?;
        let aggregate_id = non_empty(name, aggregate_id)?;
        let (name, aggregate_seq) = require(fields::AGGREGATE_SEQ)?;
        let aggregate_seq = parse_int(name, aggregate_seq)?;
        if aggregate_seq < 1 {
            return Err(EventParseError::invalid(name, format!("must be 1 or more, got {aggregate_seq}")));
        }
        let (name, event_type) = require(fields::EVENT_TYPE)?;
        let event_type = non_empty(name, event_type)?;
        let (name, payload) = require(fields::PAYLOAD)?;
        let payload = serde_json::from_str::<Value>(payload)
            .map_err(|e| EventParseError::invalid(name, format!("not JSON: {e}")))?;
        let headers = match get(fields::HEADERS)? {
            (_, None) => None,
            (name, Some(text)) => match serde_json::from_str::<Value>(text) {
                Ok(value @ Value::Object(_)) => Some(value),
                Ok(other) => {
                    return Err(EventParseError::invalid(
                        name,
                        format!("must be a JSON object, got {}", json_kind(&other)),
                    ))
                }
                Err(e) => return Err(EventParseError::invalid(name, format!("not JSON: {e}"))),
            },
        };
        let (name, created_at) = require(fields::CREATED_AT)?;
        if !is_rfc3339(created_at) {
            return Err(EventParseError::invalid(name, format!("not an RFC 3339 timestamp: {}", quote(created_at))));
        }
        // W3C: a traceparent that does not parse is ignored, with its tracestate; the event is
        // no less valid for it.
        let traceparent = get(fields::TRACEPARENT)?.1.filter(|value| trace::check_traceparent(value).is_ok());
        let tracestate = get(fields::TRACESTATE)?
            .1
            .filter(|value| traceparent.is_some() && !value.is_empty() && trace::check_tracestate(value).is_ok());

        let (name, replay) = get(fields::REPLAY)?;
        let replay = replay.map(|text| parse_int(name, text)).transpose()?;

        Ok(Event {
            traceparent: traceparent.map(str::to_owned),
            tracestate: tracestate.map(str::to_owned),
            source,
            replay,
            event_id: event_id.to_owned(),
            outbox_id,
            aggregate_type: aggregate_type.to_owned(),
            aggregate_id: aggregate_id.to_owned(),
            aggregate_seq,
            event_type: event_type.to_owned(),
            payload,
            headers,
            created_at: created_at.to_owned(),
            stream: stream.to_owned(),
            entry_id: entry_id.to_owned(),
        })
    }

    /// The event as a JSON object with one member per field (`headers`, `traceparent`,
    /// `tracestate`, `replay` and `source` are `null` when absent); this is the line format of the
    /// `outbox-consume` CLI.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "event_id": self.event_id,
            "outbox_id": self.outbox_id,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "aggregate_seq": self.aggregate_seq,
            "event_type": self.event_type,
            "payload": self.payload,
            "headers": self.headers,
            "created_at": self.created_at,
            "traceparent": self.traceparent,
            "tracestate": self.tracestate,
            "replay": self.replay,
            "source": self.source,
            "stream": self.stream,
            "entry_id": self.entry_id,
        })
    }
}

fn parse_int(field: &'static str, text: &str) -> Result<i64, EventParseError> {
    text.parse::<i64>().map_err(|_| EventParseError::invalid(field, format!("not an integer: {}", quote(text))))
}

fn non_empty<'a>(field: &'static str, text: &'a str) -> Result<&'a str, EventParseError> {
    if text.is_empty() {
        Err(EventParseError::invalid(field, "must not be empty"))
    } else {
        Ok(text)
    }
}

/// Quotes a value for an error message, shortened so that a huge bad value does not flood logs
/// or the dead-letter stream.
fn quote(text: &str) -> String {
    const MAX_CHARS: usize = 64;
    if text.chars().count() <= MAX_CHARS {
        format!("{text:?}")
    } else {
        let head: String = text.chars().take(MAX_CHARS).collect();
        format!("{head:?}...")
    }
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The canonical textual UUID form, `8-4-4-4-12` hex digits (either case).
fn is_uuid(text: &str) -> bool {
    let bytes = text.as_bytes();
    bytes.len() == 36
        && bytes.iter().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => *b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

/// RFC 3339 `date-time`: `YYYY-MM-DDTHH:MM:SS[.fraction](Z|+HH:MM|-HH:MM)`, with field ranges
/// checked (not the day-of-month against the month, which would need a calendar). Checked so
/// that a garbage timestamp is caught at the boundary rather than deep in a handler.
fn is_rfc3339(text: &str) -> bool {
    let b = text.as_bytes();
    let digits = |range: std::ops::Range<usize>| -> Option<u32> {
        let part = b.get(range)?;
        if !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        Some(part.iter().fold(0, |acc, d| acc * 10 + u32::from(d - b'0')))
    };
    let valid_date_time = (|| {
        let month = digits(5..7)?;
        let day = digits(8..10)?;
        let hour = digits(11..13)?;
        let minute = digits(14..16)?;
        let second = digits(17..19)?;
        digits(0..4)?;
        let at = |i: usize| b.get(i).copied();
        let separators = at(4) == Some(b'-')
            && at(7) == Some(b'-')
            && matches!(at(10), Some(b'T' | b't'))
            && at(13) == Some(b':')
            && at(16) == Some(b':');
        // Second 60 is a leap second, which RFC 3339 allows.
        Some(
            separators
                && (1..=12).contains(&month)
                && (1..=31).contains(&day)
                && hour <= 23
                && minute <= 59
                && second <= 60,
        )
    })();
    if valid_date_time != Some(true) {
        return false;
    }
    let mut rest = b.get(19..).unwrap_or_default();
    if let Some(fraction) = rest.strip_prefix(b".") {
        let count = fraction.iter().take_while(|c| c.is_ascii_digit()).count();
        if count == 0 {
            return false;
        }
        rest = &fraction[count..];
    }
    match rest {
        [b'Z' | b'z'] => true,
        [b'+' | b'-', h1, h2, b':', m1, m2] => {
            let all_digits = [h1, h2, m1, m2].iter().all(|c| c.is_ascii_digit());
            all_digits && (h1 - b'0') * 10 + (h2 - b'0') <= 23 && (m1 - b'0') * 10 + (m2 - b'0') <= 59
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_protocol::entry::NATIVE;

    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    const EVENT_ID: &str = "0192e4a0-7b1c-7def-8abc-0123456789ab";

    fn good_fields() -> Vec<(&'static str, String)> {
        vec![
            ("event_id", EVENT_ID.to_string()),
            ("outbox_id", "42".to_string()),
            ("aggregate_type", "order".to_string()),
            ("aggregate_id", "o-1".to_string()),
            ("aggregate_seq", "3".to_string()),
            ("event_type", "order.created".to_string()),
            ("payload", r#"{"total":12.5,"items":[1,2]}"#.to_string()),
            ("created_at", "2026-11-29T20:00:00.123456Z".to_string()),
        ]
    }

    fn parse(fields: &[(&str, String)]) -> Result<Event, EventParseError> {
        Event::from_fields("outbox:order", "1-0", fields.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())))
    }

    fn with(field: &'static str, value: &str) -> Vec<(&'static str, String)> {
        with_in(good_fields(), field, value)
    }

    fn without(field: &str) -> Vec<(&'static str, String)> {
        good_fields().into_iter().filter(|(k, _)| *k != field).collect()
    }

    fn invalid_field(fields: &[(&str, String)]) -> &'static str {
        match parse(fields) {
            Err(EventParseError::InvalidField { field, .. }) => field,
            other => panic!("expected an invalid field, got {other:?}"),
        }
    }

    #[test]
    fn parses_a_complete_entry() {
        let event = parse(&good_fields()).expect("valid entry");
        assert_eq!(event.event_id, EVENT_ID);
        assert_eq!(event.outbox_id, 42);
        assert_eq!(event.aggregate_type, "order");
        assert_eq!(event.aggregate_id, "o-1");
        assert_eq!(event.aggregate_seq, 3);
        assert_eq!(event.event_type, "order.created");
        assert_eq!(event.payload, serde_json::json!({"total": 12.5, "items": [1, 2]}));
        assert_eq!(event.headers, None);
        assert_eq!(event.created_at, "2026-11-29T20:00:00.123456Z");
        assert_eq!(event.stream, "outbox:order");
        assert_eq!(event.entry_id, "1-0");
    }

    #[test]
    fn headers_object_is_kept_and_unknown_fields_are_ignored() {
        let mut fields = with("headers", r#"{"trace":"t-1"}"#);
        fields.push(("future_field", "whatever".to_string()));
        let event = parse(&fields).expect("valid entry");
        assert_eq!(event.headers, Some(serde_json::json!({"trace": "t-1"})));
    }

    #[test]
    fn payload_may_be_any_json_value() {
        for payload in ["null", "7", r#""text""#, "[1,2]", "{}"] {
            assert!(parse(&with("payload", payload)).is_ok(), "payload {payload}");
        }
    }

    #[test]
    fn each_missing_required_field_is_named() {
        for field in NATIVE.iter().filter(|f| f.required).map(|f| f.name) {
            assert_eq!(parse(&without(field)), Err(EventParseError::MissingField { field }), "without {field}");
        }
    }

    #[test]
    fn invalid_values_name_their_field() {
        assert_eq!(invalid_field(&with("event_id", "not-a-uuid")), "event_id");
        assert_eq!(invalid_field(&with("event_id", "0192e4a0x7b1c-7def-8abc-0123456789ab")), "event_id");
        assert_eq!(invalid_field(&with("outbox_id", "12a")), "outbox_id");
        assert_eq!(invalid_field(&with("outbox_id", "")), "outbox_id");
        assert_eq!(invalid_field(&with("aggregate_type", "")), "aggregate_type");
        assert_eq!(invalid_field(&with("aggregate_id", "")), "aggregate_id");
        assert_eq!(invalid_field(&with("aggregate_seq", "0")), "aggregate_seq");
        assert_eq!(invalid_field(&with("aggregate_seq", "three")), "aggregate_seq");
        assert_eq!(invalid_field(&with("event_type", "")), "event_type");
        assert_eq!(invalid_field(&with("payload", "{not json")), "payload");
        assert_eq!(invalid_field(&with("payload", "")), "payload");
        assert_eq!(invalid_field(&with("headers", "[1]")), "headers");
        assert_eq!(invalid_field(&with("headers", "\"a\"")), "headers");
        assert_eq!(invalid_field(&with("headers", "{")), "headers");
        assert_eq!(invalid_field(&with("created_at", "yesterday")), "created_at");
    }

    #[test]
    fn error_messages_name_the_field() {
        let err = parse(&with("payload", "{oops")).expect_err("payload is not JSON");
        assert!(err.to_string().starts_with("invalid field `payload`: not JSON"), "{err}");
        assert_eq!(err.field(), "payload");
        let err = parse(&without("event_id")).expect_err("event_id is missing");
        assert_eq!(err.to_string(), "missing field `event_id`");
    }

    #[test]
    fn duplicate_and_non_utf8_values_are_rejected() {
        let mut fields = good_fields();
        fields.push(("event_type", "again".to_string()));
        assert_eq!(invalid_field(&fields), "event_type");

        let mut raw: Vec<(&[u8], &[u8])> = Vec::new();
        let good = good_fields();
        for (k, v) in &good {
            if *k == "aggregate_id" {
                raw.push((k.as_bytes(), b"\xff\xfe"));
            } else {
                raw.push((k.as_bytes(), v.as_bytes()));
            }
        }
        let err = Event::from_fields("s", "1-0", raw).expect_err("non-UTF-8 value");
        assert_eq!(err.field(), "aggregate_id");
    }

    #[test]
    fn long_bad_values_are_shortened_in_messages() {
        let long = "x".repeat(10_000);
        let err = parse(&with("event_id", &long)).expect_err("not a UUID");
        assert!(err.to_string().len() < 200, "{err}");
    }

    #[test]
    fn rfc3339_forms() {
        for ok in [
            "2026-11-29T20:00:00.123456Z",
            "2026-11-29T20:00:00Z",
            "2026-11-29t20:00:00z",
            "2026-11-29T20:00:00+02:00",
            "2026-11-29T20:00:00.1-05:30",
            "2016-12-31T23:59:60Z",
        ] {
            assert!(is_rfc3339(ok), "{ok}");
        }
        for bad in [
            "",
            "2026-11-29",
            "2026-11-29 20:00:00Z",
            "2026-13-29T20:00:00Z",
            "2026-11-00T20:00:00Z",
            "2026-11-29T24:00:00Z",
            "2026-11-29T20:60:00Z",
            "2026-11-29T20:00:00",
            "2026-11-29T20:00:00.Z",
            "2026-11-29T20:00:00+2:00",
            "2026-11-29T20:00:00+24:00",
            "2026-11-29T20:00:00Zjunk",
            "２026-11-29T20:00:00Z",
        ] {
            assert!(!is_rfc3339(bad), "{bad}");
        }
    }

    #[test]
    fn to_json_has_every_field() {
        let event = parse(&with("headers", r#"{"k":"v"}"#)).expect("valid entry");
        let json = event.to_json();
        assert_eq!(json["event_id"], EVENT_ID);
        assert_eq!(json["outbox_id"], 42);
        assert_eq!(json["aggregate_seq"], 3);
        assert_eq!(json["payload"]["items"][1], 2);
        assert_eq!(json["headers"]["k"], "v");
        assert_eq!(json["stream"], "outbox:order");
        assert_eq!(json["entry_id"], "1-0");
        assert_eq!(json["replay"], serde_json::Value::Null);
        assert_eq!(json["traceparent"], serde_json::Value::Null);
        assert_eq!(json["source"], serde_json::Value::Null);
        assert_eq!(json.as_object().map(|o| o.len()), Some(15));
        let replayed = parse(&with("replay", "7")).expect("valid entry");
        assert_eq!(replayed.replay, Some(7));
        assert_eq!(invalid_field(&with("replay", "x")), "replay");
    }

    /// The fields the relay writes in `cloudevents` format for the event of `good_fields`.
    fn cloudevent_fields() -> Vec<(&'static str, String)> {
        vec![
            ("specversion", "1.0".to_string()),
            ("id", EVENT_ID.to_string()),
            ("source", "/outbox/app/order".to_string()),
            ("type", "order.created".to_string()),
            ("subject", "o-1".to_string()),
            ("time", "2026-11-29T20:00:00.123456Z".to_string()),
            ("datacontenttype", "application/json".to_string()),
            ("data", r#"{"total":12.5,"items":[1,2]}"#.to_string()),
            ("aggregatetype", "order".to_string()),
            ("aggregateseq", "3".to_string()),
            ("outboxid", "42".to_string()),
        ]
    }

    /// `fields` with `field` set to `value` (added when missing).
    fn with_in(
        mut fields: Vec<(&'static str, String)>,
        field: &'static str,
        value: &str,
    ) -> Vec<(&'static str, String)> {
        match fields.iter_mut().find(|(k, _)| *k == field) {
            Some(slot) => slot.1 = value.to_string(),
            None => fields.push((field, value.to_string())),
        }
        fields
    }

    #[test]
    fn a_cloudevent_reads_as_the_same_event() {
        let native = parse(&good_fields()).expect("native entry");
        let cloudevent = parse(&cloudevent_fields()).expect("CloudEvents entry");
        assert_eq!(cloudevent.source.as_deref(), Some("/outbox/app/order"));
        assert_eq!(Event { source: None, ..cloudevent }, native);
    }

    #[test]
    fn each_missing_cloudevents_attribute_is_named() {
        for field in CLOUDEVENTS.iter().filter(|f| f.required).map(|f| f.name).filter(|name| *name != "specversion") {
            let fields: Vec<_> = cloudevent_fields().into_iter().filter(|(k, _)| *k != field).collect();
            assert_eq!(parse(&fields), Err(EventParseError::MissingField { field }), "without {field}");
        }
        // Without specversion it is no CloudEvent, and misses the native fields.
        let fields: Vec<_> = cloudevent_fields().into_iter().filter(|(k, _)| *k != "specversion").collect();
        assert_eq!(parse(&fields), Err(EventParseError::MissingField { field: "event_id" }));
    }

    #[test]
    fn invalid_cloudevents_attributes_are_named() {
        let ce = |field: &'static str, value: &str| invalid_field(&with_in(cloudevent_fields(), field, value));
        assert_eq!(ce("specversion", "0.3"), "specversion");
        assert_eq!(ce("datacontenttype", "text/plain"), "datacontenttype");
        assert_eq!(ce("source", ""), "source");
        assert_eq!(ce("id", "nope"), "id");
        assert_eq!(ce("aggregateseq", "0"), "aggregateseq");
        assert_eq!(ce("outboxid", "x"), "outboxid");
        assert_eq!(ce("data", "{"), "data");
        assert_eq!(ce("time", "yesterday"), "time");
        assert_eq!(ce("headers", "[]"), "headers");
        assert_eq!(ce("replay", "x"), "replay");
        let mut twice = cloudevent_fields();
        twice.push(("subject", "again".into()));
        assert_eq!(invalid_field(&twice), "subject");
    }

    #[test]
    fn the_trace_context_is_read_in_both_formats() {
        for fields in [good_fields(), cloudevent_fields()] {
            let fields = with_in(with_in(fields, "traceparent", TRACEPARENT), "tracestate", "rojo=1");
            let event = parse(&fields).expect("valid entry");
            assert_eq!(event.traceparent.as_deref(), Some(TRACEPARENT));
            assert_eq!(event.tracestate.as_deref(), Some("rojo=1"));
            assert_eq!(event.to_json()["traceparent"], TRACEPARENT);
        }
        // A traceparent that is not W3C is ignored, with its tracestate: the event stays valid.
        let event = parse(&with_in(with_in(good_fields(), "traceparent", "00-xyz"), "tracestate", "rojo=1")).unwrap();
        assert_eq!((event.traceparent, event.tracestate), (None, None));
        let event = parse(&with_in(with_in(good_fields(), "traceparent", TRACEPARENT), "tracestate", "Bad")).unwrap();
        assert_eq!((event.traceparent.as_deref(), event.tracestate), (Some(TRACEPARENT), None));
    }
}
