-- outbox_pg's data: the schema, its roles, and every table, with the indexes the relays and
-- outbox_enqueue rely on: the log (three tables and the view over them), the generations
-- retention moves them through, the shards and their cursors, the failure path, the per-aggregate
-- counters, consumer dedup, and which database the installation belongs to. Runs first in the
-- install script (bootstrap), before any function is created; the functions follow the way an
-- event goes (src/lib.rs lists the files in order).

-- The schema name is part of the contract (the worker and the docs use it), so refuse to adopt an
-- existing schema of the same name rather than mixing our objects with a user's.
DO $guard$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = 'outbox') THEN
        RAISE EXCEPTION 'outbox_pg: schema "outbox" already exists'
            USING ERRCODE = 'duplicate_schema',
                  DETAIL = 'outbox_pg creates and owns the schema "outbox" for its table and functions.',
                  HINT = 'Rename or drop the existing schema "outbox", then run CREATE EXTENSION outbox_pg again.';
    END IF;
END
$guard$;

-- Events travel as UTF-8 JSON, and the relay reads every text column as UTF-8. In a database of
-- another encoding one event with a non-ASCII character would be unreadable to the relay, so the
-- extension refuses such a database up front rather than fail at the first accented name.
DO $encoding$
BEGIN
    IF pg_catalog.getdatabaseencoding() <> 'UTF8' THEN
        RAISE EXCEPTION 'outbox_pg: database "%" uses encoding %, but outbox_pg needs UTF8',
                pg_catalog.current_database(), pg_catalog.getdatabaseencoding()
            USING ERRCODE = 'feature_not_supported',
                  DETAIL = 'Events are published to Redis as UTF-8; the relay reads every event''s text as UTF-8.',
                  HINT = 'Install outbox_pg in a UTF8 database, e.g. CREATE DATABASE app ENCODING ''UTF8'' TEMPLATE template0.';
    END IF;
END
$encoding$;

CREATE SCHEMA outbox;
COMMENT ON SCHEMA outbox IS 'outbox_pg: the outbox table and the relay''s functions';

-- Roles are cluster-wide and outlive the extension (DROP EXTENSION leaves them), so create them only
-- when missing: a second database with the extension reuses them. A role of the same name that
-- outbox_pg did not create (its comment is the mark) is refused rather than adopted: it may be
-- another application's, with members who would silently gain these privileges.
DO $roles$
DECLARE
    role_name text;
    role_comment text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['outbox_writer', 'outbox_consumer', 'outbox_admin'] LOOP
        SELECT pg_catalog.shobj_description(r.oid, 'pg_authid') INTO role_comment
          FROM pg_catalog.pg_roles r WHERE r.rolname = role_name;
        IF FOUND AND coalesce(role_comment, '') NOT LIKE 'outbox_pg:%' THEN
            RAISE EXCEPTION 'outbox_pg: role "%" already exists and was not created by outbox_pg', role_name
                USING ERRCODE = 'duplicate_object',
                      DETAIL = 'outbox_pg grants its privileges to the roles outbox_writer, outbox_consumer and outbox_admin; adopting a role it did not create would hand them to that role''s members.',
                      HINT = format('Rename or drop the existing role (ALTER ROLE %I RENAME TO ...), or, if it is meant for outbox_pg, mark it with COMMENT ON ROLE %I IS ''outbox_pg: ...''; then run CREATE EXTENSION outbox_pg again.', role_name, role_name);
        END IF;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_writer') THEN
        CREATE ROLE outbox_writer NOLOGIN;
        COMMENT ON ROLE outbox_writer IS 'outbox_pg: may call outbox_enqueue; reads no outbox rows';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_consumer') THEN
        CREATE ROLE outbox_consumer NOLOGIN;
        COMMENT ON ROLE outbox_consumer IS 'outbox_pg: may call outbox_mark_processed (consumer-side deduplication) under the consumer names it owns';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_admin') THEN
        CREATE ROLE outbox_admin NOLOGIN;
        COMMENT ON ROLE outbox_admin IS 'outbox_pg: reads outbox rows and stats; retries, skips and purges events through outbox''s functions';
    END IF;
END
$roles$;

-- -------------------------------------------------------------------------------------------------
-- The event log. Events are inserted once and never updated or deleted: the relays keep their
-- place with a cursor per shard (outbox.shards), and retention truncates whole tables. Three tables
-- take turns (generations): the current one receives new events; a closed one is truncated once
-- every shard's cursor has passed all of it and it is older than outbox.retention. See
-- docs/worker.md, "The log".
-- -------------------------------------------------------------------------------------------------

-- Ascending across the three tables: within an aggregate, id order is commit order (enqueues of
-- one aggregate take turns, see src/enqueue/order.rs), and the relay sends in id order.
CREATE SEQUENCE outbox.events_id_seq AS bigint;
COMMENT ON SEQUENCE outbox.events_id_seq IS
    'outbox_pg: event ids, ascending across the three log tables (within an aggregate, id order is commit order)';

DO $tables$
BEGIN
    FOR generation IN 0..2 LOOP
        EXECUTE format($ddl$
            CREATE TABLE outbox.events_%1$s (
                -- The inserting transaction: a batch is the events whose transactions became
                -- visible between the shard's cursor and a new snapshot.
                txid           xid8        NOT NULL,
                -- hash(aggregate) mod 16: a shard is the unit of work relays claim.
                shard          smallint    NOT NULL,
                id             bigint      NOT NULL,
                -- Stable identity of the event, sent in every stream entry: consumers deduplicate.
                event_id       uuid        NOT NULL,
                -- Identifiers compare byte-wise (COLLATE "C"), in lock-step with how Redis sees keys.
                aggregate_type text        COLLATE "C" NOT NULL,
                aggregate_id   text        COLLATE "C" NOT NULL,
                event_type     text        NOT NULL,
                payload        jsonb       NOT NULL,
                headers        jsonb,
                -- Explicit stream for this event; NULL means "use the outbox.stream template".
                stream         text,
                created_at     timestamptz NOT NULL
            ) WITH (
                -- Insert-only and truncated whole: nothing for vacuum to reclaim. (Anti-wraparound
                -- vacuums still run; analyze keeps the relays' index plans honest.)
                autovacuum_vacuum_insert_threshold = -1,
                autovacuum_analyze_scale_factor = 0.02
            )$ddl$, generation);
        -- The relays' only access path: a shard's transactions in txid order, each transaction's
        -- events in id order (a window too large for one round is read on from an id:
        -- src/log/window.rs). The relays open it by name.
        EXECUTE format('CREATE INDEX events_%1$s_batch_idx ON outbox.events_%1$s (shard, txid, id)', generation);
        -- Operators' and the failure path's: an event by its event_id.
        EXECUTE format('CREATE INDEX events_%1$s_event_id_idx ON outbox.events_%1$s (event_id)', generation);
        EXECUTE format($c$COMMENT ON TABLE outbox.events_%1$s IS
            'outbox_pg: events written by outbox_enqueue (generation %1$s of 3; read them through outbox.messages)'$c$, generation);
        EXECUTE format($c$COMMENT ON INDEX outbox.events_%1$s_batch_idx IS
            'outbox_pg: the relays'' only access path to the log, a shard''s transactions in txid order (opened by name)'$c$, generation);
        EXECUTE format($c$COMMENT ON INDEX outbox.events_%1$s_event_id_idx IS
            'outbox_pg: an event by its event_id (outbox.messages, the failure path)'$c$, generation);
    END LOOP;
END
$tables$;

-- All the events, whichever generation holds them. Reading through this view lets the planner
-- merge the three tables' (shard, txid) index scans in txid order.
CREATE VIEW outbox.events AS
    SELECT 0::smallint AS generation, e.* FROM outbox.events_0 e
    UNION ALL
    SELECT 1::smallint, e.* FROM outbox.events_1 e
    UNION ALL
    SELECT 2::smallint, e.* FROM outbox.events_2 e;
COMMENT ON VIEW outbox.events IS 'outbox_pg: the event log, all three generations';

CREATE TABLE outbox.generations (
    generation   smallint    PRIMARY KEY CHECK (generation BETWEEN 0 AND 2),
    -- current: receives new events; closing: switched away from, writers may still be inserting;
    -- closed: no writer left (closed_below known); empty: truncated, ready to become current.
    state        text        NOT NULL CHECK (state IN ('current', 'closing', 'closed', 'empty')),
    opened_at    timestamptz,
    closed_at    timestamptz,
    -- The transaction that switched away from this table: it must have committed before a
    -- snapshot can bound the table's writers.
    switched_by  xid8,
    -- Every transaction that may have written to this table has a lower txid (the next txid to be
    -- assigned, read after a snapshot that sees the switch committed: outbox._retention). A shard
    -- whose cursor's xmin has reached it has consumed everything in the table.
    closed_below xid8,
    -- When every shard's cursor was first seen past closed_below: the table's last event was
    -- published (or moved to outbox.held) by then. Retention counts from here.
    consumed_at  timestamptz,
    -- Set by outbox.purge(older_than): the table keeps its events no longer than this after
    -- consumed_at, even when outbox.retention is longer.
    keep_for     interval
);
CREATE UNIQUE INDEX generations_one_current ON outbox.generations ((true)) WHERE state = 'current';
COMMENT ON INDEX outbox.generations_one_current IS
    'outbox_pg: one current table at most; outbox_enqueue finds it through this index (by name)';
INSERT INTO outbox.generations (generation, state, opened_at)
VALUES (0, 'current', clock_timestamp()), (1, 'empty', NULL), (2, 'empty', NULL);
COMMENT ON TABLE outbox.generations IS
    'outbox_pg: the three event tables'' turns: which one receives events, and when each may be truncated';

-- -------------------------------------------------------------------------------------------------
-- outbox._initial_cursor()
--
--     The cursor a new installation starts from: every transaction visible now is consumed,
--     except the caller's, which may enqueue events itself (CREATE EXTENSION, a restore's rebase).
--
-- Returns:
--     a pg_snapshot
-- Called by: the shards' rows below; outbox._rebase (restore.sql); outbox.adopt_copy (copies.sql)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._initial_cursor() RETURNS pg_snapshot
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

-- The unit of work. A relay claims shards (FOR UPDATE SKIP LOCKED) and keeps them with a lease it
-- renews; the reaper returns the shards of a relay that exited or whose lease expired.
CREATE TABLE outbox.shards (
    shard      smallint    PRIMARY KEY CHECK (shard BETWEEN 0 AND 15),
    -- Consumed: every transaction visible in this snapshot (its events were published, or moved to
    -- outbox.held). Moves only when a batch finishes.
    cursor     pg_snapshot NOT NULL,
    cursor_at  timestamptz NOT NULL,
    claimed_by integer,
    claimed_at timestamptz,
    -- A window too large for one round (more than 10,000 events or 16 MB: one large transaction,
    -- a backlog) is published in parts: its end, and the position up to which it is consumed (the
    -- largest id of a transaction, and the last id of it published; src/log/window.rs). NULL
    -- otherwise.
    window_upto    pg_snapshot,
    window_max_id  bigint,
    window_last_id bigint,
    CONSTRAINT shards_claim_recorded CHECK ((claimed_by IS NULL) = (claimed_at IS NULL)),
    CONSTRAINT shards_window_whole CHECK ((window_upto IS NULL) = (window_max_id IS NULL)
                                          AND (window_upto IS NULL) = (window_last_id IS NULL))
) WITH (fillfactor = 50);
INSERT INTO outbox.shards (shard, cursor, cursor_at)
SELECT s, outbox._initial_cursor(), clock_timestamp() FROM generate_series(0, 15) AS s;
COMMENT ON TABLE outbox.shards IS
    'outbox_pg: per shard, the relays'' cursor (what is consumed) and which relay holds the shard';

-- When each shard's cursor passed where, at most about once a second per shard: what
-- outbox.messages reads published_at from (the first tick whose cursor includes the event).
CREATE TABLE outbox.ticks (
    shard  smallint    NOT NULL,
    cursor pg_snapshot NOT NULL,
    at     timestamptz NOT NULL
);
CREATE INDEX ticks_shard_at_idx ON outbox.ticks (shard, at);
COMMENT ON TABLE outbox.ticks IS
    'outbox_pg: when each shard''s cursor passed where, about once a second at most: outbox.messages.published_at';
COMMENT ON INDEX outbox.ticks_shard_at_idx IS
    'outbox_pg: a shard''s ticks in time order (published_at; the latest, for outbox.stats.last_published_at)';

-- Snapshots taken about once a second while events are undelivered (by housekeeping), kept until
-- every cursor has passed them: PgQ's ticks. A shard whose cursor lags (after an outage, or behind a
-- backlog) reads up to the first of them after its cursor instead of up to now, so that a round
-- holds about a second of traffic per shard rather than the whole backlog. A later snapshot sees
-- every transaction an earlier one saw committed, so windows between them keep commit order.
CREATE TABLE outbox.snapshots (
    taken_at    timestamptz PRIMARY KEY,
    snap        pg_snapshot NOT NULL,
    -- The transaction that recorded it (NULL in rows recorded before 0.4.0). taken_at is that
    -- transaction's start, and it drew its txid later: every txid above this one was drawn after
    -- taken_at, so no event of such a transaction is older than taken_at (the age check's bound,
    -- src/log/pending.rs). A snapshot's xmax is no such bound: a transaction that drew its txid
    -- before the snapshot and was still running is at or above it, and not in its xip.
    recorded_by xid8
);
COMMENT ON TABLE outbox.snapshots IS
    'outbox_pg: snapshots taken while events were undelivered; a lagging shard reads up to the next one rather than the whole backlog';

-- The failure path: events Redis rejected (with their aggregate's later events waiting behind
-- them), and events waiting behind those. Written only when something goes wrong; every column of
-- the event is copied, so that retention may truncate its table.
CREATE TABLE outbox.held (
    id            bigint      PRIMARY KEY,
    event_id      uuid        NOT NULL UNIQUE,
    shard         smallint    NOT NULL,
    aggregate_type text       COLLATE "C" NOT NULL,
    aggregate_id  text        COLLATE "C" NOT NULL,
    -- Assigned when the event left the log; the entry carries it when it is finally published.
    aggregate_seq bigint      NOT NULL,
    event_type    text        NOT NULL,
    payload       jsonb       NOT NULL,
    headers       jsonb,
    stream        text,
    created_at    timestamptz NOT NULL,
    -- waiting: to be published (backing off if available_at is set); failed: dead letter, holds its
    -- aggregate until retried or skipped; published / skipped: done (kept for retention).
    status        text        NOT NULL DEFAULT 'waiting' CHECK (status IN ('waiting', 'failed', 'published', 'skipped')),
    attempts      integer     NOT NULL DEFAULT 0,
    rejections    integer     NOT NULL DEFAULT 0,
    available_at  timestamptz,
    failed_at     timestamptz,
    published_at  timestamptz,
    last_error    text
);
CREATE INDEX held_undelivered_idx ON outbox.held (shard, aggregate_type, aggregate_id, aggregate_seq)
    WHERE status IN ('waiting', 'failed');
CREATE INDEX held_done_idx ON outbox.held (published_at) WHERE status IN ('published', 'skipped');
COMMENT ON INDEX outbox.held_undelivered_idx IS
    'outbox_pg: what the failure path still holds, per shard and aggregate in aggregate_seq order; the relay''s statements spell its predicate to use it';
COMMENT ON INDEX outbox.held_done_idx IS
    'outbox_pg: the failure path''s published and skipped rows by age, for retention';
COMMENT ON TABLE outbox.held IS
    'outbox_pg: events Redis rejected, dead letters, and the events of their aggregates waiting behind them';

-- The last aggregate_seq handed out per aggregate, advanced when a batch finishes. Kept after
-- retention, so that numbering never restarts (outbox.forget_aggregates() is the opt-in way out).
CREATE TABLE outbox.aggregates (
    aggregate_type text   COLLATE "C" NOT NULL,
    aggregate_id   text   COLLATE "C" NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);
COMMENT ON TABLE outbox.aggregates IS
    'outbox_pg: last aggregate_seq handed out per aggregate; kept after retention so that numbering never restarts';
COMMENT ON INDEX outbox.aggregates_pkey IS
    'outbox_pg: the relays read each aggregate''s counter through this index (by name), one probe per aggregate';
-- Only last_seq changes, which no index covers: every update can be HOT, in place on its page.
ALTER TABLE outbox.aggregates SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);

-- Consumer-side deduplication for consumers that write to PostgreSQL: outbox_mark_processed()
-- records (consumer, event_id) in the consumer's own transaction, together with its effect.
CREATE TABLE outbox.processed_messages (
    consumer     text        NOT NULL CHECK (consumer <> ''),
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer, event_id)
);
COMMENT ON TABLE outbox.processed_messages IS
    'outbox_pg: events each consumer has processed (consumer-side deduplication); kept for outbox.retention';
CREATE INDEX processed_messages_processed_at_idx ON outbox.processed_messages (processed_at);
COMMENT ON INDEX outbox.processed_messages_processed_at_idx IS
    'outbox_pg: dedup marks by age, for outbox.retention and outbox.purge_processed';
ALTER TABLE outbox.processed_messages SET (autovacuum_vacuum_scale_factor = 0.02);

-- Who may record under a consumer name: the role that used it first (and that role's members).
-- Without it any outbox_consumer could mark events processed for another consumer, which would
-- then skip them. An admin releases a name by deleting its row.
CREATE TABLE outbox.consumers (
    consumer      text        PRIMARY KEY CHECK (consumer <> ''),
    owner         regrole     NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
COMMENT ON TABLE outbox.consumers IS
    'outbox_pg: consumer names and the role that owns each (its first user); only that role and its members may call outbox_mark_processed under the name';

-- Which database this installation belongs to. CREATE DATABASE ... TEMPLATE copies a database
-- with its outbox: the copy's relays find another database's OID here and publish nothing until an
-- admin says what the copy is (outbox.adopt_copy), since the copied events are the original's and
-- the copied counters would number the copy's events like the original's. Not dumped: a restore
-- gets the row CREATE EXTENSION makes in the database it restores into.
CREATE TABLE outbox.installation (
    database_oid oid         NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE UNIQUE INDEX installation_one_row ON outbox.installation ((true));
COMMENT ON INDEX outbox.installation_one_row IS 'outbox_pg: one row at most';
INSERT INTO outbox.installation (database_oid)
SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database();
COMMENT ON TABLE outbox.installation IS
    'outbox_pg: the database this outbox belongs to; a copy made by CREATE DATABASE ... TEMPLATE is not relayed until outbox.adopt_copy()';

-- The relays running outside the server (outbox-relay), one row per connection, so that relays
-- configured differently refuse to run together (outbox._join_relays) and outbox.outside_relays
-- shows who relays. Unlogged: it describes connections, which a crash ends anyway; a row whose
-- backend is gone is ignored and removed by the next relay that joins.
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

-- pg_dump keeps the log (undelivered events among it), cursors, counters, the failure path and the
-- dedup marks. The txid values and cursors belong to the dumped cluster: a restore rebases them onto
-- the new cluster's counter (restore.sql). Ticks are not kept: the rebase leaves one per shard.
SELECT pg_catalog.pg_extension_config_dump('outbox.events_0', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.events_1', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.events_2', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.events_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.generations', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.shards', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.held', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.aggregates', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.processed_messages', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.consumers', '');

-- Writers get nothing here: they enqueue through outbox_enqueue (SECURITY DEFINER) and cannot read
-- other writers' payloads. Admins read everything (outbox.messages, in operations.sql, is the view
-- to read) and repair through the functions (retry_failed, skip_failed, purge: SECURITY DEFINER),
-- never by writing rows.
GRANT USAGE ON SCHEMA outbox TO outbox_admin;
GRANT SELECT ON outbox.events_0, outbox.events_1, outbox.events_2, outbox.generations, outbox.shards,
                outbox.ticks, outbox.snapshots, outbox.held, outbox.aggregates, outbox.installation,
                outbox.outside_relays TO outbox_admin;
GRANT SELECT ON outbox.events TO outbox_admin;
GRANT SELECT, DELETE ON outbox.processed_messages TO outbox_admin;
GRANT SELECT, DELETE ON outbox.consumers TO outbox_admin;
