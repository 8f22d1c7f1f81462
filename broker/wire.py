"""Parsing of site messages (claims, renewals, releases) into contract models, with the reason
code a broken one is answered with. Formats: :mod:`contracts.mqtt` (JSON, protocol v1)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TypeVar

from pydantic import ValidationError

from contracts import SCHEMA_VERSION, ReasonCode, Record

R = TypeVar("R", bound=Record)


@dataclass(frozen=True, slots=True)
class Malformed:
    """Why a site message was refused before it reached the lease book.

    Attributes:
        code: ``malformed`` (not JSON, not an object, schema mismatch) or ``unsupported_version``.
        text: what was wrong, for the site's operator.
        in_reply_to: the message's id field (``claim_id`` / ``lease_id``) if it could be read as a
            string, else ``""``.
    """

    code: ReasonCode
    text: str
    in_reply_to: str = ""


def payload_bytes(payload: object) -> bytes:
    """An aiomqtt payload (``bytes``, ``bytearray``, ``str``, number or ``None``) as bytes."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    if payload is None:
        return b""
    return str(payload).encode()


def parse_site_message(model: type[R], payload: bytes, id_field: str) -> R | Malformed:
    """Parse ``payload`` as ``model`` (e.g. :class:`contracts.Claim` with ``id_field="claim_id"``).

    Returns the model, or a :class:`Malformed` saying why not: not UTF-8 JSON, not a JSON object,
    a ``schema_version`` other than :data:`contracts.SCHEMA_VERSION` (``unsupported_version``), a
    missing or mistyped field, or an unknown field (``malformed``).
    """
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return Malformed(ReasonCode.MALFORMED, f"not JSON: {e}")
    if not isinstance(obj, dict):
        return Malformed(ReasonCode.MALFORMED, f"not a JSON object but {type(obj).__name__}")
    ident = obj.get(id_field)
    in_reply_to = ident if isinstance(ident, str) else ""
    version = obj.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        return Malformed(
            ReasonCode.UNSUPPORTED_VERSION,
            f"schema_version {version!r}, expected {SCHEMA_VERSION}",
            in_reply_to,
        )
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "(root)"
        return Malformed(
            ReasonCode.MALFORMED,
            f"{e.error_count()} schema error(s); {where}: {first.get('msg', '')}",
            in_reply_to,
        )
