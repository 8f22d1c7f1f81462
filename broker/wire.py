"""Strict decoding of site messages (claims, renewals, releases) into contract models, with the
reason code a broken one is answered with. Formats: :mod:`contracts.mqtt` (JSON, protocol v1);
limits: :data:`contracts.mqtt.LIMITS`.

Checks, in order, each failing with ``malformed`` (``unsupported_version`` for the version) and a
``check`` label counted in ``gpupool_broker_malformed_messages_total``: ``size`` (payload over
``max_payload_bytes``), ``utf8`` (not valid UTF-8, or a ``\\u`` escape of a lone surrogate),
``json`` (not JSON, or a constant ``NaN``/``Infinity``), ``depth`` (objects and arrays nested deeper
than ``max_depth``, checked on the text before parsing so no input can exhaust the parser's
recursion), ``non_finite`` (a number that overflows to infinity), ``object`` (not a JSON object),
``version`` and ``schema`` (pydantic strict mode: no type coercion — ``true`` is not a count,
``"600"`` is not a duration — plus every bound of the model). A claim that carries a command
field (:data:`contracts.mqtt.CLAIM_COMMAND_FIELDS`) fails check ``command`` with
``command_not_allowed``, before the schema.

Readers are tolerant of additive changes: fields the model does not know are dropped (at every
nesting level) before validation, and every integer ``schema_version`` >= 1 is accepted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from contracts import ReasonCode, Record
from contracts.base import known_fields
from contracts.mqtt import LIMITS

R = TypeVar("R", bound=Record)

CHECKS = ("size", "utf8", "json", "depth", "non_finite", "object", "version", "command", "schema")
"""Every ``check`` a site message can fail (the metric's label values)."""


@dataclass(frozen=True, slots=True)
class Malformed:
    """Why a site message was refused before it reached the lease book.

    Attributes:
        code: ``malformed`` or ``unsupported_version`` (or ``internal``/``rate_limited`` when the
            service answers without the book).
        text: what was wrong, for the site's operator.
        in_reply_to: the message's id field (``claim_id`` / ``lease_id``) if it could be read as a
            bounded printable string, else ``""``.
        check: the failed check (one of :data:`CHECKS`); ``""`` for service answers.
        request_id: the message's ``request_id`` if it could be read, else ``None``.
    """

    code: ReasonCode
    text: str
    in_reply_to: str = ""
    check: str = ""
    request_id: str | None = None


def payload_bytes(payload: object) -> bytes:
    """An aiomqtt payload (``bytes``, ``bytearray``, ``str``, number or ``None``) as bytes."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    if payload is None:
        return b""
    return str(payload).encode()


def _depth_exceeds(text: str, limit: int) -> bool:
    """True if ``[``/``{`` nest deeper than ``limit`` outside strings (a linear scan)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


class _NonFinite(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(f"number {text[:40]} is not finite")
    return value


def _clean_str(value: object) -> bool:
    """True if ``value`` is a string that encodes as UTF-8 (no lone surrogates)."""
    if not isinstance(value, str):
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _strings_valid(obj: object) -> bool:
    if isinstance(obj, dict):
        return all(_clean_str(k) and _strings_valid(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_strings_valid(v) for v in obj)
    return _clean_str(obj)


def _ident(obj: dict[str, Any], field: str) -> str | None:
    value = obj.get(field)
    if isinstance(value, str) and 0 < len(value) <= LIMITS.max_id_chars and value.isprintable():
        return value if _clean_str(value) else None
    return None


def parse_site_message(
    model: type[R], payload: bytes, id_field: str, refused: Collection[str] = ()
) -> R | Malformed:
    """Parse ``payload`` as ``model`` (e.g. :class:`contracts.Claim` with ``id_field="claim_id"``).

    ``refused``: top-level field names a site may never send (a claim's
    :data:`contracts.mqtt.CLAIM_COMMAND_FIELDS`): a payload carrying one is answered
    ``command_not_allowed`` (check ``command``) instead of having the field ignored as unknown.

    Returns the model, or a :class:`Malformed` saying which check failed and why (see the
    module docstring). Never raises.
    """
    if len(payload) > LIMITS.max_payload_bytes:
        return Malformed(
            ReasonCode.MALFORMED,
            f"payload of {len(payload)} bytes exceeds {LIMITS.max_payload_bytes}",
            check="size",
        )
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        return Malformed(ReasonCode.MALFORMED, f"not UTF-8: {e.reason} at byte {e.start}", check="utf8")
    if _depth_exceeds(text, LIMITS.max_depth):
        return Malformed(ReasonCode.MALFORMED, f"nested deeper than {LIMITS.max_depth}", check="depth")
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except _NonFinite as e:
        return Malformed(ReasonCode.MALFORMED, str(e), check="non_finite")
    except (ValueError, RecursionError) as e:
        return Malformed(ReasonCode.MALFORMED, f"not JSON: {str(e)[:200]}", check="json")
    if not isinstance(obj, dict):
        return Malformed(ReasonCode.MALFORMED, f"not a JSON object but {type(obj).__name__}", check="object")
    in_reply_to = _ident(obj, id_field) or ""
    request_id = _ident(obj, "request_id")
    if not _strings_valid(obj):
        return Malformed(
            ReasonCode.MALFORMED, "a string is not valid Unicode (lone surrogate)", in_reply_to, "utf8"
        )
    version = obj.get("schema_version", 1)
    if type(version) is not int or version < 1:
        return Malformed(
            ReasonCode.UNSUPPORTED_VERSION,
            f"schema_version {str(version)[:40]!r}: an integer >= 1 is expected",
            in_reply_to,
            "version",
            request_id,
        )
    sent = sorted(set(refused).intersection(obj))
    if sent:
        return Malformed(
            ReasonCode.COMMAND_NOT_ALLOWED,
            f"a site never sends a command ({', '.join(sent)}): name a workload profile",
            in_reply_to,
            "command",
            request_id,
        )
    fields = known_fields(model, obj)
    fields.pop("schema_version", None)  # a newer compatible version is read as this one
    try:
        return model.model_validate(fields, strict=True)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "(root)"
        return Malformed(
            ReasonCode.MALFORMED,
            f"{e.error_count()} schema error(s); {where}: {first.get('msg', '')}"[:500],
            in_reply_to,
            "schema",
            request_id,
        )


def peek_id(payload: bytes, id_field: str) -> str:
    """The ``id_field`` of a site message if it can be read cheaply and safely (within the size
    and depth limits, a bounded printable string), else ``""`` — for answers given without
    decoding the message (``rate_limited``, ``internal``). Never raises."""
    if len(payload) > LIMITS.max_payload_bytes:
        return ""
    try:
        text = payload.decode("utf-8")
        if _depth_exceeds(text, LIMITS.max_depth):
            return ""
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return ""
    return (_ident(obj, id_field) or "") if isinstance(obj, dict) else ""
