//! What backends, the launcher and the relays share: per relayed database, where to find its
//! relays' latches so that a committing backend can wake them, and their status for monitoring;
//! for the launcher, its latch and the rescan requests of `CREATE EXTENSION` / `CREATE DATABASE`.
//!
//! The launcher owns the assignment of entries to databases: it claims an entry before it starts a
//! database's first relay and releases it once that database's relays are gone. Everyone else finds
//! their database's entry by its OID (`MyDatabaseId`), so a backend in a database without relays
//! finds none and reports no relay.
//!
//! There are `outbox.max_databases` entries (`database_entries()`), sized at server start
//! (`sized`): each costs `ENTRY_BYTES` of shared memory, its state here, its error text and its
//! relays' rounds in flight (`in_flight`).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic, PgLwLock};

use sized::{SharedArray, Zeroed};

pub mod databases;
pub mod in_flight;
pub mod sized;

use databases::DATABASES;
pub use databases::{database_entries, entry_of, this_entry, DatabaseShared, MAX_RELAYS};

/// Shared memory per database entry: its state, its error text, its relays' rounds in flight.
pub const ENTRY_BYTES: usize =
    size_of::<DatabaseShared>() + size_of::<ErrorText>() + size_of::<in_flight::InFlightEntry>();

/// Whether the extension is installed in an entry's database, as its relays found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtensionState {
    /// No relay has looked yet (the launcher starts one relay to find out).
    Unknown = 0,
    Present = 1,
    /// A relay found it missing and exited; the launcher starts none until a rescan is requested.
    Missing = 2,
    /// A relay found a copy of another database's installation, not adopted (`outbox.adopt_copy`),
    /// and exited: like `Missing`, the database gets no relay (and no entry) until a rescan, which
    /// adopt_copy() requests.
    Copy = 3,
}

impl ExtensionState {
    fn from_u8(state: u8) -> ExtensionState {
        match state {
            1 => ExtensionState::Present,
            2 => ExtensionState::Missing,
            3 => ExtensionState::Copy,
            _ => ExtensionState::Unknown,
        }
    }
}

/// What the whole cluster shares besides the entries.
#[derive(Default)]
pub struct RelayShared {
    /// The launcher's `PGPROC`, 0 while it does not run: set to wake it for a rescan.
    launcher_proc: AtomicUsize,
    /// Set by the launcher while every entry serves a database with outbox_pg and a database it
    /// would relay has none: `outbox_enqueue` then refuses in a database without an entry, since
    /// no relay would deliver its events.
    full: AtomicBool,
    /// Set by the launcher after a pass that left no entry to a probe (every entry free or serving
    /// a database with outbox_pg): which databases are relayed is then decided. False from server
    /// start until the launcher's first such pass, and again while probes run: `outbox_enqueue` in
    /// a database without an entry waits for it (`await_decision`), so that a database about to be
    /// left out never accepts events in the first seconds after a start.
    decided: AtomicBool,
    /// Bumped by every committed `CREATE EXTENSION` or `CREATE DATABASE`: the launcher looks again
    /// at the databases where it found no extension.
    rescan_generation: AtomicU32,
}

/// An entry's most recent error message, truncated to fit; shown in `outbox.stats`. Read and
/// written only under `LAST_ERROR` (they are written rarely).
pub struct ErrorText {
    len: UnsafeCell<usize>,
    bytes: UnsafeCell<[u8; ERROR_TEXT_CAPACITY]>,
}

const ERROR_TEXT_CAPACITY: usize = 512;

// SAFETY: plain bytes (an empty text when zeroed), valid in shared memory.
unsafe impl Zeroed for ErrorText {}

// SAFETY: only atomics inside, valid in shared memory across processes.
unsafe impl PGRXSharedMemory for RelayShared {}

// SAFETY: the names are unique to this extension.
static RELAY: PgAtomic<RelayShared> = unsafe { PgAtomic::new(c"outbox_pg_relay") };
static ERROR_TEXTS: SharedArray<ErrorText> = unsafe { SharedArray::new(c"outbox_pg_last_errors") };
/// Guards `ERROR_TEXTS`.
static LAST_ERROR: PgLwLock<()> = unsafe { PgLwLock::new(c"outbox_pg_last_error") };

/// Requests the shared memory; must be called from `_PG_init` while preloading, after the settings
/// are defined (`outbox.max_databases` sizes it).
pub fn init() {
    pg_shmem_init!(RELAY);
    pg_shmem_init!(LAST_ERROR = ());
    // SAFETY: called once, from _PG_init while preloading, before the postmaster calls the hooks.
    unsafe {
        PREVIOUS_REQUEST_HOOK = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(request_entries);
        PREVIOUS_STARTUP_HOOK = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(attach_entries);
    }
}

static mut PREVIOUS_REQUEST_HOOK: pg_sys::shmem_request_hook_type = None;
static mut PREVIOUS_STARTUP_HOOK: pg_sys::shmem_startup_hook_type = None;

/// Reserves the entries `outbox.max_databases` asks for (the postmaster, once).
#[pg_guard]
unsafe extern "C-unwind" fn request_entries() {
    // SAFETY: the hook chain set up by `init`; the requests are made from the request hook.
    unsafe {
        if let Some(previous) = PREVIOUS_REQUEST_HOOK {
            previous();
        }
        let entries = crate::guc::max_databases();
        DATABASES.request(entries);
        ERROR_TEXTS.request(entries);
        in_flight::ROUNDS.request(entries);
    }
}

/// Creates or finds the entries (the postmaster, at start and after a crash restart).
#[pg_guard]
unsafe extern "C-unwind" fn attach_entries() {
    // SAFETY: the hook chain set up by `init`; the arrays are attached under AddinShmemInitLock,
    // with the length requested (the setting cannot change while the server runs).
    unsafe {
        if let Some(previous) = PREVIOUS_STARTUP_HOOK {
            previous();
        }
        let entries = crate::guc::max_databases();
        let lock = sized::addin_shmem_init_lock();
        pg_sys::LWLockAcquire(lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        DATABASES.attach(entries);
        ERROR_TEXTS.attach(entries);
        in_flight::ROUNDS.attach(entries);
        pg_sys::LWLockRelease(lock);
    }
}

fn now_us() -> i64 {
    // SAFETY: reads the clock; no preconditions.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

fn here() -> Option<&'static DatabaseShared> {
    this_entry().map(|entry| &DATABASES.get()[entry])
}

// ---- The launcher's side -------------------------------------------------------------------

/// The databases that have an entry (left by a previous launcher, for one that starts).
pub fn assigned_databases() -> Vec<(usize, pg_sys::Oid)> {
    DATABASES
        .get()
        .iter()
        .enumerate()
        .filter_map(|(entry, state)| {
            let database = state.database.load(Ordering::SeqCst);
            (database != 0).then(|| (entry, pg_sys::Oid::from(database)))
        })
        .collect()
}

/// Assigns a free entry to `database`, its state reset; `None` when all are taken.
pub fn claim_entry(database: pg_sys::Oid) -> Option<usize> {
    let entries = DATABASES.get();
    let entry = entries.iter().position(|entry| entry.database.load(Ordering::SeqCst) == 0)?;
    let state = &entries[entry];
    state.extension.store(ExtensionState::Unknown as u8, Ordering::SeqCst);
    state.redis_connected.store(false, Ordering::SeqCst);
    state.last_error_at.store(0, Ordering::SeqCst);
    state.housekeeping_due.store(0, Ordering::SeqCst);
    state.alert_logged_at.store(0, Ordering::SeqCst);
    state.paused.store(false, Ordering::SeqCst);
    state.published_total.store(0, Ordering::SeqCst);
    state.committed_shards.store(0, Ordering::SeqCst);
    state.replay_requested.store(true, Ordering::SeqCst);
    state.repairs_seen.store(0, Ordering::SeqCst);
    state.repairs_raised.store(1, Ordering::SeqCst);
    state.step_aside_by.store(0, Ordering::SeqCst);
    crate::shared::in_flight::reset(entry);
    // Last: from now on backends in that database find the entry.
    state.database.store(database.to_u32(), Ordering::SeqCst);
    Some(entry)
}

/// Whether the launcher could not give every database it would relay an entry (see `full`).
pub fn set_full(full: bool) {
    RELAY.get().full.store(full, Ordering::SeqCst);
}

/// Whether this database has no relays because every entry serves another database: its events
/// would never be delivered.
pub fn left_out_for_lack_of_entries() -> bool {
    RELAY.get().full.load(Ordering::SeqCst) && this_entry().is_none()
}

/// Records whether the launcher's last pass decided every entry (see `decided`).
pub fn set_decided(decided: bool) {
    RELAY.get().decided.store(decided, Ordering::SeqCst);
}

/// Whether no entry is held by a probe: each is free or serves a database with outbox_pg.
pub fn no_entry_probing() -> bool {
    DATABASES.get().iter().all(|entry| {
        entry.database.load(Ordering::SeqCst) == 0
            || entry.extension.load(Ordering::SeqCst) == ExtensionState::Present as u8
    })
}

/// What `outbox_enqueue` in a database without an entry learns by waiting for the launcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The database has an entry, or may get a free one: the events will be relayed.
    Relayed,
    /// Every entry serves another database with outbox_pg: this one is left out.
    LeftOut,
    /// The launcher did not decide within the wait (it is not running, or still starting).
    Undecided,
}

/// For `outbox_enqueue`: whether this database's events will be relayed. With an entry, at once;
/// without one, waits (on this backend's latch, interruptible) until the launcher has decided
/// every entry, at most `wait`, then answers by what it decided. A backend that found its entry
/// once finds it again without waiting.
pub fn await_decision(wait: std::time::Duration) -> Decision {
    let deadline = std::time::Instant::now() + wait;
    loop {
        if this_entry().is_some() {
            return Decision::Relayed;
        }
        let relay = RELAY.get();
        if relay.decided.load(Ordering::SeqCst) {
            if this_entry().is_some() {
                return Decision::Relayed;
            }
            let free = DATABASES.get().iter().any(|entry| entry.database.load(Ordering::SeqCst) == 0);
            if free {
                // A database that has just got outbox_pg (or in the transaction creating it): the
                // launcher's rescan gives it the free entry.
                return Decision::Relayed;
            }
            return Decision::LeftOut;
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            return Decision::Undecided;
        }
        let ms = (deadline - now).as_millis().min(20) as std::ffi::c_long;
        // SAFETY: a backend's own latch, waited on and reset as latch.h prescribes; interrupts
        // (a cancel, a termination) are processed right after.
        unsafe {
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                ms,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        pgrx::check_for_interrupts!();
    }
}

/// Whether every entry is assigned to a database whose relays found outbox_pg (none is a probe).
pub fn every_entry_serves() -> bool {
    DATABASES.get().iter().all(|entry| {
        entry.database.load(Ordering::SeqCst) != 0
            && entry.extension.load(Ordering::SeqCst) == ExtensionState::Present as u8
    })
}

/// Frees an entry whose relays are all gone.
pub fn release_entry(entry: usize) {
    DATABASES.get()[entry].database.store(0, Ordering::SeqCst);
}

pub fn extension_state(entry: usize) -> ExtensionState {
    ExtensionState::from_u8(DATABASES.get()[entry].extension.load(Ordering::SeqCst))
}

/// Process id of the relay in `slot` of `entry`, if one runs there.
pub fn relay_pid_at(entry: usize, slot: usize) -> Option<i32> {
    Some(DATABASES.get()[entry].relay_pid[slot].load(Ordering::SeqCst)).filter(|&pid| pid != 0)
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
    wake_launcher();
}

/// Sets the launcher's latch, if it runs. No lock, no allocation, no error.
fn wake_launcher() {
    let proc = RELAY.get().launcher_proc.load(Ordering::SeqCst) as *mut pg_sys::PGPROC;
    if !proc.is_null() {
        // SAFETY: as in `set_latches`: a PGPROC stays a valid PGPROC for the life of the cluster.
        unsafe { pg_sys::SetLatch(&raw mut (*proc).procLatch) };
    }
}

/// Records an error for the database of `entry` (the launcher's: a relay it could not start).
pub fn set_error_at(entry: usize, message: &str) {
    let Some(text) = ERROR_TEXTS.get().get(entry) else { return };
    // Truncate on a character boundary so the text stays valid UTF-8.
    let mut len = message.len().min(ERROR_TEXT_CAPACITY);
    while !message.is_char_boundary(len) {
        len -= 1;
    }
    {
        let _exclusive = LAST_ERROR.exclusive();
        // SAFETY: the texts are written only under the exclusive lock, and read under the shared.
        unsafe {
            let bytes = &mut *text.bytes.get();
            bytes[..len].copy_from_slice(&message.as_bytes()[..len]);
            *text.len.get() = len;
        }
    }
    DATABASES.get()[entry].last_error_at.store(now_us(), Ordering::SeqCst);
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

/// Called by the relay in `slot` once it runs: from now on commits wake it. False when the
/// launcher released its database's entry meanwhile (the relay then exits).
pub fn register_relay(slot: usize) -> bool {
    let Some(here) = here() else { return false };
    // SAFETY: MyProc is this process's PGPROC, set up before a worker's main function runs.
    let proc = unsafe { pg_sys::MyProc } as usize;
    // SAFETY: MyProcPid is set for every backend.
    let pid = unsafe { pg_sys::MyProcPid };
    here.relay_alive_at[slot].store(now_us(), Ordering::SeqCst);
    here.relay_pid[slot].store(pid, Ordering::SeqCst);
    here.relay_proc[slot].store(proc, Ordering::SeqCst);
    true
}

/// Called by the relay in `slot` every time round its loop: it is alive.
pub fn relay_alive(slot: usize) {
    if let Some(here) = here() {
        here.relay_alive_at[slot].store(now_us(), Ordering::SeqCst);
    }
}

/// How many relays of this database are running and alive: gone round their loop within `lease`.
/// A relay that hangs (stopped, stuck) stops counting after `lease`, so that the others take all
/// of its shards over, not just the share they had while it counted.
pub fn relays_alive(lease: std::time::Duration) -> i32 {
    let Some(here) = here() else { return 0 };
    let now = now_us();
    (0..MAX_RELAYS)
        .filter(|&slot| {
            here.relay_pid[slot].load(Ordering::SeqCst) != 0
                && now - here.relay_alive_at[slot].load(Ordering::SeqCst) < lease.as_micros() as i64
        })
        .count() as i32
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
    ExtensionState::from_u8(here.extension.swap(state as u8, Ordering::SeqCst))
}

/// Whether the relays are paused; set by them from `outbox.enabled` on every loop.
/// A replay was asked for in this database (or may be left unfinished): the relays look.
pub fn request_replay() {
    if let Some(here) = here() {
        here.replay_requested.store(true, Ordering::SeqCst);
    }
}

/// Whether the relays should look for a replay to run.
pub fn replay_requested() -> bool {
    here().is_some_and(|here| here.replay_requested.load(Ordering::SeqCst))
}

/// A relay found no replay to run.
pub fn replays_done() {
    if let Some(here) = here() {
        here.replay_requested.store(false, Ordering::SeqCst);
    }
}

/// A loss repair may run in this database: no relay of it starts a live round before one finds
/// that none runs (`repairs_checked`).
pub fn raise_repairs() {
    if let Some(here) = here() {
        here.repairs_raised.fetch_add(1, Ordering::SeqCst);
    }
}

/// Whether a loss repair may run in this database, and the count to hand to `repairs_checked`
/// after looking. Two atomic loads: it is read before every live round.
pub fn repairs_raised() -> Option<u64> {
    let here = here()?;
    let raised = here.repairs_raised.load(Ordering::SeqCst);
    (raised != here.repairs_seen.load(Ordering::SeqCst)).then_some(raised)
}

/// A relay that read `raised` from `repairs_raised` then found no loss repair running: what was
/// raised up to then is done (a repair raised meanwhile keeps the gate shut).
pub fn repairs_checked(raised: u64) {
    if let Some(here) = here() {
        here.repairs_seen.fetch_max(raised, Ordering::SeqCst);
    }
}

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

thread_local! {
    /// The entry whose relays this backend asked to step aside, until its transaction ends.
    static STEPPING_ASIDE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Asks the relays of `database` (if it is relayed) to step aside until the current transaction
/// ends: those connected exit, one that connects meanwhile exits at once, and the launcher starts
/// none. The statement that asks holds a lock that keeps new sessions out only once it runs, and a
/// relay the launcher had just started may have connected before that: it must see the request
/// too, however late it gets to look. No lock, no allocation, no error (the drop hook).
pub fn request_step_aside(database: pg_sys::Oid) {
    let Some(entry) = entry_of(database) else { return };
    // SAFETY: MyProcPid is set for every backend.
    let pid = unsafe { pg_sys::MyProcPid };
    DATABASES.get()[entry].step_aside_by.store(pid, Ordering::SeqCst);
    STEPPING_ASIDE.set(Some(entry));
    set_latches(&DATABASES.get()[entry]);
}

/// At the end of every transaction (src/enqueue/wake.rs): a request this backend made is over
/// (the statement is done or failed, and its lock is released right after), and the launcher is
/// woken to start the relays again. No lock, no allocation, no error.
pub fn end_step_aside() {
    let Some(entry) = STEPPING_ASIDE.take() else { return };
    // SAFETY: MyProcPid is set for every backend.
    let pid = unsafe { pg_sys::MyProcPid };
    // Another backend's request on the same database stays.
    let _ = DATABASES.get()[entry].step_aside_by.compare_exchange(pid, 0, Ordering::SeqCst, Ordering::SeqCst);
    wake_launcher();
}

/// Whether a backend's statement needs the database of `entry` without sessions. A request whose
/// backend is gone (its transaction's end always clears it, so only a backend that crashed, which
/// restarts the whole server anyway) counts for nothing.
pub fn step_aside_pending(entry: usize) -> bool {
    let pid = DATABASES.get()[entry].step_aside_by.load(Ordering::SeqCst);
    // SAFETY: signal 0 only checks that the process exists.
    pid != 0 && unsafe { libc::kill(pid, 0) } == 0
}

/// Whether the relays of the database this relay is connected to must step aside.
pub fn step_aside_requested() -> bool {
    this_entry().is_some_and(step_aside_pending)
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
    let at = DATABASES.get()[entry].last_error_at.load(Ordering::SeqCst);
    if at == 0 {
        return None;
    }
    let text = ERROR_TEXTS.get().get(entry)?;
    let _shared = LAST_ERROR.share();
    // SAFETY: read under the shared lock, written only under the exclusive one; `len` never
    // exceeds the capacity.
    let message = unsafe {
        let bytes = &*text.bytes.get();
        String::from_utf8_lossy(&bytes[..(*text.len.get()).min(ERROR_TEXT_CAPACITY)]).into_owned()
    };
    Some((message, at))
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
