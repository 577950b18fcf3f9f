-- outbox_pg 0.2.0 -> 0.3.0, the part written by hand: what an upgrade cannot take from src/sql/
-- (tables, indexes, sequences and their comments and grants, data, the Rust functions'
-- declarations, and the functions and indexes it must drop). `python3 scripts/sql.py write` puts
-- every function, view, trigger, comment and grant of src/sql/ after it (at `-- @replaceable`) and
-- writes sql/outbox_pg--0.2.0--0.3.0.sql; sql/README.md has the rules.

-- tests/upgrade.rs checks that the whole script makes a schema equal to a fresh 0.3.0 install.
\echo Use "ALTER EXTENSION outbox_pg UPDATE" to load this file. \quit

-- Bounded windows: snapshots recorded while events wait; a shard more than a second behind reads up
-- to the next one (docs/worker.md, "Catching up"). The claim returns each shard's own upto and
-- whether it is bounded; the batch read takes one upto per shard.
CREATE TABLE outbox.snapshots (
    taken_at timestamptz PRIMARY KEY,
    snap     pg_snapshot NOT NULL
);

COMMENT ON TABLE outbox.snapshots IS
    'outbox_pg: snapshots taken while events were undelivered; a lagging shard reads up to the next one rather than the whole backlog';

GRANT SELECT ON outbox.snapshots TO outbox_admin;

DROP FUNCTION outbox._claim_shards(integer, integer, integer);

-- The relays read the log in Rust, straight from its indexes (src/log/window.rs).
DROP FUNCTION outbox._read_batch(smallint[], text[], pg_snapshot, integer);

-- outbox_enqueue in Rust (src/enqueue/mod.rs): the same checks and the same row, through kept plans;
-- SECURITY DEFINER without a pinned search_path (its statements qualify every name). Its SQL
-- helper _prepare_enqueue is gone with the PL/pgSQL body.
CREATE OR REPLACE FUNCTION @extschema@.outbox_enqueue(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL,
    stream         text  DEFAULT NULL
) RETURNS uuid
LANGUAGE c VOLATILE PARALLEL UNSAFE
SECURITY DEFINER
AS 'MODULE_PATHNAME', 'outbox_enqueue_wrapper';

DROP FUNCTION outbox._prepare_enqueue(text, text, text, text);

-- The finish updates the counters the batch's read found and inserts the others (no INSERT ... ON
-- CONFLICT per new aggregate), and moves the shards first: one argument more.
DROP FUNCTION outbox._advance(integer, smallint[], text[], text[], text[], bigint[]);

-- -------------------------------------------------------------------------------------------------
-- Nothing committed is lost, under any interleaving (issue 23).
-- -------------------------------------------------------------------------------------------------

-- Retention: a closed table's bound is the next transaction id to be assigned (a snapshot's xmax
-- is not above every running writer); a table is truncated once it has been consumed for keep,
-- or for what outbox.purge asked (docs/worker.md, "Retention and table size").
CREATE  FUNCTION outbox."_next_xid"() RETURNS bigint /* i64 */
STRICT VOLATILE PARALLEL UNSAFE 
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'next_xid_wrapper';

ALTER TABLE outbox.generations ADD COLUMN consumed_at timestamptz, ADD COLUMN keep_for interval;

-- A table 0.2.0 closed may have a bound below a writer that was still running: raise it to one
-- that is above every transaction that has an id now.
UPDATE outbox.generations SET closed_below = greatest(closed_below, outbox._next_xid()::text::xid8) WHERE state = 'closed';

DROP FUNCTION outbox._retention(interval, boolean);

-- Order locks: the cap counts the locks held; past it, a shared lock that forget_aggregates takes
-- exclusively (src/enqueue/order.rs).
CREATE  FUNCTION outbox."_exclude_transactions_past_the_cap"() RETURNS bool /* bool */
STRICT VOLATILE PARALLEL UNSAFE 
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'exclude_transactions_past_the_cap_wrapper';

-- Bounded rounds: a window too large for one round is published in parts, transaction by
-- transaction in the order of their largest ids, read on from an id (src/log/window.rs).
ALTER TABLE outbox.shards ADD COLUMN window_upto pg_snapshot, ADD COLUMN window_max_id bigint,
                          ADD COLUMN window_last_id bigint,
                          ADD CONSTRAINT shards_window_whole CHECK ((window_upto IS NULL) = (window_max_id IS NULL)
                                          AND (window_upto IS NULL) = (window_last_id IS NULL));

DROP INDEX outbox.events_0_batch_idx;

CREATE INDEX events_0_batch_idx ON outbox.events_0 (shard, txid, id);

DROP INDEX outbox.events_1_batch_idx;

CREATE INDEX events_1_batch_idx ON outbox.events_1 (shard, txid, id);

DROP INDEX outbox.events_2_batch_idx;

CREATE INDEX events_2_batch_idx ON outbox.events_2 (shard, txid, id);

-- Copies: CREATE DATABASE ... TEMPLATE of a relayed database is not relayed until adopted.
CREATE TABLE outbox.installation (
    database_oid oid         NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE UNIQUE INDEX installation_one_row ON outbox.installation ((true));

INSERT INTO outbox.installation (database_oid)
SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database();

COMMENT ON TABLE outbox.installation IS
    'outbox_pg: the database this outbox belongs to; a copy made by CREATE DATABASE ... TEMPLATE is not relayed until outbox.adopt_copy()';

GRANT SELECT ON outbox.installation TO outbox_admin;

-- Health from index walks whatever the statistics (src/log/pending.rs): outbox._undelivered() is
-- replaced by outbox._health(), which outbox.stats and oldest_pending_age() read.
CREATE FUNCTION outbox._log_pending(count_events boolean)
RETURNS TABLE (events bigint, oldest timestamptz)
LANGUAGE c STRICT VOLATILE
AS 'MODULE_PATHNAME', 'log_pending_sql_wrapper';

-- Replay (src/sql/replay.sql): the journal of what each round published, replays, stream marks
-- and the losses the relays notice. Its Rust helpers first.
CREATE  FUNCTION outbox."_rescan_at_commit"() RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'rescan_at_commit_wrapper';

CREATE  FUNCTION outbox."_wake_for_replay"() RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'wake_for_replay_wrapper';

CREATE  FUNCTION outbox."_check_allowed_stream"(
	"stream" TEXT /* & str */
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'check_allowed_stream_for_replay_wrapper';

-- Replay: sending events Redis lost (or that a new consumer needs) again, from the outbox, which
-- keeps every published event for outbox.retention. docs/worker.md, "Replay" and "When Redis loses
-- entries"; the relay side is src/relay/replay.rs.
--
-- What each round published is journaled by its finish (outbox._advance): the event ids in the
-- order they went out and the aggregate_seq each was given. A replay walks that journal, so it
-- sends exactly the events that were published, in the order they were (commit order per
-- aggregate), with the aggregate_seq they had; it never sends an event that was not published,
-- and it marks nothing.

-- -------------------------------------------------------------------------------------------------
-- The journal: one row per finished round that published something, in the table of the log's
-- generation that was current then, truncated with it (outbox._retention). Insert-only.
-- -------------------------------------------------------------------------------------------------
CREATE SEQUENCE outbox.journal_round_seq AS bigint;

COMMENT ON SEQUENCE outbox.journal_round_seq IS
    'outbox_pg: numbers the journal''s rounds in the order they were finished';

SELECT pg_catalog.pg_extension_config_dump('outbox.journal_round_seq', '');

DO $tables$
BEGIN
    FOR generation IN 0..2 LOOP
        EXECUTE format($ddl$
            CREATE TABLE outbox.journal_%1$s (
                round       bigint      PRIMARY KEY,
                finished_at timestamptz NOT NULL,
                -- How many events the round published (the arrays' length).
                events      integer     NOT NULL,
                -- In the order Redis received them, and the aggregate_seq each was sent with.
                event_ids   uuid[]      NOT NULL,
                seqs        bigint[]    NOT NULL,
                -- The stream keys they went to, so that a repair walks only the rounds that wrote
                -- to the stream Redis lost (NULL: not recorded, walked whatever the stream).
                streams     text[]
            ) WITH (autovacuum_vacuum_insert_threshold = -1)$ddl$, generation);
        -- Stored out of line as they are: a round's ids (16 bytes of randomness each) do not
        -- compress, and trying (pglz) took 13% of the relay's CPU in a drain.
        EXECUTE format('ALTER TABLE outbox.journal_%1$s ALTER COLUMN event_ids SET STORAGE EXTERNAL,
                                                      ALTER COLUMN seqs SET STORAGE EXTERNAL', generation);
        EXECUTE format('CREATE INDEX journal_%1$s_finished_idx ON outbox.journal_%1$s (finished_at)', generation);
        EXECUTE format($c$COMMENT ON TABLE outbox.journal_%1$s IS
            'outbox_pg: what each round published while log table %1$s was current (read it through outbox.journal)'$c$,
            generation);
        EXECUTE format('SELECT pg_catalog.pg_extension_config_dump(''outbox.journal_%1$s'', '''')', generation);
    END LOOP;
END
$tables$;

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
GRANT SELECT ON outbox.redis_losses, outbox.stream_marks TO outbox_admin;
GRANT SELECT ON outbox.redis_losses TO pg_monitor;

-- -------------------------------------------------------------------------------------------------
-- A COMMENT on every object (src/sql/, one file per concern; issue 25).
-- -------------------------------------------------------------------------------------------------
-- The data (schema.sql).
COMMENT ON SEQUENCE outbox.events_id_seq IS
    'outbox_pg: event ids, ascending across the three log tables (within an aggregate, id order is commit order)';

COMMENT ON INDEX outbox.events_0_batch_idx IS
    'outbox_pg: the relays'' only access path to the log, a shard''s transactions in txid order (opened by name)';

COMMENT ON INDEX outbox.events_1_batch_idx IS
    'outbox_pg: the relays'' only access path to the log, a shard''s transactions in txid order (opened by name)';

COMMENT ON INDEX outbox.events_2_batch_idx IS
    'outbox_pg: the relays'' only access path to the log, a shard''s transactions in txid order (opened by name)';

COMMENT ON INDEX outbox.events_0_event_id_idx IS
    'outbox_pg: an event by its event_id (outbox.messages, the failure path)';

COMMENT ON INDEX outbox.events_1_event_id_idx IS
    'outbox_pg: an event by its event_id (outbox.messages, the failure path)';

COMMENT ON INDEX outbox.events_2_event_id_idx IS
    'outbox_pg: an event by its event_id (outbox.messages, the failure path)';

COMMENT ON INDEX outbox.generations_one_current IS
    'outbox_pg: one current table at most; outbox_enqueue finds it through this index (by name)';

COMMENT ON TABLE outbox.ticks IS
    'outbox_pg: when each shard''s cursor passed where, about once a second at most: outbox.messages.published_at';

COMMENT ON INDEX outbox.ticks_shard_at_idx IS
    'outbox_pg: a shard''s ticks in time order (published_at; the latest, for outbox.stats.last_published_at)';

COMMENT ON INDEX outbox.held_undelivered_idx IS
    'outbox_pg: what the failure path still holds, per shard and aggregate in aggregate_seq order; the relay''s statements spell its predicate to use it';

COMMENT ON INDEX outbox.held_done_idx IS
    'outbox_pg: the failure path''s published and skipped rows by age, for retention';

COMMENT ON INDEX outbox.aggregates_pkey IS
    'outbox_pg: the relays read each aggregate''s counter through this index (by name), one probe per aggregate';

COMMENT ON INDEX outbox.processed_messages_processed_at_idx IS
    'outbox_pg: dedup marks by age, for outbox.retention and outbox.purge_processed';

COMMENT ON INDEX outbox.installation_one_row IS 'outbox_pg: one row at most';

-- @replaceable
-- Dropped once the views that used them in 0.2.0 are replaced.
DROP FUNCTION outbox._undelivered();
DROP FUNCTION outbox._read_shard(smallint, pg_snapshot, pg_snapshot, integer);
DROP FUNCTION outbox._cursor_below(pg_snapshot, bigint);
DROP FUNCTION outbox._counters(text[], text[]);
DROP FUNCTION outbox._shard_of(text, text);
DROP FUNCTION outbox.uuid_generate_v7();
