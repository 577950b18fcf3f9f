-- outbox_pg 0.3.0 -> 0.4.0, made by `python3 scripts/sql.py write` from
-- sql/upgrade/outbox_pg--0.3.0--0.4.0.sql (what cannot be replaced in place) and the
-- functions, views, triggers, comments and grants of src/sql/ (replaced in place). Do not edit:
-- edit those files and run the script again (sql/README.md).
-- outbox_pg 0.3.0 -> 0.4.0, the part written by hand: what an upgrade cannot take from src/sql/
-- (tables, indexes, sequences and their comments and grants, data, the Rust functions'
-- declarations, and the functions and indexes it must drop). `python3 scripts/sql.py write` puts
-- every function, view, trigger, comment and grant of src/sql/ after it (at `-- @replaceable`) and
-- writes sql/outbox_pg--0.3.0--0.4.0.sql; sql/README.md has the rules.

-- tests/upgrade.rs checks that the whole script makes a schema equal to a fresh 0.4.0 install.
\echo Use "ALTER EXTENSION outbox_pg UPDATE" to load this file. \quit

-- The relays running outside the server (src/sql/schema.sql); the round's reads in SQL for them
-- (src/sql/relay/read.sql), the trace context's rules they use (src/sql/trace.sql) and
-- outbox._join_relays (src/sql/relay/outside.sql) are made below by CREATE OR REPLACE.
CREATE UNLOGGED TABLE outbox.outside_relays (
    backend_pid     integer     PRIMARY KEY,
    host            text        NOT NULL,
    version         text        NOT NULL,
    stream_template text        NOT NULL,
    entry_format    text        NOT NULL,
    joined_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
COMMENT ON TABLE outbox.outside_relays IS
    'outbox_pg: the outbox-relay processes relaying this database, one row per connection (rows of ended connections are ignored)';
GRANT SELECT ON outbox.outside_relays TO outbox_admin;

-- The transaction that recorded each snapshot: the age check's bound (src/sql/schema.sql).
ALTER TABLE outbox.snapshots ADD COLUMN recorded_by xid8;

-- -------------------------------------------------------------------------------------------------
-- Replaced in place: every function, view, trigger, comment and grant of src/sql/.
-- -------------------------------------------------------------------------------------------------
-- src/sql/schema.sql
COMMENT ON SCHEMA outbox IS 'outbox_pg: the outbox table and the relay''s functions';

CREATE OR REPLACE VIEW outbox.events AS
    SELECT 0::smallint AS generation, e.* FROM outbox.events_0 e
    UNION ALL
    SELECT 1::smallint, e.* FROM outbox.events_1 e
    UNION ALL
    SELECT 2::smallint, e.* FROM outbox.events_2 e;

COMMENT ON VIEW outbox.events IS 'outbox_pg: the event log, all three generations';

CREATE OR REPLACE FUNCTION outbox._initial_cursor() RETURNS pg_snapshot
LANGUAGE sql VOLATILE SET search_path = pg_catalog, pg_temp
AS $fn$
    -- The caller's transaction id may be assigned after its snapshot was taken (then it is not
    -- below the snapshot's xmax): the cursor's xmax is raised above it.
    WITH now_ AS (SELECT pg_current_xact_id()::text::bigint AS me, pg_current_snapshot() AS snap),
         bounds AS (SELECT me, snap, least(pg_snapshot_xmin(snap)::text::bigint, me) AS xmin,
                           greatest(pg_snapshot_xmax(snap)::text::bigint, me + 1) AS xmax FROM now_)
    SELECT (xmin::text || ':' || xmax::text || ':'
            || array_to_string(ARRAY(SELECT x FROM (SELECT pg_snapshot_xip(snap)::text::bigint AS x UNION SELECT me) ids
                                      ORDER BY x), ','))::pg_snapshot
      FROM bounds
$fn$;

COMMENT ON FUNCTION outbox._initial_cursor() IS
    'Internal: the cursor a new installation starts from: everything visible now is consumed, except the calling transaction';

REVOKE ALL ON FUNCTION outbox._initial_cursor() FROM PUBLIC;

GRANT USAGE ON SCHEMA outbox TO outbox_admin;

GRANT SELECT ON outbox.events TO outbox_admin;

-- src/sql/enqueue.sql
CREATE OR REPLACE FUNCTION @extschema@.outbox_enqueue(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL,
    stream         text  DEFAULT NULL
) RETURNS uuid
-- src/enqueue/: the argument checks, the order lock, and one insert into the log's current table
-- through plans kept for the session.
LANGUAGE c VOLATILE PARALLEL UNSAFE
-- No SET search_path clause (it would cost a GUC save and restore on every call): the direct
-- insert runs no user code, and the executor path (a table a DBA gave a trigger) pins
-- search_path = pg_catalog, pg_temp itself around the insert (src/enqueue/).
SECURITY DEFINER
AS 'MODULE_PATHNAME', 'outbox_enqueue_wrapper';

COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) IS
    'Writes one event to the outbox log in the caller''s transaction and returns its event_id; the relay publishes it to Redis after commit';

CREATE OR REPLACE FUNCTION @extschema@.outbox_enqueue(aggregate_type text, aggregate_id bigint, event_type text, payload jsonb,
                                           headers jsonb DEFAULT NULL, stream text DEFAULT NULL) RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL UNSAFE
AS $fn$ SELECT @extschema@.outbox_enqueue($1, $2::text, $3, $4, $5, $6) $fn$;

CREATE OR REPLACE FUNCTION @extschema@.outbox_enqueue(aggregate_type text, aggregate_id uuid, event_type text, payload jsonb,
                                           headers jsonb DEFAULT NULL, stream text DEFAULT NULL) RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL UNSAFE
AS $fn$ SELECT @extschema@.outbox_enqueue($1, $2::text, $3, $4, $5, $6) $fn$;

COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, bigint, text, jsonb, jsonb, text) IS
    'outbox_enqueue for a bigint aggregate id (stored as its text form)';

COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, uuid, text, jsonb, jsonb, text) IS
    'outbox_enqueue for a uuid aggregate id (stored as its text form)';

REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) FROM PUBLIC;

REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, bigint, text, jsonb, jsonb, text) FROM PUBLIC;

REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, uuid, text, jsonb, jsonb, text) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, text, text, jsonb, jsonb, text) TO outbox_writer;

GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, bigint, text, jsonb, jsonb, text) TO outbox_writer;

GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, uuid, text, jsonb, jsonb, text) TO outbox_writer;

-- src/sql/trace.sql
CREATE OR REPLACE FUNCTION outbox._debug_string(value text, shorten boolean) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$
    SELECT '"' || pg_catalog.replace(pg_catalog.replace(pg_catalog.replace(pg_catalog.replace(pg_catalog.replace(
               CASE WHEN shorten AND pg_catalog.length(value) > 60 THEN pg_catalog.left(value, 60) || '...' ELSE value END,
               pg_catalog.chr(92), pg_catalog.chr(92) || pg_catalog.chr(92)), '"', pg_catalog.chr(92) || '"'),
               pg_catalog.chr(9), pg_catalog.chr(92) || 't'), pg_catalog.chr(13), pg_catalog.chr(92) || 'r'),
               pg_catalog.chr(10), pg_catalog.chr(92) || 'n') || '"'
$fn$;

COMMENT ON FUNCTION outbox._debug_string(text, boolean) IS
    'Internal: a string as the extension''s trace-context messages quote it';

CREATE OR REPLACE FUNCTION outbox._traceparent_problem(value text) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    parts text[] := string_to_array(value, '-');
    part  text;
    names constant text[] := ARRAY['trace id', 'parent id', 'flags'];
    lens  constant integer[] := ARRAY[32, 16, 2];
BEGIN
    IF coalesce(cardinality(parts), 0) <> 4 THEN
        RETURN 'it must be four parts separated by ''-'': 00-<32 lowercase hex: trace id>-<16 lowercase hex: parent id>-<2 lowercase hex: flags>';
    END IF;
    IF parts[1] <> '00' THEN
        RETURN CASE WHEN parts[1] ~ '^[0-9a-f]{2}$' THEN format('version %s is not supported, only 00', parts[1])
                    ELSE 'the version must be 00' END;
    END IF;
    FOR i IN 1 .. 3 LOOP
        part := parts[i + 1];
        IF octet_length(part) <> lens[i] OR part !~ '^[0-9a-f]*$' THEN
            RETURN format('the %s must be %s lowercase hex digits, got %s', names[i], lens[i], outbox._debug_string(part, true));
        END IF;
        IF i < 3 AND part ~ '^0*$' THEN
            RETURN format('the %s must not be all zeros', names[i]);
        END IF;
    END LOOP;
    RETURN NULL;
END
$fn$;

COMMENT ON FUNCTION outbox._traceparent_problem(text) IS
    'Internal: why a traceparent is not valid W3C trace context, NULL when it is';

CREATE OR REPLACE FUNCTION outbox._tracestate_problem(value text) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    keys   text[] := '{}';
    member text;
    key    text;
    at     integer;
BEGIN
    IF octet_length(value) > 512 THEN
        RETURN format('it is %s bytes long, the limit is 512', octet_length(value));
    END IF;
    FOREACH member IN ARRAY string_to_array(value, ',') LOOP
        member := btrim(member, E' \t');
        CONTINUE WHEN member = '';
        at := strpos(member, '=');
        IF at = 0 THEN
            RETURN format('member %s is not key=value', outbox._debug_string(member, true));
        END IF;
        key := left(member, at - 1);
        IF NOT (key ~ '^[a-z][a-z0-9_*/-]{0,255}$'
                OR key ~ '^[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13}$') THEN
            RETURN format('key %s is not valid: lowercase letters, digits and _-*/ starting with a letter (or tenant@system)',
                          outbox._debug_string(key, true));
        END IF;
        IF substr(member, at + 1) !~ '^[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]$' THEN
            RETURN format('the value of %s is not valid: 1 to 256 printable ASCII characters but '','' and ''='', not ending in a blank',
                          outbox._debug_string(key, false));
        END IF;
        IF key = ANY (keys) THEN
            RETURN format('key %s appears more than once', outbox._debug_string(key, false));
        END IF;
        keys := keys || key;
        IF cardinality(keys) > 32 THEN
            RETURN 'it has more than 32 members';
        END IF;
    END LOOP;
    RETURN NULL;
END
$fn$;

COMMENT ON FUNCTION outbox._tracestate_problem(text) IS
    'Internal: why a tracestate is not valid W3C trace context, NULL when it is';

CREATE OR REPLACE FUNCTION outbox._traceparent(headers jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT CASE WHEN pg_catalog.jsonb_typeof(headers -> 'traceparent') = 'string'
                     AND outbox._traceparent_problem(headers ->> 'traceparent') IS NULL
                THEN headers ->> 'traceparent' END
$fn$;

COMMENT ON FUNCTION outbox._traceparent(jsonb) IS
    'Internal: the valid W3C traceparent an event''s headers carry, else NULL';

CREATE OR REPLACE FUNCTION outbox._tracestate(headers jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT CASE WHEN outbox._traceparent(headers) IS NOT NULL
                     AND pg_catalog.jsonb_typeof(headers -> 'tracestate') = 'string'
                     AND headers ->> 'tracestate' <> ''
                     AND outbox._tracestate_problem(headers ->> 'tracestate') IS NULL
                THEN headers ->> 'tracestate' END
$fn$;

COMMENT ON FUNCTION outbox._tracestate(jsonb) IS
    'Internal: the valid, non-empty W3C tracestate an event''s headers carry beside a valid traceparent, else NULL';

-- src/sql/relay/claim.sql
CREATE OR REPLACE FUNCTION outbox._claim_shards(relay_pid integer, share integer, lease_ms integer)
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

CREATE OR REPLACE FUNCTION outbox._held_shards(relay_pid integer, cursors text[])
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

-- src/sql/relay/read.sql
CREATE OR REPLACE FUNCTION outbox._event_size(aggregate_type text, aggregate_id text, event_type text, payload text,
                                   headers text, traceparent text, tracestate text, stream text)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    -- 300: the field names, ids, sequence number and timestamp (approximate_size's FIXED).
    SELECT 300::bigint + coalesce(pg_catalog.octet_length(aggregate_type), 0)
           + coalesce(pg_catalog.octet_length(aggregate_id), 0) + coalesce(pg_catalog.octet_length(event_type), 0)
           + coalesce(pg_catalog.octet_length(payload), 0) + coalesce(pg_catalog.octet_length(headers), 0)
           + coalesce(pg_catalog.octet_length(traceparent), 0) + coalesce(pg_catalog.octet_length(tracestate), 0)
           + coalesce(pg_catalog.octet_length(stream), 0)
$fn$;

COMMENT ON FUNCTION outbox._event_size(text, text, text, text, text, text, text, text) IS
    'Relay internal: about how many bytes an event takes on the wire (OutboxEvent::approximate_size), what a round''s byte allowance counts';

REVOKE ALL ON FUNCTION outbox._event_size(text, text, text, text, text, text, text, text) FROM PUBLIC;

CREATE OR REPLACE FUNCTION outbox._whole_transactions(the_shard smallint, txids bigint[], afters bigint[], max_ids bigint[])
RETURNS TABLE (txid bigint, txn_max_id bigint, id bigint, event_id uuid, aggregate_type text,
               aggregate_id text, event_type text, payload text, headers text, stream text,
               created_at timestamptz, traceparent text, tracestate text, size bigint,
               complete boolean, position_max_id bigint, position_last_id bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $fn$
BEGIN
    IF cardinality(txids) > 0 THEN
        RETURN QUERY
            SELECT x.txid, t.max_id, x.id, x.event_id, x.aggregate_type, x.aggregate_id, x.event_type,
                   x.payload, x.headers, x.stream, x.created_at, x.tp, x.ts,
                   outbox._event_size(x.aggregate_type, x.aggregate_id, x.event_type, x.payload, x.headers,
                                      x.tp, x.ts, x.stream),
                   NULL::boolean, NULL::bigint, NULL::bigint
              FROM unnest(txids, afters, max_ids) WITH ORDINALITY AS t(txid, after_id, max_id, n)
             CROSS JOIN LATERAL (
                   SELECT e.txid::text::bigint AS txid, e.id, e.event_id,
                          e.aggregate_type, e.aggregate_id, e.event_type, e.payload::text AS payload,
                          e.headers::text AS headers, e.stream,
                          e.created_at,
                          outbox._traceparent(e.headers) AS tp, outbox._tracestate(e.headers) AS ts
                     FROM outbox.events e
                    WHERE e.shard = the_shard AND e.txid = t.txid::text::xid8 AND e.id > t.after_id
                   OFFSET 0) x
             ORDER BY t.n, x.id;
    END IF;
END
$fn$;

COMMENT ON FUNCTION outbox._whole_transactions(smallint, bigint[], bigint[], bigint[]) IS
    'Relay internal: the events of the transactions outbox._read_window takes whole, in publish order';

REVOKE ALL ON FUNCTION outbox._whole_transactions(smallint, bigint[], bigint[], bigint[]) FROM PUBLIC;

CREATE OR REPLACE FUNCTION outbox._read_window(the_shard smallint, cursor text, upto text, window_max_id bigint,
                                    window_last_id bigint, max_events integer, max_bytes bigint, taken integer)
RETURNS TABLE (txid bigint, txn_max_id bigint, id bigint, event_id uuid, aggregate_type text,
               aggregate_id text, event_type text, payload text, headers text, stream text,
               created_at timestamptz, traceparent text, tracestate text, size bigint,
               complete boolean, position_max_id bigint, position_last_id bigint)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
-- Index scans of (shard, txid, id), whatever the statistics say: never a sequential scan of the log.
SET enable_seqscan = off
SET enable_bitmapscan = off
-- Its statements planned once per session: with custom plans, replanned at every call, sixteen
-- empty windows took 10 ms, against 1.2 ms (the plans are index probes whatever the values).
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_variable
DECLARE
    c          pg_snapshot := $2::pg_snapshot;
    u          pg_snapshot := $3::pg_snapshot;
    from_xmax  xid8 := pg_snapshot_xmax(c);
    upto_xmax  xid8 := pg_snapshot_xmax(u);
    -- The transactions the cursor saw running and upto sees completed.
    seen       xid8[] := ARRAY(SELECT x FROM pg_snapshot_xip(c) AS x WHERE pg_visible_in_snapshot(x, u));
    lowest     constant bigint := -9223372036854775808;
    -- The allowance left (Budget).
    left_events bigint := max_events;
    left_bytes  bigint := max_bytes;
    took        bigint := taken;
    n          bigint := 0;
    total      bigint := 0;
    fits       boolean := true;
    -- The position, as (window_max_id, window_last_id): none unless both are given.
    resumed    constant boolean := window_max_id IS NOT NULL AND window_last_id IS NOT NULL;
    start_max  bigint := CASE WHEN resumed THEN window_max_id ELSE lowest END;
    start_last bigint := CASE WHEN resumed THEN window_last_id ELSE lowest END;
    pos_max    bigint := CASE WHEN resumed THEN window_max_id END;
    pos_last   bigint := CASE WHEN resumed THEN window_last_id END;
    done       boolean := true;
    after      bigint;
    whole      boolean;
    cut        bigint;
    -- Per generation (index generation + 1): the last id a table's own read took (or `after`),
    -- whether that read stopped, and its allowance.
    last_read  bigint[];
    stopped    boolean;
    g          integer;
    g_events   bigint;
    g_bytes    bigint;
    g_took     bigint;
    one        bigint;
    p          record;
    r          record;
    -- The transactions taken whole, not yet returned: one query returns them all (a row loop in
    -- PL/pgSQL was most of a drain's cost here), before the next transaction read row by row.
    whole_ts    bigint[] := '{}';
    whole_after bigint[] := '{}';
    whole_max   bigint[] := '{}';
    t_events    bigint;
    t_bytes     bigint;
BEGIN
    IF left_events <= 0 OR left_bytes <= 0 THEN
        complete := false;
        position_max_id := pos_max;
        position_last_id := pos_last;
        RETURN NEXT;
        RETURN;
    END IF;

    -- The whole window, if it fits: it does when it has fewer than max_events events and fewer
    -- than max_bytes bytes (read_shard takes it then, in any order; whatever the order, the
    -- first event's exception never makes a window that reaches either bound fit). Counted in
    -- index order, stopping at either bound; then read again in id order.
    IF NOT resumed THEN
        -- A window with as many events as the allowance does not fit, whatever their sizes:
        -- counted from the index without reading an event (a drain's backlog never fits).
        SELECT count(*) INTO n
          FROM (SELECT 1 FROM outbox.events e
                 WHERE e.shard = the_shard AND e.txid = ANY (seen)
                UNION ALL
                SELECT 1 FROM outbox.events e
                 WHERE e.shard = the_shard AND e.txid >= from_xmax AND e.txid < upto_xmax
                   AND pg_visible_in_snapshot(e.txid, u)
                 LIMIT left_events) x;
        fits := n < left_events;
        n := 0;
    END IF;
    IF NOT resumed AND fits THEN
        FOR one IN
            SELECT outbox._event_size(e.aggregate_type, e.aggregate_id, e.event_type, e.payload::text,
                                      e.headers::text, outbox._traceparent(e.headers),
                                      outbox._tracestate(e.headers), e.stream)
              FROM outbox.events e
             WHERE e.shard = the_shard AND e.txid = ANY (seen)
            UNION ALL
            SELECT outbox._event_size(e.aggregate_type, e.aggregate_id, e.event_type, e.payload::text,
                                      e.headers::text, outbox._traceparent(e.headers),
                                      outbox._tracestate(e.headers), e.stream)
              FROM outbox.events e
             WHERE e.shard = the_shard AND e.txid >= from_xmax AND e.txid < upto_xmax
               AND pg_visible_in_snapshot(e.txid, u)
        LOOP
            n := n + 1;
            total := total + one;
            IF n >= left_events OR total >= left_bytes THEN
                fits := false;
                EXIT;
            END IF;
        END LOOP;
        IF fits THEN
            RETURN QUERY
                SELECT w.txid::text::bigint, w.id, w.id, w.event_id, w.aggregate_type, w.aggregate_id,
                       w.event_type, w.payload, w.headers_text, w.stream,
                       w.created_at,
                       w.tp, w.ts,
                       outbox._event_size(w.aggregate_type, w.aggregate_id, w.event_type, w.payload,
                                          w.headers_text, w.tp, w.ts, w.stream),
                       NULL::boolean, NULL::bigint, NULL::bigint
                  FROM (SELECT e.txid, e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type,
                               e.payload::text AS payload, e.headers::text AS headers_text, e.stream,
                               e.created_at, outbox._traceparent(e.headers) AS tp,
                               outbox._tracestate(e.headers) AS ts
                          FROM outbox.events e
                         WHERE e.shard = the_shard AND e.txid = ANY (seen)
                        UNION ALL
                        SELECT e.txid, e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type,
                               e.payload::text, e.headers::text, e.stream, e.created_at,
                               outbox._traceparent(e.headers), outbox._tracestate(e.headers)
                          FROM outbox.events e
                         WHERE e.shard = the_shard AND e.txid >= from_xmax AND e.txid < upto_xmax
                           AND pg_visible_in_snapshot(e.txid, u)
                        OFFSET 0) w
                 ORDER BY w.id;
            txid := NULL; txn_max_id := NULL; id := NULL; event_id := NULL; aggregate_type := NULL;
            aggregate_id := NULL; event_type := NULL; payload := NULL; headers := NULL; stream := NULL;
            created_at := NULL; traceparent := NULL; tracestate := NULL; size := NULL;
            complete := true;
            position_max_id := NULL;
            position_last_id := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;

    -- In parts. The window's transactions with their largest ids, per table (a transaction in
    -- two tables is "spans"), found from the index: those the cursor saw running, and those from
    -- its xmax walked one txid at a time (the next txid is one probe, however many events the
    -- previous one has).
    FOR p IN
        WITH RECURSIVE
            r0(t) AS (
                SELECT (SELECT e.txid FROM outbox.events_0 e
                         WHERE e.shard = the_shard AND e.txid >= from_xmax AND e.txid < upto_xmax
                         ORDER BY e.txid LIMIT 1)
                UNION ALL
                SELECT (SELECT e.txid FROM outbox.events_0 e
                         WHERE e.shard = the_shard AND e.txid > r0.t AND e.txid < upto_xmax
                         ORDER BY e.txid LIMIT 1)
                  FROM r0 WHERE r0.t IS NOT NULL),
            r1(t) AS (
                SELECT (SELECT e.txid FROM outbox.events_1 e
                         WHERE e.shard = the_shard AND e.txid >= from_xmax AND e.txid < upto_xmax
                         ORDER BY e.txid LIMIT 1)
                UNION ALL
                SELECT (SELECT e.txid FROM outbox.events_1 e
                         WHERE e.shard = the_shard AND e.txid > r1.t AND e.txid < upto_xmax
                         ORDER BY e.txid LIMIT 1)
                  FROM r1 WHERE r1.t IS NOT NULL),
            r2(t) AS (
                SELECT (SELECT e.txid FROM outbox.events_2 e
                         WHERE e.shard = the_shard AND e.txid >= from_xmax AND e.txid < upto_xmax
                         ORDER BY e.txid LIMIT 1)
                UNION ALL
                SELECT (SELECT e.txid FROM outbox.events_2 e
                         WHERE e.shard = the_shard AND e.txid > r2.t AND e.txid < upto_xmax
                         ORDER BY e.txid LIMIT 1)
                  FROM r2 WHERE r2.t IS NOT NULL),
            found(generation, t) AS (
                SELECT 0, r0.t FROM r0 WHERE r0.t IS NOT NULL AND pg_visible_in_snapshot(r0.t, u)
                UNION ALL
                SELECT 1, r1.t FROM r1 WHERE r1.t IS NOT NULL AND pg_visible_in_snapshot(r1.t, u)
                UNION ALL
                SELECT 2, r2.t FROM r2 WHERE r2.t IS NOT NULL AND pg_visible_in_snapshot(r2.t, u)
                UNION ALL
                SELECT gen, x FROM unnest(seen) AS x CROSS JOIN generate_series(0, 2) AS gen),
            largest(t, max_id) AS (
                SELECT f.t,
                       CASE f.generation
                           WHEN 0 THEN (SELECT e.id FROM outbox.events_0 e
                                         WHERE e.shard = the_shard AND e.txid = f.t ORDER BY e.id DESC LIMIT 1)
                           WHEN 1 THEN (SELECT e.id FROM outbox.events_1 e
                                         WHERE e.shard = the_shard AND e.txid = f.t ORDER BY e.id DESC LIMIT 1)
                           ELSE (SELECT e.id FROM outbox.events_2 e
                                  WHERE e.shard = the_shard AND e.txid = f.t ORDER BY e.id DESC LIMIT 1)
                       END
                  FROM found f)
        SELECT l.t, max(l.max_id) AS max_id, count(*) > 1 AS spans
          FROM largest l
         WHERE l.max_id IS NOT NULL
         GROUP BY l.t
        HAVING max(l.max_id) >= start_max
         ORDER BY max(l.max_id)
    LOOP
        IF left_events <= 0 OR left_bytes <= 0 THEN
            done := false;
            EXIT;
        END IF;
        after := CASE WHEN p.max_id = start_max THEN start_last ELSE lowest END;
        IF NOT p.spans THEN
            -- Taken whole if all of it fits, as the row loop below would take it: every event
            -- while the allowance lasts, the round's first whatever its size.
            SELECT count(*), coalesce(sum(outbox._event_size(e.aggregate_type, e.aggregate_id, e.event_type,
                                                            e.payload::text, e.headers::text,
                                                            outbox._traceparent(e.headers),
                                                            outbox._tracestate(e.headers), e.stream)), 0)
              INTO t_events, t_bytes
              FROM outbox.events e
             WHERE e.shard = the_shard AND e.txid = p.t AND e.id > after;
            IF t_events <= left_events AND (t_bytes <= left_bytes OR (t_events = 1 AND took = 0)) THEN
                IF t_events > 0 THEN
                    whole_ts := whole_ts || p.t::text::bigint;
                    whole_after := whole_after || after;
                    whole_max := whole_max || p.max_id;
                    left_events := left_events - t_events;
                    left_bytes := greatest(left_bytes - t_bytes, 0);
                    took := took + t_events;
                    pos_max := p.max_id;
                    pos_last := p.max_id;
                END IF;
                -- A read that ends with the allowance used up counts as stopped, even at the
                -- transaction's last event (LogTable::read checks the allowance before each row).
                IF left_events <= 0 OR left_bytes <= 0 THEN
                    done := false;
                    EXIT;
                END IF;
                CONTINUE;
            END IF;
        END IF;
        -- Those taken whole come first.
        RETURN QUERY SELECT * FROM outbox._whole_transactions(the_shard, whole_ts, whole_after, whole_max);
        whole_ts := '{}';
        whole_after := '{}';
        whole_max := '{}';
        whole := true;
        cut := NULL;
        IF p.spans THEN
            -- Each table read alone from this allowance (read_transaction): where each stops.
            last_read := ARRAY[NULL, NULL, NULL]::bigint[];
            g := -1;
            stopped := false;
            FOR r IN
                SELECT e.generation, e.id,
                       outbox._event_size(e.aggregate_type, e.aggregate_id, e.event_type, e.payload::text,
                                          e.headers::text, outbox._traceparent(e.headers),
                                          outbox._tracestate(e.headers), e.stream) AS size
                  FROM outbox.events e
                 WHERE e.shard = the_shard AND e.txid = p.t AND e.id > after
                 ORDER BY e.generation, e.id
            LOOP
                IF r.generation <> g THEN
                    IF g >= 0 AND NOT stopped AND (g_events <= 0 OR g_bytes <= 0) THEN
                        cut := least(cut, last_read[g + 1]);
                    END IF;
                    g := r.generation;
                    g_events := left_events;
                    g_bytes := left_bytes;
                    g_took := took;
                    last_read[g + 1] := after;
                    stopped := false;
                END IF;
                CONTINUE WHEN stopped;
                IF g_events <= 0 OR g_bytes <= 0 OR NOT (r.size <= g_bytes OR g_took = 0) THEN
                    stopped := true;
                    cut := least(cut, last_read[g + 1]);
                    CONTINUE;
                END IF;
                g_events := g_events - 1;
                g_bytes := greatest(g_bytes - r.size, 0);
                g_took := g_took + 1;
                last_read[g + 1] := r.id;
            END LOOP;
            IF g >= 0 AND NOT stopped AND (g_events <= 0 OR g_bytes <= 0) THEN
                cut := least(cut, last_read[g + 1]);
            END IF;
            whole := cut IS NULL;
        END IF;
        -- Row by row: a transaction the allowance cuts, or one in two log tables. A row its
        -- table's own read did not reach is not there to take.
        FOR txid, txn_max_id, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream,
            created_at, traceparent, tracestate, size IN
            SELECT x.txid, p.max_id, x.id, x.event_id, x.aggregate_type, x.aggregate_id, x.event_type, x.payload,
                   x.headers, x.stream, x.created_at, x.tp, x.ts,
                   outbox._event_size(x.aggregate_type, x.aggregate_id, x.event_type, x.payload, x.headers,
                                      x.tp, x.ts, x.stream)
              FROM (SELECT e.txid::text::bigint AS txid, e.id, e.event_id,
                           e.aggregate_type, e.aggregate_id, e.event_type, e.payload::text AS payload,
                           e.headers::text AS headers, e.stream,
                           e.created_at,
                           outbox._traceparent(e.headers) AS tp, outbox._tracestate(e.headers) AS ts
                      FROM outbox.events e
                     WHERE e.shard = the_shard AND e.txid = p.t AND e.id > after
                       AND (NOT p.spans OR e.id <= last_read[e.generation + 1])
                    OFFSET 0) x
             ORDER BY x.id
        LOOP
            IF (cut IS NOT NULL AND id > cut)
               OR left_events <= 0 OR left_bytes <= 0 OR NOT (size <= left_bytes OR took = 0) THEN
                whole := false;
                EXIT;
            END IF;
            left_events := left_events - 1;
            left_bytes := greatest(left_bytes - size, 0);
            took := took + 1;
            pos_max := p.max_id;
            pos_last := id;
            RETURN NEXT;
        END LOOP;
        -- A table's read that ends with the allowance used up counts as stopped, even at the
        -- transaction's last event (LogTable::read checks the allowance before each row).
        IF NOT p.spans AND (left_events <= 0 OR left_bytes <= 0) THEN
            whole := false;
        END IF;
        IF NOT whole THEN
            done := false;
            EXIT;
        END IF;
    END LOOP;
    RETURN QUERY SELECT * FROM outbox._whole_transactions(the_shard, whole_ts, whole_after, whole_max);
    txid := NULL; txn_max_id := NULL; id := NULL; event_id := NULL; aggregate_type := NULL;
    aggregate_id := NULL; event_type := NULL; payload := NULL; headers := NULL; stream := NULL;
    created_at := NULL; traceparent := NULL; tracestate := NULL; size := NULL;
    complete := done;
    position_max_id := CASE WHEN done THEN NULL ELSE pos_max END;
    position_last_id := CASE WHEN done THEN NULL ELSE pos_last END;
    RETURN NEXT;
END
$fn$;

COMMENT ON FUNCTION outbox._read_window(smallint, text, text, bigint, bigint, integer, bigint, integer) IS
    'Relay internal: what a round takes of one shard''s window (events in publish order, then a row with complete and the position), as the in-server relay reads it';

REVOKE ALL ON FUNCTION outbox._read_window(smallint, text, text, bigint, bigint, integer, bigint, integer) FROM PUBLIC;

CREATE OR REPLACE FUNCTION outbox._read_windows(shards smallint[], cursors text[], uptos text[], window_max_ids bigint[],
                                     window_last_ids bigint[], max_events integer, max_bytes bigint, taken integer)
RETURNS TABLE (shard smallint, txid bigint, txn_max_id bigint, id bigint, event_id uuid, aggregate_type text,
               aggregate_id text, event_type text, payload text, headers text, stream text,
               created_at timestamptz, traceparent text, tracestate text, size bigint,
               complete boolean, position_max_id bigint, position_last_id bigint)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_variable
DECLARE
    left_events integer := max_events;
    left_bytes  bigint := max_bytes;
    took        integer := taken;
    c           pg_snapshot;
    u           pg_snapshot;
BEGIN
    IF cardinality(cursors) <> cardinality(shards) OR cardinality(uptos) <> cardinality(shards)
       OR cardinality(window_max_ids) <> cardinality(shards) OR cardinality(window_last_ids) <> cardinality(shards) THEN
        RAISE EXCEPTION 'outbox._read_windows: % shards but % cursors, % uptos, % window_max_ids, % window_last_ids',
                cardinality(shards), cardinality(cursors), cardinality(uptos), cardinality(window_max_ids),
                cardinality(window_last_ids)
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass one element of each array per shard.';
    END IF;
    FOR n IN 1 .. cardinality(shards) LOOP
        shard := shards[n];
        c := cursors[n]::pg_snapshot;
        u := uptos[n]::pg_snapshot;
        IF left_events > 0 AND left_bytes > 0
           AND NOT EXISTS (SELECT 1 FROM pg_snapshot_xip(c) AS x WHERE pg_visible_in_snapshot(x, u))
           AND NOT EXISTS (SELECT 1 FROM outbox.events e
                            WHERE e.shard = shards[n] AND e.txid >= pg_snapshot_xmax(c) AND e.txid < pg_snapshot_xmax(u)) THEN
            txid := NULL; txn_max_id := NULL; id := NULL; event_id := NULL; aggregate_type := NULL;
            aggregate_id := NULL; event_type := NULL; payload := NULL; headers := NULL; stream := NULL;
            created_at := NULL; traceparent := NULL; tracestate := NULL; size := NULL;
            complete := true; position_max_id := NULL; position_last_id := NULL;
            RETURN NEXT;
            CONTINUE;
        END IF;
        -- Into the output columns as they come.
        FOR txid, txn_max_id, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream,
            created_at, traceparent, tracestate, size, complete, position_max_id, position_last_id IN
            SELECT * FROM outbox._read_window(shards[n], cursors[n], uptos[n], window_max_ids[n],
                                              window_last_ids[n], left_events, left_bytes, took) LOOP
            IF complete IS NULL THEN
                left_events := left_events - 1;
                left_bytes := greatest(left_bytes - size, 0);
                took := took + 1;
            END IF;
            RETURN NEXT;
        END LOOP;
    END LOOP;
END
$fn$;

COMMENT ON FUNCTION outbox._read_windows(smallint[], text[], text[], bigint[], bigint[], integer, bigint, integer) IS
    'Relay internal: outbox._read_window for several shards in one statement, each with the allowance the ones before it left';

REVOKE ALL ON FUNCTION outbox._read_windows(smallint[], text[], text[], bigint[], bigint[], integer, bigint, integer) FROM PUBLIC;

CREATE OR REPLACE FUNCTION outbox._last_seqs(aggregate_types text[], aggregate_ids text[])
RETURNS bigint[]
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $fn$
    SELECT coalesce(ARRAY(
               SELECT (SELECT a.last_seq FROM outbox.aggregates a
                        WHERE a.aggregate_type = k.aggregate_type COLLATE "C"
                          AND a.aggregate_id = k.aggregate_id COLLATE "C")
                 FROM unnest(aggregate_types, aggregate_ids) WITH ORDINALITY AS k(aggregate_type, aggregate_id, n)
                ORDER BY k.n), '{}')
$fn$;

COMMENT ON FUNCTION outbox._last_seqs(text[], text[]) IS
    'Relay internal: the last aggregate_seq of each of these aggregates (NULL without a counter), one primary-key probe each';

REVOKE ALL ON FUNCTION outbox._last_seqs(text[], text[]) FROM PUBLIC;

-- src/sql/relay/outside.sql
CREATE OR REPLACE FUNCTION outbox._join_relays(relay_pid integer, host text, version text, stream_template text,
                                    entry_format text)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    other record;
    in_server_template text := pg_catalog.current_setting('outbox.stream', true);
    in_server_format text := coalesce(pg_catalog.current_setting('outbox.entry_format', true), 'native');
BEGIN
    LOCK TABLE outbox.outside_relays IN SHARE ROW EXCLUSIVE MODE;
    DELETE FROM outbox.outside_relays r
     WHERE r.backend_pid = relay_pid
        OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_get_activity(r.backend_pid));
    SELECT r.* INTO other FROM outbox.outside_relays r
     WHERE r.stream_template IS DISTINCT FROM $4 OR r.entry_format IS DISTINCT FROM $5
     ORDER BY r.joined_at LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox-relay: this relay writes to streams "%" as % entries, but the outbox-relay of backend % on %, relaying this database since %, writes to "%" as % entries',
                        $4, $5, other.backend_pid, other.host, other.joined_at, other.stream_template, other.entry_format
              USING ERRCODE = 'object_not_in_prerequisite_state',
                    HINT = 'Give every relay of a database the same stream template (outbox.stream, --stream) and entry format, or stop the other relay first.';
    END IF;
    IF in_server_template IS NOT NULL
       AND (in_server_template IS DISTINCT FROM $4 OR in_server_format IS DISTINCT FROM $5)
       AND EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity a
                    WHERE a.datname = pg_catalog.current_database() AND a.backend_type = 'outbox_pg relay') THEN
        RAISE EXCEPTION 'outbox-relay: this relay writes to streams "%" as % entries, but this server''s outbox_pg relays write to "%" as % entries',
                        $4, $5, in_server_template, in_server_format
              USING ERRCODE = 'object_not_in_prerequisite_state',
                    HINT = 'Give outbox-relay the server''s outbox.stream and outbox.entry_format, or stop the server''s relays first (outbox.enabled = off).';
    END IF;
    INSERT INTO outbox.outside_relays (backend_pid, host, version, stream_template, entry_format)
    VALUES (relay_pid, $2, $3, $4, $5);
END
$fn$;

COMMENT ON FUNCTION outbox._join_relays(integer, text, text, text, text) IS
    'Relay internal: records an outbox-relay connection, refusing one whose stream template or entry format differs from a running relay''s';

REVOKE ALL ON FUNCTION outbox._join_relays(integer, text, text, text, text) FROM PUBLIC;

-- src/sql/relay/failure_path.sql
CREATE OR REPLACE FUNCTION outbox._held_aggregates(aggregate_types text[], aggregate_ids text[], shards smallint[])
RETURNS SETOF bigint
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM outbox.held h WHERE h.shard = ANY (shards) AND h.status IN ('waiting', 'failed')) THEN
        RETURN;
    END IF;
    -- One index probe per aggregate, whatever the statistics: the LIMIT keeps the subquery from
    -- being flattened into a join whose order the planner would choose (a generic plan made while
    -- the failure path was empty could scan it once per aggregate).
    RETURN QUERY
        SELECT a.position
          FROM unnest(aggregate_types, aggregate_ids) WITH ORDINALITY AS a(aggregate_type, aggregate_id, position)
         CROSS JOIN LATERAL (SELECT 1 FROM outbox.held h
                              WHERE h.shard = ANY (shards)
                                AND h.aggregate_type = a.aggregate_type COLLATE "C" AND h.aggregate_id = a.aggregate_id COLLATE "C"
                                AND h.status IN ('waiting', 'failed')
                              LIMIT 1) w;
END
$fn$;

COMMENT ON FUNCTION outbox._held_aggregates(text[], text[], smallint[]) IS
    'Relay internal: which of these aggregates (1-based positions) have events on the failure path, so that their new events wait behind them';

CREATE OR REPLACE FUNCTION outbox._held_due(shards smallint[], max_events integer, in_order boolean DEFAULT true)
RETURNS TABLE (
    id             bigint,
    event_id       text,
    aggregate_type text,
    aggregate_id   text,
    aggregate_seq  bigint,
    event_type     text,
    payload        text,
    headers        text,
    stream         text,
    created_at     text
)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        WITH undelivered AS MATERIALIZED (
            SELECT h.*,
                   bool_or(h.status = 'failed' OR coalesce(h.available_at > clock_timestamp(), false))
                       OVER (PARTITION BY h.aggregate_type, h.aggregate_id ORDER BY h.aggregate_seq
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS blocked
              FROM outbox.held h
             WHERE h.shard = ANY (shards) AND h.status IN ('waiting', 'failed')
        )
        SELECT u.id, u.event_id::text, u.aggregate_type, u.aggregate_id, u.aggregate_seq, u.event_type,
               u.payload::text, u.headers::text, u.stream,
               to_char(u.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
          FROM undelivered u
         WHERE u.status = 'waiting'
           AND (CASE WHEN in_order THEN NOT u.blocked ELSE (u.available_at IS NULL OR u.available_at <= clock_timestamp()) END)
         ORDER BY u.id
         LIMIT max_events;
END
$fn$;

COMMENT ON FUNCTION outbox._held_due(smallint[], integer, boolean) IS
    'Relay internal: the failure path''s events due now in these shards, each aggregate''s up to its first one backing off or failed (in_order)';

CREATE OR REPLACE FUNCTION outbox._hold(event_ids uuid[], seqs bigint[], errors text[], max_attempts integer, retry_delay_ms integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
DECLARE
    failed bigint;
BEGIN
    WITH held AS (
        INSERT INTO outbox.held AS h (id, event_id, shard, aggregate_type, aggregate_id, aggregate_seq, event_type,
                                      payload, headers, stream, created_at, status, attempts, rejections,
                                      available_at, failed_at, last_error)
        SELECT e.id, e.event_id, e.shard, e.aggregate_type, e.aggregate_id, x.seq, e.event_type, e.payload,
               e.headers, e.stream, e.created_at,
               CASE WHEN x.error IS NOT NULL AND max_attempts <= 1 THEN 'failed' ELSE 'waiting' END,
               (x.error IS NOT NULL)::integer,
               (x.error IS NOT NULL)::integer,
               CASE WHEN x.error IS NOT NULL THEN clock_timestamp() + retry_delay_ms * interval '1 millisecond' END,
               CASE WHEN x.error IS NOT NULL AND max_attempts <= 1 THEN clock_timestamp() END,
               x.error
          FROM unnest(event_ids, seqs, errors) AS x(event_id, seq, error)
         CROSS JOIN LATERAL (SELECT * FROM outbox.events v WHERE v.event_id = x.event_id LIMIT 1) e
        ON CONFLICT (id) DO NOTHING
        RETURNING h.status
    )
    SELECT count(*) FILTER (WHERE status = 'failed') INTO failed FROM held;
    RETURN failed;
END
$fn$;

COMMENT ON FUNCTION outbox._hold(uuid[], bigint[], text[], integer, integer) IS
    'Relay internal: moves events Redis rejected, and the events of their aggregates behind them, from the log to the failure path; returns how many failed';

CREATE OR REPLACE FUNCTION outbox._settle_held(published_ids bigint[], rejected_ids bigint[], errors text[],
                                    max_attempts integer, retry_delay_ms integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
DECLARE
    failed bigint;
BEGIN
    UPDATE outbox.held h
       SET status = 'published', published_at = clock_timestamp(), last_error = NULL, available_at = NULL,
           attempts = h.attempts + (h.attempts < 2147483647)::integer
     WHERE h.id = ANY (published_ids) AND h.status = 'waiting';
    WITH rejected AS (
        UPDATE outbox.held h
           SET rejections = h.rejections + (h.rejections < 2147483647)::integer,
               attempts = h.attempts + (h.attempts < 2147483647)::integer,
               -- Looked up per row (at most outbox.batch_size of them) rather than joined: the
               -- rows are found through the primary key whatever the statistics say.
               last_error = (SELECT x.error FROM unnest(rejected_ids, errors) AS x(id, error) WHERE x.id = h.id LIMIT 1),
               status = CASE WHEN h.rejections::bigint + 1 >= max_attempts THEN 'failed' ELSE 'waiting' END,
               failed_at = CASE WHEN h.rejections::bigint + 1 >= max_attempts THEN clock_timestamp() END,
               available_at = clock_timestamp()
                              + least(retry_delay_ms * power(2, least(h.rejections, 20)), 300000) * interval '1 millisecond'
         WHERE h.id = ANY (rejected_ids) AND h.status = 'waiting'
        RETURNING h.status
    )
    SELECT count(*) FILTER (WHERE status = 'failed') INTO failed FROM rejected;
    RETURN failed;
END
$fn$;

COMMENT ON FUNCTION outbox._settle_held(bigint[], bigint[], text[], integer, integer) IS
    'Relay internal: marks the failure path''s events Redis accepted published, and backs off or fails those it rejected again; returns how many failed';

REVOKE ALL ON FUNCTION outbox._held_aggregates(text[], text[], smallint[]) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox._held_due(smallint[], integer, boolean) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox._hold(uuid[], bigint[], text[], integer, integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox._settle_held(bigint[], bigint[], text[], integer, integer) FROM PUBLIC;

-- src/sql/relay/finish.sql
CREATE OR REPLACE FUNCTION outbox._advance(relay_pid integer, shards smallint[], cursors text[],
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

-- src/sql/relay/housekeeping.sql
CREATE OR REPLACE FUNCTION outbox._reap_shards(lease_ms integer)
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

CREATE OR REPLACE FUNCTION outbox._record_snapshot(record boolean)
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

CREATE OR REPLACE FUNCTION outbox._retention(keep interval, purge_older_than interval DEFAULT NULL)
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

-- src/sql/restore.sql
CREATE OR REPLACE FUNCTION outbox._rebase()
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

CREATE OR REPLACE FUNCTION outbox._catch_restored_row()
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

CREATE OR REPLACE FUNCTION outbox._rebase_after_restore()
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

CREATE OR REPLACE TRIGGER catch_restored_shard BEFORE INSERT ON outbox.shards
    FOR EACH ROW EXECUTE FUNCTION outbox._catch_restored_row();

CREATE OR REPLACE TRIGGER catch_restored_generation BEFORE INSERT ON outbox.generations
    FOR EACH ROW EXECUTE FUNCTION outbox._catch_restored_row();

CREATE OR REPLACE TRIGGER rebase_restored_shards AFTER INSERT ON outbox.shards
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._rebase_after_restore();

CREATE OR REPLACE TRIGGER rebase_restored_generations AFTER INSERT ON outbox.generations
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

-- src/sql/dedup.sql
CREATE OR REPLACE FUNCTION @extschema@.outbox_mark_processed(consumer text, event_id uuid)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    first_time boolean;
    caller     regrole;
    owner_role regrole;
BEGIN
    IF outbox_mark_processed.consumer IS NULL OR outbox_mark_processed.consumer = '' THEN
        RAISE EXCEPTION 'outbox_mark_processed: consumer must be a non-empty name, got %',
                coalesce(quote_literal(outbox_mark_processed.consumer), 'NULL')
            USING ERRCODE = CASE WHEN outbox_mark_processed.consumer IS NULL THEN 'null_value_not_allowed'
                                 ELSE 'invalid_parameter_value' END,
                  HINT = 'Name the consuming service, e.g. ''notifications''; each consumer deduplicates on its own.';
    END IF;
    IF octet_length(outbox_mark_processed.consumer) > 255 THEN
        RAISE EXCEPTION 'outbox_mark_processed: consumer name is % bytes long (starts with %), the limit is 255 bytes',
                octet_length(outbox_mark_processed.consumer), quote_literal(left(outbox_mark_processed.consumer, 40))
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Name the consuming service with at most 255 bytes, like aggregate and event types, e.g. ''notifications''.';
    END IF;
    IF outbox_mark_processed.event_id IS NULL THEN
        RAISE EXCEPTION 'outbox_mark_processed: event_id must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'Pass the entry''s event_id field, e.g. outbox_mark_processed(''notifications'', ''…''::uuid).';
    END IF;
    -- A consumer name belongs to the role that used it first: another consumer marking events
    -- under it would make this one skip them. current_user is the owner here (SECURITY DEFINER),
    -- so the caller's role comes from _calling_role (the role in effect outside this function).
    caller := outbox._calling_role();
    SELECT c.owner INTO owner_role FROM outbox.consumers c WHERE c.consumer = outbox_mark_processed.consumer;
    IF NOT FOUND THEN
        INSERT INTO outbox.consumers AS c (consumer, owner)
        VALUES (outbox_mark_processed.consumer, caller)
        ON CONFLICT ON CONSTRAINT consumers_pkey DO NOTHING;
        SELECT c.owner INTO owner_role FROM outbox.consumers c WHERE c.consumer = outbox_mark_processed.consumer;
    END IF;
    IF NOT pg_catalog.pg_has_role(caller::oid, owner_role::oid, 'MEMBER') THEN
        RAISE EXCEPTION 'outbox_mark_processed: consumer name % belongs to role %, not to %',
                quote_literal(outbox_mark_processed.consumer), owner_role, caller
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Use a consumer name of your own, or have an outbox_admin release this one (DELETE FROM outbox.consumers WHERE consumer = ...) or grant you its owner role.';
    END IF;
    INSERT INTO outbox.processed_messages AS p (consumer, event_id)
    VALUES (outbox_mark_processed.consumer, outbox_mark_processed.event_id)
    ON CONFLICT ON CONSTRAINT processed_messages_pkey DO NOTHING
    RETURNING true INTO first_time;
    RETURN coalesce(first_time, false);
END
$fn$;

COMMENT ON FUNCTION @extschema@.outbox_mark_processed(text, uuid) IS
    'Consumer-side dedup: records that consumer processed event_id; true the first time, false on a repeat';

CREATE OR REPLACE FUNCTION outbox.purge_processed(older_than interval)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    purged bigint;
BEGIN
    IF older_than IS NULL OR older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox.purge_processed: older_than must be a non-negative interval, got %', coalesce(older_than::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass a window longer than redeliveries can take, e.g. ''7 days''.';
    END IF;
    DELETE FROM outbox.processed_messages p WHERE p.processed_at <= now() - older_than;
    GET DIAGNOSTICS purged = ROW_COUNT;
    RETURN purged;
END
$fn$;

COMMENT ON FUNCTION outbox.purge_processed(interval) IS
    'Deletes consumer dedup marks older than older_than; returns how many';

REVOKE ALL ON FUNCTION @extschema@.outbox_mark_processed(text, uuid) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION @extschema@.outbox_mark_processed(text, uuid) TO outbox_consumer;

REVOKE ALL ON FUNCTION outbox.purge_processed(interval) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION outbox.purge_processed(interval) TO outbox_admin;

-- src/sql/copies.sql
CREATE OR REPLACE FUNCTION outbox._database_created_by()
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

CREATE OR REPLACE FUNCTION outbox.adopt_copy(publish_copied_events boolean DEFAULT false)
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

-- src/sql/operations.sql
CREATE OR REPLACE VIEW outbox.messages AS
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

CREATE OR REPLACE FUNCTION outbox._check_event_ids(caller text, ids bigint[], hint text)
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

CREATE OR REPLACE FUNCTION outbox.retry_failed(ids bigint[] DEFAULT NULL)
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

CREATE OR REPLACE FUNCTION outbox.skip_failed(ids bigint[])
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

CREATE OR REPLACE FUNCTION outbox.forget_aggregates()
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

CREATE OR REPLACE FUNCTION outbox.purge(older_than interval)
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

-- src/sql/journal.sql
CREATE OR REPLACE VIEW outbox.journal AS
SELECT 0::smallint AS generation, j.* FROM outbox.journal_0 j
UNION ALL
SELECT 1::smallint, j.* FROM outbox.journal_1 j
UNION ALL
SELECT 2::smallint, j.* FROM outbox.journal_2 j;

COMMENT ON VIEW outbox.journal IS
    'outbox_pg: every round that published events: when, which event_ids in which order, with which aggregate_seq';

GRANT SELECT ON outbox.journal TO outbox_admin;

-- src/sql/replay.sql
CREATE OR REPLACE VIEW outbox.replays AS
SELECT r.id, r.state, r.requested_at, r.requested_by, r.since, r.until, r.published_since, r.streams,
       r.aggregate_types, r.event_ids, r.to_stream, r.max_rate,
       r.replayed, greatest(r.journaled - r.walked, 0) AS remaining, r.filtered, r.missing, r.errors,
       r.last_error, r.finished_at
  FROM outbox.replay_requests r;

COMMENT ON VIEW outbox.replays IS
    'outbox_pg: each replay: its selection, state (running, done, cancelled), events replayed, journal entries still to walk (remaining), left out by the filters, no longer retained (missing), refused by Redis (errors)';

CREATE OR REPLACE FUNCTION outbox.replay(since timestamptz, until timestamptz DEFAULT NULL, streams text[] DEFAULT NULL,
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

CREATE OR REPLACE FUNCTION outbox._request_replay(since timestamptz, until timestamptz, streams text[], aggregate_types text[],
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

CREATE OR REPLACE FUNCTION outbox.cancel_replay(replay bigint)
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

CREATE OR REPLACE FUNCTION outbox._claim_replay(relay_pid integer, lease_ms integer)
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

CREATE OR REPLACE FUNCTION outbox._replay_walk(first_round bigint, first_index integer, last_round bigint, max_rounds integer,
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

CREATE OR REPLACE FUNCTION outbox._raw_size(jsonb)
RETURNS integer
LANGUAGE internal IMMUTABLE STRICT PARALLEL SAFE
AS 'byteaoctetlen';

COMMENT ON FUNCTION outbox._raw_size(jsonb) IS
    'outbox_pg: the uncompressed size of a jsonb value, without detoasting it; internal';

CREATE OR REPLACE FUNCTION outbox._replay_select(event_ids uuid[], since timestamptz, until timestamptz,
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

CREATE OR REPLACE FUNCTION outbox._replay_events(event_ids uuid[], since timestamptz, until timestamptz,
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

CREATE OR REPLACE FUNCTION outbox._replay_progress(replay bigint, relay_pid integer, next_round bigint, next_index integer,
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

CREATE OR REPLACE FUNCTION outbox._replays_running()
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

-- src/sql/losses.sql
CREATE OR REPLACE FUNCTION outbox._store_marks(target text, streams text[], last_ms bigint[], last_seqs bigint[],
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

CREATE OR REPLACE FUNCTION outbox.repair_losses(losses bigint[] DEFAULT NULL)
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

CREATE OR REPLACE FUNCTION outbox._report_losses(streams text[], expected_ids text[], expected_at timestamptz[], found_ids text[])
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

CREATE OR REPLACE FUNCTION outbox._forget_marks(target text, streams text[], last_ms bigint[], last_seqs bigint[])
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

CREATE OR REPLACE FUNCTION outbox._prune_marks(target text, kept bigint, retention_s integer)
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

CREATE OR REPLACE FUNCTION outbox._repairs_running()
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT EXISTS (SELECT 1 FROM outbox.redis_losses l JOIN outbox.replay_requests r ON r.id = l.replay_id
                    WHERE r.state = 'running');
$fn$;

COMMENT ON FUNCTION outbox._repairs_running() IS
    'outbox_pg: whether a replay that repairs a Redis loss still runs; relays only';

CREATE OR REPLACE FUNCTION outbox._stored_marks(target text, most bigint)
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

CREATE OR REPLACE FUNCTION outbox._unrepaired_losses(replay bigint)
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

-- src/sql/health.sql
CREATE OR REPLACE FUNCTION outbox._log_pending(count_events boolean)
RETURNS TABLE (events bigint, oldest timestamptz)
LANGUAGE c STRICT VOLATILE
AS 'MODULE_PATHNAME', 'log_pending_sql_wrapper';

COMMENT ON FUNCTION outbox._log_pending(boolean) IS
    'Internal: the log''s undelivered events (counted when count_events) and when the oldest was enqueued, from the log''s indexes';

CREATE OR REPLACE FUNCTION outbox._health(count_events boolean DEFAULT true)
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

CREATE OR REPLACE FUNCTION outbox.oldest_pending_age()
RETURNS interval
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT clock_timestamp() - h.oldest FROM outbox._health(false) h
$fn$;

COMMENT ON FUNCTION outbox.oldest_pending_age() IS
    'Age of the oldest undelivered event (pending or in flight), NULL when none: the outbox health signal';

CREATE OR REPLACE VIEW outbox.stats AS
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

REVOKE ALL ON FUNCTION outbox._health(boolean) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox._log_pending(boolean) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION outbox._health(boolean) TO outbox_admin, pg_monitor;

GRANT SELECT ON outbox.stats TO outbox_admin, pg_monitor;

GRANT USAGE ON SCHEMA outbox TO pg_monitor;

-- src/sql/api.sql
COMMENT ON FUNCTION outbox.relay_pid() IS
    'Process id of a relay serving this database, NULL when none runs';

COMMENT ON FUNCTION outbox.redis_connected() IS
    'Whether the relays'' last contact with Redis succeeded';

COMMENT ON FUNCTION outbox.relays() IS
    'One row per running relay of this database: slot, pid, the events it is publishing and since when, and whether that round is older than outbox.lease (a hung relay)';

COMMENT ON FUNCTION outbox.relay_status() IS
    'The relays'' state as outbox.stats shows it: pid, how many run, Redis health, latest error, events in flight and published since the server started';

COMMENT ON FUNCTION outbox._next_xid() IS
    'Internal: the next transaction id to be assigned, above every transaction that has one; retention''s bound on the writers of a switched table';

COMMENT ON FUNCTION outbox._enqueue_in_progress(text, text) IS
    'Internal: whether a transaction holds this aggregate''s order lock, i.e. is enqueuing for it right now (outbox.forget_aggregates)';

COMMENT ON FUNCTION outbox._exclude_transactions_past_the_cap() IS
    'Internal: keeps transactions past the order-lock cap out until this transaction ends; false, without waiting, while one runs (outbox.forget_aggregates)';

COMMENT ON FUNCTION outbox._calling_role() IS
    'Internal: the role the caller acts as outside any SECURITY DEFINER function (outbox_mark_processed)';

COMMENT ON FUNCTION outbox._check_allowed_stream(text) IS
    'Internal: refuses a stream outbox.allowed_streams does not allow (outbox.replay''s to_stream)';

COMMENT ON FUNCTION outbox._rescan_at_commit() IS
    'Internal: asks the launcher, when the calling transaction commits, to look again at the databases it relays none of (outbox.adopt_copy: the copy gets relays)';

COMMENT ON FUNCTION outbox._wake_for_replay() IS
    'Internal: sends the relays to look for replays when the calling transaction commits (outbox.replay)';

REVOKE ALL ON FUNCTION outbox._check_allowed_stream(text) FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox._wake_for_replay() FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox._rescan_at_commit() FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox._next_xid() FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox._exclude_transactions_past_the_cap() FROM PUBLIC;

REVOKE ALL ON FUNCTION outbox._enqueue_in_progress(text, text) FROM PUBLIC;
