"""The Kubernetes source: read the cluster's GPUs, pods and Kueue's queue, produce per-node state to
``telemetry.scheduler``, in the records the Slurm source emits.

:class:`KubernetesCollector` keeps one :class:`collectors.kube_watch.Informer` (list + watch,
resourceVersion, relist on 410) per kind: Nodes, Pods (all namespaces), and, with Kueue
(``kueue=True``), ``kueue.x-k8s.io/v1beta2`` Workloads, LocalQueues and ClusterQueues. Each
:meth:`~KubernetesCollector.collect` builds one :class:`contracts.scheduler.SchedulerNode` per
node from the caches (:mod:`collectors.kube_records`: GPUs held by pods by slot, gpupool's own
lent pods as :data:`contracts.scheduler.LENT_JOB_NAME`, pending pods and Kueue workloads as
pending jobs) and produces them keyed by host.

Failures never escape :meth:`~KubernetesCollector.collect`: while a cache is not synced with
the API server (never listed, or its watch failed: unreachable, refused, 403...) the read fails
and produces nothing (a node record without its pods would show held GPUs as free), counted in
``gpupool_collector_kubernetes_reads_total{outcome="failed"}``, the cause in
``gpupool_collector_kubernetes_errors_total{resource,reason}``, logged when it starts or changes.
Objects that do not parse are skipped and counted.

It needs read access only (``deploy/kubernetes/collector/collector.yaml``): ``get``/``list``/
``watch`` on nodes and pods, and on Kueue's workloads, localqueues and clusterqueues.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kubernetes import client

from collectors.kube_parse import (
    NodeInfo,
    PodInfo,
    WorkloadInfo,
    parse_cluster_queue,
    parse_local_queue,
    parse_node,
    parse_pod,
    parse_workload,
)
from collectors.kube_records import build_node_records, pending_gpus
from collectors.kube_watch import Informer
from collectors.scheduler_source import ReadFailures, produce_records, run_every
from collectors.metrics import KubernetesMetrics
from contracts.bus import Bus, Producer, require_topics
from contracts.scheduler import SchedulerNode
from contracts.topics import KafkaTopics

__all__ = ["KUEUE_GROUP", "KUEUE_VERSION", "KubernetesCollector", "KubernetesRead"]

log = logging.getLogger(__name__)

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
"""Kueue's API version read (Kueue v0.17; served by every Kueue since v0.15)."""


@dataclass(slots=True)
class KubernetesRead:
    """What one :meth:`KubernetesCollector.collect` did.

    Attributes:
        ok: every cache was synced and records were built.
        failure: ``resource:reason`` of the first cache not synced, ``None`` when ``ok``.
        records: the node records built (produced when ``ok``).
        overflow: pods that did not fit their node's GPUs (counted ``over_allocated``).
        produced: records the producer accepted.
        duration_s: wall time of the read.
    """

    ok: bool = False
    failure: str | None = None
    records: list[SchedulerNode] = field(default_factory=list)
    overflow: int = 0
    produced: int = 0
    duration_s: float = 0.0


class KubernetesCollector:
    """Reads a Kubernetes cluster (list + watch) and produces :class:`SchedulerNode` records every
    ``interval_s`` of :meth:`run` (module docstring).

    Args:
        bus: where records go.
        topics: topic names (``telemetry_scheduler``).
        api: a client of the cluster (:func:`runtime.kube.kubernetes_client`).
        lent_namespace: the broker's lent namespace (``[broker] k8s_namespace``): its gpupool pods
            are gpupool's holds.
        resource: the GPUs' extended resource.
        kueue: also read Kueue's Workloads, LocalQueues and ClusterQueues (their CRDs must exist).
        client_id: the producer's client id.
        clock: wall clock for the records' ``ts`` (Unix s).
        metrics: where it counts (``gpupool_collector_kubernetes_*``); ``None``: new ones on a
            registry of their own.
    """

    def __init__(
        self,
        bus: Bus,
        topics: KafkaTopics,
        api: client.ApiClient,
        *,
        lent_namespace: str = "gpupool-lent",
        resource: str = "nvidia.com/gpu",
        kueue: bool = True,
        client_id: str = "gpupool-collector-kubernetes",
        clock: Callable[[], float] = time.time,
        metrics: KubernetesMetrics | None = None,
    ) -> None:
        self._bus = bus
        self._topics = topics
        self._client_id = client_id
        self._clock = clock
        self._producer: Producer | None = None
        self._seq = 0
        self._failures = ReadFailures("kubernetes")
        self._pending: dict[str, int] = {}
        self.metrics = metrics if metrics is not None else KubernetesMetrics()
        self.metrics.watch_pending(lambda: {(q,): n for q, n in self._pending.items()})
        core = client.CoreV1Api(api)
        custom = client.CustomObjectsApi(api)
        count = self._count
        self.nodes: Informer[NodeInfo] = Informer(
            "nodes", core.list_node, partial(parse_node, resource=resource), count
        )
        self.pods: Informer[PodInfo] = Informer(
            "pods", core.list_pod_for_all_namespaces,
            partial(parse_pod, resource=resource, lent_namespace=lent_namespace), count,
        )  # fmt: skip
        self.kueue = kueue
        kueue_list = partial(custom.list_cluster_custom_object, KUEUE_GROUP, KUEUE_VERSION)
        self.workloads: Informer[WorkloadInfo] = Informer(
            "workloads", partial(kueue_list, "workloads"), partial(parse_workload, resource=resource), count
        )
        self.local_queues: Informer[tuple[str, str, str]] = Informer(
            "localqueues", partial(kueue_list, "localqueues"), parse_local_queue, count
        )
        self.cluster_queues: Informer[tuple[str, int]] = Informer(
            "clusterqueues", partial(kueue_list, "clusterqueues"), partial(parse_cluster_queue, resource=resource),
            count,
        )  # fmt: skip

    def _count(self, resource: str, reason: str) -> None:
        self.metrics.errors.labels(resource=resource, reason=reason).inc()

    @property
    def informers(self) -> list[Informer[Any]]:
        """The caches this source reads (Kueue's only with ``kueue``)."""
        kinds: list[Informer[Any]] = [self.nodes, self.pods]
        if self.kueue:
            kinds += [self.workloads, self.local_queues, self.cluster_queues]
        return kinds

    async def start(self) -> None:
        """Check that ``telemetry.scheduler`` exists, start the producer and the watches. Raises
        :class:`contracts.bus.MissingTopicsError` if the topic is missing and what the bus's
        producer raises when it cannot start."""
        if self._producer is None:
            await require_topics(self._bus, [self._topics.telemetry_scheduler])
            producer = self._bus.producer(self._client_id)
            await producer.start()
            self._producer = producer
        for informer in self.informers:
            informer.start()

    async def stop(self) -> None:
        """Stop the watches, flush and stop the producer (idempotent)."""
        await asyncio.gather(*(asyncio.to_thread(i.stop) for i in self.informers))
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                await producer.flush()
            finally:
                await producer.stop()

    def synced(self) -> bool:
        """Every cache holds the API server's state (listed, watch not failed since)."""
        return all(i.synced for i in self.informers)

    def build(self) -> tuple[list[SchedulerNode], int, dict[str, int]]:
        """Records of the caches now: ``(records, pods that did not fit, pending GPUs by
        ClusterQueue)``; no API call. Raises ``RuntimeError`` naming ``resource:reason`` when a
        cache is not synced."""
        for informer in self.informers:
            failure = informer.failure
            if failure is not None:
                raise RuntimeError(f"{informer.resource}:{failure}")
        nodes = sorted(self.nodes.snapshot(), key=lambda n: n.name)
        pods = self.pods.snapshot()
        workloads = self.workloads.snapshot() if self.kueue else []
        local_queues = {(ns, name): cq for ns, name, cq in self.local_queues.snapshot()} if self.kueue else {}
        quotas = dict(self.cluster_queues.snapshot()) if self.kueue else {}
        records, overflow = build_node_records(
            nodes, pods, workloads, local_queues, quotas, ts=self._clock(), seq_start=self._seq
        )
        self._seq += len(records)
        pending = pending_gpus(pods, workloads, local_queues)
        return records, len(overflow), pending

    async def collect(self) -> KubernetesRead:
        """Build the records from the caches and produce them (module docstring); never raises
        for a cluster failure (counted, see :class:`KubernetesRead`).

        Raises:
            RuntimeError: :meth:`start` was not awaited.
        """
        if self._producer is None:
            raise RuntimeError("KubernetesCollector is not started")
        t0 = time.monotonic()
        result = KubernetesRead()
        try:
            records, overflow, pending = self.build()
        except RuntimeError as exc:
            result.failure = str(exc)
            self.metrics.reads.labels(outcome="failed").inc()
            self._failures.failed(result.failure)
            result.duration_s = time.monotonic() - t0
            self.metrics.read_duration.observe(result.duration_s)
            return result
        self._failures.ok()
        if overflow:
            self.metrics.errors.labels(resource="pods", reason="over_allocated").inc(overflow)
        result.ok, result.records, result.overflow = True, records, overflow
        self._pending = pending
        result.produced = await produce_records(self._producer, self._topics.telemetry_scheduler, records, self._failed)
        self.metrics.reads.labels(outcome="ok").inc()
        self.metrics.records.inc(result.produced)
        result.duration_s = time.monotonic() - t0
        self.metrics.read_duration.observe(result.duration_s)
        return result

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        """:meth:`collect` every ``interval_s`` seconds (start to start) until ``stop`` is set; an
        unexpected exception of a read is logged and counted (``resource="loop"``), never raised."""
        await run_every(self.collect, interval_s, stop, self._failed)

    def _failed(self, where: str, exc: BaseException) -> None:
        """Count a failure reported by :mod:`collectors.scheduler_source` (``where``: ``produce``
        or ``loop``)."""
        self.metrics.errors.labels(resource=where, reason=type(exc).__name__).inc()
