// One outbox_pg stream entry as a typed event (README, "Stream entries"), in either entry format:
// native (outbox_pg's own field names) or CloudEvents (`outbox.entry_format = cloudevents`: the
// CloudEvents 1.0 attributes as fields, told apart by `specversion`). Parsed with the rules of the
// Rust consumer (consumer/src/event.rs), the field names as protocol/src/entry.rs lists them: a
// missing or invalid field makes the entry malformed, and names the field (the CloudEvents
// attribute's name in a CloudEvent); unknown fields are ignored, so that newer relays can add some.

export interface OutboxEvent {
  /** Stable across redeliveries and replays: the dedup key. CloudEvents: `id`. */
  eventId: string;
  /** The row id in outbox.messages (a bigint; kept as text, it may exceed 2^53). */
  outboxId: string;
  aggregateType: string;
  /** CloudEvents: `subject`. */
  aggregateId: string;
  /** 1, 2, 3, ... per aggregate, in commit order. */
  aggregateSeq: number;
  /** CloudEvents: `type`. */
  eventType: string;
  /** The payload's JSON, parsed. CloudEvents: `data`. */
  payload: unknown;
  /** The headers' JSON object, or null when the event has none. */
  headers: Record<string, unknown> | null;
  /** Enqueue time, RFC 3339 UTC with microseconds. CloudEvents: `time`. */
  createdAt: string;
  /** The W3C traceparent of the enqueuing transaction, or null: continue the trace from it. One
   *  that is not valid W3C counts as none, as the specification says. */
  traceparent: string | null;
  /** The W3C tracestate that goes with traceparent, or null. */
  tracestate: string | null;
  /** The id of the outbox.replay() that sent this entry again, or null for a first publication. */
  replay: string | null;
  /** A CloudEvent's `source` attribute; null for a native entry. */
  source: string | null;
  /** Where the entry was read: a copy of the same event has another entry id. */
  entryId: string;
}

/** Why an entry cannot be an event. No retry can fix it: it goes to the dead-letter stream. */
export class MalformedEntry extends Error {
  constructor(
    readonly field: string,
    reason: string,
  ) {
    super(`field ${field}: ${reason}`);
  }
}

type Native =
  | "event_id"
  | "outbox_id"
  | "aggregate_type"
  | "aggregate_id"
  | "aggregate_seq"
  | "event_type"
  | "payload"
  | "headers"
  | "traceparent"
  | "tracestate"
  | "created_at"
  | "replay";

/** The field of a CloudEvents entry that carries each native field (protocol/src/entry.rs). */
const CLOUDEVENTS: Record<Native, string> = {
  event_id: "id",
  outbox_id: "outboxid",
  aggregate_type: "aggregatetype",
  aggregate_id: "subject",
  aggregate_seq: "aggregateseq",
  event_type: "type",
  payload: "data",
  headers: "headers",
  traceparent: "traceparent",
  tracestate: "tracestate",
  created_at: "time",
  replay: "replay",
};

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
const INTEGER = /^-?[0-9]+$/;
const RFC3339 = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$/;
/** W3C Trace Context, version 00; the trace id and the parent id must not be all zeros. */
const TRACEPARENT = /^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$/;

/** Parses an entry's flat field/value list, as XREADGROUP and XAUTOCLAIM return it. */
export function parseEntry(entryId: string, flat: string[]): OutboxEvent {
  const fields = new Map<string, string>();
  for (let i = 0; i + 1 < flat.length; i += 2) {
    if (fields.has(flat[i])) throw new MalformedEntry(flat[i], "appears more than once");
    fields.set(flat[i], flat[i + 1]);
  }
  const cloudEvent = fields.has("specversion");
  const nameOf = (native: Native): string => (cloudEvent ? CLOUDEVENTS[native] : native);
  const own = (name: string): string => {
    const value = fields.get(name);
    if (value === undefined) throw new MalformedEntry(name, "missing");
    if (value === "") throw new MalformedEntry(name, "empty");
    return value;
  };
  const optional = (native: Native): string | null => fields.get(nameOf(native)) ?? null;
  const required = (native: Native): string => own(nameOf(native));
  const integer = (native: Native, text: string): string => {
    if (!INTEGER.test(text)) throw new MalformedEntry(nameOf(native), `not an integer: ${JSON.stringify(text)}`);
    return text;
  };
  const json = (native: Native, text: string): unknown => {
    try {
      return JSON.parse(text);
    } catch (error) {
      throw new MalformedEntry(nameOf(native), `not JSON: ${(error as Error).message}`);
    }
  };

  let source: string | null = null;
  if (cloudEvent) {
    const specversion = own("specversion");
    if (specversion !== "1.0") {
      throw new MalformedEntry("specversion", `only CloudEvents 1.0 is read, got ${JSON.stringify(specversion)}`);
    }
    const contentType = own("datacontenttype");
    if (contentType !== "application/json") {
      throw new MalformedEntry("datacontenttype", `must be application/json, got ${JSON.stringify(contentType)}`);
    }
    source = own("source");
  }
  const eventId = required("event_id");
  if (!UUID.test(eventId)) throw new MalformedEntry(nameOf("event_id"), `not a UUID: ${JSON.stringify(eventId)}`);
  const seq = Number(integer("aggregate_seq", required("aggregate_seq")));
  if (!Number.isSafeInteger(seq) || seq < 1) {
    throw new MalformedEntry(nameOf("aggregate_seq"), `must be 1 or more, got ${seq}`);
  }
  const headersText = optional("headers");
  let headers: Record<string, unknown> | null = null;
  if (headersText !== null) {
    const value = json("headers", headersText);
    if (typeof value !== "object" || value === null || Array.isArray(value)) {
      throw new MalformedEntry("headers", "must be a JSON object");
    }
    headers = value as Record<string, unknown>;
  }
  const createdAt = required("created_at");
  if (!RFC3339.test(createdAt)) {
    throw new MalformedEntry(nameOf("created_at"), `not RFC 3339: ${JSON.stringify(createdAt)}`);
  }
  // W3C: a traceparent that does not parse is ignored, with its tracestate; the event is no less
  // valid for it.
  const traceparent = optional("traceparent");
  const traced = traceparent !== null && TRACEPARENT.test(traceparent);
  const tracestate = optional("tracestate");
  const replay = optional("replay");

  return {
    eventId,
    outboxId: integer("outbox_id", required("outbox_id")),
    aggregateType: required("aggregate_type"),
    aggregateId: required("aggregate_id"),
    aggregateSeq: seq,
    eventType: required("event_type"),
    payload: json("payload", required("payload")),
    headers,
    createdAt,
    traceparent: traced ? traceparent : null,
    tracestate: traced && tracestate !== "" ? tracestate : null,
    replay: replay === null ? null : integer("replay", replay),
    source,
    entryId,
  };
}
