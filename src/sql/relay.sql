-- The statements the relay workers run (claim, settle, reap, retention), in schema outbox. They
-- live here so that they can be read, explained and tested from psql; the worker calls them through
-- SPI. PL/pgSQL rather than SQL functions: it keeps their plans for the session, where an SQL
-- function would parse and plan them again on every call. Not for applications: EXECUTE is revoked
-- from PUBLIC. Why each is fenced the way it is (plans that stale statistics flipped, measured) is
-- in docs/performance.md.

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
-- (Probing "any earlier undelivered event outside this batch?" for every row instead walks all
-- earlier pending events of the aggregate per row: quadratic in one aggregate's backlog.)

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
-- Trusting an estimate of one pending row, the planner can choose to read every undelivered row
-- and sort them by id. Without sorts, the only plans left walk the pending index in id order and
-- stop at the batch size, whatever the estimates say. (The window below still sorts the batch
-- itself: it has no other way to, and the candidates are materialized first.)
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
-- Settling must look rows up by primary key, whatever the statistics say: with stale statistics
-- the planner otherwise hashed every undelivered row, walked the whole undelivered index per batch,
-- or compared every row with every id in a nested loop (docs/performance.md, "Findings"). So there
-- is no join at all: the ids
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

REVOKE ALL ON FUNCTION outbox._reap_expired(integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._reject(bigint[], text, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._claim_batch(integer, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._relay_batch(integer, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._relay_waiting(text[], text[], bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._mark_published(bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._release(bigint[], text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._purge_batch(integer, integer) FROM PUBLIC;
