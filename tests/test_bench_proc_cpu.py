"""The benchmarks' CPU census (bench/support/proc_cpu.py): each part gets what its processes
used between readings, a reaped child's CPU once, and the ``/proc`` parsing it rests on."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from bench.support.proc_cpu import Census, Proc, bench_parts, parse_stat, read_procs, workload_port


def _p(
    pid: int, ppid: int, own: float, children: float = 0.0, comm: str = "x", cmdline: str = "", start: int = 1
) -> Proc:
    return Proc(pid, ppid, start, comm, cmdline, own, children)


def _census(readings: list[dict[int, Proc]], apart: frozenset[str] = frozenset()) -> Census:
    it = iter(readings)

    def classify(p: Proc, lookup: Callable[[int], Proc | None]) -> str | None:
        return None if p.comm == "other" else p.comm

    return Census(classify, read=lambda: next(it), apart=apart)


def _readings(*rows: list[Proc]) -> list[dict[int, Proc]]:
    return [{p.pid: p for p in row} for row in rows]


def test_each_part_gets_what_its_processes_used_since_the_first_reading() -> None:
    c = _census(
        _readings(
            [_p(1, 0, 5.0, comm="d"), _p(2, 1, 1.0, comm="s"), _p(9, 0, 7.0, comm="other")],
            [_p(1, 0, 5.5, comm="d"), _p(2, 1, 1.25, comm="s"), _p(9, 0, 9.0, comm="other")],
        )
    )
    assert c.sample() == {"d": 0.0, "s": 0.0}  # the first reading only sets the start
    assert c.sample() == {"d": 0.5, "s": 0.25}  # "other" is not counted


def test_a_reaped_child_counts_once_and_an_unseen_one_with_its_parent() -> None:
    c = _census(
        _readings(
            [_p(1, 0, 1.0, comm="d"), _p(2, 1, 0.5, comm="s")],
            [_p(1, 0, 1.0, comm="d"), _p(2, 1, 0.75, comm="s"), _p(3, 1, 0.25, comm="w")],
            # 2 and 3 exited and were reaped (their last counted 0.75 + 0.25, plus 0.5 unseen
            # use: 2's last 0.1 s and a child no reading saw)
            [_p(1, 0, 1.0, 1.5, comm="d")],
        )
    )
    c.sample()
    assert c.sample() == {"d": 0.0, "s": 0.25, "w": 0.25}  # a new process: all its use is new
    assert c.sample() == pytest.approx({"d": 0.5, "s": 0.25, "w": 0.25})


def test_children_gone_with_their_parent_count_once() -> None:
    # a workload (3) under a hold script (2) under a slurmstepd (1) reaped by tini (0): all three
    # end between two readings; tini's children's CPU grows by their totals plus 0.25 s unseen
    c = _census(
        _readings(
            [
                _p(0, 0, 0.0, comm="t"),
                _p(1, 0, 0.5, comm="d"),
                _p(2, 1, 0.5, comm="s"),
                _p(3, 2, 2.0, comm="w"),
            ],
            [_p(0, 0, 0.0, 0.5 + 0.5 + 2.0 + 0.25, comm="t")],
        )
    )
    c.sample()
    assert c.sample() == pytest.approx({"t": 0.25, "d": 0.0, "s": 0.0, "w": 0.0})


def test_a_reused_pid_is_a_new_process() -> None:
    c = _census(_readings([_p(2, 1, 3.0, comm="s", start=1)], [_p(2, 1, 0.5, comm="s", start=9)]))
    c.sample()
    assert c.sample() == {"s": 0.5}


def test_reaped_children_apart() -> None:
    c = _census(
        _readings([_p(1, 0, 1.0, comm="d")], [_p(1, 0, 1.5, 2.0, comm="d")]),
        apart=frozenset({"d"}),
    )
    c.sample()
    assert c.sample() == {"d": 0.5, "d: exited children": 2.0}


def test_parse_stat() -> None:
    # a comm with spaces and parentheses; fields 14-17 are 100, 50, 20, 10 ticks, starttime 4242
    tail = "S 77 1 1 0 -1 0 0 0 0 0 100 50 20 10 20 0 1 0 4242 0 0"
    comm, ppid, start, own, children = parse_stat(f"123 (a (b) c) {tail}")
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert (comm, ppid, start) == ("a (b) c", 77, 4242)
    assert own == pytest.approx(150 * tick) and children == pytest.approx(30 * tick)
    with pytest.raises(ValueError):
        parse_stat("123 no parentheses")
    with pytest.raises(ValueError):
        parse_stat("123 (x) S 1 2")


def test_read_procs_sees_this_process() -> None:
    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:
        pass
    me = read_procs()[os.getpid()]
    assert me.ppid == os.getppid() and "pytest" in me.cmdline and me.own_s >= 0.05


def test_workload_port() -> None:
    assert workload_port("python -m simulator.inference_server --port 28301 --drain-s 10") == 28301
    assert workload_port("python -m simulator.inference_server --port=28302") == 28302
    assert workload_port("python -m simulator.inference_server") == 0
    assert workload_port("x --port {port}") == 0


def test_bench_parts() -> None:
    m = "/tmp/gpupool-bench-edge-abc"
    procs = {
        p.pid: p
        for p in (
            _p(
                10, 1, 0, comm="tini", cmdline=f"tini -s -- slurmd -D -N gpu-node-001 -f {m}/slurm/slurm.conf"
            ),
            _p(11, 10, 0, comm="slurmd", cmdline=f"slurmd -D -N gpu-node-001 -f {m}/slurm/slurm.conf"),
            _p(12, 10, 0, comm="slurmstepd", cmdline="slurmstepd: [5.batch]"),
            _p(13, 12, 0, comm="slurm_script", cmdline=f"/bin/bash {m}/slurm/spool/job00005/slurm_script"),
            _p(14, 13, 0, comm="python", cmdline="python -m simulator.inference_server --port 29501"),
            _p(20, 1, 0, comm="python", cmdline=f"python -c app broker run --config {m}/broker.toml"),
            _p(21, 20, 0, comm="squeue", cmdline="squeue -h"),
            _p(30, 1, 0, comm="python", cmdline="python bench/edge_reclaim.py"),
            _p(31, 30, 0, comm="sbatch", cmdline="sbatch --parsable"),
            _p(40, 1, 0, comm="slurmstepd", cmdline="slurmstepd: [5.batch]"),  # another cluster's
            _p(41, 1, 0, comm="slurmctld", cmdline=f"slurmctld -c -f {m}/slurm/slurm.conf"),
            _p(42, 41, 0, comm="slurmscriptd", cmdline=": slurmscriptd"),
            _p(50, 30, 0, comm="python", cmdline="python -m bench.support.proc_cpu"),
        )
    }
    classify = bench_parts(m, bench_pid=30, census_pid=50)
    parts = {pid: classify(p, procs.get) for pid, p in procs.items()}
    assert parts == {
        10: "slurmd",
        11: "slurmd",
        12: "slurmstepd",
        13: "hold scripts (bash, sleep)",
        14: "workload 14 29501",
        20: "broker",
        21: "broker's Slurm commands",
        30: "bench: load driver, site SDK",
        31: "bench's Slurm commands",
        40: None,
        41: "slurmctld",
        42: "slurmctld",
        50: "census (this reader)",
    }
