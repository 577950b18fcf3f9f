//! The process: settings (a bad one exits with status 2 and its message), SIGTERM and SIGINT (a
//! stop flag looked at between rounds and during waits: the round in flight finishes, the process
//! exits 0), connecting with backoff (100 ms doubling to 10 s, with jitter) and again when the
//! connection is lost (listening again), and the loop: a round, then at once another if work is
//! waiting, else the pause after a busy round, the commit wake-up's handshake and a wait for a
//! notification or the poll interval, whichever comes first.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_round::coalesce::coalesce_window;
use outbox_round::db::DbError;

use crate::config::{self, Command, Config};
use crate::log::{self, redact_any_url, Level, OncePerChange};
use crate::pg::{ConnectOptions, PgDatabase};
use crate::rounds::{self, Outcome, Relay};
use crate::wake::{self, Woken};

/// The process's exit status.
pub fn main() -> i32 {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let env: HashMap<String, String> =
        std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))).collect();
    let config = match config::parse(&args, &env) {
        Ok(Command::Run(config)) => *config,
        Ok(Command::Help) => {
            print!("{}", config::help());
            return 0;
        }
        Ok(Command::Version) => {
            println!("outbox-relay {}", env!("CARGO_PKG_VERSION"));
            return 0;
        }
        Err(message) => {
            eprintln!("outbox-relay: {}", log::scrub(&message));
            return 2;
        }
    };
    if let Some(password) = &config.redis_password {
        log::hide(&password.0);
    }
    if let Err(error) = PgDatabase::prepare(&config.database_url, &ConnectOptions::default()) {
        eprintln!("outbox-relay: --database-url cannot be used: {}", log::scrub(&error.to_string()));
        return 2;
    }
    // The round's own lines (outbox-round) go through this process's log, which hides secrets.
    outbox_round::hooks::install(outbox_round::hooks::Hooks {
        log: log::info,
        warning: log::warning,
        raise_repairs: rounds::raise_repairs,
        wake_relays: rounds::shards_given_back,
        ..outbox_round::hooks::Hooks::default()
    });
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Err(error) = signal_hook::flag::register(signal, Arc::clone(&stop)) {
            log::log(Level::Fatal, &format!("cannot handle signal {signal}: {error}"));
            return 1;
        }
    }
    log::info(&format!(
        "outbox-relay {} starting: database {}, Redis {}",
        env!("CARGO_PKG_VERSION"),
        redact_any_url(&config.database_url),
        redact_any_url(&config.redis_url)
    ));
    relay(config, &stop);
    log::info("outbox-relay stopped");
    0
}

/// Connects, serves the connection until it is lost or a stop, and again, until a stop.
fn relay(config: Config, stop: &AtomicBool) {
    let url = config.database_url.clone();
    let shown = redact_any_url(&url);
    let mut relay: Option<Relay> = None;
    let mut backoff = Backoff::new();
    let mut failures = OncePerChange::default();
    while !stop.load(Ordering::Relaxed) {
        let mut db = match PgDatabase::connect(&url, &ConnectOptions::default()) {
            Ok(db) => db,
            Err(error) => {
                let delay = backoff.next_delay();
                // Once per outage: a server stopping, starting up or gone says so differently each time.
                failures.log_state(
                    Level::Warning,
                    "cannot connect",
                    &format!("cannot connect to {shown}: {error}; retrying"),
                );
                wake::pause(delay, stop);
                continue;
            }
        };
        backoff.reset();
        failures.clear();
        log::info(&format!(
            "connected to {shown} as role \"{}\" (backend pid {}), listening on {}",
            db.role(),
            db.backend_pid(),
            db.listening().join(", ")
        ));
        let relay = match &mut relay {
            Some(relay) => {
                relay.reconnected();
                relay
            }
            None => match Relay::new(config.clone(), db.database()) {
                Ok(made) => relay.insert(made),
                Err(error) => {
                    log::log(Level::Fatal, &format!("cannot hand the Redis password to the sink: {error}"));
                    return;
                }
            },
        };
        serve(&mut db, relay, stop);
        if stop.load(Ordering::Relaxed) {
            // The round in flight was finished; give the shards up so that the other relays take
            // them at their next claim, not when their reaper notices the connection gone.
            rounds::release(&mut db, relay);
        } else {
            log::warning(&format!("the connection to {shown} was lost; reconnecting"));
            wake::pause(backoff.next_delay(), stop);
        }
    }
}

/// Runs rounds on `db` until a stop or the connection is lost.
fn serve(db: &mut PgDatabase, relay: &mut Relay, stop: &AtomicBool) {
    let poll_interval = relay.config.poll_interval;
    let mut state = OncePerChange::default();
    let mut errors = OncePerChange::default();
    let mut last_round: Option<Instant> = None;
    let mut woken = Woken::Timeout;
    let mut writer_pause = wake::WRITER_IN_FLIGHT_PAUSE;
    // The last notification's round found nothing to publish.
    let mut empty_notification = false;
    while !stop.load(Ordering::Relaxed) {
        if woken == Woken::Notified && empty_notification {
            // Any role may notify the channel: a notification is only a hint. After one that
            // found nothing, the next waits for the floor, so that a flood of them is no busy
            // loop; a commit's notification, which finds its events, waits for nothing.
            if let Some(gap) = last_round.and_then(|at| wake::MIN_WAKE_GAP.checked_sub(at.elapsed())) {
                wake::pause(gap, stop);
            }
        }
        let notified = woken == Woken::Notified;
        let writer_waited = woken == Woken::WriterInFlight;
        if writer_waited {
            wake::pause(writer_pause, stop);
        }
        last_round = Some(Instant::now());
        let step = step(db, relay, stop, poll_interval, &mut state);
        woken = match step {
            Ok((woken, claimed)) => {
                errors.clear();
                empty_notification = notified && claimed == 0;
                // The pause for a writer in flight doubles only while the rounds between find
                // nothing: under steady commits, where a writer is nearly always in flight and
                // nearly every round finds work, it stays at 2 ms (it grew to 20 ms whatever
                // the rounds found, and p50 at 1,000 events/s was 13 ms).
                writer_pause = if writer_waited && claimed == 0 && woken == Woken::WriterInFlight {
                    (writer_pause * 2).min(wake::WRITER_IN_FLIGHT_PAUSE_MAX)
                } else {
                    wake::WRITER_IN_FLIGHT_PAUSE
                };
                woken
            }
            Err(_) if db.is_closed() => return,
            Err(error) => {
                errors.log(Level::Warning, &format!("database \"{}\": {error}; retrying", db.database()));
                match wake::sleep(db, poll_interval, stop) {
                    Ok(woken) => woken,
                    Err(_) if db.is_closed() => return,
                    Err(_) => Woken::Timeout,
                }
            }
        };
    }
}

/// One round and what follows it: at once another if work is waiting, the readiness line and a
/// wait if the database cannot be relayed, else the pause after a busy round (`outbox.linger`),
/// the wake-up's handshake and the wait. Also how many events the round took.
fn step(
    db: &mut PgDatabase,
    relay: &mut Relay,
    stop: &AtomicBool,
    poll_interval: Duration,
    state: &mut OncePerChange,
) -> Result<(Woken, usize), DbError> {
    // Read what arrived while working: unread notifications hold the server's queue.
    db.drain_notifications()?;
    match rounds::round(db, relay)? {
        Outcome::NotReady(readiness) => {
            let line = readiness.message(db.database(), db.role()).unwrap_or_default();
            state.log(Level::Warning, &line);
            Ok((wake::sleep(db, poll_interval, stop)?, 0))
        }
        Outcome::Ran { more, wake, retry_in, claimed } => {
            if let Some(channel) = &wake {
                db.listen(channel)?;
            }
            let how = match &wake {
                Some(channel) => format!("woken at commit on channel {channel}, polling every {poll_interval:?}"),
                None => format!("no commit wake-up in this install, polling every {poll_interval:?}"),
            };
            state.log(
                Level::Log,
                &format!(
                    "ready: relaying database \"{}\" as role \"{}\" (backend pid {}); {how}",
                    db.database(),
                    db.role(),
                    db.backend_pid()
                ),
            );
            if more {
                return Ok((Woken::MoreWork, claimed));
            }
            if let Some(retry_in) = retry_in {
                // A failure's backoff: a commit's notification does not cut it short.
                wake::pause(retry_in, stop);
                return Ok((Woken::Timeout, claimed));
            }
            if claimed > 0 {
                // Under steady commits, the next round gathers those that follow, as the worker's
                // does: half a millisecond after a round of one or two events, up to the linger.
                wake::pause(coalesce_window(claimed, relay.config.linger), stop);
            }
            let woken = wake::idle(db, wake.is_some(), poll_interval, stop, |db| {
                Ok(matches!(rounds::round(db, relay)?, Outcome::Ran { more: true, .. }))
            })?;
            Ok((woken, claimed))
        }
    }
}

/// Reconnection delays: 100 ms doubling to 10 s, each drawn between half and all of it (jitter,
/// so that relays cut off together do not come back together).
pub struct Backoff {
    next: Duration,
    seed: u64,
}

impl Backoff {
    pub const FIRST: Duration = Duration::from_millis(100);
    pub const MAX: Duration = Duration::from_secs(10);

    pub fn new() -> Backoff {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        Backoff { next: Backoff::FIRST, seed: (nanos as u64) ^ (u64::from(std::process::id()) << 32) | 1 }
    }

    pub fn reset(&mut self) {
        self.next = Backoff::FIRST;
    }

    pub fn next_delay(&mut self) -> Duration {
        // xorshift64: enough randomness to spread relays apart.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let fraction = 0.5 + (self.seed % 1_000) as f64 / 2_000.0;
        let delay = self.next.mul_f64(fraction);
        self.next = (self.next * 2).min(Backoff::MAX);
        delay
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_ten_seconds_with_jitter() {
        let mut backoff = Backoff::new();
        let mut ceiling = Backoff::FIRST;
        for _ in 0..12 {
            let delay = backoff.next_delay();
            assert!(delay >= ceiling / 2 && delay <= ceiling, "{delay:?} for {ceiling:?}");
            ceiling = (ceiling * 2).min(Backoff::MAX);
        }
        assert!(backoff.next_delay() <= Backoff::MAX);
        backoff.reset();
        assert!(backoff.next_delay() <= Backoff::FIRST);
    }
}
