"""Per-lease rows of the demo: site, GPUs, the partition (PKey, SL, verified), its QoS (lent VL,
share bound, verified on the paths' ports) and the
isolate→verified time, folded from the lease log (Kafka ``leases.log``,
:class:`contracts.LeaseLogRecord`) and the fabric manager's timings
(:class:`gpupool.demo_fabric.TimedOpenSmFabric`).

:class:`LeaseWatch` follows the lease log on the bus while the demo runs (a fresh consumer group,
so from the beginning) for the live table; at the end the demo folds the whole dumped log with
:func:`lease_rows`. :func:`write_rows` writes the rows as JSON lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import tempfile
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from contracts import LeaseLogRecord
from contracts.base import decode_compatible
from contracts.bus import Bus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseRow:
    """One lease as the demo shows it.

    Attributes:
        lease_id: the lease.
        site: edge site holding it.
        gpus: GPU keys held (``host/uuid``, :func:`contracts.gpu_key`).
        state: its newest state (``granted``, ``active``, ``reclaiming``, ``released``...).
        granted_at: grant time, Unix s.
        pkey: the partition's PKey as ``0x`` + 4 hex digits; ``None``: no partition (fabric off).
        sl: the partition's InfiniBand service level (0..15); ``None`` without a partition.
        verified: True when the partition was read back from the fabric before the grant.
        isolate_s: seconds from the start of isolation to the verified partition and QoS;
            ``None`` when not isolated (or not measured).
        qos_vl: the lease traffic's own virtual lane; ``None``: no QoS managed (or no partition).
        qos_share_percent: its lent-share bound, percent of a busy link; ``None`` without QoS.
        qos_verified: True when the SL2VL and VL arbitration tables of every port on the
            lease's paths were read back as planned before the grant.
        qos_ports: how many ports that was; ``None`` without QoS.
    """

    lease_id: str
    site: str
    gpus: tuple[str, ...]
    state: str
    granted_at: float
    pkey: str | None
    sl: int | None
    verified: bool
    isolate_s: float | None
    qos_vl: int | None = None
    qos_share_percent: float | None = None
    qos_verified: bool = False
    qos_ports: int | None = None

    @property
    def live(self) -> bool:
        """True while the lease holds its GPUs (granted, active or reclaiming)."""
        return self.state in ("granted", "active", "reclaiming")

    def hosts(self) -> list[str]:
        """The distinct hosts of :attr:`gpus`, sorted."""
        return sorted({g.split("/", 1)[0] for g in self.gpus})

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly dict (``gpus`` as a list)."""
        d = asdict(self)
        d["gpus"] = list(self.gpus)
        return d


def lease_rows(records: Iterable[LeaseLogRecord], isolate_s: Mapping[str, float]) -> list[LeaseRow]:
    """One :class:`LeaseRow` per lease id of ``records``, ordered by grant time then id.

    The newest record of a lease (highest ``seq``, then latest ``ts``) gives its state; the
    partition is the one on its newest record that has one (the lease log carries it on every
    transition after the grant). ``isolate_s`` maps lease id → isolate→verified seconds.
    """
    newest: dict[str, LeaseLogRecord] = {}
    partition: dict[str, LeaseLogRecord] = {}
    for rec in records:
        cur = newest.get(rec.lease_id)
        if cur is None or (rec.seq, rec.ts) >= (cur.seq, cur.ts):
            newest[rec.lease_id] = rec
        if rec.partition is not None:
            had = partition.get(rec.lease_id)
            if had is None or (rec.seq, rec.ts) >= (had.seq, had.ts):
                partition[rec.lease_id] = rec
    rows: list[LeaseRow] = []
    for lease_id, rec in newest.items():
        p = partition[lease_id].partition if lease_id in partition else None
        q = p.qos if p is not None else None
        rows.append(LeaseRow(
            lease_id=lease_id,
            site=rec.site,
            gpus=tuple(rec.gpus),
            state=rec.state.value,
            granted_at=rec.granted_at,
            pkey=None if p is None else f"0x{p.pkey:04x}",
            sl=None if p is None else p.sl,
            verified=bool(p is not None and p.verified),
            isolate_s=isolate_s.get(lease_id),
            qos_vl=None if q is None else q.vl,
            qos_share_percent=None if q is None else q.share_percent,
            qos_verified=bool(q is not None and q.verified),
            qos_ports=None if q is None else q.ports_verified,
        ))
    rows.sort(key=lambda r: (r.granted_at, r.lease_id))
    return rows


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-quantile (0 < q ≤ 1) of ``values``; ``None`` when empty.
    Raises ``ValueError`` for ``q`` outside (0, 1]."""
    if not 0 < q <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def write_rows(rows: Sequence[LeaseRow], path: Path) -> None:
    """Write ``rows`` to ``path`` as JSON lines (one :meth:`LeaseRow.as_dict` per line),
    atomically (a temporary file renamed over it). Raises ``OSError``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(r.as_dict(), sort_keys=True) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class LeaseWatch:
    """Follows the lease log ``topic`` on ``bus`` from its beginning and keeps every record.

    A record that does not decode is skipped and logged (``demo_lease_record_rejected``); it is
    counted once, when the demo dumps the log at the end
    (``gpupool_report_rejected_records_total{reason="bad_record"}``, :mod:`gpupool.report.leases`).
    """

    def __init__(self, bus: Bus, topic: str) -> None:
        self.bus = bus
        self.topic = topic
        self.records: list[LeaseLogRecord] = []

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set (polls every 0.25 s). Raises the bus's connection errors."""
        consumer = self.bus.consumer([self.topic], f"gpupool-demo-leases-{uuid.uuid4().hex[:8]}",
                                     client_id="gpupool-demo")
        await consumer.start()
        try:
            while not stop.is_set():
                for msg in await consumer.getmany(timeout_s=0.25):
                    if msg.value is None:  # tombstones
                        continue
                    try:
                        self.records.append(decode_compatible(LeaseLogRecord, msg.value))
                    except ValueError as e:
                        log.warning("demo_lease_record_rejected", extra={"error": str(e)[:200]})
        finally:
            await consumer.stop()

    def rows(self, isolate_s: Mapping[str, float]) -> list[LeaseRow]:
        """:func:`lease_rows` of the records read so far."""
        return lease_rows(self.records, isolate_s)
