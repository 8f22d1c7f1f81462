"""Benchmark: inference that survives a reclaim — an edge site keeps ``--target`` leases of the
simulated inference server (:class:`broker.kept_leases.KeptLeases`) under a steady open-loop load
(``--rate`` requests/s, :class:`simulator.load.OpenLoopLoad`) while Slurm takes lent GPUs back for
training jobs, ``--reclaims`` times.

Set-up (every process on this machine; the services through ``deploy/local/*.sh``,
``bench/support/services.py``):

* a private Slurm cluster (4 nodes × 8 GPUs, ``GraceTime`` = ``--notice-s``), a private Mosquitto
  (one site, ``edge-a``) and the shared Kafka node (a fresh topic prefix, topics created as
  ``gpupool topics create`` does);
* ``gpupool broker run`` in a child process, lending through Slurm (``[broker] scheduler =
  "slurm"``, placeholder holds) with one workload profile: ``python -m simulator.inference_server``
  (``--latency-ms`` of simulated work per request; on SIGTERM it drains up to the notice);
* capacity as analytics would send it: every GPU idle, refreshed every 20 s; a node's GPUs busy
  while a training job runs there, idle again once it ended;
* the site in this process: an :class:`broker.edge.EdgeClient`, the kept leases (a new endpoint
  takes traffic once the broker's health check and the site's readiness probe passed:
  :func:`simulator.load.probe`, ``/health`` of that lease then ``--warmup`` requests; serving
  endpoints are checked every second), the load.

After ``--start-s`` of load (the broker holds every offered GPU with a placeholder meanwhile),
each reclaim: once every kept lease serves, ``--settle-s`` and then ``--steady-s`` seconds passed
(the steady state measured), a training job
needing all 8 GPUs of the node of one kept lease is submitted to the ``training`` partition; Slurm
preempts the lease's hold (and the node's placeholders), the broker turns the lease
``reclaiming`` with Slurm's deadline, the site claims a replacement, switches traffic once it
serves, lets the old endpoint drain and releases early; the training job runs at least
``--train-s`` (so the broker's reads of Slurm see it, as they see any real training job, and end
its hold on the GPUs taken back: ``retake_hold_max_s`` in :mod:`broker.lending`); it is cancelled.

Printed: reclaims (hand-overs), early releases and GPUs returned before the deadline; requests
in total and failed, during reclaims (sent between a notice and the early release, or the
deadline) and in steady state (the quiet ``--steady-s`` before each reclaim); p50/p99 latency of both and the ratio of the p99s
(target: 0 failed requests over >= 50 reclaims; p99 during reclaims <= 1.5 × steady state);
notice → switch and notice → release; training submit → running.

Latency is taken from the moment the load driver sent each request: the driver runs in this
process, on the cores every simulated node shares, and when it is starved of CPU it sends late;
that lateness is the client's, not the endpoints' (:mod:`simulator.load`). The latency from each
request's due time (which includes it), the ratio on it, and the driver's lag are printed too.
Where the tail comes from: the served requests by endpoint (the leaving one, its replacement, the
one the reclaim did not touch) and by phase, with the driver's lag and new connections; this
process's CPU use and its time waiting for a CPU in each kind of window; the load average.
What the reclaims cost the host, in CPU seconds (load-independent, unlike the latency): every
process of the run sorted into parts (:mod:`bench.support.proc_cpu`, read every 0.5 s by a
process of its own) — the load driver and site SDK, the broker, Slurm's daemons, the hold
scripts, each workload process by role (leaving, replacement, untouched) — with each part's CPU
per wall second in steady state and in reclaims, and its CPU seconds per reclaim beyond steady
state.
``--steady-burst`` (a diagnostic) starts the workload's process in each steady window, as a
replacement's start does in a reclaim, to see what that start alone costs the tail.

Exit 0 when the targets are met
(the count of reclaims only with ``--reclaims`` >= 50), 1 otherwise, 2 when a service did not start.

Run: ``.venv/bin/python bench/edge_reclaim.py [--reclaims 50] [--rate 200] [--notice-s 10]``
(about 5 minutes; ``--reclaims 5`` to try it). The numbers swing with the machine's load (every
process here shares its cores).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tomli_w  # noqa: E402

from bench.support.proc_cpu import BENCH_PARTS  # noqa: E402
from bench.support.proc_cpu import WORKLOAD as WORKLOAD_PART  # noqa: E402
from bench.support.services import (  # noqa: E402
    NODES,
    Cluster,
    start_kafka,
    start_mosquitto,
    stop_kafka,
    stop_mosquitto,
)
from broker.acl import BROKER_USER  # noqa: E402
from broker.edge import EdgeClient  # noqa: E402
from broker.kept_leases import Handover, KeptLeases  # noqa: E402
from contracts import CapacityUpdate, GpuState, KafkaTopics, encode  # noqa: E402
from gpupool.topics_cli import create_all  # noqa: E402
from runtime.kafka import KafkaBus  # noqa: E402
from simulator.load import OpenLoopLoad, RequestRecord, probe, quantile, summarize  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SITE = "edge-a"
WORKLOAD = "infer"
GPUS_PER_NODE = 8


class Capacity:
    """Capacity updates on Kafka as analytics sends them: every GPU idle, a node busy while
    training runs there; everything re-sent every ``refresh_s`` (the broker forgets silent GPUs)."""

    def __init__(self, bus: KafkaBus, topics: KafkaTopics, refresh_s: float = 20.0) -> None:
        self.producer = bus.producer(client_id="bench-capacity")
        self.topics = topics
        self.busy: set[str] = set()
        self.refresh_s = refresh_s

    async def send(self, hosts: list[str]) -> None:
        """Send a capacity update of every GPU of ``hosts`` (busy or idle as marked), now."""
        now = time.time()
        for host in hosts:
            state = GpuState.BUSY if host in self.busy else GpuState.IDLE
            for i in range(GPUS_PER_NODE):
                u = CapacityUpdate(
                    ts=now, host=host, gpu_uuid=f"gpu{i}", state=state, since=now - 60,
                    predicted_idle_until=None if state is GpuState.BUSY else now + 3600,
                    model_name="NVIDIA H100 80GB HBM3",
                )  # fmt: skip
                await self.producer.send(self.topics.capacity, encode(u), key=u.key)
        await self.producer.flush()

    async def set_busy(self, host: str, busy: bool) -> None:
        """Mark ``host`` busy (training runs there) or idle, and send its capacity at once."""
        (self.busy.add if busy else self.busy.discard)(host)
        await self.send([host])

    async def refresh_forever(self) -> None:
        """Send every node's capacity again every ``refresh_s`` seconds (analytics' refresh), until cancelled."""
        while True:
            await self.send(NODES)
            await asyncio.sleep(self.refresh_s)


def _broker_config(path: Path, cluster: Cluster, control: Path, notice_s: int, latency_ms: float,
                   port_min: int) -> None:  # fmt: skip
    argv = [sys.executable, "-m", "simulator.inference_server", "--port", "{port}",
            "--latency-ms", str(latency_ms), "--drain-s", str(notice_s), "--quiet-s", str(notice_s)]  # fmt: skip
    broker = {
        "scheduler": "slurm",
        "slurm_conf": str(cluster.conf),
        "slurm_output_dir": str(control),
        "notice_s": float(notice_s),
        "lease_ttl_s": 30.0,
        "offer_ttl_s": 60.0,
        "workloads": [
            {"name": WORKLOAD, "argv": argv, "port_min": port_min, "port_max": port_min + 99, "health_timeout_s": 30.0}
        ],
    }
    path.write_text(tomli_w.dumps({"broker": broker}))


def _start_broker(cfg: Path, kafka: str, creds: dict[str, object], topics: KafkaTopics, log: Path) -> subprocess.Popen[bytes]:
    run = uuid.uuid4().hex[:6]
    users = creds["users"]
    assert isinstance(users, dict)
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", "from gpupool.cli import app; app(prog_name='gpupool')",
             "--log-level", "INFO", "broker", "run", "--config", str(cfg), "--kafka", kafka, "--mqtt", f"{creds['host']}:{creds['port']}",
             "--topic-prefix", topics.prefix, "--group-id", f"bench-edge-{run}", "--client-id", f"bench-edge-{run}",
             "--metrics-port", "0"],
            env={**os.environ, "GPUPOOL_MQTT_PASSWORD": users[BROKER_USER]}, stdin=subprocess.DEVNULL,
            stdout=out, stderr=out, cwd=REPO,
        )  # fmt: skip


def _host(site: EdgeClient, lease_id: str) -> str | None:
    msg = site.known_leases.get(lease_id)
    if msg is None:
        return None
    return msg.hosts[0] if msg.hosts else msg.gpus[0].split("/", 1)[0]


def _done(h: Handover) -> bool:
    return h.released_at is not None or h.ended is not None


async def _until(cond: object, timeout_s: float, what: str) -> None:
    assert callable(cond)
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


async def _reclaims(
    args: argparse.Namespace, cluster: Cluster, capacity: Capacity, site: EdgeClient, kept: KeptLeases,
    submit_to_running: list[float], steady: list[tuple[float, float]],
) -> None:  # fmt: skip
    """The reclaims (module docstring); the quiet ``--steady-s`` before each one goes to
    ``steady``. The harness asks Slurm at most every 0.25 s: it shares the cores it measures."""
    n = 0
    while len(kept.handovers) < args.reclaims:
        await _until(
            lambda: len(kept.endpoints.serving) >= args.target and all(_done(h) for h in kept.handovers),
            args.notice_s + 60, "every kept lease serving",
        )  # fmt: skip
        await asyncio.sleep(args.settle_s)  # the training node's placeholders come back meanwhile
        quiet = time.time()
        if args.steady_burst:  # diagnostic: a workload process starting, as a replacement's does
            burst = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "simulator.inference_server", "--port", "0", cwd=REPO,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        await asyncio.sleep(args.steady_s)
        steady.append((quiet, time.time()))
        if args.steady_burst:
            burst.kill()
            await burst.wait()
        serving = [lid for lid, ep in kept.leases.items() if ep in kept.endpoints.serving]
        host = _host(site, serving[n % len(serving)])
        n += 1
        assert host is not None
        await capacity.set_busy(host, True)
        t0 = time.monotonic()
        job = await cluster.submit_training(host, GPUS_PER_NODE)
        try:
            submit_to_running.append(await cluster.until_running(job, t0, args.notice_s + 60, poll_s=0.25))
            running_at = time.monotonic()
            await _until(lambda: all(_done(h) for h in kept.handovers), args.notice_s + 30, "hand-overs done")
            await asyncio.sleep(max(0.0, running_at + args.train_s - time.monotonic()))
        finally:
            await cluster.cancel(job)
            await cluster.until_gone(job, poll_s=0.25)
            await capacity.set_busy(host, False)
        print(f"reclaims {len(kept.handovers)}/{args.reclaims} (training on {host})", file=sys.stderr, flush=True)


async def _run(args: argparse.Namespace, tmp: Path) -> int:
    cluster = Cluster(tmp / "slurm", args.notice_s)
    kafka_started = False
    broker: subprocess.Popen[bytes] | None = None
    mq_state = tmp / "mqtt"
    started = cluster.script("start")
    if started.returncode != 0:
        print(started.stdout, started.stderr, file=sys.stderr)
        return 2
    try:
        creds = await start_mosquitto(mq_state, [SITE])
        kafka, kafka_started = await start_kafka()
    except RuntimeError as e:
        print(e, file=sys.stderr)
        cluster.script("stop")
        return 2
    census_out = tmp / "cpu.jsonl"
    census = subprocess.Popen(
        [sys.executable, "-m", "bench.support.proc_cpu", "--match", str(tmp), "--every", "0.5", "--out", str(census_out),
         "--bench-pid", str(os.getpid())], cwd=REPO, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    bus = KafkaBus(kafka, client_id="bench-edge")
    topics = KafkaTopics(prefix=f"benchedge{uuid.uuid4().hex[:8]}.")
    log_path = args.broker_log or tmp / "broker.log"
    load_task: asyncio.Task[None] | None = None
    refresh: asyncio.Task[None] | None = None
    stop = asyncio.Event()
    submit_to_running: list[float] = []
    steady: list[tuple[float, float]] = []
    capacity = Capacity(bus, topics)
    loadavg: list[float] = []
    cpu: list[tuple[float, ...]] = []
    broker_pid: list[int] = []
    sampler = asyncio.create_task(_sample_loadavg(loadavg, cpu, broker_pid))
    try:
        await create_all(kafka, topics, 1, replication_factor=1)
        await capacity.producer.start()
        refresh = asyncio.create_task(capacity.refresh_forever())
        cfg = tmp / "broker.toml"
        _broker_config(cfg, cluster, tmp / "lending", args.notice_s, args.latency_ms, args.port_min)
        broker = _start_broker(cfg, kafka, creds, topics, log_path)
        broker_pid.append(broker.pid)
        users = creds["users"]
        async with EdgeClient(
            site=SITE, host=creds["host"], port=creds["port"], username=SITE, password=users[SITE],
            root=creds["root"], client_id=f"bench-{SITE}-{uuid.uuid4().hex[:6]}", connect_timeout_s=30,
        ) as site:  # fmt: skip
            fast_s = args.fast_ms / 1000 if args.fast_ms is not None else None

            async def warm(ep: str, lid: str) -> bool:
                # over the load's own connection pool (--pooled-probe) or a session of the probe's own
                how = load.probe if args.pooled_probe else probe
                return await how(ep, lid, warmup=args.warmup, concurrency=args.warm_concurrency, fast_s=fast_s)

            kept = KeptLeases(
                site, target=args.target, workload=WORKLOAD, renew_every_s=5.0, ready_timeout_s=40.0,
                drain_timeout_s=float(args.notice_s), duration_seconds=3600.0,
                probe=warm if args.warmup >= 0 else None,
                recheck=lambda ep, lid: probe(ep, lid, warmup=0), recheck_every_s=1.0, overlap_s=args.overlap_s,
            )  # fmt: skip
            load = OpenLoopLoad(kept.endpoints, rate_per_s=args.rate, timeout_s=2.0)
            async with load, kept:
                await kept.ready(180)
                load_task = asyncio.create_task(load.run(stop))
                await asyncio.sleep(args.start_s)  # the broker puts a placeholder on every offered GPU
                began = time.time()
                await _reclaims(args, cluster, capacity, site, kept, submit_to_running, steady)
                stop.set()
                await load_task
                ended = time.time()
    except (RuntimeError, TimeoutError) as e:
        tail = log_path.read_text(errors="replace").splitlines()[-30:] if log_path.exists() else []
        print(f"benchmark failed: {e!r}\nbroker log tail:", *tail, sep="\n", file=sys.stderr)
        return 1
    finally:
        stop.set()
        for t in (load_task, refresh, sampler):
            if t is not None:
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
        if broker is not None and broker.poll() is None:
            broker.send_signal(signal.SIGTERM)
            try:
                broker.wait(30)
            except subprocess.TimeoutExpired:
                broker.kill()
        await cluster.cancel_all()
        census.terminate()
        census.wait()
        with contextlib.suppress(Exception):
            await capacity.producer.stop()
        await bus.close()
        cluster.script("stop")
        await stop_mosquitto(mq_state)
        if kafka_started:
            await stop_kafka()
    parts = [json.loads(line) for line in census_out.read_text().splitlines() if line.strip()]
    return _report(args, kept, load, submit_to_running, steady, began, ended, loadavg, cpu, parts)


def _runqueue_wait_s() -> float:
    """Seconds the calling thread has waited on a run queue, runnable but not running
    (``/proc/thread-self/schedstat``, second field, ns); NaN where the kernel does not say."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) process ``pid`` has used (``/proc/<pid>/stat``); NaN when unknown."""
    if pid is None:
        return float("nan")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return float("nan")


def _machine_busy_s() -> float:
    """CPU seconds all cores have spent busy (``/proc/stat``: all but idle and iowait)."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(ticks[:8]) - ticks[3] - ticks[4]) / _TICK
    except (OSError, IndexError, ValueError):
        return float("nan")


CPU_COUNTERS = ("this process's CPU", "its loop's wait for a CPU", "the broker's CPU", "all cores busy")
"""What :func:`_sample_loadavg` samples besides the time, in that order (seconds so far)."""


async def _sample_loadavg(into: list[float], cpu: list[tuple[float, ...]], broker_pid: list[int],
                          every_s: float = 0.1) -> None:  # fmt: skip
    """Every ``every_s`` seconds until cancelled: append (Unix s, *the :data:`CPU_COUNTERS`*) to
    ``cpu`` (the broker's once ``broker_pid`` holds its pid), and every tenth time the machine's
    1-minute load average to ``into``."""
    n = 0
    while True:
        pid = broker_pid[0] if broker_pid else None
        cpu.append((time.time(), time.process_time(), _runqueue_wait_s(), _proc_cpu_s(pid), _machine_busy_s()))
        if n % 10 == 0:
            into.append(os.getloadavg()[0])
        n += 1
        await asyncio.sleep(every_s)


def _cpu_share(cpu: list[tuple[float, ...]], windows: list[tuple[float, float]]) -> list[float]:
    """Each of the :data:`CPU_COUNTERS` per wall second inside ``windows`` (samples of
    :func:`_sample_loadavg`; NaN without samples there)."""
    used = [0.0] * len(CPU_COUNTERS)
    wall = 0.0
    for a, b in itertools.pairwise(cpu):
        if any(w0 <= a[0] and b[0] <= w1 for w0, w1 in windows):
            wall += b[0] - a[0]
            used = [u + (y - x) for u, x, y in zip(used, a[1:], b[1:], strict=True)]
    return [u / wall if wall else float("nan") for u in used]


def _overlap(a: float, b: float, windows: list[tuple[float, float]]) -> float:
    """Seconds of [a, b] inside ``windows`` (which do not overlap each other)."""
    return sum(max(0.0, min(b, w1) - max(a, w0)) for w0, w1 in windows)


def _parts_cpu(
    parts: list[dict[str, object]], windows: list[tuple[float, float]]
) -> tuple[dict[str, float], float]:
    """CPU seconds each part used inside ``windows`` (each reading interval's use spread evenly
    over it, the share inside counted) and the wall seconds of those windows the readings cover."""
    used: dict[str, float] = {}
    wall = 0.0
    for x, y in itertools.pairwise(parts):
        a, b = float(x["t"]), float(y["t"])  # type: ignore[arg-type]
        share = _overlap(a, b, windows) / (b - a) if b > a else 0.0
        if share <= 0:
            continue
        wall += share * (b - a)
        cx, cy = x["cpu"], y["cpu"]
        assert isinstance(cx, dict) and isinstance(cy, dict)
        for name, v in cy.items():
            used[name] = used.get(name, 0.0) + share * (v - cx.get(name, 0.0))
    return used, wall


_WORKLOAD_ROLES = ("workload: leaving (drain)", "workload: replacement (start)", "workload: untouched")
"""The rows of the workload processes in a reclaim (:func:`_workload_role`)."""


def _workload_role(name: str, leaving_ports: set[int], new_pids: set[int]) -> str:
    """The row of a workload process's part (``workload <pid> <port>``) in a reclaim window: the
    replacement if its process was first seen then, the leaving endpoint's if it serves on that
    port, else the endpoint the reclaim did not touch."""
    _, pid, port = name.split()
    if int(pid) in new_pids:
        return _WORKLOAD_ROLES[1]
    if int(port) in leaving_ports:
        return _WORKLOAD_ROLES[0]
    return _WORKLOAD_ROLES[2]


def _events(hs: list[Handover], windows: list[tuple[float, float]]) -> list[tuple[tuple[float, float], set[int]]]:
    """The reclaim windows merged where they overlap (one training job taking back both kept
    leases makes two hand-overs at once), each with the ports of the endpoints it took back."""
    out: list[tuple[tuple[float, float], set[int]]] = []
    for h, (a, b) in sorted(zip(hs, windows, strict=True), key=lambda x: x[1][0]):
        port = {int(h.endpoint.rsplit(":", 1)[1].split("/")[0])} if h.endpoint else set()
        if out and a <= out[-1][0][1]:
            (a0, b0), ports = out[-1]
            out[-1] = ((a0, max(b0, b)), ports | port)
        else:
            out.append(((a, b), port))
    return out


def _parts_report(parts: list[dict[str, object]], hs: list[Handover], windows: list[tuple[float, float]],
                  steady_windows: list[tuple[float, float]], target: int) -> None:  # fmt: skip
    """The CPU by part of the host (:mod:`bench.support.proc_cpu`): CPU s per wall s in steady
    windows and in reclaims (the hand-overs' windows merged where they overlap: :func:`_events`),
    and CPU s per reclaim against the same time of steady state; workload processes by role (the
    leaving endpoints', the replacements started in that reclaim, any untouched), against one of
    as many of the ``target`` serving endpoints in steady state."""
    if len(parts) < 2:
        return
    steady_used, steady_wall = _parts_cpu(parts, steady_windows)
    rows: dict[str, float] = {}
    wall = 0.0
    first_seen: dict[int, float] = {}
    for row in parts:
        cpu = row["cpu"]
        assert isinstance(cpu, dict)
        for name in cpu:
            if name.startswith(WORKLOAD_PART):
                first_seen.setdefault(int(name.split()[1]), float(row["t"]))  # type: ignore[arg-type]
    events = _events(hs, windows)
    for w, ports in events:
        used, ww = _parts_cpu(parts, [w])
        wall += ww
        new = {pid for pid, t in first_seen.items() if w[0] <= t <= w[1] + 0.5}
        for name, v in used.items():
            key = _workload_role(name, ports, new) if name.startswith(WORKLOAD_PART) else name
            rows[key] = rows.get(key, 0.0) + v
    steady_rows: dict[str, float] = {}
    for name, v in steady_used.items():
        key = "workloads" if name.startswith(WORKLOAD_PART) else name
        steady_rows[key] = steady_rows.get(key, 0.0) + v
    n = len(events) or 1
    mean_s = wall / n
    nan = float("nan")
    per_endpoint = steady_rows.get("workloads", 0.0) / steady_wall / target if steady_wall else nan
    leaving = sum(len(ports) for _, ports in events) / n  # endpoints taken back per reclaim
    print(
        f"{'CPU by part of the host (/proc)':38} {'steady':>9} {'reclaims':>9} {'CPU s per':>10} {'extra per':>10}"
    )
    print(f"{'  (CPU s per wall s; per reclaim: in':38} {'':>9} {'':>9} {'reclaim':>10} {'reclaim':>10}")
    print(f"{'  its window: ' + str(len(events)) + ' of mean ' + format(mean_s, '.2f') + ' s)':38}")
    total_st = sum(steady_rows.values()) / steady_wall if steady_wall else nan
    total_du = sum(rows.values()) / wall if wall else nan
    for name in [*BENCH_PARTS, *_WORKLOAD_ROLES]:
        if name in _WORKLOAD_ROLES:  # steady: as many serving endpoints; a replacement did not run
            st = {0: per_endpoint * leaving, 1: nan, 2: per_endpoint * (target - leaving)}[_WORKLOAD_ROLES.index(name)]
        else:
            st = steady_rows.get(name, 0.0) / steady_wall if steady_wall else nan
        du = rows.get(name, 0.0) / wall if wall else nan
        per = rows.get(name, 0.0) / n
        extra = per - (st * mean_s if st == st else 0.0)
        print(f"{name:38} {st:9.3f} {du:9.3f} {per:10.3f} {extra:10.3f}")
    extra = (total_du - total_st) * mean_s
    print(f"{'all parts':38} {total_st:9.3f} {total_du:9.3f} {total_du * mean_s:10.3f} {extra:10.3f}")


def _ms(values: list[float], q: float) -> str:
    return f"{quantile(values, q) * 1e3:8.1f}" if values else f"{'—':>8}"


def _breakdown(records: list[RequestRecord], hs: list[Handover], windows: list[tuple[float, float]],
               steady_windows: list[tuple[float, float]]) -> None:  # fmt: skip
    """Where the tail comes from: the served requests of each kind, by where they went (the leaving
    endpoint, the replacement, the endpoint the reclaim did not touch) and by phase (notice →
    switch → +1 s → release); for each, p99 of the latency, of the driver's own lag (due → sent:
    its process late, part of the latency), of the latency less that lag, and the new connections."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.sent_at)
    times = [r.sent_at for r in ok]
    rows: dict[str, list[RequestRecord]] = {k: [] for k in (
        "steady state", "during: all", "  leaving endpoint", "  replacement endpoint", "  untouched endpoint",
        "  notice -> switch", "  switch -> +1 s", "  +1 s -> release")}  # fmt: skip
    for a, b in steady_windows:
        rows["steady state"] += ok[bisect.bisect_left(times, a) : bisect.bisect_right(times, b)]
    for i, (h, (a, b)) in enumerate(zip(hs, windows, strict=True)):
        inside = ok[bisect.bisect_left(times, a) : bisect.bisect_right(times, b)]
        before = {r.endpoint for r in ok[bisect.bisect_left(times, a - 1.0) : bisect.bisect_left(times, a)]}
        switched = h.switched_at if h.switched_at is not None else b
        rows["during: all"] += [r for r in inside if not any(a0 <= r.sent_at <= b0 for a0, b0 in windows[:i])]
        for r in inside:
            role = "leaving" if r.endpoint == h.endpoint else "untouched" if r.endpoint in before else "replacement"
            rows[f"  {role} endpoint"].append(r)
            phase = "notice -> switch" if r.sent_at < switched else "switch -> +1 s" if r.sent_at < switched + 1 else "+1 s -> release"
            rows[f"  {phase}"].append(r)  # fmt: skip
    print(f"{'where the tail comes from (served)':38} {'requests':>9} {'p99 ms':>8} {'lag p99':>8} "
          f"{'p99-lag':>8} {'new conn':>8} {'conn p99':>8}")  # fmt: skip
    for name, rs in rows.items():
        conns = [r.connect_s for r in rs if r.connect_s is not None]
        print(f"{name:38} {len(rs):9d} {_ms([r.latency_s for r in rs], 0.99)} {_ms([r.lag_s for r in rs], 0.99)} "
              f"{_ms([r.latency_s - r.lag_s for r in rs], 0.99)} {len(conns):8d} {_ms(conns, 0.99)}")  # fmt: skip


def _report(
    args: argparse.Namespace, kept: KeptLeases, load: OpenLoopLoad, submit_to_running: list[float],
    steady_windows: list[tuple[float, float]], began: float, ended: float, loadavg: list[float],
    cpu: list[tuple[float, ...]], parts: list[dict[str, object]],
) -> int:  # fmt: skip
    hs = kept.handovers
    windows = []
    for h in hs:
        end = h.released_at if h.released_at is not None else (h.deadline if h.deadline is not None else h.noticed_at)
        windows.append((h.noticed_at, end))
    records = load.records
    if args.records is not None:
        with args.records.open("w") as out:
            for r in records:
                out.write(json.dumps({"request": r.row()}) + "\n")
            for h in hs:
                out.write(json.dumps({"handover": dataclasses.asdict(h)}) + "\n")
            out.write(json.dumps({"steady": steady_windows}) + "\n")
    # the target's latency: from the moment the driver sent each request (its own lateness, a
    # starved client process, is not the endpoints' doing; simulator.load); from the due time too
    during, _ = summarize(records, windows, from_send=True)
    steady, _ = summarize(records, steady_windows, from_send=True)
    during_due, _ = summarize(records, windows)
    steady_due, _ = summarize(records, steady_windows)
    failed = sum(1 for r in records if not r.ok)
    early = sum(1 for h in hs if h.early)
    switch = [h.switched_at - h.noticed_at for h in hs if h.switched_at is not None]
    release = [h.released_at - h.noticed_at for h in hs if h.released_at is not None]
    before = [h.deadline - h.released_at for h in hs if h.released_at is not None and h.deadline is not None]
    errors = Counter(r.error for r in records if not r.ok)
    ratio = during.p99_s / steady.p99_s
    ratio_due = during_due.p99_s / steady_due.p99_s
    print(f"\nedge site under load through {len(hs)} reclaims: {args.rate:g} requests/s over {args.target} kept leases, "
          f"notice {args.notice_s} s, {args.latency_ms:g} ms per request, {ended - began:.0f} s")  # fmt: skip
    print(f"{'latency from the send':38} {'requests':>9} {'failed':>7} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'| from due: p50':>15} {'p99':>8} {'driver lag p99':>15}")  # fmt: skip
    for name, s, d in (("steady state (quiet before each)", steady, steady_due), ("during reclaims", during, during_due)):
        print(f"{name:38} {s.total:9d} {s.failed:7d} {s.p50_s * 1e3:8.2f} {s.p99_s * 1e3:8.2f} "
              f"{d.p50_s * 1e3:15.2f} {d.p99_s * 1e3:8.2f} {s.lag_p99_s * 1e3:15.2f}")  # fmt: skip
    print(f"all requests of the run {len(records)}, failed {failed}: {dict(errors) or 'none'}")
    print(f"reclaims {len(hs)}; released early {early}; GPUs returned before the deadline {len(before)} "
          f"(by {statistics.median(before) if before else float('nan'):.2f} s, median); "
          f"kept-lease counts {dict(sorted(kept.counts.items()))}")  # fmt: skip
    for name, vals in (("notice -> traffic switched", switch), ("notice -> released", release),
                       ("training submit -> RUNNING", submit_to_running)):  # fmt: skip
        if vals:
            print(f"{name:38} p50 {statistics.median(vals):6.2f} s  p99 {quantile(vals, 0.99):6.2f} s  (n={len(vals)})")
    per = sorted(p for w in windows if (p := summarize(records, [w], from_send=True)[0].p99_s) == p)  # NaN: none
    per_steady = sorted(p for w in steady_windows if (p := summarize(records, [w], from_send=True)[0].p99_s) == p)
    if per and per_steady:
        print(f"p99 of each reclaim: median {statistics.median(per) * 1e3:.1f} ms, worst {per[-1] * 1e3:.1f} ms; "
              f"of each steady window: median {statistics.median(per_steady) * 1e3:.1f} ms, "
              f"worst {per_steady[-1] * 1e3:.1f} ms")  # fmt: skip
    _breakdown(records, hs, windows, steady_windows)
    print(f"{'CPU seconds per wall second':38} {'steady':>9} {'reclaims':>9}   (this process: load driver, "
          f"site SDK, harness)")  # fmt: skip
    for name, st, du in zip(CPU_COUNTERS, _cpu_share(cpu, steady_windows), _cpu_share(cpu, windows), strict=True):
        print(f"{name:38} {st:9.2f} {du:9.2f}")
    _parts_report(parts, hs, windows, steady_windows, args.target)
    if loadavg:
        print(f"load average (1 min) during the run: min {min(loadavg):.2f}, median {statistics.median(loadavg):.2f}, "
              f"max {max(loadavg):.2f} ({os.cpu_count()} CPUs)")  # fmt: skip
    failed_ok = failed == 0
    ratio_ok = ratio <= 1.5
    count_ok = len(hs) >= 50 or args.reclaims < 50
    print(f"failed edge requests {failed} (target 0): {'met' if failed_ok else 'MISSED'}; "
          f"p99 during reclaims / steady state {ratio:.2f}x (target <= 1.5x): {'met' if ratio_ok else 'MISSED'} "
          f"({ratio_due:.2f}x from the due time); "
          f"reclaims {len(hs)} (target >= 50){'' if len(hs) >= 50 else ' (a shorter run)'}")  # fmt: skip
    print(json.dumps({"reclaims": len(hs), "released_early": early, "returned_before_deadline": len(before),
                      "requests_during": during.total, "failed_during": during.failed, "requests_steady": steady.total,
                      "failed_steady": steady.failed, "requests_all": len(records), "failed_all": failed, "p99_steady_ms": round(steady.p99_s * 1e3, 3),
                      "p99_during_ms": round(during.p99_s * 1e3, 3), "p99_ratio": round(ratio, 3),
                      "p99_steady_due_ms": round(steady_due.p99_s * 1e3, 3), "p99_during_due_ms": round(during_due.p99_s * 1e3, 3),
                      "p99_ratio_due": round(ratio_due, 3), "driver_lag_p99_steady_ms": round(steady.lag_p99_s * 1e3, 3),
                      "driver_lag_p99_during_ms": round(during.lag_p99_s * 1e3, 3),
                      "loadavg_median": round(statistics.median(loadavg), 2) if loadavg else None}))  # fmt: skip
    return 0 if failed_ok and ratio_ok and count_ok else 1


def main() -> int:
    """Run the benchmark (module docstring); exit 0 when the targets are met, 1 otherwise, 2 when a service could not start."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reclaims", type=int, default=50, help="reclaims to make (>= 1)")
    p.add_argument("--rate", type=float, default=200.0, help="requests per second (open loop)")
    p.add_argument("--target", type=int, default=2, help="leases kept serving")
    p.add_argument("--notice-s", type=int, default=10, help="reclaim notice (Slurm GraceTime), seconds")
    p.add_argument("--start-s", type=float, default=15.0,
                   help="load before the first reclaim while the broker fills the pool with placeholders, seconds")
    p.add_argument("--steady-s", type=float, default=3.0, help="steady state measured before each reclaim, seconds")
    p.add_argument("--settle-s", type=float, default=3.0, help="wait after a reclaim before the steady state, seconds")
    p.add_argument("--train-s", type=float, default=2.0,
                   help="each training job runs at least this long before it is cancelled, seconds")
    p.add_argument("--latency-ms", type=float, default=5.0, help="simulated work per request, ms")
    p.add_argument("--warmup", type=int, default=20,
                   help="the site's readiness probe of a new endpoint: /health, then this many requests "
                        "(-1: no probe, the broker's health check alone)")  # fmt: skip
    p.add_argument("--warm-concurrency", type=int, default=1,
                   help="the readiness probe's warm-up requests sent this many at a time (>= 1)")
    p.add_argument("--fast-ms", type=float, default=None,
                   help="the readiness probe passes only when its last warm-up requests answered within this "
                        "many ms (default: any answer)")
    p.add_argument("--pooled-probe", action=argparse.BooleanOptionalAction, default=False,
                   help="warm a new endpoint over the load's own connection pool, or (default) a session of its own")
    p.add_argument("--overlap-s", type=float, default=0.0,
                   help="a leaving endpoint keeps its share this long after its replacement serves (KeptLeases overlap_s)")
    p.add_argument("--port-min", type=int, default=28300,
                   help="the workload's ports: this one and the 99 above (another run on this machine must not share them)")
    p.add_argument("--steady-burst", action="store_true",
                   help="diagnostic: start the workload's process (simulator.inference_server) at the start of each "
                        "steady window, as a replacement's start does during a reclaim; off by default")
    p.add_argument("--broker-log", type=Path, help="the broker's JSON log (default: a temporary file)")
    p.add_argument("--records", type=Path, help="write every request and hand-over here (JSON lines)")
    args = p.parse_args()
    if args.reclaims < 1 or args.target < 1:
        p.error("--reclaims and --target must be >= 1")
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-edge-") as tmp:
        return asyncio.run(_run(args, Path(tmp)))


if __name__ == "__main__":
    raise SystemExit(main())
