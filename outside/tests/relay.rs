//! outbox-relay relays what the SQL-only install logs, as the background worker does (issue 37,
//! step 4): every committed event reaches Redis once a relay runs, none of a rolled-back
//! transaction, each aggregate's events in order and numbered 1, 2, 3, ...; a relay killed with
//! SIGKILL mid-drain and started again loses nothing (at least once: what its round in flight had
//! sent may come twice, in order); two relays share the shards, and one started later gets its
//! share long before a poll interval.

mod common;

use common::*;
use std::time::Duration;

#[test]
fn every_committed_event_reaches_redis_in_order_and_no_rolled_back_one() {
    let pg = sql_only_server();
    let redis = Redis::start();
    let mut relay = start_relay(&pg, &redis, &[]);
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
    wait_for_nothing_pending(&pg);
    assert!(relay.terminate().success());
    // It gave its shards up before exiting: the next relay takes them at once.
    let claimed: i64 = connect_as(&pg, DATABASE, OWNER)
        .query_one("SELECT count(*) FROM outbox.shards WHERE claimed_by IS NOT NULL", &[])
        .unwrap()
        .get(0);
    assert_eq!(claimed, 0);
}

#[test]
fn a_relay_killed_mid_drain_and_started_again_loses_nothing() {
    let pg = sql_only_server();
    let redis = Redis::start();
    let total = enqueue(&pg, 4, 5_000, 50);
    let mut relay = start_relay(&pg, &redis, &[]);
    wait_for(DEADLINE, "the drain to have begun", || (redis.xlen("outbox:order") > 0).then_some(()));
    relay.kill9();
    let mut relay = start_relay(&pg, &redis, &[]);
    wait_for_distinct(&redis, total);
    assert_in_order(&redis, total);
    assert!(relay.terminate().success());
}

#[test]
fn two_relays_share_the_shards_and_publish_everything_once_in_order() {
    let pg = sql_only_server();
    let redis = Redis::start();
    let mut first = start_relay(&pg, &redis, &[]);
    let mut second = start_relay(&pg, &redis, &[]);
    let total = enqueue(&pg, 30, 20, 16);
    wait_for_distinct(&redis, total);
    assert_in_order(&redis, total);
    // Both relays held shards: each one's backend pid is in outbox.shards (or was: a full read
    // shares them out once both are counted).
    let mut app = connect_as(&pg, DATABASE, OWNER);
    wait_for(DEADLINE, "both relays to hold shards", || (shard_holders(&mut app).len() == 2).then_some(()));
    assert!(first.terminate().success());
    assert!(second.terminate().success());
}

#[test]
fn a_relay_started_later_gets_its_share_long_before_the_poll_interval() {
    let pg = sql_only_server();
    let redis = Redis::start();
    // A poll interval far longer than the wait below: the shares must change because the relays
    // count each other again soon after one joins, not because a poll interval passed.
    let slow = ["--poll-interval", "120s"];
    let mut first = start_relay(&pg, &redis, &slow);
    // 64 aggregates fall in every one of the 16 shards: alone, the first relay holds them all.
    let mut total = enqueue(&pg, 4, 64, 64);
    wait_for_distinct(&redis, total);
    let mut app = connect_as(&pg, DATABASE, OWNER);
    wait_for(DEADLINE, "the first relay to hold every shard", || {
        matches!(shard_holders(&mut app)[..], [(_, 16)]).then_some(())
    });
    let mut second = start_relay(&pg, &redis, &slow);
    // Writers keep both relays turning (a relay counts in its rounds).
    let mut t = 1_000;
    wait_for(Duration::from_secs(30), "both relays to hold shards", || {
        enqueue_one(&mut app, t, 16, 64);
        t += 1;
        total += 16;
        (shard_holders(&mut app).len() == 2).then_some(())
    });
    wait_for_distinct(&redis, total);
    assert_in_order(&redis, total);
    // Giving shards back is no failure: no WARNING (a notification whose result could not be read
    // failed the turn and said "retrying").
    for relay in [&first, &second] {
        assert_eq!(relay.count_lines("WARNING"), 0, "{:?}", relay.lines());
    }
    assert!(first.terminate().success());
    assert!(second.terminate().success());
}

#[test]
fn connections_named_outbox_relay_do_not_shrink_the_relays_share() {
    let pg = sql_only_server();
    let redis = Redis::start();
    // Any role that may connect can name its connections outbox-relay: they publish nothing, so
    // the relay must not count them among the relays it shares the shards with.
    pg.connect().batch_execute("CREATE ROLE intruder LOGIN").unwrap();
    let impostors: Vec<postgres::Client> = (0..15)
        .map(|_| {
            let url = format!("{}?application_name=outbox-relay", url(&pg, "intruder", DATABASE));
            postgres::Client::connect(&url, postgres::NoTls).unwrap()
        })
        .collect();
    let mut relay = start_relay(&pg, &redis, &[]);
    // 64 aggregates fall in every one of the 16 shards.
    let total = enqueue(&pg, 8, 64, 64);
    wait_for_distinct(&redis, total);
    assert_in_order(&redis, total);
    drop(impostors);
    assert!(relay.terminate().success());
}

#[test]
fn relays_writing_to_different_streams_refuse_to_run_together() {
    let pg = sql_only_server();
    let redis = Redis::start();
    let mut first = start_relay(&pg, &redis, &[]);
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

/// Enqueues events, waits until the running relay has published them and recorded them published,
/// and asks for their replay into the stream `replayed`: how many, and the replay's id. The relay
/// writes a round to Redis before its finish commits the round's journal, and a replay requested
/// in between finds nothing to replay (one run in four of the two replay tests, on a loaded
/// machine).
fn replay_what_was_published(pg: &Cluster, redis: &Redis) -> (usize, i64) {
    let total = enqueue(pg, 2, 10, 2);
    wait_for_distinct(redis, total);
    let mut app = connect_as(pg, DATABASE, OWNER);
    wait_for(DEADLINE, &format!("{total} events recorded published"), || {
        let published: i64 =
            app.query_one("SELECT count(*) FROM outbox.messages WHERE status = 'published'", &[]).unwrap().get(0);
        (published as usize >= total).then_some(())
    });
    let replay: i64 = app
        .query_one(
            "SELECT outbox.replay(since => now() - interval '1 hour', to_stream => 'replayed', partial => true)",
            &[],
        )
        .unwrap()
        .get(0);
    (total, replay)
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
    let (total, replay) = replay_what_was_published(&pg, &redis);
    let entries = redis.wait_for_entries("replayed", total);
    assert_eq!(entries.len(), total);
    relay.wait_for_line(&format!("replay {replay} is done"));
    assert!(relay.terminate().success());
}

/// The relay passes a replay's range back to the server as text: under a database's DateStyle
/// that writes a zone abbreviation, one the abbreviations read otherwise (Asia/Kolkata's IST reads
/// as Israel's, 3.5 hours off), the range moved and the replay sent nothing.
#[test]
fn a_replay_sends_the_same_events_whatever_the_databases_date_style() {
    let pg = sql_only_server();
    let redis = Redis::start();
    pg.connect()
        .batch_execute(&format!(
            "ALTER DATABASE {DATABASE} SET DateStyle = 'SQL, DMY'; ALTER DATABASE {DATABASE} SET TimeZone = 'Asia/Kolkata'"
        ))
        .unwrap();
    let mut relay = start_relay(&pg, &redis, &["--poll-interval", "100ms"]);
    let (total, replay) = replay_what_was_published(&pg, &redis);
    relay.wait_for_line(&format!("replay {replay} is done"));
    assert_eq!(redis.xlen("replayed"), total);
    assert!(relay.terminate().success());
}
