"""``gpupool`` command line: one sub-command group per stage, plus ``demo``, ``report`` and ``config``.

Stage command groups are defined next to their stage (``collectors.cli``, ``analytics.cli``,
``broker.cli``) and mounted here; this module only wires them (the demo command: :mod:`gpupool.demo_cli`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from analytics.cli import app as analytics_app
from broker.cli import broker_app, edge_app
from collectors.cli import app as collect_app
from contracts.tracing import setup_tracing
from gpupool.config_cli import config_app
from gpupool.demo_cli import demo
from gpupool.logs import setup_logging
from gpupool.report.cli import report

app = typer.Typer(
    name="gpupool",
    help="Lend idle GPUs of an InfiniBand training pool to edge inference sites, and take them back.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    # help texts are plain text: "host/uuid[/gi]" must print as it is, not be parsed as markup
    rich_markup_mode=None,
)
app.add_typer(collect_app, name="collect", help="Collectors: GPU and InfiniBand telemetry → Kafka.")
app.add_typer(analytics_app, name="analytics", help="Analytics: Kafka → DuckDB → idle capacity.")
app.add_typer(broker_app, name="broker", help="Broker: capacity → MQTT offers → leases; training demand.")
app.add_typer(edge_app, name="edge", help="Edge-site client: list offers, claim, renew, release, watch.")
app.add_typer(config_app, name="config", help="Settings: show the effective configuration, secrets masked.")
app.command("report")(report)


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


app.command("demo")(demo)
