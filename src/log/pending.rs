//! What the log holds undelivered, exactly, for `outbox.stats` and the age alert: the events no
//! shard's cursor, or position in a window published in parts, has consumed yet (src/log/window.rs).
//! Read from the log's `(shard, txid, id)` indexes without the planner, so that no statistics
//! can make it slow: a plan that trusted the statistics of a table holding one transaction of
//! 2,000,000 events filtered a bitmap scan on the shard alone and took ten seconds, once a second,
//! in the relay's own housekeeping. (The failure path's part is SQL: `outbox._health`.)

use pgrx::prelude::*;

use crate::log::snapshot::Snapshot;
use crate::log::tables::{committed, LogTable, LogTables};

/// The undelivered events of the log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogPending {
    /// How many (when counted).
    pub events: i64,
    /// When the oldest was enqueued (a timestamptz), if any: of each undelivered transaction, its
    /// first undelivered event (a transaction's events are enqueued in id order, one clock).
    pub oldest: Option<i64>,
}

/// A shard as `outbox.shards` has it, with the snapshot of now.
struct ShardState {
    shard: i16,
    cursor: Snapshot,
    /// A window published in parts: its end and the position reached.
    window: Option<(Snapshot, (i64, i64))>,
}

const SHARDS: &str = "SELECT shard, cursor::text, window_upto::text, window_max_id, window_last_id, \
                             pg_catalog.pg_current_snapshot()::text \
                        FROM outbox.shards ORDER BY shard";

/// The snapshots housekeeping records once a second while anything is undelivered
/// (`outbox._record_snapshot`), as (when, the txid that recorded it), oldest first.
const RECORDED: &str = "SELECT (extract(epoch FROM taken_at) * 1000000)::int8 - 946684800000000, \
                               recorded_by::text::int8 \
                          FROM outbox.snapshots WHERE recorded_by IS NOT NULL ORDER BY taken_at";

/// Where the search for the oldest may stop, once an undelivered event of `oldest` was found: past
/// the txid of the transaction that recorded the first snapshot at or after it. A transaction
/// above that txid drew its own later, so after the recording transaction began (`taken_at`,
/// at or after `oldest`), and enqueued every event later still (both enqueues draw the txid
/// before they read the clock): none is older. Not the snapshot's xmax: a transaction running
/// then may be above it (found by attack). Without a bound, the age check read every undelivered
/// transaction once a second: a paused relay's housekeeping took 73% of a core while writers
/// enqueued 7,000 events a second.
fn walk_bound(recorded: &[(i64, u64)], oldest: Option<i64>) -> u64 {
    oldest
        .and_then(|oldest| recorded.iter().find(|(taken_at, _)| *taken_at >= oldest))
        .map_or(u64::MAX, |(_, recorded_by)| recorded_by.saturating_add(1))
}

/// Counts (when `count`) the log's undelivered events and finds the oldest. Without counting, each
/// undelivered transaction costs a probe of the index and one row read, however many events it
/// has; counting reads every undelivered row (a rolled-back subtransaction's rows are in the
/// index too: only the row says whether it is there).
pub fn log_pending(count: bool) -> Result<LogPending, pgrx::spi::Error> {
    let mut shards = Vec::new();
    let mut now = None;
    Spi::connect(|client| {
        for row in client.select(SHARDS, None, &[])? {
            let parse = |text: Option<String>| text.as_deref().and_then(Snapshot::parse);
            let Some(cursor) = parse(row.get::<String>(2)?) else { continue };
            let upto = parse(row.get::<String>(3)?);
            let position = row.get::<i64>(4)?.zip(row.get::<i64>(5)?);
            now = parse(row.get::<String>(6)?);
            shards.push(ShardState {
                shard: row.get::<i16>(1)?.unwrap_or_default(),
                cursor,
                window: upto.zip(position),
            });
        }
        Ok::<_, pgrx::spi::Error>(())
    })?;
    let Some(now) = now else { return Ok(LogPending::default()) };
    let recorded: Vec<(i64, u64)> = if count {
        Vec::new()
    } else {
        Spi::connect(|client| {
            client
                .select(RECORDED, None, &[])?
                .map(|row| Ok((row.get::<i64>(1)?.unwrap_or_default(), row.get::<i64>(2)?.unwrap_or_default() as u64)))
                .collect::<Result<Vec<_>, pgrx::spi::Error>>()
        })?
    };
    let mut pending = LogPending::default();
    // Taken after `now`: its snapshot sees every transaction `now` shows as committed.
    let mut tables = LogTables::open();
    if !count {
        // Each shard's first undelivered transaction first: the oldest of them bounds the walks.
        for state in &shards {
            tally_transactions(&mut tables, state, &now, 1, &mut pending, false, &recorded);
        }
    }
    for state in &shards {
        tally_transactions(&mut tables, state, &now, usize::MAX, &mut pending, count, &recorded);
    }
    Ok(pending)
}

/// Adds up to `most` undelivered transactions of `state`'s shard to `pending`, ascending, below
/// the bound the oldest found so far gives (`walk_bound`) when not counting.
fn tally_transactions(
    tables: &mut LogTables,
    state: &ShardState,
    now: &Snapshot,
    most: usize,
    pending: &mut LogPending,
    count: bool,
    recorded: &[(i64, u64)],
) {
    let below = if count { u64::MAX } else { walk_bound(recorded, pending.oldest) };
    for txid in undelivered_transactions(tables, state, now, below, most).into_iter().take(most) {
        if !count && txid >= walk_bound(recorded, pending.oldest) {
            break;
        }
        let done_below = consumed_position(tables, state, txid);
        tables.all(|table| {
            tally(table, state.shard, txid, done_below, count, pending);
            true
        });
    }
}

/// The transactions of `state`'s shard visible in `now` and not in its cursor, ascending: those
/// the cursor saw running, and those from its xmax below `below`, the first `most` of each table.
fn undelivered_transactions(
    tables: &mut LogTables,
    state: &ShardState,
    now: &Snapshot,
    below: u64,
    most: usize,
) -> Vec<u64> {
    let mut found = std::collections::BTreeSet::new();
    let upto = now.xmax.min(below);
    tables.all(|table| {
        for &txid in state.cursor.xip.iter().filter(|&&txid| now.sees(txid)) {
            if committed(txid) && table.first_txid(state.shard, txid, txid + 1).is_some() {
                found.insert(txid);
            }
        }
        let mut from = state.cursor.xmax;
        let mut walked = 0;
        while from < upto && walked < most {
            let Some(txid) = table.first_txid(state.shard, from, upto) else { break };
            if now.sees(txid) && committed(txid) {
                found.insert(txid);
                walked += 1;
            }
            from = txid + 1;
        }
        true
    });
    found.into_iter().collect()
}

/// For a transaction of a window published in parts, the id up to which it is consumed: all of it
/// (i64::MAX) when its largest id is below the position's, up to the position's id when it is the
/// position's transaction, none (i64::MIN) otherwise.
fn consumed_position(tables: &mut LogTables, state: &ShardState, txid: u64) -> i64 {
    let Some((upto, (max_id, last_id))) = &state.window else { return i64::MIN };
    if !upto.sees(txid) || state.cursor.sees(txid) {
        return i64::MIN;
    }
    let mut largest = i64::MIN;
    tables.all(|table| {
        largest = largest.max(table.last_id(state.shard, txid).unwrap_or(i64::MIN));
        true
    });
    match largest.cmp(max_id) {
        std::cmp::Ordering::Less => i64::MAX,
        std::cmp::Ordering::Equal => *last_id,
        std::cmp::Ordering::Greater => i64::MIN,
    }
}

/// Adds transaction `txid`'s undelivered events in `table` (its ids above `done_below`) to
/// `pending`: their number when `count`, and the creation time of the first.
fn tally(table: &LogTable, shard: i16, txid: u64, done_below: i64, count: bool, pending: &mut LogPending) {
    if done_below == i64::MAX {
        return;
    }
    let mut first = None;
    table.rows_of(shard, txid, done_below, pgrx::pg_sys::ScanDirection::ForwardScanDirection, |_, created_at| {
        first.get_or_insert(created_at);
        pending.events += i64::from(count);
        count
    });
    if let Some(created) = first {
        pending.oldest = Some(pending.oldest.map_or(created, |oldest| oldest.min(created)));
    }
}

/// `outbox._log_pending(count_events)`: the log's undelivered events (0 unless counted) and when
/// the oldest was enqueued; `outbox._health` adds the failure path's.
#[pg_extern(sql = false)]
fn log_pending_sql(
    count_events: bool,
) -> TableIterator<'static, (name!(events, i64), name!(oldest, Option<TimestampWithTimeZone>))> {
    let pending = log_pending(count_events).unwrap_or_else(|error| error!("outbox._log_pending: {error}"));
    let oldest = pending.oldest.and_then(|at| TimestampWithTimeZone::try_from(at).ok());
    TableIterator::once((pending.events, oldest))
}
