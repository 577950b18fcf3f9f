-- The W3C trace context's rules (protocol/src/trace.rs) in SQL, in both installs: the SQL-only
-- outbox_enqueue refuses a trace context by them (src/sql/sql_only/enqueue.sql), and the window read
-- (src/sql/relay/read.sql) finds the trace context an event's headers carry by them, as the Rust
-- relay's TraceContext::from_headers does, since it counts in the event's size.

-- A value as Rust's {:?} shows a string (quoted, \ " and the common control characters escaped),
-- after protocol/src/trace.rs's `shorten` when `shorten` (at most 60 characters, then '...').
CREATE FUNCTION outbox._debug_string(value text, shorten boolean) RETURNS text
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

-- Why a traceparent is not valid W3C (protocol/src/trace.rs, check_traceparent), NULL when it is.
CREATE FUNCTION outbox._traceparent_problem(value text) RETURNS text
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

-- Why a tracestate is not valid W3C (protocol/src/trace.rs, check_tracestate), NULL when it is.
CREATE FUNCTION outbox._tracestate_problem(value text) RETURNS text
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

-- The traceparent an event's headers carry, as outbox_sink's TraceContext::from_headers takes it: a
-- JSON string under "traceparent" of headers that are an object, valid W3C; else NULL.
CREATE FUNCTION outbox._traceparent(headers jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT CASE WHEN pg_catalog.jsonb_typeof(headers -> 'traceparent') = 'string'
                     AND outbox._traceparent_problem(headers ->> 'traceparent') IS NULL
                THEN headers ->> 'traceparent' END
$fn$;
COMMENT ON FUNCTION outbox._traceparent(jsonb) IS
    'Internal: the valid W3C traceparent an event''s headers carry, else NULL';

-- The tracestate that goes with it: only beside a valid traceparent, a JSON string, not empty,
-- valid W3C; else NULL.
CREATE FUNCTION outbox._tracestate(headers jsonb) RETURNS text
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
