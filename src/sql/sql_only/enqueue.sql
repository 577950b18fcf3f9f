-- The SQL-only install (docs/sql-only.md): outbox_enqueue in PL/pgSQL, doing what the Rust one of
-- src/enqueue/ does, in the same order, with the same SQLSTATEs, messages and hints: the argument
-- checks, the trace context, the aggregate's order lock, its shard (the same FNV-1a hash), and one
-- row in the current log table. tests/sql_only.rs runs README's bad-input table against both.
--
-- What differs, because SQL cannot reach it: the outbox.* settings are placeholders here (no
-- library defines them), so any session may set them, and their check hooks do not run (a bad
-- outbox.traceparent is refused by outbox_enqueue rather than by SET); the order lock is an
-- advisory lock with the Rust lock's keys (the Rust one is of the type PostgreSQL keeps for C
-- code, LOCKTAG_USERLOCK); a sleeping relay is woken at commit by a NOTIFY on
-- outbox._wake_channel() rather than through shared memory.

-- -------------------------------------------------------------------------------------------------
-- outbox._aggregate_hash(aggregate_type, aggregate_id)
--
--     src/enqueue/order.rs's aggregate_hash: FNV-1a, 64 bits, over the type's UTF-8 bytes, a 0xff
--     byte and the id's, as a bigint (the unsigned value's bits). Fixed forever: a stored event's
--     shard must mean the same to both installs. Computed in two 32-bit halves, so that no step
--     overflows a bigint: the prime is 2^40 + 435.
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._aggregate_hash(aggregate_type text, aggregate_id text) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    bytes bytea := convert_to(aggregate_type, 'UTF8') || decode('ff', 'hex') || convert_to(aggregate_id, 'UTF8');
    high  bigint := 3421674724;  -- 0xcbf29ce4, the offset basis's high half
    low   bigint := 2216829733;  -- 0x84222325
    t     bigint;
BEGIN
    FOR i IN 0 .. length(bytes) - 1 LOOP
        low := low # get_byte(bytes, i);
        t := low * 435;
        high := (high * 435 + (t >> 32) + ((low & 16777215) << 8)) & 4294967295;
        low := t & 4294967295;
    END LOOP;
    RETURN (high << 32) | low;
END
$fn$;
COMMENT ON FUNCTION outbox._aggregate_hash(text, text) IS
    'Internal (SQL-only install): the aggregate''s 64-bit FNV-1a hash, as the extension computes it (its shard and order lock)';

-- The shard (0..15) of an aggregate: the hash modulo 16, its low four bits.
CREATE FUNCTION outbox._shard_of(aggregate_type text, aggregate_id text) RETURNS smallint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$ SELECT (outbox._aggregate_hash(aggregate_type, aggregate_id) OPERATOR(pg_catalog.&) 15)::smallint $fn$;
COMMENT ON FUNCTION outbox._shard_of(text, text) IS
    'Internal (SQL-only install): the shard (0..15) of an aggregate, as the extension computes it';

-- -------------------------------------------------------------------------------------------------
-- The order lock (src/enqueue/order.rs): an advisory lock keyed by the aggregate's hash, held to
-- the end of the transaction, taken with the Rust lock's fields (pg_advisory_xact_lock(int4, int4)
-- sets the database, the hash's two halves, and 2 as the fourth field, as the Rust tag does). A
-- transaction holds at most 256; past that it takes the shared past-the-cap lock instead, a
-- single-key advisory lock. The count lives in a transaction-local setting, which a rolled-back
-- subtransaction restores, as it releases the locks it took; the count includes repeats, so at
-- 256 it is corrected from pg_locks.
-- -------------------------------------------------------------------------------------------------

-- The two int4 keys of an aggregate's order lock: the hash's high and low halves, their bits.
CREATE FUNCTION outbox._order_lock_keys(hash bigint, OUT high integer, OUT low integer)
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$
    SELECT (hash OPERATOR(pg_catalog.>>) 32)::integer,
           (((hash OPERATOR(pg_catalog.&) 4294967295) OPERATOR(pg_catalog.#) 2147483648) OPERATOR(pg_catalog.-) 2147483648)::integer
$fn$;
COMMENT ON FUNCTION outbox._order_lock_keys(bigint) IS
    'Internal (SQL-only install): the advisory lock keys of an aggregate''s order lock';

-- The past-the-cap lock's key: a fixed one, far from the small numbers applications pick.
CREATE FUNCTION outbox._past_cap_key() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT 8037766566451159920::bigint $fn$;
COMMENT ON FUNCTION outbox._past_cap_key() IS
    'Internal (SQL-only install): the advisory lock key transactions past the order-lock cap share';

-- How many order locks this transaction holds, from pg_locks (the count's correction at the cap).
CREATE FUNCTION outbox._order_locks_held() RETURNS integer
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT count(*)::integer FROM pg_locks l
     WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.objsubid = 2 AND l.mode = 'ExclusiveLock'
       AND l.granted AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
$fn$;
COMMENT ON FUNCTION outbox._order_locks_held() IS
    'Internal (SQL-only install): how many order locks the calling transaction holds';

CREATE FUNCTION outbox._lock_aggregate(hash bigint) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE STRICT
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    keys  record := outbox._order_lock_keys(hash);
    held  integer := coalesce(nullif(current_setting('outbox_sql_only.order_locks', true), ''), '0')::integer;
BEGIN
    IF held >= 256 THEN
        held := outbox._order_locks_held();
        PERFORM set_config('outbox_sql_only.order_locks', held::text, true);
    END IF;
    IF held < 256 THEN
        PERFORM pg_advisory_xact_lock(keys.high, keys.low);
        PERFORM set_config('outbox_sql_only.order_locks', (held + 1)::text, true);
    ELSIF NOT EXISTS (SELECT 1 FROM pg_locks l
                       WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.objsubid = 2
                         AND l.mode = 'ExclusiveLock' AND l.granted
                         AND l.classid = (keys.high::bigint & 4294967295)::text::oid
                         AND l.objid = (keys.low::bigint & 4294967295)::text::oid) THEN
        PERFORM pg_advisory_xact_lock_shared(outbox._past_cap_key());
    END IF;
END
$fn$;
COMMENT ON FUNCTION outbox._lock_aggregate(bigint) IS
    'Internal (SQL-only install): takes the aggregate''s order lock until the transaction ends, or the past-the-cap lock beyond 256';

-- -------------------------------------------------------------------------------------------------
-- The commit wake-up (docs/sql-only.md, "Commit wake-up"): relays outside the server LISTEN on this
-- channel, and outbox_enqueue notifies it with an empty payload when a relay sleeps, i.e. holds
-- the wake key. A relay, listening already, goes to sleep by taking the key when no writer shares
-- it (it never waits for the key: a waiting request makes writers' tries fail, and notify), then
-- looks for work once more; so a writer either notifies or is seen by that look.
-- PostgreSQL folds a transaction's identical notifications into one, delivers it at commit, drops
-- it at rollback or with the subtransaction that sent it, and only to listeners in this database.
-- Empty, because the relay reads every shard when woken, and LISTEN needs no privilege: a payload
-- would show any role that can connect what is being written.
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._wake_key() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT 8037766566451159921::bigint $fn$;
COMMENT ON FUNCTION outbox._wake_key() IS
    'Internal (SQL-only install): the advisory lock key a relay outside the server holds while it sleeps, which writers share until they commit';

CREATE FUNCTION outbox._wake_channel() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT 'outbox_pg'::text $fn$;
COMMENT ON FUNCTION outbox._wake_channel() IS
    'Internal (SQL-only install): the channel outbox_enqueue notifies at commit, which relays outside the server listen on';

CREATE FUNCTION outbox._enqueue_in_progress(aggregate_type text, aggregate_id text) RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE STRICT
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    keys record := outbox._order_lock_keys(outbox._aggregate_hash(aggregate_type, aggregate_id));
BEGIN
    -- Tried at session level and released at once (a lock this transaction holds itself is taken
    -- again and released, leaving its own): no lock table entry kept per aggregate checked.
    IF pg_try_advisory_lock(keys.high, keys.low) THEN
        PERFORM pg_advisory_unlock(keys.high, keys.low);
        RETURN false;
    END IF;
    RETURN true;
END
$fn$;

CREATE FUNCTION outbox._exclude_transactions_past_the_cap() RETURNS boolean
LANGUAGE sql VOLATILE PARALLEL UNSAFE STRICT
AS $fn$ SELECT pg_catalog.pg_try_advisory_xact_lock(outbox._past_cap_key()) $fn$;

-- -------------------------------------------------------------------------------------------------
-- The checks' messages (src/enqueue/mod.rs, src/enqueue/trace.rs, protocol/src/trace.rs)
-- -------------------------------------------------------------------------------------------------

-- Refuses a required name that is NULL, empty or longer than `lim` bytes (mod.rs's `required`).
CREATE FUNCTION outbox._refuse_name(name text, value text, lim integer, missing text, too_long text) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF value IS NULL THEN
        RAISE EXCEPTION 'outbox_enqueue: % must not be NULL', name USING ERRCODE = 'null_value_not_allowed', HINT = missing;
    ELSIF value = '' THEN
        RAISE EXCEPTION 'outbox_enqueue: % must not be empty (got '''')', name USING ERRCODE = 'invalid_parameter_value', HINT = missing;
    ELSIF octet_length(value) > lim THEN
        RAISE EXCEPTION 'outbox_enqueue: % is % bytes long (starts with %), the limit is % bytes',
                name, octet_length(value), quote_literal(left(value, 40)), lim
            USING ERRCODE = 'invalid_parameter_value', HINT = too_long;
    END IF;
END
$fn$;
COMMENT ON FUNCTION outbox._refuse_name(text, text, integer, text, text) IS
    'Internal (SQL-only install): outbox_enqueue''s refusal of a NULL, empty or overlong name';

-- Refuses headers longer than 65,536 bytes as JSON text; `merged`: with the trace context merged in.
CREATE FUNCTION outbox._check_headers_size(headers text, merged boolean) RETURNS void
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF octet_length(headers) > 65536 THEN
        RAISE EXCEPTION 'outbox_enqueue: headers are % bytes as JSON text% (starts with %), the limit is 65536 bytes',
                octet_length(headers),
                CASE WHEN merged THEN ' with the trace context (outbox.traceparent, outbox.tracestate) merged in' ELSE '' END,
                left(headers, 40)
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'Headers carry small metadata such as trace ids; put data in the payload.';
    END IF;
END
$fn$;
COMMENT ON FUNCTION outbox._check_headers_size(text, boolean) IS
    'Internal (SQL-only install): outbox_enqueue''s limit on the headers'' size';

-- Refuses a trace context value (from `what`) that is not valid (trace.rs's `check`); the value
-- shown quoted, at most 100 characters.
CREATE FUNCTION outbox._check_trace(what text, value text, traceparent boolean) RETURNS void
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    problem text := CASE WHEN traceparent THEN outbox._traceparent_problem(value) ELSE outbox._tracestate_problem(value) END;
BEGIN
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'outbox_enqueue: % % is not valid: %', what, outbox._shown_trace(value), problem
            USING ERRCODE = 'invalid_parameter_value', HINT = outbox._trace_hint(traceparent);
    END IF;
END
$fn$;
COMMENT ON FUNCTION outbox._check_trace(text, text, boolean) IS
    'Internal (SQL-only install): refuses a traceparent or tracestate that is not valid W3C trace context';

-- trace.rs's `shown`: quoted, at most 100 characters, then '...'.
CREATE FUNCTION outbox._shown_trace(value text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$
    SELECT '''' || pg_catalog.replace(pg_catalog.left(value, 100), '''', '''''') || ''''
           || CASE WHEN pg_catalog.length(value) > 100 THEN '...' ELSE '' END
$fn$;
COMMENT ON FUNCTION outbox._shown_trace(text) IS
    'Internal (SQL-only install): a trace context value as error messages show it';

CREATE FUNCTION outbox._trace_hint(traceparent boolean) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$
    SELECT CASE WHEN traceparent
                THEN 'A W3C traceparent looks like ''00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'': version 00, lowercase hex, trace id and parent id not all zeros. Pass the one your tracer gives, or none.'
                ELSE 'A W3C tracestate looks like ''rojo=00f067aa0ba902b7,congo=t61rcWkgMzE'': at most 32 key=value members and 512 bytes. Pass the one your tracer gives, or none.' END
$fn$;
COMMENT ON FUNCTION outbox._trace_hint(boolean) IS
    'Internal (SQL-only install): the hint of a refused traceparent (true) or tracestate (false)';

-- The headers to store (trace.rs's with_trace_context): as given when they carry a trace context
-- or none is set, else with outbox.traceparent and outbox.tracestate merged in; a trace context
-- that is not valid is refused.
CREATE FUNCTION outbox._with_trace_context(headers jsonb) RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    member      jsonb;
    traceparent text;
    tracestate  text;
    trace       jsonb;
BEGIN
    IF headers IS NOT NULL THEN
        FOREACH traceparent IN ARRAY ARRAY['traceparent', 'tracestate'] LOOP
            member := headers -> traceparent;
            IF member IS NOT NULL AND jsonb_typeof(member) <> 'string' THEN
                RAISE EXCEPTION 'outbox_enqueue: headers'' % must be a JSON string, got a JSON %', traceparent,
                        CASE jsonb_typeof(member) WHEN 'null' THEN 'null' WHEN 'number' THEN 'number'
                                                  WHEN 'boolean' THEN 'boolean' ELSE 'array or object' END
                    USING ERRCODE = 'invalid_parameter_value', HINT = outbox._trace_hint(traceparent = 'traceparent');
            END IF;
        END LOOP;
        traceparent := headers ->> 'traceparent';
        tracestate := headers ->> 'tracestate';
        IF traceparent IS NOT NULL THEN
            PERFORM outbox._check_trace('headers'' traceparent', traceparent, true);
            IF tracestate IS NOT NULL THEN
                PERFORM outbox._check_trace('headers'' tracestate', tracestate, false);
            END IF;
            RETURN headers;
        ELSIF tracestate IS NOT NULL THEN
            RAISE EXCEPTION 'outbox_enqueue: headers carry a tracestate (%) but no traceparent', outbox._shown_trace(tracestate)
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'A tracestate belongs to the traceparent it came with: add that traceparent to the headers, or leave the tracestate out.';
        END IF;
    END IF;
    tracestate := nullif(current_setting('outbox.tracestate', true), '');
    traceparent := nullif(current_setting('outbox.traceparent', true), '');
    IF traceparent IS NULL THEN
        IF tracestate IS NOT NULL THEN
            RAISE EXCEPTION 'outbox_enqueue: outbox.tracestate is set (%) but outbox.traceparent is not', outbox._shown_trace(tracestate)
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Set both in the enqueuing transaction (SET LOCAL outbox.traceparent = ''00-...''), or RESET outbox.tracestate.';
        END IF;
        RETURN headers;
    END IF;
    PERFORM outbox._check_trace('outbox.traceparent', traceparent, true);
    trace := jsonb_build_object('traceparent', traceparent);
    IF tracestate IS NOT NULL THEN
        PERFORM outbox._check_trace('outbox.tracestate', tracestate, false);
        trace := trace || jsonb_build_object('tracestate', tracestate);
    END IF;
    RETURN coalesce(headers || trace, trace);
END
$fn$;
COMMENT ON FUNCTION outbox._with_trace_context(jsonb) IS
    'Internal (SQL-only install): the headers with the trace context of outbox.traceparent and outbox.tracestate merged in';

-- -------------------------------------------------------------------------------------------------
-- outbox_enqueue: src/sql/enqueue.sql describes it, comments it and grants it; this is its body
-- for the SQL-only install. SECURITY DEFINER as there, with search_path pinned (PL/pgSQL resolves
-- operators through it, and runs with the owner's rights).
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION @extschema@.outbox_enqueue(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL,
    stream         text  DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    stored_headers jsonb := headers;
    patterns       text;
    template       text;
    key            text;
    payload_bytes  integer;
    payload_limit  bigint;
    bytes          bytea;
    hash           bigint := -3750763034362895579;  -- FNV-1a's offset basis, 0xcbf29ce484222325
    held           integer;
    unused         text;
    event_id       uuid;
    txid           xid8;
    current_table  smallint;
BEGIN
    -- The checks, in the Rust function's order. Each statement run costs, even a check that
    -- passes: PL/pgSQL prepares every expression anew in each transaction, and a call is often its
    -- transaction's only one. So one expression tells whether a check could refuse or has work
    -- (headers, a stream), and the checks run in order only then.
    IF current_setting('transaction_read_only') = 'on' OR pg_is_in_recovery()
       OR NOT coalesce(octet_length(aggregate_type) BETWEEN 1 AND 255 AND octet_length(aggregate_id) BETWEEN 1 AND 1024
                       AND octet_length(event_type) BETWEEN 1 AND 255 AND payload IS NOT NULL, false)
       OR headers IS NOT NULL OR stream IS NOT NULL THEN
        -- What an INSERT would refuse, before anything else, as the Rust function does.
        IF current_setting('transaction_read_only') = 'on' THEN
            RAISE EXCEPTION 'cannot execute outbox_enqueue() in a read-only transaction' USING ERRCODE = 'read_only_sql_transaction';
        END IF;
        IF pg_is_in_recovery() THEN
            RAISE EXCEPTION 'cannot execute outbox_enqueue() during recovery' USING ERRCODE = 'read_only_sql_transaction';
        END IF;
        IF aggregate_type IS NULL OR aggregate_type = '' OR octet_length(aggregate_type) > 255 THEN
            PERFORM outbox._refuse_name('aggregate_type', aggregate_type, 255,
                'Pass the kind of entity the event is about, e.g. ''payment''.',
                'aggregate_type names a kind of entity, e.g. ''payment''; put data in the payload.');
        END IF;
        IF aggregate_id IS NULL OR aggregate_id = '' OR octet_length(aggregate_id) > 1024 THEN
            PERFORM outbox._refuse_name('aggregate_id', aggregate_id, 1024,
                'Pass the id of the entity the event is about (text, bigint or uuid).',
                'Pass the id of the entity the event is about (text, bigint or uuid); put data in the payload.');
        END IF;
        IF event_type IS NULL OR event_type = '' OR octet_length(event_type) > 255 THEN
            PERFORM outbox._refuse_name('event_type', event_type, 255,
                'Pass what happened, e.g. ''payment.created''.',
                'event_type names what happened, e.g. ''payment.created''; put data in the payload.');
        END IF;
        IF payload IS NULL THEN
            RAISE EXCEPTION 'outbox_enqueue: payload must not be NULL' USING ERRCODE = 'null_value_not_allowed',
                HINT = 'Pass a jsonb value; use ''null''::jsonb for an event without a body.';
        END IF;
        IF headers IS NOT NULL THEN
            IF jsonb_typeof(headers) <> 'object' THEN
                RAISE EXCEPTION 'outbox_enqueue: headers must be a JSON object, got a JSON %: %', jsonb_typeof(headers), left(headers::text, 100)
                    USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass e.g. ''{"trace_id": "abc"}''::jsonb, or NULL for no headers.';
            END IF;
            IF octet_length(headers::text) > 65536 THEN
                PERFORM outbox._check_headers_size(headers::text, false);
            END IF;
        END IF;
        IF stream IS NOT NULL THEN
            IF outbox._trim_whitespace(stream) = '' THEN
                RAISE EXCEPTION 'outbox_enqueue: stream must not be empty or blank (got ''%'')', stream
                    USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass NULL to use the outbox.stream template, or a Redis key of 1 to 512 bytes.';
            END IF;
            IF octet_length(stream) > 512 THEN
                RAISE EXCEPTION 'outbox_enqueue: stream is % bytes long (starts with %), the limit is 512 bytes', octet_length(stream), quote_literal(left(stream, 40))
                    USING ERRCODE = 'invalid_parameter_value', HINT = 'Pass NULL to use the outbox.stream template, or a Redis key of 1 to 512 bytes.';
            END IF;
        END IF;
    END IF;
    PERFORM FROM pg_database d WHERE d.datname = current_database() AND d.datistemplate;
    IF FOUND THEN
        RAISE EXCEPTION 'database "%" is a template, and outbox_pg relays no template database, so no relay would deliver this event', current_database()
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Enqueue in the databases created from it, or make it an ordinary database (ALTER DATABASE ... IS_TEMPLATE false).';
    END IF;
    -- Likewise: outbox.allowed_streams other than its default '*', a payload over the default
    -- limit or any limit set, a trace context in the headers or the settings.
    IF coalesce(current_setting('outbox.allowed_streams', true), '') NOT IN ('', '*')
       OR octet_length(payload::text) > (CASE WHEN coalesce(current_setting('outbox.max_payload_size', true), '') = '' THEN 1048576 ELSE 0 END)
       OR headers ?| '{traceparent,tracestate}'::text[]
       OR current_setting('outbox.traceparent', true) <> '' OR current_setting('outbox.tracestate', true) <> '' THEN
        patterns := outbox._allowed_streams();
        IF NOT '*' = ANY (SELECT outbox._trim_whitespace(p) FROM unnest(string_to_array(patterns, ',')) p) THEN
            template := coalesce(nullif(current_setting('outbox.stream', true), ''), 'outbox:{aggregate_type}');
            key := coalesce(stream, array_to_string(ARRAY(
                       SELECT replace(part, '{event_type}', event_type)
                         FROM unnest(string_to_array(template, '{aggregate_type}')) WITH ORDINALITY AS t(part, n) ORDER BY n),
                       aggregate_type));
            IF NOT outbox._stream_allowed(patterns, key) THEN
                RAISE EXCEPTION 'outbox_enqueue: stream "%" (%) is not allowed by outbox.allowed_streams', outbox._shown_key(key),
                        CASE WHEN stream IS NOT NULL THEN 'the stream argument' ELSE format('outbox.stream (''%s'') for this event', template) END
                    USING ERRCODE = 'insufficient_privilege',
                          HINT = format('Allowed streams match one of these patterns: ''%s''. Use such a stream, or have a superuser extend outbox.allowed_streams.', patterns);
            END IF;
        END IF;
        -- The limit applies to what is sent to Redis: the payload's JSON text.
        payload_bytes := octet_length(payload::text);
        payload_limit := pg_size_bytes(coalesce(nullif(current_setting('outbox.max_payload_size', true), ''), '1048576'));
        IF payload_bytes > payload_limit THEN
            RAISE EXCEPTION 'outbox_enqueue: payload is % bytes, larger than outbox.max_payload_size (% bytes)', payload_bytes, payload_limit
                USING ERRCODE = 'program_limit_exceeded',
                      HINT = 'Put large documents elsewhere and send a reference in the event, or have a superuser raise outbox.max_payload_size.';
        END IF;
        stored_headers := outbox._with_trace_context(headers);
        IF stored_headers IS DISTINCT FROM headers THEN
            PERFORM outbox._check_headers_size(stored_headers::text, true);
        END IF;
    END IF;

    -- outbox._aggregate_hash, here (a call costs more than the hash), in two statements a byte:
    -- the product by the prime, 2^40 + 435, modulo 2^64, made of parts no step overflows.
    bytes := convert_to(aggregate_type, 'UTF8') || decode('ff', 'hex') || convert_to(aggregate_id, 'UTF8');
    FOR i IN 0 .. length(bytes) - 1 LOOP
        hash := hash # get_byte(bytes, i);
        hash := (((hash >> 32) * 435 + ((hash & 16777215) << 8) + (((hash & 4294967295) * 435) >> 32)) << 32)
                | (((hash & 4294967295) * 435) & 4294967295);
    END LOOP;
    -- Right before the id is drawn: enqueues of one aggregate take turns until commit. Below the
    -- cap, outbox._lock_aggregate's lock (outbox._order_lock_keys' keys) and count in one
    -- expression; at the cap, that function.
    held := coalesce(nullif(current_setting('outbox_sql_only.order_locks', true), ''), '0')::integer;
    IF held < 256 THEN
        unused := pg_advisory_xact_lock((hash >> 32)::integer, (((hash & 4294967295) # 2147483648) - 2147483648)::integer)::text
                  || set_config('outbox_sql_only.order_locks', (held + 1)::text, true);
    ELSE
        PERFORM outbox._lock_aggregate(hash);
    END IF;
    -- Wakes a sleeping relay at commit (docs/sql-only.md, "Commit wake-up"). A relay outside the
    -- server holds the wake key while it sleeps: a writer that cannot share it notifies. One that
    -- can holds it to its commit, so no relay falls asleep before that commit, and the relay's
    -- last look before sleeping finds what it committed. Awake relays cost writers no NOTIFY
    -- (a notifying commit flushes the WAL alone: half the commits at 8 writers). Every call
    -- asks: PostgreSQL keeps one notification per transaction, and a lock already held is found
    -- in the backend's own table. Where transactions may be prepared, none notifies: a
    -- transaction that sent a NOTIFY cannot be (PREPARE TRANSACTION refuses it), and the relay
    -- finds the events at its poll interval.
    IF NOT pg_try_advisory_xact_lock_shared(outbox._wake_key())
       AND current_setting('max_prepared_transactions') = '0' THEN
        PERFORM pg_notify(outbox._wake_channel(), '');
    END IF;
    -- A UUIDv7: the Unix time in milliseconds (48 bits, 12 hex digits), the version 7, then a
    -- random UUID's random bits (its variant's too): its first 15 characters, 'xxxxxxxx-xxxx-4',
    -- replaced (uuid_in takes a '-' after any group of four digits).
    event_id := overlay(gen_random_uuid()::text
                        PLACING encode(substr(int8send(floor(date_part('epoch', clock_timestamp()) * 1000)::bigint), 3), 'hex') || '-7'
                        FROM 1 FOR 15)::uuid;
    -- The transaction id before the generation (outbox._retention's bound on a switched table's
    -- writers). Read committed: the next statement's snapshot is taken after it. Repeatable read
    -- keeps an older snapshot: the row is locked, which raises a serialization failure if a switch
    -- committed since that snapshot and holds off a switch until this transaction ends.
    txid := pg_current_xact_id();
    IF current_setting('transaction_isolation') = 'read committed' THEN
        SELECT g.generation INTO current_table FROM outbox.generations g WHERE g.state = 'current';
    ELSE
        SELECT g.generation INTO current_table FROM outbox.generations g WHERE g.state = 'current' FOR SHARE;
    END IF;
    -- The shard: the hash's low four bits.
    CASE current_table
        WHEN 0 THEN
            INSERT INTO outbox.events_0 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
            VALUES (txid, (hash & 15)::smallint, nextval('outbox.events_id_seq'), event_id, aggregate_type, aggregate_id, event_type, payload, stored_headers, stream, clock_timestamp());
        WHEN 1 THEN
            INSERT INTO outbox.events_1 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
            VALUES (txid, (hash & 15)::smallint, nextval('outbox.events_id_seq'), event_id, aggregate_type, aggregate_id, event_type, payload, stored_headers, stream, clock_timestamp());
        WHEN 2 THEN
            INSERT INTO outbox.events_2 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
            VALUES (txid, (hash & 15)::smallint, nextval('outbox.events_id_seq'), event_id, aggregate_type, aggregate_id, event_type, payload, stored_headers, stream, clock_timestamp());
        ELSE
            RAISE EXCEPTION 'outbox_enqueue: outbox.generations names no current table 0, 1 or 2';
    END CASE;
    RETURN event_id;
END
$fn$;
