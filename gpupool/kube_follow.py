"""Simulated DCGM telemetry that follows training pods on Kubernetes, as the Slurm demo's follows
Slurm's jobs.

:class:`PodFollower` watches the cluster's Nodes and Pods (:class:`collectors.kube_watch.Informer`,
list + watch) and, every ``poll_s``, folds which GPUs pods other than gpupool's hold into an
:class:`gpupool.demo_slurm.AllocationHistory`; give it to
:meth:`simulator.fleet.Fleet.follow_scheduler` and each simulated GPU a training pod holds reports
its trace's duty cycle (at least :data:`simulator.fleet.FOLLOW_BUSY_PCT`), every other one 0 %.

GPU identity: kwok nodes have no kubelet, so no device plugin and no PodResources API to say
which device a pod got. The follower uses the Kubernetes source's own slot mapping
(:func:`collectors.kube_records.build_node_records`: gpupool's pods at their
``gpupool.io/slot``, other pods the lowest free slots in creation order), so the telemetry's GPU
index ``i`` is busy exactly when the scheduler records that analytics reads say slot ``i`` is
held. On a real cluster the device is the one the device plugin allocated: dcgm-exporter's pod
labels (``--kubernetes``, from the kubelet's PodResources ``List``) say which pod uses which GPU,
and slot = device index only holds once the collector reads those device ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Mapping
from functools import partial

from kubernetes import client

from collectors.kube_parse import NodeInfo, PodInfo, parse_node, parse_pod
from collectors.kube_records import build_node_records
from collectors.kube_watch import Informer
from contracts.scheduler import LENT_JOB_NAME
from gpupool.demo_slurm import AllocationHistory

__all__ = ["PodFollower"]


class PodFollower:
    """Which simulated GPUs training pods hold, over time (module docstring).

    Args:
        api: a client of the cluster (read access to nodes and pods).
        gpu_keys: ``(node, GPU index)`` → the simulated GPU's key (nodes outside it are ignored).
        lent_namespace: the broker's lent namespace (gpupool's pods there are not training).
        resource: the GPUs' extended resource.
        poll_s: seconds between two folds of the caches into :attr:`history`.
    """

    def __init__(
        self,
        api: client.ApiClient,
        gpu_keys: Mapping[tuple[str, int], str],
        *,
        lent_namespace: str = "gpupool-lent",
        resource: str = "nvidia.com/gpu",
        poll_s: float = 0.5,
    ) -> None:
        self.gpu_keys = dict(gpu_keys)
        self.poll_s = poll_s
        self.history = AllocationHistory(len(self.gpu_keys))
        """``history(gpu_key, at) -> bool``: held by a training pod at wall time ``at``."""
        self.errors: Counter[tuple[str, str]] = Counter()
        """Failed lists or watches and rejected objects, by ``(resource, reason)``."""
        core = client.CoreV1Api(api)
        self.nodes: Informer[NodeInfo] = Informer(
            "nodes", core.list_node, partial(parse_node, resource=resource), self._error
        )
        self.pods: Informer[PodInfo] = Informer(
            "pods",
            core.list_pod_for_all_namespaces,
            partial(parse_pod, resource=resource, lent_namespace=lent_namespace),
            self._error,
        )

    def _error(self, resource: str, reason: str) -> None:
        self.errors[(resource, reason)] += 1

    def held(self) -> frozenset[str] | None:
        """Keys of the simulated GPUs training pods hold now, by the caches; ``None`` while a cache
        is not synced with the API server."""
        if not (self.nodes.synced and self.pods.synced):
            return None
        records, _ = build_node_records(
            self.nodes.snapshot(), self.pods.snapshot(), [], {}, {}, ts=time.time()
        )
        return frozenset(
            self.gpu_keys[(r.host, g.index)]
            for r in records
            for g in r.gpus
            if g.allocated and g.job_name != LENT_JOB_NAME and (r.host, g.index) in self.gpu_keys
        )

    def observe(self) -> bool:
        """Fold the caches into :attr:`history` now; False (nothing added: the last fold stands)
        while a cache is not synced."""
        held = self.held()
        if held is None:
            return False
        self.history.add(time.time(), held)
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Watch and fold every ``poll_s`` until ``stop`` is set, then stop watching."""
        self.nodes.start()
        self.pods.start()
        try:
            while not stop.is_set():
                self.observe()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_s)
        finally:
            await asyncio.gather(asyncio.to_thread(self.nodes.stop), asyncio.to_thread(self.pods.stop))
