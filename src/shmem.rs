//! What backends, the launcher and the relays share: per relayed database, where to find its
//! relays' latches so that a committing backend can wake them, and their status for monitoring;
//! for the launcher, its latch and the rescan requests of `CREATE EXTENSION` / `CREATE DATABASE`.
//!
//! The launcher owns the assignment of entries to databases: it claims an entry before it starts a
//! database's first relay and releases it once that database's relays are gone. Everyone else finds
//! their database's entry by its OID (`MyDatabaseId`), so a backend in a database without relays
//! finds none and reports no relay.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU8, AtomicUsize, Ordering};

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic, PgLwLock};

/// Most relays `outbox.workers` may ask for, per database.
pub const MAX_RELAYS: usize = 16;
/// Most databases relayed at once (each needs one entry; see docs/worker.md).
pub const MAX_DATABASES: usize = 16;

/// Whether the extension is installed in an entry's database, as its relays found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtensionState {
    /// No relay has looked yet (the launcher starts one relay to find out).
    Unknown = 0,
    Present = 1,
    /// A relay found it missing and exited; the launcher starts none until a rescan is requested.
    Missing = 2,
}

/// One relayed database's shared state. Plain atomics: it is read on every commit that enqueued,
/// so it must never take a lock.
#[derive(Default)]
pub struct DatabaseShared {
    /// The database (its OID), 0 while the entry is free. Written only by the launcher.
    database: AtomicU32,
    /// `ExtensionState`, as the relays last found it.
    extension: AtomicU8,
    /// Address of each relay's `PGPROC` (which lives in shared memory) by slot, 0 while none runs.
    relay_proc: [AtomicUsize; MAX_RELAYS],
    /// Process id of each relay by slot, 0 while none runs.
    relay_pid: [AtomicI32; MAX_RELAYS],
    /// Whether the relays' last contact with Redis succeeded.
    redis_connected: AtomicBool,
    /// When the entry's last error was set (PostgreSQL timestamp, µs since 2000), 0 if never.
    last_error_at: AtomicI64,
    /// Set once `outbox.fault_injection` fired, so that it fires once per arming.
    fault_fired: AtomicBool,
    /// When the next housekeeping is due (PostgreSQL timestamp, µs); whichever relay gets there
    /// first does it, so a hung relay never stops the lease reaper or the age alert.
    housekeeping_due: AtomicI64,
    /// When the age WARNING was last logged while the alert is on; 0 while it is off.
    alert_logged_at: AtomicI64,
    /// Set while the relays are paused (`outbox.enabled = off`): committing backends then leave
    /// them asleep instead of waking them for nothing on every commit.
    paused: AtomicBool,
    /// Events the relays published since the entry was claimed (`outbox.stats.published_total`).
    published_total: AtomicI64,
    /// Shards (one bit each) that transactions committed events into since the relays last looked:
    /// a round reads only these, and every shard once per poll interval.
    committed_shards: AtomicU32,
}

/// What the whole cluster shares.
#[derive(Default)]
pub struct RelayShared {
    databases: [DatabaseShared; MAX_DATABASES],
    /// A database being dropped (its OID), set by the drop hook in the dropping backend: the relays
    /// connected to it exit so that DROP DATABASE does not find them there. 0 when none.
    step_aside_for: AtomicU32,
    /// The launcher's `PGPROC`, 0 while it does not run: set to wake it for a rescan.
    launcher_proc: AtomicUsize,
    /// Bumped by every committed `CREATE EXTENSION` or `CREATE DATABASE`: the launcher looks again
    /// at the databases where it found no extension.
    rescan_generation: AtomicU32,
}

/// An entry's most recent error message, truncated to fit; shown in `outbox.stats`.
pub struct ErrorText {
    len: usize,
    bytes: [u8; ERROR_TEXT_CAPACITY],
}

const ERROR_TEXT_CAPACITY: usize = 512;

impl Default for ErrorText {
    fn default() -> Self {
        ErrorText { len: 0, bytes: [0; ERROR_TEXT_CAPACITY] }
    }
}

/// The error texts of all entries, under one lock (they are written rarely).
#[derive(Default)]
pub struct ErrorTexts([ErrorText; MAX_DATABASES]);

// SAFETY: plain bytes, valid in shared memory.
unsafe impl PGRXSharedMemory for ErrorTexts {}

// SAFETY: the name is unique to this extension.
static LAST_ERROR: PgLwLock<ErrorTexts> = unsafe { PgLwLock::new(c"outbox_pg_last_error") };

// SAFETY: only atomics inside, valid in shared memory across processes.
unsafe impl PGRXSharedMemory for RelayShared {}

// SAFETY: the name is unique to this extension.
static RELAY: PgAtomic<RelayShared> = unsafe { PgAtomic::new(c"outbox_pg_relay") };

/// Requests the shared memory; must be called from `_PG_init` while preloading.
pub fn init() {
    pg_shmem_init!(RELAY);
    pg_shmem_init!(LAST_ERROR);
}

fn now_us() -> i64 {
    // SAFETY: reads the clock; no preconditions.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

fn my_database() -> u32 {
    // SAFETY: MyDatabaseId is set once a backend is connected (InvalidOid before, which no entry has).
    unsafe { pg_sys::MyDatabaseId }.to_u32()
}

/// The entry of the database this process is connected to, if the launcher serves it.
pub fn this_entry() -> Option<usize> {
    entry_of(pg_sys::Oid::from(my_database()))
}

fn here() -> Option<&'static DatabaseShared> {
    this_entry().map(|entry| &RELAY.get().databases[entry])
}

// ---- The launcher's side -------------------------------------------------------------------

/// The entry assigned to `database`, if any.
pub fn entry_of(database: pg_sys::Oid) -> Option<usize> {
    let database = database.to_u32();
    (database != 0).then_some(())?;
    RELAY.get().databases.iter().position(|entry| entry.database.load(Ordering::SeqCst) == database)
}

/// The databases that have an entry (left by a previous launcher, for one that starts).
pub fn assigned_databases() -> Vec<(usize, pg_sys::Oid)> {
    let shared = RELAY.get();
    (0..MAX_DATABASES)
        .filter_map(|entry| {
            let database = shared.databases[entry].database.load(Ordering::SeqCst);
            (database != 0).then(|| (entry, pg_sys::Oid::from(database)))
        })
        .collect()
}

/// Assigns a free entry to `database`, its state reset; `None` when all are taken.
pub fn claim_entry(database: pg_sys::Oid) -> Option<usize> {
    let shared = RELAY.get();
    let entry = shared.databases.iter().position(|entry| entry.database.load(Ordering::SeqCst) == 0)?;
    let state = &shared.databases[entry];
    state.extension.store(ExtensionState::Unknown as u8, Ordering::SeqCst);
    state.redis_connected.store(false, Ordering::SeqCst);
    state.last_error_at.store(0, Ordering::SeqCst);
    state.fault_fired.store(false, Ordering::SeqCst);
    state.housekeeping_due.store(0, Ordering::SeqCst);
    state.alert_logged_at.store(0, Ordering::SeqCst);
    state.paused.store(false, Ordering::SeqCst);
    state.published_total.store(0, Ordering::SeqCst);
    state.committed_shards.store(0, Ordering::SeqCst);
    crate::claims::reset(entry);
    // Last: from now on backends in that database find the entry.
    state.database.store(database.to_u32(), Ordering::SeqCst);
    Some(entry)
}

/// Frees an entry whose relays are all gone.
pub fn release_entry(entry: usize) {
    RELAY.get().databases[entry].database.store(0, Ordering::SeqCst);
}

pub fn extension_state(entry: usize) -> ExtensionState {
    match RELAY.get().databases[entry].extension.load(Ordering::SeqCst) {
        1 => ExtensionState::Present,
        2 => ExtensionState::Missing,
        _ => ExtensionState::Unknown,
    }
}

/// Process id of the relay in `slot` of `entry`, if one runs there.
pub fn relay_pid_at(entry: usize, slot: usize) -> Option<i32> {
    Some(RELAY.get().databases[entry].relay_pid[slot].load(Ordering::SeqCst)).filter(|&pid| pid != 0)
}

/// Called by the launcher once it runs: committed `CREATE EXTENSION`s wake it from now on.
pub fn register_launcher() {
    // SAFETY: MyProc is this process's PGPROC, set up before a worker's main function runs.
    RELAY.get().launcher_proc.store(unsafe { pg_sys::MyProc } as usize, Ordering::SeqCst);
}

pub fn unregister_launcher() {
    RELAY.get().launcher_proc.store(0, Ordering::SeqCst);
}

pub fn rescan_generation() -> u32 {
    RELAY.get().rescan_generation.load(Ordering::SeqCst)
}

/// After a commit that created an extension or a database: the launcher looks again at every
/// database it found without the extension. No lock, no allocation, no error (commit callback).
pub fn request_rescan() {
    RELAY.get().rescan_generation.fetch_add(1, Ordering::SeqCst);
    let proc = RELAY.get().launcher_proc.load(Ordering::SeqCst) as *mut pg_sys::PGPROC;
    if !proc.is_null() {
        // SAFETY: as in `set_latches`: a PGPROC stays a valid PGPROC for the life of the cluster.
        unsafe { pg_sys::SetLatch(&raw mut (*proc).procLatch) };
    }
}

/// Records an error for the database of `entry` (the launcher's: a relay it could not start).
pub fn set_error_at(entry: usize, message: &str) {
    let mut texts = LAST_ERROR.exclusive();
    let text = &mut texts.0[entry];
    // Truncate on a character boundary so the text stays valid UTF-8.
    let mut len = message.len().min(ERROR_TEXT_CAPACITY);
    while !message.is_char_boundary(len) {
        len -= 1;
    }
    text.bytes[..len].copy_from_slice(&message.as_bytes()[..len]);
    text.len = len;
    RELAY.get().databases[entry].last_error_at.store(now_us(), Ordering::SeqCst);
}

// ---- A relay's side (its own database's entry) ---------------------------------------------

/// Records the relays' latest error for `outbox.stats`.
pub fn set_last_error(message: &str) {
    if let Some(entry) = this_entry() {
        set_error_at(entry, message);
    }
}

/// Claims the housekeeping if it is due: true for exactly one relay per due time. The claimer
/// pushes the due time `busy_interval` ahead at once, so that a claimer that hangs is replaced by
/// another relay after that interval.
pub fn claim_housekeeping(busy_interval: std::time::Duration) -> bool {
    let Some(here) = here() else { return false };
    let due = &here.housekeeping_due;
    let current = due.load(Ordering::SeqCst);
    let now = now_us();
    now >= current
        && due
            .compare_exchange(current, now + busy_interval.as_micros() as i64, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
}

/// Sets when the next housekeeping is due, `after` from now.
pub fn schedule_housekeeping(after: std::time::Duration) {
    if let Some(here) = here() {
        here.housekeeping_due.store(now_us() + after.as_micros() as i64, Ordering::SeqCst);
    }
}

/// How long until the next housekeeping is due (zero if it is).
pub fn until_housekeeping() -> std::time::Duration {
    let left = here().map_or(0, |here| here.housekeeping_due.load(Ordering::SeqCst) - now_us());
    std::time::Duration::from_micros(left.max(0) as u64)
}

/// The age alert's state shared by the relays: when its WARNING was last logged, if it is on.
pub fn alert_logged_at() -> Option<std::time::Duration> {
    let at = here()?.alert_logged_at.load(Ordering::SeqCst);
    (at != 0).then(|| std::time::Duration::from_micros((now_us() - at).max(0) as u64))
}

pub fn set_alert_logged(on: bool) {
    if let Some(here) = here() {
        here.alert_logged_at.store(if on { now_us() } else { 0 }, Ordering::SeqCst);
    }
}

/// Whether the armed fault already fired; `arm` false re-arms it.
pub fn fault_fired() -> bool {
    here().is_some_and(|here| here.fault_fired.load(Ordering::SeqCst))
}

pub fn set_fault_fired(fired: bool) {
    if let Some(here) = here() {
        here.fault_fired.store(fired, Ordering::SeqCst);
    }
}

/// Called by the relay in `slot` once it runs: from now on commits wake it. False when the
/// launcher released its database's entry meanwhile (the relay then exits).
pub fn register_relay(slot: usize) -> bool {
    let Some(here) = here() else { return false };
    // SAFETY: MyProc is this process's PGPROC, set up before a worker's main function runs.
    let proc = unsafe { pg_sys::MyProc } as usize;
    // SAFETY: MyProcPid is set for every backend.
    let pid = unsafe { pg_sys::MyProcPid };
    // Connected, so a drop of this database that asked relays to step aside has failed (the
    // connection waited for it to end): the request is void.
    let _ = RELAY.get().step_aside_for.compare_exchange(my_database(), 0, Ordering::SeqCst, Ordering::SeqCst);
    here.relay_pid[slot].store(pid, Ordering::SeqCst);
    here.relay_proc[slot].store(proc, Ordering::SeqCst);
    true
}

/// Called by the relay in `slot` when it stops.
pub fn unregister_relay(slot: usize) {
    if let Some(here) = here() {
        here.relay_proc[slot].store(0, Ordering::SeqCst);
        here.relay_pid[slot].store(0, Ordering::SeqCst);
        if (0..MAX_RELAYS).all(|slot| here.relay_pid[slot].load(Ordering::SeqCst) == 0) {
            here.redis_connected.store(false, Ordering::SeqCst);
        }
    }
}

/// What a relay found: the extension installed (or not) in its database. Returns what the relays
/// had found before, so that one of them (the first to notice) reports a change.
pub fn set_extension_state(state: ExtensionState) -> ExtensionState {
    let Some(here) = here() else { return ExtensionState::Unknown };
    match here.extension.swap(state as u8, Ordering::SeqCst) {
        1 => ExtensionState::Present,
        2 => ExtensionState::Missing,
        _ => ExtensionState::Unknown,
    }
}

/// Whether the relays are paused; set by them from `outbox.enabled` on every loop.
pub fn set_paused(paused: bool) {
    if let Some(here) = here() {
        here.paused.store(paused, Ordering::Relaxed);
    }
}

pub fn set_redis_connected(connected: bool) {
    if let Some(here) = here() {
        here.redis_connected.store(connected, Ordering::Relaxed);
    }
}

/// Records, after a commit, the shards it enqueued into.
pub fn mark_shards_committed(shards: u32) {
    if let Some(here) = here() {
        here.committed_shards.fetch_or(shards, Ordering::SeqCst);
    }
}

/// Takes, of the shards in `mine`, those committed into since the last call (a relay, at the start
/// of a round); the other relays' shards are left flagged for them.
pub fn take_committed_shards(mine: u32) -> u32 {
    here().map_or(0, |here| here.committed_shards.fetch_and(!mine, Ordering::SeqCst) & mine)
}

/// Counts events a relay published (after the settle committed).
pub fn add_published(events: i64) {
    if let Some(here) = here() {
        here.published_total.fetch_add(events, Ordering::Relaxed);
    }
}

/// Asks the relays connected to `database` to exit (it is being dropped), and wakes them.
pub fn request_step_aside(database: pg_sys::Oid) {
    RELAY.get().step_aside_for.store(database.to_u32(), Ordering::SeqCst);
    if let Some(entry) = entry_of(database) {
        set_latches(&RELAY.get().databases[entry]);
    }
}

/// Whether the database this relay is connected to is being dropped.
pub fn step_aside_requested() -> bool {
    let here = my_database();
    here != 0 && RELAY.get().step_aside_for.load(Ordering::SeqCst) == here
}

// ---- What backends report (`outbox.stats`, `outbox.relays()`) -------------------------------

/// Whether the launcher serves the database this process is connected to. Everything that reports
/// on the relays asks this first, so that the stats of a database tell that database's truth.
pub fn relays_serve_this_database() -> bool {
    this_entry().is_some()
}

/// Process id of the relay in `slot` of this database, if one runs there.
pub fn relay_pid_in(slot: usize) -> Option<i32> {
    this_entry().and_then(|entry| relay_pid_at(entry, slot))
}

/// Process id of this database's first running relay, if any.
pub fn relay_pid() -> Option<i32> {
    (0..MAX_RELAYS).find_map(relay_pid_in)
}

/// How many relays run in this database.
pub fn relays_running() -> i32 {
    (0..MAX_RELAYS).filter(|&slot| relay_pid_in(slot).is_some()).count() as i32
}

pub fn redis_connected() -> bool {
    here().is_some_and(|here| here.redis_connected.load(Ordering::Relaxed))
}

pub fn published_total() -> i64 {
    here().map_or(0, |here| here.published_total.load(Ordering::Relaxed))
}

/// This database's latest relay error and when it happened, if any.
pub fn last_error() -> Option<(String, i64)> {
    let entry = this_entry()?;
    let at = RELAY.get().databases[entry].last_error_at.load(Ordering::SeqCst);
    if at == 0 {
        return None;
    }
    let texts = LAST_ERROR.share();
    let text = &texts.0[entry];
    Some((String::from_utf8_lossy(&text.bytes[..text.len]).into_owned(), at))
}

/// Sets the latches of this database's running relays. Safe to call from a commit callback: no
/// lock, no allocation, no error.
pub fn wake_relays() {
    let Some(here) = here() else { return };
    if here.paused.load(Ordering::Relaxed) {
        // Re-enabling is a reload, which wakes each relay by itself (SIGHUP).
        return;
    }
    set_latches(here);
}

/// If a relay exited and another process now uses that PGPROC, that process sees a spurious latch
/// wake-up, which every latch user must tolerate anyway.
fn set_latches(database: &DatabaseShared) {
    for slot in &database.relay_proc {
        let proc = slot.load(Ordering::SeqCst) as *mut pg_sys::PGPROC;
        if !proc.is_null() {
            // SAFETY: PGPROCs live in shared memory for the life of the cluster; the pointer was
            // published by a relay itself and stays a valid PGPROC even after that relay exits.
            unsafe { pg_sys::SetLatch(&raw mut (*proc).procLatch) };
        }
    }
}
