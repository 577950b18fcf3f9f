//! Stream entries as a real relay writes them into a real redis-server, in both entry formats
//! (issue 28): each entry has exactly the fields outbox_protocol lists for its format, in that
//! order, the optional ones when the event has them; the consumer crate reads every entry back as
//! the event that was enqueued, with the trace context the enqueuing transaction ran in.

mod common;

use std::collections::HashMap;

use common::{wait_for, Env, Redis, DEADLINE};
use outbox_consumer::Event;
use outbox_protocol::entry::Format;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const OTHER_TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";

/// An entry as XRANGE returns it: its ID and its fields in the order they were written.
type Entry = (String, Vec<(String, String)>);

fn entries(redis: &Redis, stream: &str) -> Vec<Entry> {
    redis.query(redis::cmd("XRANGE").arg(stream).arg("-").arg("+"))
}

fn wait_for_entries(redis: &Redis, stream: &str, count: usize) -> Vec<Entry> {
    wait_for(DEADLINE, &format!("{count} entries in {stream}"), || {
        let found = entries(redis, stream);
        (found.len() >= count).then_some(found)
    })
}

/// Checks that `entry` has the fields of `format` the protocol lists, in its order: every
/// required one, and of the optional ones exactly `optional`.
fn assert_protocol_fields(entry: &Entry, format: Format, optional: &[&str]) {
    let expected: Vec<&str> = format
        .fields()
        .iter()
        .filter(|field| field.required || optional.contains(&field.name))
        .map(|field| field.name)
        .collect();
    let written: Vec<&str> = entry.1.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(written, expected, "{format:?} entry {}", entry.0);
}

/// The entry read as the consumer crate reads it.
fn event(stream: &str, entry: &Entry) -> Event {
    Event::from_fields(stream, &entry.0, entry.1.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())))
        .unwrap_or_else(|e| panic!("entry {} is malformed: {e}", entry.0))
}

/// Three events: a trace context in the headers; one from the transaction's settings; none.
/// Returns their event ids.
fn enqueue_three(client: &mut postgres::Client) -> [String; 3] {
    let enqueue = |client: &mut postgres::Client, id: &str, headers: Option<&str>| -> String {
        client
            .query_one(
                "SELECT outbox_enqueue('payment', $1, 'payment.created', '{\"amount\": \"12.34\"}', $2::text::jsonb)::text",
                &[&id, &headers],
            )
            .unwrap()
            .get(0)
    };
    let in_headers =
        format!(r#"{{"traceparent": "{TRACEPARENT}", "tracestate": "rojo=00f067aa0ba902b7", "tenant": "t1"}}"#);
    let first = enqueue(client, "p-1", Some(&in_headers));
    let mut txn = client.transaction().unwrap();
    txn.batch_execute(&format!("SET LOCAL outbox.traceparent = '{OTHER_TRACEPARENT}'")).unwrap();
    let second =
        txn.query_one("SELECT outbox_enqueue('payment', 'p-2', 'payment.created', '{}')::text", &[]).unwrap().get(0);
    txn.commit().unwrap();
    let third = enqueue(client, "p-1", None);
    [first, second, third]
}

#[test]
fn native_entries_carry_the_trace_context_as_fields_of_their_own() {
    let env = Env::start(&["outbox.poll_interval = '200ms'"]);
    let mut client = env.pg.connect();
    let ids = enqueue_three(&mut client);
    let found = wait_for_entries(&env.redis, "outbox:payment", 3);

    assert_protocol_fields(&found[0], Format::Native, &["headers", "traceparent", "tracestate"]);
    assert_protocol_fields(&found[1], Format::Native, &["headers", "traceparent"]);
    assert_protocol_fields(&found[2], Format::Native, &[]);
    let events: Vec<Event> = found.iter().map(|entry| event("outbox:payment", entry)).collect();
    assert_eq!(events.iter().map(|e| e.event_id.clone()).collect::<Vec<_>>(), ids);
    assert_eq!(events[0].traceparent.as_deref(), Some(TRACEPARENT));
    assert_eq!(events[0].tracestate.as_deref(), Some("rojo=00f067aa0ba902b7"));
    assert_eq!(events[0].headers.as_ref().unwrap()["tenant"], "t1");
    assert_eq!(events[1].traceparent.as_deref(), Some(OTHER_TRACEPARENT));
    assert_eq!(events[1].tracestate, None);
    // The settings' trace context is kept in the headers too, under the same key.
    assert_eq!(events[1].headers.as_ref().unwrap()["traceparent"], OTHER_TRACEPARENT);
    assert_eq!((events[2].traceparent.as_deref(), events[2].headers.as_ref()), (None, None));
    assert_eq!(events.iter().map(|e| e.aggregate_seq).collect::<Vec<_>>(), [1, 1, 2]);
    assert!(events.iter().all(|e| e.source.is_none()));
}

/// `outbox.entry_format = cloudevents` set for one database (ALTER DATABASE, then a reload): its
/// relays restart and write CloudEvents, whose attributes carry the same events; a replay's entry
/// carries `replay` too. The consumer crate reads the stream, which then holds both formats.
#[test]
fn cloudevents_entries_carry_the_same_events_as_attributes() {
    let env = Env::start(&["outbox.poll_interval = '200ms'"]);
    let mut client = env.pg.connect();
    client.execute("SELECT outbox_enqueue('payment', 'p-0', 'payment.created', '{}')", &[]).unwrap();
    wait_for_entries(&env.redis, "outbox:payment", 1);

    client
        .batch_execute(
            "ALTER DATABASE postgres SET outbox.entry_format = 'cloudevents';
             ALTER DATABASE postgres SET outbox.cloudevents_source = 'https://example.com/{database}/{aggregate_type}';
             SELECT pg_reload_conf();",
        )
        .unwrap();
    let log_line = "the settings of database \"postgres\" changed";
    wait_for(DEADLINE, "the relay to restart with the database's settings", || {
        env.pg.log().contains(log_line).then_some(())
    });
    let ids = enqueue_three(&mut client);
    let found = wait_for_entries(&env.redis, "outbox:payment", 4);
    let found = &found[1..];
    assert_protocol_fields(&found[0], Format::CloudEvents, &["headers", "traceparent", "tracestate"]);
    assert_protocol_fields(&found[1], Format::CloudEvents, &["headers", "traceparent"]);
    assert_protocol_fields(&found[2], Format::CloudEvents, &[]);
    let fields: HashMap<&str, &str> = found[0].1.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let created_at: String = client
        .query_one(
            "SELECT to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') FROM outbox.messages
              WHERE event_id = $1::text::uuid",
            &[&ids[0]],
        )
        .unwrap()
        .get(0);
    for (attribute, value) in [
        ("specversion", "1.0"),
        ("id", ids[0].as_str()),
        ("source", "https://example.com/postgres/payment"),
        ("type", "payment.created"),
        ("subject", "p-1"),
        ("time", created_at.as_str()),
        ("datacontenttype", "application/json"),
        ("data", r#"{"amount": "12.34"}"#),
        ("aggregatetype", "payment"),
        ("aggregateseq", "1"),
        ("traceparent", TRACEPARENT),
        ("tracestate", "rojo=00f067aa0ba902b7"),
    ] {
        assert_eq!(fields.get(attribute).copied(), Some(value), "attribute {attribute}");
    }
    let events: Vec<Event> = found.iter().map(|entry| event("outbox:payment", entry)).collect();
    assert_eq!(events.iter().map(|e| e.event_id.clone()).collect::<Vec<_>>(), ids);
    assert_eq!(events[1].traceparent.as_deref(), Some(OTHER_TRACEPARENT));
    assert_eq!(events[0].source.as_deref(), Some("https://example.com/postgres/payment"));

    // A replay of the first CloudEvent's event is a CloudEvent with `replay`.
    let replay: i64 = client
        .query_one(
            "SELECT outbox.replay(since => created_at, event_ids => ARRAY[event_id], to_stream => 'history:payment')
               FROM outbox.messages WHERE event_id = $1::text::uuid",
            &[&ids[0]],
        )
        .unwrap()
        .get(0);
    let replayed = wait_for_entries(&env.redis, "history:payment", 1);
    assert_protocol_fields(&replayed[0], Format::CloudEvents, &["headers", "traceparent", "tracestate", "replay"]);
    let again = event("history:payment", &replayed[0]);
    assert_eq!((again.event_id.as_str(), again.replay, again.aggregate_seq), (ids[0].as_str(), Some(replay), 1));

    // Back to native: the stream holds both formats, and the consumer reads both.
    client.batch_execute("ALTER DATABASE postgres RESET outbox.entry_format; SELECT pg_reload_conf();").unwrap();
    wait_for(DEADLINE, "the relay to restart again", || (env.pg.log().matches(log_line).count() >= 2).then_some(()));
    client.execute("SELECT outbox_enqueue('payment', 'p-9', 'payment.created', '{}')", &[]).unwrap();
    let found = wait_for_entries(&env.redis, "outbox:payment", 5);
    let formats: Vec<Format> =
        found.iter().map(|entry| Format::of(entry.1.iter().map(|(name, _)| name.as_bytes()))).collect();
    use Format::{CloudEvents, Native};
    assert_eq!(formats, [Native, CloudEvents, CloudEvents, CloudEvents, Native]);
    let seqs: Vec<(String, i64)> =
        found.iter().map(|entry| event("outbox:payment", entry)).map(|e| (e.aggregate_id, e.aggregate_seq)).collect();
    assert_eq!(seqs.iter().filter(|(id, _)| id == "p-1").map(|(_, seq)| *seq).collect::<Vec<_>>(), [1, 2]);
}
