"""A simulated edge site's request load: open loop at a steady rate over the endpoints of its kept
leases (:class:`broker.kept_leases.Endpoints`), every request's latency and outcome recorded, and
the summary of those sent inside given windows (reclaims) against those outside (steady state).

Open loop: request *i* is due at ``start + i / rate`` and is sent then, whether or not earlier
ones have been answered, so a slow or stalled server never slows the sending ("coordinated
omission" avoided). Each request records its latency from its due time (``latency_s``) and how
late the driver itself began it (``lag_s``: its process waiting for a CPU, or its event loop
busy). Since the driver never waits for answers, that lateness is the driver's own, not the
served endpoint's: :func:`summarize` with ``from_send`` takes the latency from the moment the
request was sent (``latency_s - lag_s``), and reports the driver's lag apart. A request fails
when no endpoint serves, the connection fails, the answer is not 200, or no answer came within
``timeout_s``; failures are never retried.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp

from broker.kept_leases import Endpoints, NoEndpoint


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request of the load.

    Attributes:
        sent_at: when it was due (Unix s).
        latency_s: due time → answer read (or failure), seconds.
        ok: answered 200.
        endpoint: where it went (``None``: no endpoint served).
        error: why it failed (``no_endpoint``, ``status:<code>``, the exception's class name); ``""``.
        lag_s: due time → the driver began the request, seconds: the driver's own scheduling
            delay (its event loop busy or its process off the CPU), part of ``latency_s``.
        connect_s: seconds spent opening a new connection for it (part of ``latency_s``);
            ``None`` when it went over a pooled one (or failed before a connection was needed).
    """

    sent_at: float
    latency_s: float
    ok: bool
    endpoint: str | None
    error: str = ""
    lag_s: float = 0.0
    connect_s: float | None = None

    def row(self) -> list[object]:
        """The record as a JSON array: ``[sent_at, latency_s, ok, endpoint, error, lag_s, connect_s]``
        (the ``request`` lines of ``bench/edge_reclaim.py --records`` and of the demo's request file)."""
        return [self.sent_at, self.latency_s, self.ok, self.endpoint, self.error, self.lag_s, self.connect_s]


@dataclass(frozen=True, slots=True)
class LoadSummary:
    """Requests of one kind (during reclaims, or steady state).

    Attributes:
        total: requests sent.
        failed: requests that failed.
        p50_s / p99_s: latency quantiles of the successful ones, seconds (nearest rank; NaN if
            none): from the due time, or from the send with ``summarize(from_send=True)``.
        lag_p99_s: p99 of the driver's own lag (due → sent) of the successful ones, seconds.
    """

    total: int
    failed: int
    p50_s: float
    p99_s: float
    lag_p99_s: float = float("nan")


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank (the smallest value with at least a
    ``q`` share of the values at or below it); NaN when empty. Raises ``ValueError`` for ``q``
    outside [0, 1]."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} outside [0, 1]")
    if not values:
        return float("nan")
    s = sorted(values)
    rank = max(1, math.ceil(q * len(s) - 1e-9))  # ceil(q n), immune to q n landing a hair above an integer
    return s[min(len(s), rank) - 1]


def summarize(
    records: Sequence[RequestRecord], windows: Sequence[tuple[float, float]], *, from_send: bool = False
) -> tuple[LoadSummary, LoadSummary]:
    """(requests sent inside any of ``windows``, those sent outside all of them); a window is
    ``(start, end)`` in Unix s, both ends included. Latencies from each request's due time, or
    with ``from_send`` from the moment the driver sent it (module docstring)."""
    inside: list[RequestRecord] = []
    outside: list[RequestRecord] = []
    spans = sorted(windows)
    for r in records:
        hit = any(a <= r.sent_at <= b for a, b in spans)
        (inside if hit else outside).append(r)

    def one(rs: list[RequestRecord]) -> LoadSummary:
        ok = [r for r in rs if r.ok]
        lat = [r.latency_s - r.lag_s if from_send else r.latency_s for r in ok]
        return LoadSummary(
            len(rs), len(rs) - len(ok), quantile(lat, 0.5), quantile(lat, 0.99), quantile([r.lag_s for r in ok], 0.99)
        )

    return one(inside), one(outside)


async def probe(
    endpoint: str,
    lease_id: str | None = None,
    *,
    session: aiohttp.ClientSession | None = None,
    health_path: str = "/health",
    path: str = "/v1/infer",
    warmup: int = 10,
    concurrency: int = 1,
    fast_s: float | None = None,
    timeout_s: float = 1.0,
) -> bool:
    """A site's check of an endpoint of the simulated inference server (``KeptLeases(probe=...,
    recheck=...)``): ``GET <health_path>`` answers 200 — for ``lease_id``, when given (the body's
    ``lease_id``: not another lease's process on the same address) — then ``warmup`` requests
    ``POST <path>``, ``concurrency`` at a time, each answer 200, so the first requests of the load
    do not meet a cold process; with ``fast_s``, the slowest answer of the last ``concurrency``
    must also have come within ``fast_s`` seconds (the process answers at speed, not just at
    all). Over ``session`` when given (the load's: the connections opened stay in its pool, so
    the load's first requests to the endpoint need no new connection), else over a session of
    its own. False on any other answer, a connection error or a timeout of ``timeout_s`` per
    request. Raises ``ValueError`` for ``concurrency`` below 1."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def infer(s: aiohttp.ClientSession) -> float | None:
        t0 = time.perf_counter()
        async with s.post(f"http://{endpoint}{path}", json={}, timeout=timeout) as answer:
            await answer.read()
            return time.perf_counter() - t0 if answer.status == 200 else None

    async def check(s: aiohttp.ClientSession) -> bool:
        async with s.get(f"http://{endpoint}{health_path}", timeout=timeout) as answer:
            body = await answer.json(content_type=None)
            if answer.status != 200 or (lease_id is not None and body.get("lease_id") != lease_id):
                return False
        left, last = warmup, []
        while left > 0:
            n = min(concurrency, left)
            last = await asyncio.gather(*(infer(s) for _ in range(n)))
            if None in last:
                return False
            left -= n
        return fast_s is None or not last or max(t for t in last if t is not None) <= fast_s

    try:
        if session is not None:
            return await check(session)
        async with aiohttp.ClientSession() as own:
            return await check(own)
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
        return False  # ValueError: a body not JSON; AttributeError: JSON but not an object


class OpenLoopLoad:
    """Requests at ``rate_per_s`` (open loop, module docstring) to ``POST http://<endpoint><path>``
    with an empty JSON body, each endpoint taken from ``endpoints`` (round robin, counted in flight
    so a leaving endpoint drains).

    Args:
        endpoints: the view of serving endpoints.
        rate_per_s: requests per second (> 0).
        path: the request path (the simulated inference server's ``/v1/infer``).
        timeout_s: a request without an answer this long fails, seconds.
        endpoint_wait_s: a request sent while no endpoint serves waits this long for one
            (:meth:`broker.kept_leases.Endpoints.acquire`) before it fails ``no_endpoint``,
            seconds; the wait counts in its latency. 0: it fails at once.
        clock: Unix time source of ``RequestRecord.sent_at``.

    Attributes:
        records: every finished request, in finishing order.
        sent: requests sent so far (those still in flight are not in ``records`` yet).

    Used as an async context manager, its HTTP session (and connection pool) is open from entry
    to exit: :meth:`probe` then warms the very connections the load will use. Without it,
    :meth:`run` opens a session for its own duration.

    Raises ``ValueError`` for a rate that is not positive.
    """

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        rate_per_s: float = 200.0,
        path: str = "/v1/infer",
        timeout_s: float = 2.0,
        endpoint_wait_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        self.endpoints = endpoints
        self.rate_per_s = rate_per_s
        self.path = path
        self.timeout_s = timeout_s
        self.endpoint_wait_s = endpoint_wait_s
        self._clock = clock
        self.records: list[RequestRecord] = []
        self.sent = 0
        self._session: aiohttp.ClientSession | None = None

    def _new_session(self) -> aiohttp.ClientSession:
        traced = aiohttp.TraceConfig()
        traced.on_connection_create_start.append(_connect_started)
        traced.on_connection_create_end.append(_connect_ended)
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            trace_configs=[traced],
        )

    async def __aenter__(self) -> OpenLoopLoad:
        """Open the session the load's requests and :meth:`probe` share."""
        self._session = self._new_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def probe(self, endpoint: str, lease_id: str | None = None, **kwargs: Any) -> bool:
        """:func:`probe` over the load's session (keyword arguments as there); outside the
        context manager, over a session of its own."""
        return await probe(endpoint, lease_id, session=self._session, **kwargs)

    async def run(self, stop: asyncio.Event) -> None:
        """Send until ``stop`` is set, then wait for the requests still in flight (at most
        ``timeout_s``)."""
        if self._session is not None:
            await self._drive(self._session, stop)
            return
        async with self._new_session() as session:
            await self._drive(session, stop)

    async def _drive(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        pending: set[asyncio.Task[None]] = set()
        t0, unix0 = time.perf_counter(), self._clock()
        i = 0
        while not stop.is_set():
            due = t0 + i / self.rate_per_s
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            task = asyncio.create_task(self._one(session, due, unix0 + (due - t0)))
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
            self.sent = i
        if pending:
            await asyncio.wait(pending, timeout=self.timeout_s + 1.0)

    async def _one(self, session: aiohttp.ClientSession, due: float, sent_at: float) -> None:
        lag = time.perf_counter() - due
        endpoint: str | None = None
        error = ""
        connect = _Connect()
        try:
            async with self.endpoints.acquire(self.endpoint_wait_s) as endpoint:
                async with session.post(f"http://{endpoint}{self.path}", json={}, trace_request_ctx=connect) as answer:
                    await answer.read()
                    if answer.status != 200:
                        error = f"status:{answer.status}"
        except NoEndpoint:
            error = "no_endpoint"
        except (aiohttp.ClientError, TimeoutError) as e:
            error = type(e).__name__
        self.records.append(
            RequestRecord(sent_at, time.perf_counter() - due, not error, endpoint, error, max(0.0, lag), connect.seconds)
        )


class _Connect:
    """A request's new connection, timed by aiohttp's tracing (``trace_request_ctx``)."""

    __slots__ = ("started", "seconds")

    def __init__(self) -> None:
        self.started: float | None = None
        self.seconds: float | None = None


async def _connect_started(session: object, ctx: SimpleNamespace, params: object) -> None:
    if isinstance(ctx.trace_request_ctx, _Connect):
        ctx.trace_request_ctx.started = time.perf_counter()


async def _connect_ended(session: object, ctx: SimpleNamespace, params: object) -> None:
    c = ctx.trace_request_ctx
    if isinstance(c, _Connect) and c.started is not None:
        c.seconds = time.perf_counter() - c.started
