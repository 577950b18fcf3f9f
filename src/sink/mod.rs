//! Where events go. Redis Streams is the only sink today; this module is the boundary the worker
//! talks to (`redis::RedisSink`, and the types below), so the worker never sees a Redis type.
//!
//! - `redis`: the sink itself: one topology (a node, a master found through Sentinel, a Cluster)
//!   behind one `publish`, and what counts as a failure of Redis or of an entry.
//! - `node`: one node: connecting (credentials, TLS) and the MULTI/EXEC exchange with a deadline.
//! - `cluster`: hash slots and the slot map; `sentinel`: asking sentinels for the master.
//! - `address`: URLs (one node, or a list of nodes), the password file, and masking.

pub mod address;
pub mod cluster;
pub mod node;
pub mod redis;
pub mod sentinel;

use std::time::Duration;

pub use crate::guc::RedisMode;

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

impl std::fmt::Display for BrokerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What happened to one entry of a published batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryOutcome {
    /// Redis stored the entry.
    Published,
    /// Redis refused this entry because of the entry itself (e.g. WRONGTYPE: its stream key holds
    /// another type). Other entries are unaffected.
    Rejected(String),
    /// Redis refused this entry for a reason that concerns the whole server (OOM, LOADING, ...).
    BrokerRefused(String),
    /// Not executed: Redis discarded the transaction because another entry was refused. It goes
    /// back untouched and is sent again next round.
    NotSent,
}
