"""Leases in Kubernetes end to end (broker/lending_kubernetes.py): the broker on a real Kafka and
Mosquitto, lending the GPUs of the local control plane (deploy/local/kubernetes.sh: kwok nodes with
``nvidia.com/gpu``, Kueue's ``training`` queues, deploy/kubernetes/lending/lending.yaml applied), a
site on the SDK. The broker talks to the API server as its ServiceAccount
``gpupool:gpupool-broker`` (impersonated), so every test also checks that the Role of
lending.yaml is enough.

Training workloads are Kueue Jobs in LocalQueue ``training`` pinned to the test's node: Kueue
admits them (lent pods are not in its quota), kube-scheduler preempts lent pods for them with the
lease's notice as the grace period. Every pod of the lent namespace and every training Job is
deleted when a test ends. Fencing and gpupool-down run for every scheduler in
tests/test_broker_lending_schedulers.py.

The workload-endpoint test runs for every scheduler in tests/test_broker_lending_schedulers.py,
on the one node with a kubelet (deploy/local/kubelet.sh). kwok's nodes run no containers: a claim
naming a workload there is refused (below)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from broker.edge import ClaimRejected, EdgeClient
from broker.lending_kubernetes import KubernetesLending, parse_pod
from broker.workloads import WorkloadProfile
from contracts import KafkaTopics, LeaseState, ReasonCode
from contracts.bus import Bus
from tests.lending_support import (
    KUBE_LENT,
    KUBE_TRAINING,
    LOCAL_WORKLOAD_IMAGE,
    KubernetesUnderTest,
    as_broker,
    edge_site,
    held_offer,
    idle_capacity,
    lending_broker,
    until,
)
from tests.services import K8S_BUILD_TIMEOUT_S, kubernetes_built

pytestmark = pytest.mark.timeout(180 if kubernetes_built() else K8S_BUILD_TIMEOUT_S + 180)

NOTICE_S = 5
"""The leases' notice = the lent pods' termination grace period, seconds."""
LENT, TRAINING = KUBE_LENT, KUBE_TRAINING


@pytest.fixture
def kube(kubeconfig: Path) -> Iterator[KubernetesUnderTest]:
    """The local control plane as the shared lending tests drive it; every training Job and lent
    pod deleted before and after the test."""
    sched = KubernetesUnderTest(kubeconfig, NOTICE_S, workloads=(PROFILE,))
    sched.clean()
    yield sched
    sched.clean()


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


PROFILE = WorkloadProfile(
    name="infer", argv=("true", "{port}"), port_min=28200, port_max=28299, image=LOCAL_WORKLOAD_IMAGE
)


@contextlib.asynccontextmanager
async def _lent_node(
    bus: Bus, topics: KafkaTopics, creds: dict[str, Any], kube: KubernetesUnderTest, host: str
) -> AsyncIterator[tuple[KubernetesLending, EdgeClient, str]]:
    """Every GPU of ``host`` idle, a broker lending through Kubernetes, a site: (lending, site,
    the offer of ``host`` once placeholder pods hold its 8 GPUs)."""
    lending = kube.lending()
    await idle_capacity(bus, topics, host)
    async with lending_broker(bus, topics, creds, lending, NOTICE_S, (PROFILE,)), edge_site(creds) as site:
        yield lending, site, await held_offer(site, lambda: len(lending.idle_slots(host)), host, 8)


async def test_scheduler_preempts_a_lease_the_site_gets_the_deletion_timestamp_as_deadline_within_1s(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any],
    kube: KubernetesUnderTest,
) -> None:  # fmt: skip
    host = "gpu-node-002"
    with LentWatch(kube.admin) as seen:
        async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, kube, host) as (
            lending,
            site,
            offer,
        ):
            lease = await site.claim(offer, count=2, duration_seconds=600)
            lease_pods = lending.held_gpus()[lease.lease_id]
            submitted = time.time()
            train = kube.submit_training(host, 8)  # needs the lent GPUs and the 6 idle placeholders'
            msg = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 15)
            noticed = time.time()
            assert msg.reason is not None
            victim = msg.reason.removeprefix("scheduler_preempted:")
            assert victim in lease_pods
            # the test's own watch (a thread) may see the deletion after the broker did
            await until(lambda: (p := seen.pods.get(victim)) is not None and p.deleting_at is not None, 5)
            pod = seen.pods[victim]
            assert pod.deleting_at is not None and pod.deleting_seen is not None
            assert msg.reclaim_deadline == pod.deleting_at  # the scheduler's own deadline
            assert NOTICE_S - 1.5 <= msg.reclaim_deadline - submitted <= NOTICE_S + 10
            latency = max(0.0, noticed - pod.deleting_seen)  # 0: the test's watch was the later one
            assert latency <= 1.0, f"notice {latency:.3f} s after the pod was seen being deleted"
            # idle placeholders chosen as victims go at once: training does not wait for their grace
            idle_victims = [n for n in seen.preempted() if n not in lease_pods]
            assert idle_victims
            await until(lambda: all(seen.pods[n].gone_seen for n in idle_victims), 3)
            assert all(seen.pods[n].gone_seen - seen.pods[n].deleting_seen <= 1.5 for n in idle_victims)  # type: ignore[operator]
            assert kube.training_state(train) == "pending"
            revoked = await site.wait_lease(
                lease.lease_id, lambda m: m.state is LeaseState.REVOKED, NOTICE_S + 5
            )
            assert revoked.ts <= msg.reclaim_deadline + 1.0
            await until(
                lambda: kube.training_state(train) == "running", msg.reclaim_deadline - time.time() + 5
            )
            print(
                f"notice at the site {latency * 1000:.0f} ms after the test saw the deletionTimestamp; "
                f"{noticed - submitted:.2f} s after the training submit; deadline {msg.reclaim_deadline - submitted:.2f} s"
            )


async def test_evicts_only_the_gpus_training_needs(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any],
    kube: KubernetesUnderTest,
) -> None:  # fmt: skip
    host, needed = "gpu-node-003", 3
    with LentWatch(kube.admin) as seen:
        async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, kube, host) as (
            lending,
            site,
            offer,
        ):
            leases = []
            for left in range(8, 0, -1):  # every GPU of the node lent, one lease each
                for _ in range(20):  # the offer the site saw may just have been replaced: claim again
                    offer = await held_offer(site, lambda: len(lending.idle_slots(host)), host, left)
                    try:
                        leases.append(await site.claim(offer, count=1, duration_seconds=600))
                        break
                    except ClaimRejected as e:
                        assert e.reply.code is ReasonCode.UNKNOWN_OFFER, e.reply
                        await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"no lease on {host} with {left} GPUs left")
            assert not lending.idle_slots(host)
            kube.submit_training(host, needed)  # fewer than the 8 lent
            await until(lambda: len(seen.preempted()) >= needed, 15)
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
            assert len(kube.lent_holding(host)) == 8 - needed  # the other leases keep their GPUs


async def test_a_claim_naming_a_workload_on_a_node_that_runs_no_containers_is_refused(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any],
    kube: KubernetesUnderTest,
) -> None:  # fmt: skip
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, kube, "gpu-node-001") as (
        lending,
        site,
        offer,
    ):
        with pytest.raises(ClaimRejected) as refused:
            await site.claim(offer, count=1, workload="infer")
        assert refused.value.reply.code is ReasonCode.ISOLATION_FAILED
        assert "node gpu-node-001 runs no containers" in refused.value.reply.text
        assert not lending.held_gpus()
        assert len(lending.idle_slots("gpu-node-001")) == 8  # nothing was carved


def test_the_broker_role_is_least_privilege(kubeconfig: Path) -> None:
    """The broker's ServiceAccount may manage pods in the lent namespace and nothing else."""
    broker_api = as_broker(kubeconfig)
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
    kube: KubernetesUnderTest,
) -> None:  # fmt: skip
    host, bus = "gpu-node-002", kafka_bus
    async with _lent_node(bus, kafka_stage_topics, mosquitto, kube, host) as (lending, site, offer):
        kept = await site.claim(offer, count=2, duration_seconds=600)
        short = await site.claim(
            await held_offer(site, lambda: len(lending.idle_slots(host)), host, 6),
            count=1,
            duration_seconds=2,
        )
        kept_pods = set(lending.held_gpus()[kept.lease_id])
        short_pods = set(lending.held_gpus()[short.lease_id])
    await asyncio.sleep(3.0)  # the short lease ends while no broker runs: its pod stays meanwhile
    assert short_pods <= set(kube.lent_holding(host))
    again = kube.lending()
    async with (
        lending_broker(kafka_bus, kafka_stage_topics, mosquitto, again, NOTICE_S),
        edge_site(mosquitto) as site,
    ):
        assert set(again.held_gpus()[kept.lease_id]) == kept_pods  # adopted, not recreated
        assert short.lease_id not in again.held_gpus()
        await until(lambda: not short_pods & set(kube.lent_holding(host)), 3)
        assert kept_pods <= set(kube.lent_holding(host))
        # the adopted lease is still taken back with notice
        kube.submit_training(host, 8)
        msg = await site.wait_lease(kept.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 15)
        assert msg.reason is not None and msg.reason.removeprefix("scheduler_preempted:") in kept_pods
