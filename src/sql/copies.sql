-- Copies: a database created with CREATE DATABASE ... TEMPLATE from a relayed one carries its log,
-- cursors and counters. Unless it carries nothing of the original's, its relays publish nothing
-- until an admin adopts it (outbox.installation names the original until then;
-- src/relay/readiness.rs). docs/worker.md, "A copy is not the original".

-- -------------------------------------------------------------------------------------------------
-- outbox._database_created_by()
--
--     The transaction that created this database, as a full transaction id: every event copied
--     into it by CREATE DATABASE ... TEMPLATE is older (nobody was connected to the template),
--     every event enqueued in it is younger.
--
-- Returns:
--     that transaction id; NULL when this database's pg_database row was frozen (a database that
--     old was not just copied)
-- Reads:   pg_database
-- Called by: outbox.adopt_copy; the relays, to tell a copy that carries nothing of the original's
--            from one that does (src/relay/readiness.rs)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._database_created_by()
RETURNS xid8
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT CASE WHEN age(d.xmin) < 2000000000
                THEN (pg_current_xact_id()::text::bigint - age(d.xmin))::text::xid8 END
      FROM pg_database d WHERE d.datname = current_database()
$fn$;

COMMENT ON FUNCTION outbox._database_created_by() IS
    'Internal: the transaction that created this database (events copied from a template are older, its own younger); NULL when frozen';

-- -------------------------------------------------------------------------------------------------
-- outbox.adopt_copy(publish_copied_events)
--
--     Adopts a copied installation as this database's own, after which its relays publish. The
--     copied events were the original database's to publish: unless publish_copied_events, they
--     are consumed without being published, and the failure path's copies are skipped. They are
--     told apart from the copy's own by transaction id (outbox._database_created_by). The counters
--     are kept, so the copy's aggregates continue their numbering: point the copy at streams of
--     its own first (outbox.stream, outbox.redis_url), or its aggregate_seqs collide with the
--     original's. What the copy holds of the original's Redis stays the original's: the copied
--     running replays (repairs too) are cancelled, with the reason in outbox.replays.last_error
--     (the original finishes them; a replay the copy needs is asked for again, in the copy), and
--     the copied stream marks and Redis losses are dropped (they describe the streams the original
--     wrote; the copy's relays record their own).
--
-- Parameters:
--     publish_copied_events  false (default): leave the copied undelivered events to the
--                            original; true: publish them from here too
-- Returns:
--     a sentence saying what it did
-- Writes:  update outbox.shards (cursors, claims), outbox.held (skipped), outbox.installation,
--          outbox.replay_requests (cancelled); delete outbox.snapshots, outbox.stream_marks,
--          outbox.redis_losses
-- Called by: admins (role outbox_admin), once, in the copy
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox.adopt_copy(publish_copied_events boolean DEFAULT false)
RETURNS text
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    original oid;
    here oid;
    created_by xid8;
    skipped bigint := 0;
    cancelled bigint := 0;
BEGIN
    SELECT i.database_oid INTO original FROM outbox.installation i;
    SELECT d.oid INTO here FROM pg_database d WHERE d.datname = current_database();
    IF publish_copied_events IS NULL THEN
        RAISE EXCEPTION 'outbox.adopt_copy: publish_copied_events must be true or false, got NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'false (the default) leaves the copied events to the original database; true publishes them from here too.';
    END IF;
    IF original = here THEN
        RAISE EXCEPTION 'outbox.adopt_copy: the outbox of database "%" is its own, not a copy', current_database()
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'adopt_copy is for a database created with CREATE DATABASE ... TEMPLATE from a relayed one; this one is relayed as it is.';
    END IF;
    -- Its relays wait for the claim rows: nobody publishes while the cursors move.
    PERFORM 1 FROM outbox.shards FOR UPDATE;
    IF NOT publish_copied_events THEN
        created_by := outbox._database_created_by();
        UPDATE outbox.shards
           SET cursor = coalesce((created_by::text || ':' || created_by::text || ':')::pg_snapshot, outbox._initial_cursor()),
               cursor_at = clock_timestamp(),
               window_upto = NULL, window_max_id = NULL, window_last_id = NULL;
        UPDATE outbox.held h
           SET status = 'skipped', published_at = clock_timestamp(),
               last_error = format('copied from database oid %s; left to it by outbox.adopt_copy()', original)
         WHERE h.status IN ('waiting', 'failed');
        GET DIAGNOSTICS skipped = ROW_COUNT;
    END IF;
    -- The copied claims name the original's relays, which are alive in their own database.
    UPDATE outbox.shards SET claimed_by = NULL, claimed_at = NULL;
    DELETE FROM outbox.snapshots;
    -- The copied replays (repairs too) are the original's, which goes on with them: finished here,
    -- they would send its events a second time, to its streams (or to its history stream).
    UPDATE outbox.replay_requests r
       SET state = 'cancelled', finished_at = clock_timestamp(), claimed_by = NULL, claimed_at = NULL,
           not_before = NULL,
           last_error = format('copied from database oid %s, whose replay it is; cancelled here by outbox.adopt_copy()', original)
     WHERE r.state = 'running';
    GET DIAGNOSTICS cancelled = ROW_COUNT;
    -- The marks and losses describe the streams the original wrote: checked from here they would
    -- report the original's losses as the copy's (and repair_losses() would replay them).
    DELETE FROM outbox.stream_marks;
    DELETE FROM outbox.redis_losses;
    UPDATE outbox.installation SET database_oid = here, installed_at = clock_timestamp();
    -- An unadopted copy has no relays: the launcher gives it some once this commits.
    PERFORM outbox._rescan_at_commit();
    RETURN CASE WHEN publish_copied_events
                THEN format('adopted the copy of database oid %s; its undelivered events will be published from here too; its replays are left to it (%s running cancelled here)', original, cancelled)
                ELSE format('adopted the copy of database oid %s; its undelivered events are left to it (%s on the failure path skipped), and its replays (%s running cancelled here)', original, skipped, cancelled)
           END;
END
$fn$;

COMMENT ON FUNCTION outbox.adopt_copy(boolean) IS
    'Makes a copied outbox (CREATE DATABASE ... TEMPLATE) this database''s own, so that its relays publish; copied undelivered events are left to the original unless publish_copied_events, copied running replays are cancelled, copied stream marks and Redis losses dropped';

REVOKE ALL ON FUNCTION outbox._database_created_by() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.adopt_copy(boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.adopt_copy(boolean) TO outbox_admin;
