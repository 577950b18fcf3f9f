//! The commit wake-up of a relay outside the server (docs/sql-only.md, "Commit wake-up"): after a
//! round that found nothing, the relay *tries* the wake key (`pg_try_advisory_lock(
//! outbox._wake_key())`, a session lock, exclusive; never waits for it: a waiting exclusive request
//! makes every writer's shared try fail, and every writer would notify), looks for work once more
//! while holding it, then sleeps on the channel it has listened on since connect until a
//! notification, the poll interval or a stop, and lets the key go when it wakes. A writer that
//! shares the key has not committed yet: the relay then runs another round shortly instead of
//! sleeping.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use outbox_round::db::{first, DbError};

use crate::pg::PgDatabase;

/// How long the relay waits before its next round when a writer in flight shares the wake key: 2 ms,
/// doubling while the rounds between find nothing, up to 20 ms. A transaction left open (a bulk
/// load of minutes) kept a relay at a round every 2 ms, about 150 a second and a third of a core
/// (found by the fault suite); the growth bounds that to 50 a second, and a commit of such a
/// transaction waits at most 20 ms more. Any round that finds work starts again from 2 ms.
pub const WRITER_IN_FLIGHT_PAUSE: Duration = Duration::from_millis(2);
pub const WRITER_IN_FLIGHT_PAUSE_MAX: Duration = Duration::from_millis(20);

/// After a notification whose round found nothing, the least time before the next notified
/// round: any role may `pg_notify` the channel, so a notification is only a hint, and a flood of
/// them must not become a busy loop (src/run.rs).
pub const MIN_WAKE_GAP: Duration = Duration::from_millis(5);

/// The longest the relay waits without looking at its stop flag.
const STOP_CHECK: Duration = Duration::from_millis(100);

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woken {
    /// A notification came (commits to relay, or anyone's `pg_notify`).
    Notified,
    /// The poll interval passed.
    Timeout,
    /// SIGTERM or SIGINT.
    Stopped,
    /// A writer shares the wake key: it has not committed; run another round shortly.
    WriterInFlight,
    /// The last look, made holding the key, found work.
    MoreWork,
}

/// Tries to take the wake key, never waiting; true when taken.
pub fn try_take_key(db: &mut PgDatabase) -> Result<bool, DbError> {
    Ok(first::<bool>(&db.query_outside_transaction("SELECT pg_try_advisory_lock(outbox._wake_key())", &[])?)?
        .unwrap_or(false))
}

/// Lets the wake key go.
pub fn release_key(db: &mut PgDatabase) -> Result<(), DbError> {
    db.query_outside_transaction("SELECT pg_advisory_unlock(outbox._wake_key())", &[])?;
    Ok(())
}

/// Waits up to `timeout` for a notification, looking at `stop` at least every 100 ms; reads every
/// notification that came before returning `Notified`.
pub fn sleep(db: &mut PgDatabase, timeout: Duration, stop: &AtomicBool) -> Result<Woken, DbError> {
    let deadline = Instant::now() + timeout;
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(Woken::Stopped);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(Woken::Timeout);
        }
        if db.wait_for_notification(left.min(STOP_CHECK))?.is_some() {
            db.drain_notifications()?;
            return Ok(Woken::Notified);
        }
    }
}

/// Sleeps while `stop` is not set, up to `pause` (no database involved).
pub fn pause(pause: Duration, stop: &AtomicBool) {
    let deadline = Instant::now() + pause;
    while !stop.load(Ordering::Relaxed) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(STOP_CHECK));
    }
}

/// After a round that found nothing: with the wake-up (`wake`), the handshake then the sleep;
/// without it (a database with the extension, whose writers notify no one), the sleep alone, the
/// poll interval being the only wake-up. `last_look` runs a round while the key is held and says
/// whether more work is waiting.
pub fn idle(
    db: &mut PgDatabase,
    wake: bool,
    poll_interval: Duration,
    stop: &AtomicBool,
    last_look: impl FnOnce(&mut PgDatabase) -> Result<bool, DbError>,
) -> Result<Woken, DbError> {
    if !wake {
        return sleep(db, poll_interval, stop);
    }
    if !try_take_key(db)? {
        return Ok(Woken::WriterInFlight);
    }
    let woken = match last_look(db) {
        Ok(true) => Ok(Woken::MoreWork),
        Ok(false) => sleep(db, poll_interval, stop),
        Err(error) => Err(error),
    };
    // Released whatever happened: a relay that kept the key would make every writer notify. A lost
    // connection released it already.
    let released = release_key(db);
    let woken = woken?;
    released?;
    Ok(woken)
}
