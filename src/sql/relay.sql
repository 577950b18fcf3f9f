-- The statements the relay workers run, in schema outbox: claim shards, read a batch from the log,
-- finish it (cursor, counters, the failure path), housekeeping (reaper, retention). They live here
-- so that they can be read, explained and tested from psql; the worker calls them through SPI
-- (except the reads of the log and of the counters, which it runs in Rust: outbox._read_log,
-- outbox._counters). PL/pgSQL rather than SQL
-- functions: it keeps their plans for the session. Not for applications:
-- EXECUTE is revoked from PUBLIC. The design is in docs/worker.md, "The log".

-- All the events, whichever generation holds them. Reading through this view lets the planner
-- merge the three tables' (shard, txid) index scans in txid order.
CREATE VIEW outbox.events AS
    SELECT 0::smallint AS generation, e.* FROM outbox.events_0 e
    UNION ALL
    SELECT 1::smallint, e.* FROM outbox.events_1 e
    UNION ALL
    SELECT 2::smallint, e.* FROM outbox.events_2 e;
COMMENT ON VIEW outbox.events IS 'outbox_pg: the event log, all three generations';

-- Takes and keeps this relay's share of the 16 shards (FOR UPDATE SKIP LOCKED, so relays never
-- wait on each other), gives back what is above the share, renews the lease a third of the way
-- through, and returns the shards it holds with their cursors and how long ago each moved, the
-- snapshot each shard reads up to, whether that is a recorded snapshot rather than now (bounded:
-- the shard lags, more follows), and whether the failure path holds anything in them. Shards held
-- by a relay that exited, or whose lease expired (a hung relay), are taken like free ones. Writes
-- only when something changes hands or a lease is renewed.
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

-- One shard's window of the log: the events of the transactions visible in upto and not in the
-- cursor, oldest transaction first, the range part cut after max_events rows. The relays run the
-- same code (src/batch.rs: the rule exists once) straight on the (shard, txid) indexes; this is
-- it for tests and diagnosis.
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

CREATE FUNCTION outbox._read_shard(the_shard smallint, cursor pg_snapshot, upto pg_snapshot, max_events integer)
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

COMMENT ON FUNCTION outbox._read_shard(smallint, pg_snapshot, pg_snapshot, integer) IS
    'Relay internal: the events of one shard that became visible between its cursor and upto, oldest transaction first';

-- The cursor that consumes, of snapshot upto, only the transactions below bound (the tests use it
-- to read up to a chosen transaction). Every transaction below bound is visible in it exactly when
-- it is visible in upto; none from bound on is.
CREATE FUNCTION outbox._cursor_below(upto pg_snapshot, bound bigint)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT least(pg_snapshot_xmin(upto)::text::bigint, bound)::text || ':' || bound::text || ':'
           || array_to_string(ARRAY(SELECT x FROM pg_snapshot_xip(upto) AS x WHERE x::text::bigint < bound ORDER BY x), ',')
$fn$;

-- The last aggregate_seq of each of these aggregates (1-based positions; absent: none yet). One
-- primary-key probe per aggregate, straight from the index, whatever the statistics: the relays
-- run the same code (src/counters.rs); this is it for tests and diagnosis.
CREATE FUNCTION outbox._counters(aggregate_types text[], aggregate_ids text[])
RETURNS TABLE (ordinal bigint, last_seq bigint)
LANGUAGE c STRICT STABLE
AS 'MODULE_PATHNAME', 'counters_wrapper';

-- Which of these aggregates have events on the failure path (waiting or failed in outbox.held):
-- their new events must wait behind those. 1-based positions.
CREATE FUNCTION outbox._held_aggregates(aggregate_types text[], aggregate_ids text[], shards smallint[])
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

-- Held events that may go now, in these shards: in per-aggregate order, each aggregate's waiting
-- events up to the first one that is backing off or failed (with in_order; without, every waiting
-- event that is not backing off).
CREATE FUNCTION outbox._held_due(shards smallint[], max_events integer, in_order boolean DEFAULT true)
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
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        WITH undelivered AS MATERIALIZED (
            SELECT h.*,
                   bool_or(h.status = 'failed' OR coalesce(h.available_at > clock_timestamp(), false))
                       OVER (PARTITION BY h.aggregate_type, h.aggregate_id ORDER BY h.aggregate_seq
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS blocked
              FROM outbox.held h
             WHERE h.shard = ANY (shards) AND h.status IN ('waiting', 'failed')
        )
        SELECT u.id, u.event_id::text, u.aggregate_type, u.aggregate_id, u.aggregate_seq, u.event_type,
               u.payload::text, u.headers::text, u.stream,
               to_char(u.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
          FROM undelivered u
         WHERE u.status = 'waiting'
           AND (CASE WHEN in_order THEN NOT u.blocked ELSE (u.available_at IS NULL OR u.available_at <= clock_timestamp()) END)
         ORDER BY u.id
         LIMIT max_events;
END
$fn$;

-- Moves events from the log to the failure path, with the aggregate_seq they were given: an event
-- Redis rejected (error set: backing off, or failed at max_attempts) and the events of its
-- aggregate that wait behind it (error NULL). Copies every column, so that retention may truncate
-- the log under them. Returns how many became failed.
CREATE FUNCTION outbox._hold(event_ids uuid[], seqs bigint[], errors text[], max_attempts integer, retry_delay_ms integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
DECLARE
    failed bigint;
BEGIN
    WITH held AS (
        INSERT INTO outbox.held AS h (id, event_id, shard, aggregate_type, aggregate_id, aggregate_seq, event_type,
                                      payload, headers, stream, created_at, status, attempts, rejections,
                                      available_at, failed_at, last_error)
        SELECT e.id, e.event_id, e.shard, e.aggregate_type, e.aggregate_id, x.seq, e.event_type, e.payload,
               e.headers, e.stream, e.created_at,
               CASE WHEN x.error IS NOT NULL AND max_attempts <= 1 THEN 'failed' ELSE 'waiting' END,
               (x.error IS NOT NULL)::integer,
               (x.error IS NOT NULL)::integer,
               CASE WHEN x.error IS NOT NULL THEN clock_timestamp() + retry_delay_ms * interval '1 millisecond' END,
               CASE WHEN x.error IS NOT NULL AND max_attempts <= 1 THEN clock_timestamp() END,
               x.error
          FROM unnest(event_ids, seqs, errors) AS x(event_id, seq, error)
         CROSS JOIN LATERAL (SELECT * FROM outbox.events v WHERE v.event_id = x.event_id LIMIT 1) e
        ON CONFLICT (id) DO NOTHING
        RETURNING h.status
    )
    SELECT count(*) FILTER (WHERE status = 'failed') INTO failed FROM held;
    RETURN failed;
END
$fn$;

-- Settles held events after a publish: published ones are done; rejected ones count the rejection,
-- back off (doubling from retry_delay_ms, at most 5 minutes) and fail at max_attempts. Counters
-- saturate: an overflow here would stall the relay on the row forever. Returns how many failed.
CREATE FUNCTION outbox._settle_held(published_ids bigint[], rejected_ids bigint[], errors text[],
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

-- Forgets the recorded snapshots every cursor has reached (outbox.snapshots), and, while anything is
-- undelivered (record), records one for lagging shards to read up to, at most about once a second.
-- Housekeeping calls it. Returns whether it recorded one.
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

-- The reaper: frees the shards of relays that exited or whose lease expired, so that the others
-- take them at their next round. Returns how many.
CREATE FUNCTION outbox._reap_shards(lease_ms integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $fn$
DECLARE
    reaped bigint;
BEGIN
    UPDATE outbox.shards s SET claimed_by = NULL, claimed_at = NULL
     WHERE s.claimed_by IS NOT NULL
       AND (s.claimed_at < clock_timestamp() - lease_ms * interval '1 millisecond'
            OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_get_activity(s.claimed_by)));
    GET DIAGNOSTICS reaped = ROW_COUNT;
    RETURN reaped;
END
$fn$;

-- Retention, one step per call, each a few statements: closes a switched table once no writer can
-- be left on it, truncates a closed table that every shard has consumed and that is older than
-- keep, switches to a new table when the current one is older than half of keep, and deletes done
-- rows of the failure path, old ticks and old dedup marks. The TRUNCATE waits at most 100 ms for
-- its lock (readers hold the tables for a moment each round) and is retried at the next call.
-- Returns the number of events and rows removed.
CREATE FUNCTION outbox._retention(keep interval, switch_now boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $fn$
DECLARE
    removed bigint := 0;
    n bigint;
    g record;
    oldest_cursor_xmin xid8;
BEGIN
    -- Close: a snapshot taken after the switch committed bounds every writer of the table (each
    -- took its transaction id before reading which table is current). Never in the switching
    -- transaction itself, which no writer has seen committed.
    UPDATE outbox.generations SET state = 'closed', closed_below = pg_snapshot_xmax(pg_current_snapshot())
     WHERE state = 'closing' AND pg_xact_status(switched_by) = 'committed';

    -- Truncate what every shard has consumed.
    SELECT min(pg_snapshot_xmin(s.cursor)) INTO oldest_cursor_xmin FROM outbox.shards s;
    FOR g IN SELECT * FROM outbox.generations
              WHERE state = 'closed' AND closed_below <= oldest_cursor_xmin
                AND (switch_now OR closed_at < clock_timestamp() - keep)
              ORDER BY closed_at LOOP
        BEGIN
            SET LOCAL lock_timeout = '100ms';
            EXECUTE format('SELECT count(*) FROM outbox.events_%s', g.generation) INTO n;
            EXECUTE format('TRUNCATE outbox.events_%s', g.generation);
            UPDATE outbox.generations
               SET state = 'empty', opened_at = NULL, closed_at = NULL, closed_below = NULL, switched_by = NULL
             WHERE generation = g.generation;
            removed := removed + n;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- readers in the way: next time
        END;
    END LOOP;

    -- Switch: the next table must be empty (truncated) first; switch_now (purge) only switches away
    -- from a table that holds events.
    UPDATE outbox.generations SET state = 'closing', closed_at = clock_timestamp(), switched_by = pg_current_xact_id()
     WHERE state = 'current'
       AND ((switch_now AND EXISTS (SELECT 1 FROM outbox.events e WHERE e.generation = outbox.generations.generation))
            OR (keep > interval '0' AND opened_at < clock_timestamp() - keep / 2))
       AND EXISTS (SELECT 1 FROM outbox.generations n
                    WHERE n.generation = (outbox.generations.generation + 1) % 3 AND n.state = 'empty');
    IF FOUND THEN
        UPDATE outbox.generations SET state = 'current', opened_at = clock_timestamp()
         WHERE generation = (SELECT (generation + 1) % 3 FROM outbox.generations WHERE state = 'closing'
                              ORDER BY closed_at DESC LIMIT 1);
    END IF;

    -- The failure path's done rows, old ticks (the oldest still needed: the oldest event's), dedup marks.
    DELETE FROM outbox.held h WHERE h.status IN ('published', 'skipped') AND h.published_at < now() - keep;
    GET DIAGNOSTICS n = ROW_COUNT;
    removed := removed + n;
    DELETE FROM outbox.ticks t
     WHERE t.at < least(now() - keep, coalesce((SELECT min(opened_at) FROM outbox.generations WHERE opened_at IS NOT NULL), now()))
       AND EXISTS (SELECT 1 FROM outbox.ticks u WHERE u.shard = t.shard AND u.at > t.at);
    DELETE FROM outbox.processed_messages p WHERE p.processed_at < now() - keep;
    GET DIAGNOSTICS n = ROW_COUNT;
    removed := removed + n;
    RETURN removed;
END
$fn$;

COMMENT ON FUNCTION outbox._retention(interval, boolean) IS
    'Relay internal: one retention step: close, truncate and switch the event tables, delete done failure-path rows, old ticks and dedup marks';

REVOKE ALL ON FUNCTION outbox._initial_cursor() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._claim_shards(integer, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._read_shard(smallint, pg_snapshot, pg_snapshot, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._read_log(smallint, text, text, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._record_snapshot(boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._cursor_below(pg_snapshot, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._counters(text[], text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._held_aggregates(text[], text[], smallint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._held_due(smallint[], integer, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._hold(uuid[], bigint[], text[], integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._settle_held(bigint[], bigint[], text[], integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._advance(integer, smallint[], text[], text[], text[], bigint[], boolean[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._reap_shards(integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._retention(interval, boolean) FROM PUBLIC;
GRANT SELECT ON outbox.events TO outbox_admin;
