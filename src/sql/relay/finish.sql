-- The finish: the one write a round makes on the happy path, once Redis has accepted its batch
-- (src/relay/settle.rs; docs/worker.md, "Finishing a batch" and "The finish"). It moves the
-- shards' cursors and the aggregates' counters per batch, never per event; what Redis refused went
-- to the failure path just before, in the same transaction (failure_path.sql).

-- -------------------------------------------------------------------------------------------------
-- outbox._advance(relay_pid, shards, cursors, window_uptos, window_max_ids, window_last_ids,
--                 aggregate_types, aggregate_ids, last_seqs, counted, published, published_seqs,
--                 published_streams)
--
--     Finishes a batch: moves each shard's cursor, or its position in the window it is publishing
--     in parts, for shards this relay still holds, and the counters of the aggregates it consumed.
--     A shard taken over after this relay's lease expired raises (55P03), so the whole finish
--     rolls back and the new holder publishes the batch again: a duplicate, never a gap. Records a
--     tick (for outbox.messages.published_at) per shard at most about once a second, when a
--     cursor moves.
--
--     The shards go first: their row locks keep any other relay from taking them over until this
--     commits, so nobody else writes the counters of their aggregates meanwhile. The counters the
--     batch's read found (counted) are upserted: ON CONFLICT finds the row before inserting and
--     updates it (one deleted meanwhile is inserted again). The others are plain INSERTs, which
--     cost half of what ON CONFLICT does for a new row (no speculative insertion); a workload
--     where every event is its own aggregate (a payment, an order) makes a new counter for every
--     event (docs/performance.md).
--
-- Parameters:
--     relay_pid        the calling relay's process id: the shards must still be claimed by it
--     shards           the shards to move, with, per shard n:
--     cursors          its new cursor (window_uptos[n] NULL: the window is done, and this is
--                      its end), or its current one while a window is published in parts
--     window_uptos     the end of the window published in parts, or NULL
--     window_max_ids, window_last_ids  the position reached in that window, or NULL
--     aggregate_types, aggregate_ids  the batch's aggregates, with, per aggregate n:
--     last_seqs        its last aggregate_seq after the batch
--     counted          whether the batch's read found its counter
--     published, published_seqs  what Redis received, in order, with the aggregate_seq each was
--                      sent with: journaled for replays (replay.sql), in the journal table of the
--                      log's current generation
--     published_streams  the stream keys those went to, each once (NULL: not known; a repair
--                      then walks the round whatever stream it lost)
-- Returns:
--     nothing; raises lock_not_available when a shard is no longer this relay's
-- Reads:   outbox.ticks (the shards' latest)
-- Writes:  update outbox.shards (cursor, cursor_at, window_*); insert outbox.ticks; insert or
--          update outbox.aggregates; insert outbox.journal_0..2
-- Called by: the round's finish (src/relay/settle.rs), last in its transaction
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._advance(relay_pid integer, shards smallint[], cursors text[],
                                window_uptos text[], window_max_ids bigint[], window_last_ids bigint[],
                                aggregate_types text[], aggregate_ids text[], last_seqs bigint[],
                                counted boolean[], published uuid[], published_seqs bigint[],
                                published_streams text[] DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
DECLARE
    advanced integer;
    current_generation smallint;
    round bigint;
    -- A value, not clock_timestamp() in the statement: a volatile bound cannot be an index
    -- condition, and every round would then read every tick of each of its shards.
    recent timestamptz := clock_timestamp() - interval '1 second';
BEGIN
    WITH moved AS (
        UPDATE outbox.shards s
           SET cursor = x.cursor::pg_snapshot, cursor_at = clock_timestamp(),
               window_upto = x.window_upto::pg_snapshot, window_max_id = x.window_max_id,
               window_last_id = x.window_last_id
          FROM unnest(shards, cursors, window_uptos, window_max_ids, window_last_ids)
               AS x(shard, cursor, window_upto, window_max_id, window_last_id)
         WHERE s.shard = x.shard AND s.claimed_by = relay_pid
        RETURNING s.shard, s.cursor, s.window_upto IS NULL AS whole
    ), ticked AS (
        INSERT INTO outbox.ticks (shard, cursor, at)
        SELECT m.shard, m.cursor, clock_timestamp()
          FROM moved m
         WHERE m.whole AND NOT EXISTS (SELECT 1 FROM outbox.ticks t
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
    IF cardinality(published) > 0 THEN
        -- One row per round, in the table of the generation current now: retention truncates it
        -- with that generation's log table, whose events it is mostly about.
        SELECT g.generation INTO current_generation FROM outbox.generations g WHERE g.state = 'current';
        round := nextval('outbox.journal_round_seq');
        IF current_generation = 0 THEN
            INSERT INTO outbox.journal_0 VALUES (round, clock_timestamp(), cardinality(published), published, published_seqs,
                                                 published_streams);
        ELSIF current_generation = 1 THEN
            INSERT INTO outbox.journal_1 VALUES (round, clock_timestamp(), cardinality(published), published, published_seqs,
                                                 published_streams);
        ELSE
            INSERT INTO outbox.journal_2 VALUES (round, clock_timestamp(), cardinality(published), published, published_seqs,
                                                 published_streams);
        END IF;
    END IF;
END
$fn$;

COMMENT ON FUNCTION outbox._advance(integer, smallint[], text[], text[], bigint[], bigint[], text[], text[], bigint[], boolean[], uuid[], bigint[], text[]) IS
    'Relay internal: finishes a batch: moves the cursors (or window positions) of the shards this relay still holds and the counters of its aggregates, and journals what it published';

REVOKE ALL ON FUNCTION outbox._advance(integer, smallint[], text[], text[], bigint[], bigint[], text[], text[], bigint[], boolean[], uuid[], bigint[], text[]) FROM PUBLIC;
