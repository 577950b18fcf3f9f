-- The failure path, outbox.held: events Redis rejected, backing off and retried until they go or
-- fail (dead letters), and, with outbox.ordering = aggregate, the later events of their aggregates
-- waiting behind them in aggregate_seq order (docs/worker.md, "Order per aggregate" and "Failures
-- of Redis versus failures of one event"). A round's read asks which events are due and which of
-- its aggregates must wait (src/relay/read.rs); its finish moves events here and settles those it
-- sent (src/relay/settle.rs). Written only when something goes wrong: on the happy path none of
-- these functions writes a row. An admin's retry_failed and skip_failed are in operations.sql.
--
-- "On the failure path" is status IN ('waiting', 'failed'), spelt that way wherever a statement
-- looks for it (here, in the claim, in outbox._health) so that the planner uses the partial index
-- held_undelivered_idx (schema.sql).

-- -------------------------------------------------------------------------------------------------
-- outbox._held_aggregates(aggregate_types, aggregate_ids, shards)
--
--     Which of a round's aggregates have events on the failure path: their events in this round
--     must not overtake those, and join them there instead of being sent.
--
-- Parameters:
--     aggregate_types, aggregate_ids  the round's aggregates, aggregate_types[n] with aggregate_ids[n]
--     shards                          the shards the round read
-- Returns:
--     the 1-based positions n of the aggregates that have waiting or failed events
-- Reads:   outbox.held, one index probe per aggregate
-- Writes:  nothing
-- Called by: the round's read (src/relay/read.rs), with outbox.ordering = aggregate, when the
--            claim found anything on the failure path in its shards
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._held_aggregates(aggregate_types text[], aggregate_ids text[], shards smallint[])
RETURNS SETOF bigint
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM outbox.held h WHERE h.shard = ANY (shards) AND h.status IN ('waiting', 'failed')) THEN
        RETURN;
    END IF;
    -- One index probe per aggregate, whatever the statistics: the LIMIT keeps the subquery from
    -- being flattened into a join whose order the planner would choose (a generic plan made while
    -- the failure path was empty could scan it once per aggregate).
    RETURN QUERY
        SELECT a.position
          FROM unnest(aggregate_types, aggregate_ids) WITH ORDINALITY AS a(aggregate_type, aggregate_id, position)
         CROSS JOIN LATERAL (SELECT 1 FROM outbox.held h
                              WHERE h.shard = ANY (shards)
                                AND h.aggregate_type = a.aggregate_type COLLATE "C" AND h.aggregate_id = a.aggregate_id COLLATE "C"
                                AND h.status IN ('waiting', 'failed')
                              LIMIT 1) w;
END
$fn$;

COMMENT ON FUNCTION outbox._held_aggregates(text[], text[], smallint[]) IS
    'Relay internal: which of these aggregates (1-based positions) have events on the failure path, so that their new events wait behind them';

-- -------------------------------------------------------------------------------------------------
-- outbox._held_due(shards, max_events, in_order)
--
--     The failure path's events that may be sent now, in these shards, in id order. With in_order
--     (outbox.ordering = aggregate): each aggregate's waiting events up to its first one that is
--     backing off or failed. Without: every waiting event that is not backing off.
--
-- Parameters:
--     shards      the shards the round holds
--     max_events  at most this many (outbox.batch_size)
--     in_order    keep each aggregate's order (default true)
-- Returns:
--     id, event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, payload, headers,
--     stream, created_at: the stream entry's fields as text (created_at in RFC 3339, UTC)
-- Reads:   outbox.held
-- Writes:  nothing
-- Called by: the round's read (src/relay/read.rs), when the claim found anything on the failure
--            path in its shards
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._held_due(shards smallint[], max_events integer, in_order boolean DEFAULT true)
RETURNS TABLE (
    id             bigint,
    event_id       text,
    aggregate_type text,
    aggregate_id   text,
    aggregate_seq  bigint,
    event_type     text,
    payload        text,
    headers        text,
    stream         text,
    created_at     text
)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        WITH undelivered AS MATERIALIZED (
            SELECT h.*,
                   bool_or(h.status = 'failed' OR coalesce(h.available_at > clock_timestamp(), false))
                       OVER (PARTITION BY h.aggregate_type, h.aggregate_id ORDER BY h.aggregate_seq
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS blocked
              FROM outbox.held h
             WHERE h.shard = ANY (shards) AND h.status IN ('waiting', 'failed')
        )
        SELECT u.id, u.event_id::text, u.aggregate_type, u.aggregate_id, u.aggregate_seq, u.event_type,
               u.payload::text, u.headers::text, u.stream,
               to_char(u.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
          FROM undelivered u
         WHERE u.status = 'waiting'
           AND (CASE WHEN in_order THEN NOT u.blocked ELSE (u.available_at IS NULL OR u.available_at <= clock_timestamp()) END)
         ORDER BY u.id
         LIMIT max_events;
END
$fn$;

COMMENT ON FUNCTION outbox._held_due(smallint[], integer, boolean) IS
    'Relay internal: the failure path''s events due now in these shards, each aggregate''s up to its first one backing off or failed (in_order)';

-- -------------------------------------------------------------------------------------------------
-- outbox._hold(event_ids, seqs, errors, max_attempts, retry_delay_ms)
--
--     Moves events from the log to the failure path with the aggregate_seq they were given: an
--     event Redis rejected (its error set: backing off for retry_delay_ms, or failed at once when
--     max_attempts is 1) and the events of its aggregate that wait behind it (error NULL). Copies
--     every column of the event, so that retention may truncate its log table under it. An event
--     already there is left as it is.
--
-- Parameters:
--     event_ids       the events, as the log has them
--     seqs            the aggregate_seq each was given in the round
--     errors          Redis's error for a rejected event; NULL for one waiting behind it
--     max_attempts    outbox.max_attempts
--     retry_delay_ms  outbox.retry_delay: the first backoff
-- Returns:
--     how many became failed
-- Reads:   outbox.events (the log, by event_id)
-- Writes:  insert outbox.held
-- Called by: the round's finish (src/relay/settle.rs), in its transaction, before _advance moves
--            the cursors past these events
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._hold(event_ids uuid[], seqs bigint[], errors text[], max_attempts integer, retry_delay_ms integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
DECLARE
    failed bigint;
BEGIN
    WITH held AS (
        INSERT INTO outbox.held AS h (id, event_id, shard, aggregate_type, aggregate_id, aggregate_seq, event_type,
                                      payload, headers, stream, created_at, status, attempts, rejections,
                                      available_at, failed_at, last_error)
        SELECT e.id, e.event_id, e.shard, e.aggregate_type, e.aggregate_id, x.seq, e.event_type, e.payload,
               e.headers, e.stream, e.created_at,
               CASE WHEN x.error IS NOT NULL AND max_attempts <= 1 THEN 'failed' ELSE 'waiting' END,
               (x.error IS NOT NULL)::integer,
               (x.error IS NOT NULL)::integer,
               CASE WHEN x.error IS NOT NULL THEN clock_timestamp() + retry_delay_ms * interval '1 millisecond' END,
               CASE WHEN x.error IS NOT NULL AND max_attempts <= 1 THEN clock_timestamp() END,
               x.error
          FROM unnest(event_ids, seqs, errors) AS x(event_id, seq, error)
         CROSS JOIN LATERAL (SELECT * FROM outbox.events v WHERE v.event_id = x.event_id LIMIT 1) e
        ON CONFLICT (id) DO NOTHING
        RETURNING h.status
    )
    SELECT count(*) FILTER (WHERE status = 'failed') INTO failed FROM held;
    RETURN failed;
END
$fn$;

COMMENT ON FUNCTION outbox._hold(uuid[], bigint[], text[], integer, integer) IS
    'Relay internal: moves events Redis rejected, and the events of their aggregates behind them, from the log to the failure path; returns how many failed';

-- -------------------------------------------------------------------------------------------------
-- outbox._settle_held(published_ids, rejected_ids, errors, max_attempts, retry_delay_ms)
--
--     Settles the failure path's events a round sent: those Redis accepted are published; those
--     it rejected again count the rejection, back off (doubling from retry_delay_ms, at most 5
--     minutes) and fail once their rejections reach max_attempts. Counters saturate: an overflow
--     here would stall the relay on the row forever.
--
-- Parameters:
--     published_ids   ids of the events Redis accepted
--     rejected_ids    ids of the events it rejected, with errors[n] the error of rejected_ids[n]
--     errors
--     max_attempts    outbox.max_attempts
--     retry_delay_ms  outbox.retry_delay
-- Returns:
--     how many became failed
-- Reads:   outbox.held
-- Writes:  update outbox.held (status, attempts, rejections, available_at, failed_at,
--          published_at, last_error)
-- Called by: the round's finish (src/relay/settle.rs)
-- -------------------------------------------------------------------------------------------------
CREATE FUNCTION outbox._settle_held(published_ids bigint[], rejected_ids bigint[], errors text[],
                                    max_attempts integer, retry_delay_ms integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET jit = off
SET enable_seqscan = off
AS $fn$
DECLARE
    failed bigint;
BEGIN
    UPDATE outbox.held h
       SET status = 'published', published_at = clock_timestamp(), last_error = NULL, available_at = NULL,
           attempts = h.attempts + (h.attempts < 2147483647)::integer
     WHERE h.id = ANY (published_ids) AND h.status = 'waiting';
    WITH rejected AS (
        UPDATE outbox.held h
           SET rejections = h.rejections + (h.rejections < 2147483647)::integer,
               attempts = h.attempts + (h.attempts < 2147483647)::integer,
               -- Looked up per row (at most outbox.batch_size of them) rather than joined: the
               -- rows are found through the primary key whatever the statistics say.
               last_error = (SELECT x.error FROM unnest(rejected_ids, errors) AS x(id, error) WHERE x.id = h.id LIMIT 1),
               status = CASE WHEN h.rejections::bigint + 1 >= max_attempts THEN 'failed' ELSE 'waiting' END,
               failed_at = CASE WHEN h.rejections::bigint + 1 >= max_attempts THEN clock_timestamp() END,
               available_at = clock_timestamp()
                              + least(retry_delay_ms * power(2, least(h.rejections, 20)), 300000) * interval '1 millisecond'
         WHERE h.id = ANY (rejected_ids) AND h.status = 'waiting'
        RETURNING h.status
    )
    SELECT count(*) FILTER (WHERE status = 'failed') INTO failed FROM rejected;
    RETURN failed;
END
$fn$;

COMMENT ON FUNCTION outbox._settle_held(bigint[], bigint[], text[], integer, integer) IS
    'Relay internal: marks the failure path''s events Redis accepted published, and backs off or fails those it rejected again; returns how many failed';

REVOKE ALL ON FUNCTION outbox._held_aggregates(text[], text[], smallint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._held_due(smallint[], integer, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._hold(uuid[], bigint[], text[], integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox._settle_held(bigint[], bigint[], text[], integer, integer) FROM PUBLIC;
