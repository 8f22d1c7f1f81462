"""The claim step the broker benchmarks time (``bench/slurm.py``, ``bench/lending_kubernetes.py``):
one GPU of the first offer that has one, claim → lease at the site."""

from __future__ import annotations

import asyncio
import time

from broker.edge import ClaimRejected, EdgeClient
from contracts import LeaseMessage


async def claim_one_gpu(site: EdgeClient, out: dict[str, list[float]], tag: str) -> LeaseMessage | None:
    """Claim one GPU of the first offer ``site`` knows with GPUs: the seconds from the claim to the
    lease at the site go to ``out[tag]`` and the lease is returned; a refused claim's seconds go to
    ``out[f"{tag}_refused"]`` and ``None`` is returned (after 50 ms), as when no offer is known
    yet (after 10 ms). Raises ``TimeoutError`` if the broker does not answer within 10 s."""
    offer = next((o for o in site.known_offers.values() if o.gpus), None)
    if offer is None:
        await asyncio.sleep(0.01)
        return None
    t0 = time.perf_counter()
    try:
        lease = await site.claim(offer.offer_id, count=1, timeout_s=10)
    except ClaimRejected:
        out[f"{tag}_refused"].append(time.perf_counter() - t0)
        await asyncio.sleep(0.05)
        return None
    out[tag].append(time.perf_counter() - t0)
    return lease
