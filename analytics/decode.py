"""Decoding of telemetry records read from the bus, with a reason code for every rejection."""

from __future__ import annotations

import math

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from contracts import SCHEMA_VERSION, GpuSample, IbPortSample, KafkaTopics, decode
from contracts.bus import BusMessage


class RejectedRecord(ValueError):
    """A record that cannot be used; :attr:`reason` is the metric label
    (``tombstone``, ``unknown_topic``, ``malformed_json``, ``invalid_record``,
    ``unsupported_version``, ``bad_timestamp``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        """Build with a reason code and a short human detail."""
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def decode_telemetry(msg: BusMessage, topics: KafkaTopics) -> GpuSample | IbPortSample:
    """Decode ``msg`` by its topic: :class:`GpuSample` on ``topics.telemetry_gpu``,
    :class:`IbPortSample` on ``topics.telemetry_ib_port`` (JSON, :func:`contracts.decode`).

    Raises:
        RejectedRecord: with the reason the record cannot be used.
    """
    model: type[GpuSample] | type[IbPortSample]
    if msg.topic == topics.telemetry_gpu:
        model = GpuSample
    elif msg.topic == topics.telemetry_ib_port:
        model = IbPortSample
    else:
        raise RejectedRecord("unknown_topic", msg.topic)
    if msg.value is None:
        raise RejectedRecord("tombstone")
    try:
        record = decode(model, msg.value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if any(e.get("type") == "json_invalid" for e in errors):
            raise RejectedRecord("malformed_json", str(errors[0].get("msg", ""))) from exc
        raise RejectedRecord("invalid_record", _summary(errors)) from exc
    except ValueError as exc:  # contracts.decode: schema_version != SCHEMA_VERSION
        raise RejectedRecord("unsupported_version", f"expected {SCHEMA_VERSION}") from exc
    if not math.isfinite(record.ts):
        raise RejectedRecord("bad_timestamp", repr(record.ts))
    return record


def _summary(errors: list[ErrorDetails]) -> str:
    if not errors:
        return ""
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"])
    return f"{loc}: {first['msg']}"[:200]
