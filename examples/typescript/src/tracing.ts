// Continuing the enqueuer's trace (README, "Tracing"). An entry carries the W3C `traceparent` and
// `tracestate` of the transaction that enqueued its event; the W3C propagator turns them into the
// parent of a CONSUMER span, `process <stream>` as the OpenTelemetry messaging conventions name
// it, inside which the event is processed. So the trace goes on from the producer's request,
// through outbox_pg, into this consumer. An event enqueued in no trace gets a span of its own, a
// new root.
//
// Spans go to whatever tracer provider the process registered (none: OpenTelemetry's no-op one).
// With OTEL_EXPORT_FILE=path this file registers one that writes each finished span as a JSON
// line to that file (how tests/examples.rs sees them); for a collector, register your SDK's OTLP
// exporter instead, here or in your own setup.

import { appendFileSync } from "node:fs";
import {
  ROOT_CONTEXT,
  SpanKind,
  SpanStatusCode,
  defaultTextMapGetter,
  trace,
  type Span,
  type Tracer,
} from "@opentelemetry/api";
import { ExportResultCode, W3CTraceContextPropagator, type ExportResult } from "@opentelemetry/core";
import {
  BasicTracerProvider,
  SimpleSpanProcessor,
  type ReadableSpan,
  type SpanExporter,
} from "@opentelemetry/sdk-trace-base";
import type { OutboxEvent } from "./event.js";

const propagator = new W3CTraceContextPropagator();

/** Writes each span as one JSON line: ids in W3C hex, the event's id, the attributes. */
export class JsonLinesSpanExporter implements SpanExporter {
  constructor(private readonly path: string) {}

  export(spans: ReadableSpan[], resultCallback: (result: ExportResult) => void): void {
    try {
      const lines = spans.map((span) => {
        const context = span.spanContext();
        return JSON.stringify({
          trace_id: context.traceId,
          span_id: context.spanId,
          parent_span_id: span.parentSpanContext?.spanId ?? null,
          name: span.name,
          kind: SpanKind[span.kind],
          status: SpanStatusCode[span.status.code],
          event_id: span.attributes["messaging.message.id"] ?? null,
          attributes: span.attributes,
        });
      });
      // One write per batch, appended: a process killed later loses no span already ended.
      appendFileSync(this.path, lines.map((line) => `${line}\n`).join(""));
      resultCallback({ code: ExportResultCode.SUCCESS });
    } catch (error) {
      resultCallback({ code: ExportResultCode.FAILED, error: error as Error });
    }
  }

  async shutdown(): Promise<void> {}
}

/** Registers a tracer provider exporting to OTEL_EXPORT_FILE when it is set; the tracer. */
export function setUpTracing(): { tracer: Tracer; shutdown: () => Promise<void> } {
  const file = process.env.OTEL_EXPORT_FILE;
  let shutdown = async () => {};
  if (file) {
    const provider = new BasicTracerProvider({
      spanProcessors: [new SimpleSpanProcessor(new JsonLinesSpanExporter(file))],
    });
    trace.setGlobalTracerProvider(provider);
    shutdown = () => provider.shutdown();
  }
  return { tracer: trace.getTracer("outbox-pg-consumer-example"), shutdown };
}

/** Runs `process` inside the event's CONSUMER span: a child of the enqueuer's span when the entry
 *  has a traceparent, else a new root. The span ends when `process` settles; its status is ERROR
 *  when it throws. */
export async function inProcessSpan<T>(
  tracer: Tracer,
  stream: string,
  group: string,
  event: OutboxEvent,
  process: (span: Span) => Promise<T>,
): Promise<T> {
  const carrier: Record<string, string> = {};
  if (event.traceparent !== null) carrier.traceparent = event.traceparent;
  if (event.tracestate !== null) carrier.tracestate = event.tracestate;
  const parent = propagator.extract(ROOT_CONTEXT, carrier, defaultTextMapGetter);
  const attributes = {
    "messaging.system": "redis",
    "messaging.operation.name": "process",
    "messaging.operation.type": "process",
    "messaging.destination.name": stream,
    "messaging.consumer.group.name": group,
    "messaging.message.id": event.eventId,
    "outbox.aggregate_type": event.aggregateType,
    "outbox.aggregate_id": event.aggregateId,
    "outbox.aggregate_seq": event.aggregateSeq,
    "outbox.event_type": event.eventType,
  };
  // startActiveSpan: the handler's own spans are children when a context manager is registered.
  return tracer.startActiveSpan(
    `process ${stream}`,
    { kind: SpanKind.CONSUMER, attributes },
    parent,
    async (span) => {
      try {
        return await process(span);
      } catch (error) {
        span.recordException(error as Error);
        span.setStatus({ code: SpanStatusCode.ERROR, message: (error as Error).message });
        throw error;
      } finally {
        span.end();
      }
    },
  );
}
