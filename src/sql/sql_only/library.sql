-- The SQL-only install (docs/sql-only.md, scripts/sql.py sql-only): the functions the library
-- provides (src/api.rs, src/log/pending.rs), written in SQL and PL/pgSQL, with the signatures the
-- extension declares, so that the rest of src/sql/ runs unchanged on top of them. Used only by the
-- SQL-only install; the extension keeps its Rust ones. Their comments and grants are health.sql's,
-- as for the Rust ones.
--
-- No relay runs inside this server: the functions that report the in-server relays answer as the
-- extension does where its library is not preloaded (no pid, not connected, no rows), and the
-- commit wake-ups for a replay and an adopted copy are no-ops (an outside relay finds that work
-- when it polls). outbox_enqueue's wake-up is a NOTIFY (enqueue.sql).

-- The version of this install, which an outside relay checks against its own before it runs a
-- round (outside/src/readiness.rs): the extension's install records it in pg_extension, this one
-- here. scripts/sql.py writes the version in.
CREATE FUNCTION outbox._version() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT '@OUTBOX_VERSION@'::text $fn$;

COMMENT ON FUNCTION outbox._version() IS 'Internal (SQL-only install): the version of this install, which outside relays check';

CREATE FUNCTION outbox.relay_pid() RETURNS integer
LANGUAGE sql VOLATILE PARALLEL SAFE STRICT
AS $fn$ SELECT NULL::integer $fn$;

CREATE FUNCTION outbox.redis_connected() RETURNS boolean
LANGUAGE sql VOLATILE PARALLEL SAFE STRICT
AS $fn$ SELECT false $fn$;

CREATE FUNCTION outbox.relays()
RETURNS TABLE (slot integer, pid integer, claimed bigint, claimed_at timestamptz, claim_expired boolean)
LANGUAGE sql VOLATILE PARALLEL SAFE STRICT
AS $fn$ SELECT NULL::integer, NULL::integer, NULL::bigint, NULL::timestamptz, NULL::boolean WHERE false $fn$;

CREATE FUNCTION outbox.relay_status()
RETURNS TABLE (worker_pid integer, workers integer, redis_connected boolean, last_error text,
               last_error_at timestamptz, in_flight bigint, published_total bigint)
LANGUAGE sql VOLATILE PARALLEL SAFE STRICT
AS $fn$ SELECT NULL::integer, 0, false, NULL::text, NULL::timestamptz, 0::bigint, 0::bigint $fn$;

CREATE FUNCTION outbox._wake_for_replay() RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE STRICT
AS $fn$ SELECT $fn$;

CREATE FUNCTION outbox._rescan_at_commit() RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE STRICT
AS $fn$ SELECT $fn$;

-- The role the caller acts as outside any SECURITY DEFINER function (GetOuterUserId): what SET ROLE
-- chose, else the session's user. A SECURITY DEFINER function changes neither.
CREATE FUNCTION outbox._calling_role() RETURNS oid
LANGUAGE sql STABLE PARALLEL SAFE STRICT
AS $fn$
    SELECT r.oid FROM pg_catalog.pg_roles r
     WHERE r.rolname = CASE pg_catalog.current_setting('role') WHEN 'none' THEN SESSION_USER
                            ELSE pg_catalog.current_setting('role') END
$fn$;

-- The next transaction id to be assigned, or above (ReadNextFullTransactionId has no SQL form):
-- above the snapshot's xmax and above every transaction id held now. Every transaction holds the
-- lock on its own id from right after the id is assigned, before it can take a snapshot, so a
-- writer that read a table as current (outbox._retention) is in pg_locks or has ended (then it is
-- below xmax). pg_locks shows 32-bit ids: each is placed in the epoch that puts it nearest xmax.
CREATE FUNCTION outbox._next_xid() RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL UNSAFE STRICT
SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH x AS (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax),
         held AS (SELECT l.transactionid::text::bigint AS xid FROM pg_locks l
                   WHERE l.locktype = 'transactionid' AND l.transactionid IS NOT NULL)
    SELECT greatest(x.xmax, coalesce(max(
               CASE WHEN ((x.xmax >> 32) << 32) + h.xid > x.xmax + 2147483648 THEN ((x.xmax >> 32) << 32) + h.xid - 4294967296
                    WHEN ((x.xmax >> 32) << 32) + h.xid < x.xmax - 2147483648 THEN ((x.xmax >> 32) << 32) + h.xid + 4294967296
                    ELSE ((x.xmax >> 32) << 32) + h.xid END) + 1, 0))
      FROM x LEFT JOIN held h ON true
     GROUP BY x.xmax
$fn$;

-- The log's undelivered events for outbox._health, by the rule of src/log/pending.rs's index walk:
-- per shard, the events of the transactions now sees completed and its cursor does not (those at or
-- above the cursor's xmax, and those it saw running), less what the position in a window published
-- in parts has consumed; a rolled-back transaction's rows are not visible, so not counted. Through
-- the (shard, txid, id) indexes from each cursor on, so it reads what is undelivered, not the log:
-- by outbox.messages' rule, a scan of the whole log, it took 24 ms a call at 30,000 published
-- events, and the outside relay's housekeeping calls it once per poll interval. Without counting,
-- it reads each shard's first undelivered event, then only the transactions up to the one that
-- recorded the first snapshot after the oldest of those (src/log/pending.rs, `walk_bound`, says
-- why none above it can be older).
CREATE FUNCTION outbox._log_pending(count_events boolean)
RETURNS TABLE (events bigint, oldest timestamptz)
LANGUAGE plpgsql STRICT VOLATILE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    now_snapshot  pg_snapshot := pg_current_snapshot();
    below         xid8 := pg_snapshot_xmax(now_snapshot);
    s             record;
    n             bigint;
    first_created timestamptz;
BEGIN
    events := 0;
    IF NOT count_events THEN
        FOR s IN SELECT sh.shard, sh.cursor, sh.window_upto, sh.window_max_id, sh.window_last_id FROM outbox.shards sh LOOP
            oldest := least(oldest, outbox._first_pending(s.shard, s.cursor, s.window_upto, s.window_max_id,
                                                           s.window_last_id, now_snapshot));
        END LOOP;
        below := least(below, (SELECT (p.recorded_by::text::bigint + 1)::text::xid8 FROM outbox.snapshots p
                                WHERE p.taken_at >= oldest AND p.recorded_by IS NOT NULL
                                ORDER BY p.taken_at LIMIT 1));
    END IF;
    FOR s IN SELECT sh.shard, sh.cursor, sh.window_upto, sh.window_max_id, sh.window_last_id FROM outbox.shards sh LOOP
        SELECT count(*), min(u.created_at) INTO n, first_created
          FROM (SELECT e.id, e.txid, e.created_at FROM outbox.events e
                 WHERE e.shard = s.shard AND e.txid >= pg_snapshot_xmax(s.cursor) AND e.txid < below
                UNION ALL
                SELECT e.id, e.txid, e.created_at FROM outbox.events e
                 WHERE e.shard = s.shard AND e.txid = ANY (ARRAY(SELECT pg_snapshot_xip(s.cursor)))) u
          -- In the window published in parts: the transaction's largest id in the shard.
          LEFT JOIN LATERAL (SELECT max(l.id) AS largest FROM outbox.events l
                              WHERE l.shard = s.shard AND l.txid = u.txid) t
                 ON s.window_upto IS NOT NULL AND pg_visible_in_snapshot(u.txid, s.window_upto)
         WHERE pg_visible_in_snapshot(u.txid, now_snapshot)
           AND NOT coalesce(t.largest < s.window_max_id OR (t.largest = s.window_max_id AND u.id <= s.window_last_id),
                            false);
        IF count_events THEN
            events := events + n;
        END IF;
        oldest := least(oldest, first_created);
    END LOOP;
    RETURN NEXT;
END
$fn$;

-- The creation time of an undelivered event of a shard, as outbox._log_pending counts them (the
-- first from the cursor's xmax on, in (txid, id) order, else one of a transaction the cursor saw
-- running), or NULL: a candidate for the oldest, which bounds the walk for it.
CREATE FUNCTION outbox._first_pending(the_shard smallint, cursor pg_snapshot, window_upto pg_snapshot,
                                      window_max_id bigint, window_last_id bigint, now_snapshot pg_snapshot)
RETURNS timestamptz
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    r       record;
    largest bigint;
BEGIN
    -- Fetched a few rows at a time in index order (a cursor's fast-start plan, each log table's
    -- index merged): it stops at the first the cursor and the window have not consumed.
    FOR r IN (SELECT e.id, e.txid, e.created_at FROM outbox.events e
               WHERE e.shard = the_shard AND e.txid >= pg_snapshot_xmax(cursor) AND e.txid < pg_snapshot_xmax(now_snapshot)
               ORDER BY e.txid, e.id)
             UNION ALL
             (SELECT e.id, e.txid, e.created_at FROM outbox.events e
               WHERE e.shard = the_shard AND e.txid = ANY (ARRAY(SELECT pg_snapshot_xip(cursor)))) LOOP
        CONTINUE WHEN NOT pg_visible_in_snapshot(r.txid, now_snapshot);
        IF window_upto IS NOT NULL AND pg_visible_in_snapshot(r.txid, window_upto) THEN
            SELECT max(l.id) INTO largest FROM outbox.events l WHERE l.shard = the_shard AND l.txid = r.txid;
            CONTINUE WHEN largest < window_max_id OR (largest = window_max_id AND r.id <= window_last_id);
        END IF;
        RETURN r.created_at;
    END LOOP;
    RETURN NULL;
END
$fn$;
COMMENT ON FUNCTION outbox._first_pending(smallint, pg_snapshot, pg_snapshot, bigint, bigint, pg_snapshot) IS
    'Internal (SQL-only install): when an undelivered event of a shard was enqueued, the candidate that bounds the age check''s walk';

-- outbox.allowed_streams' patterns (src/enqueue/streams.rs): comma-separated globs, `*` any run,
-- `?` one character, `\` makes the next one literal; blanks around the commas ignored. Each is
-- matched as a regular expression made of it, all of the key.
CREATE FUNCTION outbox._stream_allowed(patterns text, key text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    backslash constant text := chr(92);
    pattern text;
    regex   text;
    c       text;
    literal boolean;
BEGIN
    FOREACH pattern IN ARRAY string_to_array(patterns, ',') LOOP
        pattern := outbox._trim_whitespace(pattern);
        CONTINUE WHEN pattern = '';
        regex := '';
        literal := false;
        FOREACH c IN ARRAY regexp_split_to_array(pattern, '') LOOP
            IF NOT literal AND c = backslash THEN
                literal := true;
                CONTINUE;
            END IF;
            regex := regex || CASE WHEN literal THEN outbox._regex_literal(c)
                                   WHEN c = '*' THEN '.*'
                                   WHEN c = '?' THEN '.'
                                   ELSE outbox._regex_literal(c) END;
            literal := false;
        END LOOP;
        IF literal THEN
            regex := regex || outbox._regex_literal(backslash);
        END IF;
        IF key ~ ('^(?:' || regex || ')$') THEN
            RETURN true;
        END IF;
    END LOOP;
    RETURN false;
END
$fn$;

-- One character as a regular expression that matches only it: a bracket expression, with the
-- characters special inside one escaped.
CREATE FUNCTION outbox._regex_literal(c text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$
    SELECT '[' || CASE WHEN c IN (pg_catalog.chr(92), ']', '^', '-') THEN pg_catalog.chr(92) || c ELSE c END || ']'
$fn$;
COMMENT ON FUNCTION outbox._regex_literal(text) IS
    'Internal (SQL-only install): a regular expression matching exactly this one character';

-- Rust's str::trim: the characters with Unicode's White_Space property, at both ends.
CREATE FUNCTION outbox._trim_whitespace(value text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$
    SELECT pg_catalog.btrim(value, E'\t\n\x0b\f\r ' || pg_catalog.chr(133) || pg_catalog.chr(160) || pg_catalog.chr(5760)
                                   || pg_catalog.chr(8192) || pg_catalog.chr(8193) || pg_catalog.chr(8194) || pg_catalog.chr(8195)
                                   || pg_catalog.chr(8196) || pg_catalog.chr(8197) || pg_catalog.chr(8198) || pg_catalog.chr(8199)
                                   || pg_catalog.chr(8200) || pg_catalog.chr(8201) || pg_catalog.chr(8202) || pg_catalog.chr(8232)
                                   || pg_catalog.chr(8233) || pg_catalog.chr(8239) || pg_catalog.chr(8287) || pg_catalog.chr(12288))
$fn$;
COMMENT ON FUNCTION outbox._trim_whitespace(text) IS
    'Internal (SQL-only install): the value without Unicode white space at either end, as Rust''s str::trim';
COMMENT ON FUNCTION outbox._stream_allowed(text, text) IS
    'Internal (SQL-only install): whether a stream key matches one of outbox.allowed_streams'' glob patterns';

-- outbox.allowed_streams as outbox_enqueue reads it: its default, '*', when not set. A placeholder
-- setting reads '' once a transaction that set it has ended, so '' is taken as not set too.
CREATE FUNCTION outbox._allowed_streams() RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
AS $fn$ SELECT coalesce(NULLIF(pg_catalog.current_setting('outbox.allowed_streams', true), ''), '*') $fn$;
COMMENT ON FUNCTION outbox._allowed_streams() IS
    'Internal (SQL-only install): outbox.allowed_streams, ''*'' when not set';

CREATE FUNCTION outbox._check_allowed_stream(stream text) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE STRICT
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    patterns text := outbox._allowed_streams();
BEGIN
    IF NOT '*' = ANY (SELECT outbox._trim_whitespace(p) FROM unnest(string_to_array(patterns, ',')) p)
       AND NOT outbox._stream_allowed(patterns, stream) THEN
        RAISE EXCEPTION 'outbox.replay: stream "%" (to_stream) is not allowed by outbox.allowed_streams', outbox._shown_key(stream)
            USING ERRCODE = 'insufficient_privilege',
                  HINT = format('Allowed streams match one of these patterns: ''%s''. Replay into such a stream, or have a superuser extend outbox.allowed_streams.', patterns);
    END IF;
END
$fn$;

-- A stream key as the messages show it: at most 100 characters, then '...'.
CREATE FUNCTION outbox._shown_key(key text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$ SELECT CASE WHEN pg_catalog.length(key) > 100 THEN pg_catalog.left(key, 100) || '...' ELSE key END $fn$;
COMMENT ON FUNCTION outbox._shown_key(text) IS
    'Internal (SQL-only install): a stream key as error messages show it, at most 100 characters';

-- outbox._raw_size (replay.sql) is byteaoctetlen, a LANGUAGE internal function, which only a
-- superuser may declare: here the size of the value's JSON text, which detoasts it (a replay's
-- selection reads payloads one batch at a time).
CREATE FUNCTION outbox._raw_size(jsonb)
RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$ SELECT pg_catalog.octet_length($1::text) $fn$;
