// The example service: an activity feed, one row per event, written by a consumer of an
// outbox_pg stream. Settings come from flags or the environment (`node dist/main.js --help`).
// Prints one JSON line per event it processed on stdout; logs and a summary on stderr.

import { hostname } from "node:os";
import { parseArgs, type ParseArgsConfig } from "node:util";
import { Redis } from "ioredis";
import pg from "pg";
import { Consumer, type ConsumerConfig, type Handler } from "./consumer.js";
import { setUpTracing } from "./tracing.js";

const USAGE = `usage: node dist/main.js [--flag value ...]   (flag, environment variable: default)
  --redis              REDIS_URL                 redis://127.0.0.1:6379
  --database           DATABASE_URL              the PG* variables (PGHOST, PGDATABASE, ...)
  --stream             OUTBOX_STREAM             outbox:payment
  --group              OUTBOX_GROUP              activity (also the dedup name in outbox_mark_processed)
  --consumer           OUTBOX_CONSUMER           <hostname>-<pid>
  --dead-letter        OUTBOX_DEAD_LETTER        <stream>:dead
  --max-deliveries     OUTBOX_MAX_DELIVERIES     5
  --claim-idle-ms      OUTBOX_CLAIM_IDLE_MS      30000
  --claim-interval-ms  OUTBOX_CLAIM_INTERVAL_MS  5000
  --batch              OUTBOX_BATCH              100
  --block-ms           OUTBOX_BLOCK_MS           1000
  --delete-acked       OUTBOX_DELETE_ACKED       off (true or 1: on); acknowledge with XACKDEL ...
                       ACKED where Redis has it (8.2 or later), else XACK: an entry every group
                       acknowledged is deleted at once (for outbox.stream_trim = 'acked')
environment only:
  OTEL_EXPORT_FILE     write each finished span as a JSON line to this file (default: spans go to
                       the tracer provider the process registered, none: not recorded)`;

const string = { type: "string" } as const;

/** Each setting from its flag, else its environment variable, else the default. */
function settings(): { redis: string; database: string | undefined; consumer: ConsumerConfig } {
  const { values: flag } = parse({
    options: {
      redis: string,
      database: string,
      stream: string,
      group: string,
      consumer: string,
      "dead-letter": string,
      "max-deliveries": string,
      "claim-idle-ms": string,
      "claim-interval-ms": string,
      batch: string,
      "block-ms": string,
      "delete-acked": { type: "boolean" },
      help: { type: "boolean" },
    },
  });
  if (flag.help) {
    console.log(USAGE);
    process.exit(0);
  }
  const env = process.env;
  const stream = flag.stream ?? env.OUTBOX_STREAM ?? "outbox:payment";
  return {
    redis: flag.redis ?? env.REDIS_URL ?? "redis://127.0.0.1:6379",
    database: flag.database ?? env.DATABASE_URL, // undefined: the PG* variables
    consumer: {
      stream,
      group: flag.group ?? env.OUTBOX_GROUP ?? "activity",
      consumer: flag.consumer ?? env.OUTBOX_CONSUMER ?? `${hostname()}-${process.pid}`,
      deadLetterStream: flag["dead-letter"] ?? env.OUTBOX_DEAD_LETTER ?? `${stream}:dead`,
      maxDeliveries: positive("max-deliveries", flag["max-deliveries"] ?? env.OUTBOX_MAX_DELIVERIES ?? "5"),
      claimIdleMs: positive("claim-idle-ms", flag["claim-idle-ms"] ?? env.OUTBOX_CLAIM_IDLE_MS ?? "30000"),
      claimIntervalMs: positive(
        "claim-interval-ms",
        flag["claim-interval-ms"] ?? env.OUTBOX_CLAIM_INTERVAL_MS ?? "5000",
      ),
      batchSize: positive("batch", flag.batch ?? env.OUTBOX_BATCH ?? "100"),
      blockMs: positive("block-ms", flag["block-ms"] ?? env.OUTBOX_BLOCK_MS ?? "1000"),
      deleteAcked: flag["delete-acked"] ?? onOff("OUTBOX_DELETE_ACKED", env.OUTBOX_DELETE_ACKED ?? ""),
    },
  };
}

/** parseArgs, with a bad command line reported as such (exit code 2). */
function parse<T extends ParseArgsConfig>(config: T): ReturnType<typeof parseArgs<T>> {
  try {
    return parseArgs(config);
  } catch (error) {
    usageError((error as Error).message);
  }
}

function usageError(message: string): never {
  console.error(`${message}\n${USAGE}`);
  process.exit(2);
}

function positive(flag: string, text: string): number {
  const value = Number(text);
  if (!Number.isSafeInteger(value) || value < 1) {
    usageError(`--${flag} must be a positive integer, got ${JSON.stringify(text)}`);
  }
  return value;
}

/** An on/off environment variable: true or 1, false or 0 or empty (unset). */
function onOff(variable: string, text: string): boolean {
  const value = text.trim().toLowerCase();
  if (value === "true" || value === "1") return true;
  if (value === "false" || value === "0" || value === "") return false;
  usageError(`${variable} must be true, 1, false or 0, got ${JSON.stringify(text)}`);
}

const ACTIVITY_TABLE = `CREATE TABLE IF NOT EXISTS activity (
  id bigserial PRIMARY KEY, event_id uuid NOT NULL, aggregate_type text NOT NULL,
  aggregate_id text NOT NULL, aggregate_seq bigint NOT NULL, event_type text NOT NULL,
  payload jsonb NOT NULL, headers jsonb, created_at timestamptz NOT NULL,
  handled_by text NOT NULL, handled_at timestamptz NOT NULL DEFAULT now())`;

/** The effect: the event as a row of the feed. A payload with "fail": true is refused, to try
 *  out retries and the dead-letter stream. */
function recordActivity(consumer: string): Handler {
  return async (db, event) => {
    const payload = event.payload as Record<string, unknown> | null;
    if (typeof payload === "object" && payload !== null && payload.fail === true) {
      throw new Error('the payload says "fail": true');
    }
    await db.query(
      `INSERT INTO activity (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                             payload, headers, created_at, handled_by)
       VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7::jsonb, $8::timestamptz, $9)`,
      [
        event.eventId,
        event.aggregateType,
        event.aggregateId,
        event.aggregateSeq,
        event.eventType,
        JSON.stringify(event.payload),
        event.headers === null ? null : JSON.stringify(event.headers),
        event.createdAt,
        consumer,
      ],
    );
  };
}

async function main(): Promise<void> {
  const { redis: redisUrl, database, consumer: config } = settings();
  const log = (line: string) => console.error(`[${config.consumer}] ${line}`);

  let stopping = false;
  for (const signal of ["SIGINT", "SIGTERM"] as const) {
    process.on(signal, () => {
      if (stopping) process.exit(130); // a second signal: now
      stopping = true;
    });
  }

  const redis = new Redis(redisUrl);
  const db = new pg.Client({
    connectionString: database,
    // Shows in pg_stat_activity which consumer a session belongs to.
    application_name: `${config.group}/${config.consumer}`,
  });
  // A lost connection ends the process; its unacknowledged entries wait for the next start.
  db.on("error", (error) => {
    log(`PostgreSQL: ${error.message}`);
    process.exit(1);
  });
  await db.connect();
  await db.query(ACTIVITY_TABLE);

  const tracing = setUpTracing();
  const consumer = new Consumer(redis, db, config, recordActivity(config.consumer), log, tracing.tracer);
  await consumer.setUp();
  const fallback = config.deleteAcked && consumer.acknowledgesWith === "XACK";
  const unavailable = fallback ? " (--delete-acked: this Redis has no XACKDEL, 8.2 or later needed)" : "";
  log(
    `consuming ${config.stream} as ${config.consumer} in group ${config.group}, ` +
      `acknowledging with ${consumer.acknowledgesWith}${unavailable}`,
  );
  await consumer.run(() => stopping);

  const t = consumer.stats;
  log(
    `processed ${t.processed}, duplicates ${t.duplicates}, replayed ${t.replayed}, ` +
      `dead-lettered ${t.deadLettered}, handler errors ${t.handlerErrors}, ` +
      `reclaimed ${t.reclaimed}, order warnings ${t.orderWarnings}`,
  );
  await tracing.shutdown();
  await db.end();
  redis.disconnect();
}

main().catch((error: unknown) => {
  console.error(error instanceof Error ? (error.stack ?? error.message) : error);
  process.exit(1);
});
