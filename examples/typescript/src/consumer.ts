// A consumer-group member for one outbox_pg stream. The rules, and why (README.md beside this
// file has the whole story):
// - dedup by event_id in PostgreSQL: outbox_mark_processed() in the same transaction as the
//   effect, so the mark and the effect commit together or not at all;
// - XACK only after that transaction committed (or found the event done already); with
//   deleteAcked, XACKDEL ... ACKED where Redis has it (8.2 or later), which also deletes an entry
//   every group has acknowledged;
// - on start, this consumer name's own unacknowledged entries first, then XAUTOCLAIM of entries
//   idle for claimIdleMs (crashed consumers', and our own failures), then new entries;
// - after maxDeliveries deliveries (XPENDING's count) an entry goes to the dead-letter stream;
//   a malformed one at once;
// - aggregate_seq checked against the last one applied per aggregate: gaps and reordering are
//   reported, never refused;
// - each event processed inside a CONSUMER span, the child of the enqueuer's span when the entry
//   carries a traceparent (tracing.ts).

import type { Span, Tracer } from "@opentelemetry/api";
import { SpanStatusCode } from "@opentelemetry/api";
import type { Redis } from "ioredis";
import type pg from "pg";
import { MalformedEntry, parseEntry, type OutboxEvent } from "./event.js";
import { inProcessSpan } from "./tracing.js";

export interface ConsumerConfig {
  stream: string;
  group: string;
  /** This process's name in the group; a restart under the same name resumes its entries. */
  consumer: string;
  deadLetterStream: string;
  batchSize: number;
  blockMs: number;
  /** An entry pending this long is taken over by XAUTOCLAIM: longer than the slowest handler. */
  claimIdleMs: number;
  claimIntervalMs: number;
  maxDeliveries: number;
  /** Acknowledge with `XACKDEL ... ACKED` instead of XACK, so that an entry every consumer group
   *  has acknowledged is deleted at once: for streams the relay trims by acknowledgement
   *  (`outbox.stream_trim = 'acked'`), where it would otherwise stay until the next XADD trims it.
   *  Used only when the server has XACKDEL (Redis 8.2 or later, asked in setUp); else XACK. */
  deleteAcked: boolean;
}

/** The effect. It runs inside the transaction that marks the event processed; throw to refuse. */
export type Handler = (db: pg.ClientBase, event: OutboxEvent) => Promise<void>;

export interface Stats {
  processed: number;
  duplicates: number;
  /** Entries with a `replay` field (outbox.replay() sent them again), duplicates or not. */
  replayed: number;
  deadLettered: number;
  handlerErrors: number;
  reclaimed: number;
  orderWarnings: number;
}

/** [entry id, flat field/value list]; the fields are null for an entry deleted from the stream. */
type Entry = [string, string[] | null];

/** The handler threw: the event's fault, retried and in the end dead-lettered. Anything else
 *  (Redis or PostgreSQL gone) ends the process, and its entries wait for the next one. */
class HandlerFailed extends Error {}

export class Consumer {
  readonly stats: Stats = {
    processed: 0,
    duplicates: 0,
    replayed: 0,
    deadLettered: 0,
    handlerErrors: 0,
    reclaimed: 0,
    orderWarnings: 0,
  };
  private claimCursor = "0-0";
  private nextClaimAt = 0;
  /** config.deleteAcked and the server has XACKDEL. */
  private ackDeletes = false;

  constructor(
    private readonly redis: Redis,
    private readonly db: pg.Client,
    private readonly config: ConsumerConfig,
    private readonly handler: Handler,
    private readonly log: (line: string) => void,
    private readonly tracer: Tracer,
  ) {}

  /** Creates the group (from the stream's start) and the order-check table if missing; with
   *  deleteAcked, asks the server whether it has XACKDEL. */
  async setUp(): Promise<void> {
    this.ackDeletes = this.config.deleteAcked && (await this.serverHas("XACKDEL"));
    try {
      await this.redis.xgroup("CREATE", this.config.stream, this.config.group, "0", "MKSTREAM");
    } catch (error) {
      if (!String(error).includes("BUSYGROUP")) throw error;
    }
    await this.db.query(`CREATE TABLE IF NOT EXISTS aggregate_positions (
      consumer_group text NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
      last_seq bigint NOT NULL, PRIMARY KEY (consumer_group, aggregate_type, aggregate_id))`);
  }

  /** The command this consumer acknowledges with: XACKDEL (with ACKED) when deleteAcked is set and
   *  the server has it, else XACK. Known once setUp() has run. */
  get acknowledgesWith(): "XACKDEL" | "XACK" {
    return this.ackDeletes ? "XACKDEL" : "XACK";
  }

  /** Whether the server knows `command` (COMMAND INFO answers nil for an unknown one): what it
   *  offers, asked rather than guessed from its version. */
  private async serverHas(command: string): Promise<boolean> {
    const info = (await this.redis.call("COMMAND", "INFO", command)) as unknown[] | null;
    return Array.isArray(info) && info[0] !== null && info[0] !== undefined;
  }

  /** Consumes until `stopping()` says so; the entry in hand is finished first. */
  async run(stopping: () => boolean): Promise<void> {
    await this.resumeOwnEntries(stopping);
    while (!stopping()) {
      let seen = 0;
      if (this.claimCursor !== "0-0" || Date.now() >= this.nextClaimAt) {
        seen = await this.reclaim(stopping);
      }
      // Do not block after reclaimed work: there may be more of it.
      const fresh = await this.read(">", seen > 0 ? 0 : this.config.blockMs);
      for (const [id, fields] of fresh) {
        if (stopping()) return;
        await this.handle(id, fields, 1); // read with ">": its first delivery
      }
    }
  }

  /** What this consumer name read before a crash or a stop and never acknowledged, in stream
   *  order, before anything newer: a restart keeps each aggregate's order. */
  private async resumeOwnEntries(stopping: () => boolean): Promise<void> {
    let after = "0";
    for (;;) {
      const entries = await this.read(after, 0);
      if (entries.length === 0) return;
      for (const [id, fields] of entries) {
        if (stopping()) return;
        await this.handle(id, fields, await this.deliveries(id));
        after = id;
      }
    }
  }

  private async read(from: string, blockMs: number): Promise<Entry[]> {
    const { group, consumer, batchSize, stream } = this.config;
    const block = blockMs > 0 ? ["BLOCK", blockMs] : [];
    const reply = (await this.redis.call(
      "XREADGROUP",
      ...["GROUP", group, consumer, "COUNT", batchSize, ...block, "STREAMS", stream, from],
    )) as [string, Entry[]][] | null;
    return reply?.[0]?.[1] ?? [];
  }

  /** One XAUTOCLAIM page: entries pending longer than claimIdleMs, whoever holds them. */
  private async reclaim(stopping: () => boolean): Promise<number> {
    const { stream, group, consumer, claimIdleMs, batchSize } = this.config;
    const [cursor, entries] = (await this.redis.xautoclaim(
      stream,
      group,
      consumer,
      claimIdleMs,
      this.claimCursor,
      "COUNT",
      batchSize,
    )) as [string, (Entry | null)[]];
    this.claimCursor = cursor;
    if (cursor === "0-0") this.nextClaimAt = Date.now() + this.config.claimIntervalMs;
    const claimed = entries.filter((entry): entry is Entry => entry !== null);
    if (claimed.length > 0) this.log(`reclaimed ${claimed.length} entries idle for ${claimIdleMs} ms or more`);
    for (const [id, fields] of claimed) {
      if (stopping()) break;
      this.stats.reclaimed++;
      await this.handle(id, fields, await this.deliveries(id));
    }
    return claimed.length;
  }

  /** The entry's delivery count, this delivery included; null once it is not ours any more. */
  private async deliveries(id: string): Promise<number | null> {
    const rows = (await this.redis.xpending(this.config.stream, this.config.group, id, id, 1)) as [
      string,
      string,
      number,
      number,
    ][];
    const row = rows[0];
    return row !== undefined && row[1] === this.config.consumer ? row[3] : null;
  }

  private async handle(id: string, fields: string[] | null, deliveries: number | null): Promise<void> {
    if (deliveries === null) return; // acknowledged or claimed by another consumer meanwhile
    if (fields === null) {
      await this.ack(id); // deleted from the stream (XDEL, MAXLEN): nothing left to handle
      return;
    }
    let event: OutboxEvent;
    try {
      event = parseEntry(id, fields);
    } catch (error) {
      if (!(error instanceof MalformedEntry)) throw error;
      await this.deadLetter(id, fields, `malformed entry: ${error.message}`, deliveries);
      return;
    }
    const { stream, group } = this.config;
    await inProcessSpan(this.tracer, stream, group, event, (span) => this.process(id, fields, event, deliveries, span));
  }

  /** What happens to a well-formed entry: applied once, or a duplicate, or left for a retry, or
   *  dead-lettered. Its outcome goes on the span as `outbox.outcome`. */
  private async process(
    id: string,
    fields: string[],
    event: OutboxEvent,
    deliveries: number,
    span: Span,
  ): Promise<void> {
    const outcome = (what: string) => span.setAttribute("outbox.outcome", what);
    const { maxDeliveries } = this.config;
    if (deliveries > maxDeliveries) {
      // Never acknowledged nor reported failed that often: its handler probably kills the process.
      outcome("dead-lettered");
      await this.deadLetter(id, fields, `delivered ${deliveries} times without being acknowledged`, deliveries);
      return;
    }
    let applied: "processed" | "duplicate";
    try {
      applied = await this.applyOnce(event);
    } catch (error) {
      if (!(error instanceof HandlerFailed)) throw error;
      this.stats.handlerErrors++;
      span.setStatus({ code: SpanStatusCode.ERROR, message: error.message });
      if (deliveries >= maxDeliveries) {
        outcome("dead-lettered");
        await this.deadLetter(id, fields, `handler failed on delivery ${deliveries}: ${error.message}`, deliveries);
      } else {
        outcome("retried");
        this.log(
          `${describe(event)}: handler failed on delivery ${deliveries} of ${maxDeliveries} ` +
            `(retried after ${this.config.claimIdleMs} ms): ${error.message}`,
        );
      }
      return; // left pending: XAUTOCLAIM hands it out again
    }
    await this.ack(id);
    outcome(applied);
    if (event.replay !== null) this.stats.replayed++;
    if (applied === "duplicate") {
      this.stats.duplicates++;
      return;
    }
    this.stats.processed++;
    console.log(
      JSON.stringify({
        event_id: event.eventId,
        aggregate_type: event.aggregateType,
        aggregate_id: event.aggregateId,
        aggregate_seq: event.aggregateSeq,
        event_type: event.eventType,
        entry_id: id,
        deliveries,
        trace_id: span.spanContext().traceId,
      }),
    );
  }

  /** The dedup rule: the mark and the effect commit together, so a crash anywhere before COMMIT
   *  undoes both, and a redelivery after it finds the mark and skips the effect. */
  private async applyOnce(event: OutboxEvent): Promise<"processed" | "duplicate"> {
    const db = this.db;
    await db.query("BEGIN");
    try {
      const mark = await db.query<{ first: boolean }>("SELECT outbox_mark_processed($1, $2) AS first", [
        this.config.group,
        event.eventId,
      ]);
      if (!mark.rows[0].first) {
        await db.query("ROLLBACK");
        return "duplicate";
      }
      const warning = await this.checkOrder(event);
      try {
        await this.handler(db, event);
      } catch (error) {
        throw new HandlerFailed(error instanceof Error ? error.message : String(error));
      }
      await db.query("COMMIT");
      if (warning !== null) {
        this.stats.orderWarnings++;
        this.log(warning);
      }
      return "processed";
    } catch (error) {
      await db.query("ROLLBACK").catch(() => undefined);
      throw error;
    }
  }

  /** aggregate_seq against the last one applied for the aggregate (outbox_pg numbers them 1, 2,
   *  3, ... in commit order). A gap: earlier events not handled yet (failing, dead-lettered, or
   *  lost); lower: an earlier event handled late (a retry). Reported, never refused. */
  private async checkOrder(event: OutboxEvent): Promise<string | null> {
    const key = [this.config.group, event.aggregateType, event.aggregateId];
    const found = await this.db.query<{ last_seq: string }>(
      `SELECT last_seq FROM aggregate_positions
        WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3 FOR UPDATE`,
      key,
    );
    const last = found.rows.length > 0 ? Number(found.rows[0].last_seq) : 0;
    await this.db.query(
      `INSERT INTO aggregate_positions AS p VALUES ($1, $2, $3, $4)
       ON CONFLICT (consumer_group, aggregate_type, aggregate_id)
       DO UPDATE SET last_seq = greatest(p.last_seq, excluded.last_seq)`,
      [...key, event.aggregateSeq],
    );
    const seq = event.aggregateSeq;
    if (seq === last + 1) return null;
    if (seq > last + 1) {
      return `${describe(event)}: gap: aggregate_seq ${seq} follows ${last}, ${seq - last - 1} earlier not handled yet`;
    }
    return `${describe(event)}: reordered: aggregate_seq ${seq} after ${last}`;
  }

  /** XACK, or XACKDEL ... ACKED (deleteAcked, where the server has it): the entry is also deleted
   *  if every other group has acknowledged it already, else it stays for them. */
  private async ack(id: string): Promise<void> {
    const { stream, group } = this.config;
    if (this.ackDeletes) {
      await this.redis.call("XACKDEL", stream, group, "ACKED", "IDS", 1, id);
      return;
    }
    await this.redis.xack(stream, group, id);
  }

  /** XADD a copy (fields plus why) to the dead-letter stream, then acknowledge it. Not one
   *  transaction on purpose: a crash in between leaves the dead letter twice, never zero times. */
  private async deadLetter(id: string, fields: string[], error: string, deliveries: number): Promise<void> {
    const { deadLetterStream, stream } = this.config;
    const why = ["error", error, "deliveries", deliveries, "original_id", id, "original_stream", stream];
    await this.redis.xadd(deadLetterStream, "*", ...fields, ...why);
    await this.ack(id);
    this.stats.deadLettered++;
    this.log(`entry ${id} moved to ${deadLetterStream}: ${error}`);
  }
}

function describe(event: OutboxEvent): string {
  return `${event.aggregateType}/${event.aggregateId} #${event.aggregateSeq} (event ${event.eventId})`;
}
