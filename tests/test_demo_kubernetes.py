"""The Kubernetes half of the demo's pipeline: the Kubernetes source's node records → the jobs the
training stream folds (which GPU slots training and gpupool's lent pods hold on each node)."""

from __future__ import annotations

from collectors.kube_parse import NodeInfo, PodInfo
from collectors.kube_records import build_node_records
from contracts.scheduler import LENT_JOB_NAME
from gpupool.demo_kubernetes import record_jobs


def _pod(name: str, node: str | None, gpus: int, created: float, *, phase: str = "Running", job: str | None = None,
         lent: bool = False, slot: int | None = None) -> PodInfo:
    ns = "gpupool-lent" if lent else "training"
    return PodInfo(ns, name, f"uid-{name}", node, phase, gpus, created, job=job, slot=slot, lent=lent)


def test_records_become_jobs_with_the_sources_slots() -> None:
    nodes = [NodeInfo(n, 8, "True", False, None) for n in ("n1", "n2", "n3")]
    pods = [
        _pod("hold-3", "n1", 1, 0.0, lent=True, slot=3),  # gpupool's placeholder keeps its own slot
        _pod("a-0", "n1", 2, 1.0, job="a"),  # the oldest training pod takes the lowest free slots
        _pod("b-0", "n1", 2, 2.0, job="b"),
        _pod("d-0", None, 1, 0.5, job="d", phase="Pending"),  # not bound: holds nothing
        _pod("e-0", "n1", 4, 0.1, job="e", phase="Succeeded"),  # ended: holds nothing
        _pod("w-0", "n2", 8, 1.0, job="w"),  # a two-node Job
        _pod("w-1", "n3", 8, 1.0, job="w"),
        _pod("p-0", "n1", 1, 5.0),  # a bare pod, no Job
    ]
    records, overflow = build_node_records(nodes, pods, [], {}, {}, ts=10.0)
    assert overflow == []
    jobs = {j.job_id: j for j in record_jobs(records)}
    assert set(jobs) == {"gpupool-lent/hold-3", "training/a", "training/b", "training/w", "training/p-0"}
    hold = jobs["gpupool-lent/hold-3"]
    assert (hold.name, hold.state, hold.gpus_by_node) == (LENT_JOB_NAME, "RUNNING", {"n1": (3,)})
    a = jobs["training/a"]
    assert (a.name, a.user, a.state, a.gpus_by_node) == ("a", "training", "RUNNING", {"n1": (0, 1)})
    assert jobs["training/b"].gpus_by_node == {"n1": (2, 4)}  # slot 3 is the placeholder's
    assert jobs["training/p-0"].gpus_by_node == {"n1": (5,)}
    assert jobs["training/w"].gpus_by_node == {"n2": tuple(range(8)), "n3": tuple(range(8))}


def test_no_gpu_held_no_job() -> None:
    records, _ = build_node_records([NodeInfo("n1", 8, "True", False, None)], [], [], {}, {}, ts=1.0)
    assert record_jobs(records) == []
