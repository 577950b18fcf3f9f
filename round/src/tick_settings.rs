//! What every step of a round is given: the settings it runs with, and the maps and sets it keeps
//! per event. A leaf: the steps (`read`, `publish`, `settle`, `replay`) and the round that calls
//! them all use it.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outbox_sink::entry::EntrySettings;

/// The round's per-event maps and sets: keyed by aggregates, so by the application's strings, and
/// looked up several times per event. foldhash is several times faster than the standard SipHash
/// on such short keys and, seeded per process, keeps a hostile choice of ids from degrading them.
pub type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
pub type Set<K> = HashSet<K, foldhash::fast::RandomState>;

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
    /// Where and how entries are written (`outbox.stream`, `outbox.stream_maxlen`,
    /// `outbox.stream_trim`, `outbox.entry_format`).
    pub entries: EntrySettings,
    /// Keep per-aggregate order (`outbox.ordering = aggregate`).
    pub in_order: bool,
    /// Read every shard held, not only those committed into since the last round (the relay asks
    /// for it once per poll interval, after a cut batch and after a failure).
    pub full_read: bool,
    pub max_attempts: i32,
    pub retry_delay_ms: i32,
    /// `outbox.redis_timeout`, named when a round timed out.
    pub redis_timeout: Duration,
    /// `outbox.replay_on_loss`: a loss found is repaired by a replay.
    pub replay_on_loss: bool,
}
