-- The relays that run outside the server (outbox-relay, docs/outside-relay.md): joining the
-- database's relays. Like every function under src/sql/relay/: search_path pinned, EXECUTE revoked
-- from PUBLIC (a relay connects as the role that installed outbox_pg, or one granted these).
-- -------------------------------------------------------------------------------------------------
-- outbox._join_relays(relay_pid, host, version, stream_template, entry_format)
--
--     Records an outbox-relay connection in outbox.outside_relays, unless another relay of the
--     database writes its entries differently: two relays with different stream templates (or
--     entry formats) would publish one aggregate's events to two streams, or in two shapes, and a
--     consumer would see half of them. Then it raises, naming both, and the relay waits. The
--     in-server relays count too, where the library is loaded: their outbox.stream and
--     outbox.entry_format are this server's settings. Rows of connections that ended are removed
--     first. Joins take turns (a lock on the table), so two relays started together cannot both
--     find the other absent.
--
-- Parameters:
--     relay_pid        the relay's backend pid (pg_backend_pid()), what it claims shards as
--     host, version    where the relay runs and its version, shown in outbox.outside_relays
--     stream_template  its outbox.stream setting
--     entry_format     its outbox.entry_format setting
-- Raises:  55000 (object_not_in_prerequisite_state) when another relay writes differently
-- Writes:  outbox.outside_relays
-- Called by: outbox-relay, each time it connects (outside/src/readiness.rs)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._join_relays(relay_pid integer, host text, version text, stream_template text,
                                    entry_format text)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    other record;
    in_server_template text := pg_catalog.current_setting('outbox.stream', true);
    in_server_format text := coalesce(pg_catalog.current_setting('outbox.entry_format', true), 'native');
BEGIN
    LOCK TABLE outbox.outside_relays IN SHARE ROW EXCLUSIVE MODE;
    DELETE FROM outbox.outside_relays r
     WHERE r.backend_pid = relay_pid
        OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_get_activity(r.backend_pid));
    SELECT r.* INTO other FROM outbox.outside_relays r
     WHERE r.stream_template IS DISTINCT FROM $4 OR r.entry_format IS DISTINCT FROM $5
     ORDER BY r.joined_at LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox-relay: this relay writes to streams "%" as % entries, but the outbox-relay of backend % on %, relaying this database since %, writes to "%" as % entries',
                        $4, $5, other.backend_pid, other.host, other.joined_at, other.stream_template, other.entry_format
              USING ERRCODE = 'object_not_in_prerequisite_state',
                    HINT = 'Give every relay of a database the same stream template (outbox.stream, --stream) and entry format, or stop the other relay first.';
    END IF;
    IF in_server_template IS NOT NULL
       AND (in_server_template IS DISTINCT FROM $4 OR in_server_format IS DISTINCT FROM $5)
       AND EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity a
                    WHERE a.datname = pg_catalog.current_database() AND a.backend_type = 'outbox_pg relay') THEN
        RAISE EXCEPTION 'outbox-relay: this relay writes to streams "%" as % entries, but this server''s outbox_pg relays write to "%" as % entries',
                        $4, $5, in_server_template, in_server_format
              USING ERRCODE = 'object_not_in_prerequisite_state',
                    HINT = 'Give outbox-relay the server''s outbox.stream and outbox.entry_format, or stop the server''s relays first (outbox.enabled = off).';
    END IF;
    INSERT INTO outbox.outside_relays (backend_pid, host, version, stream_template, entry_format)
    VALUES (relay_pid, $2, $3, $4, $5);
END
$fn$;

COMMENT ON FUNCTION outbox._join_relays(integer, text, text, text, text) IS
    'Relay internal: records an outbox-relay connection, refusing one whose stream template or entry format differs from a running relay''s';

REVOKE ALL ON FUNCTION outbox._join_relays(integer, text, text, text, text) FROM PUBLIC;
