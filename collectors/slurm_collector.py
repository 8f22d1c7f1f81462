"""The Slurm source: read the scheduler on an interval, produce per-node state to ``telemetry.scheduler``.

One :meth:`SlurmCollector.collect` runs ``scontrol --all show node -d -o`` and ``scontrol --all
show job -d -o`` concurrently (each with a deadline; ``SLURM_CONF`` names the cluster), parses
them (:mod:`collectors.slurm_parse`), builds one :class:`contracts.scheduler.SchedulerNode` per
node (:mod:`collectors.slurm_records`) and produces them to ``topics.telemetry_scheduler`` keyed
by host, like the other telemetry.

Why ``scontrol show job`` for the backfill estimates and not ``squeue --start``: both print the
same two fields of the job record (its ``start_time``, the expected start that the backfill
scheduler sets for a pending job, and ``sched_nodes``; ``squeue --start`` columns ``START_TIME``
and ``SCHEDNODES``), and ``scontrol`` gives them in the read that also gives the GPU indices, so
allocations and plans come from one consistent snapshot of the controller (``tests`` compare
the two on the local cluster).

Failures never escape :meth:`collect`: a command that fails (not installed, exit status, timeout,
empty output) or output with no parseable record fails this read of the Slurm source only;
nothing is produced for it (a node record without its jobs would show held GPUs as free), the
failure is counted in ``gpupool_collector_slurm_errors_total{command,reason}`` and logged when it
starts or changes. Lines that do not parse are counted (``reason`` = the parser's) and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import tzinfo
from functools import partial
from pathlib import Path

from collectors.scheduler_source import ReadFailures, produce_records, run_every
from collectors.metrics import SlurmMetrics
from collectors.slurm_parse import JobInfo, NodeInfo, ParseProblem, parse_job, parse_node, parse_records, pending_gpus
from collectors.slurm_records import build_node_records
from contracts.bus import Bus, Producer, require_topics
from contracts.scheduler import SchedulerNode
from contracts.topics import KafkaTopics

__all__ = ["SlurmCollector", "SlurmRead"]

log = logging.getLogger(__name__)

NODE_COMMAND: tuple[str, ...] = ("scontrol", "--all", "show", "node", "--details", "--oneliner")
"""Nodes with their GRES and GRES in use (``GresUsed=gpu:h100:6(IDX:0-5)``)."""
JOB_COMMAND: tuple[str, ...] = ("scontrol", "--all", "show", "job", "--details", "--oneliner")
"""Every job the controller still knows, with per-node GRES indices and pending jobs' plans."""


@dataclass(slots=True)
class SlurmRead:
    """What one :meth:`SlurmCollector.collect` did.

    Attributes:
        ok: both commands ran and gave records.
        failure: ``command:reason`` of the first failure, ``None`` when ``ok``.
        records: the node records built (produced when ``ok``).
        problems: lines that did not parse, by reason.
        produced: records the producer accepted.
        duration_s: wall time of the read (both commands, parsing, producing).
    """

    ok: bool = False
    failure: str | None = None
    records: list[SchedulerNode] = field(default_factory=list)
    problems: Counter[str] = field(default_factory=Counter)
    produced: int = 0
    duration_s: float = 0.0


class _CommandFailed(Exception):
    def __init__(self, command: str, reason: str, detail: str = "") -> None:
        super().__init__(f"{command}: {reason} {detail}".strip())
        self.command = command
        self.reason = reason
        self.detail = detail


class SlurmCollector:
    """Reads a Slurm cluster every ``interval_s`` and produces :class:`SchedulerNode` records.

    Args:
        bus: where records go.
        topics: topic names (``telemetry_scheduler``).
        slurm_conf: the cluster's ``slurm.conf`` (given to the commands as ``SLURM_CONF``);
            ``None``: the commands' own default (``/etc/slurm/slurm.conf``).
        timeout_s: deadline of each command, seconds (> 0).
        run_prefix: argv put before each command (e.g. ``["ssh", "login-1"]``).
        client_id: the producer's client id.
        clock: wall clock for the records' ``ts`` (Unix s).
        tz: time zone ``scontrol`` prints in (``None``: this process's local zone, the one the
            commands it runs print in).
        metrics: where it counts (``gpupool_collector_slurm_*``); give it the collector
            service's registry (``SlurmMetrics(service_registry)``) so its ``/metrics`` shows
            them; ``None``: new ones on a registry of their own (:attr:`metrics`).

    Raises:
        ValueError: ``timeout_s`` not positive.
    """

    def __init__(
        self,
        bus: Bus,
        topics: KafkaTopics,
        *,
        slurm_conf: Path | str | None = None,
        timeout_s: float = 10.0,
        run_prefix: Sequence[str] = (),
        client_id: str = "gpupool-collector-slurm",
        clock: Callable[[], float] = time.time,
        tz: tzinfo | None = None,
        metrics: SlurmMetrics | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self._bus = bus
        self._topics = topics
        self._env = dict(os.environ)
        if slurm_conf is not None:
            self._env["SLURM_CONF"] = str(slurm_conf)
        self._timeout_s = timeout_s
        self._run_prefix = list(run_prefix)
        self._client_id = client_id
        self._clock = clock
        self._tz = tz
        self._producer: Producer | None = None
        self._seq = 0
        self._failures = ReadFailures("slurm")
        self._pending: dict[str, int] = {}
        """GPUs asked by pending jobs at the latest read, by partition (replaced whole)."""
        self.metrics = metrics if metrics is not None else SlurmMetrics()
        self.metrics.watch_pending(lambda: {(part,): n for part, n in self._pending.items()})

    async def start(self) -> None:
        """Check that ``telemetry.scheduler`` exists and start the producer. Raises
        :class:`contracts.bus.MissingTopicsError` if the topic is missing (no stage creates
        topics: ``gpupool topics create``) and what the bus's producer raises when it cannot
        start."""
        if self._producer is None:
            await require_topics(self._bus, [self._topics.telemetry_scheduler])
            producer = self._bus.producer(self._client_id)
            await producer.start()
            self._producer = producer

    async def stop(self) -> None:
        """Flush and stop the producer (idempotent)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                await producer.flush()
            finally:
                await producer.stop()

    async def _run(self, argv: Sequence[str]) -> str:
        """stdout of ``run_prefix + argv``; raises :class:`_CommandFailed` (``not_found``,
        ``exec_error``, ``timeout``, ``exit_status``, ``empty_output``)."""
        name = " ".join(argv[:4])
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._run_prefix, *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._env,
                start_new_session=True,
            )  # fmt: skip
        except FileNotFoundError as exc:
            raise _CommandFailed(name, "not_found", str(exc)) from exc
        except OSError as exc:
            raise _CommandFailed(name, "exec_error", str(exc)) from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self._timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise _CommandFailed(name, "timeout") from None
        if proc.returncode != 0:
            raise _CommandFailed(name, "exit_status", err.decode(errors="replace")[-300:])
        text = out.decode(errors="replace")
        if not text.strip():
            raise _CommandFailed(name, "empty_output")
        return text

    async def read(self) -> tuple[list[NodeInfo], list[JobInfo], list[ParseProblem]]:
        """Run both commands and parse them: ``(nodes, jobs, problems)``.

        Raises:
            _CommandFailed: a command failed, or its output had no parseable node (the job list
                may be empty: ``No jobs in the system``).
        """
        node_text, job_text = await asyncio.gather(self._run(NODE_COMMAND), self._run(JOB_COMMAND))
        nodes, node_problems = parse_records(node_text, parse_node)
        jobs, job_problems = parse_records(job_text, partial(parse_job, tz=self._tz))
        if not nodes:
            raise _CommandFailed(" ".join(NODE_COMMAND[:4]), "no_records", node_text[:200])
        if job_problems and not jobs:
            raise _CommandFailed(" ".join(JOB_COMMAND[:4]), "no_records", job_text[:200])
        return nodes, jobs, [*node_problems, *job_problems]

    async def collect(self) -> SlurmRead:
        """Read Slurm once and produce one record per node (module docstring); never raises for
        a Slurm failure (counted, see :class:`SlurmRead`).

        Raises:
            RuntimeError: :meth:`start` was not awaited.
        """
        if self._producer is None:
            raise RuntimeError("SlurmCollector is not started")
        t0 = time.monotonic()
        result = SlurmRead()
        try:
            nodes, jobs, problems = await self.read()
        except _CommandFailed as exc:
            self.metrics.errors.labels(command=exc.command, reason=exc.reason).inc()
            result.failure = f"{exc.command}:{exc.reason}"
            self._failures.failed(result.failure, command=exc.command, reason=exc.reason, detail=exc.detail)
            result.duration_s = time.monotonic() - t0
            self.metrics.read_duration.observe(result.duration_s)
            return result
        self._failures.ok()
        for p in problems:
            result.problems[p.reason] += 1
            self.metrics.errors.labels(command="parse", reason=p.reason).inc()
            log.warning(
                "slurm_line_rejected", extra={"reason": p.reason, "line_no": p.lineno, "line": p.line[:200]}
            )
        records = build_node_records(nodes, jobs, ts=self._clock(), seq_start=self._seq)
        self._seq += len(records)
        result.records = records
        result.ok = True
        self._pending = pending_gpus(jobs)
        result.produced = await produce_records(self._producer, self._topics.telemetry_scheduler, records, self._failed)
        self.metrics.records.inc(result.produced)
        result.duration_s = time.monotonic() - t0
        self.metrics.read_duration.observe(result.duration_s)
        return result

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        """:meth:`collect` every ``interval_s`` seconds (start to start) until ``stop`` is set; an
        unexpected exception of a read is logged and counted (``command="loop"``), never raised."""
        await run_every(self.collect, interval_s, stop, self._failed)

    def _failed(self, where: str, exc: BaseException) -> None:
        """Count a failure reported by :mod:`collectors.scheduler_source` (``where``: ``produce``
        or ``loop``)."""
        self.metrics.errors.labels(command=where, reason=type(exc).__name__).inc()
