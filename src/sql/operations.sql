-- Operating the outbox: dead letters (retry, skip), retention on demand, sequence counters, and
-- health (oldest_pending_age, outbox.stats). Runs last in the install script (finalize): the stats
-- view reads the Rust helper relay_status(), and the privileges below cover the Rust helpers too.
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

-- Privileges: operations are for outbox_admin, health also for pg_monitor.
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

-- The Rust helpers the SQL above calls (created by the Rust code, hence granted here).
REVOKE ALL ON FUNCTION outbox._prepare_enqueue(text, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._lock_for_claim() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._relay_claims() FROM PUBLIC;
