//! How a claimed outbox row becomes a Redis stream entry: its stream key and its fields, in the
//! entry format `outbox.entry_format` names (the field lists: outbox_protocol's `entry`).
//! Pure functions, so that they are unit-tested and fuzzed without PostgreSQL or Redis.

use outbox_protocol::entry::{self as fields, cloudevents as ce};

pub use crate::event::{OutboxEvent, TraceContext};

/// The entry format (`outbox.entry_format`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryFormat {
    /// The fields of outbox_protocol's `entry::NATIVE`.
    Native,
    /// CloudEvents 1.0 attributes, one field each (`entry::CLOUDEVENTS`); `source` is
    /// `source_template` (`outbox.cloudevents_source`) rendered for each event in `database`.
    CloudEvents { source_template: String, database: String },
}

/// How a round writes its entries: to which stream, trimmed how, in which format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntrySettings {
    /// `outbox.stream`, for events enqueued without a stream.
    pub stream_template: String,
    /// `outbox.stream_maxlen`, `None` when streams are not trimmed.
    pub maxlen: Option<u64>,
    /// `outbox.stream_trim = 'acked'`: trim only entries every consumer group acknowledged
    /// (`XADD ... ACKED`, Redis 8.2 or later).
    pub trim_acked: bool,
    pub format: EntryFormat,
}

/// The placeholders of `outbox.cloudevents_source`.
pub const SOURCE_PLACEHOLDERS: [&str; 3] = ["{database}", "{aggregate_type}", "{event_type}"];

/// `outbox.cloudevents_source` for one event: each placeholder replaced, in one pass, by its value
/// percent-encoded for the part of the URI reference it stands in (RFC 3986 sections 2.2, 3), so
/// that the source stays a URI reference, with the same parts, whatever a database or type is
/// named, and a value is never expanded again. Any other text is kept as written.
///
/// Kept as they are, besides letters, digits and `-._~`: in a path segment `!$&'()*+,;=:@`
/// (`:` not in a relative reference's first segment, which would read as a scheme); in the
/// authority `!$&'()*+,;=`; in the query and the fragment `!$'()*,:@`, so that `&`, `=`, `+` and
/// `;` in a value never split a `key=value` pair. `/`, `?` and `#` are always encoded.
pub fn render_source(template: &str, database: &str, aggregate_type: &str, event_type: &str) -> String {
    let values = [database, aggregate_type, event_type];
    let layout = UriLayout::of(template);
    let mut out = String::with_capacity(template.len() + database.len() + aggregate_type.len());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let tail = &rest[open..];
        match SOURCE_PLACEHOLDERS.iter().position(|placeholder| tail.starts_with(placeholder)) {
            Some(which) => {
                let at = template.len() - tail.len();
                percent_encode(values[which], layout.part(at).kept(), &mut out);
                rest = &tail[SOURCE_PLACEHOLDERS[which].len()..];
            }
            None => {
                out.push('{');
                rest = &tail[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The part of a URI reference (RFC 3986, section 3) a placeholder stands in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UriPart {
    Scheme,
    Authority,
    /// The first segment of a relative reference's path: it cannot hold `:` (section 4.2).
    FirstSegment,
    Path,
    Query,
    Fragment,
}

impl UriPart {
    /// The characters, besides letters and digits, a value keeps as they are in this part.
    fn kept(self) -> &'static [u8] {
        match self {
            UriPart::Scheme => b"",
            UriPart::Authority => b"-._~!$&'()*+,;=",
            UriPart::FirstSegment => b"-._~!$&'()*+,;=@",
            UriPart::Path => b"-._~!$&'()*+,;=:@",
            UriPart::Query | UriPart::Fragment => b"-._~!$'()*,:@",
        }
    }
}

/// Where the parts of a template begin and end, found from its own delimiters (placeholders hold
/// none, and their encoded values none either).
struct UriLayout {
    scheme_colon: Option<usize>,
    authority_end: usize,
    first_segment_end: usize,
    query_at: usize,
    fragment_at: usize,
}

impl UriLayout {
    fn of(template: &str) -> UriLayout {
        let fragment_at = template.find('#').unwrap_or(template.len());
        let query_at = template[..fragment_at].find('?').unwrap_or(fragment_at);
        let first_slash = template[..query_at].find('/').unwrap_or(query_at);
        let scheme_colon = template[..first_slash].find(':');
        let hier_start = scheme_colon.map_or(0, |colon| colon + 1);
        let authority_end = match template[hier_start..query_at].strip_prefix("//") {
            Some(authority) => authority.find('/').map_or(query_at, |end| hier_start + 2 + end),
            None => hier_start,
        };
        let first_segment_end = if scheme_colon.is_none() && authority_end == 0 { first_slash } else { 0 };
        UriLayout { scheme_colon, authority_end, first_segment_end, query_at, fragment_at }
    }

    /// The part the template's byte `at` stands in.
    fn part(&self, at: usize) -> UriPart {
        if at >= self.fragment_at {
            UriPart::Fragment
        } else if at >= self.query_at {
            UriPart::Query
        } else if self.scheme_colon.is_some_and(|colon| at < colon) {
            UriPart::Scheme
        } else if at < self.authority_end {
            UriPart::Authority
        } else if at < self.first_segment_end {
            UriPart::FirstSegment
        } else {
            UriPart::Path
        }
    }
}

fn percent_encode(value: &str, kept: &[u8], out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || kept.contains(&byte) {
            out.push(byte as char);
        } else {
            out.push('%');
            out.push(HEX[usize::from(byte >> 4)] as char);
            out.push(HEX[usize::from(byte & 0xF)] as char);
        }
    }
}

/// Why `template` cannot be `outbox.cloudevents_source`, if it cannot: it must be a non-empty URI
/// reference, so no blank or control character and no brace but those of its placeholders.
pub fn check_source_template(template: &str) -> Result<(), String> {
    if template.is_empty() {
        return Err("it is empty; CloudEvents require a source".into());
    }
    if let Some(bad) = template.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("it contains {bad:?}, which a URI reference cannot hold"));
    }
    let layout = UriLayout::of(template);
    let mut rest = template;
    while let Some(at) = rest.find(['{', '}']) {
        let tail = &rest[at..];
        match SOURCE_PLACEHOLDERS.iter().find(|placeholder| tail.starts_with(*placeholder)) {
            Some(placeholder) if layout.part(template.len() - tail.len()) == UriPart::Scheme => {
                return Err(format!(
                    "{template:?} has {placeholder} in its scheme (before its first ':'), where no value can be percent-encoded"
                ));
            }
            Some(placeholder) => rest = &tail[placeholder.len()..],
            None => {
                let shown: String = match tail.find('}') {
                    Some(end) if end < 40 => tail[..=end].to_string(),
                    _ => tail.chars().take(40).collect(),
                };
                return Err(format!("\"{shown}\" is not one of its placeholders ({})", SOURCE_PLACEHOLDERS.join(", ")));
            }
        }
    }
    // What every event's source looks like: each placeholder's value is encoded for the part it
    // stands in, which makes it a valid piece of that part; "x" stands for each.
    let rendered = render_source(template, "x", "x", "x");
    check_uri_reference(&rendered).map_err(|why| format!("{template:?} is not a URI reference (RFC 3986): {why}"))
}

/// Whether `text` is a URI reference as RFC 3986 (section 4.1) defines it: a URI, or a relative
/// reference; ASCII only, every `%` starting an escape of two hex digits.
fn check_uri_reference(text: &str) -> Result<(), String> {
    const UNRESERVED_AND_SUB_DELIMS: &[u8] = b"-._~!$&'()*+,;=";
    let pchar = |c: u8| c.is_ascii_alphanumeric() || UNRESERVED_AND_SUB_DELIMS.contains(&c) || c == b':' || c == b'@';
    let bytes = text.as_bytes();
    let check = |part: &str, start: usize, end: usize, allowed: &dyn Fn(u8) -> bool| -> Result<(), String> {
        let mut i = start;
        while i < end {
            let c = bytes[i];
            if c == b'%' {
                let escape = bytes.get(i + 1..i + 3).filter(|hex| hex.iter().all(u8::is_ascii_hexdigit));
                if escape.is_none() || i + 3 > end {
                    let shown: String = text[i..].chars().take(3).collect();
                    return Err(format!(
                        "{shown:?} at byte {i} of its {part} is not a percent-escape (% and two hex digits)"
                    ));
                }
                i += 3;
                continue;
            }
            if !allowed(c) {
                let shown = text[i..].chars().next().unwrap_or_default();
                return Err(format!("{shown:?} at byte {i} may not appear in its {part} (percent-encode it)"));
            }
            i += 1;
        }
        Ok(())
    };
    let fragment_at = text.find('#').unwrap_or(text.len());
    let query_at = text[..fragment_at].find('?').unwrap_or(fragment_at);
    let before_query = &text[..query_at];
    let first_delimiter = before_query.find('/').unwrap_or(before_query.len());
    let mut path_start = 0;
    if let Some(colon) = before_query[..first_delimiter].find(':') {
        let scheme = &text[..colon];
        let valid = scheme.as_bytes().first().is_some_and(u8::is_ascii_alphabetic)
            && scheme.bytes().all(|c| c.is_ascii_alphanumeric() || b"+-.".contains(&c));
        if !valid {
            return Err(format!(
                "{scheme:?} before its first ':' is not a scheme (a letter, then letters, digits, '+', '-' or '.'); a relative reference's first segment cannot hold ':'"
            ));
        }
        path_start = colon + 1;
    }
    if text[path_start..query_at].starts_with("//") {
        let authority_start = path_start + 2;
        let authority_end = text[authority_start..query_at].find('/').map_or(query_at, |end| authority_start + end);
        let authority_char = |c: u8| pchar(c) || c == b'[' || c == b']';
        check("authority", authority_start, authority_end, &authority_char)?;
        path_start = authority_end;
    }
    let path_char = |c: u8| pchar(c) || c == b'/';
    check("path", path_start, query_at, &path_char)?;
    let query_char = |c: u8| pchar(c) || c == b'/' || c == b'?';
    if query_at < fragment_at {
        check("query", query_at + 1, fragment_at, &query_char)?;
    }
    if fragment_at < text.len() {
        check("fragment", fragment_at + 1, text.len(), &query_char)?;
    }
    Ok(())
}

/// Refuses a stream template (`outbox.stream`) no stream can be made of: blank (every event enqueued
/// without a stream would go to one blank key), or longer than the 512 bytes `outbox_enqueue`
/// allows a stream. Braces other than the placeholders stay allowed: `{...}` is a Redis Cluster
/// hash tag.
pub fn check_stream_template(template: &str) -> Result<(), String> {
    if template.trim().is_empty() {
        return Err(format!("{template:?} is blank: every event enqueued without a stream would go to that one key"));
    }
    if template.len() > 512 {
        return Err(format!("it is {} bytes long, and a stream key may be at most 512", template.len()));
    }
    Ok(())
}

/// Substitutes `{aggregate_type}` and `{event_type}` in `template`, in one pass, so that a value
/// that itself contains a placeholder is inserted verbatim and never expanded again. Any other
/// text, braces included, is kept as written.
pub fn render_stream_template(template: &str, aggregate_type: &str, event_type: &str) -> String {
    const AGGREGATE_TYPE: &str = "{aggregate_type}";
    const EVENT_TYPE: &str = "{event_type}";
    let mut out = String::with_capacity(template.len() + aggregate_type.len() + event_type.len());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let tail = &rest[open..];
        if let Some(after) = tail.strip_prefix(AGGREGATE_TYPE) {
            out.push_str(aggregate_type);
            rest = after;
        } else if let Some(after) = tail.strip_prefix(EVENT_TYPE) {
            out.push_str(event_type);
            rest = after;
        } else {
            out.push('{');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

impl OutboxEvent {
    /// The stream key this event goes to: its own `stream`, or the rendered template.
    pub fn stream_key(&self, template: &str) -> String {
        match &self.stream {
            Some(stream) => stream.clone(),
            None => render_stream_template(template, &self.aggregate_type, &self.event_type),
        }
    }

    /// About how many bytes this event takes on the wire to Redis (its fields and their names,
    /// not the stream key or the protocol's framing): what a batch's size budget counts.
    pub fn approximate_size(&self) -> usize {
        // Field names, ids, sequence number, timestamp; in CloudEvents also the constant attributes
        // and the source.
        const FIXED: usize = 300;
        FIXED
            + self.aggregate_type.len()
            + self.aggregate_id.len()
            + self.event_type.len()
            + self.payload.len()
            + self.headers.as_ref().map_or(0, String::len)
            + self
                .trace
                .as_ref()
                .map_or(0, |trace| trace.traceparent.len() + trace.tracestate.as_ref().map_or(0, String::len))
            + self.stream.as_ref().map_or(0, String::len)
    }

    /// The longest single argument this event's XADD carries, and which field it is: Redis refuses
    /// an argument longer than its `proto-max-bulk-len`, and does so by closing the connection.
    pub fn largest_argument(&self) -> (&'static str, usize) {
        [
            ("payload", self.payload.len()),
            ("headers", self.headers.as_ref().map_or(0, String::len)),
            ("aggregate_id", self.aggregate_id.len()),
            ("stream", self.stream.as_ref().map_or(0, String::len)),
            ("aggregate_type", self.aggregate_type.len()),
            ("event_type", self.event_type.len()),
        ]
        .into_iter()
        .max_by_key(|(_, len)| *len)
        .unwrap_or(("payload", 0))
    }

    /// Calls `field` with each of the entry's field/value pairs in `format`, in the order
    /// outbox_protocol's `entry` lists them, borrowed from the event (the numbers are formatted on
    /// the stack): a round encodes thousands of them, and an allocation per field was most of the
    /// relay's own work. The optional fields (headers, trace context, replay) are present only when
    /// the event has them.
    pub fn for_each_field(&self, format: &EntryFormat, mut field: impl FnMut(&'static str, &str)) {
        let mut number = NumberText::default();
        let traceparent = self.trace.as_ref().map(|trace| trace.traceparent.as_str());
        let tracestate = self.trace.as_ref().and_then(|trace| trace.tracestate.as_deref());
        match format {
            EntryFormat::Native => {
                field(fields::EVENT_ID, &self.event_id);
                field(fields::OUTBOX_ID, number.format(self.id));
                field(fields::AGGREGATE_TYPE, &self.aggregate_type);
                field(fields::AGGREGATE_ID, &self.aggregate_id);
                field(fields::AGGREGATE_SEQ, number.format(self.aggregate_seq));
                field(fields::EVENT_TYPE, &self.event_type);
                field(fields::PAYLOAD, &self.payload);
                self.optional_fields(&mut field, None, traceparent, tracestate);
                field(fields::CREATED_AT, &self.created_at);
                if let Some(replay) = self.replay {
                    field(fields::REPLAY, number.format(replay));
                }
            }
            EntryFormat::CloudEvents { source_template, database } => {
                let source = render_source(source_template, database, &self.aggregate_type, &self.event_type);
                field(ce::SPECVERSION, ce::SPECVERSION_VALUE);
                field(ce::ID, &self.event_id);
                field(ce::SOURCE, &source);
                field(ce::TYPE, &self.event_type);
                field(ce::SUBJECT, &self.aggregate_id);
                field(ce::TIME, &self.created_at);
                field(ce::DATACONTENTTYPE, ce::DATACONTENTTYPE_VALUE);
                field(ce::DATA, &self.payload);
                field(ce::AGGREGATETYPE, &self.aggregate_type);
                field(ce::AGGREGATESEQ, number.format(self.aggregate_seq));
                field(ce::OUTBOXID, number.format(self.id));
                self.optional_fields(&mut field, self.replay, traceparent, tracestate);
            }
        }
    }

    /// `headers`, `traceparent`, `tracestate` (and `replay` when given), those the event has.
    fn optional_fields(
        &self,
        field: &mut impl FnMut(&'static str, &str),
        replay: Option<i64>,
        traceparent: Option<&str>,
        tracestate: Option<&str>,
    ) {
        if let Some(headers) = &self.headers {
            field(fields::HEADERS, headers);
        }
        if let Some(traceparent) = traceparent {
            field(fields::TRACEPARENT, traceparent);
        }
        if let Some(tracestate) = tracestate {
            field(fields::TRACESTATE, tracestate);
        }
        if let Some(replay) = replay {
            field(fields::REPLAY, NumberText::default().format(replay));
        }
    }

    /// How many fields `for_each_field` gives.
    pub fn field_count(&self, format: &EntryFormat) -> usize {
        let required = match format {
            EntryFormat::Native => 8,
            EntryFormat::CloudEvents { .. } => 11,
        };
        let trace = self.trace.as_ref().map_or(0, |trace| 1 + usize::from(trace.tracestate.is_some()));
        required + usize::from(self.headers.is_some()) + trace + usize::from(self.replay.is_some())
    }

    /// The entry's fields as owned pairs, for the tests (the relay uses `for_each_field`).
    #[cfg(test)]
    pub fn fields(&self, format: &EntryFormat) -> Vec<(&'static str, String)> {
        let mut fields = Vec::with_capacity(self.field_count(format));
        self.for_each_field(format, |name, value| fields.push((name, value.to_string())));
        fields
    }
}

/// A stack buffer for an `i64`'s decimal text: the entries' numbers, and the lengths and counts
/// of the RESP the sink writes (sink/src/node.rs).
#[derive(Default)]
pub struct NumberText {
    bytes: [u8; 20],
}

impl NumberText {
    pub fn format(&mut self, value: i64) -> &str {
        let negative = value < 0;
        let mut magnitude = value.unsigned_abs();
        let mut at = self.bytes.len();
        loop {
            at -= 1;
            self.bytes[at] = b'0' + (magnitude % 10) as u8;
            magnitude /= 10;
            if magnitude == 0 {
                break;
            }
        }
        if negative {
            at -= 1;
            self.bytes[at] = b'-';
        }
        // Only ASCII digits and '-' were written.
        std::str::from_utf8(&self.bytes[at..]).unwrap_or("0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> OutboxEvent {
        OutboxEvent {
            id: 7,
            event_id: "0190a5b2-0000-7000-8000-000000000000".into(),
            aggregate_type: "payment".into(),
            aggregate_id: "42".into(),
            aggregate_seq: 3,
            event_type: "payment.created".into(),
            payload: r#"{"amount": 100}"#.into(),
            headers: None,
            trace: None,
            stream: None,
            created_at: "2026-11-29T20:00:00.123456Z".into(),
            replay: None,
        }
    }

    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn cloudevents() -> EntryFormat {
        EntryFormat::CloudEvents {
            source_template: "/outbox/{database}/{aggregate_type}".into(),
            database: "app".into(),
        }
    }

    /// The event with every optional field: headers carrying a trace context, and a replay.
    fn full_event() -> OutboxEvent {
        let headers = format!(r#"{{"tenant": "t1", "traceparent": "{TRACEPARENT}", "tracestate": "rojo=1"}}"#);
        OutboxEvent {
            trace: TraceContext::from_headers(Some(&headers)),
            headers: Some(headers),
            replay: Some(9),
            ..event()
        }
    }

    fn names(fields: &[(&'static str, String)]) -> Vec<&'static str> {
        fields.iter().map(|(name, _)| *name).collect()
    }

    /// What the relay writes is what outbox_protocol lists for each format, in its order: every
    /// field for an event that has every optional one, the required ones for an event with none.
    #[test]
    fn entries_have_the_fields_the_protocol_lists_in_its_order() {
        use outbox_protocol::entry::Format;
        for (format, protocol) in [(EntryFormat::Native, Format::Native), (cloudevents(), Format::CloudEvents)] {
            let every: Vec<&str> = protocol.fields().iter().map(|field| field.name).collect();
            let required: Vec<&str> = protocol.fields().iter().filter(|f| f.required).map(|f| f.name).collect();
            let full = full_event();
            assert_eq!(names(&full.fields(&format)), every, "{format:?}");
            assert_eq!(full.fields(&format).len(), full.field_count(&format));
            assert_eq!(names(&event().fields(&format)), required, "{format:?}");
            assert_eq!(event().fields(&format).len(), event().field_count(&format));
        }
    }

    #[test]
    fn a_cloudevent_carries_the_events_values_in_its_attributes() {
        let fields = full_event().fields(&cloudevents());
        let get = |name: &str| fields.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str());
        assert_eq!(get("specversion"), Some("1.0"));
        assert_eq!(get("id"), Some("0190a5b2-0000-7000-8000-000000000000"));
        assert_eq!(get("source"), Some("/outbox/app/payment"));
        assert_eq!(get("type"), Some("payment.created"));
        assert_eq!(get("subject"), Some("42"));
        assert_eq!(get("time"), Some("2026-11-29T20:00:00.123456Z"));
        assert_eq!(get("datacontenttype"), Some("application/json"));
        assert_eq!(get("data"), Some(r#"{"amount": 100}"#));
        assert_eq!(get("aggregatetype"), Some("payment"));
        assert_eq!(get("aggregateseq"), Some("3"));
        assert_eq!(get("outboxid"), Some("7"));
        assert_eq!(get("traceparent"), Some(TRACEPARENT));
        assert_eq!(get("tracestate"), Some("rojo=1"));
        assert_eq!(get("replay"), Some("9"));
        assert!(get("headers").is_some_and(|headers| headers.contains("tenant")));
    }

    #[test]
    fn the_trace_context_is_read_from_valid_headers_only() {
        let trace = |headers: &str| TraceContext::from_headers(Some(headers));
        assert_eq!(trace(r#"{"a": 1}"#), None);
        assert_eq!(TraceContext::from_headers(None), None);
        assert_eq!(
            trace(&format!(r#"{{"traceparent": "{TRACEPARENT}"}}"#)),
            Some(TraceContext { traceparent: TRACEPARENT.into(), tracestate: None })
        );
        assert_eq!(
            trace(&format!(r#"{{"traceparent": "{TRACEPARENT}", "tracestate": ""}}"#)),
            Some(TraceContext { traceparent: TRACEPARENT.into(), tracestate: None })
        );
        // What an older version let into the headers: a bad traceparent is no trace context, a bad
        // tracestate is left out.
        assert_eq!(trace(r#"{"traceparent": "00-x-y-01", "tracestate": "a=1"}"#), None);
        assert_eq!(trace(r#"{"traceparent": 7}"#), None);
        assert_eq!(trace(r#"{"nested": {"traceparent": "x"}}"#), None);
        assert_eq!(
            trace(&format!(r#"{{"traceparent": "{TRACEPARENT}", "tracestate": "Bad=1"}}"#)),
            Some(TraceContext { traceparent: TRACEPARENT.into(), tracestate: None })
        );
    }

    #[test]
    fn the_source_is_rendered_as_a_uri_reference() {
        assert_eq!(render_source("/outbox/{database}/{aggregate_type}", "app", "payment", "e"), "/outbox/app/payment");
        assert_eq!(render_source("urn:{event_type}", "d", "a", "payment.created"), "urn:payment.created");
        assert_eq!(render_source("/{database}/{x}", "my db/é", "a", "e"), "/my%20db%2F%C3%A9/{x}");
        // A value holding a placeholder is not expanded again.
        assert_eq!(render_source("/{aggregate_type}", "d", "{database}", "e"), "/%7Bdatabase%7D");
    }

    /// Issue 35, 9: each value is encoded for the part of the URI it stands in, so a query parser
    /// reads in the query exactly the pairs the template wrote, whatever the value holds.
    #[test]
    fn placeholders_are_encoded_for_the_part_they_stand_in() {
        let tricky = "acc.q&a=1 #ü?/x+y;z:w@v";
        let source = render_source(
            "https://events.example.com/{database}/{aggregate_type}?type={event_type}&v=1",
            "acc",
            tricky,
            tricky,
        );
        assert_eq!(
            source,
            "https://events.example.com/acc/acc.q&a=1%20%23%C3%BC%3F%2Fx+y;z:w@v\
             ?type=acc.q%26a%3D1%20%23%C3%BC%3F%2Fx%2By%3Bz:w@v&v=1"
        );
        let (_, query) = source.split_once('?').unwrap();
        let pairs: Vec<(&str, &str)> =
            query.split(['&', ';']).map(|pair| pair.split_once('=').unwrap_or((pair, ""))).collect();
        assert_eq!(pairs, [("type", "acc.q%26a%3D1%20%23%C3%BC%3F%2Fx%2By%3Bz:w@v"), ("v", "1")]);
        assert!(!pairs[0].1.contains('+'), "a + in a query reads as a blank");
        // The fragment, even after a '?' of its own.
        assert_eq!(
            render_source("/x#{event_type}", "d", "a", tricky),
            "/x#acc.q%26a%3D1%20%23%C3%BC%3F%2Fx%2By%3Bz:w@v"
        );
        assert_eq!(render_source("/x#f?t={event_type}", "d", "a", "a=b&c"), "/x#f?t=a%3Db%26c");
        // A path segment keeps the sub-delimiters, ':' and '@' (RFC 3986, 3.3)...
        assert_eq!(render_source("/p/{event_type}", "d", "a", "a=b&c+d;e:f@g"), "/p/a=b&c+d;e:f@g");
        assert_eq!(render_source("urn:{event_type}", "d", "a", "x:y"), "urn:x:y");
        // ...but not the first segment of a relative reference, where ':' would make a scheme.
        assert_eq!(render_source("{database}/x", "a:b", "a", "e"), "a%3Ab/x");
        assert_eq!(render_source("x/{database}", "a:b", "a", "e"), "x/a:b");
        // The authority: ':' and '@' would make a port or user information.
        assert_eq!(
            render_source("https://{database}.example.com/e", "a:b@c", "a", "e"),
            "https://a%3Ab%40c.example.com/e"
        );
        assert_eq!(render_source("//{database}/{database}", "a:b", "a", "e"), "//a%3Ab/a:b");
        // Every rendering is a URI reference, whatever the values.
        for template in [
            "https://events.example.com/{database}/{aggregate_type}?type={event_type}&v=1",
            "{database}/{aggregate_type}#{event_type}",
            "//{database}:80/{aggregate_type}?{event_type}",
            "urn:{database}",
        ] {
            let rendered = render_source(template, tricky, "\"<>\\^|`{}%", tricky);
            assert_eq!(check_uri_reference(&rendered), Ok(()), "{rendered}");
        }
        // No value can be encoded in a scheme.
        let error = check_source_template("{database}:x").unwrap_err();
        assert!(error.contains("scheme") && error.contains("{database}"), "{error}");
    }

    #[test]
    fn source_templates_are_checked() {
        assert_eq!(check_source_template("/outbox/{database}/{aggregate_type}"), Ok(()));
        assert_eq!(check_source_template("https://example.com/orders/{event_type}"), Ok(()));
        assert!(check_source_template("").unwrap_err().contains("empty"));
        assert!(check_source_template("/a b").unwrap_err().contains("' '"));
        let error = check_source_template("/outbox/{tenant}/x").unwrap_err();
        assert!(error.contains("\"{tenant}\" is not one of its placeholders ({database}"), "{error}");
        assert!(check_source_template("/outbox/}").is_err());
        // Review of issue 28, 11: URI references only, as RFC 3986 defines them.
        for good in [
            "urn:x:{database}/{aggregate_type}/{event_type}?q=%2F#frag",
            "https://user@example.com:8080/a/{database}?x=1&y=/z#f",
            "//example.com/{aggregate_type}",
            "relative/{event_type}",
            "https://[::1]:80/x",
            "/a%20b",
        ] {
            assert_eq!(check_source_template(good), Ok(()), "{good}");
        }
        for (bad, named) in [
            ("urn:x:{database}/{aggregate_type}/{event_type}?q=%zz#\"<>", "%zz"),
            ("/a\"b", "'\"'"),
            ("/a<b", "'<'"),
            ("/a>b", "'>'"),
            ("/a%2", "%2"),
            ("/a%", "%"),
            ("/é", "'é'"),
            ("/a^b", "'^'"),
            ("/a|b", "'|'"),
            ("/a#b#c", "'#'"),
            ("1x:/a", "\"1x\""),
            ("a\\b", "'\\\\'"),
        ] {
            let error = check_source_template(bad).unwrap_err();
            assert!(error.contains(named) && error.contains("URI reference"), "{bad}: {error}");
            assert!(error.contains(&format!("{bad:?}")), "names the value: {error}");
        }
    }

    #[test]
    fn template_substitutes_both_placeholders() {
        assert_eq!(
            render_stream_template("app:{aggregate_type}:{event_type}", "payment", "payment.created"),
            "app:payment:payment.created"
        );
    }

    #[test]
    fn template_keeps_unknown_braces_and_does_not_reexpand_values() {
        assert_eq!(render_stream_template("{x}{aggregate_type}{", "{event_type}", "e"), "{x}{event_type}{");
        assert_eq!(render_stream_template("plain", "a", "e"), "plain");
        assert_eq!(render_stream_template("", "a", "e"), "");
        assert_eq!(render_stream_template("{{aggregate_type}}", "a", "e"), "{a}");
    }

    #[test]
    fn stream_key_prefers_the_events_own_stream() {
        let mut e = event();
        assert_eq!(e.stream_key("outbox:{aggregate_type}"), "outbox:payment");
        e.stream = Some("custom".into());
        assert_eq!(e.stream_key("outbox:{aggregate_type}"), "custom");
    }

    #[test]
    fn numbers_are_written_as_rust_formats_them() {
        let mut text = NumberText::default();
        for value in [0, 7, -1, 42, i64::MAX, i64::MIN, 1_000_000] {
            assert_eq!(text.format(value), value.to_string());
        }
    }

    #[test]
    fn fields_include_headers_only_when_present() {
        let mut e = event();
        let names: Vec<_> = e.fields(&EntryFormat::Native).iter().map(|(k, _)| *k).collect();
        assert_eq!(
            names,
            [
                "event_id",
                "outbox_id",
                "aggregate_type",
                "aggregate_id",
                "aggregate_seq",
                "event_type",
                "payload",
                "created_at"
            ]
        );
        e.headers = Some(r#"{"trace":"t"}"#.into());
        let fields = e.fields(&EntryFormat::Native);
        assert!(fields.contains(&("headers", r#"{"trace":"t"}"#.into())));
        assert!(fields.contains(&("outbox_id", "7".into())));
        assert!(fields.contains(&("aggregate_seq", "3".into())));
    }

    /// A reference implementation written differently (token scan by index) to compare against.
    fn reference_render(template: &str, aggregate_type: &str, event_type: &str) -> String {
        let mut out = String::new();
        let mut i = 0;
        while i < template.len() {
            let rest = &template[i..];
            if rest.starts_with("{aggregate_type}") {
                out.push_str(aggregate_type);
                i += "{aggregate_type}".len();
            } else if rest.starts_with("{event_type}") {
                out.push_str(event_type);
                i += "{event_type}".len();
            } else {
                let c = rest.chars().next().unwrap();
                out.push(c);
                i += c.len_utf8();
            }
        }
        out
    }

    fn text_with_placeholders() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        proptest::collection::vec(
            prop_oneof![
                Just("{aggregate_type}".to_string()),
                Just("{event_type}".to_string()),
                Just("{".to_string()),
                Just("}".to_string()),
                Just("{aggregate_type".to_string()),
                any::<String>(),
            ],
            0..8,
        )
        .prop_map(|parts| parts.concat())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 2000, ..Default::default() })]

        /// Fuzzes the template substitution: never panics on any UTF-8, matches the reference,
        /// and inserts values verbatim (a value holding a placeholder is not expanded again).
        #[test]
        fn template_rendering_matches_the_reference(
            template in text_with_placeholders(),
            aggregate_type in text_with_placeholders(),
            event_type in text_with_placeholders(),
        ) {
            let rendered = render_stream_template(&template, &aggregate_type, &event_type);
            proptest::prop_assert_eq!(&rendered, &reference_render(&template, &aggregate_type, &event_type));
            if !template.contains('{') {
                proptest::prop_assert_eq!(rendered, template);
            }
        }

        /// Fuzzes the row-to-entry conversion: every event yields the fixed field list, values
        /// unchanged, `headers` exactly when present, and an explicit stream wins over the template.
        #[test]
        fn entries_carry_every_field_verbatim(
            id in proptest::prelude::any::<i64>(),
            seq in 1i64..,
            aggregate_type in text_with_placeholders(),
            aggregate_id in proptest::prelude::any::<String>(),
            payload in proptest::prelude::any::<String>(),
            headers in proptest::option::of(proptest::prelude::any::<String>()),
            stream in proptest::option::of(proptest::prelude::any::<String>()),
        ) {
            let event = OutboxEvent {
                id,
                event_id: "e".into(),
                aggregate_type: aggregate_type.clone(),
                aggregate_id: aggregate_id.clone(),
                aggregate_seq: seq,
                event_type: "t".into(),
                payload: payload.clone(),
                headers: headers.clone(),
                trace: None,
                stream: stream.clone(),
                created_at: "c".into(),
                replay: None,
            };
            let fields = event.fields(&EntryFormat::Native);
            let get = |name: &str| fields.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string());
            proptest::prop_assert_eq!(fields.len(), if headers.is_some() { 9 } else { 8 });
            proptest::prop_assert_eq!(get("outbox_id"), Some(id.to_string()));
            proptest::prop_assert_eq!(get("aggregate_seq"), Some(seq.to_string()));
            proptest::prop_assert_eq!(get("aggregate_id"), Some(aggregate_id));
            proptest::prop_assert_eq!(get("payload"), Some(payload));
            proptest::prop_assert_eq!(get("headers"), headers);
            let key = event.stream_key("s:{aggregate_type}");
            match stream {
                Some(explicit) => proptest::prop_assert_eq!(key, explicit),
                None => proptest::prop_assert_eq!(key, format!("s:{aggregate_type}")),
            }
        }
    }

    #[test]
    fn a_blank_or_overlong_stream_template_is_refused_and_hash_tags_are_kept() {
        for good in ["outbox:{aggregate_type}", "{payments}:{event_type}", "x"] {
            assert_eq!(check_stream_template(good), Ok(()), "{good}");
        }
        for bad in ["", "  ", "\t"] {
            assert!(check_stream_template(bad).unwrap_err().contains("is blank"), "{bad:?}");
        }
        assert!(check_stream_template(&"s".repeat(513)).unwrap_err().contains("513 bytes"));
    }
}
