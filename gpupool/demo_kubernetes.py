"""Lending through a Kubernetes cluster in the demo's pipeline (the harvest replay on Kubernetes,
``bench/harvest.py --scheduler kubernetes``).

:class:`KubernetesParts` is :class:`gpupool.demo_slurm.SlurmParts` for a cluster someone else
runs (``DemoConfig.kubeconfig``; the harvest replay submits the training Jobs,
:mod:`simulator.kubernetes_replay`):

* the collectors' Kubernetes source (:class:`collectors.kube_collector.KubernetesCollector`:
  nodes, pods and Kueue's workloads into ``telemetry.scheduler``, Kueue's pending workloads as the
  demand);
* the broker's :class:`broker.lending_kubernetes.KubernetesLending` (one-GPU placeholder pods in
  ``gpupool-lent``, kube-scheduler's priority preemption with the notice as grace period), its
  slots keyed by the fleet's GPU UUIDs as DCGM reports them;
* a :class:`gpupool.demo_slurm.TrainingStream` fed every ``poll_s`` with the node records the
  source builds from its caches (:func:`record_jobs`): the fleet's DCGM telemetry follows the
  GPUs training pods hold, and the training starts are recorded for the harvest figures.

GPU identity: a pod states a GPU count, not devices; the slot of each pod's GPUs is the
source's (:func:`collectors.kube_records.assign_slots`: lent pods their own slot, the others the
lowest free slots in order of creation), so telemetry, the records analytics reads and the
broker's keys agree. No site workload runs (kwok runs no containers; a claim naming one
is refused), so the sites claim GPUs only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from collectors.kube_records import build_node_records
from collectors.slurm_parse import JobInfo
from contracts.scheduler import SchedulerNode
from gpupool.demo_slurm import TrainingStream

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from broker.lending_kubernetes import KubernetesLending
    from collectors.kube_collector import KubernetesCollector
    from contracts import KafkaTopics
    from contracts.bus import Bus
    from simulator.fleet import Fleet


@dataclass(frozen=True)
class KubeCluster:
    """A Kubernetes cluster someone else runs (and stops): its kubeconfig and the notice the
    lent pods get as their termination grace period, seconds."""

    kubeconfig: Path
    notice_s: float

    def close(self) -> None:
        """Nothing: whoever runs the cluster stops it."""


def record_jobs(records: Iterable[SchedulerNode]) -> list[JobInfo]:
    """The jobs holding GPUs in the Kubernetes source's node records
    (:func:`collectors.kube_records.build_node_records`), as
    :meth:`gpupool.demo_slurm.TrainingStream.observe` folds them: one per ``job_id``
    (``<namespace>/<Job name or pod name>``; each of gpupool's lent pods its own, named
    :data:`contracts.scheduler.LENT_JOB_NAME`), ``RUNNING`` (a bound pod holds its GPUs), with its
    GPU slots by node."""
    held: dict[str, tuple[str | None, str | None, str | None, dict[str, list[int]]]] = {}
    for r in records:
        for g in r.gpus:
            if g.allocated and g.job_id is not None:
                *_, by_node = held.setdefault(g.job_id, (g.job_name, g.user, g.partition, {}))
                by_node.setdefault(r.host, []).append(g.index)
    return [
        JobInfo(
            job_id,
            name,
            user,
            partition,
            "RUNNING",
            None,
            {h: tuple(sorted(ix)) for h, ix in by_node.items()},
        )
        for job_id, (name, user, partition, by_node) in held.items()
    ]


class PodStream(TrainingStream):
    """A :class:`gpupool.demo_slurm.TrainingStream` that reads the node records the Kubernetes
    ``source`` would send, built from its caches (no API call), instead of Slurm, and submits
    nothing (the harvest replay does)."""

    def __init__(
        self,
        source: KubernetesCollector,
        compression: float,
        out_dir: Path,
        gpu_keys: Mapping[tuple[str, int], str],
        poll_s: float,
    ) -> None:
        super().__init__(None, (), compression, out_dir, gpu_keys, poll_s)
        self.source = source

    async def _poll(self) -> None:
        if not (self.source.nodes.synced and self.source.pods.synced):
            return
        t = time.time()
        records, _ = build_node_records(
            self.source.nodes.snapshot(), self.source.pods.snapshot(), [], {}, {}, ts=t
        )
        self.observe(t, record_jobs(records))

    def cancel_all(self, timeout_s: float = 30.0) -> None:
        """Nothing: the stream submitted nothing, and the lending deletes its own pods
        (``timeout_s`` is unused)."""


@dataclass
class KubernetesParts:
    """What lending through Kubernetes adds to the demo's pipeline (:meth:`build`); the same
    attributes as :class:`gpupool.demo_slurm.SlurmParts` (``workload`` is None: no site
    workload runs here)."""

    cluster: KubeCluster
    stream: PodStream
    source: KubernetesCollector
    lending: KubernetesLending
    workload: None
    notice_s: float
    poll_s: float
    locate: dict[str, tuple[str, int]]

    @classmethod
    def build(
        cls,
        cluster: KubeCluster,
        fleet: Fleet,
        bus: Bus,
        topics: KafkaTopics,
        registry: CollectorRegistry,
        out_dir: Path,
        *,
        load: float,
        compression: float,
        seed: int,
        horizon_s: float,
        poll_s: float = 0.5,
        submit: bool = True,
    ) -> KubernetesParts:
        """Wire the parts for ``fleet`` (its hosts are the cluster's kwok nodes; its telemetry
        starts following the training pods). ``load``, ``seed`` and ``horizon_s`` are unused:
        nothing is submitted. Raises ``ValueError`` when ``submit`` is True (the demo submits no
        training Jobs to Kubernetes), or for an unreadable kubeconfig."""
        from broker.lending_kubernetes import KubernetesLending
        from broker.placeholders import GpuMap
        from collectors.kube_collector import KubernetesCollector
        from collectors.metrics import KubernetesMetrics
        from runtime.kube import kubernetes_client

        if submit:
            raise ValueError("through Kubernetes the demo only follows training Jobs someone else submits")
        keys = {(g.host, g.index): g.key for g in fleet.gpus()}
        source = KubernetesCollector(
            bus, topics, kubernetes_client(cluster.kubeconfig), metrics=KubernetesMetrics(registry)
        )
        stream = PodStream(
            source,
            compression,
            out_dir / "training",
            keys,
            poll_s,
        )
        fleet.follow_scheduler(stream.history)
        lending = KubernetesLending(
            kubernetes_client(cluster.kubeconfig), notice_s=cluster.notice_s, poll_s=0.25
        )
        lending.gpu_map = GpuMap({h: [fleet.gpu(h, i).uuid for i in range(fleet.gpus_per_node)]
                                  for h in fleet.hosts()})  # fmt: skip
        return cls(
            cluster,
            stream,
            source,
            lending,
            None,
            cluster.notice_s,
            poll_s,
            {k: hi for hi, k in keys.items()},
        )

    async def close(self) -> None:
        """Nothing to cancel (see :meth:`PodStream.cancel_all`)."""
        await asyncio.to_thread(self.stream.cancel_all)
