//! What the extension's integration tests share beyond the servers (those are outbox-testkit's,
//! re-exported here so that a test names everything through `common`): an environment of a
//! Redis and a cluster with the extension created; enqueue and status helpers and the events the
//! upgrade and restore tests start from; the extension's files swapped for another build's;
//! producers that record the fate of every transaction, and the invariant checker that compares
//! that record with PostgreSQL and Redis; stepped sessions (`steps`).
#![allow(dead_code)]

pub mod steps;
pub mod trees;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// Each test binary names a few of them.
#[allow(unused_imports)]
pub use outbox_testkit::{
    free_port, run, stream_keys_on, try_connect, wait_for, Certificates, Cluster, ClusterNode, PgInstall, Redis,
    RedisCluster, SentinelSet, StreamStore, TempDir, DEADLINE, SENTINEL_MASTER,
};

/// A directory of the installation under test (`--bindir`, `--pkglibdir`, `--sharedir`).
pub fn pg_config(flag: &str) -> PathBuf {
    PathBuf::from(PgInstall::under_test().ask(flag))
}

/// A PostgreSQL client program (pg_dump, pg_restore, psql) of the installation under test.
pub fn pg_command(program: &str) -> Command {
    PgInstall::under_test().command(program)
}

/// Every file named `outbox_pg*` under `dir`, in subdirectories too (a `cargo pgrx package`
/// directory nests them as they are installed).
pub fn extension_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(next) = stack.pop() {
        for entry in fs::read_dir(&next).unwrap_or_else(|e| panic!("read {}: {e}", next.display())) {
            let path = entry.unwrap_or_else(|e| panic!("read {}: {e}", next.display())).path();
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name().is_some_and(|name| name.to_string_lossy().starts_with("outbox_pg")) {
                found.push(path);
            }
        }
    }
    found
}

/// outbox_pg's files in an installation's directories, swapped for other ones during a test (the
/// previous release, another major's build) and put back when dropped, however the test ends.
/// Each file is written beside its target and renamed over it: a running server keeps the
/// library it mapped.
pub struct SwappedExtension {
    libdir: PathBuf,
    extdir: PathBuf,
    backup: PathBuf,
}

impl SwappedExtension {
    /// Saves the extension's files installed in `install` into `backup`, a directory of their
    /// own.
    pub fn save(install: &PgInstall, backup: PathBuf) -> SwappedExtension {
        let swapped =
            SwappedExtension { libdir: install.pkglibdir().to_path_buf(), extdir: install.extension_dir(), backup };
        let _ = fs::remove_dir_all(&swapped.backup);
        fs::create_dir_all(&swapped.backup).unwrap_or_else(|e| panic!("create {}: {e}", swapped.backup.display()));
        for dir in [&swapped.libdir, &swapped.extdir] {
            for path in extension_files(dir) {
                let saved = swapped.backup.join(path.file_name().unwrap_or_default());
                fs::copy(&path, &saved)
                    .unwrap_or_else(|e| panic!("save {} as {}: {e}", path.display(), saved.display()));
            }
        }
        swapped
    }

    /// Whether the library was installed when the files were saved.
    pub fn had_library(&self) -> bool {
        self.backup.join("outbox_pg.so").exists()
    }

    /// Replaces the installed files by those under `from` (a `cargo pgrx package` directory).
    pub fn install(&self, from: &Path) {
        for path in extension_files(&self.extdir) {
            fs::remove_file(&path).unwrap_or_else(|e| panic!("remove {}: {e}", path.display()));
        }
        for path in extension_files(from) {
            let name = path.file_name().unwrap_or_default().to_owned();
            let dir = if name == "outbox_pg.so" { &self.libdir } else { &self.extdir };
            let temporary = dir.join(format!(".{}.outbox-test", name.to_string_lossy()));
            fs::copy(&path, &temporary)
                .unwrap_or_else(|e| panic!("copy {} into {}: {e}", path.display(), dir.display()));
            fs::rename(&temporary, dir.join(&name)).unwrap_or_else(|e| panic!("rename into {}: {e}", dir.display()));
        }
    }

    /// Puts back the files that were saved (and no library if none was).
    pub fn restore(&self) {
        if !self.had_library() {
            let _ = fs::remove_file(self.libdir.join("outbox_pg.so"));
        }
        self.install(&self.backup);
    }
}

impl Drop for SwappedExtension {
    fn drop(&mut self) {
        self.restore();
    }
}

/// A test environment: Redis first (the cluster's relay points at it), then PostgreSQL with the
/// extension created in database `postgres`.
pub struct Env {
    pub redis: Redis,
    pub pg: Cluster,
}

impl Env {
    pub fn start(extra: &[&str]) -> Env {
        Env::start_with_redis(&[], extra)
    }

    /// Like `start`, with extra redis-server arguments (e.g. `--appendonly yes`, so that a killed
    /// Redis keeps what it acknowledged).
    pub fn start_with_redis(redis_args: &[&str], extra: &[&str]) -> Env {
        let redis = Redis::start_with(redis_args);
        let pg = Cluster::start(redis.port, extra);
        pg.connect().batch_execute("CREATE EXTENSION outbox_pg").unwrap_or_else(|e| panic!("CREATE EXTENSION: {e}"));
        Env { redis, pg }
    }
}

/// Enqueues an event with an empty payload, to `stream` or the template's; returns its event_id.
pub fn enqueue_to(
    client: &mut postgres::Client,
    aggregate_type: &str,
    aggregate_id: &str,
    stream: Option<&str>,
) -> String {
    client
        .query_one(
            "SELECT outbox_enqueue($1, $2, 'test.event', '{}'::jsonb, NULL, $3)::text",
            &[&aggregate_type, &aggregate_id, &stream],
        )
        .unwrap()
        .get(0)
}

/// Events in each settled state, where the upgrade and restore tests start: three published
/// events of payment 1, and a failed event of refund 7 (its stream key `poisoned` is not a stream;
/// the cluster must run with `outbox.max_attempts = 1`) with that aggregate's next event pending
/// behind it.
pub struct PublishedAndFailed {
    pub published: Vec<String>,
    pub poison: String,
    pub behind_poison: String,
}

/// Enqueues [`PublishedAndFailed`]'s events and waits until each shows its state.
pub fn publish_and_fail(client: &mut postgres::Client, redis: &Redis) -> PublishedAndFailed {
    let published: Vec<String> = (0..3).map(|_| enqueue_to(client, "payment", "1", None)).collect();
    redis.wait_for_entries("outbox:payment", 3);
    redis.query::<()>(redis::cmd("SET").arg("poisoned").arg("not a stream"));
    let poison = enqueue_to(client, "refund", "7", Some("poisoned"));
    let behind_poison = enqueue_to(client, "refund", "7", None);
    wait_for(DEADLINE, "the poison event to fail", || (status_of(client, &poison) == "failed").then_some(()));
    for id in &published {
        wait_for(DEADLINE, "the published events to show published", || {
            (status_of(client, id) == "published").then_some(())
        });
    }
    PublishedAndFailed { published, poison, behind_poison }
}

/// The entries of aggregate `aggregate_id` among `entries`, as (event_id, aggregate_seq), in stream
/// order: what an upgrade must keep numbering on.
pub fn seqs_of(entries: &[HashMap<String, String>], aggregate_id: &str) -> Vec<(String, String)> {
    entries
        .iter()
        .filter(|e| e["aggregate_id"] == aggregate_id)
        .map(|e| (e["event_id"].clone(), e["aggregate_seq"].clone()))
        .collect()
}

/// Asserts that in `entries` (stream order) every aggregate's `aggregate_seq` runs 1, 2, 3, ...
/// with no gap and no repeat; `what` names the scenario in the failure.
pub fn assert_numbered_in_order(entries: &[HashMap<String, String>], what: &str) {
    let mut last: HashMap<&str, i64> = HashMap::new();
    for entry in entries {
        let seq: i64 = entry["aggregate_seq"].parse().unwrap();
        let previous = last.insert(entry["aggregate_id"].as_str(), seq).unwrap_or(0);
        assert_eq!(seq, previous + 1, "{what}: aggregate {} numbered out of order: {entry:?}", entry["aggregate_id"]);
    }
}

/// The status outbox.messages gives an event.
pub fn status_of(client: &mut postgres::Client, event_id: &str) -> String {
    client.query_one("SELECT status FROM outbox.messages WHERE event_id = $1::text::uuid", &[&event_id]).unwrap().get(0)
}

/// Counts rows of outbox.messages by status.
pub fn status_counts(client: &mut postgres::Client) -> HashMap<String, i64> {
    client
        .query("SELECT status, count(*) FROM outbox.messages GROUP BY status", &[])
        .unwrap()
        .into_iter()
        .map(|row| (row.get::<_, String>(0), row.get::<_, i64>(1)))
        .collect()
}

/// A small deterministic PRNG (xorshift64*), so that workloads need no extra crate.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// One event as its producer knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerEvent {
    pub event_id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
}

/// What producers know about their transactions, one `Vec` of events per transaction:
/// committed (COMMIT answered), rolled back (ROLLBACK, or an error before COMMIT was sent) and
/// ambiguous (the connection broke while COMMIT was in flight: the outcome is unknown until the
/// events are looked up in outbox.messages).
#[derive(Default, Debug)]
pub struct Ledger {
    pub committed: Vec<Vec<LedgerEvent>>,
    pub rolled_back: Vec<Vec<LedgerEvent>>,
    pub ambiguous: Vec<Vec<LedgerEvent>>,
}

pub type SharedLedger = Arc<Mutex<Ledger>>;

/// The relay's Redis user with the least privileges README's "Permissions" lists for one node
/// (password `relay-pw`): XADD inside MULTI/EXEC, PING, and XINFO STREAM for the lost-entry check.
/// A cluster adds `+wait`, `+cluster|slots` and `+asking`.
pub const RELAY_ACL_USER: &[&str] =
    &["relay", "on", ">relay-pw", "~outbox:*", "-@all", "+multi", "+exec", "+xadd", "+ping", "+xinfo|stream"];

pub const ENQUEUE: &str = "SELECT outbox_enqueue($1, $2, $3, $4::text::jsonb, NULL, $5)::text";

/// Enqueues one event in its own transaction and records it as committed.
pub fn enqueue_recorded(
    client: &mut postgres::Client,
    ledger: &SharedLedger,
    aggregate_type: &str,
    aggregate_id: &str,
    stream: Option<&str>,
) -> String {
    let event_id: String =
        client.query_one(ENQUEUE, &[&aggregate_type, &aggregate_id, &"scenario.event", &"{}", &stream]).unwrap().get(0);
    ledger.lock().unwrap().committed.push(vec![LedgerEvent {
        event_id: event_id.clone(),
        aggregate_type: aggregate_type.to_string(),
        aggregate_id: aggregate_id.to_string(),
    }]);
    event_id
}

/// What producer threads do: short transactions of 1..=`max_events_per_txn` events over a small
/// set of aggregates shared by all producers (so they contend on the aggregates' sequence rows),
/// some rolled back on purpose. Bounded by `max_txns` per producer and by `max_time`.
#[derive(Clone, Debug)]
pub struct Workload {
    pub producers: usize,
    pub aggregate_types: Vec<&'static str>,
    pub aggregates_per_type: u64,
    pub max_events_per_txn: u64,
    pub rollback_percent: u64,
    pub max_txns: usize,
    pub max_time: Duration,
    /// Sleep between two transactions of one producer.
    pub pause: Duration,
    /// Padding added to each payload.
    pub payload_padding: usize,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            producers: 3,
            aggregate_types: vec!["order", "payment"],
            aggregates_per_type: 6,
            max_events_per_txn: 3,
            rollback_percent: 15,
            max_txns: 1_000,
            max_time: Duration::from_secs(90),
            pause: Duration::from_millis(5),
            payload_padding: 32,
        }
    }
}

/// Producer threads writing `Workload` transactions to the cluster on `port` until stopped,
/// reconnecting whenever their connection breaks (server crash, restart), and recording every
/// transaction's fate in the ledger.
pub struct Producers {
    stop: Arc<AtomicBool>,
    committed: Arc<AtomicUsize>,
    reconnects: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

/// How one producer transaction ended.
enum TxnOutcome {
    Committed(Vec<LedgerEvent>),
    RolledBack(Vec<LedgerEvent>),
    Ambiguous(Vec<LedgerEvent>),
}

impl Producers {
    pub fn start(port: u16, workload: Workload, ledger: SharedLedger) -> Producers {
        let stop = Arc::new(AtomicBool::new(false));
        let committed = Arc::new(AtomicUsize::new(0));
        let reconnects = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(workload.producers));
        let handles = (0..workload.producers)
            .map(|p| {
                let (stop, committed, reconnects, running, ledger, workload) = (
                    stop.clone(),
                    committed.clone(),
                    reconnects.clone(),
                    running.clone(),
                    ledger.clone(),
                    workload.clone(),
                );
                std::thread::spawn(move || {
                    produce(p, port, &workload, &ledger, &stop, &committed, &reconnects);
                    running.fetch_sub(1, Ordering::SeqCst);
                })
            })
            .collect();
        Producers { stop, committed, reconnects, running, handles }
    }

    /// Transactions committed so far, by all producers.
    pub fn committed(&self) -> usize {
        self.committed.load(Ordering::SeqCst)
    }

    /// Times a producer had to connect again after losing its connection.
    pub fn reconnects(&self) -> usize {
        self.reconnects.load(Ordering::SeqCst)
    }

    /// Waits until the producers have committed `more` transactions beyond what they had now.
    pub fn wait_for_commits(&self, more: usize) {
        let target = self.committed() + more;
        wait_for(DEADLINE, &format!("producers to commit {target} transactions"), || {
            assert!(
                self.running.load(Ordering::SeqCst) > 0 || self.committed() >= target,
                "the producers stopped (limits reached) at {} committed transactions, before {target}",
                self.committed()
            );
            (self.committed() >= target).then_some(())
        });
    }

    /// Stops the producers and waits for them.
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        for handle in self.handles {
            handle.join().expect("producer thread panicked");
        }
    }
}

fn produce(
    producer: usize,
    port: u16,
    workload: &Workload,
    ledger: &SharedLedger,
    stop: &AtomicBool,
    committed: &AtomicUsize,
    reconnects: &AtomicUsize,
) {
    let started = Instant::now();
    let mut rng = Rng::new(0x5EED ^ ((producer as u64) << 17) ^ u64::from(port));
    let mut client: Option<postgres::Client> = None;
    let mut connected_once = false;
    let padding = "x".repeat(workload.payload_padding);
    let mut txns = 0;
    while !stop.load(Ordering::SeqCst) && txns < workload.max_txns && started.elapsed() < workload.max_time {
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            match try_connect(port) {
                Ok(c) => {
                    if connected_once {
                        reconnects.fetch_add(1, Ordering::SeqCst);
                    }
                    connected_once = true;
                    client = Some(c);
                }
                Err(_) => {
                    // The server is restarting (crash recovery, immediate stop): try again soon.
                    client = None;
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            }
        }
        let Some(c) = client.as_mut() else { continue };
        let events = 1 + rng.below(workload.max_events_per_txn);
        let mut aggregates: Vec<(&str, String)> = (0..events)
            .map(|_| {
                let t = workload.aggregate_types[rng.below(workload.aggregate_types.len() as u64) as usize];
                (t, rng.below(workload.aggregates_per_type).to_string())
            })
            .collect();
        // One lock order for the aggregates' sequence rows: producers wait for each other, never deadlock.
        aggregates.sort();
        let roll_back = rng.below(100) < workload.rollback_percent;
        let payload = format!("{{\"producer\": {producer}, \"txn\": {txns}, \"pad\": \"{padding}\"}}");
        let outcome = run_transaction(c, &aggregates, &payload, roll_back);
        let mut ledger = ledger.lock().unwrap();
        match outcome {
            TxnOutcome::Committed(events) => {
                ledger.committed.push(events);
                committed.fetch_add(1, Ordering::SeqCst);
            }
            TxnOutcome::RolledBack(events) => ledger.rolled_back.push(events),
            TxnOutcome::Ambiguous(events) => ledger.ambiguous.push(events),
        }
        drop(ledger);
        txns += 1;
        if !workload.pause.is_zero() {
            std::thread::sleep(workload.pause);
        }
    }
}

fn run_transaction(
    client: &mut postgres::Client,
    aggregates: &[(&str, String)],
    payload: &str,
    roll_back: bool,
) -> TxnOutcome {
    let mut events = Vec::new();
    let mut tx = match client.transaction() {
        Ok(tx) => tx,
        Err(_) => return TxnOutcome::RolledBack(events),
    };
    for (aggregate_type, aggregate_id) in aggregates {
        let no_stream: Option<&str> = None;
        match tx.query_one(ENQUEUE, &[aggregate_type, aggregate_id, &"test.event", &payload, &no_stream]) {
            Ok(row) => events.push(LedgerEvent {
                event_id: row.get(0),
                aggregate_type: aggregate_type.to_string(),
                aggregate_id: aggregate_id.clone(),
            }),
            // COMMIT was never sent: whatever this transaction wrote is gone.
            Err(_) => return TxnOutcome::RolledBack(events),
        }
    }
    if roll_back {
        // Even if the connection breaks here, COMMIT was never sent.
        let _ = tx.rollback();
        return TxnOutcome::RolledBack(events);
    }
    match tx.commit() {
        Ok(()) => TxnOutcome::Committed(events),
        // The server may have committed before the connection broke (or before it reported a
        // crash of another process): only outbox.messages can tell.
        Err(_) => TxnOutcome::Ambiguous(events),
    }
}

/// Waits until the relays have failed at least `rounds` more times (each failed round records its
/// error with a new `outbox.stats.last_error_at`) and returns the latest error. Nothing is written
/// per event when Redis fails as a whole, so this is how a test sees retries.
pub fn wait_for_failed_rounds(client: &mut postgres::Client, rounds: usize, what: &str) -> String {
    let mut seen: Vec<std::time::SystemTime> = Vec::new();
    let mut latest = String::new();
    wait_for(DEADLINE, what, || {
        let row = client.query_one("SELECT last_error, last_error_at FROM outbox.stats", &[]).unwrap();
        if let (Some(error), Some(at)) =
            (row.get::<_, Option<String>>(0), row.get::<_, Option<std::time::SystemTime>>(1))
        {
            if seen.last() != Some(&at) {
                seen.push(at);
                latest = error;
            }
        }
        (seen.len() > rounds).then(|| latest.clone())
    })
}

/// Waits until the outbox has nothing pending or in flight.
pub fn wait_drained(client: &mut postgres::Client) {
    wait_for(DEADLINE, "outbox.stats to show nothing pending or publishing", || {
        let row = client.query_one("SELECT pending, publishing FROM outbox.stats", &[]).unwrap();
        (row.get::<_, i64>(0) == 0 && row.get::<_, i64>(1) == 0).then_some(())
    });
}

/// What a scenario permits.
#[derive(Clone, Copy, Debug, Default)]
pub struct Expect {
    /// At-least-once duplicates (same event_id, same fields) may appear: the scenario crashes a
    /// process or loses a connection between an XADD and its settlement.
    pub duplicates: bool,
}

/// What the checker found.
#[derive(Debug, Default)]
pub struct Report {
    pub committed_txns: usize,
    pub committed_events: usize,
    pub rolled_back_events: usize,
    pub ambiguous_committed: usize,
    pub ambiguous_rolled_back: usize,
    pub delivered: usize,
    pub duplicates: usize,
    pub entries: usize,
    pub aggregates: usize,
}

/// The invariant checker. Resolves ambiguous transactions by looking their events up, waits until
/// the outbox has drained, then asserts against outbox.messages and every stream in Redis:
/// - outbox.messages holds exactly the committed events (none rolled back, none unknown), all
///   `published`;
/// - every committed event is in its stream (zero loss), no rolled-back or unknown event is in any
///   stream, and every entry carries exactly the row's fields (duplicates included), and a
///   duplicate the same `aggregate_seq` as the first occurrence;
/// - duplicates only when `expect.duplicates`;
/// - per aggregate, the first occurrences of its events carry `aggregate_seq` 1, 2, ... n in stream
///   order (the relay assigns it; the database keeps no per-event copy), and come in id order,
///   which within an aggregate is commit order.
///
/// Assumes the default `outbox.stream` template (`outbox:{aggregate_type}`).
pub fn check_invariants(
    scenario: &str,
    pg: &Cluster,
    redis: &dyn StreamStore,
    ledger: &SharedLedger,
    expect: Expect,
) -> Report {
    check_invariants_beside(scenario, pg, redis, ledger, expect, None)
}

/// `check_invariants`, leaving out the streams whose keys start with `beside` (a replay's `into`
/// stream, checked by its test). An entry's `replay` field (it is a replay, src/relay/replay.rs)
/// is not one of the row's fields: the entry is compared without it.
pub fn check_invariants_beside(
    scenario: &str,
    pg: &Cluster,
    redis: &dyn StreamStore,
    ledger: &SharedLedger,
    expect: Expect,
    beside: Option<&str>,
) -> Report {
    let mut client = pg.connect_eventually();
    let mut ledger = ledger.lock().unwrap();
    let mut report = Report::default();

    // Ambiguous commits: all of a transaction's events are in outbox.messages, or none.
    for events in std::mem::take(&mut ledger.ambiguous) {
        let ids: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
        let found: i64 = client
            .query_one("SELECT count(*) FROM outbox.messages WHERE event_id::text = ANY ($1)", &[&ids])
            .unwrap()
            .get(0);
        if found == ids.len() as i64 {
            report.ambiguous_committed += 1;
            ledger.committed.push(events);
        } else {
            assert_eq!(found, 0, "[{scenario}] a transaction was partly committed: {found} of {ids:?}");
            report.ambiguous_rolled_back += 1;
            ledger.rolled_back.push(events);
        }
    }
    let committed: HashMap<String, LedgerEvent> =
        ledger.committed.iter().flatten().map(|e| (e.event_id.clone(), e.clone())).collect();
    let rolled_back: std::collections::HashSet<String> =
        ledger.rolled_back.iter().flatten().map(|e| e.event_id.clone()).collect();
    report.committed_txns = ledger.committed.len();
    report.committed_events = committed.len();
    report.rolled_back_events = rolled_back.len();
    drop(ledger);

    wait_drained(&mut client);

    // The rows, with the fields their stream entries must carry.
    let rows = client
        .query(
            "SELECT id::text, event_id::text, aggregate_type, aggregate_id, id, event_type, payload::text,
                    headers::text, coalesce(stream, 'outbox:' || aggregate_type), status,
                    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
               FROM outbox.messages",
            &[],
        )
        .unwrap();
    let mut expected: HashMap<String, (String, HashMap<String, String>)> = HashMap::new();
    let mut aggregates: std::collections::HashSet<(String, String)> = std::collections::HashSet::new();
    for row in rows {
        let event_id: String = row.get(1);
        let (aggregate_type, aggregate_id, id): (String, String, i64) = (row.get(2), row.get(3), row.get(4));
        let status: String = row.get(9);
        assert!(!rolled_back.contains(&event_id), "[{scenario}] rolled-back event {event_id} is in outbox.messages");
        let known = committed.get(&event_id);
        assert!(known.is_some(), "[{scenario}] outbox.messages holds event {event_id}, which nobody committed");
        let known = known.unwrap();
        assert_eq!(
            (&known.aggregate_type, &known.aggregate_id),
            (&aggregate_type, &aggregate_id),
            "[{scenario}] event {event_id} has another aggregate than enqueued"
        );
        assert_eq!(status, "published", "[{scenario}] event {event_id} ({aggregate_type}/{aggregate_id}, id {id})");
        let mut fields: HashMap<String, String> = [
            ("event_id", event_id.clone()),
            ("outbox_id", row.get(0)),
            ("aggregate_type", aggregate_type.clone()),
            ("aggregate_id", aggregate_id.clone()),
            ("event_type", row.get(5)),
            ("payload", row.get(6)),
            ("created_at", row.get(10)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if let Some(headers) = row.get::<_, Option<String>>(7) {
            fields.insert("headers".into(), headers);
        }
        aggregates.insert((aggregate_type, aggregate_id));
        expected.insert(event_id, (row.get(8), fields));
    }
    for id in committed.keys() {
        assert!(expected.contains_key(id), "[{scenario}] committed event {id} is missing from outbox.messages");
    }
    report.aggregates = aggregates.len();

    // Every stream in Redis.
    let mut first_seen: HashMap<String, usize> = HashMap::new();
    let mut seq_of: HashMap<String, String> = HashMap::new();
    let mut last_seq: HashMap<(String, String, String), (i64, i64)> = HashMap::new();
    for stream in redis.stream_keys() {
        if beside.is_some_and(|prefix| stream.starts_with(prefix)) {
            continue;
        }
        for (position, mut entry) in redis.entries(&stream).into_iter().enumerate() {
            report.entries += 1;
            entry.remove("replay");
            let event_id = entry.get("event_id").cloned().unwrap_or_default();
            assert!(!rolled_back.contains(&event_id), "[{scenario}] rolled-back event {event_id} reached {stream}");
            let Some((want_stream, fields)) = expected.get(&event_id) else {
                panic!("[{scenario}] stream {stream} holds an unknown event: {entry:?}");
            };
            assert_eq!(&stream, want_stream, "[{scenario}] event {event_id} went to the wrong stream");
            let seq_field = entry.remove("aggregate_seq").unwrap_or_default();
            assert_eq!(&entry, fields, "[{scenario}] entry {position} of {stream} differs from its row");
            if first_seen.insert(event_id.clone(), position).is_some() {
                report.duplicates += 1;
                assert!(expect.duplicates, "[{scenario}] event {event_id} delivered twice to {stream}");
                assert_eq!(
                    seq_of.get(&event_id),
                    Some(&seq_field),
                    "[{scenario}] event {event_id} was published again with another aggregate_seq"
                );
                continue;
            }
            seq_of.insert(event_id.clone(), seq_field.clone());
            let key = (stream.clone(), fields["aggregate_type"].clone(), fields["aggregate_id"].clone());
            let seq: i64 = seq_field.parse().unwrap();
            let id: i64 = fields["outbox_id"].parse().unwrap();
            let (previous, previous_id) = last_seq.insert(key.clone(), (seq, id)).unwrap_or((0, 0));
            assert_eq!(
                seq,
                previous + 1,
                "[{scenario}] {}/{} in {stream}: first occurrence of aggregate_seq {seq} (event {event_id}, \
                 entry {position}) follows aggregate_seq {previous}",
                key.1,
                key.2
            );
            assert!(
                id > previous_id,
                "[{scenario}] {}/{} in {stream}: event id {id} came after id {previous_id} (not commit order)",
                key.1,
                key.2
            );
        }
    }
    report.delivered = first_seen.len();
    let missing: Vec<&String> = committed.keys().filter(|id| !first_seen.contains_key(*id)).collect();
    assert!(missing.is_empty(), "[{scenario}] {} committed events never reached Redis: {missing:?}", missing.len());
    eprintln!(
        "[{scenario}] committed {} transactions / {} events over {} aggregates; rolled back {} events; \
         ambiguous commits: {} committed, {} rolled back; delivered {} distinct events in {} entries ({} duplicates)",
        report.committed_txns,
        report.committed_events,
        report.aggregates,
        report.rolled_back_events,
        report.ambiguous_committed,
        report.ambiguous_rolled_back,
        report.delivered,
        report.entries,
        report.duplicates
    );
    report
}
