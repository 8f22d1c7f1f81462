"""The demo's serving site: an edge site that keeps leases of the workload profile
(:class:`broker.kept_leases.KeptLeases`: a replacement claimed on each reclaim notice or at-risk
message, traffic moved once it serves, the old endpoint drained, the lease released early) and
drives a steady open-loop request load at their endpoints (:class:`simulator.load.OpenLoopLoad`)
through the reclaims Slurm makes for training jobs, and what that load saw (:class:`EdgeLoadSummary`).

Only lending through a training scheduler runs a workload on leased GPUs (``[[broker.workloads]]``):
without one (``--scheduler none``) there are no endpoints to send requests to, and the demo says so
(:func:`no_load_reason`) rather than showing a load that never ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from broker.edge import EdgeClient
from broker.kept_leases import Handover, KeptLeases
from simulator.load import OpenLoopLoad, RequestRecord, probe, quantile, summarize

LOSSES = ("expired", "revoked", "lost", "unhealthy", "start_failed")
"""Counters of :class:`broker.kept_leases.KeptLeases` of leases that left without a hand-over."""
UNANSWERED = "unanswered"
"""Error of a request sent and not finished when the load stopped (counted as failed)."""


@dataclass(frozen=True)
class EdgeLoadSummary:
    """What the serving site's request load saw (latencies in seconds, ``None`` when no request of
    that kind succeeded).

    Attributes:
        site: the serving site.
        rate_per_s: requests per second (open loop).
        target / gpus_per_lease: leases kept serving, GPUs each.
        load_s: seconds the load ran (from the first serving endpoint to the end of the demo).
        sent: requests sent; ``served + failed == sent``.
        served: answered 200.
        failed: the others: no endpoint served, connection error, not 200, timeout, or still
            unanswered when the load stopped (:data:`UNANSWERED`).
        failed_by: ``failed`` by reason (``no_endpoint``, ``status:<code>``, an exception's class
            name, :data:`UNANSWERED`); the values add up to ``failed``.
        steady_sent / steady_failed / steady_p50_s / steady_p99_s: requests sent outside every
            reclaim window, those that failed, latency quantiles (nearest rank) of the served ones,
            from the moment the load driver sent each (:func:`simulator.load.summarize`).
        reclaim_sent / reclaim_failed / reclaim_p50_s / reclaim_p99_s: the same for requests sent
            inside a reclaim window (notice → early release, or → the deadline when not released,
            or → the end of the load).
        reclaims: hand-overs noticed while the load ran (reclaim notices and at-risk messages).
        reclaims_with_deadline: those that had a reclaim deadline (Slurm preempted the lease).
        reclaims_survived: hand-overs released before their deadline (or at risk, with none yet)
            with no failed request sent in their window.
        released_early: hand-overs released before their deadline (or with none yet).
        driver_lag_p99_s: p99 of the load driver's own lateness (due → sent) over the served
            requests, seconds (the demo's process busy): not in the latencies above.
        losses: leases that left without a hand-over, by why (the :attr:`KeptLeases.counts
            <broker.kept_leases.KeptLeases>` ``expired``, ``revoked``, ``lost``, ``unhealthy``,
            ``start_failed`` that are not 0): their endpoint may fail requests until it leaves.
    """

    site: str
    rate_per_s: float
    target: int
    gpus_per_lease: int
    load_s: float
    sent: int
    served: int
    failed: int
    failed_by: dict[str, int]
    steady_sent: int
    steady_failed: int
    steady_p50_s: float | None
    steady_p99_s: float | None
    reclaim_sent: int
    reclaim_failed: int
    reclaim_p50_s: float | None
    reclaim_p99_s: float | None
    reclaims: int
    reclaims_with_deadline: int
    reclaims_survived: int
    released_early: int
    driver_lag_p99_s: float | None = None
    losses: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly dict."""
        return asdict(self)


def _or_none(x: float) -> float | None:
    return None if x != x else x  # NaN: no request of that kind succeeded


def _window(h: Handover, end: float) -> tuple[float, float]:
    """A hand-over's reclaim window: notice → early release, else → the deadline, else → ``end``."""
    if h.released_at is not None:
        return h.noticed_at, h.released_at
    return h.noticed_at, min(h.deadline, end) if h.deadline is not None else end


def load_summary(
    site: str, rate_per_s: float, target: int, gpus_per_lease: int, sent: int,
    records: Sequence[RequestRecord], handovers: Sequence[Handover], began: float, ended: float,
    counts: Mapping[str, int] | None = None,
) -> EdgeLoadSummary:  # fmt: skip
    """The summary of a load that ran from ``began`` to ``ended`` (Unix s): ``sent`` requests of
    which ``records`` finished, through ``handovers``; ``counts``: the kept leases' counters
    (:attr:`broker.kept_leases.KeptLeases.counts`). Raises ``ValueError`` when more records than
    requests sent are given."""
    if len(records) > sent:
        raise ValueError(f"{len(records)} requests finished but only {sent} were sent")
    during = [h for h in handovers if began <= h.noticed_at <= ended]
    windows = [_window(h, ended) for h in during]
    inside, outside = summarize(records, windows, from_send=True)
    failed_by = Counter(r.error for r in records if not r.ok)
    if sent > len(records):
        failed_by[UNANSWERED] += sent - len(records)
    served = sum(1 for r in records if r.ok)
    survived = 0
    for h, (a, b) in zip(during, windows, strict=True):
        if h.early and not any(a <= r.sent_at <= b and not r.ok for r in records):
            survived += 1
    return EdgeLoadSummary(
        site=site, rate_per_s=rate_per_s, target=target, gpus_per_lease=gpus_per_lease,
        load_s=round(max(0.0, ended - began), 2), sent=sent, served=served, failed=sent - served,
        failed_by=dict(failed_by),
        steady_sent=outside.total, steady_failed=outside.failed,
        steady_p50_s=_or_none(outside.p50_s), steady_p99_s=_or_none(outside.p99_s),
        reclaim_sent=inside.total, reclaim_failed=inside.failed,
        reclaim_p50_s=_or_none(inside.p50_s), reclaim_p99_s=_or_none(inside.p99_s),
        reclaims=len(during), reclaims_with_deadline=sum(1 for h in during if h.deadline is not None),
        reclaims_survived=survived, released_early=sum(1 for h in during if h.early),
        driver_lag_p99_s=_or_none(quantile([r.lag_s for r in records if r.ok], 0.99)),
        losses={k: n for k in LOSSES if (n := (counts or {}).get(k, 0))},
    )  # fmt: skip


def no_load_reason(scheduler: dict[str, object]) -> str:
    """Why the demo ran no request load, from its ``DemoSummary.scheduler`` status."""
    return (f"not run: leases run no workload without a training scheduler ({scheduler.get('detail', 'none')}), "
            "so there is no endpoint to send requests to")  # fmt: skip


@dataclass
class ServingSite:
    """One edge site keeping ``target`` leases of ``workload`` and sending ``rate_per_s``
    requests/s at their endpoints (module docstring). :meth:`run` until the demo's stop;
    :meth:`finish` stops the load first (the endpoints still up), so no request fails for the
    demo's own shutdown.

    Args:
        name: the site (MQTT user, ``{site}`` topic level).
        workload: the workload profile each claim names.
        connection: keyword arguments of :class:`broker.edge.EdgeClient` (``host``, ``port``,
            ``username``, ``password``, ``root``, ``protocol``).
        rate_per_s: requests per second (> 0).
        target / gpus_per_lease: leases kept serving, GPUs each (>= 1).
        notice_s: the reclaim notice, seconds (the longest drain of a leaving endpoint).
        renew_every_s: renewal period of each lease, seconds (under the broker's lease TTL).
        warmup: requests the site's readiness probe sends to a new endpoint before it takes traffic.
        request_timeout_s: a request without an answer this long fails, seconds.
        endpoint_wait_s: a request sent while no endpoint serves waits this long for one
            (:meth:`broker.kept_leases.Endpoints.acquire`), seconds; ``None``: twice the notice.

    Attributes:
        kept: the :class:`broker.kept_leases.KeptLeases` while :meth:`run` runs (then the last one).
        load: the :class:`simulator.load.OpenLoopLoad` once an endpoint served.
    """

    name: str
    workload: str
    connection: dict[str, Any]
    rate_per_s: float = 50.0
    target: int = 2
    gpus_per_lease: int = 1
    notice_s: float = 4.0
    renew_every_s: float = 2.0
    warmup: int = 5
    request_timeout_s: float = 2.0
    endpoint_wait_s: float | None = None
    kept: KeptLeases | None = field(default=None, init=False)
    load: OpenLoopLoad | None = field(default=None, init=False)
    _load_stop: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _load_done: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _began: float | None = field(default=None, init=False)
    _ended: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.rate_per_s > 0 or self.target < 1 or self.gpus_per_lease < 1:
            raise ValueError(f"rate_per_s > 0, target >= 1 and gpus_per_lease >= 1 needed, got {self}")

    @property
    def notices(self) -> dict[str, tuple[float, float | None, str]]:
        """Hand-overs with a reclaim deadline: lease id → (noticed at, deadline, reason), Unix s
        (noticed at: the reclaim notice, or the at-risk message when that came first); the shape
        of :attr:`simulator.sites.SimulatedSite.notices`."""
        hs = self.kept.handovers if self.kept is not None else []
        return {h.lease_id: (h.noticed_at, h.deadline, h.reason) for h in hs if h.deadline is not None}

    def stats(self) -> dict[str, object]:
        """The kept leases' counters (:attr:`broker.kept_leases.KeptLeases.counts`), the requests
        sent and the leases kept now."""
        counts = dict(self.kept.counts) if self.kept is not None else {}
        return {**counts, "requests_sent": self.load.sent if self.load is not None else 0,
                "live_leases": len(self.kept.leases) if self.kept is not None else 0}  # fmt: skip

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, keep the leases and, from the first serving endpoint, send the load until
        :meth:`finish` or ``stop``. Raises ``ConnectionError`` when MQTT cannot be reached."""
        async with EdgeClient(site=self.name, persistent=True, **self.connection) as client:
            async with KeptLeases(
                client, target=self.target, workload=self.workload, gpus_per_lease=self.gpus_per_lease,
                renew_every_s=self.renew_every_s, ready_timeout_s=30.0, drain_timeout_s=self.notice_s,
                duration_seconds=3600.0, probe=lambda ep, lid: probe(ep, lid, warmup=self.warmup),
                recheck=lambda ep, lid: probe(ep, lid, warmup=0), recheck_every_s=1.0,
                release_on_exit=False,  # the demo's end cancels every hold; its broker may be gone by then
            ) as kept:  # fmt: skip
                self.kept = kept
                relay = asyncio.create_task(self._relay(stop))
                try:
                    while not kept.endpoints.serving and not self._load_stop.is_set():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._load_stop.wait(), 0.1)
                    if not self._load_stop.is_set():
                        self.load = OpenLoopLoad(
                            kept.endpoints, rate_per_s=self.rate_per_s, timeout_s=self.request_timeout_s,
                            endpoint_wait_s=2 * self.notice_s if self.endpoint_wait_s is None else self.endpoint_wait_s,
                        )
                        self._began = time.time()
                        try:
                            await self.load.run(self._load_stop)
                        finally:
                            self._ended = time.time()
                    self._load_done.set()
                    await stop.wait()
                finally:
                    relay.cancel()

    async def _relay(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._load_stop.set()

    async def finish(self, timeout_s: float = 5.0) -> None:
        """Stop sending and wait (at most ``timeout_s``) for the requests in flight to finish."""
        self._load_stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._load_done.wait(), timeout_s)

    def write_records(self, path: Path) -> None:
        """Write every finished request (``{"request": RequestRecord.row()}``)
        and every hand-over (``{"handover": <Handover fields>}``) as JSON lines, the format of
        ``bench/edge_reclaim.py --records``. Raises ``OSError``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as out:
            for r in self.load.records if self.load is not None else []:
                out.write(json.dumps({"request": r.row()}) + "\n")
            for h in self.kept.handovers if self.kept is not None else []:
                out.write(json.dumps({"handover": asdict(h)}) + "\n")

    def summary(self) -> EdgeLoadSummary | None:
        """:func:`load_summary` of the load; ``None`` when it never started (no endpoint served)."""
        if self.load is None or self._began is None or self.kept is None:
            return None
        return load_summary(
            self.name,
            self.rate_per_s,
            self.target,
            self.gpus_per_lease,
            self.load.sent,
            self.load.records,
            self.kept.handovers,
            self._began,
            self._ended or time.time(),
            self.kept.counts,
        )
