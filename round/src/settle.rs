//! The last part of a round: finish it in one short transaction, once Redis has answered. Each
//! shard's cursor (or position in a window published in parts), the counters of the round's
//! aggregates, the marks of the streams it wrote to (src/relay/losses.rs), and, only when Redis
//! refused something, the failure path; and only if the log still belongs to the installation the
//! round was read from.

use std::collections::BTreeSet;

use crate::db::{first, Database, DbError};
use outbox_sink::entry::OutboxEvent;
use outbox_sink::marks::Mark;

use crate::losses;
use crate::read::{Batch, ShardBatch};
use crate::state::RoundState;
use crate::tick_settings::TickSettings;

const HOLD: &str = "SELECT outbox._hold($1::uuid[], $2, $3, $4, $5)";
const SETTLE_HELD: &str = "SELECT outbox._settle_held($1, $2, $3, $4, $5)";
/// Run by every round that published anything: the worker keeps its plan (`KEPT`).
const ADVANCE: &str = "SELECT outbox._advance($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)";

/// The finish's statements whose plans a connection keeps (src/relay/spi.rs).
pub const KEPT: &[&str] = &[ADVANCE];

/// How a round is finished.
#[derive(Default)]
pub struct Settlement {
    /// Log events that go to the failure path: (event_id, aggregate_seq, the rejection if Redis
    /// rejected this one; None for events waiting behind one).
    pub hold: Vec<(String, i64, Option<String>)>,
    /// Failure-path events Redis accepted.
    pub held_published: Vec<i64>,
    /// Failure-path events Redis rejected again, with the error.
    pub held_rejected: Vec<(i64, String)>,
    /// What the round published, in the order Redis received it: (event_id, aggregate_seq), for
    /// the journal replays walk (src/sql/replay.sql).
    pub journal: Vec<(String, i64)>,
    /// The stream keys of `journal`'s events, each once: journaled with them, so that a repair
    /// walks only the rounds that wrote to the stream it repairs.
    pub journal_streams: BTreeSet<String>,
    /// The marks that moved since they were last stored (sink/src/marks.rs), of the Redis
    /// `marks_target` names: those of this round's entries among them. Stored in the finish, so
    /// that what marks the events published also records what Redis acknowledged of them.
    pub marks: Vec<(String, Mark)>,
    pub marks_target: String,
}

impl Settlement {
    /// Journals an event Redis received, sent to its stream under `template`.
    pub fn journal(&mut self, event: &OutboxEvent, template: &str) {
        self.journal.push((event.event_id.clone(), event.aggregate_seq));
        if !event.stream.as_ref().is_some_and(|stream| self.journal_streams.contains(stream)) {
            self.journal_streams.insert(event.stream_key(template));
        }
    }
}

/// What a finish wrote.
#[derive(Debug, Clone, Copy, Default)]
pub struct Finished {
    pub dead_lettered: i64,
}

/// Writes the round's outcome in one transaction, if the log still belongs to the installation
/// the batch was read from (`Statements::installation`).
pub fn finish(
    db: &mut impl Database,
    mut settlement: Settlement,
    batch: &Batch,
    settings: &TickSettings,
    state: &mut RoundState,
) -> Result<Finished, String> {
    let (max_attempts, retry_delay_ms, pid) = (settings.max_attempts, settings.retry_delay_ms, settings.pid);
    let advancing: Vec<&ShardBatch> = batch.shards.iter().filter(|s| s.advance).collect();
    let shards: Vec<i16> = advancing.iter().map(|s| s.shard).collect();
    let cursors: Vec<String> = advancing.iter().map(|s| s.next_cursor.clone()).collect();
    let window_uptos: Vec<Option<String>> =
        advancing.iter().map(|s| s.window.as_ref().map(|(upto, _)| upto.clone())).collect();
    let window_max_ids: Vec<Option<i64>> = advancing.iter().map(|s| s.window.as_ref().map(|(_, p)| p.0)).collect();
    let window_last_ids: Vec<Option<i64>> = advancing.iter().map(|s| s.window.as_ref().map(|(_, p)| p.1)).collect();
    let counter_types: Vec<String> = batch.counters.iter().map(|(t, ..)| t.clone()).collect();
    let counter_ids: Vec<String> = batch.counters.iter().map(|(_, i, ..)| i.clone()).collect();
    let counter_seqs: Vec<i64> = batch.counters.iter().map(|(_, _, s, _)| *s).collect();
    let counted: Vec<bool> = batch.counters.iter().map(|(.., c)| *c).collect();
    // The journal's event ids cross as uuids: as text, `uuid_in` on every one of a drain's
    // 10,000 ids a round was 3% of the relay's CPU. They were read from the log's uuid column.
    let journal_ids: Vec<[u8; 16]> = settlement
        .journal
        .iter()
        .map(|(id, _)| uuid::Uuid::parse_str(id).map(|id| *id.as_bytes()))
        .collect::<Result<_, _>>()
        .map_err(|error| format!("an event id of the round is not a uuid: {error}"))?;
    let journal_seqs: Vec<i64> = settlement.journal.iter().map(|(_, seq)| *seq).collect();
    let journal_streams: Vec<String> = std::mem::take(&mut settlement.journal_streams).into_iter().collect();
    let read_from = batch.installation;
    let holds = !settlement.hold.is_empty() || !settlement.held_rejected.is_empty();
    let finished = db.transaction(|db| {
        let mut finished = Finished::default();
        if !settlement.hold.is_empty() {
            let event_ids: Vec<String> = settlement.hold.iter().map(|(e, ..)| e.clone()).collect();
            let seqs: Vec<i64> = settlement.hold.iter().map(|(_, s, _)| *s).collect();
            let errors: Vec<Option<String>> = settlement.hold.iter().map(|(.., e)| e.clone()).collect();
            finished.dead_lettered += first::<i64>(&db.query(
                HOLD,
                &[event_ids.into(), seqs.into(), errors.into(), max_attempts.into(), retry_delay_ms.into()],
            )?)?
            .unwrap_or(0);
        }
        if !settlement.held_published.is_empty() || !settlement.held_rejected.is_empty() {
            let rejected: Vec<i64> = settlement.held_rejected.iter().map(|(id, _)| *id).collect();
            let errors: Vec<String> = settlement.held_rejected.iter().map(|(_, e)| e.clone()).collect();
            finished.dead_lettered += first::<i64>(&db.query(
                SETTLE_HELD,
                &[
                    settlement.held_published.into(),
                    rejected.into(),
                    errors.into(),
                    max_attempts.into(),
                    retry_delay_ms.into(),
                ],
            )?)?
            .unwrap_or(0);
        }
        if !shards.is_empty() || !counter_types.is_empty() || !journal_ids.is_empty() {
            db.execute(
                ADVANCE,
                &[
                    pid.into(),
                    shards.into(),
                    cursors.into(),
                    window_uptos.into(),
                    window_max_ids.into(),
                    window_last_ids.into(),
                    counter_types.into(),
                    counter_ids.into(),
                    counter_seqs.into(),
                    counted.into(),
                    journal_ids.into(),
                    journal_seqs.into(),
                    journal_streams.into(),
                ],
            )?;
        }
        losses::write_marks(db, &settlement.marks_target, &settlement.marks)?;
        // Checked after the writes, in their transaction: the rows they touched stay locked until
        // it ends, so a DROP EXTENSION cannot slip in between this check and the commit.
        if db.installation()? != Some(read_from) {
            return Err(DbError::new(
                "outbox_pg was dropped and created again while this batch was being published; nothing was finished",
            ));
        }
        Ok(finished)
    });
    if finished.is_err() || holds {
        state.forget_kept_claim();
    }
    finished.map_err(String::from)
}
