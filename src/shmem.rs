//! What backends and the relay worker share: where to find the relay's latch so that a committing
//! backend can wake it, and the relay's status for monitoring.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicUsize, Ordering};

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic, PgLwLock};

/// Most relays `outbox.workers` may ask for.
pub const MAX_RELAYS: usize = 16;

/// The relays' shared state. Plain atomics: it is read on every commit that enqueued, so it must
/// never take a lock.
#[derive(Default)]
pub struct RelayShared {
    /// Address of each relay's `PGPROC` (which lives in shared memory) by slot, 0 while none runs.
    relay_proc: [AtomicUsize; MAX_RELAYS],
    /// Process id of each relay by slot, 0 while none runs.
    relay_pid: [AtomicI32; MAX_RELAYS],
    /// Whether the relay's last contact with Redis succeeded.
    redis_connected: AtomicBool,
    /// When `LAST_ERROR` was set (PostgreSQL timestamp, microseconds since 2000), 0 if never.
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
    /// The database the relays serve (its OID), 0 before the first relay started: functions
    /// called in another database report no relay rather than this one's.
    relay_database: AtomicU32,
    /// Events the relays published since the server started (`outbox.stats.published_total`).
    published_total: AtomicI64,
    /// A database being dropped (its OID), set by the drop hook in the dropping backend: the relays
    /// connected to it exit so that DROP DATABASE does not find them there. 0 when none.
    step_aside_for: AtomicU32,
    /// Shards (one bit each) that transactions committed events into since the relays last looked:
    /// a round reads only these, and every shard once per poll interval.
    committed_shards: AtomicU32,
}

/// The relay's most recent error message, truncated to fit; shown in `outbox.stats`.
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

// SAFETY: plain bytes, valid in shared memory.
unsafe impl PGRXSharedMemory for ErrorText {}

// SAFETY: the name is unique to this extension.
static LAST_ERROR: PgLwLock<ErrorText> = unsafe { PgLwLock::new(c"outbox_pg_last_error") };

// SAFETY: only atomics inside, valid in shared memory across processes.
unsafe impl PGRXSharedMemory for RelayShared {}

// SAFETY: the name is unique to this extension.
static RELAY: PgAtomic<RelayShared> = unsafe { PgAtomic::new(c"outbox_pg_relay") };

/// Requests the shared memory; must be called from `_PG_init` while preloading.
pub fn init() {
    pg_shmem_init!(RELAY);
    pg_shmem_init!(LAST_ERROR);
}

/// Records the relay's latest error for `outbox.stats`.
pub fn set_last_error(message: &str) {
    let mut text = LAST_ERROR.exclusive();
    // Truncate on a character boundary so the text stays valid UTF-8.
    let mut len = message.len().min(ERROR_TEXT_CAPACITY);
    while !message.is_char_boundary(len) {
        len -= 1;
    }
    text.bytes[..len].copy_from_slice(&message.as_bytes()[..len]);
    text.len = len;
    // SAFETY: reads the clock; no preconditions.
    RELAY.get().last_error_at.store(unsafe { pg_sys::GetCurrentTimestamp() }, Ordering::SeqCst);
}

/// The relay's latest error and when it happened, if any.
pub fn last_error() -> Option<(String, i64)> {
    let at = RELAY.get().last_error_at.load(Ordering::SeqCst);
    if at == 0 {
        return None;
    }
    let text = LAST_ERROR.share();
    Some((String::from_utf8_lossy(&text.bytes[..text.len]).into_owned(), at))
}

fn now_us() -> i64 {
    // SAFETY: reads the clock; no preconditions.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Claims the housekeeping if it is due: true for exactly one relay per due time. The claimer
/// pushes the due time `busy_interval` ahead at once, so that a claimer that hangs is replaced by
/// another relay after that interval.
pub fn claim_housekeeping(busy_interval: std::time::Duration) -> bool {
    let due = &RELAY.get().housekeeping_due;
    let current = due.load(Ordering::SeqCst);
    let now = now_us();
    now >= current
        && due
            .compare_exchange(current, now + busy_interval.as_micros() as i64, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
}

/// Sets when the next housekeeping is due, `after` from now.
pub fn schedule_housekeeping(after: std::time::Duration) {
    RELAY.get().housekeeping_due.store(now_us() + after.as_micros() as i64, Ordering::SeqCst);
}

/// How long until the next housekeeping is due (zero if it is).
pub fn until_housekeeping() -> std::time::Duration {
    let left = RELAY.get().housekeeping_due.load(Ordering::SeqCst) - now_us();
    std::time::Duration::from_micros(left.max(0) as u64)
}

/// The age alert's state shared by the relays: when its WARNING was last logged, if it is on.
pub fn alert_logged_at() -> Option<std::time::Duration> {
    let at = RELAY.get().alert_logged_at.load(Ordering::SeqCst);
    (at != 0).then(|| std::time::Duration::from_micros((now_us() - at).max(0) as u64))
}

pub fn set_alert_logged(on: bool) {
    RELAY.get().alert_logged_at.store(if on { now_us() } else { 0 }, Ordering::SeqCst);
}

/// Whether the armed fault already fired; `arm` false re-arms it.
pub fn fault_fired() -> bool {
    RELAY.get().fault_fired.load(Ordering::SeqCst)
}

pub fn set_fault_fired(fired: bool) {
    RELAY.get().fault_fired.store(fired, Ordering::SeqCst);
}

/// Called by the relay in `slot` once it runs: from now on commits wake it.
pub fn register_relay(slot: usize) {
    // SAFETY: MyProc is this process's PGPROC, set up before a worker's main function runs.
    let proc = unsafe { pg_sys::MyProc } as usize;
    // SAFETY: MyProcPid is set for every backend.
    let pid = unsafe { pg_sys::MyProcPid };
    // SAFETY: set when the worker connected to its database.
    let database = unsafe { pg_sys::MyDatabaseId }.to_u32();
    RELAY.get().relay_database.store(database, Ordering::SeqCst);
    // Connected, so a drop of this database that asked relays to step aside has failed (the
    // connection waited for it to end): the request is void.
    let _ = RELAY.get().step_aside_for.compare_exchange(database, 0, Ordering::SeqCst, Ordering::SeqCst);
    RELAY.get().relay_pid[slot].store(pid, Ordering::SeqCst);
    RELAY.get().relay_proc[slot].store(proc, Ordering::SeqCst);
}

/// Called by the relay in `slot` when it stops.
pub fn unregister_relay(slot: usize) {
    RELAY.get().relay_proc[slot].store(0, Ordering::SeqCst);
    RELAY.get().relay_pid[slot].store(0, Ordering::SeqCst);
    if slot == 0 {
        RELAY.get().redis_connected.store(false, Ordering::SeqCst);
    }
}

/// Whether the relays are paused; set by them from `outbox.enabled` on every loop.
pub fn set_paused(paused: bool) {
    RELAY.get().paused.store(paused, Ordering::Relaxed);
}

pub fn set_redis_connected(connected: bool) {
    RELAY.get().redis_connected.store(connected, Ordering::Relaxed);
}

/// Process id of the relay in `slot`, if one runs there.
pub fn relay_pid_in(slot: usize) -> Option<i32> {
    Some(RELAY.get().relay_pid[slot].load(Ordering::SeqCst)).filter(|&pid| pid != 0)
}

/// Whether the relays serve the database this process is connected to. Everything that reports
/// on the relays (`outbox.stats`, `outbox.relays()`, `relay_pid()`) asks this first, so that the
/// stats of a database tell that database's truth.
pub fn relays_serve_this_database() -> bool {
    // SAFETY: MyDatabaseId is set once a backend is connected (InvalidOid before, which no relay has).
    let here = unsafe { pg_sys::MyDatabaseId }.to_u32();
    here != 0 && RELAY.get().relay_database.load(Ordering::SeqCst) == here
}

/// The database the relays serve, if one ever started.
pub fn relay_database() -> Option<pg_sys::Oid> {
    Some(RELAY.get().relay_database.load(Ordering::SeqCst)).filter(|&oid| oid != 0).map(pg_sys::Oid::from)
}

/// Records, after a commit, the shards it enqueued into.
pub fn mark_shards_committed(shards: u32) {
    RELAY.get().committed_shards.fetch_or(shards, Ordering::SeqCst);
}

/// Takes, of the shards in `mine`, those committed into since the last call (a relay, at the start
/// of a round); the other relays' shards are left flagged for them.
pub fn take_committed_shards(mine: u32) -> u32 {
    RELAY.get().committed_shards.fetch_and(!mine, Ordering::SeqCst) & mine
}

/// Counts events a relay published (after the settle committed).
pub fn add_published(events: i64) {
    RELAY.get().published_total.fetch_add(events, Ordering::Relaxed);
}

pub fn published_total() -> i64 {
    RELAY.get().published_total.load(Ordering::Relaxed)
}

/// Asks the relays connected to `database` to exit (it is being dropped), and wakes them.
pub fn request_step_aside(database: pg_sys::Oid) {
    RELAY.get().step_aside_for.store(database.to_u32(), Ordering::SeqCst);
    set_every_relay_latch();
}

/// Whether the database this relay is connected to is being dropped.
pub fn step_aside_requested() -> bool {
    // SAFETY: set when the worker connected to its database.
    let here = unsafe { pg_sys::MyDatabaseId }.to_u32();
    here != 0 && RELAY.get().step_aside_for.load(Ordering::SeqCst) == here
}

/// Process id of the first running relay, if any.
pub fn relay_pid() -> Option<i32> {
    (0..MAX_RELAYS).find_map(relay_pid_in)
}

/// How many relays are running.
pub fn relays_running() -> i32 {
    (0..MAX_RELAYS).filter(|&slot| relay_pid_in(slot).is_some()).count() as i32
}

pub fn redis_connected() -> bool {
    RELAY.get().redis_connected.load(Ordering::Relaxed)
}

/// Sets every running relay's latch. Safe to call from a commit callback: no lock, no allocation,
/// no error. If a relay exited and another process now uses that PGPROC, that process sees a
/// spurious latch wake-up, which every latch user must tolerate anyway.
pub fn wake_relays() {
    if RELAY.get().paused.load(Ordering::Relaxed) {
        // Re-enabling is a reload, which wakes each relay by itself (SIGHUP).
        return;
    }
    set_every_relay_latch();
}

fn set_every_relay_latch() {
    for slot in &RELAY.get().relay_proc {
        let proc = slot.load(Ordering::SeqCst) as *mut pg_sys::PGPROC;
        if !proc.is_null() {
            // SAFETY: PGPROCs live in shared memory for the life of the cluster; the pointer was
            // published by a relay itself and stays a valid PGPROC even after that relay exits.
            unsafe { pg_sys::SetLatch(&raw mut (*proc).procLatch) };
        }
    }
}
