"""Command-line options derived from the settings model: each option is declared once, as a field
of :class:`runtime.settings.DeploymentSettings` (type, default, validation, its docstring as
description, its option name in a :class:`runtime.settings.Flag` mark), and a command names which
fields it takes (:class:`runtime.settings.RunFlags`, by path or pattern: ``"collectors.*"``).

:func:`settings_command` turns those fields into the Typer options of a command: ``--config`` plus
one option per field, each of the field's type, defaulting to ``None`` = "not given" (so
:meth:`RunFlags.load` takes the value from ``GPUPOOL_*``, then the ``--config`` TOML file, then the
model's default), its help the field's description followed by the model's default and the setting
it overrides (``(default: 5; setting collectors.interval_s)``). Booleans get ``--x/--no-x``, lists
are repeatable.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer
from pydantic import SecretStr
from pydantic.fields import FieldInfo

from runtime.settings import CONFIG_OPTION_HELP, DeploymentSettings, RunFlags, SettingsError, settings_field

__all__ = [
    "ConfigOption",
    "derived_command",
    "load_run_settings",
    "option_help",
    "settings_command",
    "settings_field",
    "settings_option",
]

F = TypeVar("F", bound=Callable[..., Any])

ConfigOption = Annotated[Path | None, typer.Option("--config", help=CONFIG_OPTION_HELP)]
"""``--config FILE``: the deployment's TOML settings file."""


def _cli_type(annotation: Any) -> tuple[Any, bool]:
    """The type Typer parses a field of ``annotation`` as, and whether it is a list (repeatable).
    ``X | None`` → ``X``, ``SecretStr`` → ``str``, ``Literal[4, 5]`` → ``int``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _cli_type(args[0]) if len(args) == 1 else (str, False)
    if typing.get_origin(annotation) is Literal:
        return type(args[0]), False
    if typing.get_origin(annotation) is list:
        item, _ = _cli_type(args[0])
        return list[item], True  # type: ignore[valid-type]
    if annotation is SecretStr:
        return str, False
    return annotation, False


def _shown_default(field: FieldInfo) -> str | None:
    """The model's default as the help shows it; ``None`` for no default worth showing (unset,
    empty, a secret)."""
    value = field.get_default(call_default_factory=True)
    if value is None or value == "" or value == [] or isinstance(value, SecretStr):
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def option_help(path: str) -> str:
    """The help of the option that sets field ``path``: its description (whitespace collapsed),
    ``(repeatable)`` for a list, then ``(default: D; setting PATH)``. Raises ``KeyError``."""
    field = settings_field(path)
    text = " ".join((field.description or "").split())
    _, repeatable = _cli_type(field.annotation)
    default = _shown_default(field)
    tail = f"default: {default}; setting {path}" if default is not None else f"setting {path}"
    return f"{text}{' (repeatable)' if repeatable else ''} ({tail})"


def settings_option(flag: str, path: str) -> Any:
    """``Annotated[T | None, typer.Option(...)]`` of the option ``--FLAG`` (``flag`` as a Python
    name, ``_`` for ``-``) that sets field ``path``: the field's type, ``--FLAG/--no-FLAG`` for a
    boolean, repeatable for a list, help from :func:`option_help`. Raises ``KeyError``."""
    field = settings_field(path)
    cli_type, _ = _cli_type(field.annotation)
    name = "--" + flag.replace("_", "-")
    decl = f"{name}/--no-{name[2:]}" if cli_type is bool else name
    return Annotated[cli_type | None, typer.Option(decl, help=option_help(path))]


def load_run_settings(flags: RunFlags, config: Path | None, **values: Any) -> DeploymentSettings:
    """The settings a command runs with (:meth:`RunFlags.load`), for the command line: a settings
    error or no Kafka bootstrap servers anywhere becomes a usage error.

    Returns:
        the settings, with ``kafka`` set.

    Raises:
        typer.BadParameter: invalid settings (file missing or not TOML, a value refused) or no
            ``kafka`` from the flags, ``GPUPOOL_KAFKA`` or the file (Typer exits with status 2).
    """
    try:
        settings = flags.load(config, **values)
    except SettingsError as e:
        raise typer.BadParameter(str(e), param_hint="--config / GPUPOOL_* / options") from None
    if settings.kafka is None:
        raise typer.BadParameter(
            "no Kafka bootstrap servers: give --kafka, GPUPOOL_KAFKA or kafka in the settings file",
            param_hint="--kafka",
        )
    return settings


def derived_command(
    func: Callable[..., Any],
    name: str,
    extra: Sequence[inspect.Parameter],
    make: Callable[[dict[str, Any]], Any],
) -> Callable[..., Any]:
    """A Typer callback around ``func``: ``func``'s parameters except ``name``, then ``extra``
    (all keyword-only, Typer options or arguments in their annotations); called, it passes the
    values of ``extra`` (a dict by parameter name) to ``make`` and its result to ``func`` as ``name``.

    Raises:
        ValueError: ``func`` has no parameter ``name``, or one named like a parameter of ``extra``.
    """
    own = inspect.signature(func, eval_str=True).parameters
    added = [p.name for p in extra]
    if name not in own or set(added) & set(own):
        raise ValueError(f"{func.__name__}: needs a parameter {name} and none of {added}")
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own.values() if p.name != name]
    params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in extra]

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        made = make({key: kwargs.pop(key) for key in added})
        return func(**{name: made}, **kwargs)

    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def settings_command(app: typer.Typer, name: str, flags: RunFlags, **command: Any) -> Callable[[F], F]:
    """Register ``func`` as command ``name`` of ``app`` with ``--config`` and one option per entry
    of ``flags`` (:func:`settings_option`) besides its own parameters; ``func`` takes the loaded
    settings as its ``settings`` parameter (:func:`load_run_settings`: flags over ``GPUPOOL_*`` over
    the file over the defaults; invalid settings or no Kafka exit 2). ``command`` goes to
    ``app.command`` (``help=...``). Returns ``func`` unchanged.

    Raises:
        KeyError: a field of ``flags`` that the settings model does not have.
        ValueError: ``func`` has no ``settings`` parameter, or one named like a flag.
    """
    extra = [
        inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ConfigOption)
    ]
    extra += [
        inspect.Parameter(
            flag, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=settings_option(flag, path)
        )
        for flag, path in flags.fields.items()
    ]

    def load(values: dict[str, Any]) -> DeploymentSettings:
        return load_run_settings(flags, values.pop("config"), **values)

    def register(func: F) -> F:
        app.command(name, **command)(derived_command(func, "settings", extra, load))
        return func

    return register
