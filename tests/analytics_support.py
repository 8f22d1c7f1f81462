"""Helpers shared by the tests of the analytics service on the in-process bus.

* :func:`service` — an :class:`AnalyticsService` on :data:`TOPICS` with :data:`IDLE` and a clock;
* :func:`drain` — step the service until its input is consumed;
* :func:`latest` — the newest capacity update per host or per GPU from the capacity topic.
"""

from __future__ import annotations

from typing import Any

from analytics.classify import IdleConfig
from analytics.service import AnalyticsService
from contracts import CapacityUpdate, KafkaTopics, decode
from contracts.bus import MemoryBus
from tests.support import Clock

TOPICS = KafkaTopics()
"""The default topic names."""
IDLE = IdleConfig(min_idle_s=30.0, stale_after_s=25.0)
"""Idle after 30 s without work, stale after 25 s without a sample (samples come every 10 s)."""


def service(bus: MemoryBus, clock: Clock, db: str = ":memory:", **options: Any) -> AnalyticsService:
    """An analytics service on ``bus`` (:data:`TOPICS`, :data:`IDLE`) reading ``clock``, its store
    at ``db``; ``options`` are further ``AnalyticsService`` keyword arguments."""
    return AnalyticsService(bus=bus, topics=TOPICS, db_path=db, idle=IDLE, clock=clock, **options)


async def drain(svc: AnalyticsService) -> int:
    """Step ``svc`` (10 ms poll) until a step consumes nothing; returns the records consumed."""
    total = 0
    while n := await svc.step(timeout_s=0.01):
        total += n
    return total


def latest(bus: MemoryBus, by: str = "key", topics: KafkaTopics | None = None) -> dict[str, CapacityUpdate]:
    """The newest capacity update (in topic order) per value of its attribute ``by`` (``"key"``:
    per GPU, ``"host"``: per node) from ``topics.capacity`` on ``bus``; tombstones are skipped."""
    out: dict[str, CapacityUpdate] = {}
    for m in bus.records((topics or TOPICS).capacity):
        if m.value is not None:
            u = decode(CapacityUpdate, m.value)
            out[getattr(u, by)] = u
    return out
