"""Lease holds in Slurm (broker/scheduler_slurm.py): parsing with right values, and holds on the
real local cluster: fencing, release, preemption with its deadline, the workload's GPUs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from broker.scheduler import Hold, HoldRequest, HoldState, NoScheduler, SchedulerError
from broker.scheduler_slurm import (
    SlurmScheduler,
    expand_indices,
    hold_from_record,
    lease_script,
    parse_job_lines,
    parse_time,
    training_gpus,
)
from tests.services import SLURM_GRACE_S

# One line of `scontrol show job -d -o` from Slurm 22.05 (deploy/local/slurm.sh), a lease hold
# that Slurm has chosen for preemption (fields cut for width; order and spelling as printed).
LINE = (
    "JobId=7 JobName=gpupool-lease UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 "
    "Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=0 "
    "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:01 "
    "TimeLimit=00:10:00 TimeMin=N/A SubmitTime=2026-12-01T14:01:29 EligibleTime=2026-12-01T14:01:29 "
    "AccrueTime=2026-12-01T14:01:29 StartTime=2026-12-01T14:01:29 EndTime=2026-12-01T14:02:00 "
    "Deadline=N/A PreemptEligibleTime=2026-12-01T14:01:29 PreemptTime=2026-12-01T14:01:30 "
    "SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-01T14:01:29 Scheduler=Main "
    "Partition=lent AllocNode:Sid=localhost:1234 ReqNodeList=gpu-node-002 ExcNodeList=(null) "
    "NodeList=gpu-node-002 BatchHost=gpu-node-002 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 "
    "ReqB:S:C:T=0:0:*:* TRES=cpu=1,node=1,billing=1,gres/gpu=8 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* "
    "CoreSpec=* JOB_GRES=gpu:h100:8 Nodes=gpu-node-002 CPU_IDs=0 Mem=0 GRES=gpu:h100:8(IDX:0-7) "
    "MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 "
    "OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) "
    "WorkDir=/tmp/sj Comment=gpupool-lease=lease-42 StdErr=/dev/null StdIn=/dev/null "
    "StdOut=/dev/null Power= TresPerNode=gres:gpu:h100:8"
)


def test_expand_indices_right_values_and_boundaries() -> None:
    assert expand_indices("0") == (0,)
    assert expand_indices("0-3") == (0, 1, 2, 3)
    assert expand_indices("0,2-3,7") == (0, 2, 3, 7)
    assert expand_indices("3-3") == (3,)
    assert expand_indices("1,1") == (1,)
    for bad in ("", "3-2", "1-", "-1", "a", "0,,1", "0-1-2"):
        with pytest.raises(ValueError):
            expand_indices(bad)


def test_parse_time() -> None:
    assert parse_time("2026-12-01T14:02:00") == datetime(2026, 12, 1, 14, 2, 0).timestamp()
    for none in ("None", "Unknown", "N/A", ""):
        assert parse_time(none) is None
    with pytest.raises(ValueError):
        parse_time("yesterday")


def test_a_preempted_hold_from_a_real_line() -> None:
    [rec] = parse_job_lines(LINE + "\n\n")
    hold = hold_from_record(rec)
    assert hold is not None
    assert hold.lease_id == "lease-42" and hold.job_id == "7" and hold.host == "gpu-node-002"
    assert hold.gpu_indices == (0, 1, 2, 3, 4, 5, 6, 7)
    assert hold.state is HoldState.PREEMPTED
    assert hold.preempted_at == datetime(2026, 12, 1, 14, 1, 30).timestamp()
    assert hold.deadline == datetime(2026, 12, 1, 14, 2, 0).timestamp()


def test_hold_states_and_other_jobs() -> None:
    [rec] = parse_job_lines(LINE)
    running = hold_from_record({**rec, "PreemptTime": "None"})
    assert running is not None and running.state is HoldState.RUNNING and running.preempted_at is None
    pending = hold_from_record({**rec, "JobState": "PENDING", "NodeList": "(null)"})
    assert pending is not None and pending.state is HoldState.PENDING and pending.host == ""
    assert pending.gpu_indices == ()
    for live in ("SIGNALING", "SUSPENDED", "STOPPED"):
        h = hold_from_record({**rec, "JobState": live})
        assert h is not None and h.state is HoldState.PREEMPTED
    for ended in ("COMPLETED", "CANCELLED", "COMPLETING", "TIMEOUT", "PREEMPTED"):
        h = hold_from_record({**rec, "JobState": ended})
        assert h is not None and h.state is HoldState.ENDED
    assert hold_from_record({**rec, "JobName": "train"}) is None  # a training job
    assert hold_from_record({**rec, "Comment": "(null)"}) is None
    with pytest.raises(ValueError):  # 8 GPUs said, 7 indices listed
        hold_from_record({**rec, "GRES": "gpu:h100:8(IDX:0-6)"})


def test_training_gpus_are_the_running_other_jobs_per_node_groups() -> None:
    train = LINE.replace("JobName=gpupool-lease", "JobName=train")
    train = train.replace("PreemptTime=2026-12-01T14:01:30 ", "")
    two_groups = train.replace(
        "Nodes=gpu-node-002 CPU_IDs=0 Mem=0 GRES=gpu:h100:8(IDX:0-7)",
        "Nodes=gpu-node-[001,003-004] CPU_IDs=0-3 Mem=0 GRES=gpu:h100:2(IDX:1,6) "
        "Nodes=gpu-node-002 CPU_IDs=0 Mem=0 GRES=gpu:h100:1(IDX:3)",
    )
    assert training_gpus(two_groups) == {
        ("gpu-node-001", 1), ("gpu-node-001", 6), ("gpu-node-003", 1), ("gpu-node-003", 6),
        ("gpu-node-004", 1), ("gpu-node-004", 6), ("gpu-node-002", 3),
    }  # fmt: skip
    assert training_gpus(LINE) == set()  # gpupool's own hold
    assert training_gpus(train) == {("gpu-node-002", i) for i in range(8)}
    for holding in ("SIGNALING", "SUSPENDED", "STOPPED"):
        assert len(training_gpus(train.replace("JobState=RUNNING", f"JobState={holding}"))) == 8
    for not_holding in ("PENDING", "COMPLETING", "COMPLETED", "CANCELLED"):
        assert training_gpus(train.replace("JobState=RUNNING", f"JobState={not_holding}")) == set()
    both = training_gpus(two_groups) | training_gpus(train)
    assert training_gpus(f"{LINE}\n\n{two_groups}\n{train}") == both
    with pytest.raises(ValueError):  # 8 GPUs said, 7 indices listed
        training_gpus(train.replace("gpu:h100:8(IDX:0-7)", "gpu:h100:8(IDX:0-6)"))
    with pytest.raises(ValueError):
        training_gpus(train.replace("Nodes=gpu-node-002", "Nodes=gpu-node-[002"))


def test_lease_script_quotes_the_workload() -> None:
    req = HoldRequest("l1", "gpu-node-001", 2, time.time() + 600, 5.0, ("server", "--name", "a b; rm -rf /"))
    script = lease_script(req)
    assert "server --name 'a b; rm -rf /' &" in script
    assert "notice_ds=50" in script
    assert ":\n" in lease_script(HoldRequest("l2", "h", 1, 0.0, 0.0))  # hold only: no command line


async def test_no_scheduler_holds_nothing() -> None:
    s = NoScheduler()
    assert s.enforced is False
    h = await s.hold(HoldRequest("l", "h", 1, 0.0, 0.0))
    assert h.state is HoldState.ENDED and h.job_id == ""
    assert await s.holds() == {} and await s.remove_stale([]) == []


def _sbatch_training(conf: Path, host: str, gpus: int) -> str:
    done = subprocess.run(
        ["sbatch", "--parsable", "-p", "training", "-w", host, f"--gres=gpu:h100:{gpus}", "-c", "1",
         "-o", "/dev/null", "--wrap", "sleep 30"],
        capture_output=True, text=True, env={**os.environ, "SLURM_CONF": str(conf)}, check=True,
    )
    return done.stdout.strip()


def _state(conf: Path, job: str) -> str:
    done = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
        env={**os.environ, "SLURM_CONF": str(conf)}, check=False,
    )
    return done.stdout.strip() or "GONE"


def _scancel(conf: Path, *jobs: str) -> None:
    subprocess.run(["scancel", *jobs], env={**os.environ, "SLURM_CONF": str(conf)}, check=False)


async def test_hold_fences_release_frees(slurm_conf: Path, tmp_path: Path) -> None:
    s = SlurmScheduler(slurm_conf, output_dir=tmp_path)
    t0 = time.monotonic()
    hold = await s.hold(HoldRequest("fence-1", "gpu-node-001", 6, time.time() + 600, SLURM_GRACE_S))
    held_s = time.monotonic() - t0
    assert hold.state is HoldState.RUNNING and hold.host == "gpu-node-001"
    assert len(hold.gpu_indices) == 6 and set(hold.gpu_indices) <= set(range(8))
    assert (await s.holds())["fence-1"].job_id == hold.job_id
    # 2 GPUs are left on the node: a training job for 2 runs beside the hold, one for 3 does not
    # fit without the lent GPUs (it would preempt the hold: see the next test).
    beside = _sbatch_training(slurm_conf, "gpu-node-001", 2)
    for _ in range(100):
        if _state(slurm_conf, beside) == "RUNNING":
            break
        await asyncio.sleep(0.1)
    assert _state(slurm_conf, beside) == "RUNNING"
    assert (await s.holds())["fence-1"].state is HoldState.RUNNING
    t1 = time.monotonic()
    await s.release("fence-1")
    released_s = time.monotonic() - t1
    assert "fence-1" not in await s.holds()
    assert released_s <= 3.0  # liveness only: bench/slurm.py measures it
    _scancel(slurm_conf, beside)
    print(f"hold running after {held_s:.3f} s; released in {released_s:.3f} s")


async def test_training_preempts_a_hold_the_deadline_is_read_and_the_workload_drains(
    slurm_conf: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "workload.log"
    workload = (
        "bash", "-c",
        f"echo GPUS=$CUDA_VISIBLE_DEVICES >> {marker}; trap 'echo TERM >> {marker}; exit 0' TERM; "
        "while true; do sleep 0.1; done",
    )
    s = SlurmScheduler(slurm_conf, output_dir=tmp_path)
    hold = await s.hold(HoldRequest("pre-1", "gpu-node-003", 8, time.time() + 600, SLURM_GRACE_S, workload))
    for _ in range(50):
        if marker.exists() and "GPUS=" in marker.read_text():
            break
        await asyncio.sleep(0.1)
    gpus = marker.read_text().split("GPUS=")[1].split()[0]
    assert tuple(int(g) for g in gpus.split(",")) == hold.gpu_indices == tuple(range(8))
    submitted = time.time()
    train = _sbatch_training(slurm_conf, "gpu-node-003", 4)
    seen = None
    for _ in range(100):  # Slurm chooses the hold for preemption: observed within 1 s
        h = (await s.holds()).get("pre-1")
        if h is not None and h.state is HoldState.PREEMPTED:
            seen = h
            break
        await asyncio.sleep(0.05)
    observed_s = time.time() - submitted
    assert seen is not None, "the hold was never marked preempted"
    assert seen.preempted_at is not None and seen.deadline is not None
    assert seen.deadline - seen.preempted_at == pytest.approx(SLURM_GRACE_S, abs=1.0)
    await s.confirm_notice(seen)  # the broker's confirmation: the script already leaving ignores it
    assert observed_s <= 5.0  # liveness only: bench/slurm.py measures it
    for _ in range(300):  # the workload got SIGTERM, drained, and the training job runs
        if _state(slurm_conf, train) == "RUNNING":
            break
        await asyncio.sleep(0.1)
    running_s = time.time() - submitted
    assert _state(slurm_conf, train) == "RUNNING"
    assert marker.read_text().count("TERM") == 1  # forwarded once, however many SIGTERMs came
    assert running_s <= SLURM_GRACE_S + 5.0
    assert "pre-1" not in await s.holds()
    await s.confirm_notice(seen)  # the hold has ended: scancel fails, and that is no error
    _scancel(slurm_conf, train)
    print(f"preemption observed {observed_s:.3f} s after submit; training RUNNING after {running_s:.3f} s")


async def test_a_hold_that_cannot_run_is_cancelled(slurm_conf: Path, tmp_path: Path) -> None:
    s = SlurmScheduler(slurm_conf, output_dir=tmp_path)
    busy = _sbatch_training(slurm_conf, "gpu-node-004", 8)  # training is never preempted by a hold
    with pytest.raises(SchedulerError, match="did not run within"):
        await s.hold(HoldRequest("busy-1", "gpu-node-004", 1, time.time() + 600, 5.0), timeout_s=1.0)
    assert "busy-1" not in await s.holds()  # the pending hold was cancelled
    _scancel(slurm_conf, busy)
    with pytest.raises(SchedulerError, match="lease id"):
        await s.hold(HoldRequest("bad id;", "gpu-node-004", 1, time.time() + 600, 5.0))
    with pytest.raises(SchedulerError, match="sbatch"):  # 9 GPUs on an 8-GPU node: refused at submit
        await s.hold(HoldRequest("nine-1", "gpu-node-004", 9, time.time() + 600, 5.0))


async def test_confirm_notice_of_a_job_that_is_gone_is_no_error_and_other_failures_are(tmp_path: Path) -> None:
    """``scancel`` may exit with Slurm's error number truncated to 8 bits and print nothing:
    ESLURM_ALREADY_DONE (2021 → 229) and ESLURM_INVALID_JOB_ID (2017 → 225) mean the job is gone."""
    s = SlurmScheduler(tmp_path / "slurm.conf", output_dir=tmp_path)
    hold = Hold("l", "42", "gpu-node-001", (0,), HoldState.PREEMPTED, None, None, None)
    for code, raised in ((229, False), (225, False), (228, True), (1, True)):

        async def failing(*argv: str, stdin: str | None = None, code: int = code) -> str:
            raise SchedulerError(f"{' '.join(argv)} exited {code}: ", code)

        s.command = failing  # type: ignore[method-assign]
        if raised:
            with pytest.raises(SchedulerError):
                await s.confirm_notice(hold)
        else:
            await s.confirm_notice(hold)
