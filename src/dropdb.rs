//! Stepping aside for `DROP DATABASE`. PostgreSQL refuses to drop a database while other sessions
//! are connected to it, and waits only five seconds for them to leave; it makes autovacuum leave by
//! signalling it, but it knows nothing of our relays, so a plain `DROP DATABASE` of the relayed
//! database failed with "being accessed by other users". `dropdb()` runs the object-access drop
//! hook after it has locked the database (so no new session can connect) and before it counts the
//! sessions still there: the hook asks the relays connected to that database to exit, and they do
//! at their next wake-up, within a few milliseconds (a Redis exchange in flight finishes first).
//!
//! The launcher starts them again a second later. Such a relay waits in its connection for the
//! drop to end: if the drop failed it connects and relays on; if it succeeded the connection
//! fails and the launcher waits for the database to exist again, as it does for a database that
//! was never created.

use pgrx::pg_sys;

use crate::shmem;

static mut PREVIOUS_HOOK: pg_sys::object_access_hook_type = None;

/// Installs the hook; called from `_PG_init` while preloading, so every backend inherits it.
pub fn init() {
    // SAFETY: runs once in the postmaster while preloading; the previous hook is chained.
    unsafe {
        PREVIOUS_HOOK = pg_sys::object_access_hook;
        pg_sys::object_access_hook = Some(on_object_access);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_object_access(
    access: pg_sys::ObjectAccessType::Type,
    class_id: pg_sys::Oid,
    object_id: pg_sys::Oid,
    sub_id: std::ffi::c_int,
    arg: *mut std::ffi::c_void,
) {
    // SAFETY: chaining to the hook that was installed before ours, with the same arguments.
    unsafe {
        if let Some(previous) = PREVIOUS_HOOK {
            previous(access, class_id, object_id, sub_id, arg);
        }
    }
    if access == pg_sys::ObjectAccessType::OAT_DROP
        && class_id == pg_sys::DatabaseRelationId
        && shmem::relay_database() == Some(object_id)
    {
        // Only shared atomics and SetLatch: nothing here can fail. If the drop fails after this
        // (other sessions stay connected), the relays come back within about a second.
        shmem::request_step_aside(object_id);
    }
}
