//! One round of the relay: claim a batch (and commit), publish it to Redis (no transaction open),
//! settle the rows (second short transaction). No signal handling and no waiting here, so that the
//! outcome alone decides what the main loop does next.

use std::collections::BTreeMap;

use pgrx::prelude::*;

use crate::entry::OutboxEvent;
use crate::sink::redis::{BrokerError, EntryOutcome, RedisSink};
use crate::worker::txn;

/// What the relay needs to know for one round; read from the settings before each round.
#[derive(Debug, Clone)]
pub struct TickSettings {
    pub batch_size: usize,
    pub stream_template: String,
    pub stream_maxlen: Option<u64>,
}

/// The outcome of one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickOutcome {
    /// A batch was claimed and settled. `published` reached Redis; `rejected` were refused by
    /// Redis because of the entry itself and went back to pending with their error.
    Worked { claimed: usize, published: usize, rejected: usize },
    /// Nothing was pending.
    Idle,
    /// The extension is not installed in the relay's database (yet, or any more).
    ExtensionMissing,
    /// Redis failed as a whole; the claimed rows went back to pending. Some rows may have been
    /// published before the failure was noticed.
    BrokerDown { error: BrokerError, published: usize },
    /// The database refused a statement (e.g. during DROP EXTENSION); nothing was lost.
    DatabaseError(String),
}

const EXTENSION_INSTALLED: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'outbox_pg')";
const CLAIM: &str =
    "SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at \
                     FROM outbox._claim_batch($1)";
const MARK_PUBLISHED: &str = "SELECT outbox._mark_published($1)";
const RELEASE: &str = "SELECT outbox._release($1, $2)";
const REAP: &str = "SELECT outbox._reap_expired($1)";

/// Returns claims whose lease expired or whose claimer is gone; `Ok(None)` when the extension is
/// not installed.
pub fn reap_expired_claims(lease_ms: i32) -> Result<Option<i64>, String> {
    txn::run(move || -> Result<Option<i64>, pgrx::spi::Error> {
        if !extension_installed()? {
            return Ok(None);
        }
        Spi::get_one_with_args::<i64>(REAP, &[lease_ms.into()])
    })
    .and_then(|r| r.map_err(|e| e.to_string()))
}

fn extension_installed() -> Result<bool, pgrx::spi::Error> {
    Ok(Spi::get_one::<bool>(EXTENSION_INSTALLED)?.unwrap_or(false))
}

/// Claims up to `batch_size` pending events and commits the claim.
fn claim(batch_size: usize) -> Result<Option<Vec<OutboxEvent>>, String> {
    let batch_size = batch_size as i32;
    txn::run(move || -> Result<Option<Vec<OutboxEvent>>, pgrx::spi::Error> {
        if !extension_installed()? {
            return Ok(None);
        }
        Spi::connect_mut(|client| {
            let rows = client.update(CLAIM, None, &[batch_size.into()])?;
            let mut events = Vec::with_capacity(rows.len());
            for row in rows {
                events.push(OutboxEvent {
                    id: row.get::<i64>(1)?.unwrap_or_default(),
                    event_id: row.get::<String>(2)?.unwrap_or_default(),
                    aggregate_type: row.get::<String>(3)?.unwrap_or_default(),
                    aggregate_id: row.get::<String>(4)?.unwrap_or_default(),
                    event_type: row.get::<String>(5)?.unwrap_or_default(),
                    payload: row.get::<String>(6)?.unwrap_or_default(),
                    headers: row.get::<String>(7)?,
                    stream: row.get::<String>(8)?,
                    created_at: row.get::<String>(9)?.unwrap_or_default(),
                });
            }
            // RETURNING gives no order; publish oldest first.
            events.sort_unstable_by_key(|event| event.id);
            Ok(Some(events))
        })
    })
    .and_then(|r| r.map_err(|e| e.to_string()))
}

/// Marks `published` rows published and returns every `(ids, error)` group to pending.
fn settle(published: Vec<i64>, released: BTreeMap<String, Vec<i64>>) -> Result<(), String> {
    txn::run(move || -> Result<(), pgrx::spi::Error> {
        if !published.is_empty() {
            Spi::get_one_with_args::<i64>(MARK_PUBLISHED, &[published.into()])?;
        }
        for (error, ids) in released {
            Spi::get_one_with_args::<i64>(RELEASE, &[ids.into(), error.into()])?;
        }
        Ok(())
    })
    .and_then(|r| r.map_err(|e| e.to_string()))
}

/// One round: claim, publish, settle.
pub fn tick(sink: &mut RedisSink, settings: &TickSettings) -> TickOutcome {
    let events = match claim(settings.batch_size) {
        Err(error) => return TickOutcome::DatabaseError(error),
        Ok(None) => return TickOutcome::ExtensionMissing,
        Ok(Some(events)) if events.is_empty() => return TickOutcome::Idle,
        Ok(Some(events)) => events,
    };
    let claimed = events.len();

    let mut published = Vec::with_capacity(claimed);
    let mut released: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut rejected = 0;
    let mut broker_error = None;
    match sink.publish(&events, &settings.stream_template, settings.stream_maxlen) {
        Ok(outcomes) => {
            for (event, outcome) in events.iter().zip(outcomes) {
                match outcome {
                    EntryOutcome::Published => published.push(event.id),
                    EntryOutcome::Rejected(error) => {
                        rejected += 1;
                        released.entry(error).or_default().push(event.id);
                    }
                    EntryOutcome::BrokerRefused(error) => {
                        released.entry(error.clone()).or_default().push(event.id);
                        broker_error.get_or_insert(BrokerError(error));
                    }
                }
            }
        }
        Err(error) => {
            released.insert(error.0.clone(), events.iter().map(|event| event.id).collect());
            broker_error = Some(error);
        }
    }

    let published_count = published.len();
    // If settling fails the rows stay `publishing` until their lease expires and are then
    // published again: a duplicate, never a loss.
    if let Err(error) = settle(published, released) {
        return TickOutcome::DatabaseError(error);
    }
    match broker_error {
        Some(error) => TickOutcome::BrokerDown { error, published: published_count },
        None => TickOutcome::Worked { claimed, published: published_count, rejected },
    }
}
