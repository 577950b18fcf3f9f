//! SQL-callable functions implemented in Rust, all in schema `outbox`: the pieces SQL cannot do
//! itself, the relays' status, and the checks `outbox_enqueue` (src/enqueue.rs) makes.

use pgrx::prelude::*;

pub(crate) use outbox::{check_allowed_stream, check_relayed_database};

#[pg_schema]
mod outbox {
    use pgrx::pg_sys;
    use pgrx::pg_sys::panic::ErrorReport;
    use pgrx::prelude::*;

    use crate::{claims, guc, shmem};

    /// Generates a UUIDv7: time-ordered, so the unique index on `event_id` grows at its right edge
    /// (like the id index) instead of touching a random page per insert.
    #[pg_extern(volatile, parallel_safe)]
    fn uuid_generate_v7() -> pgrx::Uuid {
        pgrx::Uuid::from_bytes(*uuid::Uuid::now_v7().as_bytes())
    }

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
    }

    /// Refuses, for `outbox_enqueue`, a stream `outbox.allowed_streams` does not permit.
    pub(crate) fn check_allowed_stream(aggregate_type: &str, event_type: &str, stream: Option<&str>) {
        let patterns = guc::allowed_streams();
        if !crate::streams::allows_every_stream(&patterns) {
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
        if !crate::streams::allowed(patterns, &key) {
            let source = if stream.is_some() {
                "the stream argument".to_string()
            } else {
                format!("outbox.stream ('{template}') for this event")
            };
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                format!(
                    "outbox_enqueue: stream \"{}\" ({source}) is not allowed by outbox.allowed_streams",
                    crate::streams::shown(&key)
                ),
                "outbox_enqueue",
            )
            .set_hint(format!(
                "Allowed streams match one of these patterns: '{patterns}'. Use such a stream, or have a superuser extend outbox.allowed_streams."
            ))
            .report(PgLogLevel::ERROR);
        }
    }

    /// Whether a transaction is enqueuing for this aggregate right now (src/order.rs).
    #[pg_extern(volatile, parallel_unsafe, name = "_enqueue_in_progress")]
    fn enqueue_in_progress(aggregate_type: &str, aggregate_id: &str) -> bool {
        crate::order::enqueue_in_progress(aggregate_type, aggregate_id)
    }

    /// The shard (0..15) of an aggregate: which relay's unit of work its events belong to.
    #[pg_extern(immutable, parallel_safe, name = "_shard_of")]
    fn shard_of(aggregate_type: &str, aggregate_id: &str) -> i16 {
        crate::order::shard_of(aggregate_type, aggregate_id)
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

    /// Process id of the running relay worker, or NULL when none runs.
    #[pg_extern(volatile, parallel_safe)]
    fn relay_pid() -> Option<i32> {
        if crate::preloaded() && shmem::relays_serve_this_database() {
            shmem::relay_pid()
        } else {
            None
        }
    }

    /// Whether the relay's last contact with Redis succeeded.
    #[pg_extern(volatile, parallel_safe)]
    fn redis_connected() -> bool {
        crate::preloaded() && shmem::relays_serve_this_database() && shmem::redis_connected()
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
        if !crate::preloaded() || !shmem::relays_serve_this_database() {
            return TableIterator::new(Vec::new());
        }
        let held = claims::held(guc::lease());
        let rows: Vec<_> = (0..shmem::MAX_RELAYS)
            .filter_map(|slot| {
                let pid = shmem::relay_pid_in(slot)?;
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
            if crate::preloaded() && shmem::relays_serve_this_database() {
                (
                    shmem::relay_pid(),
                    shmem::relays_running(),
                    shmem::redis_connected(),
                    shmem::last_error(),
                    claims::in_flight_count(guc::lease()),
                    shmem::published_total(),
                )
            } else {
                (None, 0, false, None, 0, 0)
            };
        let (message, at) = match error {
            Some((message, at)) => (Some(message), TimestampWithTimeZone::try_from(at).ok()),
            None => (None, None),
        };
        TableIterator::once((pid, workers, connected, message, at, in_flight, published))
    }
}
