//! The consumer loop: read through a consumer group, deduplicate, call the handler, acknowledge,
//! reclaim abandoned entries and dead-letter the ones that cannot succeed. The dedup protocol is
//! documented on [`Consumer`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use redis::Value;

use crate::config::ConsumerConfig;
use crate::connection::{self, Connection};
use crate::error::ConsumerError;
use crate::event::Event;
use crate::reply::{self, RawEntry};

/// Counters of what a consumer did since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Events whose handler succeeded and which were acknowledged.
    pub processed: u64,
    /// Copies of already-processed events, acknowledged without calling the handler.
    pub duplicates: u64,
    /// Entries moved to the dead-letter stream (malformed ones included) and acknowledged.
    pub dead_lettered: u64,
    /// Handler calls that returned an error.
    pub handler_errors: u64,
    /// Entries that could not be parsed into an [`Event`] (all of them are dead-lettered).
    pub malformed: u64,
    /// Entries taken over from an idle consumer with XAUTOCLAIM.
    pub reclaimed: u64,
    /// Entries left pending because another copy of the same event was in flight.
    pub deferred: u64,
    /// Reconnections made by [`Consumer::run`] after transient failures.
    pub reconnects: u64,
}

/// A Redis Streams consumer group member that hands each event to a handler at least once and,
/// thanks to the dedup keys, normally exactly once. Create one per thread; it owns one
/// connection.
///
/// # Deduplication protocol
///
/// Before the handler runs, the consumer takes the key `<dedup_prefix>:<event_id>` (in cluster
/// mode `<dedup_prefix>:{<stream>}:<event_id>`, see [`ConsumerConfig::dedup_key`]) with
/// `SET key "inflight|<entry_id>|<consumer>" NX EX <ttl>`:
///
/// * the key was free: run the handler. On success, `SET key done EX <ttl>` and `XACK` in one
///   script, so "done" and the acknowledgement cannot be separated. On failure, delete the key
///   (only if it still holds our marker) so that the retry is not mistaken for a duplicate, and
///   leave the entry pending.
/// * the key says `done` (or anything that is not an in-flight marker): the event was already
///   processed; XACK this copy, skip the handler, count a duplicate.
/// * the key is an in-flight marker for this same stream entry: an earlier delivery of this very
///   entry was abandoned mid-handler (its consumer crashed or was stopped hard) and we have just
///   reclaimed it, so take the marker over and run the handler again. A plain `SET NX` would
///   instead skip the entry as a duplicate and the event would be lost.
/// * the key is an in-flight marker for another entry: another copy of the event is being
///   handled right now. Leave this copy pending; once the other copy is done, the reclaimed copy
///   is acknowledged as a duplicate (or processed, if the other copy failed).
///
/// Remaining windows: a crash after the handler succeeded but before the script ran redelivers
/// the entry and runs the handler again (at-least-once); a handler slower than
/// `claim_idle_timeout` can be reclaimed and run concurrently by another consumer.
pub struct Consumer {
    config: ConsumerConfig,
    conn: Connection,
    stats: Stats,
    /// Where the next XAUTOCLAIM page starts; `0-0` between scans.
    claim_cursor: String,
    next_claim_at: Instant,
    /// `config.delete_acked` and the server has `XACKDEL`.
    ack_deletes: bool,
}

/// What happened to one entry (for the stats and the poll loop).
enum Outcome {
    Processed,
    Duplicate,
    Failed,
    DeadLettered,
    Deferred,
}

/// The state of an event's dedup key, as found before calling the handler.
enum DedupState {
    /// We hold the in-flight marker (fresh, or taken over from an abandoned delivery).
    Acquired { marker: String },
    /// The event was processed already.
    Done,
    /// Another copy of the event is in flight elsewhere.
    Busy,
}

/// Sets the key to `ARGV[1]` unless it holds "done": taken over when it holds an in-flight marker
/// for this same entry (prefix `ARGV[3]`), taken when it vanished meanwhile. Returns 1 acquired,
/// 2 taken over, 0 done, 3 busy elsewhere. A script so that read-and-replace is atomic.
const ACQUIRE_SCRIPT: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  return 1
end
if string.sub(v, 1, 9) ~= 'inflight|' then
  return 0
end
if string.sub(v, 1, string.len(ARGV[3])) == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  return 2
end
return 3
";

/// Deletes the key only if it still holds our marker, so a failing consumer whose entry was
/// meanwhile reclaimed does not delete the marker of the consumer now handling it.
const RELEASE_SCRIPT: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// Marks the event done (`KEYS[1]` = dedup key set to `ARGV[1]` for `ARGV[2]` seconds) and
/// acknowledges the entry (`KEYS[2]` = stream, `ARGV[3]` = group, `ARGV[4]` = entry ID). A script
/// rather than MULTI/EXEC because it is one command: the cluster client routes it by its first key
/// (both keys share a slot in cluster mode, see `ConsumerConfig::dedup_key`) and follows a
/// redirection for it as for any command, which it cannot do for a transaction (its sync client
/// has no MULTI/EXEC at all). Atomic all the same, and replicated as one unit.
const DONE_SCRIPT: &str = r"
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return redis.call('XACK', KEYS[2], ARGV[3], ARGV[4])
";

/// `DONE_SCRIPT` with `XACKDEL ... ACKED` ([`ConsumerConfig::delete_acked`]): the entry is also
/// deleted if every other group acknowledged it already.
const DONE_DELETE_SCRIPT: &str = r"
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return redis.call('XACKDEL', KEYS[2], ARGV[3], 'ACKED', 'IDS', 1, ARGV[4])
";

const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// The value of a dedup key once its event was processed.
const DONE: &str = "done";

impl Consumer {
    /// Validates `config`, reads the files it names (password, certificates), connects to Redis
    /// (one server, or the cluster through its seed nodes) and creates the consumer group if it
    /// does not exist (with MKSTREAM, so the stream may not exist yet either).
    pub fn connect(config: ConsumerConfig) -> Result<Consumer, ConsumerError> {
        config.validate()?;
        let conn = connection::open(&config)?;
        let mut consumer = Consumer {
            config,
            conn,
            stats: Stats::default(),
            claim_cursor: "0-0".to_string(),
            next_claim_at: Instant::now(),
            ack_deletes: false,
        };
        consumer.ack_deletes = consumer.config.delete_acked && consumer.server_has("XACKDEL")?;
        consumer.ensure_group()?;
        Ok(consumer)
    }

    /// The configuration this consumer runs with.
    pub fn config(&self) -> &ConsumerConfig {
        &self.config
    }

    /// The command this consumer acknowledges with: `XACKDEL` (with `ACKED`) when
    /// [`ConsumerConfig::delete_acked`] is set and the server has it, else `XACK`.
    pub fn acknowledges_with(&self) -> &'static str {
        if self.ack_deletes {
            "XACKDEL"
        } else {
            "XACK"
        }
    }

    /// Whether the server knows `command` (`COMMAND INFO` answers nil for an unknown one): what
    /// it offers, asked rather than guessed from its version.
    fn server_has(&mut self, command: &str) -> Result<bool, ConsumerError> {
        let info: Value = redis::cmd("COMMAND")
            .arg("INFO")
            .arg(command)
            .query(&mut self.conn)
            .map_err(ConsumerError::redis("COMMAND INFO"))?;
        Ok(matches!(info, Value::Array(items) if items.first().is_some_and(|item| !matches!(item, Value::Nil))))
    }

    /// What this consumer has done so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// One step: reclaim idle pending entries if a scan is due, then read new entries (blocking
    /// up to `block_timeout` when nothing was reclaimed), and handle each one. Returns how many
    /// entries were examined (0 after a timeout with nothing to do).
    ///
    /// `handler` is called once per event not seen before; an `Err` leaves the entry pending for
    /// a retry after `claim_idle_timeout`, until `max_deliveries` is reached.
    pub fn poll_once<H, E>(&mut self, mut handler: H) -> Result<usize, ConsumerError>
    where
        H: FnMut(&Event) -> Result<(), E>,
        E: std::fmt::Display,
    {
        let never = AtomicBool::new(false);
        self.poll(&mut handler, &never)
    }

    /// Polls until `stop` is set, riding out transient Redis failures by reconnecting (up to
    /// `reconnect_attempts` in a row). When `stop` is set (e.g. by a signal handler, or by the
    /// handler itself) the event being handled is finished and acknowledged, and `run` returns;
    /// entries already read but not yet handled stay pending and are reclaimed later.
    pub fn run<H, E>(&mut self, handler: H, stop: &AtomicBool) -> Result<(), ConsumerError>
    where
        H: FnMut(&Event) -> Result<(), E>,
        E: std::fmt::Display,
    {
        self.run_loop(handler, stop, None)
    }

    /// Like [`Consumer::run`], but also returns once no entry has arrived for `idle` (useful for
    /// batch jobs and scripts that drain a stream and exit).
    pub fn run_with_idle_exit<H, E>(
        &mut self,
        handler: H,
        stop: &AtomicBool,
        idle: Duration,
    ) -> Result<(), ConsumerError>
    where
        H: FnMut(&Event) -> Result<(), E>,
        E: std::fmt::Display,
    {
        self.run_loop(handler, stop, Some(idle))
    }

    fn run_loop<H, E>(&mut self, mut handler: H, stop: &AtomicBool, idle: Option<Duration>) -> Result<(), ConsumerError>
    where
        H: FnMut(&Event) -> Result<(), E>,
        E: std::fmt::Display,
    {
        let mut last_activity = Instant::now();
        let mut failures: u32 = 0;
        while !stop.load(Ordering::SeqCst) {
            match self.poll(&mut handler, stop) {
                Ok(seen) => {
                    failures = 0;
                    if seen > 0 {
                        last_activity = Instant::now();
                    } else if idle.is_some_and(|idle| last_activity.elapsed() >= idle) {
                        break;
                    }
                }
                Err(error) if error.is_transient() && failures < self.config.reconnect_attempts => {
                    failures += 1;
                    // Exponential backoff (100 ms, 200 ms, ... capped) so a restarting server is
                    // not hammered, checked against `stop` so shutdown stays prompt.
                    let backoff = Duration::from_millis(100u64 << failures.saturating_sub(1).min(6)).min(MAX_BACKOFF);
                    sleep_unless_stopped(backoff, stop);
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    // A failed reconnect is retried on the next round: the poll fails again
                    // and counts towards `reconnect_attempts`. One that cannot succeed (a file
                    // that became unreadable, a certificate the server now refuses, a permission
                    // taken away) ends the run with its own error rather than the poll's.
                    match self.reconnect() {
                        Ok(()) => self.stats.reconnects += 1,
                        Err(error) if !error.is_transient() => return Err(error),
                        Err(_) => {}
                    }
                }
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// Replaces the connection (re-reading the password and certificate files, and in cluster
    /// mode the slot map, so a failed-over master's replica is found) and re-creates the group if
    /// it vanished.
    fn reconnect(&mut self) -> Result<(), ConsumerError> {
        self.conn = connection::open(&self.config)?;
        self.ensure_group()
    }

    fn ensure_group(&mut self) -> Result<(), ConsumerError> {
        let result: redis::RedisResult<Value> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.config.stream)
            .arg(&self.config.group)
            .arg(&self.config.group_start_id)
            .arg("MKSTREAM")
            .query(&mut self.conn);
        match result {
            Ok(_) => Ok(()),
            // Another consumer (or an earlier run) created it: exactly what we wanted.
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(ConsumerError::Redis { operation: "XGROUP CREATE", source: e }),
        }
    }

    fn poll<H, E>(&mut self, handler: &mut H, stop: &AtomicBool) -> Result<usize, ConsumerError>
    where
        H: FnMut(&Event) -> Result<(), E>,
        E: std::fmt::Display,
    {
        let mut seen = 0;
        let scanning = self.claim_cursor != "0-0";
        if scanning || Instant::now() >= self.next_claim_at {
            let claimed = self.reclaim()?;
            seen += claimed.len();
            for (entry, deliveries) in claimed {
                if stop.load(Ordering::SeqCst) {
                    return Ok(seen);
                }
                self.stats.reclaimed += 1;
                self.handle(&entry, deliveries, handler)?;
            }
        }
        if stop.load(Ordering::SeqCst) {
            return Ok(seen);
        }
        // Do not block when reclaimed work was just done: there may be more of it.
        let block = if seen > 0 { None } else { Some(self.config.block_timeout) };
        let fresh = self.read_new(block)?;
        seen += fresh.len();
        for entry in fresh {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            // An entry read with `>` is on its first delivery.
            self.handle(&entry, 1, handler)?;
        }
        Ok(seen)
    }

    fn read_new(&mut self, block: Option<Duration>) -> Result<Vec<RawEntry>, ConsumerError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.config.group)
            .arg(&self.config.consumer_name)
            .arg("COUNT")
            .arg(self.config.batch_size);
        if let Some(block) = block.filter(|b| !b.is_zero()) {
            // At least 1 ms: `BLOCK 0` would mean "forever".
            cmd.arg("BLOCK").arg(millis(block).max(1));
        }
        cmd.arg("STREAMS").arg(&self.config.stream).arg(">");
        let value: Value = cmd.query(&mut self.conn).map_err(ConsumerError::redis("XREADGROUP"))?;
        reply::read_group(value).map_err(|detail| ConsumerError::UnexpectedReply { operation: "XREADGROUP", detail })
    }

    /// One XAUTOCLAIM page, with each claimed entry's delivery count (XAUTOCLAIM has already
    /// counted this delivery). Entries that left our PEL between the two commands (acknowledged
    /// or claimed by someone else) are dropped.
    fn reclaim(&mut self) -> Result<Vec<(RawEntry, u64)>, ConsumerError> {
        let value: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.config.stream)
            .arg(&self.config.group)
            .arg(&self.config.consumer_name)
            .arg(millis(self.config.claim_idle_timeout))
            .arg(&self.claim_cursor)
            .arg("COUNT")
            .arg(self.config.batch_size)
            .query(&mut self.conn)
            .map_err(ConsumerError::redis("XAUTOCLAIM"))?;
        let claim = reply::auto_claim(value)
            .map_err(|detail| ConsumerError::UnexpectedReply { operation: "XAUTOCLAIM", detail })?;
        self.claim_cursor = claim.cursor;
        if self.claim_cursor == "0-0" {
            self.next_claim_at = Instant::now() + self.config.claim_interval;
        }
        if !claim.deleted.is_empty() {
            // Redis 7 already dropped these from the PEL; for 6.2 the ack does it. Nothing is left
            // to process: the entry itself is gone.
            self.xack(&claim.deleted)?;
        }
        if claim.entries.is_empty() {
            return Ok(Vec::new());
        }

        let mut commands = Vec::with_capacity(claim.entries.len());
        for entry in &claim.entries {
            let mut cmd = redis::cmd("XPENDING");
            cmd.arg(&self.config.stream).arg(&self.config.group).arg(&entry.id).arg(&entry.id).arg(1);
            commands.push(cmd);
        }
        // One key (the stream) for every command: a single node in cluster mode too.
        let rows = self.conn.pipeline(commands).map_err(ConsumerError::redis("XPENDING"))?;
        let mut out = Vec::with_capacity(claim.entries.len());
        for (entry, row) in claim.entries.into_iter().zip(rows) {
            let pending = reply::pending(row)
                .map_err(|detail| ConsumerError::UnexpectedReply { operation: "XPENDING", detail })?;
            if let Some(info) =
                pending.into_iter().find(|p| p.id == entry.id && p.consumer == self.config.consumer_name)
            {
                out.push((entry, info.deliveries));
            }
        }
        Ok(out)
    }

    /// Handles one entry on its `deliveries`-th delivery. Errors are Redis failures only; the
    /// entry's own problems end in an [`Outcome`].
    fn handle<H, E>(&mut self, entry: &RawEntry, deliveries: u64, handler: &mut H) -> Result<Outcome, ConsumerError>
    where
        H: FnMut(&Event) -> Result<(), E>,
        E: std::fmt::Display,
    {
        let event = match Event::from_fields(&self.config.stream, &entry.id, entry.field_slices()) {
            Ok(event) => event,
            Err(parse_error) => {
                // No retry can fix a malformed entry: dead-letter it on first sight.
                self.stats.malformed += 1;
                self.dead_letter(entry, &format!("malformed entry: {parse_error}"), deliveries)?;
                return Ok(Outcome::DeadLettered);
            }
        };
        let key = self.config.dedup_key(&event.event_id);
        let too_many = deliveries > self.config.max_deliveries;
        match self.acquire(&key, &entry.id)? {
            DedupState::Done => {
                self.xack(std::slice::from_ref(&entry.id))?;
                self.stats.duplicates += 1;
                Ok(Outcome::Duplicate)
            }
            DedupState::Busy if too_many => {
                let reason = format!("delivered {deliveries} times while another copy of the event stayed in flight");
                self.dead_letter(entry, &reason, deliveries)?;
                Ok(Outcome::DeadLettered)
            }
            DedupState::Busy => {
                self.stats.deferred += 1;
                Ok(Outcome::Deferred)
            }
            DedupState::Acquired { marker } if too_many => {
                // Delivered more often than allowed without an ack or a reported failure: its
                // handler probably crashes the process. Do not run it again.
                self.release(&key, &marker)?;
                let reason = format!("delivered {deliveries} times without being acknowledged");
                self.dead_letter(entry, &reason, deliveries)?;
                Ok(Outcome::DeadLettered)
            }
            DedupState::Acquired { marker } => match handler(&event) {
                Ok(()) => {
                    redis::cmd("EVAL")
                        .arg(if self.ack_deletes { DONE_DELETE_SCRIPT } else { DONE_SCRIPT })
                        .arg(2)
                        .arg(&key)
                        .arg(&self.config.stream)
                        .arg(DONE)
                        .arg(ttl_secs(self.config.dedup_ttl))
                        .arg(&self.config.group)
                        .arg(&entry.id)
                        .exec(&mut self.conn)
                        .map_err(ConsumerError::redis("SET done + XACK"))?;
                    self.stats.processed += 1;
                    Ok(Outcome::Processed)
                }
                Err(handler_error) => {
                    self.stats.handler_errors += 1;
                    // Free the key first: the retry must not be taken for a duplicate.
                    self.release(&key, &marker)?;
                    if deliveries >= self.config.max_deliveries {
                        let reason = format!("handler failed on delivery {deliveries}: {handler_error}");
                        self.dead_letter(entry, &reason, deliveries)?;
                        Ok(Outcome::DeadLettered)
                    } else {
                        Ok(Outcome::Failed)
                    }
                }
            },
        }
    }

    fn acquire(&mut self, key: &str, entry_id: &str) -> Result<DedupState, ConsumerError> {
        let marker = format!("inflight|{entry_id}|{}", self.config.consumer_name);
        let ttl = ttl_secs(self.config.dedup_ttl);
        // The common case, a first sighting, is a single plain SET NX EX.
        let set: Value = redis::cmd("SET")
            .arg(key)
            .arg(&marker)
            .arg("NX")
            .arg("EX")
            .arg(ttl)
            .query(&mut self.conn)
            .map_err(ConsumerError::redis("SET NX"))?;
        if !matches!(set, Value::Nil) {
            return Ok(DedupState::Acquired { marker });
        }
        let verdict: i64 = redis::cmd("EVAL")
            .arg(ACQUIRE_SCRIPT)
            .arg(1)
            .arg(key)
            .arg(&marker)
            .arg(ttl)
            .arg(format!("inflight|{entry_id}|"))
            .query(&mut self.conn)
            .map_err(ConsumerError::redis("dedup check"))?;
        match verdict {
            0 => Ok(DedupState::Done),
            1 | 2 => Ok(DedupState::Acquired { marker }),
            3 => Ok(DedupState::Busy),
            other => Err(ConsumerError::UnexpectedReply {
                operation: "dedup check",
                detail: format!("script returned {other}"),
            }),
        }
    }

    fn release(&mut self, key: &str, marker: &str) -> Result<(), ConsumerError> {
        redis::cmd("EVAL")
            .arg(RELEASE_SCRIPT)
            .arg(1)
            .arg(key)
            .arg(marker)
            .exec(&mut self.conn)
            .map_err(ConsumerError::redis("dedup release"))
    }

    fn xack(&mut self, ids: &[String]) -> Result<(), ConsumerError> {
        if ids.is_empty() {
            return Ok(());
        }
        if self.ack_deletes {
            return redis::cmd("XACKDEL")
                .arg(&self.config.stream)
                .arg(&self.config.group)
                .arg("ACKED")
                .arg("IDS")
                .arg(ids.len())
                .arg(ids)
                .exec(&mut self.conn)
                .map_err(ConsumerError::redis("XACKDEL"));
        }
        redis::cmd("XACK")
            .arg(&self.config.stream)
            .arg(&self.config.group)
            .arg(ids)
            .exec(&mut self.conn)
            .map_err(ConsumerError::redis("XACK"))
    }

    /// Copies the entry to the dead-letter stream with why and how often it failed, then
    /// acknowledges it. Not one MULTI on purpose: a failing XADD inside MULTI would not stop the
    /// XACK, losing the entry; in this order a crash or a lost connection in between only
    /// duplicates the dead letter. (In cluster mode the dead-letter stream may live on another
    /// node, where no transaction could reach anyway.)
    fn dead_letter(&mut self, entry: &RawEntry, error: &str, deliveries: u64) -> Result<(), ConsumerError> {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.config.dead_letter_stream).arg("*");
        for (name, value) in &entry.fields {
            cmd.arg(name.as_slice()).arg(value.as_slice());
        }
        cmd.arg("error")
            .arg(error)
            .arg("deliveries")
            .arg(deliveries)
            .arg("original_id")
            .arg(&entry.id)
            .arg("original_stream")
            .arg(&self.config.stream);
        cmd.exec(&mut self.conn).map_err(ConsumerError::redis("XADD dead letter"))?;
        self.xack(std::slice::from_ref(&entry.id))?;
        self.stats.dead_lettered += 1;
        Ok(())
    }
}

/// Milliseconds for a Redis argument; config validation keeps durations far below overflow.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Whole seconds for `EX`, rounded up and at least 1 (`EX 0` is an error in Redis).
fn ttl_secs(duration: Duration) -> u64 {
    let secs = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    secs.max(1)
}

fn sleep_unless_stopped(total: Duration, stop: &AtomicBool) {
    let deadline = Instant::now() + total;
    while !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        thread::sleep((deadline - now).min(Duration::from_millis(50)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_can_move_to_another_thread() {
        // Both connection types must stay `Send`: applications create a consumer and hand it to
        // a worker thread.
        fn assert_send<T: Send>() {}
        assert_send::<Consumer>();
    }

    #[test]
    fn ttl_rounds_up_to_whole_seconds() {
        assert_eq!(ttl_secs(Duration::from_millis(1)), 1);
        assert_eq!(ttl_secs(Duration::from_secs(2)), 2);
        assert_eq!(ttl_secs(Duration::from_millis(2001)), 3);
        assert_eq!(ttl_secs(Duration::ZERO), 1);
    }
}
