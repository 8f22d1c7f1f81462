"""Concurrent HTTP scrapes of ``/metrics`` endpoints with httpx.

Many targets run at once under an :class:`asyncio.Semaphore`; each has one deadline covering
connect, headers and body. A target that fails — refused connection, timeout, HTTP status other
than 2xx, a body cut off mid-transfer, a response that is not HTTP, a body over the size limit —
fails alone: its :class:`ScrapeResult` carries a short ``reason`` and the others are unaffected.
Whether a body that arrived whole is *usable* (garbage, empty) is decided by the caller after
parsing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Self

import httpx

ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
"""Accept header: the Prometheus text format 0.0.4, as Prometheus itself asks for it."""
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
"""Default limit of a decoded body (a dcgm-exporter page of 8 GPUs is about 100 kB)."""

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
            HTTP response), ``bad_encoding`` (a ``Content-Encoding`` that does not decode),
            ``too_large``, ``invalid_url``, ``transport_error``,
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


class Scraper:
    """Scrapes HTTP targets concurrently; use as an async context manager or call :meth:`aclose`.

    Args:
        timeout_s: deadline of one scrape (connect + headers + body), seconds.
        concurrency: scrapes in flight at most.
        max_body_bytes: a larger (decoded) body fails as ``too_large``.
        client: an httpx client to use instead of a new one (tests inject a transport); it is
            not closed by :meth:`aclose`.

    Raises:
        ValueError: ``timeout_s`` <= 0 or ``concurrency`` < 1.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 2.0,
        concurrency: int = 64,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self._sem = asyncio.Semaphore(concurrency)
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            headers={"Accept": ACCEPT},
            follow_redirects=False,
            trust_env=False,  # scrape targets are reached directly, never through an env proxy
        )

    async def __aenter__(self) -> Self:
        """Return the scraper itself (the client is ready from construction)."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close as :meth:`aclose` does."""
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client if this scraper created it."""
        if self._own_client:
            await self._client.aclose()

    async def scrape(self, target: str) -> ScrapeResult:
        """Scrape one target (waiting for a concurrency slot first). Never raises for a failed
        target; see :class:`ScrapeResult` for the reasons."""
        async with self._sem:
            ts = time.time()
            t0 = time.monotonic()
            got_headers = False
            status: int | None = None
            try:
                async with asyncio.timeout(self.timeout_s):
                    async with self._client.stream("GET", target) as resp:
                        got_headers = True
                        status = resp.status_code
                        if not 200 <= status < 300:
                            return ScrapeResult(
                                target, ts, time.monotonic() - t0, f"http_{status}", status=status
                            )
                        chunks: list[bytes] = []
                        size = 0
                        async for chunk in resp.aiter_bytes():
                            size += len(chunk)
                            if size > self.max_body_bytes:
                                return ScrapeResult(
                                    target,
                                    ts,
                                    time.monotonic() - t0,
                                    "too_large",
                                    status=status,
                                    detail=f"> {self.max_body_bytes} bytes",
                                )
                            chunks.append(chunk)
            except (TimeoutError, httpx.TimeoutException) as e:
                return ScrapeResult(
                    target, ts, time.monotonic() - t0, "timeout", status=status, detail=str(e)
                )
            except httpx.ConnectError as e:
                return ScrapeResult(target, ts, time.monotonic() - t0, "connect_error", detail=str(e))
            except httpx.DecodingError as e:  # a Content-Encoding (gzip...) that does not decode
                return ScrapeResult(
                    target, ts, time.monotonic() - t0, "bad_encoding", status=status, detail=str(e)
                )
            except httpx.RemoteProtocolError as e:
                reason = "truncated" if got_headers else "protocol_error"
                return ScrapeResult(target, ts, time.monotonic() - t0, reason, status=status, detail=str(e))
            except (httpx.InvalidURL, httpx.UnsupportedProtocol) as e:
                return ScrapeResult(target, ts, time.monotonic() - t0, "invalid_url", detail=str(e))
            except httpx.HTTPError as e:
                return ScrapeResult(
                    target,
                    ts,
                    time.monotonic() - t0,
                    "transport_error",
                    status=status,
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
            body = b"".join(chunks).decode("utf-8", "replace")
            return ScrapeResult(target, ts, time.monotonic() - t0, "ok", body=body, status=status)

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
