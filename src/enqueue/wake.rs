//! Wake-on-commit: a transaction that enqueued sets the relay's latch right after it commits, so
//! delivery does not wait for the poll interval. A rollback wakes nobody, and many enqueues in one
//! transaction wake the relay once.

use std::cell::Cell;

use pgrx::pg_sys;

use crate::shared;

thread_local! {
    /// The shards the current transaction enqueued into (one bit per shard), 0 if none; cleared at
    /// every transaction end.
    static ENQUEUED_IN_XACT: Cell<u32> = const { Cell::new(0) };
    /// Whether the current transaction created an extension or a database (src/hooks/object_access.rs).
    static RESCAN_AT_COMMIT: Cell<bool> = const { Cell::new(false) };
    /// Whether the current transaction asked for a replay (`outbox.replay`).
    static REPLAY_AT_COMMIT: Cell<bool> = const { Cell::new(false) };
}

/// Makes the current transaction, if it commits, send the relays to look for replays: the replay
/// it asked for is visible to them only then.
pub fn replay_at_commit() {
    REPLAY_AT_COMMIT.with(|replay| replay.set(true));
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

/// Makes the current transaction wake the relays for every shard when it commits: a `COMMIT
/// PREPARED`, which commits events this session did not enqueue (src/hooks/object_access.rs).
pub fn arm_all() {
    ENQUEUED_IN_XACT.with(|armed| armed.set(armed.get() | ((1u32 << crate::enqueue::order::SHARDS) - 1)));
}

/// Runs at every transaction end in every backend: keep it to a flag check and `SetLatch`, since
/// an error here (after commit) would take the whole cluster down.
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    match event {
        pg_sys::XactEvent::XACT_EVENT_COMMIT | pg_sys::XactEvent::XACT_EVENT_PARALLEL_COMMIT => {
            crate::enqueue::order::transaction_ended();
            shared::end_step_aside();
            if RESCAN_AT_COMMIT.with(|rescan| rescan.replace(false)) {
                shared::request_rescan();
            }
            if REPLAY_AT_COMMIT.with(|replay| replay.replace(false)) {
                shared::request_replay();
                shared::wake_relays();
            }
            let shards = ENQUEUED_IN_XACT.with(|armed| armed.replace(0));
            if shards != 0 {
                // After the commit is visible: a relay that takes these bits and then a snapshot
                // sees the transaction in it (src/relay/read.rs reads only the flagged shards).
                shared::mark_shards_committed(shards);
                shared::wake_relays()
            }
        }
        // A prepared transaction commits later, in whichever session runs COMMIT PREPARED: that
        // session's commit wakes the relays (`arm_all`).
        pg_sys::XactEvent::XACT_EVENT_ABORT
        | pg_sys::XactEvent::XACT_EVENT_PARALLEL_ABORT
        | pg_sys::XactEvent::XACT_EVENT_PREPARE => {
            crate::enqueue::order::transaction_ended();
            shared::end_step_aside();
            ENQUEUED_IN_XACT.with(|armed| armed.set(0));
            RESCAN_AT_COMMIT.with(|rescan| rescan.set(false));
            REPLAY_AT_COMMIT.with(|replay| replay.set(false));
        }
        _ => {}
    }
}
