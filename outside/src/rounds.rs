//! One turn of the relay outside the server: outbox-round's round (claim, read, publish to Redis,
//! finish: the same code the background worker runs), with the bookkeeping around it that the
//! worker does in src/relay/worker.rs: housekeeping once per poll interval (the reaper, the age of
//! the oldest pending event, recorded snapshots, retention), the stream marks that notice lost
//! entries, replay rounds while a replay runs, the next full read, and backoff after a failure.
//!
//! What differs from the worker, and why: no shared memory, so every outside relay does its own
//! housekeeping (each statement is idempotent: the reaper frees a shard once, retention truncates a
//! table once), its share of the shards comes from counting the relays connected to the database
//! (`pg_stat_activity`), and no commit flags tell it which shards were committed into (every held
//! shard is read each round: outbox-round's default hooks).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use outbox_round::backoff::Backoff;
use outbox_round::db::{first, Database, DbError};
use outbox_round::housekeeping::{self, HousekeepingOutcome};
use outbox_round::losses::{self, MarkKeeping};
use outbox_round::read;
use outbox_round::replay::{self, ReplayOutcome};
use outbox_round::round::{self, Flight, RoundTimings, TickOutcome};
use outbox_round::state::RoundState;
use outbox_round::tick_settings::TickSettings;
use outbox_round::SHARDS;
use outbox_sink::entry::EntrySettings;
use outbox_sink::redis::RedisSink;

use crate::config::Config;
use crate::log::{self, Level, OncePerChange};
use crate::password::PasswordFile;
use crate::pg::{PgDatabase, APPLICATION_NAME, DEFAULT_WAKE_CHANNEL};
use crate::readiness::{self, Readiness};

/// The relays sharing this database's shards: those that joined (`outbox._join_relays`), whose
/// connection is still there and ran a statement within the lease ($1, ms), as the worker counts the
/// relays alive within `outbox.lease`. Not every connection named `outbox-relay`: any role may
/// connect under that application_name, and a relay refused by the join check publishes nothing;
/// counting either shrank the share of the relays that publish, and the shards beyond it waited for
/// as long as those connections stayed (found by attack). Nor a relay that hangs (SIGSTOP, a stuck
/// call): it keeps its backend, idle, and counted it kept the others' share at half while the reaper
/// freed its shards. A backend whose state this role may not see (state_change NULL) counts.
const JOINED_RELAYS: &str = "SELECT count(*)::int8 FROM outbox.outside_relays r \
                             WHERE r.backend_pid = pg_catalog.pg_backend_pid() \
                                OR r.backend_pid IN (SELECT a.pid FROM pg_catalog.pg_stat_activity a \
                                                      WHERE a.datname = pg_catalog.current_database() \
                                                        AND (a.state_change IS NULL \
                                                             OR a.state_change > pg_catalog.now() - $1 * interval '1 millisecond'))";
/// Whether the relay's role may read outbox.outside_relays (the installing role and outbox_admin
/// may); a role granted only the round's functions counts connections by application_name.
const MAY_READ_RELAYS: &str = "SELECT pg_catalog.has_table_privilege('outbox.outside_relays', 'SELECT')";
/// The fallback: connections named outbox-relay, active within the lease ($2, ms).
const RELAYS: &str = "SELECT count(*)::int8 FROM pg_catalog.pg_stat_activity \
                      WHERE datname = pg_catalog.current_database() AND application_name = $1 \
                        AND (pid = pg_catalog.pg_backend_pid() OR state_change IS NULL \
                             OR state_change > pg_catalog.now() - $2 * interval '1 millisecond')";

/// Retries after a failure of Redis or of the database: 100 ms doubling to 10 s (as the worker's).
const BACKOFF_BASE: Duration = Duration::from_millis(100);
const BACKOFF_CAP: Duration = Duration::from_secs(10);
/// How long to wait before looking again while another relay runs a loss repair.
const REPAIR_WAIT: Duration = Duration::from_millis(20);

/// Raised when this process asked for a replay that repairs a loss (outbox-round's
/// `raise_repairs` hook): no live round until the repair is done.
static REPAIRS_RAISED: AtomicBool = AtomicBool::new(false);

/// outbox-round's `raise_repairs` hook.
pub fn raise_repairs() {
    REPAIRS_RAISED.store(true, Ordering::SeqCst);
}

/// Raised when this relay's claim gave shards back (its share shrank: another relay joined):
/// after the round, a notification on the wake channel wakes the relays asleep for their poll
/// interval, which take them at once. Without it, a relay that joined while another held every
/// shard found nothing at its first look and slept a whole poll interval (two relays draining a
/// backlog were one).
static SHARDS_GIVEN_BACK: AtomicBool = AtomicBool::new(false);

/// outbox-round's `wake_relays` hook.
pub fn shards_given_back() {
    SHARDS_GIVEN_BACK.store(true, Ordering::SeqCst);
}

/// The state a failure of Redis is logged under: once per outage, whatever each retry's error
/// says (refused, reset, timed out), until a round publishes again.
const REDIS_DOWN: &str = "Redis down";
/// The shortest time a count of the relays sharing the shards is kept, just after joining.
const SHARE_RECOUNT_MIN: Duration = Duration::from_millis(10);
/// Housekeeping at least this often, and no more often than once per poll interval.
const HOUSEKEEPING_MIN: Duration = Duration::from_secs(1);

/// What a relay keeps between rounds: its settings, its Redis, how entries are written, and what
/// outbox-round keeps from one round to the next.
pub struct Relay {
    pub config: Config,
    pub sink: RedisSink,
    pub entries: EntrySettings,
    /// `OUTBOX_REDIS_PASSWORD`, where the sink reads it.
    _password: Option<PasswordFile>,
    state: RoundState,
    flight: Option<Flight>,
    marks: MarkKeeping,
    backoff: Backoff,
    /// No round before this (a failure's backoff).
    retry_at: Option<Instant>,
    /// The next full read (every held shard, and a fresh claim) and the next housekeeping.
    full_read_at: Instant,
    housekeeping_at: Instant,
    /// This relay's share of the shards, and when it was counted.
    share: Option<(usize, Instant)>,
    replays_running: bool,
    /// The backend this relay joined the database's relays as (`readiness::join`), and when.
    joined: Option<i32>,
    joined_at: Instant,
    /// The last full readiness check that passed: on which backend, when, and the wake channel.
    ready: Option<(i32, Instant, Option<String>)>,
    /// A loss repair runs (or may): replay rounds only, until none does.
    repairing: bool,
    kept_alive_at: Instant,
    /// The state last logged (failures, the age alert), each once per change.
    health: OncePerChange,
    alert: OncePerChange,
}

impl Relay {
    /// The relay for `config`, relaying database `database` (its name, for CloudEvents' source).
    /// Connects to nothing yet.
    pub fn new(config: Config, database: &str) -> std::io::Result<Relay> {
        let password = config.redis_password.as_ref().map(|secret| PasswordFile::new(&secret.0)).transpose()?;
        let mut sink = RedisSink::new();
        sink.configure(config.redis_config(password.as_ref().map(PasswordFile::path)));
        let entries = config.entry_settings(database);
        let seed = u64::from(std::process::id()) << 20 ^ Instant::now().elapsed().as_nanos() as u64;
        let housekeeping_at = Instant::now() + HOUSEKEEPING_MIN.min(config.poll_interval) / 2;
        Ok(Relay {
            config,
            sink,
            entries,
            _password: password,
            state: RoundState::default(),
            flight: None,
            marks: MarkKeeping::default(),
            backoff: Backoff::new(BACKOFF_BASE, BACKOFF_CAP, seed),
            retry_at: None,
            full_read_at: Instant::now(),
            // Half a poll interval after the full readiness check and the share's count, which
            // run once per poll interval from the first turn: together, the three stalled one
            // turn a second for several milliseconds, which was the p99 at 1,000 events/s.
            housekeeping_at,
            share: None,
            replays_running: false,
            joined: None,
            joined_at: Instant::now(),
            ready: None,
            repairing: false,
            kept_alive_at: Instant::now(),
            health: OncePerChange::default(),
            alert: OncePerChange::default(),
        })
    }

    /// A new connection: what a round kept of the old one is gone with it (the claim is the old
    /// backend's; a round in flight is read and published again: at least once).
    pub fn reconnected(&mut self) {
        self.flight = None;
        self.state = RoundState::default();
        self.share = None;
        self.full_read_at = Instant::now();
    }
}

/// What a turn found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The database cannot be relayed now (src/readiness.rs): nothing was read or published.
    NotReady(Readiness),
    /// The round ran. `more`: work is waiting (run the next round at once); `wake`: the channel of
    /// the SQL-only install's commit wake-up, None where there is none (the extension's install);
    /// `retry_in`: a failure's backoff, the longest to wait before the next turn; `claimed`: the
    /// live events the round took (what the pause after it grows with).
    Ran { more: bool, wake: Option<String>, retry_in: Option<Duration>, claimed: usize },
}

/// Runs one turn on `db`. An `Err` is a failure of the database (a statement, a lost connection:
/// `db.is_closed()` tells); failures of Redis are handled here, with backoff, as the worker's are.
pub fn round(db: &mut PgDatabase, relay: &mut Relay) -> Result<Outcome, DbError> {
    let outcome = turn(db, relay);
    if outcome.is_err() {
        relay.ready = None;
    }
    outcome
}

fn turn(db: &mut PgDatabase, relay: &mut Relay) -> Result<Outcome, DbError> {
    // The full check (standby, schema, version, privileges: ten statements and a catalog scan) once
    // per poll interval and on every new connection; in between, each round's own readiness (the
    // installation and, once a second, its version) notices a dropped or replaced schema, and a
    // failed round brings the full check back at once.
    let wake = match &relay.ready {
        Some((backend, at, wake)) if *backend == db.backend_pid() && at.elapsed() < relay.config.poll_interval => {
            wake.clone()
        }
        _ => match readiness::check(db)? {
            Readiness::Ready { wake, .. } => {
                relay.ready = Some((db.backend_pid(), Instant::now(), wake.clone()));
                wake
            }
            other => {
                relay.ready = None;
                relay.flight = None;
                return Ok(Outcome::NotReady(other));
            }
        },
    };
    if relay.joined != Some(db.backend_pid()) {
        let format = if relay.config.cloudevents { "cloudevents" } else { "native" };
        if let Some(conflict) = readiness::join(db, db.backend_pid(), &relay.config.stream_template, format)? {
            return Ok(Outcome::NotReady(conflict));
        }
        relay.joined = Some(db.backend_pid());
        relay.joined_at = Instant::now();
        relay.share = None;
    }
    if let Some(retry_at) = relay.retry_at {
        let left = retry_at.saturating_duration_since(Instant::now());
        if !left.is_zero() {
            return Ok(Outcome::Ran { more: false, wake, retry_in: Some(left), claimed: 0 });
        }
        relay.retry_at = None;
    }
    let poll = relay.config.poll_interval;
    if Instant::now() >= relay.housekeeping_at {
        housekeep(db, relay)?;
        relay.housekeeping_at = Instant::now() + poll.max(HOUSEKEEPING_MIN);
    }
    let settings = tick_settings(db, relay)?;
    if relay.state.version_checked.is_some() && !relay.marks.loaded() {
        keep_marks(db, relay)?;
    }
    // No live round while a loss repair runs, so that in each stream the replayed events come
    // before any later one (docs/worker.md, "When Redis loses entries"): raised by this relay's
    // report, or found by housekeeping (another relay's).
    if relay.config.replay_on_loss && (relay.repairing || REPAIRS_RAISED.swap(false, Ordering::SeqCst)) {
        if losses::repairs_running(db, &mut relay.state)? {
            relay.repairing = true;
            relay.replays_running = true;
            let more = relay.retry_at.is_none() && replay_turn(db, relay, &settings, false);
            let retry_in = if more { None } else { Some(REPAIR_WAIT) };
            return Ok(Outcome::Ran { more, wake, retry_in, claimed: 0 });
        }
        relay.repairing = false;
    }
    let mut timings = RoundTimings::default();
    let mut outcome = round::tick(db, &mut relay.sink, &settings, &mut relay.state, &mut relay.flight, &mut timings);
    if SHARDS_GIVEN_BACK.swap(false, Ordering::SeqCst) {
        // After the claim's commit: the shards are free when the others look.
        let channel = wake.as_deref().unwrap_or(DEFAULT_WAKE_CHANNEL);
        // Cast: the relay reads no column of type void.
        db.query_outside_transaction("SELECT pg_catalog.pg_notify($1, '')::pg_catalog.text", &[channel.into()])?;
    }
    if let Some(line) = relay.config.log_min_duration.and_then(|threshold| timings.slow_round_line(&outcome, threshold))
    {
        log::info(&line);
    }
    if timings.total() >= settings.lease && !matches!(outcome, TickOutcome::Idle) {
        log::warning(&format!(
            "one round took {} ms, longer than outbox.lease ({} ms): its shards' lease expired meanwhile and other relays \
             may have published the same events again; raise --lease",
            timings.total().as_millis(),
            settings.lease.as_millis()
        ));
    }
    if matches!(outcome, TickOutcome::Idle) && relay.kept_alive_at.elapsed() >= poll {
        relay.kept_alive_at = Instant::now();
        if let Err(error) = relay.sink.keep_alive() {
            outcome = TickOutcome::BrokerDown { error, published: 0 };
        }
    }
    if matches!(outcome, TickOutcome::Worked { .. } | TickOutcome::Idle | TickOutcome::SteppedOver) {
        keep_marks(db, relay)?;
    }
    losses::report_found(db, &mut relay.sink, relay.config.replay_on_loss).map_err(DbError::new)?;
    if REPAIRS_RAISED.load(Ordering::SeqCst) && matches!(outcome, TickOutcome::BrokerDown { .. }) {
        // The sink stopped the round before writing because its check found losses, recorded just
        // now: not a failure of Redis (no backoff); the repair comes next.
        relay.full_read_at = Instant::now();
        return Ok(Outcome::Ran { more: true, wake, retry_in: None, claimed: 0 });
    }
    match &outcome {
        TickOutcome::Worked { in_flight: true, .. } => {}
        TickOutcome::Worked { more: true, .. }
        | TickOutcome::SteppedOver
        | TickOutcome::BrokerDown { .. }
        | TickOutcome::DatabaseError(_) => relay.full_read_at = Instant::now(),
        _ if settings.full_read => relay.full_read_at = Instant::now() + poll,
        _ => {}
    }
    let checking = matches!(outcome, TickOutcome::Idle) && relay.sink.check_between_rounds();
    let claimed = match outcome {
        TickOutcome::Worked { claimed, .. } => claimed,
        _ => 0,
    };
    let (mut more, retry_in) = judge(relay, outcome, &settings)?;
    if relay.replays_running && relay.flight.is_none() && relay.retry_at.is_none() {
        more |= replay_turn(db, relay, &settings, more);
    }
    Ok(Outcome::Ran { more: more || checking, wake, retry_in, claimed })
}

/// What the round's outcome means: whether more waits, and a failure's backoff (logged once per
/// change of state). A failure of the database is the caller's (it reconnects or retries).
fn judge(
    relay: &mut Relay,
    outcome: TickOutcome,
    settings: &TickSettings,
) -> Result<(bool, Option<Duration>), DbError> {
    match outcome {
        TickOutcome::Worked { claimed, published, rejected, dead_lettered, last_rejection, more, in_flight, .. } => {
            if claimed > 0 || !in_flight {
                relay.backoff.reset();
                relay.health.log(Level::Log, "publishing");
            }
            if rejected > 0 {
                log::warning(&format!(
                    "Redis refused {rejected} events of a round ({published} published); they wait on the failure path, \
                     {dead_lettered} reached outbox.max_attempts ({}) and are failed: {}",
                    settings.max_attempts,
                    last_rejection.unwrap_or_default()
                ));
            }
            Ok((more || in_flight, None))
        }
        TickOutcome::SteppedOver => Ok((true, None)),
        TickOutcome::Idle => {
            relay.backoff.reset();
            // An outage that ends while there is nothing to publish (the keep-alive connected
            // again) ends here, or the next one would not be logged.
            if relay.health.is(REDIS_DOWN) && relay.sink.is_connected() {
                relay.health.log(Level::Log, "Redis is reachable again");
            }
            Ok((false, None))
        }
        TickOutcome::BrokerDown { error, published } => {
            let delay = relay.backoff.next_delay();
            relay.retry_at = Some(Instant::now() + delay);
            relay.health.log_state(
                Level::Warning,
                REDIS_DOWN,
                &format!("Redis failed ({error}) after {published} events of the round; nothing of it is lost, retrying"),
            );
            Ok((false, Some(delay)))
        }
        TickOutcome::DatabaseError(error) => Err(DbError::new(error)),
        TickOutcome::ExtensionMissing => Err(DbError::new("the schema outbox went away during the round")),
        TickOutcome::ExtensionOutdated { installed } => {
            Err(DbError::new(format!("the schema outbox is at version {installed} now, not {}", readiness::RELAY_VERSION)))
        }
        TickOutcome::CopiedInstallation { original } => Err(DbError::new(format!(
            "this database's outbox schema is a copy (CREATE DATABASE ... TEMPLATE) of the installation of database oid \
             {original}, with its events and counters: nothing is published until an admin runs SELECT outbox.adopt_copy()"
        ))),
    }
}

/// The settings of the round about to run.
fn tick_settings(db: &mut PgDatabase, relay: &mut Relay) -> Result<TickSettings, DbError> {
    let config = &relay.config;
    // A count is kept as long as this relay had been joined when it counted, from 10 ms up to the
    // poll interval: relays started together join a few milliseconds apart, and the first to
    // count alone held every shard for a poll interval (two relays draining a backlog were one).
    let kept_for =
        |at: Instant| config.poll_interval.min(at.saturating_duration_since(relay.joined_at).max(SHARE_RECOUNT_MIN));
    let share = match relay.share {
        Some((share, at)) if at.elapsed() < kept_for(at) => share,
        _ => {
            let lease_ms = config.lease_ms();
            let counted = db.transaction(|db| {
                if first::<bool>(&db.select(MAY_READ_RELAYS, &[])?)?.unwrap_or(false) {
                    first::<i64>(&db.select(JOINED_RELAYS, &[lease_ms.into()])?)
                } else {
                    first::<i64>(&db.select(RELAYS, &[APPLICATION_NAME.into(), lease_ms.into()])?)
                }
            })?;
            let relays = counted.unwrap_or(1).max(1);
            let share = SHARDS.div_ceil(relays as u64) as usize;
            relay.share = Some((share, Instant::now()));
            share
        }
    };
    Ok(TickSettings {
        slot: 0,
        pid: db.backend_pid(),
        share,
        lease: config.lease,
        batch_size: config.batch_size,
        entries: relay.entries.clone(),
        in_order: config.ordered,
        full_read: Instant::now() >= relay.full_read_at,
        max_attempts: config.max_attempts,
        retry_delay_ms: config.retry_delay.as_millis().min(i32::MAX as u128) as i32,
        redis_timeout: config.redis_timeout,
        replay_on_loss: config.replay_on_loss,
    })
}

/// The reaper, the age of the oldest pending event (the alert), recorded snapshots, retention.
fn housekeep(db: &mut PgDatabase, relay: &mut Relay) -> Result<(), DbError> {
    let lease_ms = relay.config.lease_ms();
    let found = match housekeeping::housekeeping(db, &mut relay.state, lease_ms)? {
        HousekeepingOutcome::Done(found) => found,
        _ => return Ok(()),
    };
    if found.reaped > 0 {
        log::info(&format!(
            "freed {} shards of a relay that exited or whose lease expired; the relays take them over and publish what it had not finished",
            found.reaped
        ));
    }
    match (found.oldest_pending_age, relay.config.alert_age) {
        (Some(age), Some(alert)) if age >= alert => {
            relay.alert.log(
                Level::Warning,
                &format!(
                    "the oldest pending event is {}s old, above outbox.alert_age ({}s)",
                    age.as_secs(),
                    alert.as_secs()
                ),
            );
        }
        _ => relay.alert.clear(),
    }
    relay.replays_running = found.replays_running;
    relay.repairing |= found.repairs_running;
    let retention_s = relay.config.retention_s();
    housekeeping::retention(db, retention_s)?;
    Ok(())
}

/// The stream marks: those earlier relays stored, loaded before the first write; this relay's own,
/// stored when they moved (src/relay/losses.rs in outbox-round).
fn keep_marks(db: &mut PgDatabase, relay: &mut Relay) -> Result<(), DbError> {
    let retention_s = relay.config.retention_s();
    relay.marks.keep(db, &mut relay.sink, 0, retention_s).map_err(DbError::new)
}

/// A replay round after a live one (short while live traffic flows); whether it wants another.
fn replay_turn(db: &mut PgDatabase, relay: &mut Relay, settings: &TickSettings, live: bool) -> bool {
    let limits = if live { replay::Limits::LIVE } else { replay::Limits::IDLE };
    match replay::replay_round(db, &mut relay.sink, settings, &mut relay.state, limits) {
        ReplayOutcome::Nothing => {
            relay.replays_running = false;
            false
        }
        ReplayOutcome::Waiting => false,
        ReplayOutcome::Ran { id, refused, done, .. } => {
            if done {
                log::info(&format!("replay {id} is done (outbox.replays)"));
            }
            if refused > 0 {
                log::warning(&format!("Redis refused {refused} events of replay {id} (outbox.replays)"));
            }
            !done
        }
        ReplayOutcome::BrokerDown(error) => {
            let delay = relay.backoff.next_delay();
            relay.retry_at = Some(Instant::now() + delay);
            relay.health.log_state(
                Level::Warning,
                REDIS_DOWN,
                &format!("Redis failed during a replay round ({error}); retrying"),
            );
            false
        }
        ReplayOutcome::DatabaseError(error) => {
            relay.health.log(Level::Warning, &format!("a replay round failed: {error}; retrying"));
            false
        }
    }
}

/// Gives up this relay's shards before it exits (`read::release_shards`), once what it had in
/// flight is landed; a failure changes nothing (its backend ends with the process, which frees them
/// as well, a little later).
pub fn release(db: &mut PgDatabase, relay: &mut Relay) {
    if let Some(outcome) = round::land_in_flight(db, &mut relay.sink, &mut relay.state, &mut relay.flight) {
        if !matches!(outcome, TickOutcome::Worked { .. }) {
            return;
        }
    }
    let pid = db.backend_pid();
    let _ = read::release_shards(db, &mut relay.state, pid, relay.config.lease);
}
