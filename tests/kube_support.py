"""The local Kubernetes control plane as the Kubernetes source's tests drive it: a namespace of
the test's own with a Kueue ClusterQueue and LocalQueue (:class:`Team`), Jobs and pods pinned to a
node, pods as the broker's lent ones, and a client acting as the collector's ServiceAccount."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from collectors.kube_collector import KUEUE_GROUP, KUEUE_VERSION
from tests.lending_support import KUBE_LENT

HOST = "gpu-node-003"
COLLECTOR_ACCOUNT = "system:serviceaccount:gpupool:gpupool-collector"
KUEUE = (KUEUE_GROUP, KUEUE_VERSION)


def as_collector(kubeconfig: Path) -> client.ApiClient:
    """A client acting as the collector's ServiceAccount (impersonated)."""
    api = config.new_client_from_config(config_file=str(kubeconfig))
    api.set_default_header("Impersonate-User", COLLECTOR_ACCOUNT)
    return api


def until(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"not within {timeout_s} s: {what}")


class Team:
    """A namespace with its own ClusterQueue (``nvidia.com/gpu`` quota ``quota``) and LocalQueue
    ``q``; Jobs and lent pods made through it are deleted at the end."""

    def __init__(self, kubeconfig: Path, quota: int = 4) -> None:
        self.admin = config.new_client_from_config(config_file=str(kubeconfig))
        self.core, self.batch = client.CoreV1Api(self.admin), client.BatchV1Api(self.admin)
        self.custom = client.CustomObjectsApi(self.admin)
        self.ns = f"t-{uuid.uuid4().hex[:8]}"
        self.lent: list[str] = []
        self.core.create_namespace({"metadata": {"name": self.ns}})
        flavor = {"name": "gpu", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": str(quota)}]}
        cq = {
            "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "ClusterQueue", "metadata": {"name": self.ns},
            "spec": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.ns}},
                "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [flavor]}],
            },
        }  # fmt: skip
        self.custom.create_cluster_custom_object(*KUEUE, "clusterqueues", cq)
        lq = {
            "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "LocalQueue",
            "metadata": {"name": "q", "namespace": self.ns}, "spec": {"clusterQueue": self.ns},
        }  # fmt: skip
        until(lambda: self._create_lq(lq), 30, "LocalQueue created (Kueue's webhook answers)")

    def _create_lq(self, lq: dict[str, Any]) -> bool:
        try:
            self.custom.create_namespaced_custom_object(*KUEUE, self.ns, "localqueues", lq)
        except ApiException as e:
            if e.status == 409:
                return True
            return False
        return True

    def job(self, name: str, gpus: int, node: str = HOST, max_exec_s: int | None = None) -> None:
        """A Kueue Job of one pod of ``gpus`` GPUs pinned to ``node``."""
        labels = {"kueue.x-k8s.io/queue-name": "q"}
        if max_exec_s is not None:
            labels["kueue.x-k8s.io/max-exec-time-seconds"] = str(max_exec_s)
        container = {"name": "main", "image": "registry.k8s.io/pause:3.10",
                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}  # fmt: skip
        spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                "nodeSelector": {"kubernetes.io/hostname": node}, "containers": [container]}  # fmt: skip
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
               "spec": {"suspend": True, "template": {"spec": spec}}}  # fmt: skip
        self.batch.create_namespaced_job(self.ns, job)

    def pod(self, name: str, gpus: int, node: str = HOST, namespace: str | None = None, **meta: Any) -> None:
        """A bare pod of ``gpus`` GPUs pinned to ``node``."""
        container = {"name": "main", "image": "registry.k8s.io/pause:3.10",
                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}  # fmt: skip
        spec: dict[str, Any] = {"terminationGracePeriodSeconds": 0, "containers": [container],
                                "nodeSelector": {"kubernetes.io/hostname": node}}  # fmt: skip
        if namespace == KUBE_LENT:
            spec["priorityClassName"] = "gpupool-lent"
            self.lent.append(name)
        self.core.create_namespaced_pod(
            namespace or self.ns, {"metadata": {"name": name, **meta}, "spec": spec}
        )

    def lent_pod(self, slot: int, node: str = HOST) -> str:
        """A pod as the broker's placeholders are (lent namespace, gpupool labels, one GPU)."""
        name = f"gpupool-{self.ns}-gpu{slot}"
        labels = {"app.kubernetes.io/managed-by": "gpupool", "gpupool.io/node": node, "gpupool.io/slot": str(slot),
                  "gpupool.io/state": "idle"}  # fmt: skip
        self.pod(name, 1, node, namespace=KUBE_LENT, labels=labels)
        return name

    def running(self, job: str) -> bool:
        pods = self.core.list_namespaced_pod(
            self.ns, label_selector=f"batch.kubernetes.io/job-name={job}"
        ).items
        return bool(pods) and all(p.spec.node_name and p.status.phase == "Running" for p in pods)

    def workload(self, job: str) -> dict[str, Any]:
        """The Workload Kueue made for Job ``job`` (``{}`` before it exists)."""
        items = self.custom.list_namespaced_custom_object(*KUEUE, self.ns, "workloads")["items"]
        return next((w for w in items if w["metadata"]["ownerReferences"][0]["name"] == job), {})

    def close(self) -> None:
        for name in self.lent:
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_pod(name, KUBE_LENT, grace_period_seconds=0)
        with contextlib.suppress(ApiException):
            for job in self.batch.list_namespaced_job(self.ns).items:
                self.batch.delete_namespaced_job(job.metadata.name, self.ns, propagation_policy="Background")
            self.core.delete_collection_namespaced_pod(self.ns, grace_period_seconds=0)
        until(  # the next test's GPUs are free again
            lambda: not self.core.list_namespaced_pod(self.ns).items
            and not [p for p in self.core.list_namespaced_pod(KUBE_LENT).items if p.metadata.name in self.lent],
            30, "the test's pods gone",
        )  # fmt: skip
        with contextlib.suppress(ApiException):
            self.core.delete_namespace(self.ns, propagation_policy="Background")
        with contextlib.suppress(ApiException):
            self.custom.delete_cluster_custom_object(*KUEUE, "clusterqueues", self.ns)


@pytest.fixture
def team(kubeconfig: Path) -> Iterator[Team]:
    """A :class:`Team` (quota 4 GPUs), its pods gone and its objects deleted after the test."""
    t = Team(kubeconfig)
    try:
        yield t
    finally:
        t.close()
