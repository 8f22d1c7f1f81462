"""Concurrent scrapes against a local aiohttp server whose endpoints misbehave in every way a real
exporter does: each bad target fails alone with its reason, the good ones arrive whole."""

from __future__ import annotations

import asyncio
import gzip
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from collectors.scrape import Scraper

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
    fx = FakeExporters()
    await fx.start()
    try:
        yield fx
    finally:
        await fx.stop()


async def test_each_failure_fails_alone_with_its_reason(exporters: FakeExporters) -> None:
    targets = {
        "ok": exporters.url("/ok"),
        "http_500": exporters.url("/500"),
        "truncated": exporters.url("/truncated"),
        "timeout": exporters.url("/slow"),
        "connect_error": exporters.refused,
        "protocol_error": exporters.not_http,
        "invalid_url": "ftp://127.0.0.1/metrics",
        "ok2": exporters.url("/ok/2"),
        "garbage_arrives_whole": exporters.url("/garbage"),
        "bad_encoding": exporters.url("/badgzip"),
    }
    async with Scraper(timeout_s=0.5, concurrency=16) as scraper:
        t0 = time.monotonic()
        results = await scraper.scrape_all(targets.values())
        elapsed = time.monotonic() - t0
    got = {name: r.reason for name, r in zip(targets, results, strict=True)}
    assert got == {
        "ok": "ok",
        "http_500": "http_500",
        "truncated": "truncated",
        "timeout": "timeout",
        "connect_error": "connect_error",
        "protocol_error": "protocol_error",
        "invalid_url": "invalid_url",
        "ok2": "ok",
        "garbage_arrives_whole": "ok",
        "bad_encoding": "bad_encoding",
    }
    by = dict(zip(targets, results, strict=True))
    assert by["ok"].body == GOOD_BODY and by["ok"].status == 200 and by["ok"].ok
    assert "gpu-node-2" in (by["ok2"].body or "")
    assert by["http_500"].status == 500 and by["http_500"].body is None
    assert by["garbage_arrives_whole"].body == GARBAGE_BODY  # usability is the parser's call
    assert by["timeout"].duration_s < 2.0
    assert elapsed < 2.0  # concurrent: one slow target does not delay the others
    assert all(r.ts > 0 for r in results)


async def test_body_size_limit(exporters: FakeExporters) -> None:
    async with Scraper(timeout_s=2.0, max_body_bytes=1000) as scraper:
        res = await scraper.scrape(exporters.url("/ok"))
    assert res.reason == "too_large" and res.body is None


async def test_concurrency_is_bounded(exporters: FakeExporters) -> None:
    async with Scraper(timeout_s=5.0, concurrency=3) as scraper:
        results = await scraper.scrape_all([exporters.url(f"/gated/{i}") for i in range(10)])
    assert all(r.ok for r in results)
    assert exporters.max_in_flight == 3


async def test_scrape_many_yields_as_completed(exporters: FakeExporters) -> None:
    order = []
    async with Scraper(timeout_s=0.5) as scraper:
        async for res in scraper.scrape_many([exporters.url("/slow"), exporters.url("/ok")]):
            order.append(res.reason)
    assert order == ["ok", "timeout"]


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        Scraper(timeout_s=0)
    with pytest.raises(ValueError):
        Scraper(concurrency=0)


async def test_deadline_covers_the_body(exporters: FakeExporters) -> None:
    async with Scraper(timeout_s=0.3) as scraper:
        res = await scraper.scrape(exporters.url("/slowbody"))
    assert res.reason == "timeout" and res.status == 200 and res.body is None
    assert res.duration_s < 1.0


async def test_gzip_body_is_decoded_and_the_limit_counts_decoded_bytes(exporters: FakeExporters) -> None:
    compressed = len(gzip.compress(GOOD_BODY.encode()))
    assert compressed < len(GOOD_BODY.encode())
    async with Scraper(timeout_s=2.0) as scraper:
        res = await scraper.scrape(exporters.url("/gzip"))
    assert res.ok and res.body == GOOD_BODY
    async with Scraper(timeout_s=2.0, max_body_bytes=compressed + 1) as scraper:
        res = await scraper.scrape(exporters.url("/gzip"))
    assert res.reason == "too_large" and res.body is None


async def test_prometheus_accept_header_and_keep_alive(exporters: FakeExporters) -> None:
    async with Scraper(timeout_s=2.0, concurrency=4) as scraper:
        for _ in range(5):
            assert (await scraper.scrape(exporters.url("/ok"))).ok
    assert exporters.accept == ["text/plain;version=0.0.4;q=1,*/*;q=0.1"] * 5
    assert len(set(exporters.peers)) == 1  # one connection, reused by every scrape


async def test_per_host_connection_limit(exporters: FakeExporters) -> None:
    async with Scraper(timeout_s=5.0, concurrency=32) as scraper:
        results = await scraper.scrape_all([exporters.url(f"/gated/{i}") for i in range(12)])
    assert all(r.ok for r in results)
    assert exporters.max_in_flight == 8  # PER_HOST_CONNECTIONS: all 12 targets share one host:port


async def test_injected_session_is_used_with_scrape_settings_and_left_open(exporters: FakeExporters) -> None:
    async with aiohttp.ClientSession() as session:
        async with Scraper(timeout_s=0.3, session=session) as scraper:
            ok = await scraper.scrape(exporters.url("/ok"))
            slow = await scraper.scrape(exporters.url("/slow"))
        assert ok.ok and slow.reason == "timeout"  # the scraper's deadline, not the session's 5 min
        assert exporters.accept[0] == "text/plain;version=0.0.4;q=1,*/*;q=0.1"
        assert not session.closed
    with pytest.raises(RuntimeError):
        await scraper.scrape(exporters.url("/ok"))
