//! The checks `outbox_enqueue` makes before it writes: that a relay will deliver the event (the
//! library preloaded, this database relayed and not a template, an entry of shared memory for it)
//! and that `outbox.allowed_streams` allows its stream.

use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::guc;
use crate::shared;
use outbox_sink::streams;

/// Refuses, for `outbox_enqueue`, when no relay would deliver the event: the library is not
/// preloaded, or `outbox.databases` leaves this database out.
pub fn check_relayed_database() {
    if !crate::preloaded() {
        ErrorReport::new(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "outbox_pg is not loaded through shared_preload_libraries, so no relay would deliver this event",
            "outbox_enqueue",
        )
        .set_hint("Add outbox_pg to shared_preload_libraries in postgresql.conf and restart PostgreSQL.")
        .report(PgLogLevel::ERROR);
    }
    if this_database_is_a_template() {
        ErrorReport::new(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!(
                "database \"{}\" is a template, and outbox_pg relays no template database, so no relay would deliver this event",
                current_database()
            ),
            "outbox_enqueue",
        )
        .set_hint("Enqueue in the databases created from it, or make it an ordinary database (ALTER DATABASE ... IS_TEMPLATE false).")
        .report(PgLogLevel::ERROR);
    }
    if let Some(relayed) = guc::databases() {
        let here = current_database();
        if !relayed.contains(&here) {
            let (setting, list) = if guc::databases_listed() {
                ("outbox.databases", relayed.join(", "))
            } else {
                ("outbox.database", relayed.join(""))
            };
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                format!(
                    "outbox_pg relays only database \"{}\" ({setting}), not \"{here}\", so no relay would deliver this event",
                    relayed.join("\", \"")
                ),
                "outbox_enqueue",
            )
            .set_hint(format!(
                "Enqueue in a relayed database, or add \"{here}\" to outbox.databases (currently '{list}') in postgresql.conf and reload; an empty outbox.databases relays every database with outbox_pg."
            ))
            .report(PgLogLevel::ERROR);
        }
    }
    // An unadopted copy has no relay and takes no entry; its events wait for adopt_copy(), as
    // before (the copy's own are published once it is adopted).
    if shared::this_entry().is_none() && unadopted_copy_of().is_some() {
        return;
    }
    // Last: it may wait for the launcher's decision (only without an entry, in the seconds
    // after a start or while it probes databases for outbox_pg).
    let left_out_hint = "Raise outbox.max_databases (a restart), relay fewer databases (outbox.databases names the ones to relay, in the order they are preferred), or drop outbox_pg from databases that do not need it; the server log's WARNING names every database left out.";
    match shared::await_decision(DECISION_WAIT) {
        shared::Decision::Relayed => {}
        shared::Decision::LeftOut => {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                left_out_message(),
                "outbox_enqueue",
            )
            .set_hint(left_out_hint)
            .report(PgLogLevel::ERROR);
        }
        shared::Decision::Undecided => {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                format!(
                    "database \"{}\" has no relay yet: the outbox_pg launcher has not decided within {}s which databases it relays (outbox.max_databases), so this event might never be delivered",
                    current_database(),
                    DECISION_WAIT.as_secs()
                ),
                "outbox_enqueue",
            )
            .set_hint("Try again; if it persists, check that the outbox_pg launcher runs (pg_stat_activity, backend_type 'outbox_pg launcher') and the server log for its WARNINGs (max_worker_processes).")
            .report(PgLogLevel::ERROR);
        }
    }
}

/// How long `outbox_enqueue` in a database without relays waits for the launcher to decide
/// whether it gets some (it decides within a second or two of a start).
const DECISION_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

fn left_out_message() -> String {
    format!(
        "database \"{}\" has no relay: outbox_pg already relays {} databases (outbox.max_databases), so no relay would deliver its events",
        current_database(),
        shared::database_entries()
    )
}

/// Whether this database is a template (`pg_database.datistemplate`): the launcher relays none.
fn this_database_is_a_template() -> bool {
    // SAFETY: a syscache lookup of this backend's own database, released before returning.
    unsafe {
        let tuple = pg_sys::SearchSysCache1(
            pg_sys::SysCacheIdentifier::DATABASEOID as i32,
            pg_sys::Datum::from(pg_sys::MyDatabaseId),
        );
        if tuple.is_null() {
            return false;
        }
        let template = (*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple)).datistemplate;
        pg_sys::ReleaseSysCache(tuple);
        template
    }
}

/// Why no relay serves this database: an unadopted copy of another database's outbox (it gets
/// relays once adopted), or every entry of shared memory serves another database (outbox.stats
/// shows it as last_error; outbox_enqueue refuses then).
pub fn left_out_reason() -> Option<String> {
    if let Some(original) = unadopted_copy_of() {
        return Some(format!(
            "database \"{}\" holds a copy of the outbox of database oid {original} (CREATE DATABASE ... TEMPLATE): it has no relay and publishes nothing until SELECT outbox.adopt_copy() in it",
            current_database()
        ));
    }
    shared::left_out_for_lack_of_entries().then(left_out_message)
}

/// The database whose installation this one is a copy of, if `outbox.installation` names another
/// database (a copy not adopted yet; the probe adopts one that carries nothing at once). Asked only
/// in a database without relays.
fn unadopted_copy_of() -> Option<u32> {
    // SAFETY: set for every connected backend.
    let here = unsafe { pg_sys::MyDatabaseId };
    // outbox.installation is outbox_admin's: read as the bootstrap superuser, whatever role
    // enqueues or reads outbox.stats (an error's transaction abort restores the user too).
    let mut user = pg_sys::InvalidOid;
    let mut context = 0;
    // SAFETY: saves and switches the current user for one catalog-like read, restored below.
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
        pg_sys::SetUserIdAndSecContext(
            pg_sys::Oid::from(pg_sys::BOOTSTRAP_SUPERUSERID),
            context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32,
        );
    }
    let recorded = Spi::get_one::<pg_sys::Oid>("SELECT database_oid FROM outbox.installation");
    // SAFETY: restores what was saved above.
    unsafe { pg_sys::SetUserIdAndSecContext(user, context) };
    let recorded = recorded.ok().flatten()?;
    (recorded != here).then(|| recorded.to_u32())
}

/// Refuses, for `outbox_enqueue`, a stream `outbox.allowed_streams` does not permit.
pub fn check_allowed_stream(aggregate_type: &str, event_type: &str, stream: Option<&str>) {
    let patterns = guc::allowed_streams();
    if !streams::allows_every_stream(&patterns) {
        check_stream(&patterns, aggregate_type, event_type, stream);
    }
}

/// Refuses a stream (given, or from the template) that `outbox.allowed_streams` does not allow.
fn check_stream(patterns: &str, aggregate_type: &str, event_type: &str, stream: Option<&str>) {
    let template = guc::stream_template();
    let key = match stream {
        Some(stream) => stream.to_string(),
        None => outbox_sink::entry::render_stream_template(&template, aggregate_type, event_type),
    };
    if !streams::allowed(patterns, &key) {
        let source = if stream.is_some() {
            "the stream argument".to_string()
        } else {
            format!("outbox.stream ('{template}') for this event")
        };
        ErrorReport::new(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            format!(
                "outbox_enqueue: stream \"{}\" ({source}) is not allowed by outbox.allowed_streams",
                streams::shown(&key)
            ),
            "outbox_enqueue",
        )
        .set_hint(format!(
            "Allowed streams match one of these patterns: '{patterns}'. Use such a stream, or have a superuser extend outbox.allowed_streams."
        ))
        .report(PgLogLevel::ERROR);
    }
}

/// The name of the database this backend is connected to (looked up once per backend).
fn current_database() -> String {
    thread_local! {
        static NAME: std::cell::OnceCell<String> = const { std::cell::OnceCell::new() };
    }
    NAME.with(|name| {
        name.get_or_init(|| {
            // SAFETY: connected backend; the name is palloc'd in the current context and
            // copied before that context goes away.
            unsafe {
                let raw = pg_sys::get_database_name(pg_sys::MyDatabaseId);
                if raw.is_null() {
                    String::new()
                } else {
                    std::ffi::CStr::from_ptr(raw).to_string_lossy().into_owned()
                }
            }
        })
        .clone()
    })
}
