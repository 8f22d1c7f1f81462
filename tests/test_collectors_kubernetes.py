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
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from analytics.classify import FB_USED, GR_ENGINE_ACTIVE, IdleConfig
from analytics.service import AnalyticsService
from collectors.kube_collector import KubernetesCollector
from collectors.kube_parse import parse_time
from contracts import GpuSample, GpuState, KafkaTopics, decode, encode
from contracts.bus import MemoryBus
from contracts.scheduler import LENT_JOB_NAME, SchedulerNode
from runtime.kafka import KafkaBus
from tests.kube_support import HOST, KUEUE, Team, as_collector, until
from tests.kube_support import team as team  # the fixture
from tests.lending_support import KUBE_LENT, as_broker
from tests.services import K8S_BUILD_TIMEOUT_S, kubernetes_built

pytestmark = pytest.mark.timeout(180 if kubernetes_built() else K8S_BUILD_TIMEOUT_S + 180)

MAX_EXEC_S = 600
"""The running Job's maximum execution time (Kueue label ``max-exec-time-seconds``), seconds."""


def _scene(team: Team) -> float:
    """The scene of the module docstring; returns the running workload's quota reservation (Unix s)."""
    team.job("a", 2, max_exec_s=MAX_EXEC_S)
    until(lambda: team.running("a"), 30, "job a running")
    team.lent_pod(7)
    team.job("b", 3)
    team.pod("huge", 9)
    until(lambda: team.workload("b").get("status", {}).get("conditions"), 30, "workload b seen by Kueue")
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
                until(
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


async def test_collect_run_with_kubernetes_streams_node_records(
    kubeconfig: Path, kafka_bus: KafkaBus, kafka_stage_topics: KafkaTopics
) -> None:
    """``gpupool collect run --kubernetes --kubeconfig`` alone (no GPU source) reads the cluster
    every --kubernetes-interval and produces to the prefixed telemetry.scheduler, until SIGTERM; with
    a Slurm cluster too, the settings are refused (one training scheduler)."""
    topic = kafka_stage_topics.telemetry_scheduler
    gpupool = str(Path(sys.executable).parent / "gpupool")
    base = [gpupool, "collect", "run", "--kafka", kafka_bus.bootstrap_servers, "--topic-prefix",
            kafka_stage_topics.prefix, "--metrics-port", "0", "--kubernetes", "--kubeconfig", str(kubeconfig)]  # fmt: skip
    proc = subprocess.Popen(
        [*base, "--kubernetes-interval", "0.5"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    consumer = kafka_bus.consumer([topic], f"g{uuid.uuid4().hex}")
    await consumer.start()
    msgs: list[Any] = []
    try:
        deadline = time.monotonic() + 40
        while len(msgs) < 8 and time.monotonic() < deadline:  # two reads of four nodes
            msgs += await consumer.getmany(timeout_s=1.0)
    finally:
        await consumer.stop()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
    assert proc.returncode == 0, err[-2000:]
    records = [decode(SchedulerNode, m.value or b"") for m in msgs]
    assert len(records) >= 8 and all(r.scheduler == "kubernetes" and len(r.gpus) == 8 for r in records)
    assert {m.key for m in msgs} == {r.host for r in records} == {f"gpu-node-00{i}" for i in range(1, 5)}
    both = subprocess.run(
        [*base, "--slurm-conf", "/etc/slurm/slurm.conf"], capture_output=True, text=True, timeout=60
    )
    assert both.returncode == 2 and "kubernetes or slurm_conf, not both" in both.stderr, both.stderr[-1000:]
