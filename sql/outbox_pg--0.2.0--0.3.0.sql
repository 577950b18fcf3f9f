-- outbox_pg 0.2.0 -> 0.3.0. Every schema change made after 0.2.0 goes here, in the commit that
-- makes it (sql/README.md). tests/upgrade.rs checks that the result equals a fresh 0.3.0 install.
--
-- So far 0.3.0 changes only the library: nothing to do in the schema.
\echo Use "ALTER EXTENSION outbox_pg UPDATE" to load this file. \quit
