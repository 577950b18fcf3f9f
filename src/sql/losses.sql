-- Noticing that Redis lost entries it had acknowledged, and repairing them: the stream marks the
-- relays store (sink/src/marks.rs, src/relay/losses.rs), the losses they record, and the replays
-- that repair them (replay.sql). docs/worker.md, "When Redis loses entries".

-- -------------------------------------------------------------------------------------------------
-- What the relays know of the streams they write to (sink/src/marks.rs), and the losses they found.
-- -------------------------------------------------------------------------------------------------
CREATE TABLE outbox.stream_marks (
    -- Which Redis (its nodes as the relay names them in its logs, never credentials, and
    -- " db N" for a database other than 0): the marks of one say nothing of another's.
    target     text        COLLATE "C" NOT NULL,
    stream     text        COLLATE "C" NOT NULL,
    -- The last entry ID Redis returned for this stream (<ms>-<seq>), and when it was written.
    last_ms    bigint      NOT NULL,
    last_seq   bigint      NOT NULL,
    written_at timestamptz NOT NULL,
    PRIMARY KEY (target, stream)
);
COMMENT ON TABLE outbox.stream_marks IS
    'outbox_pg: per stream, the last entry ID Redis returned to a relay: what the relays check Redis still has';

CREATE SEQUENCE outbox.redis_loss_id_seq AS bigint;
COMMENT ON SEQUENCE outbox.redis_loss_id_seq IS 'outbox_pg: loss ids (outbox.redis_losses)';
SELECT pg_catalog.pg_extension_config_dump('outbox.redis_loss_id_seq', '');

CREATE TABLE outbox.redis_losses (
    id          bigint      PRIMARY KEY DEFAULT nextval('outbox.redis_loss_id_seq'),
    stream      text        COLLATE "C" NOT NULL,
    detected_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- What a relay had written last (entry ID, when), and what Redis had then (NULL: no stream).
    expected_id text        NOT NULL,
    expected_at timestamptz NOT NULL,
    found_id    text,
    -- The replay that repairs it (outbox.repair_losses, or outbox.replay_on_loss): the last one
    -- asked for. Repaired once it is done with events replayed and none refused.
    replay_id   bigint,
    UNIQUE (stream, expected_id)
);
COMMENT ON TABLE outbox.redis_losses IS
    'outbox_pg: streams Redis lost entries of after acknowledging them, as the relays found, and the replay that repairs each';
SELECT pg_catalog.pg_extension_config_dump('outbox.redis_losses', '');

-- -------------------------------------------------------------------------------------------------
-- outbox._store_marks(target, streams, last_ms, last_seqs, written_at)
--
--     Stores a relay's stream marks for the Redis it writes to (sink/src/marks.rs), keeping the
--     later of each.
-- Writes:  insert or update outbox.stream_marks
-- Called by: a relay, in the transaction that finishes a round (or records a replay round's
--          progress), and at most once a second for marks a failed finish did not store
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._store_marks(target text, streams text[], last_ms bigint[], last_seqs bigint[],
                                    written_at timestamptz[])
RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
    INSERT INTO outbox.stream_marks AS m (target, stream, last_ms, last_seq, written_at)
    SELECT target, x.* FROM unnest(streams, last_ms, last_seqs, written_at) AS x
    ON CONFLICT (target, stream) DO UPDATE
       SET last_ms = excluded.last_ms, last_seq = excluded.last_seq, written_at = excluded.written_at
     WHERE (excluded.last_ms, excluded.last_seq) > (m.last_ms, m.last_seq);
$fn$;
COMMENT ON FUNCTION outbox._store_marks(text, text[], bigint[], bigint[], timestamptz[]) IS
    'outbox_pg: stores the last entry ID written to each stream; relays only';

-- -------------------------------------------------------------------------------------------------
-- outbox.repair_losses(losses)
--
--     Replays what Redis lost: for each loss not repaired (of those ids, or all), the events of
--     exactly its stream (the key as it is: no pattern) published since the last entry Redis kept
--     (every retained one, for a stream Redis lost whole), and records the replay with the loss.
--     A loss is repaired once its replay is done with events replayed and none refused; one whose
--     replay was cancelled or refused by Redis is replayed again. One whose replay is done having
--     replayed nothing (no retained event maps to that stream under the outbox.stream template of
--     now: it was written under an earlier one, or retention removed its events) is replayed again
--     only when its id is passed; without ids it gets a WARNING saying what to do instead. Losses a
--     running replay repairs are left to it.
-- Returns: (loss, replay) per replay asked for
-- Raises:  22023 for an empty array, or ids no loss has; 22004 for a NULL id
-- Writes:  outbox.redis_losses (replay_id); outbox.replay_requests through outbox._request_replay
-- Called by: outbox_admin; a relay when outbox.replay_on_loss is on
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox.repair_losses(losses bigint[] DEFAULT NULL)
RETURNS TABLE (loss bigint, replay bigint)
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    l record;
    kept_since timestamptz;
    unknown bigint[];
BEGIN
    IF losses IS NOT NULL THEN
        IF cardinality(losses) = 0 THEN
            RAISE EXCEPTION 'outbox.repair_losses: losses must list loss ids (got %)', losses
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Pass NULL (or nothing) to repair every loss not repaired yet; the ids are in outbox.redis_losses.';
        END IF;
        IF array_ndims(losses) > 1 THEN
            RAISE EXCEPTION 'outbox.repair_losses: losses must be a list, not an array of % dimensions (got %)',
                            array_ndims(losses), losses
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Pass the ids of outbox.redis_losses as one list, e.g. ARRAY[1, 2], or nothing for every loss.';
        END IF;
        IF array_position(losses, NULL) IS NOT NULL THEN
            RAISE EXCEPTION 'outbox.repair_losses: losses must not hold NULL (got %)', losses
                USING ERRCODE = 'null_value_not_allowed', HINT = 'Pass the ids of outbox.redis_losses to repair.';
        END IF;
        SELECT array_agg(x.id ORDER BY x.id) INTO unknown FROM unnest(losses) AS x(id)
         WHERE NOT EXISTS (SELECT 1 FROM outbox.redis_losses r WHERE r.id = x.id);
        IF unknown IS NOT NULL THEN
            RAISE EXCEPTION 'outbox.repair_losses: no loss has the id(s) %', unknown
                USING ERRCODE = 'invalid_parameter_value', HINT = 'The ids are in outbox.redis_losses.';
        END IF;
    END IF;
    SELECT coalesce(min(g.opened_at), '-infinity') INTO kept_since FROM outbox.generations g WHERE g.state <> 'empty';
    FOR l IN SELECT r.*, q.state AS replay_state, q.replayed, q.errors
               FROM outbox.redis_losses r
               LEFT JOIN outbox.replay_requests q ON q.id = r.replay_id
              WHERE losses IS NULL OR r.id = ANY (losses)
              ORDER BY r.id FOR UPDATE OF r LOOP
        -- Repaired, or being repaired.
        CONTINUE WHEN l.replay_state = 'running' OR (l.replay_state = 'done' AND l.errors = 0 AND l.replayed > 0);
        IF l.replay_state = 'done' AND l.errors = 0 AND losses IS NULL THEN
            RAISE WARNING 'outbox.repair_losses: replay % of loss % replayed no event of stream "%": no retained event published since it was lost maps to that stream under the outbox.stream template of now',
                          l.replay_id, l.id, l.stream
                USING HINT = format('If stream %L was written under an earlier outbox.stream template (or an event''s own stream), replay its events into it: SELECT outbox.replay(since => ..., aggregate_types => ARRAY[...], to_stream => %L). The loss stays counted in outbox.stats.redis_data_loss; SELECT outbox.repair_losses(ARRAY[%s]) tries it again.',
                                    l.stream, l.stream, l.id);
            CONTINUE;
        END IF;
        loss := l.id;
        -- Redis's clock stamps its entry IDs: what it lost was written after the last ID it kept,
        -- give or take a second between its clock and this server's.
        replay := outbox._request_replay(kept_since, NULL, ARRAY[l.stream], NULL, NULL, NULL,
                                         CASE WHEN l.found_id IS NOT NULL THEN
                                             to_timestamp(split_part(l.found_id, '-', 1)::bigint / 1000.0) - interval '1 second' END,
                                         true, NULL, true);
        UPDATE outbox.redis_losses r SET replay_id = replay WHERE r.id = l.id;
        RETURN NEXT;
    END LOOP;
END
$fn$;
COMMENT ON FUNCTION outbox.repair_losses(bigint[]) IS
    'outbox_pg: replays exactly the stream of each loss in outbox.redis_losses not repaired (or of those ids); returns the replays';

-- -------------------------------------------------------------------------------------------------
-- outbox._report_losses(streams, expected_ids, expected_at, found_ids)
--
--     Records losses a relay found; a loss another relay recorded already is not recorded twice.
-- Returns: the losses recorded now
-- Writes:  insert outbox.redis_losses
-- Called by: a relay after a check of its stream marks (src/relay/worker.rs)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._report_losses(streams text[], expected_ids text[], expected_at timestamptz[], found_ids text[])
RETURNS SETOF outbox.redis_losses
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
    INSERT INTO outbox.redis_losses (stream, expected_id, expected_at, found_id)
    SELECT * FROM unnest(streams, expected_ids, expected_at, found_ids)
    ON CONFLICT (stream, expected_id) DO NOTHING
    RETURNING *;
$fn$;
COMMENT ON FUNCTION outbox._report_losses(text[], text[], timestamptz[], text[]) IS
    'outbox_pg: records the losses a relay found, once; relays only';

-- -------------------------------------------------------------------------------------------------
-- outbox._forget_marks(target, streams, last_ms, last_seqs)
--
--     A lost stream's stored mark goes, so that a relay started later does not find the same loss
--     again: marks at or below what was lost only (another relay may have stored a later one).
-- Writes:  delete outbox.stream_marks
-- Called by: a relay, in the transaction that records the losses it found
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._forget_marks(target text, streams text[], last_ms bigint[], last_seqs bigint[])
RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
    DELETE FROM outbox.stream_marks m
     USING unnest(_forget_marks.streams, _forget_marks.last_ms, _forget_marks.last_seqs) AS l(stream, ms, seq)
     WHERE m.target = _forget_marks.target AND m.stream = l.stream AND (m.last_ms, m.last_seq) <= (l.ms, l.seq);
$fn$;
COMMENT ON FUNCTION outbox._forget_marks(text, text[], bigint[], bigint[]) IS
    'outbox_pg: deletes the stored marks of streams Redis lost, up to the loss; relays only';

-- -------------------------------------------------------------------------------------------------
-- outbox._prune_marks(target, kept, retention_s)
--
--     The marks the relays need not keep: those of target beyond the kept written to most recently
--     (a relay checks no more), and, with outbox.retention (retention_s), those of any Redis not
--     written to for longer than it.
-- Returns: how many were deleted
-- Writes:  delete outbox.stream_marks
-- Called by: a relay, now and then (src/relay/worker.rs)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._prune_marks(target text, kept bigint, retention_s integer)
RETURNS bigint
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH pruned AS (
        DELETE FROM outbox.stream_marks m
         WHERE (m.target = _prune_marks.target
                AND m.written_at < (SELECT k.written_at FROM outbox.stream_marks k WHERE k.target = _prune_marks.target
                                     ORDER BY k.written_at DESC OFFSET kept - 1 LIMIT 1))
            OR m.written_at < now() - retention_s * interval '1 second'
        RETURNING 1
    )
    SELECT count(*) FROM pruned;
$fn$;
COMMENT ON FUNCTION outbox._prune_marks(text, bigint, integer) IS
    'outbox_pg: deletes the stream marks no relay checks any more; relays only';

-- -------------------------------------------------------------------------------------------------
-- outbox._repairs_running()
--
--     Whether a replay that repairs a loss still runs: while one does, with outbox.replay_on_loss,
--     no relay of the database starts a live round.
-- Reads:   outbox.redis_losses, outbox.replay_requests
-- Called by: a relay, before live rounds while the database's repair gate is raised, and by
--          housekeeping
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._repairs_running()
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT EXISTS (SELECT 1 FROM outbox.redis_losses l JOIN outbox.replay_requests r ON r.id = l.replay_id
                    WHERE r.state = 'running');
$fn$;
COMMENT ON FUNCTION outbox._repairs_running() IS
    'outbox_pg: whether a replay that repairs a Redis loss still runs; relays only';

-- -------------------------------------------------------------------------------------------------
-- outbox._stored_marks(target, most)
--
--     The stream marks stored for the Redis target names, the most recently written first, at most
--     most of them: what a relay adopts before its first write (a relay checks no more).
-- Returns: per stream, its last entry ID (ms, seq) and when it was written, in microseconds since
--          1970
-- Reads:   outbox.stream_marks
-- Called by: a relay, at start and when it is pointed at another Redis
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._stored_marks(target text, most bigint)
RETURNS TABLE (stream text, last_ms bigint, last_seq bigint, written_us bigint)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT m.stream, m.last_ms, m.last_seq, (extract(epoch FROM m.written_at) * 1000000)::bigint
      FROM outbox.stream_marks m
     WHERE m.target = _stored_marks.target
     ORDER BY m.written_at DESC
     LIMIT most;
$fn$;
COMMENT ON FUNCTION outbox._stored_marks(text, bigint) IS
    'outbox_pg: the stream marks stored for a Redis, the most recently written first; relays only';

-- -------------------------------------------------------------------------------------------------
-- outbox._unrepaired_losses(replay)
--
--     The losses a replay was to repair and did not, once it is done: it replayed nothing (their
--     streams' events map to other streams now, or retention removed them).
-- Reads:   outbox.redis_losses, outbox.replay_requests
-- Called by: a relay, after the last round of a replay, to say so (a WARNING per loss)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._unrepaired_losses(replay bigint)
RETURNS TABLE (id bigint, stream text)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT l.id, l.stream
      FROM outbox.redis_losses l JOIN outbox.replay_requests r ON r.id = l.replay_id
     WHERE r.id = _unrepaired_losses.replay AND r.state = 'done' AND r.replayed = 0
     ORDER BY l.id;
$fn$;
COMMENT ON FUNCTION outbox._unrepaired_losses(bigint) IS
    'outbox_pg: the losses a done replay repaired nothing of; relays only';

REVOKE ALL ON FUNCTION outbox.repair_losses(bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._store_marks(text, text[], bigint[], bigint[], timestamptz[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._forget_marks(text, text[], bigint[], bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._prune_marks(text, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._repairs_running() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._stored_marks(text, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._unrepaired_losses(bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._report_losses(text[], text[], timestamptz[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.repair_losses(bigint[]) TO outbox_admin;
GRANT SELECT ON outbox.redis_losses, outbox.stream_marks TO outbox_admin;
GRANT SELECT ON outbox.redis_losses TO pg_monitor;
