//! The scenarios of issue 26 beside the drains of `main.rs`: drains of large payloads (events/s and
//! MB/s, beside the external relay), one transaction of a million events (how soon its first
//! entries arrive, how the relay's memory behaves), and a replay of it (speed, memory).

use std::time::{Duration, Instant};

use outbox_testkit::{rss_kb, PeakMemory};

use crate::{
    configure, drain_baseline_with, drain_in_server_with, pause_and_empty_outbox, pg, redis_connection, relay_pids,
    wait_until, wait_until_every, Args, Drain, Result, OUTBOX_TABLES,
};

/// A payload of about `bytes` bytes of JSON text, for event `i`.
pub fn padded_payload(bytes: usize) -> String {
    format!("jsonb_build_object('payment_id', i, 'amount', '12.34', 'pad', repeat('x', {}))", bytes.saturating_sub(60))
}

/// A drain of payloads of one size: outbox_pg with one worker, and the best of the external
/// relay's one and two processes.
pub struct PayloadDrain {
    pub payload_bytes: usize,
    pub events: i64,
    pub ours: Drain,
    pub external: Drain,
}

impl PayloadDrain {
    /// Payload megabytes a second.
    pub fn mb_per_s(&self, drain: &Drain) -> f64 {
        drain.events_per_s * self.payload_bytes as f64 / 1e6
    }
}

pub fn payload_drain(args: &Args, events: i64, payload_bytes: usize) -> Result<PayloadDrain> {
    let payload = padded_payload(payload_bytes);
    let ours = drain_in_server_with(args, events, 10_000, 1, &payload)?;
    let mut admin = pg(&args.pg)?;
    configure(&mut admin, &[("outbox.enabled", "off")])?;
    let external = [1, 2]
        .into_iter()
        .map(|processes| drain_baseline_with(args, events, 10_000, processes, &payload))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .max_by(|a, b| a.events_per_s.total_cmp(&b.events_per_s))
        .ok_or("no external drain")?;
    Ok(PayloadDrain { payload_bytes, events, ours, external })
}

/// One transaction of `events` events: how long its commit took, how soon after it the first
/// entry reached Redis, how long the whole transaction took to publish, and the relay's private
/// memory before and at its peak; then a replay of all of it into another stream.
pub struct LargeTransaction {
    pub events: i64,
    pub enqueue_s: f64,
    pub first_entry_ms: f64,
    pub publish_s: f64,
    pub rss_rest_kb: u64,
    pub rss_peak_kb: u64,
    pub replay_s: f64,
    pub replay_rss_peak_kb: u64,
}

pub fn large_transaction(args: &Args, events: i64) -> Result<LargeTransaction> {
    const STREAM: &str = "outbox:bench_large";
    const REPLAYED: &str = "bench:replayed";
    let mut admin = pg(&args.pg)?;
    pause_and_empty_outbox(&mut admin)?;
    let mut redis = redis_connection(&args.redis)?;
    redis::cmd("DEL").arg(STREAM).arg(REPLAYED).query::<()>(&mut redis)?;
    configure(&mut admin, &[("outbox.workers", "1"), ("outbox.enabled", "on")])?;
    wait_until(Duration::from_secs(30), || Ok(relay_pids(&mut admin)?.len() == 1))?;
    let relay = relay_pids(&mut admin)?[0];
    let rss_rest_kb = rss_kb(relay);
    let peak = PeakMemory::watch(relay);

    // The events of the transaction reach Redis only after its commit; the clock starts there.
    let since: std::time::SystemTime = admin.query_one("SELECT clock_timestamp()", &[])?.get(0);
    let started = Instant::now();
    let mut writer = pg(&args.pg)?;
    let mut txn = writer.transaction()?;
    txn.batch_execute(&format!(
        "SELECT outbox_enqueue('bench_large', (i % 1000)::bigint, 'payment.created', {})
           FROM generate_series(1, {events}) AS i",
        crate::BACKLOG_PAYLOAD
    ))?;
    let enqueue_s = started.elapsed().as_secs_f64();
    txn.commit()?;
    let committed = Instant::now();
    wait_until_every(Duration::from_secs(60), Duration::from_millis(1), || {
        let len: i64 = redis::cmd("XLEN").arg(STREAM).query(&mut redis)?;
        Ok(len > 0)
    })?;
    let first_entry_ms = committed.elapsed().as_secs_f64() * 1000.0;
    wait_until(Duration::from_secs(1800), || {
        let len: i64 = redis::cmd("XLEN").arg(STREAM).query(&mut redis)?;
        Ok(len >= events)
    })?;
    let publish_s = committed.elapsed().as_secs_f64();
    let rss_peak_kb = peak.peak_kb();
    drop(peak);

    // A replay sends what was *published*: a round's entries reach Redis before its finish records
    // them published (and journals them), so the replay waits for the last finish too. Asked for
    // at once, under load it found nine of the ten last rounds journaled and sent 90,000 of 100,000.
    wait_until(Duration::from_secs(60), || {
        let pending: bool = admin.query_one("SELECT outbox.oldest_pending_age() IS NOT NULL", &[])?.get(0);
        Ok(!pending)
    })?;

    // A replay of the whole transaction into a stream of its own.
    let peak = PeakMemory::watch(relay);
    let started = Instant::now();
    let id: i64 = admin.query_one("SELECT outbox.replay(since => $1, to_stream => $2)", &[&since, &REPLAYED])?.get(0);
    wait_until(Duration::from_secs(1800), || {
        let state: String = admin.query_one("SELECT state FROM outbox.replays WHERE id = $1", &[&id])?.get(0);
        Ok(state == "done")
    })?;
    let replay_s = started.elapsed().as_secs_f64();
    let replayed: i64 = redis::cmd("XLEN").arg(REPLAYED).query(&mut redis)?;
    if replayed < events {
        return Err(format!("the replay sent {replayed} of {events} events").into());
    }
    let replay_rss_peak_kb = peak.peak_kb();
    redis::cmd("DEL").arg(STREAM).arg(REPLAYED).query::<()>(&mut redis)?;
    admin.batch_execute(&format!("VACUUM {OUTBOX_TABLES}"))?;
    Ok(LargeTransaction {
        events,
        enqueue_s,
        first_entry_ms,
        publish_s,
        rss_rest_kb,
        rss_peak_kb,
        replay_s,
        replay_rss_peak_kb,
    })
}
