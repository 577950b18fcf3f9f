//! What a round takes from the log: an event with its place in the publish order, the round's
//! allowance, and what a shard's read gives back. The rule that reads a window is the worker's
//! index walk (src/log/window.rs) or the SQL function `outbox._read_window` outside the server
//! (`Statements::read_window`).

use outbox_sink::event::OutboxEvent;

use crate::snapshot::Snapshot;

/// Most events one round takes from the log, over all the shards it reads.
pub const ROUND_EVENTS: usize = 10_000;
/// About how many bytes of events one round takes from the log (at least one event, however large).
pub const ROUND_BYTES: usize = 16 * 1024 * 1024;

/// An event of a window, with the transaction that wrote it.
#[derive(Debug, Clone)]
pub struct LogEvent {
    pub txid: u64,
    /// In a window published in parts, the largest `id` of its transaction in its shard; in a
    /// window read whole, its own `id`. Events go out in (`txn_max_id`, `id`) order.
    pub txn_max_id: i64,
    /// `aggregate_seq` is 0: the relay assigns it (round/src/read.rs).
    pub event: OutboxEvent,
}

impl LogEvent {
    /// Where the event stands in its window's publish order.
    pub fn position(&self) -> Position {
        (self.txn_max_id, self.event.id)
    }
}

/// One shard's part of a round.
#[derive(Debug, Default)]
pub struct WindowRead {
    /// In publish order.
    pub events: Vec<LogEvent>,
    /// Whether these events finish the window: the shard's cursor may move to its `upto`.
    pub complete: bool,
    /// Where the window stands after these events, when they do not finish it.
    pub position: Option<Position>,
}

/// One shard's read as a round asks for it: the window between `cursor` and `upto`, from `from` on
/// (a window published in parts).
#[derive(Debug, Clone)]
pub struct WindowAsk {
    pub shard: i16,
    pub cursor: Snapshot,
    pub upto: Snapshot,
    pub from: Option<Position>,
}

/// A place in a window's publish order: (a transaction's largest id, an id of that transaction).
/// Everything at or before it is consumed.
pub type Position = (i64, i64);

/// What is left of a round's allowance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub events: usize,
    pub bytes: usize,
    /// Events taken so far this round.
    pub taken: usize,
}

impl Budget {
    /// A round's of at most `events` events (fewer than `ROUND_EVENTS` after exchanges that timed
    /// out: round/src/state.rs, `RoundAllowance`).
    pub fn round_of(events: usize) -> Budget {
        Budget { events: events.clamp(1, ROUND_EVENTS), bytes: ROUND_BYTES, taken: 0 }
    }

    pub fn exhausted(&self) -> bool {
        self.events == 0 || self.bytes == 0
    }

    /// Whether an event of `size` bytes may still be taken: a round's first always may, however
    /// large, so that no event is too large to publish.
    pub fn allows(&self, size: usize) -> bool {
        self.events > 0 && (size <= self.bytes || self.taken == 0)
    }

    pub fn take(&mut self, size: usize) {
        self.events = self.events.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(size);
        self.taken += 1;
    }
}
