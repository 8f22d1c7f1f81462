"""Lease states and the lease-log record (Kafka ``leases.log``, compacted by ``lease_id``).

State machine (DESIGN.md "Broker protocol")::

    granted ─► active ─► reclaiming(deadline) ─► released | revoked
        │         │                               ▲
        │         └──────────────► released ──────┘ (site releases early)
        └───────► expired (no renewal within the TTL)

``released``, ``expired`` and ``revoked`` are terminal; a GPU is in at most one non-terminal lease.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from contracts.base import Record


class LeaseState(StrEnum):
    """State of a lease; see the module docstring for the transitions."""

    GRANTED = "granted"
    ACTIVE = "active"
    RECLAIMING = "reclaiming"
    RELEASED = "released"
    EXPIRED = "expired"
    REVOKED = "revoked"

    @property
    def live(self) -> bool:
        """True while the lease holds its GPUs (granted, active, reclaiming)."""
        return self in (LeaseState.GRANTED, LeaseState.ACTIVE, LeaseState.RECLAIMING)


class LeaseKind(StrEnum):
    """The two kinds of lease a site chooses between in its claim (``Claim.lease_kind``).

    ``preemptible``: spot capacity; promises only the reclaim notice (``notice_seconds``): the
    GPUs may be taken back at any time the training scheduler needs them, with that notice.
    ``window``: a promised window; the lease is promised until ``window_until`` (the offer's
    ``available_until`` at the grant, from the scheduler's plan and the idle predictor, capped
    at the lease's ``ends_at``): no reclaim of gpupool's own takes the GPUs back before it unless
    forced, and a training job planned onto the GPUs before it is announced early (``at_risk``).
    Offers state a price for each kind (``Offer.window_price`` / ``Offer.preemptible_price``).
    """

    PREEMPTIBLE = "preemptible"
    WINDOW = "window"


class LeaseReason(StrEnum):
    """Why a lease transition happened: the ``reason`` of a lease-log record and lease message is
    one of these values, possibly followed by ``:<detail>`` where noted, and by at most one of
    the suffixes :attr:`GUARANTEE_BROKEN` / :attr:`DEFERRED_TO_GUARANTEE_END` on a reclaim."""

    CLAIM = "claim"
    """Granted from a claim naming an offer."""
    MATCH = "match"
    """Granted from a matched claim; ``match:<tier>`` with tier ``node``, ``leaf`` or ``cross_leaf``."""
    RENEWAL = "renewal"
    """Renewed by the site (TTL moved; ``granted`` → ``active`` on the first)."""
    SITE_RELEASE = "site_release"
    """Released early by the site."""
    TTL = "ttl"
    """Expired: not renewed within the TTL."""
    ENDED = "ended"
    """Expired: the claim's ``duration_seconds`` (``ends_at``) was reached."""
    DEMAND = "demand"
    """Reclaiming for a training demand: ``demand:<demand_id>``."""
    RECLAIM = "reclaim"
    """Reclaiming asked for by the operator without a demand record."""
    SCHEDULER_PREEMPTED = "scheduler_preempted"
    """Reclaiming because the training scheduler chose the lease's hold for preemption (a
    pending training job needs the GPUs); ``scheduler_preempted:<job id>``, the deadline is the
    scheduler's own (the end of its grace time), also when the hold's workload had already
    drained and left when the broker read it."""
    AT_RISK = "at_risk"
    """The lease is at risk (its state does not change): the training scheduler has planned a
    pending job onto its GPUs (``at_risk_since`` and ``reclaim_expected_at`` are set; a window
    lease's promise is cut there). Expect a reclaim notice by ``reclaim_expected_at``; moving
    away before it leaves training nothing to wait for."""
    HOLD_LOST = "hold_lost"
    """Reclaiming at once: the lease's hold in the training scheduler ended while the lease was
    live without the scheduler choosing it for preemption (cancelled by an operator, node
    failure); ``hold_lost:<job id>``."""
    RECLAIM_DEADLINE = "reclaim_deadline"
    """Revoked: the reclaim deadline passed."""
    REBUILD_CONFLICT = "rebuild_conflict"
    """Revoked at a broker start: another live lease in the lease log holds one of its GPUs."""
    LOG_WRITE_FAILED = "log_write_failed"
    """Never granted: the lease log did not take the grant (the claim was answered ``internal``);
    this record supersedes a grant record that may have landed late."""
    GUARANTEE_BROKEN = ";guarantee_broken"
    """Suffix: a forced demand cut the minimum guaranteed duration short."""
    DEFERRED_TO_GUARANTEE_END = ";deferred_to_guarantee_end"
    """Suffix: the reclaim deadline was moved to the end of the minimum guarantee."""


class LaneQos(Record):
    """The QoS isolation of a lease's traffic on the fabric: its own virtual lane with a bounded
    share, read back from every port on the paths between the leased hosts and the edge gateway.

    Attributes:
        sl: InfiniBand service level of the lease's traffic (0..15).
        vl: the virtual lane that SL maps to on every port of the paths (1..14; no other SL uses it).
        share_percent: the lent-share bound, percent of a link's bandwidth that lent traffic can
            take at most while training keeps the link busy (0 < share <= 50; idle bandwidth is
            not reserved for training, lent traffic may use it).
        ports_verified: ports whose SL2VL and VLArbitration tables were read back and matched
            the plan (switch ports and the HCA ports at both ends).
        verified: True once every one of those ports matched.
    """

    sl: int = Field(ge=0, le=15)
    vl: int = Field(ge=0, le=15)
    share_percent: float = Field(gt=0, le=100)
    ports_verified: int = Field(default=0, ge=0)
    verified: bool = False


class Partition(Record):
    """The InfiniBand isolation given to a lease.

    Attributes:
        pkey: partition key, ``0x0001``..``0x7ffe`` (the 0x8000 full-member bit is not included).
        sl: InfiniBand service level (0..15) of inference traffic.
        limited_members: port GUIDs of the leased hosts (limited membership).
        full_members: port GUIDs of the edge gateway (full membership).
        verified: True once the PKey tables read back from the fabric matched.
        qos: the lease traffic's virtual lane and share bound, verified on its paths; ``None``:
            the fabric manager does not manage QoS (or a broker older than this field).
    """

    pkey: int = Field(ge=1, le=0x7FFE)
    sl: int = Field(ge=0, le=15)
    limited_members: list[str] = Field(default_factory=list)
    full_members: list[str] = Field(default_factory=list)
    verified: bool = False
    qos: LaneQos | None = None


class LeaseLogRecord(Record):
    """One lease transition; the newest record per ``lease_id`` is the lease's state.

    Attributes:
        lease_id: unique lease id.
        site: edge site that holds it.
        claim_id: the claim it came from (idempotency key of the site).
        offer_id: the offer it came from (the first one, when several).
        offer_ids: every offer the GPUs came from (a matched claim may span several nodes'
            offers under one leaf switch); empty in records of older brokers (= ``[offer_id]``).
        hosts: the nodes of the GPUs, sorted (every host the fabric isolation must cover); empty
            in records of older brokers (the host is the first part of each GPU key).
        gpus: GPU keys (:func:`contracts.topics.gpu_key`) held.
        state: the state after this transition.
        ts: time of the transition (Unix s).
        granted_at: when it was granted (Unix s).
        expires_at: lease TTL deadline; moved by each renewal (Unix s).
        ends_at: the lease ends here at the latest — grant time + the claim's
            ``duration_seconds`` (Unix s); renewals never move ``expires_at`` past it. ``None``:
            no end but the TTL.
        min_until: the minimum guaranteed duration ends here (Unix s): no training demand takes
            the GPUs back before it unless forced (``PoolDemand.force``; then ``reason`` says
            ``guarantee_broken``). Counted from the claim's acceptance (when it was checked against
            the offers' ``available_until``), so fabric isolation time is part of it and the
            guarantee never outlasts the promise. ``None``: no guarantee.
        reclaim_deadline: when reclaiming, the time the GPUs are taken back regardless (Unix s).
        notice_seconds: reclaim notice promised by the offer.
        partition: the fabric isolation, once applied.
        lent_share_percent: the lent-share bound the lease's traffic gets, percent of a busy
            link (:attr:`LaneQos.share_percent`); ``None``: no QoS plan (fabric QoS not managed).
        reason: why the transition happened (``demand:<id>``, ``ttl``, ``site_release``...);
            a reclaim adds ``;guarantee_broken`` when forced inside the guarantee and
            ``;deferred_to_guarantee_end`` when its deadline was moved to ``min_until``.
        seq: per-lease transition counter (1, 2, 3...).
        workload: the operator's workload profile the site named in its claim
            (``[broker] workloads``), run on the leased GPUs; ``None``: hold only.
        kind: ``preemptible`` or ``window`` (:class:`LeaseKind`); records of older brokers:
            ``preemptible``.
        window_until: a window lease's promised end as granted (Unix s, never moved later; equal
            to ``min_until``); ``None`` for a preemptible lease.
        at_risk_since: when the broker learnt that the training scheduler plans a pending job
            onto the lease's GPUs (Unix s); ``None``: not at risk.
        reclaim_expected_at: the scheduler's planned start of that job (Unix s): a reclaim is
            expected by then; moves earlier when a newer plan is earlier, never later; ``None``:
            not at risk.
    """

    lease_id: str
    site: str
    claim_id: str
    offer_id: str
    offer_ids: list[str] = Field(default_factory=list)
    hosts: list[str] = Field(default_factory=list)
    gpus: list[str]
    state: LeaseState
    ts: float
    granted_at: float
    expires_at: float
    ends_at: float | None = None
    min_until: float | None = None
    reclaim_deadline: float | None = None
    notice_seconds: float
    partition: Partition | None = None
    lent_share_percent: float | None = Field(default=None, gt=0, le=100)
    reason: str = ""
    seq: int = 1
    workload: str | None = None
    kind: LeaseKind = LeaseKind.PREEMPTIBLE
    window_until: float | None = None
    at_risk_since: float | None = None
    reclaim_expected_at: float | None = None
