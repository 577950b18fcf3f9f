//! outbox-relay relays what the SQL-only install logs, as the background worker does (issue 37,
//! step 4): every committed event reaches Redis once a relay runs, none of a rolled-back
//! transaction, each aggregate's events in order and numbered 1, 2, 3, ...; a relay killed with
//! SIGKILL mid-drain and started again loses nothing (at least once: what its round in flight had
//! sent may come twice, in order); two relays share the shards.

mod common;

use std::collections::{HashMap, HashSet};

use common::*;
use outbox_protocol::entry as fields;
use outbox_testkit::Redis;

/// Enqueues `transactions` transactions of `per_transaction` events each, spread over
/// `aggregates` orders, as the database's owner.
fn enqueue(pg: &Cluster, transactions: usize, per_transaction: usize, aggregates: usize) -> usize {
    let mut app = connect_as(pg, DATABASE, OWNER);
    for t in 0..transactions {
        let mut tx = app.transaction().unwrap();
        tx.execute(
            "SELECT outbox_enqueue('order', (($1::int8 + n) % $2::int8)::text, 'order.created', \
                    jsonb_build_object('t', $1::int8, 'n', n)) FROM generate_series(1, $3::int8) AS n",
            &[&(t as i64), &(aggregates as i64), &(per_transaction as i64)],
        )
        .unwrap();
        tx.commit().unwrap();
    }
    transactions * per_transaction
}

/// The entries of stream `outbox:order`, grouped by aggregate, in stream order: (seq, event_id).
fn by_aggregate(redis: &Redis) -> HashMap<String, Vec<(i64, String)>> {
    let mut grouped: HashMap<String, Vec<(i64, String)>> = HashMap::new();
    for entry in redis.entries("outbox:order") {
        grouped
            .entry(entry[fields::AGGREGATE_ID].clone())
            .or_default()
            .push((entry[fields::AGGREGATE_SEQ].parse().unwrap(), entry[fields::EVENT_ID].clone()));
    }
    grouped
}

/// Waits until Redis holds `count` distinct events.
fn wait_for_distinct(redis: &Redis, count: usize) {
    wait_for(DEADLINE, &format!("{count} distinct events in Redis"), || {
        let distinct: HashSet<String> =
            redis.entries("outbox:order").into_iter().map(|entry| entry[fields::EVENT_ID].clone()).collect();
        (distinct.len() >= count).then_some(())
    });
}

/// Each aggregate's entries, duplicates aside, are numbered 1, 2, 3, ... in stream order; a
/// duplicate (at least once) only repeats an event already there.
fn assert_in_order(redis: &Redis, total: usize) {
    let mut events = 0;
    for (aggregate, entries) in by_aggregate(redis) {
        let mut next = 1;
        let mut seen = HashMap::new();
        for (seq, event_id) in entries {
            match seen.get(&seq) {
                Some(first) => assert_eq!(first, &event_id, "aggregate {aggregate}: seq {seq} names two events"),
                None => {
                    assert_eq!(seq, next, "aggregate {aggregate}: seq {seq} where {next} was due");
                    seen.insert(seq, event_id);
                    next += 1;
                }
            }
        }
        events += seen.len();
    }
    assert_eq!(events, total, "every event once, duplicates aside");
}

fn start_relay(pg: &Cluster, redis: &Redis) -> RelayProcess {
    let url = url(pg, OWNER, DATABASE);
    let relay = RelayProcess::start(&["--database-url", &url, "--redis-url", &redis.url()]);
    relay.wait_for_line("ready: relaying database");
    relay
}

#[test]
fn every_committed_event_reaches_redis_in_order_and_no_rolled_back_one() {
    let pg = sql_only_server();
    let redis = Redis::start();
    let mut relay = start_relay(&pg, &redis);
    let total = enqueue(&pg, 40, 25, 7);
    {
        let mut app = connect_as(&pg, DATABASE, OWNER);
        let mut tx = app.transaction().unwrap();
        tx.execute("SELECT outbox_enqueue('order', 'rolled-back', 'order.created', '{}'::jsonb)", &[]).unwrap();
        tx.rollback().unwrap();
    }
    wait_for_distinct(&redis, total);
    assert_in_order(&redis, total);
    assert!(!by_aggregate(&redis).contains_key("rolled-back"));
    // Finished too: nothing is left pending in the database.
    let mut app = connect_as(&pg, DATABASE, OWNER);
    wait_for(DEADLINE, "nothing pending", || {
        let pending: i64 = app.query_one("SELECT pending FROM outbox.stats", &[]).unwrap().get(0);
        (pending == 0).then_some(())
    });
    assert!(relay.terminate().success());
}

#[test]
fn a_relay_killed_mid_drain_and_started_again_loses_nothing() {
    let pg = sql_only_server();
    let redis = Redis::start();
    let total = enqueue(&pg, 4, 5_000, 50);
    let mut relay = start_relay(&pg, &redis);
    wait_for(DEADLINE, "the drain to have begun", || (redis.xlen("outbox:order") > 0).then_some(()));
    relay.kill9();
    let mut relay = start_relay(&pg, &redis);
    wait_for_distinct(&redis, total);
    assert_in_order(&redis, total);
    assert!(relay.terminate().success());
}

#[test]
fn two_relays_share_the_shards_and_publish_everything_once_in_order() {
    let pg = sql_only_server();
    let redis = Redis::start();
    let mut first = start_relay(&pg, &redis);
    let mut second = start_relay(&pg, &redis);
    let total = enqueue(&pg, 30, 20, 16);
    wait_for_distinct(&redis, total);
    assert_in_order(&redis, total);
    // Both relays held shards: each one's backend pid is in outbox.shards (or was: a full read
    // shares them out once both are counted).
    let mut app = connect_as(&pg, DATABASE, OWNER);
    wait_for(DEADLINE, "both relays to hold shards", || {
        let holders: i64 = app
            .query_one("SELECT count(DISTINCT claimed_by) FROM outbox.shards WHERE claimed_by IS NOT NULL", &[])
            .unwrap()
            .get(0);
        (holders == 2).then_some(())
    });
    assert!(first.terminate().success());
    assert!(second.terminate().success());
}

#[test]
fn relays_writing_to_different_streams_refuse_to_run_together() {
    let pg = sql_only_server();
    let redis = Redis::start();
    let mut first = start_relay(&pg, &redis);
    let url = url(&pg, OWNER, DATABASE);
    let mut second = RelayProcess::start(&[
        "--database-url",
        &url,
        "--redis-url",
        &redis.url(),
        "--stream",
        "elsewhere:{aggregate_type}",
    ]);
    let line = second.wait_for_line("writes to streams");
    assert!(line.contains("\"elsewhere:{aggregate_type}\"") && line.contains("\"outbox:{aggregate_type}\""), "{line}");
    let total = enqueue(&pg, 5, 20, 4);
    wait_for_distinct(&redis, total);
    assert_in_order(&redis, total);
    assert_eq!(redis.stream_keys(), vec!["outbox:order".to_string()], "the refused relay published nothing");
    assert!(!second.lines().iter().any(|line| line.contains("ready: relaying")), "{:?}", second.lines());
    // Once the first one is gone, the second one joins (the first's row is of an ended connection).
    assert!(first.terminate().success());
    second.wait_for_line("ready: relaying database");
    let more = enqueue(&pg, 1, 10, 1);
    wait_for(DEADLINE, "the second relay to publish to its streams", || {
        (redis.stream_keys().iter().any(|key| key == "elsewhere:order") && redis.xlen("elsewhere:order") == more)
            .then_some(())
    });
    assert!(second.terminate().success());
}

#[test]
fn a_poison_event_is_dead_lettered_without_stalling_the_others() {
    let pg = sql_only_server();
    let redis = Redis::start();
    // A key that is not a stream: Redis refuses every XADD to it (WRONGTYPE).
    redis.query::<()>(redis::cmd("SET").arg("poisoned").arg("not a stream"));
    let url = url(&pg, OWNER, DATABASE);
    let mut relay = RelayProcess::start(&[
        "--database-url",
        &url,
        "--redis-url",
        &redis.url(),
        "--max-attempts",
        "2",
        "--retry-delay",
        "10ms",
    ]);
    relay.wait_for_line("ready: relaying database");
    let mut app = connect_as(&pg, DATABASE, OWNER);
    app.execute("SELECT outbox_enqueue('refund', '7', 'refund.created', '{}'::jsonb, NULL, 'poisoned')", &[]).unwrap();
    // Its aggregate's next event waits behind it; the other aggregates' do not.
    app.execute("SELECT outbox_enqueue('refund', '7', 'refund.settled', '{}'::jsonb)", &[]).unwrap();
    let total = enqueue(&pg, 5, 10, 3);
    wait_for_distinct(&redis, total);
    assert_in_order(&redis, total);
    wait_for(DEADLINE, "the poison event to be dead-lettered", || {
        let failed: i64 = app
            .query_one("SELECT count(*) FROM outbox.messages WHERE status = 'failed' AND stream = 'poisoned'", &[])
            .unwrap()
            .get(0);
        (failed == 1).then_some(())
    });
    assert_eq!(redis.xlen("outbox:refund"), 0, "refund 7's next event waits behind the failed one");
    // An admin skips it: the one behind goes out.
    app.execute("SELECT outbox.skip_failed(ARRAY(SELECT id FROM outbox.messages WHERE status = 'failed'))", &[])
        .unwrap();
    redis.wait_for_entries("outbox:refund", 1);
    assert!(relay.terminate().success());
}

#[test]
fn a_replay_sends_published_events_again() {
    let pg = sql_only_server();
    let redis = Redis::start();
    let mut relay = RelayProcess::start(&[
        "--database-url",
        &url(&pg, OWNER, DATABASE),
        "--redis-url",
        &redis.url(),
        "--poll-interval",
        "100ms",
    ]);
    relay.wait_for_line("ready: relaying database");
    let total = enqueue(&pg, 2, 10, 2);
    wait_for_distinct(&redis, total);
    let mut app = connect_as(&pg, DATABASE, OWNER);
    let replay: i64 = app
        .query_one(
            "SELECT outbox.replay(since => now() - interval '1 hour', to_stream => 'replayed', partial => true)",
            &[],
        )
        .unwrap()
        .get(0);
    let entries = redis.wait_for_entries("replayed", total);
    assert_eq!(entries.len(), total);
    relay.wait_for_line(&format!("replay {replay} is done"));
    assert!(relay.terminate().success());
}
