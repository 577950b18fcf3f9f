-- outbox_pg schema: the outbox table and the indexes the relay worker relies on.
-- Runs first in the install script (bootstrap), before any function is created.

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

CREATE TABLE outbox.messages (
    -- Ascending, but not commit order: a lower id can commit after a higher one.
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Stable identity of the event, sent in every stream entry so consumers can deduplicate.
    event_id       uuid        NOT NULL UNIQUE,
    -- Identifiers compare byte-wise (COLLATE "C"): cheaper in every index probe and lock-step with
    -- how Redis sees keys; their sort order is not meant for humans.
    aggregate_type text        COLLATE "C" NOT NULL CHECK (aggregate_type <> ''),
    aggregate_id   text        COLLATE "C" NOT NULL CHECK (aggregate_id <> ''),
    -- 1, 2, 3, ... per (aggregate_type, aggregate_id), gap-free in commit order; sent with the entry.
    aggregate_seq  bigint      NOT NULL CHECK (aggregate_seq > 0),
    event_type     text        NOT NULL CHECK (event_type <> ''),
    payload        jsonb       NOT NULL,
    headers        jsonb       CHECK (headers IS NULL OR jsonb_typeof(headers) = 'object'),
    -- Explicit stream for this event; NULL means "use the outbox.stream template".
    stream         text        CHECK (stream IS NULL OR octet_length(stream) BETWEEN 1 AND 512),
    status         text        NOT NULL DEFAULT 'pending'
                               CHECK (status IN ('pending', 'publishing', 'published', 'failed', 'skipped')),
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    claimed_at     timestamptz,
    -- A session's claim (outbox._claim_batch): when, and its process id, to return claims of one
    -- that exited or whose lease expired. Relays keep their claims in shared memory instead.
    claimed_by     integer,
    published_at   timestamptz,
    -- Not before this time (per-event backoff after Redis rejected the event); NULL = at once.
    available_at   timestamptz,
    -- Publish attempts so far, whatever the outcome: counted when a relay settles its claim (a
    -- relay's claim is in shared memory and writes nothing), or when a session claims the row.
    attempts       integer     NOT NULL DEFAULT 0,
    -- Attempts Redis rejected because of the event itself; at outbox.max_attempts it is dead-lettered.
    rejections     integer     NOT NULL DEFAULT 0,
    failed_at      timestamptz,
    last_error     text,
    -- A session's claim always says when and by whom, so that the reaper can return it.
    CONSTRAINT messages_claim_recorded CHECK (status <> 'publishing' OR (claimed_at IS NOT NULL AND claimed_by IS NOT NULL))
);

COMMENT ON TABLE outbox.messages IS
    'outbox_pg: events written by outbox_enqueue() in the caller''s transaction; the relay worker publishes committed rows to Redis Streams';
COMMENT ON COLUMN outbox.messages.id IS 'Ascending identity; the relay publishes oldest first. Not commit order across transactions.';
COMMENT ON COLUMN outbox.messages.event_id IS 'Stable event identity (UUIDv7), sent as the entry field event_id; consumers deduplicate on it';
COMMENT ON COLUMN outbox.messages.stream IS 'Explicit Redis stream key; NULL means the outbox.stream template decides';
COMMENT ON COLUMN outbox.messages.aggregate_seq IS 'Per-aggregate sequence number (1, 2, 3, ...), gap-free in commit order; consumers use it to detect gaps and reordering';
COMMENT ON COLUMN outbox.messages.status IS 'pending -> published (a relay''s claim is held in shared memory; a session''s claim is publishing); failed (dead letter) until retried or skipped; see docs/worker.md';
COMMENT ON COLUMN outbox.messages.available_at IS 'Earliest next try after Redis rejected the event (per-event backoff); NULL means now';
COMMENT ON COLUMN outbox.messages.attempts IS 'Publish attempts, whatever the outcome: counted when a relay settles its claim, or when a session claims the row';
COMMENT ON COLUMN outbox.messages.rejections IS 'How many times Redis rejected this event because of the event itself; outbox.max_attempts dead-letters it';
COMMENT ON COLUMN outbox.messages.last_error IS 'Why the last publish attempt failed (Redis error text); NULL once published';

-- The last sequence number handed out per aggregate. One small row per aggregate ever seen; its row
-- lock is what serialises concurrent enqueues of the same aggregate (and only of that aggregate).
CREATE TABLE outbox.aggregates (
    aggregate_type text   COLLATE "C" NOT NULL,
    aggregate_id   text   COLLATE "C" NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);
COMMENT ON TABLE outbox.aggregates IS
    'outbox_pg: last aggregate_seq handed out per aggregate; kept after retention so that numbering never restarts';
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

CREATE INDEX processed_messages_processed_at_idx ON outbox.processed_messages (processed_at);
ALTER TABLE outbox.processed_messages SET (autovacuum_vacuum_scale_factor = 0.02);

-- The worker's queries touch only the rows these partial indexes hold, so their cost does not grow
-- with the number of published rows kept for retention.
CREATE INDEX messages_pending_idx ON outbox.messages (id) WHERE status = 'pending';
CREATE INDEX messages_publishing_idx ON outbox.messages (claimed_at) WHERE status = 'publishing';
CREATE INDEX messages_failed_idx ON outbox.messages (id) WHERE status = 'failed';
-- Per-aggregate order, two questions per claim (see _relay_batch):
-- "is an earlier event of this aggregate still undelivered?", asked once per aggregate in a batch;
CREATE INDEX messages_undelivered_idx ON outbox.messages (aggregate_type, aggregate_id, aggregate_seq)
    WHERE status IN ('pending', 'publishing', 'failed');
-- "does an earlier event of this aggregate block it?", asked of every pending row the claim reads.
-- Only rows in flight elsewhere, dead-lettered or backing off can block, and the relay's own writes
-- never put a row here (pending -> published), so this index is almost always empty and the probe
-- costs one page, however many events of the aggregate are pending.
CREATE INDEX messages_blocking_idx ON outbox.messages (aggregate_type, aggregate_id, aggregate_seq)
    WHERE status IN ('publishing', 'failed') OR (status = 'pending' AND available_at IS NOT NULL);
-- Retention deletes, and the stats read, the oldest and newest published rows through it.
CREATE INDEX messages_published_idx ON outbox.messages (published_at) WHERE status IN ('published', 'skipped');

-- Every row is updated at least twice and later deleted: vacuum it early and often so dead tuples
-- and the partial indexes stay small under sustained load.
ALTER TABLE outbox.messages SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02,
    fillfactor = 90
);

-- pg_dump must keep undelivered events (and the id sequence, so restored ids keep ascending).
SELECT pg_catalog.pg_extension_config_dump('outbox.messages', 'WHERE status <> ''published''');
SELECT pg_catalog.pg_extension_config_dump('outbox.messages_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.aggregates', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.processed_messages', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.consumers', '');

-- Writers get nothing here: they enqueue through outbox_enqueue (SECURITY DEFINER) and cannot read
-- other writers' payloads. Admins read everything and repair through the functions
-- (retry_failed, skip_failed, purge: SECURITY DEFINER), never by writing rows: a hand-written
-- status could hide an event from the relay or mark one published that never was.
GRANT USAGE ON SCHEMA outbox TO outbox_admin;
GRANT SELECT ON outbox.messages TO outbox_admin;
GRANT SELECT ON outbox.aggregates TO outbox_admin;
GRANT SELECT, DELETE ON outbox.processed_messages TO outbox_admin;
GRANT SELECT, DELETE ON outbox.consumers TO outbox_admin;
