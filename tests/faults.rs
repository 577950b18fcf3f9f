//! Fault injection against real processes: a private PostgreSQL (outbox_pg preloaded) and a private
//! redis-server, with producer threads committing, rolling back and reconnecting throughout while
//! something breaks. Each scenario ends with the invariant checker (`common::check_invariants`):
//! outbox.messages holds exactly the committed events, all published; every committed event is in
//! Redis (zero loss), nothing from a rolled-back transaction is (ambiguous commits, whose connection
//! broke during COMMIT, are looked up); duplicates only where the scenario allows them, and then
//! with the same event_id and fields; per aggregate, first occurrences in `aggregate_seq` order 1..n.
//!
//! Scenarios: the relay killed with SIGKILL mid-drain three times (cluster crash recovery);
//! immediate shutdown mid-drain; Redis killed mid-drain and restarted; Redis paused (CLIENT PAUSE
//! WRITE) beyond the relay's timeout, and hung with a batch in flight (also across a fast
//! shutdown); Redis out of memory, steadily and flapping around its limit; the relay paused with the
//! age alert; a hot standby (no workers in recovery) promoted after the primary died, and a
//! failover to a synchronous standby mid-drain; one of two relays hung (SIGSTOP) holding claims;
//! WRONGTYPE on one aggregate's stream; bad input to `outbox_enqueue` and roles; broken settings;
//! a Redis too slow to answer a whole round within `outbox.redis_timeout`.
//!
//! The default sizes keep the whole file well under three minutes on two cores (debug build,
//! `--test-threads=2`). `OUTBOX_HEAVY_FAULTS=1` runs heavier variants: more producers and events,
//! ten kill rounds, three immediate-shutdown and Redis-kill rounds, bigger backlogs.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use postgres::error::SqlState;

use common::{
    check_invariants, enqueue_recorded, status_counts, wait_drained, wait_for, wait_for_failed_rounds, Cluster, Env,
    Expect, LedgerEvent, Producers, Redis, Rng, SharedLedger, Workload, DEADLINE,
};

fn heavy() -> bool {
    std::env::var("OUTBOX_HEAVY_FAULTS").is_ok_and(|v| v == "1")
}

/// `light` normally, `heavy` with OUTBOX_HEAVY_FAULTS=1.
fn scale(light: usize, heavy_value: usize) -> usize {
    if heavy() {
        heavy_value
    } else {
        light
    }
}

fn workload() -> Workload {
    Workload {
        producers: scale(3, 6),
        max_txns: scale(1_000, 10_000),
        pause: Duration::from_millis(scale(15, 5) as u64),
        ..Workload::default()
    }
}

/// Events waiting when a fault is injected mid-drain.
fn backlog() -> i64 {
    scale(150, 1_500) as i64
}

fn count(client: &mut postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).unwrap().get(0)
}

/// Like `wait_for`, but polling every millisecond: for moments that last only a few milliseconds.
fn poll_fast<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {DEADLINE:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Sets the stage for a fault "mid-drain": pauses the relay until at least `backlog` events wait,
/// resumes it, and returns as soon as the streams have grown, i.e. while the relay is working
/// through the backlog. Returns the (first) relay's pid and how many entries it had added by then.
fn mid_drain(pg: &Cluster, redis: &Redis, backlog: i64) -> (i32, usize) {
    let mut client = pg.connect_eventually();
    pg.set(&mut client, &[("outbox.enabled", "off")]);
    wait_for(DEADLINE, &format!("a backlog of {backlog} pending events"), || {
        (count(&mut client, "SELECT pending FROM outbox.stats") >= backlog).then_some(())
    });
    let relay = wait_for(DEADLINE, "a relay", || pg.backend_pids(&mut client, "outbox_pg relay").first().copied());
    let before = redis.total_entries();
    pg.set(&mut client, &[("outbox.enabled", "on")]);
    let grown = poll_fast("the relay to start draining the backlog", || {
        let now = redis.total_entries();
        (now > before).then_some(now - before)
    });
    (relay, grown)
}

fn log_count(pg: &Cluster, needle: &str) -> usize {
    pg.log().matches(needle).count()
}

#[test]
fn relay_killed_with_sigkill_mid_drain_repeatedly() {
    let env = Env::start(&["outbox.batch_size = 20", "outbox.poll_interval = '100ms'"]);
    let ledger = SharedLedger::default();
    let producers = Producers::start(env.pg.port, workload(), ledger.clone());
    producers.wait_for_commits(20);
    let rounds = scale(3, 10);
    for round in 1..=rounds {
        let (relay, grown) = mid_drain(&env.pg, &env.redis, backlog());
        env.pg.kill_9(relay);
        // The postmaster resets the whole cluster (crash recovery); the launcher starts a new relay.
        wait_for(DEADLINE, "the postmaster to notice the killed relay", || {
            env.pg.log().contains(&format!("(PID {relay}) was terminated by signal 9")).then_some(())
        });
        let mut client = env.pg.connect_eventually();
        let new_relay = wait_for(DEADLINE, "a new relay after crash recovery", || {
            env.pg.backend_pids(&mut client, "outbox_pg relay").first().copied().filter(|&pid| pid != relay)
        });
        producers.wait_for_commits(20);
        eprintln!("round {round}: killed relay {relay} after it had added {grown} entries; new relay {new_relay}");
    }
    let reconnects = producers.reconnects();
    producers.stop();
    assert!(reconnects >= rounds, "each crash must cut the producers off: {reconnects} reconnects");
    assert!(log_count(&env.pg, "all server processes terminated; reinitializing") >= rounds);
    check_invariants("kill -9 relay", &env.pg, &env.redis, &ledger, Expect { duplicates: true });
}

#[test]
fn immediate_shutdown_mid_drain_then_restart() {
    let env = Env::start(&["outbox.batch_size = 20", "outbox.poll_interval = '100ms'"]);
    let ledger = SharedLedger::default();
    let producers = Producers::start(env.pg.port, workload(), ledger.clone());
    producers.wait_for_commits(20);
    for round in 1..=scale(1, 3) {
        let (relay, grown) = mid_drain(&env.pg, &env.redis, backlog());
        env.pg.pg_ctl_stop("immediate");
        // Producers keep trying to connect while the server is down.
        let before = producers.committed();
        env.pg.pg_ctl_start();
        producers.wait_for_commits(20);
        eprintln!("round {round}: immediate shutdown with relay {relay} after {grown} entries; {before} txns before");
    }
    let reconnects = producers.reconnects();
    producers.stop();
    assert!(reconnects >= 1, "the shutdown must cut the producers off");
    check_invariants("immediate shutdown", &env.pg, &env.redis, &ledger, Expect { duplicates: true });
}

#[test]
fn redis_killed_mid_drain_and_restarted() {
    // An append-only file written before each reply: a killed Redis keeps every entry it acknowledged.
    let mut env = Env::start_with_redis(
        &["--appendonly", "yes", "--appendfsync", "always"],
        &["outbox.batch_size = 20", "outbox.poll_interval = '100ms'"],
    );
    let ledger = SharedLedger::default();
    let producers = Producers::start(env.pg.port, workload(), ledger.clone());
    producers.wait_for_commits(20);
    for round in 1..=scale(1, 3) {
        let warnings = log_count(&env.pg, "cannot publish to Redis");
        let (_, grown) = mid_drain(&env.pg, &env.redis, backlog());
        env.redis.kill();
        wait_for(DEADLINE, "the relay to report Redis down", || {
            (log_count(&env.pg, "cannot publish to Redis") > warnings).then_some(())
        });
        producers.wait_for_commits(20);
        env.redis.restart();
        producers.wait_for_commits(20);
        eprintln!("round {round}: Redis killed after {grown} entries");
    }
    producers.stop();
    check_invariants("Redis killed", &env.pg, &env.redis, &ledger, Expect { duplicates: true });
}

#[test]
fn redis_paused_longer_than_the_socket_timeout_mid_drain() {
    let env = Env::start(&["outbox.batch_size = 20", "outbox.poll_interval = '100ms'"]);
    let ledger = SharedLedger::default();
    let producers = Producers::start(env.pg.port, workload(), ledger.clone());
    producers.wait_for_commits(20);
    for round in 1..=scale(1, 2) {
        let warnings = log_count(&env.pg, "cannot publish to Redis");
        let recoveries = log_count(&env.pg, "publishing to Redis at");
        let (_, grown) = mid_drain(&env.pg, &env.redis, backlog());
        // Writes block for 5 s (10 s in heavy runs, where a starved relay may start its next
        // pipeline late); the relay's socket timeout is 2 s.
        env.redis.pause_writes(Duration::from_millis(scale(5_000, 10_000) as u64));
        wait_for(DEADLINE, "the relay to time out", || {
            (log_count(&env.pg, "cannot publish to Redis") > warnings).then_some(())
        });
        wait_for(DEADLINE, "the relay to publish again after the pause", || {
            (log_count(&env.pg, "publishing to Redis at") > recoveries).then_some(())
        });
        producers.wait_for_commits(20);
        let line = env.pg.log().lines().rfind(|l| l.contains("cannot publish to Redis")).unwrap().to_string();
        eprintln!("round {round}: paused Redis after {grown} entries: {line}");
    }
    producers.stop();
    check_invariants("Redis paused", &env.pg, &env.redis, &ledger, Expect { duplicates: true });
}

/// Redis stops answering writes (`CLIENT PAUSE ... WRITE` stands for a hung server, or a network
/// partition that drops packets) while the relay has a batch of 100 in flight; the relay's timeout
/// is 1 s. Stops being paused when dropped.
struct HungRedis<'a>(&'a Redis);

impl<'a> HungRedis<'a> {
    fn hang(redis: &'a Redis) -> HungRedis<'a> {
        redis.pause_writes(Duration::from_secs(600));
        HungRedis(redis)
    }
}

impl Drop for HungRedis<'_> {
    fn drop(&mut self) {
        self.0.unpause();
    }
}

/// A cluster whose relay (timeout 1 s) is stuck on a hung Redis with a batch of 100 in flight.
fn relay_stuck_on_a_hung_redis<'a>(env: &'a Env, ledger: &SharedLedger) -> HungRedis<'a> {
    let mut client = env.pg.connect();
    enqueue_recorded(&mut client, ledger, "hung", "0", None);
    env.redis.wait_for_entries("outbox:hung", 1);
    let hung = HungRedis::hang(&env.redis);
    // One transaction, one wake-up: the relay's first pipeline to the hung Redis is the full batch.
    let ids: Vec<String> = client
        .query("SELECT outbox_enqueue('hung', i::text, 'e', '{}')::text FROM generate_series(1, 100) i", &[])
        .unwrap()
        .into_iter()
        .map(|row| row.get(0))
        .collect();
    ledger.lock().unwrap().committed.push(
        ids.into_iter()
            .enumerate()
            .map(|(i, event_id)| LedgerEvent {
                event_id,
                aggregate_type: "hung".into(),
                aggregate_id: (i + 1).to_string(),
            })
            .collect(),
    );
    // Either it sends the batch, or it was still talking to Redis about the first event (the
    // lost-entry check after a write) when Redis hung, timed out there, and now hangs reconnecting:
    // stuck on the hung Redis both ways (the second came in 1 of 3 runs and failed this wait).
    wait_for(DEADLINE, "the relay to send the batch to the hung Redis", || {
        (count(&mut client, "SELECT publishing FROM outbox.stats") == 100
            || env.pg.log().contains("cannot publish to Redis"))
        .then_some(())
    });
    hung
}

/// README: "`outbox.redis_timeout`: connect, read and write timeout; a slower Redis counts as
/// unavailable". A Redis that stops answering must be reported (WARNING, rows back to pending with
/// `last_error`) within a few timeouts, not after one timeout per entry of the pipeline.
#[test]
fn a_hung_redis_counts_as_unavailable_after_the_redis_timeout() {
    let env = Env::start(&["outbox.redis_timeout = '1s'", "outbox.batch_size = 100", "outbox.poll_interval = '100ms'"]);
    let ledger = SharedLedger::default();
    let hung = relay_stuck_on_a_hung_redis(&env, &ledger);
    let mut client = env.pg.connect();
    // Fifteen timeouts' worth: generous for "after the timeout", far below one per entry (100 s).
    let within = Duration::from_secs(15);
    wait_for(within, "the WARNING about the hung Redis (timeout 1 s)", || {
        env.pg.log().contains("cannot publish to Redis").then_some(())
    });
    wait_for(within, "the batch to go back to pending", || {
        (count(&mut client, "SELECT publishing FROM outbox.stats") == 0).then_some(())
    });
    drop(hung);
    check_invariants("hung Redis", &env.pg, &env.redis, &ledger, Expect { duplicates: true });
}

/// docs/worker.md: signals are deferred during a Redis round trip and "served right after, at most
/// `outbox.redis_timeout` later". A fast shutdown must therefore not wait for the relay to go
/// through its whole pipeline against a hung Redis; nothing is lost by it.
#[test]
fn fast_shutdown_is_not_held_up_by_a_hung_redis() {
    let env = Env::start(&["outbox.redis_timeout = '1s'", "outbox.batch_size = 100", "outbox.poll_interval = '100ms'"]);
    let ledger = SharedLedger::default();
    let hung = relay_stuck_on_a_hung_redis(&env, &ledger);
    // Fifteen timeouts' worth again.
    let stopped = env.pg.pg_ctl_stop_within("fast", Duration::from_secs(15));
    drop(hung);
    if let Err(output) = stopped {
        let relay_line = env.pg.log().lines().rfind(|l| l.contains("outbox_pg")).unwrap_or_default().to_string();
        panic!("fast shutdown did not finish within 15 s while Redis hung: {output}\nlast relay line: {relay_line}");
    }
    env.pg.pg_ctl_start();
    check_invariants("shutdown with a hung Redis", &env.pg, &env.redis, &ledger, Expect { duplicates: true });
}

/// A Redis that cannot answer a whole round within `outbox.redis_timeout`: the relay makes its
/// rounds smaller until they fit, instead of sending the same round again for good (found by
/// attack: with a 10 ms timeout, a 9,000-event transaction put 36,000 entries into Redis in 75 s
/// and published nothing, each attempt executed by Redis and then counted as unanswered).
#[test]
fn a_round_redis_cannot_answer_in_time_is_made_smaller_until_it_fits() {
    let env = Env::start(&["outbox.redis_timeout = '10ms'", "outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    // One transaction of 10,000 events of 1 kB: one full round, some 10 MB for Redis to execute.
    client
        .batch_execute(
            "SELECT outbox_enqueue('big', (i % 97)::text, 'e', jsonb_build_object('i', i, 'pad', repeat('x', 1000)))
               FROM generate_series(1, 10000) i",
        )
        .unwrap();
    wait_for(DEADLINE, "all 10,000 events published despite the 10 ms timeout", || {
        (status_counts(&mut client).get("published").copied() == Some(10_000)).then_some(())
    });
    assert!(env.pg.log().contains("the next rounds take at most"), "no round was made smaller:\n{}", env.pg.log());
    // Every event, each aggregate's first occurrences numbered 1, 2, 3, ...; the copies are the
    // rounds that timed out (Redis executed them), each at most half the one before.
    let entries = env.redis.entries("outbox:big");
    let mut first = std::collections::HashSet::new();
    let mut next_seq = std::collections::HashMap::new();
    for entry in &entries {
        if first.insert(entry["event_id"].clone()) {
            let expected = next_seq.entry(entry["aggregate_id"].clone()).or_insert(1);
            assert_eq!(entry["aggregate_seq"].parse::<i64>().unwrap(), *expected, "{entry:?}");
            *expected += 1;
        }
    }
    assert_eq!(first.len(), 10_000);
    eprintln!("{} entries for 10,000 events", entries.len());
}

#[test]
fn redis_out_of_memory_keeps_events_pending_without_dead_letters() {
    let env = Env::start(&["outbox.max_attempts = 2", "outbox.retry_delay = '10ms'", "outbox.poll_interval = '100ms'"]);
    let ledger = SharedLedger::default();
    let producers = Producers::start(env.pg.port, workload(), ledger.clone());
    producers.wait_for_commits(50);
    let mut client = env.pg.connect();
    wait_for(DEADLINE, "some events in Redis", || (env.redis.total_entries() > 0).then_some(()));

    // noeviction and a limit below what Redis already uses: every write answers OOM.
    env.redis.query::<()>(redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg("noeviction"));
    env.redis.query::<()>(redis::cmd("SET").arg("filler").arg("f".repeat(2 << 20)));
    env.redis.query::<()>(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("1mb"));
    assert!(env.redis.used_memory() > 1 << 20);
    let oom_at = count(&mut client, "SELECT coalesce(max(id), 0) FROM outbox.messages");
    // Twice max_attempts rounds against OOM and more, with producers still committing.
    let error = wait_for_failed_rounds(&mut client, 5, "several rounds against OOM");
    assert!(error.contains("OOM"), "{error}");
    let published = count(
        &mut client,
        &format!("SELECT count(*) FROM outbox.messages WHERE id > {oom_at} AND status = 'published'"),
    );
    assert_eq!(published, 0, "an event enqueued after the OOM began was published");
    producers.wait_for_commits(20);
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE status NOT IN ('pending', 'publishing')), sum(rejections),
                    (SELECT failed FROM outbox.stats)
               FROM outbox.messages WHERE id > $1",
            &[&oom_at],
        )
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, Option<i64>>(1), row.get::<_, i64>(2)), (0, Some(0), 0));
    let redis_connected: bool = client.query_one("SELECT redis_connected FROM outbox.stats", &[]).unwrap().get(0);
    let last_error: Option<String> = client.query_one("SELECT last_error FROM outbox.stats", &[]).unwrap().get(0);
    eprintln!("during OOM: redis_connected = {redis_connected}, last_error = {last_error:?}");
    assert!(last_error.is_some_and(|e| e.contains("OOM")));

    env.redis.query::<()>(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0"));
    producers.wait_for_commits(20);
    producers.stop();
    check_invariants("Redis OOM", &env.pg, &env.redis, &ledger, Expect { duplicates: false });
    assert_eq!(count(&mut client, "SELECT sum(rejections) FROM outbox.messages"), 0);
}

/// Redis crossing its memory limit back and forth while the relay's pipelines are being executed.
/// Redis reads a big pipeline in 16 KB pieces and serves other clients in between, so an XADD
/// refused with OOM can be followed, in the same pipeline, by a later event of the same aggregate
/// that Redis accepts (the limit moved, or memory was freed). OOM is a Redis-wide failure: the
/// relay must not let that later event overtake the refused one.
#[test]
fn redis_flapping_at_its_memory_limit_keeps_per_aggregate_order() {
    let env = Env::start(&["outbox.poll_interval = '50ms'", "outbox.enabled = off", "outbox.batch_size = 300"]);
    env.redis.query::<()>(redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg("noeviction"));
    let ledger = SharedLedger::default();
    // Few aggregates and large payloads: each pipeline (300 events, about 600 KB) carries many
    // events of every aggregate and takes Redis several reads.
    let load = Workload {
        producers: 2,
        aggregate_types: vec!["flap"],
        aggregates_per_type: 3,
        max_events_per_txn: 8,
        rollback_percent: 0,
        payload_padding: 2_000,
        pause: Duration::from_millis(20),
        max_txns: 1_500,
        ..Workload::default()
    };
    let producers = Producers::start(env.pg.port, load, ledger.clone());
    let mut client = env.pg.connect();
    wait_for(DEADLINE, "a backlog", || (count(&mut client, "SELECT pending FROM outbox.stats") >= 600).then_some(()));

    // Another client moves the limit below and above the memory in use, again and again, while
    // the relay works through the backlog.
    let stop = Arc::new(AtomicBool::new(false));
    let flapper = {
        let stop = stop.clone();
        let mut redis = env.redis.connection();
        std::thread::spawn(move || {
            let mut rng = Rng::new(7);
            let mut flips = 0;
            while !stop.load(Ordering::SeqCst) {
                for limit in ["1", "0"] {
                    if redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(limit).query::<()>(&mut redis).is_err() {
                        return flips; // Redis is gone: the test failed and is tearing down
                    }
                    std::thread::sleep(Duration::from_micros(50 + rng.below(400)));
                }
                flips += 1;
            }
            flips
        })
    };
    env.pg.set(&mut client, &[("outbox.enabled", "on")]);
    // Wait for many rounds that ran into OOM.
    let oom_rounds = scale(5, 10);
    wait_for_failed_rounds(&mut client, oom_rounds, "the relay to run into OOM several times");
    stop.store(true, Ordering::SeqCst);
    let flips = flapper.join().unwrap();
    producers.wait_for_commits(20);
    producers.stop();
    eprintln!("maxmemory flipped {flips} times; at least {oom_rounds} rounds ran into OOM");
    check_invariants("Redis OOM flapping", &env.pg, &env.redis, &ledger, Expect { duplicates: false });
}

#[test]
fn paused_relay_raises_the_age_alert_and_drains_in_order_when_resumed() {
    let env = Env::start(&["outbox.alert_age = '1s'", "outbox.poll_interval = '100ms'"]);
    let ledger = SharedLedger::default();
    let producers = Producers::start(env.pg.port, workload(), ledger.clone());
    producers.wait_for_commits(20);
    let mut client = env.pg.connect();
    env.pg.set(&mut client, &[("outbox.enabled", "off")]);
    wait_for(DEADLINE, "the relay to pause", || env.pg.log().contains("outbox.enabled is off").then_some(()));
    let frozen = env.redis.total_entries();
    let warning = wait_for(DEADLINE, "the age WARNING", || {
        env.pg.log().lines().find(|l| l.contains("WARNING") && l.contains("oldest pending event")).map(str::to_string)
    });
    eprintln!("{warning}");
    assert!(warning.contains("paused"), "{warning}");
    assert_eq!(env.redis.total_entries(), frozen, "a paused relay published");
    let waiting = count(&mut client, "SELECT pending FROM outbox.stats");
    assert!(waiting > 0);
    env.pg.set(&mut client, &[("outbox.enabled", "on")]);
    producers.wait_for_commits(20);
    producers.stop();
    // (With producers still running, a heavy run may keep the oldest event above 1 s.)
    wait_for(DEADLINE, "the alert to clear", || env.pg.log().contains("alert cleared").then_some(()));
    eprintln!("backlog when resumed: {waiting} events");
    check_invariants("paused relay", &env.pg, &env.redis, &ledger, Expect { duplicates: false });
}

/// A standby runs no launcher and no relay (they start only once recovery has finished).
fn assert_no_outbox_workers(standby: &mut postgres::Client) {
    let workers = count(standby, "SELECT count(*) FROM pg_stat_activity WHERE backend_type LIKE 'outbox_pg%'");
    assert_eq!(workers, 0, "an outbox_pg worker runs on the standby");
}

#[test]
fn promoted_hot_standby_relays_what_the_old_primary_committed() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let ledger = SharedLedger::default();
    let producers = Producers::start(env.pg.port, workload(), ledger.clone());
    producers.wait_for_commits(20);
    // Some events are published by the primary, then it stops relaying: the rest stay pending.
    wait_for(DEADLINE, "the primary to publish", || (env.redis.total_entries() > 0).then_some(()));
    let mut primary = env.pg.connect();
    env.pg.set(&mut primary, &[("outbox.enabled", "off")]);
    wait_for(DEADLINE, "the primary's relay to pause", || env.pg.log().contains("outbox.enabled is off").then_some(()));
    let published_by_primary = env.redis.total_entries();

    // A standby made under write load; it replays the outbox but runs no outbox_pg worker.
    let standby = env.pg.standby();
    let mut replica = standby.connect();
    assert!(standby.in_recovery(&mut replica));
    assert_no_outbox_workers(&mut replica);
    let err = replica.query_one("SELECT outbox_enqueue('standby', 1, 'e', '{}')", &[]).unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::READ_ONLY_SQL_TRANSACTION), "{err}");
    producers.wait_for_commits(50);
    wait_for(DEADLINE, "pending events replayed on the standby", || {
        assert_no_outbox_workers(&mut replica);
        (count(&mut replica, "SELECT count(*) FROM outbox.messages WHERE status = 'pending'") > 0).then_some(())
    });
    producers.stop();
    env.pg.wait_replayed_by(&standby);
    assert_no_outbox_workers(&mut replica);
    let pending_on_primary = count(&mut primary, "SELECT pending FROM outbox.stats");
    drop(primary);

    // Fail over: the primary dies, the standby is promoted and relays from there.
    env.pg.pg_ctl_stop("immediate");
    drop(replica);
    standby.promote();
    let mut promoted = standby.connect();
    standby.set(&mut promoted, &[("outbox.enabled", "on")]);
    standby.relay_pid(&mut promoted);
    assert_eq!(
        count(&mut promoted, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_pg launcher'"),
        1
    );
    // And it takes new events.
    let more = Producers::start(standby.port, Workload { max_txns: 30, ..workload() }, ledger.clone());
    more.wait_for_commits(20);
    more.stop();
    eprintln!("primary published {published_by_primary} entries and left {pending_on_primary} pending");
    check_invariants("promoted standby", &standby, &env.redis, &ledger, Expect { duplicates: false });
}

/// Failover to a synchronous standby while the primary's relay is mid-drain: every commit the
/// producers saw acknowledged is on the standby. The relay commits asynchronously, so its latest
/// marks may or may not have reached the standby. A relay's claim lives in the primary's shared
/// memory, so the rows it was publishing are pending on the standby, and the promoted server's
/// relay publishes them again (duplicates, never a loss).
#[test]
fn failover_to_a_synchronous_standby_while_the_primary_relay_is_mid_drain() {
    let env = Env::start(&["outbox.batch_size = 20", "outbox.poll_interval = '100ms'"]);
    // Made before the primary requires a synchronous standby, so it does not inherit the setting.
    let standby = env.pg.standby();
    let mut primary = env.pg.connect();
    env.pg.set(&mut primary, &[("synchronous_standby_names", "*")]);
    wait_for(DEADLINE, "synchronous replication", || {
        primary.query_opt("SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync'", &[]).unwrap().map(|_| ())
    });
    drop(primary);
    let ledger = SharedLedger::default();
    let producers = Producers::start(env.pg.port, workload(), ledger.clone());
    producers.wait_for_commits(20);
    let (relay, grown) = mid_drain(&env.pg, &env.redis, backlog());
    env.pg.pg_ctl_stop("immediate");

    let mut replica = standby.connect();
    assert_no_outbox_workers(&mut replica);
    let pending = count(&mut replica, "SELECT count(*) FROM outbox.messages WHERE status = 'pending'");
    let claimed = count(&mut replica, "SELECT count(*) FROM outbox.shards WHERE claimed_by IS NOT NULL");
    eprintln!("shards held by the old primary's relay, on the standby: {claimed} (taken over after promotion)");
    drop(replica);
    standby.promote();
    producers.stop();
    let mut promoted = standby.connect();
    standby.relay_pid(&mut promoted);
    let more = Producers::start(standby.port, Workload { max_txns: 30, ..workload() }, ledger.clone());
    more.wait_for_commits(20);
    more.stop();
    eprintln!("primary killed with relay {relay} mid-drain ({grown} entries in); {pending} rows were pending");
    check_invariants("failover mid-drain", &standby, &env.redis, &ledger, Expect { duplicates: true });
}

/// The pid of relay `slot` (its process title is `postgres: outbox_pg relay <slot>`).
fn relay_in_slot(pg: &Cluster, client: &mut postgres::Client, slot: usize) -> i32 {
    wait_for(DEADLINE, &format!("relay {slot}"), || {
        pg.backend_pids(client, "outbox_pg relay").into_iter().find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|title| String::from_utf8_lossy(&title).contains(&format!("outbox_pg relay {slot} ")))
        })
    })
}

/// What the relays are doing, for failure messages.
fn relay_activity(client: &mut postgres::Client) -> String {
    client
        .query(
            "SELECT pid, state, wait_event_type, wait_event, xact_start IS NOT NULL, pg_blocking_pids(pid)::text,
                    left(query, 60)
               FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay' ORDER BY pid",
            &[],
        )
        .unwrap()
        .into_iter()
        .map(|r| {
            format!(
                "  pid {} state {:?} waiting {:?}/{:?} in transaction {} blocked by {} query {:?}",
                r.get::<_, i32>(0),
                r.get::<_, Option<String>>(1),
                r.get::<_, Option<String>>(2),
                r.get::<_, Option<String>>(3),
                r.get::<_, bool>(4),
                r.get::<_, String>(5),
                r.get::<_, Option<String>>(6)
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A process stopped with SIGSTOP, resumed when dropped (also when the test fails) and in any
/// case by a watchdog after `at_most`, so that a test can never hang on it.
struct Stopped {
    pid: i32,
    resumed: Arc<AtomicBool>,
}

impl Stopped {
    fn stop(pid: i32, at_most: Duration) -> Stopped {
        // SAFETY: kill(2) on a relay pid looked up in pg_stat_activity.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        let resumed = Arc::new(AtomicBool::new(false));
        let watchdog = resumed.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + at_most;
            while Instant::now() < deadline && !watchdog.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
            }
            if !watchdog.swap(true, Ordering::SeqCst) {
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGCONT) };
            }
        });
        Stopped { pid, resumed }
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if !self.resumed.swap(true, Ordering::SeqCst) {
            // SAFETY: as above.
            unsafe { libc::kill(self.pid, libc::SIGCONT) };
        }
    }
}

/// One of two relays hangs (SIGSTOP) while it holds a claim. The other relay keeps publishing; the
/// hung relay's claim must be ignored after `outbox.lease` (README) so that its aggregates are not
/// stuck behind it, and every event is delivered while it is still hung. When it wakes up, its
/// stale batch may add duplicates, never reorder.
fn hung_relay_scenario(slot: usize) {
    let env = Env::start(&[
        "outbox.workers = 2",
        "outbox.lease = '2s'",
        "outbox.batch_size = 20",
        "outbox.poll_interval = '100ms'",
        "outbox.alert_age = '3s'",
    ]);
    let mut client = env.pg.connect();
    let hung = relay_in_slot(&env.pg, &mut client, slot);
    relay_in_slot(&env.pg, &mut client, 1 - slot);
    let ledger = SharedLedger::default();
    let producers = Producers::start(env.pg.port, workload(), ledger.clone());
    producers.wait_for_commits(20);
    // Stop the relay at a moment it holds claims, outside any transaction: a process frozen inside
    // one may hold locks, even buffer content locks, that freeze PostgreSQL itself (plain SELECTs
    // included), which no lease can help with. A relay publishing to Redis holds none.
    let (stopped, held) = wait_for(DEADLINE, &format!("relay {slot} to be stopped holding claims"), || {
        mid_drain(&env.pg, &env.redis, backlog());
        let stopped = Stopped::stop(hung, Duration::from_secs(45));
        let outside: bool = client
            .query_one("SELECT xact_start IS NULL FROM pg_stat_activity WHERE pid = $1", &[&hung])
            .unwrap()
            .get(0);
        if !outside {
            return None;
        }
        let held: i64 = client
            .query_one("SELECT coalesce(sum(claimed), 0)::bigint FROM outbox.relays() WHERE pid = $1", &[&hung])
            .unwrap()
            .get(0);
        (held > 0).then_some((stopped, held))
    });
    producers.wait_for_commits(20);
    producers.stop();
    // Everything is delivered while it is still hung: its claim expires and the other relay
    // publishes those events again.
    let expired = format!("relay {slot} has held its claim of {held} events");
    wait_for(Duration::from_secs(20), &format!("relay {slot}'s claim to expire (lease 2 s)"), || {
        env.pg.log().contains(&expired).then_some(())
    });
    let listed: bool =
        client.query_one("SELECT claim_expired FROM outbox.relays() WHERE pid = $1", &[&hung]).unwrap().get(0);
    assert!(
        listed,
        "outbox.relays() shows the hung relay's claim as expired; relays:\n{}",
        relay_activity(&mut client)
    );
    wait_drained(&mut client);
    drop(stopped);
    eprintln!("relay {slot} (pid {hung}) hung holding {held} claims");
    check_invariants(&format!("hung relay {slot}"), &env.pg, &env.redis, &ledger, Expect { duplicates: true });
}

#[test]
fn claims_of_a_hung_second_relay_are_returned_after_the_lease() {
    hung_relay_scenario(1);
}

#[test]
fn claims_of_a_hung_first_relay_are_returned_after_the_lease() {
    hung_relay_scenario(0);
}

#[test]
fn an_aggregate_whose_stream_redis_rejects_holds_back_only_itself() {
    let env = Env::start(&["outbox.max_attempts = 3", "outbox.retry_delay = '20ms'", "outbox.poll_interval = '100ms'"]);
    env.redis.query::<()>(redis::cmd("SET").arg("poisoned").arg("not a stream"));
    let ledger = SharedLedger::default();
    let producers = Producers::start(env.pg.port, workload(), ledger.clone());
    let mut client = env.pg.connect();
    for _ in 0..5 {
        enqueue_recorded(&mut client, &ledger, "bad", "1", Some("poisoned"));
        producers.wait_for_commits(10);
    }
    producers.wait_for_commits(20);
    producers.stop();
    // Everything else is delivered; the bad aggregate's head is dead-lettered, its tail waits.
    wait_for(DEADLINE, "all but the poisoned aggregate delivered", || {
        let row = client
            .query_one(
                "SELECT count(*) FILTER (WHERE aggregate_type <> 'bad' AND status <> 'published'),
                        count(*) FILTER (WHERE aggregate_type = 'bad' AND status = 'failed'),
                        count(*) FILTER (WHERE aggregate_type = 'bad' AND status = 'pending')
                   FROM outbox.messages",
                &[],
            )
            .unwrap();
        ((row.get::<_, i64>(0), row.get::<_, i64>(1), row.get::<_, i64>(2)) == (0, 1, 4)).then_some(())
    });
    let head: (i64, i32, String) = client
        .query_one("SELECT aggregate_seq, rejections, last_error FROM outbox.messages WHERE status = 'failed'", &[])
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .unwrap();
    assert_eq!((head.0, head.1), (1, 3));
    assert!(head.2.contains("WRONGTYPE"), "{}", head.2);
    // While it is stuck, every other committed event is in Redis already.
    let delivered: std::collections::HashSet<String> = env
        .redis
        .stream_keys()
        .iter()
        .flat_map(|stream| env.redis.entries(stream))
        .map(|entry| entry["event_id"].clone())
        .collect();
    let missing: Vec<String> = ledger
        .lock()
        .unwrap()
        .committed
        .iter()
        .flatten()
        .filter(|e| e.aggregate_type != "bad" && !delivered.contains(&e.event_id))
        .map(|e| e.event_id.clone())
        .collect();
    assert!(missing.is_empty(), "held up by the poisoned aggregate: {missing:?}");
    // Repaired, the poisoned aggregate follows, in order; then the whole check.
    env.redis.query::<()>(redis::cmd("DEL").arg("poisoned"));
    assert_eq!(count(&mut client, "SELECT outbox.retry_failed()"), 1);
    check_invariants("WRONGTYPE on one aggregate", &env.pg, &env.redis, &ledger, Expect { duplicates: false });
}

fn refused(client: &mut postgres::Client, sql: &str, params: &[&(dyn postgres::types::ToSql + Sync)], code: &SqlState) {
    let err = client.query(sql, params).expect_err(sql);
    assert_eq!(err.code(), Some(code), "{sql}: {err}");
}

#[test]
fn bad_input_is_refused_and_leaves_the_relay_working() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let ledger = SharedLedger::default();

    // Odd but valid stream names: delivered to exactly that key, nothing substituted or trimmed.
    let long_name = format!("{}✓", "k".repeat(509)); // 512 bytes
    let odd: Vec<&str> = vec![
        "with space",
        "{braces}",
        "x:{aggregate_type}:{event_type}",
        "new\nline",
        "tab\tand\r\ncrlf",
        "*",
        "$",
        "ünïcödé ✓ 🚀",
        "quote'\"\\",
        &long_name,
    ];
    let mut odd_ids = Vec::new();
    for (i, name) in odd.iter().enumerate() {
        odd_ids.push(enqueue_recorded(&mut client, &ledger, "odd", &i.to_string(), Some(name)));
    }
    for (name, id) in odd.iter().zip(&odd_ids) {
        let entries = env.redis.wait_for_entries(name, 1);
        assert_eq!(entries.len(), 1, "{name:?}");
        assert_eq!(&entries[0]["event_id"], id, "{name:?}");
    }

    // Refused, with nothing inserted: too long, empty, or blank (a padded unset variable, not a
    // key anyone means).
    let ten_kb = "s".repeat(10 * 1024);
    let just_over = format!("{}✓", "k".repeat(510)); // 513 bytes
    let enqueue_to = "SELECT outbox_enqueue('bad', 1, 'e', '{}', NULL, $1)";
    for stream in [ten_kb.as_str(), just_over.as_str(), "", "  "] {
        refused(&mut client, enqueue_to, &[&stream], &SqlState::INVALID_PARAMETER_VALUE);
    }
    for headers in ["[1, 2]", "\"text\"", "42", "null", "true"] {
        refused(
            &mut client,
            "SELECT outbox_enqueue('bad', 1, 'e', '{}', $1::text::jsonb)",
            &[&headers],
            &SqlState::INVALID_PARAMETER_VALUE,
        );
    }
    for empty in [
        "SELECT outbox_enqueue('', 1, 'e', '{}')",
        "SELECT outbox_enqueue('bad', '', 'e', '{}')",
        "SELECT outbox_enqueue('bad', 1, '', '{}')",
    ] {
        refused(&mut client, empty, &[], &SqlState::INVALID_PARAMETER_VALUE);
    }
    for nulls in [
        "SELECT outbox_enqueue(NULL::text, 1, 'e', '{}')",
        "SELECT outbox_enqueue('bad', NULL::text, 'e', '{}')",
        "SELECT outbox_enqueue('bad', NULL::bigint, 'e', '{}')",
        "SELECT outbox_enqueue('bad', NULL::uuid, 'e', '{}')",
        "SELECT outbox_enqueue('bad', 1, NULL::text, '{}')",
        "SELECT outbox_enqueue('bad', 1, 'e', NULL::jsonb)",
    ] {
        refused(&mut client, nulls, &[], &SqlState::NULL_VALUE_NOT_ALLOWED);
    }
    // Payloads over outbox.max_payload_size (1MB by default; superusers may lower it per session).
    refused(
        &mut client,
        "SELECT outbox_enqueue('bad', 1, 'e', jsonb_build_object('blob', repeat('x', 1100000)))",
        &[],
        &SqlState::PROGRAM_LIMIT_EXCEEDED,
    );
    client.batch_execute("SET outbox.max_payload_size = '1kB'").unwrap();
    refused(
        &mut client,
        "SELECT outbox_enqueue('bad', 1, 'e', jsonb_build_object('blob', repeat('x', 2000)))",
        &[],
        &SqlState::PROGRAM_LIMIT_EXCEEDED,
    );
    client.batch_execute("RESET outbox.max_payload_size").unwrap();
    // A failed enqueue inside a transaction aborts it; the events before it never existed.
    {
        let mut tx = client.transaction().unwrap();
        tx.query_one("SELECT outbox_enqueue('bad', 1, 'e', '{}')", &[]).unwrap();
        assert!(tx.query_one("SELECT outbox_enqueue('bad', 1, 'e', '{}', '[]')", &[]).is_err());
        // COMMIT of an aborted transaction is answered with ROLLBACK; the checker finds no trace of it.
        let _ = tx.commit();
    }

    // Roles: without the grant nobody enqueues, claims, reads or repairs; a writer only enqueues.
    client.batch_execute("CREATE ROLE intruder LOGIN; CREATE ROLE app LOGIN; GRANT outbox_writer TO app").unwrap();
    let connect_as = |role: &str| {
        postgres::Client::connect(
            &format!("host=127.0.0.1 port={} user={role} dbname=postgres", env.pg.port),
            postgres::NoTls,
        )
        .unwrap()
    };
    let mut intruder = connect_as("intruder");
    let denied = SqlState::INSUFFICIENT_PRIVILEGE;
    for sql in [
        "SELECT outbox_enqueue('bad', 1, 'e', '{}')",
        "SELECT outbox_enqueue('bad', 1::bigint, 'e', '{}')",
        "SELECT outbox_enqueue('bad', gen_random_uuid(), 'e', '{}')",
        "SELECT * FROM outbox.messages",
        "SELECT * FROM outbox._claim_shards(1, 16, 1000)",
        "SELECT outbox._advance(1, '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}')",
        "SELECT outbox.retry_failed()",
        "SELECT outbox.purge('0')",
        "INSERT INTO outbox.events_0 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, created_at)
         VALUES (pg_current_xact_id(), 0, 1, gen_random_uuid(), 'bad', '1', 'e', '{}', now())",
    ] {
        refused(&mut intruder, sql, &[], &denied);
    }
    let mut app = connect_as("app");
    let app_event: String = app.query_one("SELECT outbox_enqueue('app', 1, 'e', '{}')::text", &[]).unwrap().get(0);
    ledger.lock().unwrap().committed.push(vec![LedgerEvent {
        event_id: app_event,
        aggregate_type: "app".into(),
        aggregate_id: "1".into(),
    }]);
    for sql in [
        "SELECT * FROM outbox.messages",
        "SELECT * FROM outbox._claim_shards(1, 16, 1000)",
        "UPDATE outbox.shards SET cursor = cursor",
    ] {
        refused(&mut app, sql, &[], &denied);
    }

    // After all that the relay still delivers, and the table holds exactly the accepted events.
    enqueue_recorded(&mut client, &ledger, "normal", "1", None);
    env.redis.wait_for_entries("outbox:normal", 1);
    wait_drained(&mut client);
    let counts = status_counts(&mut client);
    assert_eq!(counts.len(), 1, "{counts:?}");
    assert_eq!(counts.get("published"), Some(&(odd.len() as i64 + 2)), "{counts:?}");
    check_invariants("bad input", &env.pg, &env.redis, &ledger, Expect { duplicates: false });
}

#[test]
fn broken_settings_warn_once_never_crash_loop_and_recover_when_fixed() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let secured = Redis::start_with(&["--requirepass", "right-pw"]);
    let mut client = env.pg.connect();
    let ledger = SharedLedger::default();

    // Out-of-range and malformed values are refused by ALTER SYSTEM itself.
    for (name, value) in [
        ("outbox.batch_size", "-5"),
        ("outbox.batch_size", "0"),
        ("outbox.batch_size", "1000000"),
        ("outbox.lease", "'1ms'"),
        ("outbox.poll_interval", "'1ms'"),
        ("outbox.redis_timeout", "'0'"),
        ("outbox.max_attempts", "0"),
        ("outbox.workers", "0"),
        ("outbox.ordering", "'random'"),
        ("outbox.enabled", "'maybe'"),
        ("outbox.fault_injection", "'explode'"),
    ] {
        let sql = format!("ALTER SYSTEM SET {name} = {value}");
        let err = client.batch_execute(&sql).expect_err(&sql);
        assert_eq!(err.code(), Some(&SqlState::INVALID_PARAMETER_VALUE), "{sql}: {err}");
    }
    client.batch_execute("SELECT pg_reload_conf()").unwrap();
    let batch_size: String = client.query_one("SHOW outbox.batch_size", &[]).unwrap().get(0);
    assert_eq!(batch_size, "100");

    let relay = env.pg.relay_pid(&mut client);
    let launcher = env.pg.backend_pids(&mut client, "outbox_pg launcher");
    let wrong_password = format!("redis://:wrong-pw@127.0.0.1:{}", secured.port);
    let cases = [
        ("not a Redis scheme", "http://x"),
        ("unparsable", "redis://[bad"),
        ("unreachable", "redis://127.0.0.1:1"),
        ("wrong password", wrong_password.as_str()),
    ];
    for (i, (what, url)) in cases.iter().enumerate() {
        // Paused first, so that the relay reads the bad URL before it sees the events.
        env.pg.set(&mut client, &[("outbox.enabled", "off")]);
        wait_for(DEADLINE, "the relay to pause", || (log_count(&env.pg, "outbox.enabled is off") > i).then_some(()));
        let first = count(&mut client, "SELECT coalesce(max(id), 0) + 1 FROM outbox.messages");
        for n in 0..5 {
            enqueue_recorded(&mut client, &ledger, "settings", &format!("{i}-{n}"), None);
        }
        env.pg.set(&mut client, &[("outbox.redis_url", url), ("outbox.enabled", "on")]);
        let warning = wait_for(DEADLINE, &format!("the WARNING for the {what} URL"), || {
            let log = env.pg.log();
            let lines: Vec<&str> = log.lines().filter(|l| l.contains("cannot publish to Redis")).collect();
            (lines.len() > i).then(|| lines[lines.len() - 1].to_string())
        });
        assert!(warning.contains("WARNING"), "{warning}");
        assert!(!warning.contains("wrong-pw"), "the password reached the log: {warning}");
        // No crash loop: the same relay retries, with backoff, several times.
        wait_for_failed_rounds(&mut client, 6, &format!("retries against the {what} URL"));
        assert_eq!(env.pg.backend_pids(&mut client, "outbox_pg relay"), vec![relay], "the relay was replaced");
        let row = client
            .query_one(
                "SELECT count(*) FILTER (WHERE status = 'pending'), sum(rejections)
                   FROM outbox.messages WHERE id >= $1",
                &[&first],
            )
            .unwrap();
        assert_eq!((row.get::<_, i64>(0), row.get::<_, Option<i64>>(1)), (5, Some(0)));
        assert_eq!(count(&mut client, "SELECT failed FROM outbox.stats"), 0);
        assert_eq!(log_count(&env.pg, "cannot publish to Redis"), i + 1, "one WARNING per failure state");
        eprintln!("{what}: {warning}");

        // Fixed: everything is delivered, and the recovery is logged once.
        env.pg.set(&mut client, &[("outbox.redis_url", &env.redis.url())]);
        wait_for(DEADLINE, "delivery after the URL was fixed", || {
            (count(&mut client, "SELECT count(*) FROM outbox.messages WHERE status <> 'published'") == 0).then_some(())
        });
        // The recovery line is logged after the round's finish committed, so it may follow the
        // delivery by a moment.
        wait_for(DEADLINE, "the recovery LOG line", || {
            (log_count(&env.pg, "publishing to Redis at") > i).then_some(())
        });
        assert_eq!(log_count(&env.pg, "publishing to Redis at"), i + 1);
        assert_eq!(log_count(&env.pg, "cannot publish to Redis"), i + 1);
    }
    assert_eq!(env.pg.relay_pid(&mut client), relay);
    assert_eq!(env.pg.backend_pids(&mut client, "outbox_pg launcher"), launcher);
    assert!(!env.pg.log().contains("terminated by signal"), "a worker crashed");
    assert!(!env.pg.log().contains("exited with exit code"), "a worker exited");
    assert_eq!(secured.total_entries(), 0);
    check_invariants("broken settings", &env.pg, &env.redis, &ledger, Expect { duplicates: false });
}

/// Issue 23, item 4b: with two relays, one hung (SIGSTOP) and the survivor freed its shards once
/// its lease expired, but kept claiming only its share of 8 (16 shards over two relays, the hung
/// one still counted): events of the other 8 shards waited until the hung relay woke. A relay that
/// has not gone round its loop for a lease stops counting, so the survivor takes all 16, and a
/// burst on every shard arrives while the other is still frozen.
#[test]
fn a_hung_relay_loses_all_its_shards_and_a_burst_on_every_shard_arrives_while_it_is_frozen() {
    let env = Env::start(&["outbox.workers = 2", "outbox.lease = '2s'", "outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let hung = relay_in_slot(&env.pg, &mut client, 1);
    let survivor = relay_in_slot(&env.pg, &mut client, 0);
    wait_for(DEADLINE, "both relays to hold shards", || {
        let holders: i64 = client
            .query_one("SELECT count(DISTINCT claimed_by) FROM outbox.shards WHERE claimed_by IS NOT NULL", &[])
            .unwrap()
            .get(0);
        (holders == 2).then_some(())
    });
    // Frozen outside any transaction (see hung_relay_scenario).
    let stopped = wait_for(DEADLINE, "the relay to be stopped outside a transaction", || {
        let stopped = Stopped::stop(hung, Duration::from_secs(50));
        let outside: bool = client
            .query_one("SELECT xact_start IS NULL FROM pg_stat_activity WHERE pid = $1", &[&hung])
            .unwrap()
            .get(0);
        outside.then_some(stopped)
    });
    wait_for(Duration::from_secs(30), "the survivor to hold all 16 shards", || {
        let held: i64 =
            client.query_one("SELECT count(*) FROM outbox.shards WHERE claimed_by = $1", &[&survivor]).unwrap().get(0);
        (held == 16).then_some(())
    });
    // A burst on every shard, delivered while the hung relay is frozen.
    let ids: Vec<String> = client
        .query(
            "SELECT DISTINCT ON (tests.shard_of('burst', i::text)) i::text FROM generate_series(1, 1000) i
              ORDER BY tests.shard_of('burst', i::text), i",
            &[],
        )
        .unwrap()
        .into_iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(ids.len(), 16);
    for id in &ids {
        client.execute("SELECT outbox_enqueue('burst', $1, 'e', '{}')", &[id]).unwrap();
    }
    env.redis.wait_for_entries("outbox:burst", 16);
    assert!(!stopped.resumed.load(Ordering::SeqCst), "delivered only after the hung relay was resumed");
    drop(stopped);
    // Awake again, it counts again: the shards are shared out once more.
    wait_for(DEADLINE, "the woken relay to take its share back", || {
        let held: i64 =
            client.query_one("SELECT count(*) FROM outbox.shards WHERE claimed_by = $1", &[&hung]).unwrap().get(0);
        (held == 8).then_some(())
    });
}

/// Whether process `pid` has exited (gone, or a zombie nobody reaped yet).
fn exited(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit_once(')').is_none_or(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// The processes whose parent is `parent`, from /proc.
fn children_of(parent: i32) -> Vec<i32> {
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // "pid (comm) state ppid ...": the comm may hold blanks, so split after its ')'.
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok());
        if ppid == Some(parent) {
            children.push(pid);
        }
    }
    children
}

#[test]
fn a_relay_orphaned_by_a_killed_postmaster_stops_publishing_at_once() {
    // PostgreSQL reports the postmaster's death to a worker through its latch wait, and a drain
    // never waits: an orphaned relay went on draining, rounds whose finishes (asynchronous commits,
    // no WAL writer left) the restarted server never saw, so all of them were published again.
    let env = Env::start(&["outbox.batch_size = 20", "outbox.poll_interval = '100ms'"]);
    let ledger = SharedLedger::default();
    let mut client = env.pg.connect();
    env.pg.set(&mut client, &[("outbox.enabled", "off")]);
    // Ten rounds' worth at least (a round takes up to 10,000 events).
    let backlog = 200_000usize;
    for _ in 0..4 {
        let mut txn = client.transaction().unwrap();
        let events = txn
            .query(
                "SELECT outbox_enqueue('orphan', (i % 50)::text, 'scenario.event', '{}')::text, (i % 50)::text
                   FROM generate_series(1, $1) i",
                &[&(backlog as i32 / 4)],
            )
            .unwrap()
            .iter()
            .map(|row| LedgerEvent {
                event_id: row.get(0),
                aggregate_type: "orphan".to_string(),
                aggregate_id: row.get(1),
            })
            .collect();
        txn.commit().unwrap();
        ledger.lock().unwrap().committed.push(events);
    }
    let relay = wait_for(DEADLINE, "a relay", || env.pg.backend_pids(&mut client, "outbox_pg relay").first().copied());
    let before = env.redis.total_entries();
    env.pg.set(&mut client, &[("outbox.enabled", "on")]);
    poll_fast("the relay to start draining the backlog", || (env.redis.total_entries() > before).then_some(()));
    let postmaster: i32 = std::fs::read_to_string(env.pg.data.join("postmaster.pid"))
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let children = children_of(postmaster);
    assert!(children.contains(&relay), "the relay {relay} is a child of the postmaster {postmaster}: {children:?}");
    drop(client);
    env.pg.kill_9(postmaster);
    wait_for(DEADLINE, "the orphaned relay to exit", || exited(relay).then_some(()));
    let published = env.redis.total_entries() - before;
    // The relay stops within a round or two of 10,000 events, where it used to drain the whole
    // backlog.
    assert!(
        published < backlog / 2,
        "the orphaned relay published {published} of the {backlog} backlog's events after the postmaster died"
    );
    // The new postmaster refuses to start while the old one's pid is still a process (a zombie
    // not reaped yet counts) or a process still uses its shared memory.
    wait_for(DEADLINE, "every orphaned server process to exit", || {
        (children.iter().all(|&pid| exited(pid)) && !std::path::Path::new(&format!("/proc/{postmaster}")).exists())
            .then_some(())
    });
    env.pg.pg_ctl_start();
    let mut client = env.pg.connect_eventually();
    wait_drained(&mut client);
    check_invariants("postmaster killed mid-drain", &env.pg, &env.redis, &ledger, Expect { duplicates: true });
}
