"""What the training scheduler's sources (:mod:`collectors.slurm_collector`,
:mod:`collectors.kube_collector`) share: producing one read's node records, and reading on an
interval.

Both report every failure through a callback ``failed(where, exc)``, where ``where`` is
``"produce"`` (a record or the flush refused by Kafka) or ``"loop"`` (an unexpected exception
of a whole read), so each source counts it under its own metric label.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from contracts.base import encode
from contracts.bus import Producer
from contracts.scheduler import SchedulerNode

log = logging.getLogger(__name__)

Failed = Callable[[str, BaseException], None]


async def produce_records(producer: Producer, topic: str, records: Sequence[SchedulerNode], failed: Failed) -> int:
    """Send ``records`` to ``topic`` (keyed by their partition key), then flush; return how many
    sends were accepted. A refused send or flush is reported as ``failed("produce", exc)`` and
    never raised: one refused record must not stop the read, and the next read sends a fresh
    state anyway."""
    produced = 0
    for rec in records:
        try:
            await producer.send(topic, encode(rec), key=rec.partition_key)
            produced += 1
        except Exception as exc:  # noqa: BLE001 — reported; the next read sends a fresh state
            failed("produce", exc)
            log.warning("scheduler_produce_failed", extra={"host": rec.host, "error": repr(exc)})
    try:
        await producer.flush()
    except Exception as exc:  # noqa: BLE001 — reported; the next read sends a fresh state
        failed("produce", exc)
        log.warning("scheduler_flush_failed", extra={"error": repr(exc)})
    return produced


async def run_every(collect: Callable[[], Awaitable[object]], interval_s: float, stop: asyncio.Event,
                    failed: Failed) -> None:
    """Await ``collect()`` every ``interval_s`` seconds (start to start) until ``stop`` is set.
    An unexpected exception of a read is logged and reported as ``failed("loop", exc)``, never
    raised; cancellation propagates."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            await collect()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failed("loop", exc)
            log.exception("scheduler_collect_failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, interval_s - (time.monotonic() - started)))
