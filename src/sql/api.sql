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
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
-- Writers (role outbox_writer) need no privilege on the table, so they cannot read other writers'
-- payloads; every name below is schema-qualified and the search_path is pinned.
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    payload_limit integer;
    payload_bytes integer;
    headers_bytes integer;
    writer_txid   xid8;
    target        smallint;
    event_shard   smallint;
    new_event_id  uuid;
BEGIN
    IF outbox_enqueue.aggregate_type IS NULL THEN
        RAISE EXCEPTION 'outbox_enqueue: aggregate_type must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the kind of entity the event is about, e.g. ''payment''.';
    ELSIF outbox_enqueue.aggregate_type = '' THEN
        RAISE EXCEPTION 'outbox_enqueue: aggregate_type must not be empty (got '''')'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the kind of entity the event is about, e.g. ''payment''.';
    ELSIF octet_length(outbox_enqueue.aggregate_type) > 255 THEN
        RAISE EXCEPTION 'outbox_enqueue: aggregate_type is % bytes long (starts with %), the limit is 255 bytes',
                octet_length(outbox_enqueue.aggregate_type), quote_literal(left(outbox_enqueue.aggregate_type, 40))
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'aggregate_type names a kind of entity, e.g. ''payment''; put data in the payload.';
    END IF;
    IF outbox_enqueue.aggregate_id IS NULL THEN
        RAISE EXCEPTION 'outbox_enqueue: aggregate_id must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the id of the entity the event is about (text, bigint or uuid).';
    ELSIF outbox_enqueue.aggregate_id = '' THEN
        RAISE EXCEPTION 'outbox_enqueue: aggregate_id must not be empty (got '''')'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the id of the entity the event is about (text, bigint or uuid).';
    ELSIF octet_length(outbox_enqueue.aggregate_id) > 1024 THEN
        RAISE EXCEPTION 'outbox_enqueue: aggregate_id is % bytes long (starts with %), the limit is 1024 bytes',
                octet_length(outbox_enqueue.aggregate_id), quote_literal(left(outbox_enqueue.aggregate_id, 40))
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the id of the entity the event is about (text, bigint or uuid); put data in the payload.';
    END IF;
    IF outbox_enqueue.event_type IS NULL THEN
        RAISE EXCEPTION 'outbox_enqueue: event_type must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass what happened, e.g. ''payment.created''.';
    ELSIF outbox_enqueue.event_type = '' THEN
        RAISE EXCEPTION 'outbox_enqueue: event_type must not be empty (got '''')'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass what happened, e.g. ''payment.created''.';
    ELSIF octet_length(outbox_enqueue.event_type) > 255 THEN
        RAISE EXCEPTION 'outbox_enqueue: event_type is % bytes long (starts with %), the limit is 255 bytes',
                octet_length(outbox_enqueue.event_type), quote_literal(left(outbox_enqueue.event_type, 40))
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'event_type names what happened, e.g. ''payment.created''; put data in the payload.';
    END IF;
    IF outbox_enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'outbox_enqueue: payload must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass a jsonb value; use ''null''::jsonb for an event without a body.';
    END IF;
    IF outbox_enqueue.headers IS NOT NULL THEN
        IF jsonb_typeof(outbox_enqueue.headers) <> 'object' THEN
            RAISE EXCEPTION 'outbox_enqueue: headers must be a JSON object, got a JSON %: %',
                    jsonb_typeof(outbox_enqueue.headers), left(outbox_enqueue.headers::text, 100)
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Pass e.g. ''{"trace_id": "abc"}''::jsonb, or NULL for no headers.';
        END IF;
        headers_bytes := octet_length(outbox_enqueue.headers::text);
        IF headers_bytes > 65536 THEN
            RAISE EXCEPTION 'outbox_enqueue: headers are % bytes as JSON text (starts with %), the limit is 65536 bytes',
                    headers_bytes, left(outbox_enqueue.headers::text, 40)
                USING ERRCODE = 'program_limit_exceeded',
                      HINT = 'Headers carry small metadata such as trace ids; put data in the payload.';
        END IF;
    END IF;
    IF outbox_enqueue.stream IS NOT NULL THEN
        IF outbox_enqueue.stream = '' THEN
            RAISE EXCEPTION 'outbox_enqueue: stream must not be empty (got '''')'
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Pass NULL to use the outbox.stream template, or a Redis key of 1 to 512 bytes.';
        ELSIF octet_length(outbox_enqueue.stream) > 512 THEN
            RAISE EXCEPTION 'outbox_enqueue: stream is % bytes long (starts with %), the limit is 512 bytes',
                    octet_length(outbox_enqueue.stream), quote_literal(left(outbox_enqueue.stream, 40))
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Pass NULL to use the outbox.stream template, or a Redis key of 1 to 512 bytes.';
        END IF;
    END IF;

    -- Checks that a relay will deliver the event (the library is preloaded and relays this
    -- database) and that its stream is one outbox.allowed_streams permits, arms the commit-time
    -- wake-up of the relay, and returns outbox.max_payload_size in bytes.
    -- It also takes the aggregate's order lock: enqueues of one aggregate take turns until commit,
    -- so within an aggregate the id drawn below follows commit order.
    payload_limit := outbox._prepare_enqueue(outbox_enqueue.aggregate_type, outbox_enqueue.aggregate_id,
                                             outbox_enqueue.event_type, outbox_enqueue.stream);
    -- The limit applies to what is sent to Redis: the payload's JSON text.
    payload_bytes := octet_length(outbox_enqueue.payload::text);
    IF payload_bytes > payload_limit THEN
        RAISE EXCEPTION 'outbox_enqueue: payload is % bytes, larger than outbox.max_payload_size (% bytes)',
                payload_bytes, payload_limit
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'Put large documents elsewhere and send a reference in the event, or have a superuser raise outbox.max_payload_size.';
    END IF;

    -- The transaction id before the generation: a writer that read a generation just before it was
    -- switched already had its transaction id then, which is how retention knows when no writer
    -- can be left on a closed table (outbox._rotate).
    writer_txid := pg_catalog.pg_current_xact_id();
    SELECT g.generation INTO target FROM outbox.generations g WHERE g.state = 'current';
    event_shard := outbox._shard_of(outbox_enqueue.aggregate_type, outbox_enqueue.aggregate_id);
    new_event_id := outbox.uuid_generate_v7();
    -- One statement per table, so that each keeps its plan (no dynamic SQL on this path).
    IF target = 0 THEN
        INSERT INTO outbox.events_0 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
        VALUES (writer_txid, event_shard, nextval('outbox.events_id_seq'), new_event_id, outbox_enqueue.aggregate_type,
                outbox_enqueue.aggregate_id, outbox_enqueue.event_type, outbox_enqueue.payload, outbox_enqueue.headers,
                outbox_enqueue.stream, clock_timestamp());
    ELSIF target = 1 THEN
        INSERT INTO outbox.events_1 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
        VALUES (writer_txid, event_shard, nextval('outbox.events_id_seq'), new_event_id, outbox_enqueue.aggregate_type,
                outbox_enqueue.aggregate_id, outbox_enqueue.event_type, outbox_enqueue.payload, outbox_enqueue.headers,
                outbox_enqueue.stream, clock_timestamp());
    ELSE
        INSERT INTO outbox.events_2 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
        VALUES (writer_txid, event_shard, nextval('outbox.events_id_seq'), new_event_id, outbox_enqueue.aggregate_type,
                outbox_enqueue.aggregate_id, outbox_enqueue.event_type, outbox_enqueue.payload, outbox_enqueue.headers,
                outbox_enqueue.stream, clock_timestamp());
    END IF;
    RETURN new_event_id;
END
$fn$;

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
