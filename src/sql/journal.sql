-- The journal of what the relays published: per finished round, the event ids in the order Redis
-- received them and the aggregate_seq each was sent with (the log does not hold it: the relay
-- numbers events when it publishes them). Written by the finish (relay/finish.sql,
-- outbox._advance), read by replays (replay.sql), truncated with the log (relay/housekeeping.sql).
-- docs/worker.md, "Replay".

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
    END LOOP;
END
$tables$;
-- Top-level statements, as in schema.sql: the SQL-only install (scripts/sql.py) leaves them out.
SELECT pg_catalog.pg_extension_config_dump('outbox.journal_0', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.journal_1', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.journal_2', '');

CREATE VIEW outbox.journal AS
SELECT 0::smallint AS generation, j.* FROM outbox.journal_0 j
UNION ALL
SELECT 1::smallint, j.* FROM outbox.journal_1 j
UNION ALL
SELECT 2::smallint, j.* FROM outbox.journal_2 j;
COMMENT ON VIEW outbox.journal IS
    'outbox_pg: every round that published events: when, which event_ids in which order, with which aggregate_seq';

GRANT SELECT ON outbox.journal TO outbox_admin;
