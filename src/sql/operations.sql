-- Operating the outbox, for role outbox_admin: the status of any event (outbox.messages), dead
-- letters (retry, skip), retention on demand (purge), and the sequence counters (forget). The
-- functions are SECURITY DEFINER: outbox_admin may read every row but write none, so a repair goes
-- through them, made as the owner, and no hand-written row can hide an event from the relay or
-- mark one published that never was. Health (outbox.stats) is in health.sql, copies in copies.sql.

-- -------------------------------------------------------------------------------------------------
-- outbox.messages
--
--     Every event and what became of it, one row per event: the one place to ask "pending,
--     published (when), failed (why) or skipped?" of an event_id. Built from the log, each shard's
--     cursor and the failure path (outbox.held); nothing here is stored per event. An event of the
--     log is published once its shard's cursor, or the position reached in a window published in
--     parts, has consumed it (the rule outbox._health counts by, health.sql), unless it went to
--     the failure path, whose status it then shows ('waiting' shown as pending). aggregate_seq is
--     shown for events on the failure path (the relay assigns it when an event leaves the log, and
--     a published event carries it in its stream entry). published_at is when the batch that
--     consumed the event finished, to within about a second (outbox.ticks).
--
-- Reads:   outbox.events, outbox.shards, outbox.ticks, outbox.held
-- Read by: admins (role outbox_admin); tests
-- -------------------------------------------------------------------------------------------------
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
            WHEN pg_catalog.pg_visible_in_snapshot(e.txid, s.cursor) OR w.consumed THEN 'published'
            ELSE 'pending' END                                                  AS status,
       e.created_at,
       CASE WHEN h.status IS NOT NULL THEN h.published_at
            WHEN pg_catalog.pg_visible_in_snapshot(e.txid, s.cursor) THEN
                coalesce((SELECT t.at FROM outbox.ticks t
                           WHERE t.shard = e.shard AND t.at >= e.created_at
                             AND pg_catalog.pg_visible_in_snapshot(e.txid, t.cursor)
                           ORDER BY t.at LIMIT 1), s.cursor_at)
            WHEN w.consumed THEN s.cursor_at
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
  -- Of a window published in parts (src/log/window.rs), what the position has passed: the events
  -- of the transactions whose largest id in the shard is below it, and of the one at it up to it.
  -- Said without that largest id, so that each event costs one index probe whatever the size of
  -- its transaction: (largest id, e.id) <= (max, last) holds when no event m of the transaction
  -- has (m.id, e.id) > (max, last), and only those from window_max_id on can.
  CROSS JOIN LATERAL (
      SELECT s.window_upto IS NOT NULL
             AND pg_catalog.pg_visible_in_snapshot(e.txid, s.window_upto)
             AND NOT pg_catalog.pg_visible_in_snapshot(e.txid, s.cursor)
             AND NOT EXISTS (SELECT FROM outbox.events m
                              WHERE m.shard = e.shard AND m.txid = e.txid AND m.id >= s.window_max_id
                                AND (m.id, e.id) > (s.window_max_id, s.window_last_id)) AS consumed) w
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

-- -------------------------------------------------------------------------------------------------
-- outbox._check_event_ids(caller, ids, hint)
--
--     Refuses a list of outbox.messages ids that cannot name an event: empty or of more than one
--     dimension (22023; NULL itself is the caller's to allow), holding a NULL (22004) or an id
--     below 1 (22023).
--
-- Parameters:
--     caller  the function checked, for the message
--     ids     the list
--     hint    what to pass instead
-- Called by: outbox.retry_failed, outbox.skip_failed
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._check_event_ids(caller text, ids bigint[], hint text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF ids IS NULL THEN
        RETURN;
    END IF;
    IF cardinality(ids) = 0 THEN
        RAISE EXCEPTION '%: ids is empty: it names no event', caller
            USING ERRCODE = 'invalid_parameter_value', HINT = hint;
    END IF;
    IF array_ndims(ids) > 1 THEN
        RAISE EXCEPTION '%: ids must be a list, not an array of % dimensions (got %)', caller, array_ndims(ids), ids
            USING ERRCODE = 'invalid_parameter_value', HINT = hint;
    END IF;
    IF array_position(ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION '%: ids holds a NULL (got %)', caller, ids
            USING ERRCODE = 'null_value_not_allowed', HINT = hint;
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(ids) i WHERE i < 1) THEN
        RAISE EXCEPTION '%: ids holds %, which is no event id (they start at 1)', caller,
                        (SELECT min(i) FROM unnest(ids) i)
            USING ERRCODE = 'invalid_parameter_value', HINT = hint;
    END IF;
END
$fn$;

COMMENT ON FUNCTION outbox._check_event_ids(text, bigint[], text) IS
    'Internal: refuses an empty or multidimensional list of event ids, a NULL in it, or an id below 1';

-- -------------------------------------------------------------------------------------------------
-- outbox.retry_failed(ids)
--
--     Puts failed (dead-lettered) events back on the failure path as waiting, due now, with their
--     counters reset: the relay sends them again in its next round.
--
-- Parameters:
--     ids     the events' ids (outbox.messages.id), or NULL (the default) for every failed event
-- Returns:
--     how many it retried
-- Writes:  update outbox.held
-- Called by: admins (role outbox_admin)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox.retry_failed(ids bigint[] DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    retried bigint;
BEGIN
    PERFORM outbox._check_event_ids('outbox.retry_failed', ids, 'Pass NULL (the default) to retry every failed event.');
    UPDATE outbox.held h
       SET status = 'waiting', attempts = 0, rejections = 0, available_at = NULL, failed_at = NULL
     WHERE h.status = 'failed' AND (ids IS NULL OR h.id = ANY (ids));
    GET DIAGNOSTICS retried = ROW_COUNT;
    RETURN retried;
END
$fn$;

COMMENT ON FUNCTION outbox.retry_failed(bigint[]) IS
    'Returns failed events (all, or those ids) to pending with attempts reset; returns how many';

-- -------------------------------------------------------------------------------------------------
-- outbox.skip_failed(ids)
--
--     Gives up on failed events for good, so that the later events of their aggregates flow
--     again. Each is kept (status skipped, published_at = when skipped) until retention removes it.
--
-- Parameters:
--     ids     the failed events' ids, not empty: skipping is never done for "all"
-- Returns:
--     how many it skipped
-- Writes:  update outbox.held
-- Called by: admins (role outbox_admin)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox.skip_failed(ids bigint[])
RETURNS bigint
LANGUAGE plpgsql VOLATILE
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
    PERFORM outbox._check_event_ids('outbox.skip_failed', ids, 'List the failed events by outbox.messages.id.');
    UPDATE outbox.held h
       SET status = 'skipped', published_at = clock_timestamp()
     WHERE h.status = 'failed' AND h.id = ANY (ids);
    GET DIAGNOSTICS skipped = ROW_COUNT;
    RETURN skipped;
END
$fn$;

COMMENT ON FUNCTION outbox.skip_failed(bigint[]) IS
    'Marks these failed events skipped (never delivered), releasing the later events of their aggregates; returns how many';

-- -------------------------------------------------------------------------------------------------
-- outbox.forget_aggregates()
--
--     outbox.aggregates remembers the last aggregate_seq of every aggregate ever seen, so that no
--     aggregate's numbering ever restarts: consumers may use aggregate_seq as a version ("apply
--     only if newer"), and a restart at 1 would make them drop every later event. The price is one
--     small row per distinct aggregate, kept after retention. A DBA who knows that no consumer
--     compares aggregate_seq across long silences can forget the aggregates that have no event
--     left in the outbox (neither in the log nor on the failure path): their next event starts
--     again at 1. An aggregate a transaction is enqueuing for right now (it holds the aggregate's
--     order lock) is not forgotten, nor a counter a relay is advancing (SKIP LOCKED). While a
--     transaction that went past the order-lock cap runs (it enqueues for aggregates without their
--     lock, src/enqueue/order.rs), nothing is forgotten: it may hold an uncommitted event of any
--     aggregate.
--
-- Returns:
--     how many counters it forgot (0, with a NOTICE, while a transaction past the cap runs)
-- Reads:   outbox.events, outbox.held, the order locks (outbox._enqueue_in_progress,
--          outbox._exclude_transactions_past_the_cap)
-- Writes:  delete outbox.aggregates
-- Called by: admins (role outbox_admin)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox.forget_aggregates()
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    forgotten bigint;
BEGIN
    IF NOT outbox._exclude_transactions_past_the_cap() THEN
        RAISE NOTICE 'outbox.forget_aggregates: a transaction that enqueued for more than 256 aggregates is running; nothing was forgotten'
            USING HINT = 'Its events beyond the 256th aggregate carry no order lock to check; call outbox.forget_aggregates() again once it has ended.';
        RETURN 0;
    END IF;
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

-- -------------------------------------------------------------------------------------------------
-- outbox.purge(older_than)
--
--     Retention on demand: removes the published (and skipped) events older than older_than, a
--     whole log table at a time. Now: every table that every shard consumed at least older_than
--     ago. Then: the tables already switched away from keep their events no longer than
--     older_than, and the current table, if it holds events and was opened before
--     now - older_than, is switched away from, so that it too goes older_than after the relays
--     consumed it (the housekeeping truncates it then, or the next purge). Failed and undelivered
--     events are never deleted; consumers' dedup marks are left to outbox.retention and
--     outbox.purge_processed.
--
-- Parameters:
--     older_than  a non-negative interval; '0' purges every published event once consumed
-- Returns:
--     how many events and rows it removed
-- Writes:  through outbox._retention (relay/housekeeping.sql)
-- Called by: admins (role outbox_admin)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox.purge(older_than interval)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF older_than IS NULL OR older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox.purge: older_than must be a non-negative interval, got %', coalesce(older_than::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass e.g. ''7 days''; ''0'' purges every published event.';
    END IF;
    RETURN outbox._retention(NULL, older_than);
END
$fn$;

COMMENT ON FUNCTION outbox.purge(interval) IS
    'Deletes published and skipped events older than older_than (whole log tables once consumed); returns how many';

-- Privileges: operations are for outbox_admin.
REVOKE ALL ON FUNCTION outbox._check_event_ids(text, bigint[], text) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.retry_failed(bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.skip_failed(bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.purge(interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.forget_aggregates() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.retry_failed(bigint[]) TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.skip_failed(bigint[]) TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.purge(interval) TO outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.forget_aggregates() TO outbox_admin;
GRANT SELECT ON outbox.messages TO outbox_admin;
