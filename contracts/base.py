"""Base record type and the JSON wire codec shared by Kafka and MQTT.

Every record carries ``schema_version`` so that a consumer can reject (and count) a record
written by a newer, incompatible producer instead of misreading it.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict

SCHEMA_VERSION = 1
"""Version of every record defined in :mod:`contracts`. Bumped on an incompatible change."""


class Record(BaseModel):
    """Base of every record on the bus or on MQTT.

    Unknown fields are rejected (``extra="forbid"``) so a typo in a producer is an error at the
    producer, not silent data loss at the consumer. Records are immutable once built.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION


R = TypeVar("R", bound=Record)


def encode(record: Record) -> bytes:
    """Serialise ``record`` to UTF-8 JSON bytes (the wire format on Kafka and MQTT)."""
    return record.model_dump_json().encode()


def decode(model: type[R], payload: bytes | str) -> R:
    """Parse JSON ``payload`` into ``model``.

    Raises:
        pydantic.ValidationError: the payload is not JSON, misses a field, has a wrong type, or
            carries a ``schema_version`` other than :data:`SCHEMA_VERSION`.
    """
    rec = model.model_validate_json(payload)
    if rec.schema_version != SCHEMA_VERSION:
        # Raise a ValidationError-compatible error so callers need one except clause.
        raise ValueError(f"unsupported schema_version {rec.schema_version} (expected {SCHEMA_VERSION})")
    return rec
