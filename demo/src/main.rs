//! The payments demo: a burst of PIX-style payments, each saved together with its
//! `payment.created` event by `outbox_enqueue` in one transaction (some rolled back on purpose),
//! relayed by outbox_pg to Redis, and consumed by a "notification service" that deduplicates by
//! `event_id`. Along the way the relay is made to crash between publishing and marking (so an
//! event is published twice) and is paused while payments keep coming (so the age alert fires).
//! It ends with a report and exits non-zero if an event was lost or a rolled-back payment produced
//! one. `scripts/demo.sh` starts the servers and runs it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_consumer::{Consumer, ConsumerConfig, Event};

type Error = Box<dyn std::error::Error + Send + Sync>;
type Result<T> = std::result::Result<T, Error>;

struct Args {
    pg: String,
    redis: String,
    pg_log: String,
    payments: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args { pg: String::new(), redis: String::new(), pg_log: String::new(), payments: 2000 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--pg" => args.pg = value,
            "--redis" => args.redis = value,
            "--pg-log" => args.pg_log = value,
            "--payments" => {
                args.payments = value.parse().map_err(|_| format!("--payments: not a number: {value:?}"))?;
                if args.payments < 20 {
                    return Err(format!("--payments: at least 20, got {}", args.payments).into());
                }
            }
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    if args.pg.is_empty() || args.redis.is_empty() || args.pg_log.is_empty() {
        return Err("usage: payments-demo --pg CONNINFO --redis URL --pg-log FILE [--payments N]".into());
    }
    Ok(args)
}

fn main() {
    match parse_args().and_then(|args| run(&args)) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(error) => {
            eprintln!("payments-demo: {error}");
            std::process::exit(2);
        }
    }
}

/// What the producers know for sure: committed event ids (with commit time) and rolled-back payments.
#[derive(Default)]
struct Ledger {
    committed: HashMap<String, Instant>,
    committed_in_burst: HashSet<String>,
    rolled_back_payments: HashSet<i64>,
}

/// What the notification service saw.
#[derive(Default)]
struct Inbox {
    arrived: HashMap<String, Instant>,
    payment_ids: HashSet<i64>,
}

fn connect(conninfo: &str) -> Result<postgres::Client> {
    Ok(postgres::Client::connect(conninfo, postgres::NoTls)?)
}

fn settle(admin: &mut postgres::Client, settings: &[(&str, &str)]) -> Result<()> {
    for (name, value) in settings {
        admin.batch_execute(&format!("ALTER SYSTEM SET {name} = '{value}'"))?;
    }
    admin.batch_execute("SELECT pg_reload_conf()")?;
    Ok(())
}

fn wait_for(what: &str, timeout: Duration, mut probe: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !probe()? {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn log_contains(path: &str, needle: &str) -> bool {
    std::fs::read_to_string(path).map(|log| log.contains(needle)).unwrap_or(false)
}

/// Commits `count` payments from `producers` connections; every tenth is rolled back ("insufficient
/// funds"). Amounts are generated in cents and converted to NUMERIC by the database.
fn pay(args: &Args, ledger: &Arc<Mutex<Ledger>>, first: usize, count: usize, burst: bool) -> Result<()> {
    let producers = 4;
    let handles: Vec<_> = (0..producers)
        .map(|p| {
            let (ledger, conninfo) = (ledger.clone(), args.pg.clone());
            std::thread::spawn(move || -> Result<()> {
                let mut client = connect(&conninfo)?;
                let insert = client.prepare(
                    "INSERT INTO payments (payer_key, payee_key, amount) VALUES ($1, $2, $3::bigint / 100.0) RETURNING id, amount::text",
                )?;
                let enqueue = client.prepare(
                    "SELECT outbox_enqueue('payment', $1::bigint, 'payment.created',
                                           jsonb_build_object('payment_id', $1::bigint, 'amount', $2::text::numeric,
                                                              'payer_key', $3::text, 'payee_key', $4::text),
                                           jsonb_build_object('source', 'payments-demo'))::text",
                )?;
                for n in (first + p..first + count).step_by(producers) {
                    let cents = 100 + (n as i64 * 7919) % 250_000;
                    let (payer, payee) = (format!("+55119{:08}", n % 100_000_000), format!("payee{}@pix.example", n % 97));
                    let mut tx = client.transaction()?;
                    let row = tx.query_one(&insert, &[&payer, &payee, &cents])?;
                    let (id, amount): (i64, String) = (row.get(0), row.get(1));
                    let event_id: String = tx.query_one(&enqueue, &[&id, &amount, &payer, &payee])?.get(0);
                    if n % 10 == 3 {
                        tx.rollback()?;
                        ledger.lock().map_err(|_| "poisoned")?.rolled_back_payments.insert(id);
                    } else {
                        tx.commit()?;
                        let mut ledger = ledger.lock().map_err(|_| "poisoned")?;
                        ledger.committed.insert(event_id.clone(), Instant::now());
                        if burst {
                            ledger.committed_in_burst.insert(event_id);
                        }
                    }
                }
                Ok(())
            })
        })
        .collect();
    for handle in handles {
        handle.join().map_err(|_| "producer panicked")??;
    }
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted.get(((p / 100.0) * (sorted.len().saturating_sub(1)) as f64).round() as usize).copied().unwrap_or(f64::NAN)
}

fn run(args: &Args) -> Result<bool> {
    let mut admin = connect(&args.pg)?;
    admin.batch_execute(
        "CREATE TABLE IF NOT EXISTS payments (
             id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             payer_key  text NOT NULL,
             payee_key  text NOT NULL,
             amount     numeric(14, 2) NOT NULL CHECK (amount > 0),
             created_at timestamptz NOT NULL DEFAULT now()
         )",
    )?;
    settle(&mut admin, &[("outbox.enabled", "on"), ("outbox.fault_injection", "none"), ("outbox.alert_age", "2s")])?;

    // The notification service: a consumer group on the payment stream, deduplicating by event_id.
    let ledger: Arc<Mutex<Ledger>> = Arc::default();
    let inbox: Arc<Mutex<Inbox>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut config = ConsumerConfig::new(args.redis.clone(), "outbox:payment", "notifications");
    config.block_timeout = Duration::from_millis(100);
    let consumer = {
        let (inbox, stop) = (inbox.clone(), stop.clone());
        let mut consumer = Consumer::connect(config)?;
        std::thread::spawn(move || -> Result<outbox_consumer::Stats> {
            consumer.run(
                |event: &Event| -> std::result::Result<(), String> {
                    let mut inbox = inbox.lock().map_err(|_| "poisoned".to_string())?;
                    inbox.arrived.entry(event.event_id.clone()).or_insert_with(Instant::now);
                    if let Some(id) = event.payload.get("payment_id").and_then(|v| v.as_i64()) {
                        inbox.payment_ids.insert(id);
                    }
                    Ok(())
                },
                &stop,
            )?;
            Ok(consumer.stats())
        })
    };

    let burst = args.payments * 6 / 10;
    println!("== 1. a burst of {burst} PIX payments from 4 connections (INSERT + outbox_enqueue per transaction; every 10th rolled back)");
    let started = Instant::now();
    pay(args, &ledger, 0, burst, true)?;
    let committed_so_far = ledger.lock().map_err(|_| "poisoned")?.committed.len();
    println!(
        "   {committed_so_far} committed in {:.2} s ({:.0} payments/s)",
        started.elapsed().as_secs_f64(),
        burst as f64 / started.elapsed().as_secs_f64()
    );
    wait_for("the burst to reach the notification service", Duration::from_secs(120), || {
        Ok(inbox.lock().map_err(|_| "poisoned")?.arrived.len() >= committed_so_far)
    })?;

    println!("== 2. the relay dies right after publishing a batch and before marking it (outbox.fault_injection)");
    let relay_before: i32 = admin.query_one("SELECT coalesce(outbox.relay_pid(), 0)", &[])?.get(0);
    settle(&mut admin, &[("outbox.fault_injection", "crash_after_publish")])?;
    let mut n = burst;
    wait_for("the injected crash", Duration::from_secs(60), || {
        pay(args, &ledger, n, 8, false)?;
        n += 8;
        Ok(log_contains(&args.pg_log, "crash_after_publish: exiting"))
    })?;
    settle(&mut admin, &[("outbox.fault_injection", "none")])?;
    wait_for("a new relay", Duration::from_secs(60), || {
        let pid: i32 = admin.query_one("SELECT coalesce(outbox.relay_pid(), 0)", &[])?.get(0);
        Ok(pid != 0 && pid != relay_before)
    })?;
    println!("   relay {relay_before} exited after XADD; a new relay returned its claims and published them again");

    println!("== 3. the relay is paused (outbox.enabled = off) while payments keep coming; outbox.alert_age = 2s");
    settle(&mut admin, &[("outbox.enabled", "off")])?;
    let paused_at = Instant::now();
    let rest = args.payments.saturating_sub(n).max(10);
    let mut paid = 0;
    while !log_contains(&args.pg_log, "oldest pending event is") || paused_at.elapsed() < Duration::from_secs(3) {
        let chunk = (rest / 4).max(5).min(rest.saturating_sub(paid).max(5));
        pay(args, &ledger, n, chunk, false)?;
        n += chunk;
        paid += chunk;
        let row = admin.query_one("SELECT pending, coalesce(oldest_pending_age::text, '-') FROM outbox.stats", &[])?;
        println!("   pending {:>5}, oldest_pending_age {}", row.get::<_, i64>(0), row.get::<_, String>(1));
        if paused_at.elapsed() > Duration::from_secs(60) {
            return Err("the age alert did not fire within 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(700));
    }
    println!("   the relay logged: WARNING: outbox_pg: oldest pending event is … old, above outbox.alert_age");
    settle(&mut admin, &[("outbox.enabled", "on")])?;
    let resumed = Instant::now();
    wait_for("the backlog to drain", Duration::from_secs(120), || {
        let row = admin
            .query_one("SELECT pending + publishing, coalesce(oldest_pending_age::text, '-') FROM outbox.stats", &[])?;
        let left: i64 = row.get(0);
        println!("   resumed: {left:>5} undelivered, oldest_pending_age {}", row.get::<_, String>(1));
        Ok(left == 0)
    })?;
    println!("   backlog drained {:.2} s after resuming", resumed.elapsed().as_secs_f64());

    let total_committed = ledger.lock().map_err(|_| "poisoned")?.committed.len();
    let _ = wait_for("every event at the notification service", Duration::from_secs(60), || {
        Ok(inbox.lock().map_err(|_| "poisoned")?.arrived.len() >= total_committed)
    });
    stop.store(true, Ordering::SeqCst);
    let stats = consumer.join().map_err(|_| "consumer panicked")??;

    // The report.
    let ledger = ledger.lock().map_err(|_| "poisoned")?;
    let inbox = inbox.lock().map_err(|_| "poisoned")?;
    let lost: Vec<&String> = ledger.committed.keys().filter(|id| !inbox.arrived.contains_key(*id)).collect();
    let ghosts = ledger.rolled_back_payments.intersection(&inbox.payment_ids).count();
    let mut latencies: Vec<f64> = ledger
        .committed_in_burst
        .iter()
        .filter_map(|id| Some(inbox.arrived.get(id)?.saturating_duration_since(*ledger.committed.get(id)?)))
        .map(|d| d.as_secs_f64() * 1000.0)
        .collect();
    latencies.sort_by(|a, b| a.total_cmp(b));
    let committed_payments: i64 = admin.query_one("SELECT count(*) FROM payments", &[])?.get(0);
    let dead: i64 = admin.query_one("SELECT failed FROM outbox.stats", &[])?.get(0);
    println!();
    println!("== report");
    println!("   payments committed              {committed_payments:>7}");
    println!("   payments rolled back            {:>7}", ledger.rolled_back_payments.len());
    println!("   events delivered (unique)       {:>7}", inbox.arrived.len());
    println!("   duplicates dropped by consumer  {:>7}", stats.duplicates);
    println!("   events lost                     {:>7}", lost.len());
    println!("   events from rolled-back txns    {ghosts:>7}");
    println!("   dead-lettered                   {dead:>7}");
    println!(
        "   commit → notification latency   p50 {:.2} ms, p99 {:.2} ms (burst, {} events)",
        percentile(&latencies, 50.0),
        percentile(&latencies, 99.0),
        latencies.len()
    );
    println!("   where to look next: SELECT * FROM outbox.stats; docs/worker.md; consumer/README.md");
    let ok = lost.is_empty()
        && ghosts == 0
        && committed_payments as usize == ledger.committed.len()
        && stats.duplicates >= 1;
    if ok {
        println!("OK: nothing lost, nothing from rolled-back payments, duplicates recognised by event_id.");
    } else {
        println!(
            "FAILED: lost {:?}, ghosts {ghosts}, duplicates recognised {}",
            lost.iter().take(5).collect::<Vec<_>>(),
            stats.duplicates
        );
    }
    Ok(ok)
}
