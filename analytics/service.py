"""The analytics stage: bus → DuckDB → idle detection → capacity updates on the bus.

One :meth:`AnalyticsService.step`:

1. reads one batch from ``telemetry.gpu`` and ``telemetry.ib_port`` (one consumer group);
2. decodes it as one batch (:func:`analytics.decode.decode_batch`: :class:`contracts.GpuScrape`
   records straight to Arrow columns by a compiled decoder, :mod:`analytics.scrapes`; other
   records by msgspec twins of their models; the pydantic model deciding every record those
   refuse) and builds its Arrow rows a column at
   a time (:func:`analytics.rows.gpu_scrapes_table`, :func:`analytics.rows.gpu_samples_table`),
   both with the garbage collector paused; a record that cannot be used (or one GPU of a scrape
   record) is counted by reason (``gpupool_analytics_rejected_records_total``) and skipped, never
   fatal;
3. feeds GPU samples to the :class:`~analytics.classify.IdleClassifier` (in offset order) and, every
   ``publish_interval_s``, marks GPUs not heard from for ``stale_after_s`` unknown and forgets
   those not heard from for ``forget_after_s`` (no more updates, out of the gauges);
4. writes the rows, the decided capacity updates, ended idle runs and the offsets after the batch
   in ONE DuckDB transaction (:meth:`analytics.store.AnalyticsStore.write`);
5. commits the consumer (secondary: DuckDB's offsets are authoritative, and the consumer resumes
   from them through ``on_assign``);
6. publishes a :class:`contracts.CapacityUpdate` to ``capacity`` (keyed by GPU) for every GPU
   whose state or grade changed, and re-publishes every GPU at least every ``refresh_s``;
7. every ``publish_interval_s``, sets ``gpupool_analytics_consumer_lag_records`` (end offsets of
   the owned partitions minus the offsets stored in DuckDB); every ``retention.interval_s``, runs
   the store's maintenance (1-minute rollups, then expiry: :mod:`analytics.retention`);
8. keeps its capacity snapshot for the gauges its ``/metrics`` reads at scrape time
   (:class:`analytics.metrics.AnalyticsMetrics`, served from :attr:`AnalyticsService.registry`).

Fabric headroom: every ``headroom_refresh_s`` (and at the first step) one query over the store,
``node_headroom_over(headroom_window_s)`` (:mod:`analytics.views`), gives every host's headroom:
1 − the p95 utilisation of its busiest InfiniBand port in its busier direction (PortXmitData or
PortRcvData) over the window. Every capacity update carries its host's value in ``headroom``
(``None`` when unknown: no IB reads of that host, or none with a valid interval yet). A GPU whose
state does not change carries a new value with its next periodic re-publication (``refresh_s``).

Leaf and uplinks: every instance reads the compacted ``fabric.topology`` topic whole (a consumer
of its own, never committed, so each instance sees every snapshot; the newest wins) and derives
each host's leaf switch and that leaf's uplink ports (:func:`analytics.fabric_leaf.leaf_map`).
With each headroom refresh, a second query over ``fabric_headroom_over(headroom_window_s)``
reads those uplink ports (switch ports, read by the switch-side fabric collector) and gives every
leaf the headroom of its busiest uplink and its worst XmitWait fraction
(:func:`analytics.fabric_leaf.leaf_headroom`). Every capacity update carries its host's ``leaf``
and ``leaf_headroom`` (``None`` when unknown: no topology yet, a host not in it, or no uplink read);
a GPU whose leaf changes (a first or new topology) is re-published at once.
Switch ports are keyed by the switch on ``telemetry.ib_port``: with several instances, an
instance knows the uplinks of the switches whose partitions it owns, and a leaf whose switch
another instance owns is unknown here (it never blocks).

A node whose known headroom is below ``min_headroom`` is not offerable, and neither is a node
whose leaf's busiest uplink has less headroom than ``lent_share`` (the share of a link lent
traffic may take) or whose uplinks wait for credits above ``max_uplink_xmit_wait``
(:func:`analytics.fabric_leaf.uplink_block_reason`). This is decided here, not in the broker
(which stays simple: it never offers ``unknown``): the host's idle GPUs are published as
``unknown`` with reason ``fabric_headroom`` (node) or ``leaf_uplink_headroom`` /
``leaf_uplink_xmit_wait`` (uplinks) (``since`` = when the block began, no grade, no prediction)
and go back to ``idle`` when the headroom recovers. Unknown headroom (hosts without IB, or no
interval yet) never blocks an offer. The classifier is not affected: a blocked GPU's
idle run goes on and is learned from as usual.

Scale-out: instances of one consumer group split the partitions; each owns the GPUs and the
InfiniBand ports of its partitions. Both telemetry topics are keyed by host and co-partitioned
(:mod:`contracts.topics`), so an instance holds every GPU and every port of its hosts and their
node headroom is whole. When a rebalance takes a partition away, the instance forgets that
partition's GPUs (no stale decision, refresh or gauge for a GPU another instance now owns) and its
hosts (GPU and port samples alike): their headroom is dropped and left out of every refresh
(:meth:`AnalyticsService.headroom`) until a sample of the host is read again from an owned
partition. Their rows stay in its DuckDB file. The new owner resumes from its own stored offset
for the partition, else from the group's committed offset.

Tracing (:mod:`runtime.tracing`, when on): an update that changes a GPU's state or grade is sent
inside a ``process telemetry.gpu`` span (CONSUMER), child of the trace context carried by the
newest sample of that GPU — the sample whose state the update reports — with a ``send capacity``
span (PRODUCER) whose context travels in the capacity record's headers. Periodic refreshes and
stale decisions are not traced, so the trace volume follows state changes, not fleet size.

If the DuckDB write fails, nothing of the batch is stored or published; the consumer is rebuilt so
it resumes from the stored offsets and the batch is read again (the classifier ignores samples it
has already seen). If publishing fails, the updates stay due and go out on the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow as pa
from opentelemetry.context import Context
from prometheus_client import CollectorRegistry

from analytics.offsets import table_topics
from analytics.metrics import AnalyticsMetrics, CapacitySnapshot
from analytics.classify import GpuStatus, IdleClassifier, IdleConfig, IdleRun
from analytics.decode import (
    GpuRecord,
    IbPortRecord,
    RejectedRecord,
    decode_batch,
    decode_telemetry,
    paused_gc,
)
from analytics.fabric_leaf import LeafHeadroom, LeafMap, leaf_headroom, leaf_map, uplink_block_reason
from analytics.identity import GpuIdentities, with_uuid
from analytics.predict import IdlePredictor, PredictorConfig
from analytics.retention import RetentionConfig
from analytics.rows import (
    counters_out_of_range,
    gpu_samples_table,
    gpu_scrapes_table,
    gpu_states_table,
    ib_port_samples_table,
    idle_runs_table,
)
from analytics.scrapes import GpuObservation, ScrapeColumns
from analytics.scheduler import DEFAULT_PLAN_LEAD_S, DEFAULT_STALE_AFTER_S, SchedulerJoin, scheduler_gpus_table
from analytics.store import AnalyticsStore, StoreBatch
from analytics.views import HEADROOM_WINDOW_S
from contracts import (
    CapacityUpdate,
    FabricTopology,
    GpuState,
    IdleGrade,
    KafkaTopics,
    decode,
    encode,
)
from contracts.bus import Bus, BusMessage, Consumer, Producer, TopicPartition, require_topics
from contracts.scheduler import SchedulerNode
from runtime import tracing
from runtime.backoff import Backoff

log = logging.getLogger(__name__)
_TRACER = tracing.tracer(__name__)

_R = TypeVar("_R", GpuRecord, IbPortRecord)
_T = TypeVar("_T")


@dataclass(slots=True)
class _Decoded:
    # every GPU sample, in offset order (classifier): scrape records' GPUs as observations
    gpu: list[GpuRecord | GpuObservation] = field(default_factory=list)
    gpu_rows: list[GpuRecord] = field(default_factory=list)  # those of per-sample records (and salvaged)
    gpu_pos: list[tuple[int, int]] = field(default_factory=list)  # (partition, offset) of gpu_rows
    scrapes: ScrapeColumns = field(default_factory=ScrapeColumns)  # scrape records, in columns
    scrape_uuid: list[str | None] = field(default_factory=list)  # their GPUs' resolved UUIDs
    ib: list[IbPortRecord] = field(default_factory=list)
    ib_pos: list[tuple[int, int]] = field(default_factory=list)
    offsets: dict[TopicPartition, int] = field(default_factory=dict)
    renames: list[tuple[str, str, str]] = field(default_factory=list)  # (stand-in key, key, UUID)
    scheduler: list[tuple[SchedulerNode, int, int]] = field(default_factory=list)


class AnalyticsService:
    """The analytics stage over a :class:`contracts.bus.Bus`; see the module docstring."""

    def __init__(
        self,
        *,
        bus: Bus,
        topics: KafkaTopics,
        db_path: str,
        idle: IdleConfig | None = None,
        group_id: str = "gpupool-analytics",
        publish_interval_s: float = 1.0,
        refresh_s: float = 30.0,
        pool: str = "default",
        predictor: PredictorConfig | None = None,
        clock: Callable[[], float] = time.time,
        max_records: int = 5000,
        client_id: str = "gpupool-analytics",
        memory_limit: str | None = None,
        retention: RetentionConfig | None = None,
        min_headroom: float = 0.2,
        headroom_refresh_s: float = 30.0,
        headroom_window_s: float = HEADROOM_WINDOW_S,
        lent_share: float = 0.2,
        max_uplink_xmit_wait: float = 0.5,
        forget_after_s: float = 3600.0,
        scheduler: bool = False,
        scheduler_stale_s: float = DEFAULT_STALE_AFTER_S,
        plan_lead_s: float = DEFAULT_PLAN_LEAD_S,
        metrics: AnalyticsMetrics | None = None,
    ) -> None:
        """Configure; nothing is opened before :meth:`start`.

        Args:
            bus: where telemetry is read and capacity updates are written.
            topics: topic names.
            db_path: DuckDB file, or ``":memory:"``.
            idle: idle-detection thresholds (:class:`IdleConfig` defaults if ``None``).
            group_id: consumer group; instances of one group split the partitions.
            publish_interval_s: period (s) of the stale check and of the refresh scan.
            refresh_s: every GPU's update is re-published at least this often (s).
            pool: pool name put on every update.
            predictor: prediction settings; default: :class:`PredictorConfig` (the pool's
                recent runs, 90 % confidence) and, with no history, ``min_idle_s`` seconds at 50 %.
            clock: wall clock (Unix s) for stale checks and refresh timing; injectable for tests.
            max_records: most records per step.
            client_id: bus client id.
            memory_limit: memory the process may use for its store (e.g. ``"2GB"``): DuckDB
                gets :data:`analytics.store.DUCKDB_MEMORY_SHARE` of it, the rest is left for
                Python (batches of at most ``max_records`` records).
            retention: raw/rollup retention and the maintenance period (:class:`RetentionConfig`
                defaults if ``None``: raw 24 h, rollups 30 days, every 60 s).
            min_headroom: a host whose known fabric headroom (0..1) is below this is not
                offerable (module docstring); 0 turns the check off.
            headroom_refresh_s: period (s) of the headroom query.
            headroom_window_s: window (s) of the p95, per port, back from its latest read.
            lent_share: share (0..1) of a link lent traffic may take; a host whose leaf's busiest
                uplink has less known headroom is not offerable (0 turns the check off).
            max_uplink_xmit_wait: a host whose leaf's uplinks wait for credits more than this
                (XmitWait fraction, 0..1) is not offerable (1 turns the check off).
            forget_after_s: a GPU whose latest sample is this old (s, by ``clock``) is forgotten:
                no more updates for it, out of the gauges, its own prediction history dropped (its
                rows stay in DuckDB until retention). Checked every ``publish_interval_s``.
            scheduler: also read ``telemetry.scheduler`` and join it (module docstring, "The
                training scheduler"); ``False``: the scheduler plays no part.
            scheduler_stale_s: a host whose latest scheduler state is older than this (s) is not
                offered (with ``scheduler``).
            plan_lead_s: a GPU the scheduler's plan needs for a pending job is offered until this
                long (s) before the job's planned start, and its lease is told it is at risk
                then (:class:`analytics.scheduler.SchedulerJoin`; ``math.inf``: never offered).
            metrics: this service's Prometheus metrics (one :class:`AnalyticsMetrics` per
                service); ``None``: new ones on a registry of their own. Its ``/metrics`` serves
                :attr:`registry`.

        Raises:
            ValueError: a non-positive interval, window or ``max_records``, ``min_headroom``,
                ``lent_share`` or ``max_uplink_xmit_wait`` outside 0..1, or ``forget_after_s`` not
                above the idle config's ``stale_after_s``.
        """
        if publish_interval_s <= 0 or refresh_s <= 0 or max_records <= 0:
            raise ValueError("publish_interval_s, refresh_s and max_records must be > 0")
        if headroom_refresh_s <= 0 or headroom_window_s <= 0:
            raise ValueError("headroom_refresh_s and headroom_window_s must be > 0")
        if not 0.0 <= min_headroom <= 1.0:
            raise ValueError("min_headroom must be in 0..1")
        if not (0.0 <= lent_share <= 1.0 and 0.0 <= max_uplink_xmit_wait <= 1.0):
            raise ValueError("lent_share and max_uplink_xmit_wait must be in 0..1")
        self.min_headroom = min_headroom
        self.lent_share = lent_share
        self.max_uplink_xmit_wait = max_uplink_xmit_wait
        self._leaves = LeafMap()
        self._leaf_headroom: dict[str, LeafHeadroom] = {}
        self._topology_consumer: Consumer | None = None
        self._topology_started: asyncio.Future[None] | None = None
        self._headroom_refresh_s = headroom_refresh_s
        self._headroom_window_s = headroom_window_s
        self._headroom: dict[str, float] = {}
        self._last_headroom = float("-inf")
        self._blocked_since: dict[str, float] = {}
        self.idle = idle if idle is not None else IdleConfig()
        if not forget_after_s > self.idle.stale_after_s:
            raise ValueError(
                f"forget_after_s ({forget_after_s}) must be above stale_after_s ({self.idle.stale_after_s})"
            )
        self.forget_after_s = forget_after_s
        self.topics = topics
        self.pool = pool
        self._bus = bus
        self._db_path = db_path
        self._group_id = group_id
        self._client_id = client_id
        self._publish_interval_s = publish_interval_s
        self._refresh_s = refresh_s
        self._clock = clock
        self._max_records = max_records
        self._memory_limit = memory_limit
        self.retention = retention if retention is not None else RetentionConfig()
        self._classifier = IdleClassifier(self.idle)
        self._identities = GpuIdentities()
        self._predictor = IdlePredictor(
            predictor if predictor is not None else PredictorConfig(default_remaining_s=self.idle.min_idle_s)
        )
        self._store: AnalyticsStore | None = None
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self._next_offsets: dict[TopicPartition, int] = {}
        self._pending_runs: list[IdleRun] = []
        self._published: dict[str, CapacityUpdate] = {}
        self._published_at: dict[str, float] = {}
        self._last_tick = float("-inf")
        self._rows_ingested = 0
        self._seen_idle: set[str] = set()
        self._inflight: asyncio.Future[Any] | None = None
        self._trace_headers: dict[str, tuple[tuple[str, bytes], ...]] = {}
        self._step_started_ns = 0
        self._partition_of: dict[str, TopicPartition] = {}
        self._hosts_of: dict[TopicPartition, set[str]] = {}
        self._released_hosts: set[str] = set()
        self._stored_state: dict[str, tuple[GpuState, float, IdleGrade | None]] = {}
        self._lag_values: dict[TopicPartition, int] = {}
        """Consumer lag by owned partition (replaced whole: the scrape reads it)."""
        self._capacity: CapacitySnapshot | None = None
        """GPUs at the end of the last step (``None`` before the first; replaced whole)."""
        self._allocated_idle: Mapping[tuple[str, str, str], int] = {}
        """Idle GPUs the scheduler has allocated, by (partition, user, job) (replaced whole)."""
        self.metrics = metrics if metrics is not None else AnalyticsMetrics()
        """This service's Prometheus metrics."""
        self.metrics.watch(
            gpus=lambda: {} if (c := self._capacity) is None else c.gpus(),
            idle_gpus=lambda: {} if (c := self._capacity) is None else c.idle_gpus(),
            idle_gpu_memory=lambda: {} if (c := self._capacity) is None else c.idle_memory(),
            leaf_uplink_headroom=lambda: {
                (leaf,): fig.headroom for leaf, fig in self._leaf_headroom.items() if fig.headroom is not None
            },
            leaf_uplink_xmit_wait=lambda: {
                (leaf,): fig.xmit_wait for leaf, fig in self._leaf_headroom.items() if fig.xmit_wait is not None
            },
            consumer_lag=lambda: {(tp.topic, str(tp.partition)): n for tp, n in self._lag_values.items()},
            allocated_idle_gpus=lambda: {k: n for k, n in self._allocated_idle.items()},
        )
        self._last_maintenance = float("-inf")
        self._scheduler = SchedulerJoin(scheduler_stale_s, plan_lead_s) if scheduler else None

    # lifecycle -------------------------------------------------------------------------------
    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry this service's ``/metrics`` serves (its metrics only)."""
        return self.metrics.registry

    @property
    def store(self) -> AnalyticsStore:
        """The DuckDB store. Raises ``RuntimeError`` before :meth:`start`."""
        if self._store is None:
            raise RuntimeError("AnalyticsService not started")
        return self._store

    async def start(self) -> None:
        """Check that the topics exist, open the store, reload offsets, idle-run history and the GPUs
        stored under a stand-in id (:mod:`analytics.identity`), start the producer and join the
        consumer group. Raises :class:`contracts.bus.MissingTopicsError` if a topic is missing (no
        stage creates topics: ``gpupool topics create``; checked before anything is opened), and
        what the bus or DuckDB raise (connection, lock, schema errors)."""
        await require_topics(self._bus, [*self._telemetry_topics(), self.topics.capacity])
        self._store = AnalyticsStore(
            self._db_path, memory_limit=self._memory_limit, metrics=self.metrics, sources=table_topics(self.topics)
        )
        self._next_offsets = self._store.stored_offsets(self._telemetry_topics())
        pcfg = self._predictor.config
        # Every GPU's latest max(per-GPU, per-pool) runs hold the pool's latest max_runs_per_pool.
        per_gpu = max(pcfg.max_runs_per_gpu, pcfg.max_runs_per_pool)
        for key, pool, duration, censored in self._store.idle_runs(per_gpu):
            self._predictor.observe(key, duration, censored=censored, pool=pool)
        for host, stand_in, gi in self._store.stand_in_gpus():  # their UUID may appear now
            self._identities.remember_stand_in(host, stand_in, gi)
        self._producer = self._bus.producer(self._client_id)
        await self._producer.start()
        self._consumer = self._new_consumer()
        await self._consumer.start()
        self._topology_consumer = self._bus.consumer(
            [self.topics.fabric_topology],
            f"{self._group_id}-topology-{uuid.uuid4().hex[:12]}",
            client_id=self._client_id,
        )
        # In the background: a deployment without the fabric collector (or its topic) starts as fast
        # as before, and the leaf map follows once the consumer is assigned.
        self._topology_started = asyncio.ensure_future(self._topology_consumer.start())
        self.metrics.lent_share.set(self.lent_share)
        log.info(
            "analytics_started",
            extra={
                "db": self._db_path,
                "group_id": self._group_id,
                "stored_offsets": len(self._next_offsets),
            },
        )

    async def stop(self) -> None:
        """Leave the group, flush the producer and close the store (idempotent). An error of the
        bus while stopping is logged; the store is closed regardless."""
        consumer, producer, topology = self._consumer, self._producer, self._topology_consumer
        self._consumer = self._producer = self._topology_consumer = None
        started, self._topology_started = self._topology_started, None
        if started is not None and not started.done():
            started.cancel()
        if started is not None:
            with contextlib.suppress(BaseException):
                await started
        for name, part in (("consumer", consumer), ("topology consumer", topology), ("producer", producer)):
            if part is None:
                continue
            try:
                await part.stop()
            except Exception as exc:  # noqa: BLE001 — logged; the store is closed regardless
                log.warning("analytics_stop_failed", extra={"part": name, "error": repr(exc)})
        if self._inflight is not None and not self._inflight.done():
            with contextlib.suppress(Exception):
                await self._inflight
        if self._store is not None:
            self._store.close()
            self._store = None
        self._capacity = None if self._capacity is None else CapacitySnapshot(pool=self.pool)
        self._allocated_idle = {}
        self._set_lag({})
        self._leaf_headroom = {}
        log.info("analytics_stopped", extra={"db": self._db_path})

    async def run(self, stop: asyncio.Event) -> None:
        """Call :meth:`step` until ``stop`` is set. An unexpected error in a step is logged and
        retried after a pause (:class:`runtime.backoff.Backoff`, 0.5 s doubling to 10 s); it
        never ends the loop."""
        backoff = Backoff(0.5, 10.0)
        while not stop.is_set():
            try:
                await self.step(timeout_s=min(0.5, self._publish_interval_s))
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception:
                delay = backoff.next()
                log.exception("analytics_step_failed", extra={"retry_in_s": round(delay, 3)})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)

    # the loop --------------------------------------------------------------------------------
    async def step(self, timeout_s: float = 0.5) -> int:
        """Read, store, classify and publish one batch (see the module docstring); return the
        number of records read (including rejected ones). Raises ``RuntimeError`` before
        :meth:`start`; bus errors other than publishing propagate."""
        consumer, producer = self._consumer, self._producer
        if consumer is None or producer is None or self._store is None:
            raise RuntimeError("AnalyticsService not started")
        msgs = await consumer.getmany(timeout_s=timeout_s, max_records=self._max_records)
        self._step_started_ns = time.time_ns()
        decoded = self._decode(msgs)
        retired = [await self._rename_gpu(*r) for r in decoded.renames]
        with paused_gc():  # see analytics.decode.paused_gc
            gpu_table = _gpu_table(decoded, self.metrics)
            ib_table = _safe_table(ib_port_samples_table, decoded.ib, decoded.ib_pos, self.metrics)
        out_of_range = counters_out_of_range(decoded.ib)
        if out_of_range:
            self.metrics.rejected_records.labels(reason="counter_out_of_range").inc(out_of_range)
        for sample in decoded.gpu:
            self._classifier.observe(sample)
        scheduler_table = self._observe_scheduler(decoded.scheduler)
        now = self._clock()
        if await self._read_topology():
            self._last_headroom = float("-inf")  # new leaves and uplinks: their headroom now
        if now - self._last_headroom >= self._headroom_refresh_s:
            await self._refresh_headroom(now)
        ticked = now - self._last_tick >= self._publish_interval_s
        if ticked:
            self._classifier.tick(now)
            self._last_tick = now
            self._forget_gone(now)
        for run in self._classifier.drain_runs():
            self._predictor.observe(run.key, run.duration_s, censored=run.censored, pool=self.pool)
            self._pending_runs.append(run)
        due = self._due_updates(now)
        transitions = [self._stored_state.get(u.key) != (u.state, u.since, u.grade) for u in due]
        batch = StoreBatch(
            gpu_samples=gpu_table,
            ib_port_samples=ib_table,
            gpu_states=gpu_states_table(due, transitions) if due else None,
            idle_runs=idle_runs_table((r, self.pool) for r in self._pending_runs)
            if self._pending_runs
            else None,
            offsets=decoded.offsets,
            scheduler_gpu_samples=scheduler_table,
        )
        if not batch.empty():  # else nothing read (or only duplicates) and nothing due
            try:
                await self._in_thread(self._store.write, batch)
            except Exception as exc:  # noqa: BLE001 — counted; nothing stored, the batch is read again
                self.metrics.ingest_failures.inc()
                log.error("analytics_ingest_failed", extra={"error": repr(exc), "records": len(msgs)})
                await self._reset_consumer()
                return len(msgs)
            self._pending_runs.clear()
            self._next_offsets.update(decoded.offsets)
            self._stored_state.update((u.key, (u.state, u.since, u.grade)) for u in due)
            self._rows_ingested += sum(t.num_rows for t in (gpu_table, ib_table) if t is not None)
            if msgs:
                try:
                    await consumer.commit()
                except Exception as exc:  # noqa: BLE001 — DuckDB holds the offsets; the group offset is a fallback
                    log.warning("analytics_commit_failed", extra={"error": repr(exc)})
            await self._publish(producer, due, now)
            await self._publish(producer, [u for u in retired if u is not None], now)
            for old, _, _ in decoded.renames:
                self._published.pop(old, None)
                self._published_at.pop(old, None)
        if ticked:
            await self._refresh_lag()
        if now - self._last_maintenance >= self.retention.interval_s:
            await self._maintain(now)
        self._update_gauges()
        return len(msgs)

    def current_states(self) -> dict[str, CapacityUpdate]:
        """The current capacity update of every GPU known, by GPU key (predictions as of each
        GPU's latest sample) — the live view of the demo."""
        return {key: self._update(st) for key, st in self._classifier.statuses().items()}

    def headroom(self) -> dict[str, float]:
        """The fabric headroom (0..1, not clamped) per host, as of the latest refresh (a copy;
        hosts of unknown headroom are absent, and so are hosts whose partition a rebalance took
        away, until one of their samples is read again)."""
        return dict(self._headroom)

    def leaves(self) -> LeafMap:
        """The host → leaf and leaf → uplink map of the newest topology read (empty before one)."""
        return self._leaves

    def leaf_headroom(self) -> dict[str, LeafHeadroom]:
        """Each leaf's uplink figures as of the latest refresh (a copy; unknown leaves absent)."""
        return dict(self._leaf_headroom)

    def partitions(self) -> set[TopicPartition]:
        """The telemetry partitions this instance owns now (empty before :meth:`start`)."""
        return set() if self._consumer is None else self._consumer.assignment()

    def stored_offsets(self) -> dict[TopicPartition, int]:
        """Next offset to read per partition, as committed to DuckDB with the rows by this
        instance (a copy; loaded from the file at :meth:`start`)."""
        return dict(self._next_offsets)

    def rows_ingested(self) -> int:
        """Telemetry rows (GPU and IB port samples) this instance committed to DuckDB since it was
        built; still valid after :meth:`stop`."""
        return self._rows_ingested

    def gpus_seen_idle(self) -> int:
        """How many distinct GPUs (and MIG instances) this instance has classified idle at least
        once; still valid after :meth:`stop`."""
        return len(self._seen_idle)

    # internals -------------------------------------------------------------------------------
    def _telemetry_topics(self) -> list[str]:
        scheduler = [self.topics.telemetry_scheduler] if self._scheduler is not None else []
        return [self.topics.telemetry_gpu, self.topics.telemetry_ib_port, *scheduler]

    def _new_consumer(self) -> Consumer:
        return self._bus.consumer(
            self._telemetry_topics(), self._group_id, client_id=self._client_id, on_assign=self._on_assign
        )

    async def _on_assign(self, assigned: set[TopicPartition]) -> dict[TopicPartition, int]:
        """Forget the GPUs and the hosts (GPU and port samples) of partitions no longer owned,
        and resume each assigned partition from the offset stored with the rows (cached copy of
        DuckDB's ``consumer_offsets``, updated after every committed write)."""
        gone = [key for key, tp in self._partition_of.items() if tp not in assigned]
        for key in gone:
            self._forget(key)
        hosts_gone: set[str] = set()
        for tp in [tp for tp in self._hosts_of if tp not in assigned]:
            hosts_gone |= self._hosts_of.pop(tp)
        self._release_hosts(hosts_gone)
        self._set_lag({tp: n for tp, n in self._lag_values.items() if tp in assigned})
        start = {tp: self._next_offsets[tp] for tp in assigned if tp in self._next_offsets}
        log.info(
            "analytics_partitions_assigned",
            extra={
                "partitions": sorted(f"{t}:{p}" for t, p in assigned),
                "resumed": len(start),
                "gpus_forgotten": len(gone),
                "hosts_forgotten": len(hosts_gone),
            },
        )
        return start

    def _own_host(self, tp: TopicPartition, host: str) -> None:
        """Note that a sample of ``host`` was read from owned partition ``tp``."""
        hosts = self._hosts_of.get(tp)
        if hosts is None:
            hosts = self._hosts_of[tp] = set()
        hosts.add(host)
        if self._released_hosts:
            self._released_hosts.discard(host)

    def _release_hosts(self, hosts: set[str]) -> None:
        """Forget ``hosts`` (their partition moved away): drop their headroom now and keep them
        out of every refresh until one of their samples is read again (:meth:`_own_host`)."""
        for host in hosts:
            self._headroom.pop(host, None)
        if self._scheduler is not None:
            self._scheduler.forget_hosts(hosts)
        self._released_hosts |= hosts

    async def _rename_gpu(self, old: str, new: str, gpu_uuid: str) -> CapacityUpdate | None:
        """A GPU known by its index (``old``) showed its UUID: move its idle track, predictor runs
        and stored rows to ``new`` (:mod:`analytics.identity`). Returns the capacity update that
        retires ``old`` (unknown, reason ``renamed``) when one was published for it."""
        assert self._store is not None
        self._classifier.rename(old, new, gpu_uuid)
        self._predictor.rename(old, new)
        tables: tuple[dict[str, Any], ...] = (
            self._partition_of, self._trace_headers, self._stored_state, self._blocked_since
        )
        for table in tables:
            value = table.pop(old, None)
            if value is not None:
                table.setdefault(new, value)
        try:
            moved = await self._in_thread(self._store.rekey_gpu, old, new, gpu_uuid)
        except Exception as exc:  # noqa: BLE001 — the live state moved; stored rows stay under the stand-in key
            log.error("gpu_rekey_failed", extra={"from": old, "to": new, "error": repr(exc)})
        else:
            log.info("gpu_key_renamed", extra={"from": old, "to": new, "rows": moved})
        last = self._published.get(old)
        if last is None:
            return None
        return last.model_copy(
            update={"state": GpuState.UNKNOWN, "reason": "renamed", "grade": None,
                    "predicted_idle_until": None, "confidence": None, "since": last.ts}
        )  # fmt: skip

    def _forget(self, key: str) -> None:
        """Drop everything this instance holds about GPU ``key`` but its prediction history."""
        self._classifier.forget(key)
        self._partition_of.pop(key, None)
        self._published.pop(key, None)
        self._published_at.pop(key, None)
        self._trace_headers.pop(key, None)
        self._stored_state.pop(key, None)
        self._blocked_since.pop(key, None)
        if self._scheduler is not None:
            self._scheduler.forget_gpu(key)

    def _forget_gone(self, now: float) -> None:
        """Forget every GPU not sampled for ``forget_after_s``: what :meth:`_forget` drops and its
        prediction history; a host none of whose GPUs is left here is dropped from the partition
        bookkeeping too (a later sample of it adds it back)."""
        gone = self._classifier.gone(now, self.forget_after_s)
        if not gone:
            return
        hosts: set[str] = set()
        for key in gone:
            st = self._classifier.status(key)
            if st is not None:
                hosts.add(st.host)
            self._forget(key)
            self._predictor.forget(key)
        hosts -= {st.host for st in self._classifier.statuses().values()}
        for owned in self._hosts_of.values():
            owned -= hosts
        log.info("analytics_gpus_forgotten", extra={"gpus": sorted(gone), "forget_after_s": self.forget_after_s})

    async def _refresh_headroom(self, now: float) -> None:
        """Reload every host's headroom with one query (``node_headroom_over``); a failure is
        logged and keeps the previous values until the next period."""
        store = self._store
        if store is None:
            return
        self._last_headroom = now
        try:
            _, rows = await self._in_thread(
                store.sql,
                "SELECT host, headroom FROM node_headroom_over(?) WHERE headroom IS NOT NULL",
                [self._headroom_window_s],
            )
        except Exception as exc:  # noqa: BLE001 — logged; the previous values stay until the next period
            log.error("analytics_headroom_failed", extra={"error": repr(exc)})
            return
        released = self._released_hosts
        self._headroom = {str(host): float(h) for host, h in rows if str(host) not in released}
        low = sorted(h for h, v in self._headroom.items() if v < self.min_headroom)
        if low:
            log.info("analytics_headroom_low", extra={"hosts": low, "min_headroom": self.min_headroom})
        await self._refresh_leaf_headroom(store)

    async def _refresh_leaf_headroom(self, store: AnalyticsStore) -> None:
        """Reload every leaf's uplink figures (one query over the uplink ports of the current
        :class:`LeafMap`); a failure is logged and keeps the previous values."""
        uplinks = sorted(self._leaves.uplink_ports())
        if not uplinks:
            self._leaf_headroom = {}
            return
        try:
            _, rows = await self._in_thread(
                store.sql,
                "SELECT port_key, port_headroom, xmit_wait_fraction FROM fabric_headroom_over(?) "
                "WHERE list_contains(?, port_key)",
                [self._headroom_window_s, uplinks],
            )
        except Exception as exc:  # noqa: BLE001 — a failed query leaves the last figures; logged
            log.error("analytics_leaf_headroom_failed", extra={"error": repr(exc)})
            return
        ports = {
            str(k): (None if h is None else float(h), None if w is None else float(w)) for k, h, w in rows
        }
        self._leaf_headroom = leaf_headroom(self._leaves, ports)
        blocked = sorted(
            leaf
            for leaf, fig in self._leaf_headroom.items()
            if uplink_block_reason(fig, lent_share=self.lent_share, max_xmit_wait=self.max_uplink_xmit_wait)
        )
        if blocked:
            log.info(
                "analytics_leaf_uplinks_busy",
                extra={
                    "leaves": blocked,
                    "lent_share": self.lent_share,
                    "max_xmit_wait": self.max_uplink_xmit_wait,
                },
            )

    async def _read_topology(self) -> bool:
        """Take the newest valid ``fabric.topology`` snapshot read since the last call, if any,
        as the :class:`LeafMap`; return whether it changed. Nothing is read until the topology
        consumer (started in the background by :meth:`start`) has started; if its start failed,
        that is logged once and the map stays as it is. A record that does not decode is counted
        (``gpupool_analytics_rejected_records_total{reason="invalid_topology"}``) and skipped; a
        bus error is logged and leaves the map as it is."""
        consumer, started = self._topology_consumer, self._topology_started
        if consumer is None or started is None or not started.done():
            return False
        if started.cancelled() or started.exception() is not None:
            exc = None if started.cancelled() else started.exception()
            log.warning("analytics_topology_consumer_failed", extra={"error": repr(exc)})
            self._topology_consumer = None  # the leaf map stays as it is; a restart retries
            return False
        try:
            msgs = await consumer.getmany(timeout_s=0, max_records=64)
        except Exception as exc:  # noqa: BLE001 — the topology stays as it is; logged, retried
            log.warning("analytics_topology_read_failed", extra={"error": repr(exc)})
            return False
        newest: FabricTopology | None = None
        for msg in msgs:
            if msg.value is None:
                continue
            try:
                newest = decode(FabricTopology, msg.value)
            except ValueError as exc:
                self.metrics.rejected_records.labels(reason="invalid_topology").inc()
                log.warning(
                    "analytics_record_rejected",
                    extra={
                        "reason": "invalid_topology",
                        "detail": str(exc)[:300],
                        "messaging.destination.name": msg.topic,
                        "messaging.kafka.message.offset": msg.offset,
                    },
                )
        if newest is None:
            return False
        self._leaves = leaf_map(newest)
        log.info(
            "analytics_topology",
            extra={
                "hosts": len(self._leaves.leaf_of),
                "leaves": len(self._leaves.uplinks),
                "uplink_ports": len(self._leaves.uplink_ports()),
                "topology_ts": newest.ts,
            },
        )
        # GPU hosts the fabric does not name: their HCAs' node descriptions (rdma-ndd's %h) and
        # their GPU samples' host names differ, so they get no leaf and no leaf-local matching.
        gpu_hosts = {st.host for st in self._classifier.statuses().values()}
        missing = sorted(gpu_hosts - self._leaves.leaf_of.keys())
        if missing:
            log.warning("analytics_hosts_without_leaf", extra={"hosts": len(missing), "first": missing[:10]})
        return True

    def _blocked(self, st: GpuStatus) -> bool:
        """True when idle GPU ``st`` is held back (:meth:`_block_reason`)."""
        return self._block_reason(st) is not None

    def _block_reason(self, st: GpuStatus) -> str | None:
        """Why idle GPU ``st`` is held back, or ``None``: ``fabric_headroom`` when its host's known
        headroom is below ``min_headroom``, else the uplink reason of its leaf
        (:func:`analytics.fabric_leaf.uplink_block_reason`), else, with the scheduler joined,
        :meth:`analytics.scheduler.SchedulerJoin.block_reason` at the clock's now. Unknown
        headroom never blocks."""
        if st.state is not GpuState.IDLE:
            return None
        h = self._headroom.get(st.host)
        if h is not None and h < self.min_headroom:
            return "fabric_headroom"
        leaf = self._leaves.leaf_of.get(st.host)
        if leaf is not None:
            reason = uplink_block_reason(
                self._leaf_headroom.get(leaf), lent_share=self.lent_share, max_xmit_wait=self.max_uplink_xmit_wait
            )
            if reason is not None:
                return reason
        if self._scheduler is not None:
            return self._scheduler.block_reason(st, self._clock())
        return None

    async def _in_thread(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run a store call in a worker thread. Shielded: if the step is cancelled the call still
        completes, and :meth:`stop` waits for it before closing the connection."""
        fut: asyncio.Future[_T] = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._inflight = fut
        return await asyncio.shield(fut)

    async def _refresh_lag(self) -> None:
        """Set the lag gauge of every owned partition; a failure to ask the bus is logged and
        leaves the previous values."""
        consumer = self._consumer
        if consumer is None:
            return
        try:
            ends = await consumer.end_offsets()
        except Exception as exc:  # noqa: BLE001 — logged; the previous lag values stay
            log.warning("analytics_lag_unavailable", extra={"error": repr(exc)})
            return
        self._set_lag({tp: max(0, end - self._next_offsets.get(tp, 0)) for tp, end in ends.items()})

    def _set_lag(self, lag: dict[TopicPartition, int]) -> None:
        """Make the lag gauge show exactly ``lag`` (partitions not in it have no series)."""
        self._lag_values = dict(lag)

    async def _maintain(self, now: float) -> None:
        """Run the store's maintenance (rollups, expiry); a failure is logged and retried at the
        next interval, never raised."""
        store = self._store
        if store is None:
            return
        self._last_maintenance = now
        try:
            result = await self._in_thread(store.maintain, self.retention, now)
        except Exception as exc:  # noqa: BLE001 — logged; retried at the next interval
            log.error("analytics_maintenance_failed", extra={"error": repr(exc)})
            return
        if result.rolled_to is not None or any(result.expired_rows.values()):
            log.info(
                "analytics_maintained",
                extra={
                    "rolled_from": result.rolled_from,
                    "rolled_to": result.rolled_to,
                    "rollup_rows": result.rollup_rows,
                    "expired_rows": result.expired_rows,
                },
            )

    async def _reset_consumer(self) -> None:
        """Rebuild the consumer so it re-reads from the stored offsets."""
        if self._consumer is not None:
            try:
                await self._consumer.stop()
            except Exception as exc:  # noqa: BLE001 — logged; a new consumer is made regardless
                log.warning("analytics_consumer_stop_failed", extra={"error": repr(exc)})
        self._consumer = self._new_consumer()
        await self._consumer.start()

    def _decode(self, msgs: Sequence[BusMessage]) -> _Decoded:
        """Skip (and count) records below the stored offsets, then decode the rest as one batch
        (:func:`analytics.decode.decode_batch`); count and log every rejection."""
        out = _Decoded()
        traced = tracing.enabled()
        consumed: Counter[str] = Counter()
        fresh: list[BusMessage] = []
        for msg in msgs:
            tp = TopicPartition(msg.topic, msg.partition)
            consumed[msg.topic] += 1
            if msg.offset < self._next_offsets.get(tp, 0):
                self.metrics.rejected_records.labels(reason="duplicate").inc()
                continue
            out.offsets[tp] = max(out.offsets.get(tp, 0), msg.offset + 1)
            fresh.append(msg)
        for topic, n in consumed.items():
            self.metrics.records_consumed.labels(topic=topic).inc(n)
        rejected: list[tuple[BusMessage, RejectedRecord]] = []
        if self._scheduler is not None:
            fresh = self._decode_scheduler(fresh, out, rejected)
        batch = decode_batch(fresh, self.topics)
        self.metrics.decode_fallbacks.inc(batch.fallbacks)
        for msg, exc in [*rejected, *batch.rejected]:
            self.metrics.rejected_records.labels(reason=exc.reason).inc()
            log.warning(
                "analytics_record_rejected",
                extra={
                    "reason": exc.reason,
                    "detail": exc.detail,
                    "messaging.destination.name": msg.topic,
                    "messaging.kafka.destination.partition": msg.partition,
                    "messaging.kafka.message.offset": msg.offset,
                },
            )
        scrapes = out.scrapes = batch.scrapes
        found: list[tuple[GpuRecord | GpuObservation, BusMessage, bool]] = [
            (r, m, False) for r, m in zip(batch.gpu, batch.gpu_msgs, strict=True)
        ]
        if scrapes.msgs:
            per_gpu = itertools.chain.from_iterable(
                itertools.repeat(m, n) for m, n in zip(scrapes.msgs, scrapes.counts, strict=True)
            )
            # what the classifier reads of each GPU, not whole samples
            observed = scrapes.observations()
            from_scrapes: list[tuple[GpuRecord | GpuObservation, BusMessage, bool]] = [
                (r, m, True) for r, m in zip(observed, per_gpu, strict=True)
            ]
            if found:  # both kinds in one batch: in the batch's order
                index = {id(m): i for i, m in enumerate(fresh)}
                found = sorted([*found, *from_scrapes], key=lambda rm: index[id(rm[1])])
            else:
                found = from_scrapes
        for raw, msg, in_scrape in found:
            record, stand_in = self._identities.resolve(raw)  # one key per GPU (analytics.identity)
            if stand_in is not None:
                out.renames.append((stand_in, record.key, record.gpu_uuid or ""))
            out.gpu.append(record)
            if in_scrape:
                out.scrape_uuid.append(record.gpu_uuid)
            elif not isinstance(record, GpuObservation):
                out.gpu_rows.append(record)
                out.gpu_pos.append((msg.partition, msg.offset))
            tp = TopicPartition(msg.topic, msg.partition)
            self._partition_of[record.key] = tp
            self._own_host(tp, record.host)
            if self._scheduler is not None:
                self._scheduler.note_gpu(record.key, record.gpu_index)
            if traced:  # the newest sample's context (none if it carried none)
                if msg.headers:
                    self._trace_headers[record.key] = msg.headers
                else:
                    self._trace_headers.pop(record.key, None)
        out.ib = batch.ib
        out.ib_pos = [(msg.partition, msg.offset) for msg in batch.ib_msgs]
        for ib_record, msg in zip(batch.ib, batch.ib_msgs, strict=True):
            self._own_host(TopicPartition(msg.topic, msg.partition), ib_record.host)
        return out

    def _decode_scheduler(
        self, msgs: list[BusMessage], out: _Decoded, rejected: list[tuple[BusMessage, RejectedRecord]]
    ) -> list[BusMessage]:
        """Decode the ``telemetry.scheduler`` records of ``msgs`` into ``out.scheduler`` (their
        rejections into ``rejected``); return the other messages."""
        rest = []
        for msg in msgs:
            if msg.topic != self.topics.telemetry_scheduler:
                rest.append(msg)
                continue
            try:
                record = decode_telemetry(msg, self.topics)
            except RejectedRecord as exc:
                rejected.append((msg, exc))
                continue
            if isinstance(record, SchedulerNode):
                out.scheduler.append((record, msg.partition, msg.offset))
                self._own_host(TopicPartition(msg.topic, msg.partition), record.host)
        return rest

    def _observe_scheduler(self, records: list[tuple[SchedulerNode, int, int]]) -> pa.Table | None:
        """Hold each scheduler record as its host's state; the ``scheduler_gpu_samples`` rows of
        them (with the state each GPU has now), ``None`` when there is none."""
        join = self._scheduler
        if join is None or not records:
            return None
        statuses = list(self._classifier.statuses().values())
        rows = []
        for record, partition, offset in records:
            join.observe(record)
            rows.append((record, partition, offset, join.states_by_index(record.host, statuses)))
        try:
            return scheduler_gpus_table(rows)
        except (ValueError, pa.ArrowException) as exc:
            self.metrics.rejected_records.labels(reason="unstorable").inc(len(rows))
            log.warning("analytics_scheduler_unstorable", extra={"error": repr(exc)})
            return None

    def _update(self, st: GpuStatus) -> CapacityUpdate:
        headroom = self._headroom.get(st.host)
        leaf = self._leaves.leaf_of.get(st.host)
        figures = self._leaf_headroom.get(leaf) if leaf is not None else None
        leaf_room = figures.headroom if figures is not None else None
        reason = self._block_reason(st)
        plan = self._planned_start(st)
        if reason is not None:
            return CapacityUpdate(
                ts=st.ts,
                host=st.host,
                gpu_uuid=st.gpu_uuid,
                gpu_instance_id=st.gpu_instance_id,
                model_name=st.model_name,
                state=GpuState.UNKNOWN,
                since=self._blocked_since.get(st.key, st.ts),
                reason=reason,
                fb_total_mib=st.fb_total_mib,
                headroom=headroom,
                pool=self.pool,
                leaf=leaf,
                leaf_headroom=leaf_room,
                planned_start=plan,
            )
        until = confidence = None
        if st.state is GpuState.IDLE:
            pred = self._predictor.predict(st.key, st.since, st.ts, pool=self.pool)
            until, confidence = pred.idle_until, pred.confidence * st.confidence_factor
            planned = self._scheduler.window_end(st.host) if self._scheduler is not None else None
            if until is not None and planned is not None:
                until = min(until, planned)  # never past a pending job's planned start on the node
        return CapacityUpdate(
            ts=st.ts,
            host=st.host,
            gpu_uuid=st.gpu_uuid,
            gpu_instance_id=st.gpu_instance_id,
            model_name=st.model_name,
            state=st.state,
            since=st.since,
            grade=st.grade,
            predicted_idle_until=until,
            confidence=confidence,
            reason=st.reason,
            fb_total_mib=st.fb_total_mib,
            headroom=headroom,
            pool=self.pool,
            leaf=leaf,
            leaf_headroom=leaf_room,
            planned_start=plan,
        )

    def _planned_start(self, st: GpuStatus) -> float | None:
        """The planned start of the pending job the scheduler plans GPU ``st`` for, once it is
        within the plan lead of the clock's now
        (:meth:`analytics.scheduler.SchedulerJoin.planned_start`), in any state; ``None``
        without the scheduler joined."""
        return self._scheduler.planned_start(st, self._clock()) if self._scheduler is not None else None

    def _due_updates(self, now: float) -> list[CapacityUpdate]:
        due: list[CapacityUpdate] = []
        for key, st in self._classifier.statuses().items():
            if st.state is GpuState.IDLE:
                self._seen_idle.add(key)
            blocked = self._blocked(st)
            if blocked:
                self._blocked_since.setdefault(key, st.ts)
            else:
                self._blocked_since.pop(key, None)
            state, grade = (GpuState.UNKNOWN, None) if blocked else (st.state, st.grade)
            last = self._published.get(key)
            if (
                last is None
                or last.state is not state
                or last.grade != grade
                or last.leaf != self._leaves.leaf_of.get(st.host)  # a new topology: at once
                or last.planned_start != self._planned_start(st)  # a plan onto it: leases at risk at once
                or now - self._published_at.get(key, float("-inf")) >= self._refresh_s
            ):
                due.append(self._update(st))
        return due

    async def _publish(self, producer: Producer, updates: list[CapacityUpdate], now: float) -> None:
        if not updates:
            return
        try:
            for update in updates:
                await self._send_update(producer, update)
            await producer.flush()
        except Exception as exc:  # noqa: BLE001 — counted; the updates stay due for the next step
            self.metrics.publish_failures.inc()
            log.warning("analytics_publish_failed", extra={"error": repr(exc), "updates": len(updates)})
            return
        for update in updates:
            self._published[update.key] = update
            self._published_at[update.key] = now
            self.metrics.capacity_updates.labels(state=update.state.value).inc()

    async def _send_update(self, producer: Producer, update: CapacityUpdate) -> None:
        """Send one update to ``capacity``; traced as the module docstring says when it changes
        the GPU's state or grade and the GPU's newest sample carried a trace context."""
        parent = self._decided_by(update)
        if parent is None:
            await producer.send(self.topics.capacity, encode(update), key=update.key)
            return
        attrs = tracing.messaging_attributes(
            tracing.KAFKA, "process", self.topics.telemetry_gpu, key=update.key, consumer_group=self._group_id
        )
        attrs.update({"hw.id": update.gpu_uuid, "hw.type": "gpu", "host.name": update.host})
        attrs.update({"gpupool.gpu.state": update.state.value, "gpupool.gpu.reason": update.reason})
        if update.model_name:
            attrs["hw.model"] = update.model_name
        with _TRACER.start_as_current_span(
            f"process {self.topics.telemetry_gpu}",
            context=parent,
            kind=tracing.SpanKind.CONSUMER,
            start_time=self._step_started_ns or None,
            attributes=attrs,
        ), _TRACER.start_as_current_span(
            f"send {self.topics.capacity}",
            kind=tracing.SpanKind.PRODUCER,
            attributes=tracing.messaging_attributes(
                tracing.KAFKA, "send", self.topics.capacity, key=update.key, client_id=self._client_id
            ),
        ) as send:
            await producer.send(
                self.topics.capacity, encode(update), key=update.key, headers=tracing.inject_headers(send)
            )

    def _decided_by(self, update: CapacityUpdate) -> Context | None:
        """The trace context of the sample that decided ``update``, or ``None`` when tracing is off,
        the update is a refresh (same state and grade as last published) or a stale decision, or
        the GPU's newest sample carried no valid context."""
        if not tracing.enabled() or update.reason == "stale":
            return None
        headers = self._trace_headers.get(update.key)
        last = self._published.get(update.key)
        if headers is None:
            return None
        if last is not None and last.state is update.state and last.grade == update.grade:
            return None  # a refresh
        return tracing.extract_context(headers)

    def _update_gauges(self) -> None:
        """Take this service's capacity snapshot (and the scheduler's allocated idle GPUs) for
        the gauges read at scrape time."""
        statuses = self._classifier.statuses().values()
        idle: Counter[tuple[str, str]] = Counter()
        memory: Counter[tuple[str, str]] = Counter()
        for st in statuses:
            if st.state is GpuState.IDLE:
                label = (st.model_name or "unknown", st.grade.value if st.grade else "unknown")
                idle[label] += 1
                memory[label] += (st.fb_total_mib or 0) * 1024 * 1024
        self._capacity = CapacitySnapshot(
            pool=self.pool,
            states=Counter(st.state.value for st in statuses),
            models=frozenset(st.model_name or "unknown" for st in statuses),
            idle=idle,
            idle_memory_bytes=memory,
        )
        if self._scheduler is not None:
            self._allocated_idle = self._scheduler.allocated_idle(statuses)


def _gpu_table(decoded: _Decoded, metrics: AnalyticsMetrics) -> pa.Table | None:
    """``gpu_samples`` rows of a decoded batch: its scrape records' GPUs a column at a time
    (:func:`analytics.rows.gpu_scrapes_table`, with the resolved UUIDs) and its per-sample
    records' (:func:`analytics.rows.gpu_samples_table`). If the scrape rows cannot be built as a
    whole, they are built from their samples like per-sample records (:func:`_safe_table`: a GPU
    that cannot be stored is dropped and counted, the others stay)."""
    tables: list[pa.Table] = []
    scrapes = decoded.scrapes
    if scrapes.msgs:
        msgs = scrapes.msgs
        try:
            tables.append(
                gpu_scrapes_table(
                    scrapes,
                    [m.partition for m in msgs],
                    [m.offset for m in msgs],
                    gpu_uuid=decoded.scrape_uuid,
                )
            )
        except Exception:  # noqa: BLE001 — built again GPU by GPU below
            positions = [
                (m.partition, m.offset) for m, n in zip(msgs, scrapes.counts, strict=True) for _ in range(n)
            ]
            resolved = [
                with_uuid(s, u) if u else s
                for s, u in zip(scrapes.samples(GpuRecord), decoded.scrape_uuid, strict=True)
            ]
            table = _safe_table(gpu_samples_table, resolved, positions, metrics)
            if table is not None:
                tables.append(table)
    legacy = _safe_table(gpu_samples_table, decoded.gpu_rows, decoded.gpu_pos, metrics)
    if legacy is not None:
        tables.append(legacy)
    if not tables:
        return None
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _safe_table(
    build: Callable[[Sequence[_R], Sequence[int], Sequence[int]], pa.Table],
    records: list[_R],
    positions: list[tuple[int, int]],
    metrics: AnalyticsMetrics,
) -> pa.Table | None:
    """Arrow table of ``records``; if the batch cannot be converted, convert record by record and
    drop (count as ``unstorable`` in ``metrics``) the ones that fail, so one bad record cannot block
    a partition."""
    if not records:
        return None
    try:
        return build(records, [p for p, _ in positions], [o for _, o in positions])
    except Exception:  # noqa: BLE001 — retried record by record below
        good: list[pa.Table] = []
        for record, (partition, offset) in zip(records, positions, strict=True):
            try:
                good.append(build([record], [partition], [offset]))
            except Exception as exc:  # noqa: BLE001 — counted as unstorable; one bad record cannot block a partition
                metrics.rejected_records.labels(reason="unstorable").inc()
                log.warning(
                    "analytics_record_unstorable",
                    extra={
                        "error": repr(exc),
                        "messaging.kafka.destination.partition": partition,
                        "messaging.kafka.message.offset": offset,
                    },
                )
        return pa.concat_tables(good) if good else None
