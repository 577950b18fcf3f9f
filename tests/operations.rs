//! Operating the relay against a real PostgreSQL and a real redis-server: per-aggregate order under
//! concurrency and failures, the lease reaper and crash recovery, dead letters, retention, the
//! health view and the age alert.

mod common;

use std::collections::{HashMap, HashSet};

use common::{status_counts, wait_for, wait_for_failed_rounds, Env, DEADLINE};

fn count(client: &mut postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).unwrap().get(0)
}

/// Checks that, in every stream, each aggregate's events (first occurrence of each event_id)
/// carry aggregate_seq 1, 2, 3, ... in stream order. Returns the event ids seen.
fn assert_per_aggregate_order(entries_by_stream: &HashMap<String, Vec<HashMap<String, String>>>) -> HashSet<String> {
    let mut seen = HashSet::new();
    let mut next_seq: HashMap<(String, String), i64> = HashMap::new();
    for (stream, entries) in entries_by_stream {
        for entry in entries {
            if !seen.insert(entry["event_id"].clone()) {
                continue; // an at-least-once duplicate
            }
            let key = (entry["aggregate_type"].clone(), entry["aggregate_id"].clone());
            let expected = next_seq.entry(key.clone()).or_insert(1);
            let seq: i64 = entry["aggregate_seq"].parse().unwrap();
            assert_eq!(seq, *expected, "stream {stream}: aggregate {key:?} out of order");
            *expected += 1;
        }
    }
    seen
}

#[test]
fn per_aggregate_order_holds_with_concurrent_producers_relays_and_rejections() {
    // Three relays, each holding a share of the shards, with small batches.
    let env = Env::start(&[
        "outbox.retry_delay = '20ms'",
        "outbox.max_attempts = 1000",
        "outbox.batch_size = 16",
        "outbox.workers = 3",
    ]);
    // Two aggregates publish to streams whose keys hold strings: Redis rejects them (WRONGTYPE)
    // until the keys are deleted below.
    let mut redis = env.redis.connection();
    for k in 0..2 {
        redis::cmd("SET").arg(format!("poison:{k}")).arg("x").query::<()>(&mut redis).unwrap();
    }

    let producers: Vec<_> = (0..4)
        .map(|p| {
            let mut client = env.pg.connect();
            std::thread::spawn(move || {
                let mut ids = Vec::new();
                for i in 0..150 {
                    let aggregate = (i * 7 + p * 3) % 20;
                    let stream = if aggregate < 2 { Some(format!("poison:{aggregate}")) } else { None };
                    let id: String = client
                        .query_one(
                            "SELECT outbox_enqueue('acct', $1, 'acct.changed', '{}', NULL, $2)::text",
                            &[&aggregate.to_string(), &stream],
                        )
                        .unwrap()
                        .get(0);
                    ids.push(id);
                }
                ids
            })
        })
        .collect();
    let committed: Vec<String> = producers.into_iter().flat_map(|h| h.join().unwrap()).collect();

    let mut client = env.pg.connect();
    wait_for(DEADLINE, "rejections on both poisoned aggregates", || {
        (count(&mut client, "SELECT count(DISTINCT aggregate_id) FROM outbox.messages WHERE rejections > 0") >= 2)
            .then_some(())
    });
    // While the head of an aggregate is rejected, its later events wait.
    let overtaken = count(
        &mut client,
        "SELECT count(*) FROM outbox.messages later JOIN outbox.messages earlier
             ON earlier.aggregate_type = later.aggregate_type AND earlier.aggregate_id = later.aggregate_id
            AND earlier.id < later.id
          WHERE later.status = 'published' AND earlier.status <> 'published'",
    );
    assert_eq!(overtaken, 0, "a later event was published before an earlier one");
    for k in 0..2 {
        redis::cmd("DEL").arg(format!("poison:{k}")).query::<()>(&mut redis).unwrap();
    }
    wait_for(DEADLINE, "every event published", || {
        (status_counts(&mut client).get("published").copied() == Some(600)).then_some(())
    });

    let mut by_stream = HashMap::new();
    for stream in ["outbox:acct", "poison:0", "poison:1"] {
        by_stream.insert(stream.to_string(), env.redis.entries(stream));
    }
    let seen = assert_per_aggregate_order(&by_stream);
    for id in &committed {
        assert!(seen.contains(id), "event {id} was never delivered");
    }
    assert_eq!(seen.len(), 600);
}

#[test]
fn crash_between_publish_and_mark_redelivers_with_the_same_event_id() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let first_relay = env.pg.relay_pid(&mut client);
    env.pg.set(&mut client, &[("outbox.fault_injection", "crash_after_publish")]);
    let mut committed = Vec::new();
    wait_for(DEADLINE, "the relay to crash after publishing", || {
        let id: String = client.query_one("SELECT outbox_enqueue('crash', 1, 'e', '{}')::text", &[]).unwrap().get(0);
        committed.push(id);
        env.pg.log().contains("crash_after_publish: exiting after publishing").then_some(())
    });
    let total = committed.len() as i64;
    wait_for(DEADLINE, "every event published after the restart", || {
        (status_counts(&mut client).get("published").copied() == Some(total)).then_some(())
    });
    let second_relay = env.pg.relay_pid(&mut client);
    assert_ne!(first_relay, second_relay);
    let entries = env.redis.entries("outbox:crash");
    let mut times_seen: HashMap<String, usize> = HashMap::new();
    for entry in &entries {
        *times_seen.entry(entry["event_id"].clone()).or_default() += 1;
    }
    for id in &committed {
        assert!(times_seen.contains_key(id), "lost {id}");
    }
    assert!(times_seen.values().any(|&n| n >= 2), "the crash must produce a duplicate: {times_seen:?}");
    // The dead relay's claim (in shared memory) was released as it exited; nothing to reap.
    // It fired once: later events are delivered once.
    let id: String = client.query_one("SELECT outbox_enqueue('crash', 2, 'e', '{}')::text", &[]).unwrap().get(0);
    let entries = env.redis.wait_for_entries("outbox:crash", entries.len() + 1);
    assert_eq!(entries.iter().filter(|e| e["event_id"] == id).count(), 1);
}

#[test]
fn poison_event_is_dead_lettered_without_holding_up_others_and_can_be_retried() {
    let env = Env::start(&["outbox.max_attempts = 3", "outbox.retry_delay = '10ms'", "outbox.poll_interval = '50ms'"]);
    let mut redis = env.redis.connection();
    redis::cmd("SET").arg("poisoned").arg("not a stream").query::<()>(&mut redis).unwrap();
    let mut client = env.pg.connect();
    client
        .batch_execute(
            "SELECT outbox_enqueue('good', i, 'e', '{}') FROM generate_series(1, 5) i;
             SELECT outbox_enqueue('bad', 1, 'e', '{}', NULL, 'poisoned');
             SELECT outbox_enqueue('bad', 1, 'e2', '{}');
             SELECT outbox_enqueue('good', i, 'e', '{}') FROM generate_series(6, 10) i;",
        )
        .unwrap();
    env.redis.wait_for_entries("outbox:good", 10);
    wait_for(DEADLINE, "the poison event to be dead-lettered", || {
        let row = client
            .query_one(
                "SELECT status, rejections, failed_at IS NOT NULL, coalesce(last_error, '') FROM outbox.messages
                  WHERE stream = 'poisoned'",
                &[],
            )
            .unwrap();
        (row.get::<_, String>(0) == "failed").then(|| {
            assert_eq!(row.get::<_, i32>(1), 3);
            assert!(row.get::<_, bool>(2));
            assert!(row.get::<_, String>(3).contains("WRONGTYPE"));
        })
    });
    // Its aggregate's next event waits behind it; everyone else went through.
    let waiting: String =
        client.query_one("SELECT status FROM outbox.messages WHERE event_type = 'e2'", &[]).unwrap().get(0);
    assert_eq!(waiting, "pending");
    assert_eq!(env.redis.xlen("outbox:bad"), 0);
    wait_for(DEADLINE, "the dead-letter WARNING", || {
        env.pg.log().contains("reached outbox.max_attempts").then_some(())
    });
    let failed: i64 = count(&mut client, "SELECT failed FROM outbox.stats");
    assert_eq!(failed, 1);

    redis::cmd("DEL").arg("poisoned").query::<()>(&mut redis).unwrap();
    assert_eq!(count(&mut client, "SELECT outbox.retry_failed()"), 1);
    env.redis.wait_for_entries("poisoned", 1);
    let entries = env.redis.wait_for_entries("outbox:bad", 1);
    assert_eq!(entries[0]["aggregate_seq"], "2");
    wait_for(DEADLINE, "everything published", || {
        (status_counts(&mut client).get("published").copied() == Some(12)).then_some(())
    });
}

#[test]
fn a_redis_outage_never_dead_letters_anything() {
    let mut env = Env::start(&["outbox.max_attempts = 2", "outbox.retry_delay = '10ms'"]);
    let mut client = env.pg.connect();
    env.redis.kill();
    client.batch_execute("SELECT outbox_enqueue('outage', i, 'e', '{}') FROM generate_series(1, 10) i").unwrap();
    // Many more failed rounds than max_attempts.
    wait_for_failed_rounds(&mut client, 5, "five failed rounds");
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox.messages WHERE status = 'failed' OR rejections > 0"), 0);
    let last_error: Option<String> = client.query_one("SELECT last_error FROM outbox.stats", &[]).unwrap().get(0);
    assert!(last_error.is_some_and(|e| !e.is_empty()));
    assert!(!client.query_one("SELECT redis_connected FROM outbox.stats", &[]).unwrap().get::<_, bool>(0));
    env.redis.restart();
    env.redis.wait_for_entries("outbox:outage", 10);
    wait_for(DEADLINE, "all published", || {
        (status_counts(&mut client).get("published").copied() == Some(10)).then_some(())
    });
}

#[test]
fn the_shards_of_a_hung_relay_are_taken_over_when_its_lease_expires() {
    let env = Env::start(&["outbox.lease = '1s'", "outbox.enabled = off"]);
    let mut client = env.pg.connect();
    client.batch_execute("SELECT outbox_enqueue('lease', i, 'e', '{}') FROM generate_series(1, 3) i").unwrap();
    // A claimer that stays connected but never finishes, like a hung relay.
    let mut hung = env.pg.connect();
    assert_eq!(count(&mut hung, "SELECT count(*) FROM outbox._claim_shards(pg_backend_pid(), 16, 1000)"), 16);
    env.pg.set(&mut client, &[("outbox.enabled", "on")]);
    env.redis.wait_for_entries("outbox:lease", 3);
    let relay = env.pg.relay_pid(&mut client);
    wait_for(DEADLINE, "the relay to hold every shard", || {
        (count(&mut client, &format!("SELECT count(*) FROM outbox.shards WHERE claimed_by = {relay}")) == 16)
            .then_some(())
    });
    let error: String = client
        .query_one("SELECT last_error FROM outbox.messages LIMIT 1", &[])
        .map(|r| r.get::<_, Option<String>>(0).unwrap_or_default())
        .unwrap();
    assert!(error.is_empty(), "published events carry no error: {error}");
    drop(hung);
}

#[test]
fn retention_removes_old_published_rows_and_keeps_failed_and_pending() {
    let env = Env::start(&[
        "outbox.retention = '1s'",
        "outbox.max_attempts = 1",
        "outbox.retry_delay = '10ms'",
        "outbox.poll_interval = '100ms'",
    ]);
    let mut redis = env.redis.connection();
    redis::cmd("SET").arg("poisoned").arg("x").query::<()>(&mut redis).unwrap();
    let mut client = env.pg.connect();
    client
        .batch_execute(
            "SELECT outbox_enqueue('kept', 1, 'e', '{}', NULL, 'poisoned');
             SELECT outbox_enqueue('kept', 1, 'e2', '{}');
             SELECT outbox_enqueue('gone', i, 'e', '{}') FROM generate_series(1, 2500) i;",
        )
        .unwrap();
    env.redis.wait_for_entries("outbox:gone", 2500);
    wait_for(DEADLINE, "retention to delete the published rows", || {
        let counts = status_counts(&mut client);
        (!counts.contains_key("published") && counts.get("failed") == Some(&1)).then_some(counts)
    });
    let counts = status_counts(&mut client);
    assert_eq!(counts.get("pending"), Some(&1), "{counts:?}");
    assert_eq!(env.redis.xlen("outbox:gone"), 2500, "retention never touches Redis");
    // The sequence numbering survives retention.
    redis::cmd("DEL").arg("poisoned").query::<()>(&mut redis).unwrap();
    client.batch_execute("SELECT outbox.retry_failed()").unwrap();
    client.batch_execute("SELECT outbox_enqueue('gone', 1, 'e', '{}')").unwrap();
    let entries = env.redis.wait_for_entries("outbox:gone", 2501);
    assert_eq!(entries.last().unwrap()["aggregate_seq"], "2");

    // outbox.forget_aggregates (opt-in) drops the counters of aggregates with no event left, except
    // one that an open transaction is enqueuing for right now: it neither waits for it nor forgets it.
    wait_for(DEADLINE, "retention to delete every row", || {
        (count(&mut client, "SELECT count(*) FROM outbox.messages") == 0).then_some(())
    });
    let aggregates = count(&mut client, "SELECT count(*) FROM outbox.aggregates");
    assert_eq!(aggregates, 2501, "one counter per aggregate ever seen ('gone' 1..2500 and 'kept' 1)");
    let mut writer = env.pg.connect();
    let mut open = writer.transaction().unwrap();
    open.batch_execute("SELECT outbox_enqueue('gone', 7, 'e', '{}')").unwrap();
    client.batch_execute("SET statement_timeout = '20s'").unwrap();
    assert_eq!(count(&mut client, "SELECT outbox.forget_aggregates()"), aggregates - 1);
    open.commit().unwrap();
    let last = env.redis.wait_for_entries("outbox:gone", 2502).pop().unwrap();
    assert_eq!(
        (last["aggregate_id"].as_str(), last["aggregate_seq"].as_str()),
        ("7", "2"),
        "gone/7 kept its numbering"
    );
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox.aggregates"), 1);
}

#[test]
fn stats_and_the_age_alert_tell_a_stalled_relay_at_a_glance() {
    let env = Env::start(&["outbox.alert_age = '1s'", "outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    client.batch_execute("SELECT outbox_enqueue('stats', 1, 'e', '{}')").unwrap();
    env.redis.wait_for_entries("outbox:stats", 1);
    wait_for(DEADLINE, "stats to show a healthy relay", || {
        let row = client
            .query_one(
                "SELECT pending, worker_pid IS NOT NULL, redis_connected, last_published_at IS NOT NULL,
                        oldest_pending_age IS NULL FROM outbox.stats",
                &[],
            )
            .unwrap();
        (row.get::<_, i64>(0) == 0
            && row.get::<_, bool>(1)
            && row.get::<_, bool>(2)
            && row.get::<_, bool>(3)
            && row.get::<_, bool>(4))
        .then_some(())
    });

    env.pg.set(&mut client, &[("outbox.enabled", "off")]);
    wait_for(DEADLINE, "the relay to pause", || env.pg.log().contains("outbox.enabled is off").then_some(()));
    client.batch_execute("SELECT outbox_enqueue('stats', 2, 'e', '{}')").unwrap();
    wait_for(DEADLINE, "the age WARNING", || {
        env.pg
            .log()
            .lines()
            .find(|l| l.contains("WARNING") && l.contains("oldest pending event is"))
            .map(str::to_string)
    });
    let age_ms: f64 = client
        .query_one("SELECT (extract(epoch FROM oldest_pending_age) * 1000)::float8 FROM outbox.stats", &[])
        .unwrap()
        .get(0);
    assert!(age_ms >= 1000.0);
    env.pg.set(&mut client, &[("outbox.enabled", "on")]);
    env.redis.wait_for_entries("outbox:stats", 2);
    wait_for(DEADLINE, "the alert to clear", || env.pg.log().contains("alert cleared").then_some(()));
    let warnings = env.pg.log().matches("oldest pending event is").count();
    assert!(warnings >= 2, "one WARNING and one recovery line");
}

#[test]
fn several_workers_share_the_load_and_keep_per_aggregate_order() {
    let env = Env::start(&["outbox.workers = 3", "outbox.batch_size = 20"]);
    let mut client = env.pg.connect();
    wait_for(DEADLINE, "three relays", || {
        (count(&mut client, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay'") == 3)
            .then_some(())
    });
    let producers: Vec<_> = (0..4)
        .map(|p| {
            let mut client = env.pg.connect();
            std::thread::spawn(move || {
                (0..500)
                    .map(|i| {
                        client
                            .query_one(
                                "SELECT outbox_enqueue('multi', $1, 'e', '{}')::text",
                                &[&((i * 13 + p * 7) % 50).to_string()],
                            )
                            .unwrap()
                            .get::<_, String>(0)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let committed: Vec<String> = producers.into_iter().flat_map(|h| h.join().unwrap()).collect();
    wait_for(DEADLINE, "every event published", || {
        (status_counts(&mut client).get("published").copied() == Some(2000)).then_some(())
    });
    let by_stream = HashMap::from([("outbox:multi".to_string(), env.redis.entries("outbox:multi"))]);
    let seen = assert_per_aggregate_order(&by_stream);
    assert!(committed.iter().all(|id| seen.contains(id)));
    let workers: i32 = client.query_one("SELECT workers FROM outbox.stats", &[]).unwrap().get(0);
    assert_eq!(workers, 3);

    // Lowering outbox.workers on reload stops the extra relays.
    env.pg.set(&mut client, &[("outbox.workers", "1")]);
    wait_for(DEADLINE, "one relay", || {
        (count(&mut client, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay'") == 1)
            .then_some(())
    });
    client.batch_execute("SELECT outbox_enqueue('multi', 'after', 'e', '{}')").unwrap();
    env.redis.wait_for_entries("outbox:multi", 2001);
}

/// The statistics are stale by nature: ANALYZE may run while a large enqueue is still uncommitted
/// (it counts no rows) or while a table is empty. The relays read the log and the counters
/// straight from their indexes, without the planner (src/log/window.rs, src/log/counters.rs), because
/// planned reads went wrong under such statistics: in the old design a claim that sorted every
/// undelivered row took 500 ms per 100 events, and in this one a generic plan of the counter probe
/// made while the counters were empty joined every counter with every aggregate of a batch (8.5 s
/// a round). With the statistics at their most misleading, a read stops at its size, the counters
/// are found, and the relay numbers every event from its aggregate's counter.
#[test]
fn the_relays_reads_need_no_statistics() {
    let env = Env::start(&["outbox.enabled = off"]);
    let mut client = env.pg.connect();
    client
        .batch_execute(
            "ALTER TABLE outbox.events_0 SET (autovacuum_enabled = false);
             ALTER TABLE outbox.aggregates SET (autovacuum_enabled = false);
             ANALYZE outbox.aggregates;",
        )
        .unwrap();
    let mut producer = env.pg.connect();
    let mut big = producer.transaction().unwrap();
    big.batch_execute("SELECT outbox_enqueue('stale', i % 5000, 'e', '{}') FROM generate_series(1, 20000) i").unwrap();
    env.pg.connect().batch_execute("ANALYZE outbox.events_0").unwrap();
    big.commit().unwrap();
    let reltuples: f32 =
        client.query_one("SELECT reltuples FROM pg_class WHERE oid = 'outbox.events_0'::regclass", &[]).unwrap().get(0);
    assert!(reltuples < 1.0, "ANALYZE counted the uncommitted rows: {reltuples}");
    // Counters the empty table's statistics know nothing of: each aggregate is at 1 already.
    client
        .batch_execute("INSERT INTO outbox.aggregates SELECT 'stale', i::text, 1 FROM generate_series(0, 4999) i")
        .unwrap();
    for shard in 0..6i16 {
        let read: i64 = client
            .query_one(
                "SELECT count(*) FROM tests.read_shard($1, (SELECT cursor FROM outbox.shards WHERE shard = $1),
                                                          pg_current_snapshot(), 100)",
                &[&shard],
            )
            .unwrap()
            .get(0);
        assert_eq!(read, 100, "a batch stops at its size");
    }
    let ids: Vec<String> = (0..5000).map(|i| i.to_string()).chain(["unknown".to_string()]).collect();
    let types = vec!["stale".to_string(); ids.len()];
    let found: i64 = client
        .query_one("SELECT count(*) FILTER (WHERE last_seq = 1) FROM tests.counters($1, $2)", &[&types, &ids])
        .unwrap()
        .get(0);
    assert_eq!(found, 5000, "every counter is found, and none for an aggregate that has none");
    env.pg.set(&mut client, &[("outbox.enabled", "on")]);
    let entries = env.redis.wait_for_entries("outbox:stale", 20000);
    let mut seqs: HashMap<&str, Vec<i64>> = HashMap::new();
    for entry in &entries {
        seqs.entry(entry["aggregate_id"].as_str()).or_default().push(entry["aggregate_seq"].parse().unwrap());
    }
    assert_eq!(seqs.len(), 5000);
    for (aggregate, seqs) in seqs {
        assert_eq!(seqs, [2, 3, 4, 5], "aggregate {aggregate} continues from its counter, in order");
    }
}

/// The shared buffers one statement touched (hits and reads), from EXPLAIN (ANALYZE, BUFFERS): what
/// it did, counted the same on every machine and whatever its load.
fn buffers_touched(client: &mut postgres::Client, sql: &str) -> i64 {
    let plan: serde_json::Value =
        client.query_one(&format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"), &[]).unwrap().get(0);
    let top = &plan[0]["Plan"];
    top["Shared Hit Blocks"].as_i64().unwrap_or(0) + top["Shared Read Blocks"].as_i64().unwrap_or(0)
}

/// Issue 23, item 3: with one transaction of 2,000,000 events in a log table whose statistics had
/// seen one distinct txid, `oldest_pending_age()` and the count behind `outbox.stats` took ten
/// seconds each (a bitmap scan filtered on the shard alone), and the relay's housekeeping, which
/// asks for the age every second, with them. Both are index walks now, whatever the statistics:
/// the age reads one row per undelivered transaction, the count each undelivered row once.
#[test]
fn health_reads_what_is_undelivered_and_nothing_more_whatever_the_statistics() {
    let env = Env::start(&["outbox.enabled = off"]);
    let mut client = env.pg.connect();
    client.batch_execute("ALTER TABLE outbox.events_0 SET (autovacuum_enabled = false)").unwrap();
    let mut producer = env.pg.connect();
    let mut big = producer.transaction().unwrap();
    big.batch_execute("SELECT outbox_enqueue('lying', i, 'e', '{}') FROM generate_series(1, 100000) i").unwrap();
    big.commit().unwrap();
    // Statistics that know one transaction only; then more transactions they know nothing of.
    client.batch_execute("ANALYZE outbox.events_0").unwrap();
    client
        .batch_execute("SELECT outbox_enqueue('lying', 'later-' || i, 'e', '{}') FROM generate_series(1, 50) i")
        .unwrap();
    let rows = 100_050i64;
    let (pending, age_known): (i64, bool) = {
        let row = client.query_one("SELECT pending, oldest_pending_age IS NOT NULL FROM outbox.stats", &[]).unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!((pending, age_known), (rows, true));
    // The age: an index probe and one row per undelivered transaction (51 here), per shard.
    let age = buffers_touched(&mut client, "SELECT outbox.oldest_pending_age()");
    assert!(age < 16 * 51 * 4, "the age touched {age} buffers for 51 undelivered transactions");
    // The count: each undelivered row once, and the index pages above them.
    let pages: i64 = client
        .query_one(
            "SELECT (pg_relation_size('outbox.events_0') + pg_relation_size('outbox.events_0_batch_idx')) / 8192",
            &[],
        )
        .unwrap()
        .get(0);
    let count = buffers_touched(&mut client, "SELECT * FROM outbox.stats");
    assert!(
        count < rows + pages + 1000,
        "outbox.stats touched {count} buffers for {rows} undelivered rows ({pages} pages)"
    );
    env.pg.set(&mut client, &[("outbox.enabled", "on")]);
    env.redis.wait_for_entries("outbox:lying", rows as usize);
    let after: i64 = client.query_one("SELECT pending FROM outbox.stats", &[]).unwrap().get(0);
    assert_eq!(after, 0);
}

/// What counts as undelivered is one rule (src/sql/health.sql) written in two forms: outbox._health
/// walks the indexes for outbox.stats and oldest_pending_age, outbox.messages says it event by
/// event. Here they must agree, and on the numbers, through every way an event is consumed: a
/// shard's cursor, the position reached in a window published in parts (inside a transaction, next
/// to a rolled-back subtransaction's row), and the failure path (waiting and failed). The relays
/// are paused and this session finishes batches as a relay would.
#[test]
fn messages_and_stats_agree_on_what_is_undelivered() {
    let env = Env::start(&["outbox.enabled = off"]);
    let mut client = env.pg.connect();
    // One aggregate in each of three shards.
    let ids: Vec<(String, i16)> = client
        .query(
            "SELECT DISTINCT ON (tests.shard_of('agree', i::text)) i::text, tests.shard_of('agree', i::text)
               FROM generate_series(1, 1000) i ORDER BY tests.shard_of('agree', i::text), i LIMIT 3",
            &[],
        )
        .unwrap()
        .into_iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let [(p, shard_p), (q, shard_q), (r, shard_r)] = [ids[0].clone(), ids[1].clone(), ids[2].clone()];
    let enqueue = |n: usize, id: &str| {
        format!("SELECT outbox_enqueue('agree', '{id}', 'e', '{{}}') FROM generate_series(1, {n});")
    };
    client.batch_execute(&format!("BEGIN; {} COMMIT;", enqueue(2, &p))).unwrap();
    client
        .batch_execute(&format!(
            "BEGIN; {} SAVEPOINT s; {} ROLLBACK TO SAVEPOINT s; COMMIT;",
            enqueue(2, &p),
            enqueue(1, &p)
        ))
        .unwrap();
    client.batch_execute(&enqueue(1, &p)).unwrap();
    client.batch_execute(&enqueue(2, &q)).unwrap();
    client.batch_execute(&enqueue(3, &r)).unwrap();

    let agree = |client: &mut postgres::Client, pending: i64, failed: i64| {
        let row = client
            .query_one(
                "SELECT h.undelivered, h.failed,
                        (SELECT count(*) FROM outbox.messages WHERE status = 'pending'),
                        (SELECT count(*) FROM outbox.messages WHERE status = 'failed'),
                        h.oldest IS NOT DISTINCT FROM (SELECT min(created_at) FROM outbox.messages WHERE status = 'pending'),
                        (SELECT s.pending FROM outbox.stats s)
                   FROM outbox._health() h",
                &[],
            )
            .unwrap();
        let (undelivered, health_failed, messages_pending, messages_failed, same_oldest, stats_pending): (
            i64,
            i64,
            i64,
            i64,
            bool,
            i64,
        ) = (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4), row.get(5));
        assert_eq!((undelivered, messages_pending, stats_pending), (pending, pending, pending), "undelivered");
        assert_eq!((health_failed, messages_failed), (failed, failed), "failed");
        assert!(same_oldest, "outbox._health and outbox.messages disagree on the oldest undelivered event");
    };
    agree(&mut client, 10, 0);

    // This session holds every shard, as a relay would.
    let me: i32 = client.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox._claim_shards(pg_backend_pid(), 16, 600000)"), 16);
    let advance = |client: &mut postgres::Client, shard: i16, cursor: &str, window: Option<(&str, i64, i64)>| {
        client
            .execute(
                "SELECT outbox._advance($1, ARRAY[$2::smallint], ARRAY[$3::text], ARRAY[$4::text], ARRAY[$5::bigint],
                                        ARRAY[$6::bigint], '{}', '{}', '{}', '{}', '{}', '{}')",
                &[&me, &shard, &cursor, &window.map(|w| w.0), &window.map(|w| w.1), &window.map(|w| w.2)],
            )
            .unwrap();
    };
    let now: String = client.query_one("SELECT pg_current_snapshot()::text", &[]).unwrap().get(0);

    // Shard q's cursor moves past its two events.
    advance(&mut client, shard_q, &now, None);
    agree(&mut client, 8, 0);

    // Shard p's window is published in parts up to the first event of its second transaction (whose
    // rolled-back subtransaction's row is in the index too): the first transaction and that event
    // are consumed.
    let transactions: Vec<(i64, i64)> = client
        .query(
            "SELECT min(id), max(id) FROM outbox.events WHERE shard = $1 GROUP BY txid ORDER BY min(id)",
            &[&shard_p],
        )
        .unwrap()
        .into_iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(transactions.len(), 3);
    let cursor_p: String =
        client.query_one("SELECT cursor::text FROM outbox.shards WHERE shard = $1", &[&shard_p]).unwrap().get(0);
    advance(&mut client, shard_p, &cursor_p, Some((&now, transactions[1].1, transactions[1].0)));
    agree(&mut client, 5, 0);

    // Shard r: Redis rejected its first event (failed at once), the second waits behind it, and its
    // cursor moves past all three.
    client
        .batch_execute(&format!(
            "SELECT outbox._hold(ARRAY(SELECT event_id FROM outbox.events WHERE shard = {shard_r} ORDER BY id LIMIT 2),
                                 ARRAY[1, 2]::bigint[], ARRAY['WRONGTYPE', NULL], 1, 10)"
        ))
        .unwrap();
    advance(&mut client, shard_r, &now, None);
    agree(&mut client, 3, 1);
}

/// What a plan read: every node's rows, and the rows its filters removed, over all its loops
/// (EXPLAIN's figures are per loop).
fn rows_examined(node: &serde_json::Value) -> f64 {
    let loops = node["Actual Loops"].as_f64().unwrap_or(0.0);
    let per_loop =
        ["Actual Rows", "Rows Removed by Filter", "Rows Removed by Index Recheck", "Rows Removed by Join Filter"]
            .iter()
            .map(|key| node[*key].as_f64().unwrap_or(0.0))
            .sum::<f64>();
    let below: f64 = node["Plans"].as_array().map_or(0.0, |plans| plans.iter().map(rows_examined).sum());
    per_loop * loops + below
}

/// Issue 35, item 8: counting what is not published in outbox.messages took 17.9 s while one
/// transaction of 100,000 events was published in parts: for every event of it, the view looked up
/// its transaction's largest id in the shard, and under the statistics of a long history that
/// lookup read every event of the transaction (12,435 loops over 6,218 index entries each). The
/// view now costs each event a bounded probe, whatever its transaction's size: here the rows the
/// plan reads stay within a small multiple of the view's rows, and every status is the one a
/// straightforward computation (each transaction's largest id by GROUP BY) gives. The relays are
/// paused and this session publishes the windows in parts as a relay would.
#[test]
fn messages_reads_each_event_once_while_a_large_transaction_is_published_in_parts() {
    let env = Env::start(&["outbox.enabled = off"]);
    let mut client = env.pg.connect();
    let me: i32 = client.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox._claim_shards(pg_backend_pid(), 16, 600000)"), 16);
    let advance_all = |client: &mut postgres::Client, windows: Option<(&str, &[i64], &[i64])>| {
        let cursors: Vec<String> = client
            .query("SELECT cursor::text FROM outbox.shards ORDER BY shard", &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let now: String = client.query_one("SELECT pg_current_snapshot()::text", &[]).unwrap().get(0);
        let shards: Vec<i16> = (0..16).collect();
        // A window in parts leaves the cursors where they are; without one they move to now.
        let cursors = if windows.is_some() { cursors } else { vec![now; 16] };
        let uptos: Vec<Option<String>> = vec![windows.map(|w| w.0.to_string()); 16];
        let max_ids: Vec<Option<i64>> = (0..16).map(|shard| windows.map(|w| w.1[shard])).collect();
        let last_ids: Vec<Option<i64>> = (0..16).map(|shard| windows.map(|w| w.2[shard])).collect();
        client
            .execute(
                "SELECT outbox._advance($1, $2, $3, $4, $5, $6, '{}', '{}', '{}', '{}', '{}', '{}')",
                &[&me, &shards, &cursors, &uptos, &max_ids, &last_ids],
            )
            .unwrap();
    };
    // A history of 2,000 small transactions, published (their shards' cursors passed them).
    client
        .batch_execute(
            "DO $$ BEGIN
                 FOR t IN 1..2000 LOOP
                     PERFORM outbox_enqueue('history', (t * 10 + i)::text, 'e', '{}') FROM generate_series(1, 10) i;
                     COMMIT;
                 END LOOP;
             END $$",
        )
        .unwrap();
    advance_all(&mut client, None);
    // In the next window: a small transaction, then one of 20,000 events over 20,000 aggregates
    // (1,250 or so a shard), then another small one.
    client.batch_execute("SELECT outbox_enqueue('early', i::text, 'e', '{}') FROM generate_series(1, 100) i").unwrap();
    client.batch_execute("SELECT outbox_enqueue('big', i::text, 'e', '{}') FROM generate_series(1, 20000) i").unwrap();
    client.batch_execute("SELECT outbox_enqueue('late', i::text, 'e', '{}') FROM generate_series(1, 100) i").unwrap();
    client.batch_execute("VACUUM ANALYZE outbox.events_0, outbox.events_1, outbox.events_2, outbox.ticks").unwrap();
    // Each shard's window is published up to the middle of the large transaction.
    let (max_ids, last_ids): (Vec<i64>, Vec<i64>) = (0..16i16)
        .map(|shard| {
            let row = client
                .query_one(
                    "SELECT max(id), percentile_disc(0.5) WITHIN GROUP (ORDER BY id)
                       FROM outbox.events WHERE shard = $1 AND aggregate_type = 'big'",
                    &[&shard],
                )
                .unwrap();
            (row.get::<_, i64>(0), row.get::<_, i64>(1))
        })
        .unzip();
    let upto: String = client.query_one("SELECT pg_current_snapshot()::text", &[]).unwrap().get(0);
    advance_all(&mut client, Some((&upto, &max_ids, &last_ids)));
    let expected_pending = count(
        &mut client,
        "SELECT count(*) FROM outbox.events e JOIN outbox.shards s USING (shard)
          WHERE e.aggregate_type = 'late' OR (e.aggregate_type = 'big' AND e.id > s.window_last_id)",
    );
    assert!((9_900..=10_200).contains(&expected_pending), "{expected_pending}");

    // Every status as a straightforward computation gives it.
    let wrong = count(
        &mut client,
        "WITH largest AS (SELECT shard, txid, max(id) AS max_id FROM outbox.events GROUP BY shard, txid),
              expected AS (
                  SELECT e.id, CASE WHEN pg_visible_in_snapshot(e.txid, s.cursor)
                                      OR (pg_visible_in_snapshot(e.txid, s.window_upto)
                                          AND (l.max_id, e.id) <= (s.window_max_id, s.window_last_id))
                                    THEN 'published' ELSE 'pending' END AS status
                    FROM outbox.events e JOIN outbox.shards s USING (shard) JOIN largest l USING (shard, txid))
         SELECT count(*) FROM expected x FULL JOIN outbox.messages m USING (id) WHERE m.status IS DISTINCT FROM x.status",
    );
    assert_eq!(wrong, 0, "events whose status differs from the straightforward computation");
    assert_eq!(
        count(&mut client, "SELECT count(*) FROM outbox.messages WHERE status <> 'published'"),
        expected_pending
    );

    // The question of the issue reads each event a bounded number of times.
    let rows = count(&mut client, "SELECT count(*) FROM outbox.messages");
    assert_eq!(rows, 20_000 + 20_000 + 200);
    let plan: serde_json::Value = client
        .query_one(
            "EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) SELECT count(*) FROM outbox.messages WHERE status <> 'published'",
            &[],
        )
        .unwrap()
        .get(0);
    let examined = rows_examined(&plan[0]["Plan"]);
    assert!(
        examined <= 20.0 * rows as f64,
        "the count read {examined} rows for a view of {rows}:\n{}",
        serde_json::to_string_pretty(&plan).unwrap()
    );
    // And so does the published_at of every event.
    let plan: serde_json::Value = client
        .query_one(
            "EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) SELECT max(published_at), count(*) FILTER (WHERE status = 'pending') FROM outbox.messages",
            &[],
        )
        .unwrap()
        .get(0);
    let examined = rows_examined(&plan[0]["Plan"]);
    assert!(examined <= 20.0 * rows as f64, "published_at read {examined} rows for a view of {rows}");
}

/// The age check (`outbox._log_pending(false)`, once a second in housekeeping) stops its walk at
/// the first snapshot recorded after the oldest event it found (src/log/pending.rs, `walk_bound`);
/// it finds the same oldest as the counting walk, which reads every undelivered transaction, also
/// when a transaction drew its txid long before it enqueued, or enqueued long before it committed.
#[test]
fn the_age_check_finds_the_oldest_the_counting_walk_finds() {
    let env = Env::start(&["outbox.enabled = off"]);
    let mut client = env.pg.connect();
    let mut drew_early = env.pg.connect();
    let mut committed_late = env.pg.connect();
    let same = |client: &mut postgres::Client, when: &str| {
        let row = client
            .query_one(
                "SELECT (SELECT oldest FROM outbox._log_pending(false)), (SELECT oldest FROM outbox._log_pending(true)),
                        (SELECT events FROM outbox._log_pending(true))",
                &[],
            )
            .unwrap();
        let (bounded, counted): (Option<std::time::SystemTime>, Option<std::time::SystemTime>) =
            (row.get(0), row.get(1));
        assert_eq!(bounded, counted, "{when}: {} pending", row.get::<_, i64>(2));
        counted
    };
    assert_eq!(same(&mut client, "an empty log"), None);
    drew_early.batch_execute("BEGIN; SELECT pg_current_xact_id()").unwrap();
    committed_late.batch_execute("BEGIN; SELECT outbox_enqueue('order', 'committed-late', 'created', '{}')").unwrap();
    for round in 0..6 {
        for i in 0..40 {
            client.execute("SELECT outbox_enqueue('order', $1, 'created', '{}')", &[&format!("{round}-{i}")]).unwrap();
        }
        // A snapshot as housekeeping records it (outbox._record_snapshot), without its one-a-second
        // limit.
        client
            .batch_execute(
                "INSERT INTO outbox.snapshots (taken_at, snap, recorded_by) VALUES (now(), pg_current_snapshot(), pg_current_xact_id())",
            )
            .unwrap();
        same(&mut client, &format!("round {round}"));
    }
    drew_early.batch_execute("SELECT outbox_enqueue('order', 'drew-early', 'created', '{}'); COMMIT").unwrap();
    let before = same(&mut client, "a transaction that drew its txid first committed");
    committed_late.batch_execute("COMMIT").unwrap();
    let after = same(&mut client, "a transaction that enqueued early committed");
    assert!(after < before, "the late commit's event is the oldest: {after:?} vs {before:?}");
}

/// A snapshot's xmax is the latest completed txid plus one, not the next txid to be drawn: a
/// transaction that drew its txid and enqueued before the snapshot, and is still running then, is
/// above its xmax (and not in its xip). The age check must not stop its walk before it.
#[test]
fn the_age_check_sees_a_transaction_running_above_a_snapshots_xmax() {
    let env = Env::start(&["outbox.enabled = off"]);
    let mut client = env.pg.connect();
    let shard_of = |client: &mut postgres::Client, id: &str| -> i16 {
        client.batch_execute("BEGIN").unwrap();
        client.execute("SELECT outbox_enqueue('order', $1, 'created', '{}')", &[&id]).unwrap();
        let shard = client.query_one("SELECT shard FROM outbox.events WHERE aggregate_id = $1", &[&id]).unwrap().get(0);
        client.batch_execute("ROLLBACK").unwrap();
        shard
    };
    let first_id = "drew-first";
    let shard = shard_of(&mut client, first_id);
    let older_id = (0..10_000)
        .map(|i| format!("enqueued-first-{i}"))
        .find(|id| shard_of(&mut client, id) == shard)
        .expect("an aggregate of the same shard");
    let mut first = env.pg.connect();
    let mut older = env.pg.connect();
    // `first` draws the lower txid, `older` the higher one and enqueues first; `first` enqueues
    // and commits, then a snapshot is recorded while `older` still runs: its xmax is `older`'s.
    first.batch_execute("BEGIN; SELECT pg_current_xact_id()").unwrap();
    older.batch_execute("BEGIN").unwrap();
    older.execute("SELECT outbox_enqueue('order', $1, 'created', '{}')", &[&older_id]).unwrap();
    first.execute("SELECT outbox_enqueue('order', $1, 'created', '{}')", &[&first_id]).unwrap();
    first.batch_execute("COMMIT").unwrap();
    let recorded: bool = client.query_one("SELECT outbox._record_snapshot(true)", &[]).unwrap().get(0);
    assert!(recorded);
    older.batch_execute("COMMIT").unwrap();
    let row = client
        .query_one(
            "SELECT (SELECT oldest FROM outbox._log_pending(false)), (SELECT oldest FROM outbox._log_pending(true)),
                    (SELECT created_at FROM outbox.events WHERE aggregate_id = $1), (SELECT snap::text FROM outbox.snapshots)",
            &[&older_id],
        )
        .unwrap();
    let (bounded, counted, expected): (
        Option<std::time::SystemTime>,
        Option<std::time::SystemTime>,
        Option<std::time::SystemTime>,
    ) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(counted, expected);
    assert_eq!(bounded, counted, "the bounded walk stopped early (snapshot {})", row.get::<_, String>(3));
}
