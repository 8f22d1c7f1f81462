"""What the lending benchmarks (``bench/slurm.py``, ``bench/lending_kubernetes.py``) share: every
GPU of their nodes idle on the bus, and the claim step they time (one GPU of the first offer that
has one, claim → lease at the site)."""

from __future__ import annotations

import asyncio
import time

from collections.abc import Iterable

from broker.edge import ClaimRejected, EdgeClient
from contracts import CapacityUpdate, GpuState, KafkaTopics, LeaseMessage, encode
from contracts.bus import Bus


async def idle_capacity(bus: Bus, topics: KafkaTopics, nodes: Iterable[str], gpus: int = 8) -> None:
    """Every GPU of ``nodes`` idle now (keys ``<node>/gpu<index>``, as the lendings' GPU maps read
    them), predicted idle for an hour, on ``topics.capacity``."""
    producer = bus.producer()
    await producer.start()
    now = time.time()
    for host in nodes:
        for i in range(gpus):
            u = CapacityUpdate(ts=now, host=host, gpu_uuid=f"gpu{i}", state=GpuState.IDLE, since=now - 60,
                               predicted_idle_until=now + 3600, model_name="NVIDIA H100 80GB HBM3")  # fmt: skip
            await producer.send(topics.capacity, encode(u), key=u.key)
    await producer.flush()
    await producer.stop()


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
