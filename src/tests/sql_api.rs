// The SQL API inside one (rolled-back) transaction: what outbox_enqueue stores, and how it refuses
// bad input. Included into `lib.rs`'s `tests` module.

use pgrx::prelude::*;

/// Runs `sql` in a subtransaction and returns the SQLSTATE and message it raised.
fn error_of(sql: &str) -> (String, String) {
    let sql = sql.to_string();
    let caught = PgTryBuilder::new(move || {
        Spi::run(&sql).expect("statement");
        None
    })
    .catch_others(|caught| match caught {
        pgrx::pg_sys::panic::CaughtError::PostgresError(report)
        | pgrx::pg_sys::panic::CaughtError::ErrorReport(report)
        | pgrx::pg_sys::panic::CaughtError::RustPanic { ereport: report, .. } => Some((
            format!("{:?}", report.sql_error_code()),
            format!("{} | hint: {}", report.message(), report.hint().unwrap_or("")),
        )),
    })
    .execute();
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
}

#[pg_test]
fn claim_takes_oldest_pending_first_and_settles() {
    for i in 0..5 {
        Spi::run(&format!("SELECT outbox_enqueue('a', '{i}', 'e', '{{\"n\": {i}}}')")).unwrap();
    }
    let claimed = Spi::get_one::<String>(
        "SELECT string_agg(aggregate_id, ',' ORDER BY id) FROM outbox._claim_batch(3)",
    )
    .unwrap()
    .unwrap();
    assert_eq!(claimed, "0,1,2");
    let states = Spi::get_one::<String>(
        "SELECT string_agg(status || ':' || attempts, ',' ORDER BY id) FROM outbox.messages",
    )
    .unwrap()
    .unwrap();
    assert_eq!(states, "publishing:1,publishing:1,publishing:1,pending:0,pending:0");
    let ids: Vec<i64> = Spi::connect(|c| {
        c.select("SELECT id FROM outbox.messages WHERE status = 'publishing' ORDER BY id", None, &[])
            .unwrap()
            .map(|row| row.get::<i64>(1).unwrap().unwrap())
            .collect()
    });
    assert_eq!(Spi::get_one_with_args::<i64>("SELECT outbox._mark_published($1)", &[ids[..2].to_vec().into()]).unwrap(), Some(2));
    assert_eq!(
        Spi::get_one_with_args::<i64>("SELECT outbox._release($1, 'boom')", &[vec![ids[2]].into()]).unwrap(),
        Some(1)
    );
    let states = Spi::get_one::<String>(
        "SELECT string_agg(status || ':' || coalesce(last_error, '-') || ':' || (published_at IS NOT NULL), ',' ORDER BY id)
           FROM outbox.messages",
    )
    .unwrap()
    .unwrap();
    assert_eq!(states, "published:-:true,published:-:true,pending:boom:false,pending:-:false,pending:-:false");
}

#[pg_test]
fn claim_formats_created_at_as_rfc3339_utc_with_microseconds() {
    Spi::run("SET LOCAL timezone = 'America/Sao_Paulo'").unwrap();
    Spi::run("SELECT outbox_enqueue('a', 'x', 'e', '{}')").unwrap();
    let (created_at, expected) = Spi::get_two::<String, String>(
        "SELECT c.created_at, to_char(m.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
           FROM outbox._claim_batch(1) c JOIN outbox.messages m ON m.id = c.id",
    )
    .unwrap();
    let created_at = created_at.unwrap();
    assert_eq!(Some(created_at.clone()), expected);
    assert_eq!(created_at.len(), "2026-11-29T20:00:00.123456Z".len(), "{created_at}");
    assert!(created_at.ends_with('Z'));
}

#[pg_test]
fn reaper_returns_claims_of_exited_processes_and_expired_leases() {
    Spi::run("SELECT outbox_enqueue('a', 'x', 'e', '{}')").unwrap();
    Spi::run("SELECT outbox_enqueue('a', 'y', 'e', '{}')").unwrap();
    Spi::run("SELECT count(*) FROM outbox._claim_batch(2)").unwrap();
    // This session is alive and the lease is long: nothing to reap.
    assert_eq!(Spi::get_one::<i64>("SELECT outbox._reap_expired(60000)").unwrap(), Some(0));
    // A claimer pid that no process has, and a claim older than the lease.
    Spi::run("UPDATE outbox.messages SET claimed_by = 0 WHERE aggregate_id = 'x'").unwrap();
    Spi::run("UPDATE outbox.messages SET claimed_at = claimed_at - interval '2 minutes' WHERE aggregate_id = 'y'").unwrap();
    assert_eq!(Spi::get_one::<i64>("SELECT outbox._reap_expired(60000)").unwrap(), Some(2));
    let states = Spi::get_one::<String>(
        "SELECT string_agg(status || ':' || attempts || ':' || last_error, ',' ORDER BY id) FROM outbox.messages",
    )
    .unwrap()
    .unwrap();
    assert_eq!(
        states,
        "pending:1:the claiming process exited before the publish was settled,pending:1:claim lease expired before the publish was settled"
    );
}

#[pg_test]
fn schema_is_registered_for_pg_dump_and_indexes_are_partial() {
    let dumped = Spi::get_one::<String>(
        "SELECT string_agg(c.relname || ':' || coalesce(cond, ''), ',' ORDER BY c.relname)
           FROM pg_extension e, unnest(e.extconfig, e.extcondition) AS t(oid, cond)
           JOIN pg_class c ON c.oid = t.oid
          WHERE e.extname = 'outbox_pg'",
    )
    .unwrap()
    .unwrap();
    assert_eq!(dumped, "messages:WHERE status <> 'published',messages_id_seq:");
    let logged = Spi::get_one::<String>("SELECT relpersistence::text FROM pg_class WHERE oid = 'outbox.messages'::regclass")
        .unwrap()
        .unwrap();
    assert_eq!(logged, "p");
    let partial = Spi::get_one::<i64>(
        "SELECT count(*) FROM pg_index WHERE indrelid = 'outbox.messages'::regclass AND indpred IS NOT NULL",
    )
    .unwrap()
    .unwrap();
    assert_eq!(partial, 2);
}
