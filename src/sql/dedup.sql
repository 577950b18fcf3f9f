-- Consumer-side deduplication, for consumers that write to PostgreSQL: they mark each event they
-- process in their own transaction, together with its effect, so that the mark and the effect
-- commit (or roll back) together (README, "Consuming events"). The marks are in
-- outbox.processed_messages, the consumer names and their owners in outbox.consumers.

-- -------------------------------------------------------------------------------------------------
-- outbox_mark_processed(consumer, event_id)
--
--     Records that consumer processed event_id: true the first time, false on a repeat (skip the
--     effect then). A consumer name belongs to the role that used it first (and that role's
--     members): another role gets 42501, since its marks would make the owner skip events.
--
-- Parameters:
--     consumer    the consuming service's name, not empty, at most 255 bytes
--     event_id    the entry's event_id
-- Returns:
--     true the first time, false on a repeat
-- Reads:   outbox.consumers
-- Writes:  insert outbox.consumers (a name's first use), outbox.processed_messages
-- Called by: consumers (role outbox_consumer), in their own transaction
-- -------------------------------------------------------------------------------------------------
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
    IF octet_length(outbox_mark_processed.consumer) > 255 THEN
        RAISE EXCEPTION 'outbox_mark_processed: consumer name is % bytes long (starts with %), the limit is 255 bytes',
                octet_length(outbox_mark_processed.consumer), quote_literal(left(outbox_mark_processed.consumer, 40))
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Name the consuming service with at most 255 bytes, like aggregate and event types, e.g. ''notifications''.';
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

-- -------------------------------------------------------------------------------------------------
-- outbox.purge_processed(older_than)
--
--     Deletes the dedup marks older than older_than. Where a relay runs, its housekeeping already
--     deletes them after outbox.retention (outbox._retention); this is for databases no relay
--     serves (outbox.databases leaves them out), e.g. a consumer's own.
--
-- Parameters:
--     older_than  a non-negative interval
-- Returns:
--     how many marks it deleted
-- Reads:   nothing else
-- Writes:  delete outbox.processed_messages
-- Called by: admins (role outbox_admin)
-- -------------------------------------------------------------------------------------------------
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

-- Privileges: deduplication is for outbox_consumer, purging the marks for outbox_admin.
REVOKE ALL ON FUNCTION @extschema@.outbox_mark_processed(text, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_mark_processed(text, uuid) TO outbox_consumer;
REVOKE ALL ON FUNCTION outbox.purge_processed(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.purge_processed(interval) TO outbox_admin;
