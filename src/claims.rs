//! The relays' claims, kept in shared memory instead of in the table.
//!
//! A relay's claim writes nothing to `outbox.messages`: the rows stay `pending`, and their ids go
//! into the relay's slot here until the round is settled. That halves the row writes per event
//! (the mark is the only one), which is most of the relay's cost (see docs/performance.md).
//!
//! Correctness rests on one rule: every claim, by a relay or by a session calling
//! `outbox._claim_batch`, holds the claim lock (a transaction-level lock only this extension can
//! take, see `lock_for_claim`) from before it reads these slots until its transaction ends, and
//! registers what it took before committing.
//! A relay reads the slots *before* its claim query takes its snapshot, and a slot is only
//! cleared after the settling transaction committed, so for every pending row it sees, either
//! the row is in a slot (in flight: skipped), or it was never claimed, or its mark committed
//! before the snapshot (then it is not pending). A claim older than `outbox.lease` is ignored, so
//! a hung relay's events are published by the others.
//!
//! Memory is zeroed at startup rather than built on the stack (it is about 1.3 MB), and every field
//! is an atomic: slots are written by their own relay only, read by claimers under the claim lock
//! and by `outbox.stats` without it (a count that is a moment old is fine there).

use std::collections::HashSet;
use std::sync::atomic::{AtomicI64, AtomicPtr, AtomicU32, Ordering};
use std::time::Duration;

use pgrx::pg_sys;

use crate::shmem::MAX_RELAYS;

/// Most ids one claim can hold: the maximum of `outbox.batch_size`.
pub const CLAIM_CAPACITY: usize = 10_000;

/// The claim lock is a lock of type `LOCKTAG_USERLOCK` (PostgreSQL keeps that type for
/// extensions; no SQL function takes it), keyed by database and these two numbers ("outb" in ASCII,
/// then 1). It used to be an advisory lock, and any role can take advisory locks: an unprivileged
/// login holding that key stopped every relay. Now only code of this extension can hold it: the
/// relays, and sessions through `outbox._claim_batch` (whose EXECUTE is revoked from PUBLIC).
const CLAIM_LOCK_CLASS: u32 = 1_869_968_482;
const CLAIM_LOCK_ID: u32 = 1;

fn claim_lock_tag() -> pg_sys::LOCKTAG {
    pg_sys::LOCKTAG {
        // SAFETY: set when the process connected to its database.
        locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
        locktag_field2: CLAIM_LOCK_CLASS,
        locktag_field3: CLAIM_LOCK_ID,
        locktag_field4: 0,
        locktag_type: pg_sys::LockTagType::LOCKTAG_USERLOCK as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    }
}

/// Whether the claim lock was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimLock {
    Held,
    /// The relay was asked to stop (SIGTERM) while another claimer held the lock.
    Stopping,
}

/// Takes the claim lock until the end of the current transaction, waiting for it if need be and
/// returning early when `stop_requested` says so. A plain lock wait would not do: PostgreSQL's
/// lock wait only notices termination through its own SIGTERM handler, which a background worker
/// replaces, so a relay stuck behind a session's open claim would not answer
/// `pg_terminate_backend` or a fast shutdown. So the relay tries without waiting and sleeps a
/// little between tries (0.1 ms, doubling to 5 ms): a claim transaction lasts milliseconds, so a
/// waiting relay gets the lock at most a few milliseconds after it is free.
pub fn lock_for_claim(stop_requested: impl Fn() -> bool) -> ClaimLock {
    let tag = claim_lock_tag();
    let mut pause = Duration::from_micros(100);
    loop {
        // SAFETY: inside a transaction; a transaction-level (not session) lock; with dontWait the
        // call never sleeps and reports a busy lock as LOCKACQUIRE_NOT_AVAIL.
        let acquired = unsafe { pg_sys::LockAcquire(&tag, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, false, true) };
        if acquired != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL {
            return ClaimLock::Held;
        }
        if stop_requested() {
            return ClaimLock::Stopping;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
}

/// The claim lock for a session (`outbox._claim_batch`): an ordinary lock wait, which a client
/// backend's own SIGTERM handling and `statement_timeout`/`lock_timeout` interrupt as usual.
pub fn lock_for_claim_in_session() {
    let tag = claim_lock_tag();
    // SAFETY: inside a transaction; a transaction-level lock, waited for like any other.
    unsafe { pg_sys::LockAcquire(&tag, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, false, false) };
}

#[repr(C)]
struct ClaimSlot {
    /// When the claim was registered (PostgreSQL timestamp, µs); 0 while the slot holds none.
    claimed_at: AtomicI64,
    count: AtomicU32,
    /// The `claimed_at` of the last expired claim the housekeeping logged, so it logs each once.
    reported_expired: AtomicI64,
    ids: [AtomicI64; CLAIM_CAPACITY],
}

#[repr(C)]
struct Claims {
    slots: [ClaimSlot; MAX_RELAYS],
}

static CLAIMS: AtomicPtr<Claims> = AtomicPtr::new(std::ptr::null_mut());
static mut PREV_SHMEM_REQUEST_HOOK: pg_sys::shmem_request_hook_type = None;
static mut PREV_SHMEM_STARTUP_HOOK: pg_sys::shmem_startup_hook_type = None;
const SHMEM_NAME: &std::ffi::CStr = c"outbox_pg_claims";

/// Requests the shared memory; must be called from `_PG_init` while preloading.
pub fn init() {
    // SAFETY: runs once in the postmaster while preloading, before any hook is called; chaining
    // to the previous hooks keeps other extensions' shared memory working.
    unsafe {
        PREV_SHMEM_REQUEST_HOOK = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(request_shmem);
        PREV_SHMEM_STARTUP_HOOK = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(attach_shmem);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn request_shmem() {
    // SAFETY: called by the postmaster in its shared memory request phase.
    unsafe {
        if let Some(previous) = PREV_SHMEM_REQUEST_HOOK {
            previous();
        }
        pg_sys::RequestAddinShmemSpace(size_of::<Claims>());
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn attach_shmem() {
    // SAFETY: called in every process that attaches shared memory, with the space requested
    // above; the addin lock serialises the first initialisation, as PostgreSQL's own modules do.
    unsafe {
        if let Some(previous) = PREV_SHMEM_STARTUP_HOOK {
            previous();
        }
        let init_lock = &raw mut (*pg_sys::MainLWLockArray.add(21)).lock; // AddinShmemInitLock
        pg_sys::LWLockAcquire(init_lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let claims = pg_sys::ShmemInitStruct(SHMEM_NAME.as_ptr(), size_of::<Claims>(), &mut found).cast::<Claims>();
        if !found {
            // All-zero is every slot empty: atomics are plain integers in memory.
            std::ptr::write_bytes(claims.cast::<u8>(), 0, size_of::<Claims>());
        }
        pg_sys::LWLockRelease(init_lock);
        CLAIMS.store(claims, Ordering::SeqCst);
    }
}

fn claims() -> Option<&'static Claims> {
    let claims = CLAIMS.load(Ordering::SeqCst);
    // SAFETY: set once per process to shared memory that lives as long as the process.
    (!claims.is_null()).then(|| unsafe { &*claims })
}

fn now_us() -> i64 {
    // SAFETY: reads the clock; no preconditions.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Whether a claim registered at `claimed_at` is older than `lease` at `now`: the one rule every
/// reader of the slots applies.
fn is_expired(claimed_at: i64, now: i64, lease: Duration) -> bool {
    now - claimed_at >= lease.as_micros() as i64
}

/// A slot's claim, if it holds one younger than `lease`.
fn live_ids(slot: &ClaimSlot, lease: Duration, now: i64) -> Option<impl Iterator<Item = i64> + '_> {
    let claimed_at = slot.claimed_at.load(Ordering::SeqCst);
    if claimed_at == 0 || is_expired(claimed_at, now, lease) {
        return None;
    }
    let count = (slot.count.load(Ordering::SeqCst) as usize).min(CLAIM_CAPACITY);
    Some(slot.ids[..count].iter().map(|id| id.load(Ordering::Relaxed)))
}

/// Ids claimed by relays other than `own_slot` (all relays for `None`), ignoring expired claims.
/// Claimers call it holding the claim lock.
pub fn in_flight_elsewhere(own_slot: Option<usize>, lease: Duration) -> HashSet<i64> {
    let Some(claims) = claims() else { return HashSet::new() };
    let now = now_us();
    let mut ids = HashSet::new();
    for (index, slot) in claims.slots.iter().enumerate() {
        if Some(index) != own_slot {
            if let Some(live) = live_ids(slot, lease, now) {
                ids.extend(live);
            }
        }
    }
    ids
}

/// Records `ids` as claimed by the relay in `slot`. Called holding the claim lock, before the
/// claiming transaction commits.
pub fn register(slot: usize, ids: &[i64]) {
    let Some(claims) = claims() else { return };
    let slot = &claims.slots[slot];
    let ids = &ids[..ids.len().min(CLAIM_CAPACITY)];
    for (cell, id) in slot.ids.iter().zip(ids) {
        cell.store(*id, Ordering::Relaxed);
    }
    slot.count.store(ids.len() as u32, Ordering::SeqCst);
    slot.claimed_at.store(now_us(), Ordering::SeqCst);
}

/// Forgets the claim of the relay in `slot`: after its rows were settled (committed), or when the
/// relay stops. Rows that were not settled are pending and get claimed again.
pub fn clear(slot: usize) {
    if let Some(claims) = claims() {
        claims.slots[slot].claimed_at.store(0, Ordering::SeqCst);
    }
}

/// Events in flight in relays (claims younger than `lease`).
pub fn in_flight_count(lease: Duration) -> i64 {
    let Some(claims) = claims() else { return 0 };
    let now = now_us();
    claims.slots.iter().filter_map(|slot| live_ids(slot, lease, now).map(|ids| ids.count() as i64)).sum()
}

/// Claims older than `lease` that have not been reported yet, as (slot, events, age), so that the
/// housekeeping logs each once: their events are being published again by other relays.
pub fn newly_expired(lease: Duration) -> Vec<(usize, usize, Duration)> {
    let Some(claims) = claims() else { return Vec::new() };
    let now = now_us();
    let mut expired = Vec::new();
    for (index, slot) in claims.slots.iter().enumerate() {
        let claimed_at = slot.claimed_at.load(Ordering::SeqCst);
        if claimed_at != 0
            && is_expired(claimed_at, now, lease)
            && slot.reported_expired.swap(claimed_at, Ordering::SeqCst) != claimed_at
        {
            let count = slot.count.load(Ordering::SeqCst) as usize;
            expired.push((index, count, Duration::from_micros((now - claimed_at) as u64)));
        }
    }
    expired
}

/// Each slot's claim for `outbox.relays`: (slot, events, claimed at (PostgreSQL timestamp, µs),
/// older than `lease`), for slots that hold one.
pub fn held(lease: Duration) -> Vec<(usize, usize, i64, bool)> {
    let Some(claims) = claims() else { return Vec::new() };
    let now = now_us();
    claims
        .slots
        .iter()
        .enumerate()
        .filter_map(|(index, slot)| {
            let claimed_at = slot.claimed_at.load(Ordering::SeqCst);
            (claimed_at != 0).then(|| {
                let count = (slot.count.load(Ordering::SeqCst) as usize).min(CLAIM_CAPACITY);
                (index, count, claimed_at, is_expired(claimed_at, now, lease))
            })
        })
        .collect()
}
