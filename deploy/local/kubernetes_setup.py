"""Readiness checks and objects of the local Kubernetes control plane (used by deploy/local/kubernetes.sh).

Usage: ``python kubernetes_setup.py COMMAND --kubeconfig PATH [options]``, commands:

* ``api``: wait until the API server's ``/readyz`` answers ``ok``.
* ``bootstrap``: create (server-side apply, field manager ``gpupool-local``) the kwok nodes
  ``gpu-node-001`` ... (annotation ``kwok.x-k8s.io/node=fake``; capacity and allocatable
  ``nvidia.com/gpu`` = ``--gpus``, ``cpu`` = ``--cpus``, ``memory`` = ``--memory``, 110 pods; NVIDIA
  GPU feature discovery's labels ``nvidia.com/gpu.present``/``.product``/``.count``), Kueue's CRDs
  (conversion through Kueue's webhook, as Kueue's kustomize patches do), the ``kueue-system``
  namespace, the ``kueue-webhook-server-cert`` Secret from ``--cert-dir`` (``ca.crt``, ``ca.key``,
  ``tls.crt``, ``tls.key``) and Kueue's webhook configurations, reduced to Kueue's own kinds and
  ``batch/v1`` Jobs and pointed at ``--webhook-url`` (nothing routes Services here).
* ``queues``: create the training queues, retrying while Kueue's webhook does not answer yet:
  ResourceFlavor ``gpu`` (node label ``nvidia.com/gpu.present=true``), ClusterQueue ``training``
  (nominal quota = what the nodes hold: ``--nodes`` × ``--gpus`` GPUs, × ``--cpus``, × ``--memory``;
  preemption of lower-priority workloads within the queue), namespace ``training`` and its
  LocalQueue ``training``; namespace ``gpupool`` and what gpupool's broker needs to lend GPUs
  (``deploy/kubernetes/lending/lending.yaml``: namespace ``gpupool-lent``, PriorityClass
  ``gpupool-lent``, the broker's ServiceAccount and Role) and gpupool's collector needs to read
  the cluster (``deploy/kubernetes/collector/collector.yaml``: its ServiceAccount and read-only
  ClusterRole); PriorityClass ``training`` (value :data:`TRAINING_PRIORITY`, preempts lower
  priorities: the class the harvest replay's training pods run with); then wait until the
  ClusterQueue is ``Active``.
* ``ready``: exit 0 at once if the API answers, every node is ``Ready`` with ``--gpus`` allocatable
  GPUs and Kueue's ``/readyz`` (``--kueue-health``) answers; used by ``status``.
* ``nodes``: wait until every node is ``Ready`` with ``--gpus`` allocatable ``nvidia.com/gpu``.
* ``local-node``: wait until the kubelet's node ``--node`` (deploy/local/kubelet.sh) is registered,
  advertise ``--gpus`` ``nvidia.com/gpu`` on it (a PATCH of the Node's ``status.capacity``, as
  Kubernetes documents for extended resources, "Advertise Extended Resources for a Node"; the
  kubelet copies capacity to allocatable), and wait until it is ``Ready`` with them allocatable;
  with ``--check-only``, check once (exit 1 when not so).
* ``delete-local-node``: delete the Node ``--node`` (gone already is fine).

Every wait gives up after ``--timeout`` seconds (default 120), tries every 0.25 s, and exits early
with status 3 when ``--pid`` (the process that should answer) has exited. Exit status: 0 done; 1
not ready in time or refused (the last error on stderr); 3 the watched process exited.

Formats: node capacity and GPU labels follow the Kubernetes device plugin API (extended resource
``nvidia.com/gpu``) and NVIDIA GPU feature discovery; Kueue objects are ``kueue.x-k8s.io/v1beta2``
(Kueue v0.17.0).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config, dynamic
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import ResourceNotFoundError
from urllib3.exceptions import HTTPError

from ready import wait_ready  # deploy/local/ready.py, next to this script

FIELD_MANAGER = "gpupool-local"
KUEUE_API = "kueue.x-k8s.io/v1beta2"
KUEUE_NAMESPACE = "kueue-system"
KUEUE_WEBHOOK_SECRET = "kueue-webhook-server-cert"
# Kueue's cert rotator injects its CA into these configurations (named <base>-<type>-webhook-configuration).
KUEUE_WEBHOOK_NAMES = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}
# Kueue's CRDs that convert between API versions through its webhook (config/components/crd/patches).
KUEUE_CONVERTED = {
    "clusterqueues",
    "cohorts",
    "localqueues",
    "multikueueclusters",
    "resourceflavors",
    "workloads",
}
# Webhook paths kept: Kueue's own kinds and batch/v1 Jobs (the one integration enabled).
KUEUE_WEBHOOK_PATHS = ("-kueue-x-k8s-io-", "-batch-v1-job")
GPU = "nvidia.com/gpu"
TRAINING = "training"
FLAVOR = "gpu"
TRAINING_PRIORITY = 1000
"""Value of PriorityClass ``training`` (training pods): above ``gpupool-lent`` (-100)."""
LENDING_YAML = Path(__file__).resolve().parents[1] / "kubernetes" / "lending" / "lending.yaml"
"""What gpupool's broker needs to lend GPUs (the file an operator applies to a real cluster)."""
COLLECTOR_YAML = Path(__file__).resolve().parents[1] / "kubernetes" / "collector" / "collector.yaml"
"""What gpupool's collector needs to read training's GPUs and demand (read-only, cluster-wide)."""


class NotReady(Exception):
    """A readiness condition does not hold yet (message: what is missing)."""


def node_names(count: int) -> list[str]:
    """``gpu-node-001`` ... ``gpu-node-<count>``: the Slurm nodes' and the simulator's host names."""
    return [f"gpu-node-{i:03d}" for i in range(1, count + 1)]


def _wait(what: str, check: Callable[[], None], timeout_s: float, pid: int | None) -> None:
    """Call ``check`` every 0.25 s until it returns (ready.wait_ready's loop); exit 1 (naming
    ``what`` and the last error) after ``timeout_s`` seconds, 3 at once when process ``pid`` has exited."""

    async def probe(_left_s: float) -> str | None:
        try:
            check()
        except (NotReady, ApiException, ResourceNotFoundError, HTTPError, OSError) as e:
            return f"{type(e).__name__}: {e}".strip()[:2000]
        return None

    status = asyncio.run(wait_ready("kubernetes_setup", what, probe, timeout_s, pid, 0.25))
    if status:
        sys.exit(status)


def _api(kubeconfig: str) -> client.ApiClient:
    return config.new_client_from_config(config_file=kubeconfig)


def check_api(api: client.ApiClient) -> None:
    """Raise :class:`NotReady` unless ``GET /readyz`` answers 200 ``ok``."""
    request = api.param_serialize(method="GET", resource_path="/readyz", auth_settings=["BearerToken"])
    resp = api.call_api(*request, _request_timeout=5)
    body = resp.read().decode(errors="replace").strip()
    if resp.status != 200 or body != "ok":
        raise NotReady(f"/readyz: {resp.status} {body[:500]}")


def check_nodes(api: client.ApiClient, count: int, gpus: int) -> None:
    """Raise :class:`NotReady` unless each of ``node_names(count)`` is Ready with ``gpus``
    allocatable ``nvidia.com/gpu``."""
    nodes = {n.metadata.name: n for n in client.CoreV1Api(api).list_node(_request_timeout=5).items}
    for name in node_names(count):
        node = nodes.get(name)
        if node is None:
            raise NotReady(f"node {name} missing")
        ready = [c.status for c in node.status.conditions or [] if c.type == "Ready"]
        if ready != ["True"]:
            raise NotReady(f"node {name} not Ready ({ready})")
        allocatable = (node.status.allocatable or {}).get(GPU)
        if allocatable != str(gpus):
            raise NotReady(f"node {name}: allocatable {GPU} {allocatable}, want {gpus}")


def local_node(api: client.ApiClient, name: str, gpus: int, advertise: bool) -> None:
    """Raise :class:`NotReady` unless node ``name`` is ``Ready`` with ``gpus`` allocatable
    ``nvidia.com/gpu``; with ``advertise``, first PATCH its status capacity to ``gpus`` when it
    does not show them (a registered node that is not Ready yet is patched too)."""
    core = client.CoreV1Api(api)
    node = core.read_node(name, _request_timeout=5)  # 404 (ApiException) until it registers
    capacity = (node.status.capacity or {}).get(GPU)
    if advertise and capacity != str(gpus):
        core.patch_node_status(name, {"status": {"capacity": {GPU: str(gpus)}}}, _request_timeout=5)
        raise NotReady(f"node {name}: {GPU} capacity {capacity}, advertised {gpus} now")
    ready = [c.status for c in node.status.conditions or [] if c.type == "Ready"]
    if ready != ["True"]:
        reasons = [f"{c.type}={c.status} {c.message or ''}" for c in node.status.conditions or []]
        raise NotReady(f"node {name} not Ready: {reasons}")
    allocatable = (node.status.allocatable or {}).get(GPU)
    if allocatable != str(gpus):
        raise NotReady(f"node {name}: allocatable {GPU} {allocatable}, want {gpus}")


def check_kueue(health: str) -> None:
    """Raise unless Kueue's health endpoint ``http://<health>/readyz`` answers 200 (its webhook
    server has started)."""
    with urllib.request.urlopen(f"http://{health}/readyz", timeout=5) as resp:
        if resp.status != 200:
            raise NotReady(f"kueue /readyz: {resp.status}")


def _apply(dyn: dynamic.DynamicClient, body: dict[str, Any]) -> None:
    """Server-side apply ``body`` (any kind the API server knows), forcing conflicts."""
    resource = dyn.resources.get(api_version=body["apiVersion"], kind=body["kind"])
    namespace = body["metadata"].get("namespace")
    dyn.server_side_apply(
        resource,
        body=body,
        name=body["metadata"]["name"],
        namespace=namespace,
        field_manager=FIELD_MANAGER,
        force_conflicts=True,
    )


def node_object(name: str, gpus: int, cpus: int, memory: str) -> dict[str, Any]:
    """A kwok-managed Node ``name`` with ``gpus`` ``nvidia.com/gpu`` (H100, as the simulator's hosts)."""
    resources = {"cpu": str(cpus), "memory": memory, "pods": "110", GPU: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.count": str(gpus),
            },
        },
        "status": {"capacity": resources, "allocatable": resources},
    }


def _webhook_configuration(doc: dict[str, Any], url: str, ca_bundle: str) -> dict[str, Any]:
    """Kueue's webhook configuration ``doc`` (from config/components/webhook/manifests.yaml) under the
    name its cert rotator expects, with only Kueue's own and Job webhooks, each called at ``url`` +
    its path."""
    kept = []
    for hook in doc["webhooks"]:
        path = hook["clientConfig"]["service"]["path"]
        if not any(p in path for p in KUEUE_WEBHOOK_PATHS):
            continue
        hook["clientConfig"] = {"url": url + path, "caBundle": ca_bundle}
        kept.append(hook)
    if not kept:
        raise SystemExit(f"no Kueue webhook kept from {doc['kind']}: paths changed?")
    return {
        "apiVersion": doc["apiVersion"],
        "kind": doc["kind"],
        "metadata": {"name": KUEUE_WEBHOOK_NAMES[doc["kind"]]},
        "webhooks": kept,
    }


def bootstrap(api: client.ApiClient, args: argparse.Namespace) -> None:
    """The ``bootstrap`` command (see the module docstring)."""
    dyn = dynamic.DynamicClient(api)
    for name in node_names(args.nodes):
        _apply(dyn, node_object(name, args.gpus, args.cpus, args.memory))
    certs = Path(args.cert_dir)
    pem = {f: (certs / f).read_bytes() for f in ("ca.crt", "ca.key", "tls.crt", "tls.key")}
    ca_bundle = base64.b64encode(pem["ca.crt"]).decode()
    kueue = Path(args.kueue_dir)
    crds = []
    for path in sorted((kueue / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in KUEUE_CONVERTED:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {"url": args.webhook_url + "/convert", "caBundle": ca_bundle},
                    "conversionReviewVersions": ["v1"],
                },
            }
        _apply(dyn, crd)
        crds.append(crd["metadata"]["name"])
    _apply(dyn, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}})
    _apply(
        dyn,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": KUEUE_WEBHOOK_SECRET, "namespace": KUEUE_NAMESPACE},
            "type": "kubernetes.io/tls",
            "data": {k: base64.b64encode(v).decode() for k, v in pem.items()},
        },
    )
    for doc in yaml.safe_load_all((kueue / "webhooks.yaml").read_text()):
        if doc and doc.get("kind") in KUEUE_WEBHOOK_NAMES:
            _apply(dyn, _webhook_configuration(doc, args.webhook_url, ca_bundle))
    ext = client.ApiextensionsV1Api(api)

    def established() -> None:
        for name in crds:
            conditions = ext.read_custom_resource_definition(name, _request_timeout=5).status.conditions or []
            if not any(c.type == "Established" and c.status == "True" for c in conditions):
                raise NotReady(f"CRD {name} not Established")

    _wait("kueue CRDs", established, args.timeout, None)


def queue_objects(nodes: int, gpus: int, cpus: int, memory: str) -> list[dict[str, Any]]:
    """ResourceFlavor, ClusterQueue, Namespace, LocalQueue and PriorityClass of the training pool
    (see the module docstring); quotas are the sum over ``nodes`` nodes of ``gpus`` GPUs, ``cpus`` CPUs and
    ``memory`` (a quantity such as ``64Gi``; multiplied keeping its unit)."""
    number = memory.rstrip("KMGTPEikmgtpe")
    unit = memory[len(number) :]
    quota = [
        {"name": "cpu", "nominalQuota": str(nodes * cpus)},
        {"name": "memory", "nominalQuota": f"{nodes * int(number)}{unit}"},
        {"name": GPU, "nominalQuota": str(nodes * gpus)},
    ]
    return [
        {
            "apiVersion": KUEUE_API,
            "kind": "ResourceFlavor",
            "metadata": {"name": FLAVOR},
            "spec": {"nodeLabels": {"nvidia.com/gpu.present": "true"}},
        },
        {
            "apiVersion": KUEUE_API,
            "kind": "ClusterQueue",
            "metadata": {"name": TRAINING},
            "spec": {
                "namespaceSelector": {},
                "queueingStrategy": "BestEffortFIFO",
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu", "memory", GPU],
                        "flavors": [{"name": FLAVOR, "resources": quota}],
                    }
                ],
            },
        },
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TRAINING}},
        {
            "apiVersion": KUEUE_API,
            "kind": "LocalQueue",
            "metadata": {"name": TRAINING, "namespace": TRAINING},
            "spec": {"clusterQueue": TRAINING},
        },
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": TRAINING},
            "value": TRAINING_PRIORITY,
            "preemptionPolicy": "PreemptLowerPriority",
            "globalDefault": False,
            "description": "Training pods: kube-scheduler preempts lower-priority pods (gpupool's lent ones) for them.",
        },
    ]


def queues(api: client.ApiClient, args: argparse.Namespace) -> None:
    """The ``queues`` command (see the module docstring)."""
    dyn = dynamic.DynamicClient(api)
    lending = [d for f in (LENDING_YAML, COLLECTOR_YAML) for d in yaml.safe_load_all(f.read_text()) if d]
    gpupool_ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpupool"}}
    for obj in [*queue_objects(args.nodes, args.gpus, args.cpus, args.memory), gpupool_ns, *lending]:
        _wait(
            f"apply {obj['kind']} {obj['metadata']['name']}",
            lambda o=obj: _apply(dyn, o),
            args.timeout,
            args.pid,
        )
    custom = client.CustomObjectsApi(api)

    def active() -> None:
        cq = custom.get_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues", TRAINING)
        conditions = cq.get("status", {}).get("conditions", [])
        if not any(c["type"] == "Active" and c["status"] == "True" for c in conditions):
            raise NotReady(f"ClusterQueue {TRAINING} not Active: {conditions}")

    _wait(f"ClusterQueue {TRAINING}", active, args.timeout, args.pid)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "command", choices=["api", "bootstrap", "queues", "ready", "nodes", "local-node", "delete-local-node"]
    )
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--pid", type=int, default=None)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--cpus", type=int, default=32)
    p.add_argument("--memory", default="64Gi")
    p.add_argument("--kueue-dir", help="the build cache's kueue/ (crds/, webhooks.yaml)")
    p.add_argument("--cert-dir", help="Kueue webhook certificates: ca.crt ca.key tls.crt tls.key")
    p.add_argument("--webhook-url", help="https://127.0.0.1:PORT where Kueue's webhook server listens")
    p.add_argument("--kueue-health", help="host:port of Kueue's health probe server")
    p.add_argument(
        "--node", default="gpu-node-run", help="the kubelet's node (local-node, delete-local-node)"
    )
    p.add_argument("--check-only", action="store_true", help="local-node: check once, change nothing")
    args = p.parse_args(argv)
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    api = _api(args.kubeconfig)
    if args.command == "api":
        _wait("kube-apiserver", lambda: check_api(api), args.timeout, args.pid)
    elif args.command == "bootstrap":
        bootstrap(api, args)
    elif args.command == "queues":
        queues(api, args)
    elif args.command == "local-node" and args.check_only:
        try:
            local_node(api, args.node, args.gpus, advertise=False)
        except (NotReady, ApiException, HTTPError, OSError) as e:
            print(f"not ready: {type(e).__name__}: {e}"[:2000], file=sys.stderr)
            return 1
    elif args.command == "local-node":
        _wait(
            f"node {args.node}",
            lambda: local_node(api, args.node, args.gpus, advertise=True),
            args.timeout,
            args.pid,
        )
    elif args.command == "delete-local-node":
        try:
            client.CoreV1Api(api).delete_node(args.node, _request_timeout=args.timeout)
        except ApiException as e:
            if e.status != 404:
                raise
    elif args.command == "nodes":
        _wait("kwok nodes", lambda: check_nodes(api, args.nodes, args.gpus), args.timeout, args.pid)
    else:
        try:
            check_api(api)
            check_nodes(api, args.nodes, args.gpus)
            check_kueue(args.kueue_health)
        except (NotReady, ApiException, HTTPError, OSError) as e:
            print(f"not ready: {type(e).__name__}: {e}"[:2000], file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
