"""The Kubernetes source over the real local control plane (deploy/local/kubernetes.sh: kwok nodes
with ``nvidia.com/gpu``, Kueue v0.17) and the real Kafka, reading the cluster as its ServiceAccount
``gpupool:gpupool-collector`` (impersonated: only the ClusterRole of
deploy/kubernetes/collector/collector.yaml).

Each test gets a namespace of its own with a ClusterQueue of 4 GPUs and a LocalQueue: a Job of 2
GPUs with a maximum execution time runs on gpu-node-003, a Job of 3 GPUs pinned there pends past
the quota, gpupool holds slot 7 with a lent pod, and a pod of 9 GPUs cannot be placed. The source's
records say so in Slurm's terms, and analytics, fed through Kafka, withholds the GPUs the pending
workload will need (``scheduler_planned``, at the estimate: the running workload's end) and does
not offer those the Job holds (``scheduler_allocated``), though DCGM says every GPU idles."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from analytics.classify import FB_USED, GR_ENGINE_ACTIVE, IdleConfig
from analytics.service import AnalyticsService
from collectors.kube_collector import KUEUE_GROUP, KUEUE_VERSION, KubernetesCollector
from collectors.kube_parse import parse_time
from contracts import GpuSample, GpuState, KafkaTopics, decode, encode
from contracts.bus import MemoryBus
from contracts.scheduler import LENT_JOB_NAME, SchedulerNode
from runtime.kafka import KafkaBus
from tests.lending_support import KUBE_LENT, as_broker
from tests.services import K8S_BUILD_TIMEOUT_S, kubernetes_built

pytestmark = pytest.mark.timeout(180 if kubernetes_built() else K8S_BUILD_TIMEOUT_S + 180)

HOST = "gpu-node-003"
COLLECTOR_ACCOUNT = "system:serviceaccount:gpupool:gpupool-collector"
KUEUE = (KUEUE_GROUP, KUEUE_VERSION)
MAX_EXEC_S = 600


def as_collector(kubeconfig: Path) -> client.ApiClient:
    """A client acting as the collector's ServiceAccount (impersonated)."""
    api = config.new_client_from_config(config_file=str(kubeconfig))
    api.set_default_header("Impersonate-User", COLLECTOR_ACCOUNT)
    return api


def _until(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
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
        _until(lambda: self._create_lq(lq), 30, "LocalQueue created (Kueue's webhook answers)")

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
        _until(  # the next test's GPUs are free again
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
    t = Team(kubeconfig)
    try:
        yield t
    finally:
        t.close()


def _scene(team: Team) -> float:
    """The scene of the module docstring; returns the running workload's quota reservation (Unix s)."""
    team.job("a", 2, max_exec_s=MAX_EXEC_S)
    _until(lambda: team.running("a"), 30, "job a running")
    team.lent_pod(7)
    team.job("b", 3)
    team.pod("huge", 9)
    _until(lambda: team.workload("b").get("status", {}).get("conditions"), 30, "workload b seen by Kueue")
    reserved = next(c for c in team.workload("a")["status"]["conditions"] if c["type"] == "QuotaReserved")
    return parse_time(reserved["lastTransitionTime"]) or 0.0


async def _collector_sees(
    collector: KubernetesCollector, cond: Callable[[SchedulerNode], bool]
) -> SchedulerNode:
    """Start the caches (if not yet) and wait until the record of HOST built from them satisfies ``cond``."""
    for informer in collector.informers:
        informer.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if collector.synced():
            records, _, _ = collector.build()
            node = next(r for r in records if r.host == HOST)
            if cond(node):
                return node
        await asyncio.sleep(0.1)
    pytest.fail(
        f"the source's caches never showed the scene: {[(i.resource, i.failure) for i in collector.informers]}"
    )


def _mine(node: SchedulerNode, ns: str) -> dict[int, str]:
    return {g.index: g.job_id or "" for g in node.gpus if g.allocated and (g.job_id or "").startswith(ns)}


async def test_records_say_what_runs_what_gpupool_holds_and_what_pends(
    kubeconfig: Path, team: Team, kafka_bus: KafkaBus, kafka_topics: KafkaTopics
) -> None:
    reserved_at = _scene(team)
    await kafka_bus.create_topics([kafka_topics.telemetry_scheduler], partitions=3)
    collector = KubernetesCollector(kafka_bus, kafka_topics, as_collector(kubeconfig))
    await collector.start()
    try:
        await _collector_sees(collector, lambda n: any(p.job_id == f"{team.ns}/b" for p in n.pending))
        read = await collector.collect()
        assert (
            read.ok
            and read.failure is None
            and read.overflow == 0
            and read.produced == len(read.records) == 4
        )
        node = next(r for r in read.records if r.host == HOST)
        assert node.scheduler == "kubernetes" and node.state == "MIXED" and node.schedulable
        mine = [
            (g.index, g.job_id, g.job_name, g.user, g.partition)
            for g in node.gpus
            if g.index in _mine(node, team.ns)
        ]
        assert mine == [
            (0, f"{team.ns}/a", "a", team.ns, team.ns),
            (1, f"{team.ns}/a", "a", team.ns, team.ns),
        ]
        lent = node.gpus[7]
        assert lent.allocated and lent.job_name == LENT_JOB_NAME and lent.user == KUBE_LENT
        assert [g.index for g in node.gpus if not g.allocated] == [2, 3, 4, 5, 6]
        [b] = [p for p in node.pending if p.job_id == f"{team.ns}/b"]
        assert (b.gpus, b.partition, b.user, b.reason) == (3, team.ns, team.ns, "Pending")
        assert b.planned_start == reserved_at + MAX_EXEC_S and b.planned_nodes == [HOST]
        [huge] = [p for p in node.pending if p.job_id == f"{team.ns}/huge"]
        assert (huge.gpus, huge.planned_start, huge.planned_nodes, huge.reason) == (
            9,
            None,
            [],
            "Unschedulable",
        )
        gauge = collector.metrics.registry.get_sample_value(
            "gpupool_collector_kubernetes_pending_gpus", {"queue": team.ns}
        )
        assert gauge == 3
        # what went to Kafka: one record per node, keyed by host
        consumer = kafka_bus.consumer([kafka_topics.telemetry_scheduler], f"g{uuid.uuid4().hex}")
        await consumer.start()
        msgs: list[Any] = []
        try:
            deadline = time.monotonic() + 20
            while len(msgs) < 4 and time.monotonic() < deadline:
                msgs += await consumer.getmany(timeout_s=1.0)
        finally:
            await consumer.stop()
        sent = {m.key: decode(SchedulerNode, m.value or b"") for m in msgs}
        assert set(sent) == {f"gpu-node-00{i}" for i in range(1, 5)} and sent[HOST] == node

        # the watch follows: a ends, b is admitted into the quota it frees and runs on slots 0-2
        team.batch.delete_namespaced_job("a", team.ns, propagation_policy="Background")
        node = await _collector_sees(collector, lambda n: set(_mine(n, team.ns).values()) == {f"{team.ns}/b"})
        assert sorted(_mine(node, team.ns)) == [0, 1, 2]
        assert not [p for p in node.pending if p.job_id == f"{team.ns}/b"]
    finally:
        await collector.stop()


async def test_end_to_end_pending_demand_withholds_gpus_and_allocations_are_busy(
    kubeconfig: Path, team: Team, kafka_bus: KafkaBus, kafka_stage_topics: KafkaTopics
) -> None:
    """collectors (Kubernetes) → Kafka → analytics: of gpu-node-003's 8 idle GPUs, 0-1 are held by
    Job a (scheduler_allocated), 2-4 are what pending Job b will need (scheduler_planned, at a's
    end), 5-6 are free and 7 is gpupool's hold: those three are offered as idle."""
    topics = kafka_stage_topics
    reserved_at = _scene(team)
    collector = KubernetesCollector(kafka_bus, topics, as_collector(kubeconfig))
    await collector.start()
    now = [time.time()]
    svc = AnalyticsService(
        bus=kafka_bus, topics=topics, db_path=":memory:", idle=IdleConfig(min_idle_s=30.0, stale_after_s=25.0),
        clock=lambda: now[0], refresh_s=3600.0, scheduler=True, group_id=f"g{uuid.uuid4().hex}",
    )  # fmt: skip
    await svc.start()
    try:
        await _collector_sees(collector, lambda n: any(p.job_id == f"{team.ns}/b" for p in n.pending))
        read = await collector.collect()
        assert read.ok
        ts = next(r.ts for r in read.records if r.host == HOST)
        producer = kafka_bus.producer("test-dcgm")
        await producer.start()
        try:
            for t in range(0, 41, 10):
                for i in range(8):
                    s = GpuSample(
                        ts=ts - 40 + t, host=HOST, gpu_uuid=f"GPU-{i}", gpu_index=i,
                        fields={GR_ENGINE_ACTIVE: 0.0, FB_USED: 0},
                    )  # fmt: skip
                    await producer.send(topics.telemetry_gpu, encode(s), key=s.partition_key)
            await producer.flush()
        finally:
            await producer.stop()
        now[0] = ts
        states: dict[str, Any] = {}

        async def settled() -> bool:
            await svc.step(timeout_s=0.5)
            states.update(svc.current_states())
            return (
                all(f"{HOST}/GPU-{i}" in states for i in range(8))
                and states[f"{HOST}/GPU-0"].reason is not None
            )

        deadline = time.monotonic() + 60
        while not await settled():
            assert time.monotonic() < deadline, f"analytics did not decide: {states}"
        got = {i: (states[f"{HOST}/GPU-{i}"].state, states[f"{HOST}/GPU-{i}"].reason) for i in range(8)}
        assert got == {
            0: (GpuState.UNKNOWN, "scheduler_allocated"),
            1: (GpuState.UNKNOWN, "scheduler_allocated"),
            2: (GpuState.UNKNOWN, "scheduler_planned"),
            3: (GpuState.UNKNOWN, "scheduler_planned"),
            4: (GpuState.UNKNOWN, "scheduler_planned"),
            5: (GpuState.IDLE, GR_ENGINE_ACTIVE),  # idle by DCGM, offered
            6: (GpuState.IDLE, GR_ENGINE_ACTIVE),  # idle by DCGM, offered
            7: (GpuState.IDLE, GR_ENGINE_ACTIVE),  # idle by DCGM, offered
        }, got
        for i in (2, 3, 4):
            assert states[f"{HOST}/GPU-{i}"].planned_start == reserved_at + MAX_EXEC_S
    finally:
        await svc.stop()
        await collector.stop()


def test_the_collector_role_reads_and_nothing_more(kubeconfig: Path) -> None:
    api = as_collector(kubeconfig)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    core.list_node()
    core.list_pod_for_all_namespaces()
    for plural in ("workloads", "localqueues", "clusterqueues"):
        custom.list_cluster_custom_object(*KUEUE, plural)
    pod = {"metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    for call in (
        lambda: core.create_namespaced_pod("training", pod),
        lambda: core.delete_namespaced_pod("x", KUBE_LENT),
        lambda: core.list_secret_for_all_namespaces(),
        lambda: core.list_namespaced_config_map("kube-system"),
        lambda: core.patch_node("gpu-node-001", {"spec": {"unschedulable": True}}),
        lambda: custom.patch_cluster_custom_object(*KUEUE, "clusterqueues", "training", {"spec": {}}),
        lambda: client.BatchV1Api(api).list_job_for_all_namespaces(),
    ):
        with pytest.raises(ApiException) as denied:
            call()
        assert denied.value.status == 403


async def test_a_denied_or_unreachable_api_server_fails_the_read_only_and_is_counted(
    kubeconfig: Path,
) -> None:
    bus, topics = MemoryBus(), KafkaTopics()
    await bus.create_topics([topics.telemetry_scheduler])
    # the broker's ServiceAccount may not list nodes: 403
    denied = KubernetesCollector(bus, topics, as_broker(kubeconfig))
    # nothing listens on port 1
    configuration = client.Configuration(host="https://127.0.0.1:1")
    configuration.verify_ssl = False
    unreachable = KubernetesCollector(bus, topics, client.ApiClient(configuration))
    for collector, reason in ((denied, "http_403"), (unreachable, "unreachable")):
        await collector.start()
        try:
            for informer in collector.informers:
                _until(
                    lambda i=informer: i.failure not in (None, "not_listed"), 15, f"{informer.resource} fails"
                )
            read = await collector.collect()
            assert not read.ok and read.produced == 0 and read.failure == f"nodes:{reason}"
            assert (
                collector.metrics.registry.get_sample_value(
                    "gpupool_collector_kubernetes_reads_total", {"outcome": "failed"}
                )
                == 1
            )
            assert (collector.metrics.registry.get_sample_value(
                "gpupool_collector_kubernetes_errors_total", {"resource": "nodes", "reason": reason}
            ) or 0) >= 1  # fmt: skip
        finally:
            await collector.stop()
