"""Concurrent scrapes against a local aiohttp server whose endpoints misbehave in every way a real
exporter does: each bad target fails alone with its reason, the good ones arrive whole."""

from __future__ import annotations

import gzip
import time

import aiohttp
import pytest

from collectors.scrape import Scraper
from tests.fake_exporters import GARBAGE_BODY, GOOD_BODY, FakeExporters


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
