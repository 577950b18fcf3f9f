-- outbox_pg 0.2.0 -> 0.3.0. Every schema change made after 0.2.0 goes here, in the commit that
-- makes it (sql/README.md). tests/upgrade.rs checks that the result equals a fresh 0.3.0 install.
\echo Use "ALTER EXTENSION outbox_pg UPDATE" to load this file. \quit

-- Bounded windows: snapshots recorded while events wait; a shard more than a second behind reads up
-- to the next one (docs/worker.md, "Catching up"). The claim returns each shard's own upto and
-- whether it is bounded; the batch read takes one upto per shard.
CREATE TABLE outbox.snapshots (
    taken_at timestamptz PRIMARY KEY,
    snap     pg_snapshot NOT NULL
);
COMMENT ON TABLE outbox.snapshots IS
    'outbox_pg: snapshots taken while events were undelivered; a lagging shard reads up to the next one rather than the whole backlog';
GRANT SELECT ON outbox.snapshots TO outbox_admin;

DROP FUNCTION outbox._claim_shards(integer, integer, integer);
CREATE FUNCTION outbox._claim_shards(relay_pid integer, share integer, lease_ms integer)
RETURNS TABLE (shard smallint, cursor text, cursor_age_ms bigint, upto text, held boolean, bounded boolean)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $fn$
#variable_conflict use_column
DECLARE
    held_now integer;
BEGIN
    SELECT count(*) INTO held_now FROM outbox.shards s WHERE s.claimed_by = relay_pid;
    IF held_now > share THEN
        UPDATE outbox.shards s SET claimed_by = NULL, claimed_at = NULL
         WHERE s.shard IN (SELECT m.shard FROM outbox.shards m WHERE m.claimed_by = relay_pid ORDER BY m.shard OFFSET share);
    ELSIF held_now < share THEN
        UPDATE outbox.shards s SET claimed_by = relay_pid, claimed_at = clock_timestamp()
         WHERE s.shard IN (
                SELECT f.shard
                  FROM outbox.shards f
                 WHERE f.claimed_by IS NULL
                    OR (f.claimed_by <> relay_pid
                        AND (f.claimed_at < clock_timestamp() - lease_ms * interval '1 millisecond'
                             OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_get_activity(f.claimed_by))))
                 ORDER BY f.shard
                 LIMIT share - held_now
                   FOR UPDATE SKIP LOCKED);
    END IF;
    UPDATE outbox.shards s SET claimed_at = clock_timestamp()
     WHERE s.claimed_by = relay_pid AND s.claimed_at < clock_timestamp() - (lease_ms / 3) * interval '1 millisecond';
    -- What each shard reads up to, taken after the claim: now; or, for a shard more than a second
    -- behind (a snapshot recorded over a second ago is ahead of its cursor), the first recorded
    -- snapshot ahead of its cursor. "Ahead" is a larger xmax: the snapshot was taken after more
    -- transactions had completed, so after the cursor's. And whether the failure path has anything
    -- in these shards (most rounds then skip it).
    RETURN QUERY
        WITH mine AS (SELECT s.* FROM outbox.shards s WHERE s.claimed_by = relay_pid),
             bounds AS (
                 SELECT m.*,
                        (SELECT p.snap FROM outbox.snapshots p
                          WHERE p.taken_at < clock_timestamp() - interval '1 second'
                            AND pg_catalog.pg_snapshot_xmax(p.snap) > pg_catalog.pg_snapshot_xmax(m.cursor)
                          ORDER BY p.taken_at LIMIT 1) AS recorded
                   FROM mine m)
        SELECT b.shard, b.cursor::text, (extract(epoch FROM clock_timestamp() - b.cursor_at) * 1000)::bigint,
               coalesce(b.recorded, pg_catalog.pg_current_snapshot())::text,
               EXISTS (SELECT 1 FROM outbox.held h
                        WHERE h.shard IN (SELECT shard FROM mine) AND h.status IN ('waiting', 'failed')),
               b.recorded IS NOT NULL
          FROM bounds b ORDER BY b.shard;
END
$fn$;
REVOKE ALL ON FUNCTION outbox._claim_shards(integer, integer, integer) FROM PUBLIC;

-- The relays read the log in Rust, straight from its indexes (src/batch.rs); _read_shard runs the
-- same code.
DROP FUNCTION outbox._read_batch(smallint[], text[], pg_snapshot, integer);
CREATE FUNCTION outbox._read_log(the_shard smallint, cursor text, upto text, max_events integer)
RETURNS TABLE (
    txid           bigint,
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
LANGUAGE c STRICT VOLATILE
AS 'MODULE_PATHNAME', 'read_log_wrapper';
REVOKE ALL ON FUNCTION outbox._read_log(smallint, text, text, integer) FROM PUBLIC;

CREATE OR REPLACE FUNCTION outbox._read_shard(the_shard smallint, cursor pg_snapshot, upto pg_snapshot, max_events integer)
RETURNS TABLE (
    txid           bigint,
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
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT * FROM outbox._read_log(the_shard, cursor::text, upto::text, max_events)
$fn$;

CREATE FUNCTION outbox._record_snapshot(record boolean)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $fn$
BEGIN
    DELETE FROM outbox.snapshots p
     WHERE pg_snapshot_xmax(p.snap) <= (SELECT min(pg_snapshot_xmax(s.cursor)) FROM outbox.shards s);
    IF NOT record
       OR EXISTS (SELECT 1 FROM outbox.snapshots p WHERE p.taken_at > clock_timestamp() - interval '900 milliseconds') THEN
        RETURN false;
    END IF;
    INSERT INTO outbox.snapshots (taken_at, snap) VALUES (clock_timestamp(), pg_current_snapshot());
    RETURN true;
END
$fn$;
REVOKE ALL ON FUNCTION outbox._record_snapshot(boolean) FROM PUBLIC;

-- A restore also forgets the recorded snapshots (they belong to the old transaction counter).
CREATE OR REPLACE FUNCTION outbox._rebase()
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    me xid8 := pg_current_xact_id();
    consumed_txid constant xid8 := '3';  -- FrozenTransactionId: below every cursor
    fresh pg_snapshot;
    undelivered bigint := 0;
    n bigint;
BEGIN
    IF (SELECT count(*) FROM outbox.restored_shards) < 16 OR (SELECT count(*) FROM outbox.restored_generations) < 3 THEN
        RETURN false;
    END IF;
    -- Nobody relays while the state is being translated (a restore outside one transaction).
    LOCK TABLE outbox.shards, outbox.generations IN EXCLUSIVE MODE;

    FOR generation IN 0..2 LOOP
        EXECUTE format(
            'UPDATE outbox.events_%s e
                SET txid = CASE WHEN pg_visible_in_snapshot(e.txid, r.cursor) THEN $1 ELSE $2 END
               FROM outbox.restored_shards r
              WHERE r.shard = e.shard AND e.txid <> $1', generation)
            USING consumed_txid, me;
        EXECUTE format('SELECT count(*) FROM outbox.events_%s WHERE txid = $1', generation) INTO n USING me;
        undelivered := undelivered + n;
    END LOOP;

    -- Every cursor starts just before the restoring transaction (outbox._initial_cursor keeps it in
    -- progress), so that its events are the first batch.
    fresh := outbox._initial_cursor();
    UPDATE outbox.shards s SET cursor = fresh, cursor_at = clock_timestamp(), claimed_by = NULL, claimed_at = NULL;
    -- published_at of the restored published events: the dumped cursor's time, an upper bound.
    DELETE FROM outbox.ticks;
    DELETE FROM outbox.snapshots;
    INSERT INTO outbox.ticks (shard, cursor, at)
    SELECT r.shard, fresh, r.cursor_at FROM outbox.restored_shards r;

    -- One current table at every step (a unique index): clear first, then take the dumped states.
    -- A table the dumped cluster was still closing had no writer left when it was dumped.
    UPDATE outbox.generations
       SET state = 'empty', opened_at = NULL, closed_at = NULL, switched_by = NULL, closed_below = NULL;
    UPDATE outbox.generations g
       SET state = CASE r.state WHEN 'closing' THEN 'closed' ELSE r.state END,
           opened_at = r.opened_at,
           closed_at = r.closed_at,
           closed_below = CASE WHEN r.state IN ('closing', 'closed') THEN pg_snapshot_xmax(fresh) END
      FROM outbox.restored_generations r
     WHERE r.generation = g.generation;
    IF NOT EXISTS (SELECT 1 FROM outbox.generations WHERE state = 'current') THEN
        UPDATE outbox.generations SET state = 'current', opened_at = clock_timestamp()
         WHERE generation = (SELECT min(generation) FROM outbox.generations WHERE state = 'empty');
    END IF;

    DELETE FROM outbox.restored_shards;
    DELETE FROM outbox.restored_generations;
    RAISE LOG 'outbox_pg: restored outbox rebased onto this cluster''s transaction ids; % undelivered events will be published', undelivered;
    RETURN true;
END
$fn$;

-- outbox_enqueue in Rust (src/enqueue.rs): the same checks and the same row, through kept plans;
-- SECURITY DEFINER without a pinned search_path (its statements qualify every name). Its SQL
-- helper _prepare_enqueue is gone with the PL/pgSQL body.
CREATE OR REPLACE FUNCTION @extschema@.outbox_enqueue(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL,
    stream         text  DEFAULT NULL
) RETURNS uuid
LANGUAGE c VOLATILE PARALLEL UNSAFE
SECURITY DEFINER
AS 'MODULE_PATHNAME', 'outbox_enqueue_wrapper';
DROP FUNCTION outbox._prepare_enqueue(text, text, text, text);

-- Comment only: the relays read the log in Rust now (src/batch.rs).
CREATE OR REPLACE FUNCTION outbox.oldest_pending_age()
RETURNS interval
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
DECLARE
    oldest timestamptz;
    now_snapshot pg_snapshot := pg_current_snapshot();
BEGIN
    SELECT min(u.created_at) INTO oldest
      FROM outbox.shards s
     CROSS JOIN LATERAL (
               -- Two index ranges per shard, as the relays read them (src/batch.rs).
               SELECT min(e.created_at) AS created_at
                 FROM outbox.events e
                WHERE e.shard = s.shard AND e.txid >= pg_snapshot_xmax(s.cursor)
                  AND pg_visible_in_snapshot(e.txid, now_snapshot)
               UNION ALL
               SELECT min(e.created_at)
                 FROM outbox.events e
                WHERE e.shard = s.shard AND e.txid = ANY (ARRAY(SELECT pg_snapshot_xip(s.cursor)))
                  AND pg_visible_in_snapshot(e.txid, now_snapshot)
               UNION ALL
               SELECT min(h.created_at) FROM outbox.held h WHERE h.shard = s.shard AND h.status = 'waiting') u;
    RETURN clock_timestamp() - oldest;
END
$fn$;

-- The counters are read in Rust too, straight from their primary key (src/counters.rs): a
-- generic plan made while outbox.aggregates was empty joined every counter with every aggregate.
CREATE OR REPLACE FUNCTION outbox._counters(aggregate_types text[], aggregate_ids text[])
RETURNS TABLE (ordinal bigint, last_seq bigint)
LANGUAGE c STRICT STABLE
AS 'MODULE_PATHNAME', 'counters_wrapper';

-- The failure path's probes no longer depend on the statistics either: one index probe per
-- aggregate (_held_aggregates), the rejected rows found through the primary key (_settle_held).
CREATE OR REPLACE FUNCTION outbox._held_aggregates(aggregate_types text[], aggregate_ids text[], shards smallint[])
RETURNS SETOF bigint
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM outbox.held h WHERE h.shard = ANY (shards) AND h.status IN ('waiting', 'failed')) THEN
        RETURN;
    END IF;
    -- One index probe per aggregate, whatever the statistics: the LIMIT keeps the subquery from
    -- being flattened into a join whose order the planner would choose (a generic plan made while
    -- the failure path was empty could scan it once per aggregate).
    RETURN QUERY
        SELECT a.position
          FROM unnest(aggregate_types, aggregate_ids) WITH ORDINALITY AS a(aggregate_type, aggregate_id, position)
         CROSS JOIN LATERAL (SELECT 1 FROM outbox.held h
                              WHERE h.shard = ANY (shards)
                                AND h.aggregate_type = a.aggregate_type COLLATE "C" AND h.aggregate_id = a.aggregate_id COLLATE "C"
                                AND h.status IN ('waiting', 'failed')
                              LIMIT 1) w;
END
$fn$;

CREATE OR REPLACE FUNCTION outbox._settle_held(published_ids bigint[], rejected_ids bigint[], errors text[],
                                    max_attempts integer, retry_delay_ms integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
DECLARE
    failed bigint;
BEGIN
    UPDATE outbox.held h
       SET status = 'published', published_at = clock_timestamp(), last_error = NULL, available_at = NULL,
           attempts = h.attempts + (h.attempts < 2147483647)::integer
     WHERE h.id = ANY (published_ids) AND h.status = 'waiting';
    WITH rejected AS (
        UPDATE outbox.held h
           SET rejections = h.rejections + (h.rejections < 2147483647)::integer,
               attempts = h.attempts + (h.attempts < 2147483647)::integer,
               -- Looked up per row (at most outbox.batch_size of them) rather than joined: the
               -- rows are found through the primary key whatever the statistics say.
               last_error = (SELECT x.error FROM unnest(rejected_ids, errors) AS x(id, error) WHERE x.id = h.id LIMIT 1),
               status = CASE WHEN h.rejections::bigint + 1 >= max_attempts THEN 'failed' ELSE 'waiting' END,
               failed_at = CASE WHEN h.rejections::bigint + 1 >= max_attempts THEN clock_timestamp() END,
               available_at = clock_timestamp()
                              + least(retry_delay_ms * power(2, least(h.rejections, 20)), 300000) * interval '1 millisecond'
         WHERE h.id = ANY (rejected_ids) AND h.status = 'waiting'
        RETURNING h.status
    )
    SELECT count(*) FILTER (WHERE status = 'failed') INTO failed FROM rejected;
    RETURN failed;
END
$fn$;

-- The finish updates the counters the batch's read found and inserts the others (no INSERT ... ON
-- CONFLICT per new aggregate), and moves the shards first: one argument more.
DROP FUNCTION outbox._advance(integer, smallint[], text[], text[], text[], bigint[]);
-- Finishes a batch: advances each shard's cursor, for shards this relay still holds (a shard taken
-- over after this relay's lease expired raises, so the whole finish rolls back and the new holder
-- publishes the batch again: a duplicate, never a gap), and the counters of the aggregates it
-- consumed. Records a tick (for published_at) per shard at most about once a second.
--
-- The shards go first: their row locks keep any other relay from taking them over until this
-- commits, so nobody else writes the counters of their aggregates meanwhile. counted[n] says
-- whether the batch's read found aggregate n's counter. Those are upserted: ON CONFLICT finds the
-- row before inserting and updates it (one that was deleted meanwhile is inserted again). The
-- others are plain INSERTs, which cost half of what ON CONFLICT does for a new row (no
-- speculative insertion); a workload where every event is its own aggregate (a payment, an
-- order) makes a new counter for every event (docs/performance.md).
CREATE FUNCTION outbox._advance(relay_pid integer, shards smallint[], cursors text[],
                                aggregate_types text[], aggregate_ids text[], last_seqs bigint[],
                                counted boolean[])
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
DECLARE
    advanced integer;
    -- A value, not clock_timestamp() in the statement: a volatile bound cannot be an index
    -- condition, and every round would then read every tick of each of its shards.
    recent timestamptz := clock_timestamp() - interval '1 second';
BEGIN
    WITH moved AS (
        UPDATE outbox.shards s
           SET cursor = x.cursor::pg_snapshot, cursor_at = clock_timestamp()
          FROM unnest(shards, cursors) AS x(shard, cursor)
         WHERE s.shard = x.shard AND s.claimed_by = relay_pid
        RETURNING s.shard, s.cursor
    ), ticked AS (
        INSERT INTO outbox.ticks (shard, cursor, at)
        SELECT m.shard, m.cursor, clock_timestamp()
          FROM moved m
         WHERE NOT EXISTS (SELECT 1 FROM outbox.ticks t
                            WHERE t.shard = m.shard AND t.at > recent)
        RETURNING 1
    )
    SELECT count(*) INTO advanced FROM moved;
    IF advanced < cardinality(shards) THEN
        RAISE EXCEPTION 'outbox_pg: relay % no longer holds all of shards %; another relay took them over', relay_pid, shards
            USING ERRCODE = 'lock_not_available',
                  HINT = 'The relay''s lease expired (outbox.lease) while it was publishing; the new holder publishes the batch again.';
    END IF;
    IF cardinality(aggregate_types) > 0 THEN
        -- Neither statement joins: each row is found through the primary key, whatever the
        -- statistics (an UPDATE ... FROM unnest planned while the table was empty scans every
        -- counter once per aggregate).
        INSERT INTO outbox.aggregates AS a (aggregate_type, aggregate_id, last_seq)
        SELECT t, i, s FROM unnest(aggregate_types, aggregate_ids, last_seqs, counted) AS x(t, i, s, c)
         WHERE x.c
        ON CONFLICT ON CONSTRAINT aggregates_pkey DO UPDATE SET last_seq = greatest(a.last_seq, excluded.last_seq);
        INSERT INTO outbox.aggregates (aggregate_type, aggregate_id, last_seq)
        SELECT t, i, s FROM unnest(aggregate_types, aggregate_ids, last_seqs, counted) AS x(t, i, s, c)
         WHERE NOT x.c;
    END IF;
END
$fn$;
REVOKE ALL ON FUNCTION outbox._advance(integer, smallint[], text[], text[], text[], bigint[], boolean[]) FROM PUBLIC;
