"""One outbox_pg stream entry as a typed event (README, "Stream entries"), in either entry format:
native (outbox_pg's own field names) or CloudEvents (`outbox.entry_format = cloudevents`: the
CloudEvents 1.0 attributes as fields, told apart by `specversion`). Parsed with the rules of the
Rust consumer (consumer/src/event.rs), the field names as protocol/src/entry.rs lists them: a
missing or invalid field makes the entry malformed, and names the field (the CloudEvents
attribute's name in a CloudEvent); unknown fields are ignored, so that newer relays can add some."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)
INTEGER = re.compile(r"-?[0-9]+")
RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})", re.ASCII)
# W3C Trace Context, version 00; the trace id and the parent id must not be all zeros.
TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")

# The field of a CloudEvents entry that carries each native field (protocol/src/entry.rs).
CLOUDEVENTS = {
    "event_id": "id",
    "outbox_id": "outboxid",
    "aggregate_type": "aggregatetype",
    "aggregate_id": "subject",
    "aggregate_seq": "aggregateseq",
    "event_type": "type",
    "payload": "data",
    "headers": "headers",
    "traceparent": "traceparent",
    "tracestate": "tracestate",
    "created_at": "time",
    "replay": "replay",
}


@dataclass(frozen=True)
class OutboxEvent:
    event_id: str  # stable across redeliveries and replays: the dedup key (CloudEvents: id)
    outbox_id: int  # the row id in outbox.messages
    aggregate_type: str
    aggregate_id: str  # CloudEvents: subject
    aggregate_seq: int  # 1, 2, 3, ... per aggregate, in commit order
    event_type: str  # CloudEvents: type
    payload: Any  # the payload's JSON, parsed (CloudEvents: data)
    headers: dict[str, Any] | None  # the headers' JSON object, or None when the event has none
    created_at: str  # enqueue time, RFC 3339 UTC with microseconds (CloudEvents: time)
    # The W3C traceparent of the enqueuing transaction, or None: continue the trace from it. One
    # that is not valid W3C counts as none, as the specification says.
    traceparent: str | None
    tracestate: str | None  # the W3C tracestate that goes with traceparent, or None
    replay: int | None  # the id of the outbox.replay() that sent this entry again, or None
    source: str | None  # a CloudEvent's source attribute; None for a native entry
    entry_id: str  # where it was read: a copy of the same event has another entry id


class MalformedEntry(Exception):
    """Why an entry cannot be an event. No retry can fix it: it goes to the dead-letter stream."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"field {field}: {reason}")
        self.field = field


def parse_entry(entry_id: str, fields: dict[str, str]) -> OutboxEvent:
    """Parses an entry's fields, as redis-py returns them (XREADGROUP, XAUTOCLAIM)."""
    cloud_event = "specversion" in fields

    def name_of(native: str) -> str:
        return CLOUDEVENTS[native] if cloud_event else native

    def own(name: str) -> str:
        value = fields.get(name)
        if value is None:
            raise MalformedEntry(name, "missing")
        if value == "":
            raise MalformedEntry(name, "empty")
        return value

    def required(native: str) -> str:
        return own(name_of(native))

    def optional(native: str) -> str | None:
        return fields.get(name_of(native))

    def integer(native: str, text: str) -> int:
        if not INTEGER.fullmatch(text):
            raise MalformedEntry(name_of(native), f"not an integer: {text!r}")
        return int(text)

    def parsed_json(native: str, text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError as error:
            raise MalformedEntry(name_of(native), f"not JSON: {error}") from None

    source = None
    if cloud_event:
        specversion = own("specversion")
        if specversion != "1.0":
            raise MalformedEntry("specversion", f"only CloudEvents 1.0 is read, got {specversion!r}")
        content_type = own("datacontenttype")
        if content_type != "application/json":
            raise MalformedEntry("datacontenttype", f"must be application/json, got {content_type!r}")
        source = own("source")
    event_id = required("event_id")
    if not UUID.fullmatch(event_id):
        raise MalformedEntry(name_of("event_id"), f"not a UUID: {event_id!r}")
    seq = integer("aggregate_seq", required("aggregate_seq"))
    if seq < 1:
        raise MalformedEntry(name_of("aggregate_seq"), f"must be 1 or more, got {seq}")
    headers = None
    headers_text = optional("headers")
    if headers_text is not None:
        headers = parsed_json("headers", headers_text)
        if not isinstance(headers, dict):
            raise MalformedEntry("headers", "must be a JSON object")
    created_at = required("created_at")
    if not RFC3339.fullmatch(created_at):
        raise MalformedEntry(name_of("created_at"), f"not RFC 3339: {created_at!r}")
    # W3C: a traceparent that does not parse is ignored, with its tracestate; the event is no less
    # valid for it.
    traceparent = optional("traceparent")
    if traceparent is not None and not TRACEPARENT.fullmatch(traceparent):
        traceparent = None
    tracestate = optional("tracestate") if traceparent is not None else None
    replay = optional("replay")

    return OutboxEvent(
        event_id=event_id,
        outbox_id=integer("outbox_id", required("outbox_id")),
        aggregate_type=required("aggregate_type"),
        aggregate_id=required("aggregate_id"),
        aggregate_seq=seq,
        event_type=required("event_type"),
        payload=parsed_json("payload", required("payload")),
        headers=headers,
        created_at=created_at,
        traceparent=traceparent,
        tracestate=tracestate or None,
        replay=None if replay is None else integer("replay", replay),
        source=source,
        entry_id=entry_id,
    )
