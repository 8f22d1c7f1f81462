"""Benchmark: one FabricCollector counter sweep over a 100-switch simulated fabric (target <= 5 s).

Starts a private fabric with ``deploy/local/fabric.sh`` (ibsim + OpenSM, a two-level fat tree from
``deploy/local/fabric/gen_topology.py``; default 20 spines × 80 leaves × 16 HCAs per leaf = 100
switches, 1281 HCAs, 4481 connected switch ports) in its own temporary state directory
(``GPUPOOL_STATE`` and ``GPUPOOL_FABRIC_DIR`` set, so its ibsim socket name is its own and the
shared ``.state/`` fabric is never touched), then measures in the same run, switches only:

* yardstick: a plain shell loop running ``perfquery -x LID p1,p2,...`` once per switch,
  sequentially, for the same ports the collector reads (same working directory, on tmpfs);
  measured once before every collector mode, the ratios use the median of those runs;
* :meth:`FabricCollector.sweep` in four modes: extended counters only
  (``legacy_counters="never"``), extended + legacy ``PortCounters`` every sweep (``legacy_every=1``;
  ibsim's PMA has no PortXmitWait or error counters in its extended attribute), legacy every 10th
  sweep (``legacy_every=10``: ten sweeps, one with the legacy run), and legacy every sweep with the
  work directory on the disk file system (the collector's default before it moved to ``/dev/shm``).

For each it prints the wall seconds per sweep (median and worst), the CPU seconds of the child
processes (perfquery) and of ibsim per sweep, the samples and how many carry legacy counters, the
errors counted, the ratio to the yardstick, and whether the worst sweep meets the 5 s target.
The fabric is stopped at the end (``fabric.sh stop``: TERM/KILL by the PIDs in its pid files), also
on an error, Ctrl-C or SIGTERM. A time budget (default 170 s, fabric start included) skips the
remaining modes when exceeded, and says so.

Run: ``.venv/bin/python bench/fabric_sweep.py [--spines 20 --leaves 80 --hcas-per-leaf 16]
[--sweeps 3] [--concurrency 6] [--budget-s 170] [--with-cas]``. Needs ibsim-utils, opensm,
infiniband-diags and libumad2sim0 (``deploy/local/install-system.sh``). Exit status 0 when every
mode ran and the legacy-every-10th mode's worst sweep met the target, 1 otherwise, 2 when the
fabric could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from collectors.fabric_collector import FabricCollector  # noqa: E402
from collectors.fabric_parse import Topology  # noqa: E402
from contracts.bus import MemoryBus  # noqa: E402
from contracts.topics import KafkaTopics  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FABRIC_SH = REPO / "deploy" / "local" / "fabric.sh"
TARGET_S = 5.0
_YARDSTICK_LOOP = (
    'while read -r lid ports; do env IBSIM_SOCKNAME="$SOCK" LD_PRELOAD="$SIM_SO" '
    'perfquery -x "$lid" "$ports" >/dev/null 2>&1 || echo "$lid" >&2; done <"$1"'
)


@dataclass
class ModeResult:
    """The sweeps of one mode: per-sweep wall seconds, child CPU seconds, ibsim CPU seconds, samples,
    samples with legacy counters, and the errors counted during the mode."""

    name: str
    wall_s: list[float] = field(default_factory=list)
    child_cpu_s: list[float] = field(default_factory=list)
    ibsim_cpu_s: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    legacy_samples: list[int] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)


def _child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` from /proc (0.0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _errors_by_reason(fc: FabricCollector) -> Counter[str]:
    """``gpupool_collector_fabric_errors_total`` by ``reason``, from ``fc``'s registry."""
    out: Counter[str] = Counter()
    for metric in fc.metrics.registry.collect():
        if metric.name == "gpupool_collector_fabric_errors":
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[s.labels["reason"]] += int(s.value)
    return out


class _ErrorLines(logging.Handler):
    """Prints the collector's ``fabric_device_error`` events with their fields, one line each."""

    _FIELDS = ("reason", "kind", "lid", "node_name", "port", "returncode", "stderr")

    def emit(self, record: logging.LogRecord) -> None:
        fields = {k: getattr(record, k) for k in self._FIELDS if hasattr(record, k)}
        if "stderr" in fields:
            fields["stderr"] = " | ".join(str(fields["stderr"]).strip().splitlines()[-2:])
        print(f"    {record.getMessage()} {fields}", file=sys.stderr, flush=True)


def _fabric(cmd: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(FABRIC_SH), cmd], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _switch_targets(topo: Topology) -> list[tuple[int, str]]:
    """(LID, "p1,p2,...") of every switch, the ports the collector reads (those with a peer)."""
    out = []
    for _, node in sorted(topo.nodes().items()):
        if node.node_type == "SW":
            ports = sorted(p for p, tp in node.ports.items() if tp.connected)
            if ports:
                out.append((node.lid, ",".join(map(str, ports))))
    return out


def _yardstick(targets_file: Path, fabric_env: dict[str, str], workdir: Path) -> tuple[float, float, int]:
    """Run the shell loop once: (wall s, child CPU s, failed perfquery runs)."""
    env = {
        **os.environ,
        "SOCK": fabric_env["IBSIM_SOCKNAME"],
        "SIM_SO": fabric_env["LD_PRELOAD"],
    }
    env.pop("LD_PRELOAD", None)
    c0, t0 = _child_cpu_s(), time.perf_counter()
    done = subprocess.run(
        ["bash", "-c", _YARDSTICK_LOOP, "yardstick", str(targets_file)],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return time.perf_counter() - t0, _child_cpu_s() - c0, len(done.stderr.split())


async def _run_mode(
    name: str,
    sweeps: int,
    fabric_env: dict[str, str],
    workdir: Path,
    ibsim_pid: int,
    deadline: float,
    **kw: Any,
) -> ModeResult:
    """Discover once, then ``sweeps`` sweeps (stopping at ``deadline``, a ``time.monotonic()`` value)."""
    res = ModeResult(name)
    async with FabricCollector(
        MemoryBus(), KafkaTopics(), env=fabric_env, workdir=workdir, timeout_s=20.0, **kw
    ) as fc:
        topo = await fc.discover()
        if topo.error is not None:
            raise RuntimeError(f"ibnetdiscover failed: {topo.error}")
        for _ in range(sweeps):
            if time.monotonic() > deadline:
                break
            c0, i0, t0 = _child_cpu_s(), _proc_cpu_s(ibsim_pid), time.perf_counter()
            samples = await fc.sweep()
            res.wall_s.append(time.perf_counter() - t0)
            res.child_cpu_s.append(_child_cpu_s() - c0)
            res.ibsim_cpu_s.append(_proc_cpu_s(ibsim_pid) - i0)
            res.samples.append(len(samples))
            res.legacy_samples.append(sum("SymbolErrorCounter" in s.counters for s in samples))
    res.errors = _errors_by_reason(fc)
    return res


def _line(res: ModeResult, yard_s: float) -> str:
    if not res.wall_s:
        return f"{res.name:<44} skipped (time budget)"
    med, worst = statistics.median(res.wall_s), max(res.wall_s)
    mean = statistics.fmean(res.wall_s)
    ok = "MET" if worst <= TARGET_S else "MISSED"
    return (
        f"{res.name:<44} sweeps={len(res.wall_s):>2} median={med:6.2f} s mean={mean:6.2f} s "
        f"worst={worst:6.2f} s  cpu/sweep: perfquery={statistics.fmean(res.child_cpu_s):5.2f} s "
        f"ibsim={statistics.fmean(res.ibsim_cpu_s):5.2f} s  samples={min(res.samples)}..{max(res.samples)} "
        f"with-legacy={res.legacy_samples} errors={dict(res.errors) or 0}  "
        f"ratio(median/yardstick)={med / yard_s:5.2f}x  target<={TARGET_S:.0f}s(worst): {ok}"
    )


async def _bench(args: argparse.Namespace, state: Path, fabric_env: dict[str, str], deadline: float) -> int:
    main_task = asyncio.current_task()
    if main_task is not None:  # SIGTERM cancels the run; main() then stops the fabric
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    info = json.loads((state / "fabric" / "fabric.json").read_text())
    ibsim_pid = int((state / "fabric" / "ibsim.pid").read_text().strip())
    env = dict(info["env"])
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    work_tmpfs = Path(tempfile.mkdtemp(prefix="gpupool-bench-work-", dir=shm))
    work_disk = state / "work-disk"
    work_disk.mkdir()
    try:
        async with FabricCollector(MemoryBus(), KafkaTopics(), env=env, workdir=work_tmpfs) as fc:
            topo = await fc.discover()
        targets = _switch_targets(topo)
        targets_file = state / "switch-targets.txt"
        targets_file.write_text("".join(f"{lid} {ports}\n" for lid, ports in targets))
        n_ports = sum(len(p.split(",")) for _, p in targets)
        print(
            f"fabric: {len(targets)} switches ({n_ports} connected ports), "
            f"{sum(n.node_type == 'CA' for n in topo.nodes().values())} CAs; "
            f"workdir tmpfs={work_tmpfs} disk={work_disk}; concurrency={args.concurrency}; "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        modes: list[tuple[str, int, Path, dict[str, Any]]] = [
            ("extended only (legacy never)", args.sweeps, work_tmpfs, {"legacy_counters": "never"}),
            ("extended + legacy every sweep", args.sweeps, work_tmpfs, {"legacy_every": 1}),
            ("extended + legacy every 10th sweep", 10, work_tmpfs, {"legacy_every": 10}),
            ("legacy every sweep, workdir on disk (before)", args.sweeps, work_disk, {"legacy_every": 1}),
        ]
        if args.with_cas:
            modes.append(("with CAs, legacy every 10th (2 sweeps)", 2, work_tmpfs, {"legacy_every": 10}))
        yard: list[tuple[float, float, int]] = []
        results: list[ModeResult] = []
        for name, sweeps, wd, kw in modes:
            if time.monotonic() > deadline:
                results.append(ModeResult(name))
                continue
            yard.append(_yardstick(targets_file, env, work_tmpfs))
            wall, cpu, failed = yard[-1]
            print(f"  yardstick: {wall:.2f} s wall, {cpu:.2f} s CPU, {failed} failed", flush=True)
            res = await _run_mode(
                name,
                sweeps,
                env,
                wd,
                ibsim_pid,
                deadline,
                concurrency=args.concurrency,
                include_cas=name.startswith("with CAs"),
                **kw,
            )
            results.append(res)
            print(f"  {name}: " + ", ".join(f"{w:.2f}" for w in res.wall_s) + " s", flush=True)
        yard_s = statistics.median(y[0] for y in yard)
        print()
        print(
            f"yardstick: sequential shell loop, perfquery -x per switch (same ports): median {yard_s:.2f} s "
            f"over {len(yard)} runs ({', '.join(f'{y[0]:.2f}' for y in yard)}), "
            f"CPU {statistics.fmean(y[1] for y in yard):.2f} s, failed runs {sum(y[2] for y in yard)}"
        )
        for res in results:
            print(_line(res, yard_s))
        every10 = results[2]
        met = bool(every10.wall_s) and max(every10.wall_s) <= TARGET_S
        complete = all(r.wall_s for r in results)
        worst10 = max(every10.wall_s) if every10.wall_s else float("nan")
        mean10 = statistics.fmean(every10.wall_s) if every10.wall_s else float("nan")
        print(
            f"\nresult: {len(targets)}-switch sweep with legacy every 10th: worst {worst10:.2f} s, "
            f"mean {mean10:.2f} s -> target <= {TARGET_S:.0f} s "
            f"{'MET' if met else 'MISSED'}{'' if complete else ' (some modes skipped: time budget)'}"
        )
        return 0 if met and complete else 1
    finally:
        shutil.rmtree(work_tmpfs, ignore_errors=True)


def main() -> int:
    """Run the benchmark (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spines", type=int, default=20)
    ap.add_argument("--leaves", type=int, default=80)
    ap.add_argument("--hcas-per-leaf", type=int, default=16)
    ap.add_argument("--sweeps", type=int, default=3, help="sweeps per mode (the every-10th mode runs 10)")
    ap.add_argument("--concurrency", type=int, default=6, help="perfquery processes at once (ibsim: <= 8)")
    ap.add_argument("--budget-s", type=float, default=170.0, help="skip remaining modes after this")
    ap.add_argument("--with-cas", action="store_true", help="also time sweeps that read every CA")
    args = ap.parse_args()
    started = time.monotonic()
    deadline = started + args.budget_s
    state = Path(tempfile.mkdtemp(prefix="gpupool-bench-fabric-"))
    env = {
        **os.environ,
        "GPUPOOL_STATE": str(state),
        "GPUPOOL_FABRIC_DIR": str(state / "fabric"),
        "GPUPOOL_FABRIC_SPINES": str(args.spines),
        "GPUPOOL_FABRIC_LEAVES": str(args.leaves),
        "GPUPOOL_FABRIC_HCAS_PER_LEAF": str(args.hcas_per_leaf),
        "GPUPOOL_FABRIC_TIMEOUT": str(max(30, int(args.budget_s * 0.6))),
    }
    for key in ("GPUPOOL_FABRIC_UPLINKS", "GPUPOOL_FABRIC_SWITCH_PORTS", "LD_PRELOAD", "IBSIM_SOCKNAME"):
        env.pop(key, None)

    def _on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _on_term)
    collector_log = logging.getLogger("collectors.fabric_collector")
    collector_log.addHandler(_ErrorLines())
    collector_log.propagate = False
    try:
        t0 = time.monotonic()
        try:
            up = _fabric("start", env, args.budget_s)
        except subprocess.TimeoutExpired:
            print("fabric: start did not finish within the budget", file=sys.stderr)
            return 2
        if up.returncode != 0:
            print(f"fabric: start failed ({up.returncode})\n{up.stdout}{up.stderr}", file=sys.stderr)
            return 2
        print(f"{up.stdout.strip()} (start took {time.monotonic() - t0:.1f} s)", flush=True)
        try:
            return asyncio.run(_bench(args, state, env, deadline))
        except asyncio.CancelledError:
            print("interrupted (SIGTERM)", file=sys.stderr)
            return 128 + signal.SIGTERM
    finally:
        t1 = time.monotonic()
        down = _fabric("stop", env, 60)
        print(f"{down.stdout.strip()} (stop took {time.monotonic() - t1:.1f} s); "
              f"whole run {time.monotonic() - started:.1f} s")
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
