"""CPU seconds by part of a benchmark's host, counted from ``/proc`` (``proc(5)``): which of the
processes a benchmark started burn the cores, whatever else runs on the machine.

:class:`Census` reads every process's ``/proc/<pid>/stat`` — ``utime``, ``stime``, ``cutime``,
``cstime`` (fields 14-17, clock ticks), ``ppid`` (4) and ``starttime`` (22) — and its
``cmdline`` once, sorts each process into a part with a :data:`Classify` function, and adds
what each used since the last reading to its part. A process's CPU includes that of its
children it has reaped (``cutime``/``cstime``), so the short-lived processes no reading sees
(``sleep``, ``mv``, ``scontrol``...) are counted with the part of the parent that reaped them;
the part of a child that was seen and then vanished is taken off its parent's increase (it was
counted already), and so is that of a child gone together with its parent (a workload, the
hold script that ran it and its ``slurmstepd``, all ended between two readings) off the
increase of the first ancestor still there. The CPU a process used between the last reading and its exit is counted with
its parent's part when the parent reaps it, and lost when no counted process does (a process
re-parented to PID 1). Readings a long way apart therefore lose more: take them often (every
0.5 s costs the reader a few ms of CPU each time on a few hundred processes).

Run as ``python -m bench.support.proc_cpu --match TEXT --every 0.5 --out FILE`` (what
``bench/edge_reclaim.py`` does, in a process of its own so that the readings never stall the
benchmark's event loop): each line of ``FILE`` is ``{"t": <Unix s>, "cpu": {part: CPU seconds so
far}}``, parts as :func:`bench_parts` sorts them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Proc:
    """One process as a reading saw it: ``pid``, ``ppid``, ``start`` (``starttime``, ticks after
    boot: with ``pid``, who it is), ``comm``, ``cmdline`` (arguments joined by spaces), ``own_s``
    (``utime + stime``) and ``children_s`` (``cutime + cstime``), seconds."""

    pid: int
    ppid: int
    start: int
    comm: str
    cmdline: str
    own_s: float
    children_s: float

    @property
    def total_s(self) -> float:
        """Its CPU and its reaped children's, seconds."""
        return self.own_s + self.children_s


Classify = Callable[[Proc, Callable[[int], "Proc | None"]], "str | None"]
"""Sorts a process into a part (``None``: not one of the benchmark's); gets the process and a
lookup of the current reading's processes by pid (for its parents)."""


def parse_stat(text: str) -> tuple[str, int, int, float, float]:
    """``/proc/<pid>/stat`` → (comm, ppid, starttime, utime + stime s, cutime + cstime s).
    Raises ``ValueError`` on another text."""
    head, _, rest = text.rpartition(")")
    if not head or "(" not in head:
        raise ValueError(f"not a /proc stat line: {text[:80]!r}")
    comm = head.partition("(")[2]
    f = rest.split()  # f[0] is field 3 (state)
    if len(f) < 20:
        raise ValueError(f"not a /proc stat line: {text[:80]!r}")
    own = (int(f[11]) + int(f[12])) * TICK_S
    children = (int(f[13]) + int(f[14])) * TICK_S
    return comm, int(f[1]), int(f[19]), own, children


def read_procs(
    root: Path = Path("/proc"), cmdlines: dict[tuple[int, int, str], str] | None = None
) -> dict[int, Proc]:
    """Every process under ``root`` now, by pid; processes that exit while being read are left
    out. ``cmdlines`` caches each (pid, starttime, comm)'s command line across readings (comm:
    a process that ``exec``s another program is read again)."""
    cache = cmdlines if cmdlines is not None else {}
    procs: dict[int, Proc] = {}
    for entry in os.scandir(root):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            comm, ppid, start, own, children = parse_stat((root / entry.name / "stat").read_text())
            key = (pid, start, comm)
            if key not in cache:
                raw = (root / entry.name / "cmdline").read_bytes()
                cache[key] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue
        procs[pid] = Proc(pid, ppid, start, comm, cache[key], own, children)
    return procs


class Census:
    """CPU seconds so far by part (module docstring).

    Args:
        classify: sorts a process into its part, or ``None`` (not counted).
        read: one reading of the processes (:func:`read_procs` by default).
        apart: parts whose processes' reaped children, those no reading counted, go to a part of
            their own, ``<part>: exited children`` (a daemon's own work apart from that of the
            short-lived processes it reaps).
    """

    def __init__(
        self,
        classify: Classify,
        read: Callable[[], dict[int, Proc]] | None = None,
        apart: frozenset[str] = frozenset(),
    ) -> None:
        self.classify = classify
        self.apart = apart
        self._cmdlines: dict[tuple[int, int, str], str] = {}
        self.read = read if read is not None else (lambda: read_procs(cmdlines=self._cmdlines))
        self.used: dict[str, float] = {}
        self._last: dict[int, Proc] = {}
        self._parts: dict[tuple[int, int, str], str | None] = {}
        self._first = True

    def _part(self, p: Proc, procs: dict[int, Proc]) -> str | None:
        key = (p.pid, p.start, p.comm)  # an exec'd process is sorted again
        if key not in self._parts:
            self._parts[key] = self.classify(p, procs.get)
        return self._parts[key]

    def sample(self) -> dict[str, float]:
        """Read the processes and return the CPU seconds each part used so far (since the first
        reading, which only sets where counting starts)."""
        procs = self.read()
        gone = {
            pid: old
            for pid, old in self._last.items()
            if (now := procs.get(pid)) is None or now.start != old.start
        }

        def counted(p: Proc) -> float:  # what was counted of p and of its children gone with it
            return p.total_s + sum(counted(c) for c in gone.values() if c.ppid == p.pid and c is not p)

        vanished: dict[int, float] = {}  # parent pid -> counted CPU of its children gone since
        for old in gone.values():
            if old.ppid not in gone:  # one gone with its parent is in its parent's count
                vanished[old.ppid] = vanished.get(old.ppid, 0.0) + counted(old)
        for pid, p in procs.items():
            part = self._part(p, procs)
            if part is None:
                continue
            old = self._last.get(pid)
            if old is not None and old.start == p.start:
                own = p.own_s - old.own_s
                reaped = max(0.0, p.children_s - old.children_s - vanished.get(pid, 0.0))
            elif self._first:
                own = reaped = 0.0
            else:  # started since the last reading: all of it is new
                own, reaped = p.own_s, p.children_s
            self.used[part] = self.used.get(part, 0.0) + own
            reaped_part = f"{part}: exited children" if part in self.apart else part
            self.used[reaped_part] = self.used.get(reaped_part, 0.0) + reaped
        self._last = {pid: p for pid, p in procs.items() if self._part(p, procs) is not None}
        self._first = False
        return dict(self.used)


def _ancestors(p: Proc, lookup: Callable[[int], Proc | None]) -> list[Proc]:
    out = []
    seen = {p.pid}
    q = lookup(p.ppid)
    while q is not None and q.pid not in seen:
        out.append(q)
        seen.add(q.pid)
        q = lookup(q.ppid)
    return out


WORKLOAD = "workload"
"""The part of a workload process starts with this word, then its pid and its ``--port`` (0 when
its command line names none): ``workload 4242 28301``."""


def workload_port(cmdline: str) -> int:
    """The value of ``--port`` on a command line (``--port 28301`` or ``--port=28301``); 0 when
    there is none or it is not a number."""
    words = cmdline.split()
    for i, w in enumerate(words):
        value = (
            words[i + 1]
            if w == "--port" and i + 1 < len(words)
            else w.removeprefix("--port=")
            if w.startswith("--port=")
            else None
        )
        if value is not None:
            return int(value) if value.isdigit() else 0
    return 0


BENCH_PARTS = (
    "bench: load driver, site SDK",
    "bench's Slurm commands",
    "broker",
    "broker's Slurm commands",
    "slurmctld",
    "slurmd",
    "slurmd: exited children",
    "slurmstepd",
    "hold scripts (bash, sleep)",
    "mosquitto, munged",
    "census (this reader)",
)
"""The parts :func:`bench_parts` sorts processes into, in the order benchmarks print them,
besides one part per workload process (:data:`WORKLOAD`)."""


def bench_parts(match: str, bench_pid: int, census_pid: int) -> Classify:
    """A :data:`Classify` for a benchmark whose private services and broker name ``match`` (its
    temporary directory) on their command lines: the benchmark's process ``bench_pid`` and its
    other children, the broker (``broker run``) and its children, Slurm's daemons of that
    cluster (``slurmctld``, ``slurmd`` and the ``tini`` before it), its ``slurmstepd`` and what
    they run (the hold scripts; each workload process, ``simulator.inference_server``, a part of
    its own: :data:`WORKLOAD`), Mosquitto and munged, and the reader ``census_pid``
    (:data:`BENCH_PARTS`)."""

    def classify(p: Proc, lookup: Callable[[int], Proc | None]) -> str | None:
        if p.pid == census_pid:
            return "census (this reader)"
        if p.pid == bench_pid:
            return "bench: load driver, site SDK"
        ours = match in p.cmdline
        if ours and "broker" in p.cmdline and " run " in p.cmdline:
            return "broker"
        if ours and p.comm.startswith("slurmctld"):
            return "slurmctld"
        if ours and (p.comm.startswith("slurmd") or p.comm == "tini"):
            return "slurmd"
        if ours and p.comm in ("mosquitto", "munged"):
            return "mosquitto, munged"
        up = _ancestors(p, lookup)
        if not any(match in a.cmdline or a.pid == bench_pid for a in up):
            return None
        if p.comm.startswith("slurmstepd"):
            return "slurmstepd"
        for a in up:
            if a.comm.startswith("slurmctld"):
                return "slurmctld"  # slurmscriptd, the scripts it runs
            if a.comm.startswith("slurmstepd"):
                if "simulator.inference_server" in p.cmdline:
                    return f"{WORKLOAD} {p.pid} {workload_port(p.cmdline)}"
                return "hold scripts (bash, sleep)"
            if match in a.cmdline and "broker" in a.cmdline and " run " in a.cmdline:
                return "broker's Slurm commands"
            if a.pid == bench_pid:
                return "bench's Slurm commands"
        return None

    return classify


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring): ``--match``, ``--every`` (0.5 s), ``--out``,
    ``--bench-pid`` (default: the parent). Runs until killed (SIGTERM ends it)."""
    p = argparse.ArgumentParser(prog="python -m bench.support.proc_cpu", description=__doc__.split("\n")[0])
    p.add_argument("--match", required=True)
    p.add_argument("--every", type=float, default=0.5)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--bench-pid", type=int, default=os.getppid())
    args = p.parse_args(argv)
    census = Census(bench_parts(args.match, args.bench_pid, os.getpid()), apart=frozenset({"slurmd"}))
    with args.out.open("a") as out:
        while True:
            t = time.time()
            used = census.sample()
            out.write(json.dumps({"t": t, "cpu": used}) + "\n")
            out.flush()
            time.sleep(max(0.0, args.every - (time.time() - t)))


if __name__ == "__main__":
    sys.exit(main())
