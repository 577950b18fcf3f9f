-- outbox_pg's public API: outbox_enqueue (in the caller's transaction) and the consumer-side
-- deduplication functions, with their privileges. Part of the install script (see src/lib.rs for
-- the order of the parts: schema.sql, then this file and relay.sql, then operations.sql).

-- outbox_enqueue lives in the extension's schema (public by default) so that applications call it
-- without a schema prefix; everything else lives in schema outbox.
CREATE FUNCTION @extschema@.outbox_enqueue(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL,
    stream         text  DEFAULT NULL
) RETURNS uuid
-- src/enqueue.rs: the argument checks, the order lock, and one insert into the log's current
-- table through plans kept for the session.
LANGUAGE c VOLATILE PARALLEL UNSAFE
-- Writers (role outbox_writer) need no privilege on the log, so they cannot read other writers'
-- payloads. No pinned search_path (it would cost a GUC save and restore on every call): the
-- function's statements schema-qualify every name, operators included.
SECURITY DEFINER
AS 'MODULE_PATHNAME', 'outbox_enqueue_wrapper';

COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) IS
    'Writes one event to the outbox log in the caller''s transaction and returns its event_id; the relay publishes it to Redis after commit';

-- Overloads so that callers pass bigint or uuid ids without a cast. Named arguments work the same.
CREATE FUNCTION @extschema@.outbox_enqueue(
    aggregate_type text,
    aggregate_id   bigint,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL,
    stream         text  DEFAULT NULL
) RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL UNSAFE
AS $fn$ SELECT @extschema@.outbox_enqueue($1, $2::text, $3, $4, $5, $6) $fn$;

COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, bigint, text, jsonb, jsonb, text) IS
    'outbox_enqueue for a bigint aggregate id (stored as its text form)';

CREATE FUNCTION @extschema@.outbox_enqueue(
    aggregate_type text,
    aggregate_id   uuid,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL,
    stream         text  DEFAULT NULL
) RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL UNSAFE
AS $fn$ SELECT @extschema@.outbox_enqueue($1, $2::text, $3, $4, $5, $6) $fn$;

COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, uuid, text, jsonb, jsonb, text) IS
    'outbox_enqueue for a uuid aggregate id (stored as its text form)';

-- Consumer-side deduplication: true the first time a consumer processes an event, false on a
-- repeat. Call it in the consumer's own transaction together with the effect, so that the mark and
-- the effect commit (or roll back) together.
CREATE FUNCTION @extschema@.outbox_mark_processed(consumer text, event_id uuid)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    first_time boolean;
    caller     regrole;
    owner_role regrole;
BEGIN
    IF outbox_mark_processed.consumer IS NULL OR outbox_mark_processed.consumer = '' THEN
        RAISE EXCEPTION 'outbox_mark_processed: consumer must be a non-empty name, got %',
                coalesce(quote_literal(outbox_mark_processed.consumer), 'NULL')
            USING ERRCODE = CASE WHEN outbox_mark_processed.consumer IS NULL THEN 'null_value_not_allowed'
                                 ELSE 'invalid_parameter_value' END,
                  HINT = 'Name the consuming service, e.g. ''notifications''; each consumer deduplicates on its own.';
    END IF;
    IF outbox_mark_processed.event_id IS NULL THEN
        RAISE EXCEPTION 'outbox_mark_processed: event_id must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the entry''s event_id field, e.g. outbox_mark_processed(''notifications'', ''…''::uuid).';
    END IF;
    -- A consumer name belongs to the role that used it first: another consumer marking events
    -- under it would make this one skip them. current_user is the owner here (SECURITY DEFINER),
    -- so the caller's role comes from _calling_role (the role in effect outside this function).
    caller := outbox._calling_role();
    SELECT c.owner INTO owner_role FROM outbox.consumers c WHERE c.consumer = outbox_mark_processed.consumer;
    IF NOT FOUND THEN
        INSERT INTO outbox.consumers AS c (consumer, owner)
        VALUES (outbox_mark_processed.consumer, caller)
        ON CONFLICT ON CONSTRAINT consumers_pkey DO NOTHING;
        SELECT c.owner INTO owner_role FROM outbox.consumers c WHERE c.consumer = outbox_mark_processed.consumer;
    END IF;
    IF NOT pg_catalog.pg_has_role(caller::oid, owner_role::oid, 'MEMBER') THEN
        RAISE EXCEPTION 'outbox_mark_processed: consumer name % belongs to role %, not to %',
                quote_literal(outbox_mark_processed.consumer), owner_role, caller
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Use a consumer name of your own, or have an outbox_admin release this one (DELETE FROM outbox.consumers WHERE consumer = ...) or grant you its owner role.';
    END IF;
    INSERT INTO outbox.processed_messages AS p (consumer, event_id)
    VALUES (outbox_mark_processed.consumer, outbox_mark_processed.event_id)
    ON CONFLICT ON CONSTRAINT processed_messages_pkey DO NOTHING
    RETURNING true INTO first_time;
    RETURN coalesce(first_time, false);
END
$fn$;

COMMENT ON FUNCTION @extschema@.outbox_mark_processed(text, uuid) IS
    'Consumer-side dedup: records that consumer processed event_id; true the first time, false on a repeat';

-- Deletes processed-message marks older than older_than (for databases other than outbox.database,
-- where the relay does not apply retention itself). Returns how many.
CREATE FUNCTION outbox.purge_processed(older_than interval)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    purged bigint;
BEGIN
    IF older_than IS NULL OR older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox.purge_processed: older_than must be a non-negative interval, got %', coalesce(older_than::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass a window longer than redeliveries can take, e.g. ''7 days''.';
    END IF;
    DELETE FROM outbox.processed_messages p WHERE p.processed_at <= now() - older_than;
    GET DIAGNOSTICS purged = ROW_COUNT;
    RETURN purged;
END
$fn$;

COMMENT ON FUNCTION outbox.purge_processed(interval) IS
    'Deletes consumer dedup marks older than older_than; returns how many';

-- Privileges: enqueue is for outbox_writer (and the owner), deduplication for outbox_consumer.
REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, bigint, text, jsonb, jsonb, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, uuid, text, jsonb, jsonb, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) TO outbox_writer;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, bigint, text, jsonb, jsonb, text) TO outbox_writer;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, uuid, text, jsonb, jsonb, text) TO outbox_writer;
REVOKE ALL ON FUNCTION @extschema@.outbox_mark_processed(text, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_mark_processed(text, uuid) TO outbox_consumer;
REVOKE ALL ON FUNCTION outbox.purge_processed(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.purge_processed(interval) TO outbox_admin;
