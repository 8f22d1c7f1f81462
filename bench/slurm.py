"""Benchmark: lending through Slurm — the training job that needs lent GPUs, and a lease's end.

Starts a private Slurm cluster with ``deploy/local/slurm.sh`` (its own state directory under a
temporary folder, ``GPUPOOL_SLURM_GRACE`` = the notice), then measures, in the same run, on every
node in parallel, for ``--rounds`` rounds:

* yardstick: a training job (``--gpus`` GPUs, partition ``training``) submitted to a node whose
  GPUs are free: submit -> RUNNING;
* lent: the same job submitted while a lease hold (:class:`broker.scheduler_slurm.SlurmScheduler`)
  holds all 8 GPUs of the node, with a workload that ignores SIGTERM (the worst case: the hold
  leaves only at the end of its notice): submit -> RUNNING, and the time from submit to gpupool
  seeing the hold preempted (``PreemptTime`` set);
* a lease's end: :meth:`SlurmScheduler.release` of a running hold -> Slurm lists it no more;
* a hold's start: :meth:`SlurmScheduler.hold` -> running on its GPUs (what a claim would wait for
  without placeholder holds).

It prints p50/p99 of each, the added time (lent - yardstick, per round and node) against the
target (<= notice + 5 s, p99 over at least 50 preemptions), and the release p99 against 1 s.
The cluster is stopped at the end, also on an error or Ctrl-C.

Run: ``.venv/bin/python bench/slurm.py [--rounds 13] [--notice-s 3] [--gpus 4]`` (4 nodes x 13
rounds = 52 preemptions). Needs Debian's slurmctld, slurmd, slurm-client and munge
(``deploy/local/install-system.sh``). Exit 0 when both targets are met, 1 otherwise, 2 when the
cluster could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.scheduler import HoldRequest, HoldState  # noqa: E402
from broker.scheduler_slurm import SlurmScheduler  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NODES = [f"gpu-node-00{i}" for i in (1, 2, 3, 4)]
IGNORES_TERM = ("bash", "-c", "trap '' TERM; while true; do sleep 0.1; done")


def _pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


class Cluster:
    """The private cluster: ``slurm.sh start|stop`` with its own state and grace time."""

    def __init__(self, state: Path, notice_s: int) -> None:
        self.env = {**os.environ, "GPUPOOL_SLURM_DIR": str(state), "GPUPOOL_SLURM_GRACE": str(notice_s)}
        self.conf = state / "slurm.conf"

    def script(self, action: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(REPO / "deploy/local/slurm.sh"), action], env=self.env,
                              capture_output=True, text=True, timeout=120, check=False)

    async def submit_training(self, host: str, gpus: int) -> str:
        proc = await asyncio.create_subprocess_exec(
            "sbatch", "--parsable", "-p", "training", "-w", host, f"--gres=gpu:h100:{gpus}", "-c", "1",
            "-o", "/dev/null", "--wrap", "sleep 600", stdout=asyncio.subprocess.PIPE,
            env={**self.env, "SLURM_CONF": str(self.conf)},
        )
        out, _ = await proc.communicate()
        return out.decode().strip()

    async def state(self, job: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "squeue", "-h", "-j", job, "-o", "%T", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, env={**self.env, "SLURM_CONF": str(self.conf)},
        )
        out, _ = await proc.communicate()
        return out.decode().strip() or "GONE"

    async def cancel(self, *jobs: str) -> None:
        proc = await asyncio.create_subprocess_exec("scancel", *jobs, env={**self.env, "SLURM_CONF": str(self.conf)})
        await proc.wait()

    async def until_running(self, job: str, t0: float, timeout_s: float = 120.0) -> float:
        while time.monotonic() - t0 < timeout_s:
            if await self.state(job) == "RUNNING":
                return time.monotonic() - t0
            await asyncio.sleep(0.02)
        raise RuntimeError(f"job {job} not RUNNING within {timeout_s} s")


async def _round(cluster: Cluster, sched: SlurmScheduler, host: str, n: int, gpus: int, notice_s: int,
                 out: dict[str, list[float]]) -> None:
    # Yardstick: the node's GPUs are free.
    t0 = time.monotonic()
    job = await cluster.submit_training(host, gpus)
    out["free"].append(await cluster.until_running(job, t0))
    await cluster.cancel(job)
    while await cluster.state(job) not in ("GONE", "COMPLETED", "CANCELLED"):
        await asyncio.sleep(0.05)
    # A hold of every GPU of the node, then the same training job.
    lease = f"bench-{host}-{n}"
    t0 = time.monotonic()
    await sched.hold(HoldRequest(lease, host, 8, time.time() + 3600, notice_s, IGNORES_TERM), timeout_s=60)
    out["hold"].append(time.monotonic() - t0)
    t0 = time.monotonic()
    job = await cluster.submit_training(host, gpus)
    seen = False
    while True:
        if not seen:
            h = (await sched.holds()).get(lease)
            if h is not None and h.state is HoldState.PREEMPTED:
                out["observed"].append(time.monotonic() - t0)
                seen = True
                await sched.confirm_notice(h)  # what the broker does when it sees a preemption
            elif h is None:  # gone before it was ever seen preempted: a notice gpupool missed
                out["missed"].append(time.monotonic() - t0)
                seen = True
        if await cluster.state(job) == "RUNNING":
            out["lent"].append(time.monotonic() - t0)
            break
        if time.monotonic() - t0 > 120:
            raise RuntimeError(f"training job {job} on {host} never ran")
        await asyncio.sleep(0.02)
    await cluster.cancel(job)
    while await cluster.state(job) not in ("GONE", "COMPLETED", "CANCELLED"):
        await asyncio.sleep(0.05)
    # A lease's end: hold, release, gone.
    lease = f"bench-rel-{host}-{n}"
    await sched.hold(HoldRequest(lease, host, gpus, time.time() + 3600, notice_s), timeout_s=60)
    t0 = time.monotonic()
    await sched.release(lease)
    out["release"].append(time.monotonic() - t0)


async def _main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-slurm-") as tmp:
        cluster = Cluster(Path(tmp) / "slurm", args.notice_s)
        started = cluster.script("start")
        if started.returncode != 0:
            print(started.stderr, file=sys.stderr)
            return 2
        try:
            sched = SlurmScheduler(cluster.conf)
            out: dict[str, list[float]] = {k: [] for k in ("free", "lent", "observed", "missed", "release", "hold")}
            for n in range(args.rounds):
                await asyncio.gather(*(_round(cluster, sched, h, n, args.gpus, args.notice_s, out) for h in NODES))
                print(f"round {n + 1}/{args.rounds}: {len(out['lent'])} preemptions", file=sys.stderr, flush=True)
        finally:
            cluster.script("stop")
    added = [lent - free for lent, free in zip(out["lent"], out["free"], strict=True)]
    rows = [
        ("training job, GPUs free (yardstick)", out["free"]),
        ("training job, GPUs lent (ignores TERM)", out["lent"]),
        ("added by lending", added),
        ("submit -> hold seen preempted", out["observed"]),
        ("hold -> running on its GPUs", out["hold"]),
        ("release -> hold gone", out["release"]),
    ]
    print(f"\nSlurm lending, {len(added)} preemptions, notice {args.notice_s} s, {args.gpus} GPUs per training job")
    print(f"{'':42} {'p50 s':>8} {'p99 s':>8}")
    for name, values in rows:
        print(f"{name:42} {statistics.median(values):8.3f} {_pct(values, 0.99):8.3f}")
    added_ok = _pct(added, 0.99) <= args.notice_s + 5.0 and len(added) >= 50
    release_ok = _pct(out["release"], 0.99) <= 1.0
    print(f"added p99 {_pct(added, 0.99):.3f} s vs target notice + 5 = {args.notice_s + 5:.1f} s: "
          f"{'met' if added_ok else 'MISSED'}")
    print(f"release p99 {_pct(out['release'], 0.99):.3f} s vs target 1 s: {'met' if release_ok else 'MISSED'}")
    print(f"preemptions gpupool did not see before the hold was gone: {len(out['missed'])}")
    print(f"ratio lent/free p50: {statistics.median(out['lent']) / statistics.median(out['free']):.2f}x")
    return 0 if added_ok and release_ok and not out["missed"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=13)
    p.add_argument("--notice-s", type=int, default=3)
    p.add_argument("--gpus", type=int, default=4)
    return asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
