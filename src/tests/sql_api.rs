// The SQL API inside one (rolled-back) transaction: what outbox_enqueue stores, and how it refuses
// bad input. Included into `lib.rs`'s `tests` module. Long, as a test file of a whole API is: each
// test reads on its own, and they share the helpers at the top.

use pgrx::prelude::*;

/// Runs `sql` in a subtransaction and returns the SQLSTATE and message it raised. The
/// subtransaction is rolled back, as a client's savepoint would be, so that nothing the failed
/// statement did (rows, `SET search_path` of a function) leaks into the rest of the test.
fn error_of(sql: &str) -> (String, String) {
    let sql = sql.to_string();
    // SAFETY: the usual PL exception-block protocol: remember context and owner, start an internal
    // subtransaction, and on error roll it back and restore both.
    let (context, owner) = unsafe {
        let saved = (pg_sys::CurrentMemoryContext, pg_sys::CurrentResourceOwner);
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        saved
    };
    let caught = PgTryBuilder::new(move || {
        Spi::run(&sql).expect("statement");
        None
    })
    .catch_others(|caught| match caught {
        pgrx::pg_sys::panic::CaughtError::PostgresError(report)
        | pgrx::pg_sys::panic::CaughtError::ErrorReport(report)
        | pgrx::pg_sys::panic::CaughtError::RustPanic { ereport: report, .. } => Some((
            format!("{:?}", report.sql_error_code()),
            format!(
                "{} | detail: {} | hint: {}",
                report.message(),
                report.detail().unwrap_or(""),
                report.hint().unwrap_or("")
            ),
        )),
    })
    .execute();
    unsafe {
        pg_sys::RollbackAndReleaseCurrentSubTransaction();
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
    }
    caught.expect("the statement must fail")
}

fn count_messages() -> i64 {
    Spi::get_one::<i64>("SELECT count(*) FROM outbox.messages").unwrap().unwrap()
}

#[pg_test]
fn enqueue_stores_one_pending_row_and_returns_its_event_id() {
    let event_id = Spi::get_one::<pgrx::Uuid>(
        "SELECT outbox_enqueue('payment', 'p-1', 'payment.created', '{\"amount\": 100}', '{\"trace\": \"t1\"}', 'custom:stream')",
    )
    .unwrap()
    .unwrap();
    let row = Spi::get_one::<String>(
        "SELECT concat_ws('|', aggregate_type, aggregate_id, event_type, payload::text, headers::text, stream, status, attempts)
           FROM outbox.messages",
    )
    .unwrap()
    .unwrap();
    assert_eq!(row, "payment|p-1|payment.created|{\"amount\": 100}|{\"trace\": \"t1\"}|custom:stream|pending|0");
    let stored = Spi::get_one::<pgrx::Uuid>("SELECT event_id FROM outbox.messages").unwrap().unwrap();
    assert_eq!(stored, event_id);
    // UUIDv7: version nibble 7.
    assert_eq!(stored.as_bytes()[6] >> 4, 7);
}

#[pg_test]
fn enqueue_finds_its_row_through_both_indexes() {
    // The row is inserted beside the executor (src/enqueue/mod.rs): its index entries must be there.
    let event_id = Spi::get_one::<pgrx::Uuid>("SELECT outbox_enqueue('idx', 'a', 'e', '{}')").unwrap().unwrap();
    Spi::run("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off").unwrap();
    let by_event_id = Spi::get_one_with_args::<i64>(
        "SELECT count(*) FROM outbox.events WHERE event_id = $1",
        &[event_id.into()],
    )
    .unwrap();
    let by_shard = Spi::get_one::<i64>(
        "SELECT count(*) FROM outbox.events WHERE shard = tests.shard_of('idx', 'a') AND txid = pg_current_xact_id()",
    )
    .unwrap();
    assert_eq!((by_event_id, by_shard), (Some(1), Some(1)));
}

#[pg_test]
fn a_per_database_redis_url_may_not_carry_a_password() {
    // pg_db_role_setting is readable by every role: a password there would be public.
    let (sqlstate, message) = error_of("ALTER DATABASE pgrx_tests SET outbox.redis_url = 'redis://relay:s3cret@h:1'");
    assert_eq!(sqlstate, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
    assert!(message.contains("may not carry a password"), "{message}");
    assert!(message.contains("outbox.redis_password_file"), "{message}");
    assert!(!message.contains("s3cret"), "{message}");
    // Every form a secret takes: a socket URL's pass= (the redis crate reads it), password=, a
    // userinfo password in any URL of a list (review of issue 28, 10a).
    for (target, url) in [
        ("DATABASE pgrx_tests", "redis+unix:///tmp/redis.sock?pass=S3cretUnix"),
        ("ROLE CURRENT_USER", "redis+unix:///tmp/redis.sock?db=0&pass=S3cretRole"),
        ("DATABASE pgrx_tests", "unix:///tmp/redis.sock?P%61SS=S3cret"),
        ("DATABASE pgrx_tests", "redis://h:1/0?password=S3cret"),
        ("ROLE CURRENT_USER", "redis://h:1,redis://a:2, rediss://:S3cret@b:3"),
        // The `@` after the password forgotten, or the scheme mistyped (found by attack).
        ("DATABASE pgrx_tests", "redis://:S3cretNoAt127.0.0.1:6379/0"),
        ("ROLE CURRENT_USER", "valkey://:S3cretScheme127.0.0.1:6379"),
    ] {
        let (sqlstate, message) = error_of(&format!("ALTER {target} SET outbox.redis_url = '{url}'"));
        assert_eq!(sqlstate, "ERRCODE_INVALID_PARAMETER_VALUE", "{url}: {message}");
        assert!(message.contains("may not carry a password"), "{url}: {message}");
        assert!(!message.contains("S3cret"), "{message}");
    }
    Spi::run("ALTER DATABASE pgrx_tests SET outbox.redis_url = 'redis://relay@h:1'").unwrap();
    Spi::run("ALTER DATABASE pgrx_tests SET outbox.redis_url = 'redis+unix:///tmp/redis.sock?db=0&user=relay'").unwrap();
    Spi::run("ALTER DATABASE pgrx_tests RESET outbox.redis_url").unwrap();
}

#[pg_test]
fn enqueue_in_a_read_only_transaction_is_refused_like_an_insert() {
    Spi::run("SET LOCAL transaction_read_only = on").unwrap();
    let (sqlstate, message) = error_of("SELECT outbox_enqueue('ro', 1, 'e', '{}')");
    assert_eq!(sqlstate, "ERRCODE_READ_ONLY_SQL_TRANSACTION", "{message}");
    assert!(message.contains("read-only transaction"), "{message}");
}

#[pg_test]
fn a_log_table_someone_changed_gets_its_row_through_the_executor() {
    // A DBA's audit trigger on the log: the direct insert would skip it, so enqueue must not. It
    // runs with the owner's rights under search_path = pg_catalog, pg_temp (the caller's path must
    // not pick what it calls), so it names its table with its schema.
    Spi::run(
        "CREATE TABLE tests.audited (event_id uuid, search_path text);
         CREATE FUNCTION tests.audit() RETURNS trigger LANGUAGE plpgsql AS
             $$BEGIN INSERT INTO tests.audited VALUES (NEW.event_id, current_setting('search_path')); RETURN NEW; END$$;
         CREATE TRIGGER audit BEFORE INSERT ON outbox.events_0 FOR EACH ROW EXECUTE FUNCTION tests.audit();
         CREATE TRIGGER audit BEFORE INSERT ON outbox.events_1 FOR EACH ROW EXECUTE FUNCTION tests.audit();
         CREATE TRIGGER audit BEFORE INSERT ON outbox.events_2 FOR EACH ROW EXECUTE FUNCTION tests.audit();",
    )
    .unwrap();
    Spi::run("SET LOCAL search_path = tests, public").unwrap();
    let event_id = Spi::get_one::<pgrx::Uuid>("SELECT outbox_enqueue('audit', 1, 'e', '{}')").unwrap().unwrap();
    let audited = Spi::get_one::<String>("SELECT event_id::text || ' ' || search_path FROM tests.audited").unwrap();
    assert_eq!(audited, Some(format!("{event_id} pg_catalog, pg_temp")));
    assert_eq!(Spi::get_one::<String>("SELECT current_setting('search_path')").unwrap().unwrap(), "tests, public");
    assert_eq!(count_messages(), 1);
}

#[pg_test]
fn enqueue_accepts_bigint_uuid_and_named_arguments_without_casts() {
    Spi::run("SELECT outbox_enqueue('order', 42, 'order.placed', '{}')").unwrap();
    Spi::run("SELECT outbox_enqueue('order', 42::bigint, 'order.placed', '{}')").unwrap();
    Spi::run("SELECT outbox_enqueue('order', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid, 'order.placed', '{}')").unwrap();
    Spi::run(
        "SELECT outbox_enqueue(aggregate_type => 'order', aggregate_id => 7, event_type => 'order.paid',
                               payload => 'null', stream => 'orders')",
    )
    .unwrap();
    let ids = Spi::get_one::<String>("SELECT string_agg(aggregate_id, ',' ORDER BY id) FROM outbox.messages")
        .unwrap()
        .unwrap();
    assert_eq!(ids, "42,42,a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11,7");
    // JSON null is a valid payload; the stream default is NULL (template decides).
    let last = Spi::get_one::<String>(
        "SELECT payload::text || '|' || stream || '|' || (headers IS NULL) FROM outbox.messages ORDER BY id DESC LIMIT 1",
    )
    .unwrap()
    .unwrap();
    assert_eq!(last, "null|orders|true");
}

#[pg_test]
fn enqueue_is_callable_without_schema_prefix_from_default_search_path() {
    Spi::run("SET LOCAL search_path = \"$user\", public").unwrap();
    Spi::run("SELECT outbox_enqueue('a', 'b', 'c', '{}')").unwrap();
    assert_eq!(count_messages(), 1);
}

#[pg_test]
fn enqueue_rejects_null_and_empty_identifiers_with_named_argument() {
    for (sql, code, needle) in [
        ("SELECT outbox_enqueue(NULL, 'x', 'e', '{}')", "ERRCODE_NULL_VALUE_NOT_ALLOWED", "aggregate_type must not be NULL"),
        ("SELECT outbox_enqueue('', 'x', 'e', '{}')", "ERRCODE_INVALID_PARAMETER_VALUE", "aggregate_type must not be empty"),
        ("SELECT outbox_enqueue('a', NULL::text, 'e', '{}')", "ERRCODE_NULL_VALUE_NOT_ALLOWED", "aggregate_id must not be NULL"),
        ("SELECT outbox_enqueue('a', NULL::bigint, 'e', '{}')", "ERRCODE_NULL_VALUE_NOT_ALLOWED", "aggregate_id must not be NULL"),
        ("SELECT outbox_enqueue('a', '', 'e', '{}')", "ERRCODE_INVALID_PARAMETER_VALUE", "aggregate_id must not be empty"),
        ("SELECT outbox_enqueue('a', 'x', NULL, '{}')", "ERRCODE_NULL_VALUE_NOT_ALLOWED", "event_type must not be NULL"),
        ("SELECT outbox_enqueue('a', 'x', '', '{}')", "ERRCODE_INVALID_PARAMETER_VALUE", "event_type must not be empty"),
        ("SELECT outbox_enqueue('a', 'x', 'e', NULL)", "ERRCODE_NULL_VALUE_NOT_ALLOWED", "payload must not be NULL"),
    ] {
        let (sqlstate, message) = error_of(sql);
        assert_eq!(sqlstate, code, "{sql}: {message}");
        assert!(message.contains(needle), "{sql}: {message}");
        assert!(message.contains("hint: ") && !message.ends_with("hint: "), "{sql} has no hint: {message}");
    }
    assert_eq!(count_messages(), 0);
}

#[pg_test]
fn enqueue_rejects_headers_that_are_not_an_object() {
    for headers in ["'[1,2]'", "'\"text\"'", "'42'", "'null'"] {
        let (sqlstate, message) = error_of(&format!("SELECT outbox_enqueue('a', 'x', 'e', '{{}}', {headers})"));
        assert_eq!(sqlstate, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
        assert!(message.contains("headers must be a JSON object"), "{message}");
    }
    assert_eq!(count_messages(), 0);
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The headers stored with the last event enqueued.
fn last_headers() -> Option<pgrx::JsonB> {
    Spi::get_one::<pgrx::JsonB>("SELECT headers FROM outbox.messages ORDER BY id DESC LIMIT 1").unwrap()
}

#[pg_test]
fn enqueue_keeps_the_trace_context_of_its_headers_or_of_its_transaction() {
    let headers = format!(r#"{{"traceparent": "{TRACEPARENT}", "tracestate": "rojo=1", "tenant": "t1"}}"#);
    Spi::run(&format!("SELECT outbox_enqueue('a', 'x', 'e', '{{}}', '{headers}')")).unwrap();
    let stored = last_headers().unwrap().0;
    assert_eq!(stored, serde_json::from_str::<serde_json::Value>(&headers).unwrap());

    // From the transaction's settings, added to the headers (or making them).
    Spi::run(&format!("SET LOCAL outbox.traceparent = '{TRACEPARENT}'")).unwrap();
    Spi::run("SELECT outbox_enqueue('a', 'x', 'e', '{}')").unwrap();
    assert_eq!(last_headers().unwrap().0, serde_json::json!({"traceparent": TRACEPARENT}));
    Spi::run("SET LOCAL outbox.tracestate = 'congo=t61rcWkgMzE'").unwrap();
    Spi::run(r#"SELECT outbox_enqueue('a', 'x', 'e', '{}', '{"tenant": "t1", "n": 1.10}')"#).unwrap();
    assert_eq!(
        last_headers().unwrap().0,
        serde_json::json!({"tenant": "t1", "n": 1.10, "traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE"})
    );
    // The headers' own trace context wins over the settings'.
    let other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    Spi::run(&format!(r#"SELECT outbox_enqueue('a', 'x', 'e', '{{}}', '{{"traceparent": "{other}"}}')"#)).unwrap();
    assert_eq!(last_headers().unwrap().0, serde_json::json!({"traceparent": other}));
    // Unset (RESET, or empty), nothing is added.
    Spi::run("RESET outbox.traceparent; SET LOCAL outbox.tracestate = ''").unwrap();
    Spi::run("SELECT outbox_enqueue('a', 'x', 'e', '{}')").unwrap();
    assert!(last_headers().is_none());
    assert_eq!(count_messages(), 5);
}

#[pg_test]
fn a_bad_trace_context_refuses_the_event_and_names_it() {
    let invalid = "ERRCODE_INVALID_PARAMETER_VALUE";
    for (headers, says) in [
        (r#"{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"}"#, "headers' traceparent '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7' is not valid: it must be four parts"),
        (r#"{"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"}"#, "the trace id must not be all zeros"),
        (r#"{"traceparent": "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"}"#, "the trace id must be 32 lowercase hex digits"),
        (r#"{"traceparent": 1}"#, "headers' traceparent must be a JSON string, got a JSON number"),
        (r#"{"tracestate": "rojo=1"}"#, "headers carry a tracestate ('rojo=1') but no traceparent"),
    ] {
        let (code, message) = error_of(&format!("SELECT outbox_enqueue('a', 'x', 'e', '{{}}', '{headers}')"));
        assert_eq!(code, invalid, "{message}");
        assert!(message.contains(says) && message.contains("hint: "), "{message}");
    }
    let (code, message) = error_of(&format!(
        r#"SELECT outbox_enqueue('a', 'x', 'e', '{{}}', '{{"traceparent": "{TRACEPARENT}", "tracestate": "Rojo=1"}}')"#
    ));
    assert_eq!(code, invalid, "{message}");
    assert!(message.contains("headers' tracestate 'Rojo=1' is not valid: key \"Rojo\"") && message.contains("tracestate looks like"), "{message}");

    // The settings refuse a bad value when it is set, naming it.
    let (code, message) = error_of("SET LOCAL outbox.traceparent = '01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'");
    assert_eq!(code, invalid, "{message}");
    assert!(message.contains(r#"invalid value for parameter "outbox.traceparent": "01-4bf92f"#), "{message}");
    assert!(message.contains("detail: version 01 is not supported, only 00") && message.contains("version 00, lowercase hex"), "{message}");
    let (code, message) = error_of(&format!("SET LOCAL outbox.tracestate = '{}'", (0..33).map(|n| format!("k{n}=v")).collect::<Vec<_>>().join(",")));
    assert_eq!(code, invalid, "{message}");
    assert!(message.contains("detail: it has more than 32 members"), "{message}");
    // A tracestate without its traceparent is refused at enqueue.
    Spi::run("SET LOCAL outbox.tracestate = 'rojo=1'").unwrap();
    let (code, message) = error_of("SELECT outbox_enqueue('a', 'x', 'e', '{}')");
    assert_eq!(code, invalid, "{message}");
    assert!(message.contains("outbox.tracestate is set ('rojo=1') but outbox.traceparent is not"), "{message}");
    assert_eq!(count_messages(), 0);
}

#[pg_test]
fn the_entry_format_settings_refuse_what_they_cannot_write() {
    Spi::run("SET LOCAL outbox.entry_format = 'cloudevents'").unwrap();
    let (code, message) = error_of("SET LOCAL outbox.entry_format = 'xml'");
    assert_eq!(code, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
    Spi::run("SET LOCAL outbox.cloudevents_source = 'https://example.com/{database}/{event_type}'").unwrap();
    for (source, says) in [
        ("/outbox/{tenant}", r#""{tenant}" is not one of its placeholders ({database}, {aggregate_type}, {event_type})"#),
        ("/out box", "which a URI reference cannot hold"),
        ("", "it is empty"),
        // Review of issue 28, 11: only URI references (RFC 3986), the value named.
        (
            "urn:x:{database}/{aggregate_type}/{event_type}?q=%zz#\"<>",
            r#""urn:x:{database}/{aggregate_type}/{event_type}?q=%zz#\"<>" is not a URI reference"#,
        ),
        ("/a<b>", "'<' at byte 2 may not appear in its path"),
        ("/a\"b", "is not a URI reference"),
        ("/a%4", "is not a percent-escape"),
    ] {
        let (code, message) = error_of(&format!("SET LOCAL outbox.cloudevents_source = '{source}'"));
        assert_eq!(code, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
        assert!(message.contains(says) && message.contains("hint: Use a URI reference"), "{message}");
    }
}

#[pg_test]
fn a_blank_or_overlong_stream_template_is_refused() {
    Spi::run("SET LOCAL outbox.stream = '{tenant}:{aggregate_type}'").unwrap();
    for (template, says) in [("", "\"\" is blank"), ("  ", "is blank"), (&"s".repeat(513), "513 bytes long")] {
        let (code, message) = error_of(&format!("SET LOCAL outbox.stream = '{template}'"));
        assert_eq!(code, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
        assert!(message.contains(says) && message.contains("hint: Use a Redis key of 1 to 512 bytes"), "{message}");
    }
}

/// outbox.max_databases sizes the entries' shared memory at server start: what
/// pg_shmem_allocations shows is exactly `ENTRY_BYTES` per entry.
#[pg_test]
fn the_database_entries_take_their_bytes_per_entry_of_shared_memory() {
    let entries = Spi::get_one::<String>("SHOW outbox.max_databases").unwrap().unwrap();
    assert_eq!(entries, "16");
    assert_eq!(crate::shared::database_entries(), 16);
    let bytes = Spi::get_one::<i64>(
        "SELECT sum(size)::bigint FROM pg_shmem_allocations
          WHERE name IN ('outbox_pg_databases', 'outbox_pg_last_errors', 'outbox_pg_in_flight')",
    )
    .unwrap()
    .unwrap();
    assert_eq!(bytes as usize, 16 * crate::shared::ENTRY_BYTES);
    // The figure README's Settings table gives.
    let per_entry = crate::shared::ENTRY_BYTES;
    let readme = include_str!("../../README.md");
    let row = readme.lines().find(|line| line.starts_with("| `outbox.max_databases`")).expect("README's row");
    assert!(row.contains(&format!("{},{:03} bytes", per_entry / 1000, per_entry % 1000)), "{per_entry} bytes: {row}");
    let (code, message) = error_of("SET outbox.max_databases = 64");
    assert_eq!(code, "ERRCODE_CANT_CHANGE_RUNTIME_PARAM", "{message}");
}

#[pg_test]
fn enqueue_rejects_payloads_over_max_payload_size() {
    Spi::run("SET LOCAL outbox.max_payload_size = '1kB'").unwrap();
    Spi::run("SELECT outbox_enqueue('a', 'x', 'e', to_jsonb(repeat('x', 1000)))").unwrap();
    let (sqlstate, message) = error_of("SELECT outbox_enqueue('a', 'x', 'e', to_jsonb(repeat('x', 1100)))");
    assert_eq!(sqlstate, "ERRCODE_PROGRAM_LIMIT_EXCEEDED", "{message}");
    assert!(message.contains("payload is 1102 bytes") && message.contains("1024 bytes"), "{message}");
    assert_eq!(count_messages(), 1);
}

#[pg_test]
fn enqueue_rejects_empty_and_overlong_stream_names() {
    let (sqlstate, message) = error_of("SELECT outbox_enqueue('a', 'x', 'e', '{}', NULL, '')");
    assert_eq!(sqlstate, "ERRCODE_INVALID_PARAMETER_VALUE");
    assert!(message.contains("stream must not be empty"), "{message}");
    let (sqlstate, message) = error_of("SELECT outbox_enqueue('a', 'x', 'e', '{}', NULL, repeat('s', 513))");
    assert_eq!(sqlstate, "ERRCODE_INVALID_PARAMETER_VALUE");
    assert!(message.contains("513 bytes"), "{message}");
    Spi::run("SELECT outbox_enqueue('a', 'x', 'e', '{}', NULL, repeat('s', 512))").unwrap();
    assert_eq!(count_messages(), 1);
    // A blank name is as empty as '' (review of issue 28, 11).
    for blank in ["   ", " \t "] {
        let (sqlstate, message) = error_of(&format!("SELECT outbox_enqueue('a', 'x', 'e', '{{}}', stream => E'{}')", blank.replace('\t', "\\t")));
        assert_eq!(sqlstate, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
        assert!(message.contains("stream must not be empty or blank") && message.contains("hint: "), "{message}");
    }
    assert_eq!(count_messages(), 1);
}

/// Review of issue 28, 11: the headers' limit held for the argument only, so the trace context of
/// outbox.traceparent/outbox.tracestate merged in made stored headers larger than the limit.
#[pg_test]
fn the_headers_limit_holds_with_the_trace_context_merged_in() {
    Spi::run("SET LOCAL outbox.traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'").unwrap();
    Spi::run("SET LOCAL outbox.tracestate = 'rojo=00f067aa0ba902b7'").unwrap();
    // {"h": "x...x"} is 9 bytes plus the x's: 65,500 bytes alone, over 65,536 merged.
    let (code, message) =
        error_of("SELECT outbox_enqueue('t', 1, 'e', '{}', jsonb_build_object('h', repeat('x', 65491)))");
    assert_eq!(code, "ERRCODE_PROGRAM_LIMIT_EXCEEDED", "{message}");
    assert!(message.contains("with the trace context") && message.contains("the limit is 65536 bytes"), "{message}");
    assert!(message.contains("hint: "), "{message}");
    assert_eq!(count_messages(), 0);
    Spi::run("SELECT outbox_enqueue('t', 1, 'e', '{}', jsonb_build_object('h', repeat('x', 65000)))").unwrap();
    assert_eq!(count_messages(), 1);
}

/// Review of issue 28, 11: consumer names are bounded like aggregate and event types (255 bytes).
#[pg_test]
fn mark_processed_refuses_an_overlong_consumer_name() {
    let (code, message) = error_of("SELECT outbox_mark_processed(repeat('c', 256), gen_random_uuid())");
    assert_eq!(code, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
    assert!(message.contains("consumer name is 256 bytes long") && message.contains("the limit is 255 bytes"), "{message}");
    assert!(message.contains("hint: "), "{message}");
    let (code, message) = error_of("SELECT outbox_mark_processed(repeat('c', 100000), gen_random_uuid())");
    assert_eq!(code, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
    assert!(message.len() < 1000, "the name is not repeated whole: {message}");
    assert_eq!(
        Spi::get_one::<bool>("SELECT outbox_mark_processed(repeat('c', 255), gen_random_uuid())").unwrap(),
        Some(true)
    );
}

/// Shared buffers a statement touched (hits and reads), from EXPLAIN (ANALYZE, BUFFERS): a count
/// of pages, not a time, so it is the same on every machine.
fn buffers_touched(query: &str) -> i64 {
    Spi::get_one_with_args::<i64>(
        "SELECT outbox_test_buffers($1)",
        &[query.into()],
    )
    .unwrap()
    .unwrap()
}

fn create_buffers_helper() {
    Spi::run(
        "CREATE FUNCTION outbox_test_buffers(query text) RETURNS bigint LANGUAGE plpgsql AS $$
         DECLARE plan json;
         BEGIN
             EXECUTE 'EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ' || query INTO plan;
             RETURN (plan->0->'Plan'->>'Shared Hit Blocks')::bigint + (plan->0->'Plan'->>'Shared Read Blocks')::bigint;
         END $$",
    )
    .unwrap();
}

#[pg_test]
fn enqueue_bounds_every_argument_and_names_it() {
    for (sql, sqlstate, argument) in [
        (format!("SELECT outbox_enqueue('{}', 1, 'e', '{{}}')", "t".repeat(256)), "ERRCODE_INVALID_PARAMETER_VALUE", "aggregate_type is 256 bytes"),
        (format!("SELECT outbox_enqueue('t', '{}', 'e', '{{}}')", "i".repeat(1025)), "ERRCODE_INVALID_PARAMETER_VALUE", "aggregate_id is 1025 bytes"),
        (format!("SELECT outbox_enqueue('t', 1, '{}', '{{}}')", "e".repeat(256)), "ERRCODE_INVALID_PARAMETER_VALUE", "event_type is 256 bytes"),
        (
            "SELECT outbox_enqueue('t', 1, 'e', '{}', jsonb_build_object('h', repeat('x', 70000)))".to_string(),
            "ERRCODE_PROGRAM_LIMIT_EXCEEDED",
            "headers are 70009 bytes",
        ),
    ] {
        let (code, message) = error_of(&sql);
        assert_eq!(code, sqlstate, "{message}");
        assert!(message.contains(argument) && message.contains("hint: "), "{message}");
    }
    // The bounds are inclusive, in bytes (a 2-byte character counts twice).
    Spi::run(&format!("SELECT outbox_enqueue('{}', '{}', '{}', '{{}}')", "t".repeat(255), "i".repeat(1024), "é".repeat(127)))
        .unwrap();
    assert_eq!(count_messages(), 1);
    // The payload limit cannot be raised past what Redis accepts in one argument.
    let (code, message) = error_of("SET outbox.max_payload_size = '1GB'");
    assert_eq!(code, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
}


#[pg_test]
fn enqueue_refuses_streams_outside_allowed_streams() {
    Spi::run("SET LOCAL outbox.allowed_streams = 'outbox:*, audit:?'").unwrap();
    Spi::run("SELECT outbox_enqueue('payment', 1, 'e', '{}')").unwrap(); // outbox:payment by the template
    Spi::run("SELECT outbox_enqueue('payment', 1, 'e', '{}', stream => 'audit:1')").unwrap();
    let (code, message) = error_of("SELECT outbox_enqueue('payment', 1, 'e', '{}', stream => 'billing:ledger')");
    assert_eq!(code, "ERRCODE_INSUFFICIENT_PRIVILEGE", "{message}");
    assert!(message.contains("\"billing:ledger\" (the stream argument)") && message.contains("outbox:*, audit:?"), "{message}");
    // The template is checked too: a writer's aggregate_type must not lead outside the patterns.
    Spi::run("SET LOCAL outbox.allowed_streams = 'outbox:payment'").unwrap();
    let (code, message) = error_of("SELECT outbox_enqueue('billing', 1, 'e', '{}')");
    assert_eq!(code, "ERRCODE_INSUFFICIENT_PRIVILEGE", "{message}");
    assert!(message.contains("\"outbox:billing\" (outbox.stream ('outbox:{aggregate_type}') for this event)"), "{message}");
    assert_eq!(count_messages(), 2);
    let (code, message) = error_of("SET outbox.allowed_streams = 'outbox:*,'");
    assert_eq!(code, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
    // Only superusers may change it.
    Spi::run("CREATE ROLE test_streams_writer IN ROLE outbox_writer").unwrap();
    Spi::run("SET LOCAL ROLE test_streams_writer").unwrap();
    let (code, message) = error_of("SET outbox.allowed_streams = '*'");
    assert_eq!(code, "ERRCODE_INSUFFICIENT_PRIVILEGE", "{message}");
    Spi::run("RESET ROLE").unwrap();
}


#[pg_test]
fn a_consumer_name_belongs_to_the_role_that_used_it_first() {
    let id = "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid";
    Spi::run("CREATE ROLE test_consumer_a IN ROLE outbox_consumer").unwrap();
    Spi::run("CREATE ROLE test_consumer_b IN ROLE outbox_consumer").unwrap();
    Spi::run("CREATE ROLE test_consumer_admin IN ROLE outbox_admin").unwrap();
    Spi::run("GRANT USAGE ON SCHEMA tests TO test_consumer_a, test_consumer_b").unwrap();
    Spi::run("SET LOCAL ROLE test_consumer_a").unwrap();
    assert_eq!(Spi::get_one::<bool>(&format!("SELECT outbox_mark_processed('mailer', {id})")).unwrap(), Some(true));
    Spi::run("RESET ROLE").unwrap();
    Spi::run("SET LOCAL ROLE test_consumer_b").unwrap();
    // b may not pre-mark events for a's consumer (a would then skip them).
    let (code, message) = error_of("SELECT outbox_mark_processed('mailer', gen_random_uuid())");
    assert_eq!(code, "ERRCODE_INSUFFICIENT_PRIVILEGE", "{message}");
    assert!(message.contains("belongs to role test_consumer_a, not to test_consumer_b"), "{message}");
    assert_eq!(Spi::get_one::<bool>(&format!("SELECT outbox_mark_processed('sms', {id})")).unwrap(), Some(true));
    Spi::run("RESET ROLE").unwrap();
    // An admin releases the name; then b may take it.
    Spi::run("SET LOCAL ROLE test_consumer_admin").unwrap();
    Spi::run("DELETE FROM outbox.consumers WHERE consumer = 'mailer'").unwrap();
    Spi::run("RESET ROLE").unwrap();
    Spi::run("SET LOCAL ROLE test_consumer_b").unwrap();
    assert_eq!(Spi::get_one::<bool>("SELECT outbox_mark_processed('mailer', gen_random_uuid())").unwrap(), Some(true));
    Spi::run("RESET ROLE").unwrap();
}

#[pg_test]
fn mark_processed_is_true_once_per_consumer_and_event() {
    let id = "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid";
    let mark = |consumer: &str| {
        Spi::get_one::<bool>(&format!("SELECT outbox_mark_processed('{consumer}', {id})")).unwrap().unwrap()
    };
    assert!(mark("notifications"));
    assert!(!mark("notifications"));
    assert!(mark("billing"), "each consumer deduplicates on its own");
    let (sqlstate, message) = error_of("SELECT outbox_mark_processed('', gen_random_uuid())");
    assert_eq!(sqlstate, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
    let (sqlstate, _) = error_of("SELECT outbox_mark_processed(NULL, gen_random_uuid())");
    assert_eq!(sqlstate, "ERRCODE_NULL_VALUE_NOT_ALLOWED");
    let (sqlstate, _) = error_of("SELECT outbox_mark_processed('x', NULL)");
    assert_eq!(sqlstate, "ERRCODE_NULL_VALUE_NOT_ALLOWED");
    Spi::run("UPDATE outbox.processed_messages SET processed_at = now() - interval '8 days' WHERE consumer = 'billing'")
        .unwrap();
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.purge_processed('7 days')").unwrap(), Some(1));
    assert!(!mark("notifications"));
    // The relay's retention step deletes marks older than its window too.
    Spi::run("UPDATE outbox.processed_messages SET processed_at = now() - interval '2 days' WHERE consumer = 'notifications'")
        .unwrap();
    assert!(Spi::get_one::<i64>("SELECT outbox._retention(interval '1 day')").unwrap().unwrap() >= 1);
    assert_eq!(Spi::get_one::<i64>("SELECT count(*) FROM outbox.processed_messages WHERE consumer = 'notifications'").unwrap(), Some(0));
}


#[pg_test]
fn writers_enqueue_without_reading_and_only_admins_operate() {
    Spi::run("CREATE ROLE test_writer IN ROLE outbox_writer").unwrap();
    Spi::run("CREATE ROLE test_admin IN ROLE outbox_admin").unwrap();
    Spi::run("CREATE ROLE test_nobody").unwrap();
    Spi::run("GRANT USAGE ON SCHEMA tests TO test_writer, test_admin, test_nobody").unwrap();

    Spi::run("SET LOCAL ROLE test_writer").unwrap();
    Spi::run("SELECT outbox_enqueue('sec', 1, 'e', '{\"secret\": 1}')").unwrap();
    for sql in [
        "SELECT count(*) FROM outbox.messages",
        "SELECT outbox.retry_failed()",
        "SELECT outbox.purge('0')",
        "SELECT outbox.forget_aggregates()",
        "SELECT * FROM outbox.stats",
        "SELECT count(*) FROM outbox._claim_shards(1, 1, 1000)",
        "SELECT count(*) FROM outbox.events_0",
    ] {
        let (sqlstate, message) = error_of(sql);
        assert_eq!(sqlstate, "ERRCODE_INSUFFICIENT_PRIVILEGE", "writer ran {sql}: {message}");
    }

    Spi::run("RESET ROLE").unwrap();
    Spi::run("SET LOCAL ROLE test_nobody").unwrap();
    let (sqlstate, message) = error_of("SELECT outbox_enqueue('sec', 2, 'e', '{}')");
    assert_eq!(sqlstate, "ERRCODE_INSUFFICIENT_PRIVILEGE", "{message}");

    Spi::run("RESET ROLE").unwrap();
    Spi::run("SET LOCAL ROLE test_admin").unwrap();
    assert_eq!(Spi::get_one::<i64>("SELECT count(*) FROM outbox.messages").unwrap(), Some(1));
    // The event is this transaction's own, not committed: not pending yet (admins may read stats).
    assert_eq!(Spi::get_one::<i64>("SELECT pending FROM outbox.stats").unwrap(), Some(0));
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.retry_failed()").unwrap(), Some(0));
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.purge('0')").unwrap(), Some(0));
    // The writer's aggregate still has its event: nothing to forget.
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.forget_aggregates()").unwrap(), Some(0));
    let (sqlstate, _) = error_of("SELECT outbox_enqueue('sec', 3, 'e', '{}')");
    assert_eq!(sqlstate, "ERRCODE_INSUFFICIENT_PRIVILEGE");
    let (sqlstate, _) = error_of("SELECT count(*) FROM outbox._claim_shards(1, 1, 1000)");
    assert_eq!(sqlstate, "ERRCODE_INSUFFICIENT_PRIVILEGE");
    Spi::run("RESET ROLE").unwrap();
}


/// A snapshot in which this test's own transaction counts as committed. A transaction never sees
/// itself as committed in its own snapshots (its id is at or above their xmax), and every pg_test
/// is one transaction, so the tests read "up to" this instead.
const UPTO: &str = "tests.cursor_below(pg_current_snapshot(), pg_current_xact_id()::text::bigint + 1)::pg_snapshot";

/// Every shard's batch for this transaction, read with `tests.read_shard` from the shard's cursor.
fn batch_ids(limit: i32) -> Vec<i64> {
    Spi::get_one_with_args::<Vec<i64>>(
        &format!(
            "SELECT coalesce(array_agg(b.id ORDER BY b.id), '{{}}')
               FROM outbox.shards s
              CROSS JOIN LATERAL tests.read_shard(s.shard, s.cursor, {UPTO}, $1) b"
        ),
        &[limit.into()],
    )
    .unwrap()
    .unwrap()
}

fn event_ids_of(condition: &str) -> Vec<i64> {
    Spi::get_one::<Vec<i64>>(&format!(
        "SELECT coalesce(array_agg(id ORDER BY id), '{{}}') FROM outbox.events WHERE {condition}"
    ))
    .unwrap()
    .unwrap()
}

/// Takes every shard from whoever holds it (the test instance's own relay), for this transaction.
fn take_all_shards() {
    Spi::run("UPDATE outbox.shards SET claimed_by = NULL, claimed_at = NULL").unwrap();
}

#[pg_test]
fn enqueue_writes_one_row_to_the_current_generation_with_its_shard_and_transaction() {
    Spi::run("SELECT outbox_enqueue('payment', 7, 'created', '{}'), outbox_enqueue('payment', 8, 'created', '{}')").unwrap();
    let row = Spi::get_one::<String>(
        "SELECT string_agg(concat_ws(':', generation, shard = tests.shard_of(aggregate_type, aggregate_id),
                                     txid = pg_current_xact_id()), ',' ORDER BY id)
           FROM outbox.events",
    )
    .unwrap()
    .unwrap();
    assert_eq!(row, "0:t:t,0:t:t");
    // Nothing else is written: no counter row, no status.
    assert_eq!(Spi::get_one::<i64>("SELECT count(*) FROM outbox.aggregates").unwrap(), Some(0));
    assert_eq!(Spi::get_one::<String>("SELECT string_agg(status, ',') FROM outbox.messages").unwrap().unwrap(), "pending,pending");
}

/// The order locks this transaction holds (userlocks of kind 2), and whether it holds the
/// past-the-cap lock (kind 3).
fn order_locks_held() -> (i64, bool) {
    let count = |kind: i32| {
        Spi::get_one_with_args::<i64>(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'userlock' AND objsubid = $1 AND pid = pg_backend_pid() AND granted",
            &[kind.into()],
        )
        .unwrap()
        .unwrap()
    };
    (count(2), count(3) == 1)
}

#[pg_test]
fn a_transaction_takes_at_most_256_order_locks() {
    Spi::run("SELECT outbox_enqueue('bulk', i, 'e', '{}') FROM generate_series(1, 300) i").unwrap();
    Spi::run("SELECT outbox_enqueue('bulk', 1, 'e', '{}')").unwrap();
    assert_eq!(order_locks_held(), (256, true), "256 order locks, then the past-the-cap lock");
}

/// The cap counts the order locks a transaction holds: a rolled-back subtransaction (an exception
/// block here; `ROLLBACK TO SAVEPOINT` in tests/interleavings.rs) releases those it took (issue 23,
/// item 4: a count of locks taken let a transaction that had rolled back 256 enqueues enqueue for a
/// new aggregate without its lock).
#[pg_test]
fn order_locks_released_by_a_rolled_back_subtransaction_do_not_count_against_the_cap() {
    Spi::run(
        "DO $$ BEGIN
             PERFORM outbox_enqueue('undone', i, 'e', '{}') FROM generate_series(1, 256) i;
             RAISE EXCEPTION 'undo';
         EXCEPTION WHEN raise_exception THEN NULL;
         END $$",
    )
    .unwrap();
    assert_eq!(order_locks_held(), (0, false), "the exception block's locks were released");
    Spi::run("SELECT outbox_enqueue('x', 'X', 'e', '{}')").unwrap();
    assert_eq!(order_locks_held(), (1, false), "a new aggregate gets its order lock");
    // A subtransaction that completes hands its locks to its parent: they still count.
    Spi::run(
        "DO $$ BEGIN
             BEGIN
                 PERFORM outbox_enqueue('kept', i, 'e', '{}') FROM generate_series(1, 255) i;
             EXCEPTION WHEN raise_exception THEN NULL;
             END;
         END $$",
    )
    .unwrap();
    Spi::run("SELECT outbox_enqueue('x', 'over', 'e', '{}')").unwrap();
    assert_eq!(order_locks_held(), (256, true), "256 held: the next aggregate is past the cap");
}

#[pg_test]
fn a_batch_is_what_became_visible_between_the_cursor_and_a_snapshot() {
    for aggregate in ["a", "b", "c", "a", "d"] {
        Spi::run(&format!("SELECT outbox_enqueue('t', '{aggregate}', 'e', '{{}}')")).unwrap();
    }
    let all = event_ids_of("true");
    assert_eq!(batch_ids(100), all);
    // Up to the cursor itself: nothing.
    let none = Spi::get_one::<i64>(
        "SELECT count(*) FROM outbox.shards s CROSS JOIN LATERAL tests.read_shard(s.shard, s.cursor, s.cursor, 100) b",
    )
    .unwrap();
    assert_eq!(none, Some(0));
    // A cursor cut below this transaction consumes nothing of it; one cut above consumes it all.
    let own = Spi::get_one::<i64>("SELECT pg_current_xact_id()::text::bigint").unwrap().unwrap();
    let below = Spi::get_one_with_args::<i64>(
        "SELECT count(*) FROM outbox.shards s
          CROSS JOIN LATERAL tests.read_shard(s.shard, s.cursor, tests.cursor_below(pg_current_snapshot(), $1)::pg_snapshot, 100) b",
        &[own.into()],
    )
    .unwrap();
    assert_eq!(below, Some(0));
    let above = Spi::get_one_with_args::<i64>(
        "SELECT count(*) FROM outbox.shards s
          CROSS JOIN LATERAL tests.read_shard(s.shard, s.cursor, tests.cursor_below(pg_current_snapshot(), $1)::pg_snapshot, 100) b",
        &[(own + 1).into()],
    )
    .unwrap();
    assert_eq!(above, Some(5));
}

#[pg_test]
fn a_batch_formats_created_at_as_rfc3339_utc_with_microseconds() {
    Spi::run("SELECT outbox_enqueue('t', 'x', 'e', '{}')").unwrap();
    Spi::run("UPDATE outbox.events_0 SET created_at = '2026-11-29 20:00:00.123456+00'").unwrap();
    let created = Spi::get_one::<String>(&format!(
        "SELECT b.created_at FROM outbox.shards s
          CROSS JOIN LATERAL tests.read_shard(s.shard, s.cursor, {UPTO}, 10) b"
    ))
    .unwrap()
    .unwrap();
    assert_eq!(created, "2026-11-29T20:00:00.123456Z");
}

/// A transaction that was running when the cursor was taken is found through the cursor's
/// in-progress list; everything between it and the cursor's xmax was consumed and is not read
/// again. Counted in pages, not time: the same on every machine.
#[pg_test]
fn a_long_transaction_never_makes_a_batch_rescan_what_was_consumed() {
    create_buffers_helper();
    // 20,000 consumed events of transactions 1,001..21,000 in shard 3, and one event of
    // transaction 1,000, which the cursor saw running.
    Spi::run(
        "INSERT INTO outbox.events_0 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, created_at)
         SELECT (1000 + i)::text::xid8, 3, nextval('outbox.events_id_seq'), gen_random_uuid(), 't', i::text, 'e', '{}', now()
           FROM generate_series(0, 20000) i",
    )
    .unwrap();
    Spi::run("ANALYZE outbox.events_0").unwrap();
    let read = "SELECT * FROM tests.read_shard(3::smallint, '1000:21001:1000', '21001:21001:', 100)";
    let rows = Spi::get_one::<i64>(&format!("SELECT count(*) FROM ({read}) b")).unwrap();
    assert_eq!(rows, Some(1), "only the long transaction's event is new");
    let pages = buffers_touched(read);
    assert!(pages < 50, "reading one event past 20,000 consumed ones touched {pages} pages");
}

/// The relays read the log straight from its datums (src/log/window.rs); what they send must be what
/// PostgreSQL's own text forms give: the uuid, the jsonb texts (a large payload is toasted), NULLs,
/// and created_at in RFC 3339, UTC, whatever the session's time zone.
#[pg_test]
fn the_log_is_read_as_postgresql_writes_its_values() {
    Spi::run("SET LOCAL timezone = 'America/St_Johns'").unwrap();
    Spi::run(
        "SELECT outbox_enqueue('acct', 'ü-1', 'opened', jsonb_build_object('name', 'Zoë', 'n', 1.50, 'big', repeat('x', 100000)),
                               '{\"trace\": \"t-1\"}', 'custom:stream');
         SELECT outbox_enqueue('acct', 'ü-1', 'closed', '[1, {\"a\": null}]')",
    )
    .unwrap();
    let shard = Spi::get_one::<i16>("SELECT tests.shard_of('acct', 'ü-1')").unwrap().unwrap();
    let differences = Spi::get_one::<i64>(&format!(
        "SELECT count(*) FROM (
             SELECT b.id, b.event_id, b.aggregate_type, b.aggregate_id, b.event_type, b.payload, b.headers, b.stream, b.created_at
               FROM tests.read_shard({shard}::smallint, (SELECT cursor FROM outbox.shards WHERE shard = {shard}), {UPTO}, 1000) b
             EXCEPT
             SELECT e.id, e.event_id::text, e.aggregate_type, e.aggregate_id, e.event_type, e.payload::text, e.headers::text, e.stream,
                    to_char(e.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
               FROM outbox.events e) d"
    ))
    .unwrap();
    assert_eq!(differences, Some(0));
    let read = Spi::get_one::<i64>(&format!(
        "SELECT count(*) FROM tests.read_shard({shard}::smallint, (SELECT cursor FROM outbox.shards WHERE shard = {shard}), {UPTO}, 1000)"
    ))
    .unwrap();
    assert_eq!(read, Some(2));
    let (sqlstate, message) = error_of("SELECT * FROM tests.read_log(0::smallint, 'not a snapshot', '1:1:', 10)");
    assert_eq!(sqlstate, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
    assert!(message.contains("cursor \"not a snapshot\" is not a pg_snapshot"), "{message}");
}

/// `created_at` as the relays write it from the datum is what `to_char` gives (the failure path and
/// replays use it) at every edge PostgreSQL's timestamps have: years BC, past 9999, its last
/// instant (an overflow wrote a wrong date there), the infinities (found by attack).
#[pg_test]
fn created_at_is_written_as_to_char_writes_it() {
    // The zone is part of each finite literal: PostgreSQL 16 and later refuse "infinity UTC".
    for literal in [
        "-infinity",
        "4714-11-24 00:00:00 BC UTC",
        "0002-06-15 12:00:00 BC UTC",
        "0001-12-31 23:59:59.999999 BC UTC",
        "0001-01-01 00:00:00 UTC",
        "1999-12-31 23:59:59.999999 UTC",
        "2004-02-29 12:34:56.000001 UTC",
        "9999-12-31 23:59:59.999999 UTC",
        "10000-01-01 00:00:00 UTC",
        "294276-12-31 23:59:59.999999 UTC",
        "infinity",
    ] {
        let (at, expected) = Spi::get_two::<pgrx::datum::TimestampWithTimeZone, String>(&format!(
            "SELECT '{literal}'::timestamptz, to_char('{literal}'::timestamptz AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
        ))
        .unwrap();
        let microseconds: i64 = at.unwrap().into();
        assert_eq!(crate::log::datums::timestamptz_text(microseconds), expected.unwrap_or_default(), "{literal}");
    }
}

/// A backlog of one aggregate costs a batch no more than many aggregates do: the read is one index
/// range, whatever the aggregates.
#[pg_test]
fn reading_a_batch_of_one_aggregates_backlog_costs_a_few_pages_per_event() {
    create_buffers_helper();
    Spi::run("SELECT outbox_enqueue('acct', 'hot', 'e', '{}') FROM generate_series(1, 3000)").unwrap();
    let shard = Spi::get_one::<i16>("SELECT tests.shard_of('acct', 'hot')").unwrap().unwrap();
    let read = buffers_touched(&format!(
        "SELECT * FROM tests.read_shard({shard}::smallint, (SELECT cursor FROM outbox.shards WHERE shard = {shard}), {UPTO}, 1000)"
    ));
    assert!(read < 5_000, "reading 1,000 events of one aggregate touched {read} pages");
}

#[pg_test]
fn shards_are_claimed_up_to_a_share_with_a_lease_and_reaped() {
    take_all_shards();
    let mine = |share: i32| {
        Spi::get_one_with_args::<String>(
            "SELECT string_agg(shard::text, ',' ORDER BY shard) FROM outbox._claim_shards(pg_backend_pid(), $1, 30000)",
            &[share.into()],
        )
        .unwrap()
        .unwrap_or_default()
    };
    assert_eq!(mine(4), "0,1,2,3");
    assert_eq!(mine(4), "0,1,2,3", "a relay keeps its shards");
    assert_eq!(mine(2), "0,1", "and gives back what is above its share");
    // Shards of a process that is gone, or whose lease expired, are taken like free ones.
    Spi::run("UPDATE outbox.shards SET claimed_by = 1, claimed_at = now() WHERE shard BETWEEN 2 AND 5").unwrap();
    Spi::run(
        "UPDATE outbox.shards SET claimed_by = pg_backend_pid() + 1000000, claimed_at = now() - interval '2 minutes'
          WHERE shard BETWEEN 6 AND 7",
    )
    .unwrap();
    assert_eq!(mine(16), "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15");
    // The reaper frees them for anyone.
    Spi::run("UPDATE outbox.shards SET claimed_by = 1 WHERE shard = 15").unwrap();
    Spi::run("UPDATE outbox.shards SET claimed_at = now() - interval '2 minutes' WHERE shard = 14").unwrap();
    assert_eq!(Spi::get_one::<i64>("SELECT outbox._reap_shards(30000)").unwrap(), Some(2));
    let free = Spi::get_one::<i64>("SELECT count(*) FROM outbox.shards WHERE claimed_by IS NULL").unwrap();
    assert_eq!(free, Some(2));
    // A claim always says by whom and since when.
    let (code, message) = error_of("UPDATE outbox.shards SET claimed_at = NULL WHERE shard = 0");
    assert_eq!(code, "ERRCODE_CHECK_VIOLATION", "{message}");
}

/// Puts shard 0 behind two snapshots recorded over a second ago (150:160:155, then 170:180:); a
/// third, recent one is not a bound yet.
fn lag_shard_zero() {
    Spi::run("UPDATE outbox.shards SET cursor = '100:100:' WHERE shard = 0").unwrap();
    Spi::run(
        "INSERT INTO outbox.snapshots VALUES (now() - interval '5 seconds', '150:160:155'),
                                             (now() - interval '4 seconds', '170:180:'),
                                             (clock_timestamp(), pg_current_snapshot())",
    )
    .unwrap();
}

#[pg_test]
fn a_lagging_shard_reads_up_to_the_next_recorded_snapshot_not_the_whole_backlog() {
    take_all_shards();
    lag_shard_zero();
    let claim = |shard: i32| {
        Spi::get_one_with_args::<String>(
            "SELECT upto || ' ' || bounded FROM outbox._claim_shards(pg_backend_pid(), 16, 30000) WHERE shard = $1",
            &[shard.into()],
        )
        .unwrap()
        .unwrap()
    };
    let advance = |cursor: &str| {
        Spi::run_with_args(
            "SELECT outbox._advance(pg_backend_pid(), ARRAY[0]::smallint[], ARRAY[$1], ARRAY[NULL], ARRAY[NULL]::bigint[],
                                    ARRAY[NULL]::bigint[], '{}', '{}', '{}', '{}', '{}', '{}')",
            &[cursor.into()],
        )
        .unwrap()
    };
    // "Now" is the claim's own snapshot (the tests beside this one commit meanwhile): it is ahead
    // of every recorded one here.
    let up_to_now = |claimed: String| {
        let (upto, bounded) = claimed.split_once(' ').unwrap();
        let xmax: i64 = upto.split(':').nth(1).unwrap().parse().unwrap();
        xmax > 180 && bounded == "false"
    };
    assert_eq!(claim(0), "150:160:155 true", "the first recorded snapshot ahead of the cursor");
    assert!(up_to_now(claim(1)), "a shard that keeps up reads up to now");
    advance("150:160:155");
    assert_eq!(claim(0), "170:180: true", "then the next one");
    advance("170:180:");
    assert!(up_to_now(claim(0)), "caught up to within a second: up to now");
    // Housekeeping forgets the snapshots every cursor has reached, and records at most one a second.
    Spi::run("UPDATE outbox.shards SET cursor = '170:180:'").unwrap();
    assert_eq!(Spi::get_one::<bool>("SELECT outbox._record_snapshot(true)").unwrap(), Some(false));
    assert_eq!(Spi::get_one::<i64>("SELECT count(*) FROM outbox.snapshots").unwrap(), Some(1));
}

#[pg_test]
fn a_kept_claim_bounds_a_lagging_shard_like_the_claim_from_where_a_round_in_flight_leaves_it() {
    take_all_shards();
    Spi::run("SELECT outbox._claim_shards(pg_backend_pid(), 16, 30000)").unwrap();
    lag_shard_zero();
    let pid = Spi::get_one::<i32>("SELECT pg_backend_pid()").unwrap().unwrap();
    // What the relay's kept-claim statement gives shard 0: the cursor it reads from and the
    // recorded snapshot it reads up to (NULL: up to now), with `left` as the cursor a round in
    // flight leaves it at.
    let held = |left: Option<&str>| {
        let mut cursors: Vec<Option<String>> = vec![None; 16];
        cursors[0] = left.map(str::to_string);
        Spi::get_one_with_args::<String>(
            &format!(
                "SELECT h.cursor || ' ' || coalesce(h.recorded, 'now')
                   FROM ({}) h(shard, cursor, window_upto, max_id, last_id, now, recorded) WHERE h.shard = 0",
                crate::relay::read::HELD
            ),
            &[pid.into(), cursors.into()],
        )
        .unwrap()
        .unwrap()
    };
    assert_eq!(held(None), "100:100: 150:160:155", "from the stored cursor: the claim's bound");
    assert_eq!(held(Some("150:160:155")), "150:160:155 170:180:", "from where a round in flight leaves it: the next");
    assert_eq!(held(Some("170:180:")), "170:180: now", "within a second of now: up to now");
}

#[pg_test]
fn finishing_moves_only_the_shards_this_relay_holds_and_advances_the_counters() {
    take_all_shards();
    Spi::run("SELECT outbox._claim_shards(pg_backend_pid(), 1, 30000)").unwrap();
    Spi::run(
        "SELECT outbox._advance(pg_backend_pid(), ARRAY[0]::smallint[], ARRAY[pg_current_snapshot()::text],
                                ARRAY[NULL], ARRAY[NULL]::bigint[], ARRAY[NULL]::bigint[],
                                ARRAY['t', 't'], ARRAY['a', 'b'], ARRAY[3, 1]::bigint[], ARRAY[false, false], '{}', '{}')",
    )
    .unwrap();
    Spi::run(
        "SELECT outbox._advance(pg_backend_pid(), '{}'::smallint[], '{}'::text[], '{}', '{}', '{}', ARRAY['t'], ARRAY['a'],
                                ARRAY[2]::bigint[], ARRAY[true], '{}', '{}')",
    )
    .unwrap();
    // A counter the read found but that is gone by the finish is written again, with the others.
    Spi::run("DELETE FROM outbox.aggregates WHERE aggregate_id = 'b'").unwrap();
    Spi::run(
        "SELECT outbox._advance(pg_backend_pid(), '{}'::smallint[], '{}'::text[], '{}', '{}', '{}', ARRAY['t', 't'], ARRAY['a', 'b'],
                                ARRAY[3, 1]::bigint[], ARRAY[true, true], '{}', '{}')",
    )
    .unwrap();
    let counters = Spi::get_one::<String>(
        "SELECT string_agg(aggregate_id || '=' || last_seq, ',' ORDER BY aggregate_id) FROM outbox.aggregates",
    )
    .unwrap()
    .unwrap();
    assert_eq!(counters, "a=3,b=1", "counters never move back");
    let positions = Spi::get_one::<String>(
        "SELECT string_agg(ordinal || ':' || last_seq, ',' ORDER BY ordinal) FROM tests.counters(ARRAY['t', 't', 't'], ARRAY['x', 'b', 'a'])",
    )
    .unwrap()
    .unwrap();
    assert_eq!(positions, "2:1,3:3");
    let (code, message) = error_of(
        "SELECT outbox._advance(pg_backend_pid(), ARRAY[1]::smallint[], ARRAY[pg_current_snapshot()::text], ARRAY[NULL],
                                ARRAY[NULL]::bigint[], ARRAY[NULL]::bigint[], '{}', '{}', '{}', '{}', '{}', '{}')",
    );
    assert_eq!(code, "ERRCODE_LOCK_NOT_AVAILABLE", "a shard this relay does not hold: {message}");
}

#[pg_test]
fn the_failure_path_keeps_each_aggregates_order_until_retried_or_skipped() {
    for aggregate in ["a", "a", "b", "a"] {
        Spi::run(&format!("SELECT outbox_enqueue('t', '{aggregate}', 'e', '{{}}')")).unwrap();
    }
    let a = event_ids_of("aggregate_id = 'a'");
    let event_id = |id: i64| {
        Spi::get_one::<String>(&format!("SELECT event_id::text FROM outbox.events WHERE id = {id}")).unwrap().unwrap()
    };
    // a#1 rejected (backing off), a#2 waits behind it; b and a#3 are not held.
    let failed = Spi::get_one_with_args::<i64>(
        "SELECT outbox._hold($1::uuid[], ARRAY[1, 2]::bigint[], ARRAY['WRONGTYPE boom', NULL], 3, 60000)",
        &[vec![event_id(a[0]), event_id(a[1])].into()],
    )
    .unwrap();
    assert_eq!(failed, Some(0));
    let due = || {
        Spi::get_one::<String>(
            "SELECT coalesce(string_agg(aggregate_id || '#' || aggregate_seq, ',' ORDER BY id), '')
               FROM outbox._held_due(ARRAY(SELECT shard FROM outbox.shards), 100, true)",
        )
        .unwrap()
        .unwrap()
    };
    assert_eq!(due(), "", "a#1 backs off, a#2 waits behind it");
    let held = Spi::get_one::<String>(
        "SELECT string_agg(p::text, ',') FROM outbox._held_aggregates(ARRAY['t', 't'], ARRAY['b', 'a'], ARRAY(SELECT shard FROM outbox.shards)) p",
    )
    .unwrap()
    .unwrap();
    assert_eq!(held, "2", "a's new events must join the failure path");
    Spi::run("UPDATE outbox.held SET available_at = NULL").unwrap();
    assert_eq!(due(), "a#1,a#2");
    // Rejected twice more: failed at max_attempts 3, and its aggregate waits.
    for _ in 0..2 {
        Spi::run_with_args(
            "SELECT outbox._settle_held('{}', ARRAY[$1]::bigint[], ARRAY['WRONGTYPE boom'], 3, 10)",
            &[a[0].into()],
        )
        .unwrap();
        Spi::run("UPDATE outbox.held SET available_at = NULL WHERE status = 'waiting'").unwrap();
    }
    let states = Spi::get_one::<String>(
        "SELECT string_agg(status || ':' || rejections || ':' || coalesce(last_error, '-'), ',' ORDER BY id) FROM outbox.held",
    )
    .unwrap()
    .unwrap();
    assert_eq!(states, "failed:3:WRONGTYPE boom,waiting:0:-");
    assert_eq!(due(), "");
    let view = Spi::get_one::<String>(
        "SELECT string_agg(status || ':' || coalesce(aggregate_seq::text, '-'), ',' ORDER BY id) FROM outbox.messages",
    )
    .unwrap()
    .unwrap();
    assert_eq!(view, "failed:1,pending:2,pending:-,pending:-");
    // Retried: pending again with counters reset, and due at once.
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.retry_failed()").unwrap(), Some(1));
    assert_eq!(due(), "a#1,a#2");
    // Skipped for good: a#2 goes on alone.
    Spi::run_with_args("SELECT outbox._settle_held('{}', ARRAY[$1]::bigint[], ARRAY['x'], 1, 10)", &[a[0].into()]).unwrap();
    assert_eq!(Spi::get_one_with_args::<i64>("SELECT outbox.skip_failed(ARRAY[$1])", &[a[0].into()]).unwrap(), Some(1));
    assert_eq!(due(), "a#2");
    Spi::run_with_args("SELECT outbox._settle_held(ARRAY[$1]::bigint[], '{}', '{}', 3, 10)", &[a[1].into()]).unwrap();
    let view = Spi::get_one::<String>("SELECT string_agg(status, ',' ORDER BY id) FROM outbox.messages WHERE aggregate_id = 'a'")
        .unwrap()
        .unwrap();
    assert_eq!(view, "skipped,published,pending");
    let (code, _) = error_of("SELECT outbox.skip_failed('{}')");
    assert_eq!(code, "ERRCODE_INVALID_PARAMETER_VALUE");
    // A list that can name no event is refused, naming what is wrong (found by attack: these
    // returned 0 without a word).
    for (call, expected, said) in [
        ("SELECT outbox.retry_failed('{}')", "ERRCODE_INVALID_PARAMETER_VALUE", "ids is empty"),
        ("SELECT outbox.retry_failed(ARRAY[NULL]::bigint[])", "ERRCODE_NULL_VALUE_NOT_ALLOWED", "holds a NULL"),
        ("SELECT outbox.retry_failed(ARRAY[-5])", "ERRCODE_INVALID_PARAMETER_VALUE", "holds -5"),
        ("SELECT outbox.skip_failed(ARRAY[-5, NULL])", "ERRCODE_NULL_VALUE_NOT_ALLOWED", "holds a NULL"),
        ("SELECT outbox.skip_failed(ARRAY[0])", "ERRCODE_INVALID_PARAMETER_VALUE", "holds 0"),
    ] {
        let (code, message) = error_of(call);
        assert_eq!(code, expected, "{call}: {message}");
        assert!(message.contains(said), "{call}: {message}");
    }
}

#[pg_test]
fn without_order_only_the_rejected_event_waits() {
    Spi::run("SELECT outbox_enqueue('t', 'a', 'e', '{}') FROM generate_series(1, 2)").unwrap();
    let a = event_ids_of("true");
    Spi::run_with_args(
        "SELECT outbox._hold(ARRAY(SELECT event_id FROM outbox.events WHERE id = ANY($1) ORDER BY id), ARRAY[1, 2]::bigint[], ARRAY['boom', NULL], 3, 60000)",
        &[a.clone().into()],
    )
    .unwrap();
    let due = Spi::get_one::<String>(
        "SELECT string_agg(aggregate_seq::text, ',') FROM outbox._held_due(ARRAY(SELECT shard FROM outbox.shards), 100, false)",
    )
    .unwrap()
    .unwrap();
    assert_eq!(due, "2");
}

#[pg_test]
fn counters_saturate_instead_of_stalling_the_relay() {
    Spi::run("SELECT outbox_enqueue('o', 1, 'e', '{}'), outbox_enqueue('o', 2, 'e', '{}')").unwrap();
    Spi::run(
        "SELECT outbox._hold(ARRAY(SELECT event_id FROM outbox.events ORDER BY id), ARRAY[1, 1]::bigint[], ARRAY['x', 'y'], 1000000, 10)",
    )
    .unwrap();
    Spi::run("UPDATE outbox.held SET attempts = 2147483647, rejections = 2147483647").unwrap();
    let ids = event_ids_of("true");
    Spi::run_with_args(
        "SELECT outbox._settle_held(ARRAY[$1]::bigint[], ARRAY[$2]::bigint[], ARRAY['boom'], 1000000, 10)",
        &[ids[1].into(), ids[0].into()],
    )
    .unwrap();
    let counters = Spi::get_one::<String>(
        "SELECT string_agg(status || ':' || attempts || ':' || rejections, ',' ORDER BY id) FROM outbox.held",
    )
    .unwrap()
    .unwrap();
    assert_eq!(counters, "failed:2147483647:2147483647,published:2147483647:2147483647");
}

#[pg_test]
fn the_messages_view_tells_every_events_status() {
    Spi::run("SELECT outbox_enqueue('v', i, 'e', '{}') FROM generate_series(1, 3) i").unwrap();
    assert_eq!(Spi::get_one::<String>("SELECT string_agg(status, ',' ORDER BY id) FROM outbox.messages").unwrap().unwrap(),
               "pending,pending,pending");
    // Consumed by the cursors (as a finished batch leaves them): published, with when.
    Spi::run(&format!("UPDATE outbox.shards SET cursor = {UPTO}, cursor_at = now()")).unwrap();
    let row = Spi::get_one::<String>(
        "SELECT string_agg(status || ':' || (published_at IS NOT NULL), ',' ORDER BY id) FROM outbox.messages",
    )
    .unwrap()
    .unwrap();
    assert_eq!(row, "published:true,published:true,published:true");
    // One question per event_id.
    let one = Spi::get_one::<String>(
        "SELECT status FROM outbox.messages WHERE event_id = (SELECT event_id FROM outbox.events ORDER BY id LIMIT 1)",
    )
    .unwrap()
    .unwrap();
    assert_eq!(one, "published");
}

/// A transaction's own events are not pending until it commits (no snapshot shows them committed),
/// so this test counts what the failure path holds; tests/operations.rs counts committed events.
#[pg_test]
fn stats_counts_the_failure_path_exactly_and_reports_the_oldest_pending_age() {
    take_all_shards();
    let stats = || {
        Spi::get_one::<String>(
            "SELECT concat_ws(',', pending, publishing, failed, coalesce(oldest_pending_age >= interval '1 hour', false))
               FROM outbox.stats",
        )
        .unwrap()
        .unwrap()
    };
    assert_eq!(stats(), "0,0,0,f");
    Spi::run("SELECT outbox_enqueue('s', i, 'e', '{}') FROM generate_series(1, 3) i").unwrap();
    Spi::run(
        "SELECT outbox._hold(ARRAY(SELECT event_id FROM outbox.events ORDER BY id), ARRAY[1, 1, 1]::bigint[],
                             ARRAY['x', NULL, NULL], 1, 10)",
    )
    .unwrap();
    Spi::run("UPDATE outbox.held SET created_at = now() - interval '2 hours' WHERE status = 'waiting'").unwrap();
    // As a finished batch leaves them: the cursors past the events moved to the failure path.
    Spi::run(&format!("UPDATE outbox.shards SET cursor = {UPTO}")).unwrap();
    // One failed, two waiting on the failure path (pending), the oldest two hours old.
    assert_eq!(stats(), "2,0,1,t");
}

#[pg_test]
fn retention_switches_tables_and_truncates_only_what_every_shard_consumed() {
    take_all_shards();
    Spi::run("SELECT outbox_enqueue('r', i, 'e', '{}') FROM generate_series(1, 5) i").unwrap();
    // Switch now: the next events go to the next table.
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.purge('0')").unwrap(), Some(0));
    Spi::run("SELECT outbox_enqueue('r', 6, 'e', '{}')").unwrap();
    let where_ = Spi::get_one::<String>("SELECT string_agg(generation::text, ',' ORDER BY id) FROM outbox.events")
        .unwrap()
        .unwrap();
    assert_eq!(where_, "0,0,0,0,0,1");
    let states = || {
        Spi::get_one::<String>("SELECT string_agg(state, ',' ORDER BY generation) FROM outbox.generations").unwrap().unwrap()
    };
    assert_eq!(states(), "closing,current,empty");
    // Closed once the switch has committed (so in a later transaction: simulated here by marking
    // the switch as made by an older, committed transaction); not truncated while unconsumed.
    Spi::run("SELECT outbox.purge('0')").unwrap();
    assert_eq!(states(), "closing,closing,current", "the switching transaction never closes what it switched");
    Spi::run(
        "UPDATE outbox.generations SET state = 'closing', switched_by = (SELECT xmin::text::xid8 FROM pg_class WHERE oid = 'outbox.events_0'::regclass)
          WHERE generation = 0",
    )
    .unwrap();
    Spi::run("UPDATE outbox.generations SET state = 'empty', opened_at = NULL WHERE generation = 2").unwrap();
    Spi::run("UPDATE outbox.generations SET state = 'current', closed_at = NULL, switched_by = NULL WHERE generation = 1").unwrap();
    Spi::run("SELECT outbox.purge('0')").unwrap();
    assert_eq!(states(), "closed,closing,current");
    // Every shard past it: truncated, and the table is ready to be current again.
    Spi::run(
        "UPDATE outbox.shards SET cursor = ((SELECT closed_below FROM outbox.generations WHERE generation = 0)::text || ':'
                                            || (SELECT closed_below FROM outbox.generations WHERE generation = 0)::text || ':')::pg_snapshot",
    )
    .unwrap();
    // The TRUNCATE waits at most 100 ms for its lock and is retried at the next call: the tests
    // running beside this one enqueue into the same table.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut removed = Spi::get_one::<i64>("SELECT outbox.purge('0')").unwrap();
    while removed == Some(0) && std::time::Instant::now() < deadline {
        removed = Spi::get_one::<i64>("SELECT outbox.purge('0')").unwrap();
    }
    assert_eq!(removed, Some(5));
    assert_eq!(states(), "empty,closing,current", "truncated; the empty current table is not switched");
    assert_eq!(Spi::get_one::<i64>("SELECT count(*) FROM outbox.events_0").unwrap(), Some(0));
    // Failed events are never removed.
    Spi::run("SELECT outbox._hold(ARRAY(SELECT event_id FROM outbox.events_1), ARRAY[1]::bigint[], ARRAY['x'], 1, 10)").unwrap();
    Spi::run("UPDATE outbox.held SET failed_at = now() - interval '1 year', published_at = now() - interval '1 year'").unwrap();
    Spi::run("SELECT outbox.purge('0')").unwrap();
    assert_eq!(Spi::get_one::<i64>("SELECT count(*) FROM outbox.held WHERE status = 'failed'").unwrap(), Some(1));
    let (code, _) = error_of("SELECT outbox.purge('-1 day')");
    assert_eq!(code, "ERRCODE_INVALID_PARAMETER_VALUE");
}

#[pg_test]
fn sequence_counters_are_kept_until_an_admin_forgets_aggregates_with_no_event_left() {
    Spi::run("INSERT INTO outbox.aggregates VALUES ('f', 'gone', 5), ('f', 'here', 3), ('f', 'held', 2)").unwrap();
    Spi::run("SELECT outbox_enqueue('f', 'here', 'e', '{}'), outbox_enqueue('f', 'held', 'e', '{}')").unwrap();
    Spi::run("SELECT outbox._hold(ARRAY(SELECT event_id FROM outbox.events WHERE aggregate_id = 'held'), ARRAY[3]::bigint[], ARRAY['x'], 1, 10)")
        .unwrap();
    // Their events leave the log as retention's TRUNCATE would take them; a DELETE of this test's
    // rows only, because a TRUNCATE here queues for the table behind every test running beside
    // this one that enqueued, and deadlocks with one that truncates it too (retention's test: seen
    // on PostgreSQL 16 in CI).
    Spi::run("DELETE FROM outbox.events_0 WHERE aggregate_type = 'f'").unwrap();
    Spi::run("SELECT outbox_enqueue('f', 'here', 'e', '{}')").unwrap();
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.forget_aggregates()").unwrap(), Some(1));
    let left = Spi::get_one::<String>("SELECT string_agg(aggregate_id, ',' ORDER BY aggregate_id) FROM outbox.aggregates")
        .unwrap()
        .unwrap();
    assert_eq!(left, "held,here");
}

#[pg_test]
fn admins_repair_through_functions_only() {
    Spi::run("CREATE ROLE test_repair_admin IN ROLE outbox_admin").unwrap();
    Spi::run("GRANT USAGE ON SCHEMA tests TO test_repair_admin").unwrap();
    Spi::run("SELECT outbox_enqueue('r', 1, 'e', '{}'), outbox_enqueue('r', 2, 'e', '{}')").unwrap();
    Spi::run("SELECT outbox._hold(ARRAY(SELECT event_id FROM outbox.events ORDER BY id), ARRAY[1, 1]::bigint[], ARRAY['x', 'y'], 1, 10)")
        .unwrap();
    Spi::run("SET LOCAL ROLE test_repair_admin").unwrap();
    for sql in [
        "UPDATE outbox.held SET status = 'published'",
        "DELETE FROM outbox.events_0",
        "UPDATE outbox.shards SET cursor = cursor",
        "TRUNCATE outbox.events_0",
        "SELECT outbox._retention(interval '0')",
    ] {
        let (code, message) = error_of(sql);
        assert_eq!(code, "ERRCODE_INSUFFICIENT_PRIVILEGE", "admin ran {sql}: {message}");
    }
    let ids = Spi::get_one::<Vec<i64>>("SELECT array_agg(id ORDER BY id) FROM outbox.messages").unwrap().unwrap();
    assert_eq!(Spi::get_one::<i64>("SELECT count(*) FROM outbox.messages WHERE status = 'failed'").unwrap(), Some(2));
    assert_eq!(Spi::get_one_with_args::<i64>("SELECT outbox.skip_failed($1)", &[vec![ids[0]].into()]).unwrap(), Some(1));
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.retry_failed()").unwrap(), Some(1));
    assert!(Spi::get_one::<i64>("SELECT outbox.purge('0')").unwrap().is_some());
    Spi::run("RESET ROLE").unwrap();
}

#[pg_test]
fn schema_is_registered_for_pg_dump_and_the_log_is_insert_only() {
    let dumped = Spi::get_one::<String>(
        "SELECT string_agg(c.relname || ':' || coalesce(cond, ''), ',' ORDER BY c.relname)
           FROM pg_extension e, unnest(e.extconfig, e.extcondition) AS t(oid, cond)
           JOIN pg_class c ON c.oid = t.oid
          WHERE e.extname = 'outbox_pg'",
    )
    .unwrap()
    .unwrap();
    assert_eq!(
        dumped,
        "aggregates:,consumers:,events_0:,events_1:,events_2:,events_id_seq:,generations:,held:,journal_0:,journal_1:,\
         journal_2:,journal_round_seq:,processed_messages:,redis_loss_id_seq:,redis_losses:,replay_event_ids:,replay_id_seq:,\
         replay_requests:,shards:"
    );
    // Two indexes per log table, the seeds' count: the relays' (shard, txid) and event_id.
    let indexes = Spi::get_one::<String>(
        "SELECT string_agg(indexrelid::regclass::text, ',' ORDER BY indexrelid::regclass::text) FROM pg_index
          WHERE indrelid = 'outbox.events_0'::regclass",
    )
    .unwrap()
    .unwrap();
    assert_eq!(indexes, "outbox.events_0_batch_idx,outbox.events_0_event_id_idx");
}

/// README's monitoring recipe: the alert query and the sql_exporter collector's query run as
/// written, and every metric's `values` names a column of the query it refers to.
#[pg_test]
fn the_readme_monitoring_queries_run_and_feed_every_metric() {
    let readme = include_str!("../../README.md");
    let start = readme.find("**Monitoring.**").expect("README's monitoring recipe");
    let recipe = &readme[start..start + readme[start..].find("**Permissions.**").expect("the next paragraph")];
    let block = |language: &str| -> &str {
        let open = recipe.find(&format!("```{language}\n")).expect(language) + language.len() + 4;
        &recipe[open..open + recipe[open..].find("```").expect("the block's end")]
    };
    Spi::run(block("sql")).unwrap();
    let yaml = block("yaml");
    let query_at = yaml.find("    query: |\n").expect("the collector's query") + "    query: |\n".len();
    let query: String = yaml[query_at..].lines().take_while(|line| line.starts_with("      ")).collect::<Vec<_>>().join("\n");
    let columns: Vec<String> = Spi::connect(|client| {
        let table = client.select(&query, None, &[]).unwrap();
        (1..=table.columns().unwrap()).map(|i| table.column_name(i).unwrap()).collect()
    });
    let values: Vec<&str> = yaml
        .lines()
        .filter_map(|line| line.trim().strip_prefix("values: [")?.strip_suffix(']'))
        .collect();
    assert_eq!(values.len(), yaml.matches("metric_name:").count());
    assert_eq!(values.len(), yaml.matches("query_ref: outbox_stats").count());
    for value in values {
        assert!(columns.iter().any(|column| column == value), "{value} is not a column of {columns:?}");
    }
    assert_eq!(columns.len(), 6, "{columns:?}");
}

/// outbox.replay, cancel_replay and repair_losses refuse what would do nothing or something else
/// than asked: with their SQLSTATE, the value, and a hint.
#[pg_test]
fn replay_cancel_and_repair_refuse_bad_arguments() {
    for (sql, code, needle) in [
        ("SELECT outbox.cancel_replay(NULL)", "ERRCODE_NULL_VALUE_NOT_ALLOWED", "replay must not be NULL"),
        ("SELECT outbox.cancel_replay(-5)", "ERRCODE_INVALID_PARAMETER_VALUE", "(got -5)"),
        ("SELECT outbox.repair_losses('{}')", "ERRCODE_INVALID_PARAMETER_VALUE", "losses must list loss ids"),
        ("SELECT outbox.repair_losses(ARRAY[NULL::bigint])", "ERRCODE_NULL_VALUE_NOT_ALLOWED", "must not hold NULL"),
        ("SELECT outbox.repair_losses(ARRAY[424242])", "ERRCODE_INVALID_PARAMETER_VALUE", "{424242}"),
        ("SELECT outbox.replay(now(), partial => NULL)", "ERRCODE_NULL_VALUE_NOT_ALLOWED", "partial must not be NULL"),
        ("SELECT outbox.replay(now(), aggregate_types => '{}')", "ERRCODE_INVALID_PARAMETER_VALUE", "aggregate_types is an empty list"),
        ("SELECT outbox.replay(now(), aggregate_types => ARRAY[NULL])", "ERRCODE_INVALID_PARAMETER_VALUE", "aggregate_types must list"),
        ("SELECT outbox.replay(now(), event_ids => '{}')", "ERRCODE_INVALID_PARAMETER_VALUE", "event_ids is an empty list"),
        ("SELECT outbox.replay(now(), streams => '{}')", "ERRCODE_INVALID_PARAMETER_VALUE", "streams is an empty list"),
        // Before the installation: nothing was recorded then, and retention removed nothing.
        ("SELECT outbox.replay('2001-01-01')", "ERRCODE_INVALID_PARAMETER_VALUE", "before anything was recorded"),
    ] {
        let (sqlstate, message) = error_of(sql);
        assert_eq!(sqlstate, code, "{sql}: {message}");
        assert!(message.contains(needle), "{sql}: {message}");
        assert!(!message.contains("no longer retained"), "{sql}: {message}");
        assert!(message.contains("hint: ") && !message.ends_with("hint: "), "{sql} has no hint: {message}");
    }
    // A replay that is not running (or no replay at all) is not cancelled.
    assert_eq!(Spi::get_one::<bool>("SELECT outbox.cancel_replay(424242)").unwrap(), Some(false));
}

/// outbox.replay's stream to send to is named without quotes (`into`, a reserved word, needed
/// them), and it is what the request records and outbox.replays shows.
#[pg_test]
fn replay_to_stream_is_named_without_quotes() {
    let id = Spi::get_one::<i64>("SELECT outbox.replay(since => now(), to_stream => 'history:payment')")
        .unwrap()
        .unwrap();
    let shown = Spi::get_one_with_args::<String>("SELECT to_stream FROM outbox.replays WHERE id = $1", &[id.into()]);
    assert_eq!(shown.unwrap().as_deref(), Some("history:payment"));
    // Positional, as the README's signature lists it.
    let id = Spi::get_one::<i64>("SELECT outbox.replay(now(), NULL, NULL, NULL, NULL, 'history:order')")
        .unwrap()
        .unwrap();
    let shown = Spi::get_one_with_args::<String>("SELECT to_stream FROM outbox.replays WHERE id = $1", &[id.into()]);
    assert_eq!(shown.unwrap().as_deref(), Some("history:order"));
}

/// A replay's event_ids filter is kept in outbox.replay_event_ids, once per id, counted in
/// outbox.replays, and goes when the replay is cancelled (issue 35, item 4).
#[pg_test]
fn a_replays_event_ids_are_a_table_of_their_own_until_it_ends() {
    // A journal round for the replay to walk.
    Spi::run("INSERT INTO outbox.journal_0 (round, finished_at, events, event_ids, seqs) VALUES (1, now(), 0, '{}', '{}')")
        .unwrap();
    let id = Spi::get_one::<i64>(
        "SELECT outbox.replay(now() - interval '1 minute', partial => true,
                              event_ids => (SELECT array_agg(gen_random_uuid()) || array_agg(x.e) FROM generate_series(1, 3) n,
                                            LATERAL (SELECT '00000000-0000-0000-0000-000000000001'::uuid AS e) x))",
    )
    .unwrap()
    .unwrap();
    let kept = || Spi::get_one::<i64>("SELECT count(*) FROM outbox.replay_event_ids").unwrap().unwrap();
    assert_eq!(kept(), 4, "three ids and one listed three times");
    let listed = Spi::get_one_with_args::<i64>("SELECT event_ids FROM outbox.replays WHERE id = $1", &[id.into()]);
    assert_eq!(listed.unwrap(), Some(4));
    let unfiltered = Spi::get_one::<i64>("SELECT outbox.replay(now() - interval '1 minute', partial => true)");
    let unfiltered = unfiltered.unwrap().unwrap();
    let none = Spi::get_one_with_args::<i64>("SELECT event_ids FROM outbox.replays WHERE id = $1", &[unfiltered.into()]);
    assert_eq!(none.unwrap(), None, "no filter");
    assert_eq!(Spi::get_one_with_args::<bool>("SELECT outbox.cancel_replay($1)", &[id.into()]).unwrap(), Some(true));
    assert_eq!(kept(), 0, "the filter goes with the replay");
}

/// repair_losses replays exactly the stream Redis lost (no glob, no comma, no trimming), and a
/// loss counts in outbox.stats.redis_data_loss until a replay is done having replayed events: a
/// repair that replayed nothing, was cancelled or refused by Redis does not repair it, and
/// repair_losses() tries again those cancelled or refused.
#[pg_test]
fn repair_losses_replays_exactly_the_stream_and_counts_what_is_not_repaired() {
    let lost = |sql: &str| Spi::get_one::<i64>(sql).unwrap().unwrap();
    Spi::run(
        r"INSERT INTO outbox.redis_losses (id, stream, expected_id, expected_at)
          SELECT 900 + n, s, '1-0', now() FROM unnest(ARRAY['outbox:a*', 'outbox:x\y', 'outbox:c,d', '   ']) WITH ORDINALITY x(s, n)",
    )
    .unwrap();
    assert_eq!(lost("SELECT redis_data_loss FROM outbox.stats"), 4);
    assert_eq!(lost("SELECT count(*) FROM outbox.repair_losses()"), 4);
    // Each replay takes its stream as a key, exactly as Redis named it.
    assert_eq!(
        lost(
            "SELECT count(*) FROM outbox.redis_losses l JOIN outbox.replay_requests r ON r.id = l.replay_id
              WHERE r.streams = ARRAY[l.stream] AND r.exact_streams"
        ),
        4
    );
    // Nothing journaled here: each replay is done at once having replayed nothing, which repairs
    // nothing; repair_losses() leaves them (with a WARNING), repair_losses(ids) tries again.
    assert_eq!(lost("SELECT redis_data_loss FROM outbox.stats"), 4);
    assert_eq!(lost("SELECT count(*) FROM outbox.repair_losses()"), 0);
    assert_eq!(lost("SELECT count(*) FROM outbox.repair_losses(ARRAY[901, 902])"), 2);
    // Running: being repaired. Done with events replayed: repaired. Cancelled, or refused by
    // Redis: not repaired, and tried again.
    Spi::run(
        "UPDATE outbox.replay_requests r SET state = CASE l.id WHEN 901 THEN 'running' WHEN 902 THEN 'done' ELSE 'cancelled' END,
                replayed = 5, errors = CASE l.id WHEN 904 THEN 1 ELSE 0 END
           FROM outbox.redis_losses l WHERE r.id = l.replay_id",
    )
    .unwrap();
    Spi::run("UPDATE outbox.replay_requests r SET state = 'done' FROM outbox.redis_losses l WHERE r.id = l.replay_id AND l.id = 904")
        .unwrap();
    assert_eq!(lost("SELECT redis_data_loss FROM outbox.stats"), 2);
    assert_eq!(lost("SELECT count(*) FROM outbox.repair_losses() WHERE loss IN (903, 904)"), 2);
    assert_eq!(lost("SELECT count(*) FROM outbox.repair_losses(ARRAY[901, 902])"), 0);
}
