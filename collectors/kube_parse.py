"""Parsers of Kubernetes and Kueue objects for the scheduler source: nodes, pods, Kueue Workloads.

Input is the API server's JSON (camelCase, as ``GET /api/v1/pods`` returns each item; the
watch's ``object``). Format sources: the Kubernetes API reference v1.31 (``core/v1`` ``Node``,
``Pod``; pod resource rules in "Resource Management for Pods and Containers" and "Sidecar
containers") and Kueue's ``kueue.x-k8s.io/v1beta2`` ``Workload``, ``LocalQueue`` and
``ClusterQueue`` (Kueue v0.17, ``apis/kueue/v1beta2``).

GPUs are the device plugin's extended resource (``nvidia.com/gpu`` by default). An extended
resource is an integer quantity, asked in ``limits`` (a request, if given, must equal the
limit), so a container's GPUs are its request, else its limit. A pod's GPUs are Kubernetes'
effective request: the larger of (its containers' sum plus its sidecars', restartable init
containers) and (its largest ordinary init container plus the sidecars started before it).

Everything here is a pure function: dict in, values out. A malformed object raises
:class:`KubeParseError` with a ``reason`` (the metric label); the caller skips that object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

__all__ = [
    "HOSTNAME_LABEL",
    "KubeParseError",
    "NodeInfo",
    "PodInfo",
    "WorkloadInfo",
    "parse_cluster_queue",
    "parse_local_queue",
    "parse_node",
    "parse_pod",
    "parse_time",
    "parse_workload",
    "pod_gpus",
]

HOSTNAME_LABEL = "kubernetes.io/hostname"
"""The well-known node label that names the node: a pod pinned to nodes selects on it."""
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""Label naming the LocalQueue of a workload's pods (Kueue)."""
JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name")
"""Labels the Job controller puts on its pods (the first is the current one)."""
MAX_GPUS_PER_OBJECT = 1 << 20
"""Most GPUs one container, pod or node may declare; more is refused (``bad_quantity``)."""


class KubeParseError(ValueError):
    """A Kubernetes object or value that does not have the documented shape; ``reason`` is the
    metric label (``no_metadata``, ``bad_quantity``, ``bad_time``, ``bad_field``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        """Build with a reason code and a short detail (the offending value)."""
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _dict(value: Any, what: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise KubeParseError("bad_field", what)
    return value


def _list(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise KubeParseError("bad_field", what)
    return value


def parse_time(text: Any) -> float | None:
    """Unix seconds of an RFC 3339 time of the API (``2026-12-01T22:44:27Z``, fractions and
    offsets allowed); ``None`` for ``None``. Raises :class:`KubeParseError` (``bad_time``)."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise KubeParseError("bad_time", repr(text)[:40])
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise KubeParseError("bad_time", text[:40]) from exc
    if when.tzinfo is None:
        raise KubeParseError("bad_time", text[:40])
    return when.timestamp()


def gpu_quantity(value: Any) -> int:
    """GPUs of an extended-resource quantity (``"8"``, ``8``); an extended resource is a whole
    number. Raises :class:`KubeParseError` (``bad_quantity``) for a fraction, a negative, a
    suffix (``"1k"``: legal for ``cpu``, not a GPU count) or more than :data:`MAX_GPUS_PER_OBJECT`."""
    if isinstance(value, bool):
        raise KubeParseError("bad_quantity", repr(value))
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and value.strip().isdigit():
        n = int(value.strip())
    else:
        raise KubeParseError("bad_quantity", repr(value)[:40])
    if not 0 <= n <= MAX_GPUS_PER_OBJECT:
        raise KubeParseError("bad_quantity", repr(value)[:40])
    return n


def _container_gpus(container: Any, resource: str) -> int:
    res = _dict(_dict(container, "container").get("resources"), "resources")
    requests = _dict(res.get("requests"), "requests")
    limits = _dict(res.get("limits"), "limits")
    if resource in requests:
        return gpu_quantity(requests[resource])
    if resource in limits:
        return gpu_quantity(limits[resource])
    return 0


def pod_gpus(spec: Mapping[str, Any], resource: str) -> int:
    """GPUs (``resource``) a pod with ``spec`` asks for: Kubernetes' effective request (module
    docstring). Raises :class:`KubeParseError` for a malformed container or quantity."""
    containers = sum(_container_gpus(c, resource) for c in _list(spec.get("containers"), "containers"))
    sidecars = 0
    init_peak = 0
    for c in _list(spec.get("initContainers"), "initContainers"):
        n = _container_gpus(c, resource)
        if _dict(c, "container").get("restartPolicy") == "Always":
            sidecars += n
        else:
            init_peak = max(init_peak, sidecars + n)
    total = max(containers + sidecars, init_peak)
    if total > MAX_GPUS_PER_OBJECT:
        raise KubeParseError("bad_quantity", f"{total} GPUs")
    return total


def _pinned_nodes(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """Nodes a pod template can only run on, when it says so by name: ``nodeName``, a
    ``nodeSelector`` on :data:`HOSTNAME_LABEL`, or a required node affinity whose every term
    has a ``kubernetes.io/hostname In`` expression (or a ``metadata.name In`` field); ``()``
    when it names none (it may run on any node its other constraints allow)."""
    if spec.get("nodeName"):
        return (str(spec["nodeName"]),)
    selector = _dict(spec.get("nodeSelector"), "nodeSelector")
    if HOSTNAME_LABEL in selector:
        return (str(selector[HOSTNAME_LABEL]),)
    affinity = _dict(_dict(spec.get("affinity"), "affinity").get("nodeAffinity"), "nodeAffinity")
    required = _dict(affinity.get("requiredDuringSchedulingIgnoredDuringExecution"), "nodeAffinity")
    terms = _list(required.get("nodeSelectorTerms"), "nodeSelectorTerms")
    names: list[str] = []
    for term in terms:
        term = _dict(term, "nodeSelectorTerm")
        found = None
        for key, exprs in (("key", term.get("matchExpressions")), ("field", term.get("matchFields"))):
            for expr in _list(exprs, "matchExpressions"):
                expr = _dict(expr, "matchExpression")
                want = HOSTNAME_LABEL if key == "key" else "metadata.name"
                if expr.get("key") == want and expr.get("operator") == "In":
                    found = [str(v) for v in _list(expr.get("values"), "values")]
        if found is None:
            return ()  # one term without a name: the pod may go elsewhere
        names.extend(found)
    return tuple(dict.fromkeys(names))


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = _dict(obj.get("metadata"), "metadata")
    if not meta.get("name"):
        raise KubeParseError("no_metadata")
    return meta


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for c in _list(status.get("conditions"), "conditions"):
        c = _dict(c, "condition")
        if c.get("type") == kind:
            return c
    return None


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One Node.

    Attributes:
        name: ``metadata.name`` (the host name of its GPU telemetry).
        gpus: allocatable GPUs (``status.allocatable[resource]``; 0 when absent).
        ready: the ``Ready`` condition's status (``True``, ``False``, ``Unknown``; ``Unknown``
            when the node has none).
        cordoned: ``spec.unschedulable`` (``kubectl cordon``/``drain``).
        reason: the ``Ready`` condition's message when not ready, else ``None``.
    """

    name: str
    gpus: int
    ready: str
    cordoned: bool
    reason: str | None


def parse_node(obj: Mapping[str, Any], resource: str) -> NodeInfo:
    """The :class:`NodeInfo` of a Node object. Raises :class:`KubeParseError`."""
    meta = _meta(obj)
    status = _dict(obj.get("status"), "status")
    allocatable = _dict(status.get("allocatable"), "allocatable")
    gpus = gpu_quantity(allocatable[resource]) if resource in allocatable else 0
    cond = _condition(status, "Ready")
    ready = str(cond.get("status")) if cond is not None else "Unknown"
    return NodeInfo(
        name=str(meta["name"]),
        gpus=gpus,
        ready=ready,
        cordoned=bool(_dict(obj.get("spec"), "spec").get("unschedulable")),
        reason=(str(cond.get("message") or cond.get("reason") or "") or None)
        if cond and ready != "True"
        else None,
    )


@dataclass(frozen=True, slots=True)
class PodInfo:
    """One Pod, as the scheduler source reads it.

    Attributes:
        namespace / name / uid: the pod.
        node: ``spec.nodeName`` (bound by the scheduler), ``None`` while pending.
        phase: ``status.phase`` (``Pending``, ``Running``, ``Succeeded``, ``Failed``, ``Unknown``).
        gpus: GPUs it asks for (:func:`pod_gpus`).
        created: ``metadata.creationTimestamp``, Unix s.
        job: the Job that owns it (its Job-name label), else ``None``.
        queue: its Kueue LocalQueue (label :data:`QUEUE_LABEL`), else ``None``.
        slot: ``gpupool.io/slot`` label of a pod of gpupool's lent namespace, else ``None``.
        lent: it is one of gpupool's own pods (in the lent namespace, managed by gpupool).
        pinned: nodes it may only run on (:func:`_pinned_nodes`).
        nominated: ``status.nominatedNodeName``: the node kube-scheduler is freeing for it by
            preemption, else ``None``.
        gated: it has ``spec.schedulingGates`` (not yet given to the scheduler, e.g. by Kueue).
    """

    namespace: str
    name: str
    uid: str
    node: str | None
    phase: str
    gpus: int
    created: float
    job: str | None = None
    queue: str | None = None
    slot: int | None = None
    lent: bool = False
    pinned: tuple[str, ...] = ()
    nominated: str | None = None
    gated: bool = False

    @property
    def terminal(self) -> bool:
        """Its containers ended (``Succeeded`` / ``Failed``): it holds nothing any more."""
        return self.phase in ("Succeeded", "Failed")

    @property
    def holds(self) -> bool:
        """Bound to a node, not ended, asks for GPUs: it holds GPUs there (a pod being deleted
        holds them until it is gone)."""
        return self.node is not None and not self.terminal and self.gpus > 0

    @property
    def pending(self) -> bool:
        """Not bound, not ended, not gated, asks for GPUs: demand the scheduler has not placed."""
        return self.node is None and not self.terminal and not self.gated and self.gpus > 0


def parse_pod(obj: Mapping[str, Any], resource: str, lent_namespace: str) -> PodInfo:
    """The :class:`PodInfo` of a Pod object; a pod counts as gpupool's own (``lent``) when it is
    in ``lent_namespace`` with label ``app.kubernetes.io/managed-by=gpupool`` (the broker's
    placeholder and lease pods, ``broker.lending_kubernetes``). Raises :class:`KubeParseError`."""
    meta = _meta(obj)
    spec = _dict(obj.get("spec"), "spec")
    status = _dict(obj.get("status"), "status")
    labels = _dict(meta.get("labels"), "labels")
    namespace = str(meta.get("namespace") or "default")
    lent = namespace == lent_namespace and labels.get("app.kubernetes.io/managed-by") == "gpupool"
    slot = None
    if lent and "gpupool.io/slot" in labels:
        text = str(labels["gpupool.io/slot"])
        if not text.isdigit():
            raise KubeParseError("bad_field", f"gpupool.io/slot={text[:20]}")
        slot = int(text)
    job = next((str(labels[k]) for k in JOB_NAME_LABELS if labels.get(k)), None)
    return PodInfo(
        namespace=namespace,
        name=str(meta["name"]),
        uid=str(meta.get("uid") or ""),
        node=str(spec["nodeName"]) if spec.get("nodeName") else None,
        phase=str(status.get("phase") or "Pending"),
        gpus=pod_gpus(spec, resource),
        created=parse_time(meta.get("creationTimestamp")) or 0.0,
        job=job,
        queue=str(labels[QUEUE_LABEL]) if labels.get(QUEUE_LABEL) else None,
        slot=slot,
        lent=lent,
        pinned=_pinned_nodes(spec),
        nominated=str(status["nominatedNodeName"]) if status.get("nominatedNodeName") else None,
        gated=bool(_list(spec.get("schedulingGates"), "schedulingGates")),
    )


@dataclass(frozen=True, slots=True)
class WorkloadInfo:
    """One Kueue Workload (a Job, or any integration's unit, as Kueue queues it).

    Attributes:
        namespace / name: the Workload.
        job: the name of the object it stands for (its first ``ownerReference``), else the name.
        queue: ``spec.queueName`` (the LocalQueue, in the same namespace).
        priority: ``spec.priority`` (0 when unset).
        created: ``metadata.creationTimestamp``, Unix s.
        gpus: GPUs of all its pods: per pod set ``count`` × :func:`pod_gpus` of its template.
        pinned: nodes its pods may only run on (union over pod sets that pin; ``()`` when a pod
            set asking for GPUs pins none).
        reserved: quota is reserved for it (condition ``QuotaReserved`` True): it is admitted or
            being admitted, and its quota counts as used.
        finished: condition ``Finished`` True.
        active: ``spec.active`` (``False``: deactivated, never admitted).
        reserved_since: when ``QuotaReserved`` last became True (Unix s), else ``None``.
        max_execution_s: ``spec.maximumExecutionTimeSeconds``: Kueue evicts it this long after
            admission (minus ``status.accumulatedPastExecutionTimeSeconds``), else ``None``.
        past_execution_s: ``status.accumulatedPastExecutionTimeSeconds`` (0 when unset).
        cluster_queue: ``status.admission.clusterQueue`` once admitted, else ``None``.
        reason: why it waits: the ``QuotaReserved`` condition's reason when False (``Pending``,
            ...), ``""`` otherwise.
    """

    namespace: str
    name: str
    job: str
    queue: str | None
    priority: int
    created: float
    gpus: int
    pinned: tuple[str, ...]
    reserved: bool
    finished: bool
    active: bool = True
    reserved_since: float | None = None
    max_execution_s: int | None = None
    past_execution_s: int = 0
    cluster_queue: str | None = None
    reason: str = ""

    @property
    def pending(self) -> bool:
        """Waiting in its queue: active, not finished, no quota reserved."""
        return self.active and not self.finished and not self.reserved

    @property
    def ends_by(self) -> float | None:
        """When Kueue ends it at the latest (Unix s): quota reserved + maximum execution time left;
        ``None`` without a maximum or a reservation time."""
        if self.reserved_since is None or self.max_execution_s is None:
            return None
        return self.reserved_since + max(0, self.max_execution_s - self.past_execution_s)


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KubeParseError("bad_field", what)
    return value


def parse_workload(obj: Mapping[str, Any], resource: str) -> WorkloadInfo:
    """The :class:`WorkloadInfo` of a ``kueue.x-k8s.io/v1beta2`` Workload. Raises
    :class:`KubeParseError`."""
    meta = _meta(obj)
    spec = _dict(obj.get("spec"), "spec")
    status = _dict(obj.get("status"), "status")
    gpus = 0
    pinned: list[str] = []
    unpinned = False
    for ps in _list(spec.get("podSets"), "podSets"):
        ps = _dict(ps, "podSet")
        count = _int(ps.get("count", 1), "podSet.count")
        if count < 0:
            raise KubeParseError("bad_field", "podSet.count")
        template = _dict(_dict(ps.get("template"), "template").get("spec"), "template.spec")
        per_pod = pod_gpus(template, resource)
        gpus += count * per_pod
        if per_pod:
            nodes = _pinned_nodes(template)
            unpinned = unpinned or not nodes
            pinned.extend(nodes)
    if gpus > MAX_GPUS_PER_OBJECT:
        raise KubeParseError("bad_quantity", f"{gpus} GPUs")
    reserved = _condition(status, "QuotaReserved")
    finished = _condition(status, "Finished")
    owners = _list(meta.get("ownerReferences"), "ownerReferences")
    owner = _dict(owners[0], "ownerReference").get("name") if owners else None
    max_exec = spec.get("maximumExecutionTimeSeconds")
    admission = _dict(status.get("admission"), "admission")
    is_reserved = reserved is not None and reserved.get("status") == "True"
    return WorkloadInfo(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta["name"]),
        job=str(owner or meta["name"]),
        queue=str(spec["queueName"]) if spec.get("queueName") else None,
        priority=_int(spec.get("priority", 0), "priority") if spec.get("priority") is not None else 0,
        created=parse_time(meta.get("creationTimestamp")) or 0.0,
        gpus=gpus,
        pinned=() if unpinned else tuple(dict.fromkeys(pinned)),
        reserved=is_reserved,
        finished=finished is not None and finished.get("status") == "True",
        active=spec.get("active") is not False,
        reserved_since=parse_time(reserved.get("lastTransitionTime")) if is_reserved and reserved else None,
        max_execution_s=_int(max_exec, "maximumExecutionTimeSeconds") if max_exec is not None else None,
        past_execution_s=_int(status.get("accumulatedPastExecutionTimeSeconds") or 0, "accumulatedPast"),
        cluster_queue=str(admission["clusterQueue"]) if admission.get("clusterQueue") else None,
        reason=str(reserved.get("reason") or "") if reserved is not None and not is_reserved else "",
    )


def parse_local_queue(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    """``(namespace, name, clusterQueue)`` of a LocalQueue. Raises :class:`KubeParseError`
    (``bad_field`` without ``spec.clusterQueue``)."""
    meta = _meta(obj)
    cq = _dict(obj.get("spec"), "spec").get("clusterQueue")
    if not cq:
        raise KubeParseError("bad_field", "spec.clusterQueue")
    return str(meta.get("namespace") or "default"), str(meta["name"]), str(cq)


def parse_cluster_queue(obj: Mapping[str, Any], resource: str) -> tuple[str, int]:
    """``(name, GPUs)`` of a ClusterQueue: the sum of ``nominalQuota`` of ``resource`` over its
    resource groups' flavors (borrowing from a cohort is not counted). Raises
    :class:`KubeParseError`."""
    meta = _meta(obj)
    total = 0
    for group in _list(_dict(obj.get("spec"), "spec").get("resourceGroups"), "resourceGroups"):
        for flavor in _list(_dict(group, "resourceGroup").get("flavors"), "flavors"):
            for res in _list(_dict(flavor, "flavor").get("resources"), "resources"):
                res = _dict(res, "resource")
                if res.get("name") == resource:
                    total += gpu_quantity(res.get("nominalQuota"))
    return str(meta["name"]), total
