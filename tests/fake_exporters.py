"""A local aiohttp server whose endpoints misbehave in every way a real DCGM exporter does (a
pytest plugin, see conftest.py): the scraper, collector-service and target tests scrape it.

* :class:`FakeExporters` — the server; :data:`GOOD_BODY` / :data:`GARBAGE_BODY` what it serves;
* :func:`exporters` — a fixture: one started for the test, stopped after it.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

SAMPLES = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cases" / "dcgm_exporter_samples"
GOOD_BODY = (SAMPLES / "synthesized_current_template_4x.prom").read_text()
GARBAGE_BODY = "\x00\x01 <html><body>502 Bad Gateway</body></html>\n{{{ not: prometheus }}}\n"


class FakeExporters:
    """aiohttp app on 127.0.0.1 serving good and broken /metrics endpoints, plus a TCP port that
    answers something that is not HTTP and a port nobody listens on."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        self.accept: list[str] = []
        self.peers: list[tuple[str, int]] = []  # client (address, port) of each request
        self.in_flight = 0
        self.max_in_flight = 0
        app = web.Application()
        app.router.add_get("/ok", self._ok)
        app.router.add_get("/ok/{n}", self._ok)
        app.router.add_get("/500", self._status500)
        app.router.add_get("/truncated", self._truncated)
        app.router.add_get("/garbage", self._garbage)
        app.router.add_get("/slow", self._slow)
        app.router.add_get("/empty", self._empty)
        app.router.add_get("/cut", self._cut)
        app.router.add_get("/badgzip", self._bad_gzip)
        app.router.add_get("/gated/{n}", self._gated)
        app.router.add_get("/gzip", self._gzip)
        app.router.add_get("/slowbody", self._slow_body)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        self._junk_server: asyncio.Server | None = None
        self.base = ""
        self.not_http = ""
        self.refused = ""
        self.gate = asyncio.Event()

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base = f"http://127.0.0.1:{port}"

        async def junk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)
            writer.write(b"SSH-2.0-OpenSSH_9.6 definitely not HTTP\r\n\r\n")
            await writer.drain()
            writer.close()

        self._junk_server = await asyncio.start_server(junk, "127.0.0.1", 0)
        self.not_http = f"http://127.0.0.1:{self._junk_server.sockets[0].getsockname()[1]}/metrics"
        with socket.socket() as s:  # a port that was free a moment ago: connection refused
            s.bind(("127.0.0.1", 0))
            self.refused = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"

    async def stop(self) -> None:
        self.gate.set()
        if self._junk_server is not None:
            self._junk_server.close()
        await self._runner.cleanup()

    def url(self, path: str) -> str:
        return f"{self.base}{path}"

    def _count(self, request: web.Request) -> None:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        self.accept.append(request.headers.get("Accept", ""))
        assert request.transport is not None
        self.peers.append(request.transport.get_extra_info("peername")[:2])

    async def _ok(self, request: web.Request) -> web.Response:
        self._count(request)
        n = request.match_info.get("n")
        body = GOOD_BODY if n is None else GOOD_BODY.replace("gpu-node-001", f"gpu-node-{n}")
        return web.Response(text=body, content_type="text/plain")

    async def _status500(self, request: web.Request) -> web.Response:
        self._count(request)
        return web.Response(status=500, text="DCGM initialization error\n")

    async def _truncated(self, request: web.Request) -> web.StreamResponse:
        self._count(request)
        resp = web.StreamResponse(
            headers={"Content-Length": str(len(GOOD_BODY)), "Content-Type": "text/plain"}
        )
        await resp.prepare(request)
        await resp.write(GOOD_BODY[: len(GOOD_BODY) // 3].encode())
        assert request.transport is not None
        request.transport.close()  # the exporter died mid-body
        return resp

    async def _garbage(self, request: web.Request) -> web.Response:
        self._count(request)
        return web.Response(text=GARBAGE_BODY, content_type="text/plain")

    async def _slow(self, request: web.Request) -> web.Response:
        self._count(request)
        try:
            await asyncio.wait_for(self.gate.wait(), 30)  # released by stop()
        except TimeoutError:
            pass
        return web.Response(text=GOOD_BODY)

    async def _cut(self, request: web.Request) -> web.Response:
        """A whole HTTP response whose body a proxy cut in the middle of a label set."""
        self._count(request)
        return web.Response(
            text=GOOD_BODY[: GOOD_BODY.index('UUID="GPU-c0ffee00-0000-4000-8000-000000000002"')]
        )

    async def _bad_gzip(self, request: web.Request) -> web.Response:
        self._count(request)
        return web.Response(body=b"this is not gzip", headers={"Content-Encoding": "gzip"})

    async def _gzip(self, request: web.Request) -> web.Response:
        self._count(request)
        return web.Response(
            body=gzip.compress(GOOD_BODY.encode()),
            headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"},
        )

    async def _slow_body(self, request: web.Request) -> web.StreamResponse:
        """Headers and the first part of the body at once, the rest only when the gate opens."""
        self._count(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        await resp.write(GOOD_BODY[:100].encode())
        try:
            await asyncio.wait_for(self.gate.wait(), 30)  # released by stop()
        except TimeoutError:
            pass
        await resp.write(GOOD_BODY[100:].encode())
        await resp.write_eof()
        return resp

    async def _empty(self, request: web.Request) -> web.Response:
        self._count(request)
        return web.Response(text="", content_type="text/plain")

    async def _gated(self, request: web.Request) -> web.Response:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.wait_for(self.gate.wait(), 0.2)
        except TimeoutError:
            pass
        finally:
            self.in_flight -= 1
        return web.Response(text=GOOD_BODY)


@pytest.fixture
async def exporters() -> AsyncIterator[FakeExporters]:
    """A started :class:`FakeExporters`, stopped after the test."""
    fx = FakeExporters()
    await fx.start()
    try:
        yield fx
    finally:
        await fx.stop()
