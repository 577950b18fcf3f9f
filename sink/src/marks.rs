//! Noticing that Redis lost entries it had acknowledged. For each stream it writes to, the relay
//! remembers the last entry ID Redis returned (a *mark*); after it connects anew (a restart, a
//! failover, a broken connection) and every `CHECK_EVERY` otherwise, it asks Redis about each
//! stream (`XINFO STREAM`, through a script that returns its IDs and counters only: `SCRIPT`), a
//! *pass* done in chunks between rounds, each stream before the relay writes to it again
//! (`Marks::streams_to_check`). A stream lost entries when it is gone, when its last generated ID is
//! below the mark (a restart without persistence, an AOF that had not synced, a failover to a
//! replica that lacked them), or when it was deleted and written to again since (a `DEL` or
//! `FLUSHALL` while the relay keeps writing): see `lost`. Trimming (`MAXLEN`, `XTRIM`) and `XDEL`
//! are not losses. The relay reports each loss and can replay what it had published since
//! (docs/worker.md, "When Redis loses entries").

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use super::{BrokerError, StreamId};

/// How often the marks are checked while the connection stays up (a `FLUSHALL` or `DEL` does not
/// break it).
pub const CHECK_EVERY: Duration = Duration::from_secs(30);
/// The most streams remembered (and checked) per relay: the relay writes to few streams unless
/// events name their own; beyond this the streams written to least recently are forgotten, a
/// quarter at a time.
pub const MAX_STREAMS: usize = 4096;
/// The most streams checked per round beyond those the round writes to (which are checked first),
/// and per exchange with Redis: a pass over `MAX_STREAMS` streams takes 64 rounds, or as many
/// turns of an idle relay, and delays none by more than one such exchange.
pub const CHECK_CHUNK: usize = 64;

/// What the check asks Redis per stream: `XINFO STREAM` run by Redis itself, of which only the IDs
/// and counters come back, never the first and last entries that `XINFO STREAM` returns whole (a
/// writer's 1 MB events made a check of 700 streams hold 1.4 GB at once). An error comes back as
/// the pair `error`, message. `EVAL` is all the relay needs beyond `xinfo|stream`; where it is
/// refused, the check asks `XINFO STREAM` itself, one stream per exchange (`Query::Xinfo`). The
/// script declares that it writes nothing (Redis 7's `no-writes`), so that a `CLIENT PAUSE WRITE`
/// (an operator's failover) does not hold the check, and with it the next round, as it holds a
/// writing script; Redis 6 refuses the flag with ERR, and gets the direct `XINFO STREAM`.
const SCRIPT: &str = "#!lua flags=no-writes
local replies = {}
for i, key in ipairs(KEYS) do
  local info = redis.pcall('XINFO', 'STREAM', key)
  local kept = {}
  if type(info) == 'table' and info.err then
    kept = {'error', info.err}
  else
    for j = 1, #info, 2 do
      if info[j] ~= 'first-entry' and info[j] ~= 'last-entry' then
        kept[#kept + 1] = info[j]
        kept[#kept + 1] = info[j + 1]
      end
    end
  end
  replies[i] = kept
end
return replies";

/// The last entry the relay wrote to a stream, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    pub id: StreamId,
    pub written_at: SystemTime,
}

/// What the relay knows of a stream between checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Known {
    mark: Mark,
    /// An entry Redis acknowledged that the next check looks for (`lost`): the mark at the last
    /// check, or, for a stream not checked yet, the first entry written to it (or the mark
    /// adopted from a predecessor). Every entry written since is later.
    anchor: StreamId,
    /// Entries Redis acknowledged from the anchor on (it included): a stream that still is the
    /// one they were written to added at least as many.
    acked_from_anchor: u64,
    /// The stream's `entries-added` (Redis 7 and later: every entry ever added, whatever was
    /// trimmed or deleted since) at the last check, and the entries this relay added since: a
    /// stream deleted and written to again (a `DEL` or `FLUSHALL` while the relay keeps writing)
    /// has added fewer than that, though its last ID is the relay's latest.
    added_at_check: Option<u64>,
    written_since_check: u64,
}

/// A stream as Redis describes it now (`XINFO STREAM`): its last generated ID and, from Redis 7
/// on, how many entries were ever added to it, its first entry (None when empty), the highest ID
/// `XDEL` removed, and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Found {
    pub last_id: StreamId,
    pub entries_added: Option<u64>,
    pub first_id: Option<StreamId>,
    pub max_deleted: Option<StreamId>,
    pub length: u64,
}

/// A stream Redis no longer has up to its mark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loss {
    pub stream: String,
    /// The relay's mark: the last entry it had written.
    pub expected: Mark,
    /// The stream's last generated ID now; None when the stream is gone.
    pub found: Option<StreamId>,
    /// The stream was deleted and written to again: its last ID is not below the mark, but it no
    /// longer holds an entry it had when last checked (or when first written), neither trimmed
    /// nor deleted with `XDEL`, or added fewer entries than were written to it since.
    pub recreated: bool,
}

/// Whether Redis lost entries of a stream the relay knows as `known`, now described by `now`
/// (None: the stream is gone); Some(recreated) when it did.
fn lost(known: &Known, now: Option<&Found>) -> Option<bool> {
    let Some(now) = now else { return Some(false) };
    if now.last_id < known.mark.id {
        return Some(false);
    }
    // Redis 7 counts the entries a stream ever added: fewer than it had at the last check plus
    // those written since, and it is not the same stream.
    if let (Some(before), Some(added)) = (known.added_at_check, now.entries_added) {
        if added < before + known.written_since_check {
            return Some(true);
        }
    }
    // The anchor is still in the stream (entries are ordered by ID), or was removed by XDEL.
    let (added, first) = (now.entries_added?, now.first_id?);
    let present = now.length > 0 && first <= known.anchor;
    let deleted = now.max_deleted.is_some_and(|deleted| known.anchor <= deleted);
    if present || deleted {
        return None;
    }
    // Gone from the front: trimmed, unless the stream never lost an entry to trimming or XDEL
    // (every entry it added is still there: it is a newer stream than the anchor's), or added
    // fewer entries than were acknowledged from the anchor on.
    (added <= now.length || added < known.acked_from_anchor).then_some(true)
}

/// The marks of the streams a relay wrote to.
#[derive(Debug, Default)]
pub struct Marks {
    marks: HashMap<String, Known>,
    /// Marks set or moved since `take_dirty` last ran (the relay stores them now and then, so that
    /// a relay started anew still knows them).
    dirty: Vec<String>,
    /// When the last complete pass began; None: begin one at the next opportunity (a new
    /// connection).
    checked: Option<Instant>,
    /// The pass under way: when it began, and the streams it has yet to check (sorted).
    pass: Option<(Instant, Vec<String>)>,
    /// Streams forgotten to stay within `MAX_STREAMS`, since the relay started.
    pub forgotten: u64,
}

impl Marks {
    /// Whether no stream is marked (nothing written, nothing adopted).
    pub fn is_empty(&self) -> bool {
        self.marks.is_empty()
    }

    /// Records that Redis returned `id` for an entry of `stream`.
    pub fn wrote(&mut self, stream: &str, id: StreamId) {
        match self.marks.get_mut(stream) {
            Some(known) => {
                known.written_since_check += 1;
                known.acked_from_anchor += 1;
                if known.mark.id < id {
                    known.mark = Mark { id, written_at: SystemTime::now() };
                    self.dirty.push(stream.to_string());
                }
            }
            None => {
                self.make_room();
                let mark = Mark { id, written_at: SystemTime::now() };
                let known =
                    Known { mark, anchor: id, acked_from_anchor: 1, added_at_check: None, written_since_check: 1 };
                self.marks.insert(stream.to_string(), known);
                self.dirty.push(stream.to_string());
            }
        }
    }

    /// Adopts marks stored earlier (by this relay's predecessors, or another relay of the
    /// database), keeping the later of each.
    pub fn adopt(&mut self, stored: impl IntoIterator<Item = (String, Mark)>) {
        // Checked before anything is written to them, like marks after a new connection.
        self.reconnected();
        for (stream, mark) in stored {
            match self.marks.get_mut(&stream) {
                Some(known) if known.mark.id >= mark.id => {}
                // Its anchor (earlier) still holds: only the mark moves.
                Some(known) => known.mark = mark,
                None => {
                    if self.marks.len() < MAX_STREAMS {
                        let known = Known {
                            mark,
                            anchor: mark.id,
                            acked_from_anchor: 1,
                            added_at_check: None,
                            written_since_check: 0,
                        };
                        self.marks.insert(stream, known);
                    }
                }
            }
        }
    }

    /// At `MAX_STREAMS`, forgets the quarter written to least recently: one pass over the marks
    /// per `MAX_STREAMS / 4` new streams, not one per new stream.
    fn make_room(&mut self) {
        if self.marks.len() < MAX_STREAMS {
            return;
        }
        let mut ages: Vec<(SystemTime, &String)> = self.marks.iter().map(|(s, k)| (k.mark.written_at, s)).collect();
        let forget = MAX_STREAMS / 4;
        ages.select_nth_unstable(forget - 1);
        let oldest: Vec<String> = ages[..forget].iter().map(|(_, s)| (*s).clone()).collect();
        for stream in &oldest {
            self.marks.remove(stream);
        }
        self.forgotten += oldest.len() as u64;
    }

    /// The marks moved since the last call, to be stored.
    pub fn take_dirty(&mut self) -> Vec<(String, Mark)> {
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        dirty.into_iter().filter_map(|stream| self.marks.get(&stream).map(|known| (stream, known.mark))).collect()
    }

    /// Marks `take_dirty` handed out that could not be stored: stored with the next ones.
    pub fn not_stored(&mut self, streams: impl IntoIterator<Item = String>) {
        self.dirty.extend(streams);
    }

    /// A new connection: a new pass at the next opportunity (the one under way, if any, is
    /// abandoned: what it checked may predate the connection).
    pub fn reconnected(&mut self) {
        self.checked = None;
        self.pass = None;
    }

    /// Whether a pass is due or under way.
    pub fn check_due(&self) -> bool {
        !self.marks.is_empty() && (self.pass.is_some() || self.checked.is_none_or(|at| at.elapsed() >= CHECK_EVERY))
    }

    /// The streams to check now, begun a pass if one is due: those of the pass's that are in
    /// `writing` (a stream must be checked before it is written to again: written to first, a
    /// stream Redis lost whole would exist again with a later ID and hide the loss), then up to
    /// `more` others. The pass ends once every stream has been handed out.
    pub fn streams_to_check<'a>(&mut self, writing: impl IntoIterator<Item = &'a str>, more: usize) -> Vec<String> {
        if self.pass.is_none() {
            if !self.check_due() {
                return Vec::new();
            }
            self.pass = Some((Instant::now(), self.streams()));
        }
        let Some((began, pending)) = self.pass.as_mut() else { return Vec::new() };
        let writing: std::collections::HashSet<&str> = writing.into_iter().collect();
        let (mut now, rest): (Vec<String>, Vec<String>) =
            std::mem::take(pending).into_iter().partition(|stream| writing.contains(stream.as_str()));
        *pending = rest;
        let more = more.min(pending.len());
        now.extend(pending.drain(..more));
        if pending.is_empty() {
            self.checked = Some(*began);
            self.pass = None;
        }
        now
    }

    /// Whether a pass is under way (streams are left to check).
    pub fn checking(&self) -> bool {
        self.pass.is_some()
    }

    /// The streams to check, in a stable order.
    pub fn streams(&self) -> Vec<String> {
        let mut streams: Vec<String> = self.marks.keys().cloned().collect();
        streams.sort_unstable();
        streams
    }

    /// Compares what Redis said of each stream (None when it is gone) with the marks, and
    /// returns the losses (`lost`). A stream Redis lost is forgotten, so that a loss is reported
    /// once; writing to it again sets a new mark.
    pub fn compare(&mut self, found: Vec<(String, Option<Found>)>) -> Vec<Loss> {
        let mut losses = Vec::new();
        for (stream, now) in found {
            let Some(known) = self.marks.get_mut(&stream) else { continue };
            match lost(known, now.as_ref()) {
                None => {
                    // Now known to be in Redis (or trimmed): what the next check looks for.
                    let now = now.unwrap_or_default();
                    known.anchor = known.mark.id;
                    known.acked_from_anchor = 1;
                    known.added_at_check = now.entries_added;
                    known.written_since_check = 0;
                }
                Some(recreated) => {
                    let expected = known.mark;
                    self.marks.remove(&stream);
                    losses.push(Loss { stream, expected, found: now.map(|now| now.last_id), recreated });
                }
            }
        }
        losses
    }
}

/// How the check asks Redis about a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Query {
    /// `SCRIPT` (`EVAL`), one per stream (a Cluster's streams are in different slots),
    /// pipelined: a few hundred bytes per stream come back, whatever its entries hold.
    #[default]
    Script,
    /// `XINFO STREAM` itself, where `EVAL` is refused: one stream per exchange, so that at most one
    /// stream's first and last entries are held at once.
    Xinfo,
}

/// Why the last generated IDs could not be read.
pub enum LastIdError {
    /// Redis refused the command itself (an ACL without `xinfo|stream`): checks are off.
    Refused(String),
    /// Redis refused `EVAL` or the script (an ACL without it, scripting off): ask with
    /// `Query::Xinfo`.
    NoScript(String),
    /// Redis failed as a whole.
    Failed(BrokerError),
}

/// Each stream's last generated ID and entries added (`XINFO STREAM`), None for a stream that does
/// not exist: one pipeline of `SCRIPT`s, or one `XINFO STREAM` per exchange (`Query`). The
/// caller bounds how many streams one call asks about (`CHECK_CHUNK`).
pub fn last_generated_ids(
    connection: &mut redis::Connection,
    streams: &[String],
    query: Query,
) -> Result<Vec<(String, Option<Found>)>, LastIdError> {
    let failed = |e: redis::RedisError| LastIdError::Failed(BrokerError(super::node::describe_error(&e)));
    let replies: Vec<redis::Value> = match query {
        Query::Script => {
            let mut pipe = redis::pipe();
            for stream in streams {
                pipe.cmd("EVAL").arg(SCRIPT).arg(1).arg(stream);
            }
            // Per-stream errors come back as values, not as a failure of the whole pipeline.
            pipe.ignore_errors().query(connection).map_err(failed)?
        }
        // One stream per call, its reply parsed before the next is asked for: XINFO STREAM's reply
        // carries the stream's first and last entries whole, and only one stream's may be held.
        Query::Xinfo if streams.len() != 1 => {
            let mut found = Vec::with_capacity(streams.len());
            for stream in streams {
                found.extend(last_generated_ids(connection, std::slice::from_ref(stream), query)?);
            }
            return Ok(found);
        }
        Query::Xinfo => {
            let mut pipe = redis::pipe();
            pipe.cmd("XINFO").arg("STREAM").arg(&streams[0]);
            pipe.ignore_errors().query(connection).map_err(failed)?
        }
    };
    let mut found = Vec::with_capacity(streams.len());
    for (stream, reply) in streams.iter().zip(replies) {
        let reply = match (query, reply) {
            // The script's reply: one list per key, or the pair `error`, message.
            (Query::Script, redis::Value::Array(mut per_key)) if per_key.len() == 1 => {
                let reply = per_key.pop().unwrap_or(redis::Value::Nil);
                match field_of(&reply, "error") {
                    Some(redis::Value::BulkString(message)) => {
                        let message = String::from_utf8_lossy(message);
                        if message.contains("no such key") {
                            found.push((stream.clone(), None));
                            continue;
                        }
                        if message.starts_with("WRONGTYPE") {
                            continue;
                        }
                        // The script may not run XINFO (an ACL), or anything else: ask directly.
                        return Err(LastIdError::NoScript(message.into_owned()));
                    }
                    _ => reply,
                }
            }
            (Query::Script, redis::Value::ServerError(error))
                if error.code() == "NOPERM" || error.code() == "ERR" || error.code() == "NOSCRIPT" =>
            {
                return Err(LastIdError::NoScript(error.to_string()))
            }
            (_, reply) => reply,
        };
        let id = match reply {
            redis::Value::ServerError(error) if error.details().unwrap_or_default().contains("no such key") => None,
            redis::Value::ServerError(error) if error.code() == "NOPERM" => {
                return Err(LastIdError::Refused(error.to_string()))
            }
            // Not a stream (nothing of ours), or a slot on the move (the next check looks again).
            redis::Value::ServerError(error) if matches!(error.code(), "WRONGTYPE" | "ASK" | "MOVED" | "TRYAGAIN") => {
                continue
            }
            redis::Value::ServerError(error) => return Err(LastIdError::Failed(BrokerError(error.to_string()))),
            reply => {
                let id_of = |name: &str| match field_of(&reply, name) {
                    Some(redis::Value::BulkString(id)) => StreamId::parse(id),
                    _ => None,
                };
                let count_of = |name: &str| match field_of(&reply, name) {
                    Some(redis::Value::Int(n)) => Some((*n).max(0) as u64),
                    _ => None,
                };
                let Some(last_id) = id_of("last-generated-id") else { continue };
                let length = count_of("length");
                Some(Found {
                    last_id,
                    // Without the length, the count says nothing of what was trimmed.
                    entries_added: count_of("entries-added").filter(|_| length.is_some()),
                    first_id: id_of("recorded-first-entry-id"),
                    max_deleted: id_of("max-deleted-entry-id"),
                    length: length.unwrap_or(0),
                })
            }
        };
        found.push((stream.clone(), id));
    }
    Ok(found)
}

/// The value of `name` in an `XINFO STREAM` reply (a flat list of names and values, or a map).
fn field_of<'a>(reply: &'a redis::Value, name: &str) -> Option<&'a redis::Value> {
    let pairs: Vec<(&redis::Value, &redis::Value)> = match reply {
        redis::Value::Array(items) => items.chunks(2).filter_map(|pair| Some((pair.first()?, pair.get(1)?))).collect(),
        redis::Value::Map(items) => items.iter().map(|(k, v)| (k, v)).collect(),
        _ => return None,
    };
    let named = |key: &redis::Value| match key {
        redis::Value::BulkString(key) => key.as_slice() == name.as_bytes(),
        redis::Value::SimpleString(key) => key == name,
        _ => false,
    };
    pairs.into_iter().find_map(|(key, value)| named(key).then_some(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(ms: u64, seq: u64) -> StreamId {
        StreamId { ms, seq }
    }

    #[test]
    fn a_mark_only_moves_forward() {
        let mut marks = Marks::default();
        marks.wrote("s", id(10, 1));
        marks.wrote("s", id(10, 0));
        marks.wrote("s", id(9, 5));
        assert_eq!(
            marks.take_dirty().into_iter().map(|(s, m)| (s, m.id)).collect::<Vec<_>>(),
            [("s".into(), id(10, 1))]
        );
        assert!(marks.take_dirty().is_empty());
        marks.wrote("s", id(11, 0));
        assert_eq!(marks.take_dirty()[0].1.id, id(11, 0));
    }

    #[test]
    fn a_stream_gone_or_behind_its_mark_is_a_loss_reported_once() {
        let mut marks = Marks::default();
        for (stream, ms) in [("kept", 10), ("trimmed", 10), ("behind", 10), ("gone", 10)] {
            marks.wrote(stream, id(ms, 3));
        }
        assert!(marks.check_due());
        assert_eq!(marks.streams_to_check([], MAX_STREAMS).len(), 4, "the whole pass");
        let at = |last_id| Some(Found { last_id, ..Found::default() });
        let losses = marks.compare(vec![
            ("kept".into(), at(id(10, 3))),
            ("trimmed".into(), at(id(12, 0))),
            ("behind".into(), at(id(10, 2))),
            ("gone".into(), None),
        ]);
        let lost: Vec<(&str, Option<StreamId>)> = losses.iter().map(|l| (l.stream.as_str(), l.found)).collect();
        assert_eq!(lost, [("behind", Some(id(10, 2))), ("gone", None)]);
        assert!(!marks.check_due(), "just checked");
        assert!(marks.compare(vec![("gone".into(), None)]).is_empty(), "reported once");
        marks.reconnected();
        assert!(marks.check_due());
    }

    #[test]
    fn a_pass_checks_the_streams_written_to_first_then_a_chunk_a_round() {
        let mut marks = Marks::default();
        for n in 0..10 {
            marks.wrote(&format!("s{n}"), id(10, n));
        }
        assert_eq!(marks.streams_to_check(["s7", "new"], 2), ["s7", "s0", "s1"]);
        assert!(marks.checking());
        // A stream of the pass written to later is checked before that write, whatever the chunk.
        assert_eq!(marks.streams_to_check(["s9"], 0), ["s9"]);
        assert_eq!(marks.streams_to_check([], 3), ["s2", "s3", "s4"]);
        assert_eq!(marks.streams_to_check(["s3"], 1), ["s5"], "s3 was checked in this pass");
        // A new connection begins the pass again.
        marks.reconnected();
        assert_eq!(marks.streams_to_check([], 1), ["s0"]);
        assert_eq!(marks.streams_to_check([], 100).len(), 9);
        assert!(!marks.checking() && !marks.check_due(), "the pass is done");
        assert!(marks.streams_to_check(["s1"], 100).is_empty());
    }

    #[test]
    fn adopted_marks_keep_the_later_of_each() {
        let mut marks = Marks::default();
        marks.wrote("a", id(20, 0));
        let at = SystemTime::now();
        marks.adopt([
            ("a".into(), Mark { id: id(10, 0), written_at: at }),
            ("b".into(), Mark { id: id(5, 0), written_at: at }),
        ]);
        let at = |last_id| Some(Found { last_id, ..Found::default() });
        let losses = marks.compare(vec![("a".into(), at(id(15, 0))), ("b".into(), at(id(5, 0)))]);
        assert_eq!(losses.len(), 1);
        assert_eq!(losses[0].expected.id, id(20, 0));
    }

    #[test]
    fn a_stream_deleted_and_written_to_again_has_added_fewer_entries() {
        let mut marks = Marks::default();
        marks.wrote("s", id(10, 0));
        let found = |last_id, added| {
            vec![(
                "s".to_string(),
                Some(Found { last_id, entries_added: Some(added), length: added, ..Found::default() }),
            )]
        };
        assert!(marks.compare(found(id(10, 0), 100)).is_empty());
        // Three more written; Redis added five (a replay, another writer): fine.
        for seq in 1..=3 {
            marks.wrote("s", id(11, seq));
        }
        assert!(marks.compare(found(id(11, 3), 105)).is_empty());
        // Two written after a DEL: the last ID is ours, but the stream added only two.
        marks.wrote("s", id(12, 0));
        marks.wrote("s", id(12, 1));
        let losses = marks.compare(found(id(12, 1), 2));
        assert_eq!(losses.len(), 1, "the stream was deleted and written to again");
    }

    /// What Redis 7 says of a stream: last ID, entries added, first entry, highest XDELed ID, length.
    fn redis7(last_id: StreamId, added: u64, first: StreamId, max_deleted: StreamId, length: u64) -> Option<Found> {
        Some(Found {
            last_id,
            entries_added: Some(added),
            first_id: Some(if length == 0 { id(0, 0) } else { first }),
            max_deleted: Some(max_deleted),
            length,
        })
    }

    #[test]
    fn a_stream_first_written_after_the_check_and_recreated_is_a_loss() {
        let mut marks = Marks::default();
        marks.wrote("new", id(10, 0));
        marks.wrote("new", id(11, 0));
        // FLUSHALL, then one more write: the stream holds 12-0 only; 10-0 was neither trimmed
        // nor deleted with XDEL.
        marks.wrote("new", id(12, 0));
        let losses = marks.compare(vec![("new".into(), redis7(id(12, 0), 1, id(12, 0), id(0, 0), 1))]);
        assert_eq!(losses.len(), 1);
        assert!(losses[0].recreated);
        assert_eq!(losses[0].expected.id, id(12, 0));
    }

    #[test]
    fn a_checked_stream_recreated_after_the_check_is_a_loss_without_writes_counted() {
        let mut marks = Marks::default();
        marks.wrote("s", id(10, 0));
        assert!(marks.compare(vec![("s".into(), redis7(id(10, 0), 1, id(10, 0), id(0, 0), 1))]).is_empty());
        // FLUSHALL right after the check, then two writes (and a third by someone else).
        marks.wrote("s", id(20, 0));
        marks.wrote("s", id(21, 0));
        let losses = marks.compare(vec![("s".into(), redis7(id(22, 0), 3, id(20, 0), id(0, 0), 3))]);
        assert_eq!(losses.len(), 1, "10-0 is gone, and nothing was ever trimmed from this stream");
    }

    #[test]
    fn an_adopted_mark_gone_from_a_recreated_stream_is_a_loss() {
        let mut marks = Marks::default();
        let at = SystemTime::now();
        marks.adopt([("s".into(), Mark { id: id(10, 0), written_at: at })]);
        marks.wrote("s", id(30, 0));
        let losses = marks.compare(vec![("s".into(), redis7(id(30, 0), 1, id(30, 0), id(0, 0), 1))]);
        assert_eq!(losses.len(), 1);
        // Adopted, and the stream is as it was (or trimmed, or emptied with XTRIM): no loss.
        for now in [
            redis7(id(10, 0), 5, id(6, 0), id(0, 0), 5),
            redis7(id(10, 0), 5, id(9, 0), id(0, 0), 2),
            redis7(id(10, 0), 5, id(0, 0), id(0, 0), 0),
        ] {
            let mut marks = Marks::default();
            marks.adopt([("s".into(), Mark { id: id(10, 0), written_at: at })]);
            assert!(marks.compare(vec![("s".into(), now)]).is_empty(), "{now:?}");
        }
    }

    #[test]
    fn trimming_and_xdel_are_not_losses() {
        // MAXLEN trimming by the relay: the first entries written since the check are trimmed,
        // and the stream added more than it holds.
        let mut marks = Marks::default();
        for ms in 10..20 {
            marks.wrote("trimmed", id(ms, 0));
        }
        assert!(marks.compare(vec![("trimmed".into(), redis7(id(19, 0), 10, id(15, 0), id(0, 0), 5))]).is_empty());
        for ms in 20..30 {
            marks.wrote("trimmed", id(ms, 0));
        }
        assert!(marks.compare(vec![("trimmed".into(), redis7(id(29, 0), 20, id(25, 0), id(0, 0), 5))]).is_empty());
        // XTRIM MAXLEN 0: empty, but it added entries.
        marks.wrote("emptied", id(40, 0));
        assert!(marks.compare(vec![("emptied".into(), redis7(id(40, 0), 1, id(0, 0), id(0, 0), 0))]).is_empty());
        // XDEL of the first entry written, or of every entry.
        marks.wrote("xdel", id(50, 0));
        marks.wrote("xdel", id(51, 0));
        assert!(marks.compare(vec![("xdel".into(), redis7(id(51, 0), 2, id(51, 0), id(50, 0), 1))]).is_empty());
        marks.wrote("xdel", id(52, 0));
        assert!(marks.compare(vec![("xdel".into(), redis7(id(52, 0), 3, id(0, 0), id(52, 0), 0))]).is_empty());
        // Redis 6: no counts, only the last generated ID.
        marks.wrote("old", id(60, 0));
        let redis6 = Some(Found { last_id: id(60, 0), ..Found::default() });
        assert!(marks.compare(vec![("old".into(), redis6)]).is_empty());
    }

    #[test]
    fn a_recreated_stream_trimmed_since_is_found_by_its_count() {
        let mut marks = Marks::default();
        marks.wrote("s", id(10, 0));
        // Recreated, then 6 written and trimmed to 5: something was trimmed, but the stream added
        // fewer than the 7 entries acknowledged from 10-0 on.
        for ms in 20..26 {
            marks.wrote("s", id(ms, 0));
        }
        assert_eq!(marks.compare(vec![("s".into(), redis7(id(25, 0), 6, id(21, 0), id(0, 0), 5))]).len(), 1);
    }

    #[test]
    fn the_least_recently_written_quarter_is_forgotten_at_the_limit() {
        let mut marks = Marks::default();
        for n in 0..MAX_STREAMS as u64 {
            marks.wrote(&format!("s{n}"), id(n + 1, 0));
        }
        assert_eq!(marks.forgotten, 0);
        marks.wrote("one more", id(1_000_000, 0));
        assert_eq!(marks.forgotten, (MAX_STREAMS / 4) as u64);
        assert_eq!(marks.streams().len(), MAX_STREAMS - MAX_STREAMS / 4 + 1);
        assert!(marks.streams().contains(&"one more".to_string()));
    }

    #[test]
    fn stream_ids_parse_and_order_as_redis_orders_them() {
        assert_eq!(StreamId::parse(b"1764446400123-7"), Some(id(1_764_446_400_123, 7)));
        assert_eq!(StreamId::parse(b"x-1"), None);
        assert!(id(2, 0) > id(1, 99));
        assert_eq!(id(3, 4).to_string(), "3-4");
    }
}
