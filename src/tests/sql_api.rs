// The SQL API inside one (rolled-back) transaction: what outbox_enqueue stores, and how it refuses
// bad input. Included into `lib.rs`'s `tests` module.

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
            format!("{} | hint: {}", report.message(), report.hint().unwrap_or("")),
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
        "SELECT string_agg(aggregate_id, ',' ORDER BY id) FROM outbox._claim_batch(3, true)",
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
fn a_relay_claim_reads_in_order_writes_nothing_and_is_settled_from_pending() {
    // Aggregate a has two events; b's first is failed, so its second must wait.
    for (aggregate, n) in [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("c", 1)] {
        Spi::run(&format!("SELECT outbox_enqueue('t', '{aggregate}', 'e', '{{\"n\": {n}}}')")).unwrap();
    }
    Spi::run("UPDATE outbox.messages SET status = 'failed' WHERE aggregate_id = 'b' AND aggregate_seq = 1").unwrap();
    let read = Spi::get_one::<String>(
        "SELECT string_agg(aggregate_id || '#' || aggregate_seq, ',' ORDER BY id) FROM outbox._relay_batch(10, true)",
    )
    .unwrap()
    .unwrap();
    assert_eq!(read, "a#1,a#2,c#1");
    // The claim wrote nothing: the rows are pending, no attempt counted.
    let states = Spi::get_one::<String>(
        "SELECT string_agg(status || ':' || attempts, ',' ORDER BY id) FROM outbox.messages WHERE aggregate_id <> 'b'",
    )
    .unwrap()
    .unwrap();
    assert_eq!(states, "pending:0,pending:0,pending:0");
    // The batch size applies after the ordering checks.
    let read = Spi::get_one::<String>(
        "SELECT string_agg(aggregate_id || '#' || aggregate_seq, ',' ORDER BY id) FROM outbox._relay_batch(1, true)",
    )
    .unwrap()
    .unwrap();
    assert_eq!(read, "a#1");
    // Settling a relay's claim marks pending rows and counts their attempt; a rejection backs off.
    let ids: Vec<i64> = Spi::connect(|c| {
        c.select("SELECT id FROM outbox.messages WHERE aggregate_id <> 'b' ORDER BY id", None, &[])
            .unwrap()
            .map(|row| row.get::<i64>(1).unwrap().unwrap())
            .collect()
    });
    assert_eq!(Spi::get_one_with_args::<i64>("SELECT outbox._mark_published($1)", &[ids[..2].to_vec().into()]).unwrap(), Some(2));
    Spi::get_one_with_args::<i64>("SELECT outbox._reject($1, 'WRONGTYPE', 5, 1000)", &[vec![ids[2]].into()]).unwrap();
    let states = Spi::get_one::<String>(
        "SELECT string_agg(status || ':' || attempts || ':' || rejections || ':' || coalesce(available_at > now(), false), ',' ORDER BY id)
           FROM outbox.messages WHERE aggregate_id <> 'b'",
    )
    .unwrap()
    .unwrap();
    assert_eq!(states, "published:1:0:false,published:1:0:false,pending:1:1:true");
    // Nothing is left to claim: c backs off, b waits behind its failed event.
    assert_eq!(Spi::get_one::<i64>("SELECT count(*) FROM outbox._claim_batch(10, true)").unwrap(), Some(0));
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

/// One aggregate with a long backlog (an account that receives a burst) must cost a claim no more
/// than many aggregates do. The first claim probed "an earlier event outside the batch?" per row,
/// walking all earlier pending events of the aggregate each time: n^2/2 index entries per batch,
/// 15 s per 1,000-event claim with 20,000 events pending for one aggregate. Measured now: about
/// 2,300 pages for the read and 23,000 for a session's claim of 1,000 events (which writes them);
/// the per-row probes of the first claim touched hundreds of thousands.
#[pg_test]
fn a_claim_of_one_aggregates_backlog_costs_a_few_pages_per_event() {
    create_buffers_helper();
    Spi::run("SELECT outbox_enqueue('acct', 'hot', 'e', '{}') FROM generate_series(1, 3000)").unwrap();
    Spi::run("SELECT outbox_enqueue('acct', 'cold', 'e', '{}')").unwrap();
    // The relay's read (step 1), then its per-aggregate probe (step 2) for the one aggregate.
    let read = buffers_touched("SELECT * FROM outbox._relay_batch(1000, true)");
    assert!(read < 20_000, "reading 1,000 events of one aggregate touched {read} pages");
    let probe = buffers_touched("SELECT * FROM outbox._relay_waiting(ARRAY['acct'], ARRAY['hot'], ARRAY[1::bigint])");
    assert!(probe < 200, "one aggregate's probe touched {probe} pages");
    // A session's claim writes its rows as well (new row versions, index entries).
    let claim = buffers_touched("SELECT * FROM outbox._claim_batch(1000, true)");
    assert!(claim < 100_000, "claiming 1,000 events of one aggregate touched {claim} pages");
    // And it claimed them in order, a run from the aggregate's first event.
    let claimed = Spi::get_one::<String>(
        "SELECT min(aggregate_seq) || '..' || max(aggregate_seq) || ':' || count(*)
           FROM outbox.messages WHERE status = 'publishing' AND aggregate_id = 'hot'",
    )
    .unwrap()
    .unwrap();
    assert_eq!(claimed, "1..1000:1000");
}

#[pg_test]
fn the_relays_probe_names_the_aggregates_with_an_earlier_event_undelivered() {
    for aggregate in ["a", "a", "a", "b", "c"] {
        Spi::run(&format!("SELECT outbox_enqueue('t', '{aggregate}', 'e', '{{}}')")).unwrap();
    }
    Spi::run("UPDATE outbox.messages SET status = 'published', published_at = now() WHERE aggregate_id = 'a' AND aggregate_seq = 1").unwrap();
    Spi::run("UPDATE outbox.messages SET status = 'skipped' WHERE aggregate_id = 'c'").unwrap();
    // a#2 is a's first undelivered event; a#3 has a#2 before it; b#2 and c#2 do not exist but b#1
    // is undelivered, and c#1 was skipped (delivered as far as order goes).
    let waiting = Spi::get_one::<String>(
        "SELECT string_agg(p::text, ',' ORDER BY p)
           FROM outbox._relay_waiting(ARRAY['t', 't', 't', 't'], ARRAY['a', 'a', 'b', 'c'], ARRAY[2, 3, 2, 2]::bigint[]) AS p",
    )
    .unwrap()
    .unwrap();
    assert_eq!(waiting, "2,3");
}

#[pg_test]
fn claim_formats_created_at_as_rfc3339_utc_with_microseconds() {
    Spi::run("SET LOCAL timezone = 'America/Sao_Paulo'").unwrap();
    Spi::run("SELECT outbox_enqueue('a', 'x', 'e', '{}')").unwrap();
    let (created_at, expected) = Spi::get_two::<String, String>(
        "SELECT c.created_at, to_char(m.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
           FROM outbox._claim_batch(1, true) c JOIN outbox.messages m ON m.id = c.id",
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
    Spi::run("SELECT count(*) FROM outbox._claim_batch(2, true)").unwrap();
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
    assert_eq!(dumped, "aggregates:,consumers:,messages:WHERE status <> 'published',messages_id_seq:,processed_messages:");
    let logged = Spi::get_one::<String>("SELECT relpersistence::text FROM pg_class WHERE oid = 'outbox.messages'::regclass")
        .unwrap()
        .unwrap();
    assert_eq!(logged, "p");
    let partial = Spi::get_one::<i64>(
        "SELECT count(*) FROM pg_index WHERE indrelid = 'outbox.messages'::regclass AND indpred IS NOT NULL",
    )
    .unwrap()
    .unwrap();
    assert_eq!(partial, 6);
}

fn ids_where(condition: &str) -> Vec<i64> {
    Spi::connect(|c| {
        c.select(&format!("SELECT id FROM outbox.messages WHERE {condition} ORDER BY id"), None, &[])
            .unwrap()
            .map(|row| row.get::<i64>(1).unwrap().unwrap())
            .collect()
    })
}

fn claim(batch: i32, in_order: bool) -> Vec<String> {
    Spi::connect_mut(|c| {
        c.update(
            "SELECT aggregate_id || '#' || aggregate_seq FROM outbox._claim_batch($1, $2) ORDER BY id",
            None,
            &[batch.into(), in_order.into()],
        )
        .unwrap()
        .map(|row| row.get::<String>(1).unwrap().unwrap())
        .collect()
    })
}

#[pg_test]
fn aggregate_seq_counts_per_aggregate_and_is_sent_with_the_claim() {
    for (agg, id) in [("a", "1"), ("a", "1"), ("a", "2"), ("b", "1"), ("a", "1")] {
        Spi::run(&format!("SELECT outbox_enqueue('{agg}', '{id}', 'e', '{{}}')")).unwrap();
    }
    let seqs = Spi::get_one::<String>(
        "SELECT string_agg(aggregate_type || aggregate_id || ':' || aggregate_seq, ',' ORDER BY id) FROM outbox.messages",
    )
    .unwrap()
    .unwrap();
    assert_eq!(seqs, "a1:1,a1:2,a2:1,b1:1,a1:3");
    // Unordered claims hand out everything; seq travels with each event.
    assert_eq!(claim(10, false), ["1#1", "1#2", "2#1", "1#1", "1#3"]);
}

#[pg_test]
fn ordered_claim_holds_back_later_events_of_an_aggregate_only() {
    for i in 1..=3 {
        Spi::run(&format!("SELECT outbox_enqueue('acc', 'x', 'e{i}', '{{}}')")).unwrap();
        Spi::run(&format!("SELECT outbox_enqueue('acc', 'y', 'e{i}', '{{}}')")).unwrap();
    }
    // A batch cut after x#2 gets x#1..2 and y#1: a run from each aggregate's first undelivered event.
    assert_eq!(claim(3, true), ["x#1", "y#1", "x#2"]);
    // While those are publishing, the later events of x and y wait.
    assert!(claim(10, true).is_empty());
    // x#1 rejected (backing off), x#2 and y#1 published: y flows, x#3 still waits for x#1.
    let x = ids_where("aggregate_id = 'x'");
    let y = ids_where("aggregate_id = 'y'");
    Spi::get_one_with_args::<i64>("SELECT outbox._reject($1, 'WRONGTYPE', 10, 60000)", &[vec![x[0]].into()]).unwrap();
    Spi::get_one_with_args::<i64>("SELECT outbox._mark_published($1)", &[vec![x[1], y[0]].into()]).unwrap();
    assert_eq!(claim(10, true), ["y#2", "y#3"]);
    // Once x#1 is available again it goes first. x#2 is already delivered, so x#3 is next, but a
    // gap in a batch's sequence cuts the run there: x#3 follows in the next batch.
    Spi::run("UPDATE outbox.messages SET available_at = NULL").unwrap();
    assert_eq!(claim(10, true), ["x#1"]);
    Spi::get_one_with_args::<i64>("SELECT outbox._mark_published($1)", &[vec![x[0]].into()]).unwrap();
    assert_eq!(claim(10, true), ["x#3"]);
    // Without ordering nothing waits.
    for i in 4..=5 {
        Spi::run(&format!("SELECT outbox_enqueue('acc', 'x', 'e{i}', '{{}}')")).unwrap();
    }
    assert_eq!(claim(10, false), ["x#4", "x#5"]);
}

#[pg_test]
fn a_failed_event_holds_its_aggregate_until_retried_or_skipped() {
    for i in 1..=3 {
        Spi::run(&format!("SELECT outbox_enqueue('acc', 'x', 'e{i}', '{{}}')")).unwrap();
    }
    Spi::run("SELECT outbox_enqueue('acc', 'z', 'e', '{}')").unwrap();
    let x = ids_where("aggregate_id = 'x'");
    assert_eq!(claim(1, true), ["x#1"]);
    // Two rejections with max_attempts = 2: the second dead-letters it.
    assert_eq!(
        Spi::get_one_with_args::<i64>("SELECT outbox._reject($1, 'WRONGTYPE x', 2, 1)", &[vec![x[0]].into()]).unwrap(),
        Some(0)
    );
    Spi::run("UPDATE outbox.messages SET available_at = NULL").unwrap();
    assert_eq!(claim(1, true), ["x#1"]);
    assert_eq!(
        Spi::get_one_with_args::<i64>("SELECT outbox._reject($1, 'WRONGTYPE x', 2, 1)", &[vec![x[0]].into()]).unwrap(),
        Some(1)
    );
    let failed = Spi::get_one::<String>(&format!(
        "SELECT status || ':' || rejections || ':' || (failed_at IS NOT NULL) || ':' || last_error
           FROM outbox.messages WHERE id = {}",
        x[0]
    ));
    assert_eq!(failed.unwrap().unwrap(), "failed:2:true:WRONGTYPE x");
    // x is held back, z is not.
    assert_eq!(claim(10, true), ["z#1"]);
    // Retrying puts it back first in line.
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.retry_failed()").unwrap(), Some(1));
    assert_eq!(Spi::get_one::<String>(&format!("SELECT status || attempts || rejections FROM outbox.messages WHERE id = {}", x[0])).unwrap().unwrap(), "pending00");
    assert_eq!(claim(1, true), ["x#1"]);
    // Dead-letter it again and skip it: the rest of x flows.
    Spi::run(&format!("UPDATE outbox.messages SET status = 'failed' WHERE id = {}", x[0])).unwrap();
    assert!(claim(10, true).is_empty());
    assert_eq!(Spi::get_one_with_args::<i64>("SELECT outbox.skip_failed($1)", &[vec![x[0]].into()]).unwrap(), Some(1));
    assert_eq!(claim(10, true), ["x#2", "x#3"]);
    let (sqlstate, message) = error_of("SELECT outbox.skip_failed(NULL)");
    assert_eq!(sqlstate, "ERRCODE_INVALID_PARAMETER_VALUE", "{message}");
}

#[pg_test]
fn purge_deletes_only_old_published_and_skipped_rows() {
    for i in 0..6 {
        Spi::run(&format!("SELECT outbox_enqueue('p', '{i}', 'e', '{{}}')")).unwrap();
    }
    let ids = ids_where("true");
    // 0,1 published long ago; 2 published now; 3 failed long ago; 4 skipped long ago; 5 pending.
    Spi::run(&format!(
        "UPDATE outbox.messages SET status = 'published', published_at = now() - interval '10 days' WHERE id IN ({}, {});
         UPDATE outbox.messages SET status = 'published', published_at = now() WHERE id = {};
         UPDATE outbox.messages SET status = 'failed', failed_at = now() - interval '10 days' WHERE id = {};
         UPDATE outbox.messages SET status = 'skipped', published_at = now() - interval '10 days' WHERE id = {};",
        ids[0], ids[1], ids[2], ids[3], ids[4]
    ))
    .unwrap();
    // The relay's batched retention takes the oldest first, batch by batch.
    assert_eq!(Spi::get_one::<i64>("SELECT outbox._purge_batch(7 * 86400, 2)").unwrap(), Some(2));
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.purge('7 days')").unwrap(), Some(1));
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.purge('0')").unwrap(), Some(1));
    assert_eq!(ids_where("true"), vec![ids[3], ids[5]]);
    let (sqlstate, _) = error_of("SELECT outbox.purge('-1 day')");
    assert_eq!(sqlstate, "ERRCODE_INVALID_PARAMETER_VALUE");
    let (sqlstate, _) = error_of("SELECT outbox.purge(NULL)");
    assert_eq!(sqlstate, "ERRCODE_INVALID_PARAMETER_VALUE");
}

fn aggregate_counters() -> String {
    Spi::get_one::<String>(
        "SELECT coalesce(string_agg(aggregate_id || ':' || last_seq, ',' ORDER BY aggregate_id), '') FROM outbox.aggregates",
    )
    .unwrap()
    .unwrap()
}

#[pg_test]
fn retention_keeps_sequence_counters_until_an_admin_forgets_idle_aggregates() {
    for id in ["a", "a", "b", "c"] {
        Spi::run(&format!("SELECT outbox_enqueue('f', '{id}', 'e', '{{}}')")).unwrap();
    }
    let ids = ids_where("true");
    // a#1 and b#1 published long ago, a#2 published now, c#1 pending.
    Spi::run(&format!(
        "UPDATE outbox.messages SET status = 'published', published_at = now() - interval '10 days' WHERE id IN ({}, {});
         UPDATE outbox.messages SET status = 'published', published_at = now() WHERE id = {};",
        ids[0], ids[2], ids[1]
    ))
    .unwrap();
    assert_eq!(Spi::get_one::<i64>("SELECT outbox._purge_batch(7 * 86400, 10)").unwrap(), Some(2));
    // Retention leaves every counter: b, with no event left, still continues at 2.
    assert_eq!(aggregate_counters(), "a:2,b:1,c:1");
    Spi::run("SELECT outbox_enqueue('f', 'b', 'e', '{}')").unwrap();
    assert_eq!(aggregate_counters(), "a:2,b:2,c:1");
    // Once b's events are gone too, forget_aggregates drops exactly the aggregates with no event
    // left; b then starts again at 1, a and c are untouched.
    Spi::run("DELETE FROM outbox.messages WHERE aggregate_id = 'b'").unwrap();
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.forget_aggregates()").unwrap(), Some(1));
    assert_eq!(aggregate_counters(), "a:2,c:1");
    Spi::run("SELECT outbox_enqueue('f', 'b', 'e', '{}')").unwrap();
    assert_eq!(aggregate_counters(), "a:2,b:1,c:1");
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.forget_aggregates()").unwrap(), Some(0));
}

#[pg_test]
fn stats_counts_exactly_and_reports_the_oldest_pending_age() {
    assert_eq!(
        Spi::get_one::<String>("SELECT concat_ws(',', pending, publishing, failed, oldest_pending_age IS NULL) FROM outbox.stats")
            .unwrap()
            .unwrap(),
        "0,0,0,t"
    );
    for i in 0..4 {
        Spi::run(&format!("SELECT outbox_enqueue('s', '{i}', 'e', '{{}}')")).unwrap();
    }
    Spi::run("UPDATE outbox.messages SET created_at = now() - interval '1 hour' WHERE aggregate_id = '0'").unwrap();
    claim(1, true);
    let ids = ids_where("status = 'pending'");
    Spi::run(&format!("UPDATE outbox.messages SET status = 'failed' WHERE id = {}", ids[0])).unwrap();
    let row = Spi::get_one::<String>(
        "SELECT concat_ws(',', pending, publishing, failed, oldest_pending_age >= interval '1 hour', redis_connected)
           FROM outbox.stats",
    )
    .unwrap()
    .unwrap();
    // The claimed row (created an hour ago) counts as undelivered; this instance has no Redis.
    assert_eq!(row, "2,1,1,t,f");
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
        "SELECT count(*) FROM outbox._claim_batch(1, true)",
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
    assert_eq!(Spi::get_one::<i64>("SELECT pending FROM outbox.stats").unwrap(), Some(1));
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.retry_failed()").unwrap(), Some(0));
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.purge('0')").unwrap(), Some(0));
    // The writer's aggregate still has its event: nothing to forget.
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.forget_aggregates()").unwrap(), Some(0));
    let (sqlstate, _) = error_of("SELECT outbox_enqueue('sec', 3, 'e', '{}')");
    assert_eq!(sqlstate, "ERRCODE_INSUFFICIENT_PRIVILEGE");
    let (sqlstate, _) = error_of("SELECT count(*) FROM outbox._claim_batch(1, true)");
    assert_eq!(sqlstate, "ERRCODE_INSUFFICIENT_PRIVILEGE");
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
    assert_eq!(Spi::get_one::<i64>("SELECT outbox._purge_batch(86400, 10)").unwrap(), Some(0));
    assert!(!mark("notifications"));
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
fn admins_repair_through_functions_only() {
    Spi::run("CREATE ROLE test_repair_admin IN ROLE outbox_admin").unwrap();
    Spi::run("GRANT USAGE ON SCHEMA tests TO test_repair_admin").unwrap();
    Spi::run("SELECT outbox_enqueue('r', 1, 'e', '{}'), outbox_enqueue('r', 2, 'e', '{}')").unwrap();
    Spi::run("UPDATE outbox.messages SET status = 'failed'").unwrap();
    Spi::run("SET LOCAL ROLE test_repair_admin").unwrap();
    for sql in [
        "UPDATE outbox.messages SET status = 'published'",
        "DELETE FROM outbox.messages",
        "INSERT INTO outbox.messages (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, payload) VALUES (gen_random_uuid(), 'a', 'b', 1, 'c', '{}')",
    ] {
        let (code, message) = error_of(sql);
        assert_eq!(code, "ERRCODE_INSUFFICIENT_PRIVILEGE", "admin ran {sql}: {message}");
    }
    let ids = Spi::get_one::<Vec<i64>>("SELECT array_agg(id ORDER BY id) FROM outbox.messages").unwrap().unwrap();
    assert_eq!(Spi::get_one_with_args::<i64>("SELECT outbox.skip_failed($1)", &[vec![ids[0]].into()]).unwrap(), Some(1));
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.retry_failed()").unwrap(), Some(1));
    // Skipped just now, after this transaction's now(): nothing is old enough yet, but it runs.
    assert_eq!(Spi::get_one::<i64>("SELECT outbox.purge('0')").unwrap(), Some(0));
    Spi::run("RESET ROLE").unwrap();
}

#[pg_test]
fn a_publishing_row_must_say_who_claimed_it_and_is_reaped_if_it_does_not() {
    Spi::run("SELECT outbox_enqueue('n', 1, 'e', '{}')").unwrap();
    let (code, message) = error_of("UPDATE outbox.messages SET status = 'publishing'");
    assert_eq!(code, "ERRCODE_CHECK_VIOLATION", "{message}");
    // A superuser can still write one (here: without the constraint); the reaper returns it.
    Spi::run("ALTER TABLE outbox.messages DROP CONSTRAINT messages_claim_recorded").unwrap();
    Spi::run("UPDATE outbox.messages SET status = 'publishing', claimed_at = NULL, claimed_by = NULL").unwrap();
    assert_eq!(Spi::get_one::<i64>("SELECT outbox._reap_expired(30000)").unwrap(), Some(1));
    let row = Spi::get_one::<String>("SELECT status || ':' || last_error FROM outbox.messages").unwrap().unwrap();
    assert_eq!(row, "pending:the claim did not record when or by whom it was made");
}

#[pg_test]
fn counters_saturate_instead_of_stalling_the_relay() {
    Spi::run("SELECT outbox_enqueue('o', 1, 'e', '{}'), outbox_enqueue('o', 2, 'e', '{}')").unwrap();
    Spi::run("UPDATE outbox.messages SET attempts = 2147483647, rejections = 2147483647").unwrap();
    let ids = Spi::get_one::<Vec<i64>>("SELECT array_agg(id ORDER BY id) FROM outbox.messages").unwrap().unwrap();
    Spi::get_one_with_args::<i64>("SELECT outbox._reject($1, 'boom', 1000000, 10)", &[vec![ids[0]].into()]).unwrap();
    Spi::get_one_with_args::<i64>("SELECT outbox._release($1, 'down')", &[vec![ids[1]].into()]).unwrap();
    assert_eq!(
        Spi::get_one_with_args::<i64>("SELECT outbox._mark_published($1)", &[ids.clone().into()]).unwrap(),
        Some(1),
        "the rejected row is failed (max attempts reached), the other is published"
    );
    let counters = Spi::get_one::<String>(
        "SELECT string_agg(status || ':' || attempts || ':' || rejections, ',' ORDER BY id) FROM outbox.messages",
    )
    .unwrap()
    .unwrap();
    assert_eq!(counters, "failed:2147483647:2147483647,published:2147483647:2147483647");
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
