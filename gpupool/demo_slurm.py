"""The demo's training scheduler: a real local Slurm cluster, a stream of training jobs, and what
lending did to them.

``gpupool demo --scheduler auto|slurm|none`` (:class:`SchedulerMode`): with ``slurm`` (or
``auto`` and Slurm's tools installed) the demo starts the local cluster of
``deploy/local/slurm.sh`` (or reuses one already running: :class:`DemoCluster`), its simulated
hosts are the Slurm nodes, and :class:`TrainingStream` submits training jobs of
:mod:`simulator.training_jobs` (AcmeTrace's Seren fit, time-compressed) to the ``training``
partition and reads Slurm's jobs (``scontrol show job -d -o``) every ``poll_s``: the GPUs training
jobs hold drive the simulated DCGM telemetry (:meth:`simulator.fleet.Fleet.follow_scheduler`), so
an idle GPU is one no training job holds. :func:`scheduler_summary` turns the run into the
summary's numbers: GPU-hours idle and lent, submit → start of the training jobs that needed lent
GPUs, leases Slurm reclaimed and whether each site had the notice before its deadline.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from collectors.slurm_parse import JobInfo, parse_job, parse_records
from contracts import LeaseLogRecord
from contracts.scheduler import LENT_JOB_NAME
from gpupool.demo_leases import percentile
from simulator.replay import ReplayError
from simulator.slurm_replay import SlurmClient
from simulator.training_jobs import TrainingJob

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from broker.lending import SlurmLending
    from broker.workloads import WorkloadProfile
    from collectors.slurm_collector import SlurmCollector
    from contracts import KafkaTopics
    from contracts.bus import Bus
    from simulator.fleet import Fleet

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SLURM_SCRIPT = REPO / "deploy" / "local" / "slurm.sh"
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
"""What ``deploy/local/slurm.sh`` and the demo run (Debian packages ``slurm-wlm``, ``munge``)."""
INSTALL_HINT = "bash deploy/local/install-system.sh"


class SchedulerMode(StrEnum):
    """``--scheduler``: ``auto`` lends through Slurm when its tools are installed and the cluster
    starts, ``slurm`` requires it (:class:`SlurmUnavailable` otherwise), ``none`` never (training
    demand is simulated from the trace, leases are bookkeeping)."""

    AUTO = "auto"
    SLURM = "slurm"
    NONE = "none"


class SlurmUnavailable(RuntimeError):
    """``--scheduler slurm`` and the local Slurm cluster cannot run (tools missing, start failed)."""


def missing_slurm_tools() -> list[str]:
    """The commands of :data:`SLURM_TOOLS` not on ``PATH`` (empty: all there)."""
    return [t for t in SLURM_TOOLS if shutil.which(t) is None]


_GRACE = re.compile(r"^PartitionName=(\S+)\s.*\bGraceTime=(\d+)", re.M)
_NODE = re.compile(r"^NodeName=(\S+)", re.M)


@dataclass
class DemoCluster:
    """The local Slurm cluster the demo lends through.

    Attributes:
        conf: its ``slurm.conf`` (``SLURM_CONF`` of every Slurm command).
        grace_s: ``GraceTime`` of its ``lent`` partition, seconds: the leases' notice.
        started: True when the demo started it (and stops it at the end); False when it was
            running already (left running).
        start_s: seconds the start (or the status check) took.
    """

    conf: Path
    grace_s: float
    started: bool
    start_s: float

    @classmethod
    def attach(cls, conf: Path, partition: str = "lent") -> DemoCluster:
        """A cluster someone else runs (and stops), from its ``slurm.conf``; the notice is the
        ``partition``'s ``GraceTime``. Raises :class:`SlurmUnavailable` when the file cannot be
        read or has no such partition with a ``GraceTime``."""
        t0 = time.monotonic()
        try:
            text = conf.read_text()
        except OSError as e:
            raise SlurmUnavailable(f"cannot read {conf}: {e}") from e
        graces = {p: float(g) for p, g in _GRACE.findall(text)}
        if partition not in graces:
            raise SlurmUnavailable(f"{conf} has no {partition!r} partition with a GraceTime")
        return cls(conf, graces[partition], False, time.monotonic() - t0)

    @classmethod
    def open(cls, nodes: int, grace_s: int, partition: str = "lent", timeout_s: float = 120.0) -> DemoCluster:
        """Reuse the cluster of ``deploy/local/slurm.sh`` (``GPUPOOL_STATE``) when it runs, else
        start one of ``nodes`` nodes with ``GraceTime`` = ``grace_s``. Blocking (run it in a
        thread). Raises :class:`SlurmUnavailable` when it cannot start, or when the running one
        lacks a node ``gpu-node-001``..``nodes`` or a ``partition`` partition."""
        t0 = time.monotonic()
        env = {**os.environ, "GPUPOOL_SLURM_NODES": str(nodes), "GPUPOOL_SLURM_GRACE": str(grace_s)}

        def script(action: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["bash", str(SLURM_SCRIPT), action], capture_output=True, text=True,
                                  timeout=timeout_s, env=env, check=False, cwd=REPO)

        try:
            running = script("status").returncode == 0
            done = script("start")
        except subprocess.TimeoutExpired as e:
            raise SlurmUnavailable(f"deploy/local/slurm.sh did not finish in {e.timeout} s") from e
        if done.returncode != 0 or not done.stdout.strip():
            raise SlurmUnavailable(f"deploy/local/slurm.sh start failed ({done.returncode}): "
                                   f"{(done.stderr or done.stdout).strip()[-600:]}")
        conf = Path(done.stdout.strip().splitlines()[-1])
        text = conf.read_text()
        graces = {p: float(g) for p, g in _GRACE.findall(text)}
        names = set(_NODE.findall(text))
        want = {f"gpu-node-{n + 1:03d}" for n in range(nodes)}
        cluster = cls(conf, graces.get(partition, float(grace_s)), not running, time.monotonic() - t0)
        if partition not in graces or not want <= names:
            cluster.close()
            raise SlurmUnavailable(f"the running Slurm cluster ({conf}) has no {partition!r} partition with a "
                                   f"GraceTime or lacks nodes {sorted(want - names)}")
        return cluster

    def close(self) -> None:
        """Stop the cluster if :attr:`started` (``deploy/local/slurm.sh stop``); otherwise leave it."""
        if self.started:
            subprocess.run(["bash", str(SLURM_SCRIPT), "stop"], capture_output=True, text=True, timeout=120,
                           check=False, cwd=REPO)


@dataclass
class TrainingRecord:
    """One training job the demo submitted: Slurm id, GPUs asked, wall times (Unix s)."""

    slurm_id: str
    gpus: int
    submitted: float
    started: float | None = None
    held: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Node → GRES indices Slurm allocated to it (first seen running)."""
    took_from_gpupool: bool = False
    """It started on a GPU a gpupool job (placeholder or lease) held while it waited."""


class AllocationHistory:
    """Which GPUs training jobs hold, over time: snapshots ``(t, keys)`` from Slurm's polls.
    Called as ``history(gpu_key, at) -> bool`` (held at wall time ``at``; before the first
    snapshot nothing is held). Also integrates GPU-seconds not held by training."""

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus
        self._times: list[float] = []
        self._held: list[frozenset[str]] = []

    def add(self, t: float, held: frozenset[str]) -> None:
        """Record that ``held`` (GPU keys) are the GPUs training jobs hold from ``t`` on."""
        self._times.append(t)
        self._held.append(held)

    def __call__(self, key: str, at: float) -> bool:
        i = bisect.bisect_right(self._times, at) - 1
        return i >= 0 and key in self._held[i]

    def latest(self) -> frozenset[str]:
        """The GPU keys training jobs held at the newest snapshot (none before the first)."""
        return self._held[-1] if self._held else frozenset()

    def free_gpu_seconds(self, t0: float, t1: float) -> float:
        """GPU-seconds in [t0, t1] no training job held (wall), from the snapshots."""
        total = 0.0
        for i, t in enumerate(self._times):
            a, b = max(t, t0), min(self._times[i + 1] if i + 1 < len(self._times) else t1, t1)
            if b > a:
                total += (b - a) * (self.gpus - len(self._held[i]))
        return total


class TrainingStream:
    """Submits ``jobs`` to Slurm's ``training`` partition at their compressed times and follows
    every job of the cluster.

    Args:
        client: Slurm's CLI on the demo's cluster; ``None`` for a subclass that reads another
            scheduler (:class:`gpupool.demo_kubernetes.PodStream`) and submits nothing.
        jobs: generated jobs (:meth:`simulator.training_jobs.TrainingWorkload.jobs`), submit order
            (none without a ``client``).
        compression: simulated seconds per wall second.
        out_dir: the jobs' output folder.
        gpu_keys: (node, GRES index) → the simulated GPU's key (nodes outside it are ignored).
        poll_s: seconds between two reads of ``scontrol show job -d -o``.
    """

    def __init__(self, client: SlurmClient | None, jobs: Sequence[TrainingJob], compression: float, out_dir: Path,
                 gpu_keys: Mapping[tuple[str, int], str], poll_s: float = 0.5) -> None:
        if client is None and jobs:
            raise ValueError("jobs to submit need a Slurm client")
        self.client = client
        self.jobs = list(jobs)
        self.compression = compression
        self.out_dir = out_dir
        self.gpu_keys = dict(gpu_keys)
        self.poll_s = poll_s
        self.history = AllocationHistory(len(self.gpu_keys))
        self.records: dict[str, TrainingRecord] = {}
        self.starts: dict[str, tuple[float, dict[str, tuple[int, ...]], bool]] = {}
        """Every training job (not a gpupool hold) seen running: Slurm id → (the first read that
        showed it running, Unix s; node → GRES indices it holds; whether a gpupool job, a
        placeholder or a lease hold, held one of those GPUs at the read before), whoever
        submitted it."""
        self.submit_errors = 0
        self._submitting: set[concurrent.futures.Future[str]] = set()
        """``sbatch`` calls running in a thread: one still running when the stream's task is
        cancelled (the demo stopping) submits a job no record holds (:meth:`cancel_all`)."""
        self._names: list[str] = []
        """Slurm job names of every job this stream tried to submit."""
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="demo-sbatch")
        self.t0: float | None = None
        self._gpupool: list[tuple[float, frozenset[str]]] = []
        """GPUs gpupool's jobs held, per read: (t, keys)."""

    async def run(self, stop: asyncio.Event) -> None:
        """Submit and poll until ``stop`` is set."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        await self._poll()
        pending = list(self.jobs)
        while not stop.is_set():
            now = time.time() - self.t0
            while pending and pending[0].submit_s / self.compression <= now:
                await self._submit(pending.pop(0))
            await self._poll()
            try:
                await asyncio.wait_for(stop.wait(), self.poll_s)
            except TimeoutError:
                pass

    async def _submit(self, job: TrainingJob) -> None:
        assert self.client is not None  # __init__: no jobs without a client
        self._names.append(f"train-{job.job_id}")  # the name SlurmClient.submit gives it
        running = self._pool.submit(self.client.submit, job, self.compression, self.out_dir)
        self._submitting.add(running)
        running.add_done_callback(self._submitting.discard)
        try:
            sid = await asyncio.wrap_future(running)
        except (ReplayError, subprocess.TimeoutExpired) as e:
            self.submit_errors += 1
            log.warning("demo_training_submit_failed", extra={"job": job.job_id, "error": str(e)[-300:]})
            return
        self.records[sid] = TrainingRecord(sid, job.gpus, time.time())
        log.info("demo_training_submitted", extra={"slurm_job_id": sid, "gpus": job.gpus})

    async def _poll(self) -> None:
        assert self.client is not None  # a stream without a Slurm client overrides this read
        # scontrol's own time format: the parser reads it (SlurmClient's epoch format is for squeue)
        env = {k: v for k, v in self.client.env.items() if k != "SLURM_TIME_FORMAT"}
        try:
            done = await asyncio.to_thread(subprocess.run, ["scontrol", "show", "job", "-d", "-o"],
                                           capture_output=True, text=True, timeout=self.client.timeout_s,
                                           env=env, check=False)
        except subprocess.TimeoutExpired:
            return
        if done.returncode != 0:
            log.warning("demo_slurm_poll_failed", extra={"error": done.stderr.strip()[-300:]})
            return
        jobs, problems = parse_records(done.stdout, parse_job)
        if problems:
            log.warning("demo_slurm_jobs_unparsed", extra={"lines": len(problems), "reason": problems[0].reason})
        self.observe(time.time(), jobs)

    def observe(self, t: float, jobs: Sequence[JobInfo]) -> None:
        """Fold one read of Slurm's jobs taken at ``t``: GPUs held by any job that is not a
        gpupool hold (:data:`contracts.scheduler.LENT_JOB_NAME`) count as training's; the demo's
        own jobs get their start time (the first read that shows them running)."""
        held: set[str] = set()
        lent: set[str] = set()
        started: list[TrainingRecord] = []
        for j in jobs:
            if j.state not in ("RUNNING", "COMPLETING"):
                continue
            keys = {self.gpu_keys[(h, i)] for h, idx in j.gpus_by_node.items() for i in idx if (h, i) in self.gpu_keys}
            if j.name == LENT_JOB_NAME:
                lent |= keys
                continue
            held |= keys
            if j.state == "RUNNING" and j.job_id not in self.starts:
                before = self._gpupool[-1][1] if self._gpupool else frozenset()
                self.starts[j.job_id] = (t, dict(j.gpus_by_node), bool(keys & before))
            rec = self.records.get(j.job_id)
            if rec is not None and rec.started is None and j.state == "RUNNING":
                rec.started, rec.held = t, dict(j.gpus_by_node)
                started.append(rec)
                # GPUs gpupool held while it waited (reads since its submission)
                rec.took_from_gpupool = any(keys & ks for ts, ks in self._gpupool if ts >= rec.submitted - self.poll_s)
        self.history.add(t, frozenset(held))
        self._gpupool.append((t, frozenset(lent)))

    def cancel_all(self, timeout_s: float = 30.0) -> None:
        """``scancel`` every job this stream submitted — also one whose ``sbatch`` was still
        running when the stream stopped (waited for, at most ``timeout_s``, then found by its
        name) — and every gpupool hold (:data:`contracts.scheduler.LENT_JOB_NAME`) submitted
        since the stream started: the cluster is left as the demo found it. Blocking."""
        assert self.client is not None  # a stream without a Slurm client overrides this
        concurrent.futures.wait(list(self._submitting), timeout=timeout_s)
        self._pool.shutdown(wait=False)
        done = self.client.run("squeue", "-h", "-n", ",".join([LENT_JOB_NAME, *self._names]), "-o", "%i|%V")
        since = (self.t0 or time.time()) - 1.0
        # by name, submitted since the stream started (a cluster shared with another run keeps its jobs)
        found = [i for i, v, *_ in (ln.split("|") for ln in done.stdout.split()) if v.isdigit() and int(v) >= since]
        self.client.cancel(*self.records, *found)


@dataclass
class SchedulerSummary:
    """What lending through Slurm did in the demo (GPU-hours simulated: wall × compression).

    Attributes:
        compression: simulated seconds per wall second of the training stream.
        gpu_hours_idle: GPU-hours no training job held.
        gpu_hours_lent: GPU-hours held by leases (grant → end, each GPU).
        training_submitted / training_started: the demo's training jobs.
        needed_lent: training jobs that started on GPUs gpupool held (an idle placeholder or a
            lease) while they waited: Slurm preempted gpupool's jobs for them.
        needed_lent_wait_p50_s / _max_s: their submit → start, wall seconds (0.5 s polls).
        needed_leased: of those, jobs that started on GPUs of a lease Slurm reclaimed for them.
        free_wait_p50_s: submit → start of the other started jobs, wall seconds (the yardstick).
        reclaimed_by_slurm: leases reclaimed because Slurm preempted their hold.
        notices_before_deadline / notices_seen: of those, notices a site received before the
            deadline the notice gave, and notices received at all.
        notice_lead_min_s: the shortest time from a notice's arrival to its deadline, seconds.
        grace_s: the lent partition's GraceTime (= the leases' notice).
    """

    compression: float
    gpu_hours_idle: float
    gpu_hours_lent: float
    training_submitted: int
    training_started: int
    needed_lent: int
    needed_lent_wait_p50_s: float | None
    needed_lent_wait_max_s: float | None
    needed_leased: int
    free_wait_p50_s: float | None
    reclaimed_by_slurm: int
    notices_before_deadline: int
    notices_seen: int
    notice_lead_min_s: float | None
    grace_s: float


def scheduler_summary(stream: TrainingStream, records: Sequence[LeaseLogRecord],
                      notices: Mapping[str, tuple[float, float | None, str]], locate: Mapping[str, tuple[str, int]],
                      t0: float, t1: float, grace_s: float) -> SchedulerSummary:
    """The summary of a run from ``t0`` to ``t1`` (Unix s): ``records`` the lease log,
    ``notices`` lease id → (received, deadline, reason) at the sites, ``locate`` GPU key →
    (node, GRES index)."""
    k = stream.compression / 3600.0
    last: dict[str, LeaseLogRecord] = {}
    reclaim: dict[str, LeaseLogRecord] = {}
    for r in records:
        last[r.lease_id] = r
        if r.state.value == "reclaiming" and r.reason.startswith("scheduler_preempted:"):
            reclaim.setdefault(r.lease_id, r)
    lent_s = 0.0
    for r in last.values():
        end = t1 if r.state.live else r.ts
        lent_s += max(0.0, min(end, t1) - max(r.granted_at, t0)) * len(r.gpus)
    # a training job needed lent GPUs when it runs on GPUs of a lease Slurm reclaimed while it waited
    reclaimed_gpus = [(locate.get(g), rec.ts) for rec in reclaim.values() for g in rec.gpus]
    needed: list[float] = []
    free: list[float] = []
    leased = 0
    for tr in stream.records.values():
        if tr.started is None:
            continue
        mine = {(h, i) for h, idx in tr.held.items() for i in idx}
        leased += any(where in mine and tr.submitted - 1.0 <= ts <= tr.started for where, ts in reclaimed_gpus)
        (needed if tr.took_from_gpupool else free).append(tr.started - tr.submitted)
    seen = [notices[lid] for lid in reclaim if lid in notices]
    leads = [dl - got for got, dl, _ in seen if dl is not None]
    return SchedulerSummary(
        compression=stream.compression,
        gpu_hours_idle=round(stream.history.free_gpu_seconds(t0, t1) * k, 2),
        gpu_hours_lent=round(lent_s * k, 2),
        training_submitted=len(stream.records),
        training_started=sum(1 for r in stream.records.values() if r.started is not None),
        needed_lent=len(needed),
        needed_lent_wait_p50_s=percentile(needed, 0.5),
        needed_lent_wait_max_s=max(needed) if needed else None,
        needed_leased=leased,
        free_wait_p50_s=percentile(free, 0.5),
        reclaimed_by_slurm=len(reclaim),
        notices_before_deadline=sum(1 for x in leads if x > 0),
        notices_seen=len(seen),
        notice_lead_min_s=min(leads) if leads else None,
        grace_s=grace_s,
    )


DEMO_WORKLOAD_PORTS = (28300, 28399)
"""Ports of the demo's simulated inference servers (one per lease, on the node = loopback here)."""


@dataclass
class SlurmParts:
    """What lending through Slurm adds to the demo's pipeline (:meth:`build`).

    Attributes:
        cluster: the cluster.
        stream: the training jobs and Slurm's allocations (the fleet's telemetry follows them).
        source: the collectors' Slurm source (``telemetry.scheduler``; analytics joins it).
        lending: the broker's :class:`broker.lending.SlurmLending` (placeholder holds, preemption).
        workload: the profile every simulated site names: the simulated inference server.
        notice_s: the leases' notice = the lent partition's GraceTime.
        poll_s: seconds between two reads of Slurm by the source and the stream.
    """

    cluster: DemoCluster
    stream: TrainingStream
    source: SlurmCollector
    lending: SlurmLending
    workload: WorkloadProfile
    notice_s: float
    poll_s: float
    locate: dict[str, tuple[str, int]]

    @classmethod
    def build(cls, cluster: DemoCluster, fleet: Fleet, bus: Bus, topics: KafkaTopics,
              registry: CollectorRegistry, out_dir: Path, *, load: float, compression: float, seed: int,
              horizon_s: float, poll_s: float = 0.5, submit: bool = True) -> SlurmParts:
        """Wire the parts for ``fleet`` (its hosts are the cluster's nodes; its telemetry starts
        following Slurm's training allocations). Training jobs: AcmeTrace's Seren fit on the
        fleet's GPUs at ``load``, ``horizon_s`` wall seconds of arrivals at ``compression``,
        with a day's warm start (the cluster starts busy); ``submit=False``: none (someone else
        submits training jobs, the stream only follows them). Raises ``FileNotFoundError`` if
        the AcmeTrace data is missing."""
        from broker.lending import SlurmLending
        from broker.placeholders import GpuMap
        from broker.scheduler_slurm import SlurmScheduler
        from broker.workloads import WorkloadProfile
        from collectors.metrics import SlurmMetrics
        from collectors.slurm_collector import SlurmCollector
        from simulator.training_jobs import TrainingWorkload, fit_workload, load_cluster_summary, load_utilisation_cdf

        keys = {(g.host, g.index): g.key for g in fleet.gpus()}
        workload = TrainingWorkload(fit_workload(load_cluster_summary("Seren")),
                                    load_utilisation_cdf("seren:GPU_UTIL"),
                                    cluster_gpus=len(keys), load=load, seed=seed)
        jobs = workload.jobs(horizon_s * compression, warm_start_s=86400.0) if submit else []
        stream = TrainingStream(SlurmClient(cluster.conf), jobs, compression, out_dir / "training", keys, poll_s)
        fleet.follow_scheduler(stream.history)
        profile = WorkloadProfile(
            name="infer",
            argv=(sys.executable, "-m", "simulator.inference_server", "--port", "{port}",
                  # drains through the notice while a site still sends (it moves its traffic first,
                  # then releases: the hold's end is the second SIGTERM); a pause in the requests (a
                  # busy machine) must not end it while the endpoint still takes traffic
                  "--drain-s", str(max(0.5, cluster.grace_s)), "--quiet-s", str(max(0.5, cluster.grace_s))),
            port_min=DEMO_WORKLOAD_PORTS[0], port_max=DEMO_WORKLOAD_PORTS[1], health_timeout_s=30,
        )  # fmt: skip
        lending = SlurmLending(
            SlurmScheduler(cluster.conf, output_dir=out_dir / "holds"),
            gpu_map=GpuMap({h: [fleet.gpu(h, i).uuid for i in range(fleet.gpus_per_node)] for h in fleet.hosts()}),
            workloads=(profile,), notice_s=cluster.grace_s, control_dir=out_dir / "broker", poll_s=0.25,
        )  # fmt: skip
        source = SlurmCollector(bus, topics, slurm_conf=cluster.conf, metrics=SlurmMetrics(registry))
        return cls(cluster, stream, source, lending, profile, cluster.grace_s, poll_s,
                   {k: hi for hi, k in keys.items()})

    async def close(self) -> None:
        """Cancel the training jobs and gpupool holds of this run (the cluster as found)."""
        await asyncio.to_thread(self.stream.cancel_all)
