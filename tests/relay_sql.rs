//! The round's reads in SQL, for the relay outside the server (src/sql/relay/read.sql), against
//! the in-server relay's Rust reads they stand for: `outbox._read_window` against
//! src/log/window.rs's `read_shard` (through `tests.read_window`), `outbox._last_seqs` against
//! src/log/counters.rs's `last_seqs` (through `tests.counters`), on logs of every shape a window
//! takes: one transaction, many, one running when the cursor was taken, rolled back ones, one
//! larger than a round, large payloads, one written into two log tables; read whole and in parts
//! with every kind of allowance, each round resuming from the position the previous one returned;
//! `outbox._read_windows` against one `_read_window` per shard.

mod common;

use common::Env;

/// A row of `outbox._read_window` with its created_at as outbox-relay writes it (and as
/// `tests.read_window` gives it): a timestamptz there, a text here.
const AS_TEXT: &str = "(to_jsonb(r) || jsonb_build_object('created_at', CASE WHEN r.complete IS NULL THEN \
                       coalesce(to_char(r.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), '') END))::text";

/// One shard's window read both ways, round after round from the position each returned, with
/// the allowance `(max_events, max_bytes, taken)` per round: the same rows every round. Returns
/// how many rounds it took.
fn same_rounds(
    client: &mut postgres::Client,
    shard: i16,
    cursor: &str,
    upto: &str,
    allowance: (i32, i64, i32),
) -> usize {
    let (max_events, max_bytes, mut taken) = allowance;
    // The SQL read gives created_at as a timestamptz, which outbox-relay writes as the worker writes
    // it (round/src/time.rs, tested against to_char): compared in that text (AS_TEXT).
    let read =
        |client: &mut postgres::Client, function: &str, from: (Option<i64>, Option<i64>), taken: i32| -> Vec<String> {
            client
                .query(
                    &format!(
                        "SELECT {} FROM {function}($1, $2, $3, $4, $5, $6, $7, $8) r",
                        if function == "outbox._read_window" { AS_TEXT } else { "to_jsonb(r)::text" }
                    ),
                    &[&shard, &cursor, &upto, &from.0, &from.1, &max_events, &max_bytes, &taken],
                )
                .unwrap_or_else(|e| panic!("{function}: {e}"))
                .iter()
                .map(|row| row.get(0))
                .collect()
        };
    let mut from = (None, None);
    for round in 1..=2000 {
        let rust = read(client, "tests.read_window", from, taken);
        let sql = read(client, "outbox._read_window", from, taken);
        assert_eq!(
            sql, rust,
            "shard {shard}, window {cursor} .. {upto}, allowance {allowance:?}, round {round} from {from:?} (taken {taken})"
        );
        let outcome: serde_json::Value = serde_json::from_str(rust.last().unwrap()).unwrap();
        if outcome["complete"] == serde_json::Value::Bool(true) {
            return round;
        }
        let next = (outcome["position_max_id"].as_i64(), outcome["position_last_id"].as_i64());
        if max_events <= 0 || max_bytes <= 0 {
            return round;
        }
        if rust.len() == 1 && next == from {
            // Only a round that took events of other shards first may take none of this one:
            // the next round starts with this shard.
            assert!(taken > 0, "round {round} made no progress: {rust:?}");
            taken = 0;
        }
        from = next;
    }
    panic!("shard {shard}: the window {cursor} .. {upto} took over 2000 rounds");
}

/// Every shard's window between two snapshots, both ways, with allowances from one event to all
/// of them, byte allowances from below one event up, and rounds that took events before.
fn same_windows(client: &mut postgres::Client, cursor: &str, upto: &str) -> (usize, usize) {
    let mut events = 0;
    let mut rounds = 0;
    for shard in 0..16i16 {
        let whole: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox._read_window($1, $2, $3, NULL, NULL, 1000000, 1000000000000, 0) r
                  WHERE r.id IS NOT NULL",
                &[&shard, &cursor, &upto],
            )
            .unwrap()
            .get(0);
        events += whole as usize;
        let n = whole as i32;
        let mut counts = vec![0, 1, 2, 3, 5, 7, 100, 10_000];
        counts.extend([n - 1, n, n + 1].into_iter().filter(|&c| c > 0));
        for max_events in counts {
            for max_bytes in [i64::MAX, 0, 1, 700, 2_000, 5_000, 12_000] {
                for taken in [0, 3] {
                    rounds += same_rounds(client, shard, cursor, upto, (max_events, max_bytes, taken));
                }
            }
        }
    }
    (events, rounds)
}

/// `outbox._read_windows` over every shard, in an order starting at `first`, against one
/// `outbox._read_window` per shard, each given what the shards before it left of the allowance
/// (one event and `size` bytes per event, the bytes never below 0). Returns the events read.
fn same_multi_read(
    client: &mut postgres::Client,
    cursor: &str,
    upto: &str,
    first: i16,
    allowance: (i32, i64),
) -> usize {
    let shards: Vec<i16> = (0..16).map(|n| (first + n) % 16).collect();
    let texts = |text: &str| vec![text.to_string(); shards.len()];
    let nulls: Vec<Option<i64>> = vec![None; shards.len()];
    let (mut events, mut bytes) = allowance;
    let mut taken = 0i32;
    let mut expected = Vec::new();
    for &shard in &shards {
        let rows = client
            .query(
                "SELECT to_jsonb(r)::text FROM outbox._read_window($1, $2, $3, NULL, NULL, $4, $5, $6) r",
                &[&shard, &cursor, &upto, &events, &bytes, &taken],
            )
            .unwrap();
        for row in rows {
            let text: String = row.get(0);
            let json: serde_json::Value = serde_json::from_str(&text).unwrap();
            if json["complete"].is_null() {
                events -= 1;
                bytes = (bytes - json["size"].as_i64().unwrap()).max(0);
                taken += 1;
            }
            expected.push((shard, text));
        }
    }
    let (events, bytes) = allowance;
    let got: Vec<(i16, String)> = client
        .query(
            "SELECT r.shard, (to_jsonb(r) - 'shard')::text FROM outbox._read_windows($1, $2, $3, $4, $5, $6, $7, 0) r",
            &[&shards, &texts(cursor), &texts(upto), &nulls, &nulls, &events, &bytes],
        )
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(got, expected, "window {cursor} .. {upto} from shard {first}, allowance {allowance:?}");
    expected.len() - shards.len()
}

fn snapshot(client: &mut postgres::Client) -> String {
    client.query_one("SELECT pg_current_snapshot()::text", &[]).unwrap().get(0)
}

fn enqueue(client: &mut postgres::Client, aggregate: &str, payload_bytes: i32, headers: Option<&str>) {
    client
        .execute(
            "SELECT outbox_enqueue('order', $1, 'created', jsonb_build_object('pad', repeat('x', $2)), $3::text::jsonb)",
            &[&aggregate, &payload_bytes, &headers],
        )
        .unwrap();
}

const TRACE: &str = r#"{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "rojo=00f067aa0ba902b7", "k": "v"}"#;

#[test]
fn the_sql_window_read_takes_what_the_relay_takes() {
    let env = Env::start(&["outbox.enabled = off"]);
    let mut client = env.pg.connect();
    let mut other = env.pg.connect();
    let start = snapshot(&mut client);

    // One transaction of a few events over a few aggregates (several shards).
    client.batch_execute("BEGIN").unwrap();
    for a in 0..6 {
        enqueue(&mut client, &format!("one-{a}"), 10, if a % 2 == 0 { Some(TRACE) } else { None });
    }
    client.batch_execute("COMMIT").unwrap();
    let after_one = snapshot(&mut client);

    // A transaction that is running when the cursor below is taken (in its in-progress list),
    // and commits before upto: the window finds it through that list.
    other.batch_execute("BEGIN").unwrap();
    for i in 0..4 {
        enqueue(&mut other, &format!("long-{}", i % 2), 50, None);
    }
    let long: i64 = other.query_one("SELECT pg_current_xact_id()::text::bigint", &[]).unwrap().get(0);
    // A later transaction completes first, so that the cursor's xmax is above the running one.
    enqueue(&mut client, "after-long", 1, None);
    let cursor = snapshot(&mut client);
    let listed: bool = client
        .query_one(
            "SELECT $1::text::xid8 IN (SELECT pg_snapshot_xip($2::text::pg_snapshot))",
            &[&long.to_string(), &cursor],
        )
        .unwrap()
        .get(0);
    assert!(listed, "the cursor {cursor} lists the running transaction {long}");

    // Many small transactions over few aggregates, some with large payloads, some rolled back,
    // one rolled back to a savepoint, and one larger than most allowances.
    for t in 0..40 {
        client.batch_execute("BEGIN").unwrap();
        for i in 0..(t % 4 + 1) {
            let payload = if t % 7 == 3 { 3_000 } else { 5 * i };
            enqueue(
                &mut client,
                &format!("many-{}", (t + i) % 5),
                payload,
                if t % 3 == 0 { Some(TRACE) } else { None },
            );
        }
        client.batch_execute(if t % 9 == 4 { "ROLLBACK" } else { "COMMIT" }).unwrap();
    }
    client.batch_execute("BEGIN").unwrap();
    enqueue(&mut client, "saved-0", 1, None);
    client.batch_execute("SAVEPOINT s").unwrap();
    enqueue(&mut client, "saved-1", 1, None);
    enqueue(&mut client, "saved-0", 1, None);
    client.batch_execute("ROLLBACK TO SAVEPOINT s").unwrap();
    enqueue(&mut client, "saved-2", 1, None);
    client.batch_execute("COMMIT").unwrap();
    client.batch_execute("BEGIN").unwrap();
    for i in 0..60 {
        enqueue(&mut client, &format!("big-{}", i % 3), if i % 10 == 0 { 4_000 } else { 20 }, None);
    }
    client.batch_execute("COMMIT").unwrap();

    // A transaction written into two log tables, as one that ran while a generation switched:
    // its first events in events_2, the rest in events_0 (the tables wrap around), in a shard of
    // its own choosing, with large payloads in each part so that byte allowances cut either.
    let shard: i16 = client.query_one("SELECT tests.shard_of('order', 'many-0')", &[]).unwrap().get(0);
    client.batch_execute("BEGIN").unwrap();
    for (table, events) in [("events_2", 5i32), ("events_0", 4)] {
        client
            .execute(
                &format!(
                    "INSERT INTO outbox.{table} (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type,
                                                 payload, headers, stream, created_at)
                     SELECT pg_current_xact_id(), $1, nextval('outbox.events_id_seq'), gen_random_uuid(), 'order',
                            'split-' || (i % 2), 'moved', jsonb_build_object('pad', repeat('y', 900 * (i % 3))),
                            CASE WHEN i % 2 = 0 THEN $2::text::jsonb END, CASE WHEN i = 1 THEN 'custom:stream' END,
                            clock_timestamp()
                       FROM generate_series(1, $3) i"
                ),
                &[&shard, &TRACE, &events],
            )
            .unwrap();
    }
    client.batch_execute("COMMIT").unwrap();

    // A transaction running when upto is taken: not in the window, whatever it wrote.
    let mut late = env.pg.connect();
    late.batch_execute("BEGIN").unwrap();
    enqueue(&mut late, "late", 1, None);
    other.batch_execute("COMMIT").unwrap();
    let upto = snapshot(&mut client);
    late.batch_execute("COMMIT").unwrap();

    let spans: i64 = client
        .query_one(
            "SELECT count(DISTINCT generation) FROM outbox.events
              WHERE txid = (SELECT txid FROM outbox.events_2 WHERE aggregate_id LIKE 'split-%' LIMIT 1)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(spans, 2, "one transaction in two log tables");

    for (cursor, upto) in [(&start, &after_one), (&cursor, &upto), (&start, &upto), (&after_one, &cursor)] {
        let (events, rounds) = same_windows(&mut client, cursor, upto);
        eprintln!("window {cursor} .. {upto}: {events} events, {rounds} rounds read both ways, the same");
        assert!(events > 0 || cursor == &after_one, "the window {cursor} .. {upto} is not empty");
    }
    // Several shards in one statement, each with what the ones before it left.
    for (first, allowance) in
        [(0, (1_000_000, i64::MAX)), (5, (7, i64::MAX)), (11, (100, 5_000)), (3, (0, 1)), (9, (40, 0))]
    {
        let events = same_multi_read(&mut client, &start, &upto, first, allowance);
        assert!(events > 0 || allowance.0 == 0 || allowance.1 == 0, "{allowance:?} read nothing");
    }
    let error = client
        .query("SELECT * FROM outbox._read_windows('{0,1}', '{}', '{}', '{}', '{}', 10, 1000, 0)", &[])
        .unwrap_err();
    assert_eq!(error.code(), Some(&postgres::error::SqlState::INVALID_PARAMETER_VALUE), "{error}");

    // The running transaction's events are in the window from the cursor that listed it.
    let found: i64 = client
        .query_one(
            "SELECT count(*) FROM generate_series(0, 15) s
              CROSS JOIN LATERAL outbox._read_window(s::smallint, $1, $2, NULL, NULL, 100000, 1000000000000, 0) r
              WHERE r.aggregate_id LIKE 'long-%'",
            &[&cursor, &upto],
        )
        .unwrap()
        .get(0);
    assert_eq!(found, 4);
}

#[test]
fn the_sql_counters_are_the_relays_counters_with_one_probe_each() {
    let env = Env::start(&["outbox.enabled = off"]);
    let mut client = env.pg.connect();
    // Statistics of an empty table, as on a fresh install: a planned join would loop over every
    // counter for every aggregate.
    client.batch_execute("ANALYZE outbox.aggregates").unwrap();
    client
        .batch_execute("INSERT INTO outbox.aggregates SELECT 'order', i::text, i * 3 FROM generate_series(0, 9999) i")
        .unwrap();
    let mut types = Vec::new();
    let mut ids = Vec::new();
    for i in (0..10_000).rev() {
        types.push(if i % 10 == 7 { "refund".to_string() } else { "order".to_string() });
        ids.push(if i % 13 == 5 { format!("missing-{i}") } else { i.to_string() });
    }
    let sql: Vec<Option<i64>> = client.query_one("SELECT outbox._last_seqs($1, $2)", &[&types, &ids]).unwrap().get(0);
    let mut rust = vec![None; types.len()];
    for row in client.query("SELECT ordinal, last_seq FROM tests.counters($1, $2)", &[&types, &ids]).unwrap() {
        let ordinal: i64 = row.get(0);
        rust[ordinal as usize - 1] = Some(row.get::<_, i64>(1));
    }
    assert_eq!(sql.len(), 10_000);
    assert_eq!(sql, rust);
    assert!(sql.iter().any(Option::is_none) && sql.iter().any(Option::is_some));
    let empty: Vec<Option<i64>> =
        client.query_one("SELECT outbox._last_seqs('{}'::text[], '{}'::text[])", &[]).unwrap().get(0);
    assert!(empty.is_empty());

    // One index probe per aggregate, whatever the statistics: 10,000 scans of the primary key,
    // never a scan of the table nor a join (auto_explain shows the function's own plan).
    let notices = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let mut logged = postgres::Config::new()
        .host("127.0.0.1")
        .port(env.pg.port)
        .user("postgres")
        .dbname("postgres")
        .notice_callback({
            let notices = notices.clone();
            move |notice| notices.lock().unwrap().push(notice.message().to_string())
        })
        .connect(postgres::NoTls)
        .unwrap();
    logged
        .batch_execute(
            "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; SET auto_explain.log_analyze = on;
             SET auto_explain.log_nested_statements = on; SET auto_explain.log_level = notice;
             SET auto_explain.log_timing = off",
        )
        .unwrap();
    let started = std::time::Instant::now();
    logged.query_one("SELECT outbox._last_seqs($1, $2)", &[&types, &ids]).unwrap();
    eprintln!("outbox._last_seqs of 10,000 aggregates (with auto_explain): {:?}", started.elapsed());
    let plans = notices.lock().unwrap().join("\n");
    let probe = plans.lines().find(|line| line.contains("aggregates_pkey")).unwrap_or_else(|| panic!("{plans}"));
    assert!(probe.contains("Index Scan using aggregates_pkey") && probe.contains("loops=10000"), "{plans}");
    assert!(!plans.contains("Seq Scan") && !plans.contains("Hash"), "{plans}");
}
