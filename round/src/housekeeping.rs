//! The relay's periodic housekeeping, done by whichever relay of a database gets there first: the
//! reaper (shards of relays that exited or hang), the oldest pending event's age, the recorded
//! snapshots a lagging shard reads up to, whether a replay runs, and retention.

use std::time::Duration;

use crate::db::{first, Database, DbError};

use crate::losses::REPAIRS_RUNNING;
use crate::readiness::{readiness, Readiness};
use crate::replay::REPLAYS_RUNNING;
use crate::state::RoundState;

const REAP: &str = "SELECT outbox._reap_shards($1)";
const RECORD_SNAPSHOT: &str = "SELECT outbox._record_snapshot($1)";
const RETENTION: &str = "SELECT outbox._retention($1 * interval '1 second')";
const OLDEST_PENDING_AGE_MS: &str = "SELECT (extract(epoch FROM outbox.oldest_pending_age()) * 1000)::float8";

/// What the relay's periodic housekeeping found.
#[derive(Debug, Clone, PartialEq)]
pub struct Housekeeping {
    /// Shards returned by the reaper (their relay exited, or its lease expired).
    pub reaped: i64,
    /// Age of the oldest undelivered event, if any.
    pub oldest_pending_age: Option<Duration>,
    /// A replay is running (or waits for its throttle): the relays look for it.
    pub replays_running: bool,
    /// One of them repairs a loss (outbox.redis_losses): no relay runs live rounds meanwhile.
    pub repairs_running: bool,
}

/// What a housekeeping pass did.
#[derive(Debug, Clone, PartialEq)]
pub enum HousekeepingOutcome {
    Done(Housekeeping),
    /// outbox_pg is not installed in this database.
    ExtensionMissing,
    /// Installed at another version, or a copy of another database's installation: nothing runs.
    NotReady,
}

/// Frees the shards of relays that exited or hang, measures the oldest pending event, and keeps the
/// recorded snapshots that bound a lagging shard's windows, in one short transaction.
pub fn housekeeping(
    db: &mut impl Database,
    state: &mut RoundState,
    lease_ms: i32,
) -> Result<HousekeepingOutcome, DbError> {
    db.transaction(|db| {
        match readiness(db, state)? {
            Readiness::Ready(_) => {}
            Readiness::Missing => return Ok(HousekeepingOutcome::ExtensionMissing),
            _ => return Ok(HousekeepingOutcome::NotReady),
        }
        let reaped = first::<i64>(&db.query(REAP, &[lease_ms.into()])?)?.unwrap_or(0);
        let oldest_pending_age = first::<f64>(&db.query(OLDEST_PENDING_AGE_MS, &[])?)?
            .map(|ms| Duration::from_secs_f64(ms.max(0.0) / 1000.0));
        // While anything waits, the snapshots that bound a lagging shard's windows.
        db.execute(RECORD_SNAPSHOT, &[oldest_pending_age.is_some().into()])?;
        let replays_running = first::<bool>(&db.query(REPLAYS_RUNNING, &[])?)?.unwrap_or(false);
        let repairs_running = replays_running && first::<bool>(&db.query(REPAIRS_RUNNING, &[])?)?.unwrap_or(false);
        Ok(HousekeepingOutcome::Done(Housekeeping { reaped, oldest_pending_age, replays_running, repairs_running }))
    })
}

/// One retention step (outbox._retention) keeping published events `retention_s` seconds (None:
/// `outbox.retention = 0`, only what `outbox.purge` asked for); returns how many events and rows it
/// removed.
pub fn retention(db: &mut impl Database, retention_s: Option<i32>) -> Result<i64, DbError> {
    db.transaction(|db| first::<i64>(&db.query(RETENTION, &[retention_s.into()])?)).map(|n| n.unwrap_or(0))
}
