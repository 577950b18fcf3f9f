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
-- Writers (role outbox_writer) need no privilege on the table, so they cannot read other writers'
-- payloads; every name below is schema-qualified and the search_path is pinned.
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    payload_limit integer;
    payload_bytes integer;
    headers_bytes integer;
    next_seq      bigint;
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
    payload_limit := outbox._prepare_enqueue(outbox_enqueue.aggregate_type, outbox_enqueue.event_type, outbox_enqueue.stream);
    -- The limit applies to what is sent to Redis: the payload's JSON text.
    payload_bytes := octet_length(outbox_enqueue.payload::text);
    IF payload_bytes > payload_limit THEN
        RAISE EXCEPTION 'outbox_enqueue: payload is % bytes, larger than outbox.max_payload_size (% bytes)',
                payload_bytes, payload_limit
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'Put large documents elsewhere and send a reference in the event, or have a superuser raise outbox.max_payload_size.';
    END IF;

    -- The aggregate's row lock, held until commit, makes concurrent enqueues of the same aggregate
    -- take turns (others are unaffected), so numbers are gap-free and follow commit order. Taking
    -- it before the insert also makes id order follow aggregate_seq order within an aggregate.
    INSERT INTO outbox.aggregates AS a (aggregate_type, aggregate_id, last_seq)
    VALUES (outbox_enqueue.aggregate_type, outbox_enqueue.aggregate_id, 1)
    ON CONFLICT ON CONSTRAINT aggregates_pkey DO UPDATE SET last_seq = a.last_seq + 1
    RETURNING a.last_seq INTO next_seq;

    INSERT INTO outbox.messages (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, payload, headers, stream)
    VALUES (outbox.uuid_generate_v7(), outbox_enqueue.aggregate_type, outbox_enqueue.aggregate_id, next_seq,
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

-- ---------------------------------------------------------------------------------------------
-- The relay's statements. They live here so that they can be read, explained and tested from
-- psql; the worker calls them through SPI. PL/pgSQL rather than SQL functions: it keeps their
-- plans for the session, where an SQL function would parse and plan them again on every call,
-- which dominated the relay's cost for small batches. Not for applications: EXECUTE is revoked
-- from PUBLIC.
-- ---------------------------------------------------------------------------------------------

-- Two ways to claim, excluding each other through the claim lock (a transaction-level lock of a
-- kind no SQL function takes, so that no role can hold it but through these functions; see
-- src/claims.rs) and through what they record:
-- * The relay workers read a batch with _relay_batch and _relay_waiting, which write nothing: the
--   ids go into the relay's slot in shared memory before the reading transaction commits
--   (src/claims.rs), and the rows stay pending until the mark. One row write per event instead of
--   two.
-- * A session (an external relay, a tool, a test) calls _claim_batch, which marks the rows
--   publishing and leaves any row a relay holds in shared memory alone.
--
-- Both choose rows the same way. Oldest first (id order) up to batch_size, and with in_order
-- (outbox.ordering = 'aggregate') per-aggregate order: an event is claimable only when every
-- earlier event of its aggregate is delivered or claimed in this same batch. That is checked in
-- two steps, each costing one index probe, so that a batch of one aggregate's events costs no
-- more than a batch of a thousand aggregates':
-- 1. Before the LIMIT, each pending row is dropped if an earlier event of its aggregate *blocks*
--    it: in flight elsewhere (publishing), dead-lettered (failed) or backing off. Those rows are in
--    messages_blocking_idx, which is almost always empty. Rows held back this way never crowd
--    other aggregates out of the batch.
-- 2. After the LIMIT, per aggregate in the batch: its events sorted by aggregate_seq are cut at
--    the first gap (an event whose predecessor is not in the batch waits for it), and the
--    aggregate is dropped if an event below its first one is still undelivered (held by another
--    relay, skipped by SKIP LOCKED, or beyond the LIMIT because its id is higher).
-- The first version probed "any earlier undelivered event outside this batch?" for every row.
-- Each probe walked all earlier pending events of the aggregate, so a batch of n events of one
-- aggregate cost n^2/2 index entries: 15 s per 1,000-event claim with 20,000 events pending for
-- one aggregate (80 events/s), against 17 ms with 10,000 aggregates.

-- Claims up to batch_size pending rows and marks them publishing. SKIP LOCKED lets several sessions
-- claim at once and get disjoint batches. The caller commits before talking to Redis, so no row
-- lock is held across network I/O, and publishes the rows of each aggregate in aggregate_seq order.
CREATE FUNCTION outbox._claim_batch(batch_size integer, in_order boolean DEFAULT true)
RETURNS TABLE (
    id             bigint,
    event_id       text,
    aggregate_type text,
    aggregate_id   text,
    aggregate_seq  bigint,
    event_type     text,
    payload        text,
    headers        text,
    stream         text,
    created_at     text
)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
-- Generic plans of these batch statements look costly enough to be JIT-compiled on every call,
-- which takes longer than running them: never JIT them.
SET jit = off
-- A queue table's statistics are stale by nature (ANALYZE may run when almost nothing is pending).
-- Trusting an estimate of one pending row, the planner once chose to read every undelivered row
-- through the per-aggregate index and sort them by id: 500 ms per 100-event claim under a real
-- backlog, and the relay fell minutes behind until the next ANALYZE (30-minute benchmark at
-- 5,000 events/s). Without sorts, the only plans left walk the pending index in id order and stop
-- at the batch size, whatever the estimates say. (The window below still sorts the batch itself:
-- it has no other way to, and the candidates are materialized first.)
SET enable_sort = off
-- Likewise every probe goes through an index, even when an ANALYZE counted no rows.
SET enable_seqscan = off
AS $fn$
#variable_conflict use_column
DECLARE
    held_by_relays bigint[];
BEGIN
    -- Held to commit: no relay claims between our reading of its claims and our commit.
    PERFORM outbox._lock_for_claim();
    held_by_relays := outbox._relay_claims();
    RETURN QUERY
        WITH candidates AS MATERIALIZED (
            SELECT m.id, m.aggregate_type, m.aggregate_id, m.aggregate_seq
              FROM outbox.messages m
             WHERE m.status = 'pending'
               AND (m.available_at IS NULL OR m.available_at <= clock_timestamp())
               AND m.id <> ALL (held_by_relays)
               -- Step 1. Under NOT in_order OR, the probe stays a per-row index probe: written as
               -- a plain NOT EXISTS the planner may turn it into an anti-join over the whole table.
               AND (NOT in_order OR NOT EXISTS (
                       SELECT 1
                         FROM outbox.messages e
                        WHERE e.aggregate_type = m.aggregate_type
                          AND e.aggregate_id = m.aggregate_id
                          AND e.aggregate_seq < m.aggregate_seq
                          AND (e.status IN ('publishing', 'failed') OR (e.status = 'pending' AND e.available_at IS NOT NULL))
                          AND NOT (e.status = 'pending' AND e.available_at <= clock_timestamp())))
             ORDER BY m.id
             LIMIT batch_size
               FOR UPDATE SKIP LOCKED
        ),
        -- Step 2. aggregate_seq - rank is the same for every event of a run without gaps.
        runs AS MATERIALIZED (
            SELECT c.id, c.aggregate_type, c.aggregate_id, c.aggregate_seq,
                   c.aggregate_seq - row_number() OVER w + 1 AS run_start,
                   first_value(c.aggregate_seq) OVER w AS first_seq
              FROM candidates c
            WINDOW w AS (PARTITION BY c.aggregate_type, c.aggregate_id ORDER BY c.aggregate_seq)
        ),
        ready AS (
            SELECT r.aggregate_type, r.aggregate_id
              FROM runs r
             WHERE r.aggregate_seq = r.first_seq
               AND NOT EXISTS (
                       SELECT 1
                         FROM outbox.messages e
                        WHERE e.aggregate_type = r.aggregate_type
                          AND e.aggregate_id = r.aggregate_id
                          AND e.aggregate_seq < r.first_seq
                          AND e.status IN ('pending', 'publishing', 'failed'))
        ),
        claimable AS (
            SELECT c.id
              FROM candidates c
             WHERE NOT in_order
            UNION ALL
            SELECT r.id
              FROM runs r
              JOIN ready USING (aggregate_type, aggregate_id)
             WHERE in_order AND r.run_start = r.first_seq
        )
        UPDATE outbox.messages m
           SET status = 'publishing',
               claimed_at = clock_timestamp(),
               claimed_by = pg_backend_pid(),
               attempts = m.attempts + (m.attempts < 2147483647)::integer
          FROM claimable c
         WHERE m.id = c.id
        RETURNING m.id, m.event_id::text, m.aggregate_type, m.aggregate_id, m.aggregate_seq, m.event_type,
                  m.payload::text, m.headers::text, m.stream,
                  to_char(m.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"');
END
$fn$;

COMMENT ON FUNCTION outbox._claim_batch(integer, boolean) IS
    'Relay internal: claims up to batch_size pending events (oldest first, FOR UPDATE SKIP LOCKED, per-aggregate order when in_order) and returns them ready to publish';

-- The relay workers' claim, step 1 (see above), read without writing or locking anything: up to
-- batch_size pending rows, oldest first, none blocked by an earlier event of its aggregate. The
-- caller holds the claim lock and has read the other relays' claims before this statement's
-- snapshot; it drops the rows they hold (with the rest of those aggregates' runs), does step 2
-- (cutting runs at gaps in Rust, then _relay_waiting), and records its own rows in shared memory
-- before committing (src/worker/tick.rs). batch_size is raised by the caller by the number of rows
-- held elsewhere, which may come back and be dropped.
CREATE FUNCTION outbox._relay_batch(batch_size integer, in_order boolean DEFAULT true)
RETURNS TABLE (
    id             bigint,
    event_id       text,
    aggregate_type text,
    aggregate_id   text,
    aggregate_seq  bigint,
    event_type     text,
    payload        text,
    headers        text,
    stream         text,
    created_at     text
)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
-- As for _claim_batch: never JIT, never sort or scan the table (stale statistics must not change
-- the plan).
SET jit = off
SET enable_sort = off
SET enable_seqscan = off
AS $fn$
#variable_conflict use_column
BEGIN
    -- The output columns are read by the same index scan that picks the rows: a second join back
    -- to the table would be at the mercy of the (stale) statistics again.
    RETURN QUERY
        SELECT m.id, m.event_id::text, m.aggregate_type, m.aggregate_id, m.aggregate_seq, m.event_type,
               m.payload::text, m.headers::text, m.stream,
               to_char(m.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
          FROM outbox.messages m
         WHERE m.status = 'pending'
           AND (m.available_at IS NULL OR m.available_at <= clock_timestamp())
           AND (NOT in_order OR NOT EXISTS (
                   SELECT 1
                     FROM outbox.messages e
                    WHERE e.aggregate_type = m.aggregate_type
                      AND e.aggregate_id = m.aggregate_id
                      AND e.aggregate_seq < m.aggregate_seq
                      AND (e.status IN ('publishing', 'failed') OR (e.status = 'pending' AND e.available_at IS NOT NULL))
                      AND NOT (e.status = 'pending' AND e.available_at <= clock_timestamp())))
         ORDER BY m.id
         LIMIT batch_size;
END
$fn$;

COMMENT ON FUNCTION outbox._relay_batch(integer, boolean) IS
    'Relay internal: reads up to batch_size pending events not blocked by an earlier event of their aggregate (oldest first) without writing; see _relay_waiting';

-- The relay workers' claim, step 2: given the first event of each aggregate's run in a batch,
-- returns the positions (1-based) of the aggregates that must wait, because an earlier event of
-- theirs is still undelivered. One index probe per aggregate.
CREATE FUNCTION outbox._relay_waiting(aggregate_types text[], aggregate_ids text[], first_seqs bigint[])
RETURNS SETOF bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
-- A probe per aggregate through messages_undelivered_idx, whatever the statistics say.
SET enable_seqscan = off
AS $fn$
BEGIN
    -- A LATERAL probe per aggregate: the planner cannot turn it around into a scan of the table
    -- joined to the list, which stale statistics (an ANALYZE that counted no rows) would favour.
    RETURN QUERY
        SELECT h.position
          FROM unnest(aggregate_types, aggregate_ids, first_seqs) WITH ORDINALITY
               AS h(aggregate_type, aggregate_id, first_seq, position)
         CROSS JOIN LATERAL (
                   SELECT 1
                     FROM outbox.messages e
                    WHERE e.aggregate_type = h.aggregate_type
                      AND e.aggregate_id = h.aggregate_id
                      AND e.aggregate_seq < h.first_seq
                      AND e.status IN ('pending', 'publishing', 'failed')
                    LIMIT 1) AS earlier;
END
$fn$;

COMMENT ON FUNCTION outbox._relay_waiting(text[], text[], bigint[]) IS
    'Relay internal: which of these aggregates have an event below first_seq still undelivered (1-based positions)';

-- Settles rows that Redis accepted: rows a session claimed (publishing) and rows a relay claimed in
-- shared memory (still pending; their attempt is counted here, since their claim wrote nothing).
CREATE FUNCTION outbox._mark_published(ids bigint[])
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
-- Settling must look rows up by primary key, whatever the statistics say. Three plans did worse:
-- given 1,000 ids as a constant (PL/pgSQL's first, custom plans) the planner hashed every
-- undelivered row (50 ms instead of 10 ms per 1,000 under a 100,000-event backlog); after ANALYZE
-- saw the undelivered index empty, it walked that whole index once per batch, filtering on the
-- ids (settles of 100 rows took 1-4 s in a 5,000 events/s run); and after an ANALYZE that ran
-- while a large enqueue was still uncommitted (it counts zero rows), the join with unnest(ids)
-- became a nested loop over a sequential scan of the table, comparing every row with every id:
-- 9 s to settle 5,000 rows, minutes for a 30,000-row backlog. So there is no join at all: the ids
-- are an index condition on the primary key (id = ANY: the btree sorts the array and descends
-- once per id), sequential scans are ruled out, and the status test is written NOT IN so that it
-- implies no partial index's predicate (status IN (...) would make the pending and undelivered
-- indexes usable): only the primary key is left to find the rows.
SET enable_seqscan = off
AS $fn$
DECLARE
    affected bigint;
BEGIN
    WITH settled AS (
        UPDATE outbox.messages m
           SET status = 'published', published_at = clock_timestamp(), last_error = NULL,
               attempts = m.attempts + (m.status = 'pending' AND m.attempts < 2147483647)::integer
         WHERE m.id = ANY (ids) AND m.status NOT IN ('published', 'failed', 'skipped')
        RETURNING 1
    )
    SELECT count(*) INTO affected FROM settled;
    RETURN affected;
END
$fn$;

COMMENT ON FUNCTION outbox._mark_published(bigint[]) IS
    'Relay internal: marks claimed events published after Redis accepted them';

-- Rows Redis rejected because of the row itself (e.g. WRONGTYPE): count the rejection, back the row
-- off (doubling from retry_delay_ms, at most 5 minutes), and dead-letter it at max_attempts.
-- Returns how many rows became failed.
CREATE FUNCTION outbox._reject(ids bigint[], error text, max_attempts integer, retry_delay_ms integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
-- Generic plans of these batch statements look costly enough to be JIT-compiled on every call,
-- which takes longer than running them: never JIT them.
SET jit = off
-- Primary-key probes only, as in _mark_published (and its status test is written NOT IN likewise).
SET enable_seqscan = off
AS $fn$
DECLARE
    affected bigint;
BEGIN
    WITH rejected AS (
        UPDATE outbox.messages m
           -- Counters saturate: an overflow error here would stall the relay on this row forever.
           SET rejections = m.rejections + (m.rejections < 2147483647)::integer,
               attempts = m.attempts + (m.status = 'pending' AND m.attempts < 2147483647)::integer,
               last_error = error,
               status = CASE WHEN m.rejections::bigint + 1 >= max_attempts THEN 'failed' ELSE 'pending' END,
               failed_at = CASE WHEN m.rejections::bigint + 1 >= max_attempts THEN clock_timestamp() END,
               available_at = clock_timestamp()
                              + least(retry_delay_ms * power(2, least(m.rejections, 20)), 300000) * interval '1 millisecond',
               claimed_at = NULL,
               claimed_by = NULL
         WHERE m.id = ANY (ids) AND m.status NOT IN ('published', 'failed', 'skipped')
        RETURNING m.status
    )
    SELECT count(*) FILTER (WHERE status = 'failed') INTO affected FROM rejected;
    RETURN affected;
END
$fn$;

COMMENT ON FUNCTION outbox._reject(bigint[], text, integer, integer) IS
    'Relay internal: records a rejection by Redis of these events, backs them off, dead-letters those at max_attempts';

-- Returns claimed rows to pending (or leaves a relay's there), recording why the publish failed.
CREATE FUNCTION outbox._release(ids bigint[], error text)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
-- Primary-key probes only, as in _mark_published (and its status test is written NOT IN likewise).
SET enable_seqscan = off
AS $fn$
DECLARE
    affected bigint;
BEGIN
    WITH released AS (
        UPDATE outbox.messages m
           SET status = 'pending', claimed_at = NULL, claimed_by = NULL, last_error = error,
               attempts = m.attempts + (m.status = 'pending' AND m.attempts < 2147483647)::integer
         WHERE m.id = ANY (ids) AND m.status NOT IN ('published', 'failed', 'skipped')
        RETURNING 1
    )
    SELECT count(*) INTO affected FROM released;
    RETURN affected;
END
$fn$;

COMMENT ON FUNCTION outbox._release(bigint[], text) IS
    'Relay internal: returns claimed events to pending after a failed publish, recording the error';

-- Returns to pending every claim whose lease expired (its relay hung or lost its connection) or
-- whose claimer is no longer running (it crashed, was killed, or the server restarted). Attempts
-- are kept. Only rows in `publishing` are looked at, through their partial index.
CREATE FUNCTION outbox._reap_expired(lease_ms integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $fn$
DECLARE
    affected bigint;
BEGIN
    WITH reaped AS (
        UPDATE outbox.messages m
           SET status = 'pending',
               claimed_at = NULL,
               claimed_by = NULL,
               last_error = CASE WHEN m.claimed_at < clock_timestamp() - lease_ms * interval '1 millisecond'
                                 THEN 'claim lease expired before the publish was settled'
                                 WHEN m.claimed_at IS NULL OR m.claimed_by IS NULL
                                 THEN 'the claim did not record when or by whom it was made'
                                 ELSE 'the claiming process exited before the publish was settled' END
         WHERE m.status = 'publishing'
           -- A claim that does not say when or by whom (CHECK messages_claim_recorded forbids it,
           -- but a superuser can write anything) could never expire: return it too.
           AND (m.claimed_at IS NULL OR m.claimed_by IS NULL
                OR m.claimed_at < now() - lease_ms * interval '1 millisecond'
                OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_get_activity(m.claimed_by)))
        RETURNING 1
    )
    SELECT count(*) INTO affected FROM reaped;
    RETURN affected;
END
$fn$;

COMMENT ON FUNCTION outbox._reap_expired(integer) IS
    'Relay internal: returns to pending the claims whose lease expired or whose claiming process exited';

REVOKE ALL ON FUNCTION outbox._reap_expired(integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._reject(bigint[], text, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._claim_batch(integer, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._relay_batch(integer, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._relay_waiting(text[], text[], bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._mark_published(bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._release(bigint[], text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._relay_claims() FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------
-- Operations: dead letters, retention, health.
-- ---------------------------------------------------------------------------------------------

-- Puts failed (dead-lettered) events back to pending with their counters reset: all of them, or
-- those ids. Returns how many.
CREATE FUNCTION outbox.retry_failed(ids bigint[] DEFAULT NULL)
RETURNS bigint
LANGUAGE sql VOLATILE
-- outbox_admin may read rows but not write them: the change is made as the owner.
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH retried AS (
        UPDATE outbox.messages m
           SET status = 'pending', attempts = 0, rejections = 0, available_at = NULL, failed_at = NULL
         WHERE m.status = 'failed' AND (ids IS NULL OR m.id = ANY (ids))
        RETURNING 1
    )
    SELECT count(*) FROM retried
$fn$;

COMMENT ON FUNCTION outbox.retry_failed(bigint[]) IS
    'Returns failed events (all, or those ids) to pending with attempts reset; returns how many';

-- Gives up on failed events for good, so that later events of their aggregates flow again. The
-- row is kept (status skipped, published_at = when skipped) until retention removes it.
CREATE FUNCTION outbox.skip_failed(ids bigint[])
RETURNS bigint
LANGUAGE plpgsql VOLATILE
-- outbox_admin may read rows but not write them: the change is made as the owner.
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    skipped bigint;
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 THEN
        RAISE EXCEPTION 'outbox.skip_failed: ids must name the failed events to skip, got %', coalesce(ids::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Skipping drops events for good; list them, e.g. outbox.skip_failed(ARRAY(SELECT id FROM outbox.messages WHERE status = ''failed'' AND ...)).';
    END IF;
    UPDATE outbox.messages m
       SET status = 'skipped', published_at = clock_timestamp()
     WHERE m.status = 'failed' AND m.id = ANY (ids);
    GET DIAGNOSTICS skipped = ROW_COUNT;
    RETURN skipped;
END
$fn$;

COMMENT ON FUNCTION outbox.skip_failed(bigint[]) IS
    'Marks these failed events skipped (never delivered), releasing the later events of their aggregates; returns how many';

-- outbox.aggregates remembers the last aggregate_seq of every aggregate ever seen, so that no
-- aggregate's numbering ever restarts: consumers may use aggregate_seq as a version ("apply only if
-- newer"), and a restart at 1 would make them drop every later event. The price is one small row
-- per distinct aggregate, kept after retention. A DBA who knows that no consumer compares
-- aggregate_seq across long silences can forget the aggregates that have no event left in the
-- outbox: their next event starts again at 1. Returns how many were forgotten.
--
-- An aggregate being enqueued right now is never forgotten: one whose row an enqueue holds is
-- skipped (SKIP LOCKED), and one whose counter moved after this statement's snapshot fails the
-- re-check after locking (`seen` keeps the value the snapshot saw, `live` is re-read).
CREATE FUNCTION outbox.forget_aggregates()
RETURNS bigint
LANGUAGE plpgsql VOLATILE
-- Admins may read but not change the counters; forgetting them is done as owner.
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    forgotten bigint;
BEGIN
    DELETE FROM outbox.aggregates a
     USING (SELECT live.aggregate_type, live.aggregate_id
              FROM outbox.aggregates live
              JOIN outbox.aggregates seen
                ON seen.aggregate_type = live.aggregate_type AND seen.aggregate_id = live.aggregate_id
             WHERE live.last_seq = seen.last_seq
               AND NOT EXISTS (SELECT 1
                                 FROM outbox.messages m
                                WHERE m.aggregate_type = seen.aggregate_type
                                  AND m.aggregate_id = seen.aggregate_id)
               FOR UPDATE OF live SKIP LOCKED) idle
     WHERE a.aggregate_type = idle.aggregate_type AND a.aggregate_id = idle.aggregate_id;
    GET DIAGNOSTICS forgotten = ROW_COUNT;
    RETURN forgotten;
END
$fn$;

COMMENT ON FUNCTION outbox.forget_aggregates() IS
    'Deletes the aggregate_seq counters of aggregates with no event left in the outbox (their numbering restarts at 1); returns how many';

-- Deletes published (and skipped) events whose published_at is older than older_than; '0' deletes
-- them all. Failed and undelivered events are never deleted. Returns how many rows it deleted.
CREATE FUNCTION outbox.purge(older_than interval)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
-- outbox_admin may read rows but not write them: the change is made as the owner.
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    purged bigint;
BEGIN
    IF older_than IS NULL OR older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox.purge: older_than must be a non-negative interval, got %', coalesce(older_than::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass e.g. ''7 days''; ''0'' purges every published event.';
    END IF;
    DELETE FROM outbox.messages m
     WHERE m.status IN ('published', 'skipped') AND m.published_at <= now() - older_than;
    GET DIAGNOSTICS purged = ROW_COUNT;
    RETURN purged;
END
$fn$;

COMMENT ON FUNCTION outbox.purge(interval) IS
    'Deletes published and skipped events older than older_than (by published_at); returns how many';

-- The relay's retention step: one small batch of the oldest expired published rows, and of the
-- oldest expired consumer dedup marks.
CREATE FUNCTION outbox._purge_batch(retention_s integer, batch_size integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
-- Generic plans of these batch statements look costly enough to be JIT-compiled on every call,
-- which takes longer than running them: never JIT them.
SET jit = off
-- Oldest first through the published-by-time index, never a sort of every expired row (see
-- _claim_batch: stale statistics must not change the plan).
SET enable_sort = off
AS $fn$
DECLARE
    affected bigint;
BEGIN
    WITH expired AS (
        SELECT m.id
          FROM outbox.messages m
         WHERE m.status IN ('published', 'skipped')
           -- now(), not clock_timestamp(): a stable bound can drive the index scan, a volatile one
           -- would filter every published row.
           AND m.published_at < now() - retention_s * interval '1 second'
         ORDER BY m.published_at
         LIMIT batch_size
    ), purged AS (
        DELETE FROM outbox.messages m USING expired e WHERE m.id = e.id RETURNING 1
    ), expired_marks AS (
        SELECT p.consumer, p.event_id
          FROM outbox.processed_messages p
         WHERE p.processed_at < now() - retention_s * interval '1 second'
         ORDER BY p.processed_at
         LIMIT batch_size
    ), purged_marks AS (
        DELETE FROM outbox.processed_messages p USING expired_marks x
         WHERE p.consumer = x.consumer AND p.event_id = x.event_id
        RETURNING 1
    )
    SELECT greatest((SELECT count(*) FROM purged), (SELECT count(*) FROM purged_marks)) INTO affected;
    RETURN affected;
END
$fn$;

COMMENT ON FUNCTION outbox._purge_batch(integer, integer) IS
    'Relay internal: deletes one batch of published events older than outbox.retention';

-- Age of the oldest event not yet delivered (pending, or claimed and in flight); NULL when none.
-- Index-backed: the lowest pending id, and the few rows being published.
-- SECURITY DEFINER: monitoring roles (pg_monitor) see the age without reading any event.
CREATE FUNCTION outbox.oldest_pending_age()
RETURNS interval
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- The lowest pending id through the pending index, never a sort of the backlog (see _claim_batch).
SET enable_sort = off
AS $fn$
    SELECT clock_timestamp() - least(
        (SELECT m.created_at FROM outbox.messages m WHERE m.status = 'pending' ORDER BY m.id LIMIT 1),
        (SELECT min(m.created_at) FROM outbox.messages m WHERE m.status = 'publishing'))
$fn$;

COMMENT ON FUNCTION outbox.oldest_pending_age() IS
    'Age of the oldest undelivered event (pending or in flight), NULL when none: the outbox health signal';

CREATE VIEW outbox.stats AS
SELECT
    -- A relay's claim lives in shared memory and leaves its rows pending: count them as publishing.
    greatest((SELECT count(*) FROM outbox.messages m WHERE m.status = 'pending') - r.in_flight, 0)
                                                                            AS pending,
    (SELECT count(*) FROM outbox.messages m WHERE m.status = 'publishing') + r.in_flight
                                                                            AS publishing,
    (SELECT count(*) FROM outbox.messages m WHERE m.status = 'failed')     AS failed,
    r.published_total,
    outbox.oldest_pending_age()                                             AS oldest_pending_age,
    (SELECT max(m.published_at) FROM outbox.messages m WHERE m.status IN ('published', 'skipped'))
                                                                            AS last_published_at,
    r.worker_pid,
    r.workers,
    r.redis_connected,
    r.last_error,
    r.last_error_at
FROM outbox.relay_status() AS r;

COMMENT ON VIEW outbox.stats IS
    'One row of outbox health, cheap enough to poll every few seconds: exact pending/publishing/failed counts (index-backed), events published since the server started, oldest_pending_age is the alert signal';
COMMENT ON COLUMN outbox.stats.published_total IS 'Events the relays of this database published since the server started (exact; a counter like pg_stat''s, reset by a restart)';
COMMENT ON COLUMN outbox.stats.oldest_pending_age IS 'Age of the oldest undelivered event; NULL when nothing is pending';
COMMENT ON COLUMN outbox.stats.last_error IS 'The relay''s most recent error (Redis or database), kept after recovery; see last_error_at';

-- Privileges: enqueue is for outbox_writer (and the owner); operations are for outbox_admin.
REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, bigint, text, jsonb, jsonb, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, uuid, text, jsonb, jsonb, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) TO outbox_writer;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, bigint, text, jsonb, jsonb, text) TO outbox_writer;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, uuid, text, jsonb, jsonb, text) TO outbox_writer;
REVOKE ALL ON FUNCTION outbox._prepare_enqueue(text, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.outbox_mark_processed(text, uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._lock_for_claim() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_mark_processed(text, uuid) TO outbox_consumer;
REVOKE ALL ON FUNCTION outbox.purge_processed(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.purge_processed(interval) TO outbox_admin;
REVOKE ALL ON FUNCTION outbox._purge_batch(integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.retry_failed(bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.skip_failed(bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.purge(interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.forget_aggregates() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.retry_failed(bigint[]) TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.skip_failed(bigint[]) TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.purge(interval) TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.forget_aggregates() TO outbox_admin;
GRANT SELECT ON outbox.stats TO outbox_admin, pg_monitor;
GRANT USAGE ON SCHEMA outbox TO pg_monitor;
