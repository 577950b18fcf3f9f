-- Health: how much is undelivered, how old the oldest undelivered event is, and the relays' state
-- (outbox.stats, outbox.oldest_pending_age(), outbox.relays()). Runs after the functions written in
-- Rust (src/lib.rs): the stats view reads relay_status(), from shared memory.
--
-- What counts as undelivered is defined once, by outbox._health, and everything that reports or
-- acts on it reads it there: outbox.stats, oldest_pending_age(), and through that the relay's age
-- alert and its recording of snapshots (src/relay/housekeeping.rs). Undelivered is:
--   * an event of the log whose transaction committed and that its shard's cursor has not
--     consumed, nor, in a window published in parts, the position reached (src/log/window.rs);
--   * an event on the failure path that is waiting (due, or backing off).
-- A failed event is not undelivered but failed, until outbox.retry_failed or outbox.skip_failed.
-- The log's part is an index walk in Rust (outbox._log_pending, src/log/pending.rs), so that no
-- statistics can make it slow; the failure path's is SQL over its partial index. outbox.messages
-- (operations.sql) shows the same rule event by event, for any filter (an event_id), which an index
-- walk over everything undelivered cannot serve, so the rule is written a second time there;
-- tests/operations.rs (messages_and_stats_agree_on_what_is_undelivered) holds the two to it. See
-- docs/worker.md, "Health".

-- -------------------------------------------------------------------------------------------------
-- outbox._log_pending(count_events)
--
--     The log's part of the rule above: its undelivered events, straight from the log's
--     (shard, txid, id) indexes. Without counting, each undelivered transaction costs one index
--     probe and one row; counting reads each undelivered row once.
--
-- Parameters:
--     count_events  count them (else events is 0, and only the oldest is looked for)
-- Returns:
--     events        how many (when counted)
--     oldest        when the oldest was enqueued, NULL when none
-- Reads:   outbox.shards, outbox.events_0..2 (their indexes, without the planner)
-- Called by: outbox._health
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._log_pending(count_events boolean)
RETURNS TABLE (events bigint, oldest timestamptz)
LANGUAGE c STRICT VOLATILE
AS 'MODULE_PATHNAME', 'log_pending_sql_wrapper';

COMMENT ON FUNCTION outbox._log_pending(boolean) IS
    'Internal: the log''s undelivered events (counted when count_events) and when the oldest was enqueued, from the log''s indexes';

-- -------------------------------------------------------------------------------------------------
-- outbox._health(count_events)
--
--     The figures of outbox.stats, by the rule above: undelivered events (the log's and the
--     failure path's waiting ones), failed ones, when the oldest undelivered was enqueued, and
--     when anything was last published. Every part is an index walk whatever the statistics: the
--     log's in Rust, the failure path through its partial index (enable_seqscan = off), the ticks
--     one backward probe per shard. SECURITY DEFINER: monitoring roles see the figures without
--     reading any event.
--
-- Parameters:
--     count_events  count (default true); false looks for the oldest only, which is cheaper
-- Returns:
--     undelivered, failed, oldest, last_published_at
-- Reads:   through outbox._log_pending; outbox.held, outbox.shards, outbox.ticks
-- Called by: outbox.stats, outbox.oldest_pending_age
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._health(count_events boolean DEFAULT true)
RETURNS TABLE (undelivered bigint, failed bigint, oldest timestamptz, last_published_at timestamptz)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
    SELECT l.events + CASE WHEN count_events
                          THEN (SELECT count(*) FROM outbox.held h WHERE h.status IN ('waiting', 'failed') AND h.status = 'waiting')
                          ELSE 0 END,
           CASE WHEN count_events
                THEN (SELECT count(*) FROM outbox.held h WHERE h.status IN ('waiting', 'failed') AND h.status = 'failed')
                ELSE 0 END,
           least(l.oldest, (SELECT min(h.created_at) FROM outbox.held h WHERE h.status IN ('waiting', 'failed') AND h.status = 'waiting')),
           greatest((SELECT max(t.last) FROM outbox.shards s
                      CROSS JOIN LATERAL (SELECT max(k.at) AS last FROM outbox.ticks k WHERE k.shard = s.shard) t),
                    (SELECT max(h.published_at) FROM outbox.held h WHERE h.status IN ('published', 'skipped') AND h.status = 'published'))
      FROM outbox._log_pending(count_events) l
$fn$;

COMMENT ON FUNCTION outbox._health(boolean) IS
    'outbox.stats'' figures: undelivered (log and failure path), failed, oldest undelivered and last published, from indexes only';

-- -------------------------------------------------------------------------------------------------
-- outbox.oldest_pending_age()
--
--     Age of the oldest undelivered event (the rule above), NULL when none: the health signal.
--     SECURITY DEFINER through _health: monitoring roles (pg_monitor) see the age without reading
--     any event.
--
-- Returns:
--     an interval, or NULL
-- Reads:   through outbox._health (without counting)
-- Called by: monitoring; the relay's housekeeping, about once a second (src/relay/housekeeping.rs)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox.oldest_pending_age()
RETURNS interval
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT clock_timestamp() - h.oldest FROM outbox._health(false) h
$fn$;

COMMENT ON FUNCTION outbox.oldest_pending_age() IS
    'Age of the oldest undelivered event (pending or in flight), NULL when none: the outbox health signal';

-- -------------------------------------------------------------------------------------------------
-- outbox.stats
--
--     One row of health, cheap enough to poll every few seconds: exact pending (undelivered
--     minus what the relays have in flight), publishing and failed counts, events published since
--     the server started, the oldest pending event's age, and the relays' pid, Redis health and
--     latest error. In a database no relay serves, it shows no relay.
--
-- Reads:   outbox._health; outbox.relay_status() (shared memory)
-- Read by: admins (role outbox_admin), monitoring (pg_monitor); README, "SQL API", lists its columns
-- -------------------------------------------------------------------------------------------------
CREATE VIEW outbox.stats AS
SELECT
    -- The relays' in-flight events (shared memory) are counted as publishing, not pending.
    greatest(h.undelivered - r.in_flight, 0)                                AS pending,
    r.in_flight                                                             AS publishing,
    h.failed,
    r.published_total,
    clock_timestamp() - h.oldest                                            AS oldest_pending_age,
    h.last_published_at,
    r.worker_pid,
    r.workers,
    r.redis_connected,
    r.last_error,
    r.last_error_at,
    -- Not repaired: no replay, or one cancelled, refused by Redis, or done having replayed nothing.
    (SELECT count(*) FROM outbox.redis_losses l
      WHERE NOT EXISTS (SELECT 1 FROM outbox.replay_requests q
                         WHERE q.id = l.replay_id
                           AND (q.state = 'running' OR (q.state = 'done' AND q.errors = 0 AND q.replayed > 0))))
                                                                            AS redis_data_loss
FROM outbox.relay_status() AS r, outbox._health() AS h;

COMMENT ON VIEW outbox.stats IS
    'One row of outbox health, cheap enough to poll every few seconds: exact pending/publishing/failed counts, events published since the server started, oldest_pending_age is the alert signal';
COMMENT ON COLUMN outbox.stats.published_total IS 'Events the relays of this database published since the server started (exact; a counter like pg_stat''s, reset by a restart)';
COMMENT ON COLUMN outbox.stats.oldest_pending_age IS 'Age of the oldest undelivered event; NULL when nothing is pending';
COMMENT ON COLUMN outbox.stats.redis_data_loss IS 'Losses of acknowledged entries the relays noticed (outbox.redis_losses) that no replay repaired or is repairing: none asked for, or one cancelled, refused by Redis, or done having replayed no event (outbox.repair_losses())';
COMMENT ON COLUMN outbox.stats.last_error IS 'The relay''s most recent error (Redis or database), kept after recovery; see last_error_at';

-- Privileges: health is for outbox_admin and pg_monitor.
REVOKE ALL ON FUNCTION outbox._health(boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._log_pending(boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._health(boolean) TO outbox_admin, pg_monitor;
GRANT SELECT ON outbox.stats TO outbox_admin, pg_monitor;
GRANT USAGE ON SCHEMA outbox TO pg_monitor;
