"""The lease book: idle capacity → offers, claims → leases, renewals, releases, reclaims, expiry.

Pure logic: no I/O and no clock of its own. Every method takes ``now`` (Unix seconds) and returns
what changed (:class:`Changes`) for the caller to log (Kafka ``leases.log``) and publish (MQTT),
so the same calls in the same order always give the same book.

Invariants (checked by :meth:`LeaseBook.violations`, property-tested with hypothesis):

* no GPU is in two live leases (``granted``, ``active``, ``reclaiming``);
* no offer holds a GPU that is leased, reserved by a claim in progress, held back for training,
  planned for a pending training job (``CapacityUpdate.planned_start``), not ``idle`` in the
  newest capacity update (or whose newest update is older than
  ``capacity_max_age_s``: checked at every call with ``now``), or, when the training scheduler
  fences what is lent (:meth:`LeaseBook.set_lendable`), not held for lending in the scheduler; a
  node has at most one offer;
* an offer never promises past its GPUs' predicted idle time
  (``Offer.available_until <= max(min(CapacityUpdate.predicted_idle_until), Offer.ts)``), and
  ``available_until`` is never before the offer's ``ts``;
* no site holds more GPUs (live leases and claims being granted) than its quota;
* no lease is reclaiming with a deadline before its ``min_until`` unless a forced reclaim did it;
* a ``window`` lease has ``window_until`` = ``min_until`` (its promise is its guarantee) and
  ``window_until`` <= ``ends_at``; a ``preemptible`` lease has no ``window_until``;
* a lease is at risk (``at_risk_since``) exactly when it has ``reclaim_expected_at``, and only
  after a capacity update said the scheduler plans a pending job onto one of its GPUs.

Lease kinds (:class:`contracts.leases.LeaseKind`, the claim's ``lease_kind``): a ``preemptible``
lease promises only the notice; a ``window`` lease is promised until ``window_until`` (the offers'
``available_until`` at the reservation, capped at ``ends_at``), refused ``duration_unavailable``
when the offers promise nothing past now. Offers state both prices (``[broker] window_price``,
``preemptible_price``).

At risk: a capacity update whose ``planned_start`` is set (the training scheduler's plan needs the
GPU for a pending job) marks the live, not yet reclaiming lease holding the GPU at risk: the same
state, reason ``at_risk``, ``at_risk_since`` = now, ``reclaim_expected_at`` = the planned start
(moved earlier by an earlier plan, never later). Its lease message goes out at once: the site's
early warning before the scheduler's hard notice. A window lease whose promise the plan cuts
(planned start before ``window_until``) is counted (:attr:`Changes.windows_cut`).

What protects training is the reclaim notice, not the prediction: a GPU is offered as long as the
newest capacity update says idle, and its offer states the prediction as ``available_until`` (the
broker promises nothing past it, and nothing at all once it has passed; analytics refreshes it).
A lease lasts while renewed, up to the claim's ``duration_seconds`` (``ends_at``), and any lease
can be reclaimed with the offer's notice.

Lease states and transitions follow :mod:`contracts.leases`: ``granted`` → ``active`` on the first
renewal; ``granted``/``active`` → ``reclaiming`` on a demand (deadline = now + the offer's notice);
→ ``released`` (site), ``expired`` (TTL or the lease's end passed), ``revoked`` (reclaim deadline
passed). A claim is granted in two steps (:meth:`LeaseBook.begin_claim` reserves the GPUs,
:meth:`LeaseBook.grant` or :meth:`LeaseBook.abort` finishes it) so that fabric isolation can be
applied in between without another claim taking the same GPUs.

A claim names an offer, or gives requirements and the book picks the offers
(:func:`broker.match.match`: one node, else several nodes under one leaf switch); a matched lease
may span several offers (``LeaseLogRecord.offer_ids`` / ``hosts``). Before GPUs are reserved the
site's quota and fair share are checked (:mod:`broker.quota`); every decision is logged
(``claim_decided``) and returned in :attr:`Changes.decisions` (the service counts it in
``gpupool_broker_claim_decisions_total``).

Minimum guaranteed duration: a lease claimed with ``min_duration_seconds`` is not taken back by a
reclaim before ``min_until`` (= grant time + that duration) unless the reclaim is forced. An
unforced reclaim that would end inside the guarantee gets its deadline moved to ``min_until``
(reason ``…;deferred_to_guarantee_end``, :attr:`Changes.reclaims_deferred`): the demand is met
when the guarantee ends. A forced one keeps ``now + notice`` (reason ``…;guarantee_broken``,
:attr:`Changes.guarantees_broken`). A demand for
``count`` GPUs takes unguarded leases first, from the sites most over their fair share.
"""

from __future__ import annotations

import heapq
import logging
import math
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType

from broker.config import BrokerConfig
from broker.match import Placement, match
from broker.quota import WaitingSites, fair_share, holdings, quota_refusal, reclaim_order
from broker.workloads import WorkloadError, allowed
from contracts import (
    CapacityUpdate,
    Claim,
    GpuState,
    LeaseLogRecord,
    LeaseMessage,
    LeaseState,
    Offer,
    OfferedGpu,
    PoolDemand,
    ReasonCode,
    Release,
    Renewal,
)
from contracts.leases import LeaseKind, LeaseReason, Partition
from contracts.mqtt import Requirements
from contracts.topics import lease_hosts

log = logging.getLogger(__name__)

_Node = tuple[str, str]
"""(pool, host): offers group a node's idle GPUs."""
_ClaimKey = tuple[str, str]
"""(site, claim_id): the idempotency key of a claim."""
_WINDOW_MIN_S = 1e-3
"""A matched window claim needs offers promised at least this far past now, seconds."""


@dataclass(frozen=True, slots=True)
class Answer:
    """The book's answer to a site's claim, renewal or release (becomes a :class:`contracts.Reply`).

    Attributes:
        code: :attr:`ReasonCode.OK` or the reason of the rejection.
        text: a short human-readable explanation.
        lease_id: the lease granted, renewed or released, when there is one.
        replayed: True when a repeated ``claim_id`` got its first answer again.
    """

    code: ReasonCode
    text: str = ""
    lease_id: str | None = None
    replayed: bool = False

    @property
    def ok(self) -> bool:
        """True for :attr:`ReasonCode.OK`."""
        return self.code is ReasonCode.OK


@dataclass(frozen=True, slots=True)
class ClaimDecision:
    """One claim decided by the book (granted, or refused and why).

    Attributes:
        site: the claiming site.
        kind: ``offer`` (the claim names an ``offer_id``) or ``match`` (requirements).
        result: ``ok`` or the reason code of the refusal (:class:`contracts.ReasonCode` value).
    """

    site: str
    kind: str
    result: str


@dataclass(slots=True)
class Changes:
    """What one call changed, in order.

    Attributes:
        records: lease transitions (log them to ``leases.log``, then publish each as the retained
            :class:`contracts.LeaseMessage` of the lease).
        published: new offers (publish retained).
        withdrawn: offers that are gone (publish an empty retained payload on their topic).
        forgotten: terminal leases dropped from memory after ``retain_terminal_s`` (clear their
            retained lease message).
        prior: lease id → its record before the first transition in ``records`` (``None``: the
            lease is new), what :meth:`LeaseBook.undo` restores when the log write fails.
        decisions: claims decided, in order (for the caller to count).
        placements: locality tier (``node``, ``leaf``, ``cross_leaf``) of each matched claim
            reserved.
        guarantees_broken: leases reclaimed by a forced demand inside their minimum guarantee.
        reclaims_deferred: reclaims whose deadline was moved to the end of the guarantee.
        at_risk: leases newly marked at risk (or whose expected reclaim moved earlier).
        windows_cut: window leases newly at risk before their ``window_until``.
    """

    records: list[LeaseLogRecord] = field(default_factory=list)
    published: list[Offer] = field(default_factory=list)
    withdrawn: list[Offer] = field(default_factory=list)
    forgotten: list[LeaseLogRecord] = field(default_factory=list)
    prior: dict[str, LeaseLogRecord | None] = field(default_factory=dict)
    decisions: list[ClaimDecision] = field(default_factory=list)
    placements: list[str] = field(default_factory=list)
    guarantees_broken: int = 0
    reclaims_deferred: int = 0
    at_risk: int = 0
    windows_cut: int = 0

    def add(self, new: LeaseLogRecord, prior: LeaseLogRecord | None) -> None:
        """Append the transition ``prior`` → ``new`` (``prior`` ``None``: a new lease)."""
        self.records.append(new)
        self.prior.setdefault(new.lease_id, prior)

    def extend(self, other: Changes) -> Changes:
        """Append ``other``'s changes to these; returns ``self``."""
        self.records.extend(other.records)
        for lease_id, prior in other.prior.items():
            self.prior.setdefault(lease_id, prior)
        self.published.extend(other.published)
        self.withdrawn.extend(other.withdrawn)
        self.forgotten.extend(other.forgotten)
        self.decisions.extend(other.decisions)
        self.placements.extend(other.placements)
        self.guarantees_broken += other.guarantees_broken
        self.reclaims_deferred += other.reclaims_deferred
        self.at_risk += other.at_risk
        self.windows_cut += other.windows_cut
        return self

    def __bool__(self) -> bool:
        """True when there is something to log or publish (decisions and counts alone are not)."""
        return bool(self.records or self.published or self.withdrawn or self.forgotten)


@dataclass(frozen=True, slots=True)
class PendingGrant:
    """A claim that passed validation; its GPUs are reserved until :meth:`LeaseBook.grant` or
    :meth:`LeaseBook.abort`.

    Attributes:
        site: the claiming site (from the topic).
        claim_id: the site's idempotency key.
        offer: the offer claimed.
        record: the lease as it will be logged when granted (state ``granted``, seq 1, no
            partition yet; ``hosts`` every node of its GPUs); hand it to the fabric manager to
            isolate.
        offers: every offer the GPUs come from (first = ``offer``); several for a matched
            claim placed on several nodes.
        matched: True when the book picked the offers from the claim's requirements.
        tier: the locality tier of a matched claim (:attr:`broker.match.Placement.tier`),
            ``None`` for a claim naming an offer.
    """

    site: str
    claim_id: str
    offer: Offer
    record: LeaseLogRecord
    offers: tuple[Offer, ...] = ()
    matched: bool = False
    tier: str | None = None

    @property
    def nodes(self) -> set[tuple[str, str]]:
        """(pool, host) of every offer drawn from."""
        return {(o.pool, o.host) for o in (self.offers or (self.offer,))}


@dataclass(frozen=True, slots=True)
class _Retired:
    offer: Offer
    why: str  # "expired" | "claimed" | "changed"


def _default_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def lease_message(record: LeaseLogRecord, endpoints: Mapping[str, str] | None = None) -> LeaseMessage:
    """The retained MQTT message (:class:`contracts.LeaseMessage`) that tells a site the state of
    the lease in ``record``; ``endpoints``: node → ``host:port`` of the lease's workload healthy
    there (:meth:`broker.lending.Lending.endpoint`). The message's ``endpoints`` lists them in
    the order of the lease's nodes (``record.hosts``; nodes of no lease are left out), its
    ``endpoint`` is the first node's (``None`` until that one is healthy)."""
    hosts = lease_hosts(record.hosts, record.gpus)
    found = endpoints or {}
    return LeaseMessage(
        lease_id=record.lease_id,
        site=record.site,
        claim_id=record.claim_id,
        offer_id=record.offer_id,
        offer_ids=list(record.offer_ids),
        hosts=list(record.hosts),
        gpus=list(record.gpus),
        state=record.state,
        ts=record.ts,
        expires_at=record.expires_at,
        ends_at=record.ends_at,
        reclaim_deadline=record.reclaim_deadline,
        min_until=record.min_until,
        notice_seconds=record.notice_seconds,
        partition=record.partition,
        lent_share_percent=record.lent_share_percent,
        reason=record.reason,
        seq=record.seq,
        workload=record.workload,
        endpoint=found.get(hosts[0]) if hosts else None,
        endpoints=[found[h] for h in hosts if h in found],
        kind=record.kind,
        window_until=record.window_until,
        at_risk_since=record.at_risk_since,
        reclaim_expected_at=record.reclaim_expected_at,
    )


class LeaseBook:
    """Offers, leases and claim answers of one broker; see the module docstring.

    Args:
        config: offer TTL, notice, lease TTL, retention and hold times (:class:`BrokerConfig`).
        new_id: makes a fresh id from a prefix (``"offer"``, ``"lease"``); ids become MQTT topic
            levels, so they must not contain ``/``, ``+`` or ``#``. Default: prefix + 16 hex digits
            of a random UUID. Tests pass a counter to be fully deterministic.
    """

    def __init__(
        self, config: BrokerConfig | None = None, new_id: Callable[[str], str] = _default_id
    ) -> None:
        self.config = config or BrokerConfig()
        self._new_id = new_id
        self._caps: dict[str, CapacityUpdate] = {}
        self._node_of: dict[str, _Node] = {}
        self._nodes: dict[_Node, set[str]] = {}
        self._offers: dict[str, Offer] = {}
        self._node_offer: dict[_Node, str] = {}
        self._retired: dict[str, _Retired] = {}
        self._leases: dict[str, LeaseLogRecord] = {}
        self._gpu_lease: dict[str, str] = {}
        self._reserved: dict[str, _ClaimKey] = {}
        self._pending: dict[_ClaimKey, PendingGrant] = {}
        self._answers: dict[_ClaimKey, tuple[Answer, float]] = {}
        self._holds: dict[str, float] = {}
        self._demands: dict[str, float] = {}
        self._waiting = WaitingSites(self.config.fair_share_window_s)
        self._broken: set[str] = set()
        """Leases whose guarantee a forced reclaim cut short."""
        self._node_timers: list[tuple[float, _Node]] = []
        """(time, node): the node's offer must be looked at again at that time (its offer
        expires, a hold on one of its GPUs ends, a GPU's capacity update goes stale)."""
        self._lease_timers: list[tuple[float, str]] = []
        """(time, lease_id): the lease's TTL or reclaim deadline falls due then (entries of
        older transitions are skipped when popped)."""
        self._forget_at = math.inf
        """Earliest time something remembered may be forgotten (:meth:`_forget` scans then)."""
        self._held: dict[str, int] = {}
        """Site → GPUs in its live leases and claims being granted (kept up to date)."""
        self._lendable: frozenset[str] | None = None
        """GPUs the training scheduler holds ready to lend (:meth:`set_lendable`); ``None``: no
        scheduler fences what is lent, every idle GPU may be offered."""

    # read-only views ----------------------------------------------------------------------------
    @property
    def offers(self) -> Mapping[str, Offer]:
        """Live offers by ``offer_id`` (read-only view)."""
        return MappingProxyType(self._offers)

    @property
    def leases(self) -> Mapping[str, LeaseLogRecord]:
        """Newest record of every remembered lease, live or terminal, by ``lease_id`` (read-only)."""
        return MappingProxyType(self._leases)

    @property
    def capacity(self) -> Mapping[str, CapacityUpdate]:
        """Newest capacity update of every GPU, by GPU key (read-only view)."""
        return MappingProxyType(self._caps)

    def live_leases(self) -> list[LeaseLogRecord]:
        """Leases that hold their GPUs (granted, active, reclaiming), ordered by ``lease_id``."""
        return [r for _, r in sorted(self._leases.items()) if r.state.live]

    def lease_of(self, gpu: str) -> str | None:
        """The live lease holding ``gpu`` (a GPU key), or ``None``."""
        return self._gpu_lease.get(gpu)

    def lease_counts(self) -> dict[LeaseState, int]:
        """Remembered leases per state (every state present, zero if none)."""
        counts = {s: 0 for s in LeaseState}
        for r in self._leases.values():
            counts[r.state] += 1
        return counts

    # capacity -----------------------------------------------------------------------------------
    def apply_capacity(self, update: CapacityUpdate, now: float) -> Changes:
        """Take the newest state of one GPU; offers of its node follow (a GPU that turns busy or
        unknown leaves its offer at once). An update older (by ``ts``) than the one held is
        ignored. A lease's state is never changed (a leased GPU looks busy because the site uses
        it), but an update with ``planned_start`` marks the lease holding the GPU at risk
        (module docstring)."""
        ch = Changes()
        key = update.key
        old = self._caps.get(key)
        if old is not None and update.ts < old.ts:
            return ch
        self._caps[key] = update
        if update.planned_start is not None:
            self._mark_at_risk(key, update.planned_start, now, ch)
        node = (update.pool, update.host)
        dirty = {node}
        prev = self._node_of.get(key)
        if prev is not None and prev != node:
            self._nodes[prev].discard(key)
            dirty.add(prev)
        self._node_of[key] = node
        self._nodes.setdefault(node, set()).add(key)
        if update.state is not GpuState.IDLE:
            self._holds.pop(key, None)  # training has it (or it is unknown): the hold has done its job
        self._wake(node, update.ts + self.config.capacity_max_age_s)
        if key in self._holds:
            self._wake(node, self._holds[key])
        self._reconcile(dirty, now, ch)
        return ch

    def _mark_at_risk(self, gpu: str, planned_start: float, now: float, ch: Changes) -> None:
        """The scheduler plans a pending job onto ``gpu`` at ``planned_start``: mark its lease
        (granted or active) at risk, or move its expected reclaim earlier."""
        lease_id = self._gpu_lease.get(gpu)
        rec = self._leases.get(lease_id) if lease_id is not None else None
        if rec is None or rec.state not in (LeaseState.GRANTED, LeaseState.ACTIVE):
            return
        if rec.reclaim_expected_at is not None and rec.reclaim_expected_at <= planned_start:
            return
        first = rec.at_risk_since is None
        new = self._transition(
            rec,
            rec.state,
            now,
            LeaseReason.AT_RISK,
            at_risk_since=now if first else rec.at_risk_since,
            reclaim_expected_at=planned_start,
        )
        ch.add(new, rec)
        ch.at_risk += 1
        cut = first and rec.window_until is not None and planned_start < rec.window_until
        ch.windows_cut += cut
        log.info(
            "lease_at_risk",
            extra={"lease_id": rec.lease_id, "site": rec.site, "gpu": gpu, "reclaim_expected_at": planned_start,
                   "kind": rec.kind.value, "window_until": rec.window_until, "window_cut": cut},
        )  # fmt: skip

    # the training scheduler's fence ---------------------------------------------------------------
    def set_lendable(self, gpus: Collection[str] | None, now: float) -> Changes:
        """Take the GPU keys the training scheduler now holds ready to lend (for Slurm: a running
        placeholder job in the lent partition, :mod:`broker.placeholders`): from then on only
        these are offered or claimable (on top of every other condition), so an offer never
        names a GPU the scheduler has given to training. ``None`` lifts the fence (no scheduler:
        every idle GPU may be offered). Offers of the nodes whose GPUs changed follow; leases are
        never touched (a leased GPU is held by its lease's jobs, not by a placeholder)."""
        new = None if gpus is None else frozenset(gpus)
        old = self._lendable
        ch = Changes()
        if new == old:
            return ch
        self._lendable = new
        changed = set(self._caps) if old is None or new is None else old ^ new
        self._reconcile({self._node_of[g] for g in changed if g in self._node_of}, now, ch)
        return ch

    def why_not_lendable(self, gpu: str, now: float) -> str:
        """Why GPU key ``gpu`` cannot be leased now, ``""`` when it can (then it is in an offer):
        ``leased``, ``claimed by another site a moment ago``, ``not idle`` (no capacity update,
        or its state is busy or unknown: the update's ``reason`` says why), ``no recent capacity
        update``, ``planned for a pending training job``, ``held for training``, ``not held for
        lending by the training scheduler yet``."""
        return self._unavailable(gpu, now)

    def to_hold_for_lending(self, now: float) -> list[str]:
        """GPU keys, sorted, that would be offered if the training scheduler held them for
        lending: idle with a fresh capacity update, not leased, reserved or held back for
        training (what the scheduler's placeholders should hold, :mod:`broker.lending`)."""
        return sorted(g for g in self._caps if not self._unavailable(g, now, fenced=False))

    # claims ---------------------------------------------------------------------------------------
    def begin_claim(self, site: str, claim: Claim, now: float) -> tuple[Answer | PendingGrant, Changes]:
        """Validate ``claim`` that arrived on ``site``'s claims topic.

        Returns ``(Answer, Changes)`` for a rejection (the decision in ``Changes.decisions``) or a
        repeated ``claim_id`` (its first answer, ``replayed=True``, nothing changed), or
        ``(PendingGrant, Changes)`` (a matched claim's tier in ``Changes.placements``): the GPUs are reserved and the
        offers withdrawn (their remaining GPUs offered anew); finish with :meth:`grant` or
        :meth:`abort`. A claim without ``offer_id`` is matched to the best offers
        (:func:`broker.match.match`). Rejection codes: ``site_mismatch``, ``unknown_workload``
        (the claim's workload profile is not declared or not allowed to the site), ``unknown_offer``,
        ``offer_expired``, ``gpu_unavailable`` (leased, not idle, not in the offer, too few),
        ``notice_too_short``, ``duration_unavailable`` (offer not promised for
        ``min_duration_seconds``, or, for a ``window`` lease, not past now), ``no_match`` (nothing meets the requirements),
        ``quota_exceeded`` (quota or fair share, :mod:`broker.quota`).
        """
        key = (site, claim.claim_id)
        cached = self._answers.get(key)
        if cached is not None:
            a = cached[0]
            return Answer(a.code, a.text, a.lease_id, replayed=True), Changes()
        if key in self._pending:
            return Answer(ReasonCode.INTERNAL, "claim in progress; retry"), Changes()
        answer_or_grant = self._validate_claim(site, claim, now)
        if isinstance(answer_or_grant, Answer):
            self._answers[key] = (answer_or_grant, now)
            self._forget_by(now + self.config.retain_terminal_s)
            if answer_or_grant.code in (ReasonCode.GPU_UNAVAILABLE, ReasonCode.NO_MATCH):
                self._waiting.refused(site, claim.count or len(claim.gpus) or 1, now)
            ch = Changes()
            self._decided(ch, site, claim.claim_id, claim.matched, answer_or_grant.code, answer_or_grant.text)
            return answer_or_grant, ch
        ch = Changes()
        pending = answer_or_grant
        if pending.tier is not None:
            ch.placements.append(pending.tier)
        self._pending[key] = pending
        self._count_held(site, len(pending.record.gpus))
        for g in pending.record.gpus:
            self._reserved[g] = key
        for offer in pending.offers:
            self._retire(offer, "claimed", ch)
        self._reconcile(pending.nodes, now, ch)
        log.info(
            "claim_reserved",
            extra={
                "site": site,
                "claim_id": claim.claim_id,
                "kind": "match" if pending.matched else "offer",
                "lease_id": pending.record.lease_id,
                "gpus": list(pending.record.gpus),
                "hosts": list(pending.record.hosts),
                "offer_ids": list(pending.record.offer_ids),
            },
        )
        return pending, ch

    def grant(
        self, pending: PendingGrant, now: float, partition: Partition | None = None
    ) -> tuple[Answer, Changes]:
        """Turn a reserved claim into a lease in state ``granted`` (with ``partition`` if the
        fabric isolated it); ``expires_at`` counts from ``now``.

        Raises:
            KeyError: ``pending`` is not in progress (already granted or aborted).
        """
        key = (pending.site, pending.claim_id)
        if self._pending.get(key) is not pending:
            raise KeyError(f"claim {pending.claim_id} of {pending.site} is not in progress")
        del self._pending[key]
        draft = pending.record
        for g in draft.gpus:
            self._reserved.pop(g, None)
        expires = now + self.config.lease_ttl_s
        if draft.ends_at is not None:
            expires = min(expires, draft.ends_at)
        # the guarantee counts from the reservation, whose check against the offers' promise
        # (available_until) it passed: time spent isolating never stretches it past that promise
        min_until = draft.min_until
        rec = draft.model_copy(
            update={
                "ts": now,
                "granted_at": now,
                "expires_at": expires,
                "min_until": min_until,
                "partition": partition,
            }
        )
        self._leases[rec.lease_id] = rec
        self._track(rec)
        for g in rec.gpus:
            self._gpu_lease[g] = rec.lease_id
        answer = Answer(ReasonCode.OK, f"lease {rec.lease_id} granted", rec.lease_id)
        self._answers[key] = (answer, now)
        self._forget_by(now + self.config.retain_terminal_s)
        self._waiting.served(pending.site)
        ch = Changes()
        self._decided(
            ch,
            pending.site,
            pending.claim_id,
            pending.matched,
            ReasonCode.OK,
            answer.text,
            lease_id=rec.lease_id,
            gpus=list(rec.gpus),
            hosts=list(rec.hosts),
            min_until=rec.min_until,
        )
        ch.add(rec, None)
        self._reconcile(pending.nodes, now, ch)
        return answer, ch

    def abort(self, pending: PendingGrant, code: ReasonCode, text: str, now: float) -> tuple[Answer, Changes]:
        """Give up a reserved claim (e.g. ``isolation_failed``): the GPUs are free again and
        offered anew; the answer is remembered for the ``claim_id``.

        Raises:
            KeyError: ``pending`` is not in progress.
        """
        key = (pending.site, pending.claim_id)
        if self._pending.get(key) is not pending:
            raise KeyError(f"claim {pending.claim_id} of {pending.site} is not in progress")
        del self._pending[key]
        for g in pending.record.gpus:
            self._reserved.pop(g, None)
        self._count_held(pending.site, -len(pending.record.gpus))
        answer = Answer(code, text)
        self._answers[key] = (answer, now)
        self._forget_by(now + self.config.retain_terminal_s)
        ch = Changes()
        self._decided(ch, pending.site, pending.claim_id, pending.matched, code, text)
        self._reconcile(pending.nodes, now, ch)
        return answer, ch

    def claim(
        self, site: str, claim: Claim, now: float, partition: Partition | None = None
    ) -> tuple[Answer, Changes]:
        """:meth:`begin_claim` then at once :meth:`grant` (no fabric step in between)."""
        step, ch = self.begin_claim(site, claim, now)
        if isinstance(step, Answer):
            return step, ch
        answer, ch2 = self.grant(step, now, partition)
        return answer, ch.extend(ch2)

    def _decided(
        self, ch: Changes, site: str, claim_id: str, matched: bool, code: ReasonCode, text: str, **fields: object
    ) -> None:
        """Log (``claim_decided``) one claim's outcome (granted, or refused and why) and add it to
        ``ch.decisions``."""
        kind = "match" if matched else "offer"
        ch.decisions.append(ClaimDecision(site, kind, code.value))
        log.info(
            "claim_decided",
            extra={
                "site": site,
                "claim_id": claim_id,
                "kind": kind,
                "result": code.value,
                "text": text,
                **fields,
            },
        )

    def held(self) -> dict[str, int]:
        """Site → GPUs it holds now: its live leases plus its claims being granted (sites holding
        none are left out)."""
        return dict(self._held)

    def _count_held(self, site: str, delta: int) -> None:
        n = self._held.get(site, 0) + delta
        if n:
            self._held[site] = n
        else:
            self._held.pop(site, None)

    def _admit(self, site: str, wanted: int, now: float) -> Answer | None:
        """Quota, then fair share (:mod:`broker.quota`) for ``site`` taking ``wanted`` GPUs;
        ``None`` if admitted. A fair-share refusal makes the site count as waiting."""
        held = self._held
        why = quota_refusal(site, held.get(site, 0), wanted, self.config.quota_of(site))
        if why:
            return Answer(ReasonCode.QUOTA_EXCEEDED, why)
        waiting = self._waiting.waiting(now)
        if not waiting.keys() - {site}:
            return None  # nobody else waits: no fair-share limit
        free = sum(len(o.gpus) for o in self._offers.values())
        verdict = fair_share(site, wanted, held, free, waiting, self.config.weight_of)
        if not verdict.ok:
            self._waiting.refused(site, wanted, now)
            return Answer(ReasonCode.QUOTA_EXCEEDED, verdict.text)
        return None

    def _validate_claim(self, site: str, claim: Claim, now: float) -> Answer | PendingGrant:
        if claim.site != site:
            return Answer(ReasonCode.SITE_MISMATCH, f"claim names site {claim.site!r} on {site!r}'s topic")
        if claim.workload is not None:
            try:
                allowed(self.config.workloads, site, claim.workload)
            except WorkloadError as e:
                return Answer(ReasonCode.UNKNOWN_WORKLOAD, str(e))
        if claim.offer_id is None:
            return self._validate_match(site, claim, now)
        offer = self._offers.get(claim.offer_id) or self._successor(claim, now)
        if offer is None:
            return self._answer_retired(claim, now)
        if now >= offer.expires_at:
            return Answer(ReasonCode.OFFER_EXPIRED, f"offer {offer.offer_id} expired")
        wanted = self._wanted(offer, claim)
        if isinstance(wanted, Answer):
            return wanted
        if claim.min_notice_seconds > offer.notice_seconds:
            return Answer(
                ReasonCode.NOTICE_TOO_SHORT,
                f"offer gives {offer.notice_seconds:g} s notice, claim needs {claim.min_notice_seconds:g} s",
            )
        need = claim.min_duration_seconds
        if need > 0 and (offer.available_until is None or offer.available_until < now + need):
            promised = "nothing" if offer.available_until is None else f"{offer.available_until - now:.0f} s"
            return Answer(
                ReasonCode.DURATION_UNAVAILABLE,
                f"offer {offer.offer_id} is promised for {promised}, claim needs {need:g} s",
            )
        if claim.lease_kind == LeaseKind.WINDOW.value and (
            offer.available_until is None or offer.available_until <= now
        ):
            return Answer(
                ReasonCode.DURATION_UNAVAILABLE,
                f"offer {offer.offer_id} promises no window past now; claim a preemptible lease",
            )
        for g in wanted:
            why = self._unavailable(g, now)
            if why:
                return Answer(ReasonCode.GPU_UNAVAILABLE, f"{g}: {why}")
        refused = self._admit(site, len(wanted), now)
        if refused is not None:
            return refused
        return self._new_pending(site, claim, (offer,), wanted, now)

    def _validate_match(self, site: str, claim: Claim, now: float) -> Answer | PendingGrant:
        """Pick offers for a claim without ``offer_id`` (quota first: no matching for a site
        that may not take ``count`` more GPUs anyway)."""
        quota = self.config.quota_of(site)
        why = quota_refusal(site, self._held.get(site, 0), claim.count, quota)
        if why:
            return Answer(ReasonCode.QUOTA_EXCEEDED, why)
        placed = match(
            self._offers.values(),
            claim.requirements or Requirements(),
            claim.count,
            now,
            min_notice=claim.min_notice_seconds,
            # a window lease needs a promise past now, however short its minimum
            min_duration=max(claim.min_duration_seconds,
                             _WINDOW_MIN_S if claim.lease_kind == LeaseKind.WINDOW.value else 0.0),
            usable=lambda g: not self._unavailable(g, now),
        )
        if isinstance(placed, str):
            return Answer(ReasonCode.NO_MATCH, placed)
        avoided = claim.requirements.avoid_hosts if claim.requirements is not None else []
        crowded = sorted(set(placed.hosts).intersection(avoided))
        if crowded:  # no other node could hold it (broker.match: a preference, never a refusal)
            log.info(
                "match_on_avoided_hosts",
                extra={"site": site, "claim_id": claim.claim_id, "hosts": placed.hosts, "avoided": crowded},
            )
        refused = self._admit(site, len(placed.gpus), now)
        if refused is not None:
            return refused
        return self._new_pending(site, claim, placed.offers, list(placed.gpus), now, placed)

    def _new_pending(
        self,
        site: str,
        claim: Claim,
        offers: Sequence[Offer],
        gpus: list[str],
        now: float,
        placed: Placement | None = None,
    ) -> PendingGrant:
        ends_at = now + claim.duration_seconds
        need = claim.min_duration_seconds
        window: float | None = None
        if claim.lease_kind == LeaseKind.WINDOW.value:  # promised until the offers' promise (validated > now)
            promised = [o.available_until for o in offers if o.available_until is not None]
            window = min(min(promised), ends_at) if promised else now + need
        elif claim.kind is LeaseKind.WINDOW:  # a claim of an earlier release: its minimum guarantee
            window = now + need
        record = LeaseLogRecord(
            lease_id=self._new_id("lease"),
            site=site,
            claim_id=claim.claim_id,
            offer_id=offers[0].offer_id,
            offer_ids=[o.offer_id for o in offers],
            hosts=sorted({o.host for o in offers}),
            gpus=gpus,
            state=LeaseState.GRANTED,
            ts=now,
            granted_at=now,
            expires_at=min(now + self.config.lease_ttl_s, ends_at),
            ends_at=ends_at,
            min_until=window,
            notice_seconds=min(o.notice_seconds for o in offers),
            lent_share_percent=self.config.lent_share_percent,
            reason=LeaseReason.CLAIM.value if placed is None else f"{LeaseReason.MATCH}:{placed.tier}",
            seq=1,
            workload=claim.workload,
            kind=claim.kind,
            window_until=window,
        )
        return PendingGrant(
            site=site,
            claim_id=claim.claim_id,
            offer=offers[0],
            record=record,
            offers=tuple(offers),
            matched=claim.matched,
            tier=None if placed is None else placed.tier,
        )

    def _successor(self, claim: Claim, now: float) -> Offer | None:
        """The live offer that replaced the withdrawn offer ``claim.offer_id`` on its node, when
        the claim can be served from it: it holds the GPUs the claim wants (or as many as it
        counts); the old one was withdrawn because its node's offer was claimed in part or
        changed (not expired, and ``now`` is before its own expiry); and the new one's terms are
        no worse: at least the old notice, no dearer prices (an unpriced lease only where the old
        one was unpriced too), the same fabric share, and a promised window no shorter. The claim
        is then checked against the returned offer as if it had named it. ``None`` otherwise."""
        retired = self._retired.get(claim.offer_id or "")
        if retired is None or retired.why == "expired" or now >= retired.offer.expires_at:
            return None
        old = retired.offer
        current = self._offers.get(self._node_offer.get((old.pool, old.host), ""))
        if current is None or isinstance(self._wanted(current, claim), Answer):
            return None
        no_dearer = all(
            new_price == old_price or (new_price is not None and old_price is not None and new_price <= old_price)
            for new_price, old_price in (
                (current.window_price, old.window_price),
                (current.preemptible_price, old.preemptible_price),
            )
        )
        if (
            current.notice_seconds >= old.notice_seconds
            and no_dearer
            and current.lent_share_percent == old.lent_share_percent
            and (old.available_until is None or (current.available_until or 0.0) >= old.available_until)
        ):
            return current
        return None

    def _answer_retired(self, claim: Claim, now: float) -> Answer:
        retired = self._retired.get(claim.offer_id or "")
        if retired is None:
            return Answer(ReasonCode.UNKNOWN_OFFER, f"no offer {claim.offer_id}")
        if retired.why == "expired" or now >= retired.offer.expires_at:
            return Answer(ReasonCode.OFFER_EXPIRED, f"offer {claim.offer_id} expired")
        wanted = self._wanted(retired.offer, claim)
        if isinstance(wanted, Answer):
            return wanted
        if claim.count and not claim.gpus:
            free = [g.gpu for g in retired.offer.gpus if not self._unavailable(g.gpu, now)]
            if len(free) < claim.count:
                return Answer(
                    ReasonCode.GPU_UNAVAILABLE, f"only {len(free)} of the offer's GPUs are still free"
                )
        else:
            for g in wanted:
                why = self._unavailable(g, now)
                if why:
                    return Answer(ReasonCode.GPU_UNAVAILABLE, f"{g}: {why}")
        return Answer(
            ReasonCode.UNKNOWN_OFFER, f"offer {claim.offer_id} was withdrawn; claim a current offer"
        )

    @staticmethod
    def _wanted(offer: Offer, claim: Claim) -> list[str] | Answer:
        in_offer = [g.gpu for g in offer.gpus]
        if claim.gpus:
            wanted = list(dict.fromkeys(claim.gpus))
            missing = [g for g in wanted if g not in in_offer]
            if missing:
                return Answer(
                    ReasonCode.GPU_UNAVAILABLE, f"not in offer {offer.offer_id}: {', '.join(missing)}"
                )
            return wanted
        if claim.count > len(in_offer):
            return Answer(
                ReasonCode.GPU_UNAVAILABLE, f"offer has {len(in_offer)} GPUs, claim wants {claim.count}"
            )
        return in_offer[: claim.count] if claim.count else in_offer

    # renewals and releases --------------------------------------------------------------------------
    def _site_lease(self, site: str, payload_site: str, lease_id: str, now: float) -> LeaseLogRecord | Answer:
        if payload_site != site:
            return Answer(
                ReasonCode.SITE_MISMATCH, f"message names site {payload_site!r} on {site!r}'s topic"
            )
        rec = self._leases.get(lease_id)
        if rec is None or rec.site != site:
            return Answer(ReasonCode.UNKNOWN_LEASE, f"no lease {lease_id} for {site}")
        if not rec.state.live:
            return Answer(ReasonCode.LEASE_NOT_LIVE, f"lease {lease_id} is {rec.state.value}", lease_id)
        return rec

    def renew(self, site: str, renewal: Renewal, now: float) -> tuple[Answer, Changes]:
        """Heartbeat: move ``expires_at`` to ``now + min(extend_seconds or lease_ttl_s,
        lease_ttl_s)``, never past the lease's ``ends_at`` and never backwards; the first renewal
        makes a ``granted`` lease ``active``; the ``ok`` answer's text is ``renewed until
        <ISO-8601 UTC> (<Unix s>)``. Rejections: ``site_mismatch``, ``unknown_lease``
        (also another site's lease), ``lease_not_live`` (terminal, or its TTL already passed)."""
        found = self._site_lease(site, renewal.site, renewal.lease_id, now)
        if isinstance(found, Answer):
            return found, Changes()
        rec = found
        if rec.expires_at <= now:
            return Answer(
                ReasonCode.LEASE_NOT_LIVE, f"lease {rec.lease_id} TTL passed", rec.lease_id
            ), Changes()
        ttl = self.config.lease_ttl_s
        ext = min(renewal.extend_seconds, ttl) if renewal.extend_seconds is not None else ttl
        expires = now + ext
        if rec.ends_at is not None:
            expires = min(expires, rec.ends_at)
        expires = max(expires, rec.expires_at)
        state = LeaseState.ACTIVE if rec.state is LeaseState.GRANTED else rec.state
        new = self._transition(rec, state, now, LeaseReason.RENEWAL, expires_at=expires)
        text = f"renewed until {renewal_time(expires)} ({expires:.3f})"
        ch = Changes()
        ch.add(new, rec)
        return Answer(ReasonCode.OK, text, rec.lease_id), ch

    def release(self, site: str, release: Release, now: float) -> tuple[Answer, Changes]:
        """Early release by the site: the lease becomes ``released`` and its GPUs are offered
        again if still idle (or held back for training if the lease was ``reclaiming``).
        Rejections as for :meth:`renew` (a lease past its TTL can still be released)."""
        found = self._site_lease(site, release.site, release.lease_id, now)
        if isinstance(found, Answer):
            return found, Changes()
        ch = Changes()
        self._end(found, LeaseState.RELEASED, now, LeaseReason.SITE_RELEASE, ch)
        return Answer(ReasonCode.OK, f"lease {found.lease_id} released", found.lease_id), ch

    # reclaims ----------------------------------------------------------------------------------------
    def reclaim(
        self,
        now: float,
        gpus: Sequence[str] = (),
        count: int = 0,
        reason: str = LeaseReason.RECLAIM.value,
        force: bool = False,
        deadline: float | None = None,
    ) -> Changes:
        """Move leases to ``reclaiming`` with ``reclaim_deadline = now + notice_seconds`` (or
        ``deadline`` when given: the training scheduler's own, e.g. the end of Slurm's grace time;
        with ``force``, as the scheduler does not wait for the guarantee).

        ``gpus`` (GPU keys): every granted/active lease holding one of them; named GPUs that are
        not leased are held back from offers (training wants them). Else ``count`` > 0: leases
        until at least ``count`` GPUs are covered — first those whose minimum guaranteed duration
        would not be cut, each group in :func:`broker.quota.reclaim_order` (the site most over
        its share first, its newest lease first). Else every granted/active lease. Leases
        already reclaiming keep their deadline, except under ``force`` those whose deadline was
        deferred to the end of their guarantee.

        A lease whose deadline would fall before its ``min_until`` gets ``min_until`` as its
        deadline instead (reason ``<reason>;deferred_to_guarantee_end``), unless ``force``: then
        the guarantee is broken (reason ``<reason>;guarantee_broken``, counted and logged) and
        the deadline is ``now + notice_seconds``.
        """
        ch = Changes()
        takeable = [
            r
            for r in self._leases.values()
            if r.state in (LeaseState.GRANTED, LeaseState.ACTIVE) or (force and _deferred(r, now))
        ]
        if gpus:
            named = set(gpus)
            targets = sorted((r for r in takeable if named.intersection(r.gpus)), key=lambda r: r.lease_id)
            dirty: set[_Node] = set()
            for g in sorted(named):
                if g not in self._gpu_lease and g in self._caps:
                    self._hold(g, now + self.config.reclaim_hold_s)
                    dirty.add(self._node_of[g])
            self._reconcile(dirty, now, ch)
        else:
            unguarded = [r for r in takeable if not _guarded(r, now)]
            guarded = [r for r in takeable if _guarded(r, now)]
            held = self.held()
            after = dict(held)
            for r in unguarded:
                after[r.site] -= len(r.gpus)
            ordered = reclaim_order(unguarded, held, self.config.weight_of) + reclaim_order(
                guarded, after, self.config.weight_of
            )
            if count > 0:
                targets, covered = [], 0
                for r in ordered:
                    if covered >= count:
                        break
                    targets.append(r)
                    covered += len(r.gpus)
            else:
                targets = ordered
        for r in targets:
            ch.add(self._start_reclaim(r, now, reason, force, ch, deadline), r)
        return ch

    def _start_reclaim(
        self, r: LeaseLogRecord, now: float, reason: str, force: bool, ch: Changes, at: float | None = None
    ) -> LeaseLogRecord:
        """``r`` → ``reclaiming``; its deadline (``at``, else ``now + notice``) respects the minimum
        guarantee unless forced (a broken or deferred guarantee is added to ``ch``'s counts)."""
        deadline = now + r.notice_seconds if at is None else at
        why = reason
        if _guarded(r, now) and r.min_until is not None:
            extra = {"lease_id": r.lease_id, "site": r.site, "min_until": r.min_until, "reason": reason}
            if force:
                why = f"{reason}{LeaseReason.GUARANTEE_BROKEN}"
                self._broken.add(r.lease_id)
                ch.guarantees_broken += 1
                log.warning("guarantee_broken", extra={**extra, "reclaim_deadline": deadline})
            else:
                deadline = r.min_until
                why = f"{reason}{LeaseReason.DEFERRED_TO_GUARANTEE_END}"
                ch.reclaims_deferred += 1
                log.info("reclaim_deferred", extra={**extra, "reclaim_deadline": deadline})
        log.info(
            "reclaim_started",
            extra={
                "lease_id": r.lease_id,
                "site": r.site,
                "gpus": list(r.gpus),
                "reclaim_deadline": deadline,
                "reason": why,
            },
        )
        return self._transition(r, LeaseState.RECLAIMING, now, why, reclaim_deadline=deadline)

    def apply_demand(self, demand: PoolDemand, now: float) -> tuple[str, Changes]:
        """Apply a training demand once (by ``demand_id``): :meth:`reclaim` with reason
        ``demand:<id>`` (``force`` as the demand's: it may cut minimum guarantees short). Returns ``(result, changes)`` with result ``reclaimed``,
        ``nothing_to_reclaim``, ``duplicate`` or ``stale`` (older than ``demand_max_age_s``)."""
        if demand.demand_id in self._demands:
            return "duplicate", Changes()
        self._demands[demand.demand_id] = max(now, demand.ts) + self.config.demand_max_age_s
        self._forget_by(self._demands[demand.demand_id])
        if now - demand.ts > self.config.demand_max_age_s:
            return "stale", Changes()
        ch = self.reclaim(now, demand.gpus, demand.count, f"{LeaseReason.DEMAND}:{demand.demand_id}", demand.force)
        return ("reclaimed" if ch.records else "nothing_to_reclaim"), ch

    # time ----------------------------------------------------------------------------------------------
    def tick(self, now: float) -> Changes:
        """Let time pass: reclaim deadlines passed → ``revoked``; TTL or end passed → ``expired``;
        offers past ``expires_at`` withdrawn and their GPUs offered anew if still eligible; holds,
        terminal leases, claim answers and demand ids past their retention forgotten.

        Only what falls due is touched: leases whose TTL or deadline passed and nodes whose
        timers fired (offer expiry, hold end, a capacity update going stale), not every node, so
        a tick costs little when nothing happens (the service ticks every ``tick_s``)."""
        ch = Changes()
        due: set[str] = set()
        while self._lease_timers and self._lease_timers[0][0] <= now:
            due.add(heapq.heappop(self._lease_timers)[1])
        for lease_id in sorted(due):
            rec = self._leases.get(lease_id)
            if rec is None or not rec.state.live:
                continue
            deadline = rec.reclaim_deadline
            if deadline is not None and deadline <= now and not rec.expires_at < deadline:
                self._end(rec, LeaseState.REVOKED, now, LeaseReason.RECLAIM_DEADLINE, ch)
            elif rec.expires_at <= now:
                ended = rec.ends_at is not None and rec.expires_at >= rec.ends_at
                self._end(rec, LeaseState.EXPIRED, now, LeaseReason.ENDED if ended else LeaseReason.TTL, ch)
        dirty: set[_Node] = set()
        while self._node_timers and self._node_timers[0][0] <= now:
            dirty.add(heapq.heappop(self._node_timers)[1])
        expired = [
            self._offers[oid]
            for node in dirty
            if (oid := self._node_offer.get(node)) is not None and self._offers[oid].expires_at <= now
        ]
        for offer in sorted(expired, key=lambda o: o.offer_id):
            self._retire(offer, "expired", ch)
        if self._holds:
            for g in [g for g, until in self._holds.items() if until <= now]:
                del self._holds[g]
        self._forget(now, ch)
        self._reconcile(dirty, now, ch)
        self._recheck_stale(dirty, now)
        return ch

    def _recheck_stale(self, nodes: Iterable[_Node], now: float) -> None:
        """A GPU whose ``ts + capacity_max_age_s`` rounds to ``<= now`` while
        ``now - ts <= capacity_max_age_s`` still counts as fresh: look again at the next tick."""
        age = self.config.capacity_max_age_s
        for node in nodes:
            for g in self._nodes.get(node, ()):
                cap = self._caps[g]
                if cap.ts + age <= now and not now - cap.ts > age:
                    self._wake(node, math.nextafter(now, math.inf))
                    break

    def _forget(self, now: float, ch: Changes) -> None:
        """Drop what is past its retention; a no-op before :attr:`_forget_at`."""
        if now < self._forget_at:
            return
        keep = self.config.retain_terminal_s
        nxt = math.inf
        for lease_id in sorted(self._leases):
            rec = self._leases[lease_id]
            if not rec.state.live:
                if rec.ts + keep <= now:
                    del self._leases[lease_id]
                    self._broken.discard(lease_id)
                    ch.forgotten.append(rec)
                else:
                    nxt = min(nxt, rec.ts + keep)
        for key, (answer, at) in list(self._answers.items()):
            if at + keep <= now:
                if answer.lease_id is None or answer.lease_id not in self._leases:
                    del self._answers[key]
                # else: kept with its lease, looked at again when the lease is forgotten
            else:
                nxt = min(nxt, at + keep)
        for oid, r in list(self._retired.items()):
            if r.offer.expires_at + keep <= now:
                del self._retired[oid]
            else:
                nxt = min(nxt, r.offer.expires_at + keep)
        for did, until in list(self._demands.items()):
            if until <= now:
                del self._demands[did]
            else:
                nxt = min(nxt, until)
        self._forget_at = nxt

    def _forget_by(self, at: float) -> None:
        """Something remembered may be forgotten at ``at``: scan no later than that."""
        self._forget_at = min(self._forget_at, at)

    def _wake(self, node: _Node, at: float) -> None:
        """Look at ``node``'s offer again at the first tick at or after ``at``."""
        if at < math.inf:
            heapq.heappush(self._node_timers, (at, node))

    def _track(self, rec: LeaseLogRecord) -> None:
        """Schedule ``rec``'s next TTL / reclaim-deadline check (live leases only)."""
        if rec.state.live:
            due = (
                rec.expires_at if rec.reclaim_deadline is None else min(rec.expires_at, rec.reclaim_deadline)
            )
            heapq.heappush(self._lease_timers, (due, rec.lease_id))

    def _hold(self, gpu: str, until: float) -> None:
        """Hold ``gpu`` back from offers until ``until`` (the later of two holds wins)."""
        self._holds[gpu] = max(self._holds.get(gpu, -math.inf), until)
        node = self._node_of.get(gpu)
        if node is not None:
            self._wake(node, self._holds[gpu])

    # recovery ---------------------------------------------------------------------------------------
    def rebuild(self, records: Iterable[LeaseLogRecord], now: float) -> Changes:
        """Restore leases and claim answers from the lease log (any order across leases; the
        record with the highest ``seq`` per ``lease_id`` wins), then :meth:`tick` at ``now``.

        Capacity already applied is kept. Terminal leases older than ``retain_terminal_s`` are not
        restored; GPUs of recently reclaimed leases are held back as before the restart. Should two
        live leases name the same GPU (a corrupt log), the later-granted one is revoked with
        reason ``rebuild_conflict``. Claims in progress and demand ids are not in the log and
        are lost (a repeated demand after a restart is reclaimed again only if its leases are
        still granted/active). Returns the conflicts' and the tick's changes.
        """
        latest: dict[str, LeaseLogRecord] = {}
        self._broken.clear()
        for r in records:
            if r.reason.endswith(LeaseReason.GUARANTEE_BROKEN):
                self._broken.add(r.lease_id)
            cur = latest.get(r.lease_id)
            if cur is None or r.seq >= cur.seq:
                latest[r.lease_id] = r
        self._leases.clear()
        self._gpu_lease.clear()
        self._reserved.clear()
        self._pending.clear()
        self._answers.clear()
        self._holds.clear()
        self._demands.clear()
        self._waiting.clear()
        self._lease_timers.clear()
        self._held.clear()
        self._forget_at = -math.inf
        for node in self._nodes:
            self._wake(node, -math.inf)
        ch = Changes()
        keep, hold = self.config.retain_terminal_s, self.config.reclaim_hold_s
        for rec in sorted(latest.values(), key=lambda r: (r.granted_at, r.lease_id)):
            if rec.state.live:
                if any(g in self._gpu_lease for g in rec.gpus):
                    self._leases[rec.lease_id] = rec
                    new = self._transition(rec, LeaseState.REVOKED, now, LeaseReason.REBUILD_CONFLICT)
                    ch.add(new, rec)
                    continue
                for g in rec.gpus:
                    self._gpu_lease[g] = rec.lease_id
                self._count_held(rec.site, len(rec.gpus))
            elif rec.ts + keep <= now:
                continue
            elif rec.reclaim_deadline is not None and rec.ts + hold > now:
                for g in rec.gpus:
                    self._hold(g, rec.ts + hold)
            self._leases[rec.lease_id] = rec
            self._track(rec)
            self._answers[(rec.site, rec.claim_id)] = (
                Answer(ReasonCode.OK, f"lease {rec.lease_id} granted", rec.lease_id),
                rec.granted_at,
            )
        return ch.extend(self.tick(now))

    # undo ------------------------------------------------------------------------------------------
    def undo(self, ch: Changes, lease_ids: Iterable[str], now: float) -> tuple[list[LeaseLogRecord], Changes]:
        """Take back the transitions of ``ch`` on ``lease_ids`` whose lease-log write failed: each
        lease is as before ``ch`` again (its GPUs held or free as then; a new lease's claim
        answer forgotten, so the site may retry the same ``claim_id``), and a demand whose
        reclaim is undone may be applied again (its id is forgotten).

        Returns ``(restore, changes)``: ``restore`` the records to log so that the lease log
        supersedes a failed write that may still land (the prior record with ``seq`` past the
        failed one; for a new lease a ``revoked`` record with reason ``log_write_failed``: the
        book holds those now), and the offer changes of GPUs freed or taken back."""
        out = Changes()
        restore: list[LeaseLogRecord] = []
        dirty: set[_Node] = set()
        undone = set(lease_ids)
        last: dict[str, LeaseLogRecord] = {r.lease_id: r for r in ch.records if r.lease_id in undone}
        for lease_id, failed in sorted(last.items()):
            prior = ch.prior.get(lease_id)
            cur = self._leases.get(lease_id, failed)
            if cur.state.live:
                for g in cur.gpus:
                    if self._gpu_lease.get(g) == lease_id:
                        del self._gpu_lease[g]
                self._count_held(cur.site, -len(cur.gpus))
            if prior is None:
                back = failed.model_copy(  # small: it must fit where the grant did not
                    update={"state": LeaseState.REVOKED, "ts": now, "seq": failed.seq + 1, "gpus": [],
                            "hosts": [], "offer_ids": [], "reason": LeaseReason.LOG_WRITE_FAILED.value}
                )  # fmt: skip
                answer = self._answers.get((failed.site, failed.claim_id))
                if answer is not None and answer[0].lease_id == lease_id:
                    del self._answers[(failed.site, failed.claim_id)]
                self._forget_by(now + self.config.retain_terminal_s)
            else:
                back = prior.model_copy(update={"seq": failed.seq + 1})
                if back.state.live:
                    for g in back.gpus:
                        self._gpu_lease[g] = lease_id
                    self._count_held(back.site, len(back.gpus))
                    self._track(back)
                if not back.reason.endswith(LeaseReason.GUARANTEE_BROKEN):
                    self._broken.discard(lease_id)
            self._leases[lease_id] = back
            restore.append(back)
            for g in failed.gpus:
                node = self._node_of.get(g)
                if node is not None:
                    dirty.add(node)
        for rec in last.values():
            demand = demand_of(rec.reason)
            if demand is not None:
                self._demands.pop(demand, None)
        self._reconcile(dirty, now, out)
        return restore, out

    # invariants -------------------------------------------------------------------------------------
    def violations(self) -> list[str]:
        """Every broken invariant (see the module docstring) as a sentence; empty when sound."""
        out: list[str] = []
        holder: dict[str, str] = {}
        for rec in self.live_leases():
            for g in rec.gpus:
                if g in holder:
                    out.append(f"{g} is in live leases {holder[g]} and {rec.lease_id}")
                holder[g] = rec.lease_id
        if holder != self._gpu_lease:
            out.append("GPU → lease index disagrees with the live leases")
        per_node: dict[_Node, int] = {}
        for offer in self._offers.values():
            node = (offer.pool, offer.host)
            per_node[node] = per_node.get(node, 0) + 1
            preds: list[float] = []
            for og in offer.gpus:
                g = og.gpu
                cap = self._caps.get(g)
                if g in holder:
                    out.append(f"offer {offer.offer_id} holds {g}, leased by {holder[g]}")
                if g in self._reserved:
                    out.append(f"offer {offer.offer_id} holds {g}, reserved by a claim")
                if self._lendable is not None and g not in self._lendable:
                    out.append(f"offer {offer.offer_id} holds {g}, not held for lending by the scheduler")
                if cap is not None and cap.planned_start is not None:
                    out.append(f"offer {offer.offer_id} holds {g}, planned for a pending training job")
                if cap is None or cap.state is not GpuState.IDLE:
                    out.append(f"offer {offer.offer_id} holds {g}, which is not idle")
                elif cap.predicted_idle_until is not None:
                    preds.append(cap.predicted_idle_until)
            if offer.available_until is not None and offer.available_until < offer.ts:
                out.append(f"offer {offer.offer_id} is available_until before its ts")
            if preds and (
                offer.available_until is None or offer.available_until > max(min(preds), offer.ts)
            ):
                out.append(f"offer {offer.offer_id} promises past its GPUs' predicted idle time")
        out.extend(f"node {n} has {k} offers" for n, k in sorted(per_node.items()) if k > 1)
        counted = holdings(
            self._leases.values(), [(k[0], len(p.record.gpus)) for k, p in self._pending.items()]
        )
        if counted != self._held:
            out.append(f"GPUs held per site {self._held} disagree with the leases {counted}")
        for site, n in sorted(counted.items()):
            quota = self.config.quota_of(site)
            if quota is not None and n > quota:
                out.append(f"site {site} holds {n} GPUs, above its quota {quota}")
        for rec in self.live_leases():
            if (
                rec.state is LeaseState.RECLAIMING
                and rec.min_until is not None
                and rec.reclaim_deadline is not None
                and rec.reclaim_deadline < rec.min_until
                and rec.lease_id not in self._broken
            ):
                out.append(f"lease {rec.lease_id} is reclaimed inside its guarantee without force")
        for rec in self._leases.values():
            if rec.kind is LeaseKind.WINDOW:
                if rec.window_until is None or rec.window_until != rec.min_until:
                    out.append(f"window lease {rec.lease_id} has window_until {rec.window_until} != min_until")
                elif rec.ends_at is not None and rec.window_until > rec.ends_at:
                    out.append(f"window lease {rec.lease_id} is promised past its end")
            elif rec.window_until is not None:
                out.append(f"preemptible lease {rec.lease_id} promises a window")
            if (rec.at_risk_since is None) != (rec.reclaim_expected_at is None):
                out.append(f"lease {rec.lease_id} at_risk_since and reclaim_expected_at disagree")
        return out

    # internals --------------------------------------------------------------------------------------
    def _transition(
        self, rec: LeaseLogRecord, state: LeaseState, now: float, reason: str, **update: object
    ) -> LeaseLogRecord:
        new = rec.model_copy(
            update={"state": state, "ts": now, "reason": str(reason), "seq": rec.seq + 1, **update}
        )
        self._leases[rec.lease_id] = new
        if state.live:
            self._track(new)
        else:
            self._forget_by(now + self.config.retain_terminal_s)
        return new

    def _end(self, rec: LeaseLogRecord, state: LeaseState, now: float, reason: str, ch: Changes) -> None:
        new = self._transition(rec, state, now, reason)
        ch.add(new, rec)
        self._count_held(rec.site, -len(rec.gpus))
        dirty: set[_Node] = set()
        for g in rec.gpus:
            if self._gpu_lease.get(g) == rec.lease_id:
                del self._gpu_lease[g]
            if rec.reclaim_deadline is not None:
                self._hold(g, now + self.config.reclaim_hold_s)
            node = self._node_of.get(g)
            if node is not None:
                dirty.add(node)
        self._reconcile(dirty, now, ch)

    def _unavailable(self, gpu: str, now: float, *, fenced: bool = True) -> str:
        """Why ``gpu`` cannot be leased now; ``""`` if it can. ``fenced=False``: whether the
        training scheduler holds it for lending is not asked."""
        if gpu in self._gpu_lease:
            return "leased"
        if gpu in self._reserved:
            return "claimed by another site a moment ago"
        cap = self._caps.get(gpu)
        if cap is None or cap.state is not GpuState.IDLE:
            return "not idle"
        if now - cap.ts > self.config.capacity_max_age_s:
            return "no recent capacity update"
        if cap.planned_start is not None:
            return "planned for a pending training job"
        if self._holds.get(gpu, -math.inf) > now:
            return "held for training"
        if fenced and self._lendable is not None and gpu not in self._lendable:
            return "not held for lending by the training scheduler yet"
        return ""

    def _eligible(self, node: _Node, now: float) -> list[CapacityUpdate]:
        return [self._caps[g] for g in sorted(self._nodes.get(node, ())) if not self._unavailable(g, now)]

    def _retire(self, offer: Offer, why: str, ch: Changes) -> None:
        del self._offers[offer.offer_id]
        node = (offer.pool, offer.host)
        if self._node_offer.get(node) == offer.offer_id:
            del self._node_offer[node]
        self._retired[offer.offer_id] = _Retired(offer, why)
        self._forget_by(offer.expires_at + self.config.retain_terminal_s)
        ch.withdrawn.append(offer)

    def _reconcile(self, nodes: Iterable[_Node], now: float, ch: Changes) -> None:
        """Make each node's offer match its eligible GPUs (one offer per node, or none)."""
        for node in sorted(nodes):
            caps = self._eligible(node, now)
            cur_id = self._node_offer.get(node)
            cur = self._offers.get(cur_id) if cur_id is not None else None
            if caps:
                gpus = [
                    OfferedGpu(
                        gpu=c.key,
                        model_name=c.model_name,
                        fb_total_mib=c.fb_total_mib,
                        grade=c.grade.value if c.grade is not None else "free",
                    )
                    for c in caps
                ]
                preds = [c.predicted_idle_until for c in caps if c.predicted_idle_until is not None]
                # never before the offer's ts: a prediction that has passed promises nothing beyond now
                avail = max(min(preds), now) if preds else None
                if (
                    cur is not None
                    and cur.gpus == gpus
                    and now < cur.expires_at
                    and _promise_holds(cur.available_until, avail)
                ):
                    continue
            if cur is not None:
                self._retire(cur, "changed", ch)
            if not caps:
                continue
            offer = Offer(
                offer_id=self._new_id("offer"),
                ts=now,
                host=node[1],
                leaf=next((c.leaf for c in caps if c.leaf is not None), None),
                gpus=gpus,
                available_until=avail,
                expires_at=now + self.config.offer_ttl_s,
                notice_seconds=self.config.notice_s,
                pool=node[0],
                zone=self.config.pool_zones.get(node[0]),
                lent_share_percent=self.config.lent_share_percent,
                window_price=self.config.window_price,
                preemptible_price=self.config.preemptible_price,
            )
            self._offers[offer.offer_id] = offer
            self._node_offer[node] = offer.offer_id
            self._wake(node, offer.expires_at)
            ch.published.append(offer)


def _deferred(rec: LeaseLogRecord, now: float) -> bool:
    """True if ``rec`` is reclaiming with a deadline a forced reclaim would bring forward."""
    return (
        rec.state is LeaseState.RECLAIMING
        and rec.reclaim_deadline is not None
        and rec.reclaim_deadline > now + rec.notice_seconds
    )


def _guarded(rec: LeaseLogRecord, now: float) -> bool:
    """True if reclaiming ``rec`` now with its notice would end it before its ``min_until``."""
    return rec.min_until is not None and now + rec.notice_seconds < rec.min_until


def _promise_holds(offered: float | None, now_predicted: float | None) -> bool:
    """True if an offer promising ``offered`` is still honest under the new prediction."""
    if offered is None or now_predicted is None:
        return offered is None and now_predicted is None
    return offered <= now_predicted


def demand_of(reason: str) -> str | None:
    """The demand id of a reclaim's ``reason`` (``demand:<id>[;suffix]``), else ``None``."""
    prefix = f"{LeaseReason.DEMAND}:"
    if not reason.startswith(prefix):
        return None
    return reason[len(prefix):].split(";", 1)[0]


def renewal_time(ts: float) -> str:
    """``ts`` (Unix seconds) as ISO-8601 UTC to the second, ``2026-11-30T06:40:00Z`` (the time shown
    in a renewal's reply text, next to the epoch). Raises ``OverflowError``/``OSError`` for a
    time outside the platform's range."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
