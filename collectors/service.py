"""The collector stage: scrape dcgm-exporter targets and read IB sysfs roots, produce to the bus.

Each cycle scrapes every target concurrently (bounded, a deadline per target), parses each body
as it arrives (:func:`collectors.dcgm.parse_dcgm_exporter`), reads every sysfs root in a worker
thread (:func:`collectors.sysfs_ib.read_sysfs_infiniband`), runs each optional ``nvidia-smi -q -x``
command (:func:`collectors.nvsmi.read_nvidia_smi`) and the optional local NVML reader
(:class:`collectors.nvml.NvmlReader`, in a worker thread) and produces

* :class:`contracts.GpuScrape` to ``topics.telemetry_gpu`` (one record per read of a host's GPUs:
  the :class:`contracts.GpuSample` of every GPU, grouped by :func:`contracts.gpu_scrapes`) and
* :class:`contracts.NvSwitchSample` (dcgm-exporter's NVSwitch series) to ``topics.telemetry_nvswitch``,
* :class:`contracts.IbPortSample` to ``topics.telemetry_ib_port`` (sysfs roots, and UFM Telemetry
  endpoints: :func:`collectors.ufm_telemetry.parse_ufm_telemetry`), all with the host as Kafka key
  (``partition_key``, :func:`contracts.topics.telemetry_partition_key`: a host's GPUs and ports
  share a partition number, so one analytics instance sees the whole node),

JSON-encoded with :func:`contracts.encode`, each sample (GPU of a scrape record) or record with
the next value of one per-producer sequence number. A failed target, a bad line, an unreadable file or a refused record is counted
(:class:`collectors.metrics.CollectorMetrics`, served from :attr:`CollectorService.registry`) and never stops the cycle; :meth:`CollectorService.run` survives any
exception of a cycle.

Targets come from a static list and Prometheus file_sd files (:mod:`collectors.targets`: hot
reload, per-target interval and deadline, target labels as ``target_<name>`` attributes). With a
``spool_dir`` records go through :class:`collectors.spool.SpoolingProducer`, which keeps them
(memory, then disk) while Kafka is unreachable and delivers them in order once it is back.

Tracing (:mod:`runtime.tracing`, when on): each dcgm-exporter scrape is a ``scrape
dcgm-exporter`` span, and each batch sent a ``send <topic>`` span (PRODUCER) whose ``traceparent``
every record of the batch carries as a Kafka header — the start of the trace that ends at a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import aiohttp
import httpx
from prometheus_client import CollectorRegistry

from collectors.metrics import CollectorMetrics
from collectors.dcgm import DcgmParseResult, parse_dcgm_exporter
from collectors.nvml import NvmlReader, NvmlUnavailableError
from collectors.nvsmi import DEFAULT_COMMAND, read_nvidia_smi
from collectors.scrape import DEFAULT_MAX_BODY_BYTES, Scraper, ScrapeResult
from collectors.spool import GIB, RecordDroppedError, SpoolingProducer
from collectors.sysfs_ib import SysfsReadResult, read_sysfs_infiniband
from collectors.targets import Target, TargetSet
from collectors.ufm_telemetry import parse_ufm_telemetry
from collectors.xid import XidTracker
from contracts import (
    GpuSample,
    GpuScrape,
    IbPortSample,
    KafkaTopics,
    NvSwitchSample,
    encode,
    gpu_scrapes,
)
from contracts.bus import Bus, MissingTopicsError, Producer, require_topics
from runtime import tracing

if TYPE_CHECKING:  # imported by the caller only when the fabric is collected
    from collectors.fabric_collector import FabricCollector

log = logging.getLogger(__name__)
_TRACER = tracing.tracer(__name__)


@dataclass(slots=True)
class CollectStats:
    """What one :meth:`CollectorService.collect_once` did.

    Attributes:
        targets: dcgm-exporter targets scraped, plus UFM Telemetry endpoints, nvidia-smi commands
            run and the NVML reader.
        targets_ok: targets whose body (command output, NVML read) arrived and was usable.
        failures: failed targets by reason: the :class:`collectors.scrape.ScrapeResult` reasons
            (``timeout``, ``connect_error``, ``http_500``, ``truncated``...), ``truncated`` for a
            body without its final line feed, ``empty_body``, and ``garbage`` for a body of which
            no line gave a sample; for nvidia-smi the :class:`collectors.nvsmi.NvsmiReadResult`
            reasons (``binary_not_found``, ``timeout``, ``exit_status``, ``malformed_xml``...);
            for NVML the :class:`collectors.nvml.NvmlUnavailableError` reasons
            (``library_not_found``, ``driver_not_loaded``...).
        gpu_samples / nvswitches / ib_ports: records built.
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
    nvswitches: int = 0
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


class _GpuRead(NamedTuple):
    """One nvidia-smi or NVML read: its target label, ``ok`` or why not, samples, rejections."""

    target: str
    reason: str
    samples: list[GpuSample]
    rejected: Counter[str]


def _default_host(target: str) -> str | None:
    """The host part of a target URL, for series without a host label."""
    try:
        return httpx.URL(target).host or None
    except (httpx.InvalidURL, TypeError):
        return None


class CollectorService:
    """Collects GPU and InfiniBand telemetry on an interval and produces it to the bus.

    Args:
        bus: where records go (:func:`runtime.bus.make_bus`).
        topics: topic names.
        dcgm_targets: dcgm-exporter ``/metrics`` URLs.
        sysfs_roots: ``(host, sys_root)`` pairs; ``sys_root`` holds ``class/infiniband``.
        interval_s: seconds from the start of one cycle to the start of the next.
        sysfs_interval_s: seconds between the starts of two reads of the sysfs roots; ``None``
            (or ``interval_s``): every cycle reads them. Any other interval: :meth:`run` reads
            them on their own schedule (:meth:`read_sysfs_once`), so a slow read never delays a
            GPU scrape, and :meth:`collect_once` leaves them out.
        timeout_s: deadline of one scrape, seconds.
        concurrency: scrapes in flight at most.
        client_id: the producer's client id.
        max_body_bytes: largest accepted ``/metrics`` body.
        http_session: an aiohttp session every scraper shares instead of opening its own (its
            connection pool then bounds the connections); not closed here.
        nvsmi_commands: ``(host, argv)`` pairs, each run every cycle as ``nvidia-smi -q -x``
            (argv may wrap it, e.g. ``["ssh", "node-1", "nvidia-smi", "-q", "-x"]``), or as a CSV
            query when argv has ``--query-gpu=...`` (``--format=csv[,noheader][,nounits]``,
            :mod:`collectors.nvsmi_csv`); its GPUs get ``host``; deadline ``timeout_s``. A missing
            binary is counted as a failure, never raised.
        ufm_targets: UFM Telemetry Prometheus endpoint URLs (e.g. ``http://ufm:9001/metrics``),
            scraped every cycle; their port counters go to ``telemetry.ib_port``.
        nvml_host: read this machine's GPUs through NVML every cycle under this host name;
            ``None``: off. Where NVML is unavailable each cycle counts a failure.
        file_sd: Prometheus file_sd JSON files (the last path component may be a glob) whose
            targets are scraped besides ``dcgm_targets``, re-read when they change
            (:mod:`collectors.targets`). A target with its own ``__scrape_interval__`` is scraped
            by :meth:`run` on its own schedule; each target has its own deadline
            (``__scrape_timeout__``); its labels go into ``GpuSample.attributes`` as
            ``target_<name>``.
        file_sd_refresh_s: seconds between two checks of the file_sd files for changes.
        spool_dir: when given, records go through a :class:`collectors.spool.SpoolingProducer`
            (memory, then segment files in this folder): nothing is lost while the bus is
            unreachable, and a restart resumes what is on disk. ``None``: straight to the bus.
        spool_memory_records / spool_disk_bytes: the spool's memory and disk bounds.
        fabric: a switch-side :class:`collectors.fabric_collector.FabricCollector` (its own
            producer: topology to ``fabric.topology``, port counters to ``telemetry.ib_port``)
            started and stopped with the service and run by :meth:`run` beside the cycles;
            ``None``: no fabric collection.
        fabric_interval_s: seconds between the starts of two fabric sweeps.
        fabric_discover_every: the fabric is re-discovered every Nth sweep.
        forget_after_s: a dcgm-exporter target gone from the configuration (static list and
            file_sd) this long, seconds, is forgotten: its ``target`` series are removed
            (:meth:`forget_removed_targets`). Back before that, its counters go on.
        metrics: this service's Prometheus metrics (one :class:`CollectorMetrics` per service;
            a fabric collector or Slurm source of the same process counts on the same registry:
            ``FabricCollectorMetrics(service.registry)``); ``None``: new ones on a registry of
            their own. Its ``/metrics`` serves :attr:`registry`.

    Raises:
        ValueError: ``interval_s``, ``sysfs_interval_s``, ``timeout_s``, ``concurrency``,
            ``forget_after_s``, ``fabric_interval_s`` or ``fabric_discover_every`` not positive.
    """

    def __init__(
        self,
        *,
        bus: Bus,
        topics: KafkaTopics,
        dcgm_targets: Sequence[str],
        sysfs_roots: Sequence[tuple[str, Path]],
        interval_s: float = 5.0,
        sysfs_interval_s: float | None = None,
        timeout_s: float = 2.0,
        concurrency: int = 64,
        client_id: str = "gpupool-collector",
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        http_session: aiohttp.ClientSession | None = None,
        nvsmi_commands: Sequence[tuple[str, Sequence[str]]] = (),
        ufm_targets: Sequence[str] = (),
        nvml_host: str | None = None,
        file_sd: Sequence[Path | str] = (),
        file_sd_refresh_s: float = 5.0,
        spool_dir: Path | None = None,
        spool_memory_records: int = 100_000,
        spool_disk_bytes: int = GIB,
        fabric: FabricCollector | None = None,
        fabric_interval_s: float = 30.0,
        fabric_discover_every: int = 10,
        forget_after_s: float = 300.0,
        metrics: CollectorMetrics | None = None,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0 or concurrency < 1 or forget_after_s <= 0:
            raise ValueError("interval_s, timeout_s and forget_after_s must be > 0 and concurrency >= 1")
        if fabric_interval_s <= 0 or fabric_discover_every < 1:
            raise ValueError("fabric_interval_s must be > 0 and fabric_discover_every >= 1")
        if sysfs_interval_s is not None and sysfs_interval_s <= 0:
            raise ValueError("sysfs_interval_s must be > 0 (or None: every cycle)")
        self.metrics = metrics if metrics is not None else CollectorMetrics()
        """This service's Prometheus metrics."""
        self.fabric = fabric
        self.fabric_interval_s = fabric_interval_s
        self.fabric_discover_every = fabric_discover_every
        self.bus = bus
        self.topics = topics
        self.dcgm_targets = list(dcgm_targets)
        self.sysfs_roots = [(h, Path(p)) for h, p in sysfs_roots]
        self.interval_s = interval_s
        self.sysfs_interval_s = interval_s if sysfs_interval_s is None else sysfs_interval_s
        """Seconds between two reads of the sysfs roots (``interval_s``: every cycle)."""
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.client_id = client_id
        self.max_body_bytes = max_body_bytes
        self._http_session = http_session
        self.nvsmi_commands = [(h, tuple(cmd) or DEFAULT_COMMAND) for h, cmd in nvsmi_commands]
        self.ufm_targets = list(ufm_targets)
        self.nvml_host = nvml_host
        self._nvml: NvmlReader | None = None
        self.targets = TargetSet(
            self.dcgm_targets,
            file_sd,
            default_interval_s=interval_s,
            default_timeout_s=timeout_s,
            refresh_s=file_sd_refresh_s,
            metrics=self.metrics,
        )
        self.spool_dir = Path(spool_dir) if spool_dir is not None else None
        self.spool_memory_records = spool_memory_records
        self.spool_disk_bytes = spool_disk_bytes
        self._scrapers: dict[float, Scraper] = {}
        self._scrape_slots = asyncio.Semaphore(concurrency)
        self._producer: Producer | None = None
        self._scraper: Scraper | None = None
        self._seq = 0
        self._xid = XidTracker()
        self._failing: dict[str, str] = {}
        self.forget_after_s = forget_after_s
        self._target_series: dict[str, set[str]] = {}
        """dcgm-exporter targets with series, and the failure reasons counted for each."""
        self._removed_at: dict[str, float] = {}
        """Targets with series that left the configuration, and when that was first seen."""
        self.last_stats: CollectStats | None = None
        self.cycles = 0

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry this service's ``/metrics`` serves (its metrics only, plus
        those of a fabric collector or Slurm source built on it)."""
        return self.metrics.registry

    @property
    def seq(self) -> int:
        """The ``seq`` the next record will get (= records numbered so far)."""
        return self._seq

    async def start(self) -> None:
        """Check that the topics it writes exist (telemetry; ``fabric.topology`` with a fabric
        collector), start the bus producer and the HTTP client.

        Raises :class:`contracts.bus.MissingTopicsError` if a telemetry topic is missing (no stage
        creates topics: ``gpupool topics create``), and what the producer's ``start`` raises when
        the bus is unreachable — except with a spool (``spool_dir``), where records wait for the
        bus instead (the topics are then not checked); then ``OSError`` if the spool folder is
        unusable."""
        if self._producer is not None:
            return
        try:
            needed = [self.topics.telemetry_gpu, self.topics.telemetry_ib_port, self.topics.telemetry_nvswitch]
            await require_topics(self.bus, needed + ([self.topics.fabric_topology] if self.fabric else []))
        except MissingTopicsError:
            raise
        except Exception as e:
            if self.spool_dir is None:
                raise
            log.warning("topics_unchecked", extra={"error": repr(e), "spool_dir": str(self.spool_dir)})
        producer: Producer = self.bus.producer(client_id=self.client_id)
        if self.spool_dir is not None:
            producer = SpoolingProducer(
                producer,
                memory_records=self.spool_memory_records,
                disk_dir=self.spool_dir,
                disk_bytes=self.spool_disk_bytes,
                metrics=self.metrics,
            )
        await producer.start()
        if self.fabric is not None:
            try:
                await self.fabric.start()
            except BaseException:
                await producer.stop()
                raise
        self._producer = producer
        self._scraper = self._scraper_for(self.timeout_s)

    async def stop(self) -> None:
        """Flush and stop the producer, close the HTTP client. Safe to call twice."""
        producer, self._producer = self._producer, None
        scraper, self._scraper = self._scraper, None
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            await asyncio.to_thread(nvml.close)
        if producer is not None and self.fabric is not None:
            try:
                await self.fabric.stop()
            except Exception as e:  # noqa: BLE001 — the main producer must still be flushed
                log.warning("fabric_stop_failed", extra={"error": repr(e)})
        scrapers, self._scrapers = list(self._scrapers.values()), {}
        for s in [*scrapers, *([scraper] if scraper is not None and scraper not in scrapers else [])]:
            await s.aclose()
        if producer is not None:
            try:
                await self._flush(producer)  # a spool delivers what it can in its own stop
            finally:
                await producer.stop()

    async def collect_once(self) -> CollectStats:
        """Run one cycle over every target whose interval is the service's ``interval_s``
        (targets with an interval of their own are scraped by :meth:`run`) and every sysfs root
        (unless they have an interval of their own: ``sysfs_interval_s``), and return what it did.

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        if self._producer is None or self._scraper is None:
            raise RuntimeError("CollectorService.start() must be awaited before collect_once()")
        t0 = time.monotonic()
        targets = [t for t in self.targets.targets if t.interval_s == self.interval_s]
        roots = self.sysfs_roots if self.sysfs_interval_s == self.interval_s else []
        stats = CollectStats(targets=len(targets), sysfs_roots=len(roots))
        reads = [asyncio.create_task(self._read_root(host, root)) for host, root in roots]
        gpu_reads = self._start_gpu_reads(stats)
        ufm_reads = [asyncio.create_task(self._scrape_ufm(url)) for url in self.ufm_targets]
        stats.targets += len(ufm_reads)
        try:
            async for res in self._scrape(targets):
                await self._handle_scrape(res, stats)
            for read in asyncio.as_completed(reads):
                await self._handle_sysfs(await read, stats)
            for gpu_read in asyncio.as_completed(gpu_reads):
                await self._handle_gpu_read(await gpu_read, stats)
            for ufm_read in asyncio.as_completed(ufm_reads):
                await self._handle_ufm(await ufm_read, stats)
        finally:
            for r in [*reads, *gpu_reads, *ufm_reads]:
                r.cancel()
        await self._flush_counted()
        stats.duration_s = time.monotonic() - t0
        self.metrics.cycle_duration.observe(stats.duration_s)
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

    async def read_sysfs_once(self) -> CollectStats:
        """Read every sysfs root and produce its ports (what :meth:`collect_once` does for them
        when they have no interval of their own); return what it did (``sysfs_roots``,
        ``ib_ports``, ``sysfs_errors``, ``produced``...).

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        if self._producer is None:
            raise RuntimeError("CollectorService.start() must be awaited before read_sysfs_once()")
        t0 = time.monotonic()
        stats = CollectStats(sysfs_roots=len(self.sysfs_roots))
        reads = [asyncio.create_task(self._read_root(host, root)) for host, root in self.sysfs_roots]
        try:
            for read in asyncio.as_completed(reads):
                await self._handle_sysfs(await read, stats)
        finally:
            for r in reads:
                r.cancel()
        await self._flush_counted()
        stats.duration_s = time.monotonic() - t0
        return stats

    async def _flush_counted(self) -> None:
        """Flush the producer; a failure is counted and logged (the next round tries again)."""
        assert self._producer is not None  # callers check start() first
        try:
            await self._flush(self._producer)
        except Exception as e:  # noqa: BLE001 — counted; the next cycle tries again
            self.metrics.produce_errors.labels("*", type(e).__name__).inc()
            log.warning("producer_flush_failed", extra={"error": repr(e)})

    async def run(self, stop: asyncio.Event) -> None:
        """Call :meth:`collect_once` every ``interval_s`` until ``stop`` is set; meanwhile re-read
        the file_sd files every ``file_sd_refresh_s`` and scrape the targets that have an
        interval of their own on their own schedule, read the sysfs roots every
        ``sysfs_interval_s`` when that is not ``interval_s``, and sweep the fabric every
        ``fabric_interval_s`` when a fabric collector is configured. An exception of a cycle is
        logged and counted (``gpupool_collector_loop_errors_total``; fabric rounds:
        ``gpupool_collector_fabric_errors_total``), never raised."""
        loops: dict[float, asyncio.Task[None]] = {}
        watcher = asyncio.create_task(self._watch_targets(stop, loops))
        fabric = (
            asyncio.create_task(
                self.fabric.run(self.fabric_interval_s, discover_every=self.fabric_discover_every, stop=stop)
            )
            if self.fabric is not None
            else None
        )
        sysfs = (
            asyncio.create_task(self._every(self.sysfs_interval_s, self.read_sysfs_once, "sysfs_read", stop))
            if self.sysfs_roots and self.sysfs_interval_s != self.interval_s
            else None
        )
        try:
            await self._every(self.interval_s, self.collect_once, "collect_cycle", stop)
        finally:
            tasks = [watcher, *loops.values(), *(t for t in (fabric, sysfs) if t is not None)]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _every(
        self, interval_s: float, once: Callable[[], Awaitable[CollectStats]], what: str, stop: asyncio.Event
    ) -> None:
        """The loops of :meth:`run`: ``once()`` every ``interval_s`` until ``stop`` is set; an
        exception is counted (``gpupool_collector_loop_errors_total``) and logged
        (``<what>_failed``), a round longer than the interval is logged (``<what>_overrun``)."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                await once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the loop must outlive any one cycle (logged with its traceback)
                self.metrics.loop_errors.labels(type(e).__name__).inc()
                log.exception(f"{what}_failed", extra={"interval_s": interval_s})
            elapsed = time.monotonic() - started
            if elapsed > interval_s:
                log.warning(
                    f"{what}_overrun",
                    extra={"elapsed_s": round(elapsed, 3), "interval_s": interval_s},
                )
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, interval_s - elapsed))
            except TimeoutError:
                pass

    # --- targets --------------------------------------------------------------------------------
    def _scraper_for(self, timeout_s: float) -> Scraper:
        """The scraper of the targets whose deadline is ``timeout_s`` (one per distinct deadline;
        :attr:`_scrape_slots` bounds the scrapes in flight over all of them)."""
        scraper = self._scrapers.get(timeout_s)
        if scraper is None:
            scraper = Scraper(
                timeout_s=timeout_s,
                concurrency=self.concurrency,
                max_body_bytes=self.max_body_bytes,
                session=self._http_session,
            )
            self._scrapers[timeout_s] = scraper
        return scraper

    async def _scrape(self, targets: Sequence[Target]) -> AsyncIterator[ScrapeResult]:
        """Scrape ``targets`` concurrently, each with its own deadline; yield each result as soon
        as it is complete."""

        async def one(target: Target) -> ScrapeResult:
            async with self._scrape_slots:
                return await self._scraper_for(target.timeout_s).scrape(target.url)

        tasks = [asyncio.create_task(one(t)) for t in targets]
        try:
            for fut in asyncio.as_completed(tasks):
                yield await fut
        finally:  # the consumer stopped early: cancel and reap what is still running
            for task in tasks:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _with_target_labels(self, url: str, samples: list[GpuSample]) -> list[GpuSample]:
        """``samples`` with the labels of the target at ``url`` added to their attributes as
        ``target_<name>`` (the target's value wins over an exporter label of the same name)."""
        target = self.targets.get(url)
        if target is None or not target.attributes:
            return samples
        return [s.model_copy(update={"attributes": {**s.attributes, **target.attributes}}) for s in samples]

    @staticmethod
    async def _flush(producer: Producer) -> None:
        """Wait until the bus acknowledged what was sent — unless ``producer`` is a spool, which
        delivers in the background (waiting on it would stall collection while Kafka is down)."""
        if not isinstance(producer, SpoolingProducer):
            await producer.flush()

    async def _watch_targets(self, stop: asyncio.Event, loops: dict[float, asyncio.Task[None]]) -> None:
        """Re-read changed file_sd files every ``file_sd_refresh_s`` (then forget the targets
        removed ``forget_after_s`` ago: :meth:`forget_removed_targets`) and keep one
        :meth:`_interval_loop` per target interval other than ``interval_s`` in ``loops``."""
        while not stop.is_set():
            self.targets.refresh()
            self.forget_removed_targets(time.monotonic())
            wanted = {t.interval_s for t in self.targets.targets} - {self.interval_s}
            for interval in set(loops):
                if interval not in wanted or loops[interval].done():
                    loops.pop(interval).cancel()
            for interval in wanted - set(loops):
                loops[interval] = asyncio.create_task(self._interval_loop(interval, stop))
            try:
                await asyncio.wait_for(stop.wait(), self.targets.refresh_s)
            except TimeoutError:
                pass

    async def _interval_loop(self, interval_s: float, stop: asyncio.Event) -> None:
        """Scrape the targets whose interval is ``interval_s`` every ``interval_s`` seconds."""

        async def once() -> CollectStats:
            return await self._collect_targets([t for t in self.targets.targets if t.interval_s == interval_s])

        await self._every(interval_s, once, "collect_targets", stop)

    async def _collect_targets(self, targets: Sequence[Target]) -> CollectStats:
        """Scrape ``targets`` only (no sysfs, nvidia-smi or NVML) and produce what they yield.
        Raises ``RuntimeError`` if :meth:`start` was not called."""
        if self._producer is None:
            raise RuntimeError("CollectorService.start() must be awaited first")
        t0 = time.monotonic()
        stats = CollectStats(targets=len(targets))
        async for res in self._scrape(targets):
            await self._handle_scrape(res, stats)
        await self._flush_counted()
        stats.duration_s = time.monotonic() - t0
        log.debug(
            "collect_targets",
            extra={
                "targets": stats.targets,
                "gpu_samples": stats.gpu_samples,
                "duration_s": round(stats.duration_s, 4),
            },
        )
        return stats

    # --- dcgm-exporter -------------------------------------------------------------------------
    async def _handle_scrape(self, res: ScrapeResult, stats: CollectStats) -> None:
        """Use one scrape's result inside a ``scrape dcgm-exporter`` span (CLIENT, from the scrape's
        start; semconv ``url.full``, ``http.response.status_code``, ``error.type`` = the failure
        reason): the records it yields carry its context (:meth:`_produce`)."""
        with _TRACER.start_as_current_span(
            "scrape dcgm-exporter",
            kind=tracing.SpanKind.CLIENT,
            start_time=int(res.ts * 1e9),
            attributes={"url.full": res.target} if "@" not in res.target else None,
        ) as span:
            reason = await self._use_scrape(res, stats)
            if res.status is not None and span.is_recording():
                span.set_attribute("http.response.status_code", res.status)
            if reason != "ok":
                tracing.mark_error(span, reason, res.detail[:200])

    async def _use_scrape(self, res: ScrapeResult, stats: CollectStats) -> str:
        """Parse, count and produce one scrape's result; returns ``ok`` or the failure reason."""
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
                    self.metrics.rejected_samples.labels(rej.reason).inc()
                stats.rejected.update(r.reason for r in parsed.rejected)
                if not parsed.samples and parsed.sample_lines and parsed.rejected:
                    reason = "garbage"  # not one line gave a sample: not a dcgm-exporter page
                elif not body.endswith("\n"):
                    # Every exposition line ends with a line feed: the body was cut off on the way
                    # (a proxy, a crashed exporter). An incomplete page is no snapshot: none of it
                    # is used.
                    reason = "truncated"
                if reason == "ok":
                    self._seq += len(parsed.samples) + len(parsed.switches)
        self.metrics.scrape_duration.labels("dcgm").observe(res.duration_s + time.monotonic() - t0)
        self._note_target(res, reason)
        reasons = self._target_series.setdefault(res.target, set())
        if reason != "ok":
            stats.failures[reason] += 1
            self.metrics.scrapes.labels(res.target, "failure").inc()
            self.metrics.scrape_errors.labels(res.target, reason).inc()
            reasons.add(reason)
            return reason
        stats.targets_ok += 1
        self.metrics.scrapes.labels(res.target, "success").inc()
        if parsed is None:
            return reason
        stats.gpu_samples += len(parsed.samples)
        for event in self._xid.observe(parsed.xid):
            stats.xid_events += 1
            self.metrics.xid_events.labels(str(event.xid)).inc()
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
        samples = self._with_target_labels(res.target, parsed.samples)
        await self._produce(self.topics.telemetry_gpu, gpu_scrapes(samples), stats)
        stats.nvswitches += len(parsed.switches)
        await self._produce(self.topics.telemetry_nvswitch, parsed.switches, stats)
        return reason

    def forget_removed_targets(self, now: float) -> list[str]:
        """Forget the dcgm-exporter targets that left the configuration ``forget_after_s`` or more
        before ``now`` (monotonic seconds; a target's leaving is dated by the first call that
        finds it gone): remove their ``gpupool_collector_scrapes`` and
        ``gpupool_collector_scrape_errors`` series and their failure state. Returns the targets
        forgotten. :meth:`run` calls it after every file_sd check."""
        configured = {t.url for t in self.targets.targets}
        for url in self._target_series.keys() - configured:
            self._removed_at.setdefault(url, now)
        forgotten = []
        for url, since in list(self._removed_at.items()):
            if url in configured:
                del self._removed_at[url]  # back in time: nothing forgotten
            elif now - since >= self.forget_after_s:
                del self._removed_at[url]
                for result in ("success", "failure"):
                    with contextlib.suppress(KeyError):
                        self.metrics.scrapes.remove(url, result)
                for reason in self._target_series.pop(url, set()):
                    with contextlib.suppress(KeyError):
                        self.metrics.scrape_errors.remove(url, reason)
                self._failing.pop(url, None)
                forgotten.append(url)
        if forgotten:
            log.info("targets_forgotten", extra={"targets": forgotten, "forget_after_s": self.forget_after_s})
        return forgotten

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

    # --- nvidia-smi and NVML ----------------------------------------------------------------------
    def _start_gpu_reads(self, stats: CollectStats) -> list[asyncio.Task[_GpuRead]]:
        """One task per nvidia-smi command and one for NVML (each counted when it returns)."""
        stats.targets += len(self.nvsmi_commands) + (self.nvml_host is not None)
        tasks = [asyncio.create_task(self._read_nvsmi(h, cmd)) for h, cmd in self.nvsmi_commands]
        if self.nvml_host is not None:
            tasks.append(asyncio.create_task(asyncio.to_thread(self._read_nvml, self.nvml_host)))
        return tasks

    async def _read_nvsmi(self, host: str, cmd: Sequence[str]) -> _GpuRead:
        res = await read_nvidia_smi(cmd, self.timeout_s, host=host)
        rejected = Counter(r.reason for r in res.parsed.rejected) if res.parsed is not None else Counter()
        target = shlex.join(cmd)
        self._count_gpu_read("nvidia-smi", target, res.reason, res.duration_s, rejected)
        return _GpuRead(target, res.reason, res.samples, rejected)

    def _read_nvml(self, host: str) -> _GpuRead:
        """Open NVML on first use (again after a failure) and read every GPU; blocking (a thread)."""
        if self._nvml is None:
            reader = NvmlReader()
            try:
                reader.open()
            except NvmlUnavailableError as e:
                self.metrics.scrapes.labels("nvml", "failure").inc()
                self.metrics.scrape_errors.labels("nvml", e.reason).inc()
                return _GpuRead("nvml", e.reason, [], Counter())
            self._nvml = reader
        samples = self._nvml.read(host, time.time())
        nvml = self._nvml
        self._count_gpu_read("nvml", "nvml", nvml.last_failure or "ok", nvml.last_duration_s, nvml.last_errors)
        return _GpuRead("nvml", "ok", samples, nvml.last_errors)

    def _count_gpu_read(
        self, source: str, target: str, reason: str, duration_s: float, rejected: Mapping[str, int]
    ) -> None:
        """Count one nvidia-smi or NVML read: its wall time (``source``), the values refused
        (by reason), and the read as a success (``reason`` ``ok``) or a failure of ``target``."""
        self.metrics.scrape_duration.labels(source).observe(duration_s)
        for why, n in rejected.items():
            self.metrics.rejected_samples.labels(why).inc(n)
        if reason == "ok":
            self.metrics.scrapes.labels(target, "success").inc()
            return
        self.metrics.scrapes.labels(target, "failure").inc()
        self.metrics.scrape_errors.labels(target, reason).inc()

    async def _handle_gpu_read(self, read: _GpuRead, stats: CollectStats) -> None:
        stats.rejected.update(read.rejected)
        if read.reason != "ok":
            stats.failures[read.reason] += 1
            if self._failing.get(read.target) != read.reason:
                self._failing[read.target] = read.reason
                log.warning("gpu_source_failed", extra={"target": read.target, "reason": read.reason})
            return
        if self._failing.pop(read.target, None) is not None:
            log.info("gpu_source_recovered", extra={"target": read.target})
        stats.targets_ok += 1
        records = [smp.model_copy(update={"seq": self._seq + i}) for i, smp in enumerate(read.samples)]
        self._seq += len(records)
        stats.gpu_samples += len(records)
        await self._produce(self.topics.telemetry_gpu, gpu_scrapes(records), stats)

    # --- UFM Telemetry ----------------------------------------------------------------------------
    async def _scrape_ufm(self, url: str) -> ScrapeResult:
        async with self._scrape_slots:
            return await self._scraper_for(self.timeout_s).scrape(url)

    async def _handle_ufm(self, res: ScrapeResult, stats: CollectStats) -> None:
        """Parse one UFM Telemetry scrape and produce its ports; a failed scrape, an empty body or
        one no line of which is a port counter fails that target alone (counted like a
        dcgm-exporter target)."""
        self.metrics.scrape_duration.labels("ufm-telemetry").observe(res.duration_s)
        reason = res.reason
        ports: list[IbPortSample] = []
        if res.ok:
            parsed = parse_ufm_telemetry(res.body or "", ts=res.ts, seq_start=self._seq)
            for rej in parsed.rejected:
                self.metrics.rejected_samples.labels(rej.reason).inc()
            stats.rejected.update(r.reason for r in parsed.rejected)
            if not parsed.ports:
                reason = "garbage" if parsed.sample_lines else "empty_body"
            ports = parsed.ports
        self._note_target(res, reason)
        if reason != "ok":
            stats.failures[reason] += 1
            self.metrics.scrapes.labels(res.target, "failure").inc()
            self.metrics.scrape_errors.labels(res.target, reason).inc()
            return
        stats.targets_ok += 1
        self.metrics.scrapes.labels(res.target, "success").inc()
        self._seq += len(ports)
        stats.ib_ports += len(ports)
        await self._produce(self.topics.telemetry_ib_port, ports, stats)

    # --- sysfs ----------------------------------------------------------------------------------
    async def _read_root(self, host: str, root: Path) -> tuple[SysfsReadResult, float]:
        t0 = time.monotonic()
        res = await asyncio.to_thread(read_sysfs_infiniband, root, host, time.time())
        return res, time.monotonic() - t0

    async def _handle_sysfs(self, read: tuple[SysfsReadResult, float], stats: CollectStats) -> None:
        res, duration = read
        self.metrics.scrape_duration.labels("sysfs").observe(duration)
        for err in res.errors:
            self.metrics.sysfs_errors.labels(err.reason).inc()
            log.debug("sysfs_file_error", extra={"path": err.path, "reason": err.reason})
        stats.sysfs_errors += len(res.errors)
        ports = [p.model_copy(update={"seq": self._seq + i}) for i, p in enumerate(res.ports)]
        self._seq += len(ports)
        stats.ib_ports += len(ports)
        await self._produce(self.topics.telemetry_ib_port, ports, stats)

    # --- bus --------------------------------------------------------------------------------------
    async def _produce(
        self,
        topic: str,
        records: Sequence[GpuScrape | IbPortSample | NvSwitchSample],
        stats: CollectStats,
    ) -> None:
        """Send ``records`` to ``topic`` inside one ``send <topic>`` span (PRODUCER, child of the
        current span, semconv messaging attributes); every record carries that span's
        ``traceparent`` header (none when tracing is off)."""
        if not records:
            return
        errors_before = stats.produce_errors
        with _TRACER.start_as_current_span(
            f"send {topic}",
            kind=tracing.SpanKind.PRODUCER,
            attributes=tracing.messaging_attributes(
                tracing.KAFKA, "send", topic, client_id=self.client_id, batch_count=len(records)
            ),
        ) as span:
            await self._send_records(topic, records, stats, tracing.inject_headers(span))
            if stats.produce_errors > errors_before:
                tracing.mark_error(span, "produce_failed", f"{stats.produce_errors - errors_before} refused")

    async def _send_records(
        self,
        topic: str,
        records: Sequence[GpuScrape | IbPortSample | NvSwitchSample],
        stats: CollectStats,
        headers: Sequence[tuple[str, bytes]],
    ) -> None:
        assert self._producer is not None
        produced = 0
        dropped: Counter[str] = Counter()
        for rec in records:
            try:
                await self._producer.send(topic, encode(rec), key=rec.partition_key, headers=headers)
                produced += 1
            except RecordDroppedError as e:  # the spool counted it; one log line per batch here
                dropped[e.reason] += 1
            except Exception as e:  # noqa: BLE001 — one refused record must not stop the cycle
                stats.produce_errors += 1
                self.metrics.produce_errors.labels(topic, type(e).__name__).inc()
                key = rec.partition_key if isinstance(rec, GpuScrape) else rec.key
                log.warning("produce_failed", extra={"topic": topic, "key": key, "error": repr(e)})
        if dropped:
            stats.produce_errors += dropped.total()
            self.metrics.produce_errors.labels(topic, "RecordDroppedError").inc(dropped.total())
            log.warning("produce_dropped", extra={"topic": topic, "records": dict(dropped)})
        if produced:
            stats.produced += produced
            self.metrics.records_produced.labels(topic).inc(produced)
