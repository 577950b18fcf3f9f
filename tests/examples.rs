//! The consumer examples (examples/typescript, examples/python) run as their users run them: their
//! dependencies installed from the committed lock files, each consumer a child process against a
//! private PostgreSQL with outbox_pg and a private redis-server.
//!
//! The story, per language: a few hundred events over a dozen aggregates, and a poison event
//! (its handler always fails) at the head of an aggregate of its own. Consumer `a` is killed
//! (SIGKILL) mid-batch, inside an event's transaction: the test holds that event's dedup mark in
//! an open transaction of its own, so `a` waits there, deterministically. Consumer `b` takes `a`'s
//! entries over with XAUTOCLAIM, is killed the same way further on, and is started again under
//! its name, so that it resumes its own entries. Then: every event applied exactly once (the
//! `activity` table, the effect committed with the mark), in aggregate_seq order per aggregate,
//! with the entry's fields; the poison event on the dead-letter stream after MAX_DELIVERIES
//! deliveries, its aggregate's later events applied (a gap reported); a replay and a copy with an
//! unknown field absorbed as duplicates; a malformed entry dead-lettered at once; a clean SIGTERM.
//!
//! Some events are enqueued in a trace (issue 28), its W3C traceparent in their headers or in
//! `outbox.traceparent` for the transaction: each consumer exports its spans (OTEL_EXPORT_FILE), and
//! the span that processed such an event continues the enqueuer's trace, its parent the enqueuer's
//! span; the others are roots. A second, smaller story runs each example against a cluster with
//! `outbox.entry_format = cloudevents`: the same events as CloudEvents, applied once, in order, the
//! trace continued.
//!
//! `--delete-acked` (issue 38): on Redis 8.2 or later, with the relay trimming by acknowledgement,
//! each example acknowledges with `XACKDEL ... ACKED`, so an entry goes once every group has
//! acknowledged it and stays while another group has not; on an older Redis the same consumer
//! falls back to XACK, processes every event and deletes nothing. CI runs this file on both.

mod common;

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use common::{wait_for, Cluster, Env, Redis, DEADLINE};

const STREAM: &str = "outbox:order";
const DEAD_LETTERS: &str = "outbox:order:dead";
const GROUP: &str = "activity";
/// Events of the aggregates `order/o-0` .. `order/o-11`, beside the three of `order/poison`.
const EVENTS: usize = 300;
const AGGREGATES: usize = 12;
const BATCH: usize = 50;
const MAX_DELIVERIES: u32 = 3;
const CLAIM_IDLE_MS: u64 = 1000;
/// Where `a` and `b` stop, by stream position: in the middle of a batch of BATCH, so that each
/// leaves entries it read and never handled.
const FIRST_STOP: usize = 120;
const SECOND_STOP: usize = 230;
const REPLAYED: usize = 40;
/// A mark the test commits first: the consumer name then belongs to the test's role, as it does
/// to the consumers' (both are `postgres`), and the marks held later block nobody else.
const NIL_UUID: &str = "00000000-0000-0000-0000-000000000000";

/// How to start an example's consumer, its dependencies installed and built once per test binary
/// (the scenarios of one language run in parallel and share them).
struct Example {
    program: String,
    args: Vec<PathBuf>,
    env: Vec<(&'static str, PathBuf)>,
}

impl Example {
    fn command(&self) -> Command {
        let mut command = Command::new(&self.program);
        command.args(&self.args);
        for (name, value) in &self.env {
            command.env(name, value);
        }
        command
    }
}

fn typescript() -> &'static Example {
    static EXAMPLE: OnceLock<Example> = OnceLock::new();
    EXAMPLE.get_or_init(|| {
        let dir = examples_dir().join("typescript");
        let lock = fs::read(dir.join("package-lock.json")).expect("examples/typescript/package-lock.json");
        let stamp = dir.join("node_modules/.installed-from-package-lock.json");
        if fs::read(&stamp).ok().as_ref() != Some(&lock) {
            // npm ci removes node_modules first, the stamp with it.
            run(Command::new("npm").args(["ci", "--no-audit", "--no-fund"]).current_dir(&dir), "npm ci");
            fs::write(&stamp, &lock).unwrap();
        }
        run(Command::new("node").args(["node_modules/typescript/bin/tsc", "-p", "."]).current_dir(&dir), "tsc");
        Example { program: "node".into(), args: vec![dir.join("dist/main.js")], env: vec![] }
    })
}

fn python() -> &'static Example {
    static EXAMPLE: OnceLock<Example> = OnceLock::new();
    EXAMPLE.get_or_init(|| {
        let dir = examples_dir().join("python");
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let version = run(Command::new(&python).arg("--version"), "python3 --version");
        let mut lock = fs::read(dir.join("requirements.txt")).expect("examples/python/requirements.txt");
        lock.extend_from_slice(version.as_bytes());
        // Under target/, per interpreter version: the wheels are built for one.
        let site = Path::new(env!("CARGO_TARGET_TMPDIR")).join("examples-python");
        let stamp = site.join(".installed-from-requirements.txt");
        if fs::read(&stamp).ok().as_ref() != Some(&lock) {
            let _ = fs::remove_dir_all(&site);
            run(
                Command::new(&python)
                    .args(["-m", "pip", "install", "--quiet", "--no-input", "--disable-pip-version-check"])
                    .args(["--root-user-action=ignore", "--require-hashes", "-r"])
                    .arg(dir.join("requirements.txt"))
                    .arg("--target")
                    .arg(&site),
                "pip install",
            );
            fs::write(&stamp, &lock).unwrap();
        }
        Example {
            program: python,
            args: vec![dir.join("main.py")],
            env: vec![("PYTHONPATH", site), ("PYTHONDONTWRITEBYTECODE", "1".into())],
        }
    })
}

#[test]
fn typescript_consumer() {
    scenario("typescript", typescript());
}

#[test]
fn python_consumer() {
    scenario("python", python());
}

#[test]
fn typescript_consumer_deletes_what_every_group_acknowledged_where_redis_has_xackdel() {
    delete_acked_scenario("typescript", typescript());
}

#[test]
fn python_consumer_deletes_what_every_group_acknowledged_where_redis_has_xackdel() {
    delete_acked_scenario("python", python());
}

#[test]
fn typescript_consumer_of_cloudevents() {
    cloudevents_scenario("typescript", typescript());
}

#[test]
fn python_consumer_of_cloudevents() {
    cloudevents_scenario("python", python());
}

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

/// Runs a command to its end; its output, or the test fails with it.
fn run(command: &mut Command, what: &str) -> String {
    let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed ({}):\n{text}", out.status);
    text
}

/// One consumer process, its stdout and stderr in files.
struct Consumer {
    name: &'static str,
    child: Child,
    stderr: PathBuf,
}

impl Consumer {
    /// Starts consumer `name`; `run` names its files in `logs`: stdout, stderr and its spans.
    fn start(example: &Example, name: &'static str, env: &Env, logs: &Path, run: &str) -> Consumer {
        Consumer::start_with(example, name, env, logs, run, &[])
    }

    /// Like `start`, with `extra` flags after the test's own.
    fn start_with(
        example: &Example,
        name: &'static str,
        env: &Env,
        logs: &Path,
        run: &str,
        extra: &[&str],
    ) -> Consumer {
        let stderr = logs.join(format!("{run}.err"));
        let database = format!("postgresql://postgres@127.0.0.1:{}/postgres", env.pg.port);
        let child = example
            .command()
            .env("OTEL_EXPORT_FILE", logs.join(format!("{run}.spans")))
            .args(["--redis", &env.redis.url(), "--database", &database, "--stream", STREAM, "--group", GROUP])
            .args(["--consumer", name, "--batch", &BATCH.to_string(), "--block-ms", "200"])
            .args(["--max-deliveries", &MAX_DELIVERIES.to_string(), "--claim-idle-ms", &CLAIM_IDLE_MS.to_string()])
            .args(["--claim-interval-ms", "200"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(File::create(logs.join(format!("{run}.out"))).unwrap())
            .stderr(File::create(&stderr).unwrap())
            .spawn()
            .expect("start the consumer");
        Consumer { name, child, stderr }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Fails the test if the process has exited.
    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("consumer {} exited ({status}):\n{}", self.name, self.log());
        }
    }

    /// Waits until its session waits for `holder`'s transaction: the mark the test holds.
    fn wait_blocked(&mut self, db: &mut postgres::Client, holder: &mut postgres::Client) {
        let holder_pid: i32 = holder.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
        let application = format!("{GROUP}/{}", self.name);
        wait_for(DEADLINE, &format!("consumer {} to wait for the held mark", self.name), || {
            self.assert_running();
            let waiting: i64 = db
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE application_name = $1 AND $2 = ANY (pg_blocking_pids(pid))",
                    &[&application, &holder_pid],
                )
                .unwrap()
                .get(0);
            (waiting > 0).then_some(())
        });
    }

    fn kill(mut self) -> String {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        self.log()
    }

    /// SIGTERM: it finishes the entry in hand, prints its summary and exits 0.
    fn stop(mut self) -> String {
        // SAFETY: kill(2) on our own child, which has not been waited for, so the pid is its.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) }, 0);
        let status = wait_for(DEADLINE, &format!("consumer {} to exit", self.name), || self.child.try_wait().unwrap());
        let log = self.log();
        assert!(status.success(), "consumer {} exited with {status}:\n{log}", self.name);
        log
    }
}

impl Drop for Consumer {
    /// A failing test leaves no consumer behind (a no-op after `kill` or `stop`).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn redis(env: &Env) -> redis::Connection {
    redis::Client::open(env.redis.url()).unwrap().get_connection().unwrap()
}

/// The entries of `consumer` pending in the group, optionally only those idle for `idle_ms`.
fn pending_of(con: &mut redis::Connection, consumer: &str, idle_ms: Option<u64>) -> Vec<String> {
    let mut command = redis::cmd("XPENDING");
    command.arg(STREAM).arg(GROUP);
    if let Some(idle) = idle_ms {
        command.arg("IDLE").arg(idle);
    }
    command.arg("-").arg("+").arg(10_000).arg(consumer);
    let rows: Vec<(String, String, u64, u64)> = command.query(con).unwrap();
    rows.into_iter().map(|row| row.0).collect()
}

/// A transaction that holds `event_id`'s mark: a consumer reaching it waits until ROLLBACK.
fn hold_mark(env: &Env, event_id: &str) -> postgres::Client {
    let mut holder = env.pg.connect();
    holder.batch_execute("BEGIN").unwrap();
    let first: bool =
        holder.query_one("SELECT outbox_mark_processed($1, $2::text::uuid)", &[&GROUP, &event_id]).unwrap().get(0);
    assert!(first, "event {event_id} was marked before the test held it");
    holder
}

/// Waits until no session of consumer `name` is left.
fn wait_gone(db: &mut postgres::Client, name: &str) {
    let application = format!("{GROUP}/{name}");
    wait_for(DEADLINE, &format!("the session of the killed consumer {name} to end"), || {
        let sessions: i64 = db
            .query_one("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", &[&application])
            .unwrap()
            .get(0);
        (sessions == 0).then_some(())
    });
}

fn applied(db: &mut postgres::Client) -> i64 {
    db.query_one("SELECT count(*) FROM activity", &[]).map(|row| row.get(0)).unwrap_or(0)
}

fn summary_count(log: &str, what: &str) -> u64 {
    let line =
        log.lines().rev().find(|line| line.contains("processed ")).unwrap_or_else(|| panic!("no summary:\n{log}"));
    let after = line.split(&format!("{what} ")).nth(1).unwrap_or_else(|| panic!("no `{what}` in {line}"));
    after.split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

fn scenario(example_name: &str, example: &Example) {
    let env = Env::start(&[]);
    let mut db = env.pg.connect();
    let logs = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("examples-{example_name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&logs);
    fs::create_dir_all(&logs).unwrap();

    // One transaction: the stream holds the events in this order. The poison event opens its
    // aggregate; the aggregate's two later events come among the first batch.
    let no_headers: Option<&str> = None;
    let mut tx = db.transaction().unwrap();
    let poison: String =
        tx.query_one(ENQUEUE, &[&"poison", &"order.flagged", &r#"{"fail": true}"#, &no_headers]).unwrap().get(0);
    let mut expected: HashSet<String> = HashSet::new();
    let mut traces = Traces::new();
    for n in 0..EVENTS {
        if n == 10 || n == 20 {
            let id: String = tx
                .query_one(ENQUEUE, &[&"poison", &"order.updated", &format!(r#"{{"n": {n}}}"#), &no_headers])
                .unwrap()
                .get(0);
            expected.insert(id);
        }
        expected.insert(enqueue_event(&mut tx, n, &format!("o-{}", n % AGGREGATES), &mut traces));
    }
    tx.commit().unwrap();
    let total = EVENTS + 3;
    let entries = wait_for(DEADLINE, &format!("{total} entries in {STREAM}"), || {
        let entries = env.redis.entries(STREAM);
        (entries.len() >= total).then_some(entries)
    });
    let seq_of: HashMap<&str, &str> =
        entries.iter().map(|entry| (entry["event_id"].as_str(), entry["aggregate_seq"].as_str())).collect();
    let first_stop = entries[FIRST_STOP]["event_id"].clone();
    let second_stop = entries[SECOND_STOP]["event_id"].clone();

    db.execute("SELECT outbox_mark_processed($1, $2::text::uuid)", &[&GROUP, &NIL_UUID]).unwrap();
    let mut first_hold = hold_mark(&env, &first_stop);
    let mut second_hold = hold_mark(&env, &second_stop);
    let mut con = redis(&env);

    // a: killed inside the transaction of the event at FIRST_STOP, its batch half done.
    let mut a = Consumer::start(example, "a", &env, &logs, "a");
    a.wait_blocked(&mut db, &mut first_hold);
    let done = applied(&mut db);
    let left = pending_of(&mut con, "a", None);
    assert!(done > 0 && (done as usize) < total - 1, "a applied {done} events before the held one");
    assert!(left.len() > 1, "a holds {} entries: not mid-batch", left.len());
    let a_log = a.kill();
    first_hold.batch_execute("ROLLBACK").unwrap();
    // Its session, free to go on, finds the connection gone and rolls back.
    wait_gone(&mut db, "a");

    // b: once a's entries have been idle for the claim timeout, it takes them over with
    // XAUTOCLAIM before reading anything new; killed likewise at SECOND_STOP.
    wait_for(DEADLINE, "a's entries to be idle for the claim timeout", || {
        (pending_of(&mut con, "a", Some(CLAIM_IDLE_MS)).len() == left.len()).then_some(())
    });
    let mut b = Consumer::start(example, "b", &env, &logs, "b");
    b.wait_blocked(&mut db, &mut second_hold);
    assert!(pending_of(&mut con, "a", None).is_empty(), "b did not reclaim a's entries");
    assert!(pending_of(&mut con, "b", None).len() > 1, "b is not mid-batch");
    let b_log = b.kill();
    second_hold.batch_execute("ROLLBACK").unwrap();
    wait_gone(&mut db, "b");

    // b again, under its name: its own unacknowledged entries first, then the rest.
    let mut again = Consumer::start(example, "b", &env, &logs, "b-again");
    wait_for(DEADLINE, "every event applied and the poison event dead-lettered", || {
        again.assert_running();
        let dead: usize = redis::cmd("XLEN").arg(DEAD_LETTERS).query(&mut con).unwrap();
        (applied(&mut db) as usize >= total - 1 && dead >= 1).then_some(())
    });

    // A replay of some events, a copy with a field from a newer relay: duplicates. A malformed
    // copy (no event_id): dead-lettered at once.
    let replay_ids: Vec<String> = entries
        .iter()
        .filter(|entry| entry["aggregate_id"] != "poison")
        .take(REPLAYED)
        .map(|entry| entry["event_id"].clone())
        .collect();
    let replay: i64 = db
        .query_one(
            "SELECT outbox.replay(since => (SELECT min(created_at) FROM outbox.messages),
                                     event_ids => $1::text[]::uuid[])",
            &[&replay_ids],
        )
        .unwrap()
        .get(0);
    let xadd = |con: &mut redis::Connection, fields: Vec<(&str, &str)>| {
        let mut command = redis::cmd("XADD");
        command.arg(STREAM).arg("*");
        for (name, value) in fields {
            command.arg(name).arg(value);
        }
        let _: String = command.query(con).unwrap();
    };
    let copied = &entries[5];
    let mut with_unknown: Vec<(&str, &str)> = copied.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    with_unknown.push(("x_field_of_a_newer_relay", "1"));
    xadd(&mut con, with_unknown);
    let malformed: Vec<(&str, &str)> =
        copied.iter().filter(|(k, _)| k.as_str() != "event_id").map(|(k, v)| (k.as_str(), v.as_str())).collect();
    xadd(&mut con, malformed);
    wait_for(DEADLINE, "the replay to finish and the group to read and settle every entry", || {
        again.assert_running();
        let (state, replayed): (String, i64) = db
            .query_one("SELECT state, replayed FROM outbox.replays WHERE id = $1", &[&replay])
            .map(|row| (row.get(0), row.get(1)))
            .unwrap();
        if state != "done" {
            return None;
        }
        assert_eq!(replayed as usize, REPLAYED);
        let dead: usize = redis::cmd("XLEN").arg(DEAD_LETTERS).query(&mut con).unwrap();
        (settled(&mut con) && dead >= 2).then_some(())
    });
    let again_log = again.stop();

    // Every event applied once, with its fields, in aggregate_seq order per aggregate.
    let (seen, last_seq, handled_by) = applied_once_in_order(&mut db, &seq_of);
    assert_eq!(seen, expected, "the applied events are not those enqueued, poison excepted");
    for (aggregate, last) in &last_seq {
        let want = if aggregate == "poison" { 3 } else { (EVENTS / AGGREGATES) as i64 };
        assert_eq!(*last, want, "{aggregate}: last aggregate_seq applied");
    }
    assert!(
        handled_by.get("a").is_some_and(|&n| n > 0) && handled_by.get("b").is_some_and(|&n| n > 0),
        "{handled_by:?}"
    );
    assert_eq!(faithful(&mut db), total - 1, "rows whose fields match outbox.messages");
    let marks: i64 = db
        .query_one(
            "SELECT count(*) FROM outbox.processed_messages WHERE consumer = $1 AND event_id <> $2::text::uuid",
            &[&GROUP, &NIL_UUID],
        )
        .unwrap()
        .get(0);
    assert_eq!(marks as usize, total - 1, "dedup marks: one per applied event, none for the poison event");

    // The dead letters: the poison event after MAX_DELIVERIES deliveries, the malformed copy at once.
    let dead = env.redis.entries(DEAD_LETTERS);
    assert_eq!(dead.len(), 2, "{dead:#?}");
    let poisoned = &dead[0];
    assert_eq!(poisoned["event_id"], poison);
    assert_eq!(poisoned["payload"], r#"{"fail": true}"#);
    assert_eq!(poisoned["deliveries"], MAX_DELIVERIES.to_string());
    assert_eq!(poisoned["original_stream"], STREAM);
    assert!(poisoned["error"].contains(&format!("handler failed on delivery {MAX_DELIVERIES}")), "{poisoned:?}");
    assert!(poisoned["error"].contains("fail"), "{poisoned:?}");
    assert!(!dead[1].contains_key("event_id") && dead[1]["error"].contains("event_id"), "{:?}", dead[1]);
    assert_eq!(dead[1]["deliveries"], "1");

    // What the consumers reported: the gap behind the poison event (a), the takeover (b), and
    // after the restart no order warning, the replayed entries and the copy as duplicates.
    assert!(a_log.contains("order/poison #2") && a_log.contains("gap: aggregate_seq 2 follows 0"), "a:\n{a_log}");
    assert!(b_log.contains("reclaimed"), "b:\n{b_log}");
    assert_eq!(summary_count(&again_log, "replayed"), REPLAYED as u64, "b again:\n{again_log}");
    assert!(summary_count(&again_log, "duplicates") > REPLAYED as u64, "b again:\n{again_log}");
    assert_eq!(summary_count(&again_log, "order warnings"), 0, "b again:\n{again_log}");

    // The span that processed each event: the enqueuer's trace continued where there was one.
    assert_traces_continued(&logs, &seen, &traces);
    let _ = fs::remove_dir_all(&logs);
}

/// The CloudEvents story: a cluster with `outbox.entry_format = cloudevents`, events over a few
/// aggregates (some in a trace, as above) and a copy of one entry; one consumer applies every
/// event once, in order, with its fields, and continues the traces.
fn cloudevents_scenario(example_name: &str, example: &Example) {
    const COUNT: usize = 40;
    let env = Env::start(&["outbox.entry_format = 'cloudevents'"]);
    let mut db = env.pg.connect();
    let logs = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("examples-{example_name}-cloudevents-{}", std::process::id()));
    let _ = fs::remove_dir_all(&logs);
    fs::create_dir_all(&logs).unwrap();

    let mut expected: HashSet<String> = HashSet::new();
    let mut traces = Traces::new();
    let mut tx = db.transaction().unwrap();
    for n in 0..COUNT {
        expected.insert(enqueue_event(&mut tx, n, &format!("c-{}", n % 4), &mut traces));
    }
    tx.commit().unwrap();
    let entries = wait_for(DEADLINE, &format!("{COUNT} entries in {STREAM}"), || {
        let entries = env.redis.entries(STREAM);
        (entries.len() >= COUNT).then_some(entries)
    });
    for entry in &entries {
        assert_eq!(entry.get("specversion").map(String::as_str), Some("1.0"), "not a CloudEvent: {entry:?}");
    }
    let seq_of: HashMap<&str, &str> =
        entries.iter().map(|entry| (entry["id"].as_str(), entry["aggregateseq"].as_str())).collect();
    let mut con = redis(&env);
    let mut copy = redis::cmd("XADD");
    copy.arg(STREAM).arg("*");
    for (name, value) in &entries[3] {
        copy.arg(name).arg(value);
    }
    let _: String = copy.query(&mut con).unwrap();

    let mut consumer = Consumer::start(example, "c", &env, &logs, "c");
    wait_for(DEADLINE, "every event applied and the group to settle", || {
        consumer.assert_running();
        (applied(&mut db) as usize >= COUNT && settled(&mut con)).then_some(())
    });
    let log = consumer.stop();

    let (seen, last_seq, _) = applied_once_in_order(&mut db, &seq_of);
    assert_eq!(seen, expected, "the applied events are not those enqueued");
    assert!(last_seq.values().all(|&last| last == (COUNT / 4) as i64), "{last_seq:?}");
    assert_eq!(faithful(&mut db), COUNT, "rows whose fields match outbox.messages");
    assert_eq!(summary_count(&log, "duplicates"), 1, "{log}");
    assert_eq!(summary_count(&log, "order warnings"), 0, "{log}");
    assert_eq!(env.redis.entries(DEAD_LETTERS).len(), 0);
    assert_traces_continued(&logs, &seen, &traces);
    let _ = fs::remove_dir_all(&logs);
}

/// The `--delete-acked` story. Both groups exist before the events reach the stream: `audit` (the
/// test's) reads all of them and acknowledges the first AUDITED only; then one consumer of the
/// example, started with `--delete-acked`, processes every event. With XACKDEL (Redis 8.2 or later,
/// told by the version as the tests know it, not by the examples' own check) the relay trims by
/// acknowledgement (`outbox.stream_trim = 'acked'`, a bound above the events, so that it trims
/// nothing itself) and what is left in the stream is exactly what `audit` has not acknowledged;
/// without it (the relay would refuse `acked` there) the consumer says it acknowledges with XACK
/// and every entry stays. Either way nothing is pending in the consumer's group, and every event
/// was applied once, in order.
fn delete_acked_scenario(example_name: &str, example: &Example) {
    const COUNT: usize = 30;
    const AUDITED: usize = 18;
    const AUDIT: &str = "audit";
    let redis_server = Redis::start();
    let version = redis_server.info_field("server", "redis_version").expect("INFO server");
    let mut parts = version.split('.').map(|part| part.parse::<u32>().unwrap_or(0));
    let has_xackdel = (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (8, 2);
    let settings: &[&str] =
        if has_xackdel { &["outbox.stream_trim = 'acked'", "outbox.stream_maxlen = 1000"] } else { &[] };
    let pg = Cluster::start(redis_server.port, settings);
    pg.connect().batch_execute("CREATE EXTENSION outbox_pg").unwrap_or_else(|e| panic!("CREATE EXTENSION: {e}"));
    let env = Env { redis: redis_server, pg };
    let mut db = env.pg.connect();
    let mut con = redis(&env);
    let logs = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("examples-{example_name}-delete-acked-{}", std::process::id()));
    let _ = fs::remove_dir_all(&logs);
    fs::create_dir_all(&logs).unwrap();

    for group in [AUDIT, GROUP] {
        let _: () =
            redis::cmd("XGROUP").arg("CREATE").arg(STREAM).arg(group).arg("0").arg("MKSTREAM").query(&mut con).unwrap();
    }
    let no_headers: Option<&str> = None;
    let mut expected: HashSet<String> = HashSet::new();
    let mut tx = db.transaction().unwrap();
    for n in 0..COUNT {
        let payload = format!(r#"{{"n": {n}}}"#);
        let id: String =
            tx.query_one(ENQUEUE, &[&format!("d-{}", n % 3), &"order.updated", &payload, &no_headers]).unwrap().get(0);
        expected.insert(id);
    }
    tx.commit().unwrap();
    let entries = env.redis.wait_for_entries(STREAM, COUNT);
    let seq_of: HashMap<&str, &str> =
        entries.iter().map(|entry| (entry["event_id"].as_str(), entry["aggregate_seq"].as_str())).collect();
    let ids = entry_ids(&mut con);
    assert_eq!(ids.len(), COUNT);

    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(AUDIT)
        .arg("auditor")
        .arg("COUNT")
        .arg(COUNT)
        .arg("STREAMS")
        .arg(STREAM)
        .arg(">")
        .query(&mut con)
        .unwrap();
    let acked: usize = redis::cmd("XACK").arg(STREAM).arg(AUDIT).arg(&ids[..AUDITED]).query(&mut con).unwrap();
    assert_eq!(acked, AUDITED);

    let mut consumer = Consumer::start_with(example, "d", &env, &logs, "d", &["--delete-acked"]);
    wait_for(DEADLINE, "every event applied and the group to settle", || {
        consumer.assert_running();
        (applied(&mut db) as usize >= COUNT && settled(&mut con)).then_some(())
    });
    let log = consumer.stop();

    let (seen, _, _) = applied_once_in_order(&mut db, &seq_of);
    assert_eq!(seen, expected, "the applied events are not those enqueued");
    assert_eq!(summary_count(&log, "processed"), COUNT as u64, "{log}");
    assert_eq!(pending_count(&mut con, GROUP), 0, "entries left pending in {GROUP}");
    let left = entry_ids(&mut con);
    if has_xackdel {
        assert!(log.contains("acknowledging with XACKDEL"), "Redis {version}:\n{log}");
        // What both groups acknowledged is gone; what audit has not stays for it.
        assert_eq!(left, ids[AUDITED..], "Redis {version}: the entries left");
        assert_eq!(env.redis.xlen(STREAM), COUNT - AUDITED);
        assert_eq!(pending_count(&mut con, AUDIT), COUNT - AUDITED);
    } else {
        assert!(log.contains("acknowledging with XACK (--delete-acked: this Redis has no XACKDEL"), "{log}");
        assert_eq!(left, ids, "Redis {version}: XACK deletes nothing");
        assert_eq!(env.redis.xlen(STREAM), COUNT);
    }
    let _ = fs::remove_dir_all(&logs);
}

/// The IDs of the entries in the stream, in order.
fn entry_ids(con: &mut redis::Connection) -> Vec<String> {
    let rows: Vec<(String, Vec<String>)> = redis::cmd("XRANGE").arg(STREAM).arg("-").arg("+").query(con).unwrap();
    rows.into_iter().map(|(id, _)| id).collect()
}

/// How many entries `group` has pending (XPENDING's summary).
fn pending_count(con: &mut redis::Connection, group: &str) -> usize {
    let summary: (usize, redis::Value, redis::Value, redis::Value) =
        redis::cmd("XPENDING").arg(STREAM).arg(group).query(con).unwrap();
    summary.0
}

const ENQUEUE: &str = "SELECT outbox_enqueue('order', $1::text, $2::text, $3::text::jsonb, $4::text::jsonb)::text";

/// Per traced event id: the trace id it was enqueued in and the enqueuer's span id.
type Traces = HashMap<String, (String, String)>;

/// Enqueues event `n` (`order.updated`, its payload and some headers) of `aggregate_id` in `tx`;
/// returns its event_id. Events 3, 13, 23, ... carry a trace context in their headers, events 6,
/// 16, 26, ... get it from `outbox.traceparent`, set for the call only (`set_config(..., true)` is
/// SET LOCAL); each its own trace, recorded in `traces`.
fn enqueue_event(tx: &mut postgres::Transaction, n: usize, aggregate_id: &str, traces: &mut Traces) -> String {
    let (trace_id, span_id) = (format!("{:032x}", 0x7e57_0000_0000_u64 + n as u64), format!("{:016x}", 0xe0 + n));
    let traceparent = format!("00-{trace_id}-{span_id}-01");
    let (in_headers, in_setting) = (n % 10 == 3, n % 10 == 6);
    let mut headers = Vec::new();
    if n.is_multiple_of(7) {
        headers.push(format!(r#""source": "tests/examples.rs", "n": {n}"#));
    }
    if in_headers {
        headers.push(format!(r#""traceparent": "{traceparent}", "tracestate": "examples={n}""#));
    }
    let headers = (!headers.is_empty()).then(|| format!("{{{}}}", headers.join(", ")));
    let set_traceparent = "SELECT set_config('outbox.traceparent', $1, true)";
    if in_setting {
        tx.execute(set_traceparent, &[&traceparent]).unwrap();
    }
    let payload = format!(r#"{{"n": {n}, "amount_cents": {}}}"#, 100 + n);
    let id: String =
        tx.query_one(ENQUEUE, &[&aggregate_id, &"order.updated", &payload, &headers.as_deref()]).unwrap().get(0);
    if in_setting {
        tx.execute(set_traceparent, &[&""]).unwrap();
    }
    if in_headers || in_setting {
        traces.insert(id.clone(), (trace_id, span_id));
    }
    id
}

/// The group has read every entry of the stream and has none pending.
fn settled(con: &mut redis::Connection) -> bool {
    let stream: redis::streams::StreamInfoStreamReply =
        redis::cmd("XINFO").arg("STREAM").arg(STREAM).query(con).unwrap();
    let groups: redis::streams::StreamInfoGroupsReply =
        redis::cmd("XINFO").arg("GROUPS").arg(STREAM).query(con).unwrap();
    let group = groups.groups.iter().find(|g| g.name == GROUP).unwrap();
    group.last_delivered_id == stream.last_generated_id && group.pending == 0
}

/// Checks the `activity` rows: each event once, with the aggregate_seq of its entry, ascending per
/// aggregate. Returns the event ids, the last aggregate_seq per aggregate and the rows per consumer.
fn applied_once_in_order(
    db: &mut postgres::Client,
    seq_of: &HashMap<&str, &str>,
) -> (HashSet<String>, HashMap<String, i64>, HashMap<String, usize>) {
    let rows = db
        .query("SELECT event_id::text, aggregate_id, aggregate_seq, handled_by FROM activity ORDER BY id", &[])
        .unwrap();
    let mut seen: HashSet<String> = HashSet::new();
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    let mut handled_by: HashMap<String, usize> = HashMap::new();
    for row in &rows {
        let (event_id, aggregate_id, seq): (String, String, i64) = (row.get(0), row.get(1), row.get(2));
        assert!(seen.insert(event_id.clone()), "event {event_id} applied twice");
        assert_eq!(seq_of[event_id.as_str()], seq.to_string(), "event {event_id}: aggregate_seq");
        let last = last_seq.insert(aggregate_id.clone(), seq).unwrap_or(0);
        assert!(seq > last, "{aggregate_id}: aggregate_seq {seq} applied after {last}");
        *handled_by.entry(row.get(3)).or_default() += 1;
    }
    (seen, last_seq, handled_by)
}

/// The `activity` rows whose fields are those of their event in outbox.messages.
fn faithful(db: &mut postgres::Client) -> usize {
    let count: i64 = db
        .query_one(
            "SELECT count(*) FROM activity a JOIN outbox.messages m USING (event_id)
              WHERE a.aggregate_type = m.aggregate_type AND a.aggregate_id = m.aggregate_id
                AND a.event_type = m.event_type AND a.payload = m.payload
                AND a.headers IS NOT DISTINCT FROM m.headers AND a.created_at = m.created_at",
            &[],
        )
        .unwrap()
        .get(0);
    count as usize
}

/// Every span the consumers exported (each run's `<run>.spans` in `logs`) of an applied event:
/// `process <stream>`, kind CONSUMER, with the messaging attributes; for an event enqueued in a
/// trace, in that trace with the enqueuer's span as its parent, else a root. A killed consumer's
/// span of the event in hand never ended; the consumer that applied it later exported one.
fn assert_traces_continued(logs: &Path, applied: &HashSet<String>, traces: &Traces) {
    let mut spans: HashMap<String, Vec<serde_json::Value>> = HashMap::new();
    for file in fs::read_dir(logs).unwrap() {
        let path = file.unwrap().path();
        if path.extension().is_some_and(|ext| ext == "spans") {
            for line in fs::read_to_string(&path).unwrap().lines() {
                let span: serde_json::Value =
                    serde_json::from_str(line).unwrap_or_else(|e| panic!("{}: {e}: {line}", path.display()));
                let event_id = span["event_id"].as_str().unwrap_or_else(|| panic!("no event_id: {line}")).to_owned();
                spans.entry(event_id).or_default().push(span);
            }
        }
    }
    assert!(traces.len() >= 4 && traces.keys().all(|id| applied.contains(id)), "{traces:?}");
    for event_id in applied {
        let found = spans.get(event_id).unwrap_or_else(|| panic!("no span of event {event_id}"));
        for span in found {
            assert_eq!(span["name"], format!("process {STREAM}"), "{span}");
            assert_eq!(span["kind"], "CONSUMER", "{span}");
            assert_eq!(span["attributes"]["messaging.system"], "redis", "{span}");
            assert_eq!(span["attributes"]["messaging.destination.name"], STREAM, "{span}");
            match traces.get(event_id) {
                Some((trace_id, parent)) => {
                    assert_eq!(span["trace_id"].as_str(), Some(trace_id.as_str()), "{span}");
                    assert_eq!(span["parent_span_id"].as_str(), Some(parent.as_str()), "{span}");
                }
                None => assert!(span["parent_span_id"].is_null(), "a root span expected: {span}"),
            }
        }
    }
}
