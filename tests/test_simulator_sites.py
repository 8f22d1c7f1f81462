"""simulator.sites.SimulatedSite's claims against a demand: below its demand it sends up to
``parallel_claims`` claims at once, each on another node's offer, never more GPUs than it still
wants; one at a time by default; with ``claim_on_offer`` an arriving offer starts the next
round at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from contracts import LeaseState, Offer, OfferedGpu
from simulator.sites import DiurnalDemand, SimulatedSite


class FakeClient:
    """The :class:`broker.edge.EdgeClient` surface the claim loop uses: offers known, leases known,
    and a claim that takes 0.2 s and records how many were in flight at once."""

    def __init__(self, offers: int) -> None:
        now = time.time()
        self.known_offers = {
            f"o{i}": Offer(offer_id=f"o{i}", ts=now, host=f"n{i}", gpus=[OfferedGpu(gpu=f"n{i}/g0"),
                           OfferedGpu(gpu=f"n{i}/g1")], expires_at=now + 60, notice_seconds=2.0)
            for i in range(offers)
        }  # fmt: skip
        self.known_leases: dict[str, object] = {}
        self.in_flight = self.most_in_flight = 0
        self.claimed: list[tuple[str, int]] = []

    async def claim(self, offer_id: str, *, count: int, **_: object) -> SimpleNamespace:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.2)
        self.in_flight -= 1
        self.claimed.append((offer_id, count))
        lease = SimpleNamespace(lease_id=f"l{len(self.claimed)}", gpus=["g"] * count, state=LeaseState.GRANTED,
                                at_risk_since=None, ts=time.time())  # fmt: skip
        self.known_leases[lease.lease_id] = lease
        return lease


async def _one_round(parallel: int, wanted: int, offers: int = 5) -> FakeClient:
    site = SimulatedSite(name="edge-b", host="127.0.0.1", port=1, seed=3, claim_every_s=0.02, max_gpus_per_claim=1, parallel_claims=parallel,
                         demand=DiurnalDemand(peak_gpus=wanted, trough_gpus=wanted, compression=1.0))  # fmt: skip
    fake = FakeClient(offers)
    site.client = fake  # type: ignore[assignment]
    stop = asyncio.Event()
    loop = asyncio.create_task(site._claim_loop(stop))
    await asyncio.sleep(0.15)  # one round's claims are in flight (each takes 0.2 s)
    stop.set()
    await loop
    return fake


async def test_below_its_demand_a_site_claims_on_several_offers_at_once() -> None:
    fake = await _one_round(parallel=4, wanted=3)
    # 3 wanted, 4 allowed at once: 3 claims of 1 GPU, on 3 different offers, all in flight together
    assert fake.most_in_flight == 3
    assert sorted(c for _, c in fake.claimed) == [1, 1, 1] and len({o for o, _ in fake.claimed}) == 3
    fake = await _one_round(parallel=4, wanted=9, offers=2)  # no more claims than offers
    assert fake.most_in_flight == 2 and len({o for o, _ in fake.claimed}) == 2


async def test_one_claim_at_a_time_by_default() -> None:
    fake = await _one_round(parallel=1, wanted=3)
    assert fake.most_in_flight == 1 and len(fake.claimed) == 1
    with pytest.raises(ValueError):
        SimulatedSite(name="edge-b", host="127.0.0.1", port=1, parallel_claims=0)


async def test_with_claim_on_offer_an_arriving_offer_starts_the_next_claim_round_at_once() -> None:
    for on_offer in (True, False):
        site = SimulatedSite(name="edge-b", host="127.0.0.1", port=1, seed=3, claim_every_s=10.0, max_gpus_per_claim=1,
                             demand=DiurnalDemand(peak_gpus=2, trough_gpus=2, compression=1.0),
                             claim_on_offer=on_offer)  # fmt: skip
        fake = FakeClient(1)
        site.client = fake  # type: ignore[assignment]
        stop = asyncio.Event()
        loop = asyncio.create_task(site._claim_loop(stop))
        await asyncio.sleep(0.05)
        site._on_event(next(iter(fake.known_offers.values())))
        await asyncio.sleep(0.3)  # one claim takes 0.2 s
        stop.set()
        await loop
        assert len(fake.claimed) == (1 if on_offer else 0)
