//! The first part of a round: claim this relay's shards (or keep the last claim) and read what the
//! round publishes: each shard's window, or its next part (round/src/window.rs), the failure path's
//! due events, and the counters of the round's aggregates. One short transaction, which writes only
//! when shards change hands.

use std::time::Duration;

use crate::db::{Database, DbError, Row, Statements};
use outbox_sink::event::{OutboxEvent, TraceContext};

use crate::hooks::hooks;
use crate::readiness::{readiness, Readiness};
use crate::snapshot::Snapshot;
use crate::state::RoundState;
use crate::tick_settings::{Map, Set, TickSettings};
use crate::window::{Budget, LogEvent, WindowAsk};
use crate::SHARDS;

const CLAIM: &str = "SELECT shard, cursor, cursor_age_ms, upto, held, bounded, window_max_id, window_last_id \
                     FROM outbox._claim_shards($1, $2, $3)";
const HELD_DUE: &str =
    "SELECT id, event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, payload, headers, \
                        stream, created_at FROM outbox._held_due($1, $2, $3)";
const HELD_AGGREGATES: &str = "SELECT outbox._held_aggregates($1, $2, $3)";

/// What a round on a kept claim reads instead of claiming, per shard this relay holds
/// (src/sql/relay/claim.sql): `$2`, indexed by shard + 1, overrides a cursor with where a round in
/// flight leaves it.
pub const HELD: &str = "SELECT shard, cursor, window_upto, window_max_id, window_last_id, now, recorded \
                                 FROM outbox._held_shards($1, $2)";

/// The read's statements whose plans a connection keeps (src/relay/spi.rs): the claim or the kept
/// claim runs in every round, and parsing and planning them again each round was about a tenth of
/// a round's time when rounds carry an event or two.
pub const KEPT: &[&str] = &[CLAIM, HELD];

/// An idle shard's cursor is moved on this often, so that retention can see it has consumed a
/// closed table; a shard with events moves at every batch.
const IDLE_CURSOR_MOVE: Duration = Duration::from_secs(10);

/// One shard's part of a round.
#[derive(Debug, Clone)]
pub struct ShardBatch {
    pub shard: i16,
    /// The cursor to store when the batch is finished.
    pub next_cursor: String,
    /// For a window published in parts and not finished by this round: its end and the position
    /// reached (round/src/window.rs).
    pub window: Option<(String, (i64, i64))>,
    /// Whether the cursor is stored at all: a shard with no events moves only now and then.
    pub advance: bool,
}

/// A shard as the claim (or a kept claim) gives it to a round.
struct Claimed {
    shard: i16,
    cursor: String,
    /// How long ago the cursor moved (0 on a kept claim).
    age_ms: i64,
    /// What the window reads up to: the end of a window published in parts, now, or a recorded
    /// snapshot.
    upto: String,
    /// `upto` is a recorded snapshot: the shard lags, more follows.
    bounded: bool,
    /// The position reached in a window published in parts.
    position: Option<(i64, i64)>,
}

/// A window's position from its two columns (both NULL: no window in parts).
fn position(max_id: Option<i64>, last_id: Option<i64>) -> Option<(i64, i64)> {
    max_id.zip(last_id)
}

/// What a round read.
#[derive(Debug, Default)]
pub struct Batch {
    pub installation: u32,
    pub shards: Vec<ShardBatch>,
    /// From the log, in publish order (round/src/window.rs), each with its `aggregate_seq` assigned.
    pub events: Vec<OutboxEvent>,
    /// Their aggregates' counters after the batch: (type, id, last_seq, whether the read found
    /// the counter: the finish upserts those and plain-INSERTs the others).
    pub counters: Vec<(String, String, i64, bool)>,
    /// Of `events`, the ids of those whose aggregate has events on the failure path: they go there
    /// too, behind them, without being sent.
    pub diverted: Set<i64>,
    /// From the failure path, due now (aggregate_seq stored with them).
    pub held_due: Vec<OutboxEvent>,
    /// More is due than this round takes (the failure path's batch was full, or a lagging shard
    /// read up to a recorded snapshot): go again at once.
    pub more: bool,
    /// A shard read up to a recorded snapshot (it is more than a second behind).
    pub catching_up: bool,
    /// The commit flags this read took: a read that is thrown away gives them back
    /// (`give_back`), or the commits they stand for would wait for the next full read.
    pub flags_taken: u32,
}

impl Batch {
    /// Throws away a batch that will not be published (read while another round was in flight,
    /// which then did not finish cleanly): its commit flags go back, so that the next read
    /// reads those shards again.
    pub fn give_back(self) {
        if self.flags_taken != 0 {
            (hooks().mark_shards_committed)(self.flags_taken);
        }
    }
}

/// What a read found.
pub enum Read {
    Batch(Batch),
    /// The extension is missing, at another version, or a copy.
    NotReady(Readiness),
    /// A read after a round in flight (`read_round`'s `after`) needs a kept claim, and there is
    /// none now: read again once that round is finished.
    Postponed,
}

/// An event of the failure path: (id, event_id, aggregate_type, aggregate_id, aggregate_seq,
/// event_type, payload, headers, stream, created_at), as outbox._held_due returns it; its texts
/// moved out of the row.
fn held_event(mut row: Row) -> Result<OutboxEvent, DbError> {
    let headers = row.take::<String>(7)?;
    Ok(OutboxEvent {
        id: row.get::<i64>(0)?.unwrap_or_default(),
        event_id: row.take::<String>(1)?.unwrap_or_default(),
        aggregate_type: row.take::<String>(2)?.unwrap_or_default(),
        aggregate_id: row.take::<String>(3)?.unwrap_or_default(),
        aggregate_seq: row.get::<i64>(4)?.unwrap_or_default(),
        event_type: row.take::<String>(5)?.unwrap_or_default(),
        payload: row.take::<String>(6)?.unwrap_or_default(),
        trace: TraceContext::from_headers(headers.as_deref()),
        headers,
        stream: row.take::<String>(8)?,
        created_at: row.take::<String>(9)?.unwrap_or_default(),
        replay: None,
    })
}

/// Which shards a round reads outside a full read, and which commit flags it gives back, from the
/// shards held last round (`held_before`), their flags taken before the claim (`flagged_before`)
/// and the shards held now (`mine`): the flagged ones still held, and every shard newly taken
/// (its flags may have been taken by its previous holder); the flags of shards given up go back
/// for their new holder.
pub fn shards_to_read(held_before: u32, flagged_before: u32, mine: u32) -> (u32, u32) {
    ((flagged_before & mine) | (mine & !held_before), flagged_before & !mine)
}

/// Where a claimed shard comes in the order a round's allowance is shared in: windows that fit
/// before windows published in parts (a bulk transaction's window takes what the live ones leave),
/// and within each kind from shard `first` up, wrapping around. `first` is the first shard the
/// previous round's allowance did not reach: while several shards lag, always starting from
/// shard 0 gave the low shards every round and left the high ones for the end of the drain.
pub fn allowance_order(shard: i16, in_parts: bool, first: i16) -> (bool, i16) {
    let shards = SHARDS as i16;
    (in_parts, (shard - first).rem_euclid(shards))
}

/// A claimed shard as the rule below needs it.
pub struct ShardClaim {
    /// It reads up to a recorded snapshot: the shard lags.
    pub bounded: bool,
    /// It goes on with a window published in parts, from a stored position.
    pub in_parts: bool,
    /// A full read, of a shard whose cursor has not moved for `IDLE_CURSOR_MOVE`.
    pub idle_long: bool,
}

/// What a shard's read found.
pub struct ShardRead {
    /// Some events.
    pub events: bool,
    /// The end of the window: the cursor may move to its `upto`.
    pub complete: bool,
    /// A position in the window, where the next part begins.
    pub reached: bool,
}

/// What a shard's read leaves the round.
#[derive(Debug, PartialEq, Eq)]
pub struct AfterRead {
    /// The shard's cursor (or position) is stored by the finish.
    pub advance: bool,
    /// The next round follows at once and reads every shard.
    pub more: bool,
}

impl AfterRead {
    pub fn of(claim: &ShardClaim, read: &ShardRead) -> AfterRead {
        // A lagging shard steps to its recorded snapshot even when that window is empty: its next
        // window then starts from there.
        let advance = read.events
            || (read.complete && (claim.bounded || claim.in_parts))
            || (read.complete && claim.idle_long)
            || (!read.complete && !claim.in_parts && read.reached);
        // A window published in parts may end at a recorded snapshot: the claim that began it
        // found the shard lagging, and the rounds that went on with it see only the window (and a
        // kept claim reads only flagged shards). So its last part says `more`, and the next round
        // reads every shard at once; else what was committed after that snapshot waited for the
        // next full read, a poll interval later.
        let more = !read.complete || claim.in_parts;
        AfterRead { advance, more }
    }
}

/// Claims this relay's shards and reads a round: each shard's whole window (every event committed
/// between its cursor and the claim's snapshot, or, for a shard more than a second behind, the
/// next recorded snapshot, as much of it as a round takes; see "Rounds are bounded" and
/// "Catching up" in docs/worker.md), the failure path's due events, and what the batch's
/// aggregates need (counters, whether they have events waiting on the failure path). Writes only
/// when shards change hands.
///
/// `after`: a round sent to Redis whose finish has not run yet. This read then reads on from where
/// that round leaves its shards (their next cursors and window positions) and numbers on from its
/// counters, as if it had finished; it runs only on a kept claim (nothing changes hands, no
/// failure path: that round had nothing held), else it is `Postponed`. Whoever reads it publishes
/// it only if that round finishes cleanly, and gives it back otherwise.
pub fn read_round(
    db: &mut impl Database,
    settings: &TickSettings,
    state: &mut RoundState,
    after: Option<&Batch>,
) -> Result<Read, String> {
    let read = db.transaction(|client| {
        let installation = match readiness(client, state)? {
            Readiness::Ready(oid) => oid,
            other => return Ok(Read::NotReady(other)),
        };
        if after.is_some_and(|after| after.installation != installation)
            || (after.is_some()
                && state.kept_claim(installation, settings.share, settings.lease, false, true).is_none())
        {
            return Ok(Read::Postponed);
        }
        {
            let mut batch = Batch { installation, ..Batch::default() };
            // The commit flags of the shards held last round, taken before the claim's snapshot:
            // a commit that flagged one of them was visible before it, so its events are in this
            // round's window. (Taken after, a commit between the two was flagged, taken, and not
            // yet in the window: its events then waited for the next full read.)
            let held_before = state.held_shards;
            let flagged_before = (hooks().take_committed_shards)(held_before);
            batch.flags_taken = flagged_before;
            let full_read = settings.full_read && after.is_none();
            let mut claimed =
                match state.kept_claim(installation, settings.share, settings.lease, full_read, after.is_some()) {
                    Some(kept) => read_kept_claim(client, settings, state, after, &kept)?,
                    None => Vec::new(),
                };
            if after.is_some() && claimed.is_empty() {
                // The shards changed hands meanwhile: read after that round has finished.
                batch.give_back();
                return Ok(Read::Postponed);
            }
            let mut held_any = false;
            if claimed.is_empty() {
                (claimed, held_any) = claim_shards(client, settings, state, installation)?;
            }
            // Outside a full read, only the shards that commits flagged since the last round,
            // those this relay did not hold then, those publishing a window in parts, and those
            // catching up (their next window is read whether or not a commit flagged them).
            let mine: u32 = claimed.iter().fold(0, |mask, c| mask | 1u32 << (c.shard as u32 % 32));
            let (flagged, given_back) = shards_to_read(held_before, flagged_before, mine);
            if given_back != 0 {
                (hooks().mark_shards_committed)(given_back);
                (hooks().wake_relays)();
            }
            state.held_shards = mine;
            for shard in 0..SHARDS as i16 {
                if mine & (1u32 << shard) == 0 {
                    client.forget_window(shard);
                }
            }
            if claimed.is_empty() {
                return Ok(Read::Batch(batch));
            }
            let full = full_read;
            let shards: Vec<i16> = claimed.iter().map(|c| c.shard).collect();
            claimed.retain(|c| {
                full || c.position.is_some() || c.bounded || flagged & (1u32 << (c.shard as u32 % 32)) != 0
            });
            batch.catching_up = claimed.iter().any(|c| c.bounded);
            batch.more |= batch.catching_up;
            // Windows that fit are read whole first; windows published in parts share what is
            // left of the round's allowance (round/src/window.rs). Each kind from the shard the
            // last round's allowance did not reach, so that shards lagging together take turns.
            claimed.sort_by_key(|c| allowance_order(c.shard, c.position.is_some(), state.first_shard));
            let log = read_windows(client, &claimed, full, &mut batch, state)?;
            if held_any {
                let limit = settings.batch_size.min(i32::MAX as usize) as i32;
                let held = client.query(HELD_DUE, &[shards.clone().into(), limit.into(), settings.in_order.into()])?;
                for row in held {
                    batch.held_due.push(held_event(row)?);
                }
            }
            batch.more |= batch.held_due.len() >= settings.batch_size;
            batch.events = number_events(client, log, &mut batch, after, settings, held_any, shards)?;
            Ok(Read::Batch(batch))
        }
    });
    read.map_err(String::from)
}

/// Gives up every shard relay `pid` holds (a claim with a share of 0), and forgets them: a relay
/// that pauses or exits, once its round in flight is landed, so that the other relays take them at
/// their next claim rather than after the lease (30 s by default, during which nothing of them was
/// published: found by the outside relay's bench).
pub fn release_shards(
    db: &mut impl Database,
    state: &mut RoundState,
    pid: i32,
    lease: Duration,
) -> Result<(), DbError> {
    let lease_ms = lease.as_millis().min(i32::MAX as u128) as i32;
    db.transaction(|db| db.execute(CLAIM, &[pid.into(), 0i32.into(), lease_ms.into()]))?;
    state.held_shards = 0;
    state.forget_kept_claim();
    Ok(())
}

/// The shards of a claim kept from an earlier round, as the claim would give them, or none when they
/// are no longer exactly the kept ones (the claim is then forgotten).
fn read_kept_claim(
    client: &mut dyn Statements,
    settings: &TickSettings,
    state: &mut RoundState,
    after: Option<&Batch>,
    kept: &[i16],
) -> Result<Vec<Claimed>, DbError> {
    // Nothing changes hands and the lease is fresh: only the cursors, the windows and
    // the bounds are read, and only if the shards are still exactly the kept ones.
    // After a round in flight, from where it leaves the shards it moves (their next
    // cursors and window positions), as if it had finished.
    let mut claimed: Vec<Claimed> = Vec::new();
    let left: Vec<&ShardBatch> =
        after.map(|after| after.shards.iter().filter(|s| s.advance).collect()).unwrap_or_default();
    let mut cursors: Vec<Option<String>> = vec![None; SHARDS as usize];
    for shard in &left {
        cursors[shard.shard as usize] = Some(shard.next_cursor.clone());
    }
    // Reads only: a round on a kept claim writes nothing and draws no xid (`select`).
    for mut row in client.select(HELD, &[settings.pid.into(), cursors.into()])? {
        let shard = row.get::<i16>(0)?.unwrap_or_default();
        let stored = match row.take::<String>(2)? {
            Some(upto) => Some((upto, position(row.get::<i64>(3)?, row.get::<i64>(4)?))),
            None => None,
        };
        let window = match left.iter().find(|s| s.shard == shard) {
            Some(s) => s.window.clone().map(|(upto, position)| (upto, Some(position))),
            None => stored,
        };
        let now = row.take::<String>(5)?.unwrap_or_default();
        let recorded = row.take::<String>(6)?;
        // Like the claim: the window published in parts; else the first recorded
        // snapshot ahead of a lagging cursor; else now.
        let (upto, bounded, position) = match (window, recorded) {
            (Some((upto, position)), _) => (upto, false, position),
            (None, Some(recorded)) => (recorded, true, None),
            (None, None) => (now, false, None),
        };
        claimed.push(Claimed {
            shard,
            cursor: row.take::<String>(1)?.unwrap_or_default(),
            age_ms: 0,
            upto,
            bounded,
            position,
        });
    }
    if !claimed.iter().map(|c| c.shard).eq(kept.iter().copied()) {
        state.forget_kept_claim();
        claimed.clear();
    }
    Ok(claimed)
}

/// Claims this relay's share of the shards (outbox._claim_shards: SKIP LOCKED, a lease) and keeps
/// the claim for the next rounds when the failure path holds nothing in them; also whether it does.
fn claim_shards(
    client: &mut dyn Statements,
    settings: &TickSettings,
    state: &mut RoundState,
    installation: u32,
) -> Result<(Vec<Claimed>, bool), DbError> {
    let lease_ms = settings.lease.as_millis().min(i32::MAX as u128) as i32;
    let mut claimed: Vec<Claimed> = Vec::new();
    let mut held_any = false;
    for mut row in client.query(CLAIM, &[settings.pid.into(), (settings.share as i32).into(), lease_ms.into()])? {
        claimed.push(Claimed {
            shard: row.get::<i16>(0)?.unwrap_or_default(),
            cursor: row.take::<String>(1)?.unwrap_or_default(),
            age_ms: row.get::<i64>(2)?.unwrap_or_default(),
            // The end of the window being published in parts; or now (taken after
            // the claim: the reads below see every transaction it shows as
            // committed), or a recorded snapshot for a lagging shard: then more
            // follows at once.
            upto: row.take::<String>(3)?.unwrap_or_default(),
            bounded: row.get::<bool>(5)?.unwrap_or(false),
            position: position(row.get::<i64>(6)?, row.get::<i64>(7)?),
        });
        held_any = row.get::<bool>(4)?.unwrap_or(true);
    }
    let keepable = !held_any;
    state.keep_claim(installation, settings.share, claimed.iter().map(|c| c.shard).collect(), keepable);
    Ok((claimed, held_any))
}

/// Reads each claimed shard's window, as much as the round's allowance takes, into the batch's
/// shards; returns the events read. Flags the shards the allowance did not reach, so that the next
/// round comes back to them, and starts the next round's allowance at the first of them.
fn read_windows(
    client: &mut dyn Statements,
    claimed: &[Claimed],
    full: bool,
    batch: &mut Batch,
    state: &mut RoundState,
) -> Result<Vec<LogEvent>, DbError> {
    let mut asks = Vec::with_capacity(claimed.len());
    for c in claimed {
        let parse = |text: &str| {
            Snapshot::parse(text).ok_or_else(|| {
                DbError::new(format!("outbox_pg: shard {}'s cursor or snapshot {text:?} is not a pg_snapshot", c.shard))
            })
        };
        asks.push(WindowAsk { shard: c.shard, cursor: parse(&c.cursor)?, upto: parse(&c.upto)?, from: c.position });
    }
    let mut budget = Budget::round_of(state.allowance.events());
    let reads = client.read_windows(&asks, &mut budget)?;
    if reads.len() != claimed.len() {
        return Err(DbError::new(format!("outbox_pg: {} windows read for {} shards", reads.len(), claimed.len())));
    }
    let mut first_unread = None;
    let mut log = Vec::new();
    let mut unread = 0u32;
    for (c, read) in claimed.iter().zip(reads) {
        let outcome = AfterRead::of(
            &ShardClaim {
                bounded: c.bounded,
                in_parts: c.position.is_some(),
                idle_long: full && Duration::from_millis(c.age_ms as u64) >= IDLE_CURSOR_MOVE,
            },
            &ShardRead { events: !read.events.is_empty(), complete: read.complete, reached: read.position.is_some() },
        );
        let advance = outcome.advance;
        batch.more |= outcome.more;
        if !read.complete && read.position.is_none() {
            // The round's allowance ran out before this shard: nothing of it was read and
            // no position is stored, so only a flag sends the next round (a read on the
            // kept claim reads flagged shards only) back to it.
            unread |= 1u32 << (c.shard as u32 % 32);
        }
        if !read.complete && read.events.is_empty() {
            // The allowance ran out before this shard, whether or not a window of it is
            // being published in parts (found by attack: only shards with no stored
            // position counted, so two windows in parts did not take turns).
            first_unread = first_unread.or(Some(c.shard));
        }
        let window = (!read.complete).then(|| (c.upto.clone(), read.position.unwrap_or((i64::MIN, i64::MIN))));
        batch.shards.push(ShardBatch {
            shard: c.shard,
            next_cursor: if read.complete { c.upto.clone() } else { c.cursor.clone() },
            window,
            advance,
        });
        client.flush_commits(&mut read.events.iter().map(|row| row.txid));
        log.extend(read.events);
    }
    if unread != 0 {
        (hooks().mark_shards_committed)(unread);
    }
    if let Some(shard) = first_unread {
        state.first_shard = shard;
    }
    Ok(log)
}

/// The events in publish order, each numbered in its aggregate (`aggregate_seq`, from the counters,
/// or from the round in flight `after` as its finish will leave them), and those whose aggregate
/// waits on the failure path diverted to it; the batch gets the counters its finish writes.
fn number_events(
    client: &mut dyn Statements,
    mut log: Vec<LogEvent>,
    batch: &mut Batch,
    after: Option<&Batch>,
    settings: &TickSettings,
    held_any: bool,
    shards: Vec<i16>,
) -> Result<Vec<OutboxEvent>, DbError> {
    // Each shard's events in its publish order, which is commit order for every aggregate
    // (round/src/window.rs); the shards' interleave by the same key, which keeps each one's order.
    log.sort_unstable_by_key(|event| event.position());
    let mut log: Vec<OutboxEvent> = log.into_iter().map(|row| row.event).collect();
    let aggregates = distinct_aggregates(&log);
    if !aggregates.is_empty() {
        let mut found = client.last_seqs(&aggregates)?;
        if let Some(after) = after {
            // That round's counters, as its finish will have written them.
            let left: Map<(&str, &str), i64> =
                after.counters.iter().map(|(t, i, seq, _)| ((t.as_str(), i.as_str()), *seq)).collect();
            for ((t, i), seq) in aggregates.iter().zip(found.iter_mut()) {
                if let Some(&left) = left.get(&(t.as_str(), i.as_str())) {
                    *seq = Some(seq.unwrap_or(0).max(left));
                }
            }
        }
        let counted: Vec<bool> = found.iter().map(Option::is_some).collect();
        let mut last_seq: Vec<i64> = found.into_iter().map(|seq| seq.unwrap_or(0)).collect();
        let mut waiting = Set::default();
        if settings.in_order && held_any {
            let types: Vec<String> = aggregates.iter().map(|(t, _)| t.clone()).collect();
            let ids: Vec<String> = aggregates.iter().map(|(_, i)| i.clone()).collect();
            for row in client.query(HELD_AGGREGATES, &[types.into(), ids.into(), shards.into()])? {
                waiting.insert(row.get::<i64>(0)?.unwrap_or_default() as usize - 1);
            }
        }
        let index: Map<(&str, &str), usize> =
            aggregates.iter().enumerate().map(|(n, (t, i))| ((t.as_str(), i.as_str()), n)).collect();
        for event in &mut log {
            let position = index[&(event.aggregate_type.as_str(), event.aggregate_id.as_str())];
            last_seq[position] += 1;
            event.aggregate_seq = last_seq[position];
            if waiting.contains(&position) {
                batch.diverted.insert(event.id);
            }
        }
        batch.counters = aggregates
            .into_iter()
            .zip(last_seq)
            .zip(counted)
            .map(|(((t, i), seq), counted)| (t, i, seq, counted))
            .collect();
    }
    Ok(log)
}

/// The distinct aggregates of `events`, in order of first appearance.
pub fn distinct_aggregates(events: &[OutboxEvent]) -> Vec<(String, String)> {
    let mut seen = Set::default();
    events
        .iter()
        .filter(|e| seen.insert((e.aggregate_type.as_str(), e.aggregate_id.as_str())))
        .map(|e| (e.aggregate_type.clone(), e.aggregate_id.clone()))
        .collect()
}
