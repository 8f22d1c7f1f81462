"""What the lending tests share, whichever the training scheduler (Slurm, Kubernetes): idle
capacity in telemetry, a broker lending through a :class:`broker.lending.Lending`, a site, and a
:class:`SchedulerUnderTest` that tests written once drive (tests/test_broker_lending_schedulers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from broker.config import BrokerConfig
from broker.edge import EdgeClient
from broker.fabric import FabricManager
from broker.lending import Lending, SlurmLending
from broker.lending_kubernetes import MANAGED_BY, MANAGER, KubernetesLending, parse_pod
from broker.scheduler_slurm import JOB_NAME, SlurmScheduler
from broker.service import BrokerService
from broker.workloads import WorkloadProfile
from contracts import CapacityUpdate, GpuState, KafkaTopics, encode
from contracts.bus import Bus
from tests.mqtt_support import running


LOCAL_WORKLOAD_IMAGE = "gpupool.local/workload:1"
"""The local node's workload image (deploy/local/kubelet.sh): an empty root, the host's ``/usr``
and the repository mounted read-only."""
REPO = Path(__file__).resolve().parents[1]


class SchedulerUnderTest(Protocol):
    """One training scheduler as the shared lending tests see it.

    Attributes:
        notice_s: the leases' notice (the scheduler's grace time for lent GPUs), seconds.
        workloads: the workload profiles its broker declares.
    """

    notice_s: float
    workloads: tuple[WorkloadProfile, ...]

    def lending(self) -> Lending:
        """A fresh lending through this scheduler (not started)."""
        ...

    def idle_held(self, lending: Lending, host: str) -> int:
        """GPUs of ``host`` that placeholders of ``lending`` hold now (what may be offered)."""
        ...

    def stopped(self, lending: Lending) -> bool:
        """True once ``lending`` watches the scheduler no more."""
        ...

    def lent_holding(self, host: str) -> list[str]:
        """gpupool's holds (jobs, pods) on ``host`` that hold their GPUs now."""
        ...

    def submit_training(self, host: str, gpus: int) -> str:
        """A training workload needing ``gpus`` GPUs of ``host``; returns its id."""
        ...

    def training_state(self, job: str) -> str:
        """``pending`` (waiting for GPUs), ``running``, or the scheduler's own word otherwise."""
        ...

    def lease_gpus(self, lending: Lending, lease_id: str) -> list[int]:
        """The GPU indices (Slurm's GRES indices, Kubernetes' slots) the lease holds, sorted."""
        ...

    def served_gpus(self, answer: dict[str, Any]) -> list[int]:
        """The GPU indices the lease's workload says it was given (its ``/v1/infer`` answer),
        sorted: ``CUDA_VISIBLE_DEVICES`` on Slurm, ``GPUPOOL_GPU_SLOTS`` on Kubernetes."""
        ...


def inference_profile(
    name: str,
    port_min: int,
    drain_s: float,
    quiet_s: float,
    health_timeout_s: float,
    *,
    container: bool = False,
) -> WorkloadProfile:
    """The simulated inference server (``simulator.inference_server``) as a workload profile on
    ports ``port_min``..``port_min + 99``, draining ``drain_s`` seconds at most on SIGTERM and
    leaving once no request came for ``quiet_s`` seconds. With ``container`` (Kubernetes), in
    :data:`LOCAL_WORKLOAD_IMAGE` with the host's ``/usr``, this Python's installation
    (``sys.base_prefix``) and this repository (its venv) mounted, listening on every address of
    its pod."""
    argv = (sys.executable, "-m", "simulator.inference_server", "--port", "{port}",
            "--drain-s", f"{drain_s:g}", "--quiet-s", f"{quiet_s:g}")  # fmt: skip
    if not container:
        return WorkloadProfile(
            name=name, argv=argv, port_min=port_min, port_max=port_min + 99, health_timeout_s=health_timeout_s
        )
    return WorkloadProfile(
        name=name, argv=(*argv, "--bind", "0.0.0.0"), port_min=port_min, port_max=port_min + 99,
        health_timeout_s=health_timeout_s, image=LOCAL_WORKLOAD_IMAGE,
        host_paths=tuple(sorted({"/usr", sys.base_prefix, str(REPO)})),
    )  # fmt: skip


async def idle_capacity(
    bus: Bus,
    topics: KafkaTopics,
    host: str,
    gpus: int = 8,
    leaf: str | None = None,
    state: GpuState = GpuState.IDLE,
) -> None:
    """Capacity: every GPU of ``host`` idle (keys ``<host>/gpu<index>``, as the GPU maps read
    them), under leaf switch ``leaf``, or in ``state`` (busy: what analytics sees while training
    runs there)."""
    producer = bus.producer()
    await producer.start()
    now = time.time()
    for i in range(gpus):
        u = CapacityUpdate(
            ts=now, host=host, gpu_uuid=f"gpu{i}", state=state, since=now - 60, leaf=leaf,
            predicted_idle_until=now + 3600 if state is GpuState.IDLE else None, model_name="NVIDIA H100 80GB HBM3",
        )  # fmt: skip
        await producer.send(topics.capacity, encode(u), key=u.key)
    await producer.flush()
    await producer.stop()


@contextlib.asynccontextmanager
async def lending_broker(
    bus: Bus, topics: KafkaTopics, creds: dict[str, Any], lending: Lending, notice_s: float,
    workloads: Sequence[WorkloadProfile] = (), fabric: FabricManager | None = None,
) -> AsyncIterator[BrokerService]:  # fmt: skip
    """A broker on ``bus`` and the Mosquitto of ``creds`` lending through ``lending`` (and
    isolating leases with ``fabric``), serving."""
    cfg = BrokerConfig(
        offer_ttl_s=60, notice_s=notice_s, lease_ttl_s=60, tick_s=0.1, workloads=tuple(workloads),
        group_id=f"g-{uuid.uuid4().hex}",
    )  # fmt: skip
    svc = BrokerService(
        bus=bus, topics=topics, mqtt_host=creds["host"], mqtt_port=creds["port"],
        mqtt_username="gpupool-broker", mqtt_password=creds["users"]["gpupool-broker"], root=creds["root"],
        protocol=5, config=cfg, client_id=f"broker-{uuid.uuid4().hex[:8]}", lending=lending, fabric=fabric,
    )  # fmt: skip
    async with running(svc):
        yield svc


def edge_site(creds: dict[str, Any], name: str = "edge-a") -> EdgeClient:
    """A site on the SDK, MQTT 5, quick reconnects."""
    return EdgeClient(
        site=name, host=creds["host"], port=creds["port"], username=name, password=creds["users"][name],
        root=creds["root"], protocol=5, client_id=f"{name}-{uuid.uuid4().hex[:8]}",
        reconnect_min_s=0.1, reconnect_max_s=0.5,
    )  # fmt: skip


async def until(cond: Callable[[], object], timeout_s: float, step_s: float = 0.05) -> float:
    """Seconds until ``cond()`` is true, polled every ``step_s``; ``AssertionError`` after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        await asyncio.sleep(step_s)
    raise AssertionError(f"not within {timeout_s} s")


async def held_offer(site: EdgeClient, held: Callable[[], int], host: str, gpus: int) -> str:
    """The newest offer of ``host`` once it names ``gpus`` GPUs and ``held()`` (GPUs of ``host``
    placeholders hold) is at least ``gpus``."""
    for _ in range(300):
        offers = sorted((o for o in site.known_offers.values() if o.host == host), key=lambda o: o.ts)
        if offers and len(offers[-1].gpus) >= gpus and held() >= gpus:
            return offers[-1].offer_id
        await asyncio.sleep(0.05)
    raise AssertionError(f"no offer of {host} with {gpus} GPUs held by placeholders")


class SlurmUnderTest:
    """The local Slurm cluster (``slurm_conf``): training jobs in partition ``training``, lending
    through :class:`broker.lending.SlurmLending` with its control folder under ``control_dir``."""

    def __init__(
        self, conf: Path, control_dir: Path, notice_s: float, workloads: Sequence[WorkloadProfile] = ()
    ) -> None:
        self.conf, self.control_dir, self.notice_s, self.workloads = (
            conf,
            control_dir,
            notice_s,
            tuple(workloads),
        )

    def _run(self, *argv: str, check: bool = True) -> str:
        env = {**os.environ, "SLURM_CONF": str(self.conf)}
        return subprocess.run(argv, capture_output=True, text=True, env=env, check=check).stdout

    def lending(self) -> SlurmLending:
        return SlurmLending(
            SlurmScheduler(self.conf), workloads=self.workloads, notice_s=self.notice_s,
            control_dir=self.control_dir, poll_s=0.2,
        )  # fmt: skip

    def idle_held(self, lending: Lending, host: str) -> int:
        assert isinstance(lending, SlurmLending)
        return len(lending._idle.get(host, {}))

    def stopped(self, lending: Lending) -> bool:
        assert isinstance(lending, SlurmLending)
        return lending._watch is None

    def lent_holding(self, host: str) -> list[str]:
        return self._run("squeue", "-h", "-n", JOB_NAME, "-w", host, "-t", "RUNNING", "-o", "%i").split()

    def submit_training(self, host: str, gpus: int) -> str:
        return self._run(
            "sbatch", "--parsable", "-p", "training", "-w", host, f"--gres=gpu:h100:{gpus}", "-c", "1",
            "-o", "/dev/null", "--wrap", "sleep 60",
        ).strip()  # fmt: skip

    def training_state(self, job: str) -> str:
        state = self._run("squeue", "-h", "-j", job, "-o", "%T", check=False).strip() or "GONE"
        return {"PENDING": "pending", "RUNNING": "running"}.get(state, state)

    def lease_gpus(self, lending: Lending, lease_id: str) -> list[int]:
        assert isinstance(lending, SlurmLending)
        return sorted(lending.held_gpus()[lease_id])

    def served_gpus(self, answer: dict[str, Any]) -> list[int]:
        return sorted(answer["gpus"])

    def cancel(self, *jobs: str) -> None:
        """``scancel`` of ``jobs``."""
        self._run("scancel", *jobs)

    def clean(self) -> None:
        """Every gpupool and training job cancelled."""
        self._run("scancel", "-n", JOB_NAME, check=False)
        self._run("scancel", "-p", "training", check=False)


KUBE_LENT = "gpupool-lent"
"""The lent namespace of deploy/kubernetes/lending/lending.yaml."""
KUBE_TRAINING = "training"
"""Namespace and LocalQueue of training Jobs in the local cluster."""
BROKER_SERVICE_ACCOUNT = "system:serviceaccount:gpupool:gpupool-broker"


def as_broker(kubeconfig: Path) -> client.ApiClient:
    """A client of the local cluster acting as the broker's ServiceAccount (impersonated: only
    the Role of deploy/kubernetes/lending/lending.yaml)."""
    api = config.new_client_from_config(config_file=str(kubeconfig))
    api.set_default_header("Impersonate-User", BROKER_SERVICE_ACCOUNT)
    return api


class KubernetesUnderTest:
    """The local Kubernetes control plane: training workloads are Kueue Jobs of one pod pinned to
    a node (LocalQueue ``training``), lending through
    :class:`broker.lending_kubernetes.KubernetesLending` as the broker's ServiceAccount."""

    def __init__(self, kubeconfig: Path, notice_s: float, workloads: Sequence[WorkloadProfile] = ()) -> None:
        self.admin = config.new_client_from_config(config_file=str(kubeconfig))
        self.broker_api = as_broker(kubeconfig)
        self.core = client.CoreV1Api(self.admin)
        self.batch = client.BatchV1Api(self.admin)
        self.notice_s = notice_s
        self.workloads = tuple(workloads)
        self.jobs: list[str] = []

    def lending(self) -> KubernetesLending:
        return KubernetesLending(
            self.broker_api, namespace=KUBE_LENT, notice_s=self.notice_s, workloads=self.workloads, poll_s=0.2
        )

    def lease_gpus(self, lending: Lending, lease_id: str) -> list[int]:
        assert isinstance(lending, KubernetesLending)
        return sorted(lending.lease_slots(lease_id))

    def served_gpus(self, answer: dict[str, Any]) -> list[int]:
        return sorted(int(s) for s in answer["env"]["GPUPOOL_GPU_SLOTS"].split(","))

    def idle_held(self, lending: Lending, host: str) -> int:
        assert isinstance(lending, KubernetesLending)
        return len(lending.idle_slots(host))

    def stopped(self, lending: Lending) -> bool:
        assert isinstance(lending, KubernetesLending)
        return not lending.watching

    def lent_holding(self, host: str) -> list[str]:
        pods = self.core.list_namespaced_pod(KUBE_LENT, label_selector=f"{MANAGED_BY}={MANAGER}").items
        return [
            p.name for p in (parse_pod(i) for i in pods) if p is not None and p.node == host and p.holding
        ]

    def submit_training(self, host: str, gpus: int) -> str:
        name = f"train-{uuid.uuid4().hex[:8]}"
        container = {
            "name": "main",
            "image": "registry.k8s.io/pause:3.10",
            "resources": {"requests": {"cpu": "1"}, "limits": {"nvidia.com/gpu": str(gpus)}},
        }
        pod = {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "nodeSelector": {"kubernetes.io/hostname": host},
            "containers": [container],
        }
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": KUBE_TRAINING}},
            "spec": {"suspend": True, "parallelism": 1, "completions": 1, "template": {"spec": pod}},
        }
        self.batch.create_namespaced_job(KUBE_TRAINING, job)
        self.jobs.append(name)
        return name

    def training_state(self, job: str) -> str:
        """``queued`` (no pod: Kueue has not admitted it), ``pending`` (a pod not yet running on a
        node), ``running``."""
        pods = self.core.list_namespaced_pod(KUBE_TRAINING, label_selector=f"job-name={job}").items
        if not pods:
            return "queued"
        if all(p.spec.node_name and p.status.phase == "Running" for p in pods):
            return "running"
        return "pending"

    def clean(self, timeout_s: float = 30.0) -> None:
        """Every training Job and every pod of the lent namespace deleted, and gone."""
        for name in self.jobs:
            with contextlib.suppress(ApiException):
                self.batch.delete_namespaced_job(name, KUBE_TRAINING, propagation_policy="Background")
        self.core.delete_collection_namespaced_pod(KUBE_TRAINING, grace_period_seconds=0)
        self.core.delete_collection_namespaced_pod(KUBE_LENT, grace_period_seconds=0)
        deadline = time.monotonic() + timeout_s
        while (
            self.core.list_namespaced_pod(KUBE_LENT).items
            or self.core.list_namespaced_pod(KUBE_TRAINING).items
        ):
            assert time.monotonic() < deadline, "pods left after the test"
            time.sleep(0.1)
