"""``gpupool`` command line: one sub-command group per stage, plus ``demo``, ``report``, ``config``,
``topics`` and ``simulate``.

Stage command groups are defined next to their stage (``collectors.cli``, ``analytics.cli``,
``broker.cli``) and mounted here; this module only wires them (the demo command: :mod:`gpupool.demo_cli`).

Every sub-command is imported **lazily**, when it is invoked (:class:`_LazyCommands`): a process
started as ``gpupool edge claim`` imports the edge SDK only, so a site that installed gpupool
without the server extra (no aiokafka, DuckDB...) can run every ``edge`` command, and a stage's
``run`` starts without importing the other stages. ``gpupool --help`` still lists every command
(it loads them all to print their help).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from gpupool.logs import setup_logging
from runtime.tracing import setup_tracing

_LAZY: dict[str, tuple[str, str, str]] = {
    "collect": ("collectors.cli", "app", "Collectors: GPU and InfiniBand telemetry → Kafka."),
    "analytics": ("analytics.cli", "app", "Analytics: Kafka → DuckDB → idle capacity."),
    "broker": ("broker.cli", "broker_app", "Broker: capacity → MQTT offers → leases; training demand."),
    "edge": ("broker.cli", "edge_app", "Edge-site client: list offers, claim, renew, release, watch."),
    "topics": ("gpupool.topics_cli", "topics_app", "Kafka topics: create every gpupool topic, list them."),
    "simulate": ("simulator.cli", "app", "Simulator: dcgm-exporter endpoints and IB sysfs trees replaying the trace."),
    "config": ("gpupool.config_cli", "config_app", "Settings: show the effective configuration, secrets masked."),
    "report": ("gpupool.report.cli", "report", ""),
    "demo": ("gpupool.demo_cli", "demo", ""),
}
"""Command name → (module, attribute, help). The attribute is a ``typer.Typer`` (mounted as a group
with that help) or a command function (its docstring is its help)."""


_PROJECT_PACKAGES = frozenset({"contracts", "collectors", "analytics", "broker", "simulator", "gpupool"})
"""This project's own top-level packages (a missing one is a broken install, not a missing extra)."""

_BUILT_SEPARATELY: dict[str, str] = {
    "analytics_native": "and analytics' compiled scrape decoder, built from the source tree with cargo: "
    "pip install ./analytics/native (`make venv` installs both)",
}
"""Packages the stages need that no extra installs (built from this repository), with how."""


def _load_command(name: str) -> Any:
    """Import the module of command ``name`` and build its click command (typer's vendored click).

    Raises:
        KeyError: ``name`` is not a gpupool command.
        click.exceptions.Exit: (status 2, after one line on stderr) its module needs a package of
            the ``server`` extra that is not installed (an edge-site install has ``gpupool edge``
            only).
        ImportError: its module cannot be imported otherwise.
    """
    module, attr, help_text = _LAZY[name]
    try:
        obj = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        if not e.name or e.name.split(".")[0] in _PROJECT_PACKAGES:
            raise
        package = e.name.split(".")[0]
        also = f" {_BUILT_SEPARATELY[package]}" if package in _BUILT_SEPARATELY else ""
        typer.echo(
            f"gpupool {name}: the Python package {package!r} is not installed; the stages "
            f"need the server dependencies: pip install 'gpupool[server]'{also} (an edge site needs only "
            "`gpupool edge`)",
            err=True,
        )
        raise typer.Exit(2) from None
    wrapper = typer.Typer(add_completion=False, rich_markup_mode=None)
    wrapper.callback()(_noop)  # a callback keeps the wrapper a group, so `name` stays a sub-command
    if isinstance(obj, typer.Typer):
        wrapper.add_typer(obj, name=name, help=help_text)
    else:
        wrapper.command(name)(obj)
    return typer.main.get_command(wrapper).commands[name]  # type: ignore[attr-defined]


def _noop() -> None:
    """Callback of the one-command wrapper group of :func:`_load_command` (never shown)."""


class _LazyCommands(MutableMapping[str, Any]):
    """The root group's ``name → command`` mapping: every name of :data:`_LAZY` is a key from the
    start; a command is imported and built on first access to its value, then kept."""

    def __init__(self, eager: MutableMapping[str, Any]) -> None:
        self._loaded: dict[str, Any] = dict(eager)

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            if name not in _LAZY:
                raise KeyError(name)
            self._loaded[name] = _load_command(name)
        return self._loaded[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        del self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*_LAZY, *self._loaded]))

    def __len__(self) -> int:
        return len(set(_LAZY) | set(self._loaded))

    def __contains__(self, name: object) -> bool:
        return name in _LAZY or name in self._loaded


class _LazyGroup(TyperGroup):
    """The root group: its ``commands`` are a :class:`_LazyCommands`, and listing the commands
    does not load them (only looking one up does)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = _LazyCommands(self.commands)

    def list_commands(self, ctx: Any) -> list[str]:
        """Every command name, in the order of :data:`_LAZY`, without importing any."""
        return list(self.commands)


app = typer.Typer(
    name="gpupool",
    cls=_LazyGroup,
    help="Lend idle GPUs of an InfiniBand training pool to edge inference sites, and take them back.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    # help texts are plain text: "host/uuid[/gi]" must print as it is, not be parsed as markup
    rich_markup_mode=None,
)


@app.callback()
def _main(
    ctx: typer.Context,
    log_level: Annotated[str, typer.Option(help="Log level of the JSON logs on stderr.")] = "WARNING",
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(
            envvar=["GPUPOOL_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"],
            help="Export OpenTelemetry traces over OTLP/HTTP to this collector URL "
            "(e.g. http://127.0.0.1:4318). Default: tracing off.",
        ),
    ] = None,
    trace_console: Annotated[
        bool, typer.Option(help="Also write every trace span as JSON to stderr (debugging).")
    ] = False,
) -> None:
    """Set up JSON logging for every command, and OpenTelemetry tracing when configured (service
    name ``gpupool-<command>``; spans follow one scrape through Kafka and MQTT to the lease)."""
    setup_logging(log_level.upper())
    try:
        setup_tracing(f"gpupool-{ctx.invoked_subcommand or 'cli'}", otlp_endpoint, console=trace_console)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--otlp-endpoint") from e
