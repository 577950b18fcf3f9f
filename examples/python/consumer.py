"""A consumer-group member for one outbox_pg stream. The rules, and why (README.md beside this
file has the whole story):

- dedup by event_id in PostgreSQL: outbox_mark_processed() in the same transaction as the effect,
  so the mark and the effect commit together or not at all;
- XACK only after that transaction committed (or found the event done already); with delete_acked,
  XACKDEL ... ACKED where Redis has it (8.2 or later), which also deletes an entry every group has
  acknowledged;
- on start, this consumer name's own unacknowledged entries first, then XAUTOCLAIM of entries idle
  for claim_idle_ms (crashed consumers', and our own failures), then new entries;
- after max_deliveries deliveries (XPENDING's count) an entry goes to the dead-letter stream; a
  malformed one at once;
- aggregate_seq checked against the last one applied per aggregate: gaps and reordering are
  reported, never refused;
- each event processed inside a CONSUMER span, the child of the enqueuer's span when the entry
  carries a traceparent (tracing.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import psycopg
import redis
from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode

from event import MalformedEntry, OutboxEvent, parse_entry
from tracing import process_span


@dataclass
class ConsumerConfig:
    stream: str
    group: str
    consumer: str  # this process's name in the group; a restart under it resumes its entries
    dead_letter_stream: str
    batch_size: int = 100
    block_ms: int = 1000
    claim_idle_ms: int = 30000  # pending this long: taken over by XAUTOCLAIM; > the slowest handler
    claim_interval_ms: int = 5000
    max_deliveries: int = 5
    # Acknowledge with XACKDEL ... ACKED instead of XACK, so that an entry every consumer group has
    # acknowledged is deleted at once: for streams the relay trims by acknowledgement
    # (outbox.stream_trim = 'acked'), where it would otherwise stay until the next XADD trims it.
    # Used only when the server has XACKDEL (Redis 8.2 or later, asked in set_up); else XACK.
    delete_acked: bool = False


@dataclass
class Stats:
    processed: int = 0
    duplicates: int = 0
    replayed: int = 0  # entries with a `replay` field (outbox.replay() sent them again)
    dead_lettered: int = 0
    handler_errors: int = 0
    reclaimed: int = 0
    order_warnings: int = 0


# The effect. It runs inside the transaction that marks the event processed; raise to refuse.
Handler = Callable[[psycopg.Connection, OutboxEvent], None]


class HandlerFailed(Exception):
    """The handler raised: the event's fault, retried and in the end dead-lettered. Anything else
    (Redis or PostgreSQL gone) ends the process, and its entries wait for the next one."""


@dataclass
class Consumer:
    redis: redis.Redis
    db: psycopg.Connection  # in autocommit mode: transactions are explicit
    config: ConsumerConfig
    handler: Handler
    log: Callable[[str], None]
    tracer: trace.Tracer
    stats: Stats = field(default_factory=Stats)
    claim_cursor: str = "0-0"
    next_claim_at: float = 0.0
    ack_deletes: bool = False  # config.delete_acked and the server has XACKDEL

    @property
    def acknowledges_with(self) -> str:
        """The command this consumer acknowledges with: XACKDEL (with ACKED) when delete_acked is set
        and the server has it, else XACK. Known once set_up() has run."""
        return "XACKDEL" if self.ack_deletes else "XACK"

    def set_up(self) -> None:
        """Creates the group (from the stream's start) and the order-check table if missing; with
        delete_acked, asks the server whether it has XACKDEL."""
        self.ack_deletes = self.config.delete_acked and self.server_has("XACKDEL")
        try:
            self.redis.xgroup_create(self.config.stream, self.config.group, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self.db.execute(
            """CREATE TABLE IF NOT EXISTS aggregate_positions (
                 consumer_group text NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
                 last_seq bigint NOT NULL, PRIMARY KEY (consumer_group, aggregate_type, aggregate_id))"""
        )

    def server_has(self, command: str) -> bool:
        """Whether the server knows `command` (COMMAND INFO answers nil for an unknown one): what it
        offers, asked rather than guessed from its version. (redis-py's command_info() refuses to
        ask; a two-word command name is sent as two arguments.)"""
        info: Any = self.redis.execute_command("COMMAND INFO", command)
        return bool(info) and info[0] is not None

    def run(self, stopping: Callable[[], bool]) -> None:
        """Consumes until stopping() says so; the entry in hand is finished first."""
        self.resume_own_entries(stopping)
        while not stopping():
            seen = 0
            if self.claim_cursor != "0-0" or time.monotonic() >= self.next_claim_at:
                seen = self.reclaim(stopping)
            # Do not block after reclaimed work: there may be more of it.
            for entry_id, fields in self.read(">", 0 if seen else self.config.block_ms):
                if stopping():
                    return
                self.handle(entry_id, fields, 1)  # read with ">": its first delivery

    def resume_own_entries(self, stopping: Callable[[], bool]) -> None:
        """What this consumer name read before a crash or a stop and never acknowledged, in stream
        order, before anything newer: a restart keeps each aggregate's order."""
        after = "0"
        while True:
            entries = self.read(after, 0)
            if not entries:
                return
            for entry_id, fields in entries:
                if stopping():
                    return
                self.handle(entry_id, fields, self.deliveries(entry_id))
                after = entry_id

    def read(self, start: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        reply: Any = self.redis.xreadgroup(
            self.config.group,
            self.config.consumer,
            {self.config.stream: start},
            count=self.config.batch_size,
            block=block_ms or None,
        )
        return reply[0][1] if reply else []

    def reclaim(self, stopping: Callable[[], bool]) -> int:
        """One XAUTOCLAIM page: entries pending longer than claim_idle_ms, whoever holds them."""
        c = self.config
        cursor, entries, *_ = self.redis.xautoclaim(
            c.stream, c.group, c.consumer, c.claim_idle_ms, self.claim_cursor, count=c.batch_size
        )
        self.claim_cursor = cursor
        if cursor == "0-0":
            self.next_claim_at = time.monotonic() + c.claim_interval_ms / 1000
        claimed = [(entry_id, fields) for entry_id, fields in entries if entry_id is not None]
        if claimed:
            self.log(f"reclaimed {len(claimed)} entries idle for {c.claim_idle_ms} ms or more")
        for entry_id, fields in claimed:
            if stopping():
                break
            self.stats.reclaimed += 1
            self.handle(entry_id, fields, self.deliveries(entry_id))
        return len(claimed)

    def deliveries(self, entry_id: str) -> int | None:
        """The entry's delivery count, this delivery included; None once it is not ours any more."""
        rows = self.redis.xpending_range(self.config.stream, self.config.group, entry_id, entry_id, 1)
        if rows and rows[0]["consumer"] == self.config.consumer:
            return int(rows[0]["times_delivered"])
        return None

    def handle(self, entry_id: str, fields: dict[str, str], deliveries: int | None) -> None:
        if deliveries is None:
            return  # acknowledged or claimed by another consumer meanwhile
        if not fields:
            self.ack(entry_id)  # deleted from the stream (XDEL, MAXLEN): nothing left to handle
            return
        try:
            event = parse_entry(entry_id, fields)
        except MalformedEntry as error:
            self.dead_letter(entry_id, fields, f"malformed entry: {error}", deliveries)
            return
        with process_span(self.tracer, self.config.stream, self.config.group, event) as span:
            self.process(entry_id, fields, event, deliveries, span)

    def process(self, entry_id: str, fields: dict[str, str], event: OutboxEvent, deliveries: int, span: Span) -> None:
        """What happens to a well-formed entry: applied once, or a duplicate, or left for a retry, or
        dead-lettered. Its outcome goes on the span as `outbox.outcome`."""
        c = self.config
        if deliveries > c.max_deliveries:
            # Never acknowledged nor reported failed that often: its handler probably kills the process.
            span.set_attribute("outbox.outcome", "dead-lettered")
            self.dead_letter(entry_id, fields, f"delivered {deliveries} times without being acknowledged", deliveries)
            return
        try:
            duplicate = not self.apply_once(event)
        except HandlerFailed as error:
            self.stats.handler_errors += 1
            span.set_status(StatusCode.ERROR, str(error))
            if deliveries >= c.max_deliveries:
                span.set_attribute("outbox.outcome", "dead-lettered")
                self.dead_letter(entry_id, fields, f"handler failed on delivery {deliveries}: {error}", deliveries)
            else:
                span.set_attribute("outbox.outcome", "retried")
                self.log(
                    f"{describe(event)}: handler failed on delivery {deliveries} of {c.max_deliveries} "
                    f"(retried after {c.claim_idle_ms} ms): {error}"
                )
            return  # left pending: XAUTOCLAIM hands it out again
        self.ack(entry_id)
        span.set_attribute("outbox.outcome", "duplicate" if duplicate else "processed")
        if event.replay is not None:
            self.stats.replayed += 1
        if duplicate:
            self.stats.duplicates += 1
            return
        self.stats.processed += 1
        line = {
            "event_id": event.event_id,
            "aggregate_type": event.aggregate_type,
            "aggregate_id": event.aggregate_id,
            "aggregate_seq": event.aggregate_seq,
            "event_type": event.event_type,
            "entry_id": entry_id,
            "deliveries": deliveries,
            "trace_id": format(span.get_span_context().trace_id, "032x"),
        }
        print(json.dumps(line), flush=True)

    def apply_once(self, event: OutboxEvent) -> bool:
        """The dedup rule: the mark and the effect commit together, so a crash anywhere before
        COMMIT undoes both, and a redelivery after it finds the mark and skips the effect.
        True when the effect was applied, False for an event processed before."""
        warning = None
        with self.db.transaction():
            mark = self.db.execute(
                "SELECT outbox_mark_processed(%s, %s)", (self.config.group, event.event_id)
            ).fetchone()
            if mark is None or not mark[0]:
                return False
            warning = self.check_order(event)
            try:
                self.handler(self.db, event)
            except Exception as error:
                raise HandlerFailed(str(error)) from error
        if warning is not None:
            self.stats.order_warnings += 1
            self.log(warning)
        return True

    def check_order(self, event: OutboxEvent) -> str | None:
        """aggregate_seq against the last one applied for the aggregate (outbox_pg numbers them 1,
        2, 3, ... in commit order). A gap: earlier events not handled yet (failing, dead-lettered,
        or lost); lower: an earlier event handled late (a retry). Reported, never refused."""
        key = (self.config.group, event.aggregate_type, event.aggregate_id)
        row = self.db.execute(
            """SELECT last_seq FROM aggregate_positions
                WHERE consumer_group = %s AND aggregate_type = %s AND aggregate_id = %s FOR UPDATE""",
            key,
        ).fetchone()
        last = row[0] if row else 0
        self.db.execute(
            """INSERT INTO aggregate_positions AS p VALUES (%s, %s, %s, %s)
               ON CONFLICT (consumer_group, aggregate_type, aggregate_id)
               DO UPDATE SET last_seq = greatest(p.last_seq, excluded.last_seq)""",
            (*key, event.aggregate_seq),
        )
        seq = event.aggregate_seq
        if seq == last + 1:
            return None
        if seq > last + 1:
            missing = seq - last - 1
            return f"{describe(event)}: gap: aggregate_seq {seq} follows {last}, {missing} earlier not handled yet"
        return f"{describe(event)}: reordered: aggregate_seq {seq} after {last}"

    def ack(self, entry_id: str) -> None:
        """XACK, or XACKDEL ... ACKED (delete_acked, where the server has it): the entry is also
        deleted if every other group has acknowledged it already, else it stays for them."""
        if self.ack_deletes:
            self.redis.xackdel(self.config.stream, self.config.group, entry_id, ref_policy="ACKED")
        else:
            self.redis.xack(self.config.stream, self.config.group, entry_id)

    def dead_letter(self, entry_id: str, fields: dict[str, str], error: str, deliveries: int) -> None:
        """XADD a copy (fields plus why) to the dead-letter stream, then acknowledge it. Not one
        transaction on purpose: a crash in between leaves the dead letter twice, never zero times."""
        c = self.config
        why = {"error": error, "deliveries": deliveries, "original_id": entry_id, "original_stream": c.stream}
        letter: dict[Any, Any] = {**fields, **why}
        self.redis.xadd(c.dead_letter_stream, letter)
        self.ack(entry_id)
        self.stats.dead_lettered += 1
        self.log(f"entry {entry_id} moved to {c.dead_letter_stream}: {error}")


def describe(event: OutboxEvent) -> str:
    return f"{event.aggregate_type}/{event.aggregate_id} #{event.aggregate_seq} (event {event.event_id})"
