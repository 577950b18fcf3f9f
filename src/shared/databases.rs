//! The entries of shared memory, one per relayed database, and how a process finds its own:
//! what both the rest of `shared` and the relays' rounds in flight (`in_flight`) index by.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};

use pgrx::prelude::*;

use crate::shared::sized::{SharedArray, Zeroed};

/// Most relays `outbox.workers` may ask for, per database.
pub const MAX_RELAYS: usize = 16;

/// One relayed database's shared state. Plain atomics: it is read on every commit that enqueued,
/// so it must never take a lock.
pub struct DatabaseShared {
    /// The database (its OID), 0 while the entry is free. Written only by the launcher.
    pub(super) database: AtomicU32,
    /// `ExtensionState`, as the relays last found it.
    pub(super) extension: AtomicU8,
    /// Address of each relay's `PGPROC` (which lives in shared memory) by slot, 0 while none runs.
    pub(super) relay_proc: [AtomicUsize; MAX_RELAYS],
    /// Process id of each relay by slot, 0 while none runs.
    pub(super) relay_pid: [AtomicI32; MAX_RELAYS],
    /// When each relay last went round its loop (PostgreSQL timestamp, µs): a relay that has not
    /// for longer than `outbox.lease` hangs (SIGSTOP, a stuck call) and does not count when the
    /// others divide the shards among themselves.
    pub(super) relay_alive_at: [AtomicI64; MAX_RELAYS],
    /// Whether the relays' last contact with Redis succeeded.
    pub(super) redis_connected: AtomicBool,
    /// When the entry's last error was set (PostgreSQL timestamp, µs since 2000), 0 if never.
    pub(super) last_error_at: AtomicI64,
    /// When the next housekeeping is due (PostgreSQL timestamp, µs); whichever relay gets there
    /// first does it, so a hung relay never stops the lease reaper or the age alert.
    pub(super) housekeeping_due: AtomicI64,
    /// When the age WARNING was last logged while the alert is on; 0 while it is off.
    pub(super) alert_logged_at: AtomicI64,
    /// Set while the relays are paused (`outbox.enabled = off`): committing backends then leave
    /// them asleep instead of waking them for nothing on every commit.
    pub(super) paused: AtomicBool,
    /// Events the relays published since the entry was claimed (`outbox.stats.published_total`).
    pub(super) published_total: AtomicI64,
    /// Shards (one bit each) that transactions committed events into since the relays last looked:
    /// a round reads only these, and every shard once per poll interval.
    pub(super) committed_shards: AtomicU32,
    /// Set when a replay was asked for (`outbox.replay`), and by a relay that starts (it may have
    /// left one unfinished): the relays look for replays to run until one finds none.
    pub(super) replay_requested: AtomicBool,
    /// Loss repairs (src/relay/losses.rs): raised when a relay records a loss with
    /// `outbox.replay_on_loss`, when housekeeping finds a repair running, and when the entry is
    /// claimed (a repair may be left unfinished); `repairs_seen` is the count a relay had read
    /// before it found no repair running. While they differ no relay of the database starts a
    /// live round.
    pub(super) repairs_raised: AtomicU64,
    pub(super) repairs_seen: AtomicU64,
    /// Process id of a backend running a statement that needs the database without sessions
    /// (`DROP DATABASE`, `CREATE DATABASE ... TEMPLATE`, `ALTER DATABASE ... RENAME` or `SET
    /// TABLESPACE`), 0 when none: until that backend's transaction ends, the relays connected to it
    /// leave, a relay that connects leaves at once, and the launcher starts none.
    pub(super) step_aside_by: AtomicI32,
}

// SAFETY: only atomics, which all-zero bytes make valid (0, false, null), shared by processes.
unsafe impl Zeroed for DatabaseShared {}

// SAFETY: the name is unique to this extension.
pub(super) static DATABASES: SharedArray<DatabaseShared> = unsafe { SharedArray::new(c"outbox_pg_databases") };
/// How many database entries there are: `outbox.max_databases` at server start.
pub fn database_entries() -> usize {
    DATABASES.get().len()
}

pub(super) fn my_database() -> u32 {
    // SAFETY: MyDatabaseId is set once a backend is connected (InvalidOid before, which no entry has).
    unsafe { pg_sys::MyDatabaseId }.to_u32()
}

/// The entry of the database this process is connected to, if the launcher serves it. Every
/// commit that enqueued asks, so the entry found last is checked first, not all of them.
pub fn this_entry() -> Option<usize> {
    thread_local! {
        static FOUND: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    let database = my_database();
    let found = FOUND.get();
    if database != 0
        && DATABASES.get().get(found).is_some_and(|entry| entry.database.load(Ordering::SeqCst) == database)
    {
        return Some(found);
    }
    let entry = entry_of(pg_sys::Oid::from(database))?;
    FOUND.set(entry);
    Some(entry)
}

/// The entry assigned to `database`, if any.
pub fn entry_of(database: pg_sys::Oid) -> Option<usize> {
    let database = database.to_u32();
    (database != 0).then_some(())?;
    DATABASES.get().iter().position(|entry| entry.database.load(Ordering::SeqCst) == database)
}
