-- What a round reads from the log and the counters, in SQL: for the relay outside the server
-- (outbox-relay; docs/outside-relay.md, "One round, two relays"), which cannot run the background
-- worker's Rust index walks (src/log/window.rs's read_shard, src/log/counters.rs's last_seqs) and
-- must read exactly what they read. tests/relay_sql.rs reads the same logs both ways.
-- Like every function under src/sql/relay/: PL/pgSQL or SQL, search_path pinned, EXECUTE revoked
-- from PUBLIC (the relays connect as a role that owns the schema or as a superuser).

-- -------------------------------------------------------------------------------------------------
-- outbox._event_size(aggregate_type, aggregate_id, event_type, payload, headers, traceparent,
--                    tracestate, stream)
--
--     About how many bytes the event takes on the wire to Redis, what a round's byte allowance
--     counts: outbox_sink's OutboxEvent::approximate_size (sink/src/entry.rs), byte for byte, from
--     the text the relay sends (payload and headers as jsonb::text, the trace context as
--     outbox._traceparent and outbox._tracestate find it). A NULL counts as empty.
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._event_size(aggregate_type text, aggregate_id text, event_type text, payload text,
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

-- -------------------------------------------------------------------------------------------------
-- outbox._whole_transactions(the_shard, txids, afters, max_ids)
--
--     The events of transactions that outbox._read_window takes whole, as it returns them: those
--     of transaction txids[n] in the shard with an id above afters[n], each with max_ids[n] (the
--     transaction's largest id in the shard) as txn_max_id, transaction by transaction in the order
--     given, each in id order. One query for all of them: a row loop in PL/pgSQL cost a drain
--     about three times what the rows themselves cost to read.
-- Returns: _read_window's columns, complete and the position NULL
-- Called by: outbox._read_window
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._whole_transactions(the_shard smallint, txids bigint[], afters bigint[], max_ids bigint[])
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

-- -------------------------------------------------------------------------------------------------
-- outbox._read_window(the_shard, cursor, upto, window_max_id, window_last_id, max_events,
--                     max_bytes, taken)
--
--     What a round takes of one shard's window, the transactions visible in upto and not in
--     cursor, exactly as src/log/window.rs's read_shard takes it (same events, order, txn_max_id,
--     completeness and position; the batch rule is explained there):
--     - nothing of the window published yet (window_max_id NULL) and the whole window fits in the
--       allowance: all of it, in id order, txn_max_id = id;
--     - else transaction by transaction in the order of each transaction's largest id in the
--       shard, from the position (the transaction whose largest id is window_max_id, after
--       window_last_id), each transaction's events in id order, while the allowance lasts: a
--       round's first event goes whatever its size (taken = 0), every other one only if its size
--       fits in what is left of max_bytes; a transaction that the allowance cuts is read on by the
--       next round. A transaction written into two log tables (a generation switched while it
--       ran) is read from each table with the allowance, then in id order up to the first
--       table's cut (read_transaction's `cut`).
--     The whole-window read stops as soon as the window is known not to fit (max_events events
--     or max_bytes bytes reached); the read in parts lists the window's transactions with two
--     index probes each (the first txid above the last one, its largest id), then reads only the
--     transactions it takes. Everything through the log tables' (shard, txid, id) indexes. Unlike
--     the Rust walk, which skips a running transaction's index entries in one probe, a scan here
--     steps over the entries of a transaction still running now (they are not visible to it).
--
-- Parameters:
--     the_shard                      0..15
--     cursor, upto                   the window, pg_snapshot in its text form (what
--                                    _claim_shards and _held_shards return)
--     window_max_id, window_last_id  the position reached in a window published in parts, both
--                                    NULL when nothing of this window was published yet
--     max_events, max_bytes, taken   the round's allowance left (Budget in src/log/batch.rs:
--                                    events, bytes) and the events the round took so far, of
--                                    other shards (the first event of a round goes whatever its
--                                    size). The caller charges its allowance for what is
--                                    returned: one event and outbox._event_size bytes each.
-- Returns, in this order (SELECT * FROM the function keeps it):
--     one row per event taken, in publish order:
--         txid (xid8 as bigint), txn_max_id (the transaction's largest id in the shard in a read
--         in parts, the event's own id in a whole-window read), id, event_id (uuid), aggregate_type,
--         aggregate_id, event_type, payload (jsonb::text), headers (jsonb::text or NULL),
--         stream, created_at (timestamptz: the relay writes it as RFC 3339, round/src/time.rs;
--         as text here it cost a drain a microsecond an event, to_char's), traceparent and
--         tracestate (as outbox_sink's TraceContext::from_headers
--         finds them in the headers, else NULL), size (outbox._event_size);
--         complete, position_max_id, position_last_id NULL;
--     then one last row, every event column NULL, with:
--         complete                            whether these events finish the window: the
--                                             shard's cursor may move to upto
--         position_max_id, position_last_id   where the window stands after them when they do
--                                             not finish it (the position given when nothing was
--                                             taken), NULL when complete
-- Reads:   outbox.events_0..2 through their (shard, txid, id) indexes
-- Called by: the outside relay's round (outbox-relay); tests/relay_sql.rs
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._read_window(the_shard smallint, cursor text, upto text, window_max_id bigint,
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

-- -------------------------------------------------------------------------------------------------
-- outbox._read_windows(shards, cursors, uptos, window_max_ids, window_last_ids, max_events,
--                      max_bytes, taken)
--
--     A round's reads of several shards' windows in one statement: outbox._read_window for each
--     shard in the order given, each with the allowance the shards before it left, charged as the
--     caller charges it (one event and `size` bytes per event, the bytes never below 0). A shard
--     reached with the allowance spent reads nothing (its last row: not complete, the position
--     given). One statement rather than one per shard: the outside relay's round trips were most
--     of a small round's time (docs/outside-relay.md, "One round, two relays"). A window with no
--     event at all (no index entry in its txid range, no transaction the cursor saw running and
--     upto sees completed) gets _read_window's answer for it, complete, without its reads: most
--     of a live round's shards have nothing, and one probe each is a tenth of a read's cost.
--
-- Parameters:
--     shards, cursors, uptos, window_max_ids, window_last_ids
--                                    element n: shard n's arguments of outbox._read_window
--     max_events, max_bytes, taken   the round's allowance, as for outbox._read_window
-- Returns, shard by shard in the order given: the shard, then the columns of
--     outbox._read_window: its events, then its last row (complete NOT NULL)
-- Called by: the outside relay's round (outbox-relay); tests/relay_sql.rs
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._read_windows(shards smallint[], cursors text[], uptos text[], window_max_ids bigint[],
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

-- -------------------------------------------------------------------------------------------------
-- outbox._last_seqs(aggregate_types, aggregate_ids)
--
--     The last aggregate_seq of each of these aggregates, NULL for one without a counter (the
--     finish then inserts one): src/log/counters.rs's last_seqs. One primary-key probe per
--     aggregate whatever the statistics: a scalar subquery per element, which the planner cannot
--     turn into a join (a join planned while outbox.aggregates was empty hashed or looped over
--     every counter: src/log/counters.rs), with sequential scans off.
--
-- Parameters:
--     aggregate_types, aggregate_ids  the aggregates, aggregate_types[n] with aggregate_ids[n]
-- Returns:
--     an array as long as the arguments: element n is aggregate n's last_seq or NULL
-- Reads:   outbox.aggregates through aggregates_pkey
-- Called by: the outside relay's round (outbox-relay); tests/relay_sql.rs
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._last_seqs(aggregate_types text[], aggregate_ids text[])
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
