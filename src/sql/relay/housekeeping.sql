-- Housekeeping: what one relay of a database does between rounds, about once a second while
-- anything is undelivered, else every poll interval (src/relay/housekeeping.rs): free the shards
-- of relays that are gone, record the snapshots a lagging shard reads up to, and retention.
-- outbox.purge (operations.sql) runs a retention step on demand.

-- -------------------------------------------------------------------------------------------------
-- outbox._reap_shards(lease_ms)
--
--     The reaper: frees the shards of relays that exited (their pid is gone: a crash, kill -9, a
--     restart) or whose lease expired (a hung relay), so that the others take them at their next
--     claim.
--
-- Parameters:
--     lease_ms    outbox.lease
-- Returns:
--     how many shards it freed
-- Reads:   outbox.shards, pg_stat_get_activity
-- Writes:  update outbox.shards (claimed_by, claimed_at)
-- Called by: housekeeping (src/relay/housekeeping.rs)
-- -------------------------------------------------------------------------------------------------
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

COMMENT ON FUNCTION outbox._reap_shards(integer) IS
    'Relay internal: frees the shards of relays that exited or whose lease expired; returns how many';

-- -------------------------------------------------------------------------------------------------
-- outbox._record_snapshot(record)
--
--     Forgets the recorded snapshots every shard's cursor has reached, and, while anything is
--     undelivered, records one (at most about once a second) for lagging shards to read up to
--     (docs/worker.md, "Catching up"), with its time and the transaction that recorded it: the
--     start of this transaction, and its txid, drawn later (the age check's bound:
--     outbox.snapshots.recorded_by).
--
-- Parameters:
--     record      whether anything is undelivered (outbox.oldest_pending_age() is not NULL)
-- Returns:
--     whether it recorded one
-- Reads:   outbox.shards, outbox.snapshots
-- Writes:  delete and insert outbox.snapshots
-- Called by: housekeeping (src/relay/housekeeping.rs)
-- -------------------------------------------------------------------------------------------------
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
       OR EXISTS (SELECT 1 FROM outbox.snapshots p WHERE p.taken_at > now() - interval '900 milliseconds') THEN
        RETURN false;
    END IF;
    INSERT INTO outbox.snapshots (taken_at, snap, recorded_by) VALUES (now(), pg_current_snapshot(), pg_current_xact_id());
    RETURN true;
END
$fn$;

COMMENT ON FUNCTION outbox._record_snapshot(boolean) IS
    'Relay internal: forgets the recorded snapshots every cursor has passed and, while anything is undelivered, records one a second';

-- -------------------------------------------------------------------------------------------------
-- outbox._retention(keep, purge_older_than)
--
--     Retention, one step per call, each a few statements (docs/worker.md, "Retention and table
--     size", has the rule and its proof):
--       close     a switched table once the switch is visible to every new snapshot: closed_below
--                 is the next transaction id to be assigned, read after a snapshot that sees the
--                 switch committed, so it is above the id of every writer that can still insert
--                 into it;
--       consumed  a closed table once every shard's cursor xmin has reached closed_below: each of
--                 its writers has ended and its events were published or moved to outbox.held;
--       truncate  a consumed table once it has been consumed for keep (or, when outbox.purge
--                 asked for less, for its keep_for): published events are kept at least that long;
--       switch    to the next table (which must be empty) when the current one is older than half
--                 of keep, or on purge_older_than (outbox.purge) when it holds events and was
--                 opened before now - purge_older_than;
--     and deletes done rows of the failure path, old ticks and old dedup marks. The TRUNCATE
--     waits at most 100 ms for its lock (readers hold the tables for a moment each round) and is
--     retried at the next call.
--
-- Parameters:
--     keep              outbox.retention; NULL (outbox.retention = 0): no automatic switch or
--                       truncation, only what outbox.purge asked for
--     purge_older_than  outbox.purge's older_than, or NULL
-- Returns:
--     the number of events and rows removed
-- Reads:   outbox.generations, outbox.shards, outbox.events, outbox.ticks
-- Writes:  update outbox.generations; truncate outbox.events_<g> and outbox.journal_<g>; delete
--          outbox.held (published
--          or skipped), outbox.ticks, outbox.processed_messages
-- Called by: housekeeping (src/relay/housekeeping.rs); outbox.purge
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._retention(keep interval, purge_older_than interval DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $fn$
DECLARE
    removed bigint := 0;
    n bigint;
    g record;
    bound xid8;
    oldest_cursor_xmin xid8;
    switched smallint;
BEGIN
    -- Close. The switch has committed (pg_xact_status: never in the switching transaction itself,
    -- whose own id a snapshot of its own does not list as running) and the statement's snapshot
    -- sees it committed, so every writer that read the table as current did so under an earlier
    -- snapshot, with a transaction id assigned before it (outbox_enqueue takes the id first); the
    -- next id to be assigned, read after, is above all of theirs. (The xmax of a snapshot is not:
    -- it is one above the latest *completed* id, and a writer still running may hold a higher one.)
    FOR g IN SELECT * FROM outbox.generations
              WHERE state = 'closing' AND pg_xact_status(switched_by) = 'committed'
                AND pg_visible_in_snapshot(switched_by, pg_current_snapshot()) LOOP
        bound := outbox._next_xid()::text::xid8;
        UPDATE outbox.generations SET state = 'closed', closed_below = bound WHERE generation = g.generation;
    END LOOP;

    -- Consumed: every transaction below closed_below has ended, and every shard's cursor sees it.
    SELECT min(pg_snapshot_xmin(s.cursor)) INTO oldest_cursor_xmin FROM outbox.shards s;
    UPDATE outbox.generations SET consumed_at = clock_timestamp()
     WHERE state = 'closed' AND consumed_at IS NULL AND closed_below <= oldest_cursor_xmin;

    -- outbox.purge: closed and closing tables keep their events no longer than it asks.
    IF purge_older_than IS NOT NULL THEN
        UPDATE outbox.generations SET keep_for = least(coalesce(keep_for, purge_older_than), purge_older_than)
         WHERE state IN ('closing', 'closed');
    END IF;

    -- Truncate what has been consumed for long enough.
    FOR g IN SELECT * FROM outbox.generations
              WHERE state = 'closed' AND consumed_at IS NOT NULL
                AND (keep IS NOT NULL OR keep_for IS NOT NULL)
                AND consumed_at <= clock_timestamp() - least(coalesce(keep, keep_for), coalesce(keep_for, keep))
              ORDER BY closed_at LOOP
        BEGIN
            SET LOCAL lock_timeout = '100ms';
            EXECUTE format('SELECT count(*) FROM outbox.events_%s', g.generation) INTO n;
            -- The journal of the rounds finished while it was current goes with it: what it names
            -- is gone (or in the older tables, truncated before).
            EXECUTE format('TRUNCATE outbox.events_%1$s, outbox.journal_%1$s', g.generation);
            UPDATE outbox.generations
               SET state = 'empty', opened_at = NULL, closed_at = NULL, closed_below = NULL, switched_by = NULL,
                   consumed_at = NULL, keep_for = NULL
             WHERE generation = g.generation;
            removed := removed + n;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- readers in the way: next time
        END;
    END LOOP;

    -- Switch: the next table must be empty (truncated) first; outbox.purge switches only away from
    -- a table that holds events, some of them older than it asks.
    UPDATE outbox.generations c
       SET state = 'closing', closed_at = clock_timestamp(), switched_by = pg_current_xact_id(),
           keep_for = purge_older_than
     WHERE c.state = 'current'
       AND ((purge_older_than IS NOT NULL
             AND c.opened_at <= clock_timestamp() - purge_older_than
             AND EXISTS (SELECT 1 FROM outbox.events e WHERE e.generation = c.generation))
            OR (keep > interval '0' AND c.opened_at < clock_timestamp() - keep / 2))
       AND EXISTS (SELECT 1 FROM outbox.generations n WHERE n.generation = (c.generation + 1) % 3 AND n.state = 'empty')
    RETURNING c.generation INTO switched;
    IF switched IS NOT NULL THEN
        UPDATE outbox.generations SET state = 'current', opened_at = clock_timestamp()
         WHERE generation = (switched + 1) % 3;
    END IF;

    -- The failure path's done rows, old ticks (the oldest still needed: the oldest event's), dedup
    -- marks: after keep, or what outbox.purge asked for (dedup marks are the consumers', and only
    -- keep applies to them).
    IF keep IS NOT NULL OR purge_older_than IS NOT NULL THEN
        DELETE FROM outbox.held h
         WHERE h.status IN ('published', 'skipped')
           AND h.published_at <= clock_timestamp() - least(coalesce(keep, purge_older_than), coalesce(purge_older_than, keep));
        GET DIAGNOSTICS n = ROW_COUNT;
        removed := removed + n;
    END IF;
    IF keep IS NOT NULL THEN
        DELETE FROM outbox.ticks t
         WHERE t.at < least(now() - keep, coalesce((SELECT min(opened_at) FROM outbox.generations WHERE opened_at IS NOT NULL), now()))
           AND EXISTS (SELECT 1 FROM outbox.ticks u WHERE u.shard = t.shard AND u.at > t.at);
        DELETE FROM outbox.processed_messages p WHERE p.processed_at < now() - keep;
        GET DIAGNOSTICS n = ROW_COUNT;
        removed := removed + n;
    END IF;
    RETURN removed;
END
$fn$;

COMMENT ON FUNCTION outbox._retention(interval, interval) IS
    'Relay internal: one retention step: close, truncate and switch the event tables, delete done failure-path rows, old ticks and dedup marks';

REVOKE ALL ON FUNCTION outbox._reap_shards(integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._record_snapshot(boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._retention(interval, interval) FROM PUBLIC;
