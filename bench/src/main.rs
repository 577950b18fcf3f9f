//! outbox_pg benchmarks, run side by side against one PostgreSQL (outbox_pg preloaded) and one
//! Redis, and written as a Markdown report, raw JSON and a latency histogram (SVG).
//!
//! `outbox-bench all --pg CONNINFO --redis URL --pgbench PATH --out DIR [--quick]` runs everything;
//! `outbox-bench baseline-relay --pg CONNINFO --redis URL --batch N` is the external relay that the
//! drain scenario starts as 1, 2 or 4 processes. `bench/run.sh` sets up the servers and calls `all`.

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error + Send + Sync>;
type Result<T> = std::result::Result<T, Error>;

struct Args {
    command: String,
    pg: String,
    redis: String,
    pgbench: String,
    out: String,
    quick: bool,
    batch: i32,
    rate: u32,
    minutes: u32,
    /// `outbox.retention` for the sustained run; `None` keeps the server's setting (default 7 days).
    retention: Option<String>,
}

fn parse_args() -> Result<Args> {
    let mut args = std::env::args().skip(1);
    let command = args.next().ok_or("usage: outbox-bench all|baseline-relay --pg CONNINFO --redis URL ...")?;
    let mut parsed = Args {
        command,
        pg: String::new(),
        redis: String::new(),
        pgbench: "/usr/lib/postgresql/15/bin/pgbench".into(),
        out: "bench/results".into(),
        quick: false,
        batch: 1000,
        rate: 1000,
        minutes: 5,
        retention: None,
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
            "--minutes" => parsed.minutes = value()?.parse().map_err(|e| format!("--minutes: {e}"))?,
            "--retention" => parsed.retention = Some(value()?),
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
        "sustained" => sustained(&args),
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

fn wait_until(timeout: Duration, mut probe: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if probe()? {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("timed out".into());
        }
        std::thread::sleep(Duration::from_millis(2));
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
}

fn latency(args: &Args, rate: u32, seconds: u32) -> Result<Latency> {
    let mut admin = pg(&args.pg)?;
    configure(&mut admin, &[("outbox.enabled", "on"), ("outbox.workers", "1"), ("outbox.batch_size", "100")])?;
    let stream = "outbox:bench_latency";
    redis::cmd("DEL").arg(stream).query::<()>(&mut redis_connection(&args.redis)?)?;

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

    // Several producers, so that commit latency (fsync) does not cap the rate.
    let producers = (rate / 500).max(4);
    let per_producer = rate / producers;
    let commits: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let started = Instant::now();
    let handles: Vec<_> = (0..producers)
        .map(|p| {
            let (commits, conninfo) = (commits.clone(), args.pg.clone());
            std::thread::spawn(move || -> Result<()> {
                let mut client = pg(&conninfo)?;
                let interval = Duration::from_secs_f64(1.0 / per_producer as f64);
                let insert = client.prepare("INSERT INTO bench_payments (payer, amount) VALUES ($1, $2::text::numeric) RETURNING id")?;
                let enqueue = client.prepare(
                    "SELECT outbox_enqueue('bench_latency', $1::bigint, 'payment.created',
                                           jsonb_build_object('payment_id', $1::bigint, 'amount', $2::text::numeric))::text",
                )?;
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
    let commits = std::mem::take(&mut *commits.lock().map_err(|_| "poisoned")?);
    let _ = wait_until(Duration::from_secs(30), || Ok(arrivals.lock().map_err(|_| "poisoned")?.len() >= commits.len()));
    stop.store(true, Ordering::SeqCst);
    reader.join().map_err(|_| "reader panicked")??;
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
    Ok(Latency { rate, seconds, samples_ms: samples, missing })
}

/// An amount in cents as text, converted to NUMERIC by the server.
fn rust_decimal_free_amount(i: u32) -> String {
    format!("{}.{:02}", 10 + i % 990, i % 100)
}

// ------------------------------------------------------------------------------------------------
// Drain: a backlog of pending events, published by the in-server relay or by the external one.
// ------------------------------------------------------------------------------------------------

const DRAIN_STREAM: &str = "outbox:bench_drain";

fn prepare_backlog(args: &Args, admin: &mut postgres::Client, events: i64, aggregates: i64) -> Result<()> {
    configure(admin, &[("outbox.enabled", "off")])?;
    // Let a relay that is mid-round finish before the backlog is written.
    wait_until(Duration::from_secs(10), || {
        let busy: i64 =
            admin.query_one("SELECT count(*) FROM outbox.messages WHERE status = 'publishing'", &[])?.get(0);
        Ok(busy == 0)
    })?;
    admin.batch_execute("TRUNCATE outbox.messages")?;
    admin.batch_execute("VACUUM ANALYZE outbox.messages")?;
    redis::cmd("DEL").arg(DRAIN_STREAM).query::<()>(&mut redis_connection(&args.redis)?)?;
    // With 10,000 aggregates (10 events each) ordering has runs to respect; with one aggregate,
    // every event waits for the one before it. Transactions of 1,000 events: one transaction that
    // enqueues many events for one aggregate rewrites its counter row each time, and each call
    // walks the versions the transaction made before (quadratic; see docs/performance.md).
    for first in (1..=events).step_by(1000) {
        let last = (first + 999).min(events);
        admin.batch_execute(&format!(
            "SELECT outbox_enqueue('bench_drain', (i % {aggregates})::bigint, 'payment.created',
                                   jsonb_build_object('payment_id', i, 'amount', '12.34', 'payer', 'payer-' || i))
               FROM generate_series({first}, {last}) AS i"
        ))?;
    }
    admin.batch_execute("VACUUM ANALYZE outbox.messages")?;
    Ok(())
}

fn wait_drained(args: &Args, events: i64) -> Result<()> {
    let mut con = redis_connection(&args.redis)?;
    wait_until(Duration::from_secs(600), || {
        let len: i64 = redis::cmd("XLEN").arg(DRAIN_STREAM).query(&mut con)?;
        Ok(len >= events)
    })
}

fn drain_in_server(args: &Args, events: i64, aggregates: i64, workers: usize) -> Result<f64> {
    let mut admin = pg(&args.pg)?;
    prepare_backlog(args, &mut admin, events, aggregates)?;
    configure(&mut admin, &[("outbox.workers", &workers.to_string()), ("outbox.batch_size", &args.batch.to_string())])?;
    wait_until(Duration::from_secs(30), || {
        let running: i64 = admin
            .query_one("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay'", &[])?
            .get(0);
        Ok(running == workers as i64)
    })?;
    let started = Instant::now();
    admin.batch_execute("ALTER SYSTEM SET outbox.enabled = 'on'")?;
    admin.batch_execute("SELECT pg_reload_conf()")?;
    wait_drained(args, events)?;
    Ok(events as f64 / started.elapsed().as_secs_f64())
}

fn drain_baseline(args: &Args, events: i64, aggregates: i64, processes: usize) -> Result<f64> {
    let mut admin = pg(&args.pg)?;
    prepare_backlog(args, &mut admin, events, aggregates)?;
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let mut children = Vec::new();
    for _ in 0..processes {
        children.push(
            Command::new(&exe)
                .args(["baseline-relay", "--pg", &args.pg, "--redis", &args.redis, "--batch", &args.batch.to_string()])
                .spawn()?,
        );
    }
    wait_drained(args, events)?;
    let rate = events as f64 / started.elapsed().as_secs_f64();
    for mut child in children {
        let _ = child.wait();
    }
    Ok(rate)
}

/// The claim an external relay runs: what `outbox._claim_batch` does, minus the claim lock and the
/// skipping of rows held by in-server relays, which only matter when those run (they are paused
/// here) and which a hand-written relay would not have. With them, several external processes would
/// take turns claiming instead of claiming side by side (SKIP LOCKED).
const BASELINE_CLAIM: &str = "
WITH candidates AS MATERIALIZED (
    SELECT m.id, m.aggregate_type, m.aggregate_id, m.aggregate_seq
      FROM outbox.messages m
     WHERE m.status = 'pending'
       AND (m.available_at IS NULL OR m.available_at <= clock_timestamp())
       AND NOT EXISTS (
               SELECT 1 FROM outbox.messages e
                WHERE e.aggregate_type = m.aggregate_type AND e.aggregate_id = m.aggregate_id
                  AND e.aggregate_seq < m.aggregate_seq
                  AND (e.status IN ('publishing', 'failed') OR (e.status = 'pending' AND e.available_at IS NOT NULL))
                  AND NOT (e.status = 'pending' AND e.available_at <= clock_timestamp())
                OFFSET 0)
     ORDER BY m.id
     LIMIT $1::integer
       FOR UPDATE SKIP LOCKED
),
runs AS MATERIALIZED (
    SELECT c.id, c.aggregate_type, c.aggregate_id, c.aggregate_seq,
           c.aggregate_seq - row_number() OVER w + 1 AS run_start, first_value(c.aggregate_seq) OVER w AS first_seq
      FROM candidates c
    WINDOW w AS (PARTITION BY c.aggregate_type, c.aggregate_id ORDER BY c.aggregate_seq)
),
ready AS (
    SELECT r.aggregate_type, r.aggregate_id FROM runs r
     WHERE r.aggregate_seq = r.first_seq
       AND NOT EXISTS (
               SELECT 1 FROM outbox.messages e
                WHERE e.aggregate_type = r.aggregate_type AND e.aggregate_id = r.aggregate_id
                  AND e.aggregate_seq < r.first_seq AND e.status IN ('pending', 'publishing', 'failed'))
),
claimable AS (
    SELECT r.id FROM runs r JOIN ready USING (aggregate_type, aggregate_id) WHERE r.run_start = r.first_seq
)
UPDATE outbox.messages m
   SET status = 'publishing', claimed_at = clock_timestamp(), claimed_by = pg_backend_pid(), attempts = m.attempts + 1
  FROM claimable c
 WHERE m.id = c.id
RETURNING m.id, m.event_id::text, m.aggregate_type, m.aggregate_id, m.aggregate_seq, m.event_type,
          m.payload::text, m.headers::text, m.stream,
          to_char(m.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')";

/// The relay users would otherwise write: a separate process that, over client connections,
/// claims with the same choice of rows (FOR UPDATE SKIP LOCKED, per-aggregate order) marking them
/// `publishing`, XADDs the batch in one pipeline and marks it published in one statement. It exits
/// when nothing is left to claim.
fn baseline_relay(args: &Args) -> Result<()> {
    let mut client = pg(&args.pg)?;
    // As the in-server relay's functions do: no JIT, no sort or sequential scan of the table (see
    // outbox._claim_batch).
    client.batch_execute("SET jit = off; SET enable_sort = off; SET enable_seqscan = off")?;
    let mut con = redis_connection(&args.redis)?;
    let claim = client.prepare(BASELINE_CLAIM)?;
    let mark = client.prepare("SELECT outbox._mark_published($1)")?;
    let mut empty_rounds = 0;
    loop {
        let mut rows = client.query(&claim, &[&args.batch])?;
        if rows.is_empty() {
            let left: i64 =
                client.query_one("SELECT count(*) FROM outbox.messages WHERE status <> 'published'", &[])?.get(0);
            if left == 0 || empty_rounds > 2000 {
                return Ok(());
            }
            empty_rounds += 1;
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        rows.sort_by_key(|row| row.get::<_, i64>(0));
        let mut pipe = redis::pipe();
        let mut ids = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = row.get(0);
            ids.push(id);
            let aggregate_type: String = row.get(2);
            let stream: Option<String> = row.get(8);
            let cmd = pipe.cmd("XADD").arg(stream.unwrap_or_else(|| format!("outbox:{aggregate_type}"))).arg("*");
            cmd.arg("event_id").arg(row.get::<_, String>(1)).arg("outbox_id").arg(id.to_string());
            cmd.arg("aggregate_type").arg(&aggregate_type).arg("aggregate_id").arg(row.get::<_, String>(3));
            cmd.arg("aggregate_seq")
                .arg(row.get::<_, i64>(4).to_string())
                .arg("event_type")
                .arg(row.get::<_, String>(5));
            cmd.arg("payload").arg(row.get::<_, String>(6));
            if let Some(headers) = row.get::<_, Option<String>>(7) {
                cmd.arg("headers").arg(headers);
            }
            cmd.arg("created_at").arg(row.get::<_, String>(9));
        }
        pipe.query::<()>(&mut con)?;
        client.query_one(&mark, &[&ids])?;
    }
}

// ------------------------------------------------------------------------------------------------
// Enqueue cost: pgbench, business INSERT + outbox_enqueue versus business INSERT + plain INSERT.
// ------------------------------------------------------------------------------------------------

struct Tps {
    plain: f64,
    outbox: f64,
}

fn pgbench_tps(args: &Args, script: &str, seconds: u32) -> Result<f64> {
    let path = std::env::temp_dir().join(format!("outbox-bench-{}.sql", std::process::id()));
    std::fs::write(&path, script)?;
    let conninfo: HashMap<&str, &str> = args.pg.split_whitespace().filter_map(|kv| kv.split_once('=')).collect();
    let output = Command::new(&args.pgbench)
        .args(["-n", "-c", "4", "-j", "2", "-M", "prepared", "-T", &seconds.to_string(), "-f"])
        .arg(&path)
        .args(["-h", conninfo.get("host").unwrap_or(&"127.0.0.1")])
        .args(["-p", conninfo.get("port").unwrap_or(&"5432")])
        .args(["-U", conninfo.get("user").unwrap_or(&"postgres")])
        .arg(conninfo.get("dbname").unwrap_or(&"postgres"))
        .output()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let tps = text
        .lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l.trim_start_matches("tps = ").split_whitespace().next())
        .and_then(|n| n.parse::<f64>().ok())
        .ok_or_else(|| format!("pgbench gave no tps: {text}{}", String::from_utf8_lossy(&output.stderr)))?;
    Ok(tps)
}

fn enqueue_cost(args: &Args, seconds: u32, relay_on: bool) -> Result<Tps> {
    let mut admin = pg(&args.pg)?;
    configure(&mut admin, &[("outbox.enabled", if relay_on { "on" } else { "off" }), ("outbox.workers", "1")])?;
    let plain = "BEGIN;
INSERT INTO bench_payments (payer, amount) VALUES ('payer', 12.34);
INSERT INTO bench_plain_events (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, payload)
VALUES (gen_random_uuid(), 'payment', currval('bench_payments_id_seq')::text, 1, 'payment.created', '{\"amount\": \"12.34\"}');
END;
";
    let outbox = "BEGIN;
INSERT INTO bench_payments (payer, amount) VALUES ('payer', 12.34);
SELECT outbox_enqueue('payment', currval('bench_payments_id_seq'), 'payment.created', '{\"amount\": \"12.34\"}');
END;
";
    // Alternate the two, three times each, and keep the medians: the machine's noise hits both.
    let (mut plains, mut outboxes) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        plains.push(pgbench_tps(args, plain, seconds)?);
        outboxes.push(pgbench_tps(args, outbox, seconds)?);
    }
    plains.sort_by(|a, b| a.total_cmp(b));
    outboxes.sort_by(|a, b| a.total_cmp(b));
    Ok(Tps { plain: plains[1], outbox: outboxes[1] })
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

fn relay_cpu_ticks(pid: i32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("").split_whitespace().collect();
    Ok(fields.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + fields.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0))
}

fn idle(args: &Args, seconds: u64) -> Result<Idle> {
    let mut admin = pg(&args.pg)?;
    configure(&mut admin, &[("outbox.enabled", "on"), ("outbox.workers", "1")])?;
    // Whatever earlier scenarios left must be published first, or "idle" would measure a drain.
    wait_until(Duration::from_secs(300), || {
        let left: i64 = admin.query_one("SELECT pending + publishing FROM outbox.stats", &[])?.get(0);
        Ok(left == 0)
    })?;
    admin.batch_execute("SELECT outbox.purge('0')")?;
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
    let (ticks_before, xacts_before) = (relay_cpu_ticks(pid)?, xacts(&mut admin)?);
    std::thread::sleep(Duration::from_secs(seconds));
    admin.batch_execute("SELECT pg_stat_clear_snapshot()")?;
    let (ticks_after, xacts_after) = (relay_cpu_ticks(pid)?, xacts(&mut admin)?);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc_sysconf_clk_tck() } as f64;
    Ok(Idle {
        seconds,
        cpu_ms: (ticks_after - ticks_before) as f64 * 1000.0 / hz,
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
// Sustained: the latency scenario minute after minute, with the outbox's size after each minute.
// ------------------------------------------------------------------------------------------------

fn sustained(args: &Args) -> Result<()> {
    let mut admin = pg(&args.pg)?;
    admin.batch_execute(
        "CREATE TABLE IF NOT EXISTS bench_payments (id bigserial PRIMARY KEY, payer text NOT NULL,
                                                    amount numeric(12,2) NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
    )?;
    let retention = match &args.retention {
        Some(retention) => {
            configure(&mut admin, &[("outbox.retention", retention)])?;
            format!("outbox.retention = {retention}")
        }
        None => "default retention (7 days: nothing is deleted yet)".to_string(),
    };
    let command = format!(
        "BENCH_MODE=sustained bash bench/run.sh --rate {} --minutes {}{}",
        args.rate,
        args.minutes,
        args.retention.as_ref().map(|r| format!(" --retention {r}")).unwrap_or_default()
    );
    let mut md = format!(
        "# Sustained run: {} events/s for {} minutes\n\nMade with `{command}`.\n\n{}, {retention}.\n\n\
         | minute | events | achieved events/s | p50 | p99 | max | outbox.messages size | dead tuples | pending at end |\n|---|---|---|---|---|---|---|---|---|\n",
        args.rate,
        args.minutes,
        machine_facts(&mut admin)?
    );
    let mut rows = Vec::new();
    for minute in 1..=args.minutes {
        let window_started = Instant::now();
        let window = latency(args, args.rate, 60)?;
        // Producers that fall behind their schedule catch up at full speed, so a window that the
        // machine cannot sustain takes longer than a minute: report the rate actually reached.
        let achieved = window.samples_ms.len() as f64 / window_started.elapsed().as_secs_f64();
        admin.batch_execute("SELECT pg_stat_clear_snapshot()")?;
        let row = admin.query_one(
            "SELECT pg_size_pretty(pg_total_relation_size('outbox.messages')), pg_stat_get_dead_tuples('outbox.messages'::regclass),
                    (SELECT pending FROM outbox.stats)",
            &[],
        )?;
        let (size, dead, pending): (String, i64, i64) = (row.get(0), row.get(1), row.get(2));
        let (p50, p99) = (percentile(&window.samples_ms, 50.0), percentile(&window.samples_ms, 99.0));
        let max = window.samples_ms.last().copied().unwrap_or(f64::NAN);
        eprintln!("minute {minute}: {achieved:.0} events/s, p50 {p50:.2} ms, p99 {p99:.2} ms, size {size}, dead {dead}, pending {pending}");
        md.push_str(&format!(
            "| {minute} | {} | {achieved:.0} | {p50:.2} ms | {p99:.2} ms | {max:.2} ms | {size} | {dead} | {pending} |\n",
            window.samples_ms.len()
        ));
        rows.push(serde_json::json!({"minute": minute, "events": window.samples_ms.len(), "achieved_per_s": achieved, "missing": window.missing,
                                     "p50_ms": p50, "p99_ms": p99, "max_ms": max, "size": size, "dead_tuples": dead}));
    }
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(format!("{}/sustained.md", args.out), md)?;
    std::fs::write(format!("{}/sustained.json", args.out), serde_json::to_string_pretty(&rows)?)?;
    eprintln!("wrote {0}/sustained.md, {0}/sustained.json", args.out);
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

fn run_all(args: &Args) -> Result<()> {
    let (latency_seconds, drain_events, tps_seconds, idle_seconds) =
        if args.quick { (3, 20_000, 3, 3) } else { (15, 100_000, 10, 10) };
    let mut admin = pg(&args.pg)?;
    admin.batch_execute(
        "CREATE TABLE IF NOT EXISTS bench_payments (id bigserial PRIMARY KEY, payer text NOT NULL,
                                                    amount numeric(12,2) NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
         -- The equivalent table: outbox.messages' columns, defaults, constraints and indexes.
         CREATE TABLE IF NOT EXISTS bench_plain_events (LIKE outbox.messages INCLUDING ALL);",
    )?;
    let machine = machine_facts(&mut admin)?;

    eprintln!("== latency at 1,000 events/s for {latency_seconds} s");
    let lat = latency(args, 1000, latency_seconds)?;
    eprintln!("== drain {drain_events} events, in-server relay, 1/2/4 workers");
    let mut in_server = Vec::new();
    for workers in [1, 2, 4] {
        let rate = drain_in_server(args, drain_events, 10_000, workers)?;
        eprintln!("   {workers} worker(s): {rate:.0} events/s");
        in_server.push((workers, rate));
    }
    configure(&mut admin, &[("outbox.enabled", "off"), ("outbox.workers", "1")])?;
    eprintln!("== drain {drain_events} events, external relay, 1/2/4 processes");
    let mut baseline = Vec::new();
    for processes in [1, 2, 4] {
        let rate = drain_baseline(args, drain_events, 10_000, processes)?;
        eprintln!("   {processes} process(es): {rate:.0} events/s");
        baseline.push((processes, rate));
    }
    // A burst for one aggregate: every event has its predecessor in the batch or delivered.
    eprintln!("== drain {drain_events} events of one aggregate, one worker / one external process");
    let one_aggregate = (drain_in_server(args, drain_events, 1, 1)?, {
        configure(&mut admin, &[("outbox.enabled", "off")])?;
        drain_baseline(args, drain_events, 1, 1)?
    });
    eprintln!("   outbox_pg {:.0} events/s, external relay {:.0} events/s", one_aggregate.0, one_aggregate.1);
    eprintln!("== enqueue cost (pgbench, 4 clients, {tps_seconds} s per run, median of 3)");
    let tps_off = enqueue_cost(args, tps_seconds, false)?;
    let tps_on = enqueue_cost(args, tps_seconds, true)?;
    eprintln!("== idle for {idle_seconds} s");
    let idle = idle(args, idle_seconds)?;
    admin.batch_execute("SELECT outbox.purge('0'); TRUNCATE bench_payments, bench_plain_events")?;

    write_report(args, &machine, &lat, &in_server, &baseline, one_aggregate, &tps_off, &tps_on, &idle)
}

fn machine_facts(admin: &mut postgres::Client) -> Result<String> {
    let version: String = admin.query_one("SHOW server_version", &[])?.get(0);
    let fsync: String = admin.query_one("SHOW fsync", &[])?.get(0);
    let sync_commit: String = admin.query_one("SHOW synchronous_commit", &[])?.get(0);
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
        "{cores} cores ({cpu}), PostgreSQL {version} (fsync = {fsync}, synchronous_commit = {sync_commit}), Redis on loopback"
    ))
}

#[allow(clippy::too_many_arguments)]
fn write_report(
    args: &Args,
    machine: &str,
    lat: &Latency,
    in_server: &[(usize, f64)],
    baseline: &[(usize, f64)],
    one_aggregate: (f64, f64),
    tps_off: &Tps,
    tps_on: &Tps,
    idle: &Idle,
) -> Result<()> {
    std::fs::create_dir_all(&args.out)?;
    let (p50, p90, p99, max) = (
        percentile(&lat.samples_ms, 50.0),
        percentile(&lat.samples_ms, 90.0),
        percentile(&lat.samples_ms, 99.0),
        lat.samples_ms.last().copied().unwrap_or(f64::NAN),
    );
    let best_baseline = baseline.iter().map(|(_, r)| *r).fold(0.0, f64::max);
    let one_worker = in_server.first().map(|(_, r)| *r).unwrap_or(0.0);
    let json = serde_json::json!({
        "machine": machine,
        "latency": {"rate_per_s": lat.rate, "seconds": lat.seconds, "samples": lat.samples_ms.len(), "missing": lat.missing,
                    "p50_ms": p50, "p90_ms": p90, "p99_ms": p99, "max_ms": max},
        "drain_in_server": in_server.iter().map(|(w, r)| serde_json::json!({"workers": w, "events_per_s": r})).collect::<Vec<_>>(),
        "drain_external_relay": baseline.iter().map(|(p, r)| serde_json::json!({"processes": p, "events_per_s": r})).collect::<Vec<_>>(),
        "drain_ratio_one_worker_vs_best_external": one_worker / best_baseline,
        "drain_one_aggregate": {"in_server_one_worker": one_aggregate.0, "external_one_process": one_aggregate.1},
        "enqueue_tps": {"relay_off": {"plain_insert": tps_off.plain, "outbox_enqueue": tps_off.outbox, "ratio": tps_off.outbox / tps_off.plain},
                        "relay_on": {"plain_insert": tps_on.plain, "outbox_enqueue": tps_on.outbox, "ratio": tps_on.outbox / tps_on.plain}},
        "idle": {"seconds": idle.seconds, "relay_cpu_ms": idle.cpu_ms, "transactions": idle.transactions, "poll_interval": idle.poll_interval},
        "batch_size": args.batch,
        "quick": args.quick,
    });
    std::fs::write(format!("{}/results.json", args.out), serde_json::to_string_pretty(&json)?)?;
    std::fs::write(format!("{}/latency.svg", args.out), histogram_svg(&lat.samples_ms))?;
    let mut md = String::new();
    md.push_str(&format!("# outbox_pg benchmark\n\nMachine: {machine}.\n\n"));
    md.push_str(&format!(
        "## Latency: commit acknowledged → entry readable in Redis\n\n{} events/s for {} s from 4 producer connections \
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
    md.push_str(&format!(
        "## Drain: {} pending events (10,000 aggregates), batch size {}\n\n| relay | 1 | 2 | 4 |\n|---|---|---|---|\n",
        if args.quick { "20,000" } else { "100,000" },
        args.batch
    ));
    md.push_str(&format!(
        "| outbox_pg (workers, events/s) | {} |\n",
        in_server.iter().map(|(_, r)| format!("{r:.0}")).collect::<Vec<_>>().join(" | ")
    ));
    md.push_str(&format!(
        "| external relay (processes, events/s) | {} |\n\n",
        baseline.iter().map(|(_, r)| format!("{r:.0}")).collect::<Vec<_>>().join(" | ")
    ));
    md.push_str(&format!(
        "One outbox_pg worker vs the best external configuration: **{:.2}×**.\n\n",
        one_worker / best_baseline
    ));
    md.push_str(&format!(
        "The same backlog for **one aggregate** (every event waits for the one before it): outbox_pg, 1 worker: \
         {:.0} events/s; external relay, 1 process: {:.0} events/s.\n\n",
        one_aggregate.0, one_aggregate.1
    ));
    md.push_str(&format!(
        "## Enqueue cost (pgbench, 4 clients, median of 3 alternating runs)\n\n\
         | | INSERT + plain INSERT | INSERT + outbox_enqueue | ratio |\n|---|---|---|---|\n\
         | relay paused | {:.0} tps | {:.0} tps | **{:.1}%** |\n| relay running | {:.0} tps | {:.0} tps | **{:.1}%** |\n\n",
        tps_off.plain,
        tps_off.outbox,
        100.0 * tps_off.outbox / tps_off.plain,
        tps_on.plain,
        tps_on.outbox,
        100.0 * tps_on.outbox / tps_on.plain
    ));
    md.push_str(&format!(
        "## Idle\n\nOver {} s with nothing to publish (poll interval {}): relay CPU {:.1} ms, {} transactions in the database.\n",
        idle.seconds, idle.poll_interval, idle.cpu_ms, idle.transactions
    ));
    std::fs::write(format!("{}/report.md", args.out), md)?;
    eprintln!("wrote {0}/report.md, {0}/results.json, {0}/latency.svg", args.out);
    Ok(())
}
