"""Base record type and the JSON wire codec shared by Kafka and MQTT.

Every record carries ``schema_version`` so that a consumer can reject (and count) a record
written by a newer, incompatible producer instead of misreading it.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

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


def known_fields(model: type[BaseModel], obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without the keys ``model`` does not define, recursively into nested models and
    lists of models (what a tolerant reader validates)."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        if name not in obj:
            continue
        value = obj[name]
        sub = _model_of(field.annotation)
        if sub is not None and isinstance(value, dict):
            value = known_fields(sub, value)
        elif sub is not None and isinstance(value, list):
            value = [known_fields(sub, v) if isinstance(v, dict) else v for v in value]
        out[name] = value
    return out


def _model_of(annotation: object) -> type[BaseModel] | None:
    """The model in ``M``, ``M | None`` or ``list[M]``, else ``None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def decode_compatible(model: type[R], payload: bytes | str) -> R:
    """Parse JSON ``payload`` into ``model`` as a tolerant reader: fields ``model`` does not know
    are ignored (at every level) and any integer ``schema_version`` >= 1 is read (a newer
    version on the same topic only adds fields: the versioning policy of ``docs/asyncapi.yaml``).
    The record returned has this release's :data:`SCHEMA_VERSION`.

    Raises:
        ValueError (``pydantic.ValidationError`` or ``json.JSONDecodeError`` among them): not a
            JSON object, a version that is not an integer >= 1, a missing or mistyped field.
    """
    obj = json.loads(payload)
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object but {type(obj).__name__}")
    version = obj.get("schema_version", SCHEMA_VERSION)
    if type(version) is not int or version < 1:
        raise ValueError(f"unsupported schema_version {version!r} (an integer >= 1 is read)")
    fields = known_fields(model, obj)
    fields.pop("schema_version", None)
    return model.model_validate(fields)
