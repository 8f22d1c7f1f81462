"""Concurrent HTTP scrapes of ``/metrics`` endpoints with aiohttp.

Many targets run at once, bounded by an :class:`asyncio.Semaphore` and by the connection pool of
one :class:`aiohttp.ClientSession` (a :class:`aiohttp.TCPConnector` with the same total limit, a
per-host limit, and keep-alive so a target's connection is reused from scrape to scrape). Each
scrape has one deadline (:class:`aiohttp.ClientTimeout` ``total``) covering connect, headers and
body. ``gzip``/``deflate`` bodies are decoded by aiohttp; the size limit applies to the decoded
body and is enforced while it is read, so an oversized body is never held whole.

A target that fails — refused connection, timeout, HTTP status other than 2xx, a body cut off
mid-transfer, a response that is not HTTP, a ``Content-Encoding`` that does not decode, a body
over the size limit — fails alone: its :class:`ScrapeResult` carries a short ``reason`` and the
others are unaffected. Whether a body that arrived whole is *usable* (garbage, empty) is decided
by the caller after parsing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Self

import aiohttp
from aiohttp.http_exceptions import ContentEncodingError

ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
"""Accept header: the Prometheus text format 0.0.4, as Prometheus itself asks for it."""
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
"""Default limit of a decoded body (a dcgm-exporter page of 8 GPUs is about 100 kB)."""
PER_HOST_CONNECTIONS = 8
"""Connections open at most to one ``host:port`` (each exporter is usually its own); capped by
``concurrency``. Targets sharing an endpoint (several paths behind one proxy) queue for these
inside their own deadline."""
KEEPALIVE_S = 90.0
"""Seconds an idle connection stays in the pool: longer than common scrape intervals (<= 60 s),
so each target keeps one connection. A connection the server closed in the meantime costs one
reconnect (aiohttp retries an idempotent request once on a reused connection found closed)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """The outcome of one scrape.

    Attributes:
        target: the URL scraped.
        ts: wall-clock start of the scrape, Unix seconds.
        duration_s: time from start to the end of the body (or the failure), seconds.
        reason: ``ok``, or why it failed: ``timeout``, ``connect_error``, ``http_<status>``,
            ``truncated`` (connection closed inside the body), ``protocol_error`` (not a valid
            HTTP response, or the connection closed before one), ``bad_encoding`` (a
            ``Content-Encoding`` that does not decode), ``too_large``, ``invalid_url``,
            ``transport_error`` (another connection failure, e.g. a reset),
            ``internal_error`` (an unexpected exception, logged).
        body: the decoded body (UTF-8, invalid bytes replaced) when ``reason == "ok"``.
        status: HTTP status code when a response arrived.
        detail: the exception text of a failure, for logs.
    """

    target: str
    ts: float
    duration_s: float
    reason: str
    body: str | None = None
    status: int | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True when a whole 2xx body arrived."""
        return self.reason == "ok"


class _Failed(Exception):
    """A scrape ended without a usable body: ``reason`` as in :class:`ScrapeResult`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


def _failure_reason(exc: aiohttp.ClientError, got_headers: bool) -> str:
    """The :class:`ScrapeResult` reason of an aiohttp client exception.

    ``got_headers`` tells whether the status line and headers had arrived: a connection lost
    after them cut the body (``truncated``), before them there was no HTTP reply
    (``protocol_error``).
    """
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, unreachable, DNS, TLS handshake
        return "connect_error"
    if isinstance(exc, aiohttp.ClientPayloadError):  # raised while reading the body
        return "bad_encoding" if isinstance(exc.__cause__, ContentEncodingError) else "truncated"
    if isinstance(exc, aiohttp.ClientResponseError):  # status line or headers did not parse
        return "protocol_error"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "truncated" if got_headers else "protocol_error"
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return "invalid_url"
    return "transport_error"


class Scraper:
    """Scrapes HTTP targets concurrently; use as an async context manager or call :meth:`aclose`.

    The session is opened on first use (aiohttp sessions belong to the running event loop).

    Args:
        timeout_s: deadline of one scrape (connect + headers + body), seconds.
        concurrency: scrapes in flight at most (also the connection pool's total limit).
        max_body_bytes: a larger (decoded) body fails as ``too_large``.
        session: an aiohttp session to use instead of a new one (tests, or several scrapers
            sharing one pool); the deadline, ``Accept`` header and no-redirect policy are applied
            per request. It is not closed by :meth:`aclose`.

    Raises:
        ValueError: ``timeout_s`` <= 0, ``concurrency`` < 1 or ``max_body_bytes`` < 0.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 2.0,
        concurrency: int = 64,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if max_body_bytes < 0:
            raise ValueError(f"max_body_bytes must be >= 0, got {max_body_bytes}")
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.max_body_bytes = max_body_bytes
        self._sem = asyncio.Semaphore(concurrency)
        # ceil_threshold=inf: aiohttp would otherwise round deadlines over 5 s up to a whole second
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, ceil_threshold=math.inf)
        self._headers = {"Accept": ACCEPT}
        self._own_session = session is None
        self._session = session
        self._closed = False

    async def __aenter__(self) -> Self:
        """Open the session (if this scraper owns one) and return the scraper itself."""
        self._ensure_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close as :meth:`aclose` does."""
        await self.aclose()

    async def aclose(self) -> None:
        """Close the session if this scraper created it. Safe to call twice."""
        self._closed = True
        session, own = self._session, self._own_session
        if own:
            self._session = None
        if own and session is not None:
            await session.close()

    def _ensure_session(self) -> aiohttp.ClientSession:
        """The session, created on first use when none was injected."""
        if self._closed:
            raise RuntimeError("Scraper is closed")
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self.concurrency,
                limit_per_host=min(self.concurrency, PER_HOST_CONNECTIONS),
                keepalive_timeout=KEEPALIVE_S,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                timeout=self._timeout,
                trust_env=False,  # scrape targets are reached directly, never through an env proxy
                auto_decompress=True,
                raise_for_status=False,
            )
        return self._session

    async def scrape(self, target: str) -> ScrapeResult:
        """Scrape one target (waiting for a concurrency slot first; the deadline starts with the
        slot). Never raises for a failed target; see :class:`ScrapeResult` for the reasons.

        Raises:
            RuntimeError: the scraper was closed.
        """
        session = self._ensure_session()
        async with self._sem:
            ts = time.time()
            t0 = time.monotonic()
            got_headers = False
            status: int | None = None
            try:
                async with session.get(
                    target,
                    allow_redirects=False,
                    timeout=self._timeout,
                    headers=None if self._own_session else self._headers,
                ) as resp:
                    got_headers = True
                    status = resp.status
                    if not 200 <= status < 300:
                        raise _Failed(f"http_{status}")
                    body = await self._read_body(resp.content)
            except _Failed as f:
                return ScrapeResult(
                    target, ts, time.monotonic() - t0, f.reason, status=status, detail=f.detail
                )
            except TimeoutError as e:  # aiohttp's ServerTimeoutError is one too
                return ScrapeResult(
                    target, ts, time.monotonic() - t0, "timeout", status=status, detail=str(e)
                )
            except aiohttp.ClientError as e:
                reason = _failure_reason(e, got_headers)
                return ScrapeResult(
                    target,
                    ts,
                    time.monotonic() - t0,
                    reason,
                    status=None if reason in ("connect_error", "invalid_url") else status,
                    detail=f"{type(e).__name__}: {e}",
                )
            except Exception as e:  # anything else still fails this target only (and is logged)
                log.exception("scrape_internal_error", extra={"target": target})
                return ScrapeResult(
                    target,
                    ts,
                    time.monotonic() - t0,
                    "internal_error",
                    status=status,
                    detail=f"{type(e).__name__}: {e}",
                )
            return ScrapeResult(target, ts, time.monotonic() - t0, "ok", body=body, status=status)

    async def _read_body(self, content: aiohttp.StreamReader) -> str:
        """Read the (decoded) body chunk by chunk, failing with ``too_large`` as soon as it
        passes ``max_body_bytes``; decode it as UTF-8 with invalid bytes replaced."""
        chunks: list[bytes] = []
        size = 0
        while chunk := await content.readany():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _Failed("too_large", f"> {self.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "replace")

    async def scrape_many(self, targets: Iterable[str]) -> AsyncIterator[ScrapeResult]:
        """Scrape every target concurrently; yield each result as soon as it is complete."""
        tasks = [asyncio.create_task(self.scrape(t)) for t in targets]
        try:
            for fut in asyncio.as_completed(tasks):
                yield await fut
        finally:  # the consumer stopped early: cancel and reap what is still running
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def scrape_all(self, targets: Iterable[str]) -> list[ScrapeResult]:
        """Scrape every target concurrently; return the results in target order."""
        return list(await asyncio.gather(*(self.scrape(t) for t in targets)))
