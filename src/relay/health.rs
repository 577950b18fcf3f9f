//! What a relay reports about itself: its health, logged on changes of state rather than on every
//! retry (one WARNING when an outage starts, one LOG line when it ends), the age alert, and slow
//! rounds. `outbox.stats.last_error` is set from here too.

use std::time::Duration;

use pgrx::prelude::*;

use crate::guc;
use crate::relay::readiness::LIBRARY_VERSION;
use crate::relay::round::{RoundTimings, TickOutcome};
use crate::shared;

/// While the oldest pending event stays above `outbox.alert_age`, repeat the WARNING this often.
const ALERT_REPEAT: Duration = Duration::from_secs(60);

/// What the relay last reported, so that it logs changes of state rather than every retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Healthy,
    /// The database's extension version (the library's is LIBRARY_VERSION).
    ExtensionOutdated(String),
    /// The database is a copy of the installation of the database with this OID.
    Copied(u32),
    BrokerDown(String),
    DatabaseError(String),
    Disabled,
}

/// The health a relay last reported, and the Redis its current outage concerns.
pub struct HealthLog {
    health: Health,
    /// So that a reload pointing at another (also broken) Redis is reported as a new outage
    /// rather than swallowed as the same one.
    outage_target: Option<String>,
    /// An earlier relay already said (a WARNING) that this database is an unadopted copy.
    copy_reported: bool,
}

impl HealthLog {
    pub fn new(copy_reported: bool) -> HealthLog {
        HealthLog { health: Health::Healthy, outage_target: None, copy_reported }
    }

    /// Logs transitions only: a Redis outage produces one WARNING when it starts and one LOG when
    /// it ends, however many retries happen in between.
    pub fn set(&mut self, health: Health, target: impl FnOnce() -> String, failures: u32, database: &str) {
        if let Health::BrokerDown(error) | Health::DatabaseError(error) = &health {
            shared::set_last_error(error);
        }
        // One state per kind of trouble: a Redis going from "connection reset" to "connection
        // refused" is still the same outage; another Redis failing is a new one. Checked before
        // describing the target, since every healthy round passes through here.
        let same_kind = std::mem::discriminant(&health) == std::mem::discriminant(&self.health);
        let outage = matches!(health, Health::BrokerDown(_));
        if same_kind && !outage {
            return;
        }
        let target = target();
        if same_kind && self.outage_target.as_deref() == Some(target.as_str()) {
            return;
        }
        self.outage_target = outage.then(|| target.clone());
        match &health {
            Health::Healthy => match &self.health {
                Health::BrokerDown(_) => log!(
                    "outbox_pg: publishing to Redis at {target} again after {} failed attempts",
                    failures
                ),
                Health::ExtensionOutdated(_) => log!(
                    "outbox_pg: extension outbox_pg is at version {} in database \"{}\"; relaying",
                    LIBRARY_VERSION,
                    database
                ),
                Health::DatabaseError(_) => log!("outbox_pg: database statements succeed again"),
                Health::Copied(_) => log!(
                    "outbox_pg: database \"{}\" was adopted as an installation of its own (outbox.adopt_copy); relaying",
                    database
                ),
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
                    database,
                    LIBRARY_VERSION
                );
                shared::set_last_error(&problem);
                warning!(
                    "outbox_pg: {problem}; the relay waits, events stay pending (none is lost); run ALTER EXTENSION outbox_pg UPDATE in that database"
                )
            }
            Health::Copied(original) => {
                let problem = format!(
                    "database \"{}\" holds a copy of the outbox of database oid {original} (CREATE DATABASE ... TEMPLATE): its events and aggregate_seq counters are that database's, so its relays publish nothing",
                    database
                );
                shared::set_last_error(&problem);
                let advice = format!(
                    "point it at streams of its own (ALTER DATABASE \"{database}\" SET outbox.stream = ...), then run SELECT outbox.adopt_copy() in it"
                );
                if self.copy_reported {
                    log!("outbox_pg: {problem} (still); {advice}")
                } else {
                    warning!("outbox_pg: {problem}; {advice}")
                }
            }
            Health::Disabled => log!("outbox_pg: outbox.enabled is off; the relay is paused, events stay pending"),
        }
        self.health = health;
    }

    /// Logs a WARNING when the oldest pending event crosses `outbox.alert_age` (then once a minute
    /// while it stays above), and a LOG line when it is back below.
    pub fn check_alert(&self, oldest_pending_age: Option<Duration>) {
        let Some(threshold) = guc::alert_age() else {
            shared::set_alert_logged(false);
            return;
        };
        let above = oldest_pending_age.filter(|age| *age >= threshold);
        match (above, shared::alert_logged_at()) {
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
                        Health::Copied(_) => "waiting for outbox.adopt_copy() in this copied database".to_string(),
                        Health::Healthy => "running; check failed events and per-aggregate backlogs".to_string(),
                    }
                );
                shared::set_alert_logged(true);
            }
            (None, Some(_)) => {
                log!(
                    "outbox_pg: oldest pending event is {} old, below outbox.alert_age ({}) again; alert cleared",
                    oldest_pending_age.map(human).unwrap_or_else(|| "0s (none pending)".into()),
                    human(threshold)
                );
                shared::set_alert_logged(false);
            }
            _ => {}
        }
    }
}

/// A duration as an operator reads it: `42.0s`, `7m 5s`, `2h 3m`.
pub fn human(duration: Duration) -> String {
    let secs = duration.as_secs();
    match secs {
        0..60 => format!("{:.1}s", duration.as_secs_f64()),
        60..3600 => format!("{}m {}s", secs / 60, secs % 60),
        _ => format!("{}h {}m", secs / 3600, (secs % 3600) / 60),
    }
}

/// `outbox.log_min_duration`: one LOG line for a round that took at least that long, with the time
/// of each phase, so that a stall can be placed (the database, Redis, or settling). Failed rounds
/// are left out: an outage is reported once by its WARNING, not once per retry.
pub fn log_if_slow_round(outcome: &TickOutcome, timings: &RoundTimings) {
    if let Some(line) = guc::log_min_duration().and_then(|threshold| timings.slow_round_line(outcome, threshold)) {
        log!("{line}");
    }
}

pub fn millis(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::human;
    use std::time::Duration;

    #[test]
    fn durations_read_like_an_operator_writes_them() {
        assert_eq!(human(Duration::from_millis(42_300)), "42.3s");
        assert_eq!(human(Duration::from_secs(7 * 60 + 5)), "7m 5s");
        assert_eq!(human(Duration::from_secs(2 * 3600 + 3 * 60 + 9)), "2h 3m");
    }
}
