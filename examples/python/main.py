"""The example service: an activity feed, one row per event, written by a consumer of an outbox_pg
stream. Settings come from flags or the environment (`python3 main.py --help`). Prints one JSON
line per event it processed on stdout; logs and a summary on stderr."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from typing import Any

import psycopg
import redis

from consumer import Consumer, ConsumerConfig, Handler
from event import OutboxEvent
from tracing import set_up_tracing

ACTIVITY_TABLE = """CREATE TABLE IF NOT EXISTS activity (
  id bigserial PRIMARY KEY, event_id uuid NOT NULL, aggregate_type text NOT NULL,
  aggregate_id text NOT NULL, aggregate_seq bigint NOT NULL, event_type text NOT NULL,
  payload jsonb NOT NULL, headers jsonb, created_at timestamptz NOT NULL,
  handled_by text NOT NULL, handled_at timestamptz NOT NULL DEFAULT now())"""


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def on_off(parser: argparse.ArgumentParser, variable: str) -> bool:
    """An on/off environment variable: true or 1, false or 0 or empty (unset)."""
    text = os.environ.get(variable, "")
    value = text.strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0", ""):
        return False
    parser.error(f"{variable} must be true, 1, false or 0, got {text!r}")  # exit code 2


def settings() -> argparse.Namespace:
    """Each setting from its flag, else its environment variable, else the default."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="OTEL_EXPORT_FILE (environment only): write each finished span as a JSON line to this file "
        "(default: spans go to the tracer provider the process set, none: not recorded)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def setting(flag: str, variable: str, default: str | None, note: str = "", **kwargs: Any) -> None:
        text = f"environment: {variable}{note}"
        parser.add_argument(flag, default=os.environ.get(variable, default), help=text, **kwargs)

    setting("--redis", "REDIS_URL", "redis://127.0.0.1:6379")
    setting("--database", "DATABASE_URL", "", "; empty: the PG* variables")
    setting("--stream", "OUTBOX_STREAM", "outbox:payment")
    setting("--group", "OUTBOX_GROUP", "activity", "; also the dedup name in outbox_mark_processed")
    setting("--consumer", "OUTBOX_CONSUMER", f"{socket.gethostname()}-{os.getpid()}")
    setting("--dead-letter", "OUTBOX_DEAD_LETTER", None, "; none: <stream>:dead")
    setting("--max-deliveries", "OUTBOX_MAX_DELIVERIES", "5", type=positive)
    setting("--claim-idle-ms", "OUTBOX_CLAIM_IDLE_MS", "30000", type=positive)
    setting("--claim-interval-ms", "OUTBOX_CLAIM_INTERVAL_MS", "5000", type=positive)
    setting("--batch", "OUTBOX_BATCH", "100", type=positive)
    setting("--block-ms", "OUTBOX_BLOCK_MS", "1000", type=positive)
    parser.add_argument(
        "--delete-acked",
        action="store_true",
        default=on_off(parser, "OUTBOX_DELETE_ACKED"),
        help="environment: OUTBOX_DELETE_ACKED (true or 1); acknowledge with XACKDEL ... ACKED where Redis "
        "has it (8.2 or later), else XACK: an entry every group acknowledged is deleted at once "
        "(for outbox.stream_trim = 'acked')",
    )
    return parser.parse_args()  # bad values: a message and exit code 2


def record_activity(consumer: str) -> Handler:
    """The effect: the event as a row of the feed. A payload with "fail": true is refused, to try
    out retries and the dead-letter stream."""

    def handler(db: psycopg.Connection, event: OutboxEvent) -> None:
        if isinstance(event.payload, dict) and event.payload.get("fail") is True:
            raise ValueError('the payload says "fail": true')
        db.execute(
            """INSERT INTO activity (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                                     payload, headers, created_at, handled_by)
               VALUES (%s, %s, %s, %s, %s, %s::jsonb, %s::jsonb, %s::timestamptz, %s)""",
            (
                event.event_id,
                event.aggregate_type,
                event.aggregate_id,
                event.aggregate_seq,
                event.event_type,
                json.dumps(event.payload),
                None if event.headers is None else json.dumps(event.headers),
                event.created_at,
                consumer,
            ),
        )

    return handler


def main() -> None:
    args = settings()
    config = ConsumerConfig(
        stream=args.stream,
        group=args.group,
        consumer=args.consumer,
        dead_letter_stream=args.dead_letter or f"{args.stream}:dead",
        batch_size=args.batch,
        block_ms=args.block_ms,
        claim_idle_ms=args.claim_idle_ms,
        claim_interval_ms=args.claim_interval_ms,
        max_deliveries=args.max_deliveries,
        delete_acked=args.delete_acked,
    )

    def log(line: str) -> None:
        print(f"[{config.consumer}] {line}", file=sys.stderr, flush=True)

    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        if stopping:
            sys.exit(130)  # a second signal: now
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    r = redis.Redis.from_url(args.redis, decode_responses=True)
    # application_name shows in pg_stat_activity which consumer a session belongs to. A lost
    # connection ends the process; its unacknowledged entries wait for the next start.
    with psycopg.connect(args.database, autocommit=True, application_name=f"{config.group}/{config.consumer}") as db:
        db.execute(ACTIVITY_TABLE)
        consumer = Consumer(r, db, config, record_activity(config.consumer), log, set_up_tracing())
        consumer.set_up()
        fallback = config.delete_acked and consumer.acknowledges_with == "XACK"
        unavailable = " (--delete-acked: this Redis has no XACKDEL, 8.2 or later needed)" if fallback else ""
        log(
            f"consuming {config.stream} as {config.consumer} in group {config.group}, "
            f"acknowledging with {consumer.acknowledges_with}{unavailable}"
        )
        consumer.run(lambda: stopping)
    t = consumer.stats
    log(
        f"processed {t.processed}, duplicates {t.duplicates}, replayed {t.replayed}, "
        f"dead-lettered {t.dead_lettered}, handler errors {t.handler_errors}, "
        f"reclaimed {t.reclaimed}, order warnings {t.order_warnings}"
    )
    r.close()


if __name__ == "__main__":
    main()
