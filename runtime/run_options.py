"""Command-line options every stage's ``run`` command shares (Typer ``Annotated`` types).

Each option defaults to ``None`` = "not given", so :meth:`runtime.settings.RunFlags.load` takes
the value from ``GPUPOOL_*``, then the ``--config`` TOML file, then the default of
:class:`runtime.settings.DeploymentSettings`; the help names the setting it overrides.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import typer

from contracts.bus.api import Bus, MissingTopicsError
from runtime.settings import CONFIG_OPTION_HELP, DeploymentSettings, RunFlags, SettingsError

ConfigOption = Annotated[Path | None, typer.Option("--config", help=CONFIG_OPTION_HELP)]
"""``--config FILE``: the deployment's TOML settings file."""

KafkaOption = Annotated[
    str | None,
    typer.Option(help="Kafka bootstrap servers, host:port[,host:port]; required. (setting kafka)"),
]
"""``--kafka``: Kafka bootstrap servers."""

TopicPrefixOption = Annotated[
    str | None,
    typer.Option(help="Prefix of every Kafka topic name (default none). (setting topic_prefix)"),
]
"""``--topic-prefix``: prefix of every Kafka topic name."""

MetricsAddrOption = Annotated[
    str | None,
    typer.Option(help="Address the /metrics server binds to (default 127.0.0.1). (setting metrics.addr)"),
]
"""``--metrics-addr``: listen address of the stage's Prometheus ``/metrics``."""


def metrics_port_option(stage: str, default: int) -> object:
    """The ``--metrics-port`` option of ``stage`` (``collectors``, ``analytics``, ``broker``), whose
    conventional port (the one ``deploy/prometheus`` scrapes) is ``default``; for use as
    ``Annotated[int | None, metrics_port_option("broker", 9412)]``."""
    return typer.Option(
        help=f"Serve Prometheus /metrics on this port (0: off; default {default}). (setting metrics.{stage})"
    )


def load_run_settings(flags: RunFlags, config: Path | None, **values: Any) -> DeploymentSettings:
    """The settings a stage's ``run`` command runs with (:meth:`RunFlags.load`), for the command
    line: a settings error or no Kafka bootstrap servers anywhere becomes a usage error.

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


@contextlib.asynccontextmanager
async def exit_on_missing_topics(command: str, bus: Bus) -> AsyncIterator[None]:
    """Around a stage's start: a :class:`contracts.bus.MissingTopicsError` closes ``bus``, prints
    ``<command>: <message>`` (which names ``gpupool topics create``) on stderr and exits with
    status 1, without a traceback.

    Raises:
        click.exceptions.Exit: status 1, when a topic is missing.
    """
    try:
        yield
    except MissingTopicsError as e:
        await bus.close()
        typer.echo(f"{command}: {e}", err=True)
        raise typer.Exit(1) from None
