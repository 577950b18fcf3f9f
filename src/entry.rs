//! How a claimed outbox row becomes a Redis stream entry: its stream key and its fields.
//! Pure functions, so that they are unit-tested and fuzzed without PostgreSQL or Redis.

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
    /// The stream given at enqueue, if any; otherwise the template decides.
    pub stream: Option<String>,
    /// RFC 3339 with microseconds, UTC.
    pub created_at: String,
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

    /// The entry's field/value pairs, in a fixed order. `headers` is present only when the event
    /// has headers.
    /// About how many bytes this event takes on the wire to Redis (its fields and their names,
    /// not the stream key or the protocol's framing): what a batch's size budget counts.
    pub fn approximate_size(&self) -> usize {
        const FIXED: usize = 200; // field names, ids, sequence number, timestamp
        FIXED
            + self.aggregate_type.len()
            + self.aggregate_id.len()
            + self.event_type.len()
            + self.payload.len()
            + self.headers.as_ref().map_or(0, String::len)
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

    /// Calls `field` with each of the entry's field/value pairs, in a fixed order, borrowed from
    /// the event (the numbers are formatted on the stack): a round encodes thousands of them, and
    /// an allocation per field was most of the relay's own work. `headers` is present only when
    /// the event has headers.
    pub fn for_each_field(&self, mut field: impl FnMut(&'static str, &str)) {
        let mut number = NumberText::default();
        field("event_id", &self.event_id);
        field("outbox_id", number.format(self.id));
        field("aggregate_type", &self.aggregate_type);
        field("aggregate_id", &self.aggregate_id);
        field("aggregate_seq", number.format(self.aggregate_seq));
        field("event_type", &self.event_type);
        field("payload", &self.payload);
        if let Some(headers) = &self.headers {
            field("headers", headers);
        }
        field("created_at", &self.created_at);
    }

    /// How many fields `for_each_field` gives.
    pub fn field_count(&self) -> usize {
        if self.headers.is_some() {
            9
        } else {
            8
        }
    }

    /// The entry's fields as owned pairs, for the tests (the relay uses `for_each_field`).
    #[cfg(test)]
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        let mut fields = Vec::with_capacity(self.field_count());
        self.for_each_field(|name, value| fields.push((name, value.to_string())));
        fields
    }
}

/// A stack buffer for an `i64`'s decimal text: the entries' numbers, and the lengths and counts
/// of the RESP the sink writes (src/sink/node.rs).
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
            stream: None,
            created_at: "2026-11-29T20:00:00.123456Z".into(),
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
        let names: Vec<_> = e.fields().iter().map(|(k, _)| *k).collect();
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
        let fields = e.fields();
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
                stream: stream.clone(),
                created_at: "c".into(),
            };
            let fields = event.fields();
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
}
