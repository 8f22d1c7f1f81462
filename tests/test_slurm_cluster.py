"""The local Slurm cluster of deploy/local/slurm.sh: shape, GPUs as GRES, and partition preemption.

Integration tests over a real slurmctld and four slurmd (Debian's Slurm 22.05, munge): what the
lending integration builds on. A lease is a job in the ``lent`` partition; a training job that
needs its GPUs preempts it, the lease job gets SIGTERM at once and the GPUs go to training when
it exits (by the partition's GraceTime at the latest).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.services import SLURM_GRACE_S, run_service


def _slurm(conf: Path, *args: str) -> str:
    """Run a Slurm client command against the local cluster; its stdout (raises on failure)."""
    done = subprocess.run(
        list(args), capture_output=True, text=True, timeout=30, check=False,
        env={**os.environ, "SLURM_CONF": str(conf)},
    )
    assert done.returncode == 0, f"{args}: {done.stderr}"
    return done.stdout


def _records(text: str) -> list[dict[str, str]]:
    """``scontrol show ... -o`` output: one ``Key=Value`` record per line (values without spaces
    except the last field of a line, which this test does not read)."""
    out = []
    for line in text.splitlines():
        if line.strip():
            out.append(dict(re.findall(r"(\w[\w:/]*)=(\S*)", line)))
    return out


def _job_state(conf: Path, job: str) -> str:
    return _slurm(conf, "squeue", "-h", "-j", job, "-o", "%T").strip() or "GONE"


def _wait_state(conf: Path, job: str, want: str, timeout_s: float) -> float:
    """Seconds until ``job`` is in state ``want`` (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if _job_state(conf, job) == want:
            return time.monotonic() - t0
        time.sleep(0.1)
    pytest.fail(f"job {job} not {want} within {timeout_s} s (now {_job_state(conf, job)})")


def test_four_nodes_eight_gpus_each_two_partitions(slurm_conf: Path) -> None:
    nodes = _records(_slurm(slurm_conf, "scontrol", "show", "node", "-d", "-o"))
    assert sorted(n["NodeName"] for n in nodes) == [f"gpu-node-00{i}" for i in (1, 2, 3, 4)]
    for n in nodes:
        assert n["Gres"] == "gpu:h100:8"
        assert n["State"].split("+")[0] in ("IDLE", "ALLOCATED", "MIXED")  # flags: +COMPLETING...
    parts = {p["PartitionName"]: p for p in _records(_slurm(slurm_conf, "scontrol", "show", "partition", "-o"))}
    assert parts["training"]["PriorityTier"] == "10" and parts["training"]["PreemptMode"] == "OFF"
    assert parts["training"]["Default"] == "YES"
    assert parts["lent"]["PriorityTier"] == "1" and parts["lent"]["PreemptMode"] == "CANCEL"
    assert parts["lent"]["GraceTime"] == str(SLURM_GRACE_S)


def test_start_again_is_idempotent(slurm_conf: Path) -> None:
    done = run_service("slurm.sh", "start", 60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(slurm_conf)
    status = run_service("slurm.sh", "status", 30)
    assert status.returncode == 0 and status.stdout.strip() == str(slurm_conf)


def test_job_sees_exactly_its_gpus(slurm_conf: Path, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    job = _slurm(
        slurm_conf, "sbatch", "--parsable", "-p", "training", "-w", "gpu-node-003", "--gres=gpu:h100:3",
        "-c", "1", "-o", str(out), "--wrap", "echo CVD=$CUDA_VISIBLE_DEVICES; sleep 3",
    ).strip()
    _wait_state(slurm_conf, job, "RUNNING", 20)
    detail = _slurm(slurm_conf, "scontrol", "show", "job", "-d", job)
    idx = re.search(r"GRES=gpu:h100:3\(IDX:([\d,-]+)\)", detail)
    assert idx is not None, detail
    deadline = time.monotonic() + 10
    while "CVD=" not in (out.read_text() if out.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.1)
    cvd = out.read_text().split("CVD=")[1].split()[0]
    expanded = []
    for part in idx.group(1).split(","):
        lo, _, hi = part.partition("-")
        expanded += list(range(int(lo), int(hi or lo) + 1))
    assert [int(x) for x in cvd.split(",")] == expanded and len(expanded) == 3
    _slurm(slurm_conf, "scancel", job)


def test_training_preempts_a_lent_job_with_sigterm_first(slurm_conf: Path, tmp_path: Path) -> None:
    """A lent job holding 6 GPUs of a node; a training job that needs 4 of that node's GPUs
    preempts it. The lent job gets SIGTERM at once and stays until it exits by itself (here
    2 s later: a lease job leaves at its deadline); the training job runs only after that."""
    lease_out = tmp_path / "lease.out"
    script = tmp_path / "lease.sh"
    script.write_text(
        "#!/bin/bash\n"
        "trap 'echo TERM; sleep 2; echo EXIT; exit 0' TERM\n"
        "echo START\n"
        "while true; do sleep 0.1; done\n"
    )
    lease = _slurm(
        slurm_conf, "sbatch", "--parsable", "-p", "lent", "-w", "gpu-node-004", "--gres=gpu:h100:6",
        "-c", "1", "--signal=B:TERM@5", "-o", str(lease_out), str(script),
    ).strip()
    _wait_state(slurm_conf, lease, "RUNNING", 20)
    train = _slurm(
        slurm_conf, "sbatch", "--parsable", "-p", "training", "-w", "gpu-node-004", "--gres=gpu:h100:4",
        "-c", "1", "-o", "/dev/null", "--wrap", "sleep 2",
    ).strip()
    waited = _wait_state(slurm_conf, train, "RUNNING", 40)
    text = lease_out.read_text()
    assert "START" in text and "TERM" in text and "EXIT" in text, text
    assert waited >= 2.0  # the lent GPUs were not handed over before the lease job left
    assert _job_state(slurm_conf, lease) in ("GONE", "COMPLETING")
    _slurm(slurm_conf, "scancel", train)
