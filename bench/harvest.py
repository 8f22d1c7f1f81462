"""Benchmark: harvest replay on a real scheduler (Slurm, or Kubernetes with Kueue) — the same
training workload without lending, then with gpupool lending its idle GPUs (issues 14 and 16).

``--scheduler slurm`` (the default) starts a private Slurm cluster with ``deploy/local/slurm.sh``
(``--nodes`` × 8 GPUs, its own state directory under a temporary folder, the ``lent`` partition's
GraceTime = ``--notice``); ``--scheduler kubernetes`` a private control plane with
``deploy/local/kubernetes.sh`` (``--nodes`` kwok nodes × 8 ``nvidia.com/gpu``, Kueue's
ClusterQueue and LocalQueue ``training``). It generates a training workload calibrated to one
AcmeTrace cluster's published job statistics (:mod:`simulator.training_jobs`) and replays it
time-compressed (:mod:`simulator.replay`: on Slurm's ``training`` partition through
:mod:`simulator.slurm_replay`, as Kueue-admitted Jobs through :mod:`simulator.kubernetes_replay`)
twice:

1. without lending: the cluster holds only the training jobs;
2. with gpupool: the whole pipeline (:mod:`gpupool.harvest`, :func:`gpupool.demo.run_demo` in a
   process of its own) lends through the same cluster — simulated DCGM telemetry follows Slurm's
   training allocations, the Slurm collector feeds analytics (which holds back GPUs the
   scheduler's plan needs and warns leases at risk), the broker holds lendable GPUs with
   placeholder jobs in ``lent`` and Slurm's partition preemption takes them back with GraceTime
   as the notice (on Kubernetes, :mod:`gpupool.demo_kubernetes`: telemetry follows the training
   pods, the Kubernetes source reads pods and Kueue's pending workloads, the broker holds GPUs
   with placeholder pods and kube-scheduler's priority preemption takes them back with the
   notice as grace period); three simulated edge sites claim with a diurnal inference demand
   (:class:`simulator.sites.DiurnalDemand`, ``--demand-peak`` / ``--demand-trough`` of the
   cluster's GPUs in all, leases of up to ``--lease-gpus`` GPUs, the first site asking for window
   leases, the others for preemptible ones, every site releasing a lease as soon as it is at
   risk and, below its demand, claiming as soon as an offer arrives; ``--no-claim-on-offer``:
   every 0.5 s wall).

It prints, in simulated time unless marked wall, one table: idle GPU-hours (unallocated, and
allocated-but-idle apart) and the share lent; training queueing delay p50/p95/p99 without and with
lending and the difference; the scheduler's preemption of a lease → the training job running, p50/p99 (wall);
GPUs taken back ÷ GPUs training used (disruption); window leases ended before their promised window;
leases that outlived their notice; and the targets of issue 14 (met, or the gap). On Slurm two
tables follow (:mod:`gpupool.harvest_causes`): the unallocated idle GPU-hours not lent, by cause
(GPU-hours and share, summing to the unallocated idle GPU-hours less those lent), and the GPUs
taken back that no training job started on, by cause.

Run: ``.venv/bin/python bench/harvest.py [--scheduler slurm|kubernetes] [--nodes 16] [--hours 24] [--wall-minutes 20] [--load 0.8]
[--notice 2] [--lease-gpus 1] [--parallel-claims 4] [--no-claim-on-offer] [--demand-peak 0.5] [--demand-trough 0.25] [--start-hour 0] [--cluster Seren] [--seed 1] [--warmup-hours 0] [--without-only] [--without-from earlier.json]
[--keep DIR] [--json out.json]``;
a small slice: ``--nodes 4 --hours 2 --wall-minutes 3``. Exit 0 when the replays ran, 2 when the
cluster could not start, 3 when the pipeline failed. The cluster is stopped at the end, also on an
error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpupool.logs import setup_logging  # noqa: E402
from simulator.kubernetes_replay import KubernetesClient  # noqa: E402
from simulator.replay import ReplayReport, account, quantile, replay, start_latency  # noqa: E402
from simulator.slurm_replay import SlurmClient  # noqa: E402
from simulator.training_jobs import (  # noqa: E402
    GPUS_PER_NODE,
    TrainingWorkload,
    compression_for,
    fit_workload,
    load_cluster_summary,
    load_utilisation_cdf,
)

REPO = Path(__file__).resolve().parents[1]


def _cluster(action: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``deploy/local/slurm.sh <action>`` with ``env``."""
    return subprocess.run(["bash", str(REPO / "deploy/local/slurm.sh"), action], env=env,
                          capture_output=True, text=True, timeout=180, check=False)


def _pipeline_config(args: argparse.Namespace, attach: dict, state: Path, compression: float, wall_s: float):
    """The :class:`gpupool.demo.DemoConfig` of the "with gpupool" run; ``attach``: the fields that
    attach it to the replay's cluster."""
    from contracts import LeaseKind
    from gpupool.demo import DemoConfig
    from gpupool.demo_fabric import FabricMode
    from simulator.sites import DiurnalDemand

    gpus = args.nodes * GPUS_PER_NODE
    sites = ("edge-a", "edge-b", "edge-c")
    demand = DiurnalDemand(peak_gpus=math.ceil(args.demand_peak * gpus / len(sites)),
                           trough_gpus=math.ceil(args.demand_trough * gpus / len(sites)),
                           compression=compression, start_hour=args.start_hour)
    return DemoConfig(
        duration_s=wall_s, nodes=args.nodes, gpus_per_node=GPUS_PER_NODE, seed=args.seed, state_dir=state,
        training_submit=False, training_compression=compression, **attach,
        fabric=FabricMode.OFF, sites=sites, site_demand=demand, site_release_on_at_risk=True,
        site_lease_gpus=args.lease_gpus, site_claim_every_s=0.5, site_parallel_claims=args.parallel_claims,
        site_claim_on_offer=args.claim_on_offer,
        site_lease_kinds=(LeaseKind.WINDOW, LeaseKind.PREEMPTIBLE, LeaseKind.PREEMPTIBLE),
        offer_ttl_s=20.0, cause_sample_s=0.5 if args.scheduler == "slurm" else None,
        # the fabric is off: 16 nodes' InfiniBand sysfs trees, written and read every scrape, took
        # half the pipeline process's CPU (one GIL with every stage) and delayed its telemetry
        sysfs_interval_s=5.0,
        plan_lead_s=args.notice + 5.0 if args.plan_lead is None else args.plan_lead,
    )


def _with_gpupool(args, cluster, jobs, tmp: Path, compression: float, horizon_s: float, gpus: int):
    """Start Mosquitto, run the pipeline (attached to ``cluster``: :class:`SlurmCluster` or
    :class:`KubernetesCluster`) in its own process and the replay here; (run, pipeline summary)."""
    wall_s = horizon_s / compression
    out = tmp / "pipeline.json"
    cfg = _pipeline_config(args, cluster.attach(), tmp / "demo", compression, wall_s + 5.0)
    # Mosquitto in a process of its own (the embedded broker would share the pipeline's GIL)
    mqtt_env = {**os.environ, "GPUPOOL_STATE": str(tmp / "mqtt")}
    mqtt = subprocess.run(["bash", str(REPO / "deploy/local/mosquitto.sh"), "start"], env=mqtt_env,
                          capture_output=True, text=True, timeout=120, check=False)
    if mqtt.returncode == 0 and mqtt.stdout.strip():
        cfg.mqtt = mqtt.stdout.strip().splitlines()[-1]
        cfg.mqtt_credentials = tmp / "mqtt" / "mosquitto" / "credentials.json"
        print(f"mosquitto at {cfg.mqtt}", flush=True)
    else:
        print(f"mosquitto did not start, the embedded MQTT broker is used: {mqtt.stderr[-300:]}", flush=True)
    try:
        return _run_with(args, cluster, cfg, jobs, tmp, out, compression, horizon_s, gpus, wall_s)
    finally:
        subprocess.run(["bash", str(REPO / "deploy/local/mosquitto.sh"), "stop"], env=mqtt_env,
                       capture_output=True, text=True, timeout=60, check=False)


def _run_with(args, cluster, cfg, jobs, tmp: Path, out: Path, compression: float, horizon_s: float,
              gpus: int, wall_s: float):
    """The pipeline in its own process, the replay here; (run, pipeline summary)."""
    from gpupool.harvest import start_pipeline

    proc, ready = start_pipeline(cfg, out)
    try:
        said = ready.get(timeout=300)
    except Exception:  # noqa: BLE001 — queue.Empty: the pipeline did not start in time
        said = "failed: no start within 300 s"
    if said != "started":
        proc.join(30)
        raise RuntimeError(f"the gpupool pipeline did not start: {said}")
    try:
        with cluster.client() as client:
            run = replay(client, jobs, compression=compression, horizon_s=horizon_s, cluster_gpus=gpus,
                         out_dir=tmp / "out-lending", warmup_s=args.warmup_hours * 3600)
    finally:
        proc.join(wall_s + 180)
        if proc.is_alive():
            proc.terminate()
            proc.join(30)
    summary = json.loads(out.read_text()) if out.exists() else {"error": "no summary written"}
    if "error" in summary:
        raise RuntimeError(f"the gpupool pipeline failed: {summary['error']}")
    return run, summary


def _pcts(values: list[float]) -> str:
    if not values:
        return "- (none)"
    return f"{quantile(values, 0.5):.2f} / {quantile(values, 0.99):.2f} s wall ({len(values)})"


def _table(base, lent, fig, notice_s: float, compression: float) -> list[tuple[str, str, str, str]]:
    """Rows (figure, without lending, with gpupool, difference / target) of the harvest table."""
    share = fig.lent_gpu_hours / lent.idle_unallocated_gpu_hours if lent.idle_unallocated_gpu_hours else 0.0
    d95 = lent.queue_delay_s[1] - base.queue_delay_s[1]
    bound = max(0.02 * base.queue_delay_s[1], (notice_s + 5.0) * compression)
    disruption = fig.disruption
    run99 = quantile(fig.preempt_to_running_s, 0.99) if fig.preempt_to_running_s else None

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    def pct(r) -> str:
        return "{:.0f} / {:.0f} / {:.0f} s".format(*r.queue_delay_s)

    return [
        ("GPU-hours in the window", f"{base.window_gpu_hours:.1f}", f"{lent.window_gpu_hours:.1f}", ""),
        ("idle GPU-hours, unallocated",
         f"{base.idle_unallocated_gpu_hours:.1f} ({base.idle_unallocated_gpu_hours / base.window_gpu_hours:.1%})",
         f"{lent.idle_unallocated_gpu_hours:.1f} ({lent.idle_unallocated_gpu_hours / lent.window_gpu_hours:.1%})",
         ""),
        ("idle GPU-hours, allocated at 0 % (apart)", f"{base.allocated_idle_gpu_hours:.1f}",
         f"{lent.allocated_idle_gpu_hours:.1f}", "not lent (training holds them)"),
        ("GPU-hours lent (leases)", "-", f"{fig.lent_gpu_hours:.1f}", ""),
        ("share of unallocated idle lent", "-", f"{share:.1%}", f">= 60 %: {met(share >= 0.6)}"),
        ("training queueing delay p50 / p95 / p99", pct(base), pct(lent),
         "{:+.0f} / {:+.0f} / {:+.0f} s".format(*(w - b for w, b in zip(lent.queue_delay_s, base.queue_delay_s,
                                                                          strict=True)))),
        ("  added p95 vs bound", "", f"{d95:+.0f} s",
         f"<= max(2 % of {base.queue_delay_s[1]:.0f}, (notice {notice_s:g} + 5 s) x {compression:.0f}) = "
         f"{bound:.0f} s: {met(d95 <= bound)}"),
        ("jobs submitted / pending at end", f"{base.jobs_submitted} / {base.jobs_pending_at_end}",
         f"{lent.jobs_submitted} / {lent.jobs_pending_at_end}", ""),
        ("training jobs that needed gpupool's GPUs", "-", f"{fig.needed_gpupool} ({fig.needed_leased} leased)",
         "started on GPUs a placeholder or lease held"),
        ("leases granted / scheduler-preempted / at risk", "-", f"{fig.leases} / {fig.preempted} / {fig.at_risk}", ""),
        ("scheduler preemption -> training RUNNING p50 / p99", "-", _pcts(fig.preempt_to_running_s),
         f"notice {notice_s:g} s" + (f"; p99 <= notice + 5 s: {met(run99 <= notice_s + 5)}" if run99 is not None
                                     else "")),
        ("GPUs taken back / GPUs training used", "-",
         f"{fig.gpus_taken_back} / {fig.gpus_needed}" + (f" = {disruption:.2f}" if disruption is not None else ""),
         "<= 1.1: " + (met(disruption <= 1.1) if disruption is not None else "nothing taken back")),
        ("window leases ended before their window", "-", f"{fig.window_broken} of {fig.window_leases}", ""),
        ("leases that outlived the notice", "-", f"{fig.outlived_notice}", "0 expected"),
        ("  of which GPU already running training", "-", f"{fig.outlived_gpu_back}",
         "only the lease log's end came late"),
        ("leases whose hold was lost (no notice)", "-", f"{fig.hold_lost}", "ended without Slurm choosing them"),
        ("training starts on a lease without notice", "-", f"{fig.unnoticed_starts}", "0 expected"),
    ]


class SlurmCluster:
    """A private Slurm cluster (``deploy/local/slurm.sh``, state under ``tmp``) of ``args.nodes``
    nodes; the ``lent`` partition's GraceTime is ``args.notice``."""

    resolution_s = 1.0
    """Slurm's times are whole seconds."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.env = {**os.environ, "GPUPOOL_SLURM_DIR": str(tmp / "slurm"), "GPUPOOL_SLURM_NODES": str(args.nodes),
                    "GPUPOOL_SLURM_GRACE": str(args.notice)}
        self.conf: Path | None = None

    def start(self) -> str | None:
        """Start it; None, or what went wrong."""
        started = _cluster("start", self.env)
        if started.returncode != 0:
            return started.stderr[-2000:]
        self.conf = Path(started.stdout.strip().splitlines()[-1])
        return None

    def stop(self) -> None:
        """Stop it (also after a failed start)."""
        _cluster("stop", self.env)

    @contextlib.contextmanager
    def client(self) -> Iterator[SlurmClient]:
        """A :class:`simulator.slurm_replay.SlurmClient` of the cluster."""
        assert self.conf is not None, "start() first"
        yield SlurmClient(self.conf)

    def attach(self) -> dict:
        """The :class:`gpupool.demo.DemoConfig` fields that lend through this cluster."""
        from gpupool.demo_slurm import SchedulerMode

        return {"scheduler": SchedulerMode.SLURM, "slurm_conf": self.conf}


class KubernetesCluster:
    """A private Kubernetes control plane (``deploy/local/kubernetes.sh``, state under ``tmp``)
    of ``args.nodes`` kwok nodes × 8 GPUs, Kueue's ClusterQueue ``training`` holding them all."""

    resolution_s = 0.001
    """Starts and ends are the pod watch's arrival times."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.env = {**os.environ, "GPUPOOL_K8S_DIR": str(tmp / "kubernetes"), "GPUPOOL_K8S_NODES": str(args.nodes),
                    "GPUPOOL_K8S_GPUS": str(GPUS_PER_NODE)}
        self.kubeconfig: Path | None = None

    def _script(self, action: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(REPO / "deploy/local/kubernetes.sh"), action], env=self.env,
                              capture_output=True, text=True, timeout=1800, check=False)

    def start(self) -> str | None:
        """Start it (building the binaries first when they are not cached); None, or what went wrong."""
        started = self._script("start")
        if started.returncode != 0:
            return started.stderr[-2000:]
        self.kubeconfig = Path(started.stdout.strip().splitlines()[-1])
        return None

    def stop(self) -> None:
        """Stop it (also after a failed start)."""
        self._script("stop")

    @contextlib.contextmanager
    def client(self) -> Iterator[KubernetesClient]:
        """A started :class:`simulator.kubernetes_replay.KubernetesClient` of the cluster (its own
        run tag: two replays never share a Job name), closed after."""
        assert self.kubeconfig is not None, "start() first"
        with KubernetesClient(self.kubeconfig) as c:
            yield c

    def attach(self) -> dict:
        """The :class:`gpupool.demo.DemoConfig` fields that lend through this cluster (the lent
        pods' grace period = ``--notice``)."""
        return {"kubeconfig": self.kubeconfig, "notice_s": float(self.args.notice)}

CLUSTERS = {"slurm": SlurmCluster, "kubernetes": KubernetesCluster}
"""``--scheduler`` → the private cluster the replays run on."""


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the replays, print the table; the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default="Seren", help="AcmeTrace cluster row to calibrate to")
    ap.add_argument("--scheduler", choices=sorted(CLUSTERS), default="slurm", help="the training pool's scheduler")
    ap.add_argument("--nodes", type=int, default=16, help="nodes, 8 GPUs each")
    ap.add_argument("--hours", type=float, default=24.0, help="simulated hours replayed (warm-up included)")
    ap.add_argument("--wall-minutes", type=float, default=20.0, help="wall-clock minutes each replay takes")
    ap.add_argument("--warmup-hours", type=float, default=0.0, help="simulated hours replayed, not measured")
    ap.add_argument("--warm-start-days", type=float, default=7.0,
                    help="start with the jobs an earlier span of this length leaves running (0: empty cluster)")
    ap.add_argument("--load", type=float, default=0.8, help="offered load: GPU-seconds asked per second / GPUs")
    ap.add_argument("--p-single", type=float, default=0.6, help="share of single-GPU jobs (>= 0.5)")
    ap.add_argument("--notice", type=int, default=2,
                    help="a lease's notice, wall s (Slurm: the lent partition's GraceTime; Kubernetes: the lent "
                         "pods' termination grace period)")
    ap.add_argument("--plan-lead", type=float, default=None,
                    help="wall seconds before a pending job's planned start that the GPUs its plan needs "
                         "stop being lent (default: the notice + 5 s; inf: nothing planned is lent)")
    ap.add_argument("--demand-peak", type=float, default=0.5, help="edge demand at its peak, share of the GPUs")
    ap.add_argument("--demand-trough", type=float, default=0.25, help="edge demand at its trough, share of the GPUs")
    ap.add_argument("--lease-gpus", type=int, default=1,
                    help="most GPUs per lease a site claims (Slurm takes a lease back whole)")
    ap.add_argument("--parallel-claims", type=int, default=4,
                    help="claims a site sends at once while below its demand, each on another node's offer")
    ap.add_argument("--claim-on-offer", action=argparse.BooleanOptionalAction, default=True,
                    help="a site below its demand claims as soon as an offer arrives (else every 0.5 s wall)")
    ap.add_argument("--start-hour", type=float, default=0.0, help="simulated hour of day the replay starts at")
    ap.add_argument("--without-only", action="store_true", help="run only the replay without lending")
    ap.add_argument("--without-from", type=Path,
                    help="take the figures without lending from this earlier --json report of the same arguments "
                         "(that replay is not run again)")
    ap.add_argument("--keep", type=Path, help="copy the pipeline's files (lease log, training starts, cause "
                                               "samples) into this folder")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = ap.parse_args(argv)
    setup_logging("INFO", sys.stderr)

    summary = load_cluster_summary(args.cluster)
    fit = fit_workload(summary, args.p_single)
    gpus = args.nodes * GPUS_PER_NODE
    series = f"{args.cluster.lower()}:GPU_UTIL"
    workload = TrainingWorkload(fit, load_utilisation_cdf(series), cluster_gpus=gpus, load=args.load, seed=args.seed)
    horizon_s = args.hours * 3600
    compression = compression_for(horizon_s, args.wall_minutes * 60)
    jobs = workload.jobs(horizon_s, args.warm_start_days * 86400)
    carried = sum(j.carried_over for j in jobs)
    print(fit.describe())
    print(f"replay cluster {args.nodes} nodes x {GPUS_PER_NODE} GPUs; sizes up to {workload.sizes.sizes[-1]} GPUs, "
          f"mean {workload.sizes.mean:.2f}; load {args.load}: {workload.arrival_rate_per_s * 3600:.1f} jobs/h, "
          f"{len(jobs) - carried} jobs in {args.hours:g} h + {carried} running at the start (warm start "
          f"{args.warm_start_days:g} d); utilisation {series}: P(job idle all its life) = "
          f"{workload.idle_job_probability:.3f}; compression {compression:.1f}x; notice {args.notice} s wall; "
          f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start", flush=True)

    with tempfile.TemporaryDirectory(prefix="gpupool-harvest-") as tmp_name:
        tmp = Path(tmp_name)
        cluster = CLUSTERS[args.scheduler](args, tmp)
        t = time.monotonic()
        failed = cluster.start()
        if failed is not None:
            print(f"{args.scheduler} did not start: {failed}", file=sys.stderr)
            cluster.stop()
            return 2
        print(f"{args.scheduler}: {args.nodes} nodes up in {time.monotonic() - t:.1f} s", flush=True)
        loads: list[float] = []
        lending = None
        try:
            base_run = None
            if args.without_from is None:
                with cluster.client() as client:
                    yardstick = start_latency(client, tmp / "yardstick")
                    base_run = replay(client, jobs, compression=compression, horizon_s=horizon_s,
                                      cluster_gpus=gpus, out_dir=tmp / "out", warmup_s=args.warmup_hours * 3600)
            loads.append(os.getloadavg()[0])
            if not args.without_only:
                try:
                    lending = _with_gpupool(args, cluster, jobs, tmp, compression, horizon_s, gpus)
                except RuntimeError as e:
                    print(str(e), file=sys.stderr)
                    return 3
                loads.append(os.getloadavg()[0])
        finally:
            cluster.stop()
            if args.keep is not None and (tmp / "demo").is_dir():
                shutil.copytree(tmp / "demo", args.keep, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("*.duckdb*", "slurm-*", "mosquitto-*"))
        if base_run is None:
            earlier = json.loads(args.without_from.read_text())
            base, yardstick = ReplayReport(**earlier["without"]), earlier["yardstick_s"]
            loads[0] = earlier["load_average"][0]
            print(f"\nwithout lending: from {args.without_from} (not run again); load average then {loads[0]:.1f}")
        else:
            base = account(base_run, workload.idle_fraction, cluster.resolution_s)
            late = sorted(base_run.late_submits_s)
            y50 = quantile(yardstick, 0.5) if yardstick else float("nan")
            d50, d95, d99 = base.began_delay_s
            print(f"\nwithout lending: final states {dict(sorted(base.final_states.items()))}; submit -> work began "
                  f"p50/p95/p99 {d50:.0f} / {d95:.0f} / {d99:.0f} s; wall p95 {base.began_delay_wall_s[1]:.3f} s = "
                  f"{base.began_delay_wall_s[1] / y50:.2f}x the idle-cluster yardstick (p50 {y50:.3f} s); polls "
                  f"{base_run.polls} ({base_run.poll_errors} failed); submit lateness max "
                  f"{late[-1] if late else 0.0:.3f} s wall; load average {loads[0]:.1f}")
        report: dict[str, object] = {"fit": fit.describe(), "scheduler": args.scheduler, "nodes": args.nodes,
                                     "hours": args.hours, "load_average": loads,
                                     "compression": compression, "notice_s": args.notice, "yardstick_s": yardstick,
                                     "without": asdict(base)}
        if lending is not None:
            from gpupool.harvest import figures_dict, lending_figures, read_run

            run, summary = lending
            lent = account(run, workload.idle_fraction, cluster.resolution_s)
            records, starts, locate = read_run(summary)
            fig = lending_figures(records, starts, locate, run.window_wall, compression)
            late = sorted(run.late_submits_s)
            sites = {k: {c: v for c, v in st.items() if c in ("leases_granted", "at_risk_seen", "released_at_risk",
                                                              "reclaims_seen", "revoked")}
                     for k, st in summary.get("sites", {}).items()}  # fmt: skip
            d50, d95, d99 = lent.began_delay_s
            print(f"with gpupool: final states {dict(sorted(lent.final_states.items()))}; submit -> work began "
                  f"p50/p95/p99 {d50:.0f} / {d95:.0f} / {d99:.0f} s; polls {run.polls} ({run.poll_errors} failed); "
                  f"submit lateness max {late[-1] if late else 0.0:.3f} s wall; load average {loads[-1]:.1f}; "
                  f"offers {summary.get('offers')} ({summary.get('offer_violations')} for a busy GPU); sites {sites}")
            rows = _table(base, lent, fig, float(args.notice), compression)
            report |= {"with": asdict(lent), "lending": figures_dict(fig), "pipeline": summary}
            report |= _causes(summary, records, starts, locate, run.window_wall, compression, lent, fig)
        else:
            rows = [(name, w, "-", "") for name, w, _, _ in _table(base, base, _no_lending(), float(args.notice),
                                                                    compression)[:3]]
        report["table"] = rows
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"\n{'':46} {'without lending':28} {'with gpupool':28} difference / target")
        for name, without, with_, diff in rows:
            print(f"{name:46} {without:28} {with_:28} {diff}")
        if "unlent_causes" in report:
            _print_causes(report)
    return 0


def _causes(summary, records, starts, locate, window, compression: float, lent, fig) -> dict[str, object]:
    """The report's ``unlent_causes`` (cause → GPU-hours, summing to the unallocated idle GPU-hours
    not lent), ``lent_by_reads`` and ``unallocated_by_reads`` (GPU-hours, the pipeline's samples)
    and ``disruption_causes`` (cause → GPUs taken back and not used); empty without samples."""
    from gpupool.harvest_causes import cause_gpu_hours, disruption_causes, read_timeline, unlent_rows

    path = summary.get("cause_timeline_file")
    if not path:
        return {}
    hours = cause_gpu_hours(read_timeline(Path(path)), window, compression)
    return {"unlent_causes": dict(unlent_rows(hours, lent.idle_unallocated_gpu_hours, fig.lent_gpu_hours)),
            "lent_by_reads": hours.get("lent", 0.0), "unallocated_by_reads": sum(hours.values()),
            "disruption_causes": disruption_causes(records, starts, locate, window)}


def _print_causes(report: dict) -> None:
    """Print the cause tables of :func:`_causes`."""
    causes: dict[str, float] = report["unlent_causes"]
    total = sum(causes.values())
    print(f"\nunallocated idle GPU-hours not lent, by cause ({total:.1f} GPU-hours; the pipeline's reads count "
          f"{report['unallocated_by_reads']:.1f} unallocated, {report['lent_by_reads']:.1f} lent)")
    for cause, h in causes.items():
        print(f"  {cause:44} {h:8.1f} {h / total if total else 0.0:7.1%}")
    dis: dict[str, int] = report["disruption_causes"]
    lend = report["lending"]
    print(f"\nGPUs taken back that no training job started on within notice + 5 s: "
          f"{lend['gpus_taken_back'] - lend['gpus_needed']} of {lend['gpus_taken_back']}")
    for cause, n in dis.items():
        print(f"  {cause:44} {n:8d}")


def _no_lending():
    from gpupool.harvest import LendingFigures

    return LendingFigures(0, 0.0, 0, [], 0, 0, 0, 0, 0, 0, 0, 0)


if __name__ == "__main__":
    sys.exit(main())
