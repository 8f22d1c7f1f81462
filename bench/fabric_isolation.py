"""Benchmark: time from a claim to its lease, granted once its partition *and QoS* are verified on
the fabric, on the demo's fabric and on the 100-switch fabric of ``bench/fabric_sweep.py``.

Starts a private simulated fabric with ``deploy/local/fabric.sh`` (ibsim + OpenSM, its own
temporary state directory and ibsim socket), then, in one process: an embedded MQTT server (amqtt),
a :class:`broker.service.BrokerService` on an in-process bus with an
:class:`broker.fabric_opensm.OpenSmFabric`, and an edge site (:class:`broker.edge.EdgeClient`).
Each round publishes one idle GPU on the next compute host (round-robin over the leaves), waits for
its offer, and times ``EdgeClient.claim`` from the claim's publication to the granted lease
arriving (the broker grants only after the fabric shows the lease's partition — and, with QoS,
the SL2VL and VL arbitration tables of every port on its paths to the gateway); then the lease is
released and its partition verified gone before the next round.

* yardstick, measured in the same run: the same rounds with a broker whose fabric manager does
  partitions only (``qos_share_percent=None``: PKey tables, switch ports, SA path record);
  run before and after the QoS rounds, the ratio uses their pooled median;
* QoS: partition + QoS plan (lent share bound 10 %). The first QoS claim also writes the plan to
  ``opensm.conf`` and waits for OpenSM to program every port: it is reported on its own and
  left out of the percentiles;
* with ``--audit``: one QoS drift audit of every connected switch port, timed.

Prints p50/p99 (nearest rank) and the worst claim → lease time of each, the ports each lease's QoS
check read, and the ratio of the QoS p50 to the yardstick p50. The fabric is stopped at the end
(also on an error or SIGTERM).

Run: ``.venv/bin/python bench/fabric_isolation.py [--preset demo|100] [--rounds N] [--audit]``; ``demo`` is
the fabric ``gpupool demo`` starts for its 4 hosts (2 spines × 2 leaves × 2 HCAs), ``100`` the
20 spines × 80 leaves × 16 HCAs fat tree of ``bench/fabric_sweep.py``. Needs ibsim-utils, opensm,
infiniband-diags and libumad2sim0 (``deploy/local/install-system.sh``). Exit status 0 when every
round was granted, 1 otherwise, 2 when the fabric could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.edge import ClaimRejected, EdgeClient  # noqa: E402
from broker.fabric_opensm import OpenSmFabric  # noqa: E402
from broker.service import BrokerConfig, BrokerService  # noqa: E402
from contracts import CapacityUpdate, GpuState, KafkaTopics, ReasonCode, encode  # noqa: E402
from contracts.bus import MemoryBus  # noqa: E402
from gpupool.embedded_mqtt import EmbeddedMqttBroker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FABRIC_SH = REPO / "deploy" / "local" / "fabric.sh"
PRESETS = {"demo": (2, 2, 2), "100": (20, 80, 16)}
"""Fat-tree shapes: (spines, leaves, HCAs per leaf)."""
SHARE_PERCENT = 10.0


def _fabric(cmd: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(FABRIC_SH), cmd], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _hosts(info: dict[str, object], rounds: int) -> list[str]:
    """``gpu-node-NNN`` names (the broker's default mapping: the Nth compute HCA), round-robin over
    the leaves so consecutive rounds take different paths."""
    nodes = info["nodes"]
    assert isinstance(nodes, dict)
    compute = [nid for nid, n in nodes.items() if n["kind"] == "hca" and n["role"] == "compute"]
    by_leaf: dict[str, list[int]] = {}
    for i, nid in enumerate(compute, 1):
        by_leaf.setdefault(str(nodes[nid]["leaf"]), []).append(i)
    order = [idx for group in zip(*by_leaf.values(), strict=False) for idx in group]
    return [f"gpu-node-{order[r % len(order)]:03d}" for r in range(rounds)]


async def _idle(bus: MemoryBus, topics: KafkaTopics, host: str, tag: str) -> None:
    producer = bus.producer()
    await producer.start()
    now = time.time()
    u = CapacityUpdate(ts=now, host=host, gpu_uuid=f"GPU-{host}-{tag}", state=GpuState.IDLE, since=now - 60,
                       predicted_idle_until=now + 3600, model_name="NVIDIA H100 80GB HBM3")  # fmt: skip
    await producer.send(topics.capacity, encode(u), key=u.key)
    await producer.flush()
    await producer.stop()


async def _rounds(
    fabric_json: Path, hosts: list[str], *, qos: bool, timeout_s: float
) -> tuple[list[float], list[int]]:
    """Claim → lease seconds of each round, and the ports each lease's QoS check read."""
    mqtt = EmbeddedMqttBroker()
    await mqtt.start()
    bus, topics = MemoryBus(), KafkaTopics()
    mgr = OpenSmFabric(fabric_json, qos_share_percent=SHARE_PERCENT if qos else None,
                       verify_timeout_s=timeout_s, command_timeout_s=30.0,
                       audit_interval_s=1e9)  # the claims alone: the audit is timed on its own (--audit)  # fmt: skip
    cfg = BrokerConfig(lent_share_percent=mgr.lent_share_percent, offer_ttl_s=120, lease_ttl_s=300)
    svc = BrokerService(bus=bus, topics=topics, mqtt_host=mqtt.host, mqtt_port=mqtt.port, protocol=4,
                        config=cfg, fabric=mgr)  # fmt: skip
    seconds: list[float] = []
    ports: list[int] = []
    await svc.start()
    stop = asyncio.Event()
    serve = asyncio.create_task(svc.run(stop))
    try:
        await svc.wait_connected(10)
        async with EdgeClient(site="bench", host=mqtt.host, port=mqtt.port, protocol=4) as site:
            for r, host in enumerate(hosts):
                await _idle(bus, topics, host, "0")  # one GPU per host: a released one is offered again
                lease = None
                deadline = time.monotonic() + 30
                while lease is None:
                    offer = next((o for o in site.known_offers.values() if o.host == host), None)
                    if offer is None:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"no offer for {host}")
                        await asyncio.sleep(0.01)
                        continue
                    t0 = time.perf_counter()
                    try:
                        lease = await site.claim(offer.offer_id, timeout_s=timeout_s + 30)
                    except ClaimRejected as e:  # the offer was re-published meanwhile: not timed
                        if e.code is not ReasonCode.UNKNOWN_OFFER or time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.05)
                seconds.append(time.perf_counter() - t0)
                q = lease.partition.qos if lease.partition is not None else None
                if qos:
                    assert q is not None and q.verified, lease
                    ports.append(q.ports_verified)
                print(f"    {'qos ' if qos else 'part'} round {r + 1}/{len(hosts)} {host}: "
                      f"{1000 * seconds[-1]:.0f} ms{f' ({q.ports_verified} ports)' if q else ''}", flush=True)
                await site.release(lease.lease_id)
                while mgr.partitions():
                    await asyncio.sleep(0.02)
    finally:
        stop.set()
        await serve
        await svc.stop()
        await mqtt.stop()
    return seconds, ports


def _summary(name: str, values: list[float]) -> str:
    return (f"{name}: p50 {1000 * _pct(values, 0.5):.0f} ms, p99 {1000 * _pct(values, 0.99):.0f} ms, "
            f"worst {1000 * max(values):.0f} ms over {len(values)} claims")  # fmt: skip


async def _bench(args: argparse.Namespace, state: Path) -> int:
    fabric_json = state / "fabric" / "fabric.json"
    info = json.loads(fabric_json.read_text())
    hosts = _hosts(info, args.rounds)
    switches = sum(n["kind"] == "switch" for n in info["nodes"].values())
    print(f"fabric: {switches} switches, {len(info['nodes']) - switches} CAs; {args.rounds} rounds each; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    yard1, _ = await _rounds(fabric_json, hosts, qos=False, timeout_s=args.timeout_s)
    first, _ = await _rounds(fabric_json, hosts[:1], qos=True, timeout_s=args.timeout_s)
    qos, ports = await _rounds(fabric_json, hosts, qos=True, timeout_s=args.timeout_s)
    yard2, _ = await _rounds(fabric_json, hosts, qos=False, timeout_s=args.timeout_s)
    yard = yard1 + yard2
    print()
    print(_summary("yardstick, claim -> lease with partition verified (no QoS)", yard)
          + f" (runs before/after: p50 {1000 * statistics.median(yard1):.0f} / "
          f"{1000 * statistics.median(yard2):.0f} ms)")  # fmt: skip
    print(f"first QoS claim (writes the plan, OpenSM programs every port): {1000 * first[0]:.0f} ms")
    print(_summary("claim -> lease with partition + QoS verified", qos)
          + f"; ports read per lease {min(ports)}..{max(ports)}")
    if args.audit:
        mgr = OpenSmFabric(fabric_json, qos_share_percent=SHARE_PERCENT, command_timeout_s=30.0)
        t0 = time.perf_counter()
        drift = await mgr.audit()
        print(f"one QoS audit of every switch port: {time.perf_counter() - t0:.1f} s, "
              f"{sum(len(v) for v in drift.values())} ports drifting")
    ratio = statistics.median(qos) / statistics.median(yard)
    print(f"\nresult: {switches}-switch fabric, claim -> QoS verified p50 {1000 * _pct(qos, 0.5):.0f} ms, "
          f"p99 {1000 * _pct(qos, 0.99):.0f} ms; {ratio:.2f}x the partition-only yardstick p50")  # fmt: skip
    return 0


def main() -> int:
    """Run the benchmark (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    ap.add_argument("--rounds", type=int, default=20, help="claims per phase")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="fabric verification timeout per lease")
    ap.add_argument("--audit", action="store_true", help="also time one QoS audit of every switch port")
    args = ap.parse_args()
    for name in ("broker", "amqtt", "transitions", "gpupool", "aiomqtt"):
        logging.getLogger(name).setLevel(logging.ERROR)
    spines, leaves, per_leaf = PRESETS[args.preset]
    started = time.monotonic()
    state = Path(tempfile.mkdtemp(prefix="gpupool-bench-isolation-"))
    env = {
        **os.environ,
        "GPUPOOL_STATE": str(state),
        "GPUPOOL_FABRIC_DIR": str(state / "fabric"),
        "GPUPOOL_FABRIC_SPINES": str(spines),
        "GPUPOOL_FABRIC_LEAVES": str(leaves),
        "GPUPOOL_FABRIC_HCAS_PER_LEAF": str(per_leaf),
        "GPUPOOL_FABRIC_TIMEOUT": "300",
    }
    for key in ("GPUPOOL_FABRIC_UPLINKS", "GPUPOOL_FABRIC_SWITCH_PORTS", "LD_PRELOAD", "IBSIM_SOCKNAME"):
        env.pop(key, None)

    def _on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _on_term)
    try:
        t0 = time.monotonic()
        up = _fabric("start", env, 400)
        if up.returncode != 0:
            print(f"fabric: start failed ({up.returncode})\n{up.stdout}{up.stderr}", file=sys.stderr)
            return 2
        print(f"{up.stdout.strip()} (start took {time.monotonic() - t0:.1f} s)", flush=True)
        try:
            return asyncio.run(_bench(args, state))
        except (AssertionError, TimeoutError, ClaimRejected) as e:
            print(f"failed: {e!r}", file=sys.stderr)
            return 1
    finally:
        down = _fabric("stop", env, 60)
        print(f"{down.stdout.strip()}; whole run {time.monotonic() - started:.1f} s")
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
