"""Experiment: lent GPUs as a Kueue ClusterQueue borrowing training's quota over-evict.

The design the Kubernetes lending does *not* use (README, "The training scheduler: Kubernetes"),
run on the local control plane (``deploy/local/kubernetes.sh``, 4 nodes × 8 GPUs): ClusterQueue
``lent-exp`` (nominal quota 0) in cohort ``pool`` with ``training`` (``reclaimWithinCohort: Any``
for the experiment), training Jobs holding 6 GPUs on each node, 8 lent one-GPU Jobs (PriorityClass
``gpupool-lent``) 2 per node borrowing the rest, then a training Job of one 2-GPU pod on no
particular node. Kueue reclaims quota, not GPUs on a node: it may evict lent workloads on
different nodes, after which the pod fits nowhere and kube-scheduler preempts more on one node.

Prints which lent pods went (Kueue's evictions have no ``DisruptionTarget``; kube-scheduler's say
``PreemptionByScheduler``) and lent GPUs lost ÷ GPUs needed. Restores ClusterQueue ``training``
and deletes everything it made, also on an error. Needs a cluster where nothing else runs.

Run: ``.venv/bin/python bench/kueue_cohort.py [--kubeconfig .state/kubernetes/kubeconfig]``.
Exit 0 when the ratio is 1.0, 1 when lending this way over-evicts.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from kubernetes import client, config

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
NS = "lent-exp"
NODES = [f"gpu-node-00{i}" for i in range(1, 5)]


class Experiment:
    """The cluster's clients and the Jobs made."""

    def __init__(self, api: client.ApiClient) -> None:
        self.core, self.batch = client.CoreV1Api(api), client.BatchV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def job(self, ns: str, gpus: int, host: str | None = None, priority_class: str | None = None) -> str:
        """A suspended Job of one pod with ``gpus`` GPUs queued to LocalQueue ``ns`` (training's
        is ``training``), pinned to ``host`` if given."""
        name = f"j-{uuid.uuid4().hex[:6]}"
        spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 3,
            "containers": [
                {"name": "m", "image": "registry.k8s.io/pause:3.10",
                 "resources": {"requests": {"cpu": "1"}, "limits": {"nvidia.com/gpu": str(gpus)}}}
            ],
        }  # fmt: skip
        if host:
            spec["nodeSelector"] = {"kubernetes.io/hostname": host}
        if priority_class:
            spec["priorityClassName"] = priority_class
        queue = "training" if ns == "training" else NS
        body = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": queue}},
            "spec": {"suspend": True, "parallelism": 1, "completions": 1, "template": {"spec": spec}},
        }
        self.batch.create_namespaced_job(ns, body)
        return name

    def running(self, ns: str) -> list[client.V1Pod]:
        """The pods of namespace ``ns`` that are Running and not being deleted."""
        pods = self.core.list_namespaced_pod(ns).items
        return [p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]

    def until(self, what: str, cond: Any, timeout_s: float = 60.0) -> None:
        """Poll ``cond()`` every 0.1 s; ``SystemExit`` naming ``what`` after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise SystemExit(f"{what}: not within {timeout_s} s")
            time.sleep(0.1)


def run(exp: Experiment, training: dict[str, Any]) -> float:
    """The experiment (module docstring); returns lent GPUs lost ÷ GPUs needed."""
    exp.core.create_namespace({"metadata": {"name": NS}})
    spec = copy.deepcopy(training["spec"])
    spec["cohortName"] = "pool"
    spec["preemption"] = {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Any"}
    exp.custom.patch_cluster_custom_object(GROUP, VERSION, "clusterqueues", "training", {"spec": spec})
    lent = copy.deepcopy(training["spec"])
    lent["cohortName"] = "pool"
    lent.pop("preemption", None)
    for r in lent["resourceGroups"][0]["flavors"][0]["resources"]:
        r["nominalQuota"] = "0"
    exp.custom.create_cluster_custom_object(
        GROUP, VERSION, "clusterqueues",
        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterQueue", "metadata": {"name": NS}, "spec": lent},
    )  # fmt: skip
    exp.custom.create_namespaced_custom_object(
        GROUP, VERSION, NS, "localqueues",
        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LocalQueue", "metadata": {"name": NS, "namespace": NS},
         "spec": {"clusterQueue": NS}},
    )  # fmt: skip
    for host in NODES:
        exp.job("training", 6, host)
    exp.until("training holding 6 GPUs per node", lambda: len(exp.running("training")) == len(NODES))
    for n in range(2 * len(NODES)):  # admitted one at a time, interleaved over the nodes
        exp.job(NS, 1, NODES[n % len(NODES)], "gpupool-lent")
        exp.until(f"lent workload {n + 1} running", lambda n=n: len(exp.running(NS)) == n + 1)
    lent_before = {p.metadata.name for p in exp.running(NS)}
    needed = 2
    t0 = time.monotonic()
    job = exp.job("training", needed)
    went: dict[str, tuple[str, str]] = {}

    def placed() -> bool:
        for p in exp.core.list_namespaced_pod(NS).items:
            if p.metadata.deletion_timestamp and p.metadata.name not in went:
                why = [c.reason for c in p.status.conditions or [] if c.type == "DisruptionTarget"]
                went[p.metadata.name] = (p.spec.node_name, why[0] if why else "Kueue eviction")
        pods = exp.core.list_namespaced_pod("training", label_selector=f"job-name={job}").items
        return bool(pods) and pods[0].status.phase == "Running" and bool(pods[0].spec.node_name)

    exp.until("the 2-GPU training pod running", placed, 60)
    time.sleep(2.0)  # anything still being taken
    placed()
    pod = exp.core.list_namespaced_pod("training", label_selector=f"job-name={job}").items[0]
    lost = len(lent_before - {p.metadata.name for p in exp.running(NS)})
    print(
        f"training pod of {needed} GPUs running on {pod.spec.node_name} after {time.monotonic() - t0:.1f} s"
    )
    for name, (node, why) in sorted(went.items()):
        print(f"  lent pod {name} on {node}: {why}")
    print(f"lent GPUs lost / GPUs needed = {lost} / {needed} = {lost / needed:.2f}")
    return lost / needed


def cleanup(exp: Experiment, training: dict[str, Any]) -> None:
    """Delete the experiment's Jobs and pods (``training`` and the lent namespace), its lent
    LocalQueue, ClusterQueue and namespace, and put the ``training`` ClusterQueue's cohort and
    preemption back as ``training`` (its spec before the run) had them."""
    for ns in ("training", NS):
        try:
            for job in exp.batch.list_namespaced_job(ns).items:
                exp.batch.delete_namespaced_job(job.metadata.name, ns, propagation_policy="Background")
            exp.core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        except client.ApiException as e:
            if e.status != 404:
                raise
    for delete in (
        lambda: exp.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "localqueues", NS),
        lambda: exp.custom.delete_cluster_custom_object(GROUP, VERSION, "clusterqueues", NS),
        lambda: exp.core.delete_namespace(NS),
    ):
        try:
            delete()
        except client.ApiException as e:
            if e.status != 404:
                raise
    restore = {"cohortName": None, "preemption": training["spec"].get("preemption")}
    exp.custom.patch_cluster_custom_object(GROUP, VERSION, "clusterqueues", "training", {"spec": restore})


def main() -> int:
    """Run the experiment (module docstring) on the local cluster; exit 0 when it ran."""
    default = Path(os.environ.get("GPUPOOL_STATE", ".state")) / "kubernetes" / "kubeconfig"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kubeconfig", default=str(default))
    args = p.parse_args()
    exp = Experiment(config.new_client_from_config(config_file=args.kubeconfig))
    training = exp.custom.get_cluster_custom_object(GROUP, VERSION, "clusterqueues", "training")
    try:
        ratio = run(exp, training)
    finally:
        cleanup(exp, training)
    return 0 if ratio == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
