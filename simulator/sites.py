"""Simulated edge sites: each one drives a :class:`broker.edge.EdgeClient` like an inference site
would — it watches offers, claims one now and then, renews its leases, and gives GPUs back when
the broker reclaims them (most of the time promptly; now and then it lets the deadline revoke).

With a :class:`DiurnalDemand` a site wants a number of GPUs that follows the time of day (an
inference service's daily cycle): it claims while it holds fewer, and releases leases while it
holds more than it wants. With ``release_on_at_risk`` it moves away from a lease the broker says
is at risk (``LeaseMessage.at_risk_since``: a training job is planned onto its GPUs) by releasing
it at once, before any reclaim notice.

Randomness comes from one seeded :class:`random.Random` per site, so a run's choices are
reproducible up to the timing of the messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from broker.edge import BrokerRejected, ClaimRejected, EdgeClient, WatchEvent
from contracts import LeaseKind, LeaseMessage, LeaseState, Offer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiurnalDemand:
    """GPUs an inference site wants over a simulated day: a raised cosine between ``trough_gpus``
    (at ``peak_hour`` - 12 h) and ``peak_gpus`` (at ``peak_hour``), the shape of a service's
    daily request rate.

    Attributes:
        peak_gpus / trough_gpus: GPUs wanted at the busiest / quietest hour (>= 0, trough <= peak).
        compression: simulated seconds per wall second (> 0).
        start_hour: simulated hour of day (0-24) at wall time ``t0``.
        peak_hour: hour of day of the peak.

    Raises:
        ValueError: a bound outside the above.
    """

    peak_gpus: int
    trough_gpus: int
    compression: float
    start_hour: float = 0.0
    peak_hour: float = 14.0

    def __post_init__(self) -> None:
        if not 0 <= self.trough_gpus <= self.peak_gpus or not self.compression > 0:
            raise ValueError(f"need 0 <= trough <= peak and compression > 0, got {self}")

    def hour(self, elapsed_wall_s: float) -> float:
        """Simulated hour of day (0 <= h < 24) ``elapsed_wall_s`` wall seconds after ``t0``."""
        return (self.start_hour + elapsed_wall_s * self.compression / 3600.0) % 24.0

    def gpus_at(self, elapsed_wall_s: float) -> int:
        """GPUs wanted ``elapsed_wall_s`` wall seconds after ``t0`` (rounded to the nearest)."""
        phase = 2 * math.pi * (self.hour(elapsed_wall_s) - self.peak_hour) / 24.0
        return round(self.trough_gpus + (self.peak_gpus - self.trough_gpus) * (1 + math.cos(phase)) / 2)


class SimulatedSite:
    """One simulated inference site.

    Args:
        name: the site name (MQTT user and ``{site}`` topic level).
        connection: the MQTT server and credentials, keyword arguments of
            :class:`broker.edge.EdgeClient` (``host``, ``port``, ``username``, ``password``,
            ``root``, ``protocol``, ``tls``...).
        seed: seed of the site's random choices.
        claim_every_s: mean time between claim attempts, seconds (each wait jittered ±50 %).
        claim_probability: chance that an attempt claims when an offer is there.
        max_live_leases: the site claims no more while it holds this many live leases.
        max_gpus_per_claim: a claim takes 1..this many GPUs of one offer.
        duration_s: lease length asked for in each claim, seconds.
        renew_every_s: heartbeat period of each live lease, seconds (keep it under the lease TTL).
        release_on_reclaim: chance that a reclaim notice is answered with a release (after a
            short random delay within the first quarter of the notice); otherwise the site keeps
            the GPUs until the broker revokes them at the deadline.
        persistent: keep a persistent MQTT session (reclaim notices queue while offline).
        workload: the operator's workload profile each claim names (``Claim.workload``; the
            broker runs it on the leased GPUs); ``None``: none.
        demand: the GPUs the site wants over time (:class:`DiurnalDemand`, from :meth:`run`'s
            start); then ``max_live_leases`` and ``claim_probability`` do not limit it: it claims
            (up to ``max_gpus_per_claim`` at a time) while it holds fewer and releases its newest
            lease while it holds more by at least that lease's GPUs. ``None``: as above.
        parallel_claims: with a demand, claims sent at once when it wants more, each on a
            different offer (one node's offer is withdrawn and published anew as soon as a claim
            takes some of it), as many as it still wants GPUs; without a demand one at a time.
        lease_kind: the kind each claim asks for (``Claim.lease_kind``); ``None``: unset.
        release_on_at_risk: release a lease as soon as its message says it is at risk.
        claim_on_offer: with a demand, an offer that arrives ends the wait between two claim
            rounds at once (a site that subscribes to offers claims when one comes), rather than
            only after ``claim_every_s``.
    """

    def __init__(
        self,
        *,
        name: str,
        seed: int = 0,
        claim_every_s: float = 1.0,
        claim_probability: float = 0.7,
        max_live_leases: int = 2,
        max_gpus_per_claim: int = 2,
        duration_s: float = 600.0,
        renew_every_s: float = 5.0,
        release_on_reclaim: float = 0.85,
        persistent: bool = True,
        workload: str | None = None,
        demand: DiurnalDemand | None = None,
        lease_kind: LeaseKind | None = None,
        release_on_at_risk: bool = False,
        parallel_claims: int = 1,
        claim_on_offer: bool = False,
        **connection: Any,
    ) -> None:
        if parallel_claims < 1:
            raise ValueError(f"parallel_claims must be >= 1, got {parallel_claims}")
        self.name = name
        self.client = EdgeClient(site=name, persistent=persistent, **connection)
        self._rng = random.Random(seed)
        self.claim_every_s = claim_every_s
        self.claim_probability = claim_probability
        self.max_live_leases = max_live_leases
        self.max_gpus_per_claim = max_gpus_per_claim
        self.duration_s = duration_s
        self.renew_every_s = renew_every_s
        self.release_on_reclaim = release_on_reclaim
        self.workload = workload
        self.demand = demand
        self.lease_kind = lease_kind
        self.release_on_at_risk = release_on_at_risk
        self.parallel_claims = parallel_claims
        self.claim_on_offer = claim_on_offer
        self._offered = asyncio.Event()
        """Set when an offer arrives (read by the claim loop when ``claim_on_offer``)."""
        self._t0 = time.time()
        self.counts: Counter[str] = Counter()
        """``claims_sent``, ``leases_granted``, ``claim_timeouts``, ``renewals``, ``renewals_rejected``,
        ``reclaims_seen``, ``released_in_notice``, ``let_revoke``, ``revoked``, ``expired``,
        ``released``, ``at_risk_seen``, ``released_at_risk``, ``released_for_demand``."""
        self.rejections: Counter[str] = Counter()
        """Claims refused, by reason code."""
        self.notices: dict[str, tuple[float, float | None, str]] = {}
        """Reclaim notices received: lease id → (received at, the notice's deadline, reason),
        Unix s (the first notice of each lease)."""
        self._reclaims_handled: set[str] = set()
        self._at_risk: set[str] = set()
        self._ended: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def stats(self) -> dict[str, object]:
        """The counters, plus ``rejections`` by code and the site's ``live_leases`` now."""
        return {**self.counts, "rejections": dict(self.rejections), "live_leases": len(self._live())}

    def wanted_gpus(self) -> int | None:
        """GPUs the site's demand asks for now (:class:`DiurnalDemand` since :meth:`run` started),
        ``None`` without a demand."""
        return None if self.demand is None else self.demand.gpus_at(time.time() - self._t0)

    def _live(self) -> list[LeaseMessage]:
        return [m for m in self.client.known_leases.values() if m.state.live]

    async def run(self, stop: asyncio.Event) -> None:
        """Connect and act until ``stop`` is set. Raises ``ConnectionError`` if the MQTT server
        cannot be reached at the start (later outages are ridden out by the client)."""
        self._t0 = time.time()
        async with self.client:
            loops = [
                asyncio.create_task(self._watch(), name=f"site-{self.name}-watch"),
                asyncio.create_task(self._claim_loop(stop), name=f"site-{self.name}-claim"),
                asyncio.create_task(self._renew_loop(stop), name=f"site-{self.name}-renew"),
            ]
            try:
                await stop.wait()
            finally:
                for t in [*loops, *self._tasks]:
                    t.cancel()
                await asyncio.gather(*loops, *self._tasks, return_exceptions=True)

    async def _sleep(self, stop: asyncio.Event, seconds: float) -> bool:
        """Sleep ``seconds`` (or until stop); True if stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
        return stop.is_set()

    def _wanted_more(self) -> int | None:
        """With a demand: GPUs wanted beyond those held now (negative: too many), releasing
        what is too much; ``None`` without a demand."""
        if self.demand is None:
            return None
        live = [m for m in self._live() if m.state is not LeaseState.RECLAIMING and m.at_risk_since is None]
        more = self.demand.gpus_at(time.time() - self._t0) - sum(len(m.gpus) for m in live)
        for m in sorted(live, key=lambda m: (-m.ts, m.lease_id)):
            if more <= -len(m.gpus):
                more += len(m.gpus)
                self._release_now(m.lease_id, "released_for_demand")
        return more

    async def _pause(self, stop: asyncio.Event) -> bool:
        """The wait between two claim rounds: ``claim_every_s`` jittered ±50 %, cut short by an
        offer arriving with ``claim_on_offer`` and a demand; True if stopping."""
        seconds = self.claim_every_s * self._rng.uniform(0.5, 1.5)
        if not (self.claim_on_offer and self.demand is not None):
            return await self._sleep(stop, seconds)
        self._offered.clear()
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._offered.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return stop.is_set()

    async def _claim_loop(self, stop: asyncio.Event) -> None:
        while not await self._pause(stop):
            offers = sorted(self.client.known_offers.values(), key=lambda o: o.offer_id)
            more = self._wanted_more()
            if more is not None:
                if more <= 0 or not offers:
                    continue
                claims = []
                for offer in self._rng.sample(offers, min(len(offers), self.parallel_claims)):
                    if more <= 0:
                        break
                    count = min(len(offer.gpus), self.max_gpus_per_claim, more)
                    claims.append((offer, count))
                    more -= count
                await asyncio.gather(*(self._claim(offer, count) for offer, count in claims))
                continue
            if not offers or len(self._live()) >= self.max_live_leases:
                continue
            if self._rng.random() >= self.claim_probability:
                continue
            offer = self._rng.choice(offers)
            await self._claim(offer, self._rng.randint(1, min(len(offer.gpus), self.max_gpus_per_claim)))

    async def _claim(self, offer: Offer, count: int) -> None:
        """Claim ``count`` GPUs of ``offer``, counting the outcome."""
        self.counts["claims_sent"] += 1
        try:
            lease = await self.client.claim(offer.offer_id, count=count, duration_seconds=self.duration_s,
                                            workload=self.workload, lease_kind=self.lease_kind)
        except ClaimRejected as e:
            self.rejections[e.code.value] += 1
            return
        except TimeoutError:
            self.counts["claim_timeouts"] += 1
            return
        self.counts["leases_granted"] += 1
        log.info("site_lease_granted", extra={"site": self.name, "lease_id": lease.lease_id, "gpus": len(lease.gpus)})

    async def _renew_loop(self, stop: asyncio.Event) -> None:
        while not await self._sleep(stop, self.renew_every_s):
            for lease in self._live():
                try:
                    await self.client.renew(lease.lease_id, timeout_s=max(1.0, self.renew_every_s))
                    self.counts["renewals"] += 1
                except (BrokerRejected, TimeoutError):
                    self.counts["renewals_rejected"] += 1

    async def _watch(self) -> None:
        async with contextlib.aclosing(self.client.watch()) as events:
            async for event in events:
                self._on_event(event)

    def _release_now(self, lease_id: str, counter: str) -> None:
        """Release ``lease_id`` in the background, counting ``counter`` once it is done."""
        self._reclaims_handled.add(lease_id)
        task = asyncio.create_task(self._release_later(lease_id, 0.0, counter))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_event(self, event: WatchEvent) -> None:
        if isinstance(event, Offer):
            self._offered.set()
        if not isinstance(event, LeaseMessage):
            return
        if (event.at_risk_since is not None and event.state in (LeaseState.GRANTED, LeaseState.ACTIVE)
                and event.lease_id not in self._at_risk):
            self._at_risk.add(event.lease_id)
            self.counts["at_risk_seen"] += 1
            if self.release_on_at_risk and event.lease_id not in self._reclaims_handled:
                self._release_now(event.lease_id, "released_at_risk")
        if event.state is LeaseState.RECLAIMING and event.lease_id not in self._reclaims_handled:
            self._reclaims_handled.add(event.lease_id)
            self.notices[event.lease_id] = (time.time(), event.reclaim_deadline, event.reason)
            self.counts["reclaims_seen"] += 1
            if self._rng.random() < self.release_on_reclaim:
                delay = self._rng.uniform(0.0, event.notice_seconds / 4)
                task = asyncio.create_task(self._release_later(event.lease_id, delay))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                self.counts["let_revoke"] += 1
        elif not event.state.live and event.lease_id not in self._ended:
            self._ended.add(event.lease_id)
            self.counts[event.state.value] += 1

    async def _release_later(self, lease_id: str, delay: float, counter: str = "released_in_notice") -> None:
        await asyncio.sleep(delay)
        try:
            await self.client.release(lease_id)
            self.counts[counter] += 1
        except (BrokerRejected, TimeoutError) as e:
            log.info("site_release_failed", extra={"site": self.name, "lease_id": lease_id, "error": str(e)})
