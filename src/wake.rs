//! Wake-on-commit: a transaction that enqueued sets the relay's latch right after it commits, so
//! delivery does not wait for the poll interval. A rollback wakes nobody, and many enqueues in one
//! transaction wake the relay once.

use std::cell::Cell;

use pgrx::pg_sys;

use crate::shmem;

thread_local! {
    /// The shards the current transaction enqueued into (one bit per shard), 0 if none; cleared at
    /// every transaction end.
    static ENQUEUED_IN_XACT: Cell<u32> = const { Cell::new(0) };
    /// Whether the current transaction created an extension or a database (src/object_access.rs).
    static RESCAN_AT_COMMIT: Cell<bool> = const { Cell::new(false) };
}

/// Asks the launcher, if the current transaction commits, to look for new relayed databases.
pub fn rescan_at_commit() {
    RESCAN_AT_COMMIT.with(|rescan| rescan.set(true));
}

/// Registers the transaction callback for this process (inherited by every backend when done in
/// the postmaster while preloading).
pub fn init() {
    // SAFETY: `on_xact_event` matches PostgreSQL's XactCallback signature and never raises.
    unsafe { pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut()) };
}

/// Marks the current transaction as one that must wake the relay when it commits, and that has
/// events in `shard`.
pub fn arm(shard: i16) {
    ENQUEUED_IN_XACT.with(|armed| armed.set(armed.get() | 1u32 << (shard as u32 % 32)));
}

/// Runs at every transaction end in every backend: keep it to a flag check and `SetLatch`, since
/// an error here (after commit) would take the whole cluster down.
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    match event {
        pg_sys::XactEvent::XACT_EVENT_COMMIT | pg_sys::XactEvent::XACT_EVENT_PARALLEL_COMMIT => {
            crate::order::transaction_ended();
            if RESCAN_AT_COMMIT.with(|rescan| rescan.replace(false)) {
                shmem::request_rescan();
            }
            let shards = ENQUEUED_IN_XACT.with(|armed| armed.replace(0));
            if shards != 0 {
                // After the commit is visible: a relay that takes these bits and then a snapshot
                // sees the transaction in it (src/worker/tick.rs reads only the flagged shards).
                shmem::mark_shards_committed(shards);
                shmem::wake_relays()
            }
        }
        // A prepared transaction commits later, possibly in another session that wakes nobody:
        // the poll interval delivers those events.
        pg_sys::XactEvent::XACT_EVENT_ABORT
        | pg_sys::XactEvent::XACT_EVENT_PARALLEL_ABORT
        | pg_sys::XactEvent::XACT_EVENT_PREPARE => {
            crate::order::transaction_ended();
            ENQUEUED_IN_XACT.with(|armed| armed.set(0));
            RESCAN_AT_COMMIT.with(|rescan| rescan.set(false));
        }
        _ => {}
    }
}
