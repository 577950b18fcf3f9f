//! One round of the relay, over the log: claim shards and read their batches (a short transaction
//! that writes only when shards change hands), publish to Redis (no transaction open), finish (one
//! short transaction: each shard's cursor, the per-aggregate counters, and the failure path for
//! what Redis refused). No signal handling and no waiting here, so that the outcome alone decides
//! what the main loop does next. The design is in docs/worker.md, "The log".

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::{Duration, Instant};

/// The round's per-event maps and sets: keyed by aggregates, so by the application's strings, and
/// looked up several times per event. foldhash is several times faster than the standard SipHash
/// on such short keys and, seeded per process, keeps a hostile choice of ids from degrading them.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
type Set<K> = HashSet<K, foldhash::fast::RandomState>;

use pgrx::prelude::*;
use pgrx::spi::OwnedPreparedStatement;
use pgrx::{PgBuiltInOids, PgOid};

use crate::batch::{read_window, Snapshot};
use crate::claims;
use crate::counters;
use crate::entry::OutboxEvent;
use crate::guc::FaultInjection;
use crate::shmem;
use crate::sink::redis::{BrokerError, EntryOutcome, RedisSink};
use crate::worker::txn;

/// What the relay needs to know for one round; read from the settings before each round.
#[derive(Debug, Clone)]
pub struct TickSettings {
    /// This relay's slot (for what it has in flight) and process id (what holds its shards).
    pub slot: usize,
    pub pid: i32,
    /// How many of the 16 shards this relay takes: its share of `outbox.workers`.
    pub share: usize,
    /// Shards of a relay whose lease is older than this are taken over (`outbox.lease`).
    pub lease: Duration,
    /// Events read per shard per round (a round may carry `share` times as many).
    pub batch_size: usize,
    pub stream_template: String,
    pub stream_maxlen: Option<u64>,
    /// Keep per-aggregate order (`outbox.ordering = aggregate`).
    pub in_order: bool,
    /// Read every shard held, not only those committed into since the last round (the relay asks
    /// for it once per poll interval, after a cut batch and after a failure).
    pub full_read: bool,
    pub max_attempts: i32,
    pub retry_delay_ms: i32,
    pub fault: FaultInjection,
}

/// The outcome of one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickOutcome {
    /// A batch was read, published and finished. `published` reached Redis; `rejected` were
    /// refused by Redis because of the event itself and are on the failure path, backing off, of
    /// which `dead_lettered` reached `max_attempts` and are now failed. `more`: more is waiting
    /// (the failure path had a full batch due, or a shard read only up to a recorded snapshot).
    /// `catching_up`: a shard was more than a second behind and read up to a recorded snapshot.
    Worked {
        claimed: usize,
        published: usize,
        rejected: usize,
        dead_lettered: i64,
        last_rejection: Option<String>,
        more: bool,
        catching_up: bool,
    },
    /// Nothing was waiting.
    Idle,
    /// A lagging shard's window up to its next recorded snapshot was empty: its cursor stepped
    /// over it without sending anything (so this says nothing about Redis); the next round follows
    /// at once.
    SteppedOver,
    /// The extension is not installed in the relay's database (yet, or any more).
    ExtensionMissing,
    /// The database has another version of the extension than this library (a new library was
    /// installed and the server restarted, and `ALTER EXTENSION outbox_pg UPDATE` has not run yet).
    ExtensionOutdated { installed: String },
    /// Redis failed as a whole; nothing was finished, so the same batch is read again after the
    /// backoff. Some entries may have been published before the failure was noticed.
    BrokerDown { error: BrokerError, published: usize },
    /// The database refused a statement (e.g. during DROP EXTENSION); nothing was lost.
    DatabaseError(String),
}

const CLAIM: &str = "SELECT shard, cursor, cursor_age_ms, upto, held, bounded FROM outbox._claim_shards($1, $2, $3)";
const HELD_DUE: &str =
    "SELECT id, event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, payload, headers, \
                        stream, created_at FROM outbox._held_due($1, $2, $3)";
const HELD_AGGREGATES: &str = "SELECT outbox._held_aggregates($1, $2, $3)";
const HOLD: &str = "SELECT outbox._hold($1::uuid[], $2, $3, $4, $5)";
const SETTLE_HELD: &str = "SELECT outbox._settle_held($1, $2, $3, $4, $5)";
const ADVANCE: &str = "SELECT outbox._advance($1, $2, $3, $4, $5, $6, $7)";
const REAP: &str = "SELECT outbox._reap_shards($1)";
const RECORD_SNAPSHOT: &str = "SELECT outbox._record_snapshot($1)";
const RETENTION: &str = "SELECT outbox._retention($1 * interval '1 second')";
const OLDEST_PENDING_AGE_MS: &str = "SELECT (extract(epoch FROM outbox.oldest_pending_age()) * 1000)::float8";

/// The argument types of CLAIM (HELD takes its first: the relay's pid) and ADVANCE.
const CLAIM_TYPES: [PgOid; 3] = [PgOid::BuiltIn(PgBuiltInOids::INT4OID); 3];
const ADVANCE_TYPES: [PgOid; 7] = [
    PgOid::BuiltIn(PgBuiltInOids::INT4OID),
    PgOid::BuiltIn(PgBuiltInOids::INT2ARRAYOID),
    PgOid::BuiltIn(PgBuiltInOids::TEXTARRAYOID),
    PgOid::BuiltIn(PgBuiltInOids::TEXTARRAYOID),
    PgOid::BuiltIn(PgBuiltInOids::TEXTARRAYOID),
    PgOid::BuiltIn(PgBuiltInOids::INT8ARRAYOID),
    PgOid::BuiltIn(PgBuiltInOids::BOOLARRAYOID),
];

type KeptPlan = RefCell<Option<Rc<OwnedPreparedStatement>>>;

thread_local! {
    /// CLAIM and ADVANCE, prepared once per session and kept (`SPI_keepplan`): parsing, analysing
    /// and planning them again each round was about a tenth of a round's time when rounds carry an
    /// event or two. A kept plan is checked and, if what it uses changed (DROP and CREATE
    /// EXTENSION), parsed again by PostgreSQL's plan cache, so it never goes stale.
    static CLAIM_PLAN: KeptPlan = const { RefCell::new(None) };
    static ADVANCE_PLAN: KeptPlan = const { RefCell::new(None) };
    static HELD_PLAN: KeptPlan = const { RefCell::new(None) };
    /// The last full claim's outcome, while a round may go without one (`kept_claim`).
    static KEPT_CLAIM: RefCell<Option<KeptClaim>> = const { RefCell::new(None) };
}

/// What a round on a kept claim reads instead of claiming: the shards this relay holds, their
/// cursors, and the snapshot of now, taken after the commit flags (the statement's own snapshot),
/// like the claim's.
const HELD: &str = "SELECT s.shard, s.cursor::text, pg_catalog.pg_current_snapshot()::text \
                      FROM outbox.shards s WHERE s.claimed_by = $1 ORDER BY s.shard";

/// A full claim that the rounds after it may keep: when, for which installation and share, and
/// the shards it gave this relay.
struct KeptClaim {
    taken: Instant,
    installation: pg_sys::Oid,
    share: usize,
    shards: Vec<i16>,
}

/// How long a round may go on a kept claim: the claim statement (its count, its lease renewal, its
/// recorded-snapshot and failure-path probes) was most of a small round's CPU, and under a steady
/// stream of commits most rounds change nothing. At most a tenth of the lease, so that the lease,
/// renewed by the claim after a third of it, never comes near expiring.
fn claim_kept_for(lease: Duration) -> Duration {
    (lease / 10).min(Duration::from_millis(100))
}

/// Whether this round may keep the last full claim instead of claiming: not on a full read (which
/// also moves idle cursors and probes everything), with the same installation and share, and
/// within `claim_kept_for`. Only a claim that found nothing on the failure path and no lagging
/// shard is kept (`keep_claim`), and a finish that fails or holds events forgets it. The round
/// still reads its shards' rows (`HELD`) and goes on only if they are exactly the kept ones: a
/// shard taken over, freed by the reaper or rebased by a restore sends it back to the claim.
fn kept_claim(installation: pg_sys::Oid, settings: &TickSettings) -> Option<Vec<i16>> {
    if settings.full_read {
        return None;
    }
    KEPT_CLAIM.with(|kept| {
        kept.borrow()
            .as_ref()
            .filter(|k| {
                k.installation == installation
                    && k.share == settings.share
                    && k.taken.elapsed() < claim_kept_for(settings.lease)
            })
            .map(|k| k.shards.clone())
    })
}

/// Keeps a full claim's outcome for the rounds that follow, when they may use it.
fn keep_claim(
    installation: pg_sys::Oid,
    settings: &TickSettings,
    claimed: &[(i16, String, i64, String, bool)],
    held_any: bool,
) {
    let keepable = !held_any && !claimed.is_empty() && claimed.iter().all(|(.., bounded)| !bounded);
    let kept = keepable.then(|| KeptClaim {
        taken: Instant::now(),
        installation,
        share: settings.share,
        shards: claimed.iter().map(|(shard, ..)| *shard).collect(),
    });
    KEPT_CLAIM.with(|slot| *slot.borrow_mut() = kept);
}

/// The next round claims again.
fn forget_kept_claim() {
    KEPT_CLAIM.with(|slot| *slot.borrow_mut() = None);
}

/// The kept plan in `slot`, prepared from `query` the first time.
fn kept_plan(
    client: &pgrx::spi::SpiClient<'_>,
    slot: &'static std::thread::LocalKey<KeptPlan>,
    query: &str,
    types: &[PgOid],
) -> Result<Rc<OwnedPreparedStatement>, pgrx::spi::Error> {
    slot.with(|cell| {
        if let Some(plan) = cell.borrow().as_ref() {
            return Ok(plan.clone());
        }
        let plan = Rc::new(client.prepare_mut(query, types)?.keep());
        *cell.borrow_mut() = Some(plan.clone());
        Ok(plan)
    })
}

/// An idle shard's cursor is moved on this often, so that retention can see it has consumed a
/// closed table; a shard with events moves at every batch.
const IDLE_CURSOR_MOVE: Duration = Duration::from_secs(10);

/// What the relay's periodic housekeeping found.
#[derive(Debug, Clone, PartialEq)]
pub struct Housekeeping {
    /// Shards returned by the reaper (their relay exited, or its lease expired).
    pub reaped: i64,
    /// Age of the oldest undelivered event, if any.
    pub oldest_pending_age: Option<Duration>,
}

/// Frees the shards of relays that exited or hang, measures the oldest pending event, and keeps the
/// recorded snapshots that bound a lagging shard's windows, in one short transaction. `Ok(None)` when the extension is not installed at this library's version.
pub fn housekeeping(lease_ms: i32) -> Result<Option<Housekeeping>, String> {
    txn::run(move || -> Result<Option<Housekeeping>, pgrx::spi::Error> {
        if !matches!(readiness()?, Readiness::Ready(_)) {
            return Ok(None);
        }
        let reaped = Spi::get_one_with_args::<i64>(REAP, &[lease_ms.into()])?.unwrap_or(0);
        let oldest_pending_age =
            Spi::get_one::<f64>(OLDEST_PENDING_AGE_MS)?.map(|ms| Duration::from_secs_f64(ms.max(0.0) / 1000.0));
        // While anything waits, the snapshots that bound a lagging shard's windows.
        Spi::run_with_args(RECORD_SNAPSHOT, &[oldest_pending_age.is_some().into()])?;
        Ok(Some(Housekeeping { reaped, oldest_pending_age }))
    })
}

/// One retention step (outbox._retention); returns how many events and rows it removed.
pub fn retention(retention_s: i32) -> Result<i64, String> {
    txn::run(move || Spi::get_one_with_args::<i64>(RETENTION, &[retention_s.into()])).map(|n| n.unwrap_or(0))
}

/// The OID of the installed extension: which installation's log a batch was read from. A finish
/// checks it is unchanged, because after `DROP EXTENSION` and `CREATE EXTENSION` the cursors and
/// counters it would write belong to another log.
fn installation() -> pg_sys::Oid {
    // SAFETY: a catalog lookup inside a transaction; missing_ok, so it returns InvalidOid rather
    // than raising.
    unsafe { pg_sys::get_extension_oid(c"outbox_pg".as_ptr(), true) }
}

/// Whether the relay may run its statements in this database.
#[derive(Debug, Clone, PartialEq)]
enum Readiness {
    Missing,
    /// Installed at another version: its functions may not be the ones this library calls.
    Outdated(String),
    Ready(pg_sys::Oid),
}

/// The library's version: the extension version it was built with and whose statements it calls.
pub const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");

thread_local! {
    /// The installation last found at LIBRARY_VERSION, and when: the version is read again at most
    /// once a second (an ALTER EXTENSION UPDATE keeps the OID), not every round.
    static VERSION_CHECKED: std::cell::Cell<Option<(pg_sys::Oid, Instant)>> = const { std::cell::Cell::new(None) };
}

/// Checks that the extension is installed, at the version of this library. After a new library is
/// installed and the server restarted, the database keeps the old extension version until `ALTER
/// EXTENSION outbox_pg UPDATE`; until then the relay calls nothing (events wait, none is lost).
fn readiness() -> Result<Readiness, pgrx::spi::Error> {
    let oid = installation();
    if oid == pg_sys::InvalidOid {
        return Ok(Readiness::Missing);
    }
    if let Some((checked, at)) = VERSION_CHECKED.get() {
        if checked == oid && at.elapsed() < Duration::from_secs(1) {
            return Ok(Readiness::Ready(oid));
        }
    }
    let version = Spi::get_one_with_args::<String>(
        "SELECT extversion::text FROM pg_catalog.pg_extension WHERE oid = $1",
        &[oid.into()],
    )?
    .unwrap_or_default();
    if version != LIBRARY_VERSION {
        VERSION_CHECKED.set(None);
        return Ok(Readiness::Outdated(version));
    }
    VERSION_CHECKED.set(Some((oid, Instant::now())));
    Ok(Readiness::Ready(oid))
}

/// One shard's part of a round.
#[derive(Debug, Clone)]
struct ShardBatch {
    shard: i16,
    /// The cursor to store when the batch is finished.
    next_cursor: String,
    /// Whether the cursor is stored at all: a shard with no events moves only now and then.
    advance: bool,
}

/// What a round read.
#[derive(Debug, Default)]
struct Batch {
    installation: pg_sys::Oid,
    shards: Vec<ShardBatch>,
    /// From the log, oldest first (id order), each with its `aggregate_seq` assigned.
    events: Vec<OutboxEvent>,
    /// Their aggregates' counters after the batch: (type, id, last_seq, whether the read found
    /// the counter: the finish upserts those and plain-INSERTs the others).
    counters: Vec<(String, String, i64, bool)>,
    /// Of `events`, the ids of those whose aggregate has events on the failure path: they go there
    /// too, behind them, without being sent.
    diverted: Set<i64>,
    /// From the failure path, due now (aggregate_seq stored with them).
    held_due: Vec<OutboxEvent>,
    /// More is due than this round takes (the failure path's batch was full, or a lagging shard
    /// read up to a recorded snapshot): go again at once.
    more: bool,
    /// A shard read up to a recorded snapshot (it is more than a second behind).
    catching_up: bool,
}

/// An event of the failure path: (id, event_id, aggregate_type, aggregate_id, aggregate_seq,
/// event_type, payload, headers, stream, created_at), as outbox._held_due returns it.
fn held_event(row: &pgrx::spi::SpiHeapTupleData) -> Result<OutboxEvent, pgrx::spi::Error> {
    Ok(OutboxEvent {
        id: row.get::<i64>(1)?.unwrap_or_default(),
        event_id: row.get::<String>(2)?.unwrap_or_default(),
        aggregate_type: row.get::<String>(3)?.unwrap_or_default(),
        aggregate_id: row.get::<String>(4)?.unwrap_or_default(),
        aggregate_seq: row.get::<i64>(5)?.unwrap_or_default(),
        event_type: row.get::<String>(6)?.unwrap_or_default(),
        payload: row.get::<String>(7)?.unwrap_or_default(),
        headers: row.get::<String>(8)?,
        stream: row.get::<String>(9)?,
        created_at: row.get::<String>(10)?.unwrap_or_default(),
    })
}

thread_local! {
    /// The shards this relay held at its last round (one bit each).
    static HELD_SHARDS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Which shards a round reads outside a full read, and which commit flags it gives back, from the
/// shards held last round (`held_before`), their flags taken before the claim (`flagged_before`)
/// and the shards held now (`mine`): the flagged ones still held, and every shard newly taken
/// (its flags may have been taken by its previous holder); the flags of shards given up go back
/// for their new holder.
fn shards_to_read(held_before: u32, flagged_before: u32, mine: u32) -> (u32, u32) {
    ((flagged_before & mine) | (mine & !held_before), flagged_before & !mine)
}

/// Claims this relay's shards and reads a round: each shard's whole window (every event committed
/// between its cursor and the claim's snapshot, or, for a shard more than a second behind, the
/// next recorded snapshot; see "Why a window is read whole" and "Catching up" in
/// docs/worker.md), the failure path's due events, and what the batch's
/// aggregates need (counters, whether they have events waiting on the failure path). Writes only
/// when shards change hands. `Err(readiness)` when the extension is missing or at another version.
fn read_round(settings: &TickSettings) -> Result<Result<Batch, Readiness>, String> {
    let settings = settings.clone();
    txn::run(move || -> Result<Result<Batch, Readiness>, pgrx::spi::Error> {
        let installation = match readiness()? {
            Readiness::Ready(oid) => oid,
            other => return Ok(Err(other)),
        };
        Spi::connect_mut(|client| {
            let mut batch = Batch { installation, ..Batch::default() };
            let lease_ms = settings.lease.as_millis().min(i32::MAX as u128) as i32;
            let mut held_any = false;
            // The commit flags of the shards held last round, taken before the claim's snapshot:
            // a commit that flagged one of them was visible before it, so its events are in this
            // round's window. (Taken after, a commit between the two was flagged, taken, and not
            // yet in the window: its events then waited for the next full read.)
            let held_before = HELD_SHARDS.get();
            let flagged_before = shmem::take_committed_shards(held_before);
            // (shard, cursor, cursor age, what it reads up to, whether that is a recorded snapshot)
            let mut claimed: Vec<(i16, String, i64, String, bool)> = Vec::new();
            if let Some(kept) = kept_claim(installation, &settings) {
                // Nothing changes hands and the lease is fresh: only the cursors and "now" are
                // read, and only if the shards are still exactly the kept ones.
                for row in client.select(
                    &*kept_plan(client, &HELD_PLAN, HELD, &CLAIM_TYPES[..1])?,
                    None,
                    &[settings.pid.into()],
                )? {
                    claimed.push((
                        row.get::<i16>(1)?.unwrap_or_default(),
                        row.get::<String>(2)?.unwrap_or_default(),
                        0,
                        row.get::<String>(3)?.unwrap_or_default(),
                        false,
                    ));
                }
                if !claimed.iter().map(|(shard, ..)| *shard).eq(kept.iter().copied()) {
                    forget_kept_claim();
                    claimed.clear();
                }
            }
            if claimed.is_empty() {
                for row in client.update(
                    &*kept_plan(client, &CLAIM_PLAN, CLAIM, &CLAIM_TYPES)?,
                    None,
                    &[settings.pid.into(), (settings.share as i32).into(), lease_ms.into()],
                )? {
                    claimed.push((
                        row.get::<i16>(1)?.unwrap_or_default(),
                        row.get::<String>(2)?.unwrap_or_default(),
                        row.get::<i64>(3)?.unwrap_or_default(),
                        // Now (taken after the claim: the reads below see every transaction it
                        // shows as committed), or a recorded snapshot for a lagging shard: then
                        // more follows at once.
                        row.get::<String>(4)?.unwrap_or_default(),
                        row.get::<bool>(6)?.unwrap_or(false),
                    ));
                    held_any = row.get::<bool>(5)?.unwrap_or(true);
                }
                keep_claim(installation, &settings, &claimed, held_any);
            }
            // Outside a full read, only the shards that commits flagged since the last round, and
            // those this relay did not hold then.
            let mine: u32 = claimed.iter().fold(0, |mask, (shard, ..)| mask | 1u32 << (*shard as u32 % 32));
            let (flagged, given_back) = shards_to_read(held_before, flagged_before, mine);
            if given_back != 0 {
                shmem::mark_shards_committed(given_back);
                shmem::wake_relays();
            }
            HELD_SHARDS.set(mine);
            if claimed.is_empty() {
                return Ok(Ok(batch));
            }
            let full = settings.full_read;
            let shards: Vec<i16> = claimed.iter().map(|(shard, ..)| *shard).collect();
            claimed.retain(|(shard, ..)| full || flagged & (1u32 << (*shard as u32 % 32)) != 0);
            let limit = settings.batch_size.min(i32::MAX as usize) as i32;
            batch.catching_up = claimed.iter().any(|(.., bounded)| *bounded);
            batch.more |= batch.catching_up;
            // Every shard's window, whole: a cut inside a window would break commit order.
            let mut log = Vec::new();
            for (shard, cursor, age_ms, upto, bounded) in &claimed {
                let parse = |text: &str| {
                    Snapshot::parse(text).unwrap_or_else(|| {
                        error!("outbox_pg: shard {shard}'s cursor or snapshot {text:?} is not a pg_snapshot")
                    })
                };
                let events = read_window(*shard, &parse(cursor), &parse(upto), usize::MAX);
                // A lagging shard steps to its recorded snapshot even when that window is empty:
                // its next window then starts from there.
                let advance = !events.is_empty()
                    || *bounded
                    || (full && Duration::from_millis(*age_ms as u64) >= IDLE_CURSOR_MOVE);
                batch.shards.push(ShardBatch { shard: *shard, next_cursor: upto.clone(), advance });
                log.extend(events.into_iter().map(|row| row.event));
            }
            if held_any {
                let held =
                    client.update(HELD_DUE, None, &[shards.clone().into(), limit.into(), settings.in_order.into()])?;
                for row in held {
                    batch.held_due.push(held_event(&row)?);
                }
            }
            batch.more |= batch.held_due.len() >= settings.batch_size;
            // Each aggregate's events in id order, which is its commit order (src/order.rs).
            log.sort_unstable_by_key(|event| event.id);
            let aggregates = distinct_aggregates(&log);
            if !aggregates.is_empty() {
                let found = counters::last_seqs(aggregates.iter().map(|(t, i)| (t.as_str(), i.as_str())));
                let counted: Vec<bool> = found.iter().map(Option::is_some).collect();
                let mut last_seq: Vec<i64> = found.into_iter().map(|seq| seq.unwrap_or(0)).collect();
                let mut waiting = Set::default();
                if settings.in_order && held_any {
                    let types: Vec<String> = aggregates.iter().map(|(t, _)| t.clone()).collect();
                    let ids: Vec<String> = aggregates.iter().map(|(_, i)| i.clone()).collect();
                    for row in client.update(HELD_AGGREGATES, None, &[types.into(), ids.into(), shards.into()])? {
                        waiting.insert(row.get::<i64>(1)?.unwrap_or_default() as usize - 1);
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
            batch.events = log;
            Ok(Ok(batch))
        })
    })
}

/// The distinct aggregates of `events`, in order of first appearance.
fn distinct_aggregates(events: &[OutboxEvent]) -> Vec<(String, String)> {
    let mut seen = Set::default();
    events
        .iter()
        .filter(|e| seen.insert((e.aggregate_type.as_str(), e.aggregate_id.as_str())))
        .map(|e| (e.aggregate_type.clone(), e.aggregate_id.clone()))
        .collect()
}

/// How a round is finished.
#[derive(Default)]
struct Settlement {
    /// Log events that go to the failure path: (event_id, aggregate_seq, the rejection if Redis
    /// rejected this one; None for events waiting behind one).
    hold: Vec<(String, i64, Option<String>)>,
    /// Failure-path events Redis accepted.
    held_published: Vec<i64>,
    /// Failure-path events Redis rejected again, with the error.
    held_rejected: Vec<(i64, String)>,
}

/// What a finish wrote.
#[derive(Debug, Clone, Copy, Default)]
struct Finished {
    dead_lettered: i64,
}

/// Writes the round's outcome in one transaction, if the log still belongs to the installation
/// the batch was read from.
fn finish(settlement: Settlement, batch: &Batch, settings: &TickSettings) -> Result<Finished, String> {
    let (max_attempts, retry_delay_ms, pid) = (settings.max_attempts, settings.retry_delay_ms, settings.pid);
    let advancing: Vec<&ShardBatch> = batch.shards.iter().filter(|s| s.advance).collect();
    let shards: Vec<i16> = advancing.iter().map(|s| s.shard).collect();
    let cursors: Vec<String> = advancing.iter().map(|s| s.next_cursor.clone()).collect();
    let counter_types: Vec<String> = batch.counters.iter().map(|(t, ..)| t.clone()).collect();
    let counter_ids: Vec<String> = batch.counters.iter().map(|(_, i, ..)| i.clone()).collect();
    let counter_seqs: Vec<i64> = batch.counters.iter().map(|(_, _, s, _)| *s).collect();
    let counted: Vec<bool> = batch.counters.iter().map(|(.., c)| *c).collect();
    let read_from = batch.installation;
    let holds = !settlement.hold.is_empty() || !settlement.held_rejected.is_empty();
    let finished = txn::run(move || -> Result<Finished, String> {
        let mut finished = Finished::default();
        let spi = |e: pgrx::spi::Error| e.to_string();
        if !settlement.hold.is_empty() {
            let event_ids: Vec<String> = settlement.hold.iter().map(|(e, ..)| e.clone()).collect();
            let seqs: Vec<i64> = settlement.hold.iter().map(|(_, s, _)| *s).collect();
            let errors: Vec<Option<String>> = settlement.hold.iter().map(|(.., e)| e.clone()).collect();
            finished.dead_lettered += Spi::get_one_with_args::<i64>(
                HOLD,
                &[event_ids.into(), seqs.into(), errors.into(), max_attempts.into(), retry_delay_ms.into()],
            )
            .map_err(spi)?
            .unwrap_or(0);
        }
        if !settlement.held_published.is_empty() || !settlement.held_rejected.is_empty() {
            let rejected: Vec<i64> = settlement.held_rejected.iter().map(|(id, _)| *id).collect();
            let errors: Vec<String> = settlement.held_rejected.iter().map(|(_, e)| e.clone()).collect();
            finished.dead_lettered += Spi::get_one_with_args::<i64>(
                SETTLE_HELD,
                &[
                    settlement.held_published.into(),
                    rejected.into(),
                    errors.into(),
                    max_attempts.into(),
                    retry_delay_ms.into(),
                ],
            )
            .map_err(spi)?
            .unwrap_or(0);
        }
        if !shards.is_empty() || !counter_types.is_empty() {
            Spi::connect_mut(|client| {
                let advance = kept_plan(client, &ADVANCE_PLAN, ADVANCE, &ADVANCE_TYPES)?;
                client.update(
                    &*advance,
                    None,
                    &[
                        pid.into(),
                        shards.into(),
                        cursors.into(),
                        counter_types.into(),
                        counter_ids.into(),
                        counter_seqs.into(),
                        counted.into(),
                    ],
                )?;
                Ok::<_, pgrx::spi::Error>(())
            })
            .map_err(spi)?;
        }
        // Checked after the writes, in their transaction: the rows they touched stay locked until
        // it ends, so a DROP EXTENSION cannot slip in between this check and the commit.
        if installation() != read_from {
            return Err("outbox_pg was dropped and created again while this batch was being published; \
                        nothing was finished"
                .to_string());
        }
        Ok(finished)
    });
    if finished.is_err() || holds {
        forget_kept_claim();
    }
    finished
}

/// How long each phase of a round took, for `outbox.log_min_duration`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RoundTimings {
    pub claim: Duration,
    pub publish: Duration,
    pub settle: Duration,
    /// How many shards the relay held this round (None: the round did not get that far).
    pub shards_held: Option<usize>,
}

impl RoundTimings {
    pub fn total(&self) -> Duration {
        self.claim + self.publish + self.settle
    }
}

/// Clears what the relay has in flight when the round ends, whichever way.
struct InFlight(usize);

impl Drop for InFlight {
    fn drop(&mut self) {
        claims::clear(self.0);
    }
}

/// Where an event of the publish list came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Log,
    Held,
}

/// One round: read, publish, finish. `timings` receives the time of each phase that ran.
pub fn tick(sink: &mut RedisSink, settings: &TickSettings, timings: &mut RoundTimings) -> TickOutcome {
    let started = Instant::now();
    let read = read_round(settings);
    timings.claim = started.elapsed();
    let mut batch = match read {
        Err(error) => return TickOutcome::DatabaseError(error),
        Ok(Err(Readiness::Outdated(installed))) => return TickOutcome::ExtensionOutdated { installed },
        Ok(Err(_)) => return TickOutcome::ExtensionMissing,
        Ok(Ok(batch)) => batch,
    };
    timings.shards_held = Some(batch.shards.len());
    let claimed = batch.events.len() + batch.held_due.len();
    if claimed == 0 {
        // Idle shards' cursors still move now and then (retention needs them past closed tables).
        if batch.shards.iter().any(|s| s.advance) {
            if let Err(error) = finish(Settlement::default(), &batch, settings) {
                return TickOutcome::DatabaseError(error);
            }
        }
        if batch.catching_up {
            return TickOutcome::SteppedOver;
        }
        return TickOutcome::Idle;
    }
    claims::begin(settings.slot, claimed);
    let _in_flight = InFlight(settings.slot);

    // The failure path's due events first (they are older), then the log's, except those whose
    // aggregate waits on the failure path.
    // The events are moved, not copied, into the publish list (the relay's CPU per event is
    // mostly allocation and copying: docs/performance.md).
    let mut settlement = Settlement::default();
    let mut sources: Vec<Source> = Vec::with_capacity(claimed);
    let mut events: Vec<OutboxEvent> = Vec::with_capacity(claimed);
    for event in std::mem::take(&mut batch.held_due) {
        sources.push(Source::Held);
        events.push(event);
    }
    for event in std::mem::take(&mut batch.events) {
        if batch.diverted.contains(&event.id) {
            settlement.hold.push((event.event_id, event.aggregate_seq, None));
        } else {
            sources.push(Source::Log);
            events.push(event);
        }
    }
    if settings.in_order {
        let deferred = deferred_by_stream_change(&events, &settings.stream_template);
        if !deferred.is_empty() {
            let mut kept_sources = Vec::with_capacity(sources.len());
            let mut kept = Vec::with_capacity(events.len());
            for (source, event) in sources.into_iter().zip(events) {
                if !deferred.contains(&event.id) {
                    kept_sources.push(source);
                    kept.push(event);
                } else if source == Source::Log {
                    settlement.hold.push((event.event_id, event.aggregate_seq, None));
                }
            }
            (sources, events) = (kept_sources, kept);
        }
    }

    // Published as one MULTI/EXEC (split only above 64 MB), finished once. An aggregate that failed
    // in one pipeline sends nothing more this round: its later events wait on the failure path
    // behind the failed one, so Redis never sees them out of order.
    let mut published = 0;
    let mut rejected = 0;
    let mut last_rejection = None;
    let mut broken: Set<(String, String)> = Set::default();
    // One MULTI/EXEC per round (up to 64 MB): Redis applies it whole or not at all, so a refusal
    // such as OOM leaves nothing half-published to be sent twice.
    let limits = PipelineLimits { entries: usize::MAX, bytes: PIPELINE_BYTES };
    let mut pending = sources.into_iter().zip(events).peekable();
    let started = Instant::now();
    loop {
        let waits = |source: &Source, event: &OutboxEvent| {
            settings.in_order
                && *source == Source::Log
                && !broken.is_empty()
                && broken.contains(&(event.aggregate_type.clone(), event.aggregate_id.clone()))
        };
        let (chunk_sources, chunk, waiting) = next_pipeline(&mut pending, limits, waits);
        for event in waiting {
            settlement.hold.push((event.event_id, event.aggregate_seq, None));
        }
        if chunk.is_empty() {
            break;
        }
        let outcomes = match sink.publish(&chunk, &settings.stream_template, settings.stream_maxlen) {
            Ok(outcomes) => outcomes,
            Err(error) => {
                timings.publish = started.elapsed();
                return TickOutcome::BrokerDown { error, published };
            }
        };
        for ((source, event), outcome) in chunk_sources.iter().zip(&chunk).zip(&outcomes) {
            if let EntryOutcome::BrokerRefused(error) = outcome {
                // Redis as a whole refused part of the batch: finish nothing, read it all again later.
                timings.publish = started.elapsed();
                return TickOutcome::BrokerDown { error: BrokerError(error.clone()), published };
            }
            let aggregate = || (event.aggregate_type.clone(), event.aggregate_id.clone());
            match (source, outcome) {
                (Source::Held, EntryOutcome::Published) => {
                    published += 1;
                    settlement.held_published.push(event.id);
                }
                (Source::Held, EntryOutcome::Rejected(error)) => {
                    rejected += 1;
                    last_rejection = Some(error.clone());
                    settlement.held_rejected.push((event.id, error.clone()));
                }
                (Source::Held, _) => {}
                (Source::Log, EntryOutcome::Published)
                    if !(settings.in_order && !broken.is_empty() && broken.contains(&aggregate())) =>
                {
                    published += 1;
                }
                (Source::Log, EntryOutcome::Rejected(error)) => {
                    rejected += 1;
                    last_rejection = Some(error.clone());
                    settlement.hold.push((event.event_id.clone(), event.aggregate_seq, Some(error.clone())));
                    broken.insert(aggregate());
                }
                // Not sent, or (in order) published after an earlier event of its aggregate failed
                // in this same chunk (an oversize entry is rejected alone): it waits on the
                // failure path, behind the failed one.
                (Source::Log, _) => {
                    settlement.hold.push((event.event_id.clone(), event.aggregate_seq, None));
                    broken.insert(aggregate());
                }
            }
        }
    }
    timings.publish = started.elapsed();

    if settings.fault == FaultInjection::CrashAfterPublish && published > 0 {
        crash_after_publish(published);
    }

    // If finishing fails nothing is finished: the batch is read and published again (duplicates,
    // never a loss).
    let started = Instant::now();
    let finished = finish(settlement, &batch, settings);
    timings.settle = started.elapsed();
    let dead_lettered = match finished {
        Ok(finished) => {
            shmem::add_published(published as i64);
            finished.dead_lettered
        }
        Err(error) => return TickOutcome::DatabaseError(error),
    };
    TickOutcome::Worked {
        claimed,
        published,
        rejected,
        dead_lettered,
        last_rejection,
        more: batch.more,
        catching_up: batch.catching_up,
    }
}

/// The most bytes of events one pipeline sends. Redis closes the connection of a client whose
/// unread input passes `client-query-buffer-limit` (1 GB by default); a pipeline above it would fail
/// as a whole, round after round, and stall the outbox. 64 MB keeps well below it and still
/// carries thousands of ordinary events.
const PIPELINE_BYTES: usize = 64 * 1024 * 1024;

/// How much one MULTI/EXEC pipeline carries.
#[derive(Debug, Clone, Copy)]
struct PipelineLimits {
    entries: usize,
    bytes: usize,
}

/// Takes the next pipeline from `pending` (in order): up to `limits.entries` events and
/// `limits.bytes` bytes (at least one event, so one larger than the budget still goes, alone).
/// Events for which `waits` holds are taken out without being sent and returned last. Returns the
/// pipeline's sources, its events, and the waiting events.
fn next_pipeline(
    pending: &mut std::iter::Peekable<impl Iterator<Item = (Source, OutboxEvent)>>,
    limits: PipelineLimits,
    waits: impl Fn(&Source, &OutboxEvent) -> bool,
) -> (Vec<Source>, Vec<OutboxEvent>, Vec<OutboxEvent>) {
    let mut sources = Vec::with_capacity(limits.entries.min(1024));
    let mut events: Vec<OutboxEvent> = Vec::with_capacity(limits.entries.min(1024));
    let mut waiting = Vec::new();
    let mut bytes = 0usize;
    while events.len() < limits.entries {
        let Some((source, event)) = pending.peek() else { break };
        let held_back = waits(source, event);
        let size = event.approximate_size();
        if !held_back && !events.is_empty() && bytes.saturating_add(size) > limits.bytes {
            break;
        }
        let Some((source, event)) = pending.next() else { break };
        if held_back {
            waiting.push(event);
            continue;
        }
        bytes = bytes.saturating_add(size);
        sources.push(source);
        events.push(event);
    }
    (sources, events, waiting)
}

/// In per-aggregate order, a round may carry several consecutive events of one aggregate. Redis
/// rejects an entry because of its stream key (e.g. WRONGTYPE), so events to the same key share
/// their fate: if the first is rejected, so are the later ones, and order holds. An event bound for
/// a *different* key than its aggregate's earlier events in the round could succeed where they
/// fail, so it and every later event of its aggregate wait: their ids are returned. `events` are in
/// per-aggregate order.
pub fn deferred_by_stream_change(events: &[OutboxEvent], stream_template: &str) -> Set<i64> {
    let mut run_key: Map<(&str, &str), Option<String>> = Map::default();
    let mut deferred = Set::default();
    for event in events {
        let key = event.stream_key(stream_template);
        let slot = run_key
            .entry((event.aggregate_type.as_str(), event.aggregate_id.as_str()))
            .or_insert_with(|| Some(key.clone()));
        if slot.as_deref() != Some(key.as_str()) {
            // Once a run is cut, every later event of the aggregate waits too.
            *slot = None;
            deferred.insert(event.id);
        }
    }
    deferred
}

/// `outbox.fault_injection = crash_after_publish`: exit between a successful XADD and the finish, as
/// a crash would, once per arming (setting it to `none` re-arms it). The launcher starts a new
/// relay, which reads the same batch and publishes it again.
fn crash_after_publish(published: usize) {
    if shmem::fault_fired() {
        return;
    }
    shmem::set_fault_fired(true);
    log!("outbox_pg: outbox.fault_injection = crash_after_publish: exiting after publishing {published} events, before finishing the batch");
    // SAFETY: ends the process the way PostgreSQL expects; no transaction is open.
    unsafe { pg_sys::proc_exit(1) };
}

#[cfg(test)]
mod tests {
    use super::{
        claim_kept_for, deferred_by_stream_change, distinct_aggregates, next_pipeline, shards_to_read, PipelineLimits,
        Source,
    };
    use crate::entry::OutboxEvent;
    use std::time::Duration;

    fn event(id: i64, aggregate_id: &str, stream: Option<&str>) -> OutboxEvent {
        OutboxEvent {
            id,
            event_id: format!("e{id}"),
            aggregate_type: "acct".into(),
            aggregate_id: aggregate_id.into(),
            aggregate_seq: id,
            event_type: "t".into(),
            payload: "{}".into(),
            headers: None,
            stream: stream.map(str::to_string),
            created_at: String::new(),
        }
    }

    #[test]
    fn a_run_is_cut_where_its_stream_key_changes() {
        let events = vec![
            event(1, "a", None),
            event(2, "b", Some("other")),
            event(3, "a", None),
            event(4, "a", Some("elsewhere")),
            event(5, "a", None),
            event(6, "b", Some("other")),
        ];
        let deferred = deferred_by_stream_change(&events, "outbox:{aggregate_type}");
        let mut deferred: Vec<i64> = deferred.into_iter().collect();
        deferred.sort_unstable();
        // Event 5 goes to the run's key again, but after a cut its aggregate waits.
        assert_eq!(deferred, [4, 5]);
    }

    #[test]
    fn a_round_reads_the_flagged_shards_it_kept_and_every_shard_it_took() {
        // Held 0-3, of which 0 and 1 were flagged (only held shards' flags are taken). Now 2-5.
        let held_before = 0b0000_1111;
        let flagged_before = 0b0000_0011;
        let mine = 0b0011_1100;
        let (read, given_back) = shards_to_read(held_before, flagged_before, mine);
        // Kept and flagged: none (1 was given up); newly taken: 4 and 5.
        assert_eq!(read, 0b0011_0000);
        // Shards 0 and 1 were given up: their flags (0 and 1) go back for their new holder.
        assert_eq!(given_back, 0b0000_0011);
        // Kept and flagged: read; kept and not flagged: not read.
        assert_eq!(shards_to_read(0b0110, 0b0100, 0b0110), (0b0100, 0));
    }

    #[test]
    fn a_claim_is_kept_for_a_tenth_of_the_lease_and_at_most_100_ms() {
        assert_eq!(claim_kept_for(Duration::from_secs(30)), Duration::from_millis(100));
        // A short lease (the tests' 300 ms): its renewal after a third of it is never skipped.
        assert_eq!(claim_kept_for(Duration::from_millis(300)), Duration::from_millis(30));
        assert_eq!(claim_kept_for(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn aggregates_are_listed_once_in_order_of_appearance() {
        let events = vec![event(1, "b", None), event(2, "a", None), event(3, "b", None)];
        assert_eq!(distinct_aggregates(&events), [("acct".to_string(), "b".to_string()), ("acct".into(), "a".into())]);
    }

    #[test]
    fn a_pipeline_stops_at_its_entry_and_byte_limits_and_sets_waiting_events_aside() {
        let mut big = event(2, "b", None);
        big.payload = "x".repeat(5000);
        let events = vec![event(1, "a", None), big, event(3, "c", None), event(4, "a", None), event(5, "d", None)];
        let mut pending = events.into_iter().map(|e| (Source::Log, e)).peekable();
        let ids = |events: &[OutboxEvent]| events.iter().map(|e| e.id).collect::<Vec<_>>();
        // 4000 bytes: the big event does not fit behind the first one.
        let limits = PipelineLimits { entries: 10, bytes: 4000 };
        let (_, first, waiting) = next_pipeline(&mut pending, limits, |_, _| false);
        assert_eq!((ids(&first), ids(&waiting)), (vec![1], vec![]));
        // Alone, it goes anyway.
        let (_, second, _) = next_pipeline(&mut pending, limits, |_, _| false);
        assert_eq!(ids(&second), [2]);
        // Events of a waiting aggregate are set aside; the entry limit counts sent events only.
        let limits = PipelineLimits { entries: 1, bytes: 4000 };
        let (_, third, waiting) = next_pipeline(&mut pending, limits, |_, e| e.aggregate_id == "c");
        assert_eq!((ids(&third), ids(&waiting)), (vec![4], vec![3]));
        let (_, fourth, _) = next_pipeline(&mut pending, limits, |_, _| false);
        assert_eq!(ids(&fourth), [5]);
        assert!(next_pipeline(&mut pending, limits, |_, _| false).1.is_empty());
    }
}
