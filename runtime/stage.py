"""The one runner of every stage's ``run`` command (``gpupool collect|analytics|broker run``).

:func:`run_stage` builds the stage inside its event loop, serves the stage's Prometheus registry on
``/metrics``, stops on SIGTERM/SIGINT, and goes start → run → stop, closing the bus at the end.
Start failures end the command the same way for every stage, with one line on stderr and no
traceback:

* a missing Kafka topic (:class:`contracts.bus.MissingTopicsError`): ``<command>: <message>``,
  which names ``gpupool topics create``; exit 1;
* a setting the stage refuses (``ValueError`` while it is built, :class:`typer.BadParameter`):
  a usage error, exit 2;
* anything else while starting (Kafka or MQTT unreachable, a DuckDB file locked):
  ``<command>: cannot start: <error>``, logged as ``stage_start_failed``; exit 1;
* the ``/metrics`` port cannot be bound: ``<command>: cannot serve /metrics on ADDR:PORT``; exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import Protocol

import typer
from typer.exceptions import TyperException

from contracts.bus.api import Bus, MissingTopicsError

__all__ = ["Stage", "run_stage"]

log = logging.getLogger(__name__)


class Stage(Protocol):
    """What :func:`run_stage` runs: a stage service (``CollectorService``, ``AnalyticsService``,
    ``BrokerService``). It may have a ``registry`` (a ``prometheus_client.CollectorRegistry``) of
    its metrics; without one, the process-wide default registry is served."""

    async def start(self) -> None:
        """Connect and get ready; raises on failure (nothing left to stop but the bus)."""

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set."""

    async def stop(self) -> None:
        """Stop serving and release what :meth:`start` took (not the bus)."""


def run_stage(
    command: str,
    build: Callable[[], tuple[Stage, Bus]],
    *,
    metrics_port: int,
    metrics_addr: str,
    started: Callable[[], None] | None = None,
) -> None:
    """Run a stage until SIGTERM or SIGINT (module docstring for the exits).

    Args:
        command: the command, first word of every message (``gpupool broker run``).
        build: makes the stage and the bus it uses; called inside the event loop. A ``ValueError``
            it raises is a usage error.
        metrics_port / metrics_addr: where ``/metrics`` serves the stage's registry (port 0: no
            server).
        started: called once the stage has started (e.g. to tune the garbage collector).

    Raises:
        typer.Exit: status 1 on a start failure or an unusable metrics port.
        typer.BadParameter: a setting refused while building (status 2).
    """
    asyncio.run(_run(command, build, metrics_port, metrics_addr, started))


async def _run(
    command: str,
    build: Callable[[], tuple[Stage, Bus]],
    metrics_port: int,
    metrics_addr: str,
    started: Callable[[], None] | None,
) -> None:
    try:
        stage, bus = build()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # not on Windows' loops
            loop.add_signal_handler(sig, stop.set)
    try:
        _serve_metrics(command, stage, metrics_port, metrics_addr)
        await stage.start()
    except (typer.Exit, TyperException):
        await bus.close()
        raise
    except MissingTopicsError as e:
        await bus.close()
        typer.echo(f"{command}: {e}", err=True)
        raise typer.Exit(1) from None
    except Exception as e:  # noqa: BLE001 — any start failure: one line, exit 1, no traceback
        log.error("stage_start_failed", extra={"command": command, "error": repr(e)})
        await bus.close()
        text = str(e) or repr(e)
        named = text if text.startswith(type(e).__name__) else f"{type(e).__name__}: {text}"
        typer.echo(f"{command}: cannot start: {named}", err=True)
        raise typer.Exit(1) from None
    if started is not None:
        started()
    try:
        await stage.run(stop)
    finally:
        await stage.stop()
        await bus.close()


def _serve_metrics(command: str, stage: Stage, port: int, addr: str) -> None:
    """Serve ``stage.registry`` (else the default registry) on ``addr:port`` (0: nothing). Exit 1
    with a message when the port cannot be bound (in use, or an address this host does not have)."""
    if not port:
        return
    import prometheus_client

    registry = getattr(stage, "registry", prometheus_client.REGISTRY)
    try:
        prometheus_client.start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        typer.echo(f"{command}: cannot serve /metrics on {addr}:{port}: {e}", err=True)
        raise typer.Exit(1) from None
