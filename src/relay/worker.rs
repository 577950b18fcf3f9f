//! The relay worker: connected to one relayed database, it runs rounds (`tick`) while there is work,
//! sleeps on its latch (woken by committing enqueuers, or by the poll interval) when there is none,
//! and backs off when Redis or the database fails. Between rounds it does the housekeeping: return
//! expired claims, watch the oldest pending event's age, delete expired published events. Started
//! and restarted by the launcher; it exits when outbox_pg is not (or no longer) installed in its
//! database, which tells the launcher to leave that database alone, and when its database's own
//! settings (`ALTER DATABASE ... SET outbox.*`) change, so that the launcher starts it with them.
//!
//! One file, longer than most: the loop and what each outcome of a round, a replay round, a
//! housekeeping pass and a loss check means for it (health, backoff, the next wait); a split would
//! put the decisions about one relay's next step in several places.

use std::time::{Duration, Instant};

use outbox_sink::redis::RedisSink;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::prelude::*;

use crate::guc;
use crate::relay::backoff::Backoff;
use crate::relay::health::{human, log_if_slow_round, millis, Health, HealthLog};
use crate::relay::housekeeping::{self, HousekeepingOutcome};
use crate::relay::losses::{self, MarkKeeping};
use crate::relay::replay::{self, ReplayOutcome};
use crate::relay::round::{self, Flight, RoundTimings, TickOutcome};
use crate::relay::settings::{self, adopt_own_settings, redis_config, warn_about_settings};
use crate::relay::spi::SpiDatabase;
use crate::relay::state::RoundState;
use crate::relay::tick_settings::TickSettings;
use crate::relay::txn;
use crate::relay::{read, settle};
use crate::shared::in_flight;
use crate::shared::{self, ExtensionState};

/// Delay of the first retry after Redis or the database failed; doubles up to `BACKOFF_CAP`.
const BACKOFF_BASE: Duration = Duration::from_millis(100);
const BACKOFF_CAP: Duration = Duration::from_secs(10);
/// Housekeeping cadence while anything is undelivered or being purged; when the outbox is empty it
/// runs only once per poll interval, so an idle relay queries no more often than that.
const HOUSEKEEPING_BUSY: Duration = Duration::from_secs(1);
/// While another relay replays what Redis lost, how long this one waits before it looks again.
const REPAIR_WAIT: Duration = Duration::from_millis(20);
/// With live traffic going on, a running replay gets a round at least this often.
const REPLAY_EVERY: Duration = Duration::from_millis(20);
/// A live round that published something this recently means live traffic flows: replay rounds
/// are short (`replay::Limits::LIVE`) and take at most half of the relay's time.
const LIVE_RECENTLY: Duration = Duration::from_secs(1);
struct Relay {
    /// Which of the `outbox.workers` relays this is.
    slot: usize,
    sink: RedisSink,
    /// The connection the rounds run their statements on (SPI).
    db: SpiDatabase,
    /// What the rounds keep from one to the next.
    state: RoundState,
    /// A round sent to Redis and not landed yet (src/relay/round.rs, `tick`).
    flight: Option<Flight>,
    backoff: Backoff,
    health: HealthLog,
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
    /// The database's and role's own settings (pg_db_role_setting) the relay started with, and
    /// when they were last compared with the catalog.
    own_settings: String,
    own_settings_read_at: Instant,
    /// The stream marks' loading, storing and pruning (src/relay/losses.rs).
    marks: MarkKeeping,
    /// When an idle relay last made sure its Redis connection is alive (once per poll interval).
    kept_alive_at: Instant,
    /// When the last replay round ended, and how long it took: with live traffic going on, the
    /// next one runs once live rounds have had as long (and at least `REPLAY_EVERY` after it).
    replayed_at: Instant,
    replay_took: Duration,
    /// When a live round last published something.
    live_at: Option<Instant>,
    /// Redis lost entries and `outbox.replay_on_loss` is on: no live round runs until the replays
    /// that repair the losses are done, so that in each stream the replayed events come first.
    repairing: bool,
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn outbox_pg_relay_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    outbox_round::hooks::install(round_hooks());
    let database_oid = pg_sys::Oid::from(arg.value() as u32);
    // "<slot>", or "<slot> copy-reported" (src/relay/launcher.rs, start_relay).
    let extra = BackgroundWorker::get_extra();
    let mut words = extra.split_whitespace();
    let slot = words.next().and_then(|w| w.parse::<usize>().ok()).unwrap_or(0).min(shared::MAX_RELAYS - 1);
    let copy_reported = words.any(|w| w == "copy-reported");
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(database_oid), None);
    // Before the first statement: the database's own settings (its search_path among them) were
    // applied by the connection, and must not choose what the relay's statements run.
    settings::pin_session_settings();
    // Until attach_signal_handlers ran, PostgreSQL's worker start-up ignored SIGHUP: a reload the
    // postmaster signalled in that window is lost. Reading the configuration once now catches it.
    // SAFETY: the documented way for a worker to re-read postgresql.conf, outside any transaction.
    unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    let (database, own_settings) = match txn::run(|| {
        settings::pin_identity();
        Ok::<_, String>((current_database(), adopt_own_settings()))
    }) {
        Ok((database, Some(own_settings))) => (database, own_settings),
        Ok((database, None)) => {
            log!(
                "outbox_pg relay {slot}: a setting of database \"{database}\" was reset while the relay connected; restarting to apply it"
            );
            return;
        }
        Err(error) => (format!("oid {}", database_oid.to_u32()), error),
    };

    #[cfg(feature = "fault-injection")]
    crate::faults::relay_connected();
    if shared::step_aside_requested() {
        // Connected just before a statement that needs the database without sessions locked it.
        log!("outbox_pg relay {slot}: database \"{database}\" is being dropped, renamed or copied; stepping aside");
        return;
    }
    if !shared::register_relay(slot) {
        // The launcher gave up on this database meanwhile (dropped, filtered out).
        return;
    }
    in_flight::clear(slot);
    // A (re)started relay first returns the claims its predecessor left behind.
    shared::schedule_housekeeping(Duration::ZERO);
    // SAFETY: `forget_relay` matches pg_on_exit_callback and only touches shared atomics.
    unsafe { pg_sys::before_shmem_exit(Some(forget_relay), pg_sys::Datum::from(slot)) };

    let mut relay = Relay {
        slot,
        sink: RedisSink::new(),
        db: SpiDatabase::new(&[read::KEPT, settle::KEPT]),
        state: RoundState::default(),
        flight: None,
        backoff: Backoff::new(BACKOFF_BASE, BACKOFF_CAP, seed()),
        health: HealthLog::new(copy_reported),
        retry_at: None,
        database,
        shards_held: 0,
        full_read_at: Instant::now(),
        catching_up: false,
        found_extension: false,
        exit: false,
        own_settings,
        own_settings_read_at: Instant::now(),
        marks: MarkKeeping::default(),
        kept_alive_at: Instant::now(),
        replayed_at: Instant::now(),
        replay_took: Duration::ZERO,
        live_at: None,
        repairing: false,
    };
    relay.sink.configure(redis_config());

    loop {
        shared::relay_alive(relay.slot);
        if shared::step_aside_requested() {
            log!(
                "outbox_pg relay {}: database \"{}\" is being dropped, renamed or copied; stepping aside",
                relay.slot,
                relay.database
            );
            break;
        }
        let reloaded = BackgroundWorker::sighup_received();
        if reloaded {
            // SAFETY: the documented way for a worker to re-read postgresql.conf after SIGHUP.
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
        // A reload does not re-read pg_db_role_setting: start again to apply a change there. It is
        // also compared once per poll interval, because the reload may come before the change is
        // visible: `ALTER DATABASE ... SET ...; SELECT pg_reload_conf();` sent as one query string
        // is one transaction, which signals the relays before it commits (seen in CI).
        if reloaded || relay.own_settings_read_at.elapsed() >= guc::poll_interval() {
            relay.own_settings_read_at = Instant::now();
            match txn::run(|| Ok::<_, String>(settings::own_settings())) {
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
        }
        if reloaded {
            if relay.slot == 0 && relay.found_extension {
                warn_about_settings();
            }
            relay.land_in_flight();
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
            #[cfg(feature = "fault-injection")]
            crate::faults::reloaded();
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
                // Awake at least every third of the lease, so that it keeps counting as alive and
                // renews its claim whatever outbox.poll_interval says.
                let timeout = timeout.min(guc::lease() / 3);
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
    relay.land_in_flight();
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
        if let Some(wait) = self.housekeeping_if_due(poll) {
            return Some(wait);
        }
        let until_housekeeping = shared::until_housekeeping();
        shared::set_paused(!guc::enabled());
        if !guc::enabled() {
            self.land_in_flight();
            self.release_shards();
            self.set_health(Health::Disabled);
            return Some(poll.min(until_housekeeping));
        }
        report_activity(true);
        let settings = self.tick_settings();
        if let Some(wait) = self.before_live_round(&settings) {
            return Some(wait);
        }
        let mut timings = RoundTimings::default();
        let mut outcome =
            round::tick(&mut self.db, &mut self.sink, &settings, &mut self.state, &mut self.flight, &mut timings);
        // Nothing to publish: is Redis still there, and still the one the marks concern? Once per
        // poll interval, and at every retry of an outage: an idle round says nothing of Redis, and
        // taken as a recovery it logged "publishing again" every second of an outage.
        let in_outage = self.backoff.failures() > 0;
        if matches!(outcome, TickOutcome::Idle) && (in_outage || self.kept_alive_at.elapsed() >= poll) {
            self.kept_alive_at = Instant::now();
            if let Err(error) = self.sink.keep_alive() {
                outcome = TickOutcome::BrokerDown { error, published: 0 };
            }
        }
        // A loss check's pass goes on a chunk at a time while there is nothing to publish
        // (sink/src/marks.rs); while streams are left, the relay comes back at once.
        let checking = matches!(outcome, TickOutcome::Idle) && self.sink.check_between_rounds();
        if let Some(wait) = self.after_live_round(&outcome, &timings, &settings, poll) {
            return Some(wait);
        }
        // Decided before live_outcome takes the outcome: whether this is a replay round's turn.
        let replay_turn = self.replay_turn(&outcome);
        let next = self.live_outcome(outcome, &settings, poll, until_housekeeping);
        let next = if checking { Some(Duration::ZERO) } else { next };
        if replay_turn && next.is_none_or(|wait| !wait.is_zero()) && self.retry_at.is_none() {
            return self.replay(&settings).or(next);
        }
        if self.flight.is_none() && self.retry_at.is_none() && shared::replay_requested() && self.live_recently() {
            // The replay's turn comes once live rounds have had their share: wake up for it.
            let turn = self.replay_took.max(REPLAY_EVERY).saturating_sub(self.replayed_at.elapsed());
            return next.map(|wait| wait.min(turn));
        }
        next
    }

    /// Housekeeping, when this relay's turn for it has come: `Some` to end the turn there (the
    /// relay must exit, or the database failed).
    fn housekeeping_if_due(&mut self, poll: Duration) -> Option<Duration> {
        // Housekeeping runs even while the relay is disabled: that is when the age alert matters.
        // One relay does it for all, whichever gets there first (a hung one is replaced).
        if !shared::claim_housekeeping(HOUSEKEEPING_BUSY) {
            return None;
        }
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
        if self.exit {
            return Some(Duration::ZERO);
        }
        match done {
            Ok(busy) => {
                shared::schedule_housekeeping(if busy { HOUSEKEEPING_BUSY } else { poll.max(HOUSEKEEPING_BUSY) });
                None
            }
            Err(error) => Some(self.failed(Health::DatabaseError(error))),
        }
    }

    /// The settings of the round about to run, as the GUCs and shared memory say now.
    fn tick_settings(&self) -> TickSettings {
        TickSettings {
            slot: self.slot,
            // SAFETY: MyProcPid is set for every backend.
            pid: unsafe { pg_sys::MyProcPid },
            // Shared among the relays that run, not those asked for: when a worker slot is
            // missing, the running relays take its shards too.
            // and alive: a hung relay stops counting after the lease, so that the others take all
            // of its shards over rather than their share while it counted.
            share: crate::enqueue::order::SHARDS.div_ceil(shared::relays_alive(guc::lease()).max(1) as u64) as usize,
            lease: guc::lease(),
            batch_size: guc::batch_size(),
            entries: settings::entry_settings(&self.database),
            in_order: guc::ordering() == guc::Ordering::Aggregate,
            full_read: Instant::now() >= self.full_read_at,
            max_attempts: guc::max_attempts(),
            retry_delay_ms: guc::retry_delay_ms(),
            redis_timeout: guc::redis_timeout(),
            replay_on_loss: guc::replay_on_loss(),
        }
    }

    /// What must hold before a live round: the stored marks loaded, and no loss repair running.
    /// `Some` when no live round runs now (and how long to wait).
    fn before_live_round(&mut self, settings: &TickSettings) -> Option<Duration> {
        // The marks earlier relays stored, before this relay's first write: a stream Redis lost
        // while no relay ran would be written to again first, and the loss hidden.
        // (Only where the extension was last found at this library's version: the table is 0.3.0's.)
        if self.state.version_checked.is_some() && !self.marks.loaded() {
            if let Err(error) = self.keep_marks() {
                return Some(self.failed(Health::DatabaseError(error)));
            }
        }
        // No live round while a loss repair runs, whichever relay of the database recorded the
        // loss (shared::repairs_raised: two atomic loads a round; the query only while raised).
        let raised = if guc::replay_on_loss() { shared::repairs_raised() } else { None };
        if !self.repairing && raised.is_none() {
            return None;
        }
        match losses::repairs_running(&mut self.db, &mut self.state) {
            // Another relay may be running the repair: wait a little for it.
            Ok(true) => {
                self.repairing = true;
                Some(self.replay(settings).unwrap_or(REPAIR_WAIT))
            }
            Ok(false) => {
                self.repairing = false;
                if let Some(raised) = raised {
                    shared::repairs_checked(raised);
                }
                None
            }
            Err(error) => Some(self.failed(Health::DatabaseError(error.into()))),
        }
    }

    /// The bookkeeping after a live round: marks stored, losses reported, shared state, the next
    /// full read, slow-round logs. `Some` when the turn ends here (a loss to repair, a failure).
    fn after_live_round(
        &mut self,
        outcome: &TickOutcome,
        timings: &RoundTimings,
        settings: &TickSettings,
        poll: Duration,
    ) -> Option<Duration> {
        // Only where the extension is ready at this library's version (the marks' table is
        // 0.3.0's): after a round that could run.
        if matches!(outcome, TickOutcome::Worked { .. } | TickOutcome::Idle | TickOutcome::SteppedOver) {
            if let Err(error) = self.keep_marks() {
                return Some(self.failed(Health::DatabaseError(error)));
            }
        }
        if self.report_losses() && guc::replay_on_loss() {
            // The round stopped before writing (the sink found the loss first): repair, then go on.
            self.repairing = true;
            return Some(Duration::ZERO);
        }
        if !matches!(outcome, TickOutcome::ExtensionMissing | TickOutcome::DatabaseError(_)) {
            self.extension_found();
        }
        shared::set_redis_connected(self.sink.is_connected());
        // A cut batch or a failure reads everything again next round; otherwise a full read once
        // per poll interval.
        match outcome {
            // A round left in flight is landed by the next round, which reads on a kept claim.
            TickOutcome::Worked { in_flight: true, .. } => {}
            TickOutcome::Worked { more: true, .. }
            | TickOutcome::SteppedOver
            | TickOutcome::BrokerDown { .. }
            | TickOutcome::DatabaseError(_) => self.full_read_at = Instant::now(),
            _ if settings.full_read => self.full_read_at = Instant::now() + poll,
            _ => {}
        }
        if let Some(held) = timings.shards_held {
            if held < self.shards_held {
                shared::wake_relays();
            }
            self.shards_held = held;
        }
        log_if_slow_round(outcome, timings);
        if timings.total() >= settings.lease && !matches!(outcome, TickOutcome::Idle) {
            warning!(
                "outbox_pg: relay {} took {} for one round, longer than outbox.lease ({}): its shards' lease expired meanwhile and \
                 other relays may have published the same events again; raise outbox.lease",
                self.slot,
                millis(timings.total()),
                human(settings.lease)
            );
        }
        if matches!(outcome, TickOutcome::Worked { claimed, .. } if *claimed > 0) {
            self.live_at = Some(Instant::now());
        }
        None
    }

    /// Whether a replay round runs after this live round. A time share: while live traffic
    /// flows, replay rounds (short ones) alternate with at least as much time for live rounds, so
    /// a live event waits at most about one short replay round; without live traffic, a replay
    /// round follows every idle live round.
    fn replay_turn(&self, outcome: &TickOutcome) -> bool {
        self.flight.is_none()
            && shared::replay_requested()
            && if self.live_recently() {
                self.replayed_at.elapsed() >= self.replay_took.max(REPLAY_EVERY)
            } else {
                matches!(outcome, TickOutcome::Idle | TickOutcome::Worked { more: false, .. })
                    || self.replayed_at.elapsed() >= REPLAY_EVERY
            }
    }

    /// What a live round's outcome means for the relay: its health, its logs, and how long to wait
    /// (None: go on at once).
    fn live_outcome(
        &mut self,
        outcome: TickOutcome,
        settings: &TickSettings,
        poll: Duration,
        until_housekeeping: Duration,
    ) -> Option<Duration> {
        match outcome {
            TickOutcome::Worked {
                claimed,
                rejected,
                dead_lettered,
                last_rejection,
                more,
                catching_up,
                in_flight,
                ..
            } => {
                // A round only sent says nothing yet about Redis: its landing will.
                if claimed > 0 || !in_flight {
                    self.recovered();
                }
                self.note_catching_up(catching_up);
                if let Some(error) = last_rejection {
                    shared::set_last_error(&format!("Redis rejected {rejected} events: {error}"));
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
                        std::thread::sleep(outbox_round::coalesce::coalesce_window(claimed, guc::linger()));
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
            TickOutcome::CopiedInstallation { original } => {
                // Said once (a WARNING); then the relay leaves, and the launcher gives the entry to
                // a database that publishes, until adopt_copy() asks it to look again.
                self.set_health(Health::Copied(original));
                let _ = shared::set_extension_state(ExtensionState::Copy);
                self.exit = true;
                None
            }
            TickOutcome::BrokerDown { error, .. } => Some(self.failed(Health::BrokerDown(error.0))),
            TickOutcome::DatabaseError(error) => Some(self.failed(Health::DatabaseError(error))),
        }
    }

    /// Frees the shards of relays that exited or hang, checks the age alert, applies retention.
    /// `Ok(true)` while there is anything to watch (undelivered events, tables being retired).
    fn housekeeping(&mut self) -> Result<bool, String> {
        let found = match housekeeping::housekeeping(&mut self.db, &mut self.state, guc::lease_ms())? {
            HousekeepingOutcome::Done(found) => found,
            // Also while paused: a probe of a database without outbox_pg must not stay connected
            // (holding a worker slot and a shared-memory entry) just because relaying is off.
            HousekeepingOutcome::ExtensionMissing => {
                self.extension_missing();
                return Ok(false);
            }
            HousekeepingOutcome::NotReady => return Ok(false),
        };
        self.extension_found();
        if found.reaped > 0 {
            // Free shards: the relays below their share take them at once, not at their next poll.
            shared::wake_relays();
            log!(
                "outbox_pg: freed {} shards of a relay that exited or whose lease expired; the other relays take them over and publish what it had not finished",
                found.reaped
            );
        }
        for (slot, events, age) in in_flight::newly_expired(guc::lease()) {
            log!(
                "outbox_pg: relay {slot} has held its claim of {events} events for {} without finishing it, longer than outbox.lease ({}); other relays publish them again",
                human(age),
                human(guc::lease())
            );
        }
        self.health.check_alert(found.oldest_pending_age);
        if found.replays_running {
            shared::request_replay();
        }
        if found.repairs_running && guc::replay_on_loss() {
            // Also after a crash restart emptied shared memory: the gate closes for every relay.
            shared::raise_repairs();
        }

        let purged = housekeeping::retention(&mut self.db, guc::retention_s())?;
        Ok(found.oldest_pending_age.is_some() || found.reaped > 0 || purged > 0)
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
        let _ = shared::set_extension_state(ExtensionState::Present);
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
        let before = shared::set_extension_state(ExtensionState::Missing);
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

    /// Whether live rounds published something lately (live traffic flows).
    fn live_recently(&self) -> bool {
        !self.repairing && self.live_at.is_some_and(|at| at.elapsed() < LIVE_RECENTLY)
    }

    /// Runs one replay round (src/relay/replay.rs) between live rounds; how long to wait after it
    /// (Some(0): go on at once), or None when there was nothing to replay.
    fn replay(&mut self, settings: &TickSettings) -> Option<Duration> {
        let limits = if self.live_recently() { replay::Limits::LIVE } else { replay::Limits::IDLE };
        let started = Instant::now();
        let outcome = replay::replay_round(&mut self.db, &mut self.sink, settings, &mut self.state, limits);
        self.replayed_at = Instant::now();
        self.replay_took = started.elapsed();
        let repair_losses = self.report_losses() && guc::replay_on_loss();
        if repair_losses {
            self.repairing = true;
        }
        match outcome {
            // The sink stopped the round because its check found losses (recorded just now): not
            // a failure of Redis, and the check's next chunk comes at once. Counted as one, a pass
            // over thousands of lost streams took minutes of growing backoff.
            ReplayOutcome::BrokerDown(_) if repair_losses => Some(Duration::ZERO),
            ReplayOutcome::Nothing => {
                shared::replays_done();
                None
            }
            // Throttled, or another relay's: look again soon (commits still wake the relay).
            ReplayOutcome::Waiting => Some(REPLAY_EVERY),
            ReplayOutcome::Ran { id, refused, done, .. } => {
                if done {
                    log!("outbox_pg: replay {id} is done (outbox.replays)");
                }
                if refused > 0 {
                    shared::set_last_error(&format!("Redis refused {refused} events of replay {id} (outbox.replays)"));
                }
                Some(Duration::ZERO)
            }
            ReplayOutcome::BrokerDown(error) => Some(self.failed(Health::BrokerDown(error.0))),
            ReplayOutcome::DatabaseError(error) => Some(self.failed(Health::DatabaseError(error))),
        }
    }

    /// The stream marks: those earlier relays stored, loaded before this relay's first round; its
    /// own stored when they moved, at most once a second, so that a relay started anew knows
    /// them.
    fn keep_marks(&mut self) -> Result<(), String> {
        self.marks.keep(&mut self.db, &mut self.sink, self.slot, guc::retention_s())
    }

    /// Logs what a new connection learnt of the server, then records and logs the losses the
    /// sink's checks found (src/relay/losses.rs); whether there were any.
    fn report_losses(&mut self) -> bool {
        if let Some(news) = self.sink.take_capabilities_news() {
            log!("outbox_pg: relay {} connected to {news}", self.slot);
        }
        for (stream, length, over) in self.sink.take_held_back_news() {
            let maxlen = guc::stream_maxlen().unwrap_or(0);
            if over {
                warning!(
                    "outbox_pg: stream \"{stream}\" holds {length} entries, more than twice outbox.stream_maxlen = {maxlen}: with outbox.stream_trim = 'acked' Redis trims only entries every consumer group acknowledged, and a group has stopped acknowledging; the stream grows until it does (XINFO GROUPS shows each group's pending entries and lag)"
                );
            } else {
                log!("outbox_pg: stream \"{stream}\" is back to {length} entries (outbox.stream_maxlen = {maxlen}): its consumer groups acknowledge again");
            }
        }
        if let Some(refused) = self.sink.check_refused.as_mut().filter(|refused| !refused.is_empty()) {
            log!(
                "outbox_pg: the relay's Redis user may not run XINFO STREAM ({refused}): lost entries cannot be noticed; grant it +xinfo|stream"
            );
            // Logged once: the empty text still turns the checks off.
            refused.clear();
        }
        let found = self.sink.take_losses();
        if found.is_empty() {
            return false;
        }
        if let Err(error) = losses::report(&mut self.db, self.sink.marks_target(), found, guc::replay_on_loss()) {
            warning!("outbox_pg: could not record lost Redis entries: {error}");
        }
        true
    }

    /// Gives up this relay's shards while it is paused (`outbox.enabled = off`), once the round in
    /// flight is landed (`read::release_shards`); an outbox-relay taking the database over takes them
    /// at its next claim. A failure changes nothing: the lease frees them later.
    fn release_shards(&mut self) {
        if self.state.held_shards == 0 {
            return;
        }
        // SAFETY: MyProcPid is set for every backend.
        let pid = unsafe { pg_sys::MyProcPid };
        let _ = read::release_shards(&mut self.db, &mut self.state, pid, guc::lease());
    }

    /// Lands a round left in flight (round/src/round.rs, `tick`) before the relay pauses, changes
    /// its Redis or exits: its replies are read and it is finished, so that nothing it published
    /// is published again, and nothing waits on a round nobody lands.
    fn land_in_flight(&mut self) {
        match round::land_in_flight(&mut self.db, &mut self.sink, &mut self.state, &mut self.flight) {
            Some(TickOutcome::BrokerDown { error, .. }) => {
                self.failed(Health::BrokerDown(error.0));
            }
            Some(TickOutcome::DatabaseError(error)) => {
                self.failed(Health::DatabaseError(error));
            }
            _ => {}
        }
    }

    fn set_health(&mut self, health: Health) {
        let sink = &self.sink;
        self.health.set(health, || sink.describe(), self.backoff.failures(), &self.database);
    }

    fn recovered(&mut self) {
        self.set_health(Health::Healthy);
        self.backoff.reset();
    }
}

/// The name of the database this relay is connected to (inside a transaction).
/// What the round tells this process (outbox-round's hooks): PostgreSQL's log, and the shared
/// memory of the relays (commit flags, what is in flight and published, repairs).
fn round_hooks() -> outbox_round::hooks::Hooks {
    outbox_round::hooks::Hooks {
        log: |line| log!("{line}"),
        warning: |line| warning!("{line}"),
        take_committed_shards: shared::take_committed_shards,
        mark_shards_committed: shared::mark_shards_committed,
        wake_relays: shared::wake_relays,
        in_flight_begin: in_flight::begin,
        in_flight_clear: in_flight::clear,
        add_published: shared::add_published,
        raise_repairs: shared::raise_repairs,
        #[cfg(feature = "fault-injection")]
        after_publish: crate::faults::after_publish,
        #[cfg(not(feature = "fault-injection"))]
        after_publish: |_| {},
        #[cfg(feature = "fault-injection")]
        after_finish: crate::faults::after_finish,
        #[cfg(not(feature = "fault-injection"))]
        after_finish: |_| {},
    }
}

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

/// Whether the relay was asked to stop (SIGTERM: `pg_terminate_backend`, shutdown, the launcher),
/// or the postmaster is gone. pgrx's flag is cleared when read; this one stays set once seen, so
/// that every place that asks gets the same answer.
///
/// The postmaster's death is otherwise seen only by the latch wait, and a drain never waits: after
/// a `kill -9` of the postmaster an orphaned relay went on publishing for 4.5 s, rounds whose
/// finishes (asynchronous commits, the WAL writer gone) the restarted server never saw, so 162,000
/// events were published twice instead of one round's worth.
fn stop_requested() -> bool {
    static STOPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    // SAFETY: getppid has no preconditions; PostmasterPid is set before any worker starts. An
    // orphan is adopted by another process, so its parent is then no longer the postmaster.
    let orphaned = unsafe { libc::getppid() != pg_sys::PostmasterPid };
    if BackgroundWorker::sigterm_received() || orphaned {
        STOPPING.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    STOPPING.load(std::sync::atomic::Ordering::SeqCst)
}

fn seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    // SAFETY: MyProcPid is set for every backend.
    nanos ^ (unsafe { pg_sys::MyProcPid } as u64).rotate_left(32)
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
    in_flight::clear(slot.value());
    shared::unregister_relay(slot.value());
}
