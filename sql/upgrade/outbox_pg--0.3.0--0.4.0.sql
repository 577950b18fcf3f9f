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

-- @replaceable
