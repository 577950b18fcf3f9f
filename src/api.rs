//! SQL-callable functions implemented in Rust, all in schema `outbox`: the pieces SQL cannot do
//! itself and the relays' status (`outbox_enqueue` and its checks are src/enqueue/).

use pgrx::prelude::*;

#[pg_schema]
mod outbox {
    use pgrx::pg_sys;
    use pgrx::pg_sys::panic::ErrorReport;
    use pgrx::prelude::*;

    use crate::enqueue::checks::left_out_reason;
    use crate::guc;
    use crate::shared::{self, in_flight};

    /// `outbox._check_allowed_stream(stream)`: refuses (42501) a stream `outbox.allowed_streams`
    /// does not allow, for `outbox.replay`'s `to_stream`.
    #[pg_extern(volatile, parallel_unsafe, name = "_check_allowed_stream")]
    fn check_allowed_stream_for_replay(stream: &str) {
        let patterns = guc::allowed_streams();
        if !outbox_sink::streams::allows_every_stream(&patterns) && !outbox_sink::streams::allowed(&patterns, stream) {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                format!(
                    "outbox.replay: stream \"{}\" (to_stream) is not allowed by outbox.allowed_streams",
                    outbox_sink::streams::shown(stream)
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

    /// `outbox._rescan_at_commit()`: `outbox.adopt_copy()` made this database's outbox its own;
    /// once that commits, the launcher looks at it again and gives it relays (an unadopted copy
    /// has none: src/relay/launcher.rs).
    #[pg_extern(volatile, parallel_unsafe, name = "_rescan_at_commit")]
    fn rescan_at_commit() {
        crate::enqueue::wake::rescan_at_commit();
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
