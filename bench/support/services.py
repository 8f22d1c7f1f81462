"""The local services of the benchmarks, started through ``deploy/local/*.sh`` as the tests'
fixtures (``tests/services.py``) start them, but private where a benchmark needs its own settings:

* :class:`Cluster` — a private Slurm cluster (``slurm.sh`` with its own state directory and
  ``GPUPOOL_SLURM_GRACE`` = the notice), with the training-job commands the benchmarks submit;
* :func:`start_mosquitto` / :func:`stop_mosquitto` — a private Mosquitto (``mosquitto.sh`` under
  its own ``GPUPOOL_STATE``, one user per site), so no other broker on the shared server clears
  a benchmark's retained messages;
* :func:`start_kafka` / :func:`stop_kafka` — the shared Kafka node of ``kafka.sh`` (started if it
  does not run; a benchmark isolates itself with a fresh topic prefix).

A folder, not a ``bench/*.py`` file: ``make bench`` runs each of those as a benchmark.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from broker.scheduler_slurm import JOB_NAME

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "local"
NODES = [f"gpu-node-00{i}" for i in (1, 2, 3, 4)]
"""The nodes of ``slurm.sh``'s cluster (8 GPUs each, GRES ``gpu:h100``)."""


class Cluster:
    """A private Slurm cluster: ``slurm.sh start|stop`` with its own state and grace time.

    Args:
        state: the cluster's state directory (``GPUPOOL_SLURM_DIR``).
        notice_s: ``GraceTime`` of the lent partition (the leases' notice), seconds.

    Attributes:
        env: the environment of the scripts; ``conf``: its ``slurm.conf`` (Slurm clients reach
        the cluster with ``SLURM_CONF`` set to it).
    """

    def __init__(self, state: Path, notice_s: int) -> None:
        self.env = {**os.environ, "GPUPOOL_SLURM_DIR": str(state), "GPUPOOL_SLURM_GRACE": str(notice_s)}
        self.conf = state / "slurm.conf"

    def script(self, action: str) -> subprocess.CompletedProcess[str]:
        """``slurm.sh <action>`` (``start``, ``stop``, ``status``); not checked."""
        return subprocess.run(["bash", str(DEPLOY / "slurm.sh"), action], env=self.env,
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip

    def _slurm_env(self) -> dict[str, str]:
        return {**self.env, "SLURM_CONF": str(self.conf)}

    async def submit_training(self, host: str, gpus: int) -> str:
        """A training job (``sleep 600``, partition ``training``) of ``gpus`` GPUs on ``host``;
        returns its job id."""
        proc = await asyncio.create_subprocess_exec(
            "sbatch", "--parsable", "-p", "training", "-w", host, f"--gres=gpu:h100:{gpus}", "-c", "1",
            "-o", "/dev/null", "--wrap", "sleep 600", stdout=asyncio.subprocess.PIPE, env=self._slurm_env(),
        )  # fmt: skip
        out, _ = await proc.communicate()
        return out.decode().strip()

    async def state(self, job: str) -> str:
        """The job's state (``squeue %T``: ``PENDING``, ``RUNNING``...), ``GONE`` once not listed."""
        proc = await asyncio.create_subprocess_exec(
            "squeue", "-h", "-j", job, "-o", "%T", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, env=self._slurm_env(),
        )  # fmt: skip
        out, _ = await proc.communicate()
        return out.decode().strip() or "GONE"

    async def cancel(self, *jobs: str) -> None:
        """``scancel`` the jobs."""
        proc = await asyncio.create_subprocess_exec("scancel", *jobs, env=self._slurm_env())
        await proc.wait()

    async def cancel_all(self) -> None:
        """Cancel every gpupool and training job."""
        for argv in (["-n", JOB_NAME], ["-p", "training"]):
            proc = await asyncio.create_subprocess_exec("scancel", *argv, env=self._slurm_env())
            await proc.wait()

    async def until_running(
        self, job: str, t0: float, timeout_s: float = 120.0, poll_s: float = 0.02
    ) -> float:
        """Seconds from ``t0`` (``time.monotonic()``) until ``job`` runs, asking ``squeue`` every
        ``poll_s``. Raises ``RuntimeError`` after ``timeout_s``."""
        while time.monotonic() - t0 < timeout_s:
            if await self.state(job) == "RUNNING":
                return time.monotonic() - t0
            await asyncio.sleep(poll_s)
        raise RuntimeError(f"job {job} not RUNNING within {timeout_s} s")

    async def until_gone(self, job: str, poll_s: float = 0.05) -> None:
        """Wait until ``job`` is no longer pending or running (``squeue`` every ``poll_s``)."""
        while await self.state(job) not in ("GONE", "COMPLETED", "CANCELLED"):
            await asyncio.sleep(poll_s)


async def _script(script: str, action: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        "bash", str(DEPLOY / script), action, env=env, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def start_mosquitto(state: Path, sites: list[str]) -> dict[str, Any]:
    """A private Mosquitto under ``state`` (``GPUPOOL_STATE``) with one user per site of
    ``sites``; returns its credentials (``{"host", "port", "users": {name: password}, "root"}``).
    Raises ``RuntimeError`` with the script's output if it does not start."""
    env = {**os.environ, "GPUPOOL_STATE": str(state), "GPUPOOL_SITES": ",".join(sites)}
    rc, out, err = await _script("mosquitto.sh", "start", env)
    if rc != 0:
        raise RuntimeError(f"mosquitto.sh start failed ({rc}):\n{out}\n{err}")
    creds: dict[str, Any] = json.loads((state / "mosquitto" / "credentials.json").read_text())
    return creds


async def stop_mosquitto(state: Path) -> None:
    """Stop the private Mosquitto under ``state``."""
    await _script("mosquitto.sh", "stop", {**os.environ, "GPUPOOL_STATE": str(state)})


async def start_kafka() -> tuple[str, bool]:
    """The shared Kafka node (``GPUPOOL_STATE`` of the environment): ``(bootstrap host:port,
    whether this call started it)``. Raises ``RuntimeError`` if it does not start."""
    env = dict(os.environ)
    was_running = (await _script("kafka.sh", "status", env))[0] == 0
    rc, out, err = await _script("kafka.sh", "start", env)
    if rc != 0:
        raise RuntimeError(f"kafka.sh start failed ({rc}):\n{out}\n{err}")
    return out.strip().splitlines()[-1], not was_running


async def stop_kafka() -> None:
    """Stop the shared Kafka node (only if this benchmark started it)."""
    await _script("kafka.sh", "stop", dict(os.environ))
