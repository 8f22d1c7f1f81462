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
    SLOT_LABEL,
    KubernetesLending,
    LentPod,
    parse_pod,
    placeholder_pod,
)
from broker.metrics import BrokerMetrics
from contracts import LeaseLogRecord, LeaseState
from runtime.settings import BrokerSettings

HOST = "gpu-node-001"


def _pod(
    name: str = "p", labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
    phase: str = "Running", node: str | None = HOST, deleting: datetime | None = None,
    conditions: list[client.V1PodCondition] | None = None,
) -> client.V1Pod:  # fmt: skip
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name, labels=labels if labels is not None else {NODE_LABEL: HOST, SLOT_LABEL: "3"},
            annotations=annotations, deletion_timestamp=deleting,
            creation_timestamp=datetime(2026, 1, 1, tzinfo=UTC),
        ),
        spec=client.V1PodSpec(containers=[], node_name=node),
        status=client.V1PodStatus(phase=phase, conditions=conditions),
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


class _Core:
    """Records the API calls the lending makes (none may reach a server here)."""

    def __init__(self) -> None:
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


class _Hooks:
    def __init__(self) -> None:
        self.reclaims: list[tuple[str, float, str]] = []

    async def reclaim(self, lease_id: str, deadline: float, reason: str) -> None:
        self.reclaims.append((lease_id, deadline, reason))

    async def lendable(self, _: frozenset[str]) -> None:
        return None


def _lending(hooks: _Hooks, now: float) -> tuple[KubernetesLending, _Core]:
    lending = KubernetesLending(client.ApiClient(), notice_s=5, clock=lambda: now)
    core = _Core()
    lending.core = core  # type: ignore[assignment]
    lending.bind(LendingHooks(hooks.reclaim, lambda: (), hooks.lendable, lambda _: None), BrokerMetrics())
    for slot in range(4):
        pod = LentPod(
            name=f"ph{slot}", node=HOST, slot=slot, phase="Running", bound=True, created_at=now - 60
        )
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
    assert "workload" in await lending.hold(_record("L4", 2, workload="infer"))
    assert lending.idle_slots(HOST) == {2, 3}


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
