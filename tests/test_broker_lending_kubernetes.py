"""Leases in Kubernetes end to end (broker/lending_kubernetes.py): the broker on a real Kafka and
Mosquitto, lending the GPUs of the local control plane (deploy/local/kubernetes.sh: kwok nodes with
``nvidia.com/gpu``, Kueue's ``training`` queues, deploy/kubernetes/lending/lending.yaml applied), a
site on the SDK. The broker talks to the API server as its ServiceAccount
``gpupool:gpupool-broker`` (impersonated), so every test also checks that the Role of
lending.yaml is enough.

Training workloads are Kueue Jobs in LocalQueue ``training`` pinned to the test's node: Kueue
admits them (lent pods are not in its quota), kube-scheduler preempts lent pods for them with the
lease's notice as the grace period. Each test uses a node of its own; every pod of the lent
namespace and every training Job is deleted when it ends.

Not here: the workload-endpoint test of the Slurm lending. kwok runs no containers, and the
Kubernetes lending refuses claims naming a workload (:mod:`broker.lending_kubernetes`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from broker.config import BrokerConfig
from broker.edge import ClaimRejected, EdgeClient
from broker.lending_kubernetes import MANAGED_BY, MANAGER, KubernetesLending, parse_pod
from broker.service import BrokerService
from broker.workloads import WorkloadProfile
from contracts import CapacityUpdate, GpuState, KafkaTopics, LeaseState, ReasonCode, encode
from contracts.bus import Bus
from tests.mqtt_support import running
from tests.services import K8S_BUILD_TIMEOUT_S, kubernetes_built

pytestmark = pytest.mark.timeout(180 if kubernetes_built() else K8S_BUILD_TIMEOUT_S + 180)

NOTICE_S = 5
"""The leases' notice = the lent pods' termination grace period, seconds."""
LENT = "gpupool-lent"
TRAINING = "training"
GPU = "nvidia.com/gpu"
BROKER_SA = "system:serviceaccount:gpupool:gpupool-broker"


@pytest.fixture(scope="module")
def admin(kubeconfig: Path) -> client.ApiClient:
    """cluster-admin: the test's own view (training Jobs, cleanup)."""
    return config.new_client_from_config(config_file=str(kubeconfig))


def _as_broker(kubeconfig: Path) -> client.ApiClient:
    """A client acting as the broker's ServiceAccount (lending.yaml's Role only)."""
    api = config.new_client_from_config(config_file=str(kubeconfig))
    api.set_default_header("Impersonate-User", BROKER_SA)
    return api


@pytest.fixture(scope="module")
def broker_api(kubeconfig: Path) -> client.ApiClient:
    return _as_broker(kubeconfig)


class Training:
    """Training workloads of the test: Kueue Jobs of one pod pinned to a node."""

    def __init__(self, api: client.ApiClient) -> None:
        self.batch = client.BatchV1Api(api)
        self.core = client.CoreV1Api(api)
        self.names: list[str] = []

    def submit(self, host: str, gpus: int) -> str:
        """A Job of one pod asking for ``gpus`` GPUs on ``host``, queued to LocalQueue training."""
        name = f"train-{uuid.uuid4().hex[:8]}"
        container = {
            "name": "main",
            "image": "registry.k8s.io/pause:3.10",
            "resources": {"requests": {"cpu": "1"}, "limits": {GPU: str(gpus)}},
        }
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": TRAINING}},
            "spec": {
                "suspend": True,
                "parallelism": 1,
                "completions": 1,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "terminationGracePeriodSeconds": 0,
                        "nodeSelector": {"kubernetes.io/hostname": host},
                        "containers": [container],
                    }
                },
            },
        }
        self.batch.create_namespaced_job(TRAINING, job)
        self.names.append(name)
        return name

    def pods(self, job: str) -> list[client.V1Pod]:
        return list(self.core.list_namespaced_pod(TRAINING, label_selector=f"job-name={job}").items)

    def state(self, job: str) -> str:
        """``queued`` (no pod: Kueue has not admitted it), ``pending`` (a pod, not bound),
        ``running``."""
        pods = self.pods(job)
        if not pods:
            return "queued"
        if all(p.spec.node_name and p.status.phase == "Running" for p in pods):
            return "running"
        return "pending"

    def clean(self) -> None:
        for name in self.names:
            with contextlib.suppress(ApiException):
                self.batch.delete_namespaced_job(name, TRAINING, propagation_policy="Background")
        self.core.delete_collection_namespaced_pod(TRAINING, grace_period_seconds=0)


@dataclass
class Seen:
    """What the test's own watch saw of one lent pod."""

    deleting_seen: float | None = None
    """When the test's watch first saw its deletionTimestamp (Unix s, this machine's clock)."""
    deleting_at: float | None = None
    disrupted_by: str = ""
    gone_seen: float | None = None


class LentWatch:
    """The test's own watch of the lent namespace (a thread): when each pod was first seen being
    deleted, by whom, and gone."""

    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.pods: dict[str, Seen] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        version = self.core.list_namespaced_pod(LENT).metadata.resource_version
        while not self._stop.is_set():
            w = watch.Watch()
            for event in w.stream(
                self.core.list_namespaced_pod, LENT, resource_version=version, timeout_seconds=2
            ):
                now = time.time()
                pod = parse_pod(event["object"])
                version = event["object"].metadata.resource_version
                if pod is None:
                    continue
                seen = self.pods.setdefault(pod.name, Seen())
                if event["type"] == "DELETED":
                    seen.gone_seen = seen.gone_seen or now
                if pod.deleting_at is not None and seen.deleting_seen is None:
                    seen.deleting_seen, seen.deleting_at = now, pod.deleting_at
                seen.disrupted_by = seen.disrupted_by or pod.disrupted_by

    def __enter__(self) -> LentWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()

    def preempted(self) -> list[str]:
        """Pods kube-scheduler chose as preemption victims."""
        return [n for n, s in self.pods.items() if s.disrupted_by == "PreemptionByScheduler"]


@pytest.fixture
def cluster(admin: client.ApiClient) -> Iterator[Training]:
    """Training Jobs of the test; after it, every training Job and every lent pod deleted."""
    core = client.CoreV1Api(admin)
    core.delete_collection_namespaced_pod(LENT, grace_period_seconds=0)
    training = Training(admin)
    yield training
    training.clean()
    core.delete_collection_namespaced_pod(LENT, grace_period_seconds=0)
    deadline = time.monotonic() + 30
    while core.list_namespaced_pod(LENT).items or core.list_namespaced_pod(TRAINING).items:
        assert time.monotonic() < deadline, "pods left after the test"
        time.sleep(0.1)


def _lent_running(api: client.ApiClient, host: str) -> list[str]:
    """gpupool's pods on ``host`` that hold their GPU (bound, Running, not being deleted)."""
    pods = client.CoreV1Api(api).list_namespaced_pod(LENT, label_selector=f"{MANAGED_BY}={MANAGER}").items
    return [p.name for p in (parse_pod(i) for i in pods) if p is not None and p.node == host and p.holding]


async def _idle(bus: Bus, topics: KafkaTopics, host: str, gpus: int = 8) -> None:
    """Capacity: every GPU of ``host`` idle (keys ``<host>/gpu<slot>``)."""
    producer = bus.producer()
    await producer.start()
    now = time.time()
    for i in range(gpus):
        u = CapacityUpdate(
            ts=now, host=host, gpu_uuid=f"gpu{i}", state=GpuState.IDLE, since=now - 60,
            predicted_idle_until=now + 3600, model_name="NVIDIA H100 80GB HBM3",
        )  # fmt: skip
        await producer.send(topics.capacity, encode(u), key=u.key)
    await producer.flush()
    await producer.stop()


PROFILE = WorkloadProfile(name="infer", argv=("true", "{port}"), port_min=28200, port_max=28299)


def _lending(api: client.ApiClient) -> KubernetesLending:
    return KubernetesLending(api, namespace=LENT, notice_s=NOTICE_S, poll_s=0.2)


@contextlib.asynccontextmanager
async def _broker(
    bus: Bus, topics: KafkaTopics, creds: dict[str, Any], lending: KubernetesLending, group: str | None = None
) -> AsyncIterator[BrokerService]:
    cfg = BrokerConfig(
        offer_ttl_s=60, notice_s=NOTICE_S, lease_ttl_s=60, tick_s=0.1, group_id=group or f"g-{uuid.uuid4().hex}",
        workloads=(PROFILE,),
    )  # fmt: skip
    svc = BrokerService(
        bus=bus, topics=topics, mqtt_host=creds["host"], mqtt_port=creds["port"],
        mqtt_username="gpupool-broker", mqtt_password=creds["users"]["gpupool-broker"], root=creds["root"],
        protocol=5, config=cfg, client_id=f"broker-{uuid.uuid4().hex[:8]}", lending=lending,
    )  # fmt: skip
    async with running(svc):
        yield svc


def _site(creds: dict[str, Any], name: str = "edge-a") -> EdgeClient:
    return EdgeClient(
        site=name, host=creds["host"], port=creds["port"], username=name, password=creds["users"][name],
        root=creds["root"], protocol=5, client_id=f"{name}-{uuid.uuid4().hex[:8]}",
        reconnect_min_s=0.1, reconnect_max_s=0.5,
    )  # fmt: skip


async def _offer(site: EdgeClient, lending: KubernetesLending, host: str, gpus: int) -> str:
    """The newest offer of ``host`` once it names ``gpus`` GPUs held by placeholders."""
    for _ in range(300):
        offers = sorted((o for o in site.known_offers.values() if o.host == host), key=lambda o: o.ts)
        if offers and len(offers[-1].gpus) >= gpus and len(lending.idle_slots(host)) >= gpus:
            return offers[-1].offer_id
        await asyncio.sleep(0.05)
    raise AssertionError(f"no offer of {host} with {gpus} GPUs held by placeholders")


async def _until(cond: Any, timeout_s: float, step_s: float = 0.05) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        await asyncio.sleep(step_s)
    raise AssertionError(f"not within {timeout_s} s")


@contextlib.asynccontextmanager
async def _lent_node(
    bus: Bus, topics: KafkaTopics, creds: dict[str, Any], api: client.ApiClient, host: str
) -> AsyncIterator[tuple[KubernetesLending, EdgeClient, str]]:
    """Every GPU of ``host`` idle, a broker lending through Kubernetes, a site: (lending, site,
    the offer of ``host`` once placeholder pods hold its 8 GPUs)."""
    lending = _lending(api)
    await _idle(bus, topics, host)
    async with _broker(bus, topics, creds, lending), _site(creds) as site:
        yield lending, site, await _offer(site, lending, host, 8)


async def test_fencing_training_pends_while_the_lease_lives_and_runs_once_it_is_released(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any],
    broker_api: client.ApiClient, admin: client.ApiClient, cluster: Training,
) -> None:  # fmt: skip
    host = "gpu-node-001"
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, broker_api, host) as (
        lending,
        site,
        offer,
    ):
        lease = await site.claim(offer, count=8, duration_seconds=600)
        assert sorted(lease.gpus) == sorted(f"{host}/gpu{i}" for i in range(8))
        assert len(lending.held_gpus()[lease.lease_id]) == 8
        await _until(lambda: len(_lent_running(admin, host)) == 8, 5)
        train = cluster.submit(host, 1)
        # kube-scheduler preempts a lease pod: the lease is reclaimed, the training pod pends meanwhile
        msg = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 15)
        assert msg.reason is not None and msg.reason.startswith("scheduler_preempted:gpupool-gpu-node-001-")
        assert cluster.state(train) == "pending"
        await asyncio.sleep(1.0)
        assert cluster.state(train) == "pending"  # a second later: still fenced
        t0 = time.monotonic()
        await site.release(lease.lease_id)
        gone_s = await _until(lambda: not _lent_running(admin, host), 3.0, 0.02)
        assert gone_s <= 1.0, f"lease pods still holding {gone_s:.2f} s after the release"
        run_s = await _until(lambda: cluster.state(train) == "running", 10)
        print(
            f"lease pods gone {gone_s:.3f} s after release; training running {time.monotonic() - t0:.3f} s after ({run_s:.3f})"
        )


async def test_scheduler_preempts_a_lease_the_site_gets_the_deletion_timestamp_as_deadline_within_1s(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any],
    broker_api: client.ApiClient, admin: client.ApiClient, cluster: Training,
) -> None:  # fmt: skip
    host = "gpu-node-002"
    with LentWatch(admin) as seen:
        async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, broker_api, host) as (
            lending,
            site,
            offer,
        ):
            lease = await site.claim(offer, count=2, duration_seconds=600)
            lease_pods = lending.held_gpus()[lease.lease_id]
            submitted = time.time()
            train = cluster.submit(host, 8)  # needs the lent GPUs and the 6 idle placeholders'
            msg = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 15)
            noticed = time.time()
            assert msg.reason is not None
            victim = msg.reason.removeprefix("scheduler_preempted:")
            assert victim in lease_pods
            pod = seen.pods[victim]
            assert pod.deleting_at is not None and pod.deleting_seen is not None
            assert msg.reclaim_deadline == pod.deleting_at  # the scheduler's own deadline
            assert NOTICE_S - 1.5 <= msg.reclaim_deadline - submitted <= NOTICE_S + 10
            latency = noticed - pod.deleting_seen
            assert latency <= 1.0, f"notice {latency:.3f} s after the pod was seen being deleted"
            # idle placeholders chosen as victims go at once: training does not wait for their grace
            idle_victims = [n for n in seen.preempted() if n not in lease_pods]
            assert idle_victims
            await _until(lambda: all(seen.pods[n].gone_seen for n in idle_victims), 3)
            assert all(seen.pods[n].gone_seen - seen.pods[n].deleting_seen <= 1.5 for n in idle_victims)  # type: ignore[operator]
            assert cluster.state(train) == "pending"
            revoked = await site.wait_lease(
                lease.lease_id, lambda m: m.state is LeaseState.REVOKED, NOTICE_S + 5
            )
            assert revoked.ts <= msg.reclaim_deadline + 1.0
            await _until(lambda: cluster.state(train) == "running", msg.reclaim_deadline - time.time() + 5)
            print(
                f"notice at the site {latency * 1000:.0f} ms after the test saw the deletionTimestamp; "
                f"{noticed - submitted:.2f} s after the training submit; deadline {msg.reclaim_deadline - submitted:.2f} s"
            )


async def test_evicts_only_the_gpus_training_needs(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any],
    broker_api: client.ApiClient, admin: client.ApiClient, cluster: Training,
) -> None:  # fmt: skip
    host, needed = "gpu-node-003", 3
    with LentWatch(admin) as seen:
        async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, broker_api, host) as (
            lending,
            site,
            offer,
        ):
            leases = []
            for left in range(8, 0, -1):  # every GPU of the node lent, one lease each
                leases.append(
                    await site.claim(await _offer(site, lending, host, left), count=1, duration_seconds=600)
                )
            assert not lending.idle_slots(host)
            cluster.submit(host, needed)  # fewer than the 8 lent
            await _until(lambda: len(seen.preempted()) >= needed, 15)
            await asyncio.sleep(NOTICE_S + 2)  # past the deadline: nothing more is taken
            reclaimed = [
                m.lease_id
                for m in site.known_leases.values()
                if m.state in (LeaseState.RECLAIMING, LeaseState.REVOKED)
            ]
            evicted = len(seen.preempted())
            print(
                f"GPUs evicted / GPUs needed = {evicted} / {needed} = {evicted / needed:.2f}; leases reclaimed {len(reclaimed)}"
            )
            assert evicted / needed == 1.0
            assert len(reclaimed) == needed, reclaimed
            assert len(_lent_running(admin, host)) == 8 - needed  # the other leases keep their GPUs


async def test_gpupool_down_training_still_takes_the_lent_gpus(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any],
    broker_api: client.ApiClient, admin: client.ApiClient, cluster: Training,
) -> None:  # fmt: skip
    host = "gpu-node-004"
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, broker_api, host) as (
        lending,
        site,
        offer,
    ):
        await site.claim(offer, count=4, duration_seconds=600)
        await _until(lambda: bool(lending.held_gpus()), 2)
    # every gpupool process of this test is stopped (broker, its watch, the site); Kubernetes alone
    assert not lending.watching
    await _until(lambda: len(_lent_running(admin, host)) == 8, 5)
    submitted = time.monotonic()
    train = cluster.submit(host, 8)
    run_s = await _until(lambda: cluster.state(train) == "running", NOTICE_S + 10, 0.1)
    assert not _lent_running(admin, host)
    print(
        f"training needing the lent GPUs running {time.monotonic() - submitted:.3f} s after submit ({run_s:.3f})"
    )


async def test_a_claim_naming_a_workload_is_refused(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any],
    broker_api: client.ApiClient, admin: client.ApiClient, cluster: Training,
) -> None:  # fmt: skip
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, broker_api, "gpu-node-001") as (
        lending,
        site,
        offer,
    ):
        with pytest.raises(ClaimRejected) as refused:
            await site.claim(offer, count=1, workload="infer")
        assert refused.value.reply.code is ReasonCode.ISOLATION_FAILED
        assert "holds GPUs only" in refused.value.reply.text
        assert not lending.held_gpus()
        assert len(lending.idle_slots("gpu-node-001")) == 8  # nothing was carved


def test_the_broker_role_is_least_privilege(broker_api: client.ApiClient) -> None:
    """The broker's ServiceAccount may manage pods in the lent namespace and nothing else."""
    core = client.CoreV1Api(broker_api)
    core.list_namespaced_pod(LENT)
    for call in (
        lambda: core.list_namespaced_pod(TRAINING),
        lambda: core.list_node(),
        lambda: core.list_namespaced_secret(LENT),
        lambda: core.create_namespaced_pod(TRAINING, {"metadata": {"name": "x"}, "spec": {"containers": []}}),
        lambda: client.BatchV1Api(broker_api).list_namespaced_job(TRAINING),
    ):
        with pytest.raises(ApiException) as denied:
            call()
        assert denied.value.status == 403


async def test_restart_adopts_the_pods_of_live_leases_and_deletes_the_others(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any],
    broker_api: client.ApiClient, admin: client.ApiClient, cluster: Training,
) -> None:  # fmt: skip
    host, bus = "gpu-node-002", kafka_bus
    async with _lent_node(bus, kafka_stage_topics, mosquitto, broker_api, host) as (lending, site, offer):
        kept = await site.claim(offer, count=2, duration_seconds=600)
        short = await site.claim(await _offer(site, lending, host, 6), count=1, duration_seconds=2)
        kept_pods = set(lending.held_gpus()[kept.lease_id])
        short_pods = set(lending.held_gpus()[short.lease_id])
    await asyncio.sleep(3.0)  # the short lease ends while no broker runs: its pod stays meanwhile
    assert short_pods <= set(_lent_running(admin, host))
    again = _lending(broker_api)
    async with _broker(kafka_bus, kafka_stage_topics, mosquitto, again), _site(mosquitto) as site:
        assert set(again.held_gpus()[kept.lease_id]) == kept_pods  # adopted, not recreated
        assert short.lease_id not in again.held_gpus()
        await _until(lambda: not short_pods & set(_lent_running(admin, host)), 3)
        assert kept_pods <= set(_lent_running(admin, host))
        # the adopted lease is still taken back with notice
        cluster.submit(host, 8)
        msg = await site.wait_lease(kept.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 15)
        assert msg.reason is not None and msg.reason.removeprefix("scheduler_preempted:") in kept_pods
