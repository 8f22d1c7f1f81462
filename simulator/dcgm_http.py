"""Simulated dcgm-exporter endpoints: one HTTP ``/metrics`` per node, in the exporter's real format.

Format (NVIDIA dcgm-exporter ``internal/pkg/rendermetrics/render_metrics.go``, GPU template; see
also ``../shared/data/cases/dcgm_exporter_samples/synthesized_current_template_4x.prom``):

* one family per field, in DCGM field-id order, each opened by ``# HELP`` and ``# TYPE``;
* labels in the order ``gpu,UUID,pci_bus_id,device,modelName,Hostname`` then the extra labels
  sorted by name (Go sorts map keys): ``DCGM_FI_DRIVER_VERSION``, and ``err_code,err_msg`` on
  ``DCGM_FI_DEV_XID_ERRORS``; the host label is ``Hostname`` (current exporter) or, configurable,
  ``hostname``;
* int64 fields printed with Go's ``%d``, doubles with ``%f`` (six decimals); no timestamps.

Fault injection (``FleetServer.fail_mode[host]``), for the collectors' error paths:

* ``http500`` — status 500 with a short text body;
* ``truncate`` — status 200, the body cut in the middle of a series' label set (Content-Length
  matches what is sent: a proxy that truncated it);
* ``disconnect`` — Content-Length of the whole body is announced, half is sent, the connection
  is closed;
* ``garbage`` — status 200 ``text/plain`` whose body is the exposition gzip-compressed, without a
  ``Content-Encoding`` header (binary, not UTF-8);
* ``hang`` — no answer until the server stops (the client's timeout must fire).
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Literal, get_args

from aiohttp import web

from simulator.dcgm_fields import DRIVER_VERSION_FIELD, FIELDS
from simulator.fleet import Fleet
from simulator.metrics import SCRAPES_SERVED

log = logging.getLogger(__name__)

FailMode = Literal["http500", "truncate", "disconnect", "garbage", "hang"]
"""Faults a simulated endpoint can be told to show (see the module docstring)."""
FAIL_MODES: frozenset[str] = frozenset(get_args(FailMode))
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Content type of the exposition format 0.0.4."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt(value: int | float, kind: str) -> str:
    """Go's ``%d`` for int fields, ``%f`` (six decimals) for double fields."""
    return str(int(value)) if kind == "int" else f"{float(value):f}"


def render_metrics(
    fleet: Fleet, host: str, at: float | None = None, *, hostname_label: str = "Hostname"
) -> str:
    """The ``/metrics`` body node ``host`` serves at wall time ``at`` (default now).

    Returns text in Prometheus exposition format 0.0.4 laid out as dcgm-exporter does (module
    docstring). ``hostname_label`` is ``Hostname`` (current exporter) or ``hostname``.

    Raises:
        KeyError: ``host`` is not a node of ``fleet``.
        ValueError: ``hostname_label`` is neither ``Hostname`` nor ``hostname``.
    """
    if hostname_label not in ("Hostname", "hostname"):
        raise ValueError(f"hostname_label must be 'Hostname' or 'hostname', got {hostname_label!r}")
    if host not in fleet.hosts():
        raise KeyError(f"no node {host!r} in the fleet")
    at = fleet.now() if at is None else at
    gpus = fleet.gpus(host)
    values = [fleet.fields(host, g.index, at) for g in gpus]
    model = _escape(fleet.model_name)
    heads = [
        f'gpu="{g.index}",UUID="{g.uuid}",pci_bus_id="{g.pci_bus_id}",device="{g.device}",'
        f'modelName="{model}",{hostname_label}="{_escape(host)}"'
        for g in gpus
    ]
    out: list[str] = []
    for f in FIELDS:
        out.append(f"# HELP {f.name} {f.help}")
        out.append(f"# TYPE {f.name} {f.prom_type}")
        for g, head, vals in zip(gpus, heads, values, strict=True):
            extra = {DRIVER_VERSION_FIELD: fleet.driver_version, **fleet.field_labels(host, g.index, f.name)}
            tail = "".join(f',{k}="{_escape(v)}"' for k, v in sorted(extra.items()))
            out.append(f"{f.name}{{{head}{tail}}} {_fmt(vals[f.name], f.kind)}")
    return "\n".join(out) + "\n"


class _FailModes(dict[str, FailMode | None]):
    """``host → fault`` that refuses unknown hosts and unknown modes on assignment."""

    def __init__(self, hosts: list[str]) -> None:
        super().__init__({h: None for h in hosts})

    def __setitem__(self, host: str, mode: FailMode | None) -> None:
        if host not in self:
            raise KeyError(f"no node {host!r} in the fleet")
        if mode is not None and mode not in FAIL_MODES:
            raise ValueError(f"unknown fail mode {mode!r}; one of {sorted(FAIL_MODES)} or None")
        super().__setitem__(host, mode)

    def update(self, other: Mapping[str, FailMode | None] | None = None, /,  # type: ignore[override]
               **kwargs: FailMode | None) -> None:
        """Assign every pair through :meth:`__setitem__` (so each is validated)."""
        for k, v in {**(other or {}), **kwargs}.items():
            self[k] = v


class FleetServer:
    """One dcgm-exporter-like HTTP endpoint per node of ``fleet``, on loopback, each on its own
    free port (a socket bound to port 0). Paths: ``/metrics`` and ``/health``.

    Attributes:
        fail_mode: ``host → FailMode | None``; assigning an unknown host raises ``KeyError``, an
            unknown mode ``ValueError``. Takes effect on the next request.

    Args:
        fleet: the simulated fleet.
        bind: address to listen on (loopback by default).
        hostname_label: ``Hostname`` (default) or ``hostname``.
    """

    def __init__(self, fleet: Fleet, *, bind: str = "127.0.0.1", hostname_label: str = "Hostname") -> None:
        if hostname_label not in ("Hostname", "hostname"):
            raise ValueError(f"hostname_label must be 'Hostname' or 'hostname', got {hostname_label!r}")
        self.fleet = fleet
        self.bind = bind
        self.hostname_label = hostname_label
        self.fail_mode = _FailModes(fleet.hosts())
        self._runners: dict[str, web.AppRunner] = {}
        self._ports: dict[str, int] = {}
        self._stopping = asyncio.Event()
        self._hanging = 0

    async def start(self) -> None:
        """Start every node's endpoint.

        Raises:
            RuntimeError: already started.
            OSError: a socket cannot be bound.
        """
        if self._runners:
            raise RuntimeError("FleetServer already started")
        self._stopping.clear()
        try:
            for host in self.fleet.hosts():
                app = web.Application()
                app.router.add_get("/metrics", self._metrics_handler(host))
                app.router.add_get("/health", self._health)
                runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
                await runner.setup()
                self._runners[host] = runner
                sock = _bound_socket(self.bind)
                self._ports[host] = sock.getsockname()[1]
                await web.SockSite(runner, sock).start()
        except BaseException:
            await self.stop()
            raise
        log.info("fleet_server_started", extra={"nodes": len(self._ports), "bind": self.bind})

    async def stop(self) -> None:
        """Stop every endpoint; hanging requests are answered 503 first. Idempotent."""
        self._stopping.set()
        for _ in range(100):  # let hanging handlers answer before their connections are closed
            if not self._hanging:
                break
            await asyncio.sleep(0.01)
        runners, self._runners = self._runners, {}
        for runner in runners.values():
            await runner.cleanup()
        self._ports.clear()

    async def __aenter__(self) -> FleetServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def urls(self) -> dict[str, str]:
        """``host → http://127.0.0.1:<port>/metrics`` of every running endpoint."""
        return {h: f"http://{self.bind}:{p}/metrics" for h, p in self._ports.items()}

    def port(self, host: str) -> int:
        """Port of ``host``'s endpoint. Raises ``KeyError`` if it is not running."""
        return self._ports[host]

    @staticmethod
    async def _health(request: web.Request) -> web.Response:
        return web.Response(text="OK\n")

    def _metrics_handler(self, host: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            mode = self.fail_mode.get(host)
            SCRAPES_SERVED.labels(host=host, mode=mode or "ok").inc()
            if mode == "hang":
                return await self._hang(request)
            if mode == "http500":
                return web.Response(status=500, text="Internal Server Error: failed to collect metrics\n")
            body = render_metrics(self.fleet, host, hostname_label=self.hostname_label).encode()
            if mode == "truncate":
                return web.Response(body=body[: _cut_point(body)], headers={"Content-Type": CONTENT_TYPE})
            if mode == "garbage":
                return web.Response(body=gzip.compress(body, mtime=0), headers={"Content-Type": CONTENT_TYPE})
            if mode == "disconnect":
                return await self._disconnect(request, body)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

        return handler

    async def _hang(self, request: web.Request) -> web.StreamResponse:
        """Answer nothing until :meth:`stop`, then 503 (written before the connection closes)."""
        self._hanging += 1
        try:
            await self._stopping.wait()
            resp = web.Response(status=503, text="shutting down\n")
            try:
                await resp.prepare(request)
                await resp.write_eof()
            except ConnectionResetError:
                pass  # the client gave up already
            return resp
        finally:
            self._hanging -= 1

    @staticmethod
    async def _disconnect(request: web.Request, body: bytes) -> web.StreamResponse:
        """Announce the whole body, send half of it, close the connection."""
        resp = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[: len(body) // 2])
        if request.transport is not None:
            request.transport.close()
        return resp


def _bound_socket(address: str) -> socket.socket:
    """A TCP socket bound to a free port of ``address`` (closed again if binding fails)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, 0))
    except OSError:
        sock.close()
        raise
    return sock


def _cut_point(body: bytes) -> int:
    """An offset in the second half of ``body`` that falls inside a series' label set."""
    i = body.find(b'UUID="', len(body) // 2)
    return i + 10 if i >= 0 else len(body) // 2
