//! The object-access hook, installed in every backend: it tells the launcher about the catalog
//! changes that start or stop relays.
//!
//! - **Created** extensions and databases: a committed `CREATE EXTENSION` (of any extension: its
//!   name is not readable yet at this point) or `CREATE DATABASE` (whose template may hold
//!   outbox_pg) asks the launcher to look again at the databases where it found no outbox_pg.
//!   The request is made at commit (src/enqueue/wake.rs), so a rolled-back creation starts nothing.
//! - **Dropped, renamed and copied databases**: PostgreSQL refuses to drop a database while other sessions are
//!   connected to it, and waits only five seconds for them to leave; it makes autovacuum leave by
//!   signalling it, but it knows nothing of our relays, so a plain `DROP DATABASE` of a relayed
//!   database failed with "being accessed by other users". `dropdb()` runs the drop hook after it
//!   has locked the database (so no new session can connect) and before it counts the sessions
//!   still there: the hook asks the relays connected to that database to exit, and they do at
//!   their next wake-up, within a few milliseconds (a Redis exchange in flight finishes first).
//!   If the drop fails, the launcher starts them again a second later; if it succeeds, the
//!   launcher no longer finds the database and forgets it. `CREATE DATABASE ... TEMPLATE`,
//!   `ALTER DATABASE ... RENAME TO` and `ALTER DATABASE ... SET TABLESPACE` refuse the same way
//!   while anyone is connected to the database they copy or change, and have no object-access
//!   event before they count: the utility hook asks the relays to step aside before PostgreSQL
//!   runs them. The request holds until the asking transaction ends (src/shared, `step_aside_by`):
//!   a relay started meanwhile waits at its connection (they lock the database against new
//!   sessions while they work) and runs once they are done, or, connected just before the lock,
//!   finds the request and exits; the launcher starts none while it holds.
//! - **`COMMIT PREPARED`**: a prepared transaction that enqueued commits in whatever session runs
//!   `COMMIT PREPARED`, which enqueued nothing: the utility hook makes that session's commit wake
//!   the relays (every shard), so such events do not wait for the poll interval.

use pgrx::pg_sys;

use crate::enqueue::wake;
use crate::shared;

static mut PREVIOUS_HOOK: pg_sys::object_access_hook_type = None;
static mut PREVIOUS_UTILITY_HOOK: pg_sys::ProcessUtility_hook_type = None;

/// Installs the hooks; called from `_PG_init` while preloading, so every backend inherits them.
pub fn init() {
    // SAFETY: runs once in the postmaster while preloading; the previous hooks are chained.
    unsafe {
        PREVIOUS_HOOK = pg_sys::object_access_hook;
        pg_sys::object_access_hook = Some(on_object_access);
        PREVIOUS_UTILITY_HOOK = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(on_utility);
    }
}

/// The elements of a `List` of pointers.
unsafe fn pointers(list: *mut pg_sys::List) -> Vec<*mut std::ffi::c_void> {
    if list.is_null() {
        return Vec::new();
    }
    // SAFETY: a valid List of pointers (the parser's option lists), read in place.
    unsafe { (0..(*list).length as usize).map(|n| (*(*list).elements.add(n)).ptr_value).collect() }
}

/// The string argument of option `name` in a `DefElem` list, if present.
unsafe fn option_string(options: *mut pg_sys::List, name: &[u8]) -> Option<*mut std::ffi::c_char> {
    // SAFETY: the parser's DefElem list; defGetString raises for a malformed value, which the
    // statement itself would raise too.
    unsafe {
        pointers(options).into_iter().map(|p| p as *mut pg_sys::DefElem).find_map(|option| {
            let matches =
                !(*option).defname.is_null() && std::ffi::CStr::from_ptr((*option).defname).to_bytes() == name;
            (matches && !(*option).arg.is_null()).then(|| pg_sys::defGetString(option))
        })
    }
}

/// Asks the relays of database `name` (if it is relayed) to step aside.
unsafe fn step_aside_for_database(name: *const std::ffi::c_char) {
    if name.is_null() {
        return;
    }
    // SAFETY: a catalog lookup by name, missing_ok.
    let oid = unsafe { pg_sys::get_database_oid(name, true) };
    if oid != pg_sys::InvalidOid && shared::entry_of(oid).is_some() {
        shared::request_step_aside(oid);
    }
}

/// Before PostgreSQL runs a statement that needs a database without sessions (copying it as a
/// template, renaming it, moving it to another tablespace): its relays step aside. Before a
/// `COMMIT PREPARED`: its commit wakes the relays.
unsafe fn before_utility(statement: *mut pg_sys::Node) {
    // SAFETY: the statement's parse tree, read only.
    unsafe {
        if statement.is_null() {
            return;
        }
        match (*statement).type_ {
            pg_sys::NodeTag::T_CreatedbStmt => {
                let create = statement as *mut pg_sys::CreatedbStmt;
                if let Some(template) = option_string((*create).options, b"template") {
                    step_aside_for_database(template);
                }
            }
            pg_sys::NodeTag::T_RenameStmt => {
                let rename = statement as *mut pg_sys::RenameStmt;
                if (*rename).renameType == pg_sys::ObjectType::OBJECT_DATABASE {
                    step_aside_for_database((*rename).subname);
                }
            }
            pg_sys::NodeTag::T_AlterDatabaseStmt => {
                let alter = statement as *mut pg_sys::AlterDatabaseStmt;
                if option_string((*alter).options, b"tablespace").is_some() {
                    step_aside_for_database((*alter).dbname);
                }
            }
            pg_sys::NodeTag::T_TransactionStmt => {
                let transaction = statement as *mut pg_sys::TransactionStmt;
                if (*transaction).kind == pg_sys::TransactionStmtKind::TRANS_STMT_COMMIT_PREPARED {
                    wake::arm_all();
                }
            }
            _ => {}
        }
    }
}

#[pgrx::pg_guard]
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn on_utility(
    statement: *mut pg_sys::PlannedStmt,
    query: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    environment: *mut pg_sys::QueryEnvironment,
    destination: *mut pg_sys::DestReceiver,
    completion: *mut pg_sys::QueryCompletion,
) {
    // SAFETY: PostgreSQL's arguments, passed on unchanged to the next hook or the standard code.
    unsafe {
        before_utility((*statement).utilityStmt);
        match PREVIOUS_UTILITY_HOOK {
            Some(previous) => {
                previous(statement, query, read_only_tree, context, params, environment, destination, completion)
            }
            None => pg_sys::standard_ProcessUtility(
                statement,
                query,
                read_only_tree,
                context,
                params,
                environment,
                destination,
                completion,
            ),
        }
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
        && shared::entry_of(object_id).is_some()
    {
        // Only shared atomics and SetLatch: nothing here can fail. If the drop fails after this
        // (other sessions stay connected), the relays come back once its transaction has ended.
        shared::request_step_aside(object_id);
    }
}
