"""The lease log as ``gpupool report`` needs it.

Leases are not in DuckDB: the broker writes every lease transition to the Kafka topic
``leases.log`` (:class:`contracts.LeaseLogRecord`, keyed and compacted by ``lease_id``). This
module reads those records from a JSON-lines file (one ``LeaseLogRecord`` JSON object per line, the
wire format of :func:`contracts.encode`) or from the bus (reading only: it never writes to the
topic), writes such a file, and folds the records
of each lease into one :class:`LeaseSpan` for the timeline.

A compacted topic may keep only the newest record of a lease; a span is still complete then:
``granted_at`` and ``reclaim_deadline`` travel on every record, and a reclaim started at
``reclaim_deadline - notice_seconds`` (:meth:`broker.leases.LeaseBook.reclaim`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from contracts import LeaseLogRecord, LeaseState, encode
from contracts.base import decode_compatible
from contracts.bus import Bus
from gpupool.report import metrics
from runtime.replay import read_to_end

log = logging.getLogger(__name__)

CLIENT_ID = "gpupool-report"
"""Kafka client id and consumer-group prefix the report reads the lease log with (it only reads)."""


@dataclass(frozen=True, slots=True)
class LeaseSpan:
    """One lease from grant to end, for the timeline. Times are Unix seconds.

    Attributes:
        lease_id / site: the lease and the edge site holding it.
        gpus: GPU keys held (:func:`contracts.gpu_key`).
        granted_at: grant time.
        reclaim_started_at: when the lease went ``reclaiming`` (training wanted the GPUs back);
            ``None`` if never reclaimed.
        reclaim_deadline: when the GPUs were (or will be) taken back regardless; ``None`` if never
            reclaimed.
        ended_at: time of the terminal transition; ``None`` while the lease is live in the log.
        state: the lease's newest state.
        reason: reason of the newest transition (``site_release``, ``ttl``, ``reclaim_deadline``...).
        notice_seconds: reclaim notice the lease was granted with.
    """

    lease_id: str
    site: str
    gpus: tuple[str, ...]
    granted_at: float
    reclaim_started_at: float | None
    reclaim_deadline: float | None
    ended_at: float | None
    state: LeaseState
    reason: str
    notice_seconds: float

    @property
    def reclaimed(self) -> bool:
        """True if training asked for the GPUs back during this lease."""
        return self.reclaim_deadline is not None


def parse_jsonl(lines: Iterable[str], source: str = "<lines>") -> tuple[list[LeaseLogRecord], int]:
    """Decode JSON lines of :class:`contracts.LeaseLogRecord` (blank lines are skipped).

    Returns ``(records, rejected)``. A line that is not a valid record (bad JSON, a missing field,
    another ``schema_version``) is skipped, logged (``lease_log_line_rejected``) and counted in
    ``gpupool_report_rejected_records_total{reason="bad_record"}``; the other lines are kept.
    """
    records: list[LeaseLogRecord] = []
    rejected = 0
    for lineno, line in enumerate(lines, start=1):
        text = line.strip()
        if not text:
            continue
        try:
            records.append(decode_compatible(LeaseLogRecord, text))
        except ValueError as exc:  # pydantic.ValidationError is a ValueError
            rejected += 1
            metrics.REJECTED_RECORDS.labels(reason="bad_record").inc()
            log.warning(
                "lease_log_line_rejected", extra={"source": source, "line": lineno, "error": str(exc)[:300]}
            )
    return records, rejected


def load_jsonl(path: Path) -> tuple[list[LeaseLogRecord], int]:
    """Read a JSON-lines lease log file (see :func:`parse_jsonl`).

    Raises ``OSError`` (``FileNotFoundError``...) if the file cannot be read, ``UnicodeDecodeError``
    if it is not UTF-8.
    """
    with path.open(encoding="utf-8") as fh:
        return parse_jsonl(fh, source=str(path))


def write_jsonl(records: Sequence[LeaseLogRecord], path: Path) -> None:
    """Write ``records`` to ``path`` as JSON lines, atomically (a temporary file renamed over it).

    Raises ``OSError`` if the folder is not writable.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            for rec in records:
                fh.write(encode(rec) + b"\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def read_from_bus(bus: Bus, topic: str, *, timeout_s: float = 30.0) -> tuple[list[LeaseLogRecord], int]:
    """Every record of the lease log ``topic`` on ``bus`` written before this call, read to its
    end without writing anything to the topic (:func:`runtime.replay.read_to_end`, consumer
    group ``gpupool-report-<random>``, never committed). Returns ``(records, rejected)``, in offset
    order within each partition; rejected records (not a :class:`contracts.LeaseLogRecord`) are
    logged (``bus_record_rejected``) and counted in
    ``gpupool_report_rejected_records_total{reason="bad_record"}``.

    Raises ``TimeoutError`` if no partition is assigned or the ends are not reached within
    ``timeout_s`` seconds, and the bus's errors (Kafka: ``aiokafka.errors.KafkaError``).
    """
    records, rejected = await read_to_end(
        bus, topic, LeaseLogRecord, group_prefix=CLIENT_ID, client_id=CLIENT_ID, timeout_s=timeout_s
    )
    if rejected:
        metrics.REJECTED_RECORDS.labels(reason="bad_record").inc(rejected)
    return records, rejected


async def dump_lease_log(bus: Bus, topic: str, path: Path, *, timeout_s: float = 30.0) -> int:
    """Read the lease log ``topic`` to its end (:func:`read_from_bus`) and write it to ``path`` as
    JSON lines (:func:`write_jsonl`), the input of ``gpupool report --leases``.

    Returns the number of records written. Raises like :func:`read_from_bus` and
    :func:`write_jsonl`.
    """
    records, _ = await read_from_bus(bus, topic, timeout_s=timeout_s)
    write_jsonl(records, path)
    log.info("lease_log_dumped", extra={"topic": topic, "path": str(path), "records": len(records)})
    return len(records)


def lease_spans(records: Iterable[LeaseLogRecord]) -> list[LeaseSpan]:
    """Fold lease-log records into one :class:`LeaseSpan` per ``lease_id``, ordered by grant time.

    The newest record of a lease (highest ``seq``, then latest ``ts``) gives its state; the first
    ``reclaiming`` record, if the log still has it, gives the reclaim start, otherwise
    ``reclaim_deadline - notice_seconds``. Duplicated records (at-least-once delivery) are harmless.
    """
    by_lease: dict[str, list[LeaseLogRecord]] = defaultdict(list)
    for rec in records:
        by_lease[rec.lease_id].append(rec)
    spans: list[LeaseSpan] = []
    for lease_id, recs in by_lease.items():
        recs.sort(key=lambda r: (r.seq, r.ts))
        last = recs[-1]
        reclaiming = [r.ts for r in recs if r.state is LeaseState.RECLAIMING]
        if reclaiming:
            reclaim_started: float | None = min(reclaiming)
        elif last.reclaim_deadline is not None:
            reclaim_started = last.reclaim_deadline - last.notice_seconds
        else:
            reclaim_started = None
        spans.append(
            LeaseSpan(
                lease_id=lease_id,
                site=last.site,
                gpus=tuple(last.gpus),
                granted_at=last.granted_at,
                reclaim_started_at=reclaim_started,
                reclaim_deadline=last.reclaim_deadline,
                ended_at=None if last.state.live else last.ts,
                state=last.state,
                reason=last.reason,
                notice_seconds=last.notice_seconds,
            )
        )
    spans.sort(key=lambda s: (s.granted_at, s.lease_id))
    return spans
