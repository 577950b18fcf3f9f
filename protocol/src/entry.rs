//! The fields of a stream entry, as the relay writes them and a consumer reads them, in each of the
//! two entry formats (`outbox.entry_format`): `native` (the default) and `cloudevents`. The relay
//! writes the fields of its format in the order listed here, the optional ones only when the event
//! has them; a consumer must accept them in any order and ignore fields it does not know, so that
//! fields can be added without breaking older consumers. A consumer tells the formats apart by
//! `specversion`, which only a CloudEvents entry carries.

/// The event's UUID, the same for every copy of the event: the deduplication key.
pub const EVENT_ID: &str = "event_id";
/// The event's row id in `outbox.messages`.
pub const OUTBOX_ID: &str = "outbox_id";
pub const AGGREGATE_TYPE: &str = "aggregate_type";
pub const AGGREGATE_ID: &str = "aggregate_id";
/// 1, 2, 3, ... per aggregate, gap-free in commit order.
pub const AGGREGATE_SEQ: &str = "aggregate_seq";
pub const EVENT_TYPE: &str = "event_type";
/// The payload's JSON text.
pub const PAYLOAD: &str = "payload";
/// The headers' JSON text (a JSON object); only when the event has headers.
pub const HEADERS: &str = "headers";
/// The W3C `traceparent` the event was enqueued in (`outbox_enqueue` took it from the headers'
/// key of this name, or from `outbox.traceparent`); only when the event has one. The headers keep
/// it too, under the same key.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C `tracestate` that goes with `traceparent`; only when the event has one.
pub const TRACESTATE: &str = "tracestate";
/// When the event was enqueued: RFC 3339, UTC, microseconds (`2026-11-29T20:00:00.123456Z`).
pub const CREATED_AT: &str = "created_at";
/// Only on an entry that `outbox.replay` sent again: the replay's id (`outbox.replays.id`). The
/// other fields are the event's own, `event_id` and `aggregate_seq` included, so a consumer that
/// deduplicates by `event_id` needs to do nothing about replays.
pub const REPLAY: &str = "replay";

/// The CloudEvents 1.0 attributes of the `cloudevents` format, one field each, named as in the
/// Kafka protocol binding's binary mode without its `ce_` prefix (there is no Redis binding).
/// `traceparent`, `tracestate` (the Distributed Tracing extension), `headers` and `replay` have the
/// native names.
pub mod cloudevents {
    /// Always `1.0` ([`SPECVERSION_VALUE`]); its presence marks an entry as a CloudEvent.
    pub const SPECVERSION: &str = "specversion";
    pub const SPECVERSION_VALUE: &str = "1.0";
    /// The event's UUID (native `event_id`).
    pub const ID: &str = "id";
    /// `outbox.cloudevents_source` with its placeholders filled in, a URI reference.
    pub const SOURCE: &str = "source";
    /// Native `event_type`.
    pub const TYPE: &str = "type";
    /// Native `aggregate_id`.
    pub const SUBJECT: &str = "subject";
    /// Native `created_at` (RFC 3339).
    pub const TIME: &str = "time";
    /// Always `application/json` ([`DATACONTENTTYPE_VALUE`]): `data` is JSON text.
    pub const DATACONTENTTYPE: &str = "datacontenttype";
    pub const DATACONTENTTYPE_VALUE: &str = "application/json";
    /// Native `payload`.
    pub const DATA: &str = "data";
    /// Extension attributes: native `aggregate_type`, `aggregate_seq`, `outbox_id`.
    pub const AGGREGATETYPE: &str = "aggregatetype";
    pub const AGGREGATESEQ: &str = "aggregateseq";
    pub const OUTBOXID: &str = "outboxid";
}

/// A field of an entry format: its name, whether every entry carries it, and which native field's
/// value it holds (itself, in the native format; `None` for CloudEvents' own attributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub required: bool,
    pub native: Option<&'static str>,
}

const fn native(name: &'static str, required: bool) -> Field {
    Field { name, required, native: Some(name) }
}

const fn carries(name: &'static str, required: bool, native: &'static str) -> Field {
    Field { name, required, native: Some(native) }
}

/// The native format's fields, in the order the relay writes them.
pub const NATIVE: [Field; 12] = [
    native(EVENT_ID, true),
    native(OUTBOX_ID, true),
    native(AGGREGATE_TYPE, true),
    native(AGGREGATE_ID, true),
    native(AGGREGATE_SEQ, true),
    native(EVENT_TYPE, true),
    native(PAYLOAD, true),
    native(HEADERS, false),
    native(TRACEPARENT, false),
    native(TRACESTATE, false),
    native(CREATED_AT, true),
    native(REPLAY, false),
];

/// The `cloudevents` format's fields, in the order the relay writes them: the required context
/// attributes, the optional ones, data, then the extension attributes.
pub const CLOUDEVENTS: [Field; 15] = {
    use cloudevents::*;
    [
        Field { name: SPECVERSION, required: true, native: None },
        carries(ID, true, EVENT_ID),
        Field { name: SOURCE, required: true, native: None },
        carries(TYPE, true, EVENT_TYPE),
        carries(SUBJECT, true, AGGREGATE_ID),
        carries(TIME, true, CREATED_AT),
        Field { name: DATACONTENTTYPE, required: true, native: None },
        carries(DATA, true, PAYLOAD),
        carries(AGGREGATETYPE, true, AGGREGATE_TYPE),
        carries(AGGREGATESEQ, true, AGGREGATE_SEQ),
        carries(OUTBOXID, true, OUTBOX_ID),
        native(HEADERS, false),
        native(TRACEPARENT, false),
        native(TRACESTATE, false),
        native(REPLAY, false),
    ]
};

/// An entry format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Native,
    CloudEvents,
}

impl Format {
    /// The format of an entry with these field names: CloudEvents when it has `specversion`.
    pub fn of<'a>(names: impl IntoIterator<Item = &'a [u8]>) -> Format {
        if names.into_iter().any(|name| name == cloudevents::SPECVERSION.as_bytes()) {
            Format::CloudEvents
        } else {
            Format::Native
        }
    }

    /// This format's fields, in the order the relay writes them.
    pub fn fields(self) -> &'static [Field] {
        match self {
            Format::Native => &NATIVE,
            Format::CloudEvents => &CLOUDEVENTS,
        }
    }

    /// The position of the field `name` in `fields()`, if it is one of this format's.
    pub fn position(self, name: &[u8]) -> Option<usize> {
        self.fields().iter().position(|field| field.name.as_bytes() == name)
    }

    /// The field of this format that carries the native field `native`, if any.
    pub fn carrying(self, native: &str) -> Option<(usize, &'static Field)> {
        self.fields().iter().enumerate().find(|(_, field)| field.native == Some(native))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_is_found_where_it_stands() {
        for format in [Format::Native, Format::CloudEvents] {
            for (position, field) in format.fields().iter().enumerate() {
                assert_eq!(format.position(field.name.as_bytes()), Some(position), "{format:?}");
            }
            assert_eq!(format.position(b"unknown"), None);
        }
    }

    #[test]
    fn the_optional_fields_are_those_an_event_may_lack() {
        let optional =
            |format: Format| -> Vec<&str> { format.fields().iter().filter(|f| !f.required).map(|f| f.name).collect() };
        assert_eq!(optional(Format::Native), [HEADERS, TRACEPARENT, TRACESTATE, REPLAY]);
        assert_eq!(optional(Format::CloudEvents), [HEADERS, TRACEPARENT, TRACESTATE, REPLAY]);
    }

    #[test]
    fn cloudevents_carry_every_native_field_once() {
        for field in NATIVE {
            let carriers: Vec<_> = CLOUDEVENTS.iter().filter(|ce| ce.native == Some(field.name)).collect();
            assert_eq!(carriers.len(), 1, "{}", field.name);
            assert_eq!(carriers[0].required, field.required, "{}", field.name);
        }
        // CloudEvents attribute names: lower-case ASCII letters and digits, at most 20 characters.
        for field in CLOUDEVENTS {
            assert!(field.name.len() <= 20, "{}", field.name);
            assert!(field.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()), "{}", field.name);
        }
    }

    #[test]
    fn the_format_is_told_by_specversion() {
        assert_eq!(Format::of([b"event_id".as_slice(), b"payload"]), Format::Native);
        assert_eq!(Format::of([b"id".as_slice(), b"specversion"]), Format::CloudEvents);
        assert_eq!(Format::CloudEvents.carrying(AGGREGATE_SEQ).map(|(_, f)| f.name), Some("aggregateseq"));
        assert_eq!(Format::Native.carrying(AGGREGATE_SEQ).map(|(i, _)| i), Some(4));
    }
}
