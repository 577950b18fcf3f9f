//! outbox_pg benchmarks, run side by side against one PostgreSQL (outbox_pg preloaded) and one
//! Redis, and written as a Markdown report, raw JSON and a latency histogram (SVG).
//!
//! `outbox-bench all --pg CONNINFO --redis URL --pgbench PATH --out DIR [--quick]` runs everything;
//! `outbox-bench baseline-relay --pg CONNINFO --redis URL --batch N` is the external relay of the
//! seeds' design (its own table `bench_seed_outbox`, none of outbox_pg's functions) that the drain
//! and WAL scenarios start as 1, 2 or 4 processes; `outbox-bench sustained ...` is the latency
//! scenario minute after minute; `outbox-bench cdc-relay ...` is the change-data-capture peer
//! (`cdc.rs`) on the same table; `outbox-bench steady ...` is ten minutes at 75% of the producers'
//! ceiling; `outbox-bench cdc ...` only the issue-39 comparison of the three designs.
//! `bench/run.sh` sets up the servers and calls one of them.

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod cdc;
mod designs;
mod outside;
mod scale;

type Error = Box<dyn std::error::Error + Send + Sync>;
type Result<T> = std::result::Result<T, Error>;

#[derive(Clone)]
struct Args {
    command: String,
    pg: String,
    redis: String,
    pgbench: String,
    out: String,
    quick: bool,
    batch: i32,
    rate: u32,
    /// Windows of the sustained run (default 5) or of the steady one (default 10).
    minutes: Option<u32>,
    /// `outbox.retention` for the sustained run; `None` keeps the server's setting (default 7 days).
    retention: Option<String>,
    /// Seed nodes of a Redis Cluster (`redis://h1:p1,h2:p2,...`) to drain into beside the single
    /// node; `None` skips that scenario.
    cluster: Option<String>,
    /// For the relays of the seeds' table (`baseline-relay`, `cdc-relay`): publish this many events
    /// and exit (a drain); `None` follows new events until standard input closes.
    events: Option<i64>,
    /// `cdc-relay`: delete published rows (`--no-trim` leaves them, for the WAL measurement).
    trim: bool,
    /// `baseline-relay` following new events: its pause when a claim found nothing.
    poll_ms: u64,
    /// `baseline-relay`: follow new events until standard input closes instead of exiting when
    /// nothing is pending.
    follow: bool,
    /// `cdc-relay`: ask pgoutput for the columns' text instead of their binary form.
    text: bool,
    /// The `outbox-relay` binary (target/release/outbox-relay) the outside relay's scenarios run.
    relay: Option<String>,
    /// The SQL-only install (`bash scripts/sql-only.sh`'s output) for the outside relay's database.
    sql_only: Option<String>,
}

fn parse_args() -> Result<Args> {
    let mut args = std::env::args().skip(1);
    let command = args.next().ok_or("usage: outbox-bench all|baseline-relay --pg CONNINFO --redis URL ...")?;
    let mut parsed = Args {
        command,
        pg: String::new(),
        redis: String::new(),
        // bench/run.sh passes its server's own; this is the private 15's (scripts/pg-config.sh).
        pgbench: outbox_testkit::default_pg_config().with_file_name("pgbench").to_string_lossy().into_owned(),
        out: "bench/results".into(),
        quick: false,
        batch: 1000,
        rate: 1000,
        minutes: None,
        retention: None,
        cluster: None,
        events: None,
        trim: true,
        poll_ms: POLL_MS,
        follow: false,
        text: false,
        relay: None,
        sql_only: None,
    };
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--pg" => parsed.pg = value()?,
            "--redis" => parsed.redis = value()?,
            "--pgbench" => parsed.pgbench = value()?,
            "--out" => parsed.out = value()?,
            "--batch" => parsed.batch = value()?.parse().map_err(|e| format!("--batch: {e}"))?,
            "--rate" => parsed.rate = value()?.parse().map_err(|e| format!("--rate: {e}"))?,
            "--minutes" => parsed.minutes = Some(value()?.parse().map_err(|e| format!("--minutes: {e}"))?),
            "--events" => parsed.events = Some(value()?.parse().map_err(|e| format!("--events: {e}"))?),
            "--poll-ms" => parsed.poll_ms = value()?.parse().map_err(|e| format!("--poll-ms: {e}"))?,
            "--no-trim" => parsed.trim = false,
            "--follow" => parsed.follow = true,
            "--text" => parsed.text = true,
            "--retention" => parsed.retention = Some(value()?),
            "--cluster" => parsed.cluster = Some(value()?),
            "--relay" => parsed.relay = Some(value()?),
            "--sql-only" => parsed.sql_only = Some(value()?),
            "--quick" => parsed.quick = true,
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    if parsed.pg.is_empty() || parsed.redis.is_empty() {
        return Err("--pg and --redis are required".into());
    }
    Ok(parsed)
}

fn main() {
    let result = parse_args().and_then(|args| match args.command.as_str() {
        "all" => run_all(&args),
        "baseline-relay" => baseline_relay(&args),
        "cdc-relay" => cdc::cdc_relay(&args),
        "cdc" => cdc_only(&args),
        "steady" => steady(&args),
        "sustained" => sustained(&args),
        "drain" => drain_only(&args),
        "payload" => payload_only(&args),
        "outside" => outside_only(&args),
        "outside-latency" => outside::latency_only(&args),
        other => Err(format!("unknown command {other:?}").into()),
    });
    if let Err(error) = result {
        eprintln!("outbox-bench: {error} ({error:?})");
        std::process::exit(1);
    }
}

fn pg(conninfo: &str) -> Result<postgres::Client> {
    Ok(postgres::Client::connect(conninfo, postgres::NoTls)?)
}

fn redis_connection(url: &str) -> Result<redis::Connection> {
    Ok(redis::Client::open(url)?.get_connection()?)
}

/// CPU seconds (user + system) the single Redis node at `url` has used so far (`INFO cpu`): what
/// Redis itself spends per event of a drain, and so the most events per second it can take here
/// from any relay.
fn redis_cpu_seconds(url: &str) -> Result<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query(&mut redis_connection(url)?)?;
    let used = |name: &str| {
        info.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':')?.trim().parse::<f64>().ok())
            .ok_or_else(|| format!("INFO cpu has no {name}: {info}"))
    };
    Ok(used("used_cpu_user")? + used("used_cpu_sys")?)
}

/// Applies settings with ALTER SYSTEM and reloads. The relays apply a reload asynchronously; the
/// scenarios that depend on it wait for its visible effect (relay count, drained stream).
fn configure(client: &mut postgres::Client, settings: &[(&str, &str)]) -> Result<()> {
    for (name, value) in settings {
        client.batch_execute(&format!("ALTER SYSTEM SET {name} = '{value}'"))?;
    }
    client.batch_execute("SELECT pg_reload_conf()")?;
    std::thread::sleep(Duration::from_millis(300));
    Ok(())
}

fn wait_until(timeout: Duration, probe: impl FnMut() -> Result<bool>) -> Result<()> {
    wait_until_every(timeout, Duration::from_millis(2), probe)
}

fn wait_until_every(timeout: Duration, every: Duration, mut probe: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if probe()? {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("timed out".into());
        }
        std::thread::sleep(every);
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

// ------------------------------------------------------------------------------------------------
// Latency: producers at a fixed rate; a reader blocked on XREAD timestamps each entry's arrival.
// ------------------------------------------------------------------------------------------------

struct Latency {
    rate: u32,
    seconds: u32,
    samples_ms: Vec<f64>,
    missing: usize,
    /// How long the producers took to commit everything (longer than `seconds` when the machine
    /// cannot commit `rate` transactions a second).
    elapsed_s: f64,
}

impl Latency {
    /// The rate the producers reached.
    fn achieved_rate(&self) -> f64 {
        (self.samples_ms.len() + self.missing) as f64 / self.elapsed_s
    }
}

/// The three designs the bench compares.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Peer {
    /// outbox_pg's relay workers, in the server.
    OutboxPg,
    /// The seeds' polling relay (`baseline-relay`) on `bench_seed_outbox`.
    Polling,
    /// The change-data-capture relay (`cdc-relay`) on `bench_seed_outbox`.
    Cdc,
    /// outbox_pg's relay outside the server (`outbox-relay`), one process, on the database `--pg`
    /// names (the SQL-only install's, whose `outbox_enqueue` wakes it with a NOTIFY).
    Outside,
}

impl Peer {
    fn name(self) -> &'static str {
        match self {
            Peer::OutboxPg => "outbox_pg",
            Peer::Polling => "polling relay",
            Peer::Cdc => "CDC relay",
            Peer::Outside => "outside relay",
        }
    }
}

/// The polling relay's pause when a claim found nothing, while it follows new events.
const POLL_MS: u64 = 10;

fn latency(args: &Args, rate: u32, seconds: u32) -> Result<Latency> {
    latency_of(args, Peer::OutboxPg, rate, seconds)
}

/// The latency scenario with `peer` publishing: for outbox_pg each producer transaction calls
/// `outbox_enqueue`; for the other two it INSERTs into the seeds' table, which that peer's
/// process (started here, following new events) publishes.
fn latency_of(args: &Args, peer: Peer, rate: u32, seconds: u32) -> Result<Latency> {
    // Several producers, so that commit latency (fsync) does not cap the rate.
    latency_with(args, peer, rate, seconds, (rate / 500).max(4))
}

/// `latency_of` with `producers` producer connections sharing the rate.
fn latency_with(args: &Args, peer: Peer, rate: u32, seconds: u32, producers: u32) -> Result<Latency> {
    let mut admin = pg(&args.pg)?;
    let stream = "outbox:bench_latency";
    redis::cmd("DEL").arg(stream).query::<()>(&mut redis_connection(&args.redis)?)?;
    let mut outside_relay = None;
    let relay = match peer {
        Peer::OutboxPg => {
            configure(&mut admin, &[("outbox.enabled", "on"), ("outbox.workers", "1"), ("outbox.batch_size", "100")])?;
            None
        }
        Peer::Outside => {
            configure(&mut admin, &[("outbox.enabled", "off")])?;
            let process = outside::RelayProcess::start(args, args, 0)?;
            outside::wait_joined(&mut admin, 1)?;
            outside_relay = Some(process);
            None
        }
        Peer::Polling | Peer::Cdc => {
            configure(&mut admin, &[("outbox.enabled", "off")])?;
            admin.batch_execute("TRUNCATE bench_seed_outbox")?;
            if peer == Peer::Cdc {
                designs::cdc_slot_reset(&mut admin)?;
            }
            Some(designs::PeerProcess::follow(args, &mut admin, peer)?)
        }
    };
    let enqueue_sql = match peer {
        Peer::OutboxPg | Peer::Outside => {
            "SELECT outbox_enqueue('bench_latency', $1::bigint, 'payment.created',
                                   jsonb_build_object('payment_id', $1::bigint, 'amount', $2::text::numeric))::text"
        }
        Peer::Polling | Peer::Cdc => {
            "INSERT INTO bench_seed_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'bench_latency', $1::bigint::text, 'payment.created',
                     jsonb_build_object('payment_id', $1::bigint, 'amount', $2::text::numeric))
             RETURNING event_id::text"
        }
    };

    let arrivals: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (arrivals, stop, url) = (arrivals.clone(), stop.clone(), args.redis.clone());
        std::thread::spawn(move || -> Result<()> {
            let mut con = redis_connection(&url)?;
            let mut last_id = "0-0".to_string();
            while !stop.load(Ordering::SeqCst) {
                let reply: redis::streams::StreamReadReply = redis::cmd("XREAD")
                    .arg("BLOCK")
                    .arg(200)
                    .arg("COUNT")
                    .arg(1000)
                    .arg("STREAMS")
                    .arg(stream)
                    .arg(&last_id)
                    .query(&mut con)?;
                let now = Instant::now();
                let mut arrivals = arrivals.lock().map_err(|_| "poisoned")?;
                for key in reply.keys {
                    for entry in key.ids {
                        if let Some(redis::Value::BulkString(id)) = entry.map.get("event_id") {
                            arrivals.insert(String::from_utf8_lossy(id).into_owned(), now);
                        }
                        last_id = entry.id;
                    }
                }
            }
            Ok(())
        })
    };

    let per_producer = rate / producers;
    let commits: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let started = Instant::now();
    let handles: Vec<_> = (0..producers)
        .map(|p| {
            let (commits, conninfo) = (commits.clone(), args.pg.clone());
            std::thread::spawn(move || -> Result<()> {
                let mut client = pg(&conninfo)?;
                let interval = Duration::from_secs_f64(1.0 / per_producer as f64);
                let insert = client.prepare(
                    "INSERT INTO bench_payments (payer, amount) VALUES ($1, $2::text::numeric) RETURNING id",
                )?;
                let enqueue = client.prepare(enqueue_sql)?;
                let total = per_producer * seconds;
                let mut next = started + Duration::from_millis(p as u64 * 7);
                for i in 0..total {
                    let now = Instant::now();
                    if now < next {
                        std::thread::sleep(next - now);
                    }
                    next += interval;
                    let mut tx = client.transaction()?;
                    let amount = rust_decimal_free_amount(i);
                    let id: i64 = tx.query_one(&insert, &[&format!("payer-{p}"), &amount])?.get(0);
                    let event_id: String = tx.query_one(&enqueue, &[&id, &amount])?.get(0);
                    tx.commit()?;
                    let acked = Instant::now();
                    commits.lock().map_err(|_| "poisoned")?.push((event_id, acked));
                }
                Ok(())
            })
        })
        .collect();
    for handle in handles {
        handle.join().map_err(|_| "producer panicked")??;
    }
    let elapsed_s = started.elapsed().as_secs_f64();
    let commits = std::mem::take(&mut *commits.lock().map_err(|_| "poisoned")?);
    let _ = wait_until(Duration::from_secs(30), || Ok(arrivals.lock().map_err(|_| "poisoned")?.len() >= commits.len()));
    stop.store(true, Ordering::SeqCst);
    reader.join().map_err(|_| "reader panicked")??;
    if let Some(relay) = outside_relay {
        relay.stop()?;
    }
    if let Some(relay) = relay {
        relay.stop(&mut admin)?;
        if peer == Peer::Cdc {
            designs::cdc_slot_drop(&mut admin)?;
        }
    }
    let arrivals = arrivals.lock().map_err(|_| "poisoned")?;
    let mut samples = Vec::with_capacity(commits.len());
    let mut missing = 0;
    for (event_id, acked) in &commits {
        match arrivals.get(event_id) {
            // The relay may publish before the client has read the COMMIT acknowledgement: 0.
            Some(arrived) => samples.push(arrived.saturating_duration_since(*acked).as_secs_f64() * 1000.0),
            None => missing += 1,
        }
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    Ok(Latency { rate, seconds, samples_ms: samples, missing, elapsed_s })
}

/// An amount in cents as text, converted to NUMERIC by the server.
fn rust_decimal_free_amount(i: u32) -> String {
    format!("{}.{:02}", 10 + i % 990, i % 100)
}

// ------------------------------------------------------------------------------------------------
// Drain: a backlog of pending events, published by the in-server relay or by the external one.
// ------------------------------------------------------------------------------------------------

const DRAIN_STREAM: &str = "outbox:bench_drain";

/// The outbox table of the seeds' design, which the external relay and the plain-INSERT side of
/// the enqueue comparison use: a primary key and one pending index, nothing else.
const SEED_OUTBOX_DDL: &str = "
DROP TABLE IF EXISTS bench_seed_outbox;
CREATE TABLE bench_seed_outbox (
    id             bigserial PRIMARY KEY,
    event_id       uuid,
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb,
    status         text DEFAULT 'pending',
    created_at     timestamptz DEFAULT now(),
    published_at   timestamptz
);
CREATE INDEX bench_seed_outbox_pending_idx ON bench_seed_outbox (id) WHERE status = 'pending';
DROP PUBLICATION IF EXISTS bench_cdc;
CREATE PUBLICATION bench_cdc FOR TABLE bench_seed_outbox WITH (publish = 'insert');";

/// The payload of event `i` of a backlog, the same for outbox_pg and for the seeds' table.
const BACKLOG_PAYLOAD: &str = "jsonb_build_object('payment_id', i, 'amount', '12.34', 'payer', 'payer-' || i)";

/// One transaction's worth of a backlog for outbox_pg: events `first..=last` of `aggregates`
/// aggregates of type `aggregate_type`.
fn enqueue_sql(aggregate_type: &str, aggregates: i64, first: i64, last: i64, payload: &str) -> String {
    format!(
        "SELECT outbox_enqueue('{aggregate_type}', (i % {aggregates})::bigint, 'payment.created', {payload})
           FROM generate_series({first}, {last}) AS i"
    )
}

/// The same events as `enqueue_sql`, as plain rows of the seeds' outbox table.
fn seed_insert_sql(aggregate_type: &str, aggregates: i64, first: i64, last: i64, payload: &str) -> String {
    format!(
        "INSERT INTO bench_seed_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), '{aggregate_type}', (i % {aggregates})::text, 'payment.created', {payload}
           FROM generate_series({first}, {last}) AS i"
    )
}

/// The tables that hold outbox_pg's events: the log's three generations and the failure path.
const OUTBOX_TABLES: &str = "outbox.events_0, outbox.events_1, outbox.events_2, outbox.held";

/// Pauses the relays, lets one that is mid-round finish, and empties the outbox: the log, the
/// failure path, and every shard's cursor moved to now.
fn pause_and_empty_outbox(admin: &mut postgres::Client) -> Result<()> {
    configure(admin, &[("outbox.enabled", "off")])?;
    wait_until(Duration::from_secs(10), || {
        let busy: i64 = admin.query_one("SELECT publishing FROM outbox.stats", &[])?.get(0);
        Ok(busy == 0)
    })?;
    // Two transactions: holding the log's tables locked while waiting for a shard row that a
    // relay's housekeeping has updated (and that waits to read the log) would deadlock.
    admin.batch_execute(&format!(
        "TRUNCATE {OUTBOX_TABLES}, outbox.ticks, outbox.journal_0, outbox.journal_1, outbox.journal_2"
    ))?;
    admin.batch_execute("UPDATE outbox.shards SET cursor = pg_current_snapshot(), cursor_at = now()")?;
    Ok(())
}

/// Applies retention to everything published, as `outbox.purge('0')` repeated in separate
/// transactions does: a table switched by one call is truncated by a later one, once no writer can
/// be left on it and every shard has consumed it.
fn purge_everything(admin: &mut postgres::Client) -> Result<()> {
    wait_until(Duration::from_secs(60), || {
        admin.batch_execute("SELECT outbox.purge('0')")?;
        // Whether anything is left, not how much: counting a large log is what the bench must not
        // spend its time on (and what outbox.stats answers for pending events).
        let left: bool = admin.query_one("SELECT EXISTS (SELECT 1 FROM outbox.events)", &[])?.get(0);
        if left {
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(!left)
    })
}

fn prepare_backlog(
    args: &Args,
    admin: &mut postgres::Client,
    events: i64,
    aggregates: i64,
    payload: &str,
) -> Result<()> {
    pause_and_empty_outbox(admin)?;
    admin.batch_execute(&format!("VACUUM ANALYZE {OUTBOX_TABLES}"))?;
    redis::cmd("DEL").arg(DRAIN_STREAM).query::<()>(&mut redis_connection(&args.redis)?)?;
    // With 10,000 aggregates (10 events each) ordering has runs to respect; with one aggregate,
    // every event waits for the one before it. Transactions of 1,000 events: one transaction that
    // enqueues many events for one aggregate rewrites its counter row each time, and each call
    // walks the versions the transaction made before (quadratic; see docs/performance.md).
    for first in (1..=events).step_by(1000) {
        admin.batch_execute(&enqueue_sql("bench_drain", aggregates, first, (first + 999).min(events), payload))?;
    }
    admin.batch_execute(&format!("VACUUM ANALYZE {OUTBOX_TABLES}"))?;
    Ok(())
}

/// The same backlog as `prepare_backlog` (same events, same transactions of 1,000), in the seeds'
/// table for the external relay.
fn prepare_seed_backlog(
    args: &Args,
    admin: &mut postgres::Client,
    events: i64,
    aggregates: i64,
    payload: &str,
) -> Result<()> {
    admin.batch_execute("TRUNCATE bench_seed_outbox")?;
    redis::cmd("DEL").arg(DRAIN_STREAM).query::<()>(&mut redis_connection(&args.redis)?)?;
    for first in (1..=events).step_by(1000) {
        admin.batch_execute(&seed_insert_sql("bench_drain", aggregates, first, (first + 999).min(events), payload))?;
    }
    admin.batch_execute("VACUUM ANALYZE bench_seed_outbox")?;
    Ok(())
}

fn wait_drained(args: &Args, stream: &str, events: i64) -> Result<()> {
    let mut con = redis_connection(&args.redis)?;
    wait_until(Duration::from_secs(600), || {
        let len: i64 = redis::cmd("XLEN").arg(stream).query(&mut con)?;
        Ok(len >= events)
    })
}

/// Waits until the relays have settled everything they published: nothing pending, nothing in
/// flight. Polled gently, since counting a large backlog competes with the relay for the cores.
fn wait_settled(admin: &mut postgres::Client) -> Result<()> {
    wait_until_every(Duration::from_secs(120), Duration::from_millis(20), || {
        let left: i64 = admin.query_one("SELECT pending + publishing FROM outbox.stats", &[])?.get(0);
        Ok(left == 0)
    })
}

fn relay_pids(admin: &mut postgres::Client) -> Result<Vec<i32>> {
    Ok(admin
        .query("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay'", &[])?
        .iter()
        .map(|row| row.get(0))
        .collect())
}

/// Dead tuples and total size (indexes and TOAST included) of `table` as the statistics show it
/// once the relays have flushed their counters (they do so at most once a second, between rounds).
fn table_state(admin: &mut postgres::Client, tables: &str) -> Result<(i64, i64)> {
    std::thread::sleep(Duration::from_millis(2500));
    admin.batch_execute("SELECT pg_stat_clear_snapshot()")?;
    let tables: Vec<String> = tables.split(',').map(|t| t.trim().to_string()).collect();
    let row = admin.query_one(
        "SELECT sum(pg_stat_get_dead_tuples(t::regclass))::bigint, sum(pg_total_relation_size(t::regclass))::bigint
           FROM unnest($1::text[]) AS t",
        &[&tables],
    )?;
    Ok((row.get(0), row.get(1)))
}

/// One drain of a backlog: how fast, the CPU it took, and the table it left behind.
struct Drain {
    /// Workers (outbox_pg) or processes (external relay).
    relays: usize,
    events_per_s: f64,
    /// CPU per event: the relay workers (outbox_pg), or the external process plus the PostgreSQL
    /// backend serving it.
    cpu_us_per_event: f64,
    /// For the external relay: the part of `cpu_us_per_event` spent in its own process.
    client_cpu_us_per_event: Option<f64>,
    /// What the single Redis node spent per event meanwhile (None for a cluster).
    redis_cpu_us_per_event: Option<f64>,
    dead_tuples: i64,
    total_bytes: i64,
}

impl Drain {
    /// A drain by `processes` relay processes outside the server (the seeds' relay, outbox-relay):
    /// its CPU per event counted alike for both, the processes' own ticks and their backends'.
    fn by_processes(
        processes: usize,
        events: i64,
        events_per_s: f64,
        redis_cpu_us_per_event: Option<f64>,
        backend_ticks: u64,
        process_ticks: u64,
    ) -> Drain {
        Drain {
            relays: processes,
            events_per_s,
            cpu_us_per_event: ticks_to_us(backend_ticks + process_ticks) / events as f64,
            client_cpu_us_per_event: Some(ticks_to_us(process_ticks) / events as f64),
            redis_cpu_us_per_event,
            dead_tuples: 0,
            total_bytes: 0,
        }
    }
}

fn drain_in_server(args: &Args, events: i64, aggregates: i64, workers: usize) -> Result<Drain> {
    drain_in_server_with(args, events, aggregates, workers, BACKLOG_PAYLOAD)
}

/// `drain_in_server` with the payload expression `payload` (of `i`, the event's number).
fn drain_in_server_with(args: &Args, events: i64, aggregates: i64, workers: usize, payload: &str) -> Result<Drain> {
    let mut admin = pg(&args.pg)?;
    prepare_backlog(args, &mut admin, events, aggregates, payload)?;
    configure(&mut admin, &[("outbox.workers", &workers.to_string()), ("outbox.batch_size", &args.batch.to_string())])?;
    let redis_before = redis_cpu_seconds(&args.redis)?;
    let drain = enable_and_measure(&mut admin, workers, events, || wait_drained(args, DRAIN_STREAM, events))?;
    let redis_cpu_us_per_event = Some((redis_cpu_seconds(&args.redis)? - redis_before) * 1e6 / events as f64);
    let (dead_tuples, total_bytes) = table_state(&mut admin, OUTBOX_TABLES)?;
    Ok(Drain { dead_tuples, total_bytes, redis_cpu_us_per_event, ..drain })
}

/// Waits for `workers` relays, enables them, and measures how fast they publish `events` (until
/// `drained` returns) and the CPU they spend until every event is settled. The table figures are
/// left at 0 for the caller to fill in.
fn enable_and_measure(
    admin: &mut postgres::Client,
    workers: usize,
    events: i64,
    drained: impl FnOnce() -> Result<()>,
) -> Result<Drain> {
    wait_until(Duration::from_secs(30), || Ok(relay_pids(admin)?.len() == workers))?;
    let pids = relay_pids(admin)?;
    let ticks = |pids: &[i32]| pids.iter().map(|&pid| cpu_ticks(pid)).sum::<Result<u64>>();
    let ticks_before = ticks(&pids)?;
    let started = Instant::now();
    admin.batch_execute("ALTER SYSTEM SET outbox.enabled = 'on'")?;
    admin.batch_execute("SELECT pg_reload_conf()")?;
    drained()?;
    let events_per_s = events as f64 / started.elapsed().as_secs_f64();
    // The last batch is settled after its XADDs: its CPU belongs to the drain too.
    wait_settled(admin)?;
    let ticks_after = ticks(&pids)?;
    Ok(Drain {
        relays: workers,
        events_per_s,
        cpu_us_per_event: ticks_to_us(ticks_after - ticks_before) / events as f64,
        client_cpu_us_per_event: None,
        redis_cpu_us_per_event: None,
        dead_tuples: 0,
        total_bytes: 0,
    })
}

/// Streams of the topology drain: events spread over them by aggregate, so that a cluster's masters
/// all get some.
const SPREAD_STREAMS: i64 = 12;

/// The keys of the spread streams.
fn spread_stream_keys() -> Vec<String> {
    (0..SPREAD_STREAMS).map(|n| format!("outbox:bench_spread_{n}")).collect()
}

/// A connection to the single node, or to the cluster whose seed nodes `redis` lists (each
/// command then goes to the node serving its key).
fn stream_connection(redis: &str, cluster: bool) -> Result<Box<dyn redis::ConnectionLike>> {
    if cluster {
        let seeds: Vec<String> =
            redis.trim_start_matches("redis://").split(',').map(|node| format!("redis://{node}")).collect();
        Ok(Box::new(redis::cluster::ClusterClient::new(seeds)?.get_connection()?))
    } else {
        Ok(Box::new(redis_connection(redis)?))
    }
}

/// Entries in the spread streams.
fn spread_entries(redis: &str, cluster: bool) -> Result<i64> {
    let mut connection = stream_connection(redis, cluster)?;
    let mut total = 0;
    for key in spread_stream_keys() {
        total += redis::cmd("XLEN").arg(key).query::<i64>(connection.as_mut())?;
    }
    Ok(total)
}

/// Deletes the spread streams.
fn delete_spread_streams(redis: &str, cluster: bool) -> Result<()> {
    let mut connection = stream_connection(redis, cluster)?;
    for key in spread_stream_keys() {
        redis::cmd("DEL").arg(key).query::<()>(connection.as_mut())?;
    }
    Ok(())
}

/// One worker draining `events` pending events (10,000 aggregates, `SPREAD_STREAMS` streams) into
/// the single Redis node, or into the cluster (`outbox.redis_mode = cluster`) when `cluster`.
fn drain_topology(args: &Args, events: i64, cluster: Option<&str>) -> Result<Drain> {
    let mut admin = pg(&args.pg)?;
    pause_and_empty_outbox(&mut admin)?;
    let (redis, mode) = match cluster {
        Some(seeds) => (seeds, "cluster"),
        None => (args.redis.as_str(), "standalone"),
    };
    delete_spread_streams(redis, cluster.is_some())?;
    for first in (1..=events).step_by(1000) {
        let last = (first + 999).min(events);
        admin.batch_execute(&format!(
            "SELECT outbox_enqueue('bench_spread_' || ((i % 10000) % {SPREAD_STREAMS}), (i % 10000)::bigint, 'payment.created', {BACKLOG_PAYLOAD})
               FROM generate_series({first}, {last}) AS i"
        ))?;
    }
    admin.batch_execute(&format!("VACUUM ANALYZE {OUTBOX_TABLES}"))?;
    configure(
        &mut admin,
        &[
            ("outbox.redis_url", redis),
            ("outbox.redis_mode", mode),
            ("outbox.workers", "1"),
            ("outbox.batch_size", &args.batch.to_string()),
        ],
    )?;
    let drain = enable_and_measure(&mut admin, 1, events, || {
        wait_until(Duration::from_secs(600), || Ok(spread_entries(redis, cluster.is_some())? >= events))
    })?;
    // Back to the single node for the scenarios that follow.
    configure(&mut admin, &[("outbox.redis_url", &args.redis), ("outbox.redis_mode", "standalone")])?;
    let (dead_tuples, total_bytes) = table_state(&mut admin, OUTBOX_TABLES)?;
    Ok(Drain { dead_tuples, total_bytes, ..drain })
}

/// What one `baseline-relay` or `cdc-relay` process reports when it exits.
#[derive(Default)]
struct BaselineReport {
    events: u64,
    /// The PostgreSQL backends serving it: for the CDC relay, its walsender and its trimmer.
    backend_ticks: u64,
    process_ticks: u64,
    /// The CDC relay's walsender alone.
    walsender_ticks: u64,
}

fn spawn_baseline(args: &Args) -> Result<std::process::Child> {
    spawn_relay(args, "baseline-relay", &[], false)
}

/// Starts `outbox-bench COMMAND` (`baseline-relay` or `cdc-relay`) with this run's servers and
/// batch size; `follow` gives it a standard input whose closing stops it.
fn spawn_relay(args: &Args, command: &str, extra: &[&str], follow: bool) -> Result<std::process::Child> {
    Ok(Command::new(std::env::current_exe()?)
        .args([command, "--pg", &args.pg, "--redis", &args.redis, "--batch", &args.batch.to_string()])
        .args(extra)
        .stdin(if follow { std::process::Stdio::piped() } else { std::process::Stdio::null() })
        .stdout(std::process::Stdio::piped())
        .spawn()?)
}

fn finish_baseline(child: std::process::Child) -> Result<BaselineReport> {
    let output = child.wait_with_output()?;
    if !output.status.success() {
        return Err(format!("the relay process exited with {}", output.status).into());
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let mut report = BaselineReport::default();
    for pair in text.split_whitespace().filter_map(|word| word.split_once('=')) {
        match pair {
            ("events", n) => report.events = n.parse()?,
            ("backend_ticks", n) => report.backend_ticks = n.parse()?,
            ("process_ticks", n) => report.process_ticks = n.parse()?,
            ("walsender_ticks", n) => report.walsender_ticks = n.parse()?,
            _ => {}
        }
    }
    Ok(report)
}

fn drain_baseline(args: &Args, events: i64, aggregates: i64, processes: usize) -> Result<Drain> {
    drain_baseline_with(args, events, aggregates, processes, BACKLOG_PAYLOAD)
}

/// `drain_baseline` with the payload expression `payload`.
fn drain_baseline_with(args: &Args, events: i64, aggregates: i64, processes: usize, payload: &str) -> Result<Drain> {
    let mut admin = pg(&args.pg)?;
    prepare_seed_backlog(args, &mut admin, events, aggregates, payload)?;
    let redis_before = redis_cpu_seconds(&args.redis)?;
    let started = Instant::now();
    let children = (0..processes).map(|_| spawn_baseline(args)).collect::<Result<Vec<_>>>()?;
    wait_drained(args, DRAIN_STREAM, events)?;
    let events_per_s = events as f64 / started.elapsed().as_secs_f64();
    let redis_cpu_us_per_event = Some((redis_cpu_seconds(&args.redis)? - redis_before) * 1e6 / events as f64);
    let reports = children.into_iter().map(finish_baseline).collect::<Result<Vec<_>>>()?;
    let backend_ticks: u64 = reports.iter().map(|r| r.backend_ticks).sum();
    let process_ticks: u64 = reports.iter().map(|r| r.process_ticks).sum();
    let (dead_tuples, total_bytes) = table_state(&mut admin, "bench_seed_outbox")?;
    Ok(Drain {
        dead_tuples,
        total_bytes,
        ..Drain::by_processes(processes, events, events_per_s, redis_cpu_us_per_event, backend_ticks, process_ticks)
    })
}

/// The seeds' claim: the oldest pending rows, skipping those another process is claiming, marked
/// `publishing` in the same statement. No per-aggregate order: the seeds' design has none.
const SEED_CLAIM: &str = "
UPDATE bench_seed_outbox SET status = 'publishing'
 WHERE id IN (SELECT id FROM bench_seed_outbox WHERE status = 'pending' ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)
RETURNING id, event_id::text, aggregate_type, aggregate_id, event_type, payload::text, headers::text,
          to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')";

/// The seeds' settle: the whole batch marked published in one statement.
const SEED_MARK: &str = "UPDATE bench_seed_outbox SET status = 'published', published_at = now() WHERE id = ANY($1)";

/// The external relay of the seeds' design, tuned: a separate process that, over a client
/// connection and on its own table (`bench_seed_outbox`), claims a batch, XADDs it in one pipeline
/// (the same fields as outbox_pg's entries) and marks it published in one bulk UPDATE. It uses none
/// of outbox_pg's functions. It exits when nothing is left pending, printing how many events it
/// published and the CPU ticks of its backend and of itself.
fn baseline_relay(args: &Args) -> Result<()> {
    let mut client = pg(&args.pg)?;
    // Tuned as a relay that runs these prepared statements all day would be: no JIT (their generic
    // plans can cost enough to be compiled on every call, see docs/performance.md), and no
    // sequential scan: the claim's generic plan otherwise hashes the batch's ids and scans the whole
    // table to find them (22 ms against 7 ms per 1,000 rows of a 100,000-row backlog).
    client.batch_execute(
        "SET jit = off; SET enable_seqscan = off; SET application_name = 'outbox-bench baseline-relay'",
    )?;
    let stop = Arc::new(AtomicBool::new(false));
    if args.follow {
        // Following new events until the parent closes our standard input.
        let stop = stop.clone();
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            stop.store(true, Ordering::SeqCst);
        });
    }
    let backend: i32 = client.query_one("SELECT pg_backend_pid()", &[])?.get(0);
    let me = std::process::id() as i32;
    let (backend_before, me_before) = (cpu_ticks(backend)?, cpu_ticks(me)?);
    let mut con = redis_connection(&args.redis)?;
    let claim = client.prepare(SEED_CLAIM)?;
    let mark = client.prepare(SEED_MARK)?;
    let any_pending = client.prepare("SELECT EXISTS (SELECT 1 FROM bench_seed_outbox WHERE status = 'pending')")?;
    let limit = i64::from(args.batch);
    let mut published = 0u64;
    loop {
        let mut rows = client.query(&claim, &[&limit])?;
        if rows.is_empty() {
            if args.follow {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(args.poll_ms));
                continue;
            }
            // SKIP LOCKED passes over rows that another process is claiming: they are still
            // pending until its claim commits.
            if !client.query_one(&any_pending, &[])?.get::<_, bool>(0) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        rows.sort_by_key(|row| row.get::<_, i64>(0));
        let mut pipe = redis::pipe();
        let mut ids = Vec::with_capacity(rows.len());
        for (position, row) in rows.iter().enumerate() {
            let id: i64 = row.get(0);
            ids.push(id);
            let aggregate_type: String = row.get(2);
            let cmd = pipe.cmd("XADD").arg(format!("outbox:{aggregate_type}")).arg("*");
            cmd.arg("event_id").arg(row.get::<_, String>(1)).arg("outbox_id").arg(id.to_string());
            cmd.arg("aggregate_type").arg(&aggregate_type).arg("aggregate_id").arg(row.get::<_, String>(3));
            // The seeds' table has no sequence number; the row's place in the batch fills the field
            // so that entries are as large as outbox_pg's.
            cmd.arg("aggregate_seq").arg((position + 1).to_string()).arg("event_type").arg(row.get::<_, String>(4));
            cmd.arg("payload").arg(row.get::<_, String>(5));
            if let Some(headers) = row.get::<_, Option<String>>(6) {
                cmd.arg("headers").arg(headers);
            }
            cmd.arg("created_at").arg(row.get::<_, String>(7));
        }
        pipe.query::<()>(&mut con)?;
        client.execute(&mark, &[&ids])?;
        published += ids.len() as u64;
    }
    let (backend_after, me_after) = (cpu_ticks(backend)?, cpu_ticks(me)?);
    println!(
        "events={published} backend_ticks={} process_ticks={}",
        backend_after - backend_before,
        me_after - me_before
    );
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Enqueue cost: pgbench, business INSERT + outbox_enqueue versus business INSERT + plain INSERT.
// ------------------------------------------------------------------------------------------------

struct Tps {
    /// Medians.
    plain: f64,
    outbox: f64,
    plain_runs: Vec<f64>,
    outbox_runs: Vec<f64>,
    /// `outbox.stats.pending` right after each outbox_enqueue run: whether a running relay kept up.
    pending_after: Vec<i64>,
}

impl Tps {
    fn ratio(&self) -> f64 {
        self.outbox / self.plain
    }
}

fn pgbench_tps(args: &Args, script: &str, seconds: u32) -> Result<f64> {
    Ok(pgbench_run(args, script, seconds, 4, None)?.tps)
}

/// What one pgbench run did.
struct PgbenchRun {
    tps: f64,
    transactions: i64,
}

/// A pgbench command running `script` for `seconds` with `clients` clients (2 threads), at most
/// `rate` transactions a second in total if given.
fn pgbench_command(args: &Args, script: &str, seconds: u32, clients: u32, rate: Option<u32>) -> Result<Command> {
    static SCRIPTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let path = std::env::temp_dir().join(format!(
        "outbox-bench-{}-{}.sql",
        std::process::id(),
        SCRIPTS.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::write(&path, script)?;
    let conninfo: HashMap<&str, &str> = args.pg.split_whitespace().filter_map(|kv| kv.split_once('=')).collect();
    let mut command = Command::new(&args.pgbench);
    command
        .args(["-n", "-c", &clients.to_string(), "-j", "2", "-M", "prepared", "-T", &seconds.to_string()])
        .args(rate.map(|r| ["-R".to_string(), r.to_string()]).into_iter().flatten())
        .arg("-f")
        .arg(&path)
        .args(["-h", conninfo.get("host").unwrap_or(&"127.0.0.1")])
        .args(["-p", conninfo.get("port").unwrap_or(&"5432")])
        .args(["-U", conninfo.get("user").unwrap_or(&"postgres")])
        .arg(conninfo.get("dbname").unwrap_or(&"postgres"));
    Ok(command)
}

fn pgbench_run(args: &Args, script: &str, seconds: u32, clients: u32, rate: Option<u32>) -> Result<PgbenchRun> {
    let output = pgbench_command(args, script, seconds, clients, rate)?.output()?;
    pgbench_result(&output)
}

/// The tps and the transactions of a finished pgbench.
fn pgbench_result(output: &std::process::Output) -> Result<PgbenchRun> {
    let text = String::from_utf8_lossy(&output.stdout);
    let after = |prefix: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.split('/').next())
            .and_then(|n| n.parse::<f64>().ok())
    };
    let missing = || format!("pgbench gave no tps: {text}{}", String::from_utf8_lossy(&output.stderr));
    let tps = after("tps = ").ok_or_else(missing)?;
    let transactions = after("number of transactions actually processed: ").ok_or_else(missing)? as i64;
    Ok(PgbenchRun { tps, transactions })
}

/// The enqueue cost's pgbench transaction with a plain INSERT into the seeds' outbox table.
const PLAIN_SCRIPT: &str = "BEGIN;
INSERT INTO bench_payments (payer, amount) VALUES ('payer', 12.34);
INSERT INTO bench_seed_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
VALUES (gen_random_uuid(), 'payment', currval('bench_payments_id_seq')::text, 'payment.created', '{\"amount\": \"12.34\"}');
END;
";

/// The same transaction with `outbox_enqueue` (the extension's, or the SQL-only install's).
const ENQUEUE_SCRIPT: &str = "BEGIN;
INSERT INTO bench_payments (payer, amount) VALUES ('payer', 12.34);
SELECT outbox_enqueue('payment', currval('bench_payments_id_seq'), 'payment.created', '{\"amount\": \"12.34\"}');
END;
";

/// The `key=value` pairs of a connection string.
fn conninfo_parts(conninfo: &str) -> HashMap<String, String> {
    conninfo.split_whitespace().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect()
}

fn enqueue_cost(args: &Args, seconds: u32, relay_on: bool) -> Result<Tps> {
    let mut admin = pg(&args.pg)?;
    // Both sides start from empty tables.
    pause_and_empty_outbox(&mut admin)?;
    admin.batch_execute("TRUNCATE bench_seed_outbox, bench_payments")?;
    configure(&mut admin, &[("outbox.enabled", if relay_on { "on" } else { "off" }), ("outbox.workers", "1")])?;
    let (plain, outbox) = (PLAIN_SCRIPT, ENQUEUE_SCRIPT);
    // Alternate the two, three times each, and keep the medians: the machine's noise hits both.
    let (mut plain_runs, mut outbox_runs, mut pending_after) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        plain_runs.push(pgbench_tps(args, plain, seconds)?);
        outbox_runs.push(pgbench_tps(args, outbox, seconds)?);
        pending_after.push(admin.query_one("SELECT pending FROM outbox.stats", &[])?.get(0));
    }
    let median = |runs: &[f64]| {
        let mut sorted = runs.to_vec();
        sorted.sort_by(|a, b| a.total_cmp(b));
        sorted[sorted.len() / 2]
    };
    Ok(Tps { plain: median(&plain_runs), outbox: median(&outbox_runs), plain_runs, outbox_runs, pending_after })
}

// ------------------------------------------------------------------------------------------------
// WAL per event: enqueue, relay and retention, outbox_pg against the seeds' path.
// ------------------------------------------------------------------------------------------------

const WAL_STREAM: &str = "outbox:bench_wal";

/// WAL bytes written by each phase of one path.
struct WalPath {
    enqueue: i64,
    relay: i64,
    retention: i64,
}

impl WalPath {
    fn total(&self) -> i64 {
        self.enqueue + self.relay + self.retention
    }
}

struct Wal {
    events: i64,
    aggregates: i64,
    per_transaction: i64,
    outbox: WalPath,
    seeds: WalPath,
    /// The CDC relay: the same INSERTs as the seeds' path; the relay (`--no-trim`) until it has
    /// published everything; the DELETE of the published rows.
    cdc: WalPath,
}

/// The WAL insert position. Not `pg_current_wal_lsn()`, the write position: the relays commit
/// asynchronously, and WAL they inserted may not be written yet when a phase ends.
fn wal_position(admin: &mut postgres::Client) -> Result<String> {
    Ok(admin.query_one("SELECT pg_current_wal_insert_lsn()::text", &[])?.get(0))
}

fn wal_since(admin: &mut postgres::Client, from: &str) -> Result<i64> {
    Ok(admin
        .query_one("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::text::pg_lsn)::bigint", &[&from])?
        .get(0))
}

/// Measures one path: a CHECKPOINT (so that both paths start with no page already imaged since the
/// last one), then `enqueue`, `relay` and `retention` in turn, the WAL position read after each.
fn wal_path(
    admin: &mut postgres::Client,
    enqueue: impl FnOnce(&mut postgres::Client) -> Result<()>,
    relay: impl FnOnce(&mut postgres::Client) -> Result<()>,
    retention: impl FnOnce(&mut postgres::Client) -> Result<()>,
) -> Result<WalPath> {
    admin.batch_execute("CHECKPOINT")?;
    let start = wal_position(admin)?;
    enqueue(admin)?;
    let enqueued = wal_since(admin, &start)?;
    relay(admin)?;
    let relayed = wal_since(admin, &start)?;
    retention(admin)?;
    let retained = wal_since(admin, &start)?;
    Ok(WalPath { enqueue: enqueued, relay: relayed - enqueued, retention: retained - relayed })
}

fn wal_per_event(args: &Args, events: i64, aggregates: i64, per_transaction: i64) -> Result<Wal> {
    let mut admin = pg(&args.pg)?;
    // Nothing else may write while WAL is counted: an autovacuum would land in one path's window
    // and not the other's.
    configure(&mut admin, &[("autovacuum", "off")])?;
    let measured = (|| -> Result<Wal> {
        wait_until(Duration::from_secs(120), || {
            let running: i64 = admin
                .query_one("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'", &[])?
                .get(0);
            Ok(running == 0)
        })?;
        let batches = |admin: &mut postgres::Client, sql: &dyn Fn(i64, i64) -> String| -> Result<()> {
            for first in (1..=events).step_by(per_transaction as usize) {
                admin.batch_execute(&sql(first, (first + per_transaction - 1).min(events)))?;
            }
            Ok(())
        };

        pause_and_empty_outbox(&mut admin)?;
        configure(&mut admin, &[("outbox.workers", "1"), ("outbox.batch_size", &args.batch.to_string())])?;
        redis::cmd("DEL").arg(WAL_STREAM).query::<()>(&mut redis_connection(&args.redis)?)?;
        let outbox = wal_path(
            &mut admin,
            |admin| batches(admin, &|first, last| enqueue_sql("bench_wal", aggregates, first, last, BACKLOG_PAYLOAD)),
            |admin| {
                configure(admin, &[("outbox.enabled", "on")])?;
                wait_drained(args, WAL_STREAM, events)?;
                wait_settled(admin)
            },
            purge_everything,
        )?;
        configure(&mut admin, &[("outbox.enabled", "off")])?;

        admin.batch_execute("TRUNCATE bench_seed_outbox")?;
        redis::cmd("DEL").arg(WAL_STREAM).query::<()>(&mut redis_connection(&args.redis)?)?;
        let seeds = wal_path(
            &mut admin,
            |admin| {
                batches(admin, &|first, last| seed_insert_sql("bench_wal", aggregates, first, last, BACKLOG_PAYLOAD))
            },
            |_| {
                let report = finish_baseline(spawn_baseline(args)?)?;
                if report.events != events as u64 {
                    return Err(format!("baseline-relay published {} of {events} events", report.events).into());
                }
                Ok(())
            },
            |admin| Ok(admin.batch_execute("DELETE FROM bench_seed_outbox WHERE status = 'published'")?),
        )?;

        admin.batch_execute("TRUNCATE bench_seed_outbox")?;
        redis::cmd("DEL").arg(WAL_STREAM).query::<()>(&mut redis_connection(&args.redis)?)?;
        // The slot exists before the events are written, as it would in production.
        designs::cdc_slot_reset(&mut admin)?;
        let cdc = wal_path(
            &mut admin,
            |admin| {
                batches(admin, &|first, last| seed_insert_sql("bench_wal", aggregates, first, last, BACKLOG_PAYLOAD))
            },
            |_| {
                let relay = spawn_relay(args, "cdc-relay", &["--events", &events.to_string(), "--no-trim"], false)?;
                let report = finish_baseline(relay)?;
                if report.events != events as u64 {
                    return Err(format!("cdc-relay published {} of {events} events", report.events).into());
                }
                Ok(())
            },
            // What the relay's trimming deletes, in one statement.
            |admin| Ok(admin.batch_execute("DELETE FROM bench_seed_outbox")?),
        );
        designs::cdc_slot_drop(&mut admin)?;
        Ok(Wal { events, aggregates, per_transaction, outbox, seeds, cdc: cdc? })
    })();
    admin.batch_execute("ALTER SYSTEM RESET autovacuum")?;
    admin.batch_execute("SELECT pg_reload_conf()")?;
    measured
}

// ------------------------------------------------------------------------------------------------
// Idle: what a relay with nothing to do costs.
// ------------------------------------------------------------------------------------------------

struct Idle {
    seconds: u64,
    cpu_ms: f64,
    transactions: i64,
    poll_interval: String,
}

/// User plus system CPU time of process `pid` so far, in clock ticks (`/proc/<pid>/stat`).
fn cpu_ticks(pid: i32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("").split_whitespace().collect();
    Ok(fields.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + fields.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0))
}

fn ticks_to_us(ticks: u64) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc_sysconf_clk_tck() } as f64;
    ticks as f64 * 1e6 / hz
}

fn idle(args: &Args, seconds: u64) -> Result<Idle> {
    let mut admin = pg(&args.pg)?;
    configure(&mut admin, &[("outbox.enabled", "on"), ("outbox.workers", "1")])?;
    // Whatever earlier scenarios left must be published first, or "idle" would measure a drain.
    wait_until(Duration::from_secs(300), || {
        let left: i64 = admin.query_one("SELECT pending + publishing FROM outbox.stats", &[])?.get(0);
        Ok(left == 0)
    })?;
    purge_everything(&mut admin)?;
    let pid: i32 =
        admin.query_one("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay'", &[])?.get(0);
    let poll_interval: String = admin.query_one("SHOW outbox.poll_interval", &[])?.get(0);
    // Let it settle into its idle rhythm.
    std::thread::sleep(Duration::from_secs(3));
    let xacts = |admin: &mut postgres::Client| -> Result<i64> {
        Ok(admin
            .query_one(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()",
                &[],
            )?
            .get(0))
    };
    admin.batch_execute("SELECT pg_stat_clear_snapshot()")?;
    let (ticks_before, xacts_before) = (cpu_ticks(pid)?, xacts(&mut admin)?);
    std::thread::sleep(Duration::from_secs(seconds));
    admin.batch_execute("SELECT pg_stat_clear_snapshot()")?;
    let (ticks_after, xacts_after) = (cpu_ticks(pid)?, xacts(&mut admin)?);
    Ok(Idle {
        seconds,
        cpu_ms: ticks_to_us(ticks_after - ticks_before) / 1000.0,
        // Minus this session's own two snapshot-clearing transactions and the counter reads.
        transactions: (xacts_after - xacts_before - 3).max(0),
        poll_interval,
    })
}

unsafe fn libc_sysconf_clk_tck() -> i64 {
    extern "C" {
        fn sysconf(name: i32) -> i64;
    }
    // _SC_CLK_TCK is 2 on Linux.
    unsafe { sysconf(2) }
}

// ------------------------------------------------------------------------------------------------
// Drain only: the drain figures side by side, for a quick comparison of two builds on one day.
// ------------------------------------------------------------------------------------------------

/// One worker, the one-aggregate backlog, and the external relay with one and two processes, each
/// twice (the second run shows the spread); printed, not written to the results.
fn drain_only(args: &Args) -> Result<()> {
    let events = if args.quick { 20_000 } else { 100_000 };
    let mut admin = pg(&args.pg)?;
    admin.batch_execute(SEED_OUTBOX_DDL)?;
    for round in 1..=2 {
        let one = drain_in_server(args, events, 10_000, 1)?;
        let single = drain_in_server(args, events, 1, 1)?;
        configure(&mut admin, &[("outbox.enabled", "off")])?;
        let external: Vec<Drain> = [1, 2]
            .into_iter()
            .map(|processes| drain_baseline(args, events, 10_000, processes))
            .collect::<Result<_>>()?;
        let best = external.iter().map(|d| d.events_per_s).fold(0.0, f64::max);
        eprintln!(
            "round {round}: 1 worker {:.0}/s ({:.1} µs/event, Redis {:.1} µs/event), one aggregate {:.0}/s, external 1/2 {:.0}/{:.0}/s ({:.1} µs/event); 1 worker / best external {:.2}x",
            one.events_per_s,
            one.cpu_us_per_event,
            one.redis_cpu_us_per_event.unwrap_or(f64::NAN),
            single.events_per_s,
            external[0].events_per_s,
            external[1].events_per_s,
            external[0].cpu_us_per_event,
            one.events_per_s / best
        );
    }
    Ok(())
}

/// `BENCH_MODE=payload`: one worker's drain of 2 KiB and 16 KiB payloads, twice, for an A/B of
/// what the relay does per byte (the external relay, which two builds do not change, is left out).
fn payload_only(args: &Args) -> Result<()> {
    let sizes: [(usize, i64); 2] =
        if args.quick { [(2048, 10_000), (16384, 2_000)] } else { [(2048, 50_000), (16384, 10_000)] };
    for round in 1..=2 {
        for (bytes, events) in sizes {
            let drain = drain_in_server_with(args, events, 10_000, 1, &scale::padded_payload(bytes))?;
            eprintln!(
                "round {round}: {events} events of {bytes}-byte payloads, 1 worker {:.0}/s ({:.1} MB/s, relay {:.1} µs/event)",
                drain.events_per_s,
                drain.events_per_s * bytes as f64 / 1e6,
                drain.cpu_us_per_event
            );
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Sustained: the latency scenario minute after minute, with the outbox's size after each minute.
// ------------------------------------------------------------------------------------------------

fn sustained(args: &Args) -> Result<()> {
    let mut admin = pg(&args.pg)?;
    admin.batch_execute(PAYMENTS_DDL)?;
    let retention = match &args.retention {
        Some(retention) => {
            configure(&mut admin, &[("outbox.retention", retention)])?;
            format!("outbox.retention = {retention}")
        }
        None => "default retention (7 days: nothing is deleted yet)".to_string(),
    };
    let minutes = args.minutes.unwrap_or(5);
    let command = command_line(args);
    let mut md = format!(
        "# Sustained run: {} events/s for {} minutes\n\nMade with `{command}`.\n\n{}, {retention}.\n\n",
        args.rate,
        minutes,
        machine_facts(&mut admin)?
    );
    let windows = windows(args, &mut admin, args.rate, minutes, 60, (args.rate / 500).max(4), &mut md)?;
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(format!("{}/sustained.md", args.out), md)?;
    std::fs::write(format!("{}/sustained.json", args.out), serde_json::to_string_pretty(&windows_json(&windows))?)?;
    eprintln!("wrote {0}/sustained.md, {0}/sustained.json", args.out);
    Ok(())
}

const PAYMENTS_DDL: &str =
    "CREATE TABLE IF NOT EXISTS bench_payments (id bigserial PRIMARY KEY, payer text NOT NULL,
                                                amount numeric(12,2) NOT NULL, created_at timestamptz NOT NULL DEFAULT now())";

/// One window of a sustained run.
struct Window {
    events: usize,
    missing: usize,
    achieved: f64,
    p50: f64,
    p99: f64,
    max: f64,
    size: String,
    size_bytes: i64,
    dead: i64,
    pending: i64,
    relay_rss_kb: u64,
}

/// `count` windows of `seconds` of the latency scenario at `rate` events/s from `producers`
/// connections, each followed by the outbox's size, its dead tuples, what is pending
/// (`outbox.stats`) and the relay's memory; a table row each appended to `md`.
fn windows(
    args: &Args,
    admin: &mut postgres::Client,
    rate: u32,
    count: u32,
    seconds: u32,
    producers: u32,
    md: &mut String,
) -> Result<Vec<Window>> {
    md.push_str(
        "| window | events | achieved events/s | p50 | p99 | max | outbox size (log, journal, failure path) | dead tuples in the log | pending at end | relay RssAnon |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut rows = Vec::new();
    for minute in 1..=count {
        let window_started = Instant::now();
        let window = latency_with(args, Peer::OutboxPg, rate, seconds, producers)?;
        // Producers that fall behind their schedule catch up at full speed, so a window that the
        // machine cannot sustain takes longer than planned: report the rate actually reached.
        let achieved = window.samples_ms.len() as f64 / window_started.elapsed().as_secs_f64();
        admin.batch_execute("SELECT pg_stat_clear_snapshot()")?;
        let row = admin.query_one(
            "SELECT (SELECT sum(pg_total_relation_size(t::regclass)) FROM unnest(ARRAY['outbox.events_0', 'outbox.events_1', 'outbox.events_2', 'outbox.held', 'outbox.journal_0', 'outbox.journal_1', 'outbox.journal_2']) t)::bigint,
                    (SELECT sum(pg_stat_get_dead_tuples(t::regclass)) FROM unnest(ARRAY['outbox.events_0', 'outbox.events_1', 'outbox.events_2', 'outbox.held']) t)::bigint,
                    (SELECT pending FROM outbox.stats)",
            &[],
        )?;
        let (size_bytes, dead, pending): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        let size: String = admin.query_one("SELECT pg_size_pretty($1::bigint)", &[&size_bytes])?.get(0);
        let relay_rss_kb = relay_pids(admin)?.first().map_or(0, |&pid| outbox_testkit::rss_kb(pid));
        let (p50, p99) = (percentile(&window.samples_ms, 50.0), percentile(&window.samples_ms, 99.0));
        let max = window.samples_ms.last().copied().unwrap_or(f64::NAN);
        eprintln!("window {minute}: {achieved:.0} events/s, p50 {p50:.2} ms, p99 {p99:.2} ms, size {size}, dead {dead}, pending {pending}, relay {relay_rss_kb} kB");
        md.push_str(&format!(
            "| {minute} | {} | {achieved:.0} | {p50:.2} ms | {p99:.2} ms | {max:.2} ms | {size} | {dead} | {pending} | {} kB |\n",
            window.samples_ms.len(),
            grouped(relay_rss_kb as f64)
        ));
        rows.push(Window {
            events: window.samples_ms.len(),
            missing: window.missing,
            achieved,
            p50,
            p99,
            max,
            size,
            size_bytes,
            dead,
            pending,
            relay_rss_kb,
        });
    }
    Ok(rows)
}

fn windows_json(rows: &[Window]) -> serde_json::Value {
    rows.iter()
        .enumerate()
        .map(|(i, w)| {
            serde_json::json!({"minute": i + 1, "events": w.events, "achieved_per_s": w.achieved, "missing": w.missing,
                               "p50_ms": w.p50, "p99_ms": w.p99, "max_ms": w.max, "size": w.size, "size_bytes": w.size_bytes,
                               "dead_tuples": w.dead, "pending_at_end": w.pending, "relay_rss_anon_kb": w.relay_rss_kb})
        })
        .collect()
}

/// `BENCH_MODE=steady` (issue 39): the producers' ceiling (the latency scenario asked for 10,000
/// events/s), then ten one-minute windows at 75% of it, with a retention short enough for the
/// log's steady state to show (`--retention`, default 2min); written to steady.md and steady.json
/// with the targets: every window's p99 ≤ 15 ms, nothing pending at any window's end, and the log's
/// size and the relay's memory flat (the second half's largest at most 1.2× the first half's).
fn steady(args: &Args) -> Result<()> {
    let mut admin = pg(&args.pg)?;
    admin.batch_execute(PAYMENTS_DDL)?;
    let retention = args.retention.clone().unwrap_or_else(|| if args.quick { "20s" } else { "2min" }.into());
    configure(&mut admin, &[("outbox.retention", &retention)])?;
    let (probe_s, count, seconds) = if args.quick { (5, 4, 15) } else { (20, args.minutes.unwrap_or(10), 60) };
    // The same producers for the ceiling and the run: fewer could not reach 75% of it.
    let producers = 10_000 / 500;
    eprintln!("== the producers' ceiling: 10,000 events/s asked for {probe_s} s from {producers} connections");
    let ceiling = latency_with(args, Peer::OutboxPg, 10_000, probe_s, producers)?.achieved_rate();
    let rate = (ceiling * 0.75).round() as u32;
    eprintln!("   reached {ceiling:.0} events/s; running at {rate} events/s, {count} windows of {seconds} s");
    let mut md = format!(
        "# Steady run: 75% of the producers' ceiling for {count} windows of {seconds} s\n\nMade with `{}`.\n\n{}, \
         outbox.retention = {retention}. The producers' ceiling: {} events/s reached when 10,000 were asked for {probe_s} s \
         (the latency scenario's producers, {producers} connections: INSERT a payment + `outbox_enqueue`, one event \
         a transaction); 75%: {rate} events/s asked from the same connections.\n\n",
        command_line(args),
        machine_facts(&mut admin)?,
        grouped(ceiling)
    );
    if args.quick {
        md.push_str("**Quick run**: short windows; a smoke test, not the figures.\n\n");
    }
    let rows = windows(args, &mut admin, rate, count, seconds, producers, &mut md)?;
    let half = rows.len() / 2;
    let flat = |value: &dyn Fn(&Window) -> f64| {
        let first = rows[..half.max(1)].iter().map(value).fold(0.0, f64::max);
        let second = rows[half..].iter().map(value).fold(0.0, f64::max);
        (first, second, second <= 1.2 * first)
    };
    let worst_p99 = rows.iter().map(|w| w.p99).fold(0.0, f64::max);
    let pending = rows.iter().map(|w| w.pending + w.missing as i64).max().unwrap_or(0);
    let (size_first, size_second, size_flat) = flat(&|w| w.size_bytes as f64);
    let (rss_first, rss_second, rss_flat) = flat(&|w| w.relay_rss_kb as f64);
    let yes = |met: bool| if met { "yes" } else { "**no**" };
    md.push_str(&format!(
        "\n| target | result | met? |\n|---|---|---|\n\
         | every window's p99 ≤ 15 ms | largest {worst_p99:.2} ms | {} |\n\
         | nothing pending at any window's end (`outbox.stats`, after the window's entries arrived; missing entries counted) | at most {pending} | {} |\n\
         | log size flat: the second half's largest ≤ 1.2× the first half's | {:.1} MB, then {:.1} MB | {} |\n\
         | relay memory flat: the same rule for its RssAnon | {} kB, then {} kB | {} |\n",
        yes(worst_p99 <= 15.0),
        yes(pending == 0),
        size_first / 1e6,
        size_second / 1e6,
        yes(size_flat),
        grouped(rss_first),
        grouped(rss_second),
        yes(rss_flat),
    ));
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(format!("{}/steady.md", args.out), &md)?;
    let json = serde_json::json!({"command": command_line(args), "quick": args.quick, "ceiling_per_s": ceiling, "rate_per_s": rate,
                                  "retention": retention, "window_s": seconds, "windows": windows_json(&rows),
                                  "worst_p99_ms": worst_p99, "max_pending_at_end": pending,
                                  "size_flat": size_flat, "relay_rss_flat": rss_flat});
    std::fs::write(format!("{}/steady.json", args.out), serde_json::to_string_pretty(&json)?)?;
    eprintln!("{md}\nwrote {0}/steady.md, {0}/steady.json", args.out);
    Ok(())
}

/// `BENCH_MODE=cdc`: issue 39's comparison alone (outbox_pg's one-worker drain, the polling relay's
/// one- and two-process drains, outbox_pg's latency, the WAL per event, then the CDC relay's
/// scenarios), written to cdc.md and cdc.json.
fn cdc_only(args: &Args) -> Result<()> {
    let sizes = designs::Sizes::of(args.quick);
    let (wal_events, wal_aggregates) = if args.quick { (2_000, 200) } else { (20_000, 2_000) };
    let mut admin = pg(&args.pg)?;
    admin.batch_execute(PAYMENTS_DDL)?;
    admin.batch_execute(SEED_OUTBOX_DDL)?;
    let machine = machine_facts(&mut admin)?;
    eprintln!("== latency at 1,000 events/s for {} s, outbox_pg", sizes.latency_s);
    let lat = latency(args, 1000, sizes.latency_s)?;
    eprintln!("== drain {} events: outbox_pg 1 worker, polling relay 1 and 2 processes", sizes.drain_events);
    let outbox = drain_in_server(args, sizes.drain_events, 10_000, 1)?;
    configure(&mut admin, &[("outbox.enabled", "off")])?;
    let polling = [1, 2]
        .into_iter()
        .map(|processes| drain_baseline(args, sizes.drain_events, 10_000, processes))
        .collect::<Result<Vec<_>>>()?;
    eprintln!(
        "   outbox_pg {:.0}/s, polling {:.0}/{:.0}/s",
        outbox.events_per_s, polling[0].events_per_s, polling[1].events_per_s
    );
    eprintln!("== WAL per event: {wal_events} events, three designs");
    let wal = wal_per_event(args, wal_events, wal_aggregates, 100)?;
    let comparison = designs::compare(args, &sizes)?;
    let mut md =
        format!("# outbox_pg against a CDC relay\n\nMade with `{}`.\n\nMachine: {machine}.\n\n", command_line(args));
    if args.quick {
        md.push_str("**Quick run**: smaller backlogs and shorter runs; a smoke test, not the figures.\n\n");
    }
    md.push_str(&designs::section(
        &comparison,
        &designs::Context {
            batch: args.batch,
            drain_events: sizes.drain_events,
            outbox_drain: &outbox,
            polling_drains: &polling,
            outbox_latency: &lat,
            wal: &wal,
        },
    ));
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(format!("{}/cdc.md", args.out), &md)?;
    let json = serde_json::json!({"command": command_line(args), "machine": machine, "quick": args.quick,
                                  "outbox_pg_drain": drain_json(&outbox, "workers"),
                                  "polling_drains": polling.iter().map(|d| drain_json(d, "processes")).collect::<Vec<_>>(),
                                  "wal": {"outbox_pg": wal_json(&wal.outbox, wal.events), "seeds": wal_json(&wal.seeds, wal.events),
                                          "cdc": wal_json(&wal.cdc, wal.events)},
                                  "designs": designs::json(&comparison)});
    std::fs::write(format!("{}/cdc.json", args.out), serde_json::to_string_pretty(&json)?)?;
    eprintln!("{md}\nwrote {0}/cdc.md, {0}/cdc.json", args.out);
    Ok(())
}

/// `BENCH_MODE=outside` (issue 37, step 5): the outside relay's figures beside the in-server
/// worker's and the seeds' relay's, measured in this run: latency at 1,000 events/s, the drain with
/// 1 and 2 processes of each relay (1 worker), and the enqueue ratio. Written to
/// `outside.md` and `outside.json`.
fn outside_only(args: &Args) -> Result<()> {
    let (latency_s, drain_events, tps_s) = if args.quick { (3, 20_000, 3) } else { (15, 100_000, 10) };
    let mut admin = pg(&args.pg)?;
    admin.batch_execute(PAYMENTS_DDL)?;
    admin.batch_execute(SEED_OUTBOX_DDL)?;
    let machine = machine_facts(&mut admin)?;
    eprintln!("== latency at 1,000 events/s for {latency_s} s: in-server worker, then the seeds' relay");
    let worker_latency = latency(args, 1000, latency_s)?;
    let polling_latency = latency_of(args, Peer::Polling, 1000, latency_s)?;
    eprintln!(
        "   worker p50/p99 {:.2}/{:.2} ms, seeds' relay {:.2}/{:.2} ms",
        percentile(&worker_latency.samples_ms, 50.0),
        percentile(&worker_latency.samples_ms, 99.0),
        percentile(&polling_latency.samples_ms, 50.0),
        percentile(&polling_latency.samples_ms, 99.0)
    );
    eprintln!("== drain {drain_events} events over 10,000 aggregates: 1 worker, seeds' relay 1/2 processes");
    let worker_drain = drain_in_server(args, drain_events, 10_000, 1)?;
    configure(&mut admin, &[("outbox.enabled", "off")])?;
    let polling_drains =
        [1, 2].into_iter().map(|n| drain_baseline(args, drain_events, 10_000, n)).collect::<Result<Vec<_>>>()?;
    eprintln!(
        "   worker {:.0}/s, seeds' relay {:.0}/{:.0}/s",
        worker_drain.events_per_s, polling_drains[0].events_per_s, polling_drains[1].events_per_s
    );
    let measured = outside::measure(args, drain_events, latency_s, tps_s)?;
    let ctx = outside::Context {
        batch: args.batch,
        drain_events,
        worker_drain: &worker_drain,
        polling_drains: &polling_drains,
        worker_latency: &worker_latency,
        polling_latency: Some(&polling_latency),
    };
    let mut md = format!(
        "# outbox_pg: the relay outside the server\n\nMade with `{}`.\n\nMachine: {machine}.\n\n",
        command_line(args)
    );
    if args.quick {
        md.push_str("**Quick run**: smaller backlogs and shorter runs; a smoke test, not the figures.\n\n");
    }
    // What the machine was doing besides (e.g. other sessions' tests), as the one who ran it says.
    if let Ok(note) = std::env::var("BENCH_NOTE") {
        md.push_str(&format!("**Note**: {note}\n\n"));
    }
    md.push_str(&outside::section(&measured, &ctx));
    let json = serde_json::json!({"command": command_line(args), "machine": machine, "quick": args.quick,
                                  "batch_size": args.batch, "outside": outside::json(&measured, &ctx)});
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(format!("{}/outside.md", args.out), &md)?;
    std::fs::write(format!("{}/outside.json", args.out), serde_json::to_string_pretty(&json)?)?;
    eprintln!("{md}\nwrote {0}/outside.md, {0}/outside.json", args.out);
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Report.
// ------------------------------------------------------------------------------------------------

fn histogram_svg(samples_ms: &[f64]) -> String {
    let cap = percentile(samples_ms, 99.9).max(1.0).ceil();
    let buckets = 60usize;
    let width = cap / buckets as f64;
    let mut counts = vec![0usize; buckets];
    for &s in samples_ms {
        counts[((s / width) as usize).min(buckets - 1)] += 1;
    }
    let max = counts.iter().copied().max().unwrap_or(1).max(1) as f64;
    let (w, h, left, bottom) = (720.0, 320.0, 60.0, 40.0);
    let bar_w = (w - left - 20.0) / buckets as f64;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"18\" text-anchor=\"middle\" font-size=\"14\">outbox_pg: commit acknowledged → entry in Redis (n = {})</text>\n",
        w / 2.0,
        samples_ms.len()
    );
    for (i, &c) in counts.iter().enumerate() {
        let bh = (c as f64 / max) * (h - bottom - 40.0);
        svg.push_str(&format!(
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"#3b6ea5\"/>\n",
            left + i as f64 * bar_w,
            h - bottom - bh,
            bar_w * 0.9,
            bh
        ));
    }
    for tick in 0..=5 {
        let x = left + tick as f64 * (w - left - 20.0) / 5.0;
        svg.push_str(&format!(
            "<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{:.2} ms</text>\n",
            h - bottom + 16.0,
            cap * tick as f64 / 5.0
        ));
    }
    for (label, p) in [("p50", 50.0), ("p99", 99.0)] {
        let v = percentile(samples_ms, p);
        let x = left + (v / cap).min(1.0) * (w - left - 20.0);
        svg.push_str(&format!(
            "<line x1=\"{x:.1}\" y1=\"30\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#c0392b\" stroke-dasharray=\"4 3\"/>\n\
             <text x=\"{:.1}\" y=\"42\" fill=\"#c0392b\">{label} {v:.2} ms</text>\n",
            h - bottom,
            x + 4.0
        ));
    }
    svg.push_str(&format!(
        "<text x=\"14\" y=\"{:.1}\" transform=\"rotate(-90 14 {:.1})\" text-anchor=\"middle\">events</text>\n</svg>\n",
        h / 2.0,
        h / 2.0
    ));
    svg
}

/// The command that produced a report: `bench/run.sh` passes its own command line; run directly,
/// the `bench/run.sh` invocation with the same arguments.
fn command_line(args: &Args) -> String {
    if let Ok(command) = std::env::var("BENCH_COMMAND") {
        return command;
    }
    let mut command = String::new();
    if args.command == "sustained" {
        command.push_str(&format!(
            "BENCH_MODE=sustained bash bench/run.sh --rate {} --minutes {}",
            args.rate,
            args.minutes.unwrap_or(5)
        ));
        if let Some(retention) = &args.retention {
            command.push_str(&format!(" --retention {retention}"));
        }
    } else if matches!(args.command.as_str(), "steady" | "cdc" | "outside") {
        command.push_str(&format!("BENCH_MODE={} bash bench/run.sh", args.command));
    } else {
        command.push_str("bash bench/run.sh");
    }
    if args.quick {
        command.push_str(" --quick");
    }
    if args.batch != 1000 {
        command.push_str(&format!(" --batch {}", args.batch));
    }
    command
}

/// Everything `all` measures, for the report.
struct Results {
    command: String,
    /// `--batch`.
    batch: i32,
    machine: String,
    drain_events: i64,
    lat: Latency,
    /// 10,000 aggregates; 1, 2 and 4 workers.
    in_server: Vec<Drain>,
    /// One aggregate, one worker.
    one_aggregate: Drain,
    /// 10,000 aggregates; 1, 2 and 4 processes.
    baseline: Vec<Drain>,
    /// One aggregate, one process.
    one_aggregate_baseline: Drain,
    /// One worker, spread streams: into the single node, and into the cluster (if one was given).
    topology: Option<(Drain, Drain)>,
    wal: Wal,
    tps_off: Tps,
    tps_on: Tps,
    idle: Idle,
    /// Latency at 10,000 events/s (or what the producers reached).
    lat_10k: Latency,
    /// Drains of 2 KiB and 16 KiB payloads.
    payloads: Vec<scale::PayloadDrain>,
    /// One transaction of a million events, and its replay.
    large: scale::LargeTransaction,
    /// Issue 39: the CDC relay, the writers' cost of each relay, the slot's retained WAL.
    designs: designs::Comparison,
    /// Issue 37: the relay outside the server.
    outside: outside::Outside,
}

fn run_all(args: &Args) -> Result<()> {
    let (latency_seconds, drain_events, tps_seconds, idle_seconds, wal_events, wal_aggregates) =
        if args.quick { (3, 20_000, 3, 3, 2_000, 200) } else { (15, 100_000, 10, 10, 20_000, 2_000) };
    let (large_events, payload_events) =
        if args.quick { (100_000, [5_000, 1_000]) } else { (1_000_000, [50_000, 10_000]) };
    let mut admin = pg(&args.pg)?;
    admin.batch_execute(PAYMENTS_DDL)?;
    admin.batch_execute(SEED_OUTBOX_DDL)?;
    let machine = machine_facts(&mut admin)?;

    eprintln!("== latency at 1,000 events/s for {latency_seconds} s");
    let lat = latency(args, 1000, latency_seconds)?;
    eprintln!("== latency at 10,000 events/s for {latency_seconds} s");
    let lat_10k = latency(args, 10_000, latency_seconds)?;
    eprintln!("   reached {:.0} events/s", lat_10k.achieved_rate());
    eprintln!("== drain {drain_events} events over 10,000 aggregates, in-server relay, 1/2/4 workers");
    let mut in_server = Vec::new();
    for workers in [1, 2, 4] {
        let drain = drain_in_server(args, drain_events, 10_000, workers)?;
        eprintln!(
            "   {workers} worker(s): {:.0} events/s, relay CPU {:.1} µs/event",
            drain.events_per_s, drain.cpu_us_per_event
        );
        in_server.push(drain);
    }
    // A burst for one aggregate: every event has its predecessor in the batch or delivered.
    eprintln!("== drain {drain_events} events of one aggregate, one worker");
    let one_aggregate = drain_in_server(args, drain_events, 1, 1)?;
    eprintln!("   {:.0} events/s", one_aggregate.events_per_s);
    configure(&mut admin, &[("outbox.enabled", "off"), ("outbox.workers", "1")])?;
    eprintln!("== drain {drain_events} events over 10,000 aggregates, external relay (seeds' design), 1/2/4 processes");
    let mut baseline = Vec::new();
    for processes in [1, 2, 4] {
        let drain = drain_baseline(args, drain_events, 10_000, processes)?;
        eprintln!(
            "   {processes} process(es): {:.0} events/s, CPU {:.1} µs/event",
            drain.events_per_s, drain.cpu_us_per_event
        );
        baseline.push(drain);
    }
    eprintln!("== drain {drain_events} events of one aggregate, external relay, one process");
    let one_aggregate_baseline = drain_baseline(args, drain_events, 1, 1)?;
    eprintln!("   {:.0} events/s", one_aggregate_baseline.events_per_s);
    let topology = match &args.cluster {
        Some(seeds) => {
            eprintln!("== drain {drain_events} events over {SPREAD_STREAMS} streams, one worker: single node, then a three-master cluster");
            let single = drain_topology(args, drain_events, None)?;
            let cluster = drain_topology(args, drain_events, Some(seeds))?;
            eprintln!(
                "   single node {:.0} events/s, cluster {:.0} events/s",
                single.events_per_s, cluster.events_per_s
            );
            Some((single, cluster))
        }
        None => None,
    };
    let mut payloads = Vec::new();
    for (bytes, events) in [2048, 16384].into_iter().zip(payload_events) {
        eprintln!(
            "== drain {events} events of {bytes}-byte payloads: outbox_pg 1 worker, external relay 1/2 processes"
        );
        let drain = scale::payload_drain(args, events, bytes)?;
        eprintln!(
            "   outbox_pg {:.0} events/s ({:.1} MB/s), external {:.0} events/s ({:.1} MB/s)",
            drain.ours.events_per_s,
            drain.mb_per_s(&drain.ours),
            drain.external.events_per_s,
            drain.mb_per_s(&drain.external)
        );
        payloads.push(drain);
    }
    eprintln!("== one transaction of {large_events} events, then its replay");
    let large = scale::large_transaction(args, large_events)?;
    eprintln!(
        "   first entry {:.0} ms after the commit, all in {:.1} s; relay {} kB at rest, {} kB at most; replay {:.1} s, {} kB at most",
        large.first_entry_ms, large.publish_s, large.rss_rest_kb, large.rss_peak_kb, large.replay_s, large.replay_rss_peak_kb
    );
    eprintln!("== WAL per event: {wal_events} events over {wal_aggregates} aggregates, outbox_pg and the seeds' path");
    let wal = wal_per_event(args, wal_events, wal_aggregates, 100)?;
    eprintln!(
        "   outbox_pg {:.0} B/event, seeds {:.0} B/event",
        wal.outbox.total() as f64 / wal.events as f64,
        wal.seeds.total() as f64 / wal.events as f64
    );
    eprintln!("== enqueue cost (pgbench, 4 clients, {tps_seconds} s per run, median of 3)");
    let tps_off = enqueue_cost(args, tps_seconds, false)?;
    let tps_on = enqueue_cost(args, tps_seconds, true)?;
    eprintln!("   relay paused {:.1}%, running {:.1}%", 100.0 * tps_off.ratio(), 100.0 * tps_on.ratio());
    let designs = designs::compare(args, &designs::Sizes::of(args.quick))?;
    let outside = outside::measure(args, drain_events, latency_seconds, tps_seconds)?;
    eprintln!("== idle for {idle_seconds} s");
    let idle = idle(args, idle_seconds)?;
    purge_everything(&mut admin)?;
    admin.batch_execute("TRUNCATE bench_payments, bench_seed_outbox")?;

    write_report(
        args,
        &Results {
            command: command_line(args),
            batch: args.batch,
            machine,
            drain_events,
            lat,
            in_server,
            one_aggregate,
            baseline,
            one_aggregate_baseline,
            topology,
            wal,
            tps_off,
            tps_on,
            idle,
            lat_10k,
            payloads,
            large,
            designs,
            outside,
        },
    )
}

fn machine_facts(admin: &mut postgres::Client) -> Result<String> {
    let version: String = admin.query_one("SHOW server_version", &[])?.get(0);
    let fsync: String = admin.query_one("SHOW fsync", &[])?.get(0);
    let sync_commit: String = admin.query_one("SHOW synchronous_commit", &[])?.get(0);
    let wal_level: String = admin.query_one("SHOW wal_level", &[])?.get(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    Ok(format!(
        "{cores} cores ({cpu}), PostgreSQL {version} (fsync = {fsync}, synchronous_commit = {sync_commit}, wal_level = {wal_level}), Redis on loopback"
    ))
}

/// `n` rounded, with thousands separated by commas.
fn grouped(n: f64) -> String {
    let digits = format!("{:.0}", n.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0.0 && digits != "0" {
        out.insert(0, '-');
    }
    out
}

/// "1 worker", "2 workers"; "1 process", "4 processes".
fn plural(n: usize, noun: &str) -> String {
    match (n, noun.ends_with('s')) {
        (1, _) => format!("1 {noun}"),
        (_, true) => format!("{n} {noun}es"),
        (_, false) => format!("{n} {noun}s"),
    }
}

/// One row of the targets table.
struct Target {
    figure: String,
    result: String,
    target: &'static str,
    /// `None` when the row has no target of its own.
    met: Option<bool>,
}

/// The targets of issue 12, each with this run's figure.
fn targets(r: &Results) -> Vec<Target> {
    let (p50, p99) = (percentile(&r.lat.samples_ms, 50.0), percentile(&r.lat.samples_ms, 99.0));
    let one_worker = r.in_server[0].events_per_s;
    let (polling_rate, polling_processes) = r
        .baseline
        .iter()
        .max_by(|a, b| a.events_per_s.total_cmp(&b.events_per_s))
        .map(|d| (d.events_per_s, d.relays))
        .unwrap_or((f64::NAN, 0));
    // Issue 39: the best of the other relays, the CDC relay included.
    let cdc_rate = r.designs.cdc_drain.events_per_s;
    let (best_rate, best_name) = if cdc_rate > polling_rate {
        (cdc_rate, "the CDC relay".to_string())
    } else {
        (polling_rate, format!("the polling relay, {}", plural(polling_processes, "process")))
    };
    let writers = &r.designs.writers;
    let running_over_paused = r.tps_on.ratio() / r.tps_off.ratio();
    let wal_outbox = r.wal.outbox.total() as f64 / r.wal.events as f64;
    let wal_seeds = r.wal.seeds.total() as f64 / r.wal.events as f64;
    let max_pending = r.tps_on.pending_after.iter().copied().max().unwrap_or(0);
    let redis_us = r.in_server[0].redis_cpu_us_per_event.unwrap_or(f64::NAN);
    let mut rows = vec![
        Target {
            figure: "Enqueue ratio, relay paused: TPS of INSERT payment + `outbox_enqueue` ÷ TPS of INSERT payment + \
                     INSERT into the seeds' outbox table"
                .into(),
            result: format!(
                "{:.1}% ({} / {} tps)",
                100.0 * r.tps_off.ratio(),
                grouped(r.tps_off.outbox),
                grouped(r.tps_off.plain)
            ),
            target: "≥ 95%",
            met: Some(r.tps_off.ratio() >= 0.95),
        },
        Target {
            figure: "Enqueue ratio, relay running and keeping up".into(),
            result: format!(
                "{:.1}% ({} / {} tps; at most {} pending after a run)",
                100.0 * r.tps_on.ratio(),
                grouped(r.tps_on.outbox),
                grouped(r.tps_on.plain),
                grouped(max_pending as f64)
            ),
            target: "see next row",
            met: None,
        },
        Target {
            figure: "Enqueue ratio, running ÷ paused (4 clients)".into(),
            result: format!("{running_over_paused:.2}"),
            target: "recorded (issue 39's is the next row)",
            met: None,
        },
        Target {
            figure: format!(
                "Writers' throughput, relay running and keeping up ÷ paused, {} clients: outbox_pg (the polling \
                 relay's, the CDC relay's)",
                designs::WRITERS_CLIENTS
            ),
            result: format!(
                "{:.2} ({} / {} tps; polling {:.2}, CDC {:.2})",
                writers.outbox.ratio(),
                grouped(writers.outbox.running_median()),
                grouped(writers.outbox.paused_median()),
                writers.polling.ratio(),
                writers.cdc.ratio()
            ),
            target: "≥ 0.95",
            met: Some(writers.outbox.ratio() >= 0.95),
        },
        Target {
            figure: format!(
                "Drain, {} pending events over 10,000 aggregates, 1 worker",
                grouped(r.drain_events as f64)
            ),
            result: format!("{} events/s", grouped(one_worker)),
            target: "≥ 100,000 events/s",
            met: Some(one_worker >= 100_000.0),
        },
        Target {
            figure: format!(
                "Drain, 1 worker ÷ best other relay ({best_name}, {} events/s; the polling relay's best {}, the CDC \
                 relay {})",
                grouped(best_rate),
                grouped(polling_rate),
                grouped(cdc_rate)
            ),
            result: format!(
                "{:.2}× (Redis's own CPU, {:.1} µs per event in the 1-worker drain, caps any relay here at about {} \
                 events/s: {:.2}× the best other relay)",
                one_worker / best_rate,
                redis_us,
                grouped(1e6 / redis_us),
                1e6 / redis_us / best_rate
            ),
            target: "≥ 3×",
            met: Some(one_worker / best_rate >= 3.0),
        },
        Target {
            figure: "Drain of a one-aggregate backlog ÷ the 10,000-aggregate one (1 worker)".into(),
            result: format!(
                "{:.2}× ({} events/s)",
                r.one_aggregate.events_per_s / one_worker,
                grouped(r.one_aggregate.events_per_s)
            ),
            target: "≥ 0.5×",
            met: Some(r.one_aggregate.events_per_s / one_worker >= 0.5),
        },
        Target {
            figure: "Latency p50, commit acknowledged → entry in Redis, 1,000 events/s".into(),
            result: format!("{p50:.2} ms"),
            target: "≤ 2 ms",
            met: Some(p50 <= 2.0),
        },
        Target {
            figure: "Latency p99, same run".into(),
            result: format!("{p99:.2} ms"),
            target: "≤ 15 ms",
            met: Some(p99 <= 15.0),
        },
        Target {
            figure: "WAL per event over enqueue + relay + retention, outbox_pg ÷ the seeds' path".into(),
            result: format!(
                "{:.2}× ({} B against {} B)",
                wal_outbox / wal_seeds,
                grouped(wal_outbox),
                grouped(wal_seeds)
            ),
            target: "≤ 1.5×",
            met: Some(wal_outbox / wal_seeds <= 1.5),
        },
        // Issue 26.
        Target {
            figure: "Drain, 1 worker ÷ what Redis alone takes on this machine (1 ÷ Redis's CPU per event, same drain)"
                .into(),
            result: format!(
                "{:.0}% ({} of {} events/s)",
                100.0 * one_worker * redis_us / 1e6,
                grouped(one_worker),
                grouped(1e6 / redis_us)
            ),
            target: "≥ 70%",
            met: Some(one_worker * redis_us / 1e6 >= 0.70),
        },
        Target {
            figure: "Relay CPU per event, 10,000-aggregate drain, 1 worker".into(),
            result: format!("{:.1} µs", r.in_server[0].cpu_us_per_event),
            target: "≤ 5 µs",
            met: Some(r.in_server[0].cpu_us_per_event <= 5.0),
        },
        Target {
            figure: format!(
                "One transaction of {} events: relay's private memory at its peak over at rest",
                grouped(r.large.events as f64)
            ),
            result: format!(
                "+{} kB ({} → {} kB); first entry {:.0} ms after the commit, all in {:.1} s",
                grouped(r.large.rss_peak_kb.saturating_sub(r.large.rss_rest_kb) as f64),
                grouped(r.large.rss_rest_kb as f64),
                grouped(r.large.rss_peak_kb as f64),
                r.large.first_entry_ms,
                r.large.publish_s
            ),
            target: "flat (a few rounds' worth); first entries within 1 s",
            met: Some(
                r.large.rss_peak_kb.saturating_sub(r.large.rss_rest_kb) < 128 * 1024
                    && r.large.first_entry_ms <= 1000.0,
            ),
        },
        Target {
            figure: format!("Replay of those {} events into another stream", grouped(r.large.events as f64)),
            result: format!(
                "{} events/s; relay's private memory at most {} kB",
                grouped(r.large.events as f64 / r.large.replay_s),
                grouped(r.large.replay_rss_peak_kb as f64)
            ),
            target: "memory flat",
            met: Some(r.large.replay_rss_peak_kb.saturating_sub(r.large.rss_rest_kb) < 128 * 1024),
        },
        Target {
            figure: format!(
                "Latency at {} events/s asked (producers reached {})",
                grouped(r.lat_10k.rate as f64),
                grouped(r.lat_10k.achieved_rate())
            ),
            result: format!(
                "p50 {:.2} ms, p99 {:.2} ms",
                percentile(&r.lat_10k.samples_ms, 50.0),
                percentile(&r.lat_10k.samples_ms, 99.0)
            ),
            target: "recorded",
            met: None,
        },
    ];
    // Issue 37: the relay outside the server.
    rows.extend(
        outside::targets(&r.outside, &outside_context(r)).into_iter().map(|(figure, result, target, met)| Target {
            figure,
            result,
            target,
            met: Some(met),
        }),
    );
    rows
}

/// What the outside relay's figures are set beside in the full run.
fn outside_context(r: &Results) -> outside::Context<'_> {
    outside::Context {
        batch: r.batch,
        drain_events: r.drain_events,
        worker_drain: &r.in_server[0],
        polling_drains: &r.baseline,
        worker_latency: &r.lat,
        polling_latency: Some(&r.designs.polling_latency),
    }
}

fn drain_json(drain: &Drain, unit: &str) -> serde_json::Value {
    let mut value = serde_json::json!({
        "events_per_s": drain.events_per_s,
        "cpu_us_per_event": drain.cpu_us_per_event,
        "dead_tuples": drain.dead_tuples,
        "total_bytes": drain.total_bytes,
    });
    value[unit] = serde_json::json!(drain.relays);
    if let Some(redis) = drain.redis_cpu_us_per_event {
        value["redis_cpu_us_per_event"] = serde_json::json!(redis);
    }
    if let Some(client) = drain.client_cpu_us_per_event {
        value["client_process_cpu_us_per_event"] = serde_json::json!(client);
        value["backend_cpu_us_per_event"] = serde_json::json!(drain.cpu_us_per_event - client);
    }
    value
}

fn tps_json(tps: &Tps) -> serde_json::Value {
    serde_json::json!({"plain_insert": tps.plain, "outbox_enqueue": tps.outbox, "ratio": tps.ratio(),
                       "plain_insert_runs": tps.plain_runs, "outbox_enqueue_runs": tps.outbox_runs,
                       "pending_after_outbox_runs": tps.pending_after})
}

fn wal_json(path: &WalPath, events: i64) -> serde_json::Value {
    serde_json::json!({"enqueue_bytes": path.enqueue, "relay_bytes": path.relay, "retention_bytes": path.retention,
                       "total_bytes": path.total(), "bytes_per_event": path.total() as f64 / events as f64,
                       "enqueue_bytes_per_event": path.enqueue as f64 / events as f64})
}

fn write_report(args: &Args, r: &Results) -> Result<()> {
    std::fs::create_dir_all(&args.out)?;
    let lat = &r.lat;
    let (p50, p90, p99, max) = (
        percentile(&lat.samples_ms, 50.0),
        percentile(&lat.samples_ms, 90.0),
        percentile(&lat.samples_ms, 99.0),
        lat.samples_ms.last().copied().unwrap_or(f64::NAN),
    );
    let best_baseline = r.baseline.iter().map(|d| d.events_per_s).fold(0.0, f64::max);
    let one_worker = r.in_server[0].events_per_s;
    let targets = targets(r);
    let per_event = |bytes: i64| bytes as f64 / r.wal.events as f64;
    let json = serde_json::json!({
        "command": r.command,
        "machine": r.machine,
        "quick": args.quick,
        "batch_size": args.batch,
        "targets": targets.iter().map(|t| serde_json::json!({"figure": t.figure, "result": t.result, "target": t.target, "met": t.met}))
            .collect::<Vec<_>>(),
        "latency": {"rate_per_s": lat.rate, "seconds": lat.seconds, "samples": lat.samples_ms.len(), "missing": lat.missing,
                    "p50_ms": p50, "p90_ms": p90, "p99_ms": p99, "max_ms": max},
        "drain": {
            "events": r.drain_events,
            "aggregates": 10_000,
            "in_server": r.in_server.iter().map(|d| drain_json(d, "workers")).collect::<Vec<_>>(),
            "external_relay": r.baseline.iter().map(|d| drain_json(d, "processes")).collect::<Vec<_>>(),
            "ratio_one_worker_vs_best_external": one_worker / best_baseline,
            "one_aggregate": {
                "in_server_one_worker": drain_json(&r.one_aggregate, "workers"),
                "external_one_process": drain_json(&r.one_aggregate_baseline, "processes"),
                "ratio_vs_10000_aggregates": r.one_aggregate.events_per_s / one_worker,
            },
        },
        "topology": r.topology.as_ref().map(|(single, cluster)| serde_json::json!({
            "streams": SPREAD_STREAMS,
            "single_node": drain_json(single, "workers"),
            "cluster_three_masters": drain_json(cluster, "workers"),
            "ratio": cluster.events_per_s / single.events_per_s,
        })),
        "enqueue_tps": {"relay_off": tps_json(&r.tps_off), "relay_on": tps_json(&r.tps_on),
                        "running_over_paused": r.tps_on.ratio() / r.tps_off.ratio()},
        "wal": {"events": r.wal.events, "aggregates": r.wal.aggregates, "events_per_transaction": r.wal.per_transaction,
                "outbox_pg": wal_json(&r.wal.outbox, r.wal.events), "seeds": wal_json(&r.wal.seeds, r.wal.events),
                "cdc": wal_json(&r.wal.cdc, r.wal.events),
                "ratio": per_event(r.wal.outbox.total()) / per_event(r.wal.seeds.total()),
                "plain_insert_bytes_per_event": per_event(r.wal.seeds.enqueue)},
        "designs": designs::json(&r.designs),
        "outside": outside::json(&r.outside, &outside_context(r)),
        "idle": {"seconds": r.idle.seconds, "relay_cpu_ms": r.idle.cpu_ms, "transactions": r.idle.transactions,
                 "poll_interval": r.idle.poll_interval},
        "latency_10k": {"rate_per_s": r.lat_10k.rate, "reached_per_s": r.lat_10k.achieved_rate(),
                        "samples": r.lat_10k.samples_ms.len(), "missing": r.lat_10k.missing,
                        "p50_ms": percentile(&r.lat_10k.samples_ms, 50.0), "p99_ms": percentile(&r.lat_10k.samples_ms, 99.0),
                        "max_ms": r.lat_10k.samples_ms.last().copied().unwrap_or(f64::NAN)},
        "payload_drains": r.payloads.iter().map(|p| serde_json::json!({
            "payload_bytes": p.payload_bytes, "events": p.events,
            "outbox_pg": drain_json(&p.ours, "workers"), "outbox_pg_mb_per_s": p.mb_per_s(&p.ours),
            "external_best": drain_json(&p.external, "processes"), "external_mb_per_s": p.mb_per_s(&p.external),
        })).collect::<Vec<_>>(),
        "large_transaction": {"events": r.large.events, "enqueue_s": r.large.enqueue_s,
                              "first_entry_after_commit_ms": r.large.first_entry_ms, "published_in_s": r.large.publish_s,
                              "relay_rss_anon_rest_kb": r.large.rss_rest_kb, "relay_rss_anon_peak_kb": r.large.rss_peak_kb,
                              "replay_s": r.large.replay_s, "replay_events_per_s": r.large.events as f64 / r.large.replay_s,
                              "replay_relay_rss_anon_peak_kb": r.large.replay_rss_peak_kb},
    });
    std::fs::write(format!("{}/results.json", args.out), serde_json::to_string_pretty(&json)?)?;
    std::fs::write(format!("{}/latency.svg", args.out), histogram_svg(&lat.samples_ms))?;

    let mut md = format!("# outbox_pg benchmark\n\nMade with `{}`.\n\nMachine: {}.\n\n", r.command, r.machine);
    if args.quick {
        md.push_str(
            "**Quick run**: smaller backlogs and shorter runs than the targets are defined for; a smoke test, \
             not the figures.\n\n",
        );
    }
    md.push_str("## Targets (issues 12, 26, 37 and 39)\n\n| figure | result | target | met? |\n|---|---|---|---|\n");
    for t in &targets {
        let met = match t.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "—",
        };
        md.push_str(&format!("| {} | {} | {} | {met} |\n", t.figure, t.result, t.target));
    }
    md.push_str(&format!(
        "\n## Latency: commit acknowledged → entry readable in Redis\n\n{} events/s for {} s from 4 producer connections \
         (each transaction: INSERT a payment + `outbox_enqueue`), a reader blocked on XREAD.\n\n\
         | samples | missing | p50 | p90 | p99 | max |\n|---|---|---|---|---|---|\n| {} | {} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms |\n\n\
         ![latency histogram](latency.svg)\n\n",
        lat.rate,
        lat.seconds,
        lat.samples_ms.len(),
        lat.missing,
        p50,
        p90,
        p99,
        max
    ));

    let row =
        |drains: &[Drain], cell: &dyn Fn(&Drain) -> String| drains.iter().map(cell).collect::<Vec<_>>().join(" | ");
    md.push_str(&format!(
        "## Drain: {} pending events over 10,000 aggregates, batch size {}\n\n\
         outbox_pg: its relay workers, enabled by a reload. External relay: the seeds' design, tuned \
         (`outbox-bench baseline-relay`): its own table `bench_seed_outbox` (primary key and one pending index), \
         the same backlog inserted in transactions of 1,000; claim = `UPDATE … SET status = 'publishing' WHERE id IN \
         (SELECT id … WHERE status = 'pending' ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED) RETURNING …`, the batch \
         XADDed in one pipeline with the same fields as outbox_pg's entries, then one bulk `UPDATE … SET status = \
         'published', published_at = now() WHERE id = ANY(…)`. Throughput: until the stream holds every event. CPU: \
         `/proc/<pid>/stat` (user + system) from start until every event is settled, of the relay workers for \
         outbox_pg, of the external process plus its PostgreSQL backend for the external relay.\n\n\
         | | 1 | 2 | 4 |\n|---|---|---|---|\n",
        grouped(r.drain_events as f64),
        args.batch
    ));
    md.push_str(&format!("| outbox_pg, workers: events/s | {} |\n", row(&r.in_server, &|d| grouped(d.events_per_s))));
    md.push_str(&format!(
        "| outbox_pg, relay CPU per event | {} |\n",
        row(&r.in_server, &|d| format!("{:.1} µs", d.cpu_us_per_event))
    ));
    let redis_cell = |d: &Drain| d.redis_cpu_us_per_event.map_or("–".to_string(), |us| format!("{us:.1} µs"));
    md.push_str(&format!("| outbox_pg, Redis's CPU per event | {} |\n", row(&r.in_server, &redis_cell)));
    md.push_str(&format!(
        "| external relay, processes: events/s | {} |\n",
        row(&r.baseline, &|d| grouped(d.events_per_s))
    ));
    md.push_str(&format!(
        "| external relay, CPU per event (backend + process) | {} |\n",
        row(&r.baseline, &|d| format!(
            "{:.1} µs ({:.1} + {:.1})",
            d.cpu_us_per_event,
            d.cpu_us_per_event - d.client_cpu_us_per_event.unwrap_or(0.0),
            d.client_cpu_us_per_event.unwrap_or(0.0)
        ))
    ));
    md.push_str(&format!("| external relay, Redis's CPU per event | {} |\n\n", row(&r.baseline, &redis_cell)));
    let redis_us = r.in_server[0].redis_cpu_us_per_event.unwrap_or(f64::NAN);
    md.push_str(&format!(
        "One outbox_pg worker ÷ the best external configuration: **{:.2}×**; ÷ one external process: {:.2}×. \
         Redis's CPU per event (`INFO cpu`, user + system, over the drain) is what Redis itself spends on each \
         XADD: one core at {:.1} µs per event takes at most about {} events/s from any relay on this machine, \
         {:.2}× the best external configuration.\n\n",
        one_worker / best_baseline,
        one_worker / r.baseline[0].events_per_s,
        redis_us,
        grouped(1e6 / redis_us),
        1e6 / redis_us / best_baseline
    ));
    md.push_str(&format!(
        "The same backlog for **one aggregate** (every event waits for the one before it in outbox_pg; the \
         seeds' design keeps no order): outbox_pg, 1 worker: {} events/s ({:.2}× the 10,000-aggregate figure, relay \
         CPU {:.1} µs/event); external relay, 1 process: {} events/s.\n\n",
        grouped(r.one_aggregate.events_per_s),
        r.one_aggregate.events_per_s / one_worker,
        r.one_aggregate.cpu_us_per_event,
        grouped(r.one_aggregate_baseline.events_per_s)
    ));
    md.push_str(
        "Each drain's table 2.5 s after it was settled (`pg_stat_get_dead_tuples`, `pg_total_relation_size` after \
         `pg_stat_clear_snapshot()`; autovacuum may have run):\n\n| drain | table | dead tuples | total size |\n|---|---|---|---|\n",
    );
    let mut table_row = |label: String, table: &str, d: &Drain| {
        md.push_str(&format!(
            "| {label} | `{table}` | {} | {:.1} MB |\n",
            grouped(d.dead_tuples as f64),
            d.total_bytes as f64 / 1_048_576.0
        ))
    };
    for d in &r.in_server {
        table_row(format!("outbox_pg, {}", plural(d.relays, "worker")), "outbox.events_*, outbox.held", d);
    }
    table_row("outbox_pg, one aggregate, 1 worker".into(), "outbox.events_*, outbox.held", &r.one_aggregate);
    for d in &r.baseline {
        table_row(format!("external relay, {}", plural(d.relays, "process")), "bench_seed_outbox", d);
    }
    table_row("external relay, one aggregate, 1 process".into(), "bench_seed_outbox", &r.one_aggregate_baseline);
    table_row("CDC relay (rows deleted once published)".into(), "bench_seed_outbox", &r.designs.cdc_drain);
    md.push('\n');
    md.push_str(&designs::section(
        &r.designs,
        &designs::Context {
            batch: args.batch,
            drain_events: r.drain_events,
            outbox_drain: &r.in_server[0],
            polling_drains: &r.baseline,
            outbox_latency: &r.lat,
            wal: &r.wal,
        },
    ));

    md.push('\n');
    md.push_str(&outside::section(&r.outside, &outside_context(r)));

    if let Some((single, cluster)) = &r.topology {
        md.push_str(&format!(
            "\n## Drain into a Redis Cluster beside a single node\n\n{} pending events over 10,000 aggregates spread \
             over {SPREAD_STREAMS} streams, one worker, `outbox.redis_wait_replicas = 0`; the same backlog drained into \
             the single Redis node and into a three-master Redis Cluster (no replicas) on the same machine \
             (`outbox.redis_mode = cluster`: one MULTI/EXEC per hash slot, one pipeline per master).\n\n\
             | target | events/s | relay CPU per event |\n|---|---|---|\n\
             | single node | {} | {:.1} µs |\n| three-master cluster | {} | {:.1} µs |\n\n\
             Cluster ÷ single node: **{:.2}×**.\n",
            grouped(r.drain_events as f64),
            grouped(single.events_per_s),
            single.cpu_us_per_event,
            grouped(cluster.events_per_s),
            cluster.cpu_us_per_event,
            cluster.events_per_s / single.events_per_s
        ));
    }
    md.push_str(
        "\n## Drains of large payloads\n\nThe same drain (10,000 aggregates, transactions of 1,000) with payloads of \
         about 2 KiB and 16 KiB of JSON; outbox_pg with 1 worker, the external relay's better of 1 and 2 processes. \
         MB/s counts payload bytes.\n\n| payload | events | outbox_pg events/s | MB/s | relay CPU/event | external events/s | MB/s |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for p in &r.payloads {
        md.push_str(&format!(
            "| {} B | {} | {} | {:.1} | {:.1} µs | {} | {:.1} |\n",
            grouped(p.payload_bytes as f64),
            grouped(p.events as f64),
            grouped(p.ours.events_per_s),
            p.mb_per_s(&p.ours),
            p.ours.cpu_us_per_event,
            grouped(p.external.events_per_s),
            p.mb_per_s(&p.external)
        ));
    }
    let large = &r.large;
    md.push_str(&format!(
        "\n## One transaction of {} events, and its replay\n\nOne `SELECT outbox_enqueue(…) FROM generate_series(…)` \
         ({:.1} s), committed; the relay publishes it in rounds of at most 10,000 events or 16 MB. First entry in Redis \
         {:.0} ms after the commit; all of it in {:.1} s ({} events/s). The relay's private memory (`RssAnon`, sampled \
         every 20 ms): {} kB at rest, {} kB at most. Then `outbox.replay(since => …, to_stream => …)` of the same events: \
         {:.1} s ({} events/s), at most {} kB.\n\n\
         Latency at {} events/s asked (the producers reached {} events/s): p50 {:.2} ms, p99 {:.2} ms, max {:.1} ms \
         ({} samples, {} missing).\n",
        grouped(large.events as f64),
        large.enqueue_s,
        large.first_entry_ms,
        large.publish_s,
        grouped(large.events as f64 / large.publish_s),
        grouped(large.rss_rest_kb as f64),
        grouped(large.rss_peak_kb as f64),
        large.replay_s,
        grouped(large.events as f64 / large.replay_s),
        grouped(large.replay_rss_peak_kb as f64),
        grouped(r.lat_10k.rate as f64),
        grouped(r.lat_10k.achieved_rate()),
        percentile(&r.lat_10k.samples_ms, 50.0),
        percentile(&r.lat_10k.samples_ms, 99.0),
        r.lat_10k.samples_ms.last().copied().unwrap_or(f64::NAN),
        r.lat_10k.samples_ms.len(),
        r.lat_10k.missing
    ));
    md.push_str(&format!(
        "\n## Enqueue cost (pgbench, 4 clients, median of 3 alternating runs)\n\n\
         Both transactions INSERT a payment row; then `outbox_enqueue(…)`, or a plain INSERT into `bench_seed_outbox`, \
         the seeds' outbox table. Both tables start empty.\n\n\
         | | INSERT + plain INSERT | INSERT + outbox_enqueue | ratio |\n|---|---|---|---|\n\
         | relay paused (`outbox.enabled = off`) | {} tps | {} tps | **{:.1}%** |\n\
         | relay running | {} tps | {} tps | **{:.1}%** |\n\n\
         Running ÷ paused: **{:.2}**. Runs, plain / outbox_enqueue: paused {} / {}; running {} / {}. Events pending \
         right after each running outbox_enqueue run: {}.\n\n",
        grouped(r.tps_off.plain),
        grouped(r.tps_off.outbox),
        100.0 * r.tps_off.ratio(),
        grouped(r.tps_on.plain),
        grouped(r.tps_on.outbox),
        100.0 * r.tps_on.ratio(),
        r.tps_on.ratio() / r.tps_off.ratio(),
        r.tps_off.plain_runs.iter().map(|t| grouped(*t)).collect::<Vec<_>>().join(", "),
        r.tps_off.outbox_runs.iter().map(|t| grouped(*t)).collect::<Vec<_>>().join(", "),
        r.tps_on.plain_runs.iter().map(|t| grouped(*t)).collect::<Vec<_>>().join(", "),
        r.tps_on.outbox_runs.iter().map(|t| grouped(*t)).collect::<Vec<_>>().join(", "),
        r.tps_on.pending_after.iter().map(|n| grouped(*n as f64)).collect::<Vec<_>>().join(", ")
    ));

    let wal = &r.wal;
    let wal_row = |label: &str, path: &WalPath| {
        format!(
            "| {label} | {:.0} | {:.0} | {:.0} | **{:.0}** |\n",
            per_event(path.enqueue),
            per_event(path.relay),
            per_event(path.retention),
            per_event(path.total())
        )
    };
    md.push_str(&format!(
        "## WAL per event: enqueue + relay + retention\n\n\
         {} events over {} aggregates, {} per transaction, the same events for both paths, one after the other with \
         nothing else writing (autovacuum off for the measurement). Each path: `CHECKPOINT`, then the WAL insert \
         position (`pg_current_wal_insert_lsn()`) after each phase. outbox_pg: `outbox_enqueue` with the relay \
         paused; the relay (1 worker) enabled until everything is settled; `outbox.purge('0')`. Seeds' path: \
         plain INSERTs into `bench_seed_outbox`; the external relay (1 process) until it exits; \
         `DELETE FROM bench_seed_outbox WHERE status = 'published'`.\n\n\
         | bytes per event | enqueue | relay | retention | total |\n|---|---|---|---|---|\n{}{}{}\n\
         outbox_pg ÷ seeds' path: **{:.2}×**. The plain INSERT alone (the seeds' enqueue): {:.0} bytes per event; \
         `outbox_enqueue` alone: {:.0} ({:.2}×).\n\n",
        grouped(wal.events as f64),
        grouped(wal.aggregates as f64),
        wal.per_transaction,
        wal_row("outbox_pg", &wal.outbox),
        wal_row("seeds' path", &wal.seeds),
        wal_row("CDC relay (slot; DELETE of the published rows)", &wal.cdc),
        per_event(wal.outbox.total()) / per_event(wal.seeds.total()),
        per_event(wal.seeds.enqueue),
        per_event(wal.outbox.enqueue),
        wal.outbox.enqueue as f64 / wal.seeds.enqueue as f64
    ));
    md.push_str(&format!(
        "## Idle\n\nOver {} s with nothing to publish (poll interval {}): relay CPU {:.1} ms, {} transactions in the database.\n",
        r.idle.seconds, r.idle.poll_interval, r.idle.cpu_ms, r.idle.transactions
    ));
    std::fs::write(format!("{}/report.md", args.out), md)?;
    eprintln!("wrote {0}/report.md, {0}/results.json, {0}/latency.svg", args.out);
    Ok(())
}
