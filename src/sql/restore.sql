-- Dump and restore: pg_dump keeps the log, the cursors and the failure path (schema.sql marks them),
-- but the log's txid values and the cursors belong to the dumped cluster's transaction counter. A
-- restore into another cluster (whose counter is usually lower) would make the restored events
-- look like they were written in the future, and the new cluster's events like they were consumed
-- long ago: pending events would wait for billions of transactions and new ones would be skipped.
--
-- So the restore itself rebases. CREATE EXTENSION has already made fresh shards and generations
-- when pg_restore copies the dumped ones; the triggers below catch those rows (the only inserts
-- these tables ever see after CREATE EXTENSION), and once all of them are in, outbox._rebase()
-- translates the dumped state into this cluster's counter, in the restoring transaction:
--   * an event the dumped cursor had consumed (published, or moved to the failure path) gets the
--     txid 3, below every cursor: it stays consumed, and outbox.messages shows it published;
--   * an event the dumped cursor had not consumed gets the restoring transaction's txid, and every
--     cursor starts just before it: the relay publishes it once the restore commits, in id order
--     (which is commit order per aggregate), with the aggregate_seq that follows the restored
--     counters;
--   * closed generations stay closed, bounded above the restoring transaction, so that retention
--     never truncates a table before the relays have consumed what it holds.
-- Recommended: pg_restore --single-transaction (or psql -1): the relay then sees the database only
-- once it is rebased. See docs/worker.md, "Dump and restore".

-- The dumped rows of outbox.shards and outbox.generations, held until both tables are in.
CREATE TABLE outbox.restored_shards (
    shard     smallint    PRIMARY KEY,
    cursor    pg_snapshot NOT NULL,
    cursor_at timestamptz NOT NULL
);
CREATE TABLE outbox.restored_generations (
    generation smallint    PRIMARY KEY,
    state      text        NOT NULL,
    opened_at  timestamptz,
    closed_at  timestamptz
);
COMMENT ON TABLE outbox.restored_shards IS
    'outbox_pg: dumped cursors caught during a restore, until outbox._rebase() translates them (normally empty)';
COMMENT ON TABLE outbox.restored_generations IS
    'outbox_pg: dumped generation states caught during a restore, until outbox._rebase() translates them (normally empty)';

-- -------------------------------------------------------------------------------------------------
-- outbox._rebase()
--
--     Translates a restored dump into this cluster's transaction counter, in the restoring
--     transaction, once every dumped shard and generation row is in (the tables above). Idempotent
--     while incomplete.
--
-- Returns:
--     whether it rebased
-- Reads:   outbox.restored_shards, outbox.restored_generations
-- Writes:  update outbox.events_0..2 (txid), outbox.shards, outbox.generations; delete and insert
--          outbox.ticks; delete outbox.snapshots, outbox.restored_shards, outbox.restored_generations
-- Called by: outbox._rebase_after_restore, after each insert into outbox.shards or
--            outbox.generations (a restore's)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._rebase()
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
    -- A window the dumped relays were publishing in parts starts again whole: what they had
    -- published of it is published again (at least once, as for anything published after the dump).
    UPDATE outbox.shards s
       SET cursor = fresh, cursor_at = clock_timestamp(), claimed_by = NULL, claimed_at = NULL,
           window_upto = NULL, window_max_id = NULL, window_last_id = NULL;
    -- published_at of the restored published events: the dumped cursor's time, an upper bound.
    DELETE FROM outbox.ticks;
    DELETE FROM outbox.snapshots;
    INSERT INTO outbox.ticks (shard, cursor, at)
    SELECT r.shard, fresh, r.cursor_at FROM outbox.restored_shards r;

    -- One current table at every step (a unique index): clear first, then take the dumped states.
    -- A table the dumped cluster was still closing had no writer left when it was dumped.
    UPDATE outbox.generations
       SET state = 'empty', opened_at = NULL, closed_at = NULL, switched_by = NULL, closed_below = NULL,
           consumed_at = NULL, keep_for = NULL;
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

COMMENT ON FUNCTION outbox._rebase() IS
    'Relay internal: translates a restored dump''s cursors and txids into this cluster''s (run by the restore''s triggers)';

-- -------------------------------------------------------------------------------------------------
-- outbox._catch_restored_row()   trigger, BEFORE INSERT FOR EACH ROW on outbox.shards, outbox.generations
--
--     Catches a dumped row instead of inserting it (the extension's own row is already there),
--     keeping it in outbox.restored_shards or outbox.restored_generations for outbox._rebase.
--
-- Writes:  insert or update outbox.restored_shards, outbox.restored_generations
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._catch_restored_row()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF TG_TABLE_NAME = 'shards' THEN
        INSERT INTO outbox.restored_shards (shard, cursor, cursor_at) VALUES (NEW.shard, NEW.cursor, NEW.cursor_at)
        ON CONFLICT (shard) DO UPDATE SET cursor = excluded.cursor, cursor_at = excluded.cursor_at;
    ELSE
        INSERT INTO outbox.restored_generations (generation, state, opened_at, closed_at)
        VALUES (NEW.generation, NEW.state, NEW.opened_at, NEW.closed_at)
        ON CONFLICT (generation) DO UPDATE
            SET state = excluded.state, opened_at = excluded.opened_at, closed_at = excluded.closed_at;
    END IF;
    RETURN NULL;
END
$fn$;

COMMENT ON FUNCTION outbox._catch_restored_row() IS
    'Internal (restore): keeps a dumped row of outbox.shards or outbox.generations aside for outbox._rebase instead of inserting it';

-- -------------------------------------------------------------------------------------------------
-- outbox._rebase_after_restore()   trigger, AFTER INSERT FOR EACH STATEMENT on outbox.shards,
--                                  outbox.generations
--
--     Runs outbox._rebase, which does nothing until the last dumped row is in.
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._rebase_after_restore()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM outbox._rebase();
    RETURN NULL;
END
$fn$;

COMMENT ON FUNCTION outbox._rebase_after_restore() IS
    'Internal (restore): runs outbox._rebase after a restore''s insert into outbox.shards or outbox.generations';

-- Created after the extension's own rows (schema.sql): from here on, only a restore inserts here.
CREATE TRIGGER catch_restored_shard BEFORE INSERT ON outbox.shards
    FOR EACH ROW EXECUTE FUNCTION outbox._catch_restored_row();
CREATE TRIGGER catch_restored_generation BEFORE INSERT ON outbox.generations
    FOR EACH ROW EXECUTE FUNCTION outbox._catch_restored_row();
CREATE TRIGGER rebase_restored_shards AFTER INSERT ON outbox.shards
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._rebase_after_restore();
CREATE TRIGGER rebase_restored_generations AFTER INSERT ON outbox.generations
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._rebase_after_restore();
COMMENT ON TRIGGER catch_restored_shard ON outbox.shards IS
    'outbox_pg: catches a restore''s dumped cursor for outbox._rebase';
COMMENT ON TRIGGER catch_restored_generation ON outbox.generations IS
    'outbox_pg: catches a restore''s dumped generation state for outbox._rebase';
COMMENT ON TRIGGER rebase_restored_shards ON outbox.shards IS
    'outbox_pg: rebases a restored dump once its cursors and generations are all in';
COMMENT ON TRIGGER rebase_restored_generations ON outbox.generations IS
    'outbox_pg: rebases a restored dump once its cursors and generations are all in';

REVOKE ALL ON FUNCTION outbox._rebase() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._catch_restored_row() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._rebase_after_restore() FROM PUBLIC;
