"""Leases in Kubernetes: placeholder pods fence lent GPUs, kube-scheduler's priority preemption
takes them back with the lease's notice as the termination grace period.

:class:`KubernetesLending` (``[broker] scheduler = "kubernetes"``) implements
:class:`broker.lending.Lending` as :class:`broker.lending.SlurmLending` does for Slurm:

* *Placeholders.* Every GPU the broker would offer (:attr:`broker.lending.LendingHooks.to_hold`)
  is held ahead of time by a one-GPU pod in the lent namespace (``k8s_namespace``): image
  ``k8s_image`` (``pause``: it only holds), ``limits: {nvidia.com/gpu: 1}``, pinned to its node
  (``nodeSelector kubernetes.io/hostname``: kube-scheduler still checks that the GPU is free),
  PriorityClass ``k8s_priority_class`` (a value below every training priority,
  ``preemptionPolicy: Never``), ``terminationGracePeriodSeconds`` = the lease notice. Only GPUs a
  Running placeholder holds are reported through :attr:`~broker.lending.LendingHooks.lendable`
  (so offered).
* *GPU identity.* A pod asks for a count of ``nvidia.com/gpu``; which device the device plugin
  gave it is not in the pod object. The broker gives each placeholder a *slot* (label
  ``gpupool.io/slot``, at most one pod per slot), and slot ``n`` of node ``h`` is the GPU key
  ``h/gpu<n>`` (:class:`broker.placeholders.GpuMap` without UUIDs). Holding every free GPU of a
  node holds the right devices by count, but slot ``n`` is not device ``n``: on a cluster with a
  device plugin the key of each placeholder must be read after it starts, from the kubelet's
  PodResources API (``List``: the device ids allocated to each pod) or dcgm-exporter's pod
  labels. Not built: kwok (the local cluster) has no device plugin to read, so there the slot is
  the identity.
* *Claims stay fast.* :meth:`~KubernetesLending.hold` takes the placeholders of the lease's GPUs in
  memory (no API call on the claim's path); their annotation ``gpupool.io/lease`` (the lease id),
  label ``gpupool.io/state=lease`` and ``activeDeadlineSeconds`` (the lease's end, enforced by the
  kubelet even when gpupool is down) are patched in the background.
* *Training wins with notice.* A pending training pod that needs lent GPUs makes kube-scheduler
  preempt the fewest lent pods on one node (lower priority); each victim is deleted with its
  grace period, so its ``metadata.deletionTimestamp`` is the moment the GPU goes back. A watch of
  the lent namespace's pods (a worker thread) sees it: a lease pod with ``deletionTimestamp`` →
  :attr:`~broker.lending.LendingHooks.reclaim` with ``deadline = deletionTimestamp``, reason
  ``scheduler_preempted:<pod>``, and the lease's other pods are deleted with the same deadline
  (the site's workload gets SIGTERM on every one); a lease pod gone (or finished) while its lease
  lives → ``hold_lost:<pod>``; an idle placeholder chosen as a victim is deleted at once with no
  grace (nobody uses it: training need not wait for the notice). A lease's end deletes its pods
  with no grace.
* *gpupool down.* Placeholders and lease pods are ordinary low-priority pods: kube-scheduler
  preempts them for training by itself, with the grace period, and the kubelet ends lease pods
  at ``activeDeadlineSeconds``. At the next start the broker adopts the pods of live leases (a
  placeholder carved but not yet patched, by its GPU), deletes the pods of other leases, and
  reclaims live leases whose pods are gone.
* *Minimum guaranteed duration.* Kubernetes has none for priority preemption (a
  PodDisruptionBudget is only best effort there): gpupool keeps a claim's guarantee against its
  own demands, not when the scheduler preempts.
* *Workloads.* A claim naming a workload profile (:mod:`broker.workloads`) gets one *lease pod*
  per node of the lease: the profile's argv (:func:`broker.workloads.render`) as the command of
  a container in the profile's ``image`` (its ``host_paths`` mounted read-only), asking for the
  lease's GPUs of that node at once (``limits: {nvidia.com/gpu: N}``: the device plugin gives one
  process all of them, which one-GPU placeholders cannot), with the placeholders' PriorityClass,
  grace period (= the notice: the workload gets SIGTERM and drains within it) and
  ``activeDeadlineSeconds``. The lease's placeholders hold the GPUs until the lease pod exists;
  then they are deleted with no grace and kube-scheduler binds the lease pod to the GPUs they
  freed (a training pod pending for that node in that moment wins them: the lease pod stays
  pending, and after the profile's ``health_timeout_s`` the lease is reclaimed, ``hold_lost``).
  The endpoint is ``<pod IP>:<port>`` (the pod network; the port from the profile's range),
  published once the health path answers 200, as on Slurm. A node whose pods report no
  container ID (kwok's nodes, which run no containers) cannot run a workload: such a claim is
  refused (``isolation_failed``) before anything is carved. Env: ``GPUPOOL_LEASE_ID``,
  ``GPUPOOL_CPUS``/``OMP_NUM_THREADS`` (the profile's ``cpus_per_gpu`` × GPUs: a budget told,
  not reserved: a lease pod requests 10m CPU, as placeholders do) and ``GPUPOOL_GPU_SLOTS`` (the
  lease's slots on the node; the devices themselves are the device plugin's). InfiniBand
  partition knobs are not set on Kubernetes. At a restart the lease pods of live leases are
  adopted with their endpoints (port annotation ``gpupool.io/port``); a workload lease whose
  placeholders were carved but whose lease pod was not created yet is not started again.

The API is reached with the official ``kubernetes`` client, every call in a worker thread
(:func:`asyncio.to_thread`, at most :data:`_API_CONCURRENCY` at once); the watch runs in a
thread of its own and hands events to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from broker.lending import Lendable, LendingHooks, Reclaim, Republish, ToHold
from broker.metrics import BrokerMetrics
from broker.placeholders import GpuMap
from broker.workloads import WorkloadError, WorkloadProfile, allowed, pick_port, render, wait_healthy
from contracts import LeaseLogRecord, LeaseState
from contracts.leases import LeaseReason

log = logging.getLogger(__name__)

MANAGED_BY = "app.kubernetes.io/managed-by"
"""Label on every pod the broker makes (value :data:`MANAGER`); the watch selects on it."""
MANAGER = "gpupool"
NODE_LABEL = "gpupool.io/node"
SLOT_LABEL = "gpupool.io/slot"
STATE_LABEL = "gpupool.io/state"
"""``idle`` (a placeholder) or ``lease`` (carved into a lease)."""
LEASE_ANNOTATION = "gpupool.io/lease"
"""The lease id of a carved pod (an annotation: lease ids may be longer than a label value)."""
SLOTS_LABEL = "gpupool.io/slots"
"""Every GPU slot of a lease pod, ``-``-joined (``3-4``); its ``gpupool.io/slot`` is the first."""
PORT_ANNOTATION = "gpupool.io/port"
"""The port a lease pod's workload listens on (on its pod IP)."""
WORKLOAD_CONTAINER = "workload"
GPU_RESOURCE = "nvidia.com/gpu"
_API_CONCURRENCY = 4
_WATCH_TIMEOUT_S = 5
_RELEASE_CHECK_S = 5.0
"""Seconds a lease's end waits for its pods to go before reading them (then again, each as long)."""
_RELEASE_TRIES = 6
"""Server-side timeout of one watch request (the thread notices a stop at least this often)."""


class KubernetesError(Exception):
    """The API server refused or did not answer (the message says which call and why)."""


@dataclass(frozen=True)
class LentPod:
    """One pod of the lent namespace as the broker reads it.

    Attributes:
        name: pod name.
        node: the node it is pinned to (label ``gpupool.io/node``).
        slot: its GPU slot on that node (label ``gpupool.io/slot``).
        lease_id: the lease it is carved into (annotation), ``""`` for a placeholder.
        phase: ``status.phase`` (``Pending``, ``Running``, ``Succeeded``, ``Failed``).
        bound: True once kube-scheduler bound it (``spec.nodeName`` set).
        deleting_at: ``metadata.deletionTimestamp`` (Unix s, whole seconds): when its GPU goes
            back; ``None`` while it is not being deleted.
        disrupted_at: when the scheduler chose it as a preemption victim (its ``DisruptionTarget``
            condition, Unix s, whole seconds), else ``None``.
        disrupted_by: that condition's reason (``PreemptionByScheduler``...), else ``""``.
        created_at: ``metadata.creationTimestamp`` (Unix s).
        slots: every GPU slot of a lease pod (label ``gpupool.io/slots``); ``()`` for a
            placeholder (its one slot is ``slot``).
        pod_ip: ``status.podIP`` (``""`` until the pod has one).
        port: a lease pod's workload port (annotation ``gpupool.io/port``), else ``None``.
        runs_containers: a container of it has a container ID (``status.containerStatuses``): a
            real container runtime runs it (kwok's nodes report none).
    """

    name: str
    node: str
    slot: int
    lease_id: str = ""
    phase: str = "Pending"
    bound: bool = False
    deleting_at: float | None = None
    disrupted_at: float | None = None
    disrupted_by: str = ""
    created_at: float = 0.0
    slots: tuple[int, ...] = ()
    pod_ip: str = ""
    port: int | None = None
    runs_containers: bool = False

    @property
    def all_slots(self) -> tuple[int, ...]:
        """The GPU slots it holds on its node."""
        return self.slots or (self.slot,)

    @property
    def holding(self) -> bool:
        """Bound and Running, not being deleted: it holds its GPU."""
        return self.bound and self.phase == "Running" and self.deleting_at is None

    @property
    def finished(self) -> bool:
        """Its containers ended (``Succeeded``/``Failed``, e.g. at ``activeDeadlineSeconds``)."""
        return self.phase in ("Succeeded", "Failed")


async def _nothing_lendable(_: frozenset[str]) -> None:
    return None


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def parse_pod(pod: client.V1Pod) -> LentPod | None:
    """The :class:`LentPod` of a pod object of the client (``None`` for a pod without gpupool's
    node and slot labels)."""
    meta = pod.metadata
    if meta is None or not meta.name:
        return None
    labels = meta.labels or {}
    try:
        node, slot = labels[NODE_LABEL], int(labels[SLOT_LABEL])
    except (KeyError, ValueError):
        return None
    disrupted_at, disrupted_by = None, ""
    status = pod.status
    for c in (status.conditions if status is not None else None) or []:
        if c.type == "DisruptionTarget" and c.status == "True":
            disrupted_at, disrupted_by = _ts(c.last_transition_time), c.reason or ""
    annotations = meta.annotations or {}
    try:
        slots = tuple(int(v) for v in labels[SLOTS_LABEL].split("-")) if SLOTS_LABEL in labels else ()
        port = int(annotations[PORT_ANNOTATION]) if PORT_ANNOTATION in annotations else None
    except ValueError:
        return None
    statuses = (status.container_statuses if status is not None else None) or []
    return LentPod(
        name=meta.name,
        node=node,
        slot=slot,
        lease_id=annotations.get(LEASE_ANNOTATION, ""),
        phase=(status.phase if status is not None else None) or "Pending",
        bound=bool(pod.spec is not None and pod.spec.node_name),
        deleting_at=_ts(meta.deletion_timestamp),
        disrupted_at=disrupted_at,
        disrupted_by=disrupted_by,
        created_at=_ts(meta.creation_timestamp) or 0.0,
        slots=slots,
        pod_ip=(status.pod_ip if status is not None else None) or "",
        port=port,
        runs_containers=any(cs.container_id for cs in statuses),
    )


def _gpupool_pod_spec(node: str, priority_class: str, notice_s: float) -> dict[str, Any]:
    """The pod spec fields every gpupool pod (placeholder or lease pod) shares: pinned to
    ``node``, PriorityClass ``priority_class``, grace period ``ceil(notice_s)`` s, never restarted,
    no service account token, no service links."""
    return {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "priorityClassName": priority_class,
        "terminationGracePeriodSeconds": max(0, math.ceil(notice_s)),
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
    }


def placeholder_pod(
    name: str, node: str, slot: int, *, notice_s: float, priority_class: str, image: str, resource: str
) -> dict[str, Any]:
    """The manifest of a placeholder pod (module docstring): one ``resource`` on ``node``, GPU slot
    ``slot``, grace period ``ceil(notice_s)`` seconds, PriorityClass ``priority_class``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {MANAGED_BY: MANAGER, NODE_LABEL: node, SLOT_LABEL: str(slot), STATE_LABEL: "idle"},
        },
        "spec": {
            **_gpupool_pod_spec(node, priority_class, notice_s),
            "containers": [
                {
                    "name": "hold",
                    "image": image,
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {resource: "1"}},
                }
            ],
        },
    }


def lease_pod(
    name: str, node: str, slots: Sequence[int], lease_id: str, argv: Sequence[str], *, port: int,
    profile: WorkloadProfile, cpus: int, notice_s: float, active_deadline_s: int | None,
    priority_class: str, resource: str,
) -> dict[str, Any]:  # fmt: skip
    """The manifest of a lease pod (module docstring): ``argv`` in ``profile.image`` on ``node``
    with ``len(slots)`` of ``resource``, listening on ``port``, grace period ``ceil(notice_s)`` s,
    ``activeDeadlineSeconds`` = ``active_deadline_s`` (``None``: none). Raises
    :class:`broker.workloads.WorkloadError` when the profile has no image."""
    if profile.image is None:
        raise WorkloadError(f"workload profile {profile.name!r} has no image (required on Kubernetes)")
    env = {
        "GPUPOOL_LEASE_ID": lease_id,
        "GPUPOOL_CPUS": str(cpus),
        "OMP_NUM_THREADS": str(cpus),
        "GPUPOOL_GPU_SLOTS": ",".join(str(s) for s in sorted(slots)),
    }
    volumes = [{"name": f"host-{i}", "hostPath": {"path": p}} for i, p in enumerate(profile.host_paths)]
    mounts = [
        {"name": f"host-{i}", "mountPath": p, "readOnly": True} for i, p in enumerate(profile.host_paths)
    ]
    spec: dict[str, Any] = {
        **_gpupool_pod_spec(node, priority_class, notice_s),
        "containers": [
            {
                "name": WORKLOAD_CONTAINER,
                "image": profile.image,
                "imagePullPolicy": "IfNotPresent",
                "command": list(argv),
                "env": [{"name": k, "value": v} for k, v in env.items()],
                "ports": [{"containerPort": port, "protocol": "TCP"}],
                "readinessProbe": {
                    "httpGet": {"path": profile.health_path, "port": port},
                    "periodSeconds": 2,
                },
                "resources": {
                    "requests": {"cpu": "10m", "memory": "16Mi"},
                    "limits": {resource: str(len(slots))},
                },
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if active_deadline_s is not None:
        spec["activeDeadlineSeconds"] = max(1, active_deadline_s)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {
                MANAGED_BY: MANAGER,
                NODE_LABEL: node,
                SLOT_LABEL: str(min(slots)),
                SLOTS_LABEL: "-".join(str(s) for s in sorted(slots)),
                STATE_LABEL: "lease",
            },  # fmt: skip
            "annotations": {LEASE_ANNOTATION: lease_id, PORT_ANNOTATION: str(port)},
        },
        "spec": spec,
    }


class KubernetesLending:
    """Leases carved from placeholder pods in the lent namespace (module docstring).

    Args:
        api: a client of the cluster (its credentials need the RBAC of
            ``deploy/kubernetes/base/broker/rbac.yaml`` in ``namespace``).
        namespace: the lent namespace (placeholders and lease pods).
        priority_class: the PriorityClass of lent pods (below every training priority).
        image: the placeholders' image.
        resource: the GPU extended resource.
        notice_s: the leases' notice = the pods' termination grace period, seconds.
        workloads: the operator's workload profiles (``BrokerConfig.workloads``).
        poll_s: seconds between two passes that keep placeholders on the GPUs to hold (in
            memory; API calls only for pods to create or delete).
        unwanted_grace_s: a placeholder (holding or still pending) on a GPU no longer to hold is
            deleted after this many seconds; one on a GPU to hold stays, pending while training
            holds the GPU (kube-scheduler places pending training pods first: higher priority),
            so no pod is created and deleted again and again for it.
        clock: Unix time source.
    """

    enforced = True

    def __init__(
        self,
        api: client.ApiClient,
        *,
        namespace: str = "gpupool-lent",
        priority_class: str = "gpupool-lent",
        image: str = "registry.k8s.io/pause:3.10",
        resource: str = GPU_RESOURCE,
        notice_s: float = 30.0,
        workloads: Collection[WorkloadProfile] = (),
        poll_s: float = 0.25,
        unwanted_grace_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.priority_class = priority_class
        self.image = image
        self.resource = resource
        self.gpu_map = GpuMap()
        """Slot ↔ GPU key ``<node>/gpu<slot>`` (module docstring)."""
        self.notice_s = notice_s
        self.workloads = tuple(workloads)
        self.poll_s = poll_s
        self.unwanted_grace_s = unwanted_grace_s
        self._clock = clock
        self._reclaim: Reclaim | None = None
        self._to_hold: ToHold = lambda: ()
        self._lendable: Lendable = _nothing_lendable
        self._republish: Republish = lambda _: None
        self._endpoints: dict[str, dict[str, str]] = {}
        """Healthy workload instances: lease id → node → ``<pod IP>:<port>``."""
        self._ports: dict[str, dict[str, int]] = {}
        """Workload ports of each live lease: lease id → node → port."""
        self._metrics = BrokerMetrics()  # replaced by the service's in bind()
        self._told: frozenset[str] | None = None
        self._pods: dict[str, LentPod] = {}
        """Every pod of the lent namespace the watch has seen, by name."""
        self._idle: dict[str, dict[int, str]] = {}
        """Placeholders holding their GPU, not carved: node → slot → pod name."""
        self._leases: dict[str, list[str]] = {}
        """Pods of each live lease (fixed at carving)."""
        self._carved: dict[str, str] = {}
        """Pod name → the lease it was carved into (before the API shows the annotation)."""
        self._noticed: set[str] = set()
        """Leases already reclaimed for the scheduler (preempted, hold lost) or signalled."""
        self._creating: set[tuple[str, int]] = set()
        """Slots whose placeholder is being created (not yet seen by the watch)."""
        self._deleting: set[str] = set()
        """Pods the broker deleted (their deletion is not a preemption)."""
        self._unwanted: dict[str, float] = {}
        """Idle placeholders on GPUs not to hold: pod name → since when (clock)."""
        self._gate = asyncio.Semaphore(_API_CONCURRENCY)
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._stop_watch = threading.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []

    # wiring --------------------------------------------------------------------------------------
    def bind(self, hooks: LendingHooks, metrics: BrokerMetrics) -> None:
        """See :meth:`broker.lending.Lending.bind`."""
        self._reclaim, self._to_hold, self._lendable = hooks.reclaim, hooks.to_hold, hooks.lendable
        self._republish = hooks.republish
        self._metrics = metrics

    async def start(self, live: Sequence[LeaseLogRecord]) -> None:
        """See :meth:`broker.lending.Lending.start`: pods of live leases are adopted (a
        placeholder carved but not yet annotated is found by its GPU and annotated now), pods of
        other leases deleted, live leases without a pod reclaimed at once (``hold_lost``), lease
        pods being deleted reclaimed with their deadline. Raises :class:`KubernetesError` if the
        lent namespace cannot be listed."""
        pods, version = await self._list()
        self._pods = {p.name: p for p in pods}
        live_ids = {r.lease_id: r for r in live}
        by_gpu = {g: r for r in live for g in r.gpus}
        stale: list[str] = []
        unnamed: dict[str, list[str]] = {}
        for p in pods:
            owner = live_ids.get(p.lease_id) if p.lease_id else by_gpu.get(self._key(p) or "")
            if p.lease_id and owner is None:
                stale.append(p.name)
            elif owner is not None and not p.finished:
                self._leases.setdefault(owner.lease_id, []).append(p.name)
                self._carved[p.name] = owner.lease_id
                if not p.lease_id:
                    unnamed.setdefault(owner.lease_id, []).append(p.name)
        if stale:
            self._background(self._delete(stale, 0, "release"), "stale-pods")
            log.info("stale_holds_deleted", extra={"pods": stale})
        for rec in live:
            if rec.state is LeaseState.RECLAIMING:
                self._noticed.add(rec.lease_id)
            names = self._leases.get(rec.lease_id)
            if not names:
                self._noticed.add(rec.lease_id)
                if rec.state is not LeaseState.RECLAIMING:
                    log.warning("hold_missing_at_start", extra={"lease_id": rec.lease_id})
                    await self._notify(rec.lease_id, self._clock(), f"{LeaseReason.HOLD_LOST}:none")
                continue
            for name in names:
                await self._seen(self._pods[name])
        for lease_id, names in unnamed.items():
            self._background(self._annotate(live_ids[lease_id], names), f"hold-annotate-{lease_id}")
        for lease_id, names in self._leases.items():
            self._adopt_workload(live_ids[lease_id], [self._pods[n] for n in names])
        self._rebuild_idle()
        self._stop_watch = stop = threading.Event()  # this start's: a thread of an earlier one stays stopped
        self._events = asyncio.Queue()
        loop = asyncio.get_running_loop()
        thread = threading.Thread(
            target=self._watch_thread,
            args=(version, loop, stop, self._events),
            name="broker-k8s-watch",
            daemon=True,
        )
        thread.start()
        self._loops = [
            asyncio.create_task(self._consume_forever(), name="broker-k8s-events"),
            asyncio.create_task(self._keep_forever(), name="broker-k8s-keep"),
        ]
        await self._keep()
        log.info(
            "lending_started",
            extra={
                "scheduler": "kubernetes",
                "adopted_leases": sorted(self._leases),
                "placeholders": self._held(),
            },
        )

    async def stop(self) -> None:
        """See :meth:`broker.lending.Lending.stop`: releases in progress are awaited (at most
        ``2 × _RELEASE_CHECK_S`` seconds), the watch ends (within :data:`_WATCH_TIMEOUT_S` seconds,
        in its thread), the pods stay."""
        keep = [t for t in self._loops if t.get_name() == "broker-k8s-keep"]
        for t in keep:
            t.cancel()
        await asyncio.gather(*keep, return_exceptions=True)
        for t in list(self._tasks):
            if not t.get_name().startswith("hold-release"):
                t.cancel()
        if self._tasks:  # releases see their pods go (through the watch), for a while
            _, late = await asyncio.wait(list(self._tasks), timeout=2 * _RELEASE_CHECK_S)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        self._stop_watch.set()
        for t in self._loops:
            t.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops = []

    @property
    def watching(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return bool(self._loops)

    # leases ----------------------------------------------------------------------------------------
    async def hold(self, record: LeaseLogRecord) -> str:
        """See :meth:`broker.lending.Lending.hold`: carve the placeholders of ``record.gpus`` in
        memory; annotations follow in the background. A claim naming a workload starts its lease
        pods in the background (module docstring); it is refused (nothing carved) for a profile
        unknown or not allowed to the site, without an image, a node whose pods run no
        containers, or no free port."""
        profile: WorkloadProfile | None = None
        ports: dict[str, int] = {}
        if record.workload is not None:
            try:
                profile = allowed(self.workloads, record.site, record.workload)
                if profile.image is None:
                    raise WorkloadError(
                        f"workload profile {profile.name!r} has no image (required on Kubernetes)"
                    )
                for node in sorted(self.gpu_map.by_node(record.gpus)):
                    if not self._runs_containers(node):
                        raise WorkloadError(
                            f"workload {record.workload!r}: node {node} runs no containers (its pods in "
                            f"{self.namespace} report no container ID, as on a kwok node); claim its GPUs "
                            "without a workload"
                        )
                    ports[node] = pick_port(profile, self._ports_on(node))
            except WorkloadError as e:
                return str(e)
        taken: list[tuple[str, int, str]] = []
        for key in record.gpus:
            where = self.gpu_map.locate(key)
            name = self._idle.get(where[0], {}).pop(where[1], None) if where else None
            if where is None or name is None:
                for node, slot, n in taken:
                    self._idle.setdefault(node, {})[slot] = n
                return f"{key}: not held by a placeholder pod in {self.namespace} now; claim again"
            taken.append((where[0], where[1], name))
        names = [n for _, _, n in taken]
        for n in names:
            self._carved[n] = record.lease_id
            self._unwanted.pop(n, None)
        self._leases[record.lease_id] = names
        self._metrics.placeholder_gpus.set(self._held())
        self._background(self._tell(), f"lendable-{record.lease_id}")
        if profile is None:
            self._background(self._annotate(record, names), f"hold-annotate-{record.lease_id}")
            return ""
        self._ports[record.lease_id] = ports
        slots: dict[str, list[int]] = {}
        for node, slot, _ in taken:
            slots.setdefault(node, []).append(slot)
        for node, on_node in sorted(slots.items()):
            placeholders = [n for nd, _, n in taken if nd == node]
            self._background(
                self._start_workload(record, profile, node, on_node, ports[node], placeholders),
                f"workload-start-{record.lease_id}/{node}",
            )
        return ""

    def reclaiming(self, record: LeaseLogRecord) -> None:
        """See :meth:`broker.lending.Lending.reclaiming`: a reclaim gpupool started (a training
        demand) deletes the lease's pods with the grace left until its deadline, as the scheduler's
        preemption would; one the scheduler started was handled when seen; one deferred past the
        notice (a minimum guarantee) is left alone (its pods would go before the deadline)."""
        names = self._leases.get(record.lease_id)
        deadline = record.reclaim_deadline
        if deadline is not None and deadline - self._clock() > self.notice_s + 1.0:
            return
        if names and record.lease_id not in self._noticed:
            self._noticed.add(record.lease_id)
            left = self.notice_s if deadline is None else deadline - self._clock()
            self._background(
                self._delete(list(names), max(1, math.floor(left)), "signal"),
                f"hold-signal-{record.lease_id}",
            )

    def ended(self, record: LeaseLogRecord) -> None:
        """See :meth:`broker.lending.Lending.ended`: the lease's pods are deleted with no grace."""
        names = self._leases.pop(record.lease_id, None)
        self._noticed.discard(record.lease_id)
        self._endpoints.pop(record.lease_id, None)
        self._ports.pop(record.lease_id, None)
        for t in list(self._tasks):
            if t.get_name().startswith(f"workload-health-{record.lease_id}/"):
                t.cancel()
        if not names:
            return
        self._background(self._tell(), f"lendable-{record.lease_id}")
        self._background(self._release(record.lease_id, names), f"hold-release-{record.lease_id}")

    def endpoint(self, lease_id: str) -> Mapping[str, str]:
        """See :meth:`broker.lending.Lending.endpoint`: node → ``<pod IP>:<port>`` of each lease
        pod whose workload answered its health path."""
        return dict(self._endpoints.get(lease_id, {}))

    def held_gpus(self) -> dict[str, tuple[str, ...]]:
        """The pods of each live lease (for tests and summaries)."""
        return {lid: tuple(names) for lid, names in self._leases.items()}

    def lease_slots(self, lease_id: str) -> tuple[int, ...]:
        """The GPU slots the pods of a live lease hold (as the watch last saw them), sorted."""
        pods = [self._pods.get(n) for n in self._leases.get(lease_id, ())]
        return tuple(sorted(s for p in pods if p is not None for s in p.all_slots))

    def idle_slots(self, node: str) -> frozenset[int]:
        """Slots of ``node`` held by idle placeholders now."""
        return frozenset(self._idle.get(node, {}))

    # workloads -----------------------------------------------------------------------------------
    def _runs_containers(self, node: str) -> bool:
        """Whether a pod of the lent namespace on ``node`` has a container ID (a runtime runs it)."""
        return any(p.node == node and p.runs_containers for p in self._pods.values())

    def _ports_on(self, node: str) -> list[int]:
        """Workload ports of the live leases on ``node``."""
        return [by_node[node] for by_node in self._ports.values() if node in by_node]

    async def _start_workload(
        self, record: LeaseLogRecord, profile: WorkloadProfile, node: str, slots: list[int], port: int,
        placeholders: list[str],
    ) -> None:  # fmt: skip
        """Create the lease pod of ``record`` on ``node`` (``slots``), then hand it the GPUs: it
        replaces ``placeholders`` in the lease, which are deleted with no grace; then wait for its
        health. A failed creation reclaims the lease (``hold_lost``)."""
        lease_id = record.lease_id
        name = f"gpupool-lease-{node}-{secrets.token_hex(4)}"[:63]
        argv = render(profile, port=port, lease_id=lease_id, site=record.site, gpus=len(slots))
        deadline = None if record.ends_at is None else math.ceil(record.ends_at - self._clock())
        body: Any = lease_pod(
            name, node, slots, lease_id, argv, port=port, profile=profile,
            cpus=profile.cpus_per_gpu * len(slots), notice_s=self.notice_s, active_deadline_s=deadline,
            priority_class=self.priority_class, resource=self.resource,
        )  # fmt: skip
        try:
            await self._create_pod(body)
        except (ApiException, HTTPError, OSError) as e:
            self._metrics.scheduler_errors.labels(operation="start").inc()
            log.error(
                "workload_create_failed", extra={"lease_id": lease_id, "host": node, "error": str(e)[:500]}
            )
            if lease_id in self._leases and lease_id not in self._noticed:
                self._noticed.add(lease_id)
                await self._notify(lease_id, self._clock(), f"{LeaseReason.HOLD_LOST}:{name}")
            return
        pods = self._leases.get(lease_id)
        if pods is None:  # ended meanwhile: its placeholders are being released
            await self._delete([name], 0, "release")
            return
        self._carved[name] = lease_id
        for p in placeholders:
            self._carved.pop(p, None)
        self._leases[lease_id] = [n for n in pods if n not in placeholders] + [name]
        if lease_id in self._noticed:  # reclaimed meanwhile: the new pod leaves with the others
            left = (
                self.notice_s if record.reclaim_deadline is None else record.reclaim_deadline - self._clock()
            )
            await self._delete([*placeholders, name], max(1, math.floor(left)), "signal")
            return
        await self._delete(placeholders, 0, "release")
        log.info("workload_started", extra={"lease_id": lease_id, "host": node, "pod": name, "port": port})
        self._watch_workload(lease_id, profile, node, name)

    def _watch_workload(self, lease_id: str, profile: WorkloadProfile, node: str, pod: str) -> None:
        self._background(self._health(lease_id, profile, node, pod), f"workload-health-{lease_id}/{node}")

    def _adopt_workload(self, record: LeaseLogRecord, pods: Sequence[LentPod]) -> None:
        """After a restart: the ports of a live lease's pods (annotation) and their health again."""
        lease_pods = [p for p in pods if p.port is not None]
        if record.workload is None or not lease_pods:
            return
        try:
            profile = allowed(self.workloads, record.site, record.workload)
        except WorkloadError as e:
            log.warning("workload_not_adopted", extra={"lease_id": record.lease_id, "error": str(e)})
            return
        for p in lease_pods:
            assert p.port is not None
            self._ports.setdefault(record.lease_id, {})[p.node] = p.port
            self._watch_workload(record.lease_id, profile, p.node, p.name)

    async def _health(self, lease_id: str, profile: WorkloadProfile, node: str, name: str) -> None:
        """Wait (``profile.health_timeout_s`` in all) until the lease pod ``name`` holds its GPUs
        with a pod IP and its health path answers 200: then publish the lease again with its
        endpoint. A pod never bound and running by then: the lease is reclaimed (``hold_lost``);
        one running but not healthy is logged and counted (the lease keeps no endpoint there)."""
        t0 = time.monotonic()
        port = self._ports.get(lease_id, {}).get(node)
        pod = self._pods.get(name)
        while (
            pod is None or not pod.holding or not pod.pod_ip
        ) and time.monotonic() - t0 < profile.health_timeout_s:
            await asyncio.sleep(0.05)
            pod = self._pods.get(name)
        if lease_id not in self._leases or port is None:
            return
        if pod is None or not pod.holding or not pod.pod_ip:
            self._metrics.scheduler_errors.labels(operation="start").inc()
            log.warning("workload_not_running", extra={"lease_id": lease_id, "host": node, "pod": name})
            if lease_id not in self._noticed:
                self._noticed.add(lease_id)
                await self._notify(lease_id, self._clock(), f"{LeaseReason.HOLD_LOST}:{name}")
            return
        endpoint = f"{pod.pod_ip}:{port}"
        left = profile.health_timeout_s - (time.monotonic() - t0)
        if await wait_healthy(
            f"http://{endpoint}{profile.health_path}", left, lambda: lease_id in self._leases
        ):
            self._endpoints.setdefault(lease_id, {})[node] = endpoint
            log.info("workload_healthy", extra={"lease_id": lease_id, "host": node, "endpoint": endpoint})
            self._republish(lease_id)
            return
        if lease_id in self._leases:
            self._metrics.scheduler_errors.labels(operation="start").inc()
            log.warning(
                "workload_unhealthy", extra={"lease_id": lease_id, "host": node, "endpoint": endpoint}
            )

    # events --------------------------------------------------------------------------------------
    def _watch_thread(
        self, version: str, loop: asyncio.AbstractEventLoop, stop: threading.Event,
        events: asyncio.Queue[tuple[str, Any]],
    ) -> None:  # fmt: skip
        """Watch the lent namespace's pods from ``version`` and hand each event to ``events`` on
        ``loop`` until ``stop`` is set; after an expired version (410) or a failure, list again (a
        ``SYNC`` event) and watch on."""
        selector = f"{MANAGED_BY}={MANAGER}"

        def put(item: tuple[str, Any]) -> bool:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody listens any more
                return False
            return True

        backoff = 0.1
        while not stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(
                    self.core.list_namespaced_pod,
                    self.namespace,
                    label_selector=selector,
                    resource_version=version,
                    timeout_seconds=_WATCH_TIMEOUT_S,
                    _request_timeout=_WATCH_TIMEOUT_S + 5,
                ):
                    pod = parse_pod(event["object"])
                    if pod is not None and not put((event["type"], pod)):
                        return
                    if stop.is_set():
                        w.stop()
                version = w.resource_version or version
                backoff = 0.1
            except Exception as e:  # noqa: BLE001 — whatever broke the stream, the watch must go on
                if stop.is_set():
                    return
                if not (isinstance(e, ApiException) and e.status == 410):
                    put(("ERROR", str(e)))
                    time.sleep(backoff)
                    backoff = min(5.0, backoff * 2)
                try:
                    pods, version = self._list_sync()
                except KubernetesError as e2:
                    put(("ERROR", str(e2)))
                    continue
                if not put(("SYNC", pods)):
                    return

    async def _consume_forever(self) -> None:
        while True:
            kind, item = await self._events.get()
            try:
                await self._on_event(kind, item)
            except Exception:  # noqa: BLE001 — a bug on one event must not stop watching
                log.exception("lending_event_failed")

    async def _on_event(self, kind: str, item: Any) -> None:
        """One event of the watch thread: ``ADDED``/``MODIFIED``/``DELETED`` with a
        :class:`LentPod`, ``SYNC`` with every pod listed (after the watch expired), ``ERROR`` with
        the failure's text; then the idle placeholders are recounted and reported."""
        if kind == "ERROR":
            self._metrics.scheduler_errors.labels(operation="read").inc()
            log.error("scheduler_read_failed", extra={"scheduler": "kubernetes", "error": item})
        elif kind == "SYNC":
            listed = {p.name: p for p in item}
            for name in [n for n in self._pods if n not in listed]:
                await self._gone(self._pods.pop(name))
            for p in listed.values():
                self._pods[p.name] = p
                await self._seen(p)
        elif kind == "DELETED":
            self._pods.pop(item.name, None)
            await self._gone(item)
        else:
            self._pods[item.name] = item
            await self._seen(item)
        self._rebuild_idle()
        await self._tell()

    async def _seen(self, pod: LentPod) -> None:
        """A pod added or changed: a lease pod being deleted → the lease is reclaimed with its
        deadline; one finished → ``hold_lost``; an idle placeholder being deleted (a preemption
        victim) → deleted at once with no grace."""
        self._creating.discard((pod.node, pod.slot))
        lease_id = self._carved.get(pod.name)
        if lease_id is None:
            if pod.deleting_at is not None and pod.name not in self._deleting:
                self._background(self._delete([pod.name], 0, "release"), f"victim-{pod.name}")
            elif pod.finished and pod.name not in self._deleting:
                self._background(self._delete([pod.name], 0, "release"), f"finished-{pod.name}")
            return
        if lease_id not in self._leases or lease_id in self._noticed:
            return
        if pod.deleting_at is not None:
            self._noticed.add(lease_id)
            await self._notify(lease_id, pod.deleting_at, f"{LeaseReason.SCHEDULER_PREEMPTED}:{pod.name}")
            if pod.disrupted_at is not None:
                self._metrics.preemption_notice.observe(max(0.0, self._clock() - pod.disrupted_at))
            others = [n for n in self._leases[lease_id] if n != pod.name]
            if others:  # every pod of the lease goes at the same deadline (the workload drains)
                grace = max(1, math.floor(pod.deleting_at - self._clock()))
                self._background(self._delete(others, grace, "signal"), f"hold-signal-{lease_id}")
        elif pod.finished:
            self._noticed.add(lease_id)
            await self._notify(lease_id, self._clock(), f"{LeaseReason.HOLD_LOST}:{pod.name}")

    async def _gone(self, pod: LentPod) -> None:
        """A pod deleted: one of a live lease not yet reclaimed → ``hold_lost``."""
        self._deleting.discard(pod.name)
        self._unwanted.pop(pod.name, None)
        lease_id = self._carved.pop(pod.name, None)
        if lease_id is not None and lease_id in self._leases and lease_id not in self._noticed:
            self._noticed.add(lease_id)
            await self._notify(lease_id, self._clock(), f"{LeaseReason.HOLD_LOST}:{pod.name}")

    def _rebuild_idle(self) -> None:
        idle: dict[str, dict[int, str]] = {}
        for p in self._pods.values():
            if p.holding and p.name not in self._carved and not p.lease_id and p.name not in self._deleting:
                idle.setdefault(p.node, {}).setdefault(p.slot, p.name)
        self._idle = idle
        self._metrics.placeholder_gpus.set(self._held())

    # placeholders ------------------------------------------------------------------------------------
    async def _keep_forever(self) -> None:
        due = time.monotonic()
        while True:
            due = max(due + self.poll_s, time.monotonic())
            await asyncio.sleep(due - time.monotonic())
            try:
                await self._keep()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 — a bug in one pass must not stop the next
                log.exception("lending_keep_failed")

    async def _keep(self) -> None:
        """One pass (in memory): placeholders created for GPUs to hold without a pod, those on
        GPUs no longer to hold deleted after ``unwanted_grace_s``."""
        now = self._clock()
        wanted = self._wanted()
        occupied = {(p.node, s) for p in self._pods.values() for s in p.all_slots} | self._creating
        remove: list[str] = []
        for p in self._pods.values():
            if p.name in self._carved or p.lease_id or p.name in self._deleting or p.deleting_at is not None:
                continue
            if p.slot in wanted.get(p.node, ()):  # held, or pending until training frees the GPU
                self._unwanted.pop(p.name, None)
            elif now - self._unwanted.setdefault(p.name, now) >= self.unwanted_grace_s:
                remove.append(p.name)
        if remove:
            self._deleting.update(remove)
            self._rebuild_idle()
            self._background(self._delete(remove, 0, "release"), "placeholder-delete")
        for node, slots in sorted(wanted.items()):
            for slot in sorted(slots):
                if (node, slot) not in occupied:
                    self._creating.add((node, slot))
                    self._background(self._create(node, slot), f"placeholder-create-{node}-{slot}")
        await self._tell()

    def _wanted(self) -> dict[str, set[int]]:
        """Slots per node of the GPUs to hold for lending (what placeholders should hold)."""
        return self.gpu_map.by_node(self._to_hold())

    def _key(self, pod: LentPod) -> str | None:
        try:
            return self.gpu_map.key(pod.node, pod.slot)
        except KeyError:
            return None

    def _held(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def _tell(self) -> None:
        """Report the GPUs idle placeholders hold if they changed since the last report."""
        held = {
            k for node, slots in self._idle.items() for s in slots if (k := self._key(LentPod("", node, s)))
        }
        now = frozenset(held)
        if now != self._told:
            self._told = now
            await self._lendable(now)

    # API calls (worker threads) ----------------------------------------------------------------------
    def _list_sync(self) -> tuple[list[LentPod], str]:
        try:
            listed = self.core.list_namespaced_pod(
                self.namespace, label_selector=f"{MANAGED_BY}={MANAGER}", _request_timeout=30
            )
        except (ApiException, HTTPError, OSError) as e:
            raise KubernetesError(f"list pods in {self.namespace}: {e}") from e
        pods = [p for p in (parse_pod(item) for item in listed.items) if p is not None]
        version = listed.metadata.resource_version if listed.metadata is not None else None
        if not version:
            raise KubernetesError(f"list pods in {self.namespace}: no resourceVersion in the answer")
        return pods, version

    async def _list(self) -> tuple[list[LentPod], str]:
        async with self._gate:
            return await asyncio.to_thread(self._list_sync)

    async def _create_pod(self, body: Any) -> None:
        """Create the pod ``body`` (a manifest dict) in the lent namespace, through the API gate.

        Raises:
            ApiException, HTTPError, OSError: the API server refused it or was not reached (10 s).
        """
        async with self._gate:
            await asyncio.to_thread(self.core.create_namespaced_pod, self.namespace, body, _request_timeout=10)

    async def _create(self, node: str, slot: int) -> None:
        name = f"gpupool-{node}-gpu{slot}-{secrets.token_hex(3)}"[:63]
        body: Any = placeholder_pod(  # the client takes a manifest as well as a V1Pod
            name, node, slot, notice_s=self.notice_s, priority_class=self.priority_class, image=self.image,
            resource=self.resource,
        )  # fmt: skip
        try:
            await self._create_pod(body)
        except (ApiException, HTTPError, OSError) as e:
            self._creating.discard((node, slot))
            self._metrics.scheduler_errors.labels(operation="submit").inc()
            log.error("placeholder_create_failed", extra={"host": node, "slot": slot, "error": str(e)[:500]})

    async def _delete(self, names: Iterable[str], grace_s: int, operation: str) -> None:
        """Delete ``names`` with a grace period of ``grace_s`` seconds (a pod already gone is fine)."""
        names = list(names)
        self._deleting.update(names)

        def one(name: str) -> None:
            try:
                self.core.delete_namespaced_pod(
                    name, self.namespace, grace_period_seconds=grace_s, _request_timeout=10
                )
            except ApiException as e:
                if e.status != 404:
                    raise

        async def guarded(name: str) -> None:
            try:
                async with self._gate:
                    await asyncio.to_thread(one, name)
            except (ApiException, HTTPError, OSError) as e:
                self._metrics.scheduler_errors.labels(operation=operation).inc()
                log.error("pod_delete_failed", extra={"pod": name, "error": str(e)[:500]})

        await asyncio.gather(*(guarded(n) for n in names))

    async def _annotate(self, record: LeaseLogRecord, names: Sequence[str]) -> None:
        """Name the carved pods after the lease (annotation, label ``state=lease``) and set their
        ``activeDeadlineSeconds`` to the lease's end, counted from the pod's creation (the kubelet
        counts from its start, a little later: the pod may outlive the lease by that much when
        gpupool is down, never end before it)."""
        for name in names:
            if record.lease_id not in self._leases:
                return  # ended meanwhile: its pods are being deleted
            pod = self._pods.get(name)
            patch: dict[str, Any] = {
                "metadata": {
                    "annotations": {LEASE_ANNOTATION: record.lease_id},
                    "labels": {STATE_LABEL: "lease"},
                }
            }
            if record.ends_at is not None and pod is not None:
                patch["spec"] = {"activeDeadlineSeconds": max(1, math.ceil(record.ends_at - pod.created_at))}
            try:
                async with self._gate:
                    await asyncio.to_thread(
                        self.core.patch_namespaced_pod, name, self.namespace, patch, _request_timeout=10
                    )
            except (ApiException, HTTPError, OSError) as e:
                if record.lease_id not in self._leases or record.lease_id in self._noticed:
                    return  # ended, or being taken back: a deleting pod may refuse the patch
                self._metrics.scheduler_errors.labels(operation="retag").inc()
                log.error(
                    "hold_annotate_failed",
                    extra={"lease_id": record.lease_id, "pod": name, "error": str(e)[:500]},
                )

    async def _release(self, lease_id: str, names: list[str]) -> None:
        """Delete the lease's pods with no grace and wait until the watch sees them gone;
        observed in ``gpupool_broker_hold_release_seconds``. Every :data:`_RELEASE_CHECK_S`
        seconds without that, each pod left is read: one the API no longer has counts as gone
        (the watch missed its deletion), one still there is deleted again (a failed or lost
        delete); given up after :data:`_RELEASE_TRIES` checks (logged ``hold_release_slow``)."""
        t0 = time.perf_counter()
        await self._delete(names, 0, "release")
        for tries in range(1, _RELEASE_TRIES + 1):
            while time.perf_counter() - t0 < tries * _RELEASE_CHECK_S:
                if not any(n in self._pods for n in names):
                    for n in names:
                        self._carved.pop(n, None)
                    self._metrics.hold_release.observe(time.perf_counter() - t0)
                    log.info(
                        "hold_released",
                        extra={"lease_id": lease_id, "pods": names, "seconds": time.perf_counter() - t0},
                    )
                    return
                await asyncio.sleep(0.02)
            left = [n for n in names if n in self._pods]
            self._metrics.scheduler_errors.labels(operation="release").inc()
            log.error("hold_release_slow", extra={"lease_id": lease_id, "pods": left, "check": tries})
            again: list[str] = []
            for name in left:
                try:
                    async with self._gate:
                        pod = await asyncio.to_thread(
                            self.core.read_namespaced_pod, name, self.namespace, _request_timeout=10
                        )
                except ApiException as e:
                    if e.status == 404 and name in self._pods:  # gone, and the watch missed it
                        await self._on_event("DELETED", self._pods[name])
                    continue
                except (HTTPError, OSError):
                    continue
                meta = pod.metadata
                log.warning(
                    "hold_still_there",
                    extra={
                        "pod": name,
                        "phase": pod.status.phase if pod.status else None,
                        "deletion_timestamp": str(meta.deletion_timestamp) if meta else None,
                        "finalizers": meta.finalizers if meta else None,
                    },
                )
                again.append(name)
            if again:
                await self._delete(again, 0, "release")

    async def _notify(self, lease_id: str, deadline: float, reason: str) -> None:
        log.info(
            "scheduler_reclaim", extra={"lease_id": lease_id, "reclaim_deadline": deadline, "reason": reason}
        )
        if self._reclaim is not None:
            await self._reclaim(lease_id, deadline, reason)

    def _background(self, coro: Awaitable[None], name: str) -> None:
        async def run() -> None:
            await coro

        task = asyncio.create_task(run(), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
