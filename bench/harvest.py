"""Benchmark: harvest replay on the real Slurm cluster — training without lending (issue 14's baseline).

Starts a private Slurm cluster with ``deploy/local/slurm.sh`` (``--nodes`` × 8 GPUs, its own state
directory under a temporary folder), generates a training workload calibrated to one AcmeTrace
cluster's published job statistics (:mod:`simulator.training_jobs`), replays it on the ``training``
partition time-compressed (:mod:`simulator.slurm_replay`) and prints, in simulated time:

* the fit used (cluster row, size and run-time laws, arrival rate);
* jobs submitted / started / still pending at the end, final states as Slurm reports them;
* training queueing delay p50 / p95 / p99 (Slurm's StartTime - SubmitTime);
* the yardstick, measured first on the idle cluster: submit -> batch script start of a 0-second
  1-GPU job (Slurm's own start latency), and the replay's p95 against it;
* idle GPU-hours: unallocated (from the jobs' Slurm times, and from polled ``GresUsed``), and
  allocated-but-idle (GPUs held at 0 % utilisation) shown apart.

The "with gpupool" column (the same workload with the broker lending unallocated GPUs through the
``lent`` partition) is the second half of issue 14: the lender plugs in as an observer of
:func:`simulator.slurm_replay.replay`; this script runs the "without lending" column.

Run: ``.venv/bin/python bench/harvest.py [--nodes 16] [--hours 24] [--wall-minutes 20] [--load 0.8]
[--cluster Seren] [--seed 1] [--warmup-hours 0] [--json out.json]``. Exit 0 when the replay ran,
2 when the cluster could not start. The cluster is stopped at the end, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpupool.logs import setup_logging  # noqa: E402
from simulator.slurm_replay import SlurmClient, account, quantile, replay, start_latency  # noqa: E402
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


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the replay, print the table; the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default="Seren", help="AcmeTrace cluster row to calibrate to")
    ap.add_argument("--nodes", type=int, default=16, help="Slurm nodes, 8 GPUs each")
    ap.add_argument("--hours", type=float, default=24.0, help="simulated hours replayed (warm-up included)")
    ap.add_argument("--wall-minutes", type=float, default=20.0, help="wall-clock minutes the replay takes")
    ap.add_argument("--warmup-hours", type=float, default=0.0, help="simulated hours replayed, not measured")
    ap.add_argument("--warm-start-days", type=float, default=7.0,
                    help="start with the jobs an earlier span of this length leaves running (0: empty cluster)")
    ap.add_argument("--load", type=float, default=0.8, help="offered load: GPU-seconds asked per second / GPUs")
    ap.add_argument("--p-single", type=float, default=0.6, help="share of single-GPU jobs (>= 0.5)")
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
          f"{workload.idle_job_probability:.3f}; compression {compression:.1f}x", flush=True)

    with tempfile.TemporaryDirectory(prefix="gpupool-harvest-") as tmp:
        env = {**os.environ, "GPUPOOL_SLURM_DIR": str(Path(tmp) / "slurm"), "GPUPOOL_SLURM_NODES": str(args.nodes)}
        t = time.monotonic()
        started = _cluster("start", env)
        if started.returncode != 0:
            print(f"slurm did not start: {started.stderr[-2000:]}", file=sys.stderr)
            _cluster("stop", env)
            return 2
        print(f"slurm: {args.nodes} nodes up in {time.monotonic() - t:.1f} s", flush=True)
        try:
            client = SlurmClient(Path(started.stdout.strip().splitlines()[-1]))
            yardstick = start_latency(client, Path(tmp) / "yardstick")
            run = replay(client, jobs, compression=compression, horizon_s=horizon_s, cluster_gpus=gpus,
                         out_dir=Path(tmp) / "out", warmup_s=args.warmup_hours * 3600)
        finally:
            _cluster("stop", env)
        report = account(run, workload.idle_fraction)  # reads the jobs' output files
    late = sorted(run.late_submits_s)
    y50 = quantile(yardstick, 0.5) if yardstick else float("nan")
    p50, p95, p99 = report.queue_delay_s
    rows = [
        ("jobs submitted / started / pending at end",
         f"{report.jobs_submitted} / {report.jobs_started} / {report.jobs_pending_at_end}"),
        ("final states (Slurm)", ", ".join(f"{k or 'unseen'} {v}" for k, v in sorted(report.final_states.items()))),
        ("training queueing delay p50 / p95 / p99",
         f"{p50:.0f} / {p95:.0f} / {p99:.0f} s (Slurm times, resolution {report.queue_delay_resolution_s:.0f} s)"),
        ("  submit -> script start p50 / p95 / p99", "{:.0f} / {:.0f} / {:.0f} s".format(*report.script_delay_s)),
        ("  the same, wall", "{:.3f} / {:.3f} / {:.3f} s".format(*report.script_delay_wall_s)),
        ("  yardstick: idle cluster, wall p50 / max", f"{y50:.3f} / {max(yardstick):.3f} s ({len(yardstick)} jobs)"),
        ("  replay p95 / yardstick p50", f"{report.script_delay_wall_s[1] / y50:.2f}x"),
        ("GPU-hours in the window", f"{report.window_gpu_hours:.1f}"),
        ("idle GPU-hours, unallocated (job times)",
         f"{report.idle_unallocated_gpu_hours:.1f} ({report.idle_unallocated_gpu_hours / report.window_gpu_hours:.1%})"),
        ("idle GPU-hours, unallocated (GresUsed polls)", f"{report.idle_unallocated_sampled_gpu_hours:.1f}"),
        ("idle GPU-hours, allocated at 0 % (expected)", f"{report.allocated_idle_gpu_hours:.1f}"),
        ("share lent", "- (without lending)"),
    ]
    print(f"\n{'':46} without lending")
    for name, value in rows:
        print(f"{name:46} {value}")
    print(f"\npolls {run.polls} ({run.poll_errors} failed); submit lateness p50 {late[len(late) // 2]:.3f} s, "
          f"max {late[-1]:.3f} s (wall)" if late else "no jobs submitted")
    if args.json:
        args.json.write_text(json.dumps({"fit": fit.describe(), "nodes": args.nodes, "hours": args.hours,
                                         "compression": compression, "yardstick_s": yardstick,
                                         "report": asdict(report)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
