//! SQL-callable functions implemented in Rust, all in schema `outbox`: the pieces SQL cannot do
//! itself, the relays' status, and the checks `outbox_enqueue` (src/enqueue/mod.rs) makes.

use pgrx::prelude::*;

pub(crate) use outbox::{check_allowed_stream, check_relayed_database};

#[pg_schema]
mod outbox {
    use pgrx::pg_sys;
    use pgrx::pg_sys::panic::ErrorReport;
    use pgrx::prelude::*;

    use crate::guc;
    use crate::shared::{self, in_flight};

    /// Refuses, for `outbox_enqueue`, when no relay would deliver the event: the library is not
    /// preloaded, or `outbox.databases` leaves this database out.
    pub(crate) fn check_relayed_database() {
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

    /// Why no relay serves this database although it would be relayed: every entry of shared memory
    /// serves another database (outbox.stats shows it as last_error; outbox_enqueue refuses).
    pub(crate) fn left_out_reason() -> Option<String> {
        shared::left_out_for_lack_of_entries().then(left_out_message)
    }

    /// Refuses, for `outbox_enqueue`, a stream `outbox.allowed_streams` does not permit.
    pub(crate) fn check_allowed_stream(aggregate_type: &str, event_type: &str, stream: Option<&str>) {
        let patterns = guc::allowed_streams();
        if !crate::enqueue::streams::allows_every_stream(&patterns) {
            check_stream(&patterns, aggregate_type, event_type, stream);
        }
    }

    /// Refuses a stream (given, or from the template) that `outbox.allowed_streams` does not allow.
    fn check_stream(patterns: &str, aggregate_type: &str, event_type: &str, stream: Option<&str>) {
        let template = guc::stream_template();
        let key = match stream {
            Some(stream) => stream.to_string(),
            None => crate::render_stream_template(&template, aggregate_type, event_type),
        };
        if !crate::enqueue::streams::allowed(patterns, &key) {
            let source = if stream.is_some() {
                "the stream argument".to_string()
            } else {
                format!("outbox.stream ('{template}') for this event")
            };
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                format!(
                    "outbox_enqueue: stream \"{}\" ({source}) is not allowed by outbox.allowed_streams",
                    crate::enqueue::streams::shown(&key)
                ),
                "outbox_enqueue",
            )
            .set_hint(format!(
                "Allowed streams match one of these patterns: '{patterns}'. Use such a stream, or have a superuser extend outbox.allowed_streams."
            ))
            .report(PgLogLevel::ERROR);
        }
    }

    /// `outbox._check_allowed_stream(stream)`: refuses (42501) a stream `outbox.allowed_streams`
    /// does not allow, for `outbox.replay`'s `into`.
    #[pg_extern(volatile, parallel_unsafe, name = "_check_allowed_stream")]
    fn check_allowed_stream_for_replay(stream: &str) {
        let patterns = guc::allowed_streams();
        if !crate::enqueue::streams::allows_every_stream(&patterns)
            && !crate::enqueue::streams::allowed(&patterns, stream)
        {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                format!(
                    "outbox.replay: stream \"{}\" (into) is not allowed by outbox.allowed_streams",
                    crate::enqueue::streams::shown(stream)
                ),
                "outbox.replay",
            )
            .set_hint(format!(
                "Allowed streams match one of these patterns: '{patterns}'. Replay into such a stream, or have a superuser extend outbox.allowed_streams."
            ))
            .report(PgLogLevel::ERROR);
        }
    }

    /// `outbox._wake_for_replay()`: a replay was asked for; the relays of this database look as
    /// soon as the asking transaction commits (before, their claim would not see it).
    #[pg_extern(volatile, parallel_unsafe, name = "_wake_for_replay")]
    fn wake_for_replay() {
        crate::enqueue::wake::replay_at_commit();
    }

    /// The next transaction id to be assigned (`ReadNextFullTransactionId`): every transaction
    /// that has an id now has a lower one. Retention's bound on the writers of a switched table
    /// (outbox._retention); a snapshot's xmax is not such a bound, being one above the latest
    /// *completed* id.
    #[pg_extern(volatile, parallel_unsafe, name = "_next_xid")]
    fn next_xid() -> i64 {
        // SAFETY: reads the shared transaction-id counter under its lock; no preconditions.
        unsafe { pg_sys::ReadNextFullTransactionId() }.value as i64
    }

    /// Whether a transaction is enqueuing for this aggregate right now (src/enqueue/order.rs).
    #[pg_extern(volatile, parallel_unsafe, name = "_enqueue_in_progress")]
    fn enqueue_in_progress(aggregate_type: &str, aggregate_id: &str) -> bool {
        crate::enqueue::order::enqueue_in_progress(aggregate_type, aggregate_id)
    }

    /// Keeps transactions past the order-lock cap out until the end of the caller's transaction;
    /// false (without waiting) while one runs (src/enqueue/order.rs). For `outbox.forget_aggregates`.
    #[pg_extern(volatile, parallel_unsafe, name = "_exclude_transactions_past_the_cap")]
    fn exclude_transactions_past_the_cap() -> bool {
        crate::enqueue::order::exclude_transactions_past_the_cap()
    }

    /// `tests.shard_of` (src/sql/test_helpers.sql, test build only): the shard (0..15) of an
    /// aggregate, which relay's unit of work its events belong to.
    #[cfg(any(test, feature = "pg_test"))]
    #[pg_extern(sql = false)]
    fn shard_of(aggregate_type: &str, aggregate_id: &str) -> i16 {
        crate::enqueue::order::shard_of(aggregate_type, aggregate_id)
    }

    /// The role the caller acts as, outside any SECURITY DEFINER function: inside one (such as
    /// `outbox_mark_processed`) `current_user` is the function's owner.
    #[pg_extern(stable, parallel_safe, name = "_calling_role")]
    fn calling_role() -> pg_sys::Oid {
        // SAFETY: set for every connected backend; SECURITY DEFINER functions do not change it.
        unsafe { pg_sys::GetOuterUserId() }
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

    /// Now, as a PostgreSQL timestamp (µs since 2000).
    fn now_us() -> i64 {
        // SAFETY: reads the clock; no preconditions.
        unsafe { pg_sys::GetCurrentTimestamp() }
    }

    /// Process id of the running relay worker, or NULL when none runs.
    #[pg_extern(volatile, parallel_safe)]
    fn relay_pid() -> Option<i32> {
        if crate::preloaded() && shared::relays_serve_this_database() {
            shared::relay_pid()
        } else {
            None
        }
    }

    /// Whether the relay's last contact with Redis succeeded.
    #[pg_extern(volatile, parallel_safe)]
    fn redis_connected() -> bool {
        crate::preloaded() && shared::relays_serve_this_database() && shared::redis_connected()
    }

    /// One row per running relay: its slot, pid, and the round it has in flight (events it is
    /// publishing right now, since when; `claim_expired` once older than `outbox.lease`, when other
    /// relays take its shards over and publish them again). A relay whose round stays old is hung.
    #[allow(clippy::type_complexity)] // the column list of a set-returning SQL function
    #[pg_extern(volatile, parallel_safe)]
    fn relays() -> TableIterator<
        'static,
        (
            name!(slot, i32),
            name!(pid, i32),
            name!(claimed, i64),
            name!(claimed_at, Option<TimestampWithTimeZone>),
            name!(claim_expired, bool),
        ),
    > {
        if !crate::preloaded() || !shared::relays_serve_this_database() {
            return TableIterator::new(Vec::new());
        }
        let held = in_flight::held(guc::lease());
        let rows: Vec<_> = (0..shared::MAX_RELAYS)
            .filter_map(|slot| {
                let pid = shared::relay_pid_in(slot)?;
                let claim = held.iter().find(|(held_slot, ..)| *held_slot == slot);
                Some((
                    slot as i32,
                    pid,
                    claim.map_or(0, |(_, count, ..)| *count as i64),
                    claim.and_then(|(_, _, at, _)| TimestampWithTimeZone::try_from(*at).ok()),
                    claim.is_some_and(|(.., expired)| *expired),
                ))
            })
            .collect();
        TableIterator::new(rows)
    }

    /// The relays' state as `outbox.stats` shows it: pid, Redis health, latest error, how many
    /// events they hold claimed in shared memory, and how many they published since the server
    /// started. In a database the relays do not serve, there is no relay to report.
    #[allow(clippy::type_complexity)] // the column list of a set-returning SQL function
    #[pg_extern(volatile, parallel_safe)]
    fn relay_status() -> TableIterator<
        'static,
        (
            name!(worker_pid, Option<i32>),
            name!(workers, i32),
            name!(redis_connected, bool),
            name!(last_error, Option<String>),
            name!(last_error_at, Option<TimestampWithTimeZone>),
            name!(in_flight, i64),
            name!(published_total, i64),
        ),
    > {
        let (pid, workers, connected, error, in_flight, published) =
            if crate::preloaded() && shared::relays_serve_this_database() {
                (
                    shared::relay_pid(),
                    shared::relays_running(),
                    shared::redis_connected(),
                    shared::last_error(),
                    in_flight::in_flight_count(guc::lease()),
                    shared::published_total(),
                )
            } else {
                let left_out = crate::preloaded().then(left_out_reason).flatten();
                (None, 0, false, left_out.map(|reason| (reason, now_us())), 0, 0)
            };
        let (message, at) = match error {
            Some((message, at)) => (Some(message), TimestampWithTimeZone::try_from(at).ok()),
            None => (None, None),
        };
        TableIterator::once((pid, workers, connected, message, at, in_flight, published))
    }
}
