-- The test build's helpers: functions only tests call, to look at what the relays read from SQL.
-- Loaded only in builds with the pg_test feature (src/lib.rs, under #[cfg(any(test, feature =
-- "pg_test"))]): the test build that scripts/test.sh installs and every test runs against. A
-- production install (cargo pgrx install or package, the Debian package) has none of them, so no
-- upgrade script carries them. They live in schema tests, where pgrx puts the #[pg_test] functions
-- and which only the test build has; tests/upgrade.rs leaves that schema out when it compares an
-- upgraded installation with a fresh one. Their C functions (read_log, read_window, counters, shard_of) are
-- compiled into the test build only, too.

CREATE SCHEMA IF NOT EXISTS tests;
COMMENT ON SCHEMA tests IS
    'outbox_pg test build only: the #[pg_test] functions and the helpers tests call';

-- An event as a round reads it from the log: its transaction, its id, and the stream entry's
-- fields as text (created_at in RFC 3339, UTC).
CREATE TYPE tests.log_event AS (
    txid           bigint,
    id             bigint,
    event_id       text,
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        text,
    headers        text,
    stream         text,
    created_at     text
);
COMMENT ON TYPE tests.log_event IS
    'Test build only: an event as a round reads it from the log (tests.read_log, tests.read_shard)';

-- -------------------------------------------------------------------------------------------------
-- tests.read_log(the_shard, cursor, upto, max_events)
--
--     What a round with an allowance of max_events events would read of one shard's window,
--     between cursor and upto, in publish order: the relays' own code (src/log/window.rs), run
--     from SQL.
--
-- Parameters:
--     the_shard   0..15
--     cursor      the shard's cursor, a pg_snapshot in its text form
--     upto        the snapshot the window reads up to, likewise
--     max_events  the allowance, 0 or more
-- Returns:
--     the events, as tests.log_event rows
-- Reads:   outbox.events_0..2 through their (shard, txid, id) indexes, without the planner
-- Called by: tests.read_shard; the pg_tests (src/tests/sql_api.rs)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION tests.read_log(the_shard smallint, cursor text, upto text, max_events integer)
RETURNS SETOF tests.log_event
LANGUAGE c STRICT VOLATILE
AS 'MODULE_PATHNAME', 'read_log_wrapper';

COMMENT ON FUNCTION tests.read_log(smallint, text, text, integer) IS
    'Test build only: what a round would read of one shard''s window between cursor and upto (text snapshots), in publish order';

-- -------------------------------------------------------------------------------------------------
-- tests.read_shard(the_shard, cursor, upto, max_events)
--
--     tests.read_log for snapshots given as pg_snapshot, e.g. a shard's cursor from outbox.shards.
--
-- Called by: the pg_tests (src/tests/sql_api.rs), tests/operations.rs
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION tests.read_shard(the_shard smallint, cursor pg_snapshot, upto pg_snapshot, max_events integer)
RETURNS SETOF tests.log_event
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT * FROM tests.read_log(the_shard, cursor::text, upto::text, max_events)
$fn$;

COMMENT ON FUNCTION tests.read_shard(smallint, pg_snapshot, pg_snapshot, integer) IS
    'Test build only: tests.read_log for pg_snapshot arguments, e.g. a shard''s cursor';

-- -------------------------------------------------------------------------------------------------
-- tests.read_window(the_shard, cursor, upto, window_max_id, window_last_id, max_events, max_bytes,
--                   taken)
--
--     What the in-server relay's read (src/log/window.rs's read_shard) takes of one shard's window
--     from a position with an allowance, in the shape of outbox._read_window (src/sql/relay/read.sql):
--     the events in publish order, then a row with complete and the position.
--
-- Called by: tests/relay_sql.rs, which compares the two
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION tests.read_window(the_shard smallint, cursor text, upto text, window_max_id bigint,
                                  window_last_id bigint, max_events integer, max_bytes bigint, taken integer)
RETURNS TABLE (txid bigint, txn_max_id bigint, id bigint, event_id text, aggregate_type text,
               aggregate_id text, event_type text, payload text, headers text, stream text,
               created_at text, traceparent text, tracestate text, size bigint,
               complete boolean, position_max_id bigint, position_last_id bigint)
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'read_window_wrapper';

COMMENT ON FUNCTION tests.read_window(smallint, text, text, bigint, bigint, integer, bigint, integer) IS
    'Test build only: what the in-server relay''s read takes of one shard''s window, in the shape of outbox._read_window';

-- -------------------------------------------------------------------------------------------------
-- tests.cursor_below(upto, bound)
--
--     The cursor that consumes, of snapshot upto, only the transactions below bound, so that a test
--     can read up to a chosen transaction (its own, which no snapshot of its own shows committed):
--     every transaction below bound is visible in it exactly when it is visible in upto; none from
--     bound on is.
--
-- Returns:
--     a pg_snapshot in its text form
-- Called by: the pg_tests (src/tests/sql_api.rs)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION tests.cursor_below(upto pg_snapshot, bound bigint)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT least(pg_snapshot_xmin(upto)::text::bigint, bound)::text || ':' || bound::text || ':'
           || array_to_string(ARRAY(SELECT x FROM pg_snapshot_xip(upto) AS x WHERE x::text::bigint < bound ORDER BY x), ',')
$fn$;

COMMENT ON FUNCTION tests.cursor_below(pg_snapshot, bigint) IS
    'Test build only: the cursor that consumes, of upto, only the transactions below bound';

-- -------------------------------------------------------------------------------------------------
-- tests.counters(aggregate_types, aggregate_ids)
--
--     The last aggregate_seq of each of these aggregates, read the way the relays read them: one
--     primary-key probe per aggregate, straight from the index (src/log/counters.rs).
--
-- Parameters:
--     aggregate_types, aggregate_ids  the aggregates, aggregate_types[n] with aggregate_ids[n]
-- Returns:
--     ordinal (the 1-based position n) and last_seq of each aggregate that has a counter
-- Reads:   outbox.aggregates through aggregates_pkey
-- Called by: the pg_tests (src/tests/sql_api.rs), tests/operations.rs
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION tests.counters(aggregate_types text[], aggregate_ids text[])
RETURNS TABLE (ordinal bigint, last_seq bigint)
LANGUAGE c STRICT STABLE
AS 'MODULE_PATHNAME', 'counters_wrapper';

COMMENT ON FUNCTION tests.counters(text[], text[]) IS
    'Test build only: the last aggregate_seq of each of these aggregates, read as the relays read it';

-- -------------------------------------------------------------------------------------------------
-- tests.shard_of(aggregate_type, aggregate_id)
--
--     The shard (0..15) of an aggregate, as outbox_enqueue computes it (src/enqueue/order.rs).
--
-- Called by: the pg_tests (src/tests/sql_api.rs), tests/faults.rs, tests/interleavings.rs (to
--            find an aggregate in each shard)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION tests.shard_of(aggregate_type text, aggregate_id text)
RETURNS smallint
LANGUAGE c IMMUTABLE STRICT PARALLEL SAFE
AS 'MODULE_PATHNAME', 'shard_of_wrapper';

COMMENT ON FUNCTION tests.shard_of(text, text) IS
    'Test build only: the shard (0..15) of an aggregate, as outbox_enqueue computes it';

-- Like the relays' own functions, not for every role: read_log and counters read rows without
-- checking privileges.
REVOKE ALL ON FUNCTION tests.read_log(smallint, text, text, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION tests.read_shard(smallint, pg_snapshot, pg_snapshot, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION tests.read_window(smallint, text, text, bigint, bigint, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION tests.cursor_below(pg_snapshot, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION tests.counters(text[], text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION tests.shard_of(text, text) FROM PUBLIC;
