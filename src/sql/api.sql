-- The comments and privileges of the functions written in Rust (src/api.rs, #[pg_extern]). pgrx
-- creates those functions from the Rust code, so what SQL says about them comes last in the install
-- script (finalize, src/lib.rs), after them. What each does is in its doc comment in src/api.rs.

-- The relays' state, read from shared memory, for anyone.
COMMENT ON FUNCTION outbox.relay_pid() IS
    'Process id of a relay serving this database, NULL when none runs';
COMMENT ON FUNCTION outbox.redis_connected() IS
    'Whether the relays'' last contact with Redis succeeded';
COMMENT ON FUNCTION outbox.relays() IS
    'One row per running relay of this database: slot, pid, the events it is publishing and since when, and whether that round is older than outbox.lease (a hung relay)';
COMMENT ON FUNCTION outbox.relay_status() IS
    'The relays'' state as outbox.stats shows it: pid, how many run, Redis health, latest error, events in flight and published since the server started';

-- Helpers of the SQL functions in src/sql/, not for applications.
COMMENT ON FUNCTION outbox._next_xid() IS
    'Internal: the next transaction id to be assigned, above every transaction that has one; retention''s bound on the writers of a switched table';
COMMENT ON FUNCTION outbox._enqueue_in_progress(text, text) IS
    'Internal: whether a transaction holds this aggregate''s order lock, i.e. is enqueuing for it right now (outbox.forget_aggregates)';
COMMENT ON FUNCTION outbox._exclude_transactions_past_the_cap() IS
    'Internal: keeps transactions past the order-lock cap out until this transaction ends; false, without waiting, while one runs (outbox.forget_aggregates)';
COMMENT ON FUNCTION outbox._calling_role() IS
    'Internal: the role the caller acts as outside any SECURITY DEFINER function (outbox_mark_processed)';
COMMENT ON FUNCTION outbox._check_allowed_stream(text) IS
    'Internal: refuses a stream outbox.allowed_streams does not allow (outbox.replay''s to_stream)';
COMMENT ON FUNCTION outbox._rescan_at_commit() IS
    'Internal: asks the launcher, when the calling transaction commits, to look again at the databases it relays none of (outbox.adopt_copy: the copy gets relays)';
COMMENT ON FUNCTION outbox._wake_for_replay() IS
    'Internal: sends the relays to look for replays when the calling transaction commits (outbox.replay)';
REVOKE ALL ON FUNCTION outbox._check_allowed_stream(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._wake_for_replay() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._rescan_at_commit() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._next_xid() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._exclude_transactions_past_the_cap() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._enqueue_in_progress(text, text) FROM PUBLIC;
