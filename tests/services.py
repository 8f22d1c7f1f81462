"""pytest plugin: real Kafka, Mosquitto and Slurm from deploy/local, started once per test session.

Fixtures:

* ``kafka_bootstrap`` (session): ``"127.0.0.1:PORT"`` of a KRaft node started by
  ``deploy/local/kafka.sh start``;
* ``kafka_topics`` (function): a :class:`contracts.topics.KafkaTopics` with a fresh
  ``t<32 hex>.`` prefix, so tests never see each other's records;
* ``kafka_bus`` (function): a :class:`runtime.kafka.KafkaBus` on ``kafka_bootstrap``, closed
  after the test;
* ``kafka_stage_topics`` (function): ``kafka_topics`` with every topic created the way an operator
  does before starting a stage (:func:`create_stage_topics`, ``gpupool topics create``'s own code:
  no stage creates topics);
* ``mosquitto`` (session): the credentials of ``deploy/local/mosquitto.sh start`` as written to
  ``$GPUPOOL_STATE/mosquitto/credentials.json``:
  ``{"host": "127.0.0.1", "port": int, "users": {site or "gpupool-broker": password}, "root": "gpupool/v1"}``;
* ``slurm_conf`` (session): the path of the ``slurm.conf`` of ``deploy/local/slurm.sh start`` (4 nodes
  ``gpu-node-001``..``004`` × 8 GPUs as GRES ``gpu:h100``, partitions ``training`` and ``lent`` with
  ``GraceTime`` = :data:`SLURM_GRACE_S`); Slurm's
  clients reach that cluster with ``SLURM_CONF`` set to it.
* ``kubeconfig`` (session): the path of the kubeconfig of ``deploy/local/kubernetes.sh start`` (etcd,
  kube-apiserver, kube-controller-manager, kube-scheduler v1.31.14; kwok nodes ``gpu-node-001``..``004``
  × 8 allocatable ``nvidia.com/gpu``; Kueue with ClusterQueue ``training`` and LocalQueue
  ``training/training``); a cluster-admin token. The first start from an empty cache builds the
  binaries (minutes).
* ``kube_node`` (module): the name of the one node of that control plane that runs containers
  (``deploy/local/kubelet.sh start``: a kubelet with containerd and runc, 8 ``nvidia.com/gpu``
  advertised, label ``gpupool.io/workloads=true``), stopped and deleted after the module so that
  no other test sees it.

A service is stopped at the end of the session only if this session started it (one already
running, e.g. from ``make services-up``, is left running). A service that does not start fails
every test that needs it with the script's output; it is never skipped, in CI (``CI=true``) or
not. Tests that use these fixtures get the ``integration`` marker, so ``-m "not integration"``
deselects them.

State: ``$GPUPOOL_STATE`` (default ``<repo>/.state``), as in the scripts.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from contracts.topics import KafkaTopics
from runtime.kafka import KafkaBus

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "local"
_SERVICE_FIXTURES = {
    "kafka_bootstrap", "kafka_bus", "kafka_stage_topics", "mosquitto", "slurm_conf", "kubeconfig", "kube_node",
}  # fmt: skip


def state_dir() -> Path:
    """``$GPUPOOL_STATE`` or ``<repo>/.state``: where the scripts keep each service's files."""
    return Path(os.environ.get("GPUPOOL_STATE") or REPO / ".state")


SLURM_GRACE_S = 5
"""GraceTime of the test cluster's lent partition (= the notice of test leases), seconds."""

K8S_NODES = 4
"""kwok nodes of the test cluster (``gpu-node-001`` ...)."""

K8S_GPUS = 8
"""Allocatable ``nvidia.com/gpu`` per kwok node of the test cluster."""

_SERVICE_ENV = {
    "slurm.sh": {"GPUPOOL_SLURM_GRACE": str(SLURM_GRACE_S)},
    "kubernetes.sh": {"GPUPOOL_K8S_NODES": str(K8S_NODES), "GPUPOOL_K8S_GPUS": str(K8S_GPUS)},
    "kubelet.sh": {"GPUPOOL_K8S_GPUS": str(K8S_GPUS)},
}
"""Environment each script gets in tests, on top of this process's."""

K8S_BUILD_TIMEOUT_S = 3600.0
"""Time ``deploy/local/kubernetes.sh start`` may take when it builds the binaries first."""

_START_TIMEOUT_S = {"kubernetes.sh": K8S_BUILD_TIMEOUT_S}
"""Time a script's ``start`` may take, where not the default 180 s (a cold Kubernetes start builds
its binaries from source)."""


def run_service(
    script: str, action: str, timeout_s: float = 180.0, state: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``deploy/local/<script> <action>`` (e.g. ``"kafka.sh", "stop"``) and return the
    finished process (text stdout/stderr; not checked); with ``state``, on that state dir
    (``GPUPOOL_STATE``) instead of the session's. Tests that restart a service mid-test use this
    too. Raises ``subprocess.TimeoutExpired`` after ``timeout_s`` seconds."""
    env = {**os.environ, **_SERVICE_ENV.get(script, {})}
    if state is not None:
        env["GPUPOOL_STATE"] = str(state)
    return subprocess.run(
        ["bash", str(DEPLOY / script), action],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=REPO,
        env=env,
    )


def _fail(script: str, done: subprocess.CompletedProcess[str]) -> None:
    ci = " (CI=true)" if os.environ.get("CI") == "true" else ""
    pytest.fail(
        f"deploy/local/{script} start failed{ci} with exit status {done.returncode}\n"
        f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}",
        pytrace=False,
    )


def _start(script: str) -> tuple[str, bool]:
    """Start a service; returns (its ``host:port``, whether this call started it)."""
    was_running = run_service(script, "status", 60).returncode == 0
    try:
        done = run_service(script, "start", _START_TIMEOUT_S.get(script, 180.0))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"deploy/local/{script} start did not finish in {e.timeout} s", pytrace=False)
    if done.returncode != 0:
        _fail(script, done)
    return done.stdout.strip().splitlines()[-1], not was_running


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``host:port`` of the local Kafka node (started if needed; stopped after the session if
    this session started it)."""
    address, started = _start("kafka.sh")
    yield address
    if started:
        run_service("kafka.sh", "stop")


@pytest.fixture(scope="session")
def mosquitto() -> Iterator[dict[str, Any]]:
    """Credentials of the local Mosquitto (see the module docstring for the shape)."""
    _, started = _start("mosquitto.sh")
    creds = json.loads((state_dir() / "mosquitto" / "credentials.json").read_text())
    yield creds
    if started:
        run_service("mosquitto.sh", "stop")


@pytest.fixture(scope="session")
def slurm_conf() -> Iterator[Path]:
    """Path of the local Slurm cluster's ``slurm.conf`` (started if needed; stopped after the
    session if this session started it)."""
    conf, started = _start("slurm.sh")
    yield Path(conf)
    if started:
        run_service("slurm.sh", "stop")


def kubernetes_built() -> bool:
    """Whether ``deploy/local/kubernetes-build.sh check`` finds every binary built, i.e. a start
    needs no build. A test module that uses ``kubeconfig`` raises its pytest timeout above
    :data:`K8S_BUILD_TIMEOUT_S` when not: the first test's setup then includes the build (``make
    test`` builds in ``make deps`` first)."""
    return run_service("kubernetes-build.sh", "check", 30).returncode == 0


@pytest.fixture(scope="session")
def kubeconfig() -> Iterator[Path]:
    """Path of the local Kubernetes control plane's kubeconfig (started, and built when not cached,
    if needed; stopped after the session if this session started it)."""
    path, started = _start("kubernetes.sh")
    yield Path(path)
    if started:
        run_service("kubernetes.sh", "stop")


@pytest.fixture(scope="module")
def kube_node(kubeconfig: Path) -> Iterator[str]:
    """The name of the local control plane's node with a kubelet and a container runtime
    (started if needed; stopped, and its Node deleted, after the module)."""
    node, _ = _start("kubelet.sh")
    yield node
    run_service("kubelet.sh", "stop")


@pytest.fixture
def kafka_topics() -> KafkaTopics:
    """Topic names unique to this test: prefix ``t<uuid4 hex>.``."""
    return KafkaTopics(prefix=f"t{uuid.uuid4().hex}.")


@pytest.fixture
async def kafka_bus(kafka_bootstrap: str) -> AsyncIterator[KafkaBus]:
    """A :class:`runtime.kafka.KafkaBus` on the local node; closed after the test."""
    bus = KafkaBus(kafka_bootstrap, client_id="gpupool-test")
    yield bus
    await bus.close()


async def create_stage_topics(bootstrap: str, topics: KafkaTopics, partitions: int = 4) -> None:
    """Create every topic of ``topics`` on the cluster at ``bootstrap`` as ``gpupool topics create
    --partitions N`` does (:func:`gpupool.topics_cli.create_all`: compacted lease log and topology,
    one replica) and fail the test if a check of that command fails."""
    from gpupool.topics_cli import check_topics, create_all

    states = await create_all(bootstrap, topics, partitions, replication_factor=1)
    problems = check_topics(topics, states)
    assert not problems, problems


@pytest.fixture
async def kafka_stage_topics(kafka_bootstrap: str, kafka_topics: KafkaTopics) -> KafkaTopics:
    """``kafka_topics``, every topic created with 4 partitions by :func:`create_stage_topics`."""
    await create_stage_topics(kafka_bootstrap, kafka_topics)
    return kafka_topics


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses a real-service fixture as ``integration``."""
    for item in items:
        if _SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
