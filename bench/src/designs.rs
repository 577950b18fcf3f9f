//! Issue 39: outbox_pg beside the two designs users weigh it against, on the same machine in the
//! same run: the seeds' polling relay and a change-data-capture relay (`cdc.rs`). The drain of a
//! backlog, latency at 1,000 events/s, the writers' throughput with each relay running and keeping
//! up against it paused (pgbench, 8 clients), and the WAL a replication slot retains while the CDC
//! relay is stopped and writers go on.

use std::process::Child;
use std::time::{Duration, Instant};

use crate::{
    cdc, configure, finish_baseline, grouped, percentile, pg, pgbench_command, pgbench_result, pgbench_run,
    prepare_seed_backlog, redis_connection, redis_cpu_seconds, spawn_relay, table_state, ticks_to_us, wait_drained,
    wait_settled, wait_until, Args, BaselineReport, Drain, Latency, Peer, Result, BACKLOG_PAYLOAD, DRAIN_STREAM,
};

/// Whether the CDC relay's slot has a walsender streaming from it.
fn slot_active(admin: &mut postgres::Client) -> Result<bool> {
    Ok(admin
        .query_opt("SELECT active FROM pg_replication_slots WHERE slot_name = $1", &[&cdc::SLOT])?
        .is_some_and(|row| row.get(0)))
}

/// Creates the CDC relay's slot anew: it decodes what is committed from now on.
pub fn cdc_slot_reset(admin: &mut postgres::Client) -> Result<()> {
    cdc_slot_drop(admin)?;
    admin.query_one("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", &[&cdc::SLOT])?;
    Ok(())
}

/// Drops the CDC relay's slot, so that it retains no WAL through the scenarios that follow.
pub fn cdc_slot_drop(admin: &mut postgres::Client) -> Result<()> {
    // The walsender of a relay that has just exited may hold the slot for a moment more.
    wait_until(Duration::from_secs(30), || Ok(!slot_active(admin)?))?;
    admin.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
        &[&cdc::SLOT],
    )?;
    Ok(())
}

/// A relay of the seeds' table running as a process of its own, following new events.
pub struct PeerProcess {
    peer: Peer,
    child: Child,
}

impl PeerProcess {
    /// Starts `peer`'s process (for the CDC relay, on the slot that must exist) and waits until it
    /// is connected.
    pub fn follow(args: &Args, admin: &mut postgres::Client, peer: Peer) -> Result<PeerProcess> {
        let poll_ms = args.poll_ms.to_string();
        let child = match peer {
            Peer::Cdc => spawn_relay(args, "cdc-relay", &[], true)?,
            Peer::Polling => spawn_relay(args, "baseline-relay", &["--follow", "--poll-ms", &poll_ms], true)?,
            Peer::OutboxPg => return Err("outbox_pg's relay is no process of its own".into()),
            Peer::Outside => return Err("the outside relay is started by outside::RelayProcess".into()),
        };
        let process = PeerProcess { peer, child };
        wait_until(Duration::from_secs(30), || match peer {
            Peer::Cdc => slot_active(admin),
            _ => Ok(admin
                .query_one(
                    "SELECT count(*) > 0 FROM pg_stat_activity WHERE application_name = 'outbox-bench baseline-relay'",
                    &[],
                )?
                .get(0)),
        })?;
        Ok(process)
    }

    /// Closes its standard input, which makes it publish what it holds, confirm and exit; returns
    /// its report.
    pub fn stop(mut self, admin: &mut postgres::Client) -> Result<BaselineReport> {
        drop(self.child.stdin.take());
        let report = finish_baseline(self.child)?;
        if self.peer == Peer::Cdc {
            wait_until(Duration::from_secs(30), || Ok(!slot_active(admin)?))?;
        }
        Ok(report)
    }
}

/// The CDC relay draining `events` pending events: the slot made before the backlog was written
/// (the same transactions of 1,000 as the polling relay's backlog), then the relay started; until
/// the stream holds every event. CPU: its walsender and its trimming backend, and the process.
pub fn drain_cdc(args: &Args, events: i64, aggregates: i64) -> Result<Drain> {
    let mut admin = pg(&args.pg)?;
    configure(&mut admin, &[("outbox.enabled", "off")])?;
    cdc_slot_reset(&mut admin)?;
    let drained = (|| -> Result<Drain> {
        prepare_seed_backlog(args, &mut admin, events, aggregates, BACKLOG_PAYLOAD)?;
        let redis_before = redis_cpu_seconds(&args.redis)?;
        let started = Instant::now();
        let child = spawn_relay(args, "cdc-relay", &["--events", &events.to_string()], false)?;
        wait_drained(args, DRAIN_STREAM, events)?;
        let events_per_s = events as f64 / started.elapsed().as_secs_f64();
        let redis_cpu_us_per_event = Some((redis_cpu_seconds(&args.redis)? - redis_before) * 1e6 / events as f64);
        let report = finish_baseline(child)?;
        if report.events < events as u64 {
            return Err(format!("cdc-relay published {} of {events} events", report.events).into());
        }
        let (dead_tuples, total_bytes) = table_state(&mut admin, "bench_seed_outbox")?;
        Ok(Drain {
            relays: 1,
            events_per_s,
            cpu_us_per_event: ticks_to_us(report.backend_ticks + report.process_ticks) / events as f64,
            client_cpu_us_per_event: Some(ticks_to_us(report.process_ticks) / events as f64),
            redis_cpu_us_per_event,
            dead_tuples,
            total_bytes,
        })
    })();
    cdc_slot_drop(&mut admin)?;
    drained
}

// ------------------------------------------------------------------------------------------------
// Writers' throughput: each relay running and keeping up, against it paused.
// ------------------------------------------------------------------------------------------------

/// Clients of the writers' scenario (issue 39).
pub const WRITERS_CLIENTS: u32 = 8;

/// One design's runs: pgbench's tps with its relay paused and running (alternated), and the events
/// left unpublished right after each running run.
#[derive(Default)]
pub struct PausedRunning {
    pub paused: Vec<f64>,
    pub running: Vec<f64>,
    pub pending_after: Vec<i64>,
}

fn median(runs: &[f64]) -> f64 {
    let mut sorted = runs.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

impl PausedRunning {
    pub fn paused_median(&self) -> f64 {
        median(&self.paused)
    }
    pub fn running_median(&self) -> f64 {
        median(&self.running)
    }
    /// Running ÷ paused, of the medians.
    pub fn ratio(&self) -> f64 {
        self.running_median() / self.paused_median()
    }
    fn json(&self) -> serde_json::Value {
        serde_json::json!({"paused_tps_runs": self.paused, "running_tps_runs": self.running,
                           "paused_tps": self.paused_median(), "running_tps": self.running_median(),
                           "running_over_paused": self.ratio(), "pending_after_running_runs": self.pending_after})
    }
}

pub struct Writers {
    pub seconds: u32,
    pub outbox: PausedRunning,
    pub polling: PausedRunning,
    pub cdc: PausedRunning,
}

/// The application's transaction with outbox_pg: a payment and its event.
const OUTBOX_WRITER: &str = "BEGIN;
INSERT INTO bench_payments (payer, amount) VALUES ('payer', 12.34);
SELECT outbox_enqueue('payment', currval('bench_payments_id_seq'), 'payment.created', '{\"amount\": \"12.34\"}');
END;
";

/// The same transaction with the seeds' table, its events for stream `outbox:<aggregate_type>`.
fn seeds_writer(aggregate_type: &str) -> String {
    format!(
        "BEGIN;
INSERT INTO bench_payments (payer, amount) VALUES ('payer', 12.34);
INSERT INTO bench_seed_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
VALUES (gen_random_uuid(), '{aggregate_type}', currval('bench_payments_id_seq')::text, 'payment.created', '{{\"amount\": \"12.34\"}}');
END;
"
    )
}

fn xlen(args: &Args, stream: &str) -> Result<i64> {
    Ok(redis::cmd("XLEN").arg(stream).query(&mut redis_connection(&args.redis)?)?)
}

/// `rounds` rounds, each: for every design, a pgbench run of `seconds` with its relay paused, the
/// relay started and left to catch up (not timed), then a run with it running.
pub fn writers(args: &Args, rounds: usize, seconds: u32) -> Result<Writers> {
    let mut admin = pg(&args.pg)?;
    crate::pause_and_empty_outbox(&mut admin)?;
    admin.batch_execute("TRUNCATE bench_payments")?;
    let run = |script: &str| pgbench_run(args, script, seconds, WRITERS_CLIENTS, None);
    let (mut outbox, mut polling, mut cdc) = Default::default();
    for round in 1..=rounds {
        eprintln!("   round {round} of {rounds}");
        outbox_round(&mut admin, &mut outbox, &run)?;
        polling_round(args, &mut admin, &mut polling, &run)?;
        cdc_round(args, &mut admin, &mut cdc, &run)?;
    }
    Ok(Writers { seconds, outbox, polling, cdc })
}

fn outbox_round(
    admin: &mut postgres::Client,
    runs: &mut PausedRunning,
    run: &dyn Fn(&str) -> Result<crate::PgbenchRun>,
) -> Result<()> {
    configure(admin, &[("outbox.enabled", "off"), ("outbox.workers", "1")])?;
    wait_until(Duration::from_secs(10), || {
        Ok(admin.query_one("SELECT publishing FROM outbox.stats", &[])?.get::<_, i64>(0) == 0)
    })?;
    runs.paused.push(run(OUTBOX_WRITER)?.tps);
    configure(admin, &[("outbox.enabled", "on")])?;
    wait_settled(admin)?;
    runs.running.push(run(OUTBOX_WRITER)?.tps);
    runs.pending_after.push(admin.query_one("SELECT pending FROM outbox.stats", &[])?.get(0));
    configure(admin, &[("outbox.enabled", "off")])?;
    Ok(())
}

fn polling_round(
    args: &Args,
    admin: &mut postgres::Client,
    runs: &mut PausedRunning,
    run: &dyn Fn(&str) -> Result<crate::PgbenchRun>,
) -> Result<()> {
    let script = seeds_writer("payment_polling");
    admin.batch_execute("TRUNCATE bench_seed_outbox")?;
    runs.paused.push(run(&script)?.tps);
    let relay = PeerProcess::follow(args, admin, Peer::Polling)?;
    let any_pending = "SELECT count(*) FROM bench_seed_outbox WHERE status <> 'published'";
    wait_until(Duration::from_secs(300), || Ok(admin.query_one(any_pending, &[])?.get::<_, i64>(0) == 0))?;
    runs.running.push(run(&script)?.tps);
    runs.pending_after.push(admin.query_one(any_pending, &[])?.get(0));
    relay.stop(admin)?;
    Ok(())
}

fn cdc_round(
    args: &Args,
    admin: &mut postgres::Client,
    runs: &mut PausedRunning,
    run: &dyn Fn(&str) -> Result<crate::PgbenchRun>,
) -> Result<()> {
    const STREAM: &str = "outbox:payment_cdc";
    admin.batch_execute("TRUNCATE bench_seed_outbox")?;
    redis::cmd("DEL").arg(STREAM).query::<()>(&mut redis_connection(&args.redis)?)?;
    cdc_slot_reset(admin)?;
    let script = seeds_writer("payment_cdc");
    let outcome = (|| -> Result<()> {
        let paused = run(&script)?;
        runs.paused.push(paused.tps);
        let relay = PeerProcess::follow(args, admin, Peer::Cdc)?;
        wait_until(Duration::from_secs(300), || Ok(xlen(args, STREAM)? >= paused.transactions))?;
        let running = run(&script)?;
        runs.running.push(running.tps);
        runs.pending_after.push(paused.transactions + running.transactions - xlen(args, STREAM)?);
        relay.stop(admin)?;
        Ok(())
    })();
    cdc_slot_drop(admin)?;
    outcome
}

// ------------------------------------------------------------------------------------------------
// The slot's retained WAL while the CDC relay is stopped and writers go on.
// ------------------------------------------------------------------------------------------------

pub struct Retained {
    /// Writers' rate (pgbench `-R`, 8 clients), transactions a second, one event each.
    pub rate: u32,
    pub stopped_s: u64,
    /// `pg_current_wal_lsn() - restart_lsn` with the relay running, just before it stopped.
    pub running_bytes: i64,
    /// Seconds since the stop, WAL the slot retains (`- restart_lsn`), and WAL not yet confirmed
    /// (`- confirmed_flush_lsn`), sampled through the stop.
    pub samples: Vec<(f64, i64, i64)>,
    /// `pg_ls_waldir()`'s total at the stop's end.
    pub pg_wal_bytes: i64,
    /// From the relay's restart until it had confirmed everything written during the stop.
    pub catch_up_s: f64,
    /// Writers' transactions, and entries that reached the stream.
    pub written: i64,
    pub delivered: i64,
}

impl Retained {
    pub fn retained_at_end(&self) -> i64 {
        self.samples.last().map_or(0, |s| s.1)
    }
}

fn slot_lag(admin: &mut postgres::Client) -> Result<(i64, i64)> {
    let row = admin.query_one(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint,
                pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint
           FROM pg_replication_slots WHERE slot_name = $1",
        &[&cdc::SLOT],
    )?;
    Ok((row.get(0), row.get(1)))
}

/// Writers at `rate` transactions a second throughout; the CDC relay runs for `warm_s`, is stopped
/// for `stopped_s`, then started again and timed until it has caught up; `tail_s` more of writing.
pub fn retained(args: &Args, rate: u32, warm_s: u64, stopped_s: u64, tail_s: u64) -> Result<Retained> {
    const STREAM: &str = "outbox:payment_slot";
    let mut admin = pg(&args.pg)?;
    configure(&mut admin, &[("outbox.enabled", "off")])?;
    admin.batch_execute("TRUNCATE bench_seed_outbox")?;
    redis::cmd("DEL").arg(STREAM).query::<()>(&mut redis_connection(&args.redis)?)?;
    cdc_slot_reset(&mut admin)?;
    let outcome = (|| -> Result<Retained> {
        let mut relay = PeerProcess::follow(args, &mut admin, Peer::Cdc)?;
        let total = (warm_s + stopped_s + tail_s) as u32;
        let writers = pgbench_command(args, &seeds_writer("payment_slot"), total, WRITERS_CLIENTS, Some(rate))?
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        std::thread::sleep(Duration::from_secs(warm_s));
        let running_bytes = slot_lag(&mut admin)?.0;
        relay.stop(&mut admin)?;
        let stopped = Instant::now();
        let mut samples = Vec::new();
        let every = Duration::from_secs((stopped_s / 6).max(1));
        while stopped.elapsed() < Duration::from_secs(stopped_s) {
            std::thread::sleep(every.min(Duration::from_secs(stopped_s).saturating_sub(stopped.elapsed())));
            let (retained, unconfirmed) = slot_lag(&mut admin)?;
            samples.push((stopped.elapsed().as_secs_f64(), retained, unconfirmed));
        }
        let pg_wal_bytes: i64 = admin.query_one("SELECT sum(size)::bigint FROM pg_ls_waldir()", &[])?.get(0);
        let target: String = admin.query_one("SELECT pg_current_wal_lsn()::text", &[])?.get(0);
        let restarted = Instant::now();
        relay = PeerProcess::follow(args, &mut admin, Peer::Cdc)?;
        wait_until(Duration::from_secs(600), || {
            Ok(admin
                .query_one(
                    "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
                    &[&cdc::SLOT, &target],
                )?
                .get(0))
        })?;
        let catch_up_s = restarted.elapsed().as_secs_f64();
        let output = writers.wait_with_output()?;
        let written = pgbench_result(&output)?.transactions;
        wait_until(Duration::from_secs(60), || Ok(xlen(args, STREAM)? >= written))?;
        relay.stop(&mut admin)?;
        let delivered = xlen(args, STREAM)?;
        Ok(Retained { rate, stopped_s, running_bytes, samples, pg_wal_bytes, catch_up_s, written, delivered })
    })();
    cdc_slot_drop(&mut admin)?;
    outcome
}

// ------------------------------------------------------------------------------------------------
// The comparison, measured and written.
// ------------------------------------------------------------------------------------------------

/// What issue 39 adds to a run; outbox_pg's and the polling relay's drains, outbox_pg's latency
/// and the WAL per event come from the scenarios that measure them anyway.
pub struct Comparison {
    pub cdc_drain: Drain,
    pub polling_latency: Latency,
    pub cdc_latency: Latency,
    pub writers: Writers,
    pub retained: Retained,
}

/// Sizes of the comparison's scenarios, full or quick.
pub struct Sizes {
    pub drain_events: i64,
    pub latency_s: u32,
    pub writer_rounds: usize,
    pub writer_s: u32,
    pub retained: (u64, u64, u64),
}

impl Sizes {
    pub fn of(quick: bool) -> Sizes {
        if quick {
            Sizes { drain_events: 20_000, latency_s: 3, writer_rounds: 1, writer_s: 3, retained: (2, 10, 3) }
        } else {
            Sizes { drain_events: 100_000, latency_s: 15, writer_rounds: 3, writer_s: 10, retained: (10, 60, 20) }
        }
    }
}

pub fn compare(args: &Args, sizes: &Sizes) -> Result<Comparison> {
    eprintln!("== drain {} events over 10,000 aggregates, CDC relay (pgoutput, one slot)", sizes.drain_events);
    let cdc_drain = drain_cdc(args, sizes.drain_events, 10_000)?;
    eprintln!("   {:.0} events/s, CPU {:.1} µs/event", cdc_drain.events_per_s, cdc_drain.cpu_us_per_event);
    eprintln!("== latency at 1,000 events/s for {} s: polling relay, CDC relay", sizes.latency_s);
    let polling_latency = crate::latency_of(args, Peer::Polling, 1000, sizes.latency_s)?;
    let cdc_latency = crate::latency_of(args, Peer::Cdc, 1000, sizes.latency_s)?;
    for (peer, lat) in [(Peer::Polling, &polling_latency), (Peer::Cdc, &cdc_latency)] {
        eprintln!(
            "   {}: p50 {:.2} ms, p99 {:.2} ms ({} missing)",
            peer.name(),
            percentile(&lat.samples_ms, 50.0),
            percentile(&lat.samples_ms, 99.0),
            lat.missing
        );
    }
    eprintln!(
        "== writers' throughput, {WRITERS_CLIENTS} clients, relay paused and running, {} s per run, {} round(s)",
        sizes.writer_s, sizes.writer_rounds
    );
    let writers = writers(args, sizes.writer_rounds, sizes.writer_s)?;
    for (peer, runs) in
        [(Peer::OutboxPg, &writers.outbox), (Peer::Polling, &writers.polling), (Peer::Cdc, &writers.cdc)]
    {
        eprintln!(
            "   {}: paused {:.0} tps, running {:.0} tps: {:.2}",
            peer.name(),
            runs.paused_median(),
            runs.running_median(),
            runs.ratio()
        );
    }
    let (warm, stopped, tail) = sizes.retained;
    eprintln!("== the slot's retained WAL: CDC relay stopped for {stopped} s, writers at 1,000 events/s");
    let retained = retained(args, 1000, warm, stopped, tail)?;
    eprintln!(
        "   retained {} MB after {stopped} s; caught up in {:.1} s; {} of {} delivered",
        retained.retained_at_end() / 1_000_000,
        retained.catch_up_s,
        retained.delivered,
        retained.written
    );
    Ok(Comparison { cdc_drain, polling_latency, cdc_latency, writers, retained })
}

/// What the report needs from the rest of the run beside the comparison.
pub struct Context<'a> {
    pub batch: i32,
    pub drain_events: i64,
    pub outbox_drain: &'a Drain,
    pub polling_drains: &'a [Drain],
    pub outbox_latency: &'a Latency,
    pub wal: &'a crate::Wal,
}

fn latency_cells(lat: &Latency) -> String {
    format!(
        "{:.2} ms / {:.2} ms{}",
        percentile(&lat.samples_ms, 50.0),
        percentile(&lat.samples_ms, 99.0),
        if lat.missing > 0 { format!(" ({} missing)", lat.missing) } else { String::new() }
    )
}

/// The report's section for issue 39.
pub fn section(c: &Comparison, ctx: &Context) -> String {
    let Some(best_polling) = ctx.polling_drains.iter().max_by(|a, b| a.events_per_s.total_cmp(&b.events_per_s)) else {
        return String::new();
    };
    let wal = ctx.wal;
    let per_event = |path: &crate::WalPath| path.total() as f64 / wal.events as f64;
    let cpu = |d: &Drain| match d.client_cpu_us_per_event {
        Some(client) => format!("{:.1} µs ({:.1} + {:.1})", d.cpu_us_per_event, d.cpu_us_per_event - client, client),
        None => format!("{:.1} µs", d.cpu_us_per_event),
    };
    let redis = |d: &Drain| d.redis_cpu_us_per_event.map_or("–".into(), |us| format!("{us:.1} µs"));
    let w = &c.writers;
    let writers = |runs: &PausedRunning| {
        format!("{:.2} ({} / {} tps)", runs.ratio(), grouped(runs.running_median()), grouped(runs.paused_median()))
    };
    let mut md = format!(
        "## Against a change-data-capture relay (issue 39)\n\n\
         The CDC relay (`outbox-bench cdc-relay`, docs/performance.md \"The change-data-capture peer\") reads the \
         seeds' table's inserts from a logical replication slot (`pgoutput`, protocol 1, publication `FOR TABLE \
         bench_seed_outbox WITH (publish = 'insert')`) over a replication connection, XADDs each with the same fields \
         in MULTI/EXEC batches of up to {batch}, confirms the slot's flush LSN after Redis's reply, and deletes the \
         published rows (`DELETE … WHERE id = ANY(…)`, from a thread of its own). The server runs with `wal_level = \
         logical` for the whole run, every design alike.\n\n\
         | | outbox_pg, 1 worker | polling relay (best: {polling_n}) | CDC relay |\n|---|---|---|---|\n\
         | drain, {events} events over 10,000 aggregates: events/s | {o_rate} | {p_rate} | {c_rate} |\n\
         | CPU per event: relay (backend + process) | {o_cpu} | {p_cpu} | {c_cpu} |\n\
         | Redis's CPU per event | {o_redis} | {p_redis} | {c_redis} |\n\
         | latency at 1,000 events/s, p50 / p99 | {o_lat} | {p_lat} | {c_lat} |\n\
         | writers, {clients} clients: running ÷ paused (running / paused) | {o_w} | {p_w} | {c_w} |\n\
         | WAL per event: enqueue + relay + retention | {o_wal:.0} B | {p_wal:.0} B | {c_wal:.0} B |\n\n",
        batch = ctx.batch,
        polling_n = crate::plural(best_polling.relays, "process"),
        events = grouped(ctx.drain_events as f64),
        o_rate = grouped(ctx.outbox_drain.events_per_s),
        p_rate = grouped(best_polling.events_per_s),
        c_rate = grouped(c.cdc_drain.events_per_s),
        o_cpu = cpu(ctx.outbox_drain),
        p_cpu = cpu(best_polling),
        c_cpu = cpu(&c.cdc_drain),
        o_redis = redis(ctx.outbox_drain),
        p_redis = redis(best_polling),
        c_redis = redis(&c.cdc_drain),
        o_lat = latency_cells(ctx.outbox_latency),
        p_lat = latency_cells(&c.polling_latency),
        c_lat = latency_cells(&c.cdc_latency),
        clients = WRITERS_CLIENTS,
        o_w = writers(&w.outbox),
        p_w = writers(&w.polling),
        c_w = writers(&w.cdc),
        o_wal = per_event(&wal.outbox),
        p_wal = per_event(&wal.seeds),
        c_wal = per_event(&wal.cdc),
    );
    md.push_str(&format!(
        "One outbox_pg worker ÷ the CDC relay's drain: **{:.2}×**; ÷ the best other relay: **{:.2}×**. The CDC relay's \
         CPU per event is its walsender's decoding and its trimming backend's DELETEs plus its own process; the \
         polling relay's, its backend plus its process. Latency: the polling relay (1 process) pauses {} ms when a \
         claim finds nothing. Writers: pgbench, {} clients, {} s a run, the designs' runs alternated, medians; \
         the transaction INSERTs a payment and calls `outbox_enqueue` or INSERTs into `bench_seed_outbox`; \
         \"paused\" is outbox_pg with `outbox.enabled = off`, the other relays' processes stopped (the CDC slot \
         kept), each relay then left to catch up before the running run. Runs, paused / running: outbox_pg {} / {}; \
         polling {} / {}; CDC {} / {}. Events unpublished right after each running run: outbox_pg {}, polling {}, \
         CDC {}. WAL: the CDC relay's run was made with `--no-trim`, its retention the DELETE of the published rows \
         (bytes per event: enqueue {:.0}, relay {:.0}, retention {:.0}).\n\n",
        ctx.outbox_drain.events_per_s / c.cdc_drain.events_per_s,
        ctx.outbox_drain.events_per_s / best_polling.events_per_s.max(c.cdc_drain.events_per_s),
        crate::POLL_MS,
        WRITERS_CLIENTS,
        w.seconds,
        runs_text(&w.outbox.paused),
        runs_text(&w.outbox.running),
        runs_text(&w.polling.paused),
        runs_text(&w.polling.running),
        runs_text(&w.cdc.paused),
        runs_text(&w.cdc.running),
        ints_text(&w.outbox.pending_after),
        ints_text(&w.polling.pending_after),
        ints_text(&w.cdc.pending_after),
        wal.cdc.enqueue as f64 / wal.events as f64,
        wal.cdc.relay as f64 / wal.events as f64,
        wal.cdc.retention as f64 / wal.events as f64,
    ));
    let r = &c.retained;
    md.push_str(&format!(
        "**The slot's retained WAL** (the operational risk of this design): writers at {} transactions/s (pgbench \
         `-R`, {} clients, one event each), the CDC relay running, then stopped for {} s while they went on. \
         `pg_current_wal_lsn() - restart_lsn` of the slot: {} with the relay running; then {} (seconds after the \
         stop: retained / not yet confirmed). `pg_wal` held {} at the stop's end. Restarted, the relay had \
         confirmed everything written during the stop after {:.1} s; {} of {} events reached the stream. Nothing \
         bounds this but `max_slot_wal_keep_size`, which, once passed, invalidates the slot (its events are then \
         lost to the relay).\n",
        grouped(r.rate as f64),
        WRITERS_CLIENTS,
        r.stopped_s,
        mb(r.running_bytes),
        r.samples
            .iter()
            .map(|(s, kept, unconfirmed)| format!("{s:.0} s: {} / {}", mb(*kept), mb(*unconfirmed)))
            .collect::<Vec<_>>()
            .join(", "),
        mb(r.pg_wal_bytes),
        r.catch_up_s,
        grouped(r.delivered as f64),
        grouped(r.written as f64),
    ));
    md
}

fn mb(bytes: i64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

fn runs_text(runs: &[f64]) -> String {
    runs.iter().map(|t| grouped(*t)).collect::<Vec<_>>().join(", ")
}

fn ints_text(runs: &[i64]) -> String {
    runs.iter().map(|n| grouped(*n as f64)).collect::<Vec<_>>().join(", ")
}

pub fn json(c: &Comparison) -> serde_json::Value {
    let r = &c.retained;
    serde_json::json!({
        "cdc_drain": crate::drain_json(&c.cdc_drain, "processes"),
        "latency_1000": {
            "polling": latency_json(&c.polling_latency),
            "cdc": latency_json(&c.cdc_latency),
            "polling_poll_ms": crate::POLL_MS,
        },
        "writers": {"clients": WRITERS_CLIENTS, "seconds": c.writers.seconds,
                    "outbox_pg": c.writers.outbox.json(), "polling": c.writers.polling.json(), "cdc": c.writers.cdc.json()},
        "slot_retained_wal": {"rate_per_s": r.rate, "stopped_s": r.stopped_s, "running_bytes": r.running_bytes,
                              "samples": r.samples.iter().map(|(s, kept, unconfirmed)| serde_json::json!({"after_s": s, "retained_bytes": kept, "unconfirmed_bytes": unconfirmed})).collect::<Vec<_>>(),
                              "pg_wal_bytes": r.pg_wal_bytes, "catch_up_s": r.catch_up_s, "written": r.written, "delivered": r.delivered},
    })
}

fn latency_json(lat: &Latency) -> serde_json::Value {
    serde_json::json!({"samples": lat.samples_ms.len(), "missing": lat.missing,
                       "p50_ms": percentile(&lat.samples_ms, 50.0), "p99_ms": percentile(&lat.samples_ms, 99.0),
                       "max_ms": lat.samples_ms.last().copied().unwrap_or(f64::NAN)})
}
