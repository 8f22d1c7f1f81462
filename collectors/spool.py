"""Delivery without loss: a write-ahead spool in front of a bus producer.

:class:`SpoolingProducer` wraps any :class:`contracts.bus.Producer` (in production
:class:`runtime.kafka.KafkaBusProducer`). :meth:`~SpoolingProducer.send` never talks to the
bus: it appends the record to a FIFO queue and returns. A background *drainer* takes records from
the head of the queue in *units* (up to ``batch_records`` / ``batch_bytes``), hands a unit to the
inner producer (``send`` each record, in order), waits for the inner ``flush`` to acknowledge it,
and only then removes the unit from the queue. So when the bus is unreachable nothing is lost:
records simply wait in the queue.

Tiers. The queue is a bounded in-memory deque (``memory_records``) followed, when ``disk_dir`` is
given, by an on-disk spool (``disk_bytes``): once memory is full, new records are appended to disk,
and while anything is on disk new records keep going to disk, so the queue is always *memory
(older) ++ disk (newer)* and strictly FIFO overall. When both are full, :meth:`send` waits for
space up to ``max_wait_s`` (backpressure); after that it drops the record, counts it
(``gpupool_collector_spool_dropped_total{reason="full"}``) and raises :class:`RecordDroppedError`;
further sends drop at once (no wait) until space frees up again.

Disk tier: :mod:`collectors.spool_disk` (segment files of CRC-checked frames and a cursor;
a crash of the process loses nothing written there, a crash of the machine at most the last
``fsync_interval_s``).

Delivery guarantee (precisely).

* *Order*: records are handed to the inner producer in the order :meth:`send` accepted them, one
  unit at a time, the next unit only after the previous one was acknowledged. With Kafka's
  per-partition order and aiokafka's idempotent producer (at most one in-flight batch per
  partition), records of one key arrive in :meth:`send` order.
* *No loss while the process runs*: a record leaves the queue only when the inner ``flush``
  acknowledged it, or when it is dropped and counted (``full``, ``too_large``, ``disk_error`` at
  :meth:`send`; ``rejected`` after ``max_attempts`` *permanent* errors; ``corrupt`` frames;
  ``shutdown``: memory records that :meth:`stop` could neither deliver nor write to disk).
  Transient errors (a timeout, a lost connection, an exception whose ``retriable`` is true,
  aiokafka's ``KafkaTimeoutError``) never count as an attempt: across an outage of any length
  every record waits.
* *No duplicate across an outage*: a record handed to the inner producer is never handed again
  while the inner producer keeps it: a flush that does not finish within ``flush_poll_s`` is
  simply awaited again. aiokafka's idempotent producer retries an in-flight batch with its
  original producer id and sequence numbers until the broker acknowledges it (it never expires a
  batch in flight) and the broker drops a batch it already has, so an outage of any length
  delivers each record exactly once. A batch aiokafka fails without sending (one that waited
  for a partition leader past its timeout while Kafka restarts) ends in an inner ``flush``
  error like any other, and the inner producer (:class:`runtime.kafka.KafkaBusProducer`) goes
  on with a new producer id, so the partition's next batches are not refused.
* *Unknown outcome*: if the inner ``flush`` raises, the records of that unit are delivered or not
  one by one (aiokafka fails whole per-partition batches that the broker did not append, and a
  unit spans partitions). They stay at the head of the queue and are sent again, carrying the
  header ``gpupool-redelivery: 1`` (``gpupool_collector_spool_redelivered_total``), one record
  per unit until a flush succeeds again (so a poison record is isolated). The same holds after a
  restart for records that were in flight when the process stopped without an acknowledgement
  (crash, or :meth:`stop` while the bus was down): a consumer that needs exactly-once in those
  cases drops a flagged record it already holds. Records in the memory tier are lost when the
  process is killed (:meth:`stop` moves them to disk); ``memory_records=0`` sends every record
  through the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from aiokafka.errors import KafkaTimeoutError

from collectors.metrics import CollectorMetrics
from collectors.spool_disk import DiskSpool, DiskUnit, SpoolRecord, encode_frame, make_record, sync_paths
from contracts.bus import Producer
from runtime.backoff import Backoff

log = logging.getLogger(__name__)

REDELIVERY_HEADER = "gpupool-redelivery"
"""Header on a record sent again after an attempt of unknown outcome (value ``b"1"``)."""
GIB = 1 << 30


class RecordDroppedError(Exception):
    """:meth:`SpoolingProducer.send` dropped the record (and counted it).

    Attributes:
        reason: ``full`` (memory and disk full for ``max_wait_s``), ``too_large`` (over
            ``max_record_bytes``) or ``disk_error`` (the disk write failed).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"record dropped: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


def _is_transient(exc: BaseException) -> bool:
    """An error that says *not now* rather than *never*: it does not count as an attempt."""
    return isinstance(exc, TimeoutError | ConnectionError | OSError | KafkaTimeoutError) or bool(
        getattr(exc, "retriable", False)
    )


@dataclass(slots=True)
class _Unit:
    """The records being handed to the inner producer."""

    tier: str  # "memory" | "disk"
    records: list[SpoolRecord]
    disk: DiskUnit | None
    handed: int = 0


class SpoolingProducer:
    """A :class:`contracts.bus.Producer` that never loses a record while the bus is unreachable
    (see the module docstring for the tiers and the exact guarantee, :mod:`collectors.spool_disk`
    for the disk format).

    Args:
        inner: the producer that talks to the bus (started by :meth:`start`, stopped by
            :meth:`stop`).
        memory_records: records the memory tier holds (>= 0; 0 sends every record through disk).
        disk_dir: folder of the disk tier; ``None``: memory only.
        disk_bytes: bytes the segment files may take (>= 1 MiB).
        segment_bytes: size at which a segment is rolled (default ``disk_bytes/16``, at most 64 MiB).
        max_wait_s: how long :meth:`send` waits for space when both tiers are full.
        max_record_bytes: a larger record is refused at :meth:`send` (``too_large``).
        batch_records / batch_bytes: largest unit handed to the inner producer before a flush.
        send_timeout_s: deadline for handing one unit (the inner ``send`` may wait for buffer
            space); what was not handed by then stays queued.
        flush_poll_s: how long one inner ``flush`` is awaited before it is awaited again.
        backoff_s: ``(first, max)`` seconds between attempts after an error (doubling, jittered:
            :class:`runtime.backoff.Backoff`).
        max_attempts: permanent errors of one record before it is dropped (``rejected``).
        fsync_interval_s: seconds between fsyncs of the disk tier.
        drain_timeout_s: how long :meth:`stop` keeps delivering before it writes the rest to disk.
        stop_timeout_s: how long :meth:`stop` waits for the inner producer's own ``stop``.
        metrics: where it counts (``gpupool_collector_spool_*``; the collector service's);
            ``None``: new ones on a registry of their own (:attr:`metrics`). The tier gauges read
            this spool from :meth:`start` to :meth:`stop`.

    Raises:
        ValueError: a size or duration out of range.
    """

    def __init__(
        self,
        inner: Producer,
        *,
        memory_records: int = 100_000,
        disk_dir: Path | None = None,
        disk_bytes: int = GIB,
        segment_bytes: int | None = None,
        max_wait_s: float = 5.0,
        max_record_bytes: int = 1 << 20,
        batch_records: int = 2000,
        batch_bytes: int = 1 << 20,
        send_timeout_s: float = 5.0,
        flush_poll_s: float = 1.0,
        backoff_s: tuple[float, float] = (0.1, 5.0),
        max_attempts: int = 5,
        fsync_interval_s: float = 1.0,
        drain_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
        metrics: CollectorMetrics | None = None,
    ) -> None:
        if memory_records < 0 or (memory_records == 0 and disk_dir is None):
            raise ValueError("memory_records must be >= 0, and > 0 without a disk_dir")
        if disk_bytes < (1 << 20):
            raise ValueError(f"disk_bytes must be >= 1 MiB, got {disk_bytes}")
        if batch_records < 1 or batch_bytes < 1 or max_record_bytes < 1 or max_attempts < 1:
            raise ValueError("batch_records, batch_bytes, max_record_bytes and max_attempts must be >= 1")
        if min(max_wait_s, send_timeout_s, flush_poll_s, fsync_interval_s, *backoff_s) <= 0:
            raise ValueError("durations must be > 0")
        if drain_timeout_s < 0 or stop_timeout_s < 0:
            raise ValueError("drain_timeout_s and stop_timeout_s must be >= 0")
        self.inner = inner
        self.memory_records = memory_records
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.disk_bytes = disk_bytes
        self.segment_bytes = segment_bytes or min(64 << 20, max(disk_bytes // 16, 1 << 20))
        self.max_wait_s = max_wait_s
        self.max_record_bytes = max_record_bytes
        self.batch_records = batch_records
        self.batch_bytes = batch_bytes
        self.send_timeout_s = send_timeout_s
        self.flush_poll_s = flush_poll_s
        self.backoff_s = backoff_s
        self.max_attempts = max_attempts
        self.fsync_interval_s = fsync_interval_s
        self.drain_timeout_s = drain_timeout_s
        self.stop_timeout_s = stop_timeout_s

        self._mem: deque[SpoolRecord] = deque()
        self._mem_bytes = 0
        self._disk = (
            DiskSpool(self.disk_dir, disk_bytes, self.segment_bytes) if self.disk_dir is not None else None
        )
        self._suspect_mem = 0  # head records of the memory tier that may be on the bus already
        self._unit: _Unit | None = None
        self._probe = False  # one record per unit until a flush succeeds again
        self._head_failures = 0  # permanent errors of the head record
        self._backoff = Backoff(*backoff_s)
        self._inner_up = False
        self._shedding = False
        self._closing = False
        self._running = False
        self._stopped = False
        self._drainer: asyncio.Task[None] | None = None
        self._syncer: asyncio.Task[None] | None = None
        self._data = asyncio.Event()
        self._progress = asyncio.Event()
        self._space = asyncio.Event()
        self.metrics = metrics if metrics is not None else CollectorMetrics()
        self._spooled = {tier: self.metrics.spool_spooled.labels(tier) for tier in ("memory", "disk")}
        self.accepted = 0
        """Records accepted by :meth:`send` (plus those found on disk at :meth:`start`)."""
        self.delivered = 0
        """Records acknowledged by the bus."""
        self.dropped = 0
        """Records dropped after being accepted (``rejected``, ``corrupt``, ``shutdown``)."""

    # --- public API -----------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Records waiting (both tiers, including a unit being handed)."""
        return len(self._mem) + (self._disk.records if self._disk is not None else 0)

    @property
    def queued_by_tier(self) -> dict[str, int]:
        """Records waiting per tier: ``{"memory": n, "disk": m}``."""
        return {"memory": len(self._mem), "disk": self._disk.records if self._disk is not None else 0}

    async def start(self) -> None:
        """Resume the disk tier, try to start the inner producer and start the drainer.

        An unreachable bus is not an error: records wait and the drainer keeps trying to start
        the inner producer. Raises ``OSError`` if ``disk_dir`` cannot be created or read, and
        ``RuntimeError`` if called twice (a stopped spool is not started again: make a new one).
        """
        if self._running or self._stopped:
            raise RuntimeError("SpoolingProducer already started")
        if self._disk is not None:
            corrupt = await asyncio.to_thread(self._disk.open)
            if corrupt:
                self.metrics.spool_dropped.labels("corrupt").inc(corrupt)
            self.accepted += self._disk.records
            if self._disk.records:
                log.info(
                    "spool_resumed",
                    extra={
                        "records": self._disk.records,
                        "bytes": self._disk.bytes,
                        "suspect": self._disk.suspect,
                    },
                )
        self._running = True
        self._closing = False
        self.metrics.spool_levels = self._levels
        await self._connect()
        self._drainer = asyncio.create_task(self._drain_loop(), name="spool-drainer")
        if self._disk is not None:
            self._syncer = asyncio.create_task(self._sync_loop(), name="spool-fsync")
        self._data.set()

    async def send(
        self,
        topic: str,
        value: bytes | None,
        key: str | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        """Queue one record (``value`` ``None`` is a tombstone). Returns once it is in the memory
        tier or written to the disk tier; never waits on the bus.

        Raises:
            RuntimeError: not started, or stopping.
            RecordDroppedError: the record was dropped and counted (``full`` after waiting
                ``max_wait_s``, ``too_large``, ``disk_error``).
        """
        if not self._running or self._closing:
            raise RuntimeError("SpoolingProducer is not running")
        try:
            rec = make_record(topic, value, key, headers)
        except ValueError as e:
            self._drop_new("too_large", str(e))
        if rec.size > self.max_record_bytes:
            self._drop_new("too_large", f"{rec.size} > {self.max_record_bytes} bytes")
        frame: bytes | None = None
        while True:
            use_disk = self._disk is not None and (
                self._disk.records > 0 or len(self._mem) >= self.memory_records
            )
            if not use_disk and len(self._mem) < self.memory_records:
                self._mem.append(rec)
                self._mem_bytes += rec.size
                self._spooled["memory"].inc()
                break
            if use_disk:
                assert self._disk is not None
                frame = frame or encode_frame(rec)
                if self._disk.has_room(len(frame)):
                    try:
                        self._disk.append(frame)
                    except OSError as e:
                        log.error("spool_disk_write_failed", extra={"error": repr(e)})
                        self._drop_new("disk_error", repr(e))
                    self._spooled["disk"].inc()
                    break
            await self._wait_for_space()
        self.accepted += 1
        self._shedding = False
        self._data.set()

    async def flush(self) -> None:
        """Wait until every record accepted so far has left the spool (acknowledged by the bus,
        or dropped and counted). Waits as long as the bus is unreachable.

        Raises ``RuntimeError`` if the producer stops meanwhile (or was never started).
        """
        target = self.accepted
        while self.delivered + self.dropped < target:
            if not self._running:
                raise RuntimeError("SpoolingProducer is not running")
            self._progress.clear()
            await self._progress.wait()

    async def stop(self) -> None:
        """Deliver what the bus takes within ``drain_timeout_s``, stop the inner producer (up to
        ``stop_timeout_s``), write the memory tier's remaining records to disk (memory only:
        drop and count them, ``shutdown``), fsync and close. Safe to call twice."""
        if not self._running:
            return
        self._closing = True
        self._data.set()
        drainer, self._drainer = self._drainer, None
        if drainer is not None:
            done, _ = await asyncio.wait({drainer}, timeout=self.drain_timeout_s)
            if not done:
                drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drainer
        unit, self._unit = self._unit, None
        clean = await self._stop_inner()
        if unit is not None and unit.handed:
            if clean:  # the inner stop delivered the unit
                self._consume(unit, unit.handed)
                self.delivered += unit.handed
                self.metrics.spool_drained.inc(unit.handed)
            else:
                self._mark_suspect(unit)
        self._persist_memory()
        syncer, self._syncer = self._syncer, None
        if syncer is not None:
            syncer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await syncer
        if self._disk is not None:
            await self._sync_now()
            self._disk.close()
        self._running = False
        self._stopped = True
        self._progress.set()
        self._space.set()
        remaining = self.queued
        if self.metrics.spool_levels == self._levels:
            self.metrics.spool_levels = None
        log.info(
            "spool_stopped", extra={"queued": remaining, "delivered": self.delivered, "dropped": self.dropped}
        )

    # --- send side helpers ----------------------------------------------------------------------
    def _drop_new(self, reason: str, detail: str = "") -> NoReturn:
        """Count a record refused at :meth:`send` and raise :class:`RecordDroppedError`."""
        self.metrics.spool_dropped.labels(reason).inc()
        raise RecordDroppedError(reason, detail)

    async def _wait_for_space(self) -> None:
        """Wait until a tier has room, up to ``max_wait_s``; raise :class:`RecordDroppedError`
        (``full``) after that, and at once while already shedding."""
        if not self._shedding:
            deadline = time.monotonic() + self.max_wait_s
            while (left := deadline - time.monotonic()) > 0 and self._running and not self._closing:
                self._space.clear()
                try:
                    await asyncio.wait_for(self._space.wait(), left)
                except TimeoutError:
                    break
                if self._has_room():
                    return
            if self._has_room():
                return
            if not self._running or self._closing:
                raise RuntimeError("SpoolingProducer is not running")
            self._shedding = True
            log.error("spool_full_dropping", extra={"queued": self.queued, "waited_s": self.max_wait_s})
        self._drop_new("full")

    def _has_room(self) -> bool:
        if self._disk is None:
            return len(self._mem) < self.memory_records
        if self._disk.records == 0 and len(self._mem) < self.memory_records:
            return True
        return self._disk.has_room(self.max_record_bytes + 64)

    # --- drainer --------------------------------------------------------------------------------
    async def _connect(self) -> bool:
        """Start the inner producer if it is not started; ``False`` if the bus is unreachable."""
        if self._inner_up:
            return True
        try:
            await self.inner.start()
        except Exception as e:  # noqa: BLE001 — an unreachable bus: records wait, we try again
            self.metrics.spool_delivery_errors.labels(type(e).__name__).inc()
            self.metrics.spool_bus_up.set(0)
            log.warning("spool_bus_unreachable", extra={"error": repr(e), "queued": self.queued})
            return False
        self._inner_up = True
        return True

    async def _drain_loop(self) -> None:
        while True:
            try:
                if not await self._connect():
                    await self._pause()
                    continue
                unit = self._next_unit()
                if unit is None:
                    if self._closing:
                        return
                    self._data.clear()
                    await self._data.wait()
                    continue
                await self._deliver(unit)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the drainer must outlive any one error (logged with its traceback)
                self.metrics.spool_delivery_errors.labels(f"internal:{type(e).__name__}").inc()
                log.exception("spool_drain_error")
                await self._pause()

    async def _pause(self) -> None:
        """Sleep the current backoff (doubling it), or less if stopping."""
        delay = self._backoff.next()
        await asyncio.sleep(min(delay, 0.05) if self._closing else delay)

    def _next_unit(self) -> _Unit | None:
        """The records at the head of the queue to hand next (not removed)."""
        limit = 1 if self._probe else self.batch_records
        if self._mem:
            recs: list[SpoolRecord] = []
            size = 0
            for rec in self._mem:
                if recs and (len(recs) >= limit or size + rec.size > self.batch_bytes):
                    break
                recs.append(rec)
                size += rec.size
            return _Unit("memory", recs, None)
        if self._disk is not None and self._disk.records:
            recs, disk_unit, corrupt = self._disk.read_unit(limit, self.batch_bytes)
            if corrupt:
                self.dropped += corrupt
                self.metrics.spool_dropped.labels("corrupt").inc(corrupt)
                self._after_removal()
            if recs:
                return _Unit("disk", recs, disk_unit)
            return self._next_unit() if corrupt and self._disk.records else None
        return None

    async def _deliver(self, unit: _Unit) -> None:
        """Hand ``unit`` to the inner producer, wait for the acknowledgement, then consume it."""
        suspect = self._suspect_mem if unit.tier == "memory" else (self._disk.suspect if self._disk else 0)
        if unit.tier == "disk":
            assert self._disk is not None and unit.disk is not None
            self._disk.mark_handed(unit.disk)
        self._unit = unit
        error: BaseException | None = None
        try:
            async with asyncio.timeout(self.send_timeout_s):
                for i, rec in enumerate(unit.records):
                    headers: Sequence[tuple[str, bytes]] = rec.headers
                    if i < suspect:
                        headers = (*rec.headers, (REDELIVERY_HEADER, b"1"))
                    await self.inner.send(rec.topic, rec.value, key=rec.key, headers=headers)
                    unit.handed += 1
                    if i < suspect:
                        self.metrics.spool_redelivered.inc()
        except TimeoutError as e:
            error = e
        except Exception as e:  # noqa: BLE001 — classified below; the record was not handed
            error = e
        if error is not None:
            self.metrics.spool_delivery_errors.labels(type(error).__name__).inc()
            log.warning("spool_send_failed", extra={"error": repr(error), "handed": unit.handed})
        if unit.handed == 0:
            self._unit = None
            assert error is not None
            self._head_failed(error)
            await self._pause()
            return
        flush_error = await self._await_ack()
        self._unit = None
        if flush_error is None:
            self._consume(unit, unit.handed)
            self.delivered += unit.handed
            self.metrics.spool_drained.inc(unit.handed)
            self.metrics.spool_bus_up.set(1)
            self._probe = False
            self._head_failures = 0
            self._backoff.reset()
            if error is not None and unit.handed < len(unit.records):
                await self._pause()  # the inner producer refused more: give it a moment
            return
        self.metrics.spool_delivery_errors.labels(type(flush_error).__name__).inc()
        log.warning("spool_flush_failed", extra={"error": repr(flush_error), "handed": unit.handed})
        self._mark_suspect(unit)
        self._probe = True
        self._head_failed(flush_error)
        await self._pause()

    async def _await_ack(self) -> BaseException | None:
        """Await the inner flush until it returns (``None``) or raises (the error). A flush that
        takes longer than ``flush_poll_s`` is awaited again: what was handed stays handed."""
        while True:
            try:
                await asyncio.wait_for(self.inner.flush(), self.flush_poll_s)
                return None
            except TimeoutError:
                self.metrics.spool_bus_up.set(0)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 — returned to the caller, which classifies it
                return e

    def _head_failed(self, error: BaseException) -> None:
        """Count a permanent error against the head record; drop it after ``max_attempts``."""
        if _is_transient(error):
            self.metrics.spool_bus_up.set(0)
            return
        self._head_failures += 1
        if self._head_failures < self.max_attempts:
            return
        self._head_failures = 0
        unit = self._next_unit_of_one()
        if unit is None:
            return
        log.error(
            "spool_record_rejected",
            extra={
                "topic": unit.records[0].topic,
                "key": unit.records[0].key,
                "error": repr(error),
                "attempts": self.max_attempts,
            },
        )
        self._consume(unit, 1)
        self.dropped += 1
        self.metrics.spool_dropped.labels("rejected").inc()

    def _next_unit_of_one(self) -> _Unit | None:
        probe, self._probe = self._probe, True
        try:
            return self._next_unit()
        finally:
            self._probe = probe

    def _mark_suspect(self, unit: _Unit) -> None:
        """The handed records of ``unit`` may or may not be on the bus."""
        if unit.tier == "memory":
            self._suspect_mem = max(self._suspect_mem, unit.handed)
        elif self._disk is not None:
            self._disk.suspect = max(self._disk.suspect, unit.handed)

    def _consume(self, unit: _Unit, n: int) -> None:
        """Remove the first ``n`` records of ``unit`` (the head of its tier) from the queue."""
        if unit.tier == "memory":
            for _ in range(n):
                self._mem_bytes -= self._mem.popleft().size
            self._suspect_mem = max(0, self._suspect_mem - n)
        else:
            assert self._disk is not None and unit.disk is not None
            self._disk.consume(n, unit.disk.segment, unit.disk.ends[n - 1])
        self._after_removal()

    def _after_removal(self) -> None:
        self._progress.set()
        self._space.set()

    async def _stop_inner(self) -> bool:
        """Stop the inner producer within ``stop_timeout_s``; ``True`` if it stopped cleanly
        (everything handed was acknowledged)."""
        if not self._inner_up:
            return True
        self._inner_up = False
        task = asyncio.create_task(self.inner.stop())
        done, _ = await asyncio.wait({task}, timeout=self.stop_timeout_s)
        if not done:
            log.warning("spool_inner_stop_timeout", extra={"timeout_s": self.stop_timeout_s})
            for _ in range(3):  # aiokafka's stop awaits its buffer again when cancelled once
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    break
            return False
        if task.cancelled():
            return False
        exc = task.exception()
        if exc is not None:
            self.metrics.spool_delivery_errors.labels(type(exc).__name__).inc()
            log.warning("spool_inner_stop_failed", extra={"error": repr(exc)})
            return False
        return True

    def _persist_memory(self) -> None:
        """At stop: write the memory tier before the disk records, or drop and count it."""
        if not self._mem:
            return
        n = len(self._mem)
        if self._disk is None:
            self.dropped += n
            self.metrics.spool_dropped.labels("shutdown").inc(n)
            log.error("spool_dropped_at_shutdown", extra={"records": n, "reason": "no disk tier"})
        else:
            frames = [encode_frame(r) for r in self._mem]
            room = self.disk_bytes - self._disk.bytes
            keep = 0
            size = 0
            while keep < len(frames) and size + len(frames[keep]) <= room:
                size += len(frames[keep])
                keep += 1
            try:
                self._disk.prepend(frames[:keep], min(self._suspect_mem, keep))
            except OSError as e:
                log.error("spool_disk_write_failed", extra={"error": repr(e)})
                keep = 0
            if keep < n:
                self.dropped += n - keep
                self.metrics.spool_dropped.labels("shutdown").inc(n - keep)
                log.error("spool_dropped_at_shutdown", extra={"records": n - keep, "reason": "disk full"})
            log.info("spool_memory_persisted", extra={"records": keep})
        self._mem.clear()
        self._mem_bytes = 0
        self._suspect_mem = 0

    # --- durability and gauges ------------------------------------------------------------------
    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.fsync_interval_s)
            try:
                await self._sync_now()
            except OSError as e:
                self.metrics.spool_delivery_errors.labels(f"fsync:{type(e).__name__}").inc()
                log.error("spool_fsync_failed", extra={"error": repr(e)})

    async def _sync_now(self) -> None:
        assert self._disk is not None
        paths, dir_dirty = self._disk.take_dirty()
        if paths or dir_dirty:
            await asyncio.to_thread(sync_paths, paths, self._disk.dir if dir_dirty else None)

    def _levels(self) -> dict[str, tuple[int, int]]:
        """``{tier: (records, bytes)}`` now: record sizes in memory, segment file sizes on disk
        (read by the scrape thread: only counters are read, nothing iterated)."""
        disk = self._disk
        return {
            "memory": (len(self._mem), self._mem_bytes),
            "disk": (disk.records, disk.bytes) if disk is not None else (0, 0),
        }
