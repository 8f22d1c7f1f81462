"""Replay generated training jobs on a real Slurm cluster: the Slurm client of
:func:`simulator.replay.replay`.

:class:`SlurmClient` submits each :class:`simulator.training_jobs.TrainingJob` to the ``training``
partition with ``sbatch``, as a batch script that sleeps its compressed run time and then exits 0
(COMPLETED) or 1 (FAILED), or ``scancel``-s itself (CANCELLED, as its owner would: on time however
short). It reads (Slurm 22.05 CLI; there is no slurmdbd here):

* ``squeue -h -t all -o '%i|%T|%V|%S|%e'`` with ``SLURM_TIME_FORMAT=%s``: each job's state and its
  SubmitTime, StartTime, EndTime as Unix seconds (Slurm keeps whole seconds; finished jobs stay
  listed ``MinJobAge`` = 300 s, far longer than a poll);
* ``scontrol show node -d -o``: ``GresUsed=gpu:<type>:N(IDX:...)`` per node, the GPUs allocated now;
* the job's output file: its first line ``started=<Unix time>`` (:func:`script_start`), when the
  batch script began (ms resolution).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

from simulator.replay import Listing, ReplayError
from simulator.training_jobs import TrainingJob

_GRES_USED = re.compile(r"GresUsed=gpu:(?:[\w.-]+:)?(\d+)")
_NODE_NAME = re.compile(r"NodeName=(\S+)")
STARTED_MARK = "started="


class SlurmClient:
    """Slurm's CLI against one cluster (``SLURM_CONF``), with a per-command timeout: a
    :class:`simulator.replay.SchedulerClient`.

    Args:
        conf: path of the cluster's ``slurm.conf``.
        timeout_s: per command.
    """

    def __init__(self, conf: Path, timeout_s: float = 30.0) -> None:
        self.env = {**os.environ, "SLURM_CONF": str(conf), "SLURM_TIME_FORMAT": "%s"}
        self.timeout_s = timeout_s

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command; the completed process (never raises on a non-zero exit)."""
        return subprocess.run(list(args), capture_output=True, text=True, timeout=self.timeout_s,
                              env=self.env, check=False)

    def submit(self, job: TrainingJob, compression: float, out_dir: Path, partition: str = "training",
               gres_type: str = "h100") -> str:
        """``sbatch`` ``job`` (whole nodes above 8 GPUs); its Slurm id.

        The script prints ``started=<Unix time>`` (:func:`script_start`), sleeps ``duration_s /
        compression`` s, then exits 0 (COMPLETED) or 1 (FAILED), or runs ``scancel`` on its own job
        (CANCELLED: the job's environment has ``SLURM_CONF``). ``--time`` is the sleep in whole
        minutes plus one (Slurm's granularity), so backfill has a limit to plan with.

        Raises:
            ReplayError: sbatch failed.
        """
        sleep_s = job.duration_s / compression
        tail = {"COMPLETED": "", "FAILED": "; exit 1",
                # its owner's scancel, from inside: on time however short the job (no poll race)
                "CANCELLED": "; scancel $SLURM_JOB_ID; sleep 60"}[job.final_state]
        done = self.run(
            "sbatch", "--parsable", "-p", partition, "-J", f"train-{job.job_id}", "-N", str(job.nodes),
            f"--gres=gpu:{gres_type}:{job.gpus_per_node}", "-c", "1",
            f"--time={math.ceil(sleep_s / 60) + 1}", "-o", str(out_dir / "%j.out"),
            "--wrap", f"echo {STARTED_MARK}$(date +%s.%N); sleep {sleep_s:.3f}{tail}",
        )
        if done.returncode != 0 or not done.stdout.strip():
            raise ReplayError(f"sbatch of job {job.job_id} failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def _read(self, *args: str) -> subprocess.CompletedProcess[str]:
        """:meth:`run` for a read: a timeout is a :class:`ReplayError`."""
        try:
            return self.run(*args)
        except subprocess.TimeoutExpired as e:
            raise ReplayError(f"{args[0]} timed out after {e.timeout} s") from e

    def jobs(self) -> Listing:
        """Every job Slurm lists: id -> (state, SubmitTime, StartTime, EndTime), whole Unix s or None.

        Raises:
            ReplayError: squeue failed or timed out.
        """
        done = self._read("squeue", "-h", "-t", "all", "-o", "%i|%T|%V|%S|%e")
        if done.returncode != 0:
            raise ReplayError(f"squeue failed: {done.stderr.strip()}")
        out: Listing = {}
        for line in done.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) != 5:
                continue
            out[parts[0]] = (parts[1], _epoch(parts[2]), _epoch(parts[3]), _epoch(parts[4]))
        return out

    def gpus_used(self) -> dict[str, int]:
        """GPUs allocated per node now (``GresUsed``).

        Raises:
            ReplayError: scontrol failed or timed out.
        """
        done = self._read("scontrol", "show", "node", "-d", "-o")
        if done.returncode != 0:
            raise ReplayError(f"scontrol show node failed: {done.stderr.strip()}")
        out = {}
        for line in done.stdout.splitlines():
            name, used = _NODE_NAME.search(line), _GRES_USED.search(line)
            if name and used:
                out[name.group(1)] = int(used.group(1))
        return out

    def cancel(self, *slurm_ids: str) -> None:
        """``scancel`` these jobs (a job already gone is no error)."""
        if slurm_ids:
            self.run("scancel", *slurm_ids)

    def began(self, job_id: str, out_dir: Path) -> float | None:
        """When the job's batch script began: :func:`script_start` of ``<out_dir>/<job_id>.out``."""
        return script_start(out_dir / f"{job_id}.out")


def script_start(out_file: Path) -> float | None:
    """Unix time (s, ns digits) at which a replayed job's batch script began, from the
    ``started=`` line it wrote first to its output file; None when the file or line is missing."""
    try:
        with out_file.open() as f:
            first = f.readline().strip()
    except OSError:
        return None
    if not first.startswith(STARTED_MARK):
        return None
    try:
        return float(first[len(STARTED_MARK):])
    except ValueError:
        return None


def _epoch(text: str) -> float | None:
    """Slurm time with ``SLURM_TIME_FORMAT=%s``: Unix seconds; None for ``N/A``/``Unknown``/0/empty."""
    try:
        v = int(text)
    except ValueError:
        return None
    return float(v) if v > 0 else None
