-- Replay: sending events Redis lost (or that a new consumer needs) again, from the outbox, which
-- keeps every published event for outbox.retention. docs/worker.md, "Replay"; the relay side is
-- src/relay/replay.rs. Noticing what Redis lost, and asking for its repair, is losses.sql.
--
-- A replay walks the journal of what each round published (journal.sql), so it sends exactly the
-- events that were published, in the order they were (commit order per aggregate), with the
-- aggregate_seq they had; it never sends an event that was not published, and it marks nothing.

-- -------------------------------------------------------------------------------------------------
-- Replays asked for, and their progress.
-- -------------------------------------------------------------------------------------------------
-- A sequence of its own, not an identity column: pg_dump keeps an extension's sequence values only
-- for sequences registered like its tables.
CREATE SEQUENCE outbox.replay_id_seq AS bigint;
COMMENT ON SEQUENCE outbox.replay_id_seq IS 'outbox_pg: replay ids (outbox.replays)';
SELECT pg_catalog.pg_extension_config_dump('outbox.replay_id_seq', '');

CREATE TABLE outbox.replay_requests (
    id              bigint      PRIMARY KEY DEFAULT nextval('outbox.replay_id_seq'),
    requested_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    requested_by    name        NOT NULL DEFAULT session_user,
    -- The selection: events enqueued in [since, until), published at or after published_since,
    -- and matching every filter given.
    since           timestamptz NOT NULL,
    until           timestamptz,
    published_since timestamptz,
    streams         text[],
    -- streams are exact keys, not patterns (outbox.repair_losses: the stream Redis lost, whatever
    -- its characters).
    exact_streams   boolean     NOT NULL DEFAULT false,
    aggregate_types text[],
    -- How many event ids the event_ids filter lists (NULL: no such filter); the ids are in
    -- outbox.replay_event_ids while the replay runs, where a round probes them per event.
    event_ids       bigint,
    -- Sent to this stream instead of each event's own.
    to_stream       text,
    -- At most this many events a second (NULL: as fast as the relays go between live rounds).
    max_rate        integer CHECK (max_rate > 0),
    -- The journal rounds it walks: from first_round to last_round (the last finished when it was
    -- asked for; later rounds are live traffic), and how many events they hold.
    first_round     bigint      NOT NULL,
    last_round      bigint      NOT NULL,
    journaled       bigint      NOT NULL,
    state           text        NOT NULL DEFAULT 'running' CHECK (state IN ('running', 'done', 'cancelled')),
    -- Where it stands: the next journal round, and the position in that round's arrays.
    next_round      bigint      NOT NULL,
    next_index      integer     NOT NULL DEFAULT 0,
    -- Journal entries walked so far; events sent, left out by the filters, no longer in the log
    -- (retention removed them meanwhile, with or without the journal rounds naming them: what the
    -- walk did not reach of `journaled` when it ends is missing too), refused by Redis.
    walked          bigint      NOT NULL DEFAULT 0,
    replayed        bigint      NOT NULL DEFAULT 0,
    filtered        bigint      NOT NULL DEFAULT 0,
    missing         bigint      NOT NULL DEFAULT 0,
    errors          bigint      NOT NULL DEFAULT 0,
    last_error      text,
    -- The relay replaying it (a claim with a lease, like a shard's), and when the throttle lets
    -- it go on.
    claimed_by      integer,
    claimed_at      timestamptz,
    not_before      timestamptz,
    finished_at     timestamptz
);
CREATE INDEX replay_requests_running_idx ON outbox.replay_requests (id) WHERE state = 'running';
COMMENT ON TABLE outbox.replay_requests IS
    'outbox_pg: replays asked for with outbox.replay(), with their progress (read them through outbox.replays)';
SELECT pg_catalog.pg_extension_config_dump('outbox.replay_requests', '');

-- A replay's event_ids filter, one row per id: a round probes it per event it examines (the
-- relay never loads the list, however long). Deleted when the replay ends or is cancelled.
CREATE TABLE outbox.replay_event_ids (
    replay   bigint NOT NULL,
    event_id uuid   NOT NULL,
    PRIMARY KEY (replay, event_id)
);
COMMENT ON TABLE outbox.replay_event_ids IS
    'outbox_pg: the event ids a running replay''s event_ids filter lists (outbox.replay)';
SELECT pg_catalog.pg_extension_config_dump('outbox.replay_event_ids', '');

CREATE VIEW outbox.replays AS
SELECT r.id, r.state, r.requested_at, r.requested_by, r.since, r.until, r.published_since, r.streams,
       r.aggregate_types, r.event_ids, r.to_stream, r.max_rate,
       r.replayed, greatest(r.journaled - r.walked, 0) AS remaining, r.filtered, r.missing, r.errors,
       r.last_error, r.finished_at
  FROM outbox.replay_requests r;
COMMENT ON VIEW outbox.replays IS
    'outbox_pg: each replay: its selection, state (running, done, cancelled), events replayed, journal entries still to walk (remaining), left out by the filters, no longer retained (missing), refused by Redis (errors)';

-- -------------------------------------------------------------------------------------------------
-- outbox.replay(since, until, streams, aggregate_types, event_ids, to_stream, published_since,
--               partial, max_rate)
--
--     Asks the relays to publish again the published events enqueued in [since, until) that match
--     every filter given, in the order they were published (commit order per aggregate), each with
--     its event_id, aggregate_seq and created_at and a `replay` field naming the replay. Live
--     traffic goes on; the replay runs between live rounds, in bounded rounds.
--
-- Parameters:
--     since            enqueued at or after (required)
--     until            enqueued before (NULL: no bound)
--     streams          only events whose stream key is one of these (keys, or glob patterns as in
--                      outbox.allowed_streams); the key is the event's own stream or the
--                      outbox.stream template's now
--     aggregate_types  only these aggregate types
--     event_ids        only these events
--     to_stream        send them to this stream instead (outbox.allowed_streams applies)
--     published_since  only events published at or after this time (what a Redis loss took)
--     partial          replay what is left when retention removed part of the range, or when it
--                      starts before this installation began recording
--     max_rate         at most this many events a second
-- Returns:
--     the replay's id (outbox.replays)
-- Raises:
--     22004 for a NULL since or partial; 22023 for a since or published_since in the future, an
--     empty range, blank or overlong to_stream, an empty or multidimensional list of streams,
--     aggregate types or event ids (or one with a NULL or empty element, or a blank pattern), a
--     stream pattern ending in an escaping backslash, a max_rate below 1, a range starting before
--     this installation began recording, and a range retention removed in part (unless partial); 42501 for a to_stream outbox.allowed_streams does not
--     allow
-- Reads:   outbox.generations, outbox.journal
-- Writes:  insert outbox.replay_requests
-- Called by: outbox_admin
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox.replay(since timestamptz, until timestamptz DEFAULT NULL, streams text[] DEFAULT NULL,
                              aggregate_types text[] DEFAULT NULL, event_ids uuid[] DEFAULT NULL,
                              to_stream text DEFAULT NULL, published_since timestamptz DEFAULT NULL,
                              partial boolean DEFAULT false, max_rate integer DEFAULT NULL)
RETURNS bigint
LANGUAGE sql VOLATILE
-- outbox_admin may not write outbox.replay_requests itself.
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT outbox._request_replay(since, until, streams, aggregate_types, event_ids, to_stream, published_since,
                                  partial, max_rate, false);
$fn$;
COMMENT ON FUNCTION outbox.replay(timestamptz, timestamptz, text[], text[], uuid[], text, timestamptz, boolean, integer) IS
    'outbox_pg: publishes again the published events enqueued in [since, until) that match the filters, in order, with their event_id and aggregate_seq; returns the replay''s id (outbox.replays)';

-- -------------------------------------------------------------------------------------------------
-- outbox._request_replay(since, until, streams, aggregate_types, event_ids, to_stream, published_since,
--                        partial, max_rate, exact_streams)
--
--     outbox.replay, and with exact_streams the streams are keys compared as they are (no glob, no
--     comma, no trimming): outbox.repair_losses replays exactly the stream Redis lost.
-- Returns, raises: as outbox.replay
-- Called by: outbox.replay; outbox.repair_losses
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._request_replay(since timestamptz, until timestamptz, streams text[], aggregate_types text[],
                                       event_ids uuid[], to_stream text, published_since timestamptz, partial boolean,
                                       max_rate integer, exact_streams boolean)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $fn$
DECLARE
    kept_since timestamptz;
    journaled_since timestamptz;
    unfinished_pattern text;
    first_round bigint;
    last_round bigint;
    journaled bigint;
    created bigint;
BEGIN
    IF since IS NULL THEN
        RAISE EXCEPTION 'outbox.replay: since must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the enqueue time to replay from, e.g. since => now() - interval ''1 hour''.';
    END IF;
    IF partial IS NULL THEN
        RAISE EXCEPTION 'outbox.replay: partial must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass partial => true to replay what is left of a range retention removed in part, or false (the default).';
    END IF;
    -- A replay covers what was published when it is asked for: a time to come (or 'infinity')
    -- would select nothing while the replay reports done.
    IF since > clock_timestamp() OR published_since > clock_timestamp() THEN
        RAISE EXCEPTION 'outbox.replay: % is %, in the future: a replay sends what was published before it was asked for',
                        CASE WHEN since > clock_timestamp() THEN 'since' ELSE 'published_since' END,
                        CASE WHEN since > clock_timestamp() THEN since ELSE published_since END
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass a time in the past, e.g. now() - interval ''1 hour''.';
    END IF;
    IF array_ndims(streams) > 1 OR array_ndims(aggregate_types) > 1 OR array_ndims(event_ids) > 1 THEN
        RAISE EXCEPTION 'outbox.replay: % must be a list, not an array of more dimensions',
                        CASE WHEN array_ndims(streams) > 1 THEN 'streams'
                             WHEN array_ndims(aggregate_types) > 1 THEN 'aggregate_types' ELSE 'event_ids' END
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass a one-dimensional array, e.g. ARRAY[''a'', ''b''].';
    END IF;
    IF until IS NOT NULL AND until <= since THEN
        RAISE EXCEPTION 'outbox.replay: the range [%, %) is empty', since, until
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass an until later than since, or none.';
    END IF;
    IF to_stream IS NOT NULL AND (btrim(to_stream) = '' OR octet_length(to_stream) > 512) THEN
        RAISE EXCEPTION 'outbox.replay: to_stream must be a Redis key of 1 to 512 bytes (got % bytes)', octet_length(to_stream)
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass the stream to send the events to, or NULL for their own.';
    END IF;
    IF to_stream IS NOT NULL THEN
        PERFORM outbox._check_allowed_stream(to_stream);
    END IF;
    -- An empty list would select nothing: NULL is "every".
    IF cardinality(streams) = 0 OR cardinality(aggregate_types) = 0 OR cardinality(event_ids) = 0 THEN
        RAISE EXCEPTION 'outbox.replay: % is an empty list, which selects no event',
                        CASE WHEN cardinality(streams) = 0 THEN 'streams'
                             WHEN cardinality(aggregate_types) = 0 THEN 'aggregate_types' ELSE 'event_ids' END
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass NULL for every one, or list at least one.';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(streams) s WHERE s IS NULL OR (s = '' AND NOT exact_streams)) THEN
        RAISE EXCEPTION 'outbox.replay: streams must list keys or patterns, none of them empty or NULL (got %)', streams
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass NULL for every stream.';
    END IF;
    -- An element is a comma-separated list of patterns (as outbox.allowed_streams): one whose
    -- patterns are all blank selects nothing.
    IF NOT exact_streams AND EXISTS (SELECT 1 FROM unnest(streams) s
                                      WHERE NOT EXISTS (SELECT 1 FROM unnest(string_to_array(s, ',')) p
                                                         WHERE btrim(p) <> '')) THEN
        RAISE EXCEPTION 'outbox.replay: streams must list keys or patterns, none of them blank (got %)', streams
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass NULL for every stream.';
    END IF;
    -- A pattern's backslash escapes the next character; one that ends the pattern escapes nothing.
    SELECT btrim(p) INTO unfinished_pattern
      FROM unnest(streams) s, unnest(string_to_array(s, ',')) p
     WHERE NOT exact_streams AND btrim(p) ~ '(^|[^\\])(\\\\)*\\$' LIMIT 1;
    IF unfinished_pattern IS NOT NULL THEN
        RAISE EXCEPTION 'outbox.replay: the stream pattern % ends in a backslash that escapes nothing', unfinished_pattern
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Write \\ for a backslash in the key; \* and \? match a literal * and ?.';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(aggregate_types) a WHERE a IS NULL OR a = '') THEN
        RAISE EXCEPTION 'outbox.replay: aggregate_types must list aggregate types, none of them empty or NULL (got %)',
                        aggregate_types
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass NULL for every aggregate type.';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(event_ids) e WHERE e IS NULL) THEN
        RAISE EXCEPTION 'outbox.replay: event_ids must list event ids, none of them NULL (got %)', event_ids
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass NULL for every event.';
    END IF;
    IF max_rate IS NOT NULL AND max_rate < 1 THEN
        RAISE EXCEPTION 'outbox.replay: max_rate must be 1 or more events a second (got %)', max_rate
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass NULL to replay as fast as the relays go.';
    END IF;
    -- Every event published since this installation (or its upgrade to 0.3.0) is journaled; and
    -- every event enqueued since the oldest log table still holding events was opened is kept.
    SELECT i.installed_at INTO journaled_since FROM outbox.installation i;
    SELECT min(g.opened_at) INTO kept_since FROM outbox.generations g WHERE g.state <> 'empty';
    IF journaled_since IS NOT NULL AND since < journaled_since AND NOT partial THEN
        RAISE EXCEPTION 'outbox.replay: the range starts at %, before anything was recorded: this outbox_pg installation (or its upgrade to 0.3.0) began recording published events at %',
                        since, journaled_since
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = format('Replay from %s, or pass partial => true to replay what was recorded.', journaled_since);
    END IF;
    IF kept_since IS NOT NULL AND since < kept_since AND NOT partial THEN
        RAISE EXCEPTION 'outbox.replay: events enqueued from % to % are no longer retained (outbox.retention, outbox.purge)',
                        since, kept_since
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = format('Replay from %s, the oldest enqueue time retention kept, or pass partial => true to replay what is left.',
                                kept_since);
    END IF;
    -- Events enqueued at or after since were published at or after it.
    SELECT min(j.round) INTO first_round FROM outbox.journal j
     WHERE j.finished_at >= greatest(since, coalesce(published_since, since));
    SELECT max(j.round) INTO last_round FROM outbox.journal j;
    SELECT coalesce(sum(j.events), 0) INTO journaled FROM outbox.journal j
     WHERE j.round BETWEEN first_round AND last_round;
    INSERT INTO outbox.replay_requests (since, until, published_since, streams, exact_streams, aggregate_types,
                                        event_ids, to_stream, max_rate, first_round, last_round, journaled,
                                        next_round, state, finished_at)
    VALUES (since, until, published_since, streams, exact_streams AND streams IS NOT NULL, aggregate_types,
            CASE WHEN event_ids IS NOT NULL THEN (SELECT count(DISTINCT e) FROM unnest(event_ids) e) END,
            to_stream, max_rate, coalesce(first_round, 0), coalesce(last_round, -1), journaled, coalesce(first_round, 0),
            CASE WHEN first_round IS NULL THEN 'done' ELSE 'running' END,
            CASE WHEN first_round IS NULL THEN clock_timestamp() END)
    RETURNING id INTO created;
    -- The filter in a table of its own, where each round probes it (never copied into a round).
    IF event_ids IS NOT NULL AND first_round IS NOT NULL THEN
        INSERT INTO outbox.replay_event_ids (replay, event_id)
        SELECT created, e FROM unnest(event_ids) e
        ON CONFLICT DO NOTHING;
    END IF;
    PERFORM outbox._wake_for_replay();
    RETURN created;
END
$fn$;
COMMENT ON FUNCTION outbox._request_replay(timestamptz, timestamptz, text[], text[], uuid[], text, timestamptz, boolean, integer, boolean) IS
    'outbox_pg: records a replay (outbox.replay; with exact stream keys for outbox.repair_losses); internal';

-- -------------------------------------------------------------------------------------------------
-- outbox.cancel_replay(replay)
--
--     Stops a running replay after the round in flight; what it sent stays sent.
-- Returns: whether a running replay of that id was cancelled (false: it is done, cancelled
--          already, or no replay has that id)
-- Raises:  22004 for a NULL id; 22023 for an id below 1
-- Writes:  update outbox.replay_requests
-- Called by: outbox_admin
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox.cancel_replay(replay bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF replay IS NULL THEN
        RAISE EXCEPTION 'outbox.cancel_replay: replay must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the id outbox.replay returned (SELECT id FROM outbox.replays WHERE state = ''running'').';
    END IF;
    IF replay < 1 THEN
        RAISE EXCEPTION 'outbox.cancel_replay: replay ids are 1 or more (got %)', replay
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the id outbox.replay returned (SELECT id FROM outbox.replays WHERE state = ''running'').';
    END IF;
    UPDATE outbox.replay_requests r SET state = 'cancelled', finished_at = clock_timestamp()
     WHERE r.id = replay AND r.state = 'running';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    DELETE FROM outbox.replay_event_ids w WHERE w.replay = cancel_replay.replay;
    RETURN true;
END
$fn$;
COMMENT ON FUNCTION outbox.cancel_replay(bigint) IS
    'outbox_pg: stops a running replay after its round in flight; true if it was running';

-- -------------------------------------------------------------------------------------------------
-- outbox._claim_replay(relay_pid, lease_ms)
--
--     Claims the oldest running replay that no live relay holds (FOR UPDATE SKIP LOCKED, with a
--     lease, like the shards: a relay that exited loses it at once, one that hangs after lease_ms)
--     and whose throttle lets it go on, or renews this relay's claim of it.
-- Returns: the replay's row, or nothing
-- Writes:  update outbox.replay_requests (claimed_by, claimed_at)
-- Called by: a relay's replay round (src/relay/replay.rs)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._claim_replay(relay_pid integer, lease_ms integer)
RETURNS SETOF outbox.replay_requests
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
    UPDATE outbox.replay_requests r SET claimed_by = relay_pid, claimed_at = clock_timestamp()
     WHERE r.id = (SELECT q.id FROM outbox.replay_requests q
                    WHERE q.state = 'running'
                      AND (q.not_before IS NULL OR q.not_before <= clock_timestamp())
                      AND (q.claimed_by IS NULL OR q.claimed_by = relay_pid
                           OR q.claimed_at < clock_timestamp() - lease_ms * interval '1 millisecond'
                           OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_get_activity(q.claimed_by)))
                    ORDER BY q.id
                    LIMIT 1
                    FOR UPDATE SKIP LOCKED)
    RETURNING r.*;
$fn$;
COMMENT ON FUNCTION outbox._claim_replay(integer, integer) IS
    'outbox_pg: claims (or renews) a running replay for a relay, with a lease; relays only';

-- -------------------------------------------------------------------------------------------------
-- outbox._replay_walk(first_round, first_index, last_round, max_rounds, max_entries, only_streams)
--
--     The journal's rounds from first_round (from its entry first_index) up to last_round, in
--     order, at most max_rounds, each cut to at most max_entries entries: a replay round reads
--     about what it examines, not whole rounds of up to 10,000 entries. With only_streams (a
--     repair's exact keys), a round whose recorded streams are none of them comes back passed
--     over, without its entries (nor a read of them): a repair costs about what the lost stream
--     had, not the whole journal. Up to 128 rounds are passed over per round returned.
-- Returns: per round, the index of its first entry returned, those entries (none when passed
--          over), how many it holds, and whether it was passed over
-- Reads:   outbox.journal_0..2 (primary keys)
-- Called by: a relay's replay round
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._replay_walk(first_round bigint, first_index integer, last_round bigint, max_rounds integer,
                                    max_entries integer, only_streams text[] DEFAULT NULL)
RETURNS TABLE (round bigint, skip integer, event_ids uuid[], seqs bigint[], events integer, passed_over boolean)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $fn$
    SELECT w.round, w.skip,
           CASE WHEN w.wanted THEN w.event_ids[w.skip + 1 : w.skip + max_entries] ELSE '{}' END,
           CASE WHEN w.wanted THEN w.seqs[w.skip + 1 : w.skip + max_entries] ELSE '{}' END,
           w.events, NOT w.wanted
      FROM (SELECT r.*,
                   -- The rounds with entries before this one: those past max_rounds are left out.
                   coalesce(count(*) FILTER (WHERE r.wanted)
                                     OVER (ORDER BY r.round ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
                       AS wanted_before
              FROM (SELECT j.round, CASE WHEN j.round = first_round THEN greatest(first_index, 0) ELSE 0 END AS skip,
                           j.event_ids, j.seqs, j.events,
                           only_streams IS NULL OR j.streams IS NULL OR j.streams && only_streams AS wanted
                      FROM outbox.journal j
                     WHERE j.round BETWEEN first_round AND last_round
                     ORDER BY j.round
                     LIMIT CASE WHEN only_streams IS NULL THEN max_rounds ELSE max_rounds * 128 END) r) w
     WHERE w.wanted_before < max_rounds
     ORDER BY w.round;
$fn$;
COMMENT ON FUNCTION outbox._replay_walk(bigint, integer, bigint, integer, integer, text[]) IS
    'outbox_pg: a stretch of the journal, in the order its rounds were finished; relays only';

-- -------------------------------------------------------------------------------------------------
-- outbox._raw_size(value)
--
--     How many bytes a jsonb value holds uncompressed, read from its varlena or TOAST header: no
--     detoasting, so it costs the same for a 1 GB payload as for a small one (pg_column_size gives
--     the compressed size, 2 KB for 200 KB of repeated text). PostgreSQL's own byteaoctetlen, which
--     reads any varlena's header that way.
-- Called by: outbox._replay_select
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._raw_size(jsonb)
RETURNS integer
LANGUAGE internal IMMUTABLE STRICT PARALLEL SAFE
AS 'byteaoctetlen';
COMMENT ON FUNCTION outbox._raw_size(jsonb) IS
    'outbox_pg: the uncompressed size of a jsonb value, without detoasting it; internal';

-- -------------------------------------------------------------------------------------------------
-- outbox._replay_select(event_ids, since, until, aggregate_types, wanted_by)
--
--     What a replay round chooses by, without the payloads: the events of event_ids still in the
--     log (or in outbox.held), each with what its stream key is made of, about how many bytes it
--     takes on the wire (its payload and headers uncompressed, from their headers: no TOAST read), and
--     whether it matches the replay's selection. One index probe per event and table.
--     wanted_by names the replay whose event_ids filter (outbox.replay_event_ids) applies, one
--     primary-key probe per event (NULL: no such filter).
-- Reads:   outbox.events_0..2 (event_id indexes), outbox.held, outbox.replay_event_ids
-- Called by: a relay's replay round, before outbox._replay_events fetches the events it sends
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._replay_select(event_ids uuid[], since timestamptz, until timestamptz,
                                      aggregate_types text[], wanted_by bigint)
RETURNS TABLE (event_id uuid, aggregate_type text, event_type text, stream text, size bigint, matches boolean)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $fn$
    SELECT e.event_id, e.aggregate_type, e.event_type, e.stream,
           300 + octet_length(e.aggregate_type) + octet_length(e.aggregate_id) + octet_length(e.event_type)
               + outbox._raw_size(e.payload) + coalesce(outbox._raw_size(e.headers), 0) + coalesce(octet_length(e.stream), 0),
           e.created_at >= since AND (until IS NULL OR e.created_at < until)
           AND (aggregate_types IS NULL OR e.aggregate_type = ANY (aggregate_types))
           AND (wanted_by IS NULL OR EXISTS (SELECT 1 FROM outbox.replay_event_ids w
                                              WHERE w.replay = wanted_by AND w.event_id = e.event_id))
      FROM unnest(event_ids) AS x(event_id)
      CROSS JOIN LATERAL (
          SELECT l.event_id, l.aggregate_type, l.aggregate_id, l.event_type, l.payload, l.headers, l.stream, l.created_at
            FROM outbox.events_0 l WHERE l.event_id = x.event_id
          UNION ALL
          SELECT l.event_id, l.aggregate_type, l.aggregate_id, l.event_type, l.payload, l.headers, l.stream, l.created_at
            FROM outbox.events_1 l WHERE l.event_id = x.event_id
          UNION ALL
          SELECT l.event_id, l.aggregate_type, l.aggregate_id, l.event_type, l.payload, l.headers, l.stream, l.created_at
            FROM outbox.events_2 l WHERE l.event_id = x.event_id
          UNION ALL
          SELECT h.event_id, h.aggregate_type, h.aggregate_id, h.event_type, h.payload, h.headers, h.stream, h.created_at
            FROM outbox.held h WHERE h.event_id = x.event_id AND h.status = 'published'
          LIMIT 1
      ) e;
$fn$;
COMMENT ON FUNCTION outbox._replay_select(uuid[], timestamptz, timestamptz, text[], bigint) IS
    'outbox_pg: the journaled events still retained, without their payloads: stream, size, whether each matches a replay''s selection; relays only';

-- -------------------------------------------------------------------------------------------------
-- outbox._replay_events(event_ids, since, until, aggregate_types, wanted_by)
--
--     The events of event_ids still in the log (or, published from the failure path, in
--     outbox.held), each with whether it matches the replay's selection. One index probe per event
--     and table, whatever the statistics.
-- Returns: per event found: its fields in the text form entries carry, and matches
-- Reads:   outbox.events_0..2 (event_id indexes), outbox.held, outbox.replay_event_ids (wanted_by)
-- Called by: a relay's replay round
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._replay_events(event_ids uuid[], since timestamptz, until timestamptz,
                                      aggregate_types text[], wanted_by bigint)
RETURNS TABLE (event_id uuid, id bigint, aggregate_type text, aggregate_id text, event_type text,
               payload text, headers text, stream text, created_at text, matches boolean)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $fn$
    SELECT e.event_id, e.id, e.aggregate_type, e.aggregate_id, e.event_type, e.payload::text, e.headers::text,
           e.stream, to_char(e.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
           e.created_at >= since AND (until IS NULL OR e.created_at < until)
           AND (aggregate_types IS NULL OR e.aggregate_type = ANY (aggregate_types))
           AND (wanted_by IS NULL OR EXISTS (SELECT 1 FROM outbox.replay_event_ids w
                                              WHERE w.replay = wanted_by AND w.event_id = e.event_id))
      FROM unnest(event_ids) AS x(event_id)
      CROSS JOIN LATERAL (
          SELECT l.event_id, l.id, l.aggregate_type, l.aggregate_id, l.event_type, l.payload, l.headers, l.stream,
                 l.created_at
            FROM outbox.events_0 l WHERE l.event_id = x.event_id
          UNION ALL
          SELECT l.event_id, l.id, l.aggregate_type, l.aggregate_id, l.event_type, l.payload, l.headers, l.stream,
                 l.created_at
            FROM outbox.events_1 l WHERE l.event_id = x.event_id
          UNION ALL
          SELECT l.event_id, l.id, l.aggregate_type, l.aggregate_id, l.event_type, l.payload, l.headers, l.stream,
                 l.created_at
            FROM outbox.events_2 l WHERE l.event_id = x.event_id
          UNION ALL
          SELECT h.event_id, h.id, h.aggregate_type, h.aggregate_id, h.event_type, h.payload, h.headers, h.stream,
                 h.created_at
            FROM outbox.held h WHERE h.event_id = x.event_id AND h.status = 'published'
          LIMIT 1
      ) e;
$fn$;
COMMENT ON FUNCTION outbox._replay_events(uuid[], timestamptz, timestamptz, text[], bigint) IS
    'outbox_pg: the journaled events still retained, with whether each matches a replay''s selection; relays only';

-- -------------------------------------------------------------------------------------------------
-- outbox._replay_progress(replay, relay_pid, next_round, next_index, walked, replayed, filtered,
--                         missing, errors, last_error, done, not_before)
--
--     Records a replay round: the new position and counts, the throttle's next start, and done
--     when the journal is walked to its last round (or to the end of what retention left of it:
--     the entries of `journaled` the walk never reached are counted missing then); only while this
--     relay holds the replay and it runs (a cancel wins).
-- Returns: whether it was recorded
-- Writes:  update outbox.replay_requests
-- Called by: a relay's replay round, after Redis answered
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._replay_progress(replay bigint, relay_pid integer, next_round bigint, next_index integer,
                                        walked bigint, replayed bigint, filtered bigint, missing bigint,
                                        errors bigint, last_error text, done boolean, not_before timestamptz)
RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH recorded AS (
        UPDATE outbox.replay_requests r
           SET next_round = _replay_progress.next_round, next_index = _replay_progress.next_index,
               walked = CASE WHEN done THEN greatest(r.journaled, r.walked + _replay_progress.walked)
                             ELSE r.walked + _replay_progress.walked END,
               replayed = r.replayed + _replay_progress.replayed,
               filtered = r.filtered + _replay_progress.filtered,
               -- At the end of the walk, what it did not reach of what was journaled when the
               -- replay was asked for went with the journal rounds retention truncated meanwhile.
               missing = r.missing + _replay_progress.missing
                         + CASE WHEN done THEN greatest(r.journaled - r.walked - _replay_progress.walked, 0) ELSE 0 END,
               errors = r.errors + _replay_progress.errors,
               last_error = coalesce(_replay_progress.last_error, r.last_error),
               not_before = _replay_progress.not_before,
               state = CASE WHEN done THEN 'done' ELSE r.state END,
               finished_at = CASE WHEN done THEN clock_timestamp() END,
               claimed_by = CASE WHEN done THEN NULL ELSE r.claimed_by END,
               claimed_at = CASE WHEN done THEN NULL ELSE r.claimed_at END
         WHERE r.id = replay AND r.claimed_by = relay_pid AND r.state = 'running'
        RETURNING r.state
    ), forgotten AS (
        -- A replay done needs its event_ids filter no more.
        DELETE FROM outbox.replay_event_ids w
         WHERE w.replay = _replay_progress.replay AND EXISTS (SELECT 1 FROM recorded WHERE recorded.state = 'done')
    )
    SELECT EXISTS (SELECT 1 FROM recorded);
$fn$;
COMMENT ON FUNCTION outbox._replay_progress(bigint, integer, bigint, integer, bigint, bigint, bigint, bigint, bigint, text, boolean, timestamptz) IS
    'outbox_pg: records a replay round''s progress; relays only';

-- -------------------------------------------------------------------------------------------------
-- outbox._replays_running()
--
--     Whether any replay runs (or waits for its throttle).
-- Reads:   outbox.replay_requests (its partial index on running replays)
-- Called by: a relay's replay turn, and housekeeping (which then keeps the relays looking)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._replays_running()
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT EXISTS (SELECT 1 FROM outbox.replay_requests WHERE state = 'running');
$fn$;
COMMENT ON FUNCTION outbox._replays_running() IS
    'outbox_pg: whether any replay runs; relays only';

REVOKE ALL ON FUNCTION outbox.replay(timestamptz, timestamptz, text[], text[], uuid[], text, timestamptz, boolean, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox.cancel_replay(bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._claim_replay(integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._replays_running() FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._replay_walk(bigint, integer, bigint, integer, integer, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._request_replay(timestamptz, timestamptz, text[], text[], uuid[], text, timestamptz, boolean, integer, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._raw_size(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._replay_select(uuid[], timestamptz, timestamptz, text[], bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._replay_events(uuid[], timestamptz, timestamptz, text[], bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._replay_progress(bigint, integer, bigint, integer, bigint, bigint, bigint, bigint, bigint, text, boolean, timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.replay(timestamptz, timestamptz, text[], text[], uuid[], text, timestamptz, boolean, integer),
                          outbox.cancel_replay(bigint) TO outbox_admin;
GRANT SELECT ON outbox.replays TO outbox_admin, pg_monitor;
