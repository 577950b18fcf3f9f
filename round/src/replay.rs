//! A replay round: the relays send published events again when `outbox.replay` asks for it
//! (src/sql/replay.sql; docs/worker.md, "Replay"). A round claims a running replay (with a lease,
//! like a shard), walks the journal of published rounds from the replay's position, examines the
//! journaled events still retained without their payloads (stream, size, whether the selection
//! takes them), fetches the payloads of only those it sends, publishes them as one MULTI/EXEC with
//! their own `event_id`, `aggregate_seq` and `created_at` and a `replay` field, and records the new
//! position (past every entry it examined) once Redis has answered. Memory and the time a round
//! takes are bounded (`ROUND_EVENTS`, `ROUND_BYTES`, `ROUND_WALK`) whatever the range and the
//! payloads, so live rounds keep their latency: the relay runs a replay round only between live
//! ones. A Redis failure records nothing: the round goes again from the same position after the
//! backoff (its entries may be sent twice, which consumers deduplicating by `event_id` absorb).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, SystemTime};

use crate::db::{first, Database, DbError, Row, Value};
use outbox_sink::entry::{render_stream_template, OutboxEvent, TraceContext};
use outbox_sink::redis::{BrokerError, EntryOutcome, RedisSink};
use outbox_sink::streams;

use crate::hooks;
use crate::losses;
use crate::readiness::{readiness, Readiness};
use crate::state::RoundState;
use crate::tick_settings::TickSettings;

/// The most events one replay round sends.
pub const ROUND_EVENTS: usize = 1_000;
/// The most journal entries one replay round examines (most may be left out by the filters): they
/// are read without their payloads, and the replay's position moves past every one examined.
pub const ROUND_WALK: usize = 10_000;
/// About how many bytes of events one replay round sends (at least one event, however large).
pub const ROUND_BYTES: usize = 4 * 1024 * 1024;
/// The most journal rounds read at once (each cut to the entries the round still examines).
const ROUNDS_AT_ONCE: i32 = 8;
/// While live traffic flows, a replay round sends at most this many events and bytes, so that a
/// live event committed during it waits little (docs/worker.md, "Replay").
pub const LIVE_ROUND_EVENTS: usize = 100;
pub const LIVE_ROUND_BYTES: usize = 512 * 1024;

/// How much one replay round may send.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub events: usize,
    pub bytes: usize,
}

impl Limits {
    /// Nothing live to make wait: the full round.
    pub const IDLE: Limits = Limits { events: ROUND_EVENTS, bytes: ROUND_BYTES };
    /// Live traffic flows: a short round.
    pub const LIVE: Limits = Limits { events: LIVE_ROUND_EVENTS, bytes: LIVE_ROUND_BYTES };
}

/// The fewest journal entries examined at once (a round examines as many as it still has room for
/// events, at least this many).
const MIN_EXAMINED: usize = 256;

const CLAIM: &str = "SELECT id, since::text, next_round, next_index, last_round, until::text, streams, \
                     aggregate_types, event_ids IS NOT NULL, to_stream, max_rate, exact_streams \
                     FROM outbox._claim_replay($1, $2)";
const WALK: &str =
    "SELECT round, skip, event_ids::text[], seqs, events, passed_over FROM outbox._replay_walk($1, $2, $3, $4, $5, $6)";
const SELECT: &str = "SELECT event_id::text, aggregate_type, event_type, stream, size, matches \
                      FROM outbox._replay_select($1::uuid[], $2::timestamptz, $3::timestamptz, $4, $5)";
const EVENTS: &str = "SELECT event_id::text, id, aggregate_type, aggregate_id, event_type, payload, headers, stream, \
                      created_at, matches \
                      FROM outbox._replay_events($1::uuid[], $2::timestamptz, $3::timestamptz, $4, $5)";
/// Whether any replay runs (or waits for its throttle); housekeeping asks it too.
pub const REPLAYS_RUNNING: &str = "SELECT outbox._replays_running()";
/// The losses a finished replay was to repair and did not: it replayed nothing.
const UNREPAIRED: &str = "SELECT id, stream FROM outbox._unrepaired_losses($1)";
const PROGRESS: &str = "SELECT outbox._replay_progress($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12::timestamptz)";

/// What a replay round did.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayOutcome {
    /// No replay runs.
    Nothing,
    /// Replays run, but none may be taken now (its throttle, or another relay holds it).
    Waiting,
    /// A round of replay `id` ran: `sent` events published (`refused` of them refused by Redis),
    /// `done` when the replay has walked its whole range.
    Ran {
        id: i64,
        sent: usize,
        refused: usize,
        done: bool,
    },
    BrokerDown(BrokerError),
    DatabaseError(String),
}

/// One replay's selection and position, as claimed.
struct Claimed {
    id: i64,
    since: String,
    until: Option<String>,
    next_round: i64,
    next_index: i32,
    last_round: i64,
    streams: Option<Vec<String>>,
    /// `streams` are keys compared as they are, not patterns (outbox.repair_losses).
    exact_streams: bool,
    aggregate_types: Option<Vec<String>>,
    /// An `event_ids` filter applies: its ids stay in `outbox.replay_event_ids`, probed per event
    /// examined (never loaded here, however many).
    by_event_ids: bool,
    to_stream: Option<String>,
    max_rate: Option<i32>,
}

impl Claimed {
    /// The arguments of SELECT and EVENTS, which apply the same selection to the event ids given:
    /// `$1` the ids, then the range and the filters.
    fn selection_args(&self, ids: Vec<String>) -> [Value; 5] {
        [
            ids.into(),
            self.since.clone().into(),
            self.until.clone().into(),
            self.aggregate_types.clone().into(),
            self.by_event_ids.then_some(self.id).into(),
        ]
    }
}

/// What a round read: the events to send, in journal order, and where the replay will stand.
struct Walked {
    replay: Claimed,
    events: Vec<OutboxEvent>,
    /// The position after the entries walked.
    next_round: i64,
    next_index: i32,
    walked: i64,
    filtered: i64,
    missing: i64,
    done: bool,
}

/// Runs one replay round, if a replay is running and this relay may take it.
pub fn replay_round(
    db: &mut impl Database,
    sink: &mut RedisSink,
    settings: &TickSettings,
    state: &mut RoundState,
    limits: Limits,
) -> ReplayOutcome {
    let walked = match walk(db, settings, state, limits) {
        Ok(Walk::Walked(walked)) => walked,
        Ok(Walk::NoneRunning) => return ReplayOutcome::Nothing,
        Ok(Walk::NoneClaimable) => return ReplayOutcome::Waiting,
        Err(error) => return ReplayOutcome::DatabaseError(error),
    };
    let (mut sent, mut refused, mut last_error) = (0usize, 0usize, None);
    if !walked.events.is_empty() {
        // Into a stream of its own (`to_stream`) or the event's: an explicit stream wins over the
        // template, so `to_stream` is set as each event's stream.
        let outcomes = match sink.publish(&walked.events, &settings.entries) {
            Ok(outcomes) => outcomes,
            Err(error) => return ReplayOutcome::BrokerDown(error),
        };
        for outcome in outcomes {
            match outcome {
                EntryOutcome::Published(_) => sent += 1,
                EntryOutcome::Rejected(error) => {
                    // Nothing is marked by a replay, and nothing retried: the replay reports it.
                    refused += 1;
                    last_error = Some(error);
                }
                EntryOutcome::BrokerRefused(error) => return ReplayOutcome::BrokerDown(BrokerError(error)),
                // Behind a refused event of its aggregate: counted as refused too.
                EntryOutcome::NotSent => refused += 1,
            }
        }
    }
    let throttled_until = walked.replay.max_rate.filter(|_| sent > 0).map(|rate| {
        let pause = Duration::from_secs_f64(sent as f64 / rate.max(1) as f64);
        crate::time::timestamptz_text(postgres_now_us() + pause.as_micros() as i64)
    });
    let id = walked.replay.id;
    let done = walked.done;
    let pid = settings.pid;
    // Losses found before this round wrote, then, with the progress, the marks of what Redis
    // acknowledged (as a live round's finish does).
    if let Err(error) = losses::report_found(db, sink, settings.replay_on_loss) {
        return ReplayOutcome::DatabaseError(error);
    }
    let (marks_target, marks) = (sink.marks_target(), sink.take_dirty_marks());
    let kept = marks.clone();
    let recorded = db.transaction(|db| {
        losses::write_marks(db, &marks_target, &marks)?;
        first::<bool>(&db.query(
            PROGRESS,
            &[
                id.into(),
                pid.into(),
                walked.next_round.into(),
                walked.next_index.into(),
                walked.walked.into(),
                (sent as i64).into(),
                walked.filtered.into(),
                walked.missing.into(),
                (refused as i64).into(),
                last_error.into(),
                done.into(),
                throttled_until.into(),
            ],
        )?)?;
        if !done {
            return Ok(Vec::new());
        }
        db.query(UNREPAIRED, &[id.into()])?
            .iter()
            .map(|row| Ok((row.get::<i64>(0)?.unwrap_or_default(), row.get::<String>(1)?.unwrap_or_default())))
            .collect::<Result<Vec<(i64, String)>, DbError>>()
    });
    match recorded {
        Ok(unrepaired) => {
            for (loss, stream) in unrepaired {
                // A repair that replayed nothing repaired nothing: say so, and what to do instead.
                hooks::warning(&format!(
                    "outbox_pg: replay {id} repairing outbox.redis_losses id {loss} replayed no event of stream \"{stream}\": no \
                     retained event published since the loss maps to that stream under the outbox.stream template of now; if \
                     the stream was written under an earlier template, replay its events into it with SELECT \
                     outbox.replay(since => ..., aggregate_types => ARRAY[...], to_stream => '{}'); the loss stays counted in \
                     outbox.stats.redis_data_loss",
                    stream.replace('\'', "''")
                ));
            }
            ReplayOutcome::Ran { id, sent, refused, done }
        }
        Err(error) => {
            sink.marks_not_stored(kept);
            ReplayOutcome::DatabaseError(error.into())
        }
    }
}

/// Microseconds since 2000-01-01, PostgreSQL's epoch, now.
fn postgres_now_us() -> i64 {
    let unix = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64);
    unix - 946_684_800_000_000
}

/// A journal entry: its place (round, index in the round's arrays), event and aggregate_seq.
struct Entry {
    round: i64,
    index: i32,
    event_id: String,
    seq: i64,
}

/// Whether a replay's `streams` take the stream key `key`: as keys (exact, outbox.repair_losses),
/// or as glob patterns like outbox.allowed_streams's.
fn selects(wanted: &[String], exact: bool, key: &str) -> bool {
    if exact {
        wanted.iter().any(|stream| stream == key)
    } else {
        wanted.iter().any(|pattern| streams::allowed(pattern, key))
    }
}

/// What a walk found.
enum Walk {
    Walked(Box<Walked>),
    NoneRunning,
    NoneClaimable,
}

/// A text array column without its NULL elements (there are none: the filters' arrays, the
/// journal's event ids), moved out of the row.
fn texts(row: &mut Row, column: usize) -> Result<Option<Vec<String>>, DbError> {
    Ok(row.take::<Vec<Option<String>>>(column)?.map(|texts| texts.into_iter().flatten().collect()))
}

/// Claims a replay and reads its next round, in one short transaction.
fn walk(
    db: &mut impl Database,
    settings: &TickSettings,
    state: &mut RoundState,
    limits: Limits,
) -> Result<Walk, String> {
    let walked = db.transaction(|client| {
        if !matches!(readiness(client, state)?, Readiness::Ready(_)) {
            return Ok(Walk::NoneRunning);
        }
        let lease_ms = settings.lease.as_millis().min(i32::MAX as u128) as i32;
        {
            // At most one row (src/sql/replay.sql).
            let mut claimed = client.query(CLAIM, &[settings.pid.into(), lease_ms.into()])?;
            let Some(row) = claimed.first_mut() else {
                let running = first::<bool>(&client.query(REPLAYS_RUNNING, &[])?)?.unwrap_or(false);
                return Ok(if running { Walk::NoneClaimable } else { Walk::NoneRunning });
            };
            let replay = Claimed {
                id: row.get::<i64>(0)?.unwrap_or_default(),
                since: row.take::<String>(1)?.unwrap_or_default(),
                next_round: row.get::<i64>(2)?.unwrap_or_default(),
                next_index: row.get::<i32>(3)?.unwrap_or_default(),
                last_round: row.get::<i64>(4)?.unwrap_or_default(),
                until: row.take::<String>(5)?,
                streams: texts(row, 6)?,
                aggregate_types: texts(row, 7)?,
                by_event_ids: row.get::<bool>(8)?.unwrap_or(false),
                to_stream: row.take::<String>(9)?,
                max_rate: row.get::<i32>(10)?,
                exact_streams: row.get::<bool>(11)?.unwrap_or(false),
            };
            // The journal's entries from the replay's position, examined a stretch at a time
            // without their payloads (`outbox._replay_select`): missing, left out, or chosen,
            // until the round is full (`limits`) or has examined ROUND_WALK.
            let mut queue: VecDeque<Entry> = VecDeque::new();
            // Where reading the journal goes on, and whether it has reached its end.
            let (mut read_round, mut read_index) = (replay.next_round, replay.next_index);
            let mut journal_end = false;
            let mut chosen: Vec<Entry> = Vec::new();
            let (mut examined, mut walked, mut filtered, mut missing, mut bytes) = (0usize, 0i64, 0i64, 0i64, 0usize);
            // The first entry the round had no room for.
            let mut cut: Option<(i64, i32)> = None;
            'walk: while chosen.len() < limits.events && examined < ROUND_WALK {
                let want = (limits.events - chosen.len()).max(MIN_EXAMINED).min(ROUND_WALK - examined);
                // A repair's rounds that wrote none of its streams are passed over, each counted
                // examined once: a round passes over at most ROUND_WALK of them.
                while queue.len() < want && !journal_end && examined < ROUND_WALK {
                    let max_entries = (want - queue.len()) as i32;
                    let rounds = client.query(
                        WALK,
                        &[
                            read_round.into(),
                            read_index.into(),
                            replay.last_round.into(),
                            ROUNDS_AT_ONCE.into(),
                            max_entries.into(),
                            replay.streams.clone().filter(|_| replay.exact_streams).into(),
                        ],
                    )?;
                    if rounds.is_empty() {
                        // Walked to the end of what retention left of the journal.
                        journal_end = true;
                        break;
                    }
                    for mut journal in rounds {
                        let round = journal.get::<i64>(0)?.unwrap_or_default();
                        let skip = journal.get::<i32>(1)?.unwrap_or_default().max(0);
                        let event_ids = texts(&mut journal, 2)?.unwrap_or_default();
                        let seqs: Vec<i64> =
                            journal.take::<Vec<Option<i64>>>(3)?.unwrap_or_default().into_iter().flatten().collect();
                        let events = journal.get::<i32>(4)?.unwrap_or_default();
                        if journal.get::<bool>(5)?.unwrap_or(false) {
                            let passed = i64::from((events - skip).max(0));
                            // Walked, not examined: `filtered` counts what was looked at.
                            (walked, examined) = (walked + passed, examined + 1);
                            (read_round, read_index) = (round + 1, 0);
                            if round >= replay.last_round {
                                journal_end = true;
                                break;
                            }
                            continue;
                        }
                        let read = event_ids.len() as i32;
                        for (offset, (event_id, seq)) in event_ids.into_iter().zip(seqs).enumerate() {
                            queue.push_back(Entry { round, index: skip + offset as i32, event_id, seq });
                        }
                        if skip + read < events {
                            // Cut: the rest of this round (and the rounds after it) next time.
                            (read_round, read_index) = (round, skip + read);
                            break;
                        }
                        (read_round, read_index) = (round + 1, 0);
                        if round >= replay.last_round {
                            journal_end = true;
                            break;
                        }
                    }
                }
                if queue.is_empty() {
                    break;
                }
                let stretch: Vec<Entry> = queue.drain(..want.min(queue.len())).collect();
                let ids: Vec<String> = stretch.iter().map(|entry| entry.event_id.clone()).collect();
                // Per event still retained: its stream key, its size, whether the selection takes it.
                let mut found: HashMap<String, (String, usize, bool)> = HashMap::with_capacity(ids.len());
                for mut row in client.query(SELECT, &replay.selection_args(ids))? {
                    let event_id = row.take::<String>(0)?.unwrap_or_default();
                    let key = match row.take::<String>(3)? {
                        Some(stream) => stream,
                        None => render_stream_template(
                            &settings.entries.stream_template,
                            &row.get::<String>(1)?.unwrap_or_default(),
                            &row.get::<String>(2)?.unwrap_or_default(),
                        ),
                    };
                    let size = row.get::<i64>(4)?.unwrap_or_default().max(0) as usize;
                    let matches = row.get::<bool>(5)?.unwrap_or(false);
                    found.insert(event_id, (key, size, matches));
                }
                for entry in stretch {
                    let Some((key, size, matches)) = found.remove(&entry.event_id) else {
                        examined += 1;
                        walked += 1;
                        missing += 1;
                        continue;
                    };
                    let selected = matches
                        && replay.streams.as_ref().is_none_or(|wanted| selects(wanted, replay.exact_streams, &key));
                    if !selected {
                        examined += 1;
                        walked += 1;
                        filtered += 1;
                        continue;
                    }
                    if chosen.len() >= limits.events || (!chosen.is_empty() && bytes + size > limits.bytes) {
                        // The round is full: the replay goes on from this entry next time.
                        cut = Some((entry.round, entry.index));
                        break 'walk;
                    }
                    examined += 1;
                    walked += 1;
                    bytes += size;
                    chosen.push(entry);
                }
            }
            // Where the replay goes on: the first entry not examined.
            let (next_round, next_index, done) = match (cut, queue.front()) {
                (Some((round, index)), _) => (round, index, false),
                (None, Some(entry)) => (entry.round, entry.index, false),
                (None, None) => (read_round, read_index, journal_end),
            };
            // Only now the payloads, of the events the round sends.
            let mut events = Vec::with_capacity(chosen.len());
            if !chosen.is_empty() {
                let ids: Vec<String> = chosen.iter().map(|entry| entry.event_id.clone()).collect();
                let mut fetched: HashMap<String, OutboxEvent> = HashMap::with_capacity(ids.len());
                for mut row in client.query(EVENTS, &replay.selection_args(ids))? {
                    let headers = row.take::<String>(6)?;
                    let event = OutboxEvent {
                        event_id: row.take::<String>(0)?.unwrap_or_default(),
                        id: row.get::<i64>(1)?.unwrap_or_default(),
                        aggregate_type: row.take::<String>(2)?.unwrap_or_default(),
                        aggregate_id: row.take::<String>(3)?.unwrap_or_default(),
                        aggregate_seq: 0,
                        event_type: row.take::<String>(4)?.unwrap_or_default(),
                        payload: row.take::<String>(5)?.unwrap_or_default(),
                        trace: TraceContext::from_headers(headers.as_deref()),
                        headers,
                        stream: row.take::<String>(7)?,
                        created_at: row.take::<String>(8)?.unwrap_or_default(),
                        replay: Some(replay.id),
                    };
                    fetched.insert(event.event_id.clone(), event);
                }
                for entry in chosen {
                    // Read in the same transaction as its size: retention cannot have removed it.
                    let Some(mut event) = fetched.remove(&entry.event_id) else {
                        missing += 1;
                        continue;
                    };
                    event.aggregate_seq = entry.seq;
                    if let Some(to_stream) = &replay.to_stream {
                        event.stream = Some(to_stream.clone());
                    }
                    events.push(event);
                }
            }
            Ok(Walk::Walked(Box::new(Walked {
                replay,
                events,
                next_round,
                next_index,
                walked,
                filtered,
                missing,
                done,
            })))
        }
    });
    walked.map_err(String::from)
}
