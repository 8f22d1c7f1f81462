"""``gpupool simulate serve``: a simulated GPU fleet for running the stages without GPUs.

It serves what a real fleet exposes, driven by the real Alibaba GenAI 2026 trace
(:mod:`simulator.trace`; each GPU replays one pod, :class:`simulator.fleet.Fleet`):

* dcgm-exporter ``/metrics`` of every node, in the exporter's format
  (:func:`simulator.dcgm_http.render_metrics`), all on **one** HTTP listener (``--port``, 0 = a
  free port) at ``/nodes/<host>/metrics``, plus ``/health``;
* a Prometheus file_sd JSON of those targets (``--file-sd``; Prometheus ``<file_sd_config>``: one
  group per node, ``targets: ["<bind>:<port>"]``, ``labels: {"__metrics_path__":
  "/nodes/<host>/metrics"}``), which ``gpupool collect run --file-sd`` and Prometheus both read;
* an InfiniBand sysfs tree per node (:class:`simulator.sysfs.SysfsTree`, under ``--sysfs-dir``,
  refreshed every ``--sysfs-interval`` seconds), read by ``gpupool collect run --sysfs-root
  HOST=<sysfs-dir>/<host>/sys``.

When everything is up it prints one JSON document on stdout (:func:`serving_document`), then runs
until SIGINT or SIGTERM, stops cleanly (exit 0) and logs ``simulate_stopped``. Progress goes to the
JSON logs on stderr (``gpupool --log-level INFO simulate serve ...``): ``simulate_serving`` once,
``simulate_progress`` every ``--progress-interval`` seconds (fleet step, GPUs busy now).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from aiohttp import web

from simulator.dcgm_http import CONTENT_TYPE, render_metrics
from simulator.fleet import Fleet
from simulator.metrics import SCRAPES_SERVED
from simulator.sysfs import SysfsTree
from simulator.trace import TRACE_DIR_ENV, default_trace_dir, load_trace

log = logging.getLogger(__name__)

app = typer.Typer(
    no_args_is_help=True,
    help="Simulated GPU fleet replaying the real trace: dcgm-exporter endpoints and InfiniBand sysfs trees.",
)

NODE_PATH = "/nodes/{host}/metrics"
"""Path of node ``host``'s dcgm-exporter ``/metrics`` on the simulator's listener."""


def file_sd_groups(address: str, hosts: list[str]) -> list[dict[str, Any]]:
    """The Prometheus file_sd target groups of the simulated nodes: one group per host, target
    ``address`` (``host:port`` of the listener), label ``__metrics_path__`` = its node path."""
    return [{"targets": [address], "labels": {"__metrics_path__": NODE_PATH.format(host=h)}} for h in hosts]


def write_file_sd(path: Path, groups: list[dict[str, Any]]) -> None:
    """Write ``groups`` to ``path`` as JSON, atomically (a temporary file, then ``os.replace``), so
    a collector re-reading the file never sees half of it. Raises ``OSError`` if it cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(groups, indent=2) + "\n")
    os.replace(tmp, path)


def serving_document(
    fleet: Fleet, address: str, file_sd: Path, sysfs: SysfsTree
) -> dict[str, Any]:
    """What ``serve`` prints once everything is up::

        {"event": "simulate_serving", "gpus": int, "nodes": int, "speedup": float,
         "listen": "host:port", "targets": {host: url}, "file_sd": path,
         "sysfs_roots": {host: path}, "collect_args": [str]}

    ``collect_args`` are the ``gpupool collect run`` options that read this fleet (``--file-sd``
    and one ``--sysfs-root HOST=PATH`` per node).
    """
    roots = {h: str(p.resolve()) for h, p in sysfs.roots()}
    args = ["--file-sd", str(file_sd.resolve())]
    for h, p in roots.items():
        args += ["--sysfs-root", f"{h}={p}"]
    return {
        "event": "simulate_serving",
        "gpus": len(fleet.gpu_keys()),
        "nodes": len(fleet.hosts()),
        "speedup": fleet.speedup,
        "listen": address,
        "targets": {h: f"http://{address}{NODE_PATH.format(host=h)}" for h in fleet.hosts()},
        "file_sd": str(file_sd.resolve()),
        "sysfs_roots": roots,
        "collect_args": args,
    }


def _web_app(fleet: Fleet) -> web.Application:
    """The aiohttp application: ``/nodes/{host}/metrics`` (404 for an unknown host), ``/health``."""

    async def metrics(request: web.Request) -> web.Response:
        host = request.match_info["host"]
        if host not in fleet.hosts():
            return web.Response(status=404, text=f"no node {host}\n")
        SCRAPES_SERVED.labels(host=host, mode="ok").inc()
        return web.Response(body=render_metrics(fleet, host).encode(), headers={"Content-Type": CONTENT_TYPE})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="OK\n")

    wa = web.Application()
    wa.router.add_get("/nodes/{host}/metrics", metrics)
    wa.router.add_get("/health", health)
    return wa


async def _serve(
    fleet: Fleet, bind: str, port: int, sysfs_dir: Path, file_sd: Path, sysfs_interval_s: float,
    progress_interval_s: float,
) -> None:
    """Serve until SIGINT/SIGTERM (see the module docstring); everything started is stopped."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(_web_app(fleet), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, bind, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        address = f"{bind}:{bound}"
        sysfs = SysfsTree(fleet, sysfs_dir)
        sysfs.update(time.time())
        write_file_sd(file_sd, file_sd_groups(address, fleet.hosts()))
        doc = serving_document(fleet, address, file_sd, sysfs)
        log.info("simulate_serving", extra={k: doc[k] for k in ("gpus", "nodes", "listen", "file_sd")})
        typer.echo(json.dumps(doc))
        last_progress = time.monotonic()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), sysfs_interval_s)
            except TimeoutError:
                pass
            sysfs.update(time.time())
            if time.monotonic() - last_progress >= progress_interval_s:
                last_progress = time.monotonic()
                now = time.time()
                busy = sum(1 for k in fleet.gpu_keys() if fleet.is_busy_at(k, now))
                log.info("simulate_progress", extra={"step": fleet.step_at(now), "gpus_busy": busy,
                                                     "gpus": len(fleet.gpu_keys())})
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    log.info("simulate_stopped", extra={"step": fleet.step_at()})


@app.command("serve")
def serve(
    gpus: Annotated[int, typer.Option(min=1, help="GPUs in the fleet; a multiple of --gpus-per-node.")] = 32,
    gpus_per_node: Annotated[int, typer.Option(min=1, max=8, help="H100 GPUs per node (1..8).")] = 8,
    trace_dir: Annotated[
        Path | None,
        typer.Option(help=f"Folder of the Alibaba GenAI 2026 trace tarballs (default ${TRACE_DIR_ENV}, "
                     "else ../shared/data/traces/alibaba_genai_2026 next to the clone)."),
    ] = None,
    bind: Annotated[str, typer.Option(help="Address the HTTP listener binds to.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port of the HTTP listener (0: a free one).")] = 0,
    sysfs_dir: Annotated[
        Path, typer.Option(help="Folder of the InfiniBand sysfs trees, one <host>/sys per node.")
    ] = Path(".state/simulate/sysfs"),
    file_sd: Annotated[
        Path, typer.Option(help="Prometheus file_sd JSON written with the nodes' targets.")
    ] = Path(".state/simulate/targets.json"),
    speedup: Annotated[
        float, typer.Option(min=0.001, help="Trace seconds per wall second (1: real time; 57: one 57 s "
                            "trace sample per second).")
    ] = 1.0,
    start_step: Annotated[int, typer.Option(min=0, help="Trace step (57 s each) the replay starts at.")] = 120,
    seed: Annotated[int, typer.Option(help="Seed of the pod choice, UUIDs and noise (reproducible fleets).")] = 7,
    sysfs_interval: Annotated[
        float, typer.Option(min=0.05, help="Seconds between two refreshes of the sysfs counters.")
    ] = 1.0,
    progress_interval: Annotated[
        float, typer.Option(min=0.1, help="Seconds between two simulate_progress log lines (INFO).")
    ] = 30.0,
) -> None:
    """Serve a simulated fleet of --gpus H100 GPUs replaying the real trace, until SIGINT/SIGTERM.

    dcgm-exporter /metrics per node on one listener (http://BIND:PORT/nodes/HOST/metrics), a
    file_sd JSON of them (--file-sd) and InfiniBand sysfs trees (--sysfs-dir/HOST/sys). Prints one
    JSON document when serving (targets, file_sd, sysfs_roots, and collect_args: the options of
    `gpupool collect run` that read it). Exit 0 on SIGINT/SIGTERM, 1 if the trace cannot be read
    or the port bound, 2 on a bad option.
    """
    if gpus % gpus_per_node:
        raise typer.BadParameter(f"{gpus} GPUs is not a multiple of --gpus-per-node {gpus_per_node}",
                                 param_hint="--gpus")
    nodes = gpus // gpus_per_node
    if nodes > 999:
        raise typer.BadParameter(f"at most 999 nodes ({gpus} GPUs make {nodes})", param_hint="--gpus")
    folder = trace_dir or default_trace_dir()
    try:
        trace = load_trace(folder)
    except (OSError, ValueError) as e:  # TraceError is a ValueError
        typer.echo(f"error: cannot read the trace in {folder}: {e}", err=True)
        raise typer.Exit(1) from None
    fleet = Fleet(trace, nodes=nodes, gpus_per_node=gpus_per_node, speedup=speedup,
                  start_step=start_step, seed=seed)
    try:
        asyncio.run(_serve(fleet, bind, port, sysfs_dir, file_sd, sysfs_interval, progress_interval))
    except OSError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
