"""The Kubernetes source's pure parts: objects of the API server's JSON → pods, nodes, Kueue
workloads (collectors.kube_parse); those → SchedulerNode records, GPU slots and the quota-based
start estimate of pending workloads (collectors.kube_records); and what analytics makes of them."""

from __future__ import annotations

from typing import Any

import pytest

from analytics.scheduler import planned_gpus
from collectors.kube_parse import (
    MAX_GPUS_PER_OBJECT,
    KubeParseError,
    gpu_quantity,
    parse_cluster_queue,
    parse_local_queue,
    parse_node,
    parse_pod,
    parse_time,
    parse_workload,
    pod_gpus,
)
from collectors.kube_records import assign_slots, build_node_records, pending_gpus, plan_workloads
from contracts.scheduler import LENT_JOB_NAME

GPU = "nvidia.com/gpu"
LENT = "gpupool-lent"
T0 = 1_764_600_000.0  # 2025-12-01T14:40:00Z


def iso(ts: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def container(gpus: int | None = None, *, request: bool = False, **extra: Any) -> dict[str, Any]:
    res: dict[str, Any] = {"requests": {"cpu": "1"}}
    if gpus is not None:
        res["requests" if request else "limits"] = {
            **res.get("requests" if request else "limits", {}),
            GPU: str(gpus),
        }
    return {"name": "c", "image": "x", "resources": res, **extra}


def pod(
    name: str,
    gpus: int,
    *,
    node: str | None = "n1",
    phase: str = "Running",
    created: float = T0,
    namespace: str = "training",
    labels: dict[str, str] | None = None,
    spec: dict[str, Any] | None = None,
    status: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"containers": [container(gpus)], **(spec or {})}
    if node:
        body["nodeName"] = node
    return {
        "metadata": {
            "name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}",
            "creationTimestamp": iso(created), "labels": labels or {},
        },
        "spec": body,
        "status": {"phase": phase, **(status or {})},
    }  # fmt: skip


def lent_pod(name: str, slot: int, node: str = "n1") -> dict[str, Any]:
    labels = {
        "app.kubernetes.io/managed-by": "gpupool",
        "gpupool.io/slot": str(slot),
        "gpupool.io/node": node,
    }
    return pod(name, 1, node=node, namespace=LENT, labels=labels)


def node_obj(name: str, gpus: int = 8, ready: str = "True", cordoned: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {
            "allocatable": {GPU: str(gpus), "cpu": "32"},
            "conditions": [{"type": "Ready", "status": ready, "message": "kubelet stopped posting"}],
        },
    }


def workload(
    name: str,
    gpus_per_pod: int,
    count: int = 1,
    *,
    reserved_at: float | None = None,
    max_exec: int | None = None,
    pin: str | None = None,
    priority: int | None = None,
    created: float = T0,
    finished: bool = False,
) -> dict[str, Any]:
    template: dict[str, Any] = {"containers": [container(gpus_per_pod)]}
    if pin:
        template["nodeSelector"] = {"kubernetes.io/hostname": pin}
    conditions = []
    if reserved_at is not None:
        conditions.append(
            {
                "type": "QuotaReserved",
                "status": "True",
                "reason": "QuotaReserved",
                "lastTransitionTime": iso(reserved_at),
            }
        )
    else:
        conditions.append(
            {
                "type": "QuotaReserved",
                "status": "False",
                "reason": "Pending",
                "lastTransitionTime": iso(created),
            }
        )
    if finished:
        conditions.append({"type": "Finished", "status": "True", "lastTransitionTime": iso(created)})
    spec: dict[str, Any] = {
        "queueName": "lq",
        "podSets": [{"name": "main", "count": count, "template": {"spec": template}}],
    }
    if max_exec is not None:
        spec["maximumExecutionTimeSeconds"] = max_exec
    if priority is not None:
        spec["priority"] = priority
    return {
        "metadata": {"name": name, "namespace": "team", "creationTimestamp": iso(created),
                     "ownerReferences": [{"kind": "Job", "name": f"job-{name}"}]},
        "spec": spec,
        "status": {"conditions": conditions},
    }  # fmt: skip


LQ = {("team", "lq"): "cq"}


# parsing ------------------------------------------------------------------------------------------
def test_gpu_quantities_are_whole_numbers_up_to_the_limit() -> None:
    assert (
        gpu_quantity("8") == 8
        and gpu_quantity(0) == 0
        and gpu_quantity(MAX_GPUS_PER_OBJECT) == MAX_GPUS_PER_OBJECT
    )
    for bad in ("1k", "0.5", "-1", -1, True, None, MAX_GPUS_PER_OBJECT + 1):
        with pytest.raises(KubeParseError) as e:
            gpu_quantity(bad)
        assert e.value.reason == "bad_quantity"


def test_a_pods_gpus_are_kubernetes_effective_request() -> None:
    spec = {"containers": [container(2), container(1, request=True), container()]}
    assert pod_gpus(spec, GPU) == 3
    # an ordinary init container runs alone: the pod needs the larger of it and the containers
    assert pod_gpus({**spec, "initContainers": [container(3)]}, GPU) == 3
    assert pod_gpus({**spec, "initContainers": [container(4)]}, GPU) == 4
    # a sidecar (restartable init container) runs beside the containers, and beside later init ones
    sidecar = container(1, restartPolicy="Always")
    assert pod_gpus({**spec, "initContainers": [sidecar]}, GPU) == 4
    assert pod_gpus({**spec, "initContainers": [sidecar, container(4)]}, GPU) == 5
    assert pod_gpus({"containers": [container()]}, GPU) == 0
    with pytest.raises(KubeParseError):
        pod_gpus({"containers": "x"}, GPU)


def test_rfc3339_times() -> None:
    assert parse_time("2025-12-01T14:40:00Z") == T0
    assert parse_time("2025-12-01T15:40:00.5+01:00") == T0 + 0.5
    assert parse_time(None) is None
    for bad in ("2025-12-01T14:40:00", "yesterday", 5):
        with pytest.raises(KubeParseError):
            parse_time(bad)


def test_pods_bound_pending_lent_and_pinned() -> None:
    p = parse_pod(
        pod("a", 2, labels={"batch.kubernetes.io/job-name": "train", "kueue.x-k8s.io/queue-name": "lq"}),
        GPU,
        LENT,
    )
    assert (p.node, p.gpus, p.job, p.queue, p.holds, p.pending, p.lent) == (
        "n1",
        2,
        "train",
        "lq",
        True,
        False,
        False,
    )
    assert not parse_pod(pod("done", 2, phase="Succeeded"), GPU, LENT).holds
    assert not parse_pod(pod("cpu", 0), GPU, LENT).holds
    lent = parse_pod(lent_pod("h", 5), GPU, LENT)
    assert lent.lent and lent.slot == 5
    # the same labels outside the lent namespace are nobody's hold
    assert not parse_pod(
        {**lent_pod("h", 5), "metadata": {**lent_pod("h", 5)["metadata"], "namespace": "x"}}, GPU, LENT
    ).lent
    pinned = parse_pod(
        pod("p", 4, node=None, spec={"nodeSelector": {"kubernetes.io/hostname": "n2"}}), GPU, LENT
    )
    assert pinned.pending and pinned.pinned == ("n2",) and pinned.nominated is None
    terms = {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["n3", "n4"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n4"]}]},
    ]}  # fmt: skip
    aff = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": terms}}}
    assert parse_pod(pod("q", 1, node=None, spec=aff), GPU, LENT).pinned == ("n3", "n4")
    terms["nodeSelectorTerms"].append(
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    )
    assert parse_pod(pod("q", 1, node=None, spec=aff), GPU, LENT).pinned == ()  # one term names no node
    nominated = parse_pod(pod("r", 1, node=None, status={"nominatedNodeName": "n1"}), GPU, LENT)
    assert nominated.nominated == "n1" and nominated.pending
    gated = parse_pod(
        pod("g", 1, node=None, spec={"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}), GPU, LENT
    )
    assert not gated.pending
    with pytest.raises(KubeParseError) as e:
        parse_pod({"metadata": {}}, GPU, LENT)
    assert e.value.reason == "no_metadata"
    bad_slot = lent_pod("h", 5)
    bad_slot["metadata"]["labels"]["gpupool.io/slot"] = "five"
    with pytest.raises(KubeParseError):
        parse_pod(bad_slot, GPU, LENT)


def test_nodes_workloads_and_queues() -> None:
    n = parse_node(node_obj("n1", 8), GPU)
    assert (n.name, n.gpus, n.ready, n.cordoned, n.reason) == ("n1", 8, "True", False, None)
    down = parse_node(node_obj("n2", ready="Unknown", cordoned=True), GPU)
    assert down.ready == "Unknown" and down.cordoned and down.reason == "kubelet stopped posting"
    assert parse_node({"metadata": {"name": "cpu"}, "status": {}}, GPU).gpus == 0
    w = parse_workload(workload("w", 2, 3, reserved_at=T0, max_exec=600, pin="n1"), GPU)
    assert (w.gpus, w.job, w.reserved, w.pending, w.pinned, w.ends_by) == (
        6,
        "job-w",
        True,
        False,
        ("n1",),
        T0 + 600,
    )
    p = parse_workload(workload("p", 4), GPU)
    assert p.pending and p.reason == "Pending" and p.pinned == () and p.ends_by is None
    assert not parse_workload(workload("f", 4, finished=True), GPU).pending
    assert parse_local_queue(
        {"metadata": {"name": "lq", "namespace": "team"}, "spec": {"clusterQueue": "cq"}}
    ) == ("team", "lq", "cq")
    cq = {"metadata": {"name": "cq"}, "spec": {"resourceGroups": [{"flavors": [
        {"name": "a", "resources": [{"name": GPU, "nominalQuota": "8"}, {"name": "cpu", "nominalQuota": "64"}]},
        {"name": "b", "resources": [{"name": GPU, "nominalQuota": 4}]},
    ]}]}}  # fmt: skip
    assert parse_cluster_queue(cq, GPU) == ("cq", 12)


# slots and records --------------------------------------------------------------------------------
def _pods(*objs: dict[str, Any]) -> list[Any]:
    return [parse_pod(o, GPU, LENT) for o in objs]


def test_lent_pods_keep_their_slot_and_training_takes_the_lowest_free_in_creation_order() -> None:
    pods = _pods(
        lent_pod("h0", 0), lent_pod("h5", 5), pod("late", 2, created=T0 + 10), pod("early", 3, created=T0)
    )
    slots, over = assign_slots(8, pods)
    assert not over
    assert slots["uid-gpupool-lent-h0"] == (0,) and slots["uid-gpupool-lent-h5"] == (5,)
    assert slots["uid-training-early"] == (1, 2, 3) and slots["uid-training-late"] == (4, 6)
    # exactly full fits; one GPU more does not
    full, over = assign_slots(8, _pods(pod("a", 6), lent_pod("h", 7), lent_pod("i", 0)))
    assert not over and full["uid-training-a"] == (1, 2, 3, 4, 5, 6)
    _, over = assign_slots(8, _pods(pod("a", 7), lent_pod("h", 7), lent_pod("i", 0)))
    assert [p.name for p in over] == ["a"]


def test_records_in_slurm_terms() -> None:
    nodes = [parse_node(node_obj(n), GPU) for n in ("n1", "n2", "n3")] + [
        parse_node(node_obj("n4", ready="Unknown"), GPU), parse_node(node_obj("n5", cordoned=True), GPU)
    ]  # fmt: skip
    pods = _pods(
        pod("t-0", 3, labels={"job-name": "train", "kueue.x-k8s.io/queue-name": "lq"}, namespace="team"),
        lent_pod("h", 7),
        pod("full", 8, node="n2"),
        pod("seven", 7, node="n3"),
    )
    records, over = build_node_records(nodes, pods, [], LQ, {}, ts=T0, seq_start=10)
    assert not over
    r = {x.host: x for x in records}
    n1 = r["n1"]
    assert n1.scheduler == "kubernetes" and n1.source == "kube-apiserver" and n1.seq == 10
    held = [(g.index, g.job_id, g.job_name, g.user, g.partition) for g in n1.gpus if g.allocated]
    assert held == [(i, "team/train", "train", "team", "cq") for i in range(3)] + [
        (7, "gpupool-lent/h", LENT_JOB_NAME, LENT, None)
    ]
    assert n1.state == "MIXED" and r["n2"].state == "ALLOCATED" and r["n3"].state == "MIXED"
    assert (r["n4"].state, r["n4"].state_flags, r["n4"].schedulable) == ("DOWN", ["NOT_RESPONDING"], False)
    assert (r["n5"].state, r["n5"].state_flags, r["n5"].schedulable) == ("IDLE", ["DRAIN"], False)
    assert [len(x.gpus) for x in records] == [8] * 5


def test_pending_pods_nominated_are_planned_now_pinned_ones_are_listed() -> None:
    nodes = [parse_node(node_obj(n), GPU) for n in ("n1", "n2")]
    pods = _pods(
        pod("nom", 2, node=None, status={"nominatedNodeName": "n1"}),
        pod("pin", 3, node=None, spec={"nodeSelector": {"kubernetes.io/hostname": "n2"}}),
        pod("free", 1, node=None),
        {
            **lent_pod("ph", 1),
            "spec": {"containers": [container(1)]},
        },  # a placeholder not yet bound: not demand
    )
    records, _ = build_node_records(nodes, pods, [], {}, {}, ts=T0)
    n1, n2 = records
    [nom] = n1.pending
    assert (nom.job_id, nom.gpus, nom.planned_start, nom.planned_nodes) == ("training/nom", 2, T0, ["n1"])
    assert planned_gpus(n1) == {0: T0, 1: T0}
    [pin] = n2.pending
    assert (pin.gpus, pin.planned_start, pin.planned_nodes) == (3, None, [])
    assert planned_gpus(n2) == {}


# the quota-based estimate --------------------------------------------------------------------------
def _w(*objs: dict[str, Any]) -> list[Any]:
    return [parse_workload(o, GPU) for o in objs]


def test_a_workload_that_fits_the_free_quota_starts_now_one_more_gpu_waits_for_an_end() -> None:
    running = workload("run", 4, reserved_at=T0, max_exec=600)
    now = T0 + 100
    assert plan_workloads(_w(running, workload("fits", 4)), LQ, {"cq": 8}, now) == {("team", "fits"): now}
    assert plan_workloads(_w(running, workload("over", 5)), LQ, {"cq": 8}, now) == {
        ("team", "over"): T0 + 600
    }
    # past what ever frees (the running one has no end) or past the whole quota: no estimate
    assert (
        plan_workloads(_w(workload("run", 4, reserved_at=T0), workload("over", 5)), LQ, {"cq": 8}, now) == {}
    )
    assert plan_workloads(_w(workload("huge", 9)), LQ, {"cq": 8}, now) == {}
    assert plan_workloads(_w(workload("lost", 1)), {}, {"cq": 8}, now) == {}  # no queue known


def test_pending_workloads_are_served_by_priority_then_age_each_not_before_the_previous() -> None:
    now = T0 + 100
    ws = _w(
        workload("a", 4, reserved_at=T0, max_exec=300),
        workload("b", 4, reserved_at=T0, max_exec=600),
        workload("old", 4, created=T0),
        workload("urgent", 4, created=T0 + 50, priority=10),
        workload("small", 1, created=T0 + 60),
    )
    plans = plan_workloads(ws, LQ, {"cq": 8}, now)
    # urgent first at a's end, old at b's end; small then fits nothing left until old's end (unknown)
    assert plans == {("team", "urgent"): T0 + 300, ("team", "old"): T0 + 600}
    ws.append(parse_workload(workload("c", 8, reserved_at=T0, max_exec=900, finished=True), GPU))
    assert plan_workloads(ws, LQ, {"cq": 8}, now) == plans  # a finished workload holds nothing


def test_a_pinned_pending_workload_withholds_free_gpus_of_its_node_in_analytics() -> None:
    nodes = [parse_node(node_obj("n1"), GPU)]
    pods = _pods(pod("r-0", 4, labels={"job-name": "job-run"}, namespace="team"), lent_pod("h", 7))
    ws = _w(workload("run", 4, reserved_at=T0, max_exec=600, pin="n1"), workload("next", 3, pin="n1"))
    [rec], _ = build_node_records(nodes, pods, ws, LQ, {"cq": 6}, ts=T0 + 60)
    [p] = rec.pending
    assert (p.job_id, p.gpus, p.partition, p.planned_start, p.planned_nodes) == (
        "team/job-next",
        3,
        "cq",
        T0 + 600,
        ["n1"],
    )
    # free GPUs 4, 5, 6 first (then the lent one), lowest index first
    assert planned_gpus(rec) == {4: T0 + 600, 5: T0 + 600, 6: T0 + 600}
    # without an estimate it is listed on its node, planning nothing
    [rec], _ = build_node_records(nodes, pods, ws, LQ, {"cq": 2}, ts=T0 + 60)
    assert rec.pending[0].planned_start is None and planned_gpus(rec) == {}


def test_a_jobs_pods_take_their_clusterqueue_from_its_workload_and_pending_gpus_count_by_queue() -> None:
    nodes = [parse_node(node_obj("n1"), GPU)]
    pods = _pods(
        pod(
            "r-0", 2, labels={"batch.kubernetes.io/job-name": "job-run"}, namespace="team"
        ),  # Kueue labels the Job only
        pod("solo", 1, namespace="team"),
        pod("wait", 2, node=None, labels={"job-name": "job-run"}, namespace="team"),
        pod("stray", 5, node=None),
        {**lent_pod("ph", 1), "spec": {"containers": [container(1)]}},
    )
    ws = _w(workload("run", 2, reserved_at=T0), workload("next", 3), workload("other", 2, finished=True))
    [rec], _ = build_node_records(nodes, pods, ws, LQ, {"cq": 8}, ts=T0)
    assert [(g.job_id, g.partition) for g in rec.gpus if g.allocated] == [("team/job-run", "cq")] * 2 + [
        ("team/solo", None)
    ]
    assert pending_gpus(pods, ws, LQ) == {"cq": 3 + 2, "": 5}
