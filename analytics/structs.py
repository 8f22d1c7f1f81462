"""msgspec twins of the telemetry records, derived from the pydantic models at import time.

:func:`struct_for` builds, from a :class:`contracts.base.Record` model, a ``msgspec.Struct`` with
the same fields, types, defaults, constraints and unknown-field rule, and the model's own
properties and methods (``key``, ``partition_key``, ``data_bytes`` ...), so the rest of the stage
reads either one the same way. The JSON decoder of the twin (msgspec, C) accepts a subset of what
the model accepts (msgspec is strict: no string-to-number or float-to-int coercion, no ``NaN``
literal, numbers within float64), with the same values; :mod:`analytics.decode` sends every
record the twin refuses to the model, which then gives the verdict. Nothing is listed twice: a
field added to the model is in its twin too.

A model's ``mode="after"`` validators run on the twin after decoding (they read attributes only);
a nested model field gets a twin of its own. A model the translation does not cover (a type other
than ``int``, ``float``, ``str``, ``bool``, ``None``, ``Literal``, ``dict``, ``list``, nested
models and unions of them; a constraint other than
``ge``/``gt``/``le``/``lt``/``multiple_of``/``min_length``/``max_length``; field validators or
validators in another mode; aliases; a model setting that changes validation) has no twin: :func:`struct_for` returns ``None`` and its
records are all decoded by the model.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from typing import Any, Literal, Union

import annotated_types as at
import msgspec
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

_SCALARS = (int, float, str, bool)
_CONFIG_OK = {"extra", "frozen", "title", "json_schema_extra"}
"""Model settings that do not change what a record decodes to (``extra`` is translated)."""
_CONSTRAINTS: dict[type, str] = {
    at.Ge: "ge",
    at.Gt: "gt",
    at.Le: "le",
    at.Lt: "lt",
    at.MultipleOf: "multiple_of",
    at.MinLen: "min_length",
    at.MaxLen: "max_length",
}


class Untranslatable(TypeError):
    """A model field, setting or validator that has no msgspec equivalent."""


@functools.cache
def struct_for(
    model: type[BaseModel], types: tuple[tuple[str, Any], ...] = ()
) -> type[msgspec.Struct] | None:
    """The msgspec twin of ``model`` (module docstring), or ``None`` if it has none; one class
    per model and ``types`` (cached).

    ``types`` replaces the translated msgspec type of the fields it names (``(name, type)``
    pairs), e.g. ``list[msgspec.Raw]`` to keep a list's elements undecoded, or a twin built with
    such a replacement for a nested model. Raises ``KeyError`` for a name the model lacks.

    The twin is ``kw_only`` (fields in the model's order, required ones anywhere), ``frozen`` if
    the model is, and untracked by the cyclic garbage collector (``gc=False``: its instances hold
    only strings, numbers and containers of them, never a cycle).
    """
    try:
        return _struct_for(model, dict(types))
    except Untranslatable:
        return None


def _struct_for(model: type[BaseModel], types: dict[str, Any] | None = None) -> type[msgspec.Struct]:
    types = types or {}
    unknown = set(types) - set(model.model_fields)
    if unknown:
        raise KeyError(f"{model.__name__} has no field {sorted(unknown)}")
    config = dict(model.model_config)
    if set(config) - _CONFIG_OK:
        raise Untranslatable(f"model settings {sorted(set(config) - _CONFIG_OK)}")
    extra = config.get("extra", "ignore")
    if extra not in ("forbid", "ignore"):
        raise Untranslatable(f"extra={extra!r}")
    decorators = model.__pydantic_decorators__
    if any((decorators.validators, decorators.field_validators, decorators.root_validators)):
        raise Untranslatable("validators")
    checks = []
    for name, dec in decorators.model_validators.items():
        if dec.info.mode != "after":
            raise Untranslatable(f"model validator {name} (mode {dec.info.mode})")
        checks.append(dec.func)
    fields: list[tuple[str, Any, Any]] = []
    for name, info in model.model_fields.items():
        if info.alias not in (None, name) or info.validation_alias not in (None, name):
            raise Untranslatable(f"{name}: alias")
        if name in types:
            annotation = types[name]
        else:
            annotation = _constrained(_translate(info.annotation), info.metadata)
        if info.default_factory is not None:
            default = msgspec.field(default_factory=info.default_factory)  # type: ignore[arg-type]
        elif info.default is PydanticUndefined:
            default = msgspec.NODEFAULT
        else:
            default = info.default
        fields.append((name, annotation, default))
    namespace = _behaviour(model)
    if checks:
        namespace["__post_init__"] = _post_init(tuple(checks))
    suffix = "Struct" if not types else "RawStruct"
    return msgspec.defstruct(
        f"{model.__name__}{suffix}",
        [(n, a) if d is msgspec.NODEFAULT else (n, a, d) for n, a, d in fields],
        namespace=namespace,
        module=__name__,
        kw_only=True,
        frozen=bool(config.get("frozen", False)),
        forbid_unknown_fields=extra == "forbid",
        gc=False,
    )


def translate(tp: Any) -> Any:
    """The msgspec type of a pydantic field type (``dict[str, float | int]``, a model → its
    twin ...); raises :class:`Untranslatable`."""
    return _translate(tp)


def _translate(tp: Any) -> Any:
    """The msgspec type of a pydantic field type; raises :class:`Untranslatable`."""
    if tp is None or tp is type(None):
        return None
    if tp in _SCALARS:
        return tp
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal and all(isinstance(a, (str, int)) and not isinstance(a, bool) for a in args):
        return tp
    if origin in (Union, types.UnionType):
        return Union[tuple(_translate(a) for a in args)]  # noqa: UP007 (built from a tuple)
    if origin is dict and len(args) == 2 and args[0] is str:
        return dict[str, _translate(args[1])]  # type: ignore[misc]
    if origin is list and len(args) == 1:
        return list[_translate(args[0])]  # type: ignore[misc]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return _struct_for(tp)  # a nested model: its own twin
    raise Untranslatable(repr(tp))


def _post_init(checks: tuple[Any, ...]) -> Any:
    """A ``__post_init__`` that runs the model's ``mode="after"`` validators on the twin: they
    only read attributes, which the twin has under the same names; a ``ValueError`` they raise
    makes msgspec refuse the record (and the model then gives the verdict)."""

    def __post_init__(self: Any) -> None:
        for check in checks:
            check(self)

    return __post_init__


def _constrained(tp: Any, metadata: list[Any]) -> Any:
    """``tp`` with pydantic's constraints as ``msgspec.Meta``: on ``tp`` itself, or on the one
    member of ``X | None``; raises :class:`Untranslatable` for any other constraint or shape."""
    if not metadata:
        return tp
    meta: dict[str, Any] = {}
    for m in metadata:
        kind = _CONSTRAINTS.get(type(m))
        if kind is None:
            raise Untranslatable(repr(m))
        meta[kind] = getattr(m, kind)
    constraint = msgspec.Meta(**meta)
    members = typing.get_args(tp) if typing.get_origin(tp) is Union else (tp,)
    values = [a for a in members if a is not None and a is not type(None)]
    if len(values) != 1:
        raise Untranslatable(f"constraint on {tp!r}")
    inner = typing.Annotated[values[0], constraint]  # type: ignore[valid-type]  # built at run time
    return inner if len(values) == len(members) else Union[inner, None]  # noqa: UP007


def _behaviour(model: type[BaseModel]) -> dict[str, Any]:
    """The properties and public methods ``model`` itself defines (not pydantic's)."""
    out: dict[str, Any] = {}
    for cls in reversed(model.__mro__):
        if not issubclass(cls, BaseModel) or cls is BaseModel:
            continue
        for name, value in vars(cls).items():
            if name.startswith("_"):
                continue
            if isinstance(value, property) or (
                inspect.isfunction(value) and value.__qualname__.startswith(cls.__qualname__ + ".")
            ):
                out[name] = value
    return out
