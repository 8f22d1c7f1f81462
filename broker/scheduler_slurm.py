"""Lease holds as Slurm jobs in the lent partition (DESIGN.md "The training scheduler").

A hold is one batch job per lease and node: ``sbatch -p <lent> -w <host> --gres=gpu[:type]:<n>``
named ``gpupool-lease`` with ``--comment=gpupool-lease=<lease id>``, its time limit the lease's end
(rounded up to Slurm's whole minutes; gpupool itself ends the hold at the exact second). While it
runs, Slurm places no other job on its GPUs. A pending training job that needs them preempts it by
Slurm's own partition preemption (``PreemptType=preempt/partition_prio``, the lent partition's
``PreemptMode=CANCEL`` and ``GraceTime`` = the notice), whether or not gpupool runs.

The batch script (:func:`lease_script`) runs the site's workload, if any, on the held GPUs
(``CUDA_VISIBLE_DEVICES`` set by Slurm) and waits. It handles one signal:

* SIGTERM (``--signal=B:TERM@<notice>``: sent by Slurm when it chooses the job for preemption,
  with ``SlurmctldParameters=preempt_send_user_signal``, and ``notice`` seconds before the time
  limit; sent again by :meth:`SlurmScheduler.confirm_notice`, and then ignored): forwarded to the workload so it drains; the script leaves when the workload has exited
  or ``notice`` seconds have passed (then it is killed), whichever comes first, so training gets the GPUs at the
  deadline rather than at Slurm's next grace-time check. A hold without a workload leaves at once.

gpupool ends a hold (the lease released, expired or revoked) with a plain ``scancel``: Slurm marks
the job cancelled at once, sends SIGTERM to every process of the job (the workload drains) and
SIGKILL after the cluster's ``KillWait``.

Preemption is read from ``scontrol show job -d -o``: a job Slurm has chosen has ``PreemptTime``
set and ``EndTime`` moved to the end of its grace time — the deadline the site is told. A hold
whose workload drained and left before the grace time ran out has ended by the time it is read;
Slurm keeps its ``PreemptTime`` (for ``MinJobAge``), so it is still listed, as ended with
``preempted_at`` set: Slurm took it back, it was not lost.

Times printed by Slurm are the controller's local time; they are read in this process's local
time zone (the same host for the local cluster; set ``TZ`` to the controller's for a remote one).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import shlex
import subprocess
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import hostlist

from broker.scheduler import Hold, HoldRequest, HoldState, SchedulerError
from contracts.scheduler import LENT_JOB_NAME

JOB_NAME = LENT_JOB_NAME
"""Job name of every lease hold and placeholder (``squeue -n gpupool-lease`` lists them)."""

COMMENT_PREFIX = "gpupool-lease="
"""A hold's ``Comment`` is this prefix + the lease id."""

IDLE_COMMENT = "gpupool-idle"
"""``Comment`` of a placeholder hold not yet carved into a lease (:mod:`broker.placeholders`):
read as a :class:`Hold` with ``lease_id == ""``."""

_WORKERS = 4
"""Slurm commands that may run at once (worker threads of one :class:`SlurmScheduler`)."""
_LEASE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_JOB_STATE = re.compile(r"(?:^|\s)JobState=(\S+)")
_PREEMPT_TIME = re.compile(r"(?:^|\s)PreemptTime=(\S+)")
_FIELD = re.compile(r"(?:^|\s)([A-Za-z_][\w:/]*)=(\S*)")
_GRES_IDX = re.compile(r"gpu(?::[^:(\s]+)?:(\d+)\(IDX:([\d,\-]+)\)")
_HOLDING_STATES = frozenset(("RUNNING", "SUSPENDED", "SIGNALING", "STOPPED"))
"""Slurm job states in which a job holds its GPUs (read as running)."""
_ENDED = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "TIMEOUT", "COMPLETING", "SPECIAL_EXIT", "REVOKED",
}


def expand_indices(spec: str) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``: Slurm's GRES index list (``IDX:`` in ``scontrol -d``),
    sorted and without duplicates. Raises ``ValueError`` on anything else (empty parts, a range
    whose end is before its start, non-digits)."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a GRES index list: {spec!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"range {part!r} ends before it starts in {spec!r}")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


_NO_TIME = frozenset(("", "None", "Unknown", "N/A", "(null)"))
"""What Slurm prints for a time that is not set."""


def parse_time(value: str) -> float | None:
    """Slurm's ``2026-12-01T14:02:00`` (controller-local time) as Unix seconds; ``None`` for
    ``None``, ``Unknown``, ``N/A`` or an empty value. Raises ``ValueError`` on another form."""
    if value in _NO_TIME:
        return None
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp()


def parse_job_lines(text: str) -> list[dict[str, str]]:
    """``scontrol show job -d -o`` output -> one ``{key: value}`` per job line.

    Format: Slurm's ``scontrol`` one-liner, space-separated ``Key=Value`` pairs (see scontrol(1));
    with ``-d`` a per-node detail (``Nodes=... GRES=gpu:h100:4(IDX:0-3)``) follows on the same
    line. Values that contain spaces (``Command``, ``WorkDir`` with spaces) are cut at the first
    space: the keys read here never contain any. A key that repeats keeps its first value, except
    ``GRES`` (the per-node detail), whose values are joined with ``;``.
    """
    jobs = []
    for line in text.splitlines():
        if not line.strip() or "JobId=" not in line:
            continue
        rec: dict[str, str] = {}
        for key, value in _FIELD.findall(line):
            if key == "GRES" and "GRES" in rec:
                rec["GRES"] += ";" + value
            else:
                rec.setdefault(key, value)
        jobs.append(rec)
    return jobs


def hold_from_record(rec: Mapping[str, str]) -> Hold | None:
    """A :class:`Hold` from one parsed job line, or ``None`` if the job is not a lease hold.

    State: ``PENDING`` -> pending; ``RUNNING``/``SUSPENDED``/``SIGNALING``/``STOPPED`` -> running,
    or preempted when Slurm set ``PreemptTime``; any terminal state or ``COMPLETING`` -> ended. ``deadline`` is
    ``EndTime``. Raises ``ValueError`` on a malformed time or GRES index list.
    """
    comment = rec.get("Comment", "")
    if rec.get("JobName") != JOB_NAME or not (comment.startswith(COMMENT_PREFIX) or comment == IDLE_COMMENT):
        return None
    slurm_state = rec.get("JobState", "")
    preempted_at = parse_time(rec.get("PreemptTime", "None"))
    if slurm_state in ("RUNNING", "SUSPENDED", "SIGNALING", "STOPPED"):
        state = HoldState.PREEMPTED if preempted_at is not None else HoldState.RUNNING
    elif slurm_state in ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING"):
        state = HoldState.PENDING
    else:
        state = HoldState.ENDED
    indices: tuple[int, ...] = ()
    match = _GRES_IDX.search(rec.get("GRES", ""))
    if match and state is not HoldState.PENDING:
        indices = expand_indices(match.group(2))
        if len(indices) != int(match.group(1)):
            raise ValueError(f"GRES count {match.group(1)} but indices {match.group(2)}")
    host = rec.get("NodeList", "")
    return Hold(
        lease_id=comment[len(COMMENT_PREFIX):] if comment != IDLE_COMMENT else "",
        job_id=rec.get("JobId", ""),
        host="" if host in ("(null)", "") else host,
        gpu_indices=indices,
        state=state,
        deadline=parse_time(rec.get("EndTime", "Unknown")),
        preempted_at=preempted_at,
        started_at=parse_time(rec.get("StartTime", "Unknown")) if state is not HoldState.PENDING else None,
    )


def training_gpus(text: str) -> frozenset[tuple[str, int]]:
    """The GPUs that running jobs other than gpupool's hold, from ``scontrol show job -d -o``
    output: ``{(node, GRES index)}``.

    A job is read when its ``JobName`` is not :data:`JOB_NAME` and its ``JobState`` is one in
    which it holds its GPUs (``RUNNING``, ``SUSPENDED``, ``SIGNALING``, ``STOPPED``); each of
    its per-node detail groups (``Nodes=<hostlist> CPU_IDs=... GRES=gpu:h100:4(IDX:0-3)``, one
    per set of nodes with the same GPU indices, ``-d``) gives every node of the host list (Slurm's
    hostlist syntax, ``node[01-03,07]``) those indices. Raises ``ValueError`` on a malformed
    host list or GRES index list.
    """
    out: set[tuple[str, int]] = set()
    for line in text.splitlines():
        if "JobId=" not in line or f" JobName={JOB_NAME} " in line:
            continue
        state = _JOB_STATE.search(line)
        if state is None or state.group(1) not in _HOLDING_STATES:
            continue
        nodes: list[str] = []
        for key, value in _FIELD.findall(line):
            if key == "Nodes":
                try:
                    nodes = list(hostlist.expand_hostlist(value)) if value not in _NO_TIME else []
                except hostlist.BadHostlist as e:
                    raise ValueError(f"bad host list {value!r}: {e}") from e
            elif key == "GRES" and nodes:
                for count, spec in _GRES_IDX.findall(value):
                    indices = expand_indices(spec)
                    if len(indices) != int(count):
                        raise ValueError(f"GRES count {count} but indices {spec}")
                    out.update((node, i) for node in nodes for i in indices)
    return frozenset(out)


def planned_starts(text: str) -> dict[str, float]:
    """When Slurm plans to start a pending job other than gpupool's on each node, from
    ``scontrol show job -d -o`` output: ``{node: earliest StartTime}`` (Unix s).

    A job is read when its ``JobName`` is not :data:`JOB_NAME`, its ``JobState`` is ``PENDING``
    and both its ``StartTime`` (the backfill scheduler's expected start) and ``SchedNodeList``
    (the nodes it is planned onto, Slurm's hostlist syntax) are set. Raises ``ValueError`` on a
    malformed time or host list.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if "JobId=" not in line or f" JobName={JOB_NAME} " in line:
            continue
        state = _JOB_STATE.search(line)
        if state is None or state.group(1) != "PENDING":
            continue
        rec = parse_job_lines(line)[0]
        start, nodes = parse_time(rec.get("StartTime", "Unknown")), rec.get("SchedNodeList", "")
        if start is None or nodes in _NO_TIME:
            continue
        try:
            hosts = hostlist.expand_hostlist(nodes)
        except hostlist.BadHostlist as e:
            raise ValueError(f"bad host list {nodes!r}: {e}") from e
        for host in hosts:
            out[host] = min(start, out.get(host, start))
    return out


@dataclass(frozen=True)
class BackfillTiming:
    """The backfill scheduler's timing (slurm.conf(5), ``SchedulerParameters``).

    Attributes:
        interval_s: ``bf_interval``, seconds between two backfill cycles (Slurm's default 30).
        resolution_s: ``bf_resolution``, seconds: the backfill scheduler keeps the times at
            which jobs start and end in multiples of this (Slurm's default 60). A job it starts
            on resources its plan needs later must end by the planned start rounded down to
            such a multiple (Unix time), not only by the planned start.
    """

    interval_s: float = 30.0
    resolution_s: float = 60.0


SLURM_BACKFILL_DEFAULTS = BackfillTiming()
"""Slurm's own ``bf_interval`` and ``bf_resolution`` (what a cluster that sets neither has)."""

_BF_PARAM = re.compile(r"(?:^|,)(bf_interval|bf_resolution)=(\d+)(?=,|$)")


def backfill_timing(text: str) -> BackfillTiming:
    """:class:`BackfillTiming` from ``scontrol show config`` output (its ``SchedulerParameters
    = a=b,c=d`` line; Slurm's defaults for what it does not set, or when the line is missing).
    Raises ``ValueError`` for a ``bf_interval`` or ``bf_resolution`` of 0."""
    params = ""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "SchedulerParameters":
            params = value.strip()
    found = {k: float(v) for k, v in _BF_PARAM.findall(params)}
    timing = BackfillTiming(
        interval_s=found.get("bf_interval", SLURM_BACKFILL_DEFAULTS.interval_s),
        resolution_s=found.get("bf_resolution", SLURM_BACKFILL_DEFAULTS.resolution_s),
    )
    if timing.interval_s <= 0 or timing.resolution_s <= 0:
        raise ValueError(f"bf_interval and bf_resolution must be positive: {params!r}")
    return timing


def _listed(line: str) -> bool:
    """True for a job line :meth:`SlurmScheduler.jobs` returns: a job not ended, or one that
    ended after Slurm chose it for preemption (``PreemptTime`` set)."""
    state = _JOB_STATE.search(line)
    if state is None or state.group(1) not in _ENDED:
        return True
    preempt = _PREEMPT_TIME.search(line)
    return preempt is not None and preempt.group(1) not in _NO_TIME


def leave_function(notice: int, held_while: str = "", told: str = "") -> str:
    """The bash prelude of every hold script: ``leave``, run on SIGTERM, TERMs the workload
    (``$child``), waits for it at most ``notice`` seconds, KILLs it and exits; a second SIGTERM
    changes nothing. ``held_while``: a file, as a bash word (quoted by the caller); a script
    without a workload then keeps its GPUs, up to ``notice`` seconds, while that file exists (a
    lease's other GPUs, whose workload runs in another hold job, stay held until it is gone).
    ``told`` (with ``held_while``): a file, as a bash word, the broker writes once the lease's
    site has been told of the reclaim; a workload that left early (drained at once) does not
    give the GPUs back before it exists, while ``held_while`` does, within the same ``notice``
    seconds: training never starts on a lease's GPUs before its site heard of the reclaim,
    unless gpupool takes longer than the notice to tell it.

    It also defines ``nap SECONDS``, the scripts' wait while they hold: one that starts no
    process (``read -t`` on a pipe nothing writes to, opened once), so a hold waiting for its
    notice costs no ``fork``/``exec`` of ``sleep`` each tenth of a second, and a trapped SIGTERM
    runs its trap at once. ``leave`` itself waits with ``sleep``: bash reaps an exited workload
    only between commands, not while a trap handler waits in ``read``."""
    site_told = f"""        for ((; i < $1; i++)); do  # the rest of the notice: until the site was told
            [ -f {held_while} ] && [ ! -f {told} ] || break
            sleep 0.1
        done
""" if held_while and told else ""
    hold_on = f"""    elif [ -f {held_while} ]; then
        for ((i = 0; i < $1; i++)); do
            [ -f {held_while} ] || break
            sleep 0.1
        done
""" if held_while else ""
    return f"""notice_ds={notice * 10}
child=
leaving=
exec {{napfd}}<> <(:)  # a pipe no one writes to: nap waits on it without starting a process
nap() {{ read -r -t "$1" -u "$napfd" _; }}  # nap SECONDS
leave() {{  # leave TENTHS: TERM the workload, wait for it at most TENTHS/10 s, KILL it, exit
    local i
    [ -n "$leaving" ] && return 0  # a second SIGTERM (gpupool's confirmation) changes nothing
    leaving=1
    if [ -n "$child" ]; then
        kill -TERM "$child" 2>/dev/null
        for ((i = 0; i < $1; i++)); do
            kill -0 "$child" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$child" 2>/dev/null
{site_told}{hold_on}    fi
    # Reap every child before leaving: an orphan (even a finished one, where PID 1 does not
    # reap) keeps the job's process group alive and Slurm then waits for KillWait.
    wait
    exit 0
}}
trap 'leave $notice_ds' TERM
"""


def lease_script(request: HoldRequest) -> str:
    """The batch script of a hold (see the module docstring for its signals).

    The workload argv is quoted with :func:`shlex.quote`; it comes from the operator's workload
    profile, never from a site.
    """
    command = shlex.join(request.command) if request.command else ""
    notice = max(0, math.ceil(request.notice_s))
    return f"""#!/bin/bash
# gpupool lease {request.lease_id}: hold the GPUs, run the site's workload, leave on notice.
{leave_function(notice)}export GPUPOOL_LEASE_ID={shlex.quote(request.lease_id)}
echo "gpupool-lease start $(date +%s) CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
{command + " &" if command else ":"}
{"child=$!" if command else ""}
while true; do nap 0.2; done
"""


_JOB_GONE_EXIT = frozenset({2017 & 0xFF, 2021 & 0xFF})
"""Exit statuses of ``scancel`` for a job that is gone: Slurm's error number, truncated to 8 bits,
of ``ESLURM_INVALID_JOB_ID`` (2017) and ``ESLURM_ALREADY_DONE`` (2021; ``slurm_errno.h``), which
it may exit with without printing anything (a job that completed as the signal was sent)."""


def job_gone(error: SchedulerError) -> bool:
    """True if ``error`` (from ``scancel``) says only that the job has already ended or does not
    exist (:data:`_JOB_GONE_EXIT`, or Slurm's messages for those errors): nothing was left to do."""
    text = str(error)
    return error.returncode in _JOB_GONE_EXIT or "Invalid job id" in text or "already completing" in text


class SlurmScheduler:
    """Lease holds as jobs in Slurm's lent partition (module docstring: the job, the script).

    Args:
        slurm_conf: the cluster's ``slurm.conf`` (``SLURM_CONF`` for every command); ``None``:
            the environment's.
        partition: the lent partition (low ``PriorityTier``, ``PreemptMode=CANCEL``, ``GraceTime``
            = the notice).
        gres_type: GRES type of the GPUs (``h100`` -> ``--gres=gpu:h100:N``); ``None``: any.
        cpus_per_gpu: CPUs asked per held GPU (``-c``).
        poll_s: seconds between reads while waiting for a hold to start or end.
        command_timeout_s: limit for each Slurm command; a command past it raises
            :class:`SchedulerError`.
        output_dir: where the batch jobs write their output (``lease-<job id>.out``); ``None``:
            ``/dev/null``.
    """

    enforced = True

    def __init__(
        self,
        slurm_conf: Path | None = None,
        *,
        partition: str = "lent",
        gres_type: str | None = "h100",
        cpus_per_gpu: int = 1,
        poll_s: float = 0.05,
        command_timeout_s: float = 10.0,
        output_dir: Path | None = None,
    ) -> None:
        self.slurm_conf = slurm_conf
        self.partition = partition
        self.gres_type = gres_type
        self.cpus_per_gpu = cpus_per_gpu
        self.poll_s = poll_s
        self.command_timeout_s = command_timeout_s
        self.output_dir = output_dir
        self._env = dict(os.environ)
        self._pool: ThreadPoolExecutor | None = None
        if slurm_conf is not None:
            self._env["SLURM_CONF"] = str(slurm_conf)

    async def command(self, *argv: str, stdin: str | None = None) -> str:
        """Run one Slurm command (``SLURM_CONF`` set to :attr:`slurm_conf`); its stdout. Raises
        :class:`SchedulerError` on a non-zero exit, a missing command or a time-out (the command
        is killed then).

        The process is started and waited for in a worker thread (:meth:`_run`), never on the
        event loop's thread: a process start from a large Python process and a slow controller
        then hold up no claim, publication or other read running on the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor(), self._run, argv, stdin)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="slurm-command")
        return self._pool

    def _run(self, argv: tuple[str, ...], stdin: str | None) -> str:
        """:meth:`command` in the calling thread (blocks up to :attr:`command_timeout_s`)."""
        try:
            proc = subprocess.run(
                argv,
                input=stdin.encode() if stdin is not None else None,
                stdin=subprocess.DEVNULL if stdin is None else None,
                capture_output=True,
                env=self._env,
                timeout=self.command_timeout_s,
                check=False,
            )
        except OSError as e:
            raise SchedulerError(f"{argv[0]}: {e}") from e
        except subprocess.TimeoutExpired as e:
            raise SchedulerError(f"{shlex.join(argv)}: no answer within {self.command_timeout_s} s") from e
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip()
            raise SchedulerError(f"{shlex.join(argv)} exited {proc.returncode}: {err}", proc.returncode)
        return proc.stdout.decode(errors="replace")

    async def backfill_timing(self) -> BackfillTiming:
        """The backfill scheduler's timing, from ``scontrol show config``
        (:func:`backfill_timing`). Raises :class:`SchedulerError` if Slurm cannot be read or
        prints a timing that cannot be read."""
        text = await self.command("scontrol", "show", "config")
        try:
            return backfill_timing(text)
        except ValueError as e:
            raise SchedulerError(f"unreadable scontrol show config: {e}") from e

    async def jobs(self, job_id: str | None = None) -> list[Hold]:
        """The hold jobs Slurm lists (one job, or every job) that have not ended, and those that
        ended after Slurm chose them for preemption (``state`` ended, ``preempted_at`` set: the
        job left before its grace time ran out); another job Slurm still remembers in a final
        state, or ``COMPLETING``, is left out. Placeholders not carved into a lease are included
        (``lease_id == ""``). Raises :class:`SchedulerError` if Slurm cannot be read or prints
        what :func:`hold_from_record` cannot read."""
        argv = ("scontrol", "show", "job", "-d", "-o") + ((job_id,) if job_id else ())
        try:  # read and parsed in a worker thread: a long listing holds up nothing on the loop
            return await asyncio.get_running_loop().run_in_executor(self._executor(), self._jobs, argv)
        except SchedulerError as e:
            if job_id and "Invalid job id" in str(e):
                return []
            raise

    async def jobs_and_training(self) -> tuple[list[Hold], frozenset[tuple[str, int]], dict[str, float]]:
        """One read of every job: the holds (as :meth:`jobs` lists them), the GPUs the other
        running jobs (training) hold, ``{(node, GRES index)}`` (:func:`training_gpus`), and when
        the other pending jobs are planned to start, ``{node: Unix s}`` (:func:`planned_starts`).
        Raises :class:`SchedulerError` if Slurm cannot be read or prints what cannot be read."""
        argv = ("scontrol", "show", "job", "-d", "-o")
        return await asyncio.get_running_loop().run_in_executor(self._executor(), self._read, argv)

    def _read(self, argv: tuple[str, ...]) -> tuple[list[Hold], frozenset[tuple[str, int]], dict[str, float]]:
        """:meth:`jobs_and_training` in the calling thread."""
        text = self._run(argv, None)
        try:
            training, planned = training_gpus(text), planned_starts(text)
        except ValueError as e:
            raise SchedulerError(f"unreadable scontrol output: {e}") from e
        return self._holds(text), training, planned

    def _jobs(self, argv: tuple[str, ...]) -> list[Hold]:
        """:meth:`jobs` in the calling thread."""
        return self._holds(self._run(argv, None))

    def _holds(self, text: str) -> list[Hold]:
        """The hold jobs of ``scontrol show job -d -o`` output (:meth:`jobs`)."""
        # only gpupool's own lines of jobs not ended (or ended after a preemption) are parsed:
        # the controller lists every job it remembers (finished ones for MinJobAge, 300 s by
        # default), most of it on a busy cluster
        ours = "\n".join(
            line for line in text.splitlines() if f" JobName={JOB_NAME} " in line and _listed(line)
        )
        try:
            holds = [hold_from_record(rec) for rec in parse_job_lines(ours)]
        except ValueError as e:
            raise SchedulerError(f"unreadable scontrol output: {e}") from e
        return [h for h in holds if h is not None]

    async def hold(self, request: HoldRequest, timeout_s: float = 10.0) -> Hold:
        """See :meth:`broker.scheduler.TrainingScheduler.hold`. Raises :class:`SchedulerError`
        also for a lease id outside ``[A-Za-z0-9._-]{1,64}`` or a count below 1."""
        if not _LEASE_ID.match(request.lease_id):
            raise SchedulerError(f"lease id {request.lease_id!r} is not [A-Za-z0-9._-]{{1,64}}")
        if request.count < 1:
            raise SchedulerError(f"count must be >= 1, got {request.count}")
        minutes = max(1, math.ceil((request.end_at - time.time()) / 60.0))
        gres = f"gpu:{self.gres_type}:{request.count}" if self.gres_type else f"gpu:{request.count}"
        output = str(self.output_dir / "lease-%j.out") if self.output_dir else "/dev/null"
        argv = [
            "sbatch", "--parsable", f"--partition={self.partition}", f"--nodelist={request.host}",
            "--nodes=1", f"--gres={gres}", f"--cpus-per-task={self.cpus_per_gpu * request.count}",
            f"--time={minutes}", f"--signal=B:TERM@{max(1, math.ceil(request.notice_s))}",
            f"--job-name={JOB_NAME}", f"--comment={COMMENT_PREFIX}{request.lease_id}",
            f"--output={output}", "--no-requeue",
        ]
        job_id = (await self.command(*argv, stdin=lease_script(request))).strip().split(";")[0]
        deadline = time.monotonic() + timeout_s
        while True:
            found = await self.jobs(job_id)
            hold = found[0] if found else None
            if hold is not None and hold.state is HoldState.RUNNING and hold.gpu_indices:
                return hold
            if hold is None or hold.state is HoldState.ENDED or time.monotonic() >= deadline:
                await self.command("scancel", job_id)
                why = "ended before it ran" if hold is None or hold.state is HoldState.ENDED else (
                    f"did not run within {timeout_s} s")
                raise SchedulerError(f"hold of lease {request.lease_id} (job {job_id}) on {request.host} {why}")
            await asyncio.sleep(self.poll_s)

    async def release(self, lease_id: str, timeout_s: float = 2.0) -> None:
        """See :meth:`broker.scheduler.TrainingScheduler.release`: ``scancel`` of the lease's
        jobs (module docstring), then wait until Slurm lists none of them as pending or running.
        Raises :class:`SchedulerError` if one is still listed after ``timeout_s`` seconds."""
        jobs = [h.job_id for h in (await self.holds()).values() if h.lease_id == lease_id]
        if not jobs:
            return
        await self.command("scancel", *jobs)
        deadline = time.monotonic() + timeout_s
        while True:
            left = [h for j in jobs for h in await self.jobs(j) if h.state is not HoldState.ENDED]
            if not left:
                return
            if time.monotonic() >= deadline:
                raise SchedulerError(f"lease {lease_id}: jobs {[h.job_id for h in left]} still listed after scancel")
            await asyncio.sleep(self.poll_s)

    async def confirm_notice(self, hold: Hold) -> None:
        """Send SIGTERM to a preempted hold's batch script (``scancel --batch --signal=TERM``).

        Slurm sends it at preemption; a signal that reaches a job step still starting is lost,
        and the hold would then stay until Slurm's periodic grace-time check (up to about 30 s
        late). The broker calls this once when it first sees a hold preempted; the script
        ignores a second SIGTERM, so its deadline never moves. Raises :class:`SchedulerError`
        if ``scancel`` fails for another reason than the job being gone."""
        try:
            await self.command("scancel", "--batch", "--signal=TERM", hold.job_id)
        except SchedulerError as e:
            if not job_gone(e):
                raise

    async def holds(self) -> dict[str, Hold]:
        """See :meth:`broker.scheduler.TrainingScheduler.holds` (ended jobs are left out)."""
        return {h.lease_id: h for h in await self.jobs() if h.lease_id and h.state is not HoldState.ENDED}

    async def remove_stale(self, keep: Collection[str]) -> list[str]:
        """See :meth:`broker.scheduler.TrainingScheduler.remove_stale`."""
        stale = sorted(set(await self.holds()) - set(keep))
        for lease_id in stale:
            await self.release(lease_id)
        return stale
