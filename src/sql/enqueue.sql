-- outbox_enqueue: the application's one call, in its own transaction (src/enqueue/). It lives in
-- the extension's schema (public by default), so that applications call it without a schema
-- prefix; everything else lives in schema outbox. Writers (role outbox_writer) need no privilege
-- on the log, so they cannot read other writers' payloads.

-- -------------------------------------------------------------------------------------------------
-- outbox_enqueue(aggregate_type, aggregate_id, event_type, payload, headers, stream)
--
--     Appends one event to the log in the caller's transaction: checks every argument (README,
--     "SQL API", lists what it refuses), takes the aggregate's order lock (held until the
--     transaction ends, so that within an aggregate id order is commit order), checks the stream
--     against outbox.allowed_streams, and inserts one row into the current log table. The commit
--     wakes the database's relays; a rollback leaves nothing. No network I/O.
--
-- Parameters:
--     aggregate_type, aggregate_id  the aggregate: its events keep their order; its shard
--     event_type                    what happened
--     payload                       the event (JSON null is a valid payload)
--     headers                       a JSON object sent with the entry, or NULL
--     stream                        the Redis stream, or NULL for the outbox.stream template
-- Returns:
--     the event_id (a UUIDv7), which every stream entry of the event carries
-- Reads:   outbox.generations (which log table is current)
-- Writes:  insert outbox.events_<current generation>; nextval outbox.events_id_seq
-- Called by: applications (role outbox_writer), directly or through the overloads below
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION @extschema@.outbox_enqueue(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL,
    stream         text  DEFAULT NULL
) RETURNS uuid
-- src/enqueue/: the argument checks, the order lock, and one insert into the log's current table
-- through plans kept for the session.
LANGUAGE c VOLATILE PARALLEL UNSAFE
-- No SET search_path clause (it would cost a GUC save and restore on every call): the direct
-- insert runs no user code, and the executor path (a table a DBA gave a trigger) pins
-- search_path = pg_catalog, pg_temp itself around the insert (src/enqueue/).
SECURITY DEFINER
AS 'MODULE_PATHNAME', 'outbox_enqueue_wrapper';

COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) IS
    'Writes one event to the outbox log in the caller''s transaction and returns its event_id; the relay publishes it to Redis after commit';

-- The same for a bigint or a uuid aggregate id, stored as its text form: callers pass either
-- without a cast. Named arguments work the same.
CREATE FUNCTION @extschema@.outbox_enqueue(aggregate_type text, aggregate_id bigint, event_type text, payload jsonb,
                                           headers jsonb DEFAULT NULL, stream text DEFAULT NULL) RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL UNSAFE
AS $fn$ SELECT @extschema@.outbox_enqueue($1, $2::text, $3, $4, $5, $6) $fn$;
CREATE FUNCTION @extschema@.outbox_enqueue(aggregate_type text, aggregate_id uuid, event_type text, payload jsonb,
                                           headers jsonb DEFAULT NULL, stream text DEFAULT NULL) RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL UNSAFE
AS $fn$ SELECT @extschema@.outbox_enqueue($1, $2::text, $3, $4, $5, $6) $fn$;
COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, bigint, text, jsonb, jsonb, text) IS
    'outbox_enqueue for a bigint aggregate id (stored as its text form)';
COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, uuid, text, jsonb, jsonb, text) IS
    'outbox_enqueue for a uuid aggregate id (stored as its text form)';

-- Privileges: enqueue is for outbox_writer (and the owner).
REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, bigint, text, jsonb, jsonb, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, uuid, text, jsonb, jsonb, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) TO outbox_writer;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, bigint, text, jsonb, jsonb, text) TO outbox_writer;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, uuid, text, jsonb, jsonb, text) TO outbox_writer;
