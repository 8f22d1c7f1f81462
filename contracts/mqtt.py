"""MQTT messages between the broker and edge sites (protocol v1, JSON payloads).

Every essential field is in the JSON payload, so MQTT 3.1.1 clients work; MQTT 5 properties
(message expiry, response topic, correlation data, ``traceparent`` user property) are used in
addition where the server speaks 5. Topic names: :class:`contracts.topics.MqttTopics`.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

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


class Claim(Record):
    """A site's claim on an offer, on ``sites/{site}/claims``.

    Attributes:
        claim_id: the site's idempotency key; a repeated claim_id gets the same answer.
        site: must equal the ``{site}`` of the topic it arrived on.
        offer_id: the offer claimed.
        gpus: the subset of the offer's GPU keys wanted; empty means all of them.
        count: how many GPUs wanted when ``gpus`` is empty; 0 means all.
        duration_seconds: the lease length wanted (renewals keep it alive).
        min_notice_seconds: the shortest reclaim notice the site tolerates.
        ts: when it was sent (Unix s).
    """

    claim_id: str
    site: str
    offer_id: str
    gpus: list[str] = Field(default_factory=list)
    count: int = Field(default=0, ge=0)
    duration_seconds: float = Field(default=300.0, gt=0)
    min_notice_seconds: float = Field(default=0.0, ge=0)
    ts: float


class LeaseMessage(Record):
    """Retained lease state on ``sites/{site}/leases/{lease_id}`` (broker → site)."""

    lease_id: str
    site: str
    claim_id: str
    offer_id: str
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
    notice_seconds: float
    partition: Partition | None = None
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
    GPU_UNAVAILABLE = "gpu_unavailable"
    """A wanted GPU is already leased or no longer idle."""
    NOTICE_TOO_SHORT = "notice_too_short"
    QUOTA_EXCEEDED = "quota_exceeded"
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
