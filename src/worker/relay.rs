//! The relay worker: connected to one relayed database, it runs rounds (`tick`) while there is work,
//! sleeps on its latch (woken by committing enqueuers, or by the poll interval) when there is none,
//! and backs off when Redis or the database fails. Between rounds it does the housekeeping: return
//! expired claims, watch the oldest pending event's age, delete expired published events. Started
//! and restarted by the launcher; it exits when outbox_pg is not (or no longer) installed in its
//! database, which tells the launcher to leave that database alone, and when its database's own
//! settings (`ALTER DATABASE ... SET outbox.*`) change, so that the launcher starts it with them.

use std::time::{Duration, Instant};

use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::prelude::*;

use crate::claims;
use crate::guc::{self, FaultInjection};
use crate::shmem::{self, ExtensionState};
use crate::sink::redis::{RedisConfig, RedisSink, TlsFiles};
use crate::worker::backoff::Backoff;
use crate::worker::tick::{self, RoundTimings, TickOutcome, TickSettings};
use crate::worker::txn;

/// Delay of the first retry after Redis or the database failed; doubles up to `BACKOFF_CAP`.
const BACKOFF_BASE: Duration = Duration::from_millis(100);
const BACKOFF_CAP: Duration = Duration::from_secs(10);
/// Housekeeping cadence while anything is undelivered or being purged; when the outbox is empty it
/// runs only once per poll interval, so an idle relay queries no more often than that.
const HOUSEKEEPING_BUSY: Duration = Duration::from_secs(1);
/// While the oldest pending event stays above `outbox.alert_age`, repeat the WARNING this often.
const ALERT_REPEAT: Duration = Duration::from_secs(60);
/// After a round that published a partial batch, events are arriving one commit at a time: the
/// relay pauses before the next claim so that a round carries several of them. Each round costs
/// two short transactions and a Redis round trip whatever its size (about 0.3 to 1 ms of CPU when
/// it carries a few dozen events of new aggregates), so under a steady stream of small commits
/// one round per commit would take a good part of a core from the application. The pause grows
/// with the last round's size, COALESCE_PER_EVENT per event between COALESCE_MIN and
/// COALESCE_MAX: at 1,000 events/s rounds carry one or two events and the pause stays at half a
/// millisecond; up to about 3,000 events/s it stays within a few milliseconds; at a producer's
/// ceiling it reaches COALESCE_MAX and the relay runs under a hundred rounds a second instead of
/// thousands. 10 ms there rather than 3 halved the relay's CPU at pgbench's ceiling and raised
/// the producers' throughput with the relay running from about 0.75 to about 0.9 of that with it
/// paused (docs/performance.md): under saturation the application's throughput is worth more
/// than a few milliseconds of latency. An idle relay is woken at once by the first commit; only
/// the rounds that follow a busy one wait.
const COALESCE_MIN: Duration = Duration::from_micros(500);
const COALESCE_PER_EVENT: Duration = Duration::from_micros(250);
const COALESCE_MAX: Duration = Duration::from_millis(10);

/// The pause after a round that published `events` and drained its window.
fn coalesce_window(events: usize) -> Duration {
    COALESCE_PER_EVENT.saturating_mul(events.min(u32::MAX as usize) as u32).clamp(COALESCE_MIN, COALESCE_MAX)
}

/// What the relay last reported, so that it logs changes of state rather than every retry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Health {
    Healthy,
    /// The database's extension version (the library's is tick::LIBRARY_VERSION).
    ExtensionOutdated(String),
    BrokerDown(String),
    DatabaseError(String),
    Disabled,
}

struct Relay {
    /// Which of the `outbox.workers` relays this is.
    slot: usize,
    sink: RedisSink,
    backoff: Backoff,
    health: Health,
    /// The Redis the current outage concerns, so that a reload pointing at another (also broken)
    /// Redis is reported as a new outage rather than swallowed as the same one.
    outage_target: Option<String>,
    retry_at: Option<Instant>,
    database: String,
    /// Shards held in the last round that got that far: holding fewer now means shards were given
    /// back (outbox.workers was raised), and the other relays are woken to take them.
    shards_held: usize,
    /// When the next round reads every shard it holds, rather than only those commits flagged
    /// (once per poll interval: the safety net for what no commit flagged, such as prepared
    /// transactions committed elsewhere, and for moving idle cursors on).
    full_read_at: Instant,
    /// Whether the last round read a lagging shard up to a recorded snapshot (logged on change).
    catching_up: bool,
    /// Whether this relay has seen the extension installed (it logs its start then, so that the
    /// probe of a database without outbox_pg logs nothing).
    found_extension: bool,
    /// Set when the relay must exit: its database has no outbox_pg (any more).
    exit: bool,
    /// The database's and role's own settings (pg_db_role_setting) the relay started with.
    own_settings: String,
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn outbox_pg_relay_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let database_oid = pg_sys::Oid::from(arg.value() as u32);
    let slot = BackgroundWorker::get_extra().parse::<usize>().unwrap_or(0).min(shmem::MAX_RELAYS - 1);
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(database_oid), None);
    // Until attach_signal_handlers ran, PostgreSQL's worker start-up ignored SIGHUP: a reload the
    // postmaster signalled in that window is lost. Reading the configuration once now catches it.
    // SAFETY: the documented way for a worker to re-read postgresql.conf, outside any transaction.
    unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    let (database, own_settings) = txn::run(|| Ok::<_, String>((current_database(), own_settings())))
        .unwrap_or_else(|error| (format!("oid {}", database_oid.to_u32()), error));

    // The relay's batch statements gain nothing from JIT and would pay its compile time per call.
    // Its commits need not wait for the WAL flush: a relay commit lost in a crash (claim, mark,
    // rejection, retention) only means an event is published again or a row deleted later, never
    // that an event is lost, while waiting would put an fsync on every event's path to Redis.
    // The claim's correctness argument (src/claims.rs) needs each statement to see a fresh
    // snapshot, i.e. READ COMMITTED, and the relay writes: a database or role default of
    // repeatable read, serializable or read-only must not apply to the relay's transactions.
    for (name, value) in [
        (c"jit", c"off"),
        (c"synchronous_commit", c"off"),
        (c"default_transaction_isolation", c"read committed"),
        (c"default_transaction_read_only", c"off"),
        // A relay never waits long on a row lock (a session holding its shard rows, an admin's
        // forget_aggregates): it backs off and tries again, answering SIGTERM in between.
        (c"lock_timeout", c"2s"),
        // The relay's statements take arrays and snapshots as parameters; planned for each call's
        // values (PL/pgSQL's custom plans) the batch read cost over a millisecond a round to plan,
        // more than running it. Their generic plans are index walks whatever the values.
        (c"plan_cache_mode", c"force_generic_plan"),
    ] {
        // SAFETY: static NUL-terminated strings; all are user-settable options.
        unsafe {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_OVERRIDE,
            )
        };
    }
    if !shmem::register_relay(slot) {
        // The launcher gave up on this database meanwhile (dropped, filtered out).
        return;
    }
    claims::clear(slot);
    // A (re)started relay first returns the claims its predecessor left behind.
    shmem::schedule_housekeeping(Duration::ZERO);
    // SAFETY: `forget_relay` matches pg_on_exit_callback and only touches shared atomics.
    unsafe { pg_sys::before_shmem_exit(Some(forget_relay), pg_sys::Datum::from(slot)) };

    let mut relay = Relay {
        slot,
        sink: RedisSink::new(),
        backoff: Backoff::new(BACKOFF_BASE, BACKOFF_CAP, seed()),
        health: Health::Healthy,
        outage_target: None,
        retry_at: None,
        database,
        shards_held: 0,
        full_read_at: Instant::now(),
        catching_up: false,
        found_extension: false,
        exit: false,
        own_settings,
    };
    relay.sink.configure(redis_config());

    loop {
        if shmem::step_aside_requested() {
            log!("outbox_pg relay {}: database \"{}\" is being dropped; stepping aside", relay.slot, relay.database);
            break;
        }
        if BackgroundWorker::sighup_received() {
            // SAFETY: the documented way for a worker to re-read postgresql.conf after SIGHUP.
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
            // A reload does not re-read pg_db_role_setting: start again to apply a change there.
            match txn::run(|| Ok::<_, String>(self::own_settings())) {
                Ok(settings) if settings != relay.own_settings => {
                    log!(
                        "outbox_pg relay {}: the settings of database \"{}\" changed (ALTER DATABASE or ALTER ROLE ... SET); restarting to apply them",
                        relay.slot,
                        relay.database
                    );
                    break;
                }
                _ => {}
            }
            if relay.slot == 0 && relay.found_extension {
                warn_about_settings();
            }
            let before = relay.sink.describe();
            relay.sink.configure(redis_config());
            let after = relay.sink.describe();
            if after != before && relay.found_extension {
                // Says when the reload took effect: pg_reload_conf() only signals.
                log!("outbox_pg relay {}: after the reload, Redis is {after} (was {before})", relay.slot);
            }
            // A new Redis deserves an immediate try, not the rest of the old one's backoff.
            if after != before || !relay.sink.is_connected() {
                relay.retry_at = None;
            }
            if guc::fault_injection() == FaultInjection::None {
                shmem::set_fault_fired(false);
            }
        }

        // Background workers must flush their statistics themselves (PostgresMain does it for
        // client backends); outbox.stats estimates published rows from them. It is rate-limited
        // internally, so calling it every round is cheap.
        // SAFETY: outside any transaction, as pgstat requires.
        unsafe { pg_sys::pgstat_report_stat(false) };
        let next = relay.run_once();
        if relay.exit {
            break;
        }
        match next {
            Some(timeout) => {
                report_activity(false);
                if stop_requested() || !BackgroundWorker::wait_latch(Some(timeout)) {
                    break;
                }
            }
            None => {
                // More work is waiting: keep going, but stay responsive to signals and barriers.
                pg_sys::check_for_interrupts!();
                if stop_requested() {
                    break;
                }
            }
        }
    }
    log!("outbox_pg relay stopping");
}

impl Relay {
    /// Runs the housekeeping when due and at most one round, and returns how long to sleep before
    /// the next, or `None` to go on at once.
    fn run_once(&mut self) -> Option<Duration> {
        let poll = guc::poll_interval();
        if let Some(retry_at) = self.retry_at {
            let now = Instant::now();
            if now < retry_at {
                return Some(retry_at - now);
            }
            self.retry_at = None;
        }
        // Housekeeping runs even while the relay is disabled: that is when the age alert matters.
        // One relay does it for all, whichever gets there first (a hung one is replaced).
        if shmem::claim_housekeeping(HOUSEKEEPING_BUSY) {
            let started = Instant::now();
            let done = self.housekeeping();
            if let (Ok(_), Some(threshold)) = (&done, guc::log_min_duration()) {
                if started.elapsed() >= threshold {
                    log!(
                        "outbox_pg: slow housekeeping: {} (reaper, age check and retention), above outbox.log_min_duration ({})",
                        millis(started.elapsed()),
                        millis(threshold)
                    );
                }
            }
            match done {
                Ok(busy) => {
                    shmem::schedule_housekeeping(if busy { HOUSEKEEPING_BUSY } else { poll.max(HOUSEKEEPING_BUSY) })
                }
                Err(error) => return Some(self.failed(Health::DatabaseError(error))),
            }
        }
        let until_housekeeping = shmem::until_housekeeping();
        shmem::set_paused(!guc::enabled());
        if !guc::enabled() {
            self.set_health(Health::Disabled);
            return Some(poll.min(until_housekeeping));
        }

        report_activity(true);
        let settings = TickSettings {
            slot: self.slot,
            // SAFETY: MyProcPid is set for every backend.
            pid: unsafe { pg_sys::MyProcPid },
            // Shared among the relays that run, not those asked for: when a worker slot is
            // missing, the running relays take its shards too.
            share: crate::order::SHARDS.div_ceil(shmem::relays_running().max(1) as u64) as usize,
            lease: guc::lease(),
            batch_size: guc::batch_size(),
            stream_template: guc::stream_template(),
            stream_maxlen: guc::stream_maxlen(),
            in_order: guc::ordering() == guc::Ordering::Aggregate,
            full_read: Instant::now() >= self.full_read_at,
            max_attempts: guc::max_attempts(),
            retry_delay_ms: guc::retry_delay_ms(),
            fault: guc::fault_injection(),
        };
        let mut timings = RoundTimings::default();
        let outcome = tick::tick(&mut self.sink, &settings, &mut timings);
        if !matches!(outcome, TickOutcome::ExtensionMissing | TickOutcome::DatabaseError(_)) {
            self.extension_found();
        }
        shmem::set_redis_connected(self.sink.is_connected());
        // A cut batch or a failure reads everything again next round; otherwise a full read once
        // per poll interval.
        match &outcome {
            TickOutcome::Worked { more: true, .. }
            | TickOutcome::SteppedOver
            | TickOutcome::BrokerDown { .. }
            | TickOutcome::DatabaseError(_) => self.full_read_at = Instant::now(),
            _ if settings.full_read => self.full_read_at = Instant::now() + poll,
            _ => {}
        }
        if let Some(held) = timings.shards_held {
            if held < self.shards_held {
                shmem::wake_relays();
            }
            self.shards_held = held;
        }
        log_if_slow_round(&outcome, &timings);
        if timings.total() >= settings.lease && !matches!(outcome, TickOutcome::Idle) {
            warning!(
                "outbox_pg: relay {} took {} for one round, longer than outbox.lease ({}): its shards' lease expired meanwhile and \
                 other relays may have published the same events again; raise outbox.lease",
                self.slot,
                millis(timings.total()),
                human(settings.lease)
            );
        }
        match outcome {
            TickOutcome::Worked { claimed, rejected, dead_lettered, last_rejection, more, catching_up, .. } => {
                self.recovered();
                self.note_catching_up(catching_up);
                if let Some(error) = last_rejection {
                    shmem::set_last_error(&format!("Redis rejected {rejected} events: {error}"));
                }
                if dead_lettered > 0 {
                    warning!(
                        "outbox_pg: {dead_lettered} events reached outbox.max_attempts ({}) and are now failed; \
                         see outbox.messages WHERE status = 'failed', then outbox.retry_failed() or outbox.skip_failed()",
                        settings.max_attempts
                    );
                }
                if more {
                    None
                } else {
                    // The log was drained up to the round's snapshot (events Redis rejected back
                    // off on their own). Commits made during this round have set the latch, so
                    // the wait returns at once if there is new work.
                    if claimed > 0 {
                        std::thread::sleep(coalesce_window(claimed));
                    }
                    Some(poll.min(until_housekeeping))
                }
            }
            // Nothing was sent: not a sign that Redis is back, and no reason to wait.
            TickOutcome::SteppedOver => {
                self.note_catching_up(true);
                None
            }
            TickOutcome::Idle => {
                self.recovered();
                self.note_catching_up(false);
                Some(poll.min(until_housekeeping))
            }
            TickOutcome::ExtensionMissing => {
                self.extension_missing();
                None
            }
            TickOutcome::ExtensionOutdated { installed } => {
                self.set_health(Health::ExtensionOutdated(installed));
                Some(poll.max(Duration::from_secs(1)))
            }
            TickOutcome::BrokerDown { error, .. } => Some(self.failed(Health::BrokerDown(error.0))),
            TickOutcome::DatabaseError(error) => Some(self.failed(Health::DatabaseError(error))),
        }
    }

    /// Frees the shards of relays that exited or hang, checks the age alert, applies retention.
    /// `Ok(true)` while there is anything to watch (undelivered events, tables being retired).
    fn housekeeping(&mut self) -> Result<bool, String> {
        let Some(found) = tick::housekeeping(guc::lease_ms())? else {
            return Ok(false);
        };
        if found.reaped > 0 {
            // Free shards: the relays below their share take them at once, not at their next poll.
            shmem::wake_relays();
            log!(
                "outbox_pg: freed {} shards of a relay that exited or whose lease expired; the other relays take them over and publish what it had not finished",
                found.reaped
            );
        }
        for (slot, events, age) in claims::newly_expired(guc::lease()) {
            log!(
                "outbox_pg: relay {slot} has held its claim of {events} events for {} without finishing it, longer than outbox.lease ({}); other relays publish them again",
                human(age),
                human(guc::lease())
            );
        }
        self.check_alert(found.oldest_pending_age);

        let mut purged = 0;
        if let Some(retention_s) = guc::retention_s() {
            purged = tick::retention(retention_s)?;
        }
        Ok(found.oldest_pending_age.is_some() || found.reaped > 0 || purged > 0)
    }

    /// Logs a WARNING when the oldest pending event crosses `outbox.alert_age` (then once a minute
    /// while it stays above), and a LOG line when it is back below.
    fn check_alert(&mut self, oldest_pending_age: Option<Duration>) {
        let Some(threshold) = guc::alert_age() else {
            shmem::set_alert_logged(false);
            return;
        };
        let above = oldest_pending_age.filter(|age| *age >= threshold);
        match (above, shmem::alert_logged_at()) {
            (Some(age), last) if last.is_none_or(|since| since >= ALERT_REPEAT) => {
                warning!(
                    "outbox_pg: oldest pending event is {} old, above outbox.alert_age ({}); the relay is {}",
                    human(age),
                    human(threshold),
                    match &self.health {
                        Health::Disabled => "paused (outbox.enabled = off)".to_string(),
                        Health::BrokerDown(error) => format!("failing to reach Redis: {error}"),
                        Health::DatabaseError(error) => format!("failing: {error}"),
                        Health::ExtensionOutdated(_) => "waiting for ALTER EXTENSION outbox_pg UPDATE".to_string(),
                        Health::Healthy => "running; check failed events and per-aggregate backlogs".to_string(),
                    }
                );
                shmem::set_alert_logged(true);
            }
            (None, Some(_)) => {
                log!(
                    "outbox_pg: oldest pending event is {} old, below outbox.alert_age ({}) again; alert cleared",
                    oldest_pending_age.map(human).unwrap_or_else(|| "0s (none pending)".into()),
                    human(threshold)
                );
                shmem::set_alert_logged(false);
            }
            _ => {}
        }
    }

    /// Logs when the relay starts reading a backlog window by window (a shard more than a second
    /// behind reads up to the next recorded snapshot, not to now) and when it has caught up.
    fn note_catching_up(&mut self, catching_up: bool) {
        if catching_up == self.catching_up {
            return;
        }
        self.catching_up = catching_up;
        if catching_up {
            log!(
                "outbox_pg: relay {} is catching up on a backlog more than a second old, one recorded snapshot (about a second of traffic) per round",
                self.slot
            );
        } else {
            log!("outbox_pg: relay {} has caught up", self.slot);
        }
    }

    fn failed(&mut self, health: Health) -> Duration {
        self.set_health(health);
        let delay = self.backoff.next_delay();
        self.retry_at = Some(Instant::now() + delay);
        delay
    }

    /// The extension is installed: the launcher may start the other relays.
    fn extension_found(&mut self) {
        if self.found_extension {
            return;
        }
        self.found_extension = true;
        let _ = shmem::set_extension_state(ExtensionState::Present);
        log!(
            "outbox_pg relay {} started: database \"{}\", Redis at {}",
            self.slot,
            self.database,
            self.sink.describe()
        );
        if self.slot == 0 {
            warn_about_settings();
        }
    }

    /// No outbox_pg in this database (never, or dropped): tell the launcher and exit. A probe of a
    /// database nobody asked for stays quiet; one that `outbox.databases` names is worth a line.
    fn extension_missing(&mut self) {
        let before = shmem::set_extension_state(ExtensionState::Missing);
        if self.found_extension {
            if before == ExtensionState::Present {
                log!(
                    "outbox_pg: extension outbox_pg was dropped from database \"{}\"; its relays stop until CREATE EXTENSION outbox_pg",
                    self.database
                );
            }
        } else if guc::databases().is_some() {
            log!(
                "outbox_pg: extension outbox_pg is not installed in database \"{}\", which outbox.databases names; its relays start at CREATE EXTENSION outbox_pg",
                self.database
            );
        } else {
            debug1!("outbox_pg: no extension outbox_pg in database \"{}\"; no relay there", self.database);
        }
        self.exit = true;
    }

    fn recovered(&mut self) {
        self.set_health(Health::Healthy);
        self.backoff.reset();
    }

    /// Logs transitions only: a Redis outage produces one WARNING when it starts and one LOG when
    /// it ends, however many retries happen in between.
    fn set_health(&mut self, health: Health) {
        if let Health::BrokerDown(error) | Health::DatabaseError(error) = &health {
            shmem::set_last_error(error);
        }
        // One state per kind of trouble: a Redis going from "connection reset" to "connection
        // refused" is still the same outage; another Redis failing is a new one. Checked before
        // describing the target, since every healthy round passes through here.
        let same_kind = std::mem::discriminant(&health) == std::mem::discriminant(&self.health);
        let outage = matches!(health, Health::BrokerDown(_));
        if same_kind && !outage {
            return;
        }
        let target = self.sink.describe();
        if same_kind && self.outage_target.as_deref() == Some(target.as_str()) {
            return;
        }
        self.outage_target = outage.then(|| target.clone());
        match &health {
            Health::Healthy => match &self.health {
                Health::BrokerDown(_) => log!(
                    "outbox_pg: publishing to Redis at {target} again after {} failed attempts",
                    self.backoff.failures()
                ),
                Health::ExtensionOutdated(_) => log!(
                    "outbox_pg: extension outbox_pg is at version {} in database \"{}\"; relaying",
                    tick::LIBRARY_VERSION,
                    self.database
                ),
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
            Health::ExtensionOutdated(installed) => {
                let problem = format!(
                    "database \"{}\" has extension outbox_pg {installed} but the server runs library {}",
                    self.database,
                    tick::LIBRARY_VERSION
                );
                shmem::set_last_error(&problem);
                warning!(
                    "outbox_pg: {problem}; the relay waits, events stay pending (none is lost); run ALTER EXTENSION outbox_pg UPDATE in that database"
                )
            }
            Health::Disabled => log!("outbox_pg: outbox.enabled is off; the relay is paused, events stay pending"),
        }
        self.health = health;
    }
}

/// The name of the database this relay is connected to (inside a transaction).
fn current_database() -> String {
    // SAFETY: MyDatabaseId is set once connected; get_database_name returns a palloc'd copy or NULL.
    unsafe {
        let name = pg_sys::get_database_name(pg_sys::MyDatabaseId);
        if name.is_null() {
            return format!("oid {}", pg_sys::MyDatabaseId.to_u32());
        }
        std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned()
    }
}

/// The settings PostgreSQL applied at connection from pg_db_role_setting (`ALTER DATABASE ...
/// SET`, `ALTER ROLE ... [IN DATABASE ...] SET`), as one comparable text (inside a transaction).
fn own_settings() -> String {
    const QUERY: &str = "SELECT coalesce(string_agg(setconfig::text, ';' ORDER BY setdatabase, setrole), '')
                           FROM pg_db_role_setting
                          WHERE setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database()))
                            AND setrole IN (0, (SELECT oid FROM pg_roles WHERE rolname = session_user))";
    Spi::get_one::<String>(QUERY).ok().flatten().unwrap_or_default()
}

/// A duration as an operator reads it: `42.0s`, `7m 5s`, `2h 3m`.
fn human(duration: Duration) -> String {
    let secs = duration.as_secs();
    match secs {
        0..60 => format!("{:.1}s", duration.as_secs_f64()),
        60..3600 => format!("{}m {}s", secs / 60, secs % 60),
        _ => format!("{}h {}m", secs / 3600, (secs % 3600) / 60),
    }
}

/// Whether the relay was asked to stop (SIGTERM: `pg_terminate_backend`, shutdown, the launcher).
/// pgrx's flag is cleared when read; this one stays set once seen, so that every place that asks
/// gets the same answer.
fn stop_requested() -> bool {
    static STOPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if BackgroundWorker::sigterm_received() {
        STOPPING.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    STOPPING.load(std::sync::atomic::Ordering::SeqCst)
}

/// Settings that work but give up part of a guarantee, logged at start and after each reload, by
/// relay 0 only. A lease must outlive a round: while a relay waits on Redis, its shards' lease has
/// to stay valid, or other relays take them over and publish the same events a second time. A round
/// can wait on Redis for up to `outbox.redis_timeout` (the connect, then the exchange), so a lease
/// shorter than twice that produces duplicates under a slow Redis. And behind Sentinel or Cluster,
/// only `outbox.redis_wait_replicas` makes a failover lose nothing.
fn warn_about_settings() {
    let (lease, timeout) = (guc::lease(), guc::redis_timeout());
    if let Some(reason) = lease_problem(lease, timeout) {
        warning!("outbox_pg: {reason}");
    }
    if guc::redis_mode() != guc::RedisMode::Standalone && guc::redis_wait_replicas() == 0 {
        warning!(
            "outbox_pg: outbox.redis_mode is {} and outbox.redis_wait_replicas is 0: Redis replicates asynchronously, so a \
             failover can lose the entries the old master acknowledged last; set outbox.redis_wait_replicas = 1",
            if guc::redis_mode() == guc::RedisMode::Cluster { "cluster" } else { "sentinel" }
        );
    }
}

/// Why `lease` is too short for `redis_timeout`, if it is.
fn lease_problem(lease: Duration, redis_timeout: Duration) -> Option<String> {
    (lease < redis_timeout * 2).then(|| {
        format!(
            "outbox.lease ({}) is shorter than twice outbox.redis_timeout ({}): a relay waiting on a slow Redis \
             loses its claim and others publish the same events again; set outbox.lease to at least {}",
            human(lease),
            human(redis_timeout),
            human(redis_timeout * 2)
        )
    })
}

fn redis_config() -> RedisConfig {
    RedisConfig {
        url: guc::redis_url(),
        mode: guc::redis_mode(),
        sentinel_master: guc::redis_sentinel_master(),
        password_file: guc::redis_password_file(),
        timeout: guc::redis_timeout(),
        wait_replicas: guc::redis_wait_replicas(),
        tls: TlsFiles {
            ca_file: guc::redis_tls_ca_file(),
            cert_file: guc::redis_tls_cert_file(),
            key_file: guc::redis_tls_key_file(),
        },
    }
}

fn seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    // SAFETY: MyProcPid is set for every backend.
    nanos ^ (unsafe { pg_sys::MyProcPid } as u64).rotate_left(32)
}

/// `outbox.log_min_duration`: one LOG line for a round that took at least that long, with the time
/// of each phase, so that a stall can be placed (the database, Redis, or settling). Failed rounds
/// are left out: an outage is reported once by its WARNING, not once per retry.
fn log_if_slow_round(outcome: &TickOutcome, timings: &RoundTimings) {
    let Some(threshold) = guc::log_min_duration() else {
        return;
    };
    if timings.total() < threshold {
        return;
    }
    let events = match outcome {
        TickOutcome::Worked { claimed, published, .. } => format!("{claimed} claimed, {published} published"),
        TickOutcome::Idle => "nothing pending".to_string(),
        TickOutcome::SteppedOver => "a lagging shard stepped over an empty window".to_string(),
        TickOutcome::BrokerDown { .. }
        | TickOutcome::ExtensionMissing
        | TickOutcome::ExtensionOutdated { .. }
        | TickOutcome::DatabaseError(_) => return,
    };
    log!(
        "outbox_pg: slow round: {} ({events}): claim {}, publish to Redis {}, settle {}; above outbox.log_min_duration ({})",
        millis(timings.total()),
        millis(timings.claim),
        millis(timings.publish),
        millis(timings.settle),
        millis(threshold)
    );
}

fn millis(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
}

/// Shows what the relay is doing in `pg_stat_activity` (state and query).
fn report_activity(publishing: bool) {
    let (state, text) = if publishing {
        (pg_sys::BackendState::STATE_RUNNING, c"outbox_pg: publishing")
    } else {
        (pg_sys::BackendState::STATE_IDLE, c"outbox_pg: waiting for events")
    };
    // SAFETY: a static NUL-terminated string; pgstat copies it.
    unsafe { pg_sys::pgstat_report_activity(state, text.as_ptr()) };
}

#[pg_guard]
unsafe extern "C-unwind" fn forget_relay(_code: i32, slot: pg_sys::Datum) {
    // Its unsettled events are pending: the others may claim them at once.
    claims::clear(slot.value());
    shmem::unregister_relay(slot.value());
}

#[cfg(test)]
mod tests {
    use super::{coalesce_window, human, COALESCE_MAX, COALESCE_MIN};
    use std::time::Duration;

    #[test]
    fn a_lease_shorter_than_two_redis_timeouts_is_reported() {
        let second = Duration::from_secs(1);
        assert!(super::lease_problem(second * 30, second * 5).is_none());
        assert!(super::lease_problem(second * 10, second * 5).is_none());
        let problem = super::lease_problem(second * 9, second * 5).unwrap();
        assert!(problem.contains("outbox.lease (9.0s)") && problem.contains("at least 10.0s"), "{problem}");
    }

    #[test]
    fn the_pause_between_rounds_grows_with_their_size_within_bounds() {
        assert_eq!(coalesce_window(1), COALESCE_MIN);
        assert_eq!(coalesce_window(2), COALESCE_MIN);
        assert_eq!(coalesce_window(6), Duration::from_micros(1500));
        assert_eq!(coalesce_window(1000), COALESCE_MAX);
        assert_eq!(coalesce_window(usize::MAX), COALESCE_MAX);
    }

    #[test]
    fn durations_read_like_an_operator_writes_them() {
        assert_eq!(human(Duration::from_millis(42_300)), "42.3s");
        assert_eq!(human(Duration::from_secs(7 * 60 + 5)), "7m 5s");
        assert_eq!(human(Duration::from_secs(2 * 3600 + 3 * 60 + 9)), "2h 3m");
    }
}
