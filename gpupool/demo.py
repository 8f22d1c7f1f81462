"""``gpupool demo``: the simulator and every stage, wired through the bus and MQTT.

Embedded defaults: the in-process bus, a DuckDB file in the state directory, an embedded MQTT
broker (amqtt, MQTT 3.1.1). ``kafka`` and ``mqtt`` point the same demo at real services.

The trace drives everything: each simulated GPU replays one pod of the Alibaba GenAI 2026 trace,
time-compressed (``speedup`` trace seconds per wall second). The demo checks its own promise:
every offer is compared with the trace at the moment it was published (:class:`OfferAudit`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiomqtt

from contracts import KafkaTopics, MqttTopics, Offer, decode
from contracts.bus import make_bus

if TYPE_CHECKING:
    from simulator.dcgm_http import FleetServer
    from simulator.sysfs import SysfsTree

log = logging.getLogger(__name__)


@dataclass
class DemoConfig:
    """Everything the demo can be told; the defaults are the embedded ones.

    Times are wall-clock seconds. ``speedup`` is trace seconds per wall second (57 plays one trace
    sample, 57 s, per second).
    """

    duration_s: float = 60.0
    nodes: int = 4
    gpus_per_node: int = 8
    speedup: float = 57.0
    start_step: int = 120
    seed: int = 7
    scrape_interval_s: float = 0.5
    min_idle_s: float = 3.0
    notice_s: float = 4.0
    lease_ttl_s: float = 6.0
    offer_ttl_s: float = 20.0
    sites: tuple[str, ...] = ("edge-a", "edge-b", "edge-c")
    kafka: str | None = None
    mqtt: str | None = None
    """``host:port`` of a real MQTT broker (Mosquitto); ``None`` starts the embedded one."""
    mqtt_credentials: Path | None = None
    """credentials.json of deploy/local/mosquitto.sh (users and passwords per site and broker)."""
    mqtt_protocol: int = 5
    state_dir: Path = Path(".state/demo")
    metrics_port: int = 0
    trace_dir: Path | None = None
    topic_prefix: str | None = None
    """Kafka topic prefix; ``None``: a fresh ``demo-<run id>.`` on Kafka, none on the in-process bus."""
    fabric_state: Path | None = None
    """fabric.json of an OpenSM fabric (deploy/local/fabric.sh): each lease gets a partition verified
    on it (:class:`broker.fabric_opensm.OpenSmFabric`); ``None``: fabric isolation disabled."""
    on_started: Callable[[FleetServer, SysfsTree], object] | None = None
    """Called once, when every stage has started, with the simulated nodes' dcgm-exporter endpoints
    (``FleetServer.urls()``, ``fail_mode``) and InfiniBand sysfs trees (``SysfsTree.roots()``): lets a
    test point a real Prometheus or node_exporter at them, or inject faults. An exception it raises
    stops the demo (everything started is closed) and propagates."""


@dataclass
class OfferAudit:
    """Compares each published offer with the trace at publish time.

    ``violations`` counts offered GPUs the trace shows busy at the offer's time *and* already one
    scrape interval before it (the pipeline had the chance to see it); ``races`` counts those
    that turned busy inside the last scrape interval (no collector could have seen it yet).
    """

    offers: int = 0
    gpus_offered: int = 0
    violations: int = 0
    races: int = 0
    distinct_gpus: set[str] = field(default_factory=set)

    def check(self, offer: Offer, is_busy_at, allowance_s: float) -> None:  # noqa: ANN001
        """Audit one offer against ``is_busy_at(gpu_key, t) -> bool``."""
        self.offers += 1
        for g in offer.gpus:
            self.gpus_offered += 1
            self.distinct_gpus.add(g.gpu)
            if is_busy_at(g.gpu, offer.ts):
                if is_busy_at(g.gpu, offer.ts - allowance_s):
                    self.violations += 1
                    log.error("offer_for_busy_gpu", extra={"offer_id": offer.offer_id, "gpu": g.gpu})
                else:
                    self.races += 1
                    log.warning("offer_race", extra={"offer_id": offer.offer_id, "gpu": g.gpu, "offer_ts": offer.ts})


@dataclass
class DemoSummary:
    """What the demo did, printed at the end and returned to tests."""

    duration_s: float
    gpus: int
    trace_idle_share: float
    samples_ingested: int
    gpus_seen_idle: int
    offers: int
    gpus_offered: int
    offer_violations: int
    offer_races: int
    leases_granted: int
    reclaims_started: int
    reclaims_completed: int
    expired: int
    rejections: dict[str, int]
    partitions: list[str]

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly dict."""
        return asdict(self)


async def _audit_offers(
    host: str, port: int, creds: tuple[str | None, str | None], protocol: int, root: str,
    audit: OfferAudit, is_busy_at, allowance_s: float, stop: asyncio.Event,  # noqa: ANN001
    fleet_keys: frozenset[str], started_at: float,
) -> None:
    """Subscribe to every offer and audit each new one about ``fleet_keys`` published since
    ``started_at`` (offers retained from other runs are skipped)."""
    topics = MqttTopics(root)
    proto = aiomqtt.ProtocolVersion.V5 if protocol == 5 else aiomqtt.ProtocolVersion.V311
    seen: set[str] = set()
    async with aiomqtt.Client(host, port, username=creds[0], password=creds[1], protocol=proto,
                              identifier=f"gpupool-demo-audit-{uuid.uuid4().hex[:8]}") as client:
        await client.subscribe(topics.offers_filter, qos=1)
        async for msg in client.messages:
            if stop.is_set():
                return
            if not msg.payload:
                continue
            try:
                offer = decode(Offer, bytes(msg.payload))  # type: ignore[arg-type]
            except ValueError:
                continue
            if offer.offer_id in seen:
                continue
            seen.add(offer.offer_id)
            # a shared MQTT server may retain offers of other runs: audit only this run's GPUs
            if offer.ts < started_at or not all(g.gpu in fleet_keys for g in offer.gpus):
                continue
            audit.check(offer, is_busy_at, allowance_s)


async def run_demo(cfg: DemoConfig, progress=None) -> DemoSummary:  # noqa: ANN001, C901
    """Run the whole pipeline for ``cfg.duration_s`` seconds and return its summary.

    ``progress(snapshot: dict)`` is called about twice a second with live counts.
    Raises ``FileNotFoundError`` if the trace is missing, ``OSError`` if a service is unreachable.
    """
    from analytics.classify import IdleConfig
    from analytics.service import AnalyticsService
    from broker.fabric_opensm import OpenSmFabric
    from broker.service import BrokerConfig, BrokerService
    from collectors.service import CollectorService
    from gpupool.embedded_mqtt import EmbeddedMqttBroker
    from simulator.dcgm_http import FleetServer
    from simulator.demand import TrainingDemand
    from simulator.fleet import Fleet
    from simulator.sites import SimulatedSite
    from simulator.sysfs import SysfsTree
    from simulator.trace import default_trace_dir, load_trace

    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    if cfg.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(cfg.metrics_port, addr="127.0.0.1")  # every stage's metrics, one process
    run_id = uuid.uuid4().hex[:8]
    trace = load_trace(cfg.trace_dir or default_trace_dir())
    fleet = Fleet(trace, nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node, speedup=cfg.speedup,
                  start_step=cfg.start_step, seed=cfg.seed)
    server = FleetServer(fleet)
    await server.start()
    sysfs = SysfsTree(fleet, cfg.state_dir / f"sysfs-{run_id}")
    sysfs.update(time.time())

    bus = make_bus(cfg.kafka, client_id="gpupool-demo")
    prefix = cfg.topic_prefix if cfg.topic_prefix is not None else (f"demo-{run_id}." if cfg.kafka else "")
    topics = KafkaTopics(prefix=prefix)
    await bus.create_topics(topics.all(), partitions=4 if cfg.kafka else 1,
                            compacted=[topics.leases_log, topics.fabric_topology])

    embedded: EmbeddedMqttBroker | None = None
    if cfg.mqtt:
        mhost, _, mport = cfg.mqtt.rpartition(":")
        port = int(mport)
        protocol = cfg.mqtt_protocol
    else:
        embedded = EmbeddedMqttBroker()
        await embedded.start()
        mhost, port, protocol = embedded.host, embedded.port, 4
    users: dict[str, str] = {}
    root = "gpupool/v1"
    if cfg.mqtt_credentials:
        data = json.loads(cfg.mqtt_credentials.read_text())
        users, root = data["users"], data.get("root", root)
    root = f"{root}/demo-{run_id}" if cfg.mqtt and not cfg.mqtt_credentials else root

    def creds(user: str) -> tuple[str | None, str | None]:
        return (user, users[user]) if user in users else (None, None)

    collector = CollectorService(bus=bus, topics=topics, dcgm_targets=list(server.urls().values()),
                                 sysfs_roots=sysfs.roots(), interval_s=cfg.scrape_interval_s,
                                 timeout_s=max(0.2, cfg.scrape_interval_s * 2))
    analytics = AnalyticsService(bus=bus, topics=topics, db_path=str(cfg.state_dir / f"analytics-{run_id}.duckdb"),
                                 idle=IdleConfig(min_idle_s=cfg.min_idle_s, stale_after_s=max(3.0, 6 * cfg.scrape_interval_s),
                                                 # the trace is exact: idle means 0 % duty cycle
                                                 idle_threshold=0.0, busy_threshold=0.0),
                                 refresh_s=5.0)
    bu, bp = creds("gpupool-broker")
    broker = BrokerService(bus=bus, topics=topics, mqtt_host=mhost, mqtt_port=port, mqtt_username=bu,
                           mqtt_password=bp, root=root, protocol=protocol,
                           fabric=OpenSmFabric(cfg.fabric_state) if cfg.fabric_state else None,
                           config=BrokerConfig(offer_ttl_s=cfg.offer_ttl_s, notice_s=cfg.notice_s,
                                               lease_ttl_s=cfg.lease_ttl_s))
    sites = [SimulatedSite(name=s, host=mhost, port=port, username=creds(s)[0], password=creds(s)[1],
                           root=root, protocol=protocol, seed=cfg.seed + i,
                           renew_every_s=cfg.lease_ttl_s / 3)
             for i, s in enumerate(cfg.sites)]
    demand = TrainingDemand(fleet, bus, topics)

    stop = asyncio.Event()
    audit = OfferAudit()
    audit_creds = creds(cfg.sites[0]) if users else (None, None)
    tasks: list[asyncio.Task[object]] = []
    await collector.start()
    await analytics.start()
    await broker.start()

    async def _sysfs_loop() -> None:
        while not stop.is_set():
            sysfs.update(time.time())
            try:
                await asyncio.wait_for(stop.wait(), cfg.scrape_interval_s)
            except TimeoutError:
                pass

    try:
        if cfg.on_started is not None:
            cfg.on_started(server, sysfs)
        tasks = [asyncio.create_task(c, name=n) for n, c in [
            ("collector", collector.run(stop)), ("analytics", analytics.run(stop)),
            ("broker", broker.run(stop)), ("demand", demand.run(stop)), ("sysfs", _sysfs_loop()),
            ("audit", _audit_offers(mhost, port, audit_creds, protocol, root, audit, fleet.is_busy_at,
                                    cfg.scrape_interval_s + 0.25, stop, frozenset(fleet.gpu_keys()),
                                    time.time())),
            *[(f"site-{s.name}", s.run(stop)) for s in sites],
        ]]
        t0 = time.monotonic()
        while time.monotonic() - t0 < cfg.duration_s:
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise RuntimeError(f"demo task {t.get_name()} failed") from t.exception()
            if progress is not None:
                progress(_snapshot(analytics, broker, audit, time.monotonic() - t0))
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

        async def _dump_leases() -> None:  # the lease log as a file, for `gpupool report --leases`
            from gpupool.report.leases import dump_lease_log

            path = cfg.state_dir / f"leases-{run_id}.jsonl"
            await dump_lease_log(bus, topics.leases_log, path, timeout_s=10.0)

        for closer in (broker.stop, _dump_leases, analytics.stop, collector.stop, server.stop, bus.close):
            try:
                await closer()
            except Exception:  # noqa: BLE001 — shutting down: log and go on closing the rest
                log.exception("demo_shutdown_error")
        if embedded is not None:
            await embedded.stop()

    st = broker.stats()
    # idle share of the (GPU, step) pairs this run replayed, not of the whole trace
    steps = range(cfg.start_step, fleet.step_at() + 1)
    keys = fleet.gpu_keys()
    pairs = [(k, s) for k in keys for s in steps]
    window_idle = sum(1 for k, s in pairs if not fleet.is_busy_step(k, s)) / max(1, len(pairs))
    return DemoSummary(
        duration_s=cfg.duration_s,
        gpus=len(fleet.gpu_keys()),
        trace_idle_share=window_idle,
        samples_ingested=analytics.rows_ingested(),
        gpus_seen_idle=analytics.gpus_seen_idle(),
        offers=audit.offers,
        gpus_offered=audit.gpus_offered,
        offer_violations=audit.violations,
        offer_races=audit.races,
        leases_granted=st["leases_granted"],
        reclaims_started=st["reclaims_started"],
        reclaims_completed=st["reclaims_completed"],
        expired=st.get("expired", 0),
        rejections=dict(st.get("rejections", {})),
        partitions=list(st.get("partitions", [])),
    )


def _snapshot(analytics, broker, audit: OfferAudit, elapsed: float) -> dict[str, object]:  # noqa: ANN001
    states = Counter(u.state.value for u in analytics.current_states().values())
    st = broker.stats()
    return {
        "elapsed_s": round(elapsed, 1),
        "busy": states.get("busy", 0),
        "idle": states.get("idle", 0),
        "unknown": states.get("unknown", 0),
        "offers": audit.offers,
        "live_leases": st.get("live_leases", 0),
        "leases_granted": st["leases_granted"],
        "reclaims_started": st["reclaims_started"],
        "reclaims_completed": st["reclaims_completed"],
        "violations": audit.violations,
    }
