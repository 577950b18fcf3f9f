//! The SQL-only install (docs/sql-only.md; issue 37, step 1): what `bash scripts/sql-only.sh`
//! prints, run with `psql -f` by a database owner that is no superuser (CREATEROLE and the
//! database's owner, what RDS's rds_superuser has), on a server that does not preload the library.
//! Held against the extension (CREATE EXTENSION outbox_pg on a server that preloads it, its relay
//! paused so that events stay where enqueue put them): the same events and health after a commit
//! and a rollback, the same refusals for README's bad-input table (SQLSTATE, message and hint),
//! the same shards and order-lock keys, the same order-lock cap, the same objects (functions,
//! columns, privileges). A second run of the script stops and changes nothing. The pg_tle
//! variant's body is the same SQL, and installs as an extension script run by the owner. Its
//! `outbox_enqueue` wakes relays outside the server with one NOTIFY per committed transaction
//! (issue 37, step 3), where the extension's wakes its relays through shared memory and notifies
//! no one.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use postgres::fallible_iterator::FallibleIterator;

use common::*;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const OWNER: &str = "app_owner";
const WRITER: &str = "app_writer";

/// What `bash scripts/sql-only.sh [args]` prints.
fn sql_only_script(args: &[&str]) -> String {
    let out = Command::new("bash")
        .arg(format!("{ROOT}/scripts/sql-only.sh"))
        .args(args)
        .output()
        .expect("bash runs scripts/sql-only.sh");
    assert!(out.status.success(), "scripts/sql-only.sh {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("the script is UTF-8")
}

fn connect_as(pg: &Cluster, database: &str, user: &str) -> postgres::Client {
    let conninfo = format!("host=127.0.0.1 port={} user={user} dbname={database} connect_timeout=10", pg.port);
    postgres::Client::connect(&conninfo, postgres::NoTls)
        .unwrap_or_else(|e| panic!("connect as {user} to {database}: {e}"))
}

/// A server without the library preloaded, a database owned by a role with CREATEROLE only, the
/// SQL-only install run there by that role with psql, and a writer it made.
struct SqlOnly {
    pg: Cluster,
    files: TempDir,
}

const DATABASE: &str = "app";

impl SqlOnly {
    fn start() -> SqlOnly {
        SqlOnly::start_with(&[])
    }

    fn start_with(settings: &[&str]) -> SqlOnly {
        let pg = Cluster::builder(PgInstall::under_test()).for_tests().settings(settings).start();
        let mut admin = pg.connect();
        let preloaded: String = admin.query_one("SHOW shared_preload_libraries", &[]).unwrap().get(0);
        assert!(!preloaded.contains("outbox_pg"), "{preloaded}");
        admin.batch_execute(&format!("CREATE ROLE {OWNER} LOGIN CREATEROLE")).unwrap();
        admin.batch_execute(&format!("CREATE DATABASE {DATABASE} OWNER {OWNER}")).unwrap();
        let files = TempDir::new("sqlonly");
        install_with_psql(&pg, files.path(), DATABASE, OWNER);
        let mut owner = connect_as(&pg, DATABASE, OWNER);
        owner.batch_execute(&format!("CREATE ROLE {WRITER} LOGIN IN ROLE outbox_writer")).unwrap();
        SqlOnly { pg, files }
    }
}

/// Runs the plain script in `database` as `role` with `psql -f`, as the docs say to.
fn install_with_psql(pg: &Cluster, dir: &Path, database: &str, role: &str) {
    let path = dir.join("outbox_pg.sql");
    fs::write(&path, sql_only_script(&[])).unwrap();
    let mut psql = pg_command("psql");
    psql.args(["-X", "-q", "-h", "127.0.0.1", "-p", &pg.port.to_string(), "-U", role, "-d", database, "-f"]).arg(&path);
    let out = run(psql, "psql -f outbox_pg.sql");
    assert!(!out.contains("ERROR"), "{out}");
    let mut client = connect_as(pg, database, role);
    let superuser: bool =
        client.query_one("SELECT rolsuper FROM pg_roles WHERE rolname = current_user", &[]).unwrap().get(0);
    assert!(!superuser, "the install ran as a superuser");
}

/// A server that preloads the library, with the extension in database `postgres`, its relay paused
/// (and pointed at a closed port): enqueued events stay pending, as in the SQL-only install.
fn extension_cluster() -> Cluster {
    let pg = Cluster::start(free_port(), &["outbox.enabled = off"]);
    pg.connect().batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    pg
}

/// An error's SQLSTATE, message and hint, or "ok".
fn outcome(result: Result<(), postgres::Error>) -> (String, String, String) {
    match result {
        Ok(()) => ("ok".into(), String::new(), String::new()),
        Err(error) => {
            let db = error.as_db_error().unwrap_or_else(|| panic!("not a server error: {error}"));
            (db.code().code().to_string(), db.message().to_string(), db.hint().unwrap_or_default().to_string())
        }
    }
}

/// Runs `setup` then `call` in a transaction that is rolled back.
fn attempt(client: &mut postgres::Client, setup: &str, call: &str) -> (String, String, String) {
    let mut tx = client.transaction().unwrap();
    let result = tx.batch_execute(setup).and_then(|_| tx.batch_execute(call));
    drop(tx);
    outcome(result)
}

const VALID_TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// README's bad-input table, row by row (what outbox_enqueue refuses, with nothing inserted), and
/// what each row's SQLSTATE is: (setup, call, SQLSTATE).
fn bad_inputs() -> Vec<(String, String, &'static str)> {
    let call = |args: &str| format!("SELECT outbox_enqueue({args})");
    let long = |n: usize| "x".repeat(n);
    let big_headers = "jsonb_build_object('k', repeat('h', 65500))";
    let mut rows: Vec<(String, String, &str)> = vec![
        // NULL aggregate_type, aggregate_id, event_type or payload.
        (String::new(), call("NULL, '1', 'e', '{}'"), "22004"),
        (String::new(), call("'a', NULL::text, 'e', '{}'"), "22004"),
        (String::new(), call("'a', '1', NULL, '{}'"), "22004"),
        (String::new(), call("'a', '1', 'e', NULL"), "22004"),
        // Empty ones.
        (String::new(), call("'', '1', 'e', '{}'"), "22023"),
        (String::new(), call("'a', '', 'e', '{}'"), "22023"),
        (String::new(), call("'a', '1', '', '{}'"), "22023"),
        // Too long, in bytes (a multi-byte character counts its bytes), quoted with a ' and a \.
        (String::new(), call(&format!("'{}', '1', 'e', '{{}}'", long(256))), "22023"),
        (String::new(), call(&format!("'it''s\\{}', '1', 'e', '{{}}'", "é".repeat(130))), "22023"),
        (String::new(), call(&format!("'a', '{}', 'e', '{{}}'", long(1025))), "22023"),
        (String::new(), call(&format!("'a', '1', '{}', '{{}}'", long(256))), "22023"),
        // Headers that are not an object.
        (String::new(), call("'a', '1', 'e', '{}', '[1, 2]'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '\"text\"'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', 'true'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', 'null'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '12.5'"), "22023"),
        // Headers too long, alone and with the trace context merged in.
        (String::new(), call("'a', '1', 'e', '{}', jsonb_build_object('k', repeat('h', 65600))"), "54000"),
        (format!("SET LOCAL outbox.traceparent = '{VALID_TRACEPARENT}'"), call(&format!("'a', '1', 'e', '{{}}', {big_headers}")), "54000"),
        // A trace context that is not valid W3C, in the headers.
        (String::new(), call("'a', '1', 'e', '{}', '{\"traceparent\": \"00-abc\"}'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '{\"traceparent\": \"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '{\"traceparent\": \"0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '{\"traceparent\": \"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01\"}'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '{\"traceparent\": \"00-00000000000000000000000000000000-00f067aa0ba902b7-01\"}'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '{\"traceparent\": \"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01\"}'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '{\"traceparent\": \"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1\"}'"), "22023"),
        (String::new(), call(&format!("'a', '1', 'e', '{{}}', '{{\"traceparent\": \"00-{}-00f067aa0ba902b7-01\"}}'", "\\\"q\\\"".repeat(20))), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '{\"traceparent\": 7}'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '{\"traceparent\": null}'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '{\"traceparent\": [1]}'"), "22023"),
        (String::new(), call(&format!("'a', '1', 'e', '{{}}', '{{\"traceparent\": \"{VALID_TRACEPARENT}\", \"tracestate\": true}}'")), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', '{\"tracestate\": \"rojo=1\"}'"), "22023"),
        // Tracestates: too long, not key=value, bad keys and values, repeated keys, too many.
        (String::new(), call(&format!("'a', '1', 'e', '{{}}', jsonb_build_object('traceparent', '{VALID_TRACEPARENT}', 'tracestate', 'k=' || repeat('v', 600))")), "22023"),
        (String::new(), call(&format!("'a', '1', 'e', '{{}}', '{{\"traceparent\": \"{VALID_TRACEPARENT}\", \"tracestate\": \"rojo\"}}'")), "22023"),
        (String::new(), call(&format!("'a', '1', 'e', '{{}}', '{{\"traceparent\": \"{VALID_TRACEPARENT}\", \"tracestate\": \"Rojo=1\"}}'")), "22023"),
        (String::new(), call(&format!("'a', '1', 'e', '{{}}', '{{\"traceparent\": \"{VALID_TRACEPARENT}\", \"tracestate\": \"rojo=1,congo=\"}}'")), "22023"),
        (String::new(), call(&format!("'a', '1', 'e', '{{}}', '{{\"traceparent\": \"{VALID_TRACEPARENT}\", \"tracestate\": \"rojo=1, rojo=2\"}}'")), "22023"),
        (String::new(), call(&format!("'a', '1', 'e', '{{}}', '{{\"traceparent\": \"{VALID_TRACEPARENT}\", \"tracestate\": \"9t@sys=1,t@Sys=2\"}}'")), "22023"),
        (String::new(), call(&format!("'a', '1', 'e', '{{}}', jsonb_build_object('traceparent', '{VALID_TRACEPARENT}', 'tracestate', (SELECT string_agg('k' || n || '=1', ',') FROM generate_series(1, 33) n))")), "22023"),
        // outbox.tracestate set without outbox.traceparent.
        ("SET LOCAL outbox.tracestate = 'rojo=00f067aa0ba902b7'".into(), call("'a', '1', 'e', '{}'"), "22023"),
        // Streams: empty, blank (Unicode white space too), too long.
        (String::new(), call("'a', '1', 'e', '{}', NULL, ''"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', NULL, E' \\t\\n'"), "22023"),
        (String::new(), call("'a', '1', 'e', '{}', NULL, chr(160) || chr(12288)"), "22023"),
        (String::new(), call(&format!("'a', '1', 'e', '{{}}', NULL, '{}'", long(513))), "22023"),
        // The payload larger than outbox.max_payload_size.
        ("SET LOCAL outbox.max_payload_size = 64".into(), call("'a', '1', 'e', jsonb_build_object('k', repeat('p', 100))"), "54000"),
        ("SET LOCAL outbox.max_payload_size = '1kB'".into(), call("'a', '1', 'e', jsonb_build_object('k', repeat('p', 1100))"), "54000"),
        // Streams outbox.allowed_streams does not allow: given, and from the template.
        ("SET LOCAL outbox.allowed_streams = 'orders:*, audit:?'".into(), call("'a', '1', 'e', '{}', NULL, 'payments:1'"), "42501"),
        ("SET LOCAL outbox.allowed_streams = 'orders:*'".into(), call("'a', '1', 'e', '{}'"), "42501"),
        (
            "SET LOCAL outbox.allowed_streams = 'orders:*'; SET LOCAL outbox.stream = 'x:{event_type}:{aggregate_type}:{other}'".into(),
            call("'a', '1', 'e', '{}'"),
            "42501",
        ),
        ("SET LOCAL outbox.allowed_streams = 'orders:\\*'".into(), call("'a', '1', 'e', '{}', NULL, 'orders:1'"), "42501"),
        ("SET LOCAL outbox.allowed_streams = 'orders:*'".into(), call(&format!("'a', '1', 'e', '{{}}', NULL, '{}'", long(300))), "42501"),
    ];
    // And what each allows, to show the checks refuse no more than the extension's.
    for (setup, args) in [
        ("SET LOCAL outbox.allowed_streams = 'orders:*, audit:?'", "'a', '1', 'e', '{}', NULL, 'audit:1'"),
        ("SET LOCAL outbox.allowed_streams = 'orders:\\*'", "'a', '1', 'e', '{}', NULL, 'orders:*'"),
        ("SET LOCAL outbox.allowed_streams = 'outbox:*'", "'a', '1', 'e', '{}'"),
        ("SET LOCAL outbox.max_payload_size = '1kB'", "'a', '1', 'e', jsonb_build_object('k', repeat('p', 1000))"),
        ("", "'a', '1', 'e', '{}', NULL, 'x'"),
        ("", "'a', 42::bigint, 'e', 'null'"),
        ("", "'a', '6d9b7a6e-5f4b-4c1f-9a55-0a3c7d1c2b11'::uuid, 'e', '[]'"),
    ] {
        rows.push((setup.into(), call(args), "ok"));
    }
    rows
}

#[test]
fn the_sql_only_install_refuses_bad_input_as_the_extension_does() {
    let ext = extension_cluster();
    let only = SqlOnly::start();
    // The extension's checks of the Suset settings need a superuser to set them; in the SQL-only
    // install they are placeholders any role sets (docs/sql-only.md).
    let mut with_library = ext.connect();
    let mut without = connect_as(&only.pg, DATABASE, WRITER);
    let mut differences = Vec::new();
    for (setup, call, expected) in bad_inputs() {
        let theirs = attempt(&mut with_library, &setup, &call);
        let ours = attempt(&mut without, &setup, &call);
        assert_eq!(theirs.0, expected, "the extension's SQLSTATE for {setup}; {call}: {theirs:?}");
        if ours != theirs {
            differences.push(format!("{setup}; {call}\n  extension: {theirs:?}\n  SQL-only:  {ours:?}"));
        }
        if expected != "ok" {
            assert!(!theirs.2.is_empty(), "no hint for {call}");
        }
    }
    assert!(differences.is_empty(), "{} of the bad inputs differ:\n{}", differences.len(), differences.join("\n"));
    // Nothing inserted by any of them (the allowed ones were rolled back too).
    let count: i64 =
        connect_as(&only.pg, DATABASE, OWNER).query_one("SELECT count(*) FROM outbox.events", &[]).unwrap().get(0);
    assert_eq!(count, 0);
}

/// The events one session enqueued, as `outbox.messages` shows them (without what differs by
/// nature: ids, times, transaction ids).
fn messages(client: &mut postgres::Client) -> Vec<String> {
    client
        .query(
            "SELECT format('%s %s %s %s %s %s %s %s %s', aggregate_type, aggregate_id, event_type, payload, headers,
                           stream, status, shard, attempts)
               FROM outbox.messages ORDER BY id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

fn stats(client: &mut postgres::Client) -> String {
    client
        .query_one(
            "SELECT format('pending %s publishing %s failed %s published_total %s aged %s last_published_at %s redis_data_loss %s',
                           pending, publishing, failed, published_total, oldest_pending_age IS NOT NULL,
                           last_published_at, redis_data_loss)
               FROM outbox.stats",
            &[],
        )
        .unwrap()
        .get(0)
}

/// A committed transaction of events and a rolled-back one, the same in both installs.
fn enqueue_some(client: &mut postgres::Client) {
    let mut tx = client.transaction().unwrap();
    tx.batch_execute(&format!(
        "SELECT outbox_enqueue('payment', '42', 'payment.created', '{{\"amount\": 10}}');
         SELECT outbox_enqueue('payment', 43::bigint, 'payment.created', 'null', '{{\"source\": \"web\"}}', 'payments:eu');
         SET LOCAL outbox.traceparent = '{VALID_TRACEPARENT}';
         SET LOCAL outbox.tracestate = 'rojo=00f067aa0ba902b7';
         SELECT outbox_enqueue('refund', '6d9b7a6e-5f4b-4c1f-9a55-0a3c7d1c2b11'::uuid, 'refund.asked', '[1, 2]');
         SELECT outbox_enqueue('refund', 'r-1', 'refund.asked', '{{}}', '{{\"traceparent\": \"{VALID_TRACEPARENT}\"}}');"
    ))
    .unwrap();
    tx.commit().unwrap();
    let mut tx = client.transaction().unwrap();
    tx.batch_execute("SELECT outbox_enqueue('payment', '44', 'payment.created', '{}')").unwrap();
    tx.rollback().unwrap();
}

/// Every shard's window from its cursor to now as outbox._read_window reads it whole: each
/// event's fields that do not depend on the server (ids, transactions and times do).
fn window_reads(client: &mut postgres::Client) -> Vec<String> {
    client
        .query(
            "SELECT concat_ws(' | ', r.aggregate_type, r.aggregate_id, r.event_type, r.payload, r.headers, r.stream,
                              r.traceparent, r.tracestate, r.size, r.txn_max_id = r.id)
               FROM outbox.shards s
              CROSS JOIN LATERAL outbox._read_window(s.shard, s.cursor::text, pg_current_snapshot()::text, NULL, NULL,
                                                     100, 16777216, 0) r
              WHERE r.id IS NOT NULL
              ORDER BY r.aggregate_type, r.aggregate_id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[test]
fn committed_events_and_health_read_as_in_the_extension() {
    let ext = extension_cluster();
    let only = SqlOnly::start();
    let mut with_library = ext.connect();
    let mut writer = connect_as(&only.pg, DATABASE, WRITER);
    enqueue_some(&mut with_library);
    enqueue_some(&mut writer);
    // The writer reads nothing of the log; the owner reads it all.
    let refused = writer.query("SELECT * FROM outbox.messages", &[]).unwrap_err();
    assert_eq!(refused.code(), Some(&postgres::error::SqlState::INSUFFICIENT_PRIVILEGE), "{refused}");
    let mut owner = connect_as(&only.pg, DATABASE, OWNER);
    let ours = messages(&mut owner);
    assert_eq!(ours.len(), 4, "{ours:#?}");
    assert_eq!(ours, messages(&mut with_library));
    assert_eq!(stats(&mut owner), stats(&mut with_library));
    assert_eq!(
        stats(&mut owner),
        "pending 4 publishing 0 failed 0 published_total 0 aged t last_published_at  redis_data_loss 0"
    );
    // The round's reads in SQL that the relay outside the server runs here (src/sql/relay/read.sql;
    // tests/relay_sql.rs holds them equal to the in-server relay's): the same events, sizes and
    // trace contexts in both installs, for the database's owner.
    let window = window_reads(&mut owner);
    assert_eq!(window.len(), 4, "{window:#?}");
    assert_eq!(window, window_reads(&mut with_library));
    let seqs = "SELECT outbox._last_seqs(ARRAY['payment', 'refund'], ARRAY['42', 'r-1'])";
    let none: Vec<Option<i64>> = owner.query_one(seqs, &[]).unwrap().get(0);
    assert_eq!(none, [None, None]);
    // No relay inside the server: as the extension shows a database no relay serves.
    let relay: (Option<i32>, i32, bool) = {
        let row = owner.query_one("SELECT worker_pid, workers, redis_connected FROM outbox.stats", &[]).unwrap();
        (row.get(0), row.get(1), row.get(2))
    };
    assert_eq!(relay, (None, 0, false));
    let row = owner
        .query_one("SELECT outbox.relay_pid(), outbox.redis_connected(), (SELECT count(*) FROM outbox.relays())", &[])
        .unwrap();
    assert_eq!((row.get::<_, Option<i32>>(0), row.get::<_, bool>(1), row.get::<_, i64>(2)), (None, false, 0));
    // Event ids are UUIDv7, ascending with the ids.
    let versions: Vec<String> = owner
        .query("SELECT substr(event_id::text, 15, 1) FROM outbox.messages ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(versions, ["7"; 4]);
    // The operations run on it as on the extension: nothing published, so nothing to purge or
    // forget, nothing failed to retry.
    let row = owner
        .query_one(
            "SELECT outbox.purge('0'), outbox.forget_aggregates(), outbox.retry_failed(), outbox.oldest_pending_age() IS NOT NULL",
            &[],
        )
        .unwrap();
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, i64>(1), row.get::<_, i64>(2), row.get::<_, bool>(3)),
        (0, 0, 0, true)
    );
}

/// Enqueues for many aggregates in one transaction and returns each one's shard and the order
/// lock this transaction holds for it (its two keys and fourth field, as pg_locks shows them).
fn shards_and_locks(client: &mut postgres::Client) -> Vec<(String, String, i16, String)> {
    let mut tx = client.transaction().unwrap();
    tx.batch_execute(
        "SELECT outbox_enqueue(t, i, 'e', '{}')
           FROM unnest(ARRAY['payment', 'order', 'émoji 😀', 'a']) t, generate_series(1, 50) n,
                LATERAL (SELECT CASE WHEN n % 2 = 0 THEN n::text ELSE md5(n::text) END AS i) i",
    )
    .unwrap();
    let rows = tx
        .query(
            "SELECT e.aggregate_type, e.aggregate_id, e.shard,
                    (SELECT string_agg(format('%s/%s/%s', l.classid, l.objid, l.objsubid), ' ')
                       FROM pg_locks l
                      WHERE l.pid = pg_backend_pid() AND l.locktype IN ('advisory', 'userlock') AND l.objsubid = 2
                        AND l.mode = 'ExclusiveLock'
                        AND l.objid::text::bigint = (h.hash & 4294967295)
                        AND l.classid::text::bigint = (h.hash >> 32) & 4294967295)
               FROM outbox.events e,
                    LATERAL (SELECT pg_temp.tests_hash(e.aggregate_type, e.aggregate_id) AS hash) h
              ORDER BY e.id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2), row.get::<_, Option<String>>(3).unwrap_or_default()))
        .collect();
    tx.rollback().unwrap();
    rows
}

/// FNV-1a in plain SQL over numeric, written here once more, independent of both installs: the
/// locks each takes are looked up by it.
const TESTS_HASH: &str = "
CREATE FUNCTION pg_temp.tests_hash(t text, i text) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE b bytea := convert_to(t, 'UTF8') || decode('ff', 'hex') || convert_to(i, 'UTF8'); h numeric := 14695981039346656037;
        x numeric; r bigint := 0;
BEGIN
  FOR k IN 0 .. length(b) - 1 LOOP
    -- XOR of the low byte: subtract it and add the XORed one.
    x := mod(h, 256);
    h := h - x + ((x::int) # get_byte(b, k));
    h := mod(h * 1099511628211, 18446744073709551616);
  END LOOP;
  IF h >= 9223372036854775808 THEN h := h - 18446744073709551616; END IF;
  RETURN h::bigint;
END $$;";

#[test]
fn shards_and_order_locks_are_the_extensions() {
    let ext = extension_cluster();
    let only = SqlOnly::start();
    let mut with_library = ext.connect();
    let mut owner = connect_as(&only.pg, DATABASE, OWNER);
    for client in [&mut with_library, &mut owner] {
        client.batch_execute(TESTS_HASH).unwrap();
    }
    let ours = shards_and_locks(&mut owner);
    let theirs = shards_and_locks(&mut with_library);
    assert_eq!(ours.len(), 200);
    assert!(ours.iter().all(|(.., lock)| !lock.is_empty()), "an aggregate without its order lock: {ours:?}");
    assert_eq!(ours, theirs);
    let shards: std::collections::BTreeSet<i16> = ours.iter().map(|(_, _, shard, _)| *shard).collect();
    assert_eq!(shards.len(), 16, "200 aggregates cover every shard: {shards:?}");
    // The SQL-only install's hash is the extension's test helper's, and a second enqueuer of an
    // aggregate waits for the first to end (the lock is held to the end of the transaction).
    let same: bool = with_library
        .query_one("SELECT tests.shard_of('payment', '42') = 8 AND pg_temp.tests_hash('payment', '42') & 15 = 8", &[])
        .unwrap()
        .get(0);
    assert!(same);
    let mut first = connect_as(&only.pg, DATABASE, WRITER);
    let mut second = connect_as(&only.pg, DATABASE, OWNER);
    let mut tx = first.transaction().unwrap();
    tx.batch_execute("SELECT outbox_enqueue('payment', '42', 'e', '{}')").unwrap();
    let in_progress: bool =
        second.query_one("SELECT outbox._enqueue_in_progress('payment', '42')", &[]).unwrap().get(0);
    assert!(in_progress);
    second.batch_execute("SET lock_timeout = '200ms'").unwrap();
    let waited = second.batch_execute("SELECT outbox_enqueue('payment', '42', 'e', '{}')").unwrap_err();
    assert_eq!(waited.code(), Some(&postgres::error::SqlState::LOCK_NOT_AVAILABLE), "{waited}");
    tx.commit().unwrap();
    let in_progress: bool =
        second.query_one("SELECT outbox._enqueue_in_progress('payment', '42')", &[]).unwrap().get(0);
    assert!(!in_progress);
    second.batch_execute("SELECT outbox_enqueue('payment', '42', 'e', '{}')").unwrap();
}

/// The objects users see: functions (arguments, result, volatility, strictness, security), the
/// columns of tables and views, privileges (the owner's name left out), in schemas outbox and
/// public; the SQL-only install's own helpers (commented 'Internal (SQL-only install)') and the
/// test build's schema `tests` aside.
const OBJECTS: &str = "
SELECT format('function %s.%s(%s) %s %s strict=%s definer=%s parallel=%s acl=%s', n.nspname, p.proname,
              pg_get_function_identity_arguments(p.oid), pg_get_function_result(p.oid), p.provolatile,
              p.proisstrict, p.prosecdef, p.proparallel,
              replace(coalesce(p.proacl::text, 'default'), pg_get_userbyid(p.proowner), 'OWNER'))
  FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
 WHERE (n.nspname = 'outbox' OR (n.nspname = 'public' AND p.proname LIKE 'outbox%'))
   AND coalesce(obj_description(p.oid, 'pg_proc'), '') NOT LIKE 'Internal (SQL-only install)%'
UNION ALL
SELECT format('relation %s %s acl=%s', c.relname, c.relkind,
              replace(coalesce(c.relacl::text, 'default'), pg_get_userbyid(c.relowner), 'OWNER'))
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'outbox'
UNION ALL
SELECT format('column %s.%s %s %s', table_name, column_name, data_type, ordinal_position)
  FROM information_schema.columns WHERE table_schema = 'outbox'
ORDER BY 1";

fn objects(client: &mut postgres::Client) -> Vec<String> {
    client.query(OBJECTS, &[]).unwrap().iter().map(|row| row.get(0)).collect()
}

#[test]
fn the_install_makes_the_objects_the_extension_makes() {
    let ext = extension_cluster();
    let only = SqlOnly::start();
    let theirs = objects(&mut ext.connect());
    let ours = objects(&mut connect_as(&only.pg, DATABASE, OWNER));
    let missing: Vec<_> = theirs.iter().filter(|o| !ours.contains(o)).collect();
    let extra: Vec<_> = ours.iter().filter(|o| !theirs.contains(o)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "only in the extension: {missing:#?}\nonly in the SQL-only install: {extra:#?}"
    );
}

/// Runs `script` (a file in `dir`) in `database` as `role` with `psql -f`; its output and whether
/// it succeeded.
fn psql_file(pg: &Cluster, dir: &Path, name: &str, script: &str, role: &str) -> (bool, String) {
    let path = dir.join(name);
    fs::write(&path, script).unwrap();
    let mut psql = pg_command("psql");
    psql.args(["-X", "-q", "-h", "127.0.0.1", "-p", &pg.port.to_string(), "-U", role, "-d", DATABASE, "-f"]).arg(&path);
    let out = psql.output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

const LEFT_OVER: &str =
    "SELECT count(*) FROM pg_proc WHERE pronamespace = 'public'::regnamespace AND proname LIKE 'outbox%'";

#[test]
fn a_dropped_schema_is_named_at_reinstall_and_the_uninstall_script_clears_the_way() {
    let only = SqlOnly::start();
    let dir = only.files.path();
    let mut owner = connect_as(&only.pg, DATABASE, OWNER);
    owner.batch_execute("DROP SCHEMA outbox CASCADE").unwrap();
    let left: i64 = owner.query_one(LEFT_OVER, &[]).unwrap().get(0);
    assert_eq!(left, 4, "outbox_enqueue (three) and outbox_mark_processed stay in public");
    let (ok, out) = psql_file(&only.pg, dir, "again.sql", &sql_only_script(&[]), OWNER);
    assert!(!ok, "{out}");
    assert!(
        out.contains("functions an earlier install left are in the way: outbox_enqueue(")
            && out.contains("bash scripts/sql-only.sh --uninstall"),
        "{out}"
    );
    let uninstall = sql_only_script(&["--uninstall"]);
    let (ok, out) = psql_file(&only.pg, dir, "uninstall.sql", &uninstall, OWNER);
    assert!(ok && !out.contains("ERROR"), "{out}");
    install_with_psql(&only.pg, dir, DATABASE, OWNER);
    let mut writer = connect_as(&only.pg, DATABASE, WRITER);
    writer.batch_execute("SELECT outbox_enqueue('payment', 1, 'created', '{}')").unwrap();
    // And from a whole install: nothing of it stays but the roles, whatever another session
    // made over it (found by attack: a temporary view kept the removal from running).
    writer
        .batch_execute("CREATE TEMP VIEW mine AS SELECT public.outbox_enqueue('a', 'b', 'c', '{}'::jsonb) AS id")
        .unwrap();
    let (ok, out) = psql_file(&only.pg, dir, "uninstall.sql", &uninstall, OWNER);
    assert!(ok && !out.contains("ERROR"), "{out}");
    let left: i64 = owner.query_one(LEFT_OVER, &[]).unwrap().get(0);
    let schema: bool =
        owner.query_one("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'outbox')", &[]).unwrap().get(0);
    assert_eq!((left, schema), (0, false));
    let roles: i64 = owner
        .query_one(
            "SELECT count(*) FROM pg_roles WHERE rolname IN ('outbox_writer', 'outbox_consumer', 'outbox_admin')",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(roles, 3, "the roles stay");
}

/// The pg_tle body between its dollar quotes.
fn pg_tle_body(script: &str) -> &str {
    let tag = "$_outbox_pg_tle_$";
    let start = script.find(tag).expect("the opening quote") + tag.len();
    let end = script[start..].find(tag).expect("the closing quote") + start;
    script[start..end].trim_start_matches('\n')
}

#[test]
fn the_pg_tle_body_is_the_plain_install() {
    let plain = sql_only_script(&[]);
    let tle = sql_only_script(&["--pg-tle"]);
    assert!(tle.contains("SELECT pgtle.install_extension(\n    'outbox_pg',\n"), "{}", &tle[..400]);
    // The body, without what only CREATE EXTENSION allows, is the plain script's body (between its
    // BEGIN and the settings CREATE EXTENSION makes, and its COMMIT).
    let body = pg_tle_body(&tle);
    let dumps = body.lines().filter(|line| line.starts_with("SELECT pg_catalog.pg_extension_config_dump(")).count();
    assert_eq!(dumps, 19, "one per table and sequence the extension marks");
    let without_dumps: String = body
        .lines()
        .filter(|line| !line.starts_with("SELECT pg_catalog.pg_extension_config_dump("))
        .map(|line| format!("{line}\n"))
        .collect();
    let plain_body = plain.split_once("SET LOCAL search_path = public;\n").expect("the settings").1;
    let plain_body = plain_body.strip_suffix("\nCOMMIT;\n").expect("the COMMIT").trim_start_matches('\n');
    assert_eq!(normalize(&without_dumps), normalize(plain_body));
}

/// The SQL of a script without blank and comment lines (a statement left out leaves the blank
/// line and comments above it).
fn normalize(sql: &str) -> Vec<&str> {
    sql.lines().filter(|line| !line.trim().is_empty() && !line.trim_start().starts_with("--")).collect()
}

/// Files of a stand-in extension in the installation's extension directory, removed on drop.
struct StandIn(Vec<PathBuf>);

impl Drop for StandIn {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = fs::remove_file(path);
        }
    }
}

/// pg_tle runs the body it registered as CREATE EXTENSION runs a script file, as the role that
/// creates the extension. Without pg_tle here, the body goes into an extension of files with
/// `superuser = false`, which PostgreSQL runs the same way: as the non-superuser owner, with
/// pg_extension_config_dump allowed.
#[test]
fn the_pg_tle_body_installs_as_an_extension_script_run_by_the_owner() {
    let only = SqlOnly::start();
    let name = format!("outbox_pg_tle_body_{}", std::process::id());
    let dir = only.pg.install().extension_dir();
    let control = dir.join(format!("{name}.control"));
    let script = dir.join(format!("{name}--1.0.sql"));
    let _files = StandIn(vec![control.clone(), script.clone()]);
    fs::write(&control, "comment = 'outbox_pg pg_tle body (tests/sql_only.rs)'\ndefault_version = '1.0'\nrelocatable = false\nsuperuser = false\n").unwrap();
    fs::write(&script, pg_tle_body(&sql_only_script(&["--pg-tle"]))).unwrap();
    let mut admin = only.pg.connect();
    admin.batch_execute("CREATE ROLE tle_owner LOGIN CREATEROLE").unwrap();
    admin.batch_execute("CREATE DATABASE tle OWNER tle_owner").unwrap();
    let mut owner = connect_as(&only.pg, "tle", "tle_owner");
    owner.batch_execute(&format!("CREATE EXTENSION {name}")).unwrap();
    let dumped: i32 =
        owner.query_one("SELECT cardinality(extconfig) FROM pg_extension WHERE extname = $1", &[&name]).unwrap().get(0);
    assert_eq!(dumped, 19);
    // The roles are the cluster's, made by the first install: its writer writes here too.
    let mut writer = connect_as(&only.pg, "tle", WRITER);
    let event: String =
        writer.query_one("SELECT outbox_enqueue('payment', '42', 'e', '{}')::text", &[]).unwrap().get(0);
    let row = owner
        .query_one("SELECT status, shard FROM outbox.messages WHERE event_id = $1::text::uuid", &[&event])
        .unwrap();
    assert_eq!((row.get::<_, String>(0), row.get::<_, i16>(1)), ("pending".into(), 8));
    // The plain install and the extension made of the same body hold the same objects.
    let plain = objects(&mut connect_as(&only.pg, DATABASE, OWNER));
    assert_eq!(objects(&mut owner), plain);
}

/// The order-lock cap as the extension keeps it: a transaction holds at most 256 order locks, a
/// rolled-back subtransaction's locks no longer count, and past the cap the transaction keeps
/// `outbox.forget_aggregates` out (`outbox._exclude_transactions_past_the_cap()` is false for
/// others while it runs). Each step's (locks held, others may forget) in both installs.
fn cap_steps(bulk: &mut postgres::Client, admin: &mut postgres::Client) -> Vec<(i64, bool)> {
    let held = "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype IN ('advisory', 'userlock')
                   AND objsubid = 2 AND mode = 'ExclusiveLock'";
    let enqueue = |from: i32, to: i32| {
        format!("SELECT count(outbox_enqueue('cap', n::text, 'e', '{{}}')) FROM generate_series({from}, {to}) n")
    };
    let mut steps = Vec::new();
    let mut tx = bulk.transaction().unwrap();
    for step in [
        enqueue(1, 250),
        format!("SAVEPOINT s; {}; ROLLBACK TO SAVEPOINT s", enqueue(251, 270)),
        enqueue(271, 276),
        // Aggregates it holds already take no further lock.
        enqueue(1, 10),
        enqueue(277, 277),
        enqueue(278, 300),
    ] {
        tx.batch_execute(&step).unwrap();
        let locks: i64 = tx.query_one(held, &[]).unwrap().get(0);
        let may_forget: bool =
            admin.query_one("SELECT outbox._exclude_transactions_past_the_cap()", &[]).unwrap().get(0);
        steps.push((locks, may_forget));
    }
    tx.rollback().unwrap();
    let may_forget: bool = admin.query_one("SELECT outbox._exclude_transactions_past_the_cap()", &[]).unwrap().get(0);
    steps.push((0, may_forget));
    steps
}

#[test]
fn the_order_lock_cap_is_kept_as_in_the_extension() {
    let ext = extension_cluster();
    let only = SqlOnly::start();
    let theirs = cap_steps(&mut ext.connect(), &mut ext.connect());
    let ours = cap_steps(&mut connect_as(&only.pg, DATABASE, WRITER), &mut connect_as(&only.pg, DATABASE, OWNER));
    assert_eq!(theirs, [(250, true), (250, true), (256, true), (256, true), (256, false), (256, false), (0, true)]);
    assert_eq!(ours, theirs);
}

/// A session LISTENing on the channel relays outside the server are woken on: a relay asleep when
/// it holds the wake key, as a sleeping relay does.
struct Listener {
    client: postgres::Client,
    channel: String,
    markers: u32,
}

impl Listener {
    fn start(pg: &Cluster, database: &str) -> Listener {
        let mut listener = Listener::awake(pg, database);
        listener.client.batch_execute("SELECT pg_advisory_lock(outbox._wake_key())").unwrap();
        listener
    }

    fn awake(pg: &Cluster, database: &str) -> Listener {
        let mut client = connect_as(pg, database, OWNER);
        let channel: String = client.query_one("SELECT outbox._wake_channel()", &[]).unwrap().get(0);
        assert_eq!(channel, "outbox_pg");
        client.batch_execute(&format!("LISTEN {channel}")).unwrap();
        Listener { client, channel, markers: 0 }
    }

    /// Whether the relay could fall asleep now: no writer shares the wake key.
    fn try_to_sleep(&mut self) -> bool {
        self.client.query_one("SELECT pg_try_advisory_lock(outbox._wake_key())", &[]).unwrap().get(0)
    }

    /// The notifications (sending backend's pid, payload) that arrive before a marker that
    /// `writer` commits now. PostgreSQL delivers notifications in commit order, so the marker is a
    /// positive barrier: whatever `writer` committed before it has arrived by then, and what did
    /// not arrive was not sent.
    fn received_before_marker(&mut self, writer: &mut postgres::Client) -> Vec<(i32, String)> {
        self.markers += 1;
        let marker = format!("tests marker {}", self.markers);
        writer.execute("SELECT pg_notify($1, $2)", &[&self.channel, &marker]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut received = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let next = self.client.notifications().timeout_iter(left).next().unwrap();
            let Some(notification) = next else { panic!("no {marker:?} within 60 s; received {received:?}") };
            assert_eq!(notification.channel(), self.channel);
            if notification.payload() == marker {
                return received;
            }
            received.push((notification.process_id(), notification.payload().to_string()));
        }
    }
}

/// A SQL-only install, a listener, and a writer with its backend's pid.
fn notify_setup() -> (SqlOnly, Listener, postgres::Client, i32) {
    let only = SqlOnly::start();
    let listener = Listener::start(&only.pg, DATABASE);
    let mut writer = connect_as(&only.pg, DATABASE, WRITER);
    let pid: i32 = writer.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    (only, listener, writer, pid)
}

#[test]
fn a_committed_transaction_of_several_enqueues_notifies_once() {
    let (_only, mut listener, mut writer, pid) = notify_setup();
    let mut tx = writer.transaction().unwrap();
    tx.batch_execute(
        "SELECT count(outbox_enqueue(t, n::text, 'e', '{}')) FROM unnest(ARRAY['payment', 'order']) t, generate_series(1, 20) n;
         SAVEPOINT s;
         SELECT outbox_enqueue('refund', 7::bigint, 'e', '{}');
         RELEASE SAVEPOINT s;
         SELECT outbox_enqueue('payment', '1', 'e', '{}');",
    )
    .unwrap();
    tx.commit().unwrap();
    assert_eq!(listener.received_before_marker(&mut writer), [(pid, String::new())]);
}

#[test]
fn a_rolled_back_transaction_notifies_no_one() {
    let (_only, mut listener, mut writer, _) = notify_setup();
    let mut tx = writer.transaction().unwrap();
    tx.batch_execute("SELECT count(outbox_enqueue('payment', n::text, 'e', '{}')) FROM generate_series(1, 5) n")
        .unwrap();
    tx.rollback().unwrap();
    // And one that a refused enqueue aborted after an accepted one.
    let mut tx = writer.transaction().unwrap();
    tx.batch_execute("SELECT outbox_enqueue('payment', '1', 'e', '{}')").unwrap();
    tx.batch_execute("SELECT outbox_enqueue('payment', '', 'e', '{}')").unwrap_err();
    drop(tx);
    assert_eq!(listener.received_before_marker(&mut writer), []);
}

#[test]
fn a_rolled_back_savepoint_drops_its_notification_and_a_later_enqueue_sends_one() {
    let (_only, mut listener, mut writer, pid) = notify_setup();
    let mut tx = writer.transaction().unwrap();
    tx.batch_execute(
        "SAVEPOINT s;
         SELECT outbox_enqueue('payment', '1', 'e', '{}');
         SELECT outbox_enqueue('payment', '2', 'e', '{}');
         ROLLBACK TO SAVEPOINT s;
         SELECT outbox_enqueue('payment', '3', 'e', '{}');",
    )
    .unwrap();
    tx.commit().unwrap();
    assert_eq!(listener.received_before_marker(&mut writer), [(pid, String::new())]);
    // Only what the savepoint enqueued, rolled back: the commit has nothing to wake a relay for.
    let mut tx = writer.transaction().unwrap();
    tx.batch_execute("SAVEPOINT s; SELECT outbox_enqueue('payment', '1', 'e', '{}'); ROLLBACK TO SAVEPOINT s;")
        .unwrap();
    tx.commit().unwrap();
    assert_eq!(listener.received_before_marker(&mut writer), []);
}

#[test]
fn every_signature_of_outbox_enqueue_notifies() {
    let (_only, mut listener, mut writer, pid) = notify_setup();
    for call in [
        "SELECT outbox_enqueue('payment', '42', 'e', '{}')",
        "SELECT outbox_enqueue('payment', 42::bigint, 'e', '{}')",
        "SELECT outbox_enqueue('payment', '6d9b7a6e-5f4b-4c1f-9a55-0a3c7d1c2b11'::uuid, 'e', '{}')",
    ] {
        writer.batch_execute(call).unwrap();
        assert_eq!(listener.received_before_marker(&mut writer), [(pid, String::new())], "{call}");
    }
}

/// While no relay sleeps, writers send no NOTIFY (a notifying commit flushes the WAL alone).
#[test]
fn writers_notify_no_one_while_the_relays_are_awake() {
    let only = SqlOnly::start();
    let mut listener = Listener::awake(&only.pg, DATABASE);
    let mut writer = connect_as(&only.pg, DATABASE, WRITER);
    writer
        .batch_execute("SELECT count(outbox_enqueue('payment', n::text, 'e', '{}')) FROM generate_series(1, 5) n")
        .unwrap();
    assert_eq!(listener.received_before_marker(&mut writer), []);
}

/// A relay cannot fall asleep while a writer that found it awake has not committed, so the
/// relay's look for work after falling asleep finds that writer's events; a writer that finds it
/// asleep notifies. Stepped in a fixed order, as PostgreSQL's isolation tester would.
#[test]
fn a_writer_in_flight_keeps_the_relay_awake_until_it_commits() {
    let only = SqlOnly::start();
    let mut relay = Listener::awake(&only.pg, DATABASE);
    let mut writer = connect_as(&only.pg, DATABASE, WRITER);
    let pid: i32 = writer.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    // 1. The writer enqueues while the relay is awake, and has not committed.
    let mut tx = writer.transaction().unwrap();
    tx.batch_execute("SELECT outbox_enqueue('payment', '1', 'e', '{}')").unwrap();
    // 2. The relay, done with its rounds, cannot fall asleep.
    assert!(!relay.try_to_sleep(), "the relay fell asleep while a writer it did not wake was in flight");
    // 3. The writer commits: the relay may sleep now, and its last look sees the event.
    tx.commit().unwrap();
    assert!(relay.try_to_sleep());
    let seen: i64 = relay.client.query_one("SELECT count(*) FROM outbox.messages", &[]).unwrap().get(0);
    assert_eq!(seen, 1);
    // 4. A writer that comes now finds the relay asleep, and wakes it at its commit.
    writer.batch_execute("SELECT outbox_enqueue('payment', '2', 'e', '{}')").unwrap();
    assert_eq!(relay.received_before_marker(&mut writer), [(pid, String::new())]);
}

/// Where transactions may be prepared, writers never notify: PREPARE TRANSACTION refuses a
/// transaction that sent a NOTIFY, so a sleeping relay would make the application's prepares fail
/// now and then. The relay finds those events at its poll interval.
#[test]
fn a_transaction_that_enqueued_can_be_prepared_while_a_relay_sleeps() {
    let only = SqlOnly::start_with(&["max_prepared_transactions = 2"]);
    let mut relay = Listener::start(&only.pg, DATABASE);
    let mut writer = connect_as(&only.pg, DATABASE, WRITER);
    writer
        .batch_execute(
            "BEGIN; SELECT outbox_enqueue('payment', '1', 'e', '{}'); PREPARE TRANSACTION 'outbox-sql-only';",
        )
        .unwrap();
    connect_as(&only.pg, DATABASE, WRITER).batch_execute("COMMIT PREPARED 'outbox-sql-only'").unwrap();
    assert_eq!(relay.received_before_marker(&mut writer), []);
    let committed: i64 = relay.client.query_one("SELECT count(*) FROM outbox.messages", &[]).unwrap().get(0);
    assert_eq!(committed, 1);
}

/// The extension's enqueue wakes its relays through shared memory and notifies no one
/// (docs/sql-only.md, "What differs").
#[test]
fn the_extensions_enqueue_sends_no_notification() {
    let ext = extension_cluster();
    let mut client = ext.connect();
    let channel = "outbox_pg";
    client.batch_execute(&format!("LISTEN {channel}")).unwrap();
    let mut writer = ext.connect();
    writer.batch_execute("SELECT outbox_enqueue('payment', '42', 'e', '{}')").unwrap();
    writer.execute("SELECT pg_notify($1, 'tests marker')", &[&channel]).unwrap();
    let first = client.notifications().timeout_iter(Duration::from_secs(60)).next().unwrap();
    assert_eq!(first.map(|n| n.payload().to_string()), Some("tests marker".into()));
}

/// Run a second time, the script stops at its first error (the schema exists) and changes nothing.
#[test]
fn a_second_run_of_the_script_stops_and_changes_nothing() {
    let only = SqlOnly::start();
    let mut writer = connect_as(&only.pg, DATABASE, WRITER);
    writer.batch_execute("SELECT outbox_enqueue('payment', '42', 'e', '{}')").unwrap();
    let path = only.files.path().join("outbox_pg.sql");
    let out = pg_command("psql")
        .args(["-X", "-q", "-h", "127.0.0.1", "-p", &only.pg.port.to_string(), "-U", OWNER, "-d", DATABASE, "-f"])
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "psql's exit status for a script stopped by an error: {stderr}");
    assert!(stderr.contains("schema \"outbox\" already exists"), "{stderr}");
    assert_eq!(stderr.matches("ERROR").count(), 1, "{stderr}");
    let count: i64 =
        connect_as(&only.pg, DATABASE, OWNER).query_one("SELECT count(*) FROM outbox.messages", &[]).unwrap().get(0);
    assert_eq!(count, 1);
}
