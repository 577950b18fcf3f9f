//! The relay against a real PostgreSQL (outbox_pg preloaded, worker running) and a real
//! redis-server: what crosses a commit, a process boundary or Redis.

mod common;

use std::collections::HashMap;

use common::{assert_numbered_in_order, status_counts, wait_for, Cluster, Env, Redis, DEADLINE};

fn enqueue(client: &mut postgres::Client, aggregate_type: &str, aggregate_id: &str, payload: &str) -> String {
    client
        .query_one(
            "SELECT outbox_enqueue($1, $2, 'test.event', $3::text::jsonb)::text",
            &[&aggregate_type, &aggregate_id, &payload],
        )
        .unwrap()
        .get(0)
}

fn wait_all_published(client: &mut postgres::Client, total: i64) {
    wait_for(DEADLINE, &format!("{total} rows published"), || {
        let counts = status_counts(client);
        (counts.get("published").copied().unwrap_or(0) == total).then_some(())
    });
}

#[test]
fn committed_event_reaches_its_stream_with_every_field() {
    let env = Env::start(&[]);
    let mut client = env.pg.connect();
    let row = client
        .query_one(
            "SELECT outbox_enqueue('payment', 'p-42', 'payment.created', '{\"amount\": \"12.34\", \"n\": [1, 2]}',
                                   '{\"trace_id\": \"abc\"}')::text",
            &[],
        )
        .unwrap();
    let event_id: String = row.get(0);
    let entries = env.redis.wait_for_entries("outbox:payment", 1);
    assert_eq!(entries.len(), 1);
    let entry = &entries[0];
    let (outbox_id, created_at): (i64, String) = {
        let r = client
            .query_one(
                "SELECT id, to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') FROM outbox.messages",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    let expected: HashMap<String, String> = [
        ("event_id", event_id.as_str()),
        ("outbox_id", outbox_id.to_string().as_str()),
        ("aggregate_type", "payment"),
        ("aggregate_id", "p-42"),
        ("aggregate_seq", "1"),
        ("event_type", "payment.created"),
        ("payload", "{\"n\": [1, 2], \"amount\": \"12.34\"}"),
        ("headers", "{\"trace_id\": \"abc\"}"),
        ("created_at", created_at.as_str()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    assert_eq!(entry, &expected);
    // The payload field is the JSON text of the stored jsonb.
    let payload: serde_json::Value = serde_json::from_str(&entry["payload"]).unwrap();
    assert_eq!(payload["amount"], "12.34");

    wait_all_published(&mut client, 1);
    let row = client
        .query_one("SELECT published_at IS NOT NULL, attempts, last_error IS NULL FROM outbox.messages", &[])
        .unwrap();
    assert!(row.get::<_, bool>(0));
    // Nothing is written per event on the way out: attempts are counted on the failure path only.
    assert_eq!(row.get::<_, i32>(1), 0);
    assert!(row.get::<_, bool>(2));
}

#[test]
fn rolled_back_event_never_appears() {
    let env = Env::start(&[]);
    let mut client = env.pg.connect();
    let mut tx = client.transaction().unwrap();
    tx.query_one("SELECT outbox_enqueue('order', 1, 'order.placed', '{\"rolled\": \"back\"}')", &[]).unwrap();
    tx.rollback().unwrap();
    // A marker committed after the rollback: once it is in Redis, anything earlier would be too.
    let marker = enqueue(&mut client, "order", "2", "{\"marker\": true}");
    let entries = env.redis.wait_for_entries("outbox:order", 1);
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0]["event_id"], marker);
    wait_all_published(&mut client, 1);
    assert_eq!(status_counts(&mut client).values().sum::<i64>(), 1);
}

#[test]
fn commit_wakes_the_relay_without_polling() {
    // A ten-minute poll interval: only the commit-time wake-up can deliver within the deadline.
    let env = Env::start(&["outbox.poll_interval = '10min'"]);
    let mut client = env.pg.connect();
    env.pg.relay_pid(&mut client);
    // Let the relay go idle first (it has looked at an empty table).
    wait_for(DEADLINE, "the relay to be idle", || {
        client
            .query_opt(
                "SELECT 1 FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay' AND query = 'outbox_pg: waiting for events'",
                &[],
            )
            .unwrap()
    });
    for i in 0..3 {
        enqueue(&mut client, "wake", &i.to_string(), "{}");
        env.redis.wait_for_entries("outbox:wake", i + 1);
    }
}

#[test]
fn a_thousand_enqueues_in_one_transaction_give_a_thousand_entries() {
    let env = Env::start(&[]);
    let mut client = env.pg.connect();
    let mut tx = client.transaction().unwrap();
    tx.batch_execute(
        "SELECT outbox_enqueue('bulk', i, 'bulk.item', jsonb_build_object('i', i)) FROM generate_series(1, 1000) AS i",
    )
    .unwrap();
    tx.commit().unwrap();
    let entries = env.redis.wait_for_entries("outbox:bulk", 1000);
    assert_eq!(entries.len(), 1000);
    // One transaction, one relay: the entries come out in id order.
    let ids: Vec<i64> = entries.iter().map(|e| e["outbox_id"].parse().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    wait_all_published(&mut client, 1000);
}

#[test]
fn eight_concurrent_sessions_each_event_exactly_once() {
    let env = Env::start(&[]);
    let sessions: Vec<_> = (0..8)
        .map(|s| {
            let mut client = env.pg.connect();
            std::thread::spawn(move || {
                let mut ids = Vec::with_capacity(1000);
                for i in 0..1000 {
                    ids.push(enqueue(&mut client, "conc", &format!("{s}-{i}"), "{}"));
                }
                ids
            })
        })
        .collect();
    let committed: Vec<String> = sessions.into_iter().flat_map(|h| h.join().unwrap()).collect();
    assert_eq!(committed.len(), 8000);
    let mut client = env.pg.connect();
    wait_all_published(&mut client, 8000);
    let entries = env.redis.entries("outbox:conc");
    let mut seen: HashMap<String, usize> = HashMap::new();
    for entry in &entries {
        *seen.entry(entry["event_id"].clone()).or_default() += 1;
    }
    for id in &committed {
        assert_eq!(seen.get(id), Some(&1), "event {id} delivered {:?} times", seen.get(id));
    }
    assert_eq!(entries.len(), 8000);
}

#[test]
fn redis_outage_delays_delivery_and_records_the_error() {
    let mut env = Env::start(&[]);
    let mut client = env.pg.connect();
    enqueue(&mut client, "outage", "before", "{}");
    env.redis.wait_for_entries("outbox:outage", 1);
    wait_all_published(&mut client, 1);

    env.redis.kill();
    for i in 0..50 {
        enqueue(&mut client, "outage", &i.to_string(), "{}");
    }
    // While Redis is down the events stay pending (nothing is written per event: the batch is read
    // again after each backoff), and the relay records the failure, retry after retry.
    let first_failure: std::time::SystemTime = wait_for(DEADLINE, "the failure recorded", || {
        let row = client.query_one("SELECT last_error, last_error_at FROM outbox.stats", &[]).unwrap();
        row.get::<_, Option<String>>(0).filter(|e| !e.is_empty()).and(row.get(1))
    });
    wait_for(DEADLINE, "several failed rounds", || {
        let row = client.query_one("SELECT pending, last_error_at FROM outbox.stats", &[]).unwrap();
        let at: std::time::SystemTime = row.get(1);
        (row.get::<_, i64>(0) == 50 && at > first_failure).then_some(())
    });
    assert!(!client.query_one("SELECT outbox.redis_connected()", &[]).unwrap().get::<_, bool>(0));

    env.redis.restart();
    let entries = env.redis.wait_for_entries("outbox:outage", 50);
    assert_eq!(entries.len(), 50, "a fresh Redis holds exactly the 50 events enqueued during the outage");
    wait_all_published(&mut client, 51);
    let cleared: i64 = client
        .query_one("SELECT count(*) FROM outbox.messages WHERE last_error IS NULL AND published_at IS NOT NULL", &[])
        .unwrap()
        .get(0);
    assert_eq!(cleared, 51);
    // The outage was logged once when it started and once when it ended, not once per retry.
    let log = env.pg.log();
    assert_eq!(log.matches("cannot publish to Redis").count(), 1, "{log}");
    assert_eq!(log.matches("publishing to Redis at").count(), 1, "{log}");
}

/// After an outage a shard's backlog is read in windows that end at snapshots housekeeping recorded
/// while it waited (about a second of traffic each), not whole: three bursts, each followed by a
/// recorded snapshot, cross at least three windows, and order and numbering hold across them.
#[test]
fn a_backlog_after_an_outage_is_read_window_by_window_in_order() {
    let mut env = Env::start(&[]);
    let mut client = env.pg.connect();
    env.redis.kill();
    let mut ids: HashMap<String, Vec<String>> = HashMap::new();
    let mut cursor_xmax_before: Vec<i64> = Vec::new();
    for burst in 0..3 {
        for i in 0..5 {
            for aggregate in ["a", "b"] {
                ids.entry(aggregate.to_string()).or_default().push(enqueue(
                    &mut client,
                    "lag",
                    aggregate,
                    &i.to_string(),
                ));
            }
        }
        // Housekeeping records a snapshot about once a second while anything waits.
        let burst_done: std::time::SystemTime = client.query_one("SELECT clock_timestamp()", &[]).unwrap().get(0);
        wait_for(DEADLINE, &format!("a snapshot recorded after burst {burst}"), || {
            client
                .query_one("SELECT count(*) FROM outbox.snapshots WHERE taken_at > $1", &[&burst_done])
                .unwrap()
                .get::<_, i64>(0)
                .gt(&0)
                .then_some(())
        });
        cursor_xmax_before.push(
            client
                .query_one("SELECT max(pg_snapshot_xmax(cursor)::text::bigint) FROM outbox.shards", &[])
                .unwrap()
                .get(0),
        );
    }
    // Every recorded snapshot must be over a second old to bound a window.
    let last: std::time::SystemTime =
        client.query_one("SELECT max(taken_at) FROM outbox.snapshots", &[]).unwrap().get(0);
    wait_for(DEADLINE, "the last burst's snapshot to be a second old", || {
        client
            .query_one("SELECT clock_timestamp() > $1::timestamptz + interval '1100 ms'", &[&last])
            .unwrap()
            .get::<_, bool>(0)
            .then_some(())
    });
    let recorded: i64 = client.query_one("SELECT count(*) FROM outbox.snapshots", &[]).unwrap().get(0);
    assert!(recorded >= 3, "{recorded} snapshots recorded");
    assert!(cursor_xmax_before.windows(2).all(|w| w[0] == w[1]), "no cursor moved during the outage");

    env.redis.restart();
    let entries = env.redis.wait_for_entries("outbox:lag", 30);
    for aggregate in ["a", "b"] {
        let mine: Vec<(&str, &str)> = entries
            .iter()
            .filter(|e| e["aggregate_id"] == aggregate)
            .map(|e| (e["event_id"].as_str(), e["aggregate_seq"].as_str()))
            .collect();
        let expected: Vec<String> = (1..=15).map(|n| n.to_string()).collect();
        let expected: Vec<(&str, &str)> =
            ids[aggregate].iter().map(String::as_str).zip(expected.iter().map(String::as_str)).collect();
        assert_eq!(mine, expected, "aggregate {aggregate}: every event once, in order, numbered 1..15");
    }
    wait_all_published(&mut client, 30);
    let log = env.pg.log();
    assert!(log.contains("is catching up on a backlog"), "{log}");
    wait_for(DEADLINE, "the relay to say it caught up", || env.pg.log().contains("has caught up").then_some(()));
    // The cursors passed the recorded snapshots, which housekeeping then forgets.
    wait_for(DEADLINE, "the recorded snapshots to be forgotten", || {
        let left: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox.snapshots
                  WHERE pg_snapshot_xmax(snap) <= (SELECT min(pg_snapshot_xmax(cursor)) FROM outbox.shards)",
                &[],
            )
            .unwrap()
            .get(0);
        (left == 0).then_some(())
    });
}

/// A backlog of many rounds (enqueued while the relay was paused, across recorded snapshots, so
/// read window by window and in bounded rounds, each sent while the next is read) is published to
/// its end at once, not at the next full read. Two ways it used to stop short, each until the
/// next full read (with `outbox.poll_interval = 1h`, an hour; a drain benchmark saw 14-67% of a
/// 100,000-event backlog wait a second): the round read while another is in flight reads only
/// the shards commits flagged, so a landed round whose shards had more to read must send the
/// relay straight back for them; and a window too large for one round, begun at a recorded
/// snapshot, is continued on a kept claim that no longer knows the shard lags, so its last part
/// must say that more may follow.
fn drain_a_paused_backlog(aggregates: i64, bursts: i64, transactions: i64, events: i64, last_recorded: bool) {
    let env = Env::start(&["outbox.enabled = off"]);
    let mut client = env.pg.connect();
    for burst in 0..bursts {
        for transaction in 0..transactions {
            client
                .execute(
                    "SELECT count(outbox_enqueue('drain', (i % $2)::text, 'test.event', jsonb_build_object('n', i)))
                       FROM generate_series($1::bigint, $1::bigint + $3 - 1) AS i",
                    &[&((burst * transactions + transaction) * events), &aggregates, &events],
                )
                .unwrap();
        }
        if burst + 1 == bursts && !last_recorded {
            break;
        }
        // Housekeeping records a snapshot about once a second while anything waits; a round
        // reads up to one only once it is a second old.
        let burst_done: std::time::SystemTime = client.query_one("SELECT clock_timestamp()", &[]).unwrap().get(0);
        wait_for(DEADLINE, &format!("a snapshot recorded after burst {burst}, a second old"), || {
            client
                .query_one(
                    "SELECT count(*) FROM outbox.snapshots
                      WHERE taken_at > $1 AND taken_at < clock_timestamp() - interval '1100 ms'",
                    &[&burst_done],
                )
                .unwrap()
                .get::<_, i64>(0)
                .gt(&0)
                .then_some(())
        });
    }

    // From now on a round reads every shard only once an hour, unless told to.
    env.pg.set(&mut client, &[("outbox.enabled", "on"), ("outbox.poll_interval", "1h")]);
    let total = (bursts * transactions * events) as usize;
    wait_for(DEADLINE, &format!("{total} entries in outbox:drain"), || {
        (env.redis.xlen("outbox:drain") >= total).then_some(())
    });
    let entries = env.redis.entries("outbox:drain");
    assert_eq!(entries.len(), total, "every event once");
    assert_numbered_in_order(&entries, "the drained backlog");
    assert!(env.pg.log().contains("is catching up on a backlog"), "the backlog was read window by window");
}

/// Three bursts of twelve transactions over 1,000 aggregates, each burst's window (12,000 events
/// over 16 shards) read in one round while the round before is in flight.
#[test]
fn a_backlog_over_many_aggregates_is_published_to_its_end_without_waiting_for_a_poll() {
    drain_a_paused_backlog(1000, 3, 12, 1000, true);
}

/// One aggregate (one shard): a window of one 15,000-event transaction, more than a round takes,
/// begun at a recorded snapshot; behind it another such transaction, committed too recently for a
/// recorded snapshot to bound it. Meant for the window's last part on a kept claim; here the idle
/// shards lag behind newer snapshots, the claims stay bounded and are not kept, and the test
/// passes with or without that fix (the drain benchmark showed the wait): it guards the path's
/// order and completeness, and the rule itself is held by the unit test
/// the_last_part_of_a_window_in_parts_sends_the_relay_straight_back (src/relay/publish.rs).
#[test]
fn a_backlog_of_one_aggregate_is_published_to_its_end_without_waiting_for_a_poll() {
    drain_a_paused_backlog(1, 2, 1, 15_000, false);
}

#[test]
fn reload_with_a_new_redis_url_and_password_file_is_honoured() {
    let env = Env::start(&[]);
    let mut client = env.pg.connect();
    enqueue(&mut client, "reload", "1", "{}");
    env.redis.wait_for_entries("outbox:reload", 1);

    // A second Redis that requires a password, given through a file only the server user reads.
    let secured = Redis::start_with(&["--requirepass", "s3cret-Pw"]);
    let password_file = env.pg.dir.join("redis.pw");
    std::fs::write(&password_file, "s3cret-Pw\n").unwrap();
    std::process::Command::new("chown").arg("postgres:postgres").arg(&password_file).status().unwrap();
    std::process::Command::new("chmod").arg("600").arg(&password_file).status().unwrap();
    env.pg.set(
        &mut client,
        &[("outbox.redis_url", &secured.url()), ("outbox.redis_password_file", password_file.to_str().unwrap())],
    );
    // pg_reload_conf() only signals: an event enqueued before the relay applied the reload would
    // rightly go to the old Redis.
    let moved = format!("after the reload, Redis is 127.0.0.1:{} (was", secured.port);
    wait_for(DEADLINE, "the relay to apply the reload", || env.pg.log().contains(&moved).then_some(()));
    enqueue(&mut client, "reload", "2", "{}");
    let entries = secured.wait_for_entries("outbox:reload", 1);
    assert_eq!(entries[0]["aggregate_id"], "2");
    assert_eq!(env.redis.xlen("outbox:reload"), 1, "the old Redis got nothing more");
    assert!(!env.pg.log().contains("s3cret-Pw"), "the password reached the server log");
}

#[test]
fn redis_url_is_masked_and_hidden_from_ordinary_roles() {
    let env = Env::start(&[]);
    let mut client = env.pg.connect();
    env.pg.relay_pid(&mut client);
    // The relay has started with the working Redis and found the extension, so that it logs when
    // the reload below reaches it (pg_reload_conf() only signals).
    enqueue(&mut client, "masked", "0", "{}");
    env.redis.wait_for_entries("outbox:masked", 1);
    env.pg.set(&mut client, &[("outbox.redis_url", "redis://app:Hunter2@127.0.0.1:1/0")]);
    wait_for(DEADLINE, "the relay to apply the reload", || {
        env.pg.log().contains("after the reload, Redis is 127.0.0.1:1 (was").then_some(())
    });
    let shown = wait_for(DEADLINE, "the reload", || {
        let shown: String = client.query_one("SELECT current_setting('outbox.redis_url')", &[]).unwrap().get(0);
        (shown != env.redis.url()).then_some(shown)
    });
    assert_eq!(shown, "redis://app:****@127.0.0.1:1/0");
    // pg_settings would show the raw value in reset_val and boot_val: the setting is not listed.
    let listed: i64 =
        client.query_one("SELECT count(*) FROM pg_settings WHERE name = 'outbox.redis_url'", &[]).unwrap().get(0);
    assert_eq!(listed, 0);
    client.batch_execute("CREATE ROLE app_user LOGIN").unwrap();
    let mut app = postgres::Client::connect(
        &format!("host=127.0.0.1 port={} user=app_user dbname=postgres", env.pg.port),
        postgres::NoTls,
    )
    .unwrap();
    let err = app.query_one("SHOW outbox.redis_url", &[]).unwrap_err();
    assert_eq!(err.code(), Some(&postgres::error::SqlState::INSUFFICIENT_PRIVILEGE), "{err}");
    // The relay's own log lines name the host, never the password.
    enqueue(&mut client, "masked", "1", "{}");
    wait_for(DEADLINE, "the relay to report the unreachable Redis", || {
        env.pg.log().contains("cannot publish to Redis at 127.0.0.1:1").then_some(())
    });
    // Nor does any other line: PostgreSQL's own "parameter changed" line is masked too.
    assert!(!env.pg.log().contains("Hunter2"), "{}", env.pg.log());
}

#[test]
fn relay_shows_in_pg_stat_activity_and_restarts_after_termination() {
    let env = Env::start(&[]);
    let mut client = env.pg.connect();
    let first = env.pg.relay_pid(&mut client);
    let launcher: i64 = client
        .query_one("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_pg launcher'", &[])
        .unwrap()
        .get(0);
    assert_eq!(launcher, 1);
    // A relay shows in pg_stat_activity as soon as it connects, and in outbox.relay_pid() once it
    // has registered in shared memory, a moment later.
    wait_for(DEADLINE, "outbox.relay_pid() to name the relay", || {
        let pid = client.query_one("SELECT outbox.relay_pid()", &[]).unwrap().get::<_, Option<i32>>(0);
        (pid == Some(first)).then_some(())
    });
    client.query_one("SELECT pg_terminate_backend($1)", &[&first]).unwrap();
    let second = wait_for(DEADLINE, "a new relay", || {
        let pid = client
            .query_opt("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay'", &[])
            .unwrap()
            .map(|r| r.get::<_, i32>(0))?;
        (pid != first).then_some(pid)
    });
    assert_ne!(first, second);
    enqueue(&mut client, "restart", "1", "{}");
    env.redis.wait_for_entries("outbox:restart", 1);
    // SIGTERM from a fast shutdown ends both workers; pg_ctl fails if the server does not stop.
    env.pg.pg_ctl_stop("fast");
}

#[test]
fn relay_waits_for_database_and_extension_then_survives_drops() {
    let redis = Redis::start();
    let pg = Cluster::start(redis.port, &["outbox.databases = 'appdb'", "outbox.poll_interval = '200ms'"]);
    let mut admin = pg.connect();
    wait_for(DEADLINE, "the launcher to report the missing database", || {
        pg.log().contains("database \"appdb\" does not exist; its relays start when it is created").then_some(())
    });
    admin.batch_execute("CREATE DATABASE appdb").unwrap();
    wait_for(DEADLINE, "the relay to report the missing extension", || {
        pg.log()
            .contains("extension outbox_pg is not installed in database \"appdb\", which outbox.databases names")
            .then_some(())
    });
    let mut app = pg.connect_to("appdb");
    app.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    enqueue(&mut app, "db", "1", "{}");
    redis.wait_for_entries("outbox:db", 1);

    // DROP DATABASE of another database is not blocked by the idle workers.
    admin.batch_execute("SET statement_timeout = '30s'").unwrap();
    admin.batch_execute("CREATE DATABASE other").unwrap();
    admin.batch_execute("DROP DATABASE other").unwrap();
    // DROP EXTENSION with the relay running, then CREATE again: delivery resumes.
    app.batch_execute("SET statement_timeout = '30s'; DROP EXTENSION outbox_pg; CREATE EXTENSION outbox_pg").unwrap();
    enqueue(&mut app, "db", "2", "{}");
    redis.wait_for_entries("outbox:db", 2);
    drop(app);

    // The watched database dropped with FORCE: the relay goes, the launcher waits for it to return.
    admin.batch_execute("DROP DATABASE appdb WITH (FORCE)").unwrap();
    admin.batch_execute("CREATE DATABASE appdb").unwrap();
    let mut app = pg.connect_to("appdb");
    app.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    enqueue(&mut app, "db", "3", "{}");
    let entries = redis.wait_for_entries("outbox:db", 3);
    assert_eq!(entries[2]["aggregate_id"], "3");
    let log = pg.log();
    assert!(!log.contains("FATAL:  database \"appdb\" does not exist"), "crash loop:\n{log}");
}

#[test]
fn disabled_relay_keeps_events_pending_until_enabled() {
    let env = Env::start(&["outbox.enabled = off"]);
    let mut client = env.pg.connect();
    for i in 0..10 {
        enqueue(&mut client, "paused", &i.to_string(), "{}");
    }
    wait_for(DEADLINE, "the relay to report it is paused", || {
        env.pg.log().contains("outbox.enabled is off").then_some(())
    });
    // Paused: a later event with its own poll must still find everything pending.
    enqueue(&mut client, "paused", "10", "{}");
    assert_eq!(status_counts(&mut client).get("pending"), Some(&11));
    assert_eq!(env.redis.xlen("outbox:paused"), 0);
    env.pg.set(&mut client, &[("outbox.enabled", "on")]);
    env.redis.wait_for_entries("outbox:paused", 11);
    wait_all_published(&mut client, 11);
}

/// Transaction ids are drawn when a transaction first writes, commits happen later: an aggregate's
/// event from the lower txid can commit after one from a higher txid. A relay that cut a window at a
/// txid boundary published them out of order (found by the Redis-flapping fault test); the window
/// holds both here, with batch_size 1, so any cut would split it.
#[test]
fn an_older_transaction_that_commits_later_is_published_after() {
    let env = Env::start(&["outbox.enabled = off", "outbox.batch_size = 1"]);
    let mut older = env.pg.connect();
    let mut newer = env.pg.connect();
    older.batch_execute("BEGIN; SELECT pg_current_xact_id();").unwrap();
    newer.batch_execute("BEGIN").unwrap();
    enqueue(&mut newer, "order", "o-1", "{\"step\": 1}");
    newer.batch_execute("COMMIT").unwrap();
    enqueue(&mut older, "order", "o-1", "{\"step\": 2}");
    older.batch_execute("COMMIT").unwrap();
    let (older_txid, newer_txid): (i64, i64) = {
        let row = older
            .query_one(
                "SELECT min(txid::text::bigint) FILTER (WHERE payload->>'step' = '2'), min(txid::text::bigint) FILTER (WHERE payload->>'step' = '1')
                   FROM outbox.events",
                &[],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert!(older_txid < newer_txid, "the scenario needs the later commit to have the lower txid");
    env.pg.set(&mut older, &[("outbox.enabled", "on")]);
    let entries = env.redis.wait_for_entries("outbox:order", 2);
    let steps: Vec<(&str, &str)> =
        entries.iter().map(|e| (e["payload"].as_str(), e["aggregate_seq"].as_str())).collect();
    assert_eq!(steps, [("{\"step\": 1}", "1"), ("{\"step\": 2}", "2")]);
}

#[test]
fn stream_template_explicit_streams_and_trimming() {
    let env = Env::start(&["outbox.stream = 'app:{aggregate_type}:{event_type}'", "outbox.stream_maxlen = 10"]);
    let mut client = env.pg.connect();
    client.batch_execute("SELECT outbox_enqueue('cart', 1, 'cart.opened', '{}')").unwrap();
    client.batch_execute("SELECT outbox_enqueue('cart', 1, 'cart.closed', '{}', NULL, 'explicit:stream')").unwrap();
    env.redis.wait_for_entries("app:cart:cart.opened", 1);
    env.redis.wait_for_entries("explicit:stream", 1);
    client
        .batch_execute("SELECT outbox_enqueue('trim', i, 'x', '{}', NULL, 'trimmed') FROM generate_series(1, 500) i")
        .unwrap();
    wait_all_published(&mut client, 502);
    // MAXLEN ~ trims whole macro nodes: approximately 10, far below 500.
    assert!(env.redis.xlen("trimmed") < 500);
}

#[test]
fn an_entry_redis_rejects_does_not_hold_up_the_others() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut redis = env.redis.connection();
    // The key of one stream holds a string: Redis answers WRONGTYPE to XADD on it.
    redis::cmd("SET").arg("poisoned").arg("not a stream").query::<()>(&mut redis).unwrap();
    let mut client = env.pg.connect();
    let mut tx = client.transaction().unwrap();
    tx.batch_execute(
        "SELECT outbox_enqueue('ok', i, 'e', '{}') FROM generate_series(1, 5) i;
         SELECT outbox_enqueue('bad', 1, 'e', '{}', NULL, 'poisoned');
         SELECT outbox_enqueue('ok', i, 'e', '{}') FROM generate_series(6, 10) i;",
    )
    .unwrap();
    tx.commit().unwrap();
    env.redis.wait_for_entries("outbox:ok", 10);
    wait_for(DEADLINE, "the rejected row to record WRONGTYPE", || {
        let row = client
            .query_one("SELECT status, coalesce(last_error, '') FROM outbox.messages WHERE stream = 'poisoned'", &[])
            .unwrap();
        let (status, error): (String, String) = (row.get(0), row.get(1));
        (status == "pending" && error.contains("WRONGTYPE")).then_some(())
    });
    // Later events still flow past it.
    enqueue(&mut client, "ok", "11", "{}");
    env.redis.wait_for_entries("outbox:ok", 11);
}

#[test]
fn enqueue_without_preload_is_refused_with_a_hint() {
    let redis = Redis::start();
    let pg = Cluster::start_with(&[format!("outbox.redis_url = 'redis://127.0.0.1:{}'", redis.port)]);
    let mut client = pg.connect();
    client.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    let err = client.query_one("SELECT outbox_enqueue('a', 'b', 'c', '{}')", &[]).unwrap_err();
    let db = err.as_db_error().expect("a server error");
    assert_eq!(db.code(), &postgres::error::SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE);
    assert!(db.message().contains("shared_preload_libraries"), "{}", db.message());
    assert!(db.hint().unwrap_or("").contains("shared_preload_libraries"));
    let rows: i64 = client.query_one("SELECT count(*) FROM outbox.messages", &[]).unwrap().get(0);
    assert_eq!(rows, 0);
}

#[test]
fn shards_of_an_exited_process_are_taken_over_and_delivered() {
    // Paused, so that the claim below is certainly ours and not the relay's.
    let env = Env::start(&["outbox.enabled = off", "outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    client.batch_execute("SELECT outbox_enqueue('orphan', i, 'e', '{}') FROM generate_series(1, 3) i").unwrap();
    // A claimer that takes every shard and exits without finishing, as a crashed relay would.
    let mut claimer = env.pg.connect();
    let claimed: i64 = claimer
        .query_one("SELECT count(*) FROM outbox._claim_shards(pg_backend_pid(), 16, 600000)", &[])
        .unwrap()
        .get(0);
    assert_eq!(claimed, 16);
    drop(claimer);
    env.pg.set(&mut client, &[("outbox.enabled", "on")]);
    let entries = env.redis.wait_for_entries("outbox:orphan", 3);
    assert_eq!(entries.len(), 3);
    wait_all_published(&mut client, 3);
    let relay = env.pg.relay_pid(&mut client);
    let holders: Vec<i32> = client
        .query("SELECT DISTINCT claimed_by FROM outbox.shards", &[])
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(holders, [relay], "the relay took over every shard of the process that exited");
}

#[test]
fn switching_from_one_broken_redis_to_another_is_reported_as_a_new_outage() {
    let env = Env::start(&["outbox.redis_timeout = '500ms'"]);
    let mut client = env.pg.connect();
    // The relay is connected to the working Redis first; pg_reload_conf() only signals, so the
    // test waits until the relay has dropped that connection for the new URL before enqueueing.
    enqueue(&mut client, "switch", "0", "{}");
    env.redis.wait_for_entries("outbox:switch", 1);
    env.pg.set(&mut client, &[("outbox.redis_url", "redis://127.0.0.1:1")]);
    wait_for(DEADLINE, "the relay to apply the new URL", || {
        let connected: bool = client.query_one("SELECT redis_connected FROM outbox.stats", &[]).unwrap().get(0);
        (!connected).then_some(())
    });
    enqueue(&mut client, "switch", "1", "{}");
    wait_for(DEADLINE, "the first outage", || {
        env.pg.log().contains("cannot publish to Redis at 127.0.0.1:1:").then_some(())
    });
    env.pg.set(&mut client, &[("outbox.redis_url", "redis://127.0.0.1:2")]);
    wait_for(DEADLINE, "the second outage, naming the new target", || {
        env.pg.log().contains("cannot publish to Redis at 127.0.0.1:2:").then_some(())
    });
    env.pg.set(&mut client, &[("outbox.redis_url", &env.redis.url())]);
    env.redis.wait_for_entries("outbox:switch", 2);
    assert_eq!(env.pg.log().matches("cannot publish to Redis at 127.0.0.1:1:").count(), 1);
}

#[test]
fn a_slow_round_is_logged_with_the_time_of_each_phase() {
    // A long pause and a longer Redis timeout: on a loaded 2-core machine the relay may pick the
    // event up a second or two late, and the round it then runs must still be slow, not failed.
    let env = Env::start(&["outbox.log_min_duration = '300ms'", "outbox.redis_timeout = '10s'"]);
    let mut client = env.pg.connect();
    enqueue(&mut client, "slow", "0", "{}");
    env.redis.wait_for_entries("outbox:slow", 1);

    // Redis holds writes for 4 s (shorter than outbox.redis_timeout): the round succeeds, late.
    // Only lines after the pause count: the first round after the start may be slow too.
    let logged_before = env.pg.log().len();
    env.redis.query::<()>(redis::cmd("CLIENT").arg("PAUSE").arg(4_000).arg("WRITE"));
    enqueue(&mut client, "slow", "1", "{}");
    env.redis.wait_for_entries("outbox:slow", 2);
    let line = wait_for(DEADLINE, "the slow round's LOG line", || {
        let log = env.pg.log();
        log[logged_before..].lines().find(|line| line.contains("outbox_pg: slow round")).map(str::to_string)
    });
    assert!(line.contains("(1 claimed, 1 published)"), "{line}");
    let publish_ms: f64 = line
        .split("publish to Redis ")
        .nth(1)
        .and_then(|rest| rest.split(" ms").next())
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("no publish time in {line}"));
    assert!(publish_ms >= 300.0, "the pause is in the publish phase: {line}");
    assert!(line.contains("above outbox.log_min_duration (300.0 ms)"), "{line}");
}
