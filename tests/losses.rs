//! Loss detection (sink/src/marks.rs, src/relay/losses.rs) in the cases a review found it wrong:
//! a stream deleted and written to again before any check had a baseline, the relay moved to
//! another database of the same Redis, and a loss repair with two relays. Real PostgreSQL and
//! redis-server; every check is forced by a new connection, not waited for.

mod common;

use std::time::Duration;

use common::{enqueue_to, wait_for, Cluster, Env, Redis, DEADLINE, RELAY_ACL_USER};
use outbox_testkit::{as_server_user, rss_kb, vm_size_kb, PeakMemory};

fn losses(client: &mut postgres::Client, stream: &str) -> i64 {
    client.query_one("SELECT count(*) FROM outbox.redis_losses WHERE stream = $1", &[&stream]).unwrap().get(0)
}

/// Entries of `stream` in Redis database `db`.
fn xlen(env: &Env, db: i64, stream: &str) -> i64 {
    let mut connection = env.redis.connection();
    redis::cmd("SELECT").arg(db).query::<()>(&mut connection).unwrap();
    redis::cmd("XLEN").arg(stream).query(&mut connection).unwrap()
}

/// Limits process `pid`'s address space to `kb` (`prlimit --as`, as the server's OS user: root
/// without CAP_SYS_RESOURCE may not change another user's process).
fn limit_address_space(pid: i32, kb: u64) {
    let bytes = (kb * 1024).to_string();
    let status = as_server_user(std::path::Path::new("prlimit"))
        .args(["--pid", &pid.to_string(), &format!("--as={bytes}:{bytes}")])
        .status()
        .expect("prlimit");
    assert!(status.success(), "prlimit --pid {pid} --as={bytes}");
}

/// The relay's connections are closed: its next write checks every mark first.
fn kill_relay_connections(env: &Env) {
    let _: i64 = env.redis.query(redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal"));
}

/// A stream first written after the relay's last check, emptied by FLUSHALL and written to again
/// before the next check: the check finds the first entry written neither in the stream nor
/// trimmed nor deleted with XDEL, and records the loss once; its stored mark goes, so that a
/// relay started later does not find it again.
#[test]
fn a_stream_deleted_and_written_to_again_before_its_first_check_is_a_loss() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    // The relay connects (and checks: nothing yet) for the first event, then writes omega's.
    enqueue_to(&mut client, "alpha", "1", None);
    env.redis.wait_for_entries("outbox:alpha", 1);
    for _ in 0..3 {
        enqueue_to(&mut client, "omega", "1", None);
    }
    env.redis.wait_for_entries("outbox:omega", 3);
    let _: () = env.redis.query(&redis::cmd("FLUSHALL"));
    enqueue_to(&mut client, "omega", "1", None);
    env.redis.wait_for_entries("outbox:omega", 1);
    assert_eq!(losses(&mut client, "outbox:omega"), 0, "no check ran yet");
    kill_relay_connections(&env);
    enqueue_to(&mut client, "alpha", "1", None);
    wait_for(DEADLINE, "the loss of outbox:omega to be recorded", || {
        (losses(&mut client, "outbox:omega") == 1).then_some(())
    });
    assert!(env.pg.log().contains("Redis lost entries of stream \"outbox:omega\""), "{}", env.pg.log());
    // alpha, checked before omega's first write, is gone: lost too.
    wait_for(DEADLINE, "the loss of outbox:alpha", || (losses(&mut client, "outbox:alpha") == 1).then_some(()));
    // The stored mark at or below what was lost is gone; a relay started anew finds nothing more.
    let expected: String = client
        .query_one("SELECT expected_id FROM outbox.redis_losses WHERE stream = 'outbox:omega'", &[])
        .unwrap()
        .get(0);
    let (ms, seq) = expected.split_once('-').unwrap();
    let (ms, seq): (i64, i64) = (ms.parse().unwrap(), seq.parse().unwrap());
    let stale: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox.stream_marks WHERE stream = 'outbox:omega' AND (last_ms, last_seq) <= ($1, $2)",
            &[&ms, &seq],
        )
        .unwrap()
        .get(0);
    assert_eq!(stale, 0, "the lost mark is still stored");
    let relay = env.pg.relay_pid(&mut client);
    client.execute("SELECT pg_terminate_backend($1)", &[&relay]).unwrap();
    wait_for(DEADLINE, "a new relay", || {
        env.pg.backend_pids(&mut client, "outbox_pg relay").first().copied().filter(|&pid| pid != relay)
    });
    for n in 0..3 {
        enqueue_to(&mut client, "omega", "1", None);
        env.redis.wait_for_entries("outbox:omega", 2 + n);
    }
    assert_eq!(client.query_one("SELECT count(*) FROM outbox.redis_losses", &[]).unwrap().get::<_, i64>(0), 2);
}

/// The same Redis reached with other credentials (a rotated password, a user of its own) is not
/// another Redis: the relay keeps checking the streams it wrote there (found by attack: the
/// change of URL dropped every mark, and the stored ones were reloaded only when the relay
/// restarted, so a FLUSHALL after a password rotation went unnoticed).
#[test]
fn new_credentials_for_the_same_redis_keep_its_streams_checked() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    for _ in 0..2 {
        enqueue_to(&mut client, "cred", "1", None);
    }
    env.redis.wait_for_entries("outbox:cred", 2);
    let _: () = env.redis.query(redis::cmd("ACL").arg(&["SETUSER", "rotated", "on", ">pw-2", "~*", "&*", "+@all"][..]));
    env.pg.set(&mut client, &[("outbox.redis_url", &format!("redis://rotated:pw-2@127.0.0.1:{}", env.redis.port))]);
    // Applied once the relay publishes as the new user (the target it logs is the same).
    let mut n = 0;
    wait_for(DEADLINE, "the relay to publish as the new user", || {
        n += 1;
        enqueue_to(&mut client, "other", &n.to_string(), None);
        env.redis.wait_for_entries("outbox:other", n);
        let clients: String = env.redis.query(redis::cmd("CLIENT").arg("LIST"));
        clients.contains("user=rotated").then_some(())
    });
    let _: () = env.redis.query(&redis::cmd("FLUSHALL"));
    kill_relay_connections(&env);
    enqueue_to(&mut client, "other", "0", None);
    wait_for(DEADLINE, "the loss of outbox:cred to be recorded", || {
        (losses(&mut client, "outbox:cred") == 1).then_some(())
    });
}

/// outbox.redis_url moved from database 0 to database 1 of the same server: the marks of database
/// 0 are not checked against database 1, after a reload or a relay restart.
#[test]
fn moving_to_another_database_of_the_same_redis_is_no_loss() {
    let env = Env::start(&["outbox.poll_interval = '100ms'", "outbox.replay_on_loss = on"]);
    let mut client = env.pg.connect();
    for _ in 0..4 {
        enqueue_to(&mut client, "fpdb", "1", None);
    }
    env.redis.wait_for_entries("outbox:fpdb", 4);
    wait_for(DEADLINE, "the relay to store its mark of outbox:fpdb", || {
        let stored: i64 = client
            .query_one("SELECT count(*) FROM outbox.stream_marks WHERE stream = 'outbox:fpdb'", &[])
            .unwrap()
            .get(0);
        (stored == 1).then_some(())
    });
    env.pg.set(&mut client, &[("outbox.redis_url", &format!("{}/1", env.redis.url()))]);
    // pg_reload_conf() only signals: an event enqueued before the relay applied the reload would
    // rightly go to database 0.
    let moved = format!("after the reload, Redis is 127.0.0.1:{} db 1 (was", env.redis.port);
    wait_for(DEADLINE, "the relay to apply the reload", || env.pg.log().contains(&moved).then_some(()));
    let published_to_db1 = |client: &mut postgres::Client, n: i64| {
        enqueue_to(client, "other", "1", None);
        wait_for(DEADLINE, "the event in database 1", || (xlen(&env, 1, "outbox:other") == n).then_some(()));
    };
    published_to_db1(&mut client, 1);
    let relay = env.pg.relay_pid(&mut client);
    client.execute("SELECT pg_terminate_backend($1)", &[&relay]).unwrap();
    wait_for(DEADLINE, "a new relay", || {
        env.pg.backend_pids(&mut client, "outbox_pg relay").first().copied().filter(|&pid| pid != relay)
    });
    // The new relay checks its marks before its first write, and reports after that round.
    for n in 2..=4 {
        published_to_db1(&mut client, n);
    }
    assert_eq!(client.query_one("SELECT count(*) FROM outbox.redis_losses", &[]).unwrap().get::<_, i64>(0), 0);
    assert_eq!(xlen(&env, 1, "outbox:fpdb"), 0, "nothing replayed into database 1");
    // Database 1's marks are stored apart (once a second).
    let targets: Vec<String> = wait_for(DEADLINE, "the marks of database 1", || {
        let targets: Vec<String> = client
            .query("SELECT DISTINCT target FROM outbox.stream_marks ORDER BY 1", &[])
            .unwrap()
            .into_iter()
            .map(|row| row.get(0))
            .collect();
        (targets.len() == 2).then_some(targets)
    });
    assert!(targets[1].ends_with(" db 1") && !targets[0].contains(" db "), "{targets:?}");
}

/// With two relays and outbox.replay_on_loss, no relay runs a live round while a loss repair
/// runs: here one left running across a restart of PostgreSQL (shared memory starts anew),
/// throttled to rounds of 1,000 events a second.
#[test]
fn no_relay_runs_live_rounds_while_a_loss_repair_runs() {
    let env = Env::start(&["outbox.poll_interval = '100ms'", "outbox.replay_on_loss = on", "outbox.workers = 2"]);
    let mut client = env.pg.connect();
    let since: std::time::SystemTime = client.query_one("SELECT clock_timestamp()", &[]).unwrap().get(0);
    client
        .batch_execute("SELECT outbox_enqueue('hist', (i % 8)::text, 'e', '{}') FROM generate_series(1, 10000) i")
        .unwrap();
    let xlen = |stream: &str| -> i64 { env.redis.query(redis::cmd("XLEN").arg(stream)) };
    wait_for(Duration::from_secs(120), "10,000 entries", || (xlen("outbox:hist") == 10_000).then_some(()));
    // Journaled: the rounds are finished.
    common::wait_drained(&mut client);
    // The relays paused, a loss being repaired, as a relay would record it; then PostgreSQL
    // restarts with the relays on.
    env.pg.set(&mut client, &[("outbox.enabled", "off")]);
    client
        .execute(
            "WITH r AS (SELECT outbox.replay(since => $1, streams => ARRAY['outbox:hist'], max_rate => 1000) AS id)
             INSERT INTO outbox.redis_losses (stream, expected_id, expected_at, found_id, replay_id)
             SELECT 'outbox:hist', '1-0', now(), NULL, id FROM r",
            &[&since],
        )
        .unwrap();
    let journaled: i64 = client.query_one("SELECT journaled FROM outbox.replay_requests", &[]).unwrap().get(0);
    assert_eq!(journaled, 10_000);
    client.batch_execute("ALTER SYSTEM SET outbox.enabled = on").unwrap();
    env.pg.pg_ctl_stop("fast");
    env.pg.pg_ctl_start();
    let mut client = env.pg.connect_eventually();
    for n in 0..8 {
        enqueue_to(&mut client, "live", &n.to_string(), None);
    }
    let replay = |client: &mut postgres::Client| -> (String, i64) {
        let row = client.query_one("SELECT state, replayed FROM outbox.replays ORDER BY id DESC LIMIT 1", &[]).unwrap();
        (row.get(0), row.get(1))
    };
    let (_, before) = replay(&mut client);
    wait_for(Duration::from_secs(60), "two relays", || {
        (env.pg.backend_pids(&mut client, "outbox_pg relay").len() == 2).then_some(())
    });
    // A second later, a round more: the relays went round their loops meanwhile.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while replay(&mut client).1 < before + 1000 {
        if std::time::Instant::now() > deadline {
            let row = client.query_one("SELECT row_to_json(r)::text FROM outbox.replays r", &[]).unwrap();
            let stats = client.query_one("SELECT row_to_json(s)::text FROM outbox.stats s", &[]).unwrap();
            panic!(
                "no progress from {before}: {} / {} / live {}",
                row.get::<_, String>(0),
                stats.get::<_, String>(0),
                xlen("outbox:live")
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let live = xlen("outbox:live");
    let (state, replayed) = replay(&mut client);
    assert_eq!(live, 0, "a live round ran while the repair ran ({state}, {replayed} replayed)");
    client.execute("SELECT outbox.cancel_replay(max(id)) FROM outbox.replays", &[]).unwrap();
    env.redis.wait_for_entries("outbox:live", 8);
}

/// Issue 35, item 1: a writer's 1 MB events to 150 streams of their own, then a new connection.
/// The check asked `XINFO STREAM` of every stream in one pipeline, whose replies carry each
/// stream's first and last entries whole: 300 MB held at once, and under a memory limit an abort
/// that restarted every backend of the cluster. The check now gets IDs and counters only, a
/// chunk at a time: with the relay's address space limited to 128 MB above what it maps, it
/// stays the same process, grows by far less, finds the stream deleted meanwhile, and delivers.
#[test]
fn the_loss_check_holds_ids_not_entries_under_a_memory_limit() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    client.batch_execute("CREATE ROLE writer LOGIN; GRANT outbox_writer TO writer").unwrap();
    let mut writer = env.pg.connect();
    writer.batch_execute("SET ROLE writer").unwrap();
    let streams = 150;
    writer
        .batch_execute(&format!(
            "SELECT count(outbox_enqueue('big', g::bigint, 'e', to_jsonb(repeat('x', 1000000)), NULL, 'tenant:' || g)) \
             FROM generate_series(1, {streams}) g"
        ))
        .unwrap();
    wait_for(Duration::from_secs(120), "every big event in Redis", || {
        (env.redis.total_entries() >= streams).then_some(())
    });
    let _: i64 = env.redis.query(redis::cmd("DEL").arg("tenant:7"));
    let mut bystander = env.pg.connect();
    let relay = env.pg.relay_pid(&mut client);
    limit_address_space(relay, vm_size_kb(relay) + 128 * 1024);
    let at_rest = rss_kb(relay);
    let memory = PeakMemory::watch(relay);

    kill_relay_connections(&env);
    enqueue_to(&mut client, "probe", "1", None);
    wait_for(DEADLINE, "the loss of tenant:7 to be recorded", || (losses(&mut client, "tenant:7") == 1).then_some(()));
    env.redis.wait_for_entries("outbox:probe", 1);
    let peak = memory.peak_kb();
    drop(memory);

    assert_eq!(env.pg.relay_pid(&mut client), relay, "the relay ran on: {}", env.pg.log());
    bystander.query_one("SELECT 1", &[]).expect("no backend was restarted");
    assert!(
        peak.saturating_sub(at_rest) < 64 * 1024,
        "the relay grew from {at_rest} kB to {peak} kB checking {streams} streams of 1 MB entries"
    );
    for g in [1, 8, streams] {
        assert_eq!(losses(&mut client, &format!("tenant:{g}")), 0, "tenant:{g} lost nothing");
    }
    // By the script (IDs and counters only), not by the fallback that fetches entries.
    let stats: String = env.redis.query(redis::cmd("INFO").arg("commandstats"));
    assert!(stats.contains("cmdstat_eval:calls="), "{stats}");
}

/// Issue 35, item 1: an allocation the relay's Rust heap cannot satisfy (here 1 GiB, under an
/// address-space limit 64 MB above what the relay maps) ends that relay with FATAL, exit code 1,
/// which the postmaster restarts alone. Rust's default, abort(), is a signal: the postmaster
/// restarted every backend of the cluster, and a relay that ran out again after the restart made
/// that a loop.
#[test]
fn an_allocation_failure_ends_the_relay_alone() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    enqueue_to(&mut client, "alpha", "1", None);
    env.redis.wait_for_entries("outbox:alpha", 1);
    let mut bystander = env.pg.connect();
    let relay = env.pg.relay_pid(&mut client);
    limit_address_space(relay, vm_size_kb(relay) + 64 * 1024);
    env.pg.set(&mut client, &[("outbox.fault_injection", "out_of_memory_after_publish")]);
    wait_for(DEADLINE, "the relay to read the setting", || {
        client
            .query_one("SELECT current_setting('outbox.fault_injection')", &[])
            .ok()
            .filter(|row| row.get::<_, String>(0) == "out_of_memory_after_publish")
    });
    enqueue_to(&mut client, "alpha", "2", None);
    wait_for(DEADLINE, "the relay to end", || {
        (!std::path::Path::new(&format!("/proc/{relay}")).exists()).then_some(())
    });
    // The round was not finished: the relay started again publishes it again.
    env.redis.wait_for_entries("outbox:alpha", 3);
    let log = env.pg.log();
    assert!(!log.contains("terminating any other active server processes"), "{log}");
    bystander.query_one("SELECT 1", &[]).expect("no backend was restarted");
    assert!(log.contains("FATAL:  outbox_pg: out of memory: an allocation of 1073741824 bytes failed"), "{log}");
}

/// Where both servers crash, relative to the finish of the round that published five events.
#[derive(Debug, Clone, Copy)]
enum CrashPoint {
    /// The relay exits after Redis accepted the round, before its finish.
    BeforeFinish,
    /// The relay dies (SIGKILL, so PostgreSQL restarts every backend) right after the finish
    /// committed and was flushed.
    AfterFinish,
    /// The relay is killed once the round's marks are in outbox.stream_marks.
    AfterMarks,
}

/// PostgreSQL and Redis (snapshots only, `SAVE`d before the events) both crash at `point`, Redis
/// comes back from its snapshot, and one more event is enqueued: every event marked published is
/// then either in Redis or its stream's loss is recorded.
fn crash_both_servers(point: CrashPoint) {
    let mut env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    enqueue_to(&mut client, "warm", "1", None);
    env.redis.wait_for_entries("outbox:warm", 1);
    // Its round finished too: a finish still to come would fire crash_after_finish, armed below,
    // before the five events are even enqueued (seen on a loaded machine).
    wait_for(DEADLINE, "the warm-up event published", || {
        let published: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox.messages WHERE aggregate_type = 'warm' AND status = 'published'",
                &[],
            )
            .unwrap()
            .get(0);
        (published == 1).then_some(())
    });
    let _: String = env.redis.query(&redis::cmd("SAVE"));
    let fault = match point {
        CrashPoint::BeforeFinish => "crash_after_publish",
        CrashPoint::AfterFinish => "crash_after_finish",
        CrashPoint::AfterMarks => "none",
    };
    env.pg.set(&mut client, &[("outbox.fault_injection", fault)]);
    wait_for(DEADLINE, "the setting to be in force", || {
        let mut fresh = env.pg.connect();
        let now: String = fresh.query_one("SELECT current_setting('outbox.fault_injection')", &[]).unwrap().get(0);
        (now == fault).then_some(())
    });
    let relay = env.pg.relay_pid(&mut client);
    // Five events in one transaction, in the order they are enqueued.
    let events: Vec<String> = client
        .query(
            "SELECT outbox_enqueue('lost', '1', 'test.event', '{}'::jsonb)::text FROM generate_series(1, 5) ORDER BY 1",
            &[],
        )
        .unwrap()
        .into_iter()
        .map(|row| row.get(0))
        .collect();
    match point {
        CrashPoint::BeforeFinish => wait_for(DEADLINE, "the relay to exit before the finish", || {
            env.pg.log().contains("crash_after_publish: exiting").then_some(())
        }),
        CrashPoint::AfterFinish => wait_for(DEADLINE, "the relay to die after the finish", || {
            env.pg.log().contains("crash_after_finish: dying").then_some(())
        }),
        CrashPoint::AfterMarks => {
            env.redis.wait_for_entries("outbox:lost", 5);
            wait_for(DEADLINE, "the marks of outbox:lost to be stored", || {
                let stored: i64 = client
                    .query_one("SELECT count(*) FROM outbox.stream_marks WHERE stream = 'outbox:lost'", &[])
                    .unwrap()
                    .get(0);
                (stored == 1).then_some(())
            });
            env.pg.kill_9(relay);
        }
    }
    if !matches!(point, CrashPoint::BeforeFinish) {
        wait_for(DEADLINE, "PostgreSQL to restart every backend", || {
            env.pg.log().contains("all server processes terminated; reinitializing").then_some(())
        });
    }
    // Redis dies too, and comes back from the snapshot taken before the five events.
    env.redis.restart();
    let mut client = env.pg.connect_eventually();
    env.pg.set(&mut client, &[("outbox.fault_injection", "none")]);
    wait_for(DEADLINE, "the setting to be in force", || {
        let mut fresh = env.pg.connect();
        let now: String = fresh.query_one("SELECT current_setting('outbox.fault_injection')", &[]).unwrap().get(0);
        (now == "none").then_some(())
    });
    let last = enqueue_to(&mut client, "lost", "2", None);
    // A relay forked before that reload may still crash once more after the next finish (its
    // SIGHUP came while a starting worker ignores it): the connection is made again then.
    let mut client = Some(client);
    wait_for(DEADLINE, &format!("{point:?}: the five events in Redis, or their loss recorded"), || {
        let connection = client.get_or_insert_with(|| env.pg.connect_eventually());
        let state = connection.query_one(
            "SELECT (SELECT status = 'published' FROM outbox.messages WHERE event_id = $1::text::uuid), \
                    (SELECT count(*) FROM outbox.redis_losses WHERE stream = 'outbox:lost')",
            &[&last],
        );
        let Ok(row) = state else {
            client = None;
            return None;
        };
        let (finished, lost): (Option<bool>, i64) = (row.get(0), row.get(1));
        let in_redis: Vec<String> =
            env.redis.entries("outbox:lost").into_iter().map(|e| e["event_id"].clone()).collect();
        let all_there = events.iter().all(|event| in_redis.contains(event));
        (finished == Some(true) && (all_there || lost > 0)).then_some(())
    });
}

/// Issue 35, item 2: a round's finish committed, and its stream marks were stored about 0.8 s
/// later in a transaction of their own; PostgreSQL and Redis crashing in between kept the finish
/// (five events `published`), lost the marks, and Redis, restarted from a snapshot, lost the
/// entries: nothing noticed it. The marks now go in the finish itself.
#[test]
fn a_loss_when_both_servers_crash_around_a_finish_is_noticed() {
    for point in [CrashPoint::BeforeFinish, CrashPoint::AfterFinish, CrashPoint::AfterMarks] {
        crash_both_servers(point);
    }
}

/// An idle relay notices a Redis restart without waiting for a write: once per poll interval it
/// makes sure its connection is alive, and the new connection's check finds what Redis lost.
/// Meanwhile outbox.stats.redis_connected says Redis is gone (it stayed true before, and the loss
/// waited for the next event).
#[test]
fn an_idle_relay_notices_a_redis_restart_and_its_loss_without_a_write() {
    let mut env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let connected = |client: &mut postgres::Client| -> bool {
        client.query_one("SELECT redis_connected FROM outbox.stats", &[]).unwrap().get(0)
    };
    enqueue_to(&mut client, "idle", "1", None);
    env.redis.wait_for_entries("outbox:idle", 1);
    wait_for(DEADLINE, "redis_connected", || connected(&mut client).then_some(()));
    env.redis.kill();
    wait_for(DEADLINE, "redis_connected to turn false while nothing is published", || {
        (!connected(&mut client)).then_some(())
    });
    // A retry fails again (the error's time moves): no idle round in between was taken for a
    // recovery ("publishing ... again" every poll interval of the outage, before).
    let error_at = |client: &mut postgres::Client| -> Option<std::time::SystemTime> {
        client.query_one("SELECT last_error_at FROM outbox.stats", &[]).unwrap().get(0)
    };
    let first = error_at(&mut client);
    wait_for(DEADLINE, "a retry to fail again while Redis is away", || (error_at(&mut client) > first).then_some(()));
    assert!(!env.pg.log().contains("again after"), "no recovery while Redis was away: {}", env.pg.log());
    // Back empty (no persistence): the entry the relay wrote is gone.
    env.redis.restart();
    wait_for(DEADLINE, "the loss of outbox:idle to be recorded without a write", || {
        (losses(&mut client, "outbox:idle") == 1).then_some(())
    });
    wait_for(DEADLINE, "redis_connected again", || connected(&mut client).then_some(()));
}

/// A Redis restarted empty under a relay that wrote to many streams, with outbox.replay_on_loss:
/// the check finds the losses a chunk of streams per round, each round stopping before it writes,
/// and none of those stops counts as a failure of Redis (they did, in replay rounds: the backoff
/// grew to its cap, and finding 3,995 lost streams took 7 minutes). Every stream is repaired.
#[test]
fn many_lost_streams_are_found_and_repaired_without_backing_off() {
    let mut env = Env::start(&["outbox.poll_interval = '100ms'", "outbox.replay_on_loss = on"]);
    let mut client = env.pg.connect();
    client
        .batch_execute(
            "SELECT count(outbox_enqueue('many', n::text, 't', '{}', NULL, 'many:' || n)) FROM generate_series(1, 300) n",
        )
        .unwrap();
    env.redis.wait_for_entries("many:300", 1);
    wait_for(DEADLINE, "every event published", || {
        client
            .query_one("SELECT oldest_pending_age IS NULL FROM outbox.stats", &[])
            .unwrap()
            .get::<_, bool>(0)
            .then_some(())
    });
    env.redis.restart();
    wait_for(DEADLINE, "300 losses recorded", || {
        (client.query_one("SELECT count(*) FROM outbox.redis_losses", &[]).unwrap().get::<_, i64>(0) == 300)
            .then_some(())
    });
    // Each loss's replay counts as repairing it while it runs: wait until every one is done.
    wait_for(Duration::from_secs(180), "every repair done", || {
        let running: i64 =
            client.query_one("SELECT count(*) FROM outbox.replays WHERE state <> 'done'", &[]).unwrap().get(0);
        (running == 0).then_some(())
    });
    let repaired: i64 = client.query_one("SELECT redis_data_loss FROM outbox.stats", &[]).unwrap().get(0);
    assert_eq!(repaired, 0);
    for n in [1, 150, 300] {
        assert_eq!(env.redis.xlen(&format!("many:{n}")), 1, "many:{n} replayed");
    }
    let last_error: Option<String> = client.query_one("SELECT last_error FROM outbox.stats", &[]).unwrap().get(0);
    assert!(
        !last_error.clone().unwrap_or_default().contains("lost entries"),
        "a loss was taken for an outage: {last_error:?}"
    );
}

/// A relay whose Redis user may not PING stays connected while idle: any reply, NOPERM too, shows
/// the connection alive (it reported an outage at every poll, and delayed events by its backoff).
#[test]
fn an_idle_relay_without_ping_permission_is_not_in_an_outage() {
    let redis = Redis::start();
    let user: Vec<&str> = RELAY_ACL_USER.iter().copied().filter(|p| *p != "+ping").chain(["+eval"]).collect();
    redis.query::<()>(redis::cmd("ACL").arg([&["SETUSER"][..], &user].concat()));
    let pg = Cluster::start(
        redis.port,
        &[
            &format!("outbox.redis_url = 'redis://relay:relay-pw@127.0.0.1:{}'", redis.port),
            "outbox.poll_interval = '100ms'",
        ],
    );
    pg.connect().batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    let mut client = pg.connect();
    enqueue_to(&mut client, "noping", "1", None);
    redis.wait_for_entries("outbox:noping", 1);
    // Idle polls PING and are refused: wait until Redis logged some refusals.
    wait_for(DEADLINE, "a PING refused by the ACL", || {
        let denied: Vec<redis::Value> = redis.query(redis::cmd("ACL").arg("LOG"));
        format!("{denied:?}").contains("ping").then_some(())
    });
    enqueue_to(&mut client, "noping", "2", None);
    redis.wait_for_entries("outbox:noping", 2);
    let connected: bool = client.query_one("SELECT redis_connected FROM outbox.stats", &[]).unwrap().get(0);
    assert!(connected);
    assert!(!pg.log().contains("cannot publish"), "{}", pg.log());
}

/// Where the relay's Redis user may not run `EVAL` (README's least privileges: `+xinfo|stream`),
/// the check asks `XINFO STREAM` itself, one stream per exchange, and still finds a loss.
#[test]
fn without_eval_the_check_asks_xinfo_stream_and_still_finds_a_loss() {
    let redis = Redis::start();
    redis.query::<()>(redis::cmd("ACL").arg([&["SETUSER"][..], RELAY_ACL_USER].concat()));
    let pg = Cluster::start(
        redis.port,
        &[
            &format!("outbox.redis_url = 'redis://relay:relay-pw@127.0.0.1:{}'", redis.port),
            "outbox.poll_interval = '100ms'",
        ],
    );
    pg.connect().batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    let env = Env { redis, pg };
    let mut client = env.pg.connect();
    enqueue_to(&mut client, "gone", "1", None);
    env.redis.wait_for_entries("outbox:gone", 1);
    enqueue_to(&mut client, "kept", "1", None);
    env.redis.wait_for_entries("outbox:kept", 1);
    let _: i64 = env.redis.query(redis::cmd("DEL").arg("outbox:gone"));
    kill_relay_connections(&env);
    enqueue_to(&mut client, "kept", "2", None);
    wait_for(DEADLINE, "the loss of outbox:gone to be recorded", || {
        (losses(&mut client, "outbox:gone") == 1).then_some(())
    });
    assert_eq!(losses(&mut client, "outbox:kept"), 0);
    let denied: Vec<redis::Value> = env.redis.query(redis::cmd("ACL").arg("LOG"));
    assert!(format!("{denied:?}").contains("eval"), "the script was tried and refused: {denied:?}");
    assert!(!env.pg.log().contains("cannot notice"), "{}", env.pg.log());
}
