"""Benchmark: one read of the Kubernetes scheduler source, from its caches to SchedulerNode records.

A read of :class:`collectors.kube_collector.KubernetesCollector` makes no API call: it builds the
records from the list+watch caches (:func:`collectors.kube_records.build_node_records`: slots,
pending pods, the quota-based estimate of Kueue's pending workloads). The yardstick, in the same
run, is the Slurm source building the records of the same cluster from parsed ``scontrol`` output
(:func:`collectors.slurm_records.build_node_records`): ``--nodes`` nodes of 8 GPUs, 6 of them held
per node by training (3 two-GPU jobs or pods), one held by gpupool, ``--pending`` pending jobs
(Kubernetes: half Kueue workloads pinned to a node, half pending pods, in ``--queues``
ClusterQueues). Prints the median of ``--rounds`` reads of each (ms) and their ratio.

Run: ``.venv/bin/python bench/kube_source.py [--nodes 1000] [--pending 2000] [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectors import kube_records, slurm_records  # noqa: E402
from collectors.kube_parse import NodeInfo, PodInfo, WorkloadInfo  # noqa: E402
from collectors.slurm_parse import JobInfo  # noqa: E402
from collectors.slurm_parse import NodeInfo as SlurmNode  # noqa: E402
from contracts.scheduler import LENT_JOB_NAME  # noqa: E402

T0 = 1_764_600_000.0


def kubernetes_cluster(
    nodes: int, pending: int, queues: int
) -> tuple[list[NodeInfo], list[PodInfo], list[WorkloadInfo], dict[tuple[str, str], str], dict[str, int]]:
    """Nodes, pods, workloads, LocalQueue → ClusterQueue and quotas of the module docstring."""
    names = [f"gpu-node-{i:04d}" for i in range(nodes)]
    ns = [NodeInfo(n, 8, "True", False, None) for n in names]
    pods: list[PodInfo] = []
    for i, n in enumerate(names):
        for j in range(3):
            pods.append(
                PodInfo("train", f"p{i}-{j}", f"u{i}-{j}", n, "Running", 2, T0 + j, job=f"job{i}-{j}")
            )
        pods.append(PodInfo("gpupool-lent", f"h{i}", f"h{i}", n, "Running", 1, T0, slot=7, lent=True))
    workloads: list[WorkloadInfo] = []
    for k in range(pending):
        node = names[k % nodes]
        if k % 2:
            pods.append(PodInfo("train", f"pend{k}", f"pu{k}", None, "Pending", 2, T0 + k, pinned=(node,)))
        else:
            workloads.append(
                WorkloadInfo(
                    "team", f"w{k}", f"job-w{k}", f"q{k % queues}", 0, T0 + k, 4, (node,), False, False
                )
            )
    for q in range(queues):
        workloads.append(
            WorkloadInfo("team", f"r{q}", f"job-r{q}", f"q{q}", 0, T0, 8, (), True, False,
                          reserved_since=T0, max_execution_s=600 + q)
        )  # fmt: skip
    local = {("team", f"q{q}"): f"cq{q}" for q in range(queues)}
    return ns, pods, workloads, local, {f"cq{q}": 8 for q in range(queues)}


def slurm_cluster(nodes: int, pending: int) -> tuple[list[SlurmNode], list[JobInfo]]:
    """The same cluster as Slurm's parsed ``scontrol`` output."""
    names = [f"gpu-node-{i:04d}" for i in range(nodes)]
    gpus = tuple((i, "h100") for i in range(8))
    ns = [SlurmNode(n, "MIXED", (), None, ("training", "lent"), gpus, frozenset(range(7))) for n in names]
    jobs: list[JobInfo] = []
    for i, n in enumerate(names):
        for j in range(3):
            jobs.append(JobInfo(f"{i}.{j}", f"job{i}-{j}", "alice", "training", "RUNNING", None,
                                {n: (2 * j, 2 * j + 1)}, gpus_per_node=2, num_nodes=1))  # fmt: skip
        jobs.append(
            JobInfo(f"h{i}", LENT_JOB_NAME, "root", "lent", "RUNNING", None, {n: (7,)}, gpus_per_node=1)
        )
    for k in range(pending):
        jobs.append(JobInfo(f"p{k}", f"pend{k}", "bob", "training", "PENDING", "Resources", start=T0 + 600,
                            sched_nodes=(names[k % nodes],), gpus_per_node=4, num_nodes=1))  # fmt: skip
    return ns, jobs


def _median_ms(fn: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring); returns the exit status (0)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--pending", type=int, default=2000)
    p.add_argument("--queues", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    k = kubernetes_cluster(a.nodes, a.pending, a.queues)
    s = slurm_cluster(a.nodes, a.pending)
    slurm_ms = _median_ms(lambda: slurm_records.build_node_records(*s, ts=T0), a.rounds)
    kube_ms = _median_ms(lambda: kube_records.build_node_records(*k, ts=T0), a.rounds)
    records, overflow = kube_records.build_node_records(*k, ts=T0)
    assert not overflow and len(records) == a.nodes
    held = sum(g.allocated for r in records for g in r.gpus)
    print(
        f"{a.nodes} nodes x 8 GPUs ({held} held), {a.pending} pending, {a.queues} ClusterQueues, {a.rounds} rounds"
    )
    print(f"Slurm source, records from parsed scontrol (yardstick): {slurm_ms:.1f} ms")
    print(
        f"Kubernetes source, records from its caches:             {kube_ms:.1f} ms  ({kube_ms / slurm_ms:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
