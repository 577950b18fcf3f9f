//! Issue 37, step 5: the relay outside the server (`outbox-relay`, crate `outside/`) beside the
//! in-server worker and the seeds' relay, in the same run. Its drain of the extension's own
//! database (the worker paused: the same log, read through the SQL functions of schema 0.4.0) with
//! 1 and 2 processes; its latency at 1,000 events/s on a database holding the SQL-only install
//! (where `outbox_enqueue` wakes a sleeping relay with a NOTIFY; the extension's does not, so there
//! the poll interval would be the latency); and the enqueue ratio: the SQL-only install's PL/pgSQL
//! `outbox_enqueue` against the extension's Rust one and against a plain INSERT.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::{
    cpu_ticks, grouped, percentile, pg, pgbench_tps, plural, prepare_backlog, redis_cpu_seconds, table_state,
    wait_drained, wait_settled, wait_until, Args, Drain, Latency, Result, BACKLOG_PAYLOAD, DRAIN_STREAM,
    ENQUEUE_SCRIPT, OUTBOX_TABLES, PAYMENTS_DDL, PLAIN_SCRIPT,
};

/// The database that holds the SQL-only install, beside the extension's (`--pg`'s).
pub const SQL_ONLY_DATABASE: &str = "bench_sql_only";

/// The application_name of the relay's connections (outside/src/pg.rs).
const RELAY_APPLICATION: &str = "outbox-relay";

/// `args` with its connection string's `dbname` replaced by `database`.
fn on_database(args: &Args, database: &str) -> Args {
    let mut pg: Vec<String> =
        args.pg.split_whitespace().filter(|kv| !kv.starts_with("dbname=")).map(str::to_string).collect();
    pg.push(format!("dbname={database}"));
    Args { pg: pg.join(" "), ..args.clone() }
}

/// Makes the SQL-only database anew: `CREATE DATABASE`, then the script `bash scripts/sql-only.sh`
/// printed (`--sql-only FILE`, run by bench/run.sh) run with `psql -f`, as a database owner
/// would, and the producers' table. Returns `args` pointed at it.
pub fn create_sql_only(args: &Args) -> Result<Args> {
    let script = args.sql_only.as_deref().ok_or("--sql-only FILE (the SQL-only install) is required")?;
    let mut admin = pg(&args.pg)?;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {SQL_ONLY_DATABASE} WITH (FORCE)"))?;
    admin.batch_execute(&format!("CREATE DATABASE {SQL_ONLY_DATABASE}"))?;
    let sql_only = on_database(args, SQL_ONLY_DATABASE);
    let parts = crate::conninfo_parts(&sql_only.pg);
    let psql = std::path::Path::new(&args.pgbench).with_file_name("psql");
    let output = Command::new(&psql)
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", script])
        .args(["-h", parts.get("host").map_or("127.0.0.1", String::as_str)])
        .args(["-p", parts.get("port").map_or("5432", String::as_str)])
        .args(["-U", parts.get("user").map_or("postgres", String::as_str)])
        .args(["-d", SQL_ONLY_DATABASE])
        .output()?;
    if !output.status.success() {
        return Err(
            format!("{} -f {script} failed: {}", psql.display(), String::from_utf8_lossy(&output.stderr)).into()
        );
    }
    pg(&sql_only.pg)?.batch_execute(PAYMENTS_DDL)?;
    Ok(sql_only)
}

/// One `outbox-relay` process relaying `database`'s database, its log lines in a file.
pub struct RelayProcess {
    child: Child,
    log: PathBuf,
}

impl RelayProcess {
    /// Starts relay number `n` on `database.pg` with this run's Redis and batch size. Its settings
    /// otherwise are the defaults, or what `OUTBOX_*` variables in the environment say (e.g.
    /// `OUTBOX_LOG_MIN_DURATION=50ms` to see where a slow round goes).
    pub fn start(args: &Args, database: &Args, n: usize) -> Result<RelayProcess> {
        let relay = args.relay.as_deref().ok_or("--relay PATH (target/release/outbox-relay) is required")?;
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let log = std::env::temp_dir().join(format!(
            "outbox-bench-relay-{}-{}-{n}.log",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::SeqCst)
        ));
        let child = Command::new(relay)
            .args(["--database-url", &database.pg, "--redis-url", &args.redis])
            .args(["--batch-size", &args.batch.to_string()])
            .stdin(Stdio::null())
            .stdout(File::create(&log)?)
            .stderr(File::create(&log)?)
            .spawn()
            .map_err(|e| format!("cannot start {relay}: {e}"))?;
        Ok(RelayProcess { child, log })
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGTERM (the round in flight finishes, the shards are released), then waits for the exit.
    pub fn stop(mut self) -> Result<()> {
        Command::new("kill").args(["-TERM", &self.pid().to_string()]).status()?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait()? {
                if !status.success() {
                    return Err(format!("outbox-relay exited with {status}; its log: {}", self.log.display()).into());
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                self.child.kill()?;
                return Err(format!("outbox-relay did not stop on SIGTERM; its log: {}", self.log.display()).into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Stops every relay, returning the first error.
fn stop_all(relays: Vec<RelayProcess>) -> Result<()> {
    let mut first = Ok(());
    for relay in relays {
        let stopped = relay.stop();
        if first.is_ok() {
            first = stopped;
        }
    }
    first
}

/// Waits until `n` relays have joined the database `admin` is connected to: a row each in
/// `outbox.outside_relays` whose backend is alive.
pub fn wait_joined(admin: &mut postgres::Client, n: usize) -> Result<()> {
    wait_until(Duration::from_secs(30), || {
        let joined: i64 = admin
            .query_one(
                "SELECT count(*) FROM outbox.outside_relays r JOIN pg_stat_activity a ON a.pid = r.backend_pid",
                &[],
            )?
            .get(0);
        Ok(joined >= n as i64)
    })
    .map_err(|_| format!("{n} outbox-relay process(es) did not join within 30 s").into())
}

/// The backends serving the relays.
fn relay_backends(admin: &mut postgres::Client) -> Result<Vec<i32>> {
    Ok(admin
        .query("SELECT pid FROM pg_stat_activity WHERE application_name = $1", &[&RELAY_APPLICATION])?
        .iter()
        .map(|row| row.get(0))
        .collect())
}

/// `processes` outside relays draining `events` pending events over `aggregates` aggregates from
/// the extension's database, its worker paused (the same backlog as `drain_in_server`'s). Until
/// the stream holds every event; CPU: the relay processes and their backends, from their start
/// until every event is settled (both are new for each drain, so their totals are the drain's).
pub fn drain_outside(args: &Args, events: i64, aggregates: i64, processes: usize) -> Result<Drain> {
    let mut admin = pg(&args.pg)?;
    prepare_backlog(args, &mut admin, events, aggregates, BACKLOG_PAYLOAD)?;
    // A paused worker (`outbox.enabled = off`) keeps the shards it had claimed, and an outside relay
    // may take them only once the lease has run out (30 s): the drain would measure that wait. Let
    // them go here, as the worker would if pausing released its claims (it is alive and paused, not
    // in a round: prepare_backlog waited for that).
    admin.batch_execute(
        "UPDATE outbox.shards SET claimed_by = NULL, claimed_at = NULL
          WHERE claimed_by IN (SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay')",
    )?;
    let redis_before = redis_cpu_seconds(&args.redis)?;
    let started = Instant::now();
    let relays = (0..processes).map(|n| RelayProcess::start(args, args, n)).collect::<Result<Vec<_>>>()?;
    let measured = (|| -> Result<Drain> {
        wait_drained(args, DRAIN_STREAM, events)?;
        let events_per_s = events as f64 / started.elapsed().as_secs_f64();
        let redis_cpu_us_per_event = Some((redis_cpu_seconds(&args.redis)? - redis_before) * 1e6 / events as f64);
        wait_settled(&mut admin)?;
        let backend_ticks = relay_backends(&mut admin)?.into_iter().map(cpu_ticks).sum::<Result<u64>>()?;
        let process_ticks = relays.iter().map(|r| cpu_ticks(r.pid())).sum::<Result<u64>>()?;
        Ok(Drain::by_processes(processes, events, events_per_s, redis_cpu_us_per_event, backend_ticks, process_ticks))
    })();
    let stopped = stop_all(relays);
    let drain = measured?;
    stopped?;
    let (dead_tuples, total_bytes) = table_state(&mut admin, OUTBOX_TABLES)?;
    Ok(Drain { dead_tuples, total_bytes, ..drain })
}

// ------------------------------------------------------------------------------------------------
// Enqueue ratio: the PL/pgSQL outbox_enqueue against the Rust one and a plain INSERT.
// ------------------------------------------------------------------------------------------------

/// pgbench's tps (4 clients) of the same transaction, INSERT a payment then the event, three ways.
pub struct EnqueueRatio {
    pub seconds: u32,
    /// A plain INSERT into the seeds' outbox table (the extension's database).
    pub plain_runs: Vec<f64>,
    /// The extension's `outbox_enqueue` (Rust), its worker paused.
    pub rust_runs: Vec<f64>,
    /// The SQL-only install's `outbox_enqueue` (PL/pgSQL), no relay running.
    pub plpgsql_runs: Vec<f64>,
}

fn median(runs: &[f64]) -> f64 {
    let mut sorted = runs.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

impl EnqueueRatio {
    pub fn plain(&self) -> f64 {
        median(&self.plain_runs)
    }
    pub fn rust(&self) -> f64 {
        median(&self.rust_runs)
    }
    pub fn plpgsql(&self) -> f64 {
        median(&self.plpgsql_runs)
    }
}

/// Three alternating runs of each, every table empty at the start, no relay running on either
/// database (the PL/pgSQL enqueue then sends no NOTIFY, as with relays awake).
pub fn enqueue_ratio(args: &Args, sql_only: &Args, seconds: u32) -> Result<EnqueueRatio> {
    let mut admin = pg(&args.pg)?;
    crate::pause_and_empty_outbox(&mut admin)?;
    admin.batch_execute("TRUNCATE bench_seed_outbox, bench_payments")?;
    pg(&sql_only.pg)?.batch_execute(&format!("TRUNCATE {OUTBOX_TABLES}, bench_payments"))?;
    let mut ratio = EnqueueRatio { seconds, plain_runs: vec![], rust_runs: vec![], plpgsql_runs: vec![] };
    for _ in 0..3 {
        ratio.plain_runs.push(pgbench_tps(args, PLAIN_SCRIPT, seconds)?);
        ratio.rust_runs.push(pgbench_tps(args, ENQUEUE_SCRIPT, seconds)?);
        ratio.plpgsql_runs.push(pgbench_tps(sql_only, ENQUEUE_SCRIPT, seconds)?);
    }
    Ok(ratio)
}

// ------------------------------------------------------------------------------------------------
// All of it, and the report's section.
// ------------------------------------------------------------------------------------------------

/// What the outside relay's scenarios measured.
pub struct Outside {
    /// 1 and 2 processes, the extension's database, its worker paused.
    pub drains: Vec<Drain>,
    /// 1,000 events/s, the SQL-only database, one relay.
    pub latency: Latency,
    pub enqueue: EnqueueRatio,
}

/// The figures the outside relay is compared with, measured by the caller in the same run.
pub struct Context<'a> {
    pub batch: i32,
    pub drain_events: i64,
    /// One in-server worker.
    pub worker_drain: &'a Drain,
    /// The seeds' relay, 1 and 2 (or more) processes.
    pub polling_drains: &'a [Drain],
    pub worker_latency: &'a Latency,
    pub polling_latency: Option<&'a Latency>,
}

/// The outside relay's drains (1 and 2 processes), its latency at 1,000 events/s and the enqueue
/// ratio; the SQL-only database is made first.
pub fn measure(args: &Args, drain_events: i64, latency_s: u32, tps_s: u32) -> Result<Outside> {
    eprintln!("== outside relay: SQL-only install in database {SQL_ONLY_DATABASE}");
    let sql_only = create_sql_only(args)?;
    eprintln!("== outside relay: latency at 1,000 events/s for {latency_s} s (SQL-only database, one relay)");
    let latency = crate::latency_of(&sql_only, crate::Peer::Outside, 1000, latency_s)?;
    eprintln!(
        "   p50 {:.2} ms, p99 {:.2} ms ({} missing)",
        percentile(&latency.samples_ms, 50.0),
        percentile(&latency.samples_ms, 99.0),
        latency.missing
    );
    eprintln!("== outside relay: drain {drain_events} events over 10,000 aggregates, 1/2 processes (worker paused)");
    let mut drains = Vec::new();
    for processes in [1, 2] {
        let drain = drain_outside(args, drain_events, 10_000, processes)?;
        eprintln!(
            "   {}: {:.0} events/s, CPU {:.1} µs/event ({:.1} in the process)",
            plural(processes, "process"),
            drain.events_per_s,
            drain.cpu_us_per_event,
            drain.client_cpu_us_per_event.unwrap_or(f64::NAN)
        );
        drains.push(drain);
    }
    eprintln!("== enqueue ratio (pgbench, 4 clients, {tps_s} s per run, median of 3): plain, Rust, PL/pgSQL");
    let enqueue = enqueue_ratio(args, &sql_only, tps_s)?;
    eprintln!(
        "   plain {:.0}, Rust {:.0}, PL/pgSQL {:.0} tps; PL/pgSQL ÷ Rust {:.2}",
        enqueue.plain(),
        enqueue.rust(),
        enqueue.plpgsql(),
        enqueue.plpgsql() / enqueue.rust()
    );
    Ok(Outside { drains, latency, enqueue })
}

/// `BENCH_MODE=outside-latency`: only the outside relay's latency at 1,000 events/s (15 s, or 3
/// with `--quick`), printed, three times over; for trying a change to the relay's loop, not for
/// the report.
pub fn latency_only(args: &Args) -> Result<()> {
    let seconds = if args.quick { 3 } else { 15 };
    let sql_only = create_sql_only(args)?;
    for run in 1..=3 {
        let latency = crate::latency_of(&sql_only, crate::Peer::Outside, 1000, seconds)?;
        eprintln!(
            "run {run}: p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.1} ms ({} missing)",
            percentile(&latency.samples_ms, 50.0),
            percentile(&latency.samples_ms, 90.0),
            percentile(&latency.samples_ms, 99.0),
            latency.samples_ms.last().copied().unwrap_or(f64::NAN),
            latency.missing
        );
    }
    Ok(())
}

fn best(drains: &[Drain]) -> Option<&Drain> {
    drains.iter().max_by(|a, b| a.events_per_s.total_cmp(&b.events_per_s))
}

/// The three targets of issue 37, step 5: (figure, result, target, met).
pub fn targets(o: &Outside, ctx: &Context) -> Vec<(String, String, &'static str, bool)> {
    let best_outside = best(&o.drains).map_or(f64::NAN, |d| d.events_per_s);
    let (polling_rate, polling_processes) =
        best(ctx.polling_drains).map_or((f64::NAN, 0), |d| (d.events_per_s, d.relays));
    let p99 = percentile(&o.latency.samples_ms, 99.0);
    let ratio = o.enqueue.plpgsql() / o.enqueue.rust();
    vec![
        (
            "Drain, outside relay (`outbox-relay`, best of 1 and 2 processes) ÷ the seeds' tuned relay (best \
             configuration)"
                .into(),
            format!(
                "{:.2}× ({} / {} events/s, the seeds' relay with {})",
                best_outside / polling_rate,
                grouped(best_outside),
                grouped(polling_rate),
                plural(polling_processes, "process")
            ),
            "≥ 2×",
            best_outside >= 2.0 * polling_rate,
        ),
        (
            "Latency at 1,000 events/s, outside relay (SQL-only install, NOTIFY wake-up): p99".into(),
            format!("{p99:.2} ms{}", missing(&o.latency)),
            "≤ 15 ms",
            p99 <= 15.0 && o.latency.missing == 0,
        ),
        (
            "Enqueue: PL/pgSQL `outbox_enqueue` (SQL-only install) ÷ the Rust one (extension), pgbench tps".into(),
            format!("{:.2}× ({} / {} tps)", ratio, grouped(o.enqueue.plpgsql()), grouped(o.enqueue.rust())),
            "≥ 0.85×",
            ratio >= 0.85,
        ),
    ]
}

fn missing(lat: &Latency) -> String {
    if lat.missing > 0 {
        format!(" ({} missing)", lat.missing)
    } else {
        String::new()
    }
}

fn latency_row(label: &str, lat: &Latency) -> String {
    format!(
        "| {label} | {} | {:.2} ms | {:.2} ms | {:.2} ms | {:.1} ms | {} |\n",
        grouped(lat.achieved_rate()),
        percentile(&lat.samples_ms, 50.0),
        percentile(&lat.samples_ms, 90.0),
        percentile(&lat.samples_ms, 99.0),
        lat.samples_ms.last().copied().unwrap_or(f64::NAN),
        lat.missing
    )
}

fn cpu_cell(d: &Drain) -> String {
    match d.client_cpu_us_per_event {
        Some(client) => format!("{:.1} µs ({:.1} + {:.1})", d.cpu_us_per_event, d.cpu_us_per_event - client, client),
        None => format!("{:.1} µs", d.cpu_us_per_event),
    }
}

/// The report's section (Markdown), `##` headings.
pub fn section(o: &Outside, ctx: &Context) -> String {
    let mut md = String::from("## The relay outside the server (issue 37)\n\n");
    md.push_str("| figure | result | target | met? |\n|---|---|---|---|\n");
    for (figure, result, target, met) in targets(o, ctx) {
        md.push_str(&format!("| {figure} | {result} | {target} | {} |\n", if met { "yes" } else { "**no**" }));
    }
    md.push_str(&format!(
        "\n### Drain: {} pending events over 10,000 aggregates, batch size {}\n\n\
         `outbox-relay --database-url … --redis-url … --batch-size {}` (every other setting its default) on the \
         extension's own database, its in-server worker paused (`outbox.enabled = off`): the same log and backlog \
         as the worker's drain, read through the SQL functions (`outbox._read_window` …). Throughput: from the \
         processes' start (connecting included) until the stream holds every event. CPU per event: backends + \
         processes (`/proc/<pid>/stat`), until every event is settled.\n\n\
         | relay | processes | events/s | CPU per event (backend + process) | Redis's CPU per event |\n|---|---|---|---|---|\n",
        grouped(ctx.drain_events as f64),
        ctx.batch,
        ctx.batch
    ));
    let redis = |d: &Drain| d.redis_cpu_us_per_event.map_or("–".to_string(), |us| format!("{us:.1} µs"));
    let mut row = |label: &str, d: &Drain| {
        md.push_str(&format!(
            "| {label} | {} | {} | {} | {} |\n",
            d.relays,
            grouped(d.events_per_s),
            cpu_cell(d),
            redis(d)
        ))
    };
    row("in-server worker (outbox_pg)", ctx.worker_drain);
    for d in &o.drains {
        row("outside relay (`outbox-relay`)", d);
    }
    for d in ctx.polling_drains.iter().filter(|d| d.relays <= 2) {
        row("seeds' tuned relay (`baseline-relay`)", d);
    }
    let best_outside = best(&o.drains).map_or(f64::NAN, |d| d.events_per_s);
    md.push_str(&format!(
        "\nBest outside ÷ one worker: {:.2}×. Each drain's log afterwards (2.5 s later): {}.\n",
        best_outside / ctx.worker_drain.events_per_s,
        o.drains
            .iter()
            .map(|d| format!(
                "{}: {} dead tuples, {:.1} MB",
                plural(d.relays, "process"),
                grouped(d.dead_tuples as f64),
                d.total_bytes as f64 / 1_048_576.0
            ))
            .collect::<Vec<_>>()
            .join("; ")
    ));
    md.push_str(&format!(
        "\n### Latency at 1,000 events/s: commit acknowledged → entry readable in Redis\n\n\
         The latency scenario's producers (INSERT a payment + `outbox_enqueue` per transaction, {} s). The outside \
         relay runs on a second database of the same server holding the SQL-only install (`bash scripts/sql-only.sh`, \
         `psql -f`), whose PL/pgSQL `outbox_enqueue` wakes a sleeping relay with a NOTIFY; on the extension's \
         database no NOTIFY is sent and the outside relay would wait for its poll interval (1 s).\n\n\
         | relay | reached events/s | p50 | p90 | p99 | max | missing |\n|---|---|---|---|---|---|---|\n",
        o.latency.seconds
    ));
    md.push_str(&latency_row("in-server worker (extension)", ctx.worker_latency));
    md.push_str(&latency_row("outside relay (SQL-only install)", &o.latency));
    if let Some(polling) = ctx.polling_latency {
        md.push_str(&latency_row("seeds' relay (polls every 10 ms)", polling));
    }
    let e = &o.enqueue;
    let runs = |r: &[f64]| r.iter().map(|t| grouped(*t)).collect::<Vec<_>>().join(", ");
    md.push_str(&format!(
        "\n### Enqueue ratio (pgbench, 4 clients, {} s per run, median of 3 alternating runs)\n\n\
         Each transaction INSERTs a payment row, then the event: a plain INSERT into `bench_seed_outbox` (the seeds' \
         outbox table), the extension's `outbox_enqueue` (Rust; worker paused), or the SQL-only install's \
         `outbox_enqueue` (PL/pgSQL, second database; no relay running, so no NOTIFY). Every table empty at the \
         start.\n\n\
         | enqueue | tps (median) | runs | ÷ plain INSERT |\n|---|---|---|---|\n\
         | plain INSERT | {} | {} | 1.00 |\n| Rust `outbox_enqueue` | {} | {} | {:.2} |\n\
         | PL/pgSQL `outbox_enqueue` | {} | {} | {:.2} |\n\nPL/pgSQL ÷ Rust: **{:.2}×**.\n",
        e.seconds,
        grouped(e.plain()),
        runs(&e.plain_runs),
        grouped(e.rust()),
        runs(&e.rust_runs),
        e.rust() / e.plain(),
        grouped(e.plpgsql()),
        runs(&e.plpgsql_runs),
        e.plpgsql() / e.plain(),
        e.plpgsql() / e.rust()
    ));
    md
}

fn latency_json(lat: &Latency) -> serde_json::Value {
    serde_json::json!({"rate_per_s": lat.rate, "reached_per_s": lat.achieved_rate(), "seconds": lat.seconds,
                       "samples": lat.samples_ms.len(), "missing": lat.missing,
                       "p50_ms": percentile(&lat.samples_ms, 50.0), "p99_ms": percentile(&lat.samples_ms, 99.0),
                       "max_ms": lat.samples_ms.last().copied().unwrap_or(f64::NAN)})
}

pub fn json(o: &Outside, ctx: &Context) -> serde_json::Value {
    let e = &o.enqueue;
    serde_json::json!({
        "targets": targets(o, ctx).into_iter().map(|(figure, result, target, met)|
            serde_json::json!({"figure": figure, "result": result, "target": target, "met": met})).collect::<Vec<_>>(),
        "drain_events": ctx.drain_events,
        "outside_drains": o.drains.iter().map(|d| crate::drain_json(d, "processes")).collect::<Vec<_>>(),
        "worker_drain": crate::drain_json(ctx.worker_drain, "workers"),
        "polling_drains": ctx.polling_drains.iter().map(|d| crate::drain_json(d, "processes")).collect::<Vec<_>>(),
        "outside_latency": latency_json(&o.latency),
        "worker_latency": latency_json(ctx.worker_latency),
        "polling_latency": ctx.polling_latency.map(latency_json),
        "enqueue": {"seconds": e.seconds, "plain_runs": e.plain_runs, "rust_runs": e.rust_runs,
                    "plpgsql_runs": e.plpgsql_runs, "plain": e.plain(), "rust": e.rust(), "plpgsql": e.plpgsql(),
                    "plpgsql_over_rust": e.plpgsql() / e.rust(), "plpgsql_over_plain": e.plpgsql() / e.plain(),
                    "rust_over_plain": e.rust() / e.plain()},
    })
}
