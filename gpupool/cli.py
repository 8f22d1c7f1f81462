"""``gpupool`` command line: one sub-command group per stage, plus ``demo``, ``report`` and ``config``.

Stage command groups are defined next to their stage (``collectors.cli``, ``analytics.cli``,
``broker.cli``) and mounted here; this module only wires them and runs the demo.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from analytics.cli import app as analytics_app
from broker.cli import broker_app, edge_app
from collectors.cli import app as collect_app
from contracts.tracing import setup_tracing
from gpupool.config_cli import config_app
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


def _progress_table(snap: dict[str, object], duration: float) -> Table:
    t = Table(title=f"gpupool demo — {snap['elapsed_s']:.0f}/{duration:.0f} s", title_justify="left")
    for col in ("GPUs busy", "idle", "unknown", "offers", "live leases", "granted", "reclaims", "reclaimed",
                "bad offers"):
        t.add_column(col, justify="right")
    t.add_row(*(str(snap[k]) for k in ("busy", "idle", "unknown", "offers", "live_leases", "leases_granted",
                                        "reclaims_started", "reclaims_completed", "violations")))
    return t


@app.command()
def demo(
    duration: Annotated[float, typer.Option(help="How long to run, wall-clock seconds.")] = 60.0,
    nodes: Annotated[int, typer.Option(help="Simulated GPU nodes (8 GPUs each).")] = 4,
    speedup: Annotated[float, typer.Option(help="Trace seconds replayed per wall second (57 = one trace sample/s).")] = 57.0,
    kafka: Annotated[str | None, typer.Option(help="Kafka bootstrap host:port; default: in-process bus.")] = None,
    mqtt: Annotated[str | None, typer.Option(help="MQTT broker host:port; default: embedded amqtt (MQTT 3.1.1).")] = None,
    mqtt_credentials: Annotated[Path | None, typer.Option(help="credentials.json from deploy/local/mosquitto.sh.")] = None,
    state_dir: Annotated[Path, typer.Option(help="Where the DuckDB file and the simulated sysfs go.")] = Path(".state/demo"),
    metrics_port: Annotated[int, typer.Option(help="Serve Prometheus /metrics of every stage on this port (0: off).")] = 0,
    json_summary: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Run the simulator and every stage for DURATION seconds, show live progress, print a summary.

    GPUs replay the real Alibaba GenAI 2026 trace (../shared/data/traces). Collectors scrape the
    simulated dcgm-exporter endpoints and sysfs trees; analytics finds idle GPUs; the broker offers
    them over MQTT; simulated edge sites claim and renew; training demand reclaims. Exit code 1 if
    an offer was made for a GPU the trace showed busy.
    """
    from gpupool.demo import DemoConfig, run_demo

    cfg = DemoConfig(duration_s=duration, nodes=nodes, speedup=speedup, kafka=kafka, mqtt=mqtt,
                     mqtt_credentials=mqtt_credentials, state_dir=state_dir,
                     metrics_port=metrics_port)
    console = Console(stderr=False)
    with Live(console=console, auto_refresh=False, transient=False) as live:
        def progress(snap: dict[str, object]) -> None:
            live.update(_progress_table(snap, duration), refresh=True)

        summary = asyncio.run(run_demo(cfg, progress))
    console.print()
    s = summary.as_dict()
    if json_summary:
        console.print_json(json.dumps(s))
    else:
        t = Table(title="gpupool demo — summary", title_justify="left", show_header=False)
        t.add_column("what")
        t.add_column("value", justify="right")
        rows = [
            ("simulated GPUs", s["gpus"]),
            ("idle share of the replayed trace window", f"{100 * float(s['trace_idle_share']):.1f} %"),
            ("samples ingested into DuckDB", s["samples_ingested"]),
            ("GPUs found idle", s["gpus_seen_idle"]),
            ("offers published (GPUs offered)", f"{s['offers']} ({s['gpus_offered']})"),
            ("offers for a GPU the trace showed busy", s["offer_violations"]),
            ("  …turned busy within one scrape interval", s["offer_races"]),
            ("leases granted", s["leases_granted"]),
            ("reclaims started / completed", f"{s['reclaims_started']} / {s['reclaims_completed']}"),
            ("leases expired (no renewal)", s["expired"]),
            ("claims rejected, by reason", ", ".join(f"{k}={v}" for k, v in s["rejections"].items()) or "none"),
        ]
        for k, v in rows:
            t.add_row(k, str(v))
        console.print(t)
    if summary.offer_violations:
        raise typer.Exit(1)
