"""What the training scheduler's sources (:mod:`collectors.slurm_collector`,
:mod:`collectors.kube_collector`) share: producing one read's node records, reading on an
interval, and logging a failing read once per failure (:class:`ReadFailures`).

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


class ReadFailures:
    """A source's read failures, logged when they change rather than on every read.

    ``failed`` logs ``<source>_read_failed`` (warning) when the failure differs from the last
    read's, ``ok`` logs ``<source>_read_recovered`` (info, ``was``: the last failure) once after a
    failure. Counting the failure in a metric stays with the source (its labels differ).

    Attributes:
        source: the event prefix, for example ``"slurm"`` or ``"kubernetes"``.
        failing: the current failure (a short reason string), or None while reads succeed.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.failing: str | None = None

    def failed(self, failure: str, **extra: object) -> None:
        """Record that this read failed with ``failure``; ``extra`` is logged with the first one."""
        if self.failing != failure:
            log.warning(f"{self.source}_read_failed", extra={"failure": failure, **extra})
        self.failing = failure

    def ok(self) -> None:
        """Record that this read succeeded."""
        if self.failing is not None:
            log.info(f"{self.source}_read_recovered", extra={"was": self.failing})
            self.failing = None


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
