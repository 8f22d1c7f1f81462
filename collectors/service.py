"""The collector stage: scrape dcgm-exporter targets and read IB sysfs roots, produce to the bus.

Each cycle scrapes every target concurrently (bounded, a deadline per target), parses each body
as it arrives (:func:`collectors.dcgm.parse_dcgm_exporter`), reads every sysfs root in a worker
thread (:func:`collectors.sysfs_ib.read_sysfs_infiniband`) and produces

* :class:`contracts.GpuSample` to ``topics.telemetry_gpu`` keyed ``host/uuid[/gpu_instance]``,
* :class:`contracts.IbPortSample` to ``topics.telemetry_ib_port`` keyed ``node_guid/port``,

JSON-encoded with :func:`contracts.encode`, each with the next value of one per-producer
sequence number. A failed target, a bad line, an unreadable file or a refused record is counted
(:mod:`collectors.metrics`) and never stops the cycle; :meth:`CollectorService.run` survives any
exception of a cycle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from collectors import metrics
from collectors.dcgm import DcgmParseResult, parse_dcgm_exporter
from collectors.scrape import DEFAULT_MAX_BODY_BYTES, Scraper, ScrapeResult
from collectors.sysfs_ib import SysfsReadResult, read_sysfs_infiniband
from collectors.xid import XidTracker
from contracts import GpuSample, IbPortSample, KafkaTopics, encode
from contracts.bus import Bus, Producer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CollectStats:
    """What one :meth:`CollectorService.collect_once` did.

    Attributes:
        targets: dcgm-exporter targets scraped.
        targets_ok: targets whose body arrived and was usable.
        failures: failed targets by reason: the :class:`collectors.scrape.ScrapeResult` reasons
            (``timeout``, ``connect_error``, ``http_500``, ``truncated``...), ``truncated`` for a
            body without its final line feed, ``empty_body``, and ``garbage`` for a body of which
            no line gave a sample.
        gpu_samples / ib_ports: records built.
        rejected: parser rejections by reason (lines and values).
        sysfs_roots: roots read; sysfs_errors: files that could not be used.
        produced: records the producer accepted; produce_errors: records it refused.
        xid_events: new XID errors seen.
        duration_s: wall time of the cycle.
    """

    targets: int = 0
    targets_ok: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    gpu_samples: int = 0
    ib_ports: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    sysfs_roots: int = 0
    sysfs_errors: int = 0
    produced: int = 0
    produce_errors: int = 0
    xid_events: int = 0
    duration_s: float = 0.0

    @property
    def targets_failed(self) -> int:
        """Number of failed targets."""
        return sum(self.failures.values())


def _default_host(target: str) -> str | None:
    """The host part of a target URL, for series without a host label."""
    try:
        return httpx.URL(target).host or None
    except (httpx.InvalidURL, TypeError):
        return None


class CollectorService:
    """Collects GPU and InfiniBand telemetry on an interval and produces it to the bus.

    Args:
        bus: where records go (:func:`contracts.bus.make_bus`).
        topics: topic names.
        dcgm_targets: dcgm-exporter ``/metrics`` URLs.
        sysfs_roots: ``(host, sys_root)`` pairs; ``sys_root`` holds ``class/infiniband``.
        interval_s: seconds from the start of one cycle to the start of the next.
        timeout_s: deadline of one scrape, seconds.
        concurrency: scrapes in flight at most.
        client_id: the producer's client id.
        max_body_bytes: largest accepted ``/metrics`` body.
        http_client: an httpx client to scrape with (tests inject transports); not closed here.

    Raises:
        ValueError: ``interval_s``, ``timeout_s`` or ``concurrency`` not positive.
    """

    def __init__(
        self,
        *,
        bus: Bus,
        topics: KafkaTopics,
        dcgm_targets: Sequence[str],
        sysfs_roots: Sequence[tuple[str, Path]],
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        concurrency: int = 64,
        client_id: str = "gpupool-collector",
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0 or concurrency < 1:
            raise ValueError("interval_s and timeout_s must be > 0 and concurrency >= 1")
        self.bus = bus
        self.topics = topics
        self.dcgm_targets = list(dcgm_targets)
        self.sysfs_roots = [(h, Path(p)) for h, p in sysfs_roots]
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.client_id = client_id
        self.max_body_bytes = max_body_bytes
        self._http_client = http_client
        self._producer: Producer | None = None
        self._scraper: Scraper | None = None
        self._seq = 0
        self._xid = XidTracker()
        self._failing: dict[str, str] = {}
        self.last_stats: CollectStats | None = None
        self.cycles = 0

    @property
    def seq(self) -> int:
        """The ``seq`` the next record will get (= records numbered so far)."""
        return self._seq

    async def start(self) -> None:
        """Start the bus producer and the HTTP client. Raises what the producer's ``start``
        raises when the bus is unreachable."""
        if self._producer is not None:
            return
        producer = self.bus.producer(client_id=self.client_id)
        await producer.start()
        self._producer = producer
        self._scraper = Scraper(
            timeout_s=self.timeout_s,
            concurrency=self.concurrency,
            max_body_bytes=self.max_body_bytes,
            client=self._http_client,
        )

    async def stop(self) -> None:
        """Flush and stop the producer, close the HTTP client. Safe to call twice."""
        producer, self._producer = self._producer, None
        scraper, self._scraper = self._scraper, None
        if scraper is not None:
            await scraper.aclose()
        if producer is not None:
            try:
                await producer.flush()
            finally:
                await producer.stop()

    async def collect_once(self) -> CollectStats:
        """Run one cycle over every target and root; return what it did.

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        if self._producer is None or self._scraper is None:
            raise RuntimeError("CollectorService.start() must be awaited before collect_once()")
        t0 = time.monotonic()
        stats = CollectStats(targets=len(self.dcgm_targets), sysfs_roots=len(self.sysfs_roots))
        reads = [asyncio.create_task(self._read_root(host, root)) for host, root in self.sysfs_roots]
        try:
            async for res in self._scraper.scrape_many(self.dcgm_targets):
                await self._handle_scrape(res, stats)
            for read in asyncio.as_completed(reads):
                await self._handle_sysfs(await read, stats)
        finally:
            for r in reads:
                r.cancel()
        try:
            await self._producer.flush()
        except Exception as e:  # noqa: BLE001 — counted; the next cycle tries again
            metrics.PRODUCE_ERRORS.labels("*", type(e).__name__).inc()
            log.warning("producer_flush_failed", extra={"error": repr(e)})
        stats.duration_s = time.monotonic() - t0
        metrics.CYCLE_DURATION.observe(stats.duration_s)
        self.last_stats = stats
        self.cycles += 1
        log.debug(
            "collect_cycle",
            extra={
                "targets": stats.targets,
                "targets_failed": stats.targets_failed,
                "gpu_samples": stats.gpu_samples,
                "ib_ports": stats.ib_ports,
                "produced": stats.produced,
                "duration_s": round(stats.duration_s, 4),
            },
        )
        return stats

    async def run(self, stop: asyncio.Event) -> None:
        """Call :meth:`collect_once` every ``interval_s`` until ``stop`` is set. An exception of a
        cycle is logged and counted (``gpupool_collector_loop_errors_total``), never raised."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                await self.collect_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the loop must outlive any one cycle (logged with its traceback)
                metrics.LOOP_ERRORS.labels(type(e).__name__).inc()
                log.exception("collect_cycle_failed")
            elapsed = time.monotonic() - started
            if elapsed > self.interval_s:
                log.warning(
                    "collect_cycle_overrun",
                    extra={"elapsed_s": round(elapsed, 3), "interval_s": self.interval_s},
                )
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, self.interval_s - elapsed))
            except TimeoutError:
                pass

    # --- dcgm-exporter -------------------------------------------------------------------------
    async def _handle_scrape(self, res: ScrapeResult, stats: CollectStats) -> None:
        parsed: DcgmParseResult | None = None
        t0 = time.monotonic()
        reason = res.reason
        if res.ok:
            body = res.body or ""
            if not body.strip():
                reason = "empty_body"
            else:
                parsed = parse_dcgm_exporter(
                    body,
                    ts=res.ts,
                    target=res.target,
                    default_host=_default_host(res.target),
                    seq_start=self._seq,
                )
                for rej in parsed.rejected:
                    metrics.REJECTED_SAMPLES.labels(rej.reason).inc()
                stats.rejected.update(r.reason for r in parsed.rejected)
                if not parsed.samples and parsed.sample_lines and parsed.rejected:
                    reason = "garbage"  # not one line gave a sample: not a dcgm-exporter page
                elif not body.endswith("\n"):
                    # Every exposition line ends with a line feed: the body was cut off on the way
                    # (a proxy, a crashed exporter). An incomplete page is no snapshot: none of it
                    # is used.
                    reason = "truncated"
                if reason == "ok":
                    self._seq += len(parsed.samples)
        metrics.SCRAPE_DURATION.labels("dcgm").observe(res.duration_s + time.monotonic() - t0)
        self._note_target(res, reason)
        if reason != "ok":
            stats.failures[reason] += 1
            metrics.SCRAPES.labels(res.target, "failure").inc()
            metrics.SCRAPE_ERRORS.labels(res.target, reason).inc()
            return
        stats.targets_ok += 1
        metrics.SCRAPES.labels(res.target, "success").inc()
        if parsed is None:
            return
        stats.gpu_samples += len(parsed.samples)
        for event in self._xid.observe(parsed.xid):
            stats.xid_events += 1
            metrics.XID_EVENTS.labels(str(event.xid)).inc()
            log.warning(
                "xid_event",
                extra={
                    "gpu": event.key,
                    "xid": event.xid,
                    "previous": event.previous,
                    "count": event.count,
                    "xid_message": event.message,
                    "xid_source": event.source,
                },
            )
        await self._produce(self.topics.telemetry_gpu, parsed.samples, stats)

    def _note_target(self, res: ScrapeResult, reason: str) -> None:
        """Log a target's failures when they start or change reason, and its recovery."""
        before = self._failing.get(res.target)
        if reason == "ok":
            if before is not None:
                del self._failing[res.target]
                log.info("scrape_recovered", extra={"target": res.target, "was": before})
            return
        if before != reason:
            self._failing[res.target] = reason
            log.warning(
                "scrape_failed",
                extra={
                    "target": res.target,
                    "reason": reason,
                    "status": res.status,
                    "detail": res.detail[:200],
                },
            )

    # --- sysfs ----------------------------------------------------------------------------------
    async def _read_root(self, host: str, root: Path) -> tuple[SysfsReadResult, float]:
        t0 = time.monotonic()
        res = await asyncio.to_thread(read_sysfs_infiniband, root, host, time.time())
        return res, time.monotonic() - t0

    async def _handle_sysfs(self, read: tuple[SysfsReadResult, float], stats: CollectStats) -> None:
        res, duration = read
        metrics.SCRAPE_DURATION.labels("sysfs").observe(duration)
        for err in res.errors:
            metrics.SYSFS_ERRORS.labels(err.reason).inc()
            log.debug("sysfs_file_error", extra={"path": err.path, "reason": err.reason})
        stats.sysfs_errors += len(res.errors)
        ports = [p.model_copy(update={"seq": self._seq + i}) for i, p in enumerate(res.ports)]
        self._seq += len(ports)
        stats.ib_ports += len(ports)
        await self._produce(self.topics.telemetry_ib_port, ports, stats)

    # --- bus --------------------------------------------------------------------------------------
    async def _produce(
        self, topic: str, records: Sequence[GpuSample | IbPortSample], stats: CollectStats
    ) -> None:
        assert self._producer is not None
        produced = 0
        for rec in records:
            try:
                await self._producer.send(topic, encode(rec), key=rec.key)
                produced += 1
            except Exception as e:  # noqa: BLE001 — one refused record must not stop the cycle
                stats.produce_errors += 1
                metrics.PRODUCE_ERRORS.labels(topic, type(e).__name__).inc()
                log.warning("produce_failed", extra={"topic": topic, "key": rec.key, "error": repr(e)})
        if produced:
            stats.produced += produced
            metrics.RECORDS_PRODUCED.labels(topic).inc(produced)
