//! Replay (issue 27): the outbox is the source of truth. Events the relays published are sent again
//! on request (`outbox.replay`), from the journal of what each round published: the selection, in
//! the order they were published, with their own event_id and aggregate_seq, while live traffic
//! flows; and the relays notice when Redis lost entries it had acknowledged, say so, and (with
//! `outbox.replay_on_loss`) replay them before anything else. Real PostgreSQL, real redis-server
//! restarted without persistence, relays killed; waits with deadlines.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use common::{
    assert_numbered_in_order, check_invariants, check_invariants_beside, wait_for, Env, Expect, LedgerEvent, Producers,
    Redis, SharedLedger, Workload, DEADLINE,
};

/// Waits until replay `id` is done; its row of outbox.replays (replayed, filtered, missing, errors).
fn wait_replay_done(client: &mut postgres::Client, id: i64) -> (i64, i64, i64, i64) {
    wait_for(Duration::from_secs(120), &format!("replay {id} to be done"), || {
        let row = client
            .query_one("SELECT state, replayed, filtered, missing, errors FROM outbox.replays WHERE id = $1", &[&id])
            .unwrap();
        let state: String = row.get(0);
        (state == "done").then(|| (row.get(1), row.get(2), row.get(3), row.get(4)))
    })
}

/// Every published event's (stream, aggregate_seq) as the live stream has it, by event_id.
fn live_entries(redis: &Redis, stream: &str) -> HashMap<String, String> {
    redis.entries(stream).into_iter().map(|e| (e["event_id"].clone(), e["aggregate_seq"].clone())).collect()
}

/// Records that Redis lost `stream` whole, as a relay's check does.
fn record_lost_stream(client: &mut postgres::Client, stream: &str) {
    client
        .execute(
            "INSERT INTO outbox.redis_losses (stream, expected_id, expected_at) VALUES ($1, '9999999999999-0', now())",
            &[&stream],
        )
        .unwrap();
}

fn now(client: &mut postgres::Client) -> SystemTime {
    client.query_one("SELECT clock_timestamp()", &[]).unwrap().get(0)
}

/// `replay(to_stream => ...)` while producers commit: the history stream receives exactly the selected
/// events, once, with their own aggregate_seq and a `replay` field, in order per aggregate; the live
/// streams keep every committed event.
#[test]
fn a_replay_into_another_stream_sends_exactly_the_selection_in_order_while_live_traffic_flows() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let since = now(&mut client);
    // 2,000 events over 20 payments and 10 orders, in transactions of a few events.
    for n in 0..400 {
        let mut txn = client.transaction().unwrap();
        for k in 0..5 {
            let (kind, id) = if (n + k) % 3 == 0 { ("order", n % 10) } else { ("payment", (n * 5 + k) % 20) };
            txn.execute("SELECT outbox_enqueue($1, $2::int::text, 'e', '{}')", &[&kind, &id]).unwrap();
        }
        txn.commit().unwrap();
    }
    let until = now(&mut client);
    // The invariant checker knows every committed event.
    let ledger: SharedLedger = Default::default();
    for row in client.query("SELECT event_id::text, aggregate_type, aggregate_id FROM outbox.messages", &[]).unwrap() {
        let event = LedgerEvent { event_id: row.get(0), aggregate_type: row.get(1), aggregate_id: row.get(2) };
        ledger.lock().unwrap().committed.push(vec![event]);
    }
    let selected: i64 =
        client.query_one("SELECT count(*) FROM outbox.messages WHERE aggregate_type = 'payment'", &[]).unwrap().get(0);
    env.redis.wait_for_entries("outbox:payment", selected as usize);
    let originals = live_entries(&env.redis, "outbox:payment");

    // Live traffic throughout the replay.
    let producers = Producers::start(
        env.pg.port,
        Workload { producers: 2, max_time: Duration::from_secs(60), ..Workload::default() },
        ledger.clone(),
    );
    producers.wait_for_commits(50);
    let id: i64 = client
        .query_one(
            "SELECT outbox.replay(since => $1, until => $2, aggregate_types => ARRAY['payment'], to_stream => 'history:payment')",
            &[&since, &until],
        )
        .unwrap()
        .get(0);
    let (replayed, filtered, missing, errors) = wait_replay_done(&mut client, id);
    producers.wait_for_commits(50);
    producers.stop();
    assert_eq!((replayed, missing, errors), (selected, 0, 0), "filtered {filtered}");

    let history = env.redis.entries("history:payment");
    assert_eq!(history.len(), selected as usize, "each selected event once");
    for entry in &history {
        let event_id = &entry["event_id"];
        assert_eq!(entry["replay"], id.to_string());
        assert_eq!(entry["aggregate_type"], "payment");
        assert_eq!(Some(&entry["aggregate_seq"]), originals.get(event_id), "the aggregate_seq it was published with");
    }
    assert_numbered_in_order(&history, "the replay, per aggregate in the order they were published");
    assert!(env.redis.entries("outbox:payment").iter().all(|e| !e.contains_key("replay")), "the live stream untouched");
    check_invariants_beside("replay-into", &env.pg, &env.redis, &ledger, Expect::default(), Some("history:"));
}

/// Redis restarted without persistence while producers commit: the relay notices before it writes
/// again, records the loss, and (outbox.replay_on_loss) replays every retained event of the lost
/// streams before any later one: every committed event is in its stream, and per aggregate the
/// first occurrences keep their order.
#[test]
fn a_redis_restart_without_persistence_is_noticed_and_replayed_before_later_events() {
    let mut env = Env::start(&["outbox.poll_interval = '100ms'", "outbox.replay_on_loss = on"]);
    let ledger: SharedLedger = Default::default();
    let producers = Producers::start(
        env.pg.port,
        Workload { producers: 2, max_time: Duration::from_secs(60), ..Workload::default() },
        ledger.clone(),
    );
    producers.wait_for_commits(200);
    wait_for(DEADLINE, "the first entries", || (env.redis.total_entries() > 100).then_some(()));
    env.redis.kill();
    env.redis.restart();
    producers.wait_for_commits(200);
    producers.stop();
    let log = wait_for(DEADLINE, "the relay to report the loss", || {
        let log = env.pg.log();
        log.contains("Redis lost entries of stream").then_some(log)
    });
    assert!(log.contains("it no longer exists") && log.contains("replaying them"), "{log}");
    let mut client = env.pg.connect();
    let (losses, unrepaired): (i64, i64) = client
        .query_one("SELECT count(*), count(*) FILTER (WHERE replay_id IS NULL) FROM outbox.redis_losses", &[])
        .map(|row| (row.get(0), row.get(1)))
        .unwrap();
    assert!(losses >= 1 && unrepaired == 0, "{losses} losses, {unrepaired} unrepaired");
    wait_for(Duration::from_secs(120), "the repairs to be done", || {
        let running: i64 =
            client.query_one("SELECT count(*) FROM outbox.replays WHERE state = 'running'", &[]).unwrap().get(0);
        (running == 0).then_some(())
    });
    let report = check_invariants("loss-replayed", &env.pg, &env.redis, &ledger, Expect { duplicates: true });
    assert!(report.delivered > 0);
}

/// Without outbox.replay_on_loss, a loss is reported (WARNING, outbox.stats.redis_data_loss) and
/// outbox.repair_losses() replays it.
#[test]
fn a_loss_is_reported_and_repaired_on_request() {
    let mut env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let ledger: SharedLedger = Default::default();
    for n in 0..50 {
        common::enqueue_recorded(&mut client, &ledger, "invoice", &(n % 7).to_string(), None);
    }
    env.redis.wait_for_entries("outbox:invoice", 50);
    env.redis.kill();
    env.redis.restart();
    // The next event makes the relay connect again, and check before it writes.
    common::enqueue_recorded(&mut client, &ledger, "invoice", "1", None);
    wait_for(DEADLINE, "the loss to show in outbox.stats", || {
        let lost: i64 = client.query_one("SELECT redis_data_loss FROM outbox.stats", &[]).unwrap().get(0);
        (lost == 1).then_some(())
    });
    assert!(env.pg.log().contains("SELECT outbox.repair_losses(ARRAY["), "{}", env.pg.log());
    let replay: i64 = client.query_one("SELECT replay FROM outbox.repair_losses()", &[]).unwrap().get(0);
    wait_replay_done(&mut client, replay);
    let lost: i64 = client.query_one("SELECT redis_data_loss FROM outbox.stats", &[]).unwrap().get(0);
    assert_eq!(lost, 0);
    // Every event is back (the one published after the restart too, possibly twice).
    let ids: HashSet<String> = env.redis.entries("outbox:invoice").into_iter().map(|e| e["event_id"].clone()).collect();
    assert_eq!(ids.len(), 51);
}

/// Calls `outbox.purge('0')` until the log holds no event of `aggregate_type` any more. Whichever
/// truncates the table counts: the test's purge or the relay's housekeeping, which truncates a
/// table purge asked for as soon as it is consumed (on PostgreSQL 18 it often got there first, and
/// a test waiting for its own purge to report the events removed waited in vain).
fn purge_until_gone(client: &mut postgres::Client, aggregate_type: &str) {
    wait_for(DEADLINE, &format!("purge to remove the table holding the {aggregate_type} events"), || {
        client.query_one("SELECT outbox.purge('0')", &[]).unwrap();
        let left: bool = client
            .query_one("SELECT EXISTS (SELECT 1 FROM outbox.events WHERE aggregate_type = $1)", &[&aggregate_type])
            .unwrap()
            .get(0);
        (!left).then_some(())
    });
}

/// A range retention has removed in part is refused with 22023 naming what is gone, unless asked to
/// replay what is left; bad arguments are refused with their SQLSTATE.
#[test]
fn replay_refuses_a_range_retention_removed_and_bad_arguments() {
    let env = Env::start(&["outbox.poll_interval = '100ms'", "outbox.allowed_streams = 'outbox:*, history:*'"]);
    let mut client = env.pg.connect();
    let before = now(&mut client);
    common::enqueue_to(&mut client, "old", "1", None);
    env.redis.wait_for_entries("outbox:old", 1);
    // Switch tables and truncate the old one (published, consumed): what `before` covered is gone.
    purge_until_gone(&mut client, "old");
    let error = client.query_one("SELECT outbox.replay(since => $1)", &[&before]).unwrap_err();
    let db = error.as_db_error().expect("a database error");
    assert_eq!(db.code().code(), "22023", "{db:?}");
    assert!(
        db.message().contains("no longer retained") && db.hint().unwrap_or("").contains("partial => true"),
        "{db:?}"
    );
    client.query_one("SELECT outbox.replay(since => $1, partial => true)", &[&before]).unwrap();

    for (sql, code) in [
        ("SELECT outbox.replay(NULL)", "22004"),
        ("SELECT outbox.replay(now(), until => now() - interval '1 hour')", "22023"),
        ("SELECT outbox.replay(now(), to_stream => '')", "22023"),
        ("SELECT outbox.replay(now(), to_stream => 'elsewhere')", "42501"),
        ("SELECT outbox.replay(now(), streams => ARRAY['outbox:*', ''])", "22023"),
        ("SELECT outbox.replay(now(), max_rate => 0)", "22023"),
        ("SELECT outbox.replay('infinity')", "22023"),
        ("SELECT outbox.replay(now(), published_since => 'infinity')", "22023"),
        ("SELECT outbox.replay(now(), event_ids => '{}')", "22023"),
        ("SELECT outbox.replay(now(), aggregate_types => '{}')", "22023"),
        (r"SELECT outbox.replay(now(), streams => ARRAY['outbox:a\'])", "22023"),
        (r"SELECT outbox.replay(now(), streams => ARRAY['outbox:a\,outbox:b'])", "22023"),
        ("SELECT outbox.replay(now(), streams => ARRAY[' ', ','])", "22023"),
        ("SELECT outbox.replay(now() + interval '1 day')", "22023"),
        ("SELECT outbox.replay(now(), published_since => now() + interval '1 year')", "22023"),
        ("SELECT outbox.replay(now(), to_stream => ' ')", "22023"),
        ("SELECT outbox.replay(now(), event_ids => '{{00000000-0000-0000-0000-000000000001}}')", "22023"),
        ("SELECT outbox.repair_losses('{{1},{2}}')", "22023"),
        ("SELECT outbox.retry_failed('{{1},{2}}')", "22023"),
        ("SELECT outbox.skip_failed('{{1},{2}}')", "22023"),
    ] {
        let error = client.query_one(sql, &[]).unwrap_err();
        let db = error.as_db_error().expect("a database error");
        assert_eq!(db.code().code(), code, "{sql}: {db:?}");
        assert!(db.hint().is_some(), "{sql}: a hint");
    }
    // Each says what is wrong, not what a neighbouring check wants.
    for (sql, says) in [
        ("SELECT outbox.replay(now(), event_ids => '{}')", "event_ids is an empty list"),
        (r"SELECT outbox.replay(now(), streams => ARRAY['outbox:a\'])", r"pattern outbox:a\ ends in a backslash"),
        ("SELECT outbox.replay('infinity')", "since is infinity"),
    ] {
        let error = client.query_one(sql, &[]).unwrap_err();
        let db = error.as_db_error().expect("a database error");
        assert!(db.message().contains(says), "{sql}: {db:?}");
    }
    // An escaped backslash at the end is a literal one, and fine.
    client.query_one(r"SELECT outbox.replay(now(), streams => ARRAY['outbox:a\\'])", &[]).unwrap();
}

/// A replay interrupted by a relay kill and a Redis outage goes on from where it stood and
/// finishes; cancelling stops one.
#[test]
fn a_replay_survives_a_relay_kill_and_a_redis_outage_and_can_be_cancelled() {
    let mut env =
        Env::start_with_redis(&["--appendonly", "yes", "--appendfsync", "always"], &["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let since = now(&mut client);
    client
        .batch_execute(
            "SELECT outbox_enqueue('ledger', (n % 100)::text, 'e', jsonb_build_object('n', n)) FROM generate_series(1, 20000) n",
        )
        .unwrap();
    env.redis.wait_for_entries("outbox:ledger", 20_000);
    // Throttled, so that the kill and the outage come in the middle.
    let id: i64 = client
        .query_one("SELECT outbox.replay(since => $1, to_stream => 'history:ledger', max_rate => 4000)", &[&since])
        .unwrap()
        .get(0);
    wait_for(DEADLINE, "the replay to be under way", || (env.redis.xlen("history:ledger") > 2000).then_some(()));
    let relay = env.pg.relay_pid(&mut client);
    env.pg.kill_9(relay);
    // The postmaster resets the whole cluster (crash recovery); the launcher starts a new relay.
    wait_for(DEADLINE, "the postmaster to notice the killed relay", || {
        env.pg.log().contains(&format!("(PID {relay}) was terminated by signal 9")).then_some(())
    });
    let mut client = env.pg.connect_eventually();
    wait_for(DEADLINE, "more replayed after the kill", || (env.redis.xlen("history:ledger") > 6000).then_some(()));
    // A Redis outage in the middle (AOF with fsync always: what was written stays).
    env.redis.kill();
    wait_for(DEADLINE, "a replay round to fail against the stopped Redis", || {
        env.pg.log().contains("cannot publish to Redis").then_some(())
    });
    env.redis.restart();
    wait_replay_done(&mut client, id);
    let replayed: HashSet<String> =
        env.redis.entries("history:ledger").into_iter().map(|e| e["event_id"].clone()).collect();
    assert_eq!(replayed.len(), 20_000, "every event, possibly some twice");

    // Cancel: a slow replay stops, and stays stopped.
    let slow: i64 = client
        .query_one("SELECT outbox.replay(since => $1, to_stream => 'slow:ledger', max_rate => 500)", &[&since])
        .unwrap()
        .get(0);
    wait_for(DEADLINE, "the slow replay to start", || (env.redis.xlen("slow:ledger") > 0).then_some(()));
    let cancelled: bool = client.query_one("SELECT outbox.cancel_replay($1)", &[&slow]).unwrap().get(0);
    assert!(cancelled);
    let at_cancel = env.redis.xlen("slow:ledger");
    let state: String = client.query_one("SELECT state FROM outbox.replays WHERE id = $1", &[&slow]).unwrap().get(0);
    assert_eq!(state, "cancelled");
    // One round in flight may still land.
    wait_for(DEADLINE, "the relay to go on with live events", || {
        common::enqueue_to(&mut client, "after", "1", None);
        (env.redis.xlen("outbox:after") > 0).then_some(())
    });
    assert!(env.redis.xlen("slow:ledger") <= at_cancel + 1_000, "at most the round in flight after the cancel");
}

/// A relay started after Redis lost entries still notices it: the marks its predecessor stored
/// (outbox.stream_marks) are checked before it writes anything.
#[test]
fn a_loss_is_noticed_by_a_relay_started_after_it() {
    let mut env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    for n in 0..20 {
        common::enqueue_to(&mut client, "parcel", &(n % 3).to_string(), None);
    }
    env.redis.wait_for_entries("outbox:parcel", 20);
    wait_for(DEADLINE, "the relay to store its mark of outbox:parcel", || {
        let stored: i64 = client
            .query_one("SELECT count(*) FROM outbox.stream_marks WHERE stream = 'outbox:parcel'", &[])
            .unwrap()
            .get(0);
        (stored == 1).then_some(())
    });
    // The relay goes, Redis loses everything, a new relay comes.
    let relay = env.pg.relay_pid(&mut client);
    client.execute("SELECT pg_terminate_backend($1)", &[&relay]).unwrap();
    env.redis.kill();
    env.redis.restart();
    wait_for(DEADLINE, "a new relay", || {
        env.pg.backend_pids(&mut client, "outbox_pg relay").first().copied().filter(|&pid| pid != relay)
    });
    common::enqueue_to(&mut client, "parcel", "1", None);
    wait_for(DEADLINE, "the loss to show in outbox.stats", || {
        let lost: i64 = client.query_one("SELECT redis_data_loss FROM outbox.stats", &[]).unwrap().get(0);
        (lost == 1).then_some(())
    });
    assert!(env.pg.log().contains("Redis lost entries of stream \"outbox:parcel\""), "{}", env.pg.log());
}

/// Retention truncating the log and the journal between two rounds of a running replay: what the
/// replay did not reach of what was journaled when it was asked for is counted missing, and it
/// ends with nothing remaining. Stepped: the throttle holds the replay after its first round.
#[test]
fn retention_during_a_replay_is_counted_missing() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let since = now(&mut client);
    for _ in 0..3 {
        client
            .batch_execute("SELECT outbox_enqueue('kept', (n % 10)::text, 'e', '{}') FROM generate_series(1, 1000) n")
            .unwrap();
    }
    env.redis.wait_for_entries("outbox:kept", 3000);
    // One round, then the throttle holds it (1 event a second: for about 1,000 s).
    let id: i64 = client
        .query_one("SELECT outbox.replay(since => $1, to_stream => 'history:kept', max_rate => 1)", &[&since])
        .unwrap()
        .get(0);
    let first: i64 = wait_for(DEADLINE, "the replay's first round", || {
        let row = client.query_one("SELECT replayed, state FROM outbox.replays WHERE id = $1", &[&id]).unwrap();
        let (replayed, state): (i64, String) = (row.get(0), row.get(1));
        (replayed > 0).then(|| {
            assert_eq!(state, "running");
            replayed
        })
    });
    assert!(first < 3000, "a round sends at most 1,000 events: {first}");
    // Retention removes the log table and the journal rounds the rest of the replay was in.
    purge_until_gone(&mut client, "kept");
    // The next round, now.
    client.execute("UPDATE outbox.replay_requests SET not_before = NULL WHERE id = $1", &[&id]).unwrap();
    client.execute("SELECT outbox._wake_for_replay()", &[]).unwrap();
    let (replayed, _filtered, missing, errors) = wait_replay_done(&mut client, id);
    let remaining: i64 = client.query_one("SELECT remaining FROM outbox.replays WHERE id = $1", &[&id]).unwrap().get(0);
    assert_eq!((replayed, missing, errors, remaining), (first, 3000 - first, 0, 0));
}

/// outbox.repair_losses replays exactly the stream Redis lost, whatever its characters: a `*`, a
/// `\`, a comma are the key's own, not a pattern.
#[test]
fn repairing_a_loss_replays_exactly_its_stream() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let streams = ["outbox:a*", "outbox:ab", "outbox:acct", r"outbox:x\y", "outbox:c,d", "outbox:c"];
    for (n, stream) in streams.iter().enumerate() {
        for k in 0..=n {
            common::enqueue_to(&mut client, "thing", &k.to_string(), Some(stream));
        }
    }
    for (n, stream) in streams.iter().enumerate() {
        env.redis.wait_for_entries(stream, n + 1);
    }
    for stream in ["outbox:a*", r"outbox:x\y", "outbox:c,d"] {
        record_lost_stream(&mut client, stream);
    }
    let repairs: Vec<(String, i64)> = client
        .query(
            "SELECT l.stream, r.replay FROM outbox.repair_losses() r JOIN outbox.redis_losses l ON l.id = r.loss",
            &[],
        )
        .unwrap()
        .into_iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(repairs.len(), 3);
    for (stream, replay) in repairs {
        let (replayed, _, missing, errors) = wait_replay_done(&mut client, replay);
        let own = streams.iter().position(|s| *s == stream).unwrap() as i64 + 1;
        assert_eq!((replayed, missing, errors), (own, 0, 0), "{stream}");
        let replayed_entries = env.redis.entries(&stream).into_iter().filter(|e| e.contains_key("replay")).count();
        assert_eq!(replayed_entries as i64, own, "{stream}");
    }
    for stream in ["outbox:ab", "outbox:acct", "outbox:c"] {
        assert!(env.redis.entries(stream).iter().all(|e| !e.contains_key("replay")), "{stream} untouched");
    }
    let lost: i64 = client.query_one("SELECT redis_data_loss FROM outbox.stats", &[]).unwrap().get(0);
    assert_eq!(lost, 0);
}

/// A repair walks only the journal's rounds that wrote to the stream it repairs: one event lost
/// among thousands published to another stream is replayed without examining the others (before,
/// every entry of the retained journal was looked up: 13.6 s for 1,050,000, with live events held).
#[test]
fn a_repair_examines_only_the_rounds_that_wrote_to_the_lost_stream() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let enqueue_busy = |client: &mut postgres::Client| {
        client
            .batch_execute("SELECT outbox_enqueue('busy', (n % 50)::text, 'e', '{}') FROM generate_series(1, 3000) n")
            .unwrap();
    };
    enqueue_busy(&mut client);
    env.redis.wait_for_entries("outbox:busy", 3000);
    common::enqueue_to(&mut client, "thing", "1", Some("tiny:x"));
    env.redis.wait_for_entries("tiny:x", 1);
    enqueue_busy(&mut client);
    env.redis.wait_for_entries("outbox:busy", 6000);
    record_lost_stream(&mut client, "tiny:x");
    let replay: i64 = client.query_one("SELECT replay FROM outbox.repair_losses()", &[]).unwrap().get(0);
    let (replayed, filtered, missing, errors) = wait_replay_done(&mut client, replay);
    assert_eq!((replayed, filtered, missing, errors), (1, 0, 0, 0), "only tiny:x's round examined");
    let remaining: i64 =
        client.query_one("SELECT remaining FROM outbox.replays WHERE id = $1", &[&replay]).unwrap().get(0);
    assert_eq!(remaining, 0, "the rest walked past");
    assert_eq!(env.redis.entries("tiny:x").iter().filter(|e| e.contains_key("replay")).count(), 1);
    assert!(env.redis.entries("outbox:busy").iter().all(|e| !e.contains_key("replay")));
}

/// A loss of a stream written under an earlier outbox.stream template: no retained event maps to
/// it now, so its repair replays nothing. That is said (a WARNING naming the stream and what to do)
/// and the loss stays counted; the replay the WARNING proposes repairs it.
#[test]
fn a_loss_under_an_earlier_stream_template_is_not_counted_repaired() {
    let env = Env::start(&["outbox.poll_interval = '100ms'", "outbox.stream = 'old:{aggregate_type}'"]);
    let mut client = env.pg.connect();
    let since = now(&mut client);
    for k in 0..8 {
        common::enqueue_to(&mut client, "gadget", &k.to_string(), None);
    }
    env.redis.wait_for_entries("old:gadget", 8);
    client.execute("ALTER SYSTEM SET outbox.stream = 'new:{aggregate_type}'", &[]).unwrap();
    client.execute("SELECT pg_reload_conf()", &[]).unwrap();
    // The relay has the new template once it publishes there.
    wait_for(DEADLINE, "the relay to use the new template", || {
        common::enqueue_to(&mut client, "probe", "1", None);
        (env.redis.xlen("new:probe") > 0).then_some(())
    });
    record_lost_stream(&mut client, "old:gadget");
    let replay: i64 = client.query_one("SELECT replay FROM outbox.repair_losses()", &[]).unwrap().get(0);
    let (replayed, filtered, _, _) = wait_replay_done(&mut client, replay);
    assert!(replayed == 0 && filtered >= 8, "replayed {replayed}, filtered {filtered}");
    let lost: i64 = client.query_one("SELECT redis_data_loss FROM outbox.stats", &[]).unwrap().get(0);
    assert_eq!(lost, 1, "a repair that replayed nothing repaired nothing");
    wait_for(DEADLINE, "the relay's WARNING", || {
        env.pg.log().contains("replayed no event of stream \"old:gadget\"").then_some(())
    });
    assert!(env.pg.log().contains("to_stream => 'old:gadget'"), "{}", env.pg.log());
    // repair_losses() does not replay nothing again.
    assert_eq!(client.query("SELECT * FROM outbox.repair_losses()", &[]).unwrap().len(), 0);
    // What the WARNING proposes.
    let id: i64 = client
        .query_one(
            "SELECT outbox.replay(since => $1, aggregate_types => ARRAY['gadget'], to_stream => 'old:gadget')",
            &[&since],
        )
        .unwrap()
        .get(0);
    assert_eq!(wait_replay_done(&mut client, id).0, 8);
}

/// A replay of events larger than a round's 4 MB: each goes alone, and all arrive.
#[test]
fn a_replay_sends_events_larger_than_a_round() {
    let env = Env::start(&["outbox.poll_interval = '100ms'", "outbox.max_payload_size = '8MB'"]);
    let mut client = env.pg.connect();
    let since = now(&mut client);
    client
        .batch_execute(
            "SELECT outbox_enqueue('blob', n::text, 'e', jsonb_build_object('b', repeat(md5(n::text), 150000))) \
             FROM generate_series(1, 3) n",
        )
        .unwrap();
    env.redis.wait_for_entries("outbox:blob", 3);
    let id: i64 =
        client.query_one("SELECT outbox.replay(since => $1, to_stream => 'history:blob')", &[&since]).unwrap().get(0);
    assert_eq!(wait_replay_done(&mut client, id), (3, 0, 0, 0));
    assert_eq!(env.redis.xlen("history:blob"), 3);
}

/// A replay filtered by 200,000 event ids (issue 35, item 4): the ids are held where each round
/// probes them (`outbox.replay_event_ids`), never copied into the relay or into a round, so the
/// relay's memory stays flat; the history stream gets exactly the listed events still retained,
/// and the filter is gone once the replay is done.
#[test]
fn a_replay_filtered_by_many_event_ids_keeps_the_relays_memory_flat() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let since = now(&mut client);
    client
        .batch_execute("SELECT outbox_enqueue('item', (n % 50)::text, 'e', '{}') FROM generate_series(1, 20000) n")
        .unwrap();
    env.redis.wait_for_entries("outbox:item", 20_000);
    common::wait_drained(&mut client);
    // Every tenth event, among 198,000 ids no event has.
    let wanted: HashSet<String> = client
        .query("SELECT event_id::text FROM outbox.messages WHERE id % 10 = 0", &[])
        .unwrap()
        .into_iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(wanted.len(), 2_000);
    let relay = env.pg.relay_pid(&mut client);
    let at_rest = outbox_testkit::rss_kb(relay);
    let memory = outbox_testkit::PeakMemory::watch(relay);
    let id: i64 = client
        .query_one(
            "SELECT outbox.replay(since => $1, to_stream => 'hist:ids',
                                  event_ids => (SELECT array_agg(x ORDER BY random()) FROM (
                                      SELECT event_id AS x FROM outbox.messages WHERE id % 10 = 0
                                      UNION ALL SELECT gen_random_uuid() FROM generate_series(1, 198000)) s))",
            &[&since],
        )
        .unwrap()
        .get(0);
    let (replayed, filtered, missing, errors) = wait_replay_done(&mut client, id);
    let peak = memory.peak_kb();
    drop(memory);
    assert!(
        peak.saturating_sub(at_rest) < 16 * 1024,
        "the relay's private memory grew from {at_rest} kB to {peak} kB for 200,000 event ids"
    );
    assert_eq!((replayed, filtered, missing, errors), (2_000, 18_000, 0, 0));
    let sent: HashSet<String> = env.redis.entries("hist:ids").into_iter().map(|e| e["event_id"].clone()).collect();
    assert_eq!(sent, wanted, "exactly the listed events");
    assert_eq!(env.redis.xlen("hist:ids"), 2_000, "each once");
    let listed: i64 = client.query_one("SELECT event_ids FROM outbox.replays WHERE id = $1", &[&id]).unwrap().get(0);
    assert_eq!(listed, 200_000);
    let kept: i64 = client.query_one("SELECT count(*) FROM outbox.replay_event_ids", &[]).unwrap().get(0);
    assert_eq!(kept, 0, "the filter goes with the replay");
}
