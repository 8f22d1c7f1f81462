"""Benchmark of the broker over a real Mosquitto on loopback: claim → lease latency against a bare
MQTT request/reply round trip measured in the same run, and reclaim notice latency.

Set-up (every process on this machine, everything on 127.0.0.1):

* **Mosquitto** — a private instance started with ``deploy/local/mosquitto.sh`` under its own
  ``GPUPOOL_STATE`` (a temporary directory) with one user per site (``broker.acl`` writes the
  password file and ACL), stopped at the end. The shared instance of the tests is not touched.
* **broker** — :class:`broker.service.BrokerService` (MQTT 5) in a child process with the
  in-process bus (:class:`contracts.bus.MemoryBus`); the benchmark feeds it capacity and pool
  demands as JSON lines on its stdin. With ``--kafka HOST:PORT`` it is ``gpupool broker run``
  on real Kafka instead (fresh topic prefix; capacity and demands are produced to Kafka, and the
  lease log on the claim path is Kafka's, acks=all).
* **responder** — the yardstick: a child process that answers every MQTT 5 request on
  ``{root}/sites/+/echo/req`` on its response topic with its correlation data (QoS 1 both ways,
  like a claim and its reply).
* **sites** — ``--sites`` connected sites (default 1,000), each its own user with a persistent
  session, a retained birth and a Last Will on ``sites/{site}/state``, subscribed to its leases,
  replies and ``broker/state``. ``--active`` of them (default 4) are full
  :class:`broker.edge.EdgeClient` s in this process that claim, release and answer reclaims; the
  others are held by a child process and are otherwise idle: they do not subscribe to offers,
  whose broadcast would deliver every offer change to every site (one claim changes two offers;
  at 100 claims/s that is ~200 messages/s per site, 200,000/s for 1,000 sites — more than the
  Python clients of one 2-core machine can read, so that fan-out is not what is measured here).

Measured:

1. **Claim → lease** (open loop, ``--rate`` claims/s for ``--duration`` s, after a warm-up): the
   time from sending a claim (one GPU of a random current offer) to holding the retained lease
   message, through :meth:`broker.edge.EdgeClient.claim`. Each lease is released after 1-4 s,
   so the broker also handles ~``--rate`` releases/s. **Bare round trip**: ``--echo-rate``
   requests/s from a site-like client to the responder, in the same window. Printed: p50/p99 of
   both and the ratio (target: claim p99 <= 3× bare p99 and <= 50 ms).
2. **Reclaim**: up to ``--reclaims`` live leases are reclaimed by pool demands naming the GPUs
   of ``--leases-per-demand`` leases each (a training job wanting a node's worth back), at
   ``--reclaim-rate`` demands/s. Measured per lease from writing the demand to the site holding the
   reclaim notice
   (target p99 <= 100 ms). Sites release within the first half of the notice (``--release-share``
   of them) or keep the GPUs until the broker revokes them at the deadline; a GPU is back when its
   lease ended (released or revoked) by the deadline (target 100 %; revocations are made at the
   deadline, so up to ``REVOKE_SLACK_S`` after it counts as on time and the worst lateness is printed).

Also printed for the in-process-bus broker: its garbage-collector pauses per generation and its
event-loop stalls over the whole run (``_StallWatch``), which tell broker-side delays from the
machine's. ``--no-gc-tune`` runs the broker without :func:`broker.service.tune_gc`;
``--profile-broker FILE`` runs it under cProfile. ``--service-only SECONDS`` measures the
broker's own cost per claim, release and tick without MQTT (:func:`service_cost`).

Run: ``.venv/bin/python bench/broker.py [--sites 1000] [--rate 100] [--duration 20] [--kafka H:P]``
(about a minute). ``_broker``, ``_echo`` and ``_sites`` are the child processes' own commands.
The numbers swing with the machine's load (every process here shares its cores): compare runs
made back to back, and look at the load average printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from broker.acl import BROKER_USER
from broker.config import BrokerConfig
from broker.credentials import broker_service, edge_client, mqtt_client
from broker.edge import BrokerRejected, EdgeClient
from broker.service import BrokerService, tune_gc
from bench.support.services import start_mosquitto, stop_mosquitto
from broker.transport import birth_seq, make_client, subscriptions
from contracts import (
    CapacityUpdate,
    GpuState,
    KafkaTopics,
    LeaseMessage,
    LeaseState,
    MqttTopics,
    PeerState,
    PoolDemand,
    encode,
)

REPO = Path(__file__).resolve().parents[1]
ECHO_USER = "bench-echo"
_NODELAY = ((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),)
"""The yardstick's sockets are set up like the broker's and the sites' (broker.transport)."""
REVOKE_SLACK_S = 0.05
"""A revocation this long after the reclaim deadline still counts as "back within the notice"."""


# --- small helpers ------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank); NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s)) - 1))]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:7.2f} ms"


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``); NaN if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _site_names(n: int) -> list[str]:
    return [f"site-{i:04d}" for i in range(n)]


async def _read_ready(proc: asyncio.subprocess.Process, what: str, timeout_s: float) -> str:
    """Wait for the child's ``ready ...`` line on stdout; raises ``RuntimeError`` if it exits."""
    assert proc.stdout is not None
    async with asyncio.timeout(timeout_s):
        while True:
            line = await proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{what} exited ({await proc.wait()}) before it was ready")
            text = line.decode().strip()
            if text.startswith("ready"):
                return text


async def _stop_child(proc: asyncio.subprocess.Process | None, timeout_s: float = 15.0) -> None:
    """Close the child's stdin (it stops on EOF), then SIGTERM, then SIGKILL — by its pid."""
    if proc is None or proc.returncode is not None:
        return
    if proc.stdin is not None:
        with contextlib.suppress(ConnectionError):
            proc.stdin.close()
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
        return
    except TimeoutError:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), 5)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()


async def _broker_stalls(proc: asyncio.subprocess.Process, timeout_s: float = 15.0) -> dict[str, Any]:
    """Stop the broker child (close its stdin) and read its ``stalls {...}`` line; ``{}`` if it
    printed none in time."""
    if proc.returncode is not None or proc.stdin is None or proc.stdout is None:
        return {}
    with contextlib.suppress(ConnectionError):
        proc.stdin.close()
    try:
        async with asyncio.timeout(timeout_s):
            while line := await proc.stdout.readline():
                text = line.decode().strip()
                if text.startswith("stalls "):
                    found: dict[str, Any] = json.loads(text[len("stalls ") :])
                    return found
    except TimeoutError:
        pass
    return {}


async def _child(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).resolve()),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )


async def _until_stdin_eof() -> None:
    """Return when this process's stdin is closed (the parent's stop signal)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.readline():
        pass


# --- child: the broker on the in-process bus, fed through stdin ---------------------------------------
async def _broker_child(creds_path: Path, notice_s: float, lease_ttl_s: float, gc_tune: bool) -> None:
    """BrokerService + MemoryBus; stdin lines ``{"capacity": [...]}`` / ``{"demand": {...}}``.
    ``gc_tune``: :func:`broker.service.tune_gc` after the start, as ``gpupool broker run`` does.
    Prints ``ready``, and at the end one ``stalls {...}`` JSON line (:class:`_StallWatch`)."""
    from contracts.bus import MemoryBus

    creds = json.loads(creds_path.read_text())
    bus = MemoryBus()
    topics = KafkaTopics()
    config = BrokerConfig(
        offer_ttl_s=600,
        notice_s=notice_s,
        lease_ttl_s=lease_ttl_s,
        capacity_max_age_s=3600,
    )
    svc = broker_service(creds, bus=bus, topics=topics, config=config, client_id=f"bench-broker-{os.getpid()}")
    await svc.start()
    stop = asyncio.Event()
    runner = asyncio.create_task(svc.run(stop))
    producer = bus.producer()
    watch = _StallWatch()
    try:
        await svc.wait_connected(30)
        if gc_tune:
            tune_gc()
        watch.start()
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=64 * 1024 * 1024)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            cmd = json.loads(line)
            for cap in cmd.get("capacity", []):
                await producer.send(
                    topics.capacity, json.dumps(cap).encode(), key=f"{cap['host']}/{cap['gpu_uuid']}"
                )
            if "demand" in cmd:
                d = cmd["demand"]
                await producer.send(topics.pool_demand, json.dumps(d).encode(), key=d["demand_id"])
    finally:
        watch.stop()
        print(f"stalls {json.dumps(watch.summary())}", flush=True)
        stop.set()
        await runner
        await svc.stop()


class _StallWatch:
    """Where the broker process loses time: garbage-collector pauses (``gc.callbacks``) and event
    loop stalls (a 5 ms heartbeat that wakes up late), both in milliseconds."""

    def __init__(self) -> None:
        self.gc_ms: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.lag_ms: list[float] = []
        self._gc_t0 = 0.0
        self._task: asyncio.Task[None] | None = None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_ms[info["generation"]].append((time.perf_counter() - self._gc_t0) * 1000)

    async def _beat(self) -> None:
        period = 0.005
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(period)
            self.lag_ms.append((time.perf_counter() - t0 - period) * 1000)

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.create_task(self._beat())

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()

    def summary(self) -> dict[str, Any]:
        """Per GC generation: count, total and max pause; loop lag p99, max and time lost to
        stalls over 10 ms."""
        out: dict[str, Any] = {
            f"gc{g}": {"n": len(v), "total_ms": round(sum(v), 1), "max_ms": round(max(v, default=0), 2)}
            for g, v in self.gc_ms.items()
        }
        out["loop_lag"] = {
            "p99_ms": round(_pct(self.lag_ms, 0.99), 2),
            "max_ms": round(max(self.lag_ms, default=0), 2),
            "over_10ms": sum(1 for v in self.lag_ms if v > 10),
        }
        return out


# --- child: the yardstick responder ------------------------------------------------------------------
async def _echo_child(creds_path: Path) -> None:
    """Answer each request on ``{root}/sites/+/echo/req`` on its response topic (MQTT 5, QoS 1)."""
    creds = json.loads(creds_path.read_text())
    root = creds["root"]
    async with mqtt_client(
        creds,
        BROKER_USER,
        identifier=f"bench-responder-{os.getpid()}",
        max_queued_incoming_messages=0,
        socket_options=_NODELAY,
    ) as client:
        await client.subscribe(f"{root}/sites/+/echo/req", qos=1)
        print("ready", flush=True)
        eof = asyncio.create_task(_until_stdin_eof())
        messages = aiter(client.messages)
        while True:
            nxt = asyncio.ensure_future(anext(messages))
            done, _ = await asyncio.wait({nxt, eof}, return_when=asyncio.FIRST_COMPLETED)
            if eof in done:
                nxt.cancel()
                return
            msg = nxt.result()
            req = msg.properties
            topic = getattr(req, "ResponseTopic", None)
            if not topic:
                continue
            props = Properties(PacketTypes.PUBLISH)
            props.CorrelationData = req.CorrelationData  # type: ignore[union-attr]
            await client.publish(topic, msg.payload, qos=1, properties=props)


# --- child: the idle sites -----------------------------------------------------------------------------
async def _sites_child(creds_path: Path, first: int, count: int) -> None:
    """Hold ``count`` idle site connections (see the module docstring) until stdin closes."""
    creds = json.loads(creds_path.read_text())
    mt = MqttTopics(creds["root"])
    names = _site_names(first + count)[first:]
    gate = asyncio.Semaphore(64)
    connected = 0

    async def hold(site: str, ready: asyncio.Event, done: asyncio.Event) -> None:
        nonlocal connected
        seq = birth_seq()
        async with gate:
            client = make_client(
                creds["host"],
                creds["port"],
                username=site,
                password=creds["users"][site],
                identifier=f"gpupool-site-{site}",
                protocol=5,
                state_topic=mt.site_state(site),
                peer=site,
                seq=seq,
                persistent=True,
                timeout_s=60,
            )
            await client.__aenter__()
        try:
            await client.publish(
                mt.site_state(site),
                encode(PeerState(peer=site, online=True, seq=seq, ts=time.time())),
                qos=1,
                retain=True,
            )
            await client.subscribe(
                subscriptions(5, [mt.leases_filter(site), mt.replies(site), mt.broker_state])
            )
            connected += 1
            if connected == count:
                ready.set()
            drain = asyncio.create_task(_drain(client))
            await done.wait()
            drain.cancel()
        finally:
            with contextlib.suppress(aiomqtt.MqttError):
                await client.__aexit__(None, None, None)

    ready, done = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(hold(s, ready, done)) for s in names]
    waiter = asyncio.create_task(ready.wait())
    await asyncio.wait({waiter, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    failed = [t for t in tasks if t.done() and t.exception() is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} idle sites failed to connect") from failed[0].exception()
    print(f"ready {connected}", flush=True)
    await _until_stdin_eof()
    done.set()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _drain(client: aiomqtt.Client) -> None:
    async for _ in client.messages:
        pass


# --- the driver ------------------------------------------------------------------------------------------
class _Feed:
    """Where capacity and demands go: the broker child's stdin, or Kafka."""

    def __init__(
        self, proc: asyncio.subprocess.Process | None, kafka: Any = None, topics: KafkaTopics | None = None
    ):
        self._proc = proc
        self._producer = kafka
        self._topics = topics

    async def capacity(self, updates: list[CapacityUpdate]) -> None:
        if self._producer is not None:
            assert self._topics is not None
            for u in updates:
                await self._producer.send(self._topics.capacity, encode(u), key=u.key)
            await self._producer.flush()
            return
        assert self._proc is not None and self._proc.stdin is not None
        line = json.dumps({"capacity": [u.model_dump(mode="json") for u in updates]}) + "\n"
        self._proc.stdin.write(line.encode())
        await self._proc.stdin.drain()

    async def demand(self, demand: PoolDemand) -> None:
        if self._producer is not None:
            assert self._topics is not None
            await self._producer.send(self._topics.pool_demand, encode(demand), key=demand.demand_id)
            await self._producer.flush()
            return
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write((json.dumps({"demand": demand.model_dump(mode="json")}) + "\n").encode())
        await self._proc.stdin.drain()


@dataclass
class _Results:
    claim_s: list[float] = field(default_factory=list)
    echo_s: list[float] = field(default_factory=list)
    claim_rejected: dict[str, int] = field(default_factory=dict)
    claim_timeouts: int = 0
    echo_timeouts: int = 0
    notice_s: list[float] = field(default_factory=list)
    back_late_s: list[float] = field(default_factory=list)
    """Per reclaimed lease: end ts - reclaim deadline (negative: early)."""
    ended: dict[str, int] = field(default_factory=dict)
    not_ended: int = 0
    cpu_share: dict[str, float] = field(default_factory=dict)
    broker_stalls: dict[str, Any] = field(default_factory=dict)
    """GC pauses and event-loop stalls of the in-process-bus broker child (``_StallWatch``)."""
    """Per process: CPU seconds per wall second during the measured window."""


class _Echo:
    """The yardstick's requester: one site-like MQTT 5 client."""

    def __init__(self, creds: dict[str, Any]) -> None:
        root = creds["root"]
        self.req_topic = f"{root}/sites/{ECHO_USER}/echo/req"
        self.rep_topic = f"{root}/sites/{ECHO_USER}/echo/rep"
        self.client = mqtt_client(
            creds,
            ECHO_USER,
            identifier=f"bench-requester-{os.getpid()}",
            max_queued_incoming_messages=0,
            socket_options=_NODELAY,
        )
        self._waiting: dict[bytes, asyncio.Future[None]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        await self.client.__aenter__()
        await self.client.subscribe(self.rep_topic, qos=1)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.client.__aexit__(None, None, None)

    async def _read(self) -> None:
        async for msg in self.client.messages:
            corr = getattr(msg.properties, "CorrelationData", None)
            fut = self._waiting.pop(bytes(corr), None) if corr else None
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def round_trip(self, timeout_s: float = 5.0) -> float:
        """One request → reply; returns the seconds it took. Raises ``TimeoutError``."""
        corr = uuid.uuid4().hex.encode()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[corr] = fut
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.rep_topic
        props.CorrelationData = corr
        t0 = time.perf_counter()
        try:
            await self.client.publish(self.req_topic, b'{"ping": 1}', qos=1, properties=props)
            await asyncio.wait_for(fut, timeout_s)
        finally:
            self._waiting.pop(corr, None)
        return time.perf_counter() - t0


async def _open_loop(rate: float, duration_s: float, action: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Start ``action`` ``rate`` times a second for ``duration_s`` seconds, on schedule whatever
    each one takes (open loop); wait for the last ones."""
    tasks: set[asyncio.Task[None]] = set()
    start = time.perf_counter()
    n = 0
    while (at := n / rate) < duration_s:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        t = asyncio.create_task(action())
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        n += 1
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


class _Driver:
    """The active sites: claims, releases, reclaim handling (see the module docstring)."""

    def __init__(
        self, sites: list[EdgeClient], res: _Results, rng: random.Random, release_share: float
    ) -> None:
        self.sites = sites
        self.res = res
        self.rng = rng
        self.release_share = release_share
        self.measuring = False
        self.releasing = True
        self.live: dict[str, tuple[EdgeClient, LeaseMessage]] = {}
        self._timers: set[asyncio.Task[None]] = set()
        self._next = 0
        self.demand_sent: dict[str, float] = {}
        """lease_id → perf_counter when its demand was written."""
        self.notice_seen: dict[str, float] = {}
        self.final: dict[str, LeaseMessage] = {}
        self.watchers = [asyncio.create_task(self._watch(s)) for s in sites]

    async def claim(self) -> None:
        site = self.sites[self._next % len(self.sites)]
        self._next += 1
        offers = list(site.known_offers.values())
        if not offers:
            self.res.claim_rejected["no_offer_seen"] = self.res.claim_rejected.get("no_offer_seen", 0) + 1
            return
        offer = self.rng.choice(offers)
        t0 = time.perf_counter()
        try:
            lease = await site.claim(offer.offer_id, count=1, duration_seconds=3600, timeout_s=5)
        except BrokerRejected as e:
            if self.measuring:
                self.res.claim_rejected[e.code.value] = self.res.claim_rejected.get(e.code.value, 0) + 1
            return
        except TimeoutError:
            if self.measuring:
                self.res.claim_timeouts += 1
            return
        if self.measuring:
            self.res.claim_s.append(time.perf_counter() - t0)
        self.live[lease.lease_id] = (site, lease)
        if self.releasing:
            t = asyncio.create_task(self._release_later(site, lease.lease_id, self.rng.uniform(1.0, 4.0)))
            self._timers.add(t)
            t.add_done_callback(self._timers.discard)

    async def _release_later(self, site: EdgeClient, lease_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self.releasing:
            return
        with contextlib.suppress(BrokerRejected, TimeoutError):
            await site.release(lease_id, timeout_s=10)
        self.live.pop(lease_id, None)

    def stop_releasing(self) -> None:
        self.releasing = False
        for t in list(self._timers):
            t.cancel()

    async def _watch(self, site: EdgeClient) -> None:
        async with contextlib.aclosing(site.watch()) as events:
            async for ev in events:
                if not isinstance(ev, LeaseMessage) or ev.lease_id not in self.demand_sent:
                    continue
                if ev.state is LeaseState.RECLAIMING and ev.lease_id not in self.notice_seen:
                    self.notice_seen[ev.lease_id] = time.perf_counter()
                    if self.rng.random() < self.release_share:
                        delay = self.rng.uniform(0.0, ev.notice_seconds / 2)
                        t = asyncio.create_task(self._release_now(site, ev.lease_id, delay))
                        self._timers.add(t)
                        t.add_done_callback(self._timers.discard)
                elif not ev.state.live and ev.lease_id not in self.final:
                    self.final[ev.lease_id] = ev

    async def _release_now(self, site: EdgeClient, lease_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        with contextlib.suppress(BrokerRejected, TimeoutError):
            await site.release(lease_id, timeout_s=10)

    async def close(self) -> None:
        for t in [*self.watchers, *self._timers]:
            t.cancel()
        await asyncio.gather(*self.watchers, *self._timers, return_exceptions=True)


def _capacity(nodes: int, gpus_per_node: int, run_id: str) -> list[CapacityUpdate]:
    now = time.time()
    return [
        CapacityUpdate(
            ts=now,
            host=f"node-{run_id}-{n:04d}",
            gpu_uuid=f"GPU-{n:04d}-{g}",
            state=GpuState.IDLE,
            since=now - 600,
            predicted_idle_until=now + 7200,
            model_name="NVIDIA H100 80GB HBM3",
            fb_total_mib=81559,
            leaf=f"leaf-{n % 8}",
        )
        for n in range(nodes)
        for g in range(gpus_per_node)
    ]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; returns the numbers (also printed)."""
    # aiomqtt warns per publish while > 10 claims await their PUBACK: expected at this rate
    logging.getLogger("mqtt").setLevel(logging.ERROR)
    rng = random.Random(args.seed)
    run_id = uuid.uuid4().hex[:6]
    names = _site_names(args.sites)
    active_names, idle_names = names[: args.active], names[args.active :]
    res = _Results()
    procs: list[asyncio.subprocess.Process] = []
    kafka_bus = kafka_producer = None
    broker_proc: asyncio.subprocess.Process | None = None
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-broker-") as tmp:
        state = Path(tmp)
        t_setup = time.perf_counter()
        creds = await start_mosquitto(state, [*names, ECHO_USER])
        creds_path = state / "mosquitto" / "credentials.json"
        print(f"mosquitto 127.0.0.1:{creds['port']} with {len(names) + 2} users ({state})")
        try:
            if args.kafka:
                from runtime.kafka import KafkaBus

                topics = KafkaTopics(prefix=f"bench{run_id}.")
                kafka_bus = KafkaBus(args.kafka, client_id="bench-broker")
                await kafka_bus.create_topics(topics.all(), compacted=[topics.leases_log])
                kafka_producer = kafka_bus.producer(client_id="bench-broker")
                await kafka_producer.start()
                broker_proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-c",
                    "from gpupool.cli import app; app(prog_name='gpupool')",
                    "broker", "run", "--kafka", args.kafka, "--mqtt", f"{creds['host']}:{creds['port']}",
                    "--topic-prefix", topics.prefix, "--group-id", f"bench-{run_id}",
                    "--client-id", f"bench-broker-{run_id}", "--metrics-port", "0",
                    "--notice", str(args.notice), "--lease-ttl", "600", "--offer-ttl", "600",
                    "--tune-gc" if args.gc_tune else "--no-tune-gc",
                    *(["--lease-log-linger-ms", str(args.lease_log_linger_ms)]
                      if args.lease_log_linger_ms is not None else []),
                    env={**os.environ, "GPUPOOL_MQTT_PASSWORD": creds["users"][BROKER_USER]},
                    stdin=asyncio.subprocess.DEVNULL,
                    cwd=REPO,
                )  # fmt: skip
                feed = _Feed(None, kafka_producer, topics)
            else:
                broker_proc = await _child(
                    "_broker", "--creds", str(creds_path), "--notice", str(args.notice), "--lease-ttl", "600",
                    *([] if args.gc_tune else ["--no-gc-tune"]),
                    *(["--profile", str(args.profile_broker)] if args.profile_broker else []),
                )  # fmt: skip
                await _read_ready(broker_proc, "broker", 60)
                feed = _Feed(broker_proc)
            procs.append(broker_proc)
            echo_proc = await _child("_echo", "--creds", str(creds_path))
            procs.append(echo_proc)
            await _read_ready(echo_proc, "responder", 30)
            if idle_names:
                sites_proc = await _child(
                    "_sites",
                    "--creds",
                    str(creds_path),
                    "--first",
                    str(args.active),
                    "--count",
                    str(len(idle_names)),
                )
                procs.append(sites_proc)
                ready = await _read_ready(sites_proc, "idle sites", 120)
                print(f"idle sites connected: {ready.split()[1]}")
            async with contextlib.AsyncExitStack() as stack:
                sites = []
                for name in active_names:
                    site = edge_client(creds, name, connect_timeout_s=30)
                    sites.append(await stack.enter_async_context(site))
                echo = await stack.enter_async_context(_Echo(creds))
                await feed.capacity(_capacity(args.nodes, args.gpus_per_node, run_id))
                deadline = time.monotonic() + 60
                while min(len(s.known_offers) for s in sites) < args.nodes:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the offers did not all arrive within 60 s")
                    await asyncio.sleep(0.1)
                if broker_proc.returncode is not None:
                    raise RuntimeError("the broker exited")
                print(
                    f"set-up {time.perf_counter() - t_setup:.1f} s: {args.sites} sites connected "
                    f"({args.active} active), {args.nodes} nodes × {args.gpus_per_node} GPUs offered"
                )
                driver = _Driver(sites, res, rng, args.release_share)
                stack.push_async_callback(driver.close)

                async def echo_once() -> None:
                    try:
                        dt = await echo.round_trip()
                    except TimeoutError:
                        if driver.measuring:
                            res.echo_timeouts += 1
                        return
                    if driver.measuring:
                        res.echo_s.append(dt)

                # 1. claim → lease against the bare round trip, same window -----------------------
                await asyncio.gather(
                    _open_loop(args.rate, args.warmup, driver.claim),
                    _open_loop(args.echo_rate, args.warmup, echo_once),
                )
                pids = {
                    "bench (active sites)": os.getpid(),
                    "mosquitto": int((state / "mosquitto" / "mosquitto.pid").read_text()),
                }
                pids |= {
                    name: p.pid for name, p in zip(("broker", "responder", "idle sites"), procs, strict=False)
                }
                cpu0, t0 = {k: _cpu_s(v) for k, v in pids.items()}, time.perf_counter()
                driver.measuring = True
                await asyncio.gather(
                    _open_loop(args.rate, args.duration, driver.claim),
                    _open_loop(args.echo_rate, args.duration, echo_once),
                )
                driver.measuring = False
                wall = time.perf_counter() - t0
                res.cpu_share = {k: (_cpu_s(v) - cpu0[k]) / wall for k, v in pids.items()}
                driver.stop_releasing()
                await asyncio.sleep(0.5)

                # 2. reclaims ------------------------------------------------------------------------
                live = [
                    (s, m) for s, m in driver.live.values() if s.known_leases.get(m.lease_id, m).state.live
                ]
                rng.shuffle(live)
                targets = live[: args.reclaims]
                per = args.leases_per_demand
                batches = iter([targets[i : i + per] for i in range(0, len(targets), per)])

                async def reclaim_one() -> None:
                    batch = next(batches)
                    demand = PoolDemand(
                        demand_id=f"bench-{uuid.uuid4().hex[:12]}",
                        ts=time.time(),
                        gpus=[g for _, lease in batch for g in lease.gpus],
                        reason="bench",
                    )
                    sent = time.perf_counter()
                    for _, lease in batch:
                        driver.demand_sent[lease.lease_id] = sent
                    await feed.demand(demand)

                demands = -(-len(targets) // per)
                await _open_loop(args.reclaim_rate, demands / args.reclaim_rate, reclaim_one)
                wait_until = time.monotonic() + args.notice + 5
                while len(driver.final) < len(targets) and time.monotonic() < wait_until:
                    await asyncio.sleep(0.1)
                for _, lease in targets:
                    seen = driver.notice_seen.get(lease.lease_id)
                    if seen is not None:
                        res.notice_s.append(seen - driver.demand_sent[lease.lease_id])
                    final = driver.final.get(lease.lease_id)
                    if final is None:
                        res.not_ended += 1
                        continue
                    res.ended[final.state.value] = res.ended.get(final.state.value, 0) + 1
                    if final.reclaim_deadline is not None:  # kept by the terminal state
                        res.back_late_s.append(final.ts - final.reclaim_deadline)
                reclaims = len(targets)
        finally:
            if broker_proc is not None and not args.kafka:
                res.broker_stalls = await _broker_stalls(broker_proc)
            for p in reversed(procs):
                await _stop_child(p)
            if kafka_producer is not None:
                await kafka_producer.stop()
            if kafka_bus is not None:
                await kafka_bus.close()
            await stop_mosquitto(state)
    return _report(args, res, reclaims)


def _report(args: argparse.Namespace, res: _Results, reclaims: int) -> dict[str, Any]:
    c50, c99 = _pct(res.claim_s, 0.50), _pct(res.claim_s, 0.99)
    e50, e99 = _pct(res.echo_s, 0.50), _pct(res.echo_s, 0.99)
    n99 = _pct(res.notice_s, 0.99)
    on_time = sum(1 for d in res.back_late_s if d <= REVOKE_SLACK_S)
    back_pct = 100.0 * on_time / reclaims if reclaims else float("nan")
    ratio = c99 / e99 if e99 else float("nan")
    bus = f"Kafka {args.kafka}" if args.kafka else "in-process bus"
    print()
    print(
        f"broker benchmark: {args.sites} connected sites, {args.rate:g} claims/s "
        f"for {args.duration:g} s, {bus}"
    )
    claimed = len(res.claim_s)
    print(
        f"  claim → lease      p50 {_ms(c50)}  p99 {_ms(c99)}  ({claimed} leases; rejected "
        f"{sum(res.claim_rejected.values())} {res.claim_rejected}; timeouts {res.claim_timeouts})"
    )
    print(
        f"  bare MQTT req/rep  p50 {_ms(e50)}  p99 {_ms(e99)}  "
        f"({len(res.echo_s)} round trips; timeouts {res.echo_timeouts})"
    )
    ok1 = ratio <= 3.0 and c99 <= 0.050
    print(f"  ratio p99 {ratio:5.2f}×   target <= 3× and <= 50 ms: {'met' if ok1 else 'NOT met'}")
    if res.claim_s:
        print(f"  claim → lease mean {_ms(statistics.fmean(res.claim_s))}, max {_ms(max(res.claim_s))}")
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in res.cpu_share.items())
    print(
        f"  CPU (cores busy) while measuring: {cpu}; "
        f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    if res.broker_stalls:
        st = res.broker_stalls
        gcs = ", ".join(f"{g} {v['n']}× max {v['max_ms']} ms" for g, v in st.items() if g.startswith("gc"))
        lag = st["loop_lag"]
        print(
            f"  broker process (whole run, gc tuned: {args.gc_tune}): GC {gcs}; event-loop lag p99 "
            f"{lag['p99_ms']} ms, max {lag['max_ms']} ms, {lag['over_10ms']} stalls > 10 ms"
        )
    print(
        f"  reclaim: demand → notice at the site  p50 {_ms(_pct(res.notice_s, 0.5))}  p99 {_ms(n99)}  "
        f"({len(res.notice_s)}/{reclaims} notices)  target <= 100 ms: {'met' if n99 <= 0.1 else 'NOT met'}"
    )
    worst = max(res.back_late_s) if res.back_late_s else float("nan")
    print(
        f"  GPUs back within the notice ({args.notice:g} s): {on_time}/{reclaims} = {back_pct:.1f} %  "
        f"(ended {res.ended}, not ended {res.not_ended}; latest end vs deadline {worst * 1000:+.1f} ms)  "
        f"target 100 %: {'met' if on_time == reclaims else 'NOT met'}"
    )
    return {
        "claim_p50_ms": c50 * 1000,
        "claim_p99_ms": c99 * 1000,
        "bare_p50_ms": e50 * 1000,
        "bare_p99_ms": e99 * 1000,
        "ratio_p99": ratio,
        "claims": claimed,
        "claim_rejected": res.claim_rejected,
        "notice_p50_ms": _pct(res.notice_s, 0.5) * 1000,
        "notice_p99_ms": n99 * 1000,
        "reclaims": reclaims,
        "back_within_notice_pct": back_pct,
        "latest_end_vs_deadline_ms": worst * 1000,
        "ended": res.ended,
        "broker_stalls": res.broker_stalls,
    }


async def service_cost(seconds: float, gc_tune: bool, nodes: int, gpus_per_node: int, seed: int) -> dict[str, Any]:
    """The broker's own cost, without MQTT or a network: a :class:`BrokerService` on the
    in-process bus with its MQTT client never connected (publishes are encoded, not sent) and a
    simulated clock; 100 claims per simulated second (one GPU of a random offer, from 4 sites),
    each lease released 1-4 s later, the book ticked every ``tick_s`` (simulated; the GC upkeep
    of :func:`broker.service.tune_gc` runs on its real-time schedule). Returns per-operation wall
    times in milliseconds (p50 / p99 / max), the leases remembered at the end, and the collector's
    pauses per generation (count, total and max, ms)."""
    from contracts import Claim, Release
    from contracts.bus import MemoryBus

    now = [time.time()]
    bus = MemoryBus()
    config = BrokerConfig(offer_ttl_s=600, lease_ttl_s=600, notice_s=2, capacity_max_age_s=1e9)
    svc = BrokerService(bus=bus, topics=KafkaTopics(), mqtt_host="127.0.0.1", mqtt_port=1, config=config,
                        clock=lambda: now[0])  # fmt: skip
    svc._producer = bus.producer()  # the lease log, as start() would make it (no MQTT)
    async with svc._lock:
        for u in _capacity(nodes, gpus_per_node, "cost"):
            await svc._apply(svc.book.apply_capacity(u, now[0]), now[0])
    if gc_tune:
        tune_gc()
    watch = _StallWatch()
    gc.callbacks.append(watch._on_gc)
    rng = random.Random(seed)
    took: dict[str, list[float]] = {"claim": [], "release": [], "tick": []}
    releases: list[tuple[float, str, str]] = []
    next_tick = now[0] + config.tick_s
    for i in range(int(seconds * 100)):
        now[0] += 0.01
        if now[0] >= next_tick:
            t0 = time.perf_counter()
            await svc._tick_once()
            took["tick"].append(time.perf_counter() - t0)
            next_tick += config.tick_s
        while releases and releases[0][0] <= now[0]:
            _, site, lease_id = releases.pop(0)
            t0 = time.perf_counter()
            await svc._on_lease_request(
                site, encode(Release(lease_id=lease_id, site=site, ts=now[0])), (None, b"r"), Release
            )
            took["release"].append(time.perf_counter() - t0)
        site, claim_id = f"site-{i % 4:04d}", f"cost-{i}"
        offer = rng.choice(list(svc.book.offers.values()))
        claim = Claim(claim_id=claim_id, site=site, offer_id=offer.offer_id, count=1, duration_seconds=3600,
                      ts=now[0])  # fmt: skip
        t0 = time.perf_counter()
        await svc._on_claim(site, encode(claim), (None, claim_id.encode()), ())
        took["claim"].append(time.perf_counter() - t0)
        answer = svc.book.begin_claim(site, claim, now[0])[0]  # a repeat: the first answer again
        lease_id = getattr(answer, "lease_id", None)
        if lease_id:
            releases.append((now[0] + rng.uniform(1.0, 4.0), site, lease_id))
            releases.sort()
    out: dict[str, Any] = {
        f"{k}_{q}_ms": round(_pct(v, p) * 1000, 3) for k, v in took.items() for q, p in (("p50", 0.5), ("p99", 0.99))
    }
    out |= {f"{k}_max_ms": round(max(v, default=float("nan")) * 1000, 2) for k, v in took.items()}
    out["leases_remembered"] = len(svc.book.leases)
    gc.callbacks.remove(watch._on_gc)
    out |= {k: v for k, v in watch.summary().items() if k.startswith("gc")}
    return out


def main() -> None:
    """Parse the arguments and run the benchmark (or one of its child processes)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    b = sub.add_parser("_broker")
    b.add_argument("--creds", type=Path, required=True)
    b.add_argument("--notice", type=float, required=True)
    b.add_argument("--lease-ttl", type=float, required=True)
    b.add_argument("--no-gc-tune", action="store_true")
    b.add_argument("--profile", type=Path, default=None)
    e = sub.add_parser("_echo")
    e.add_argument("--creds", type=Path, required=True)
    s = sub.add_parser("_sites")
    s.add_argument("--creds", type=Path, required=True)
    s.add_argument("--first", type=int, required=True)
    s.add_argument("--count", type=int, required=True)
    ap.add_argument("--sites", type=int, default=1000, help="connected sites (default 1,000)")
    ap.add_argument("--active", type=int, default=4, help="sites that claim (the rest are idle)")
    ap.add_argument("--rate", type=float, default=100.0, help="claims per second")
    ap.add_argument("--echo-rate", type=float, default=50.0, help="bare request/reply round trips per second")
    ap.add_argument("--duration", type=float, default=20.0, help="measured window, seconds")
    ap.add_argument("--warmup", type=float, default=3.0, help="warm-up before it, seconds")
    ap.add_argument("--nodes", type=int, default=200, help="GPU nodes offered")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--reclaims", type=int, default=200, help="leases reclaimed in phase 2")
    ap.add_argument("--reclaim-rate", type=float, default=5.0, help="demands per second")
    ap.add_argument("--leases-per-demand", type=int, default=8, help="leases each demand takes back")
    ap.add_argument("--notice", type=float, default=2.0, help="reclaim notice of every lease, seconds")
    ap.add_argument("--release-share", type=float, default=0.9, help="share of notices answered by a release")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kafka", default="", help="run `gpupool broker run` on this Kafka (host:port)")
    ap.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
    ap.add_argument(
        "--gc-tune",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the broker calls broker.service.tune_gc() after its start (default; as `gpupool broker run`)",
    )
    ap.add_argument(
        "--service-only",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="instead: the broker's own cost per claim, release and tick over SECONDS of simulated "
        "time at 100 claims/s, without MQTT (see service_cost); honours --gc-tune, --nodes",
    )
    ap.add_argument(
        "--profile-broker",
        type=Path,
        default=None,
        help="run the in-process-bus broker under cProfile and write its stats to this file "
        "(latencies are then inflated; for finding where the broker spends its time)",
    )
    ap.add_argument(
        "--lease-log-linger-ms",
        type=float,
        default=None,
        help="with --kafka: the broker's lease-log producer linger, ms (default: the broker's)",
    )
    args = ap.parse_args()
    if args.cmd == "_broker":
        if args.profile is not None:
            import cProfile

            with cProfile.Profile() as prof:
                asyncio.run(_broker_child(args.creds, args.notice, args.lease_ttl, not args.no_gc_tune))
            prof.dump_stats(args.profile)
        else:
            asyncio.run(_broker_child(args.creds, args.notice, args.lease_ttl, not args.no_gc_tune))
    elif args.cmd == "_echo":
        asyncio.run(_echo_child(args.creds))
    elif args.cmd == "_sites":
        asyncio.run(_sites_child(args.creds, args.first, args.count))
    elif args.service_only > 0:
        cost = asyncio.run(
            service_cost(args.service_only, args.gc_tune, args.nodes, args.gpus_per_node, args.seed)
        )
        print(
            f"broker service cost ({args.service_only:g} s simulated, 100 claims/s, gc tuned: {args.gc_tune}): "
            + json.dumps(cost)
        )
    else:
        if args.active < 1 or args.active > args.sites or args.leases_per_demand < 1:
            ap.error("--active must be between 1 and --sites; --leases-per-demand at least 1")
        out = asyncio.run(run(args))
        if args.json:
            print(json.dumps(out))


if __name__ == "__main__":
    main()
