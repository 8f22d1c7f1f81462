"""collectors.scheduler_source: what the Slurm and Kubernetes sources share — producing one
read's records (a refused record or flush reported, the others sent) and the read loop (a
failing read reported, the loop going on until stopped)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from collectors.scheduler_source import ReadFailures, produce_records, run_every
from contracts.base import encode
from contracts.scheduler import SchedulerNode


class _Producer:
    """Accepts every send except to the hosts in ``refuse``; the flush raises when ``flush_fails``."""

    def __init__(self, refuse: set[str], flush_fails: bool = False) -> None:
        self.refuse, self.flush_fails = refuse, flush_fails
        self.sent: list[tuple[str, bytes, str | None]] = []

    async def send(self, topic: str, value: bytes, key: str | None = None) -> None:
        if key in self.refuse:
            raise ConnectionError(f"refused {key}")
        self.sent.append((topic, value, key))

    async def flush(self) -> None:
        if self.flush_fails:
            raise TimeoutError("flush")


def _nodes(*hosts: str) -> list[SchedulerNode]:
    return [SchedulerNode(ts=1.0, host=h, state="IDLE") for h in hosts]


def test_produce_records_sends_every_record_keyed_by_host_and_reports_the_refused_one() -> None:
    producer = _Producer(refuse={"node-b"})
    failures: list[tuple[str, str]] = []
    records = _nodes("node-a", "node-b", "node-c")
    produced = asyncio.run(produce_records(producer, "telemetry.scheduler", records,  # type: ignore[arg-type]
                                           lambda where, exc: failures.append((where, type(exc).__name__))))
    assert produced == 2
    assert [(t, k) for t, _, k in producer.sent] == [("telemetry.scheduler", "node-a"), ("telemetry.scheduler", "node-c")]
    assert producer.sent[1][1] == encode(records[2])
    assert failures == [("produce", "ConnectionError")]


def test_produce_records_reports_a_failed_flush_and_keeps_the_count() -> None:
    producer = _Producer(refuse=set(), flush_fails=True)
    failures: list[tuple[str, str]] = []
    produced = asyncio.run(produce_records(producer, "t", _nodes("a", "b"),  # type: ignore[arg-type]
                                           lambda where, exc: failures.append((where, type(exc).__name__))))
    assert produced == 2
    assert failures == [("produce", "TimeoutError")]


def test_run_every_reports_a_failing_read_and_goes_on_until_stopped() -> None:
    calls: list[int] = []
    failures: list[tuple[str, str]] = []

    async def main() -> None:
        stop = asyncio.Event()

        async def collect() -> None:
            calls.append(len(calls))
            if len(calls) == 1:
                raise ValueError("first read breaks")
            if len(calls) == 3:
                stop.set()

        await asyncio.wait_for(
            run_every(collect, 0.01, stop, lambda where, exc: failures.append((where, type(exc).__name__))), 5
        )

    asyncio.run(main())
    assert calls == [0, 1, 2]
    assert failures == [("loop", "ValueError")]


def test_read_failures_log_a_failure_once_per_change_and_the_recovery_once(caplog: pytest.LogCaptureFixture) -> None:
    failures = ReadFailures("slurm")
    with caplog.at_level(logging.INFO, logger="collectors.scheduler_source"):
        failures.ok()  # nothing failed: no recovery to log
        failures.failed("sinfo:timeout", command="sinfo")
        failures.failed("sinfo:timeout", command="sinfo")
        failures.failed("squeue:exit_1", command="squeue")
        assert failures.failing == "squeue:exit_1"
        failures.ok()
        failures.ok()
    events = [(r.getMessage(), getattr(r, "failure", None) or getattr(r, "was", None)) for r in caplog.records]
    assert events == [("slurm_read_failed", "sinfo:timeout"), ("slurm_read_failed", "squeue:exit_1"),
                      ("slurm_read_recovered", "squeue:exit_1")]
    assert caplog.records[0].command == "sinfo"  # type: ignore[attr-defined]
    assert failures.failing is None
