"""MQTT messages between the broker and edge sites (protocol v1, JSON payloads).

Every essential field is in the JSON payload, so MQTT 3.1.1 clients work; MQTT 5 properties
(message expiry, response topic, correlation data, ``traceparent`` user property) are used in
addition where the server speaks 5. Topic names: :class:`contracts.topics.MqttTopics`.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from contracts.base import Record
from contracts.leases import LeaseState, Partition


class OfferedGpu(Record):
    """One GPU inside an offer."""

    gpu: str
    """GPU key (:func:`contracts.topics.gpu_key`)."""
    model_name: str | None = None
    fb_total_mib: int | None = None
    grade: str = "free"
    """Idle grade: ``free`` or ``memory_held`` (lower grade)."""


class Offer(Record):
    """Idle capacity offered to every site; retained on ``offers/{offer_id}``, QoS 1.

    Attributes:
        offer_id: unique id; the retained topic name.
        ts: when it was published (Unix s).
        host: node the GPUs are on.
        leaf: leaf switch of the node, for locality.
        gpus: the offered GPUs (same node).
        available_until: the broker promises nothing past this (analytics' prediction, Unix s).
        expires_at: the offer lapses at this time (Unix s); also the MQTT 5 message expiry.
        notice_seconds: reclaim notice a lease from this offer gets.
        pool: pool name.
        zone: latency zone of the pool (broker config ``pool_zones``); ``None``: not configured,
            and then the offer matches no claim that asks for a zone.
        lent_share_percent: a lease from this offer gets its own virtual lane on the fabric, and
            this is the most of a link's bandwidth (percent, 0 < x <= 50) its traffic can take
            while training keeps the link busy; ``None``: the broker manages no fabric QoS.
    """

    offer_id: str
    ts: float
    host: str
    leaf: str | None = None
    gpus: list[OfferedGpu]
    available_until: float | None = None
    expires_at: float
    notice_seconds: float
    pool: str = "default"
    zone: str | None = None
    lent_share_percent: float | None = Field(default=None, gt=0, le=100)


class Requirements(Record):
    """What a claim without an ``offer_id`` needs; the broker picks the offers (matchmaking,
    ``broker/match.py``). Every field is a filter except ``prefer`` (an order) and
    ``allow_cross_leaf`` (a permission); the defaults accept any idle GPU.

    Attributes:
        model_names: acceptable GPU models (DCGM ``modelName``, e.g. ``NVIDIA H100 80GB HBM3``);
            empty: any model. A GPU whose model is unknown matches only an empty list.
        min_fb_total_mib: smallest framebuffer per GPU, MiB; a GPU of unknown size does not match.
        zone: latency zone the offers must be in (:attr:`Offer.zone`); ``None``: any zone.
        prefer: preference order, best first; each entry names a GPU model or a pool. Among
            placements of equal locality the broker takes the one whose worst GPU ranks best
            (a GPU ranks at the first entry naming its model or its pool; unnamed GPUs rank last).
        allow_cross_leaf: the GPUs may sit under different leaf switches (more fabric hops) when
            no single node or leaf has enough; default: never across leaves.
        allow_memory_held: GPUs of grade ``memory_held`` (a resident model holds memory) may be
            taken; default True.
    """

    model_names: list[str] = Field(default_factory=list)
    min_fb_total_mib: int | None = Field(default=None, ge=0)
    zone: str | None = None
    prefer: list[str] = Field(default_factory=list)
    allow_cross_leaf: bool = False
    allow_memory_held: bool = True


class Claim(Record):
    """A site's claim, on ``sites/{site}/claims``: of a named offer (``offer_id``), or of any GPUs
    that meet ``requirements`` (no ``offer_id``: the broker matches them to offers and the lease
    may span several nodes' offers under one leaf switch).

    Attributes:
        claim_id: the site's idempotency key; a repeated claim_id gets the same answer.
        site: must equal the ``{site}`` of the topic it arrived on.
        offer_id: the offer claimed; ``None``: match ``requirements`` (then ``count`` >= 1).
        gpus: the subset of the offer's GPU keys wanted; empty means all of them. Only with
            ``offer_id``.
        count: how many GPUs wanted when ``gpus`` is empty; 0 means all (of the offer).
        duration_seconds: the lease length wanted (renewals keep it alive).
        min_notice_seconds: the shortest reclaim notice the site tolerates.
        min_duration_seconds: minimum guaranteed duration, seconds: the offers must be promised
            (``available_until``) at least until ``now + min_duration_seconds``, and the lease is
            not reclaimed by a training demand before ``granted_at + min_duration_seconds`` unless
            the demand forces it (``PoolDemand.force``). 0: no guarantee. At most
            ``duration_seconds``.
        requirements: what to match when there is no ``offer_id`` (default: any idle GPU);
            must be ``None`` with an ``offer_id``.
        ts: when it was sent (Unix s).

    Raises ``pydantic.ValidationError`` (answered ``malformed``) for ``requirements`` or ``gpus``
    on the wrong kind of claim, a matched claim without ``count``, or ``min_duration_seconds``
    above ``duration_seconds``.
    """

    claim_id: str
    site: str
    offer_id: str | None = None
    gpus: list[str] = Field(default_factory=list)
    count: int = Field(default=0, ge=0)
    duration_seconds: float = Field(default=300.0, gt=0)
    min_notice_seconds: float = Field(default=0.0, ge=0)
    min_duration_seconds: float = Field(default=0.0, ge=0)
    requirements: Requirements | None = None
    ts: float

    @model_validator(mode="after")
    def _one_kind(self) -> Claim:
        if self.offer_id is not None and self.requirements is not None:
            raise ValueError("a claim names an offer_id or gives requirements, not both")
        if self.offer_id is None:
            if self.gpus:
                raise ValueError("gpus may only be named with an offer_id")
            if self.count < 1:
                raise ValueError("a claim without offer_id needs count >= 1")
        if self.min_duration_seconds > self.duration_seconds:
            raise ValueError("min_duration_seconds exceeds duration_seconds")
        return self

    @property
    def matched(self) -> bool:
        """True when the broker picks the offers (no ``offer_id``)."""
        return self.offer_id is None


class LeaseMessage(Record):
    """Retained lease state on ``sites/{site}/leases/{lease_id}`` (broker → site).

    ``offer_id`` is the first offer the GPUs came from; a matched lease may span several offers
    (``offer_ids``, all of them) on several nodes (``hosts``).
    """

    lease_id: str
    site: str
    claim_id: str
    offer_id: str
    offer_ids: list[str] = Field(default_factory=list)
    """Every offer the GPUs came from (first = ``offer_id``); empty in messages of old brokers."""
    hosts: list[str] = Field(default_factory=list)
    """Nodes of the GPUs, sorted; empty in messages of old brokers (the host is the GPU key's
    first part)."""
    gpus: list[str]
    state: LeaseState
    ts: float
    expires_at: float
    """Renew before this (Unix s) or the lease expires."""
    ends_at: float | None = None
    """The lease ends here at the latest (grant time + the claim's ``duration_seconds``, Unix s);
    renewals never move ``expires_at`` past it. ``None``: no end but the TTL."""
    reclaim_deadline: float | None = None
    """When ``reclaiming``: the GPUs are taken back at this time (Unix s)."""
    min_until: float | None = None
    """Minimum guaranteed duration: no unforced reclaim takes the GPUs back before this (Unix s);
    ``None``: no guarantee."""
    notice_seconds: float
    partition: Partition | None = None
    lent_share_percent: float | None = Field(default=None, gt=0, le=100)
    """The lent-share bound, percent of a busy link the lease's traffic can take at most
    (``partition.qos`` says how it was verified); ``None``: no fabric QoS managed."""
    reason: str = ""
    seq: int = 1


class Renewal(Record):
    """Heartbeat on ``sites/{site}/renewals``: keeps ``lease_id`` alive for ``extend_seconds``."""

    lease_id: str
    site: str
    ts: float
    extend_seconds: float | None = Field(default=None, gt=0)


class Release(Record):
    """Early release on ``sites/{site}/releases``."""

    lease_id: str
    site: str
    ts: float


class ReasonCode(StrEnum):
    """Why the broker rejected (or accepted) a site's message; carried in :class:`Reply`."""

    OK = "ok"
    MALFORMED = "malformed"
    """Payload is not JSON or does not match the schema."""
    UNSUPPORTED_VERSION = "unsupported_version"
    SITE_MISMATCH = "site_mismatch"
    """The payload's site differs from the topic's."""
    UNKNOWN_OFFER = "unknown_offer"
    OFFER_EXPIRED = "offer_expired"
    NO_MATCH = "no_match"
    """No live offer (or group of offers under one leaf) meets the claim's requirements."""
    DURATION_UNAVAILABLE = "duration_unavailable"
    """The offer is not promised (``available_until``) for the claim's minimum duration."""
    GPU_UNAVAILABLE = "gpu_unavailable"
    """A wanted GPU is already leased or no longer idle."""
    NOTICE_TOO_SHORT = "notice_too_short"
    QUOTA_EXCEEDED = "quota_exceeded"
    """The site would hold more GPUs than its quota, or more than its fair share while GPUs are
    scarce and a site below its share is waiting (``broker/quota.py``)."""
    UNKNOWN_LEASE = "unknown_lease"
    LEASE_NOT_LIVE = "lease_not_live"
    ISOLATION_FAILED = "isolation_failed"
    """The fabric partition could not be applied or verified."""
    INTERNAL = "internal"


class Reply(Record):
    """The broker's answer to a site's message, on ``sites/{site}/replies``
    (or the MQTT 5 response topic, with the request's correlation data)."""

    in_reply_to: str
    """The ``claim_id`` or ``lease_id`` answered; ``""`` when the request could not be parsed."""
    site: str
    code: ReasonCode
    text: str = ""
    lease_id: str | None = None
    ts: float


class PeerState(Record):
    """Retained birth/death on ``sites/{site}/state`` or ``broker/state``; set as Last Will.

    ``seq`` grows with every birth, so a stale death (a Last Will delivered late) can be told apart
    from the current session's.
    """

    peer: str
    online: bool
    seq: int = 0
    ts: float
