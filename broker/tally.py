"""What the broker did since it started: per-instance counts for :meth:`BrokerService.stats`,
mirrored into the process-wide Prometheus metrics of :mod:`broker.metrics`."""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from broker import metrics as m
from broker.fabric import describe
from broker.leases import LeaseBook
from contracts import LeaseLogRecord, LeaseState, ReasonCode

_PARTITIONS_SHOWN = 50

_RECLAIM_OUTCOME = {
    LeaseState.RELEASED: "released_in_notice",
    LeaseState.REVOKED: "revoked_at_deadline",
    LeaseState.EXPIRED: "expired_in_notice",
}


class Tally:
    """Counters of one broker instance (the Prometheus metrics add up every instance of the
    process)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.claims: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.demands: Counter[str] = Counter()
        self.reclaims: Counter[str] = Counter()
        self.partitions: deque[str] = deque(maxlen=_PARTITIONS_SHOWN)
        self._reclaiming: set[str] = set()

    def rebuilt(self, book: LeaseBook) -> None:
        """Leases already reclaiming when the book was rebuilt were counted by the previous
        broker: do not count their reclaim as started again."""
        self._reclaiming = {r.lease_id for r in book.live_leases() if r.state is LeaseState.RECLAIMING}
        self.lease_gauges(book)

    def transition(self, rec: LeaseLogRecord) -> None:
        """Count one logged lease transition: grants, reclaims started (once per lease, not per
        renewal while reclaiming), reclaim outcomes, expiries."""
        if rec.state is LeaseState.GRANTED and rec.seq == 1:
            self.counts["leases_granted"] += 1
            m.LEASES_GRANTED.inc()
            self.partitions.append(f"{rec.lease_id}: {describe(rec.partition)}")
        elif rec.state is LeaseState.RECLAIMING:
            if rec.lease_id not in self._reclaiming:
                self._reclaiming.add(rec.lease_id)
                self.reclaims["started"] += 1
                m.RECLAIMS.labels(outcome="started").inc()
        elif not rec.state.live:
            self._reclaiming.discard(rec.lease_id)
            if rec.state is LeaseState.EXPIRED:
                self.counts["expired"] += 1
            if rec.reclaim_deadline is not None:
                outcome = _RECLAIM_OUTCOME[rec.state]
                self.reclaims[outcome] += 1
                m.RECLAIMS.labels(outcome=outcome).inc()

    def offer_published(self) -> None:
        """One offer made."""
        self.counts["offers_published"] += 1
        m.OFFERS_PUBLISHED.inc()

    def offer_withdrawn(self) -> None:
        """One offer withdrawn."""
        self.counts["offers_withdrawn"] += 1
        m.OFFERS_WITHDRAWN.inc()

    def claim(self, code: ReasonCode) -> None:
        """One claim answered with ``code``; a refusal also counts as a rejected message."""
        self.claims[code.value] += 1
        m.CLAIMS.labels(result=code.value).inc()
        if code is not ReasonCode.OK:
            self.reject(code.value)

    def reject(self, reason: str) -> None:
        """One rejected input (site message or bus record) by ``reason``."""
        self.rejected[reason] += 1
        m.REJECTED_MESSAGES.labels(reason=reason).inc()

    def demand(self, result: str) -> None:
        """One pool demand read, by result."""
        self.demands[result] += 1
        m.DEMANDS.labels(result=result).inc()

    def capacity(self) -> None:
        """One capacity update applied."""
        self.counts["capacity_records"] += 1

    @staticmethod
    def lease_gauges(book: LeaseBook) -> None:
        """Set ``gpupool_broker_leases{state}`` from the book."""
        for state, n in book.lease_counts().items():
            m.LEASES.labels(state=state.value).set(n)

    def snapshot(self, book: LeaseBook) -> dict[str, Any]:
        """The counts plus the book's live numbers (the shape is :meth:`BrokerService.stats`)."""
        return {
            "offers_published": self.counts["offers_published"],
            "offers_withdrawn": self.counts["offers_withdrawn"],
            "live_offers": len(book.offers),
            "leases_granted": self.counts["leases_granted"],
            "live_leases": len(book.live_leases()),
            "leases_by_state": {s.value: n for s, n in book.lease_counts().items()},
            "reclaims_started": self.reclaims["started"],
            "reclaims_completed": sum(n for k, n in self.reclaims.items() if k != "started"),
            "reclaims": dict(self.reclaims),
            "expired": self.counts["expired"],
            "claims": dict(self.claims),
            "rejections": {k: n for k, n in self.claims.items() if k != ReasonCode.OK.value},
            "rejected_messages": dict(self.rejected),
            "demands": dict(self.demands),
            "capacity_records": self.counts["capacity_records"],
            "partitions": list(self.partitions),
        }
