-- outbox_pg 0.3.0 -> 0.4.0, the part written by hand: what an upgrade cannot take from src/sql/
-- (tables, indexes, sequences and their comments and grants, data, the Rust functions'
-- declarations, and the functions and indexes it must drop). `python3 scripts/sql.py write` puts
-- every function, view, trigger, comment and grant of src/sql/ after it (at `-- @replaceable`) and
-- writes sql/outbox_pg--0.3.0--0.4.0.sql; sql/README.md has the rules.

-- tests/upgrade.rs checks that the whole script makes a schema equal to a fresh 0.4.0 install.
\echo Use "ALTER EXTENSION outbox_pg UPDATE" to load this file. \quit

-- Nothing but functions so far: the round's reads in SQL for the relay outside the server
-- (src/sql/relay/read.sql) and the trace context's rules they use (src/sql/trace.sql), all made
-- below by CREATE OR REPLACE.

-- @replaceable
