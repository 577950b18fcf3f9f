-- outbox_pg functions: the public enqueue API and the statements the relay worker runs.
-- Runs last in the install script (finalize), after the Rust helpers it calls exist.

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
AS $fn$
DECLARE
    payload_limit integer;
    payload_bytes integer;
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
    END IF;
    IF outbox_enqueue.aggregate_id IS NULL THEN
        RAISE EXCEPTION 'outbox_enqueue: aggregate_id must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the id of the entity the event is about (text, bigint or uuid).';
    ELSIF outbox_enqueue.aggregate_id = '' THEN
        RAISE EXCEPTION 'outbox_enqueue: aggregate_id must not be empty (got '''')'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the id of the entity the event is about (text, bigint or uuid).';
    END IF;
    IF outbox_enqueue.event_type IS NULL THEN
        RAISE EXCEPTION 'outbox_enqueue: event_type must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass what happened, e.g. ''payment.created''.';
    ELSIF outbox_enqueue.event_type = '' THEN
        RAISE EXCEPTION 'outbox_enqueue: event_type must not be empty (got '''')'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass what happened, e.g. ''payment.created''.';
    END IF;
    IF outbox_enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'outbox_enqueue: payload must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass a jsonb value; use ''null''::jsonb for an event without a body.';
    END IF;
    IF outbox_enqueue.headers IS NOT NULL AND jsonb_typeof(outbox_enqueue.headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox_enqueue: headers must be a JSON object, got a JSON %: %',
                jsonb_typeof(outbox_enqueue.headers), left(outbox_enqueue.headers::text, 100)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass e.g. ''{"trace_id": "abc"}''::jsonb, or NULL for no headers.';
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

    -- Checks the relay is preloaded (else nothing would ever deliver the event) and arms the
    -- commit-time wake-up of the relay; returns outbox.max_payload_size in bytes.
    payload_limit := outbox._prepare_enqueue();
    -- The limit applies to what is sent to Redis: the payload's JSON text.
    payload_bytes := octet_length(outbox_enqueue.payload::text);
    IF payload_bytes > payload_limit THEN
        RAISE EXCEPTION 'outbox_enqueue: payload is % bytes, larger than outbox.max_payload_size (% bytes)',
                payload_bytes, payload_limit
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'Put large documents elsewhere and send a reference in the event, or have a superuser raise outbox.max_payload_size.';
    END IF;

    INSERT INTO outbox.messages (event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream)
    VALUES (outbox.uuid_generate_v7(), outbox_enqueue.aggregate_type, outbox_enqueue.aggregate_id,
            outbox_enqueue.event_type, outbox_enqueue.payload, outbox_enqueue.headers, outbox_enqueue.stream)
    RETURNING messages.event_id INTO new_event_id;
    RETURN new_event_id;
END
$fn$;

COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) IS
    'Writes one event to outbox.messages in the caller''s transaction and returns its event_id; the relay publishes it to Redis after commit';

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

-- ---------------------------------------------------------------------------------------------
-- The relay's statements. They are plain SQL so that they can be read, explained and tested from
-- psql; the worker calls them through SPI. Not for applications: EXECUTE is revoked from PUBLIC.
-- ---------------------------------------------------------------------------------------------

-- Claims up to batch_size pending rows, oldest first, and marks them publishing. SKIP LOCKED lets
-- several relays (or sessions) claim at once and get disjoint batches. The caller commits before
-- talking to Redis, so no row lock is held across network I/O.
CREATE FUNCTION outbox._claim_batch(batch_size integer)
RETURNS TABLE (
    id             bigint,
    event_id       text,
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        text,
    headers        text,
    stream         text,
    created_at     text
)
LANGUAGE sql VOLATILE
AS $fn$
    WITH candidates AS (
        SELECT m.id
          FROM outbox.messages m
         WHERE m.status = 'pending'
         ORDER BY m.id
         LIMIT batch_size
           FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox.messages m
       SET status = 'publishing',
           claimed_at = clock_timestamp(),
           claimed_by = pg_catalog.pg_backend_pid(),
           attempts = m.attempts + 1
      FROM candidates c
     WHERE m.id = c.id
    RETURNING m.id, m.event_id::text, m.aggregate_type, m.aggregate_id, m.event_type,
              m.payload::text, m.headers::text, m.stream,
              to_char(m.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
$fn$;

COMMENT ON FUNCTION outbox._claim_batch(integer) IS
    'Relay internal: claims up to batch_size pending events (oldest first, FOR UPDATE SKIP LOCKED) and returns them ready to publish';

-- Settles rows that Redis accepted.
CREATE FUNCTION outbox._mark_published(ids bigint[])
RETURNS bigint
LANGUAGE sql VOLATILE
AS $fn$
    WITH settled AS (
        UPDATE outbox.messages
           SET status = 'published', published_at = clock_timestamp(), last_error = NULL
         WHERE id = ANY (ids) AND status = 'publishing'
        RETURNING 1
    )
    SELECT count(*) FROM settled
$fn$;

COMMENT ON FUNCTION outbox._mark_published(bigint[]) IS
    'Relay internal: marks claimed events published after Redis accepted them';

-- Returns claimed rows to pending, recording why the publish failed.
CREATE FUNCTION outbox._release(ids bigint[], error text)
RETURNS bigint
LANGUAGE sql VOLATILE
AS $fn$
    WITH released AS (
        UPDATE outbox.messages
           SET status = 'pending', claimed_at = NULL, claimed_by = NULL, last_error = error
         WHERE id = ANY (ids) AND status = 'publishing'
        RETURNING 1
    )
    SELECT count(*) FROM released
$fn$;

COMMENT ON FUNCTION outbox._release(bigint[], text) IS
    'Relay internal: returns claimed events to pending after a failed publish, recording the error';

-- Returns to pending every claim whose lease expired (its relay hung or lost its connection) or
-- whose claimer is no longer running (it crashed, was killed, or the server restarted). Attempts
-- are kept. Only rows in `publishing` are looked at, through their partial index.
CREATE FUNCTION outbox._reap_expired(lease_ms integer)
RETURNS bigint
LANGUAGE sql VOLATILE
AS $fn$
    WITH reaped AS (
        UPDATE outbox.messages m
           SET status = 'pending',
               claimed_at = NULL,
               claimed_by = NULL,
               last_error = CASE WHEN m.claimed_at < clock_timestamp() - lease_ms * interval '1 millisecond'
                                 THEN 'claim lease expired before the publish was settled'
                                 ELSE 'the claiming process exited before the publish was settled' END
         WHERE m.status = 'publishing'
           AND (m.claimed_at < clock_timestamp() - lease_ms * interval '1 millisecond'
                OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_get_activity(m.claimed_by)))
        RETURNING 1
    )
    SELECT count(*) FROM reaped
$fn$;

COMMENT ON FUNCTION outbox._reap_expired(integer) IS
    'Relay internal: returns to pending the claims whose lease expired or whose claiming process exited';

REVOKE ALL ON FUNCTION outbox._reap_expired(integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._claim_batch(integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._mark_published(bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._release(bigint[], text) FROM PUBLIC;
