-- Operating the outbox: the status of any event (outbox.messages), dead letters (retry, skip),
-- retention on demand, sequence counters, and health (oldest_pending_age, outbox.stats). Runs last
-- in the install script (finalize): the stats view reads the Rust helper relay_status(), and the
-- privileges below cover the Rust helpers too.

-- Every event and what became of it, one row per event: the one place to ask "pending, published
-- (when), failed (why) or skipped?" of an event_id. Built from the log, each shard's cursor and the
-- failure path (outbox.held); nothing here is stored per event. aggregate_seq is shown for events
-- on the failure path (the relay assigns it when an event leaves the log, and a published event
-- carries it in its stream entry). published_at is when the batch that consumed the event finished,
-- to within about a second (outbox.ticks).
CREATE VIEW outbox.messages AS
SELECT e.id,
       e.event_id,
       e.aggregate_type,
       e.aggregate_id,
       h.aggregate_seq,
       e.event_type,
       e.payload,
       e.headers,
       e.stream,
       CASE WHEN h.status IS NOT NULL THEN CASE h.status WHEN 'waiting' THEN 'pending' ELSE h.status END
            WHEN pg_catalog.pg_visible_in_snapshot(e.txid, s.cursor) THEN 'published'
            ELSE 'pending' END                                                  AS status,
       e.created_at,
       CASE WHEN h.status IS NOT NULL THEN h.published_at
            WHEN pg_catalog.pg_visible_in_snapshot(e.txid, s.cursor) THEN
                coalesce((SELECT min(t.at) FROM outbox.ticks t
                           WHERE t.shard = e.shard AND t.at >= e.created_at
                             AND pg_catalog.pg_visible_in_snapshot(e.txid, t.cursor)), s.cursor_at)
       END                                                                      AS published_at,
       h.available_at,
       coalesce(h.attempts, 0)                                                  AS attempts,
       coalesce(h.rejections, 0)                                                AS rejections,
       h.failed_at,
       h.last_error,
       e.txid,
       e.shard
  FROM outbox.events e
  JOIN outbox.shards s ON s.shard = e.shard
  LEFT JOIN outbox.held h ON h.id = e.id
UNION ALL
-- Failure-path events whose log table retention has already truncated.
SELECT h.id, h.event_id, h.aggregate_type, h.aggregate_id, h.aggregate_seq, h.event_type, h.payload, h.headers,
       h.stream, CASE h.status WHEN 'waiting' THEN 'pending' ELSE h.status END, h.created_at, h.published_at,
       h.available_at, h.attempts, h.rejections, h.failed_at, h.last_error, NULL::xid8, h.shard
  FROM outbox.held h
 WHERE NOT EXISTS (SELECT 1 FROM outbox.events e WHERE e.event_id = h.event_id);

COMMENT ON VIEW outbox.messages IS
    'outbox_pg: every event and its status (pending, published, failed, skipped), from the log, the shards'' cursors and the failure path';

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
        UPDATE outbox.held h
           SET status = 'waiting', attempts = 0, rejections = 0, available_at = NULL, failed_at = NULL
         WHERE h.status = 'failed' AND (ids IS NULL OR h.id = ANY (ids))
        RETURNING 1
    )
    SELECT count(*) FROM retried
$fn$;

COMMENT ON FUNCTION outbox.retry_failed(bigint[]) IS
    'Returns failed events (all, or those ids) to pending with attempts reset; returns how many';

-- Gives up on failed events for good, so that later events of their aggregates flow again. The
-- event is kept (status skipped, published_at = when skipped) until retention removes it.
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
    UPDATE outbox.held h
       SET status = 'skipped', published_at = clock_timestamp()
     WHERE h.status = 'failed' AND h.id = ANY (ids);
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
-- outbox (neither in the log nor on the failure path): their next event starts again at 1. An
-- aggregate a transaction is enqueuing for right now (it holds the aggregate's order lock) is not
-- forgotten, nor a counter a relay is advancing (SKIP LOCKED). Returns how many were forgotten.
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
     USING (SELECT g.aggregate_type, g.aggregate_id
              FROM outbox.aggregates g
             WHERE NOT EXISTS (SELECT 1 FROM outbox.events e
                                WHERE e.aggregate_type = g.aggregate_type AND e.aggregate_id = g.aggregate_id)
               AND NOT EXISTS (SELECT 1 FROM outbox.held h
                                WHERE h.aggregate_type = g.aggregate_type AND h.aggregate_id = g.aggregate_id)
               AND NOT outbox._enqueue_in_progress(g.aggregate_type, g.aggregate_id)
               FOR UPDATE OF g SKIP LOCKED) idle
     WHERE a.aggregate_type = idle.aggregate_type AND a.aggregate_id = idle.aggregate_id;
    GET DIAGNOSTICS forgotten = ROW_COUNT;
    RETURN forgotten;
END
$fn$;

COMMENT ON FUNCTION outbox.forget_aggregates() IS
    'Deletes the aggregate_seq counters of aggregates with no event left in the outbox (their numbering restarts at 1); returns how many';

-- Retention on demand: deletes what is published (or skipped) and older than older_than. The log is
-- removed a whole table at a time, so this switches to a new table and truncates every older one
-- the relays have consumed; a table switched by this call is truncated by the relay's next
-- housekeeping pass (about a second later) or the next purge, once no writer can be left on it.
-- Failed and undelivered events are never deleted. Returns how many events and rows it removed.
CREATE FUNCTION outbox.purge(older_than interval)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
-- outbox_admin may read rows but not write them: the change is made as the owner.
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF older_than IS NULL OR older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox.purge: older_than must be a non-negative interval, got %', coalesce(older_than::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass e.g. ''7 days''; ''0'' purges every published event.';
    END IF;
    RETURN outbox._retention(older_than, true);
END
$fn$;

COMMENT ON FUNCTION outbox.purge(interval) IS
    'Deletes published and skipped events older than older_than (whole log tables once consumed); returns how many';

-- Age of the oldest event not yet delivered, NULL when none: per shard, the events the cursor has
-- not consumed (through the (shard, txid) index), and the waiting events of the failure path.
-- SECURITY DEFINER: monitoring roles (pg_monitor) see the age without reading any event.
CREATE FUNCTION outbox.oldest_pending_age()
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

COMMENT ON FUNCTION outbox.oldest_pending_age() IS
    'Age of the oldest undelivered event (pending or in flight), NULL when none: the outbox health signal';

-- Events not yet delivered, exactly: not consumed by their shard's cursor, plus the failure path's
-- waiting events.
CREATE FUNCTION outbox._undelivered()
RETURNS bigint
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
DECLARE
    undelivered bigint;
    now_snapshot pg_snapshot := pg_current_snapshot();
BEGIN
    SELECT coalesce(sum(n), 0) INTO undelivered
      FROM outbox.shards s
     CROSS JOIN LATERAL (
               SELECT count(*) AS n
                 FROM outbox.events e
                WHERE e.shard = s.shard AND e.txid >= pg_snapshot_xmax(s.cursor)
                  AND pg_visible_in_snapshot(e.txid, now_snapshot)
               UNION ALL
               SELECT count(*)
                 FROM outbox.events e
                WHERE e.shard = s.shard AND e.txid = ANY (ARRAY(SELECT pg_snapshot_xip(s.cursor)))
                  AND pg_visible_in_snapshot(e.txid, now_snapshot)) u;
    RETURN undelivered + (SELECT count(*) FROM outbox.held h WHERE h.status = 'waiting');
END
$fn$;

CREATE VIEW outbox.stats AS
SELECT
    -- The relays' in-flight events (shared memory) are counted as publishing, not pending.
    greatest(outbox._undelivered() - r.in_flight, 0)                       AS pending,
    r.in_flight                                                             AS publishing,
    (SELECT count(*) FROM outbox.held h WHERE h.status = 'failed')          AS failed,
    r.published_total,
    outbox.oldest_pending_age()                                             AS oldest_pending_age,
    greatest((SELECT max(t.at) FROM outbox.ticks t),
             (SELECT max(h.published_at) FROM outbox.held h WHERE h.status = 'published'))
                                                                            AS last_published_at,
    r.worker_pid,
    r.workers,
    r.redis_connected,
    r.last_error,
    r.last_error_at
FROM outbox.relay_status() AS r;

COMMENT ON VIEW outbox.stats IS
    'One row of outbox health, cheap enough to poll every few seconds: exact pending/publishing/failed counts, events published since the server started, oldest_pending_age is the alert signal';
COMMENT ON COLUMN outbox.stats.published_total IS 'Events the relays of this database published since the server started (exact; a counter like pg_stat''s, reset by a restart)';
COMMENT ON COLUMN outbox.stats.oldest_pending_age IS 'Age of the oldest undelivered event; NULL when nothing is pending';
COMMENT ON COLUMN outbox.stats.last_error IS 'The relay''s most recent error (Redis or database), kept after recovery; see last_error_at';

-- Privileges: operations are for outbox_admin, health also for pg_monitor.
REVOKE ALL ON FUNCTION outbox.retry_failed(bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.skip_failed(bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.purge(interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.forget_aggregates() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._undelivered() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.retry_failed(bigint[]) TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.skip_failed(bigint[]) TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.purge(interval) TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.forget_aggregates() TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox._undelivered() TO outbox_admin, pg_monitor;
GRANT SELECT ON outbox.messages TO outbox_admin;
GRANT SELECT ON outbox.stats TO outbox_admin, pg_monitor;
GRANT USAGE ON SCHEMA outbox TO pg_monitor;

-- The Rust helpers the SQL above calls (created by the Rust code, hence granted here).
REVOKE ALL ON FUNCTION outbox._shard_of(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._enqueue_in_progress(text, text) FROM PUBLIC;
