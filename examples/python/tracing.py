"""Continuing the enqueuer's trace (README, "Tracing"). An entry carries the W3C `traceparent` and
`tracestate` of the transaction that enqueued its event; the W3C propagator turns them into the
parent of a CONSUMER span, `process <stream>` as the OpenTelemetry messaging conventions name it,
inside which the event is processed. So the trace goes on from the producer's request, through
outbox_pg, into this consumer. An event enqueued in no trace gets a span of its own, a new root.

Spans go to whatever tracer provider the process set (none: OpenTelemetry's no-op one). With
OTEL_EXPORT_FILE=path, set_up_tracing() sets one that writes each finished span as a JSON line to
that file (how tests/examples.rs sees them); for a collector, set your SDK's OTLP exporter instead,
there or in your own setup."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Iterator, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from event import OutboxEvent

PROPAGATOR = TraceContextTextMapPropagator()


class JsonLinesSpanExporter(SpanExporter):
    """Writes each span as one JSON line: ids in W3C hex, the event's id, the attributes."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            context = span.get_span_context()
            attributes = dict(span.attributes or {})
            lines.append(
                json.dumps(
                    {
                        "trace_id": format(context.trace_id, "032x") if context else None,
                        "span_id": format(context.span_id, "016x") if context else None,
                        "parent_span_id": format(span.parent.span_id, "016x") if span.parent else None,
                        "name": span.name,
                        "kind": span.kind.name,
                        "status": span.status.status_code.name,
                        "event_id": attributes.get("messaging.message.id"),
                        "attributes": attributes,
                    }
                )
            )
        try:
            # One write per batch, appended: a process killed later loses no span already ended.
            with open(self.path, "a", encoding="utf-8") as out:
                out.write("".join(f"{line}\n" for line in lines))
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def set_up_tracing() -> trace.Tracer:
    """Sets a tracer provider exporting to OTEL_EXPORT_FILE when it is set; the tracer."""
    path = os.environ.get("OTEL_EXPORT_FILE")
    if path:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
        trace.set_tracer_provider(provider)
    return trace.get_tracer("outbox-pg-consumer-example")


@contextmanager
def process_span(tracer: trace.Tracer, stream: str, group: str, event: OutboxEvent) -> Iterator[Span]:
    """The event's CONSUMER span, current while the block runs: a child of the enqueuer's span when
    the entry has a traceparent, else a new root. An exception leaving the block marks it ERROR."""
    carrier = {}
    if event.traceparent is not None:
        carrier["traceparent"] = event.traceparent
        if event.tracestate is not None:
            carrier["tracestate"] = event.tracestate
    # Extracted into an empty context, not the current one: no traceparent means no parent.
    parent = PROPAGATOR.extract(carrier, context=Context())
    attributes: dict[str, AttributeValue] = {
        "messaging.system": "redis",
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": stream,
        "messaging.consumer.group.name": group,
        "messaging.message.id": event.event_id,
        "outbox.aggregate_type": event.aggregate_type,
        "outbox.aggregate_id": event.aggregate_id,
        "outbox.aggregate_seq": event.aggregate_seq,
        "outbox.event_type": event.event_type,
    }
    with tracer.start_as_current_span(
        f"process {stream}", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
    ) as span:
        yield span
