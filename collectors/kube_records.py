"""Kubernetes nodes, pods and Kueue workloads (:mod:`collectors.kube_parse`) →
:class:`contracts.scheduler.SchedulerNode`, the records the Slurm source emits.

Per node (Slurm terms, so analytics and the broker need no Kubernetes knowledge):

* *State*: a node whose ``Ready`` condition is not ``True`` is ``DOWN`` (plus
  ``NOT_RESPONDING`` when ``Unknown``: the node controller lost it); a cordoned node
  (``spec.unschedulable``) has the ``DRAIN`` flag; otherwise ``IDLE``, ``MIXED`` or
  ``ALLOCATED`` by its GPUs held.
* *GPUs*: indices ``0 .. allocatable - 1``. A pod states a GPU count, not devices (the device
  plugin's choice is only in the kubelet's PodResources API, which this source does not read),
  so the index of a pod's GPU is a *slot* (:func:`assign_slots`): gpupool's own lent pods hold
  the slot of their ``gpupool.io/slot`` label (the broker's GPU key ``<node>/gpu<slot>``), and
  the other pods holding GPUs on the node take the lowest free slots in order of creation
  (``creationTimestamp``, namespace, name). The mapping is deterministic from the pods alone;
  when an earlier pod ends, later pods' slots can move down. On a cluster with a device plugin,
  the slot is not the device: there the PodResources API gives each pod's device ids.
* *Holders*: a GPU a lent pod holds has ``job_name`` :data:`contracts.scheduler.LENT_JOB_NAME`
  (lendable for analytics, as the Slurm source's placeholders); any other pod's has ``job_id``
  ``<namespace>/<Job name or pod name>``, ``user`` its namespace (Kubernetes has no job owner;
  the namespace is the tenant) and ``partition`` its Kueue ClusterQueue (through its LocalQueue
  label, else its Job's Workload), else ``None``.
* *Pending demand*, as :class:`contracts.scheduler.PendingJob`:

  - a pending pod (not bound, not gated) that kube-scheduler nominated to a node
    (``status.nominatedNodeName``: it is preempting there) is planned onto that node, starting
    at the read (``ts``); a pending pod pinned to nodes by name is listed on them without a plan;
  - a pending Kueue Workload (no quota reserved) is planned when it pins its pods to nodes and
    :func:`plan_workloads` can tell when its ClusterQueue will have the quota; otherwise it is
    listed on the nodes it pins, without a plan. A workload that pins no node is on no node
    record (counted by the source's pending-GPU gauge only), as a Slurm job without a node list.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from collectors.kube_parse import NodeInfo, PodInfo, WorkloadInfo
from contracts.scheduler import LENT_JOB_NAME, PendingJob, SchedulerGpu, SchedulerNode

__all__ = [
    "assign_slots",
    "build_node_records",
    "pending_gpus",
    "plan_workloads",
    "pod_job_id",
    "workload_cluster_queue",
]


def pod_job_id(pod: PodInfo) -> str:
    """``<namespace>/<Job name>`` of a Job's pod, else ``<namespace>/<pod name>``."""
    return f"{pod.namespace}/{pod.job or pod.name}"


def assign_slots(gpus: int, pods: Sequence[PodInfo]) -> tuple[dict[str, tuple[int, ...]], list[PodInfo]]:
    """GPU slots of the pods holding GPUs on one node of ``gpus`` GPUs (module docstring): lent
    pods take their own slot (when in range and not taken twice), the others the lowest free
    slots in order of creation. Returns ``({pod uid or namespace/name: slots}, pods that did not
    fit)``; a pod that does not fit gets none (the node reports more GPUs held than it has, which
    only happens while kube-scheduler's view and the node's disagree)."""
    out: dict[str, tuple[int, ...]] = {}
    taken: set[int] = set()
    later: list[PodInfo] = []
    overflow: list[PodInfo] = []
    for pod in pods:
        if pod.lent and pod.slot is not None and pod.gpus == 1 and pod.slot < gpus and pod.slot not in taken:
            taken.add(pod.slot)
            out[_pod_key(pod)] = (pod.slot,)
        else:
            later.append(pod)
    free = [i for i in range(gpus) if i not in taken]
    used = 0
    for pod in sorted(later, key=lambda p: (p.created, p.namespace, p.name)):
        if used + pod.gpus > len(free):
            overflow.append(pod)
            continue
        out[_pod_key(pod)] = tuple(free[used : used + pod.gpus])
        used += pod.gpus
    return out, overflow


def _pod_key(pod: PodInfo) -> str:
    return pod.uid or f"{pod.namespace}/{pod.name}"


def workload_cluster_queue(w: WorkloadInfo, local_queues: Mapping[tuple[str, str], str]) -> str | None:
    """The ClusterQueue of workload ``w``: its admission's, else its LocalQueue's
    (``local_queues[(namespace, name)]``), else ``None``."""
    if w.cluster_queue:
        return w.cluster_queue
    return local_queues.get((w.namespace, w.queue)) if w.queue else None


def plan_workloads(
    workloads: Sequence[WorkloadInfo],
    local_queues: Mapping[tuple[str, str], str],
    quotas: Mapping[str, int],
    now: float,
) -> dict[tuple[str, str], float]:
    """When each pending workload's ClusterQueue will have its GPUs (``(namespace, name)`` →
    Unix s), where that can be told; Kueue itself gives no start estimate.

    Per ClusterQueue of ``quotas`` (its nominal GPU quota): free = quota − GPUs of the
    workloads with quota reserved; those with an end (:attr:`WorkloadInfo.ends_by`, their
    maximum execution time) give their GPUs back then. Pending workloads are taken in Kueue's
    order (higher ``priority`` first, then older), each starting at the earliest time, not
    before ``now`` nor before the one taken before it, when free ≥ its GPUs; it then uses them
    (and gives them back at its own maximum execution time, if any). A workload asking more than
    the quota, or more than ever frees, has no estimate and uses nothing. Cohort borrowing and
    lending are not modelled (an estimate is later than Kueue may manage)."""
    by_cq: dict[str, list[WorkloadInfo]] = {}
    for w in workloads:
        cq = workload_cluster_queue(w, local_queues)
        if cq is not None and cq in quotas and not w.finished:
            by_cq.setdefault(cq, []).append(w)
    out: dict[tuple[str, str], float] = {}
    for cq, ws in by_cq.items():
        free = quotas[cq]
        ends: list[tuple[float, int]] = []
        for w in ws:
            if w.reserved:
                free -= w.gpus
                if w.ends_by is not None:
                    ends.append((w.ends_by, w.gpus))
        heapq.heapify(ends)
        t = now
        for w in sorted(
            (w for w in ws if w.pending), key=lambda w: (-w.priority, w.created, w.namespace, w.name)
        ):
            if w.gpus > quotas[cq]:
                continue
            given: list[tuple[float, int]] = []
            start, avail = t, free
            while avail < w.gpus and ends:
                end, g = heapq.heappop(ends)
                given.append((end, g))
                avail += g
                start = max(start, end)
            if avail < w.gpus:
                for item in given:
                    heapq.heappush(ends, item)
                continue
            out[(w.namespace, w.name)] = start
            t, free = start, avail - w.gpus
            if w.max_execution_s is not None:
                heapq.heappush(ends, (start + w.max_execution_s, w.gpus))
    return out


def _gpu(index: int, pod: PodInfo | None, partition: str | None) -> SchedulerGpu:
    """GPU ``index`` of a node, held by ``pod`` (``None``: free) of ClusterQueue ``partition``."""
    if pod is None:
        return SchedulerGpu(index=index)
    return SchedulerGpu(
        index=index,
        allocated=True,
        job_id=pod_job_id(pod),
        job_name=LENT_JOB_NAME if pod.lent else pod.job or pod.name,
        user=pod.namespace,
        partition=partition,
    )


class _Queues:
    """A pod's ClusterQueue: through its own LocalQueue label, else through the Workload of its Job
    (Kueue labels the Job, not its pods)."""

    def __init__(
        self, workloads: Sequence[WorkloadInfo], local_queues: Mapping[tuple[str, str], str]
    ) -> None:
        self.local_queues = local_queues
        self.by_job = {
            (w.namespace, w.job): cq
            for w in workloads
            if (cq := workload_cluster_queue(w, local_queues)) is not None
        }

    def of(self, pod: PodInfo) -> str | None:
        if pod.queue:
            return self.local_queues.get((pod.namespace, pod.queue))
        return self.by_job.get((pod.namespace, pod.job)) if pod.job else None


def pending_gpus(
    pods: Sequence[PodInfo], workloads: Sequence[WorkloadInfo], local_queues: Mapping[tuple[str, str], str]
) -> dict[str, int]:
    """GPUs asked by pending Kueue workloads and pending pods (not gpupool's), by ClusterQueue
    (``""``: none known); a queue without such demand is absent."""
    queues = _Queues(workloads, local_queues)
    out: dict[str, int] = {}
    for w in workloads:
        if w.pending and w.gpus:
            q = workload_cluster_queue(w, local_queues) or ""
            out[q] = out.get(q, 0) + w.gpus
    for p in pods:
        if p.pending and not p.lent:
            q = queues.of(p) or ""
            out[q] = out.get(q, 0) + p.gpus
    return out


def _node_state(node: NodeInfo, held: int) -> tuple[str, list[str]]:
    flags = []
    if node.ready != "True":
        base = "DOWN"
        if node.ready == "Unknown":
            flags.append("NOT_RESPONDING")
    elif held == 0:
        base = "IDLE"
    elif held >= node.gpus:
        base = "ALLOCATED"
    else:
        base = "MIXED"
    if node.cordoned:
        flags.append("DRAIN")
    return base, flags


def build_node_records(
    nodes: Sequence[NodeInfo],
    pods: Sequence[PodInfo],
    workloads: Sequence[WorkloadInfo],
    local_queues: Mapping[tuple[str, str], str],
    quotas: Mapping[str, int],
    *,
    ts: float,
    seq_start: int = 0,
) -> tuple[list[SchedulerNode], list[PodInfo]]:
    """One :class:`SchedulerNode` per node of ``nodes`` (in order), read at ``ts`` (Unix s),
    numbered from ``seq_start`` (module docstring for the rules); also the pods that did not fit
    their node (:func:`assign_slots`). ``local_queues``: ``(namespace, LocalQueue)`` →
    ClusterQueue; ``quotas``: ClusterQueue → nominal GPUs."""
    queues = _Queues(workloads, local_queues)
    on_node: dict[str, list[PodInfo]] = {}
    pending_on: dict[str, list[PendingJob]] = {}
    for pod in pods:
        if pod.holds and pod.node is not None:
            on_node.setdefault(pod.node, []).append(pod)
        elif pod.pending and not pod.lent:
            nodes_for = [pod.nominated] if pod.nominated else list(pod.pinned)
            rec = PendingJob(
                job_id=pod_job_id(pod),
                job_name=pod.job or pod.name,
                user=pod.namespace,
                partition=queues.of(pod),
                gpus=pod.gpus,
                reason="Nominated" if pod.nominated else "Unschedulable",
                planned_start=ts if pod.nominated else None,
                planned_nodes=[pod.nominated] if pod.nominated else [],
            )
            for host in nodes_for:
                pending_on.setdefault(host, []).append(rec)
    plans = plan_workloads(workloads, local_queues, quotas, ts)
    for w in workloads:
        if not w.pending or not w.gpus or not w.pinned:
            continue
        start = plans.get((w.namespace, w.name))
        rec = PendingJob(
            job_id=f"{w.namespace}/{w.job}",
            job_name=w.job,
            user=w.namespace,
            partition=workload_cluster_queue(w, local_queues),
            gpus=w.gpus,
            reason=w.reason or "Pending",
            planned_start=start,
            planned_nodes=list(w.pinned) if start is not None else [],
        )
        for host in w.pinned:
            pending_on.setdefault(host, []).append(rec)
    out: list[SchedulerNode] = []
    overflow: list[PodInfo] = []
    for n, node in enumerate(nodes):
        holders = on_node.get(node.name, [])
        slots, over = assign_slots(node.gpus, holders)
        overflow.extend(over)
        by_slot: dict[int, PodInfo] = {}
        for pod in holders:
            for i in slots.get(_pod_key(pod), ()):
                by_slot[i] = pod
        gpus = [_gpu(i, p, queues.of(p) if p else None) for i in range(node.gpus) for p in [by_slot.get(i)]]
        state, flags = _node_state(node, len(by_slot))
        out.append(
            SchedulerNode(
                ts=ts,
                host=node.name,
                scheduler="kubernetes",
                state=state,
                state_flags=flags,
                reason=node.reason,
                gpus=gpus,
                pending=pending_on.get(node.name, []),
                source="kube-apiserver",
                seq=seq_start + n,
            )
        )
    return out, overflow
