//! The relay worker: connected to `outbox.database`, it runs rounds (`tick`) while there is work,
//! sleeps on its latch (woken by committing enqueuers, or by the poll interval) when there is none,
//! and backs off when Redis or the database fails. Started and restarted by the launcher.

use std::time::{Duration, Instant};

use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::prelude::*;

use crate::guc;
use crate::shmem;
use crate::sink::redis::{RedisConfig, RedisSink};
use crate::worker::backoff::Backoff;
use crate::worker::tick::{self, TickOutcome, TickSettings};

/// Delay of the first retry after Redis or the database failed; doubles up to `BACKOFF_CAP`.
const BACKOFF_BASE: Duration = Duration::from_millis(100);
const BACKOFF_CAP: Duration = Duration::from_secs(10);
/// How often claims are checked for an expired lease or a dead claimer.
const REAP_EVERY: Duration = Duration::from_secs(1);

/// What the relay last reported, so that it logs changes of state rather than every retry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Health {
    Healthy,
    ExtensionMissing,
    BrokerDown(String),
    DatabaseError(String),
    Disabled,
}

struct Relay {
    sink: RedisSink,
    backoff: Backoff,
    health: Health,
    retry_at: Option<Instant>,
    next_reap: Instant,
    database: String,
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn outbox_pg_relay_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let database_oid = pg_sys::Oid::from(arg.value() as u32);
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(database_oid), None);

    shmem::register_relay();
    // SAFETY: `forget_relay` matches pg_on_exit_callback and only touches shared atomics.
    unsafe { pg_sys::before_shmem_exit(Some(forget_relay), pg_sys::Datum::from(0)) };

    let mut relay = Relay {
        sink: RedisSink::new(),
        backoff: Backoff::new(BACKOFF_BASE, BACKOFF_CAP, seed()),
        health: Health::Healthy,
        retry_at: None,
        next_reap: Instant::now(),
        database: guc::database(),
    };
    relay.sink.configure(redis_config());
    log!("outbox_pg relay started: database \"{}\", Redis at {}", relay.database, relay.sink.describe());
    report_activity("idle");

    loop {
        if BackgroundWorker::sighup_received() {
            // SAFETY: the documented way for a worker to re-read postgresql.conf after SIGHUP.
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
            let before = relay.sink.describe();
            relay.sink.configure(redis_config());
            // A new Redis deserves an immediate try, not the rest of the old one's backoff.
            if relay.sink.describe() != before || !relay.sink.is_connected() {
                relay.retry_at = None;
            }
        }

        let wait = relay.run_once();
        match wait {
            Some(timeout) => {
                report_activity("idle");
                if !BackgroundWorker::wait_latch(Some(timeout)) {
                    break;
                }
            }
            None => {
                // More work is waiting: keep going, but stay responsive to signals and barriers.
                // SAFETY: processes pending interrupts (procsignal barriers, cancel) between rounds.
                pg_sys::check_for_interrupts!();
                if BackgroundWorker::sigterm_received() {
                    break;
                }
            }
        }
    }
    log!("outbox_pg relay stopping");
}

impl Relay {
    /// Runs at most one round and returns how long to sleep before the next, or `None` to run the
    /// next round at once.
    fn run_once(&mut self) -> Option<Duration> {
        let poll = guc::poll_interval();
        if !guc::enabled() {
            self.set_health(Health::Disabled);
            return Some(poll);
        }
        if let Some(retry_at) = self.retry_at {
            let now = Instant::now();
            if now < retry_at {
                return Some(retry_at - now);
            }
            self.retry_at = None;
        }
        if Instant::now() >= self.next_reap {
            self.next_reap = Instant::now() + REAP_EVERY;
            match tick::reap_expired_claims(guc::lease_ms()) {
                Ok(Some(reaped)) if reaped > 0 => {
                    log!("outbox_pg: returned {reaped} events whose claim expired or whose relay exited to pending")
                }
                Ok(_) => {}
                Err(error) => return Some(self.failed(Health::DatabaseError(error))),
            }
        }

        report_activity("publishing");
        let settings = TickSettings {
            batch_size: guc::batch_size(),
            stream_template: guc::stream_template(),
            stream_maxlen: guc::stream_maxlen(),
        };
        let outcome = tick::tick(&mut self.sink, &settings);
        shmem::set_redis_connected(self.sink.is_connected());
        match outcome {
            TickOutcome::Worked { claimed, rejected, .. } => {
                self.recovered();
                if claimed >= settings.batch_size && rejected == 0 {
                    None
                } else {
                    // The queue was drained at claim time (or only rejected rows are left, which
                    // must not be retried in a tight loop). Commits made during this round have
                    // set the latch, so the wait returns at once if there is new work.
                    Some(poll)
                }
            }
            TickOutcome::Idle => {
                self.recovered();
                Some(poll)
            }
            TickOutcome::ExtensionMissing => {
                self.set_health(Health::ExtensionMissing);
                Some(poll.max(Duration::from_secs(1)))
            }
            TickOutcome::BrokerDown { error, .. } => Some(self.failed(Health::BrokerDown(error.0))),
            TickOutcome::DatabaseError(error) => Some(self.failed(Health::DatabaseError(error))),
        }
    }

    fn failed(&mut self, health: Health) -> Duration {
        self.set_health(health);
        let delay = self.backoff.next_delay();
        self.retry_at = Some(Instant::now() + delay);
        delay
    }

    fn recovered(&mut self) {
        self.set_health(Health::Healthy);
        self.backoff.reset();
    }

    /// Logs transitions only: a Redis outage produces one WARNING when it starts and one LOG when
    /// it ends, however many retries happen in between.
    fn set_health(&mut self, health: Health) {
        // One state per kind of trouble: a Redis going from "connection reset" to "connection
        // refused" is still the same outage.
        if std::mem::discriminant(&health) == std::mem::discriminant(&self.health) {
            return;
        }
        let target = self.sink.describe();
        match &health {
            Health::Healthy => match &self.health {
                Health::BrokerDown(_) => log!(
                    "outbox_pg: publishing to Redis at {target} again after {} failed attempts",
                    self.backoff.failures()
                ),
                Health::ExtensionMissing => {
                    log!("outbox_pg: extension found in database \"{}\"; relaying", self.database)
                }
                Health::DatabaseError(_) => log!("outbox_pg: database statements succeed again"),
                Health::Disabled => log!("outbox_pg: outbox.enabled is on; relaying"),
                Health::Healthy => {}
            },
            Health::BrokerDown(error) => warning!(
                "outbox_pg: cannot publish to Redis at {target}: {error}; events stay pending and are retried with backoff"
            ),
            Health::DatabaseError(error) => {
                warning!("outbox_pg: relay statement failed: {error}; retrying with backoff")
            }
            Health::ExtensionMissing => log!(
                "outbox_pg: extension outbox_pg is not installed in database \"{}\"; the relay waits for CREATE EXTENSION outbox_pg",
                self.database
            ),
            Health::Disabled => log!("outbox_pg: outbox.enabled is off; the relay is paused, events stay pending"),
        }
        self.health = health;
    }
}

fn redis_config() -> RedisConfig {
    RedisConfig { url: guc::redis_url(), password_file: guc::redis_password_file(), timeout: guc::redis_timeout() }
}

fn seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    // SAFETY: MyProcPid is set for every backend.
    nanos ^ (unsafe { pg_sys::MyProcPid } as u64).rotate_left(32)
}

/// Shows what the relay is doing in `pg_stat_activity.query`.
fn report_activity(what: &str) {
    let text = match what {
        "publishing" => c"outbox_pg: publishing",
        _ => c"outbox_pg: waiting for events",
    };
    let state =
        if what == "publishing" { pg_sys::BackendState::STATE_RUNNING } else { pg_sys::BackendState::STATE_IDLE };
    // SAFETY: a static NUL-terminated string; pgstat copies it.
    unsafe { pg_sys::pgstat_report_activity(state, text.as_ptr()) };
}

#[pg_guard]
unsafe extern "C-unwind" fn forget_relay(_code: i32, _arg: pg_sys::Datum) {
    shmem::unregister_relay();
}
