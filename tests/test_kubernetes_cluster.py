"""The local Kubernetes control plane (deploy/local/kubernetes.sh) behaves as the Kubernetes lending
integration will rely on: the API answers, the kwok nodes carry ``nvidia.com/gpu``, Kueue admits a
training Job within the ClusterQueue's quota and holds it pending beyond, deletion honours a pod's
termination grace period, and kube-scheduler's priority preemption evicts a lower-priority pod that
holds GPUs with that pod's grace period (how training takes lent GPUs back with notice).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tests.services import K8S_BUILD_TIMEOUT_S, K8S_GPUS, K8S_NODES, kubernetes_built, run_service

# The first test's setup builds the control plane when its binaries are not cached yet.
pytestmark = pytest.mark.timeout(300 if kubernetes_built() else K8S_BUILD_TIMEOUT_S + 300)

T = TypeVar("T")

GPU = "nvidia.com/gpu"
TRAINING = "training"  # namespace, LocalQueue and ClusterQueue made by kubernetes.sh
QUOTA_GPUS = K8S_NODES * K8S_GPUS
GRACE_S = 3


def _until(what: str, probe: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    """Poll ``probe`` every 0.1 s until it returns something other than None/False; fail naming
    ``what`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def api(kubeconfig: Path) -> client.ApiClient:
    """A client of the local cluster (cluster-admin)."""
    return config.new_client_from_config(config_file=str(kubeconfig))


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    """A fresh namespace for this test; its pods are deleted at once afterwards (their GPUs free for
    the next test), the namespace itself is not waited for."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
    _until("test pods gone", lambda: not core.list_namespaced_pod(name).items)
    core.delete_namespace(name)


def _pod(name: str, gpus: int, grace_s: int, node: str | None = None, priority_class: str | None = None) -> dict[str, Any]:
    """A pod asking for ``gpus`` GPUs (kwok runs no container: it only plays the pod's status)."""
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace_s,
        "containers": [
            {
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": "1"}, "limits": {GPU: str(gpus)}},
            }
        ],
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _read_pod(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod | None:
    try:
        return core.read_namespaced_pod(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _running(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod | None:
    pod = _read_pod(core, namespace, name)
    return pod if pod is not None and pod.status.phase == "Running" else None


def test_api_answers_with_the_pinned_version(api: client.ApiClient) -> None:
    info = client.VersionApi(api).get_code()
    assert (info.major, info.minor, info.git_version) == ("1", "31", "v1.31.14")


def test_start_again_is_idempotent(kubeconfig: Path) -> None:
    done = run_service("kubernetes.sh", "start", 120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(kubeconfig)
    status = run_service("kubernetes.sh", "status", 60)
    assert status.returncode == 0 and status.stdout.strip() == str(kubeconfig), status.stderr


def test_kwok_nodes_are_ready_with_eight_gpus_each(api: client.ApiClient) -> None:
    nodes = {n.metadata.name: n for n in client.CoreV1Api(api).list_node().items}
    assert sorted(nodes) == [f"gpu-node-{i:03d}" for i in range(1, K8S_NODES + 1)]
    for node in nodes.values():
        assert node.status.allocatable[GPU] == str(K8S_GPUS)
        assert node.status.capacity[GPU] == str(K8S_GPUS)
        assert [c.status for c in node.status.conditions if c.type == "Ready"] == ["True"]
        assert node.metadata.labels["nvidia.com/gpu.present"] == "true"


def test_training_cluster_queue_quota_is_every_gpu_present(api: client.ApiClient) -> None:
    cq = client.CustomObjectsApi(api).get_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues", TRAINING)
    (flavor,) = cq["spec"]["resourceGroups"][0]["flavors"]
    quota = {r["name"]: r["nominalQuota"] for r in flavor["resources"]}
    assert quota[GPU] == str(QUOTA_GPUS)
    assert [c["status"] for c in cq["status"]["conditions"] if c["type"] == "Active"] == ["True"]


class _Jobs:
    """Kueue training Jobs in the ``training`` namespace, deleted (and their quota released) at the end."""

    def __init__(self, api: client.ApiClient) -> None:
        self.batch = client.BatchV1Api(api)
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.names: list[str] = []

    def submit(self, pods: int, gpus_per_pod: int) -> str:
        """A suspended Job of ``pods`` pods × ``gpus_per_pod`` GPUs queued to LocalQueue ``training``."""
        name = f"train-{uuid.uuid4().hex[:8]}"
        pod = _pod("x", gpus_per_pod, grace_s=0)
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": TRAINING}},
            "spec": {
                "suspend": True,
                "parallelism": pods,
                "completions": pods,
                "template": {"spec": {**pod["spec"], "restartPolicy": "Never"}},
            },
        }
        self.batch.create_namespaced_job(TRAINING, job)
        self.names.append(name)
        return name

    def workload(self, job: str) -> dict[str, Any] | None:
        """The Kueue Workload of ``job`` (owned by it), or None before Kueue made it."""
        items = self.custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", TRAINING, "workloads")["items"]
        for wl in items:
            if any(o["name"] == job for o in wl["metadata"].get("ownerReferences", [])):
                return dict(wl)
        return None

    def condition(self, job: str, kind: str) -> dict[str, Any] | None:
        wl = self.workload(job)
        if wl is None:
            return None
        for c in wl.get("status", {}).get("conditions", []):
            if c["type"] == kind:
                return dict(c)
        return None

    def admitted(self, job: str) -> bool:
        """Admitted by Kueue and started (unsuspended) with every pod Running."""
        c = self.condition(job, "Admitted")
        if c is None or c["status"] != "True" or self.batch.read_namespaced_job(job, TRAINING).spec.suspend:
            return False
        pods = self.core.list_namespaced_pod(TRAINING, label_selector=f"job-name={job}").items
        return bool(pods) and all(p.status.phase == "Running" for p in pods)

    def pending_for_quota(self, job: str) -> dict[str, Any] | None:
        """The QuotaReserved=False condition of a Workload Kueue could not fit, or None."""
        c = self.condition(job, "QuotaReserved")
        if c is not None and c["status"] == "False" and "insufficient unused quota" in c["message"]:
            return c
        return None

    def delete(self, job: str) -> None:
        self.batch.delete_namespaced_job(job, TRAINING, propagation_policy="Background")
        _until(f"workload of {job} gone", lambda: self.workload(job) is None)

    def delete_all(self) -> None:
        for name in self.names:
            try:
                self.batch.delete_namespaced_job(name, TRAINING, propagation_policy="Background")
            except ApiException as e:
                if e.status != 404:
                    raise
        _until("training pods gone", lambda: not self.core.list_namespaced_pod(TRAINING).items)
        _until(
            "training workloads gone",
            lambda: not self.custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", TRAINING, "workloads")["items"],
        )


@pytest.fixture
def jobs(api: client.ApiClient) -> Iterator[_Jobs]:
    j = _Jobs(api)
    yield j
    j.delete_all()


def test_kueue_admits_a_training_job_while_quota_is_free_and_holds_it_pending_beyond(jobs: _Jobs) -> None:
    # Three of the four nodes' GPUs: admitted, pods placed on the GPU nodes.
    big = jobs.submit(pods=K8S_NODES - 1, gpus_per_pod=K8S_GPUS)
    _until(f"{big} admitted and running", lambda: jobs.admitted(big))
    # Exactly the GPUs left: admitted too (the quota is <=, not <).
    rest = jobs.submit(pods=1, gpus_per_pod=K8S_GPUS)
    _until(f"{rest} admitted and running", lambda: jobs.admitted(rest))
    # One GPU more than is left (none): pending for quota, still suspended, no pod.
    extra = jobs.submit(pods=1, gpus_per_pod=1)
    reason = _until(f"{extra} pending for quota", lambda: jobs.pending_for_quota(extra))
    assert GPU in reason["message"]
    assert jobs.batch.read_namespaced_job(extra, TRAINING).spec.suspend is True
    assert not jobs.core.list_namespaced_pod(TRAINING, label_selector=f"job-name={extra}").items
    # Quota freed: the pending job is admitted.
    jobs.delete(rest)
    _until(f"{extra} admitted once quota is free", lambda: jobs.admitted(extra))


def test_pod_deletion_waits_for_its_termination_grace_period(api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, _pod("lease", 4, grace_s=GRACE_S))
    _until("pod running", lambda: _running(core, namespace, "lease"))
    asked = time.monotonic()
    core.delete_namespaced_pod("lease", namespace)
    terminating = _read_pod(core, namespace, "lease")
    assert terminating is not None and terminating.metadata.deletion_grace_period_seconds == GRACE_S
    _until("pod gone", lambda: _read_pod(core, namespace, "lease") is None, timeout_s=GRACE_S + 20)
    took = time.monotonic() - asked
    # deletionTimestamp has whole seconds: the pod may go up to 1 s early, never at once.
    assert GRACE_S - 1 <= took < GRACE_S + 10, took


def test_pod_deleted_with_no_grace_goes_at_once(api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, _pod("lease", 4, grace_s=30))
    _until("pod running", lambda: _running(core, namespace, "lease"))
    asked = time.monotonic()
    core.delete_namespaced_pod("lease", namespace, grace_period_seconds=0)
    _until("pod gone", lambda: _read_pod(core, namespace, "lease") is None, timeout_s=10)
    assert time.monotonic() - asked < 5


@pytest.fixture(scope="module")
def priority_classes(api: client.ApiClient) -> Iterator[tuple[str, str]]:
    """(low, high) PriorityClass names: lent GPUs' pods, and training's."""
    sched = client.SchedulingV1Api(api)
    suffix = uuid.uuid4().hex[:6]
    names = (f"lent-{suffix}", f"training-{suffix}")
    for name, value in zip(names, (100, 1000), strict=True):
        sched.create_priority_class(client.V1PriorityClass(metadata=client.V1ObjectMeta(name=name), value=value))
    yield names
    for name in names:
        sched.delete_priority_class(name)


def test_higher_priority_pod_preempts_a_lower_one_holding_gpus_with_its_grace_period(
    api: client.ApiClient, namespace: str, priority_classes: tuple[str, str]
) -> None:
    core = client.CoreV1Api(api)
    low, high = priority_classes
    node = f"gpu-node-{K8S_NODES:03d}"
    core.create_namespaced_pod(namespace, _pod("lent", K8S_GPUS, grace_s=GRACE_S, node=node, priority_class=low))
    lent = _until("lent pod running", lambda: _running(core, namespace, "lent"))
    assert lent.spec.node_name == node
    # Training needs the whole node: nothing else fits there, so the scheduler preempts.
    core.create_namespaced_pod(namespace, _pod("train", K8S_GPUS, grace_s=0, node=node, priority_class=high))

    def evicted() -> client.V1Pod | None:
        pod = _read_pod(core, namespace, "lent")
        return pod if pod is not None and pod.metadata.deletion_timestamp is not None else None

    victim = _until("lent pod preempted", evicted)
    assert victim.metadata.deletion_grace_period_seconds == GRACE_S
    assert any(c.type == "DisruptionTarget" and c.reason == "PreemptionByScheduler" for c in victim.status.conditions or [])
    deadline = victim.metadata.deletion_timestamp
    # The training pod waits for the notice: nominated to the node, not bound while the lent pod is there.
    train = _until("training pod nominated", lambda: (p := _read_pod(core, namespace, "train")) and p.status.nominated_node_name and p)
    assert train.status.nominated_node_name == node
    # Never both: the training pod bound (read first) while the lent pod still exists (read after).
    now_train, now_lent = _read_pod(core, namespace, "train"), _read_pod(core, namespace, "lent")
    assert not (now_train is not None and now_train.spec.node_name and now_lent is not None)
    running = _until("training pod running", lambda: _running(core, namespace, "train"), timeout_s=GRACE_S + 30)
    assert running.spec.node_name == node
    assert _read_pod(core, namespace, "lent") is None
    # Bound no earlier than the lent pod's deadline (whole seconds on both clocks: 1 s slack).
    scheduled = next(c.last_transition_time for c in running.status.conditions if c.type == "PodScheduled")
    assert (scheduled - deadline).total_seconds() >= -1, (scheduled, deadline)
    assert datetime.now(UTC) >= deadline
