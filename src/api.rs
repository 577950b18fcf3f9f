//! SQL-callable functions implemented in Rust. The public API (`outbox_enqueue`) is SQL in
//! `src/sql/functions.sql`; these are the pieces SQL cannot do itself. All live in schema `outbox`.

use pgrx::prelude::*;

#[pg_schema]
mod outbox {
    use pgrx::pg_sys::panic::ErrorReport;
    use pgrx::prelude::*;

    use crate::{guc, shmem, wake};

    /// Generates a UUIDv7: time-ordered, so the unique index on `event_id` grows at its right edge
    /// (like the id index) instead of touching a random page per insert.
    #[pg_extern(volatile, parallel_safe)]
    fn uuid_generate_v7() -> pgrx::Uuid {
        pgrx::Uuid::from_bytes(*uuid::Uuid::now_v7().as_bytes())
    }

    /// Called by `outbox_enqueue` before it inserts: refuses when the relay is not preloaded (the
    /// event would never be delivered), arms the commit-time wake-up, and returns
    /// `outbox.max_payload_size` in bytes.
    #[pg_extern(volatile, parallel_unsafe, name = "_prepare_enqueue")]
    fn prepare_enqueue() -> i32 {
        if !crate::preloaded() {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                "outbox_pg is not loaded through shared_preload_libraries, so no relay would deliver this event",
                "outbox_enqueue",
            )
            .set_hint("Add outbox_pg to shared_preload_libraries in postgresql.conf and restart PostgreSQL.")
            .report(PgLogLevel::ERROR);
        }
        wake::arm();
        guc::max_payload_size()
    }

    /// Process id of the running relay worker, or NULL when none runs.
    #[pg_extern(volatile, parallel_safe)]
    fn relay_pid() -> Option<i32> {
        if crate::preloaded() {
            shmem::relay_pid()
        } else {
            None
        }
    }

    /// Whether the relay's last contact with Redis succeeded.
    #[pg_extern(volatile, parallel_safe)]
    fn redis_connected() -> bool {
        crate::preloaded() && shmem::redis_connected()
    }

    /// The relay's state as `outbox.stats` shows it: pid, Redis health, latest error.
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
        ),
    > {
        let (pid, workers, connected, error) = if crate::preloaded() {
            (shmem::relay_pid(), shmem::relays_running(), shmem::redis_connected(), shmem::last_error())
        } else {
            (None, 0, false, None)
        };
        let (message, at) = match error {
            Some((message, at)) => (Some(message), TimestampWithTimeZone::try_from(at).ok()),
            None => (None, None),
        };
        TableIterator::once((pid, workers, connected, message, at))
    }
}
