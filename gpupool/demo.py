"""``gpupool demo``: the simulator and every stage, wired through the bus and MQTT.

Embedded defaults: the in-process bus, a DuckDB file in the state directory, and an MQTT server
of the run's own: a private Mosquitto with production's users and ACL, MQTT 5, when Mosquitto is
installed (:mod:`gpupool.demo_mosquitto`), else amqtt in this process (MQTT 3.1.1, anonymous).
``kafka`` and ``mqtt`` point the same demo at real services.

The trace drives everything: each simulated GPU replays one pod of the Alibaba GenAI 2026 trace,
time-compressed (``speedup`` trace seconds per wall second). The demo checks its own promise:
every offer is compared with the trace at the moment it was published (:class:`OfferAudit`).

Fabric isolation (``fabric``, :class:`gpupool.demo_fabric.FabricMode`): with ``auto`` or ``on`` and
the tools installed, the demo starts a private simulated InfiniBand fabric whose compute HCAs are
the simulated hosts (:class:`gpupool.demo_fabric.DemoFabric`) and runs the broker with OpenSM
partitions, so every lease gets a PKey and SL verified on the fabric before it is granted; the
fabric is stopped at the end, on errors and on Ctrl-C too. ``fabric_state`` instead points at a
fabric someone else runs. Per lease the demo reports site, GPUs, PKey, SL, verified and the
isolate→verified time (:class:`gpupool.demo_leases.LeaseRow`), live and in the summary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiomqtt

from contracts import KafkaTopics, LeaseKind, LeaseLogRecord, MqttTopics, Offer, decode
from gpupool.demo_fabric import (
    INSTALL_HINT,
    DemoFabric,
    FabricMode,
    FabricUnavailable,
    TimedOpenSmFabric,
    missing_tools,
)
from gpupool.demo_edge import ServingSite, no_load_reason
from gpupool.demo_leases import LeaseRow, LeaseWatch, lease_rows, percentile, write_rows
from gpupool.demo_kubernetes import KubeCluster, KubernetesParts
from gpupool.demo_slurm import DemoCluster, SchedulerMode, SlurmParts, SlurmUnavailable, missing_slurm_tools, scheduler_summary
from runtime.bus import make_bus

if TYPE_CHECKING:
    from broker.service import BrokerService
    from gpupool.demo_mosquitto import PrivateMosquitto
    from gpupool.harvest_causes import CauseSampler
    from simulator.dcgm_http import FleetServer
    from simulator.sites import DiurnalDemand, SimulatedSite
    from simulator.sysfs import SysfsTree

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 20.0
"""How long the demo waits for each task and each stage to stop before it goes on, seconds."""
Progress = Callable[[dict[str, object]], object]
"""``progress(snapshot)`` of :func:`run_demo`, called about twice a second."""


def default_state_dir() -> Path:
    """Where the demo keeps its files unless told: ``$GPUPOOL_STATE/demo`` when ``GPUPOOL_STATE``
    is set and not empty (the Makefile exports ``<clone>/.state``; the local service scripts use
    the same variable), else ``.state/demo`` relative to the current directory."""
    state = os.environ.get("GPUPOOL_STATE")
    return Path(state) / "demo" if state else Path(".state/demo")


def new_run_id() -> str:
    """A fresh run id: 8 hex digits, in the names of the run's files (``leases-<run>.jsonl``...)."""
    return uuid.uuid4().hex[:8]


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
    sysfs_interval_s: float | None = None
    """Seconds between two updates and reads of the simulated nodes' InfiniBand sysfs trees;
    ``None``: every scrape (``scrape_interval_s``)."""
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
    state_dir: Path = field(default_factory=default_state_dir)
    """Where the run's files go (:func:`default_state_dir`: ``$GPUPOOL_STATE/demo`` or ``.state/demo``)."""
    run_id: str | None = None
    """Id of the run in its file names; ``None``: a fresh one (:func:`new_run_id`)."""
    metrics_port: int = 0
    trace_dir: Path | None = None
    topic_prefix: str | None = None
    """Kafka topic prefix; ``None``: a fresh ``demo-<run id>.`` on Kafka, none on the in-process bus."""
    fabric_state: Path | None = None
    """fabric.json of an OpenSM fabric someone else runs (deploy/local/fabric.sh): each lease gets a
    partition verified on it (:class:`broker.fabric_opensm.OpenSmFabric`); overrides ``fabric``."""
    lent_share_percent: float | None = 10.0
    """The QoS plan's lent-share bound on the fabric (percent of a busy link; each lease's traffic
    gets a VL of its own, verified on its paths); ``None``: partitions only, no QoS."""
    fabric: FabricMode = FabricMode.OFF
    """Start the demo's own simulated fabric: ``auto`` when the tools are installed, ``on`` always
    (:class:`FabricUnavailable` if it cannot), ``off`` never. ``gpupool demo`` defaults to ``auto``."""
    scheduler: SchedulerMode = SchedulerMode.NONE
    """Lend through the local Slurm cluster (:mod:`gpupool.demo_slurm`): ``auto`` when its tools are
    installed and it starts, ``slurm`` always (:class:`SlurmUnavailable` if it cannot), ``none``
    never. ``gpupool demo`` defaults to ``auto``."""
    training_load: float = 0.7
    """With Slurm: offered load of the training jobs (GPU-seconds asked per second ÷ GPUs)."""
    training_compression: float = 120.0
    """With Slurm: simulated seconds of the training stream per wall second."""
    slurm_grace_s: int = 4
    """With Slurm: GraceTime of the lent partition of a cluster the demo starts (= the notice);
    a cluster already running keeps its own."""
    slurm_conf: Path | None = None
    """With Slurm: the ``slurm.conf`` of a cluster someone else runs (and stops): the demo lends
    through it (:meth:`gpupool.demo_slurm.DemoCluster.attach`) instead of starting its own."""
    plan_lead_s: float = 10.0
    """With a scheduler: a GPU its plan needs for a pending job is lent until this long (s, wall)
    before the job's planned start, and its lease is at risk from then
    (:class:`analytics.scheduler.SchedulerJoin`); ``math.inf``: nothing planned is lent."""
    training_submit: bool = True
    """With Slurm: submit the demo's own training jobs; ``False``: only follow the cluster's jobs
    (someone else submits them, e.g. the harvest replay, ``bench/harvest.py``)."""
    kubeconfig: Path | None = None
    """Lend through the Kubernetes cluster of this kubeconfig, run by someone else who also submits
    the training Jobs (:mod:`gpupool.demo_kubernetes`; ``bench/harvest.py --scheduler kubernetes``),
    the leases' notice ``notice_s`` as the lent pods' grace period; overrides ``scheduler``
    (``training_submit`` must be False)."""
    site_demand: DiurnalDemand | None = None
    """GPUs each site wants over the simulated day (:class:`simulator.sites.DiurnalDemand`);
    ``None``: sites claim now and then, a few leases each."""
    site_lease_kinds: tuple[LeaseKind | None, ...] = ()
    """Lease kind each site's claims ask for, by site order (cycled); empty: unset."""
    site_release_on_at_risk: bool = False
    """Sites release a lease as soon as it is at risk (a training job is planned onto it)."""
    site_lease_gpus: int | None = None
    """With ``site_demand``: the most GPUs one claim (one lease) takes (default 8): Slurm takes a
    lease back whole when it preempts any of its holds, so smaller leases lose fewer GPUs."""
    site_claim_every_s: float = 1.0
    """Mean time between two claim attempts of a site, seconds."""
    site_parallel_claims: int = 1
    """With ``site_demand``: claims a site sends at once, each on another node's offer
    (:class:`simulator.sites.SimulatedSite`)."""
    site_claim_on_offer: bool = False
    """With ``site_demand``: an offer arriving starts a site's next claim round at once, rather
    than after ``site_claim_every_s``."""
    serving_site: str | None = None
    """With a training scheduler (the broker runs the workload on leased GPUs): the site of
    ``sites`` that keeps ``serving_target`` leases of the workload and sends a steady request load
    at their endpoints through the reclaims (:class:`gpupool.demo_edge.ServingSite`); ``None``:
    none. ``gpupool demo`` sets the first site."""
    serving_rate_per_s: float = 50.0
    """Requests per second of the serving site's load (open loop)."""
    serving_target: int = 2
    """Leases the serving site keeps serving."""
    serving_gpus_per_lease: int = 1
    """GPUs of each lease of the serving site."""
    cause_sample_s: float | None = None
    """Lending through Slurm: every this many seconds, sample why each GPU no training job holds
    is not lent (:class:`gpupool.harvest_causes.CauseSampler`; ``cause_timeline_file`` of the
    summary); ``None``: no sampling."""
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
    Each violation is logged at ERROR (``offer_for_busy_gpu``), each race at DEBUG (``offer_race``).
    """

    offers: int = 0
    gpus_offered: int = 0
    violations: int = 0
    races: int = 0
    distinct_gpus: set[str] = field(default_factory=set)

    def check(self, offer: Offer, is_busy_at, allowance_s: float) -> None:
        """Audit one offer against ``is_busy_at(gpu_key, t) -> bool``."""
        self.offers += 1
        for g in offer.gpus:
            self.gpus_offered += 1
            self.distinct_gpus.add(g.gpu)
            if is_busy_at(g.gpu, offer.ts):
                if is_busy_at(g.gpu, offer.ts - allowance_s):
                    self.violations += 1
                    log.error("offer_for_busy_gpu", extra={"offer_id": offer.offer_id, "gpu": g.gpu, "offer_ts": offer.ts})
                else:
                    self.races += 1
                    # expected now and then, and counted in the summary: not a warning
                    log.debug("offer_race", extra={"offer_id": offer.offer_id, "gpu": g.gpu, "offer_ts": offer.ts})


@dataclass(frozen=True)
class FabricStatus:
    """Whether the demo's leases are isolated on a fabric, and why (not).

    Attributes:
        enabled: True when the broker runs with OpenSM partitions (every lease needs a verified one).
        mode: the ``fabric`` mode asked for (``auto``/``on``/``off``), or ``external``.
        detail: where the fabric is (``fabric.json``), or why there is none.
        start_s: seconds the demo's own fabric took to start; ``None`` when it started none.
    """

    enabled: bool
    mode: str
    detail: str
    start_s: float | None = None

    def notice(self) -> str:
        """The one message the demo shows about fabric isolation (what it means, how to get it)."""
        if self.enabled:
            return (f"Fabric isolation ON: every lease gets its own InfiniBand partition (PKey + SL) and "
                    f"its own virtual lane with a bounded share (QoS), verified on the fabric before "
                    f"it is granted ({self.detail}).")
        return (f"Fabric isolation OFF: leases run without fabric isolation ({self.detail}). "
                f"For a PKey + SL per lease on a simulated InfiniBand fabric, install ibsim, OpenSM "
                f"and infiniband-diags with `{INSTALL_HINT}` and run `gpupool demo --fabric on`.")


@dataclass
class DemoSummary:
    """What the demo did, printed at the end and returned to tests.

    Besides the counts: ``fabric`` (:class:`FabricStatus` as a dict), ``leases`` (one
    :meth:`LeaseRow.as_dict` per granted lease, in grant order), ``leases_verified`` (leases whose
    partition was verified on the fabric), ``leases_qos_verified`` (and their QoS on every port of
    their paths), ``isolate_p50_s`` / ``isolate_p99_s`` (nearest-rank
    percentiles of the isolate→verified seconds; ``None`` without isolation), and the files
    written: ``leases_file`` (the lease log, input of ``gpupool report --leases``) and
    ``lease_rows_file`` (the rows as JSON lines).
    """

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
    fabric: dict[str, object] = field(default_factory=dict)
    leases: list[dict[str, object]] = field(default_factory=list)
    leases_verified: int = 0
    leases_qos_verified: int = 0
    isolate_p50_s: float | None = None
    isolate_p99_s: float | None = None
    leases_file: str | None = None
    lease_rows_file: str | None = None
    scheduler: dict[str, object] = field(default_factory=dict)
    """``mode``, ``enabled``, ``detail`` and, lending through Slurm, the fields of
    :class:`gpupool.demo_slurm.SchedulerSummary`."""
    cause_timeline_file: str | None = None
    """With ``DemoConfig.cause_sample_s``: the cause samples as JSON lines
    (:func:`gpupool.harvest_causes.read_timeline`)."""
    training_starts_file: str | None = None
    """Lending through Slurm: JSON of every training job seen running (``starts``: Slurm id →
    [first seen running, Unix s; node → GRES indices]) and ``locate`` (GPU key → [node, GRES
    index]), input of :func:`gpupool.harvest.lending_figures`."""
    sites: dict[str, dict[str, object]] = field(default_factory=dict)
    """Each site's counters (:meth:`simulator.sites.SimulatedSite.stats`,
    :meth:`gpupool.demo_edge.ServingSite.stats`)."""
    edge_load: dict[str, object] = field(default_factory=dict)
    """The serving site's request load: ``enabled`` True and the fields of
    :class:`gpupool.demo_edge.EdgeLoadSummary`, or ``enabled`` False and ``detail`` saying why no
    load ran; empty without a serving site (``DemoConfig.serving_site``)."""
    edge_requests_file: str | None = None
    """The serving site's requests and hand-overs as JSON lines
    (:meth:`gpupool.demo_edge.ServingSite.write_records`)."""

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly dict."""
        return asdict(self)


async def _audit_offers(
    host: str, port: int, creds: tuple[str | None, str | None], protocol: int, root: str,
    audit: OfferAudit, is_busy_at, allowance_s: float, stop: asyncio.Event,
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
                offer = decode(Offer, bytes(msg.payload))
            except ValueError:
                continue
            if offer.offer_id in seen:
                continue
            seen.add(offer.offer_id)
            # a shared MQTT server may retain offers of other runs: audit only this run's GPUs
            if offer.ts < started_at or not all(g.gpu in fleet_keys for g in offer.gpus):
                continue
            audit.check(offer, is_busy_at, allowance_s)


async def run_demo(cfg: DemoConfig, progress: Progress | None = None) -> DemoSummary:
    """Run the whole pipeline for ``cfg.duration_s`` seconds and return its summary.

    ``progress(snapshot: dict)`` is called about twice a second with live counts (keys of
    :func:`_snapshot`: the counts, ``fabric`` (:class:`FabricStatus`), ``lease_rows`` (the live
    leases, :class:`LeaseRow`) and ``isolate_p50_s``). Starts the demo's own simulated fabric as
    ``cfg.fabric`` says and stops it before returning or raising.
    Raises ``FileNotFoundError`` if the trace is missing, ``OSError`` if a service is unreachable,
    :class:`FabricUnavailable` with ``fabric=on`` when the fabric cannot run.
    """
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    run_id = cfg.run_id or new_run_id()
    status, own = await _open_fabric(cfg, run_id)
    try:
        sched, cluster = await _open_cluster(cfg)
        try:
            return await _run_pipeline(cfg, progress, run_id, status, own, sched, cluster)
        finally:
            if cluster is not None:
                await asyncio.to_thread(cluster.close)
    finally:
        if own is not None:
            own.stop()


async def _private_mosquitto(cfg: DemoConfig, root: str, run_id: str) -> PrivateMosquitto | None:
    """The run's own Mosquitto when it is installed and starts (production's users and ACL, MQTT
    5), else ``None`` (the demo then uses amqtt in its process; a start that failed is logged)."""
    from gpupool.demo_mosquitto import PrivateMosquitto, mosquitto_binary

    if mosquitto_binary() is None:
        return None
    server = PrivateMosquitto(cfg.state_dir / f"mosquitto-{run_id}", root, list(cfg.sites))
    try:
        await server.start()
    except OSError as e:
        log.warning("demo_mosquitto_failed", extra={"error": str(e)[-500:]})
        return None
    return server


async def _open_cluster(cfg: DemoConfig) -> tuple[dict[str, object], DemoCluster | KubeCluster | None]:
    """Decide on lending through Slurm (or the caller's Kubernetes cluster) and start (or reuse)
    the local cluster when wanted and possible: (the summary's ``scheduler`` status, the cluster
    or ``None``)."""
    if cfg.kubeconfig is not None:
        return {"mode": "kubernetes", "enabled": True, "grace_s": cfg.notice_s, "start_s": 0.0,
                "detail": f"Kubernetes cluster run by the caller: {cfg.kubeconfig}, lent pods' grace period "
                          f"{cfg.notice_s:g} s"}, KubeCluster(cfg.kubeconfig, cfg.notice_s)  # fmt: skip
    mode = cfg.scheduler
    if mode is SchedulerMode.NONE:
        return {"mode": "none", "enabled": False, "detail": "--scheduler none"}, None
    if cfg.slurm_conf is not None:
        cluster = DemoCluster.attach(cfg.slurm_conf)
        return {"mode": mode.value, "enabled": True, "grace_s": cluster.grace_s, "start_s": 0.0,
                "detail": f"Slurm cluster run by the caller: {cluster.conf}, lent partition GraceTime "
                          f"{cluster.grace_s:g} s"}, cluster  # fmt: skip
    missing = missing_slurm_tools()
    if missing:
        why = f"Slurm's tools are not installed: {', '.join(missing)} (bash deploy/local/install-system.sh)"
        if mode is SchedulerMode.SLURM:
            raise SlurmUnavailable(f"--scheduler slurm, but {why}")
        return {"mode": "auto", "enabled": False, "detail": why}, None
    try:
        cluster = await asyncio.to_thread(DemoCluster.open, cfg.nodes, cfg.slurm_grace_s)
    except SlurmUnavailable as e:
        if mode is SchedulerMode.SLURM:
            raise
        log.warning("demo_slurm_failed", extra={"error": str(e)[-1000:]})
        return {"mode": "auto", "enabled": False, "detail": f"the Slurm cluster did not start: {str(e)[-300:]}"}, None
    how = "started" if cluster.started else "already running, reused"
    return {"mode": mode.value, "enabled": True, "grace_s": cluster.grace_s, "start_s": round(cluster.start_s, 2),
            "detail": f"local Slurm cluster ({how}): {cluster.conf}, lent partition GraceTime {cluster.grace_s:g} s"}, cluster


async def _open_fabric(cfg: DemoConfig, run_id: str) -> tuple[FabricStatus, DemoFabric | None]:
    """Decide on fabric isolation and start the demo's own fabric when it is wanted and possible."""
    if cfg.fabric_state is not None:
        return FabricStatus(True, "external", f"fabric {cfg.fabric_state}"), None
    if cfg.fabric is FabricMode.OFF:
        return FabricStatus(False, "off", "--fabric off"), None
    missing = missing_tools()
    if missing:
        if cfg.fabric is FabricMode.ON:
            raise FabricUnavailable(
                f"--fabric on, but the fabric tools are not installed: {', '.join(missing)} ({INSTALL_HINT})")
        return FabricStatus(False, "auto", f"fabric tools not installed: {', '.join(missing)}"), None
    try:
        own = await DemoFabric.start((cfg.state_dir / f"fabric-{run_id}").resolve(), cfg.nodes)
    except FabricUnavailable as e:
        if cfg.fabric is FabricMode.ON:
            raise
        log.warning("demo_fabric_failed", extra={"error": str(e)[-1000:]})
        return FabricStatus(False, "auto", f"the simulated fabric did not start: {str(e)[-300:]}"), None
    detail = (f"simulated fabric: ibsim + OpenSM, {len(own.compute_hcas())} host HCAs + edge gateway, "
              f"{own.fabric_json}")
    return FabricStatus(True, cfg.fabric.value, detail, round(own.start_seconds, 3)), own


async def _run_pipeline(
    cfg: DemoConfig, progress: Progress | None, run_id: str, status: FabricStatus, own: DemoFabric | None,
    sched: dict[str, object] | None = None, cluster: DemoCluster | KubeCluster | None = None,
) -> DemoSummary:
    """The demo proper (see :func:`run_demo`), with fabric isolation as ``status`` says."""
    from prometheus_client import CollectorRegistry

    from analytics.classify import IdleConfig
    from analytics.metrics import AnalyticsMetrics
    from analytics.service import AnalyticsService
    from broker.metrics import BrokerMetrics
    from broker.service import BrokerConfig, BrokerService
    from collectors.metrics import CollectorMetrics
    from collectors.service import CollectorService
    from gpupool.embedded_mqtt import EmbeddedMqttBroker
    from gpupool.report.leases import read_from_bus, write_jsonl
    from simulator.dcgm_http import FleetServer
    from simulator.demand import TrainingDemand
    from simulator.fleet import Fleet
    from simulator.sites import SimulatedSite
    from simulator.sysfs import SysfsTree
    from simulator.trace import default_trace_dir, load_trace

    registry = CollectorRegistry()  # every stage's metrics, one process, one /metrics
    broker_metrics = BrokerMetrics(registry)
    if cfg.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(cfg.metrics_port, addr="127.0.0.1", registry=registry)
    trace = load_trace(cfg.trace_dir or default_trace_dir())
    fleet = Fleet(trace, nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node, speedup=cfg.speedup,
                  start_step=cfg.start_step, seed=cfg.seed)
    fabric: TimedOpenSmFabric | None = None
    if own is not None:  # the demo's own fabric: host i is its i-th compute HCA
        fabric = TimedOpenSmFabric(own.fabric_json, host_ports=own.host_ports(fleet.hosts()),
                                   qos_share_percent=cfg.lent_share_percent, metrics=broker_metrics.fabric)
    elif cfg.fabric_state is not None:  # someone else's: the broker's default host mapping
        fabric = TimedOpenSmFabric(cfg.fabric_state, qos_share_percent=cfg.lent_share_percent,
                                   metrics=broker_metrics.fabric)
    server = FleetServer(fleet)
    await server.start()
    sysfs = SysfsTree(fleet, cfg.state_dir / f"sysfs-{run_id}")
    sysfs.update(time.time())

    bus = make_bus(cfg.kafka, client_id="gpupool-demo")
    prefix = cfg.topic_prefix if cfg.topic_prefix is not None else (f"demo-{run_id}." if cfg.kafka else "")
    topics = KafkaTopics(prefix=prefix)
    await bus.create_topics(topics.all(), partitions=4 if cfg.kafka else 1,
                            compacted=[topics.leases_log, topics.fabric_topology])
    # lending through a scheduler: training jobs, the scheduler source, the broker's lending
    parts: SlurmParts | KubernetesParts | None = None
    if isinstance(cluster, KubeCluster):
        parts = KubernetesParts.build(cluster, fleet, bus, topics, registry, cfg.state_dir / f"kubernetes-{run_id}",
                                      load=cfg.training_load, compression=cfg.training_compression,
                                      seed=cfg.seed, horizon_s=cfg.duration_s, submit=cfg.training_submit)
    elif cluster is not None:
        parts = SlurmParts.build(cluster, fleet, bus, topics, registry, cfg.state_dir / f"slurm-{run_id}",
                                 load=cfg.training_load, compression=cfg.training_compression,
                                 seed=cfg.seed, horizon_s=cfg.duration_s, submit=cfg.training_submit)

    embedded: EmbeddedMqttBroker | PrivateMosquitto | None = None
    users: dict[str, str] = {}
    root = "gpupool/v1"
    if cfg.mqtt:
        mhost, _, mport = cfg.mqtt.rpartition(":")
        port = int(mport)
        protocol = cfg.mqtt_protocol
    elif (embedded := await _private_mosquitto(cfg, root, run_id)) is not None:
        mhost, port, protocol, users = embedded.host, embedded.port, embedded.protocol, dict(embedded.users)
    else:
        embedded = EmbeddedMqttBroker()
        await embedded.start()
        mhost, port, protocol = embedded.host, embedded.port, 4
    if cfg.mqtt_credentials:
        data = json.loads(cfg.mqtt_credentials.read_text())
        users, root = data["users"], data.get("root", root)
    root = f"{root}/demo-{run_id}" if cfg.mqtt and not cfg.mqtt_credentials else root

    def creds(user: str) -> tuple[str | None, str | None]:
        return (user, users[user]) if user in users else (None, None)

    collector = CollectorService(bus=bus, topics=topics, dcgm_targets=list(server.urls().values()),
                                 sysfs_roots=sysfs.roots(), interval_s=cfg.scrape_interval_s,
                                 sysfs_interval_s=cfg.sysfs_interval_s,
                                 timeout_s=max(0.2, cfg.scrape_interval_s * 2), metrics=CollectorMetrics(registry))
    analytics = AnalyticsService(bus=bus, topics=topics, db_path=str(cfg.state_dir / f"analytics-{run_id}.duckdb"),
                                 idle=IdleConfig(min_idle_s=cfg.min_idle_s if parts is None else min(cfg.min_idle_s, 1.0), stale_after_s=max(3.0, 6 * cfg.scrape_interval_s),
                                                 # the trace is exact: idle means 0 % duty cycle
                                                 idle_threshold=0.0, busy_threshold=0.0),
                                 refresh_s=5.0, metrics=AnalyticsMetrics(registry), scheduler=parts is not None,
                                 plan_lead_s=cfg.plan_lead_s)
    bu, bp = creds("gpupool-broker")
    broker = BrokerService(bus=bus, topics=topics, mqtt_host=mhost, mqtt_port=port, mqtt_username=bu,
                           mqtt_password=bp, root=root, protocol=protocol, fabric=fabric,
                           config=BrokerConfig(offer_ttl_s=cfg.offer_ttl_s,
                                               notice_s=parts.notice_s if parts else cfg.notice_s,
                                               lease_ttl_s=cfg.lease_ttl_s,
                                               lent_share_percent=fabric.lent_share_percent if fabric else None,
                                               workloads=(parts.workload,) if parts and parts.workload else ()),
                           metrics=broker_metrics, lending=parts.lending if parts else None)
    serving: ServingSite | None = None
    if parts is not None and parts.workload is not None and cfg.serving_site in cfg.sites:
        serving = ServingSite(cfg.serving_site, parts.workload.name,
                              {"host": mhost, "port": port, "username": creds(cfg.serving_site)[0],
                               "password": creds(cfg.serving_site)[1], "root": root, "protocol": protocol},
                              rate_per_s=cfg.serving_rate_per_s, target=cfg.serving_target,
                              gpus_per_lease=cfg.serving_gpus_per_lease, notice_s=parts.notice_s,
                              renew_every_s=cfg.lease_ttl_s / 3)
    sites = [SimulatedSite(name=s, host=mhost, port=port, username=creds(s)[0], password=creds(s)[1],
                           root=root, protocol=protocol, seed=cfg.seed + i,
                           renew_every_s=cfg.lease_ttl_s / 3, workload=parts.workload.name if parts and parts.workload else None,
                           # through Slurm the sites take more (up to 3 leases of 4 GPUs): training needs them back
                           max_live_leases=3 if parts else 2,
                           max_gpus_per_claim=(cfg.site_lease_gpus or 8) if cfg.site_demand else 4 if parts else 2,
                           claim_every_s=cfg.site_claim_every_s,
                           demand=cfg.site_demand, release_on_at_risk=cfg.site_release_on_at_risk,
                           parallel_claims=cfg.site_parallel_claims, claim_on_offer=cfg.site_claim_on_offer,
                           lease_kind=cfg.site_lease_kinds[i % len(cfg.site_lease_kinds)] if cfg.site_lease_kinds else None)
             for i, s in enumerate(cfg.sites) if serving is None or s != serving.name]
    demand = TrainingDemand(fleet, bus, topics)
    watch = LeaseWatch(bus, topics.leases_log)
    sampler = _cause_sampler(cfg, parts, broker, sites)
    isolate_s: dict[str, float] = fabric.isolate_seconds if fabric is not None else {}

    stop = asyncio.Event()
    audit = OfferAudit()
    audit_creds = creds("gpupool-observer") if "gpupool-observer" in users else (
        creds(cfg.sites[0]) if users else (None, None))  # fmt: skip
    tasks: list[asyncio.Task[object]] = []
    await collector.start()
    if parts is not None:
        await parts.source.start()
    await analytics.start()
    await broker.start()

    async def _sysfs_loop() -> None:
        while not stop.is_set():
            sysfs.update(time.time())
            try:
                await asyncio.wait_for(stop.wait(), cfg.sysfs_interval_s or cfg.scrape_interval_s)
            except TimeoutError:
                pass

    leases_path = cfg.state_dir / f"leases-{run_id}.jsonl"
    rows_path = cfg.state_dir / f"lease-rows-{run_id}.jsonl"
    records: list[LeaseLogRecord] | None = None
    try:
        if cfg.on_started is not None:
            cfg.on_started(server, sysfs)
        tasks = [asyncio.create_task(c, name=n) for n, c in [
            ("collector", collector.run(stop)), ("analytics", analytics.run(stop)),
            ("broker", broker.run(stop)), ("sysfs", _sysfs_loop()),
            # training demand: the trace's busy turns, or, through Slurm, real training jobs
            *([("training", parts.stream.run(stop)), ("slurm-source", parts.source.run(parts.poll_s, stop))]
              if parts is not None else [("demand", demand.run(stop))]),
            ("audit", _audit_offers(mhost, port, audit_creds, protocol, root, audit, fleet.is_busy_at,
                                    # through Slurm a training start reaches an offer through more steps: the
                                    # demo's read of Slurm, the Slurm source's read, the scrape, analytics'
                                    # publish interval (1 s)
                                    cfg.scrape_interval_s + 0.25 + (cfg.scrape_interval_s + 2 * parts.poll_s + 1.0
                                                                    if parts else 0.0),
                                    stop, frozenset(fleet.gpu_keys()),
                                    time.time())),
            ("leases", watch.run(stop)),
            *[(f"site-{s.name}", s.run(stop)) for s in sites],
            *([(f"site-{serving.name}-serving", serving.run(stop))] if serving is not None else []),
            *([("causes", sampler.run(stop))] if sampler is not None else []),
        ]]
        t0, wall0 = time.monotonic(), time.time()
        while time.monotonic() - t0 < cfg.duration_s:
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise RuntimeError(f"demo task {t.get_name()} failed") from t.exception()
            if progress is not None:
                progress(_snapshot(analytics, broker, audit, time.monotonic() - t0, status,
                                   watch.rows(isolate_s), isolate_s))
            await asyncio.sleep(0.5)
        if serving is not None:  # the load stops while every endpoint still serves
            await serving.finish()
    finally:
        if parts is not None:  # no scheduler reclaim may start once the broker's run task is gone
            try:
                await asyncio.wait_for(parts.lending.stop(), SHUTDOWN_TIMEOUT_S)
            except Exception:  # noqa: BLE001 — shutting down: log and go on closing the rest
                log.exception("demo_shutdown_error", extra={"step": "lending"})
        stop.set()
        for t in tasks:
            if not t.done():
                t.cancel()
        if tasks:  # a task that ignores its cancellation must not hang the demo (nor keep the fabric up)
            _, stuck = await asyncio.wait(tasks, timeout=SHUTDOWN_TIMEOUT_S)
            for t in stuck:
                log.error("demo_task_stuck", extra={"task": t.get_name(), "timeout_s": SHUTDOWN_TIMEOUT_S})

        async def _dump_leases() -> None:  # the lease log as a file, for `gpupool report --leases`
            nonlocal records
            records, _ = await read_from_bus(bus, topics.leases_log, timeout_s=10.0)
            write_jsonl(records, leases_path)
            log.info("demo_lease_log_dumped", extra={"path": str(leases_path), "records": len(records)})

        wall1 = time.time()
        closers: list[Callable[[], Awaitable[object]]] = [broker.stop, _dump_leases, analytics.stop, collector.stop]
        if parts is not None:
            closers += [parts.source.stop, parts.close]
        for closer in (*closers, server.stop, bus.close):
            try:
                await asyncio.wait_for(closer(), SHUTDOWN_TIMEOUT_S)
            except Exception:  # noqa: BLE001 — shutting down: log and go on closing the rest
                log.exception("demo_shutdown_error", extra={"step": getattr(closer, "__qualname__", "?")})
        if embedded is not None:
            try:
                await asyncio.wait_for(embedded.stop(), SHUTDOWN_TIMEOUT_S)
            except Exception:  # noqa: BLE001 — as above
                log.exception("demo_shutdown_error", extra={"step": "embedded_mqtt"})

    starts_path = cfg.state_dir / f"training-starts-{run_id}.json"
    if parts is not None:
        try:
            starts_path.write_text(json.dumps({"starts": parts.stream.starts, "locate": parts.locate}))
        except OSError:
            log.exception("demo_training_starts_not_written", extra={"path": str(starts_path)})
    causes_path = cfg.state_dir / f"causes-{run_id}.jsonl"
    if sampler is not None:
        try:
            sampler.write(causes_path)
        except OSError:
            log.exception("demo_causes_not_written", extra={"path": str(causes_path)})
    rows = lease_rows(records if records is not None else watch.records, isolate_s)
    try:
        write_rows(rows, rows_path)
    except OSError:
        log.exception("demo_lease_rows_not_written", extra={"path": str(rows_path)})
    st = broker.stats()
    # idle share of the (GPU, step) pairs this run replayed, not of the whole trace
    steps = range(cfg.start_step, fleet.step_at() + 1)
    keys = fleet.gpu_keys()
    pairs = [(k, s) for k in keys for s in steps]
    window_idle = sum(1 for k, s in pairs if not fleet.is_busy_step(k, s)) / max(1, len(pairs))
    timed = [r.isolate_s for r in rows if r.isolate_s is not None]
    every_site: list[SimulatedSite | ServingSite] = [*sites, *([serving] if serving is not None else [])]
    requests_path = cfg.state_dir / f"edge-requests-{run_id}.jsonl"
    if serving is not None and serving.load is not None:
        try:
            serving.write_records(requests_path)
        except OSError:
            log.exception("demo_edge_requests_not_written", extra={"path": str(requests_path)})
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
        fabric=asdict(status),
        leases=[r.as_dict() for r in rows],
        leases_verified=sum(1 for r in rows if r.verified),
        leases_qos_verified=sum(1 for r in rows if r.verified and r.qos_verified),
        isolate_p50_s=percentile(timed, 0.50),
        isolate_p99_s=percentile(timed, 0.99),
        leases_file=str(leases_path) if records is not None else None,
        lease_rows_file=str(rows_path) if rows_path.exists() else None,
        scheduler={**(sched or {}), **(asdict(scheduler_summary(
            parts.stream, records or watch.records, {lid: n for s in every_site for lid, n in s.notices.items()},
            parts.locate, wall0, wall1, parts.notice_s)) if parts is not None else {})},
        training_starts_file=str(starts_path) if starts_path.exists() else None,
        cause_timeline_file=str(causes_path) if sampler is not None and causes_path.exists() else None,
        sites={s.name: s.stats() for s in every_site},
        edge_load=_edge_load(cfg, serving, sched),
        edge_requests_file=str(requests_path) if requests_path.exists() else None,
    )


def _cause_sampler(cfg: DemoConfig, parts: SlurmParts | KubernetesParts | None, broker: BrokerService,
                   sites: Sequence[SimulatedSite]) -> CauseSampler | None:
    """The run's :class:`gpupool.harvest_causes.CauseSampler` when ``cfg.cause_sample_s`` is set
    and it lends through Slurm, else ``None``."""
    if cfg.cause_sample_s is None or not isinstance(parts, SlurmParts):
        return None
    from gpupool.harvest_causes import CauseSampler

    def wanted() -> int | None:
        asks = [w for w in (s.wanted_gpus() for s in sites) if w is not None]
        return sum(asks) if asks else None

    return CauseSampler(book=broker.book, holds=parts.lending.hold_status, training=parts.stream.history.latest,
                        locate=parts.locate, wanted=wanted, every_s=cfg.cause_sample_s)


def _edge_load(cfg: DemoConfig, serving: ServingSite | None, sched: dict[str, object] | None) -> dict[str, object]:
    """``DemoSummary.edge_load``: the serving site's load, or why none ran (module
    :mod:`gpupool.demo_edge`); empty without a serving site."""
    if cfg.serving_site is None:
        return {}
    if serving is None:
        if sched and sched.get("enabled") and cfg.serving_site not in cfg.sites:
            return {"enabled": False, "detail": f"not run: {cfg.serving_site!r} is not one of the sites {cfg.sites}"}
        if sched and sched.get("enabled"):
            return {"enabled": False, "detail": "not run: this scheduler runs no site workload (kwok runs no containers)"}
        return {"enabled": False, "detail": no_load_reason(sched or {})}
    got = serving.summary()
    if got is None:
        return {"enabled": False, "detail": f"not run: no endpoint of {serving.name}'s leases served during the run "
                                            f"(kept-lease counts {serving.stats()})"}
    return {"enabled": True, **got.as_dict()}


def _snapshot(analytics, broker, audit: OfferAudit, elapsed: float, status: FabricStatus,
              rows: list[LeaseRow], isolate_s: dict[str, float]) -> dict[str, object]:
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
        "fabric": status,
        "lease_rows": [r for r in rows if r.live],
        "isolate_p50_s": percentile(list(isolate_s.values()), 0.50),
    }
