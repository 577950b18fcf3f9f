//! The object-access hook, installed in every backend: it tells the launcher about the catalog
//! changes that start or stop relays.
//!
//! - **Created** extensions and databases: a committed `CREATE EXTENSION` (of any extension: its
//!   name is not readable yet at this point) or `CREATE DATABASE` (whose template may hold
//!   outbox_pg) asks the launcher to look again at the databases where it found no outbox_pg.
//!   The request is made at commit (src/wake.rs), so a rolled-back creation starts nothing.
//! - **Dropped databases**: PostgreSQL refuses to drop a database while other sessions are
//!   connected to it, and waits only five seconds for them to leave; it makes autovacuum leave by
//!   signalling it, but it knows nothing of our relays, so a plain `DROP DATABASE` of a relayed
//!   database failed with "being accessed by other users". `dropdb()` runs the drop hook after it
//!   has locked the database (so no new session can connect) and before it counts the sessions
//!   still there: the hook asks the relays connected to that database to exit, and they do at
//!   their next wake-up, within a few milliseconds (a Redis exchange in flight finishes first).
//!   If the drop fails, the launcher starts them again a second later; if it succeeds, the
//!   launcher no longer finds the database and forgets it.

use pgrx::pg_sys;

use crate::{shmem, wake};

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
    let created = access == pg_sys::ObjectAccessType::OAT_POST_CREATE
        && (class_id == pg_sys::ExtensionRelationId || class_id == pg_sys::DatabaseRelationId);
    if created {
        wake::rescan_at_commit();
    }
    if access == pg_sys::ObjectAccessType::OAT_DROP
        && class_id == pg_sys::DatabaseRelationId
        && shmem::entry_of(object_id).is_some()
    {
        // Only shared atomics and SetLatch: nothing here can fail. If the drop fails after this
        // (other sessions stay connected), the relays come back within about a second.
        shmem::request_step_aside(object_id);
    }
}
