"""The Kubernetes half of the demo's pipeline: pods → the jobs the training stream folds (which
GPU slots training and gpupool's lent pods hold on each node)."""

from __future__ import annotations

from collectors.kube_parse import PodInfo
from contracts.scheduler import LENT_JOB_NAME
from gpupool.demo_kubernetes import pod_jobs


def _pod(name: str, node: str | None, gpus: int, created: float, *, phase: str = "Running", job: str | None = None,
         lent: bool = False, slot: int | None = None) -> PodInfo:
    ns = "gpupool-lent" if lent else "training"
    return PodInfo(ns, name, f"uid-{name}", node, phase, gpus, created, job=job, slot=slot, lent=lent)


def test_pods_become_jobs_with_the_sources_slots() -> None:
    pods = [
        _pod("hold-3", "n1", 1, 0.0, lent=True, slot=3),  # gpupool's placeholder keeps its own slot
        _pod("a-0", "n1", 2, 1.0, job="a"),  # the oldest training pod takes the lowest free slots
        _pod("b-0", "n1", 2, 2.0, job="b"),
        _pod("c-0", "n1", 1, 3.0, job="c", phase="Pending"),  # bound, not yet Running
        _pod("d-0", None, 1, 0.5, job="d", phase="Pending"),  # not bound: holds nothing
        _pod("e-0", "n1", 4, 0.1, job="e", phase="Succeeded"),  # ended: holds nothing
        _pod("f-0", "n1", 1, 4.0, job="f", phase="Failed"),
        _pod("w-0", "n2", 8, 1.0, job="w"),  # a two-node Job, one pod still Pending on its node
        _pod("w-1", "n3", 8, 1.0, job="w", phase="Pending"),
        _pod("x-0", "n9", 1, 1.0, job="x"),  # a node outside the fleet
        _pod("z-0", "n1", 0, 1.0, job="z"),  # no GPU
    ]
    jobs = {j.job_id: j for j in pod_jobs(pods, {"n1": 8, "n2": 8, "n3": 8})}
    assert set(jobs) == {"uid-hold-3", "training/a", "training/b", "training/c", "training/w"}
    hold = jobs["uid-hold-3"]
    assert (hold.name, hold.state, hold.gpus_by_node) == (LENT_JOB_NAME, "RUNNING", {"n1": (3,)})
    assert (jobs["training/a"].name, jobs["training/a"].gpus_by_node) == ("a", {"n1": (0, 1)})
    assert jobs["training/b"].gpus_by_node == {"n1": (2, 4)}  # slot 3 is the placeholder's
    assert (jobs["training/c"].state, jobs["training/c"].gpus_by_node) == ("PENDING", {"n1": (5,)})
    w = jobs["training/w"]
    assert w.state == "PENDING" and w.gpus_by_node == {"n2": tuple(range(8)), "n3": tuple(range(8))}
    both_running = pod_jobs([_pod("w-0", "n2", 8, 1.0, job="w"), _pod("w-1", "n3", 8, 1.0, job="w")],
                            {"n2": 8, "n3": 8})
    assert [j.state for j in both_running] == ["RUNNING"]


def test_pods_past_a_nodes_gpus_hold_nothing() -> None:
    jobs = pod_jobs([_pod("a-0", "n1", 2, 1.0, job="a"), _pod("b-0", "n1", 1, 2.0, job="b")], {"n1": 2})
    assert [(j.job_id, j.gpus_by_node) for j in jobs] == [("training/a", {"n1": (0, 1)})]
