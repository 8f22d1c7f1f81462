"""What the broker did since it started, for :meth:`BrokerService.stats`: counted once, in the
service's own Prometheus counters (:class:`broker.metrics.BrokerMetrics`), and read back from them
(besides what no metric counts: expiries, capacity records, the latest partitions).

Leases by state are kept incrementally: each logged transition moves one lease from its previous
state to its new one, each forgotten lease leaves its state, and the whole count is taken from the
book only when it is rebuilt (counting the book on every change would scan every remembered
lease on every claim). ``gpupool_broker_leases{state}`` reads :meth:`Tally.lease_counts` at
scrape time."""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from prometheus_client import Counter as PromCounter

from broker.fabric import describe
from broker.leases import LeaseBook
from broker.metrics import BrokerMetrics
from contracts import LeaseLogRecord, LeaseState, ReasonCode

_PARTITIONS_SHOWN = 50

_RECLAIM_OUTCOME = {
    LeaseState.RELEASED: "released_in_notice",
    LeaseState.REVOKED: "revoked_at_deadline",
    LeaseState.EXPIRED: "expired_in_notice",
}


def _total(counter: PromCounter) -> int:
    """The value of an unlabelled counter."""
    return next(int(s.value) for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def _by_label(counter: PromCounter, label: str) -> dict[str, int]:
    """A counter with one label: label value → count, for the values counted so far."""
    return {s.labels[label]: int(s.value) for m in counter.collect() for s in m.samples if s.name.endswith("_total")}


class Tally:
    """What one broker instance did, counted in ``metrics`` (the instance's own)."""

    def __init__(self, metrics: BrokerMetrics) -> None:
        """Start from zero; ``metrics``: the Prometheus counters of the same instance."""
        self._m = metrics
        self.counts: Counter[str] = Counter()
        """What no metric counts: ``expired`` leases, ``capacity_records`` applied."""
        self.partitions: deque[str] = deque(maxlen=_PARTITIONS_SHOWN)
        self._reclaiming: set[str] = set()
        self._state: dict[str, LeaseState] = {}
        self._by_state: Counter[LeaseState] = Counter()

    def rebuilt(self, book: LeaseBook) -> None:
        """Take the lease states from ``book`` (after a rebuild from the lease log). Leases already
        reclaiming were counted by the previous broker: their reclaim is not counted as started
        again."""
        self._reclaiming = {r.lease_id for r in book.live_leases() if r.state is LeaseState.RECLAIMING}
        self._state = {lease_id: r.state for lease_id, r in book.leases.items()}
        self._by_state = Counter(self._state.values())

    def lease_counts(self) -> dict[LeaseState, int]:
        """Remembered leases per state as tallied (every state present, zero if none); equals
        :meth:`broker.leases.LeaseBook.lease_counts` of the book whose changes were tallied.
        Safe to call from another thread (the scrape of ``/metrics``): it only looks up keys."""
        return {s: self._by_state[s] for s in LeaseState}

    def forgotten(self, rec: LeaseLogRecord) -> None:
        """A terminal lease the book dropped (``Changes.forgotten``): it leaves the counts."""
        old = self._state.pop(rec.lease_id, None)
        if old is not None:
            self._by_state[old] -= 1

    def transition(self, rec: LeaseLogRecord) -> None:
        """Count one logged lease transition: the lease's state for the gauges, grants, reclaims
        started (once per lease, not per renewal while reclaiming), reclaim outcomes, expiries."""
        old = self._state.get(rec.lease_id)
        if old is not rec.state:
            if old is not None:
                self._by_state[old] -= 1
            self._by_state[rec.state] += 1
            self._state[rec.lease_id] = rec.state
        if rec.state is LeaseState.GRANTED and rec.seq == 1:
            self._m.leases_granted.inc()
            self.partitions.append(f"{rec.lease_id}: {describe(rec.partition)}")
        elif rec.state is LeaseState.RECLAIMING:
            if rec.lease_id not in self._reclaiming:
                self._reclaiming.add(rec.lease_id)
                self._m.reclaims.labels(outcome="started").inc()
        elif not rec.state.live:
            self._reclaiming.discard(rec.lease_id)
            if rec.state is LeaseState.EXPIRED:
                self.counts["expired"] += 1
            if rec.reclaim_deadline is not None:
                outcome = _RECLAIM_OUTCOME[rec.state]
                self._m.reclaims.labels(outcome=outcome).inc()

    def offer_published(self) -> None:
        """One offer made."""
        self._m.offers_published.inc()

    def offer_withdrawn(self) -> None:
        """One offer withdrawn."""
        self._m.offers_withdrawn.inc()

    def claim(self, code: ReasonCode) -> None:
        """One claim answered with ``code``; a refusal also counts as a rejected message."""
        self._m.claims.labels(result=code.value).inc()
        if code is not ReasonCode.OK:
            self.reject(code.value)

    def reject(self, reason: str) -> None:
        """One rejected input (site message or bus record) by ``reason``."""
        self._m.rejected_messages.labels(reason=reason).inc()

    def demand(self, result: str) -> None:
        """One pool demand read, by result."""
        self._m.demands.labels(result=result).inc()

    def capacity(self) -> None:
        """One capacity update applied."""
        self.counts["capacity_records"] += 1

    def snapshot(self, book: LeaseBook) -> dict[str, Any]:
        """The counts plus the book's live numbers (the shape is :meth:`BrokerService.stats`)."""
        m = self._m
        reclaims, claims = _by_label(m.reclaims, "outcome"), _by_label(m.claims, "result")
        return {
            "offers_published": _total(m.offers_published),
            "offers_withdrawn": _total(m.offers_withdrawn),
            "live_offers": len(book.offers),
            "leases_granted": _total(m.leases_granted),
            "live_leases": len(book.live_leases()),
            "leases_by_state": {s.value: n for s, n in book.lease_counts().items()},
            "reclaims_started": reclaims.get("started", 0),
            "reclaims_completed": sum(n for k, n in reclaims.items() if k != "started"),
            "reclaims": reclaims,
            "expired": self.counts["expired"],
            "claims": claims,
            "rejections": {k: n for k, n in claims.items() if k != ReasonCode.OK.value},
            "rejected_messages": _by_label(m.rejected_messages, "reason"),
            "demands": _by_label(m.demands, "result"),
            "capacity_records": self.counts["capacity_records"],
            "partitions": list(self.partitions),
        }
