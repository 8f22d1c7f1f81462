"""The Kubernetes lending without a cluster (broker/lending_kubernetes.py): pods as the broker reads
them, the placeholder manifest, carving in memory, what each pod event does, and the settings
that choose it. The same code over the real control plane: tests/test_broker_lending_kubernetes.py."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from broker.config import BrokerConfig
from broker.lending import LendingHooks, lending_from
import broker.lending_kubernetes
from broker.lending_kubernetes import (
    LEASE_ANNOTATION,
    NODE_LABEL,
    PORT_ANNOTATION,
    SLOT_LABEL,
    SLOTS_LABEL,
    KubernetesLending,
    LentPod,
    lease_pod,
    parse_pod,
    placeholder_pod,
)
from broker.metrics import BrokerMetrics
from broker.workloads import WorkloadError, WorkloadProfile
from contracts import LeaseLogRecord, LeaseState
from runtime.settings import BrokerSettings

HOST = "gpu-node-001"


def _pod(
    name: str = "p", labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
    phase: str = "Running", node: str | None = HOST, deleting: datetime | None = None,
    conditions: list[client.V1PodCondition] | None = None, container_id: str | None = None,
    pod_ip: str | None = None,
) -> client.V1Pod:  # fmt: skip
    statuses = None
    if container_id is not None:
        statuses = [client.V1ContainerStatus(
            name="c", image="i", image_id="", ready=True, restart_count=0, container_id=container_id,
        )]  # fmt: skip
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name, labels=labels if labels is not None else {NODE_LABEL: HOST, SLOT_LABEL: "3"},
            annotations=annotations, deletion_timestamp=deleting,
            creation_timestamp=datetime(2026, 1, 1, tzinfo=UTC),
        ),
        spec=client.V1PodSpec(containers=[], node_name=node),
        status=client.V1PodStatus(phase=phase, conditions=conditions, container_statuses=statuses, pod_ip=pod_ip),
    )  # fmt: skip


def test_parse_pod_reads_node_slot_lease_deletion_and_the_disruption() -> None:
    deleting = datetime(2026, 1, 1, 0, 0, 30, tzinfo=UTC)
    chosen = client.V1PodCondition(
        type="DisruptionTarget", status="True", reason="PreemptionByScheduler",
        last_transition_time=datetime(2026, 1, 1, 0, 0, 25, tzinfo=UTC),
    )  # fmt: skip
    pod = parse_pod(_pod(annotations={LEASE_ANNOTATION: "L1"}, deleting=deleting, conditions=[chosen]))
    assert pod == LentPod(
        name="p", node=HOST, slot=3, lease_id="L1", phase="Running", bound=True,
        deleting_at=deleting.timestamp(), disrupted_at=deleting.timestamp() - 5,
        disrupted_by="PreemptionByScheduler", created_at=datetime(2026, 1, 1, tzinfo=UTC).timestamp(),
    )  # fmt: skip
    assert not pod.holding  # being deleted
    assert parse_pod(_pod()).holding  # type: ignore[union-attr]
    assert not parse_pod(_pod(node=None)).holding  # type: ignore[union-attr]  # not bound
    assert not parse_pod(_pod(phase="Pending")).holding  # type: ignore[union-attr]
    assert parse_pod(_pod(phase="Failed")).finished  # type: ignore[union-attr]


def test_parse_pod_reads_a_lease_pods_slots_port_ip_and_whether_a_runtime_runs_it() -> None:
    labels = {NODE_LABEL: HOST, SLOT_LABEL: "3", SLOTS_LABEL: "3-4"}
    pod = parse_pod(
        _pod(labels=labels, annotations={LEASE_ANNOTATION: "L1", PORT_ANNOTATION: "28100"},
             container_id="containerd://abc", pod_ip="10.244.250.7")
    )  # fmt: skip
    assert pod is not None
    assert (
        pod.all_slots == (3, 4) and pod.port == 28100 and pod.pod_ip == "10.244.250.7" and pod.runs_containers
    )
    kwok = parse_pod(_pod(container_id=""))  # kwok reports its containers with no container ID
    assert kwok is not None and kwok.all_slots == (3,) and kwok.port is None and not kwok.runs_containers
    assert parse_pod(_pod(labels={**labels, SLOTS_LABEL: "3-x"})) is None
    assert parse_pod(_pod(annotations={PORT_ANNOTATION: "http"})) is None


@pytest.mark.parametrize(
    "labels", [{}, {NODE_LABEL: HOST}, {SLOT_LABEL: "1"}, {NODE_LABEL: HOST, SLOT_LABEL: "x"}]
)
def test_parse_pod_ignores_a_pod_without_node_and_slot(labels: dict[str, str]) -> None:
    assert parse_pod(_pod(labels=labels)) is None


def test_placeholder_pod_holds_one_gpu_on_its_node_with_the_notice_as_grace() -> None:
    body = placeholder_pod(
        "n", HOST, 5, notice_s=2.1, priority_class="low", image="img", resource="nvidia.com/gpu"
    )
    spec = body["spec"]
    assert spec["terminationGracePeriodSeconds"] == 3  # rounded up: never less notice than promised
    assert spec["priorityClassName"] == "low"
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": HOST}
    assert "nodeName" not in spec  # placed by kube-scheduler, which checks the GPU is free
    (container,) = spec["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert body["metadata"]["labels"][NODE_LABEL] == HOST and body["metadata"]["labels"][SLOT_LABEL] == "5"


PROFILE = WorkloadProfile(
    name="infer", argv=("serve", "--port", "{port}", "--gpus", "{gpus}"), port_min=28100, port_max=28101,
    cpus_per_gpu=2, image="site/serve:1", host_paths=("/usr", "/opt/model"), health_timeout_s=1,
)  # fmt: skip


def test_lease_pod_runs_the_profile_on_all_its_gpus_with_the_notice_as_grace() -> None:
    body = lease_pod(
        "w", HOST, [4, 3], "L1", ("serve", "--port", "28100"), port=28100, profile=PROFILE, cpus=4,
        notice_s=2.1, active_deadline_s=600, priority_class="low", resource="nvidia.com/gpu",
    )  # fmt: skip
    spec, meta = body["spec"], body["metadata"]
    assert spec["terminationGracePeriodSeconds"] == 3 and spec["activeDeadlineSeconds"] == 600
    assert spec["priorityClassName"] == "low" and spec["nodeSelector"] == {"kubernetes.io/hostname": HOST}
    (container,) = spec["containers"]
    assert container["image"] == "site/serve:1" and container["command"] == ["serve", "--port", "28100"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}  # one pod, every GPU of the node
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {
        "GPUPOOL_LEASE_ID": "L1",
        "GPUPOOL_CPUS": "4",
        "OMP_NUM_THREADS": "4",
        "GPUPOOL_GPU_SLOTS": "3,4",
    }
    assert [m["readOnly"] for m in container["volumeMounts"]] == [True, True]
    assert [v["hostPath"]["path"] for v in spec["volumes"]] == ["/usr", "/opt/model"]
    assert meta["labels"][SLOT_LABEL] == "3" and meta["labels"][SLOTS_LABEL] == "3-4"
    assert meta["annotations"] == {LEASE_ANNOTATION: "L1", PORT_ANNOTATION: "28100"}
    parsed = parse_pod(client.ApiClient()._ApiClient__deserialize(body, "V1Pod"))  # type: ignore[attr-defined]
    assert parsed is not None and parsed.all_slots == (3, 4) and parsed.port == 28100
    with pytest.raises(WorkloadError, match="no image"):
        lease_pod(
            "w", HOST, [3], "L1", ("serve",), port=28100, profile=PROFILE.model_copy(update={"image": None}),
            cpus=1, notice_s=5, active_deadline_s=None, priority_class="low", resource="nvidia.com/gpu",
        )  # fmt: skip


class _Core:
    """Records the API calls the lending makes (none may reach a server here)."""

    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []
        self.refuse_create = False
        self.deleted: list[tuple[str, int]] = []
        self.patched: dict[str, dict[str, Any]] = {}
        self.missing: set[str] = set()
        self.hold_patch = threading.Event()
        self.hold_patch.set()

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict[str, Any], **_: Any) -> None:
        self.hold_patch.wait(5)
        self.patched[name] = body

    def read_namespaced_pod(self, name: str, namespace: str, **_: Any) -> client.V1Pod:
        if name in self.missing:
            raise ApiException(status=404)
        return _pod(name)

    def delete_namespaced_pod(self, name: str, namespace: str, grace_period_seconds: int, **_: Any) -> None:
        self.deleted.append((name, grace_period_seconds))

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any], **_: Any) -> None:
        if self.refuse_create:
            raise ApiException(status=403, reason="Forbidden")
        self.created.append(body)


class _Hooks:
    def __init__(self) -> None:
        self.reclaims: list[tuple[str, float, str]] = []

    async def reclaim(self, lease_id: str, deadline: float, reason: str) -> None:
        self.reclaims.append((lease_id, deadline, reason))

    async def lendable(self, _: frozenset[str]) -> None:
        return None


def _lending(
    hooks: _Hooks, now: float, runtime: bool = False, republished: list[str] | None = None
) -> tuple[KubernetesLending, _Core]:
    lending = KubernetesLending(client.ApiClient(), notice_s=5, workloads=(PROFILE,), clock=lambda: now)
    core = _Core()
    lending.core = core  # type: ignore[assignment]
    told = republished if republished is not None else []
    lending.bind(LendingHooks(hooks.reclaim, lambda: (), hooks.lendable, told.append), BrokerMetrics())
    for slot in range(4):
        pod = LentPod(
            name=f"ph{slot}", node=HOST, slot=slot, phase="Running", bound=True, created_at=now - 60,
            runs_containers=runtime,
        )  # fmt: skip
        lending._pods[pod.name] = pod
    lending._rebuild_idle()
    return lending, core


def _record(lease_id: str, *slots: int, workload: str | None = None) -> LeaseLogRecord:
    now = time.time()
    return LeaseLogRecord(
        lease_id=lease_id, site="edge-a", claim_id=f"c-{lease_id}", offer_id="o", state=LeaseState.GRANTED,
        gpus=[f"{HOST}/gpu{s}" for s in slots], ts=now, granted_at=now, expires_at=now + 60, notice_seconds=5,
        workload=workload,
    )  # fmt: skip


async def test_hold_carves_idle_placeholders_and_undoes_a_partial_carve() -> None:
    lending, _ = _lending(_Hooks(), time.time())
    assert await lending.hold(_record("L1", 0, 1)) == ""
    assert lending.held_gpus() == {"L1": ("ph0", "ph1")}
    assert lending.idle_slots(HOST) == {2, 3}
    # slot 3 is held, slot 7 is not: nothing carved, slot 3 still idle
    problem = await lending.hold(_record("L2", 3, 7))
    assert "gpu-node-001/gpu7" in problem and "claim again" in problem
    assert lending.idle_slots(HOST) == {2, 3} and "L2" not in lending.held_gpus()
    # a carved GPU is not carved twice
    assert await lending.hold(_record("L3", 1)) != ""
    assert "unknown workload profile" in await lending.hold(_record("L4", 2, workload="bitcoin-miner"))
    # the node's pods report no container ID (kwok): a workload cannot run there; nothing carved
    problem = await lending.hold(_record("L5", 2, workload="infer"))
    assert f"node {HOST} runs no containers" in problem
    assert lending.idle_slots(HOST) == {2, 3}


async def _settled(lending: KubernetesLending) -> None:
    """Cancel what the lending left running (releases wait for deletions no fake API reports)."""
    await asyncio.sleep(0.05)  # every task started (one cancelled before its first step warns)
    tasks = list(lending._tasks)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_workload_lease_pod_replaces_its_placeholders_and_takes_no_more_gpus() -> None:
    hooks, now = _Hooks(), time.time()
    lending, core = _lending(hooks, now, runtime=True)
    assert await lending.hold(_record("L1", 1, 2, workload="infer")) == ""
    assert lending.idle_slots(HOST) == {0, 3}
    for t in [t for t in lending._tasks if t.get_name().startswith("workload-start")]:
        await t
    (body,) = core.created
    name = body["metadata"]["name"]
    assert body["spec"]["containers"][0]["command"] == ["serve", "--port", "28100", "--gpus", "2"]
    assert body["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    # the placeholders go at once (their GPUs are the lease pod's), and their going is no hold lost
    assert sorted(core.deleted) == [("ph1", 0), ("ph2", 0)]
    assert lending.held_gpus() == {"L1": (name,)}
    for ph in ("ph1", "ph2"):
        await lending._on_event("DELETED", lending._pods[ph])
    assert hooks.reclaims == []
    # a second lease on the node gets the next port; a third finds none free
    assert await lending.hold(_record("L2", 0, workload="infer")) == ""
    assert "every port 28100-28101 is in use" in await lending.hold(_record("L3", 3, workload="infer"))
    # the lease pod holds slots 1 and 2: no placeholder is made for them
    await lending._on_event("ADDED", parse_pod(client.ApiClient()._ApiClient__deserialize(body, "V1Pod")))  # type: ignore[attr-defined]
    lending._to_hold = lambda: [f"{HOST}/gpu{s}" for s in range(4)]
    created = len(core.created)
    await lending._keep()
    assert len(core.created) == created
    lending.ended(_record("L1", 1, 2, workload="infer"))
    lending.ended(_record("L2", 0, workload="infer"))
    await _settled(lending)


async def _healthy(url: str, timeout_s: float, wanted: Any, step_s: float = 0.1) -> bool:
    return True


async def test_a_workload_lease_publishes_its_endpoint_once_its_pod_runs_and_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hooks, now, republished = _Hooks(), time.time(), []
    lending, core = _lending(hooks, now, runtime=True, republished=republished)
    monkeypatch.setattr(broker.lending_kubernetes, "wait_healthy", _healthy)
    assert await lending.hold(_record("L1", 1, 2, workload="infer")) == ""
    for t in [t for t in lending._tasks if t.get_name().startswith("workload-start")]:
        await t
    (body,) = core.created
    assert lending.endpoint("L1") == {}
    body["spec"]["nodeName"] = HOST
    pod = client.ApiClient()._ApiClient__deserialize(body, "V1Pod")  # type: ignore[attr-defined]
    pod.status = client.V1PodStatus(phase="Running", pod_ip="10.244.250.9")
    await lending._on_event("MODIFIED", parse_pod(pod))
    for t in [t for t in lending._tasks if t.get_name().startswith("workload-health")]:
        await asyncio.wait_for(t, 5)
    assert lending.endpoint("L1") == {HOST: "10.244.250.9:28100"} and republished == ["L1"]
    assert lending.lease_slots("L1") == (1, 2)
    lending.ended(_record("L1", 1, 2, workload="infer"))
    assert lending.endpoint("L1") == {}
    await _settled(lending)


async def test_events_preempted_lease_pod_gives_its_deletion_timestamp_lost_pod_reclaims_at_once() -> None:
    hooks, now = _Hooks(), time.time()
    lending, core = _lending(hooks, now)
    assert await lending.hold(_record("L1", 0, 1)) == ""
    assert await lending.hold(_record("L2", 2)) == ""
    chosen = LentPod(name="ph0", node=HOST, slot=0, phase="Running", bound=True, deleting_at=now + 5)
    await lending._on_event("MODIFIED", chosen)
    assert hooks.reclaims == [("L1", now + 5, "scheduler_preempted:ph0")]
    await lending._on_event("MODIFIED", chosen)  # the same event again: one notice only
    assert len(hooks.reclaims) == 1
    await lending._on_event("DELETED", LentPod(name="ph2", node=HOST, slot=2))
    assert hooks.reclaims[1] == ("L2", now, "hold_lost:ph2")


async def test_events_an_idle_placeholder_chosen_as_a_victim_is_deleted_with_no_grace() -> None:
    lending, core = _lending(_Hooks(), time.time())
    victim = LentPod(name="ph3", node=HOST, slot=3, phase="Running", bound=True, deleting_at=time.time() + 5)
    await lending._on_event("MODIFIED", victim)
    assert 3 not in lending.idle_slots(HOST)
    await next(t for t in lending._tasks if t.get_name() == "victim-ph3")
    assert core.deleted == [("ph3", 0)]
    # the pod gone: a SYNC (after the watch expired) that no longer lists ph0 counts it gone too
    await lending._on_event("DELETED", victim)
    listed = [p for p in lending._pods.values() if p.name != "ph0"]
    await lending._on_event("SYNC", listed)
    assert lending.idle_slots(HOST) == {1, 2}


def test_settings_choose_the_kubernetes_lending(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
        "current-context: x\n"
    )
    settings = BrokerSettings(
        scheduler="kubernetes", kubeconfig=kubeconfig, k8s_namespace="lent-b", k8s_poll_s=0.5
    )
    lending = lending_from(settings, BrokerConfig(notice_s=7), tmp_path)
    assert isinstance(lending, KubernetesLending)
    assert (lending.namespace, lending.notice_s, lending.poll_s, lending.enforced) == ("lent-b", 7, 0.5, True)
    with pytest.raises(ValueError):
        lending_from(
            BrokerSettings(scheduler="kubernetes", kubeconfig=tmp_path / "missing"), BrokerConfig(), tmp_path
        )


async def test_a_reclaim_gpupool_starts_deletes_the_lease_pods_with_the_grace_left() -> None:
    now = time.time()
    lending, core = _lending(_Hooks(), now)
    assert await lending.hold(_record("L1", 0, 1)) == ""
    assert await lending.hold(_record("L2", 2)) == ""
    deferred = _record("L2", 2).model_copy(
        update={"state": LeaseState.RECLAIMING, "reclaim_deadline": now + 6.5}
    )
    lending.reclaiming(deferred)  # past the notice + 1 s: a guarantee defers it, its pod stays
    reclaimed = _record("L1", 0, 1).model_copy(
        update={"state": LeaseState.RECLAIMING, "reclaim_deadline": now + 6.0}
    )
    lending.reclaiming(reclaimed)  # notice + 1 s exactly: signalled now
    lending.reclaiming(reclaimed)  # once
    for t in list(lending._tasks):
        await t
    assert sorted(core.deleted) == [("ph0", 6), ("ph1", 6)]
    # the carving was named in the background: the lease id, and the lease's end as the pod's deadline
    assert core.patched["ph0"]["metadata"]["annotations"] == {LEASE_ANNOTATION: "L1"}
    assert core.patched["ph2"]["metadata"]["annotations"] == {LEASE_ANNOTATION: "L2"}


async def test_placeholders_stay_on_gpus_to_hold_even_pending_and_go_unwanted_after_the_grace() -> None:
    now = [1000.0]
    hooks, wanted = _Hooks(), [f"{HOST}/gpu{s}" for s in (0, 1, 4)]
    lending = KubernetesLending(client.ApiClient(), notice_s=5, unwanted_grace_s=5, clock=lambda: now[0])
    core = _Core()
    lending.core = core  # type: ignore[assignment]
    lending.bind(LendingHooks(hooks.reclaim, lambda: wanted, hooks.lendable, lambda _: None), BrokerMetrics())
    for slot, bound in ((0, True), (1, False), (2, True)):  # slot 1: pending (training holds its GPU)
        pod = LentPod(
            name=f"ph{slot}", node=HOST, slot=slot, phase="Running" if bound else "Pending", bound=bound
        )
        await lending._on_event("ADDED", pod)
    created: list[tuple[str, int]] = []

    async def create(node: str, slot: int) -> None:
        created.append((node, slot))

    lending._create = create  # type: ignore[method-assign]
    await lending._keep()
    for t in list(lending._tasks):
        await t
    assert created == [(HOST, 4)]  # the one GPU to hold without a pod; pending slot 1 not recreated
    now[0] += 4.0
    await lending._keep()
    assert core.deleted == []  # slot 2 unwanted for less than the grace
    now[0] += 1.0
    await lending._keep()
    for t in list(lending._tasks):
        await t
    assert core.deleted == [("ph2", 0)]
    assert lending.idle_slots(HOST) == {0}


async def test_a_release_the_watch_does_not_see_through_is_checked_and_deleted_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(broker.lending_kubernetes, "_RELEASE_CHECK_S", 0.1)
    lending, core = _lending(_Hooks(), time.time())
    assert await lending.hold(_record("L1", 0, 1)) == ""
    core.missing = {"ph0"}  # ph0 is gone but its DELETED event was lost; ph1's delete was lost
    lending.ended(_record("L1", 0, 1))
    release = next(t for t in lending._tasks if t.get_name() == "hold-release-L1")
    await asyncio.sleep(0.3)
    assert "ph0" not in lending._pods  # counted gone
    assert core.deleted.count(("ph1", 0)) >= 2  # deleted again
    await lending._on_event("DELETED", lending._pods["ph1"])
    await release
    assert not lending._carved


async def test_a_pod_deleted_while_its_carving_is_being_named_does_not_come_back() -> None:
    lending, core = _lending(_Hooks(), time.time())
    core.hold_patch.clear()  # the patch naming ph0 after L1 is still on its way
    assert await lending.hold(_record("L1", 0)) == ""
    await asyncio.sleep(0.05)
    await lending._on_event("DELETED", lending._pods["ph0"])  # meanwhile the pod went
    core.hold_patch.set()
    await next(t for t in lending._tasks if t.get_name() == "hold-annotate-L1")
    assert "ph0" not in lending._pods  # a slot with no pod gets a placeholder again


async def _started(lending: KubernetesLending) -> None:
    for t in [t for t in lending._tasks if t.get_name().startswith("workload-start")]:
        await t


async def test_a_lease_pod_refused_by_the_api_reclaims_the_lease_at_once() -> None:
    hooks, now = _Hooks(), time.time()
    lending, core = _lending(hooks, now, runtime=True)
    core.refuse_create = True
    assert await lending.hold(_record("L1", 1, 2, workload="infer")) == ""
    await _started(lending)
    ((lease_id, deadline, reason),) = hooks.reclaims
    assert lease_id == "L1" and deadline == now and reason.startswith("hold_lost:gpupool-lease-")
    assert core.deleted == []  # the placeholders still hold the GPUs until the lease ends
    await _settled(lending)


async def test_a_lease_pod_that_never_runs_reclaims_the_lease_after_the_health_timeout() -> None:
    hooks, now = _Hooks(), time.time()
    lending, core = _lending(hooks, now, runtime=True)
    assert await lending.hold(_record("L1", 1, workload="infer")) == ""
    await _started(lending)
    (body,) = core.created
    pending = client.ApiClient()._ApiClient__deserialize(body, "V1Pod")  # type: ignore[attr-defined]
    pending.status = client.V1PodStatus(phase="Pending")  # training took the GPUs first: not bound
    await lending._on_event("ADDED", parse_pod(pending))
    for t in [t for t in lending._tasks if t.get_name().startswith("workload-health")]:
        await asyncio.wait_for(t, 5)  # PROFILE.health_timeout_s = 1
    ((lease_id, _, reason),) = hooks.reclaims
    assert lease_id == "L1" and reason == f"hold_lost:{body['metadata']['name']}"
    assert lending.endpoint("L1") == {}
    await _settled(lending)


async def test_a_restarted_broker_adopts_a_lease_pod_with_its_port(monkeypatch: pytest.MonkeyPatch) -> None:
    hooks, now, republished = _Hooks(), time.time(), []
    lending, _ = _lending(hooks, now, runtime=True, republished=republished)
    monkeypatch.setattr(broker.lending_kubernetes, "wait_healthy", _healthy)
    pod = LentPod(
        name="w1", node=HOST, slot=1, lease_id="L1", phase="Running", bound=True, slots=(1, 2),
        pod_ip="10.244.250.3", port=28101, runs_containers=True,
    )  # fmt: skip
    lending._pods[pod.name] = pod
    lending._leases["L1"] = [pod.name]
    lending._adopt_workload(_record("L1", 1, 2, workload="infer"), [pod])
    for t in [t for t in lending._tasks if t.get_name().startswith("workload-health")]:
        await asyncio.wait_for(t, 5)
    assert lending.endpoint("L1") == {HOST: "10.244.250.3:28101"} and republished == ["L1"]
    assert lending._ports_on(HOST) == [28101]  # a new lease on the node takes another port
    await _settled(lending)
