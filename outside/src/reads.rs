//! What the background worker reads without statements, read here with them: a shard's window
//! (`outbox._read_window`, the SQL form of src/log/window.rs's index walk, which gives the same
//! events in the same order: tests/relay_sql.rs; `outbox._read_windows` reads several shards' in one
//! statement), the aggregates' counters (`outbox._last_seqs`),
//! and which installation the log belongs to. `PgStatements` (src/pg.rs) answers outbox-round's
//! `Statements::read_window`, `last_seqs`, `installation` and `installed_version` with these.

use outbox_round::db::{first, DbError, Row, Statements, Value};
use outbox_round::snapshot::Snapshot;
use outbox_round::time::timestamptz_text;
use outbox_round::window::{Budget, LogEvent, Position, WindowAsk, WindowRead};
use outbox_sink::event::{OutboxEvent, TraceContext};

const READ_WINDOW: &str = "SELECT txid, txn_max_id, id, event_id, aggregate_type, aggregate_id, event_type, payload, \
                           headers, stream, created_at, traceparent, tracestate, size, complete, position_max_id, \
                           position_last_id FROM outbox._read_window($1, $2, $3, $4, $5, $6, $7, $8)";
const READ_WINDOWS: &str = "SELECT shard, txid, txn_max_id, id, event_id, aggregate_type, aggregate_id, event_type, \
                            payload, headers, stream, created_at, traceparent, tracestate, size, complete, \
                            position_max_id, position_last_id FROM outbox._read_windows($1, $2, $3, $4, $5, $6, $7, $8)";
const LAST_SEQS: &str = "SELECT outbox._last_seqs($1, $2)";
/// The installation's identity: the extension's OID where it was made by `CREATE EXTENSION`
/// (pg_tle's too), else the OID of the SQL-only install's table `outbox.installation`; either
/// changes when the schema is dropped and installed again, which a finish checks.
const INSTALLATION: &str = "SELECT coalesce((SELECT oid FROM pg_catalog.pg_extension WHERE extname = 'outbox_pg'), \
                            pg_catalog.to_regclass('outbox.installation')::oid)";

/// One round's read of `shard`'s window (`Statements::read_window`); `budget` is charged for what
/// it returns, as the worker's walk charges it.
pub fn read_window(
    db: &mut dyn Statements,
    shard: i16,
    cursor: &Snapshot,
    upto: &Snapshot,
    from: Option<Position>,
    budget: &mut Budget,
) -> Result<WindowRead, DbError> {
    if budget.exhausted() {
        return Ok(WindowRead { events: Vec::new(), complete: false, position: from });
    }
    let args = [
        shard.into(),
        snapshot_text(cursor).into(),
        snapshot_text(upto).into(),
        from.map(|p| p.0).into(),
        from.map(|p| p.1).into(),
        (budget.events.min(i32::MAX as usize) as i32).into(),
        (budget.bytes.min(i64::MAX as usize) as i64).into(),
        (budget.taken.min(i32::MAX as usize) as i32).into(),
    ];
    let mut rows = db.query(READ_WINDOW, &args)?;
    // The last row says whether the window is complete and where it stands; the others are events.
    let Some(last) = rows.pop() else {
        return Err(DbError::new("outbox._read_window returned no row"));
    };
    let mut read = WindowRead {
        events: Vec::with_capacity(rows.len()),
        complete: last.get::<bool>(14)?.unwrap_or(false),
        position: last.get::<i64>(15)?.zip(last.get::<i64>(16)?),
    };
    for row in rows {
        let event = log_event(row, 0)?;
        budget.take(event.event.approximate_size());
        read.events.push(event);
    }
    Ok(read)
}

/// A round's reads of several shards' windows (`Statements::read_windows`), in one statement:
/// `outbox._read_windows` charges each shard's read with what the ones before it took, as
/// `budget` is charged here.
pub fn read_windows(
    db: &mut dyn Statements,
    asks: &[WindowAsk],
    budget: &mut Budget,
) -> Result<Vec<WindowRead>, DbError> {
    if asks.is_empty() {
        return Ok(Vec::new());
    }
    let args = [
        asks.iter().map(|ask| ask.shard).collect::<Vec<i16>>().into(),
        asks.iter().map(|ask| snapshot_text(&ask.cursor)).collect::<Vec<String>>().into(),
        asks.iter().map(|ask| snapshot_text(&ask.upto)).collect::<Vec<String>>().into(),
        Value::Int8Array(asks.iter().map(|ask| ask.from.map(|p| p.0)).collect()),
        Value::Int8Array(asks.iter().map(|ask| ask.from.map(|p| p.1)).collect()),
        (budget.events.min(i32::MAX as usize) as i32).into(),
        (budget.bytes.min(i64::MAX as usize) as i64).into(),
        (budget.taken.min(i32::MAX as usize) as i32).into(),
    ];
    let mut reads = Vec::with_capacity(asks.len());
    let mut read = WindowRead::default();
    // Each shard's events, then its last row (complete not NULL), shard by shard in order.
    for row in db.query(READ_WINDOWS, &args)? {
        let shard = row.get::<i16>(0)?.unwrap_or(-1);
        if asks.get(reads.len()).map(|ask| ask.shard) != Some(shard) {
            return Err(DbError::new(format!("outbox._read_windows returned shard {shard} out of the order asked")));
        }
        match row.get::<bool>(15)? {
            Some(complete) => {
                read.complete = complete;
                read.position = row.get::<i64>(16)?.zip(row.get::<i64>(17)?);
                reads.push(std::mem::take(&mut read));
            }
            None => {
                let event = log_event(row, 1)?;
                budget.take(event.event.approximate_size());
                read.events.push(event);
            }
        }
    }
    if reads.len() != asks.len() {
        return Err(DbError::new(format!("outbox._read_windows read {} of {} shards", reads.len(), asks.len())));
    }
    Ok(reads)
}

/// An event row of `outbox._read_window` (its columns from `at` on), its texts moved out.
fn log_event(mut row: Row, at: usize) -> Result<LogEvent, DbError> {
    let headers = row.take::<String>(at + 8)?;
    let trace = row.take::<String>(at + 11)?.map(|traceparent| TraceContext { traceparent, tracestate: None });
    let trace = match (trace, row.take::<String>(at + 12)?) {
        (Some(trace), tracestate) => Some(TraceContext { tracestate, ..trace }),
        (None, _) => None,
    };
    Ok(LogEvent {
        txid: row.get::<i64>(at)?.unwrap_or_default() as u64,
        txn_max_id: row.get::<i64>(at + 1)?.unwrap_or_default(),
        event: OutboxEvent {
            id: row.get::<i64>(at + 2)?.unwrap_or_default(),
            event_id: row.take::<String>(at + 3)?.unwrap_or_default(),
            aggregate_type: row.take::<String>(at + 4)?.unwrap_or_default(),
            aggregate_id: row.take::<String>(at + 5)?.unwrap_or_default(),
            aggregate_seq: 0,
            event_type: row.take::<String>(at + 6)?.unwrap_or_default(),
            payload: row.take::<String>(at + 7)?.unwrap_or_default(),
            headers,
            trace,
            stream: row.take::<String>(at + 9)?,
            created_at: row.get::<i64>(at + 10)?.map(timestamptz_text).unwrap_or_default(),
            replay: None,
        },
    })
}

/// A snapshot in `pg_snapshot`'s text form, as `Snapshot::parse` reads it.
fn snapshot_text(snapshot: &Snapshot) -> String {
    let xip: Vec<String> = snapshot.xip.iter().map(u64::to_string).collect();
    format!("{}:{}:{}", snapshot.xmin, snapshot.xmax, xip.join(","))
}

/// `Statements::last_seqs`.
pub fn last_seqs(db: &mut dyn Statements, aggregates: &[(String, String)]) -> Result<Vec<Option<i64>>, DbError> {
    let types: Vec<String> = aggregates.iter().map(|(t, _)| t.clone()).collect();
    let ids: Vec<String> = aggregates.iter().map(|(_, i)| i.clone()).collect();
    let seqs = first::<Vec<Option<i64>>>(&db.query(LAST_SEQS, &[types.into(), ids.into()])?)?.unwrap_or_default();
    if seqs.len() != aggregates.len() {
        return Err(DbError::new(format!(
            "outbox._last_seqs returned {} counters for {} aggregates",
            seqs.len(),
            aggregates.len()
        )));
    }
    Ok(seqs)
}

/// `Statements::installation`.
pub fn installation(db: &mut dyn Statements) -> Result<Option<u32>, DbError> {
    first::<u32>(&db.query(INSTALLATION, &[])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_is_written_as_it_is_parsed() {
        for text in ["5:5:", "10:20:12,15", "1:2:1"] {
            let snapshot = Snapshot::parse(text).unwrap();
            assert_eq!(snapshot_text(&snapshot), text);
        }
    }
}
