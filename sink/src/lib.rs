//! outbox-sink: where events go. Redis Streams is the only sink today; this crate is the boundary
//! the relay talks to (`redis::RedisSink`, and the types below), so the relay never sees a Redis
//! type. It has no pgrx: the background worker inside the server and a relay outside it share it.
//!
//! - `redis`: the sink itself: one topology (a node, a master found through Sentinel, a Cluster)
//!   behind one `publish`, and what counts as a failure of Redis or of an entry.
//! - `node`: one node: connecting (credentials, TLS) and the MULTI/EXEC exchange with a deadline.
//! - `cluster`: hash slots and the slot map; `sentinel`: asking sentinels for the master.
//! - `address`: URLs (one node, or a list of nodes), the password file, and masking.
//! - `entry`: an event as a stream entry (native or CloudEvents fields, written as RESP).
//! - `marks`: each stream's last entry this relay wrote, to notice entries Redis lost.
//! - `event`: an event as the relay reads it from the log and sends it.

pub mod address;
pub mod cluster;
pub mod entry;
pub mod event;
pub mod marks;
pub mod node;
pub mod redis;
pub mod sentinel;
pub mod streams;

use std::time::Duration;

/// How the relay finds where to write (`outbox.redis_mode`): one node, a master through Sentinel,
/// or a Cluster.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RedisMode {
    /// `outbox.redis_url` is the one node.
    Standalone,
    /// `outbox.redis_url` lists the sentinels; they name the master `outbox.redis_sentinel_master`.
    Sentinel,
    /// `outbox.redis_url` lists seed nodes of a Redis Cluster.
    Cluster,
}

/// Everything needed to reach Redis, as configured by the `outbox.redis_*` settings.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct RedisConfig {
    pub url: String,
    pub mode: RedisMode,
    /// `outbox.redis_sentinel_master`: the master's name the sentinels know (Sentinel mode).
    pub sentinel_master: String,
    pub password_file: Option<String>,
    pub timeout: Duration,
    pub tls: TlsFiles,
    /// `outbox.redis_wait_replicas`: replicas that must have a batch before it counts as published.
    pub wait_replicas: u32,
    /// `outbox.replay_on_loss`: a loss found stops the round before it writes anything, so that
    /// the relays replay it first.
    pub replay_losses_first: bool,
}

/// `outbox.redis_tls_*`: where the certificates for a `rediss://` connection are. Read at every
/// (re)connect, so that rotated files take effect at the next connection.
#[derive(Clone, Default, PartialEq, Eq, Debug)]
pub struct TlsFiles {
    /// CA certificates (PEM) the server's certificate must chain to; `None`: the system's roots.
    pub ca_file: Option<String>,
    /// Client certificate and key (PEM) for servers that require them (mutual TLS).
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
}

impl TlsFiles {
    pub fn any(&self) -> bool {
        self.ca_file.is_some() || self.cert_file.is_some() || self.key_file.is_some()
    }
}

/// Redis as a whole is unusable: unreachable, timing out, out of memory, loading, read-only,
/// misconfigured, failing over. Never the events' fault, so it never counts against them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerError(pub String);

/// What a `BrokerError` says when an exchange outlasted `outbox.redis_timeout`.
pub const NO_ANSWER_IN_TIME: &str = "Redis did not answer within outbox.redis_timeout";

impl BrokerError {
    /// Redis did not answer an exchange in time (it may still have executed it).
    pub fn is_timeout(&self) -> bool {
        self.0.contains(NO_ANSWER_IN_TIME)
    }
}

impl std::fmt::Display for BrokerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// An entry ID as Redis assigns them (`<milliseconds>-<sequence>`), ordered as Redis orders them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct StreamId {
    /// Redis's clock when it added the entry, in milliseconds since 1970.
    pub ms: u64,
    pub seq: u64,
}

impl StreamId {
    /// Parses `<ms>-<seq>`.
    pub fn parse(text: &[u8]) -> Option<StreamId> {
        let text = std::str::from_utf8(text).ok()?;
        let (ms, seq) = text.split_once('-')?;
        Some(StreamId { ms: ms.parse().ok()?, seq: seq.parse().ok()? })
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

/// What happened to one entry of a published batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryOutcome {
    /// Redis stored the entry, under this ID (None if the reply was not one).
    Published(Option<StreamId>),
    /// Redis refused this entry because of the entry itself (e.g. WRONGTYPE: its stream key holds
    /// another type). Other entries are unaffected.
    Rejected(String),
    /// Redis refused this entry for a reason that concerns the whole server (OOM, LOADING, ...).
    BrokerRefused(String),
    /// Not executed: Redis discarded the transaction because another entry was refused. It goes
    /// back untouched and is sent again next round.
    NotSent,
}
