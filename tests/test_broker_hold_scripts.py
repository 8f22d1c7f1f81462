"""The hold scripts wait for their notice without starting a process: an idle placeholder
(broker/placeholders.py ``placeholder_script``) and a lease hold (broker/scheduler_slurm.py
``lease_script``) poll with bash's ``read -t`` (``nap``), not ``sleep``, and still leave at once
on SIGTERM. Run with bash outside Slurm, with a ``sleep`` on ``PATH`` that logs each start."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from broker.placeholders import placeholder_script
from broker.scheduler import HoldRequest
from broker.scheduler_slurm import lease_script


def _path_with_logging_sleep(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose ``sleep`` appends a line to a log file, then sleeps."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sleeps.log"
    real = subprocess.run(
        ["bash", "-c", "command -v sleep"], capture_output=True, text=True, check=True
    ).stdout.strip()
    fake = bin_dir / "sleep"
    fake.write_text(f'#!/bin/bash\necho "$@" >>{log}\nexec {real} "$@"\n')
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}, log


def _run_then_term(script: Path, env: dict[str, str], wait_s: float, ready: Path | None = None) -> int:
    """Run ``bash script``, wait ``wait_s`` seconds (after ``ready`` exists, when given), send
    SIGTERM and return its exit status (within 10 s)."""
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while ready is not None and not ready.exists():
            assert time.monotonic() < deadline, f"{ready} never written"
            time.sleep(0.02)
        time.sleep(wait_s)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_an_idle_placeholder_waits_without_starting_a_process(tmp_path: Path) -> None:
    env, log = _path_with_logging_sleep(tmp_path)
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    script = tmp_path / "placeholder.sh"
    script.write_text(placeholder_script(2.0, ctl))
    # 1 s of polling for the start file every 0.1 s: no sleep started; SIGTERM while idle leaves at once
    assert _run_then_term(script, env, 1.0, ready=ctl / "7.idle") == 0
    assert not log.exists(), log.read_text()
    assert not (ctl / "7.idle").exists() and not (ctl / "7.term").exists()


def test_a_lease_hold_waits_without_starting_a_process(tmp_path: Path) -> None:
    env, log = _path_with_logging_sleep(tmp_path)
    started = tmp_path / "started"
    script = tmp_path / "hold.sh"
    script.write_text(lease_script(HoldRequest("l1", "h", 1, 0.0, 2.0, ("touch", str(started)))))
    t0 = time.monotonic()
    assert _run_then_term(script, env, 1.0, ready=started) == 0
    assert time.monotonic() - t0 < 5  # left on SIGTERM, not after the notice
    assert not log.exists(), log.read_text()


def test_the_logging_sleep_sees_a_sleeping_script(tmp_path: Path) -> None:
    """The check above can fail: a loop with ``sleep`` is seen."""
    env, log = _path_with_logging_sleep(tmp_path)
    script = tmp_path / "sleeper.sh"
    script.write_text("trap 'exit 0' TERM\nwhile true; do sleep 0.1 & wait $!; done\n")
    assert _run_then_term(script, env, 0.5) == 0
    assert log.read_text().splitlines()[0] == "0.1"


def _carved_placeholder(tmp_path: Path, notice_s: float = 2.0) -> tuple[subprocess.Popen[bytes], Path]:
    """A placeholder (job 7) carved into a lease whose workload leaves at once on SIGTERM, sent
    SIGTERM once the workload runs (Slurm's preemption); the process and the control folder."""
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    script = tmp_path / "placeholder.sh"
    script.write_text(placeholder_script(notice_s, ctl))
    env = {**os.environ, "SLURM_JOB_ID": "7"}
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 10
    while not (ctl / "7.idle").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    (ctl / "7.idle").rename(ctl / "7.held")  # the broker carves it
    started = tmp_path / "started"
    (ctl / "7.start").write_text(f"trap 'exit 0' TERM\n: >{started}\nwhile true; do sleep 0.05; done\n")
    while not started.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    while not (ctl / "7.term").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return proc, ctl


def test_a_lease_hold_whose_workload_left_keeps_its_gpu_until_the_site_was_told(tmp_path: Path) -> None:
    """The workload drains at once, but the GPU stays held (the job runs) until the broker's told
    file says the lease's site was sent the reclaim: training does not start on a lease's GPU
    before its site heard of the reclaim (unless the notice runs out first, below)."""
    proc, ctl = _carved_placeholder(tmp_path)
    try:
        time.sleep(0.8)
        assert proc.poll() is None  # the workload left; the site not told yet: still held
        (ctl / "7.told").touch()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_lease_hold_leaves_untold_at_the_notice_end_or_when_its_lease_ended(tmp_path: Path) -> None:
    proc, ctl = _carved_placeholder(tmp_path)
    try:
        time.sleep(0.5)
        assert proc.poll() is None
        assert proc.wait(10) == 0  # never told: it leaves once the 2 s notice has passed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    (tmp_path / "again").mkdir()
    proc, ctl = _carved_placeholder(tmp_path / "again", notice_s=30.0)
    try:
        time.sleep(0.5)
        assert proc.poll() is None
        (ctl / "7.held").unlink()  # the lease ended (the site released it): its GPU goes back
        assert proc.wait(10) == 0  # long before the 30 s notice
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
