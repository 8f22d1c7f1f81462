"""Simulated edge sites: each one drives a :class:`broker.edge.EdgeClient` like an inference site
would — it watches offers, claims one now and then, renews its leases, and gives GPUs back when
the broker reclaims them (most of the time promptly; now and then it lets the deadline revoke).

Randomness comes from one seeded :class:`random.Random` per site, so a run's choices are
reproducible up to the timing of the messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from typing import Any

from broker.edge import BrokerRejected, ClaimRejected, EdgeClient, WatchEvent
from contracts import LeaseMessage, LeaseState

log = logging.getLogger(__name__)


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
        **connection: Any,
    ) -> None:
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
        self.counts: Counter[str] = Counter()
        """``claims_sent``, ``leases_granted``, ``claim_timeouts``, ``renewals``, ``renewals_rejected``,
        ``reclaims_seen``, ``released_in_notice``, ``let_revoke``, ``revoked``, ``expired``,
        ``released``."""
        self.rejections: Counter[str] = Counter()
        """Claims refused, by reason code."""
        self.notices: dict[str, tuple[float, float | None, str]] = {}
        """Reclaim notices received: lease id → (received at, the notice's deadline, reason),
        Unix s (the first notice of each lease)."""
        self._reclaims_handled: set[str] = set()
        self._ended: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def stats(self) -> dict[str, object]:
        """The counters, plus ``rejections`` by code and the site's ``live_leases`` now."""
        return {**self.counts, "rejections": dict(self.rejections), "live_leases": len(self._live())}

    def _live(self) -> list[LeaseMessage]:
        return [m for m in self.client.known_leases.values() if m.state.live]

    async def run(self, stop: asyncio.Event) -> None:
        """Connect and act until ``stop`` is set. Raises ``ConnectionError`` if the MQTT server
        cannot be reached at the start (later outages are ridden out by the client)."""
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

    async def _claim_loop(self, stop: asyncio.Event) -> None:
        while not await self._sleep(stop, self.claim_every_s * self._rng.uniform(0.5, 1.5)):
            offers = sorted(self.client.known_offers.values(), key=lambda o: o.offer_id)
            if not offers or len(self._live()) >= self.max_live_leases:
                continue
            if self._rng.random() >= self.claim_probability:
                continue
            offer = self._rng.choice(offers)
            count = self._rng.randint(1, min(len(offer.gpus), self.max_gpus_per_claim))
            self.counts["claims_sent"] += 1
            try:
                lease = await self.client.claim(offer.offer_id, count=count, duration_seconds=self.duration_s,
                                                 workload=self.workload)
            except ClaimRejected as e:
                self.rejections[e.code.value] += 1
                continue
            except TimeoutError:
                self.counts["claim_timeouts"] += 1
                continue
            self.counts["leases_granted"] += 1
            log.info(
                "site_lease_granted",
                extra={"site": self.name, "lease_id": lease.lease_id, "gpus": len(lease.gpus)},
            )

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

    def _on_event(self, event: WatchEvent) -> None:
        if not isinstance(event, LeaseMessage):
            return
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

    async def _release_later(self, lease_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self.client.release(lease_id)
            self.counts["released_in_notice"] += 1
        except (BrokerRejected, TimeoutError) as e:
            log.info("site_release_failed", extra={"site": self.name, "lease_id": lease_id, "error": str(e)})
