//! What a relay does about entries Redis lost (sink/src/marks.rs finds them): it stores its
//! stream marks now and then so that a relay started anew still knows them, records each loss once
//! (`outbox.redis_losses`, shown in `outbox.stats.redis_data_loss`), logs a WARNING naming the
//! stream, what may be missing and the call that repairs it, and, with `outbox.replay_on_loss`,
//! asks for that replay itself.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::db::{first, Database, DbError, Statements};
use outbox_sink::marks::{Loss, Mark, MAX_STREAMS};
use outbox_sink::redis::RedisSink;
use outbox_sink::StreamId;

use crate::hooks;
use crate::readiness::{readiness, Readiness};
use crate::state::RoundState;
use crate::time::timestamptz_text;

const STORE: &str = "SELECT outbox._store_marks($1, $2, $3, $4, $5::timestamptz[])";
const STORED: &str = "SELECT stream, last_ms, last_seq, written_us FROM outbox._stored_marks($1, $2)";
const REPORT: &str = "SELECT id, stream FROM outbox._report_losses($1, $2, $3::timestamptz[], $4)";
const REPAIR: &str = "SELECT loss, replay FROM outbox.repair_losses($1)";
/// A lost stream's stored mark goes: a relay started later must not find the same loss again.
const FORGET: &str = "SELECT outbox._forget_marks($1, $2, $3, $4)";
/// The marks no relay checks any more.
const PRUNE: &str = "SELECT outbox._prune_marks($1, $2, $3)";
/// Whether a replay that repairs a loss still runs; housekeeping asks it too.
pub const REPAIRS_RUNNING: &str = "SELECT outbox._repairs_running()";

/// How often a relay stores the stream marks that moved outside a finish (a round stores its own
/// in its finish, src/relay/settle.rs: these are a failed finish's).
const MARKS_STORED_EVERY: Duration = Duration::from_secs(1);
/// How often a relay prunes `outbox.stream_marks` (`prune_marks`).
const MARKS_PRUNED_EVERY: Duration = Duration::from_secs(60);

/// A relay's keeping of its stream marks between rounds.
pub struct MarkKeeping {
    /// The Redis whose stream marks stored by earlier relays were loaded into the sink (by its
    /// description: no credentials).
    loaded: Option<String>,
    /// When this relay last stored the marks that moved outside a finish.
    stored_at: Instant,
    /// When `outbox.stream_marks` was last pruned, and the streams forgotten when last logged.
    pruned_at: Instant,
    forgotten_logged: u64,
}

impl Default for MarkKeeping {
    fn default() -> Self {
        MarkKeeping { loaded: None, stored_at: Instant::now(), pruned_at: Instant::now(), forgotten_logged: 0 }
    }
}

impl MarkKeeping {
    /// Whether the stored marks of some Redis were loaded (at start, before the first write).
    pub fn loaded(&self) -> bool {
        self.loaded.is_some()
    }

    /// Loads the marks earlier relays stored for the sink's Redis (at start, and after a reload
    /// pointed the relay at another one), stores those that moved outside a finish, and prunes
    /// the table now and then (marks older than `retention_s` go: `outbox.retention`). Relay
    /// `slot` logs when it writes to more streams than it checks.
    pub fn keep(
        &mut self,
        db: &mut impl Database,
        sink: &mut RedisSink,
        slot: usize,
        retention_s: Option<i32>,
    ) -> Result<(), String> {
        let target = sink.marks_target();
        if self.loaded.as_deref() != Some(target.as_str()) {
            sink.adopt_marks(stored_marks(db, &target)?);
            self.loaded = Some(target.clone());
        }
        if self.stored_at.elapsed() >= MARKS_STORED_EVERY {
            self.stored_at = Instant::now();
            let marks = sink.take_dirty_marks();
            if let Err(error) = store_marks(db, &target, &marks) {
                sink.marks_not_stored(marks);
                return Err(error.into());
            }
        }
        if self.pruned_at.elapsed() >= MARKS_PRUNED_EVERY {
            self.pruned_at = Instant::now();
            prune_marks(db, &target, retention_s)?;
            let forgotten = sink.marks_forgotten();
            if forgotten > self.forgotten_logged {
                self.forgotten_logged = forgotten;
                hooks::log(&format!(
                    "outbox_pg: relay {slot} writes to more than {MAX_STREAMS} streams: losses are noticed only in the {MAX_STREAMS} written to most recently ({forgotten} streams forgotten so far)"
                ));
            }
        }
        Ok(())
    }
}

/// Whether a replay that repairs a loss still runs (false where the relay may not run its
/// statements: no extension, another version).
pub fn repairs_running(db: &mut impl Database, state: &mut RoundState) -> Result<bool, DbError> {
    db.transaction(|db| match readiness(db, state)? {
        Readiness::Ready(_) => first::<bool>(&db.query(REPAIRS_RUNNING, &[])?).map(|running| running.unwrap_or(false)),
        _ => Ok(false),
    })
}

/// Deletes the marks `outbox.stream_marks` need not keep (`PRUNE`); how many.
fn prune_marks(db: &mut impl Database, target: &str, retention_s: Option<i32>) -> Result<u64, DbError> {
    db.transaction(|db| {
        let args = [target.into(), (MAX_STREAMS as i64).into(), retention_s.into()];
        first::<i64>(&db.query(PRUNE, &args)?).map(|deleted| deleted.unwrap_or(0).max(0) as u64)
    })
}

/// Microseconds since 1970 of a time, for `timestamptz_text` (which counts from 2000).
fn postgres_us(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64) - 946_684_800_000_000
}

/// Stores marks that moved (the later of each is kept), for the Redis `target` names, in a
/// transaction of their own.
fn store_marks(db: &mut impl Database, target: &str, marks: &[(String, Mark)]) -> Result<(), DbError> {
    if marks.is_empty() {
        return Ok(());
    }
    db.transaction(|db| write_marks(db, target, marks))
}

/// Stores marks in the transaction under way: the finish of the round whose entries they are
/// (src/relay/settle.rs), so that a crash keeps either both or neither. A finish that marks
/// events published with their marks still to be stored a moment later lost them to a crash in
/// between, and with them the loss of those entries, if Redis lost them too (issue 35).
pub fn write_marks(db: &mut dyn Statements, target: &str, marks: &[(String, Mark)]) -> Result<(), DbError> {
    if marks.is_empty() {
        return Ok(());
    }
    let streams: Vec<String> = marks.iter().map(|(s, _)| s.clone()).collect();
    let ms: Vec<i64> = marks.iter().map(|(_, m)| m.id.ms as i64).collect();
    let seqs: Vec<i64> = marks.iter().map(|(_, m)| m.id.seq as i64).collect();
    let at: Vec<String> = marks.iter().map(|(_, m)| timestamptz_text(postgres_us(m.written_at))).collect();
    db.execute(STORE, &[target.into(), streams.into(), ms.into(), seqs.into(), at.into()])?;
    Ok(())
}

/// The marks stored for the Redis `target` names, the most recently written first.
fn stored_marks(db: &mut impl Database, target: &str) -> Result<Vec<(String, Mark)>, DbError> {
    db.transaction(|db| {
        let mut marks = Vec::new();
        for row in db.query(STORED, &[target.into(), (MAX_STREAMS as i64).into()])? {
            let stream = row.get::<String>(0)?.unwrap_or_default();
            let id = StreamId {
                ms: row.get::<i64>(1)?.unwrap_or_default().max(0) as u64,
                seq: row.get::<i64>(2)?.unwrap_or_default().max(0) as u64,
            };
            let unix_us = row.get::<i64>(3)?.unwrap_or_default().max(0) as u64;
            marks.push((stream, Mark { id, written_at: UNIX_EPOCH + Duration::from_micros(unix_us) }));
        }
        Ok(marks)
    })
}

/// Records the losses the sink's checks found, if any, before a round that wrote after those
/// checks is finished; on failure they stay in the sink, and the caller finishes nothing. With
/// `replay` (`outbox.replay_on_loss`) each is repaired by a replay.
pub fn report_found(db: &mut impl Database, sink: &mut RedisSink, replay: bool) -> Result<(), String> {
    let found = sink.take_losses();
    if found.is_empty() {
        return Ok(());
    }
    report(db, sink.marks_target(), found.clone(), replay).inspect_err(|_| sink.restore_losses(found))
}

/// Records losses (each once, whichever relay finds it first), forgets the lost streams' stored
/// marks of `target`, logs each new loss, and with `replay` asks for the replay that repairs it.
/// The transaction commits synchronously: the WARNING names loss ids that a crash cannot discard.
pub fn report(db: &mut impl Database, target: String, losses: Vec<Loss>, replay: bool) -> Result<(), String> {
    let lost_streams: Vec<String> = losses.iter().map(|l| l.stream.clone()).collect();
    let lost_ms: Vec<i64> = losses.iter().map(|l| l.expected.id.ms as i64).collect();
    let lost_seq: Vec<i64> = losses.iter().map(|l| l.expected.id.seq as i64).collect();
    let streams: Vec<String> = losses.iter().map(|l| l.stream.clone()).collect();
    let expected: Vec<String> = losses.iter().map(|l| l.expected.id.to_string()).collect();
    let expected_at: Vec<String> =
        losses.iter().map(|l| timestamptz_text(postgres_us(l.expected.written_at))).collect();
    // A stream deleted and written to again lost everything before: recorded as gone, so that
    // its repair replays every retained event of it.
    let found: Vec<Option<String>> =
        losses.iter().map(|l| l.found.filter(|_| !l.recreated).map(|id| id.to_string())).collect();
    let recorded: Vec<(i64, String, Option<i64>)> = db.transaction(|db| {
        db.execute("SET LOCAL synchronous_commit = on", &[])?;
        db.execute(FORGET, &[target.into(), lost_streams.into(), lost_ms.into(), lost_seq.into()])?;
        let mut recorded = Vec::new();
        for row in db.query(REPORT, &[streams.into(), expected.into(), expected_at.into(), found.into()])? {
            recorded.push((row.get::<i64>(0)?.unwrap_or_default(), row.get::<String>(1)?.unwrap_or_default(), None));
        }
        if replay && !recorded.is_empty() {
            let ids: Vec<i64> = recorded.iter().map(|(id, ..)| *id).collect();
            for row in db.query(REPAIR, &[ids.into()])? {
                let (loss, replay) = (row.get::<i64>(0)?, row.get::<i64>(1)?);
                if let Some(entry) = recorded.iter_mut().find(|(id, ..)| Some(*id) == loss) {
                    entry.2 = replay;
                }
            }
        }
        Ok(recorded)
    })?;
    if recorded.iter().any(|(_, _, replay)| replay.is_some()) {
        // Committed: every relay of the database waits for the repair before its next live round.
        (hooks::hooks().raise_repairs)();
    }
    for (id, stream, replay) in recorded {
        let Some(loss) = losses.iter().find(|l| l.stream == stream) else { continue };
        let expected_at = timestamptz_text(postgres_us(loss.expected.written_at));
        let what = match loss.found {
            Some(_) if loss.recreated => format!(
                "it was deleted and written to again (an entry it had, neither trimmed nor removed with XDEL, is gone, or \
                 it added fewer entries than were written to it), while the relay had written up to entry {} at {expected_at}: every event published to it may be missing",
                loss.expected.id
            ),
            Some(found) => format!(
                "it now ends at entry {found} (written at {}), while the relay had written up to {} at {expected_at}: \
                 the events published to it after {} may be missing",
                timestamptz_text(found.ms as i64 * 1000 - 946_684_800_000_000),
                loss.expected.id,
                timestamptz_text(found.ms as i64 * 1000 - 946_684_800_000_000)
            ),
            None => format!(
                "it no longer exists, while the relay had written up to entry {} at {expected_at}: every event \
                 published to it may be missing",
                loss.expected.id
            ),
        };
        match replay {
            Some(replay) => hooks::warning(&format!(
                "outbox_pg: Redis lost entries of stream \"{stream}\" (outbox.redis_losses id {id}): {what}; replaying them \
                 (outbox.replay_on_loss), see outbox.replays id {replay}"
            )),
            None => hooks::warning(&format!(
                "outbox_pg: Redis lost entries of stream \"{stream}\" (outbox.redis_losses id {id}): {what}; repair with \
                 SELECT outbox.repair_losses(ARRAY[{id}])"
            )),
        }
    }
    Ok(())
}
