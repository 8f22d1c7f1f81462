"""Benchmark: lending through Kubernetes — claims, a lease's end, and the notice of a preemption.

Uses the local control plane of ``deploy/local/kubernetes.sh`` (``--kubeconfig`` of a running one,
else a private one started in a temporary state directory and stopped at the end), an embedded
MQTT server and the in-process bus, every GPU of the 4 nodes idle in telemetry, one site. In the
same run, alternating in blocks of 10:

* ``--claims N`` claims of one GPU each, released at once, against a broker without the
  scheduler (:class:`broker.lending.NoLending`: the yardstick) and one lending through Kubernetes
  (:class:`broker.lending_kubernetes.KubernetesLending`, placeholder pods): claim → lease at the
  site, p50/p99 of each and their ratio; for Kubernetes also release → every pod of the lease gone
  (seen by the benchmark's own watch of the lent namespace);
* after each Kubernetes block, one lease of all 8 GPUs per node and a training pod (default
  priority, 1 GPU) pinned to each node: kube-scheduler preempts a lease pod; the moment the
  benchmark's watch sees its ``deletionTimestamp`` → the site holding the reclaim notice (the
  deadline checked equal to it), the same from the pod's ``DisruptionTarget`` condition (whole
  seconds: up to 1 s too long), and training submit → notice.

Prints p50/p99 of each, the claim p99 against 100 ms, the notice p99 against 1 s and the release
p99 against 1 s. Exit 0 when the three are met, 1 otherwise, 2 when the cluster could not start.

Run: ``.venv/bin/python bench/lending_kubernetes.py [--claims 40] [--notice-s 3] [--kubeconfig PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kubernetes import client, config, watch  # noqa: E402

from broker.config import BrokerConfig  # noqa: E402
from bench.support.lending import claim_one_gpu, idle_capacity  # noqa: E402
from broker.edge import EdgeClient  # noqa: E402
from broker.lending import Lending, NoLending  # noqa: E402
from broker.lending_kubernetes import KubernetesLending, parse_pod  # noqa: E402
from broker.service import BrokerService  # noqa: E402
from contracts import KafkaTopics, LeaseState  # noqa: E402
from contracts.bus import MemoryBus  # noqa: E402
from gpupool.embedded_mqtt import EmbeddedMqttBroker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NODES = [f"gpu-node-00{i}" for i in (1, 2, 3, 4)]
LENT = "gpupool-lent"
TRAINING = "training"


async def _until(what: str, cond: Any, timeout_s: float = 30.0) -> None:
    """Wait (polling every 20 ms) until ``cond()`` is true; ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not await cond() if asyncio.iscoroutinefunction(cond) else not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.02)


def _pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


class Watched:
    """The benchmark's own watch of the lent namespace (a thread): per pod, when it was first seen
    being deleted (this machine's clock), its deletionTimestamp and DisruptionTarget time, and
    when it was seen gone."""

    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.deleting: dict[str, tuple[float, float, float | None]] = {}
        self.gone: dict[str, float] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        version = self.core.list_namespaced_pod(LENT).metadata.resource_version
        while not self._stop.is_set():
            try:
                for event in watch.Watch().stream(
                    self.core.list_namespaced_pod, LENT, resource_version=version, timeout_seconds=2
                ):
                    now = time.time()
                    version = event["object"].metadata.resource_version
                    pod = parse_pod(event["object"])
                    if pod is None:
                        continue
                    if event["type"] == "DELETED":
                        self.gone.setdefault(pod.name, now)
                    elif pod.deleting_at is not None and pod.name not in self.deleting:
                        self.deleting[pod.name] = (now, pod.deleting_at, pod.disrupted_at)
            except Exception as e:  # noqa: BLE001 — an expired version (410), a dropped stream: list again
                print(f"benchmark watch: {type(e).__name__}: {e}; listing again", file=sys.stderr)
                listed = self.core.list_namespaced_pod(LENT)
                names = {p.metadata.name for p in listed.items}
                now = time.time()
                for name in [n for n in self.deleting if n not in names and n not in self.gone]:
                    self.gone[name] = now
                version = listed.metadata.resource_version

    def stop(self) -> None:
        """Stop the watch thread (it ends at its next event or timeout)."""
        self._stop.set()


def _training_pod(host: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"train-{uuid.uuid4().hex[:8]}"},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "nodeSelector": {"kubernetes.io/hostname": host},
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],  # fmt: skip
        },
    }


async def _phase(
    api: client.ApiClient, seen: Watched, lending: Lending, claims: int, notice_s: int, out: dict[str, list[float]],
    tag: str,
) -> None:  # fmt: skip
    """``claims`` claims of one GPU (claim → lease into ``out[tag]``), released at once; with a
    :class:`KubernetesLending` also release → pods gone and one preemption per node."""
    mqtt = EmbeddedMqttBroker()
    await mqtt.start()
    bus, topics = MemoryBus(), KafkaTopics()
    await idle_capacity(bus, topics, NODES)
    cfg = BrokerConfig(offer_ttl_s=600, lease_ttl_s=300, notice_s=notice_s, tick_s=0.1)
    svc = BrokerService(bus=bus, topics=topics, mqtt_host=mqtt.host, mqtt_port=mqtt.port, protocol=4,
                        config=cfg, lending=lending)  # fmt: skip
    await svc.start()
    stop = asyncio.Event()
    serve = asyncio.create_task(svc.run(stop))
    k8s = lending if isinstance(lending, KubernetesLending) else None
    try:
        await svc.wait_connected(10)
        async with EdgeClient(site="bench", host=mqtt.host, port=mqtt.port, protocol=4) as site:
            n = 0
            while n < claims:
                if k8s is not None:  # steady state: every GPU held by a placeholder, no release running
                    await _until(
                        "every GPU held by a placeholder, no release running",
                        lambda: (
                            sum(len(k8s.idle_slots(h)) for h in NODES) == 8 * len(NODES)
                            and not any(t.get_name().startswith("hold-") for t in k8s._tasks)
                        ),
                    )
                lease = await claim_one_gpu(site, out, tag)
                if lease is None:
                    continue
                n += 1
                pods = list(k8s.held_gpus().get(lease.lease_id, ())) if k8s else []
                t1 = time.time()
                await site.release(lease.lease_id)
                if k8s is not None:
                    for _ in range(1000):  # 10 s at most
                        if all(p in seen.gone for p in pods):
                            out["hold_gone"].append(max(seen.gone[p] for p in pods) - t1)
                            break
                        await asyncio.sleep(0.01)
                    else:
                        print(f"lease {lease.lease_id}: pods {pods} not seen gone in 10 s", file=sys.stderr)
            if k8s is not None:
                await _notices(api, seen, site, k8s, out)
    except TimeoutError:
        if k8s is not None:  # what the lending saw, to tell a lost event from a stuck pod
            print(f"idle: { {h: sorted(k8s.idle_slots(h)) for h in NODES} }", file=sys.stderr)
            print(f"not holding: {[p for p in k8s._pods.values() if not p.holding]}", file=sys.stderr)
            print(f"creating {k8s._creating} deleting {k8s._deleting} leases {k8s._leases}", file=sys.stderr)
            print(f"tasks {sorted(t.get_name() for t in k8s._tasks)}", file=sys.stderr)
        raise
    finally:
        stop.set()
        await serve
        await svc.stop()
        await mqtt.stop()
        core = client.CoreV1Api(api)
        await asyncio.to_thread(core.delete_collection_namespaced_pod, LENT, grace_period_seconds=0)
        await asyncio.to_thread(core.delete_collection_namespaced_pod, TRAINING, grace_period_seconds=0)

        async def empty() -> bool:
            lent = await asyncio.to_thread(core.list_namespaced_pod, LENT)
            training = await asyncio.to_thread(core.list_namespaced_pod, TRAINING)
            return not lent.items and not training.items

        await _until("the lent and training namespaces empty", empty)


async def _notices(
    api: client.ApiClient,
    seen: Watched,
    site: EdgeClient,
    k8s: KubernetesLending,
    out: dict[str, list[float]],
) -> None:
    """One 8-GPU lease per node, then a 1-GPU training pod on each node (module docstring)."""
    core = client.CoreV1Api(api)
    for host in NODES:
        await _until(f"8 placeholders on {host}", lambda host=host: len(k8s.idle_slots(host)) == 8)

    async def one(host: str) -> None:
        offer = None
        while offer is None:
            offer = next((o for o in site.known_offers.values() if o.host == host and len(o.gpus) == 8), None)
            await asyncio.sleep(0.01)
        lease = await site.claim(offer.offer_id, count=8, timeout_s=10)
        t0 = time.time()
        await asyncio.to_thread(core.create_namespaced_pod, TRAINING, _training_pod(host))
        msg = await site.wait_lease(
            lease.lease_id, lambda m: m.state not in (LeaseState.GRANTED, LeaseState.ACTIVE), 30
        )
        now = time.time()
        if msg.state is not LeaseState.RECLAIMING or not msg.reason or ":" not in msg.reason:
            print(f"lease {lease.lease_id}: {msg.state} ({msg.reason}) instead of a notice", file=sys.stderr)
            return
        victim = msg.reason.split(":", 1)[1]
        for _ in range(100):  # the benchmark's watch may see it a moment after the broker's
            if victim in seen.deleting:
                break
            await asyncio.sleep(0.01)
        else:
            print(f"pod {victim}: not seen being deleted", file=sys.stderr)
            return
        seen_at, deadline, disrupted_at = seen.deleting[victim]
        if msg.reclaim_deadline != deadline:
            print(
                f"lease {lease.lease_id}: deadline {msg.reclaim_deadline} != deletionTimestamp {deadline}",
                file=sys.stderr,
            )
        out["notice"].append(now - seen_at)
        if disrupted_at is not None:
            out["notice_disruption"].append(now - disrupted_at)
        out["submit_notice"].append(now - t0)
        await site.release(lease.lease_id)

    await asyncio.gather(*(one(h) for h in NODES))


def _cluster(args: argparse.Namespace, tmp: str) -> tuple[Path | None, dict[str, str]]:
    if args.kubeconfig:
        return Path(args.kubeconfig), {}
    env = {**os.environ, "GPUPOOL_STATE": tmp, "GPUPOOL_K8S_NODES": "4", "GPUPOOL_K8S_GPUS": "8"}
    done = subprocess.run(["bash", str(REPO / "deploy/local/kubernetes.sh"), "start"], capture_output=True,
                          text=True, env=env, check=False)  # fmt: skip
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return None, env
    return Path(done.stdout.strip().splitlines()[-1]), env


async def _main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-k8s-") as tmp:
        kubeconfig, env = _cluster(args, tmp)
        if kubeconfig is None:
            return 2
        api = config.new_client_from_config(config_file=str(kubeconfig))
        seen = Watched(api)
        keys = (
            "none",
            "k8s",
            "none_refused",
            "k8s_refused",
            "hold_gone",
            "notice",
            "notice_disruption",
            "submit_notice",
        )
        out: dict[str, list[float]] = {k: [] for k in keys}
        try:
            for block in range(0, args.claims, 10):
                size = min(10, args.claims - block)
                await _phase(api, seen, NoLending(), size, args.notice_s, out, "none")
                lending = KubernetesLending(api, notice_s=args.notice_s, poll_s=0.25)
                await _phase(api, seen, lending, size, args.notice_s, out, "k8s")
                print(f"claims: {len(out['k8s'])}/{args.claims}", file=sys.stderr, flush=True)
        finally:
            seen.stop()
            if env:
                subprocess.run(["bash", str(REPO / "deploy/local/kubernetes.sh"), "stop"], env=env, check=False,
                               capture_output=True)  # fmt: skip
    print(f"\nclaim -> lease at the site, {args.claims} claims each, same run; notice {args.notice_s} s")
    print(f"{'':50} {'p50 ms':>8} {'p99 ms':>8} {'n':>5}")
    for name, key in (("broker without the scheduler (yardstick)", "none"),
                      ("broker lending through Kubernetes", "k8s"),
                      ("release -> every pod of the lease gone", "hold_gone"),
                      ("deletionTimestamp seen -> notice at the site", "notice"),
                      ("DisruptionTarget (whole s) -> notice at the site", "notice_disruption"),
                      ("training pod created -> notice at the site", "submit_notice")):  # fmt: skip
        v = out[key]
        print(f"{name:50} {statistics.median(v) * 1e3:8.1f} {_pct(v, 0.99) * 1e3:8.1f} {len(v):5d}")
    claim_ok = _pct(out["k8s"], 0.99) <= 0.1
    notice_ok = _pct(out["notice"], 0.99) <= 1.0
    release_ok = _pct(out["hold_gone"], 0.99) <= 1.0
    print(f"claims refused for want of a placeholder: {len(out['k8s_refused'])}; ratio p99 k8s/none "
          f"{_pct(out['k8s'], 0.99) / _pct(out['none'], 0.99):.2f}x; claim p99 target 100 ms: "
          f"{'met' if claim_ok else 'MISSED'}; notice p99 target 1 s: {'met' if notice_ok else 'MISSED'} "
          f"({len(out['notice'])} preemptions); release p99 target 1 s: {'met' if release_ok else 'MISSED'}")  # fmt: skip
    return 0 if claim_ok and notice_ok and release_ok else 1


def main() -> int:
    """Run the benchmark (module docstring); exit 0 when the targets are met, 1 otherwise."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--claims", type=int, default=40)
    p.add_argument("--notice-s", type=int, default=3)
    p.add_argument(
        "--kubeconfig", help="a running local cluster's kubeconfig (else a private one is started)"
    )
    return asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
