"""Command-line options every stage's ``run`` command shares (Typer ``Annotated`` types).

Each option defaults to ``None`` = "not given", so :meth:`contracts.settings.RunFlags.load` takes
the value from ``GPUPOOL_*``, then the ``--config`` TOML file, then the default of
:class:`contracts.settings.DeploymentSettings`; the help names the setting it overrides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from contracts.settings import CONFIG_OPTION_HELP

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
