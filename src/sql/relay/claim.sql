-- The claim: which relay holds which of the 16 shards, and what each shard reads up to this round
-- (src/relay/read.rs runs it first in a round's read; docs/worker.md, "Shards: the unit of work").
-- Like every function under src/sql/relay/: PL/pgSQL, which keeps its plans for the session;
-- search_path pinned; EXECUTE revoked from PUBLIC, not for applications (the relays connect as
-- the bootstrap superuser).

-- -------------------------------------------------------------------------------------------------
-- outbox._claim_shards(relay_pid, share, lease_ms)
--
--     Takes and keeps this relay's share of the shards, FOR UPDATE SKIP LOCKED so that relays never
--     wait on each other: gives back what is above the share, takes free shards and those of a
--     relay that exited or whose lease expired (a hung relay) up to it, and renews its lease a
--     third of the way through. Then says, per shard it holds, what this round reads up to.
--
-- Parameters:
--     relay_pid   the calling relay's process id, recorded as claimed_by
--     share       how many shards it should hold: ceil(16 / relays alive)
--     lease_ms    outbox.lease: claims older than this are taken over
-- Returns, one row per shard it holds, in shard order:
--     shard, cursor        the shard and its cursor (pg_snapshot as text)
--     cursor_age_ms        how long ago the cursor last moved
--     upto                 what the round reads up to: the end of a window published in parts;
--                          else, for a shard more than a second behind, the first recorded
--                          snapshot ahead of its cursor; else now
--     held                 whether the failure path holds anything in these shards (the same in
--                          every row; most rounds then skip it)
--     bounded              upto is a recorded snapshot: the shard lags and more follows
--     window_max_id, window_last_id  the position reached in a window published in parts
-- Reads:   outbox.shards, outbox.snapshots, outbox.held, pg_stat_get_activity
-- Writes:  update outbox.shards (claimed_by, claimed_at), only when a shard changes hands or a
--          lease is renewed
-- Called by: the relay's round (src/relay/read.rs), except on a claim it keeps between rounds
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._claim_shards(relay_pid integer, share integer, lease_ms integer)
RETURNS TABLE (shard smallint, cursor text, cursor_age_ms bigint, upto text, held boolean, bounded boolean,
               window_max_id bigint, window_last_id bigint)
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
    -- What each shard reads up to, taken after the claim: the end of the window it is publishing
    -- in parts, with the position it reached; else now; or, for a shard more than a second behind
    -- (a snapshot recorded over a second ago is ahead of its cursor), the first recorded snapshot
    -- ahead of its cursor. "Ahead" is a larger xmax: the snapshot was taken after more
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
                   FROM mine m WHERE m.window_upto IS NULL)
        SELECT m.shard, m.cursor::text, (extract(epoch FROM clock_timestamp() - m.cursor_at) * 1000)::bigint,
               coalesce(m.window_upto, b.recorded, pg_catalog.pg_current_snapshot())::text,
               EXISTS (SELECT 1 FROM outbox.held h
                        WHERE h.shard IN (SELECT shard FROM mine) AND h.status IN ('waiting', 'failed')),
               b.recorded IS NOT NULL,
               m.window_max_id, m.window_last_id
          FROM mine m LEFT JOIN bounds b ON b.shard = m.shard ORDER BY m.shard;
END
$fn$;

COMMENT ON FUNCTION outbox._claim_shards(integer, integer, integer) IS
    'Relay internal: takes and keeps this relay''s share of the shards (SKIP LOCKED, lease) and returns what each reads up to this round';

REVOKE ALL ON FUNCTION outbox._claim_shards(integer, integer, integer) FROM PUBLIC;

-- -------------------------------------------------------------------------------------------------
-- outbox._held_shards(relay_pid, cursors)
--
--     What a round on a kept claim reads instead of claiming (nothing changes hands, the lease is
--     fresh), per shard this relay holds: its cursor, the window it publishes in parts and the
--     position reached, the snapshot of now (taken here, after the commit flags, like the claim's),
--     and the claim's bound for a lagging shard: the first snapshot recorded over a second ago
--     ahead of the cursor. Writes nothing.
--
-- Parameters:
--     relay_pid   the calling relay's process id (claimed_by)
--     cursors     per shard (indexed by shard + 1), where a round in flight leaves its cursor, or
--                 NULL: the stored cursor then
-- Returns, one row per shard it holds, in shard order:
--     shard, cursor                the shard and its cursor (pg_snapshot as text)
--     window_upto                  the end of a window published in parts, or NULL
--     window_max_id, window_last_id  the position reached in it
--     now                          pg_current_snapshot()
--     recorded                     the first recorded snapshot over a second old ahead of the cursor
-- Reads:   outbox.shards, outbox.snapshots
-- Called by: the relay's round on a kept claim (src/relay/read.rs)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._held_shards(relay_pid integer, cursors text[])
RETURNS TABLE (shard smallint, cursor text, window_upto text, window_max_id bigint, window_last_id bigint,
               now text, recorded text)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        SELECT s.shard, coalesce(cursors[s.shard + 1], s.cursor::text), s.window_upto::text,
               s.window_max_id, s.window_last_id, pg_catalog.pg_current_snapshot()::text,
               (SELECT p.snap::text FROM outbox.snapshots p
                 WHERE p.taken_at < clock_timestamp() - interval '1 second'
                   AND pg_catalog.pg_snapshot_xmax(p.snap)
                       > pg_catalog.pg_snapshot_xmax(coalesce(cursors[s.shard + 1]::pg_snapshot, s.cursor))
                 ORDER BY p.taken_at LIMIT 1)
          FROM outbox.shards s WHERE s.claimed_by = relay_pid ORDER BY s.shard;
END
$fn$;

COMMENT ON FUNCTION outbox._held_shards(integer, text[]) IS
    'Relay internal: what a round on a kept claim reads per shard it holds (cursor, window, now, the bound of a lagging shard)';

REVOKE ALL ON FUNCTION outbox._held_shards(integer, text[]) FROM PUBLIC;
