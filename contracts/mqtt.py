"""MQTT messages between the broker and edge sites (protocol v1, JSON payloads).

Every essential field is in the JSON payload, so MQTT 3.1.1 clients work; MQTT 5 properties
(message expiry, response topic, correlation data, ``traceparent`` user property) are used in
addition where the server speaks 5. Topic names: :class:`contracts.topics.MqttTopics`.

Limits (:data:`LIMITS`) bound what a site may send; a message outside them is answered
``malformed`` and changes nothing (``broker/wire.py`` checks them before any decision).

Compatibility (readers tolerant, writers strict): a reader ignores fields it does not know and
accepts every ``schema_version`` from 1 up (within one topic root every change is additive: new
optional fields, new enum values documented as such); writers (:class:`contracts.Record`) refuse
unknown fields. A breaking change moves to a new topic root (``gpupool/v2``) and the broker serves
both roots for a transition.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import ConfigDict, Field, StringConstraints, model_validator

from contracts.base import Record
from contracts.leases import LeaseKind, LeaseState, Partition


class _Limits:
    """Bounds of site messages (and of what the broker writes back), one place for the code and
    the AsyncAPI document (``x-limits``)."""

    max_payload_bytes: Final = 16_384
    """Largest site message (claim, renewal, release), bytes of UTF-8 JSON; also Mosquitto's
    ``message_size_limit`` of the generated config is larger only by topic overhead."""
    max_depth: Final = 8
    """Deepest nesting of JSON objects and arrays in a site message."""
    max_id_chars: Final = 128
    """Longest id (``claim_id``, ``lease_id``, ``offer_id``, ``request_id``): 1 to 128 printable
    ASCII characters, no space (``^[!-~]{1,128}$``)."""
    max_site_chars: Final = 64
    """Longest site name (``^[A-Za-z0-9_.-]{1,64}$``, also the MQTT user name)."""
    max_name_chars: Final = 256
    """Longest GPU key, model name, pool or zone name in a request."""
    max_list_items: Final = 1024
    """Most entries of a list in a request (``gpus``, ``model_names``, ``prefer``, ``avoid_hosts``)."""
    max_count: Final = 1024
    """Most GPUs one claim may ask for (``count``)."""
    max_duration_seconds: Final = 7 * 86_400.0
    """Longest lease a claim may ask for (``duration_seconds``), seconds (7 days)."""
    max_notice_seconds: Final = 86_400.0
    """Largest ``min_notice_seconds`` a claim may give, seconds."""
    max_extend_seconds: Final = 86_400.0
    """Largest ``extend_seconds`` of a renewal, seconds (the broker caps it at its lease TTL)."""
    site_request_rate_per_s: Final = 50.0
    """Default per-site rate of claims, renewals and releases together (token bucket refill, per
    second); past it: ``rate_limited``."""
    site_request_burst: Final = 100.0
    """Default per-site burst (token bucket size)."""
    request_max_age_seconds: Final = 300.0
    """Default: a request whose ``ts`` is older than this on arrival is ignored (counted)."""
    mosquitto_max_packet_bytes: Final = 65_536
    """``max_packet_size`` of the generated Mosquitto config: the largest MQTT packet either way;
    Mosquitto disconnects a client that sends a larger one."""
    mosquitto_max_queued_messages: Final = 1000
    """``max_queued_messages`` of the generated config: QoS 1 messages queued per client beyond
    those in flight."""
    mosquitto_max_queued_bytes: Final = 16 * 1024 * 1024
    """``max_queued_bytes`` of the generated config, per client."""


LIMITS = _Limits()
"""The protocol's limits (see :class:`_Limits`)."""

Id = Annotated[str, StringConstraints(pattern=r"^[!-~]{1,128}$")]
"""An id chosen by a site or the broker: 1..128 printable ASCII characters without space."""
SiteName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
"""A site name: the MQTT user name and the ``{site}`` topic level."""
Name = Annotated[str, StringConstraints(min_length=1, max_length=256)]
"""A GPU key, model, pool, zone or host name (1..256 characters)."""
UnixTime = Annotated[float, Field(allow_inf_nan=False, ge=0)]
"""Seconds since the Unix epoch (UTC), finite."""


class Message(Record):
    """Base of the MQTT messages: field docstrings become the schema's descriptions."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class OfferedGpu(Message):
    """One GPU inside an offer."""

    gpu: str
    """GPU key ``host/uuid`` or ``host/uuid/gi`` (a MIG instance; :func:`contracts.topics.gpu_key`):
    name it in a claim's ``gpus``."""
    model_name: str | None = None
    """DCGM ``modelName``, e.g. ``NVIDIA H100 80GB HBM3``; ``null``: unknown."""
    fb_total_mib: int | None = None
    """Framebuffer size, MiB; ``null``: unknown."""
    grade: str = "free"
    """Idle grade: ``free`` (nothing resident) or ``memory_held`` (a resident model holds
    framebuffer memory; a lower grade)."""


class Offer(Message):
    """Idle capacity offered to every site; retained on ``offers/{offer_id}``, QoS 1.

    Lifetime: an offer is withdrawn (empty retained payload on its topic) when it is claimed,
    when its GPUs or its promise change (a GPU turns busy, is leased, or analytics predicts a
    shorter idle time: a new offer with a new ``offer_id`` replaces it, which happens whenever
    the capacity stream changes the node, typically every few seconds on a busy pool) and at
    ``expires_at`` (``offer_ttl_s`` after ``ts``, 60 s by default), when still-idle GPUs are offered
    again under a new id. A claim of an offer withdrawn because its node's offer was claimed in
    part or changed, made before the old offer's ``expires_at``, is served from the node's current
    offer when that one's terms are no worse (notice, prices, fabric share, a promise no shorter)
    and holds the GPUs the claim wants; the lease then names the current ``offer_id``. Otherwise a
    claim of a withdrawn or expired offer is answered ``unknown_offer`` or ``offer_expired``;
    claim by ``requirements`` to avoid racing re-issues.
    """

    offer_id: str
    """Unique id; the last level of the retained topic."""
    ts: float
    """When it was published (Unix s)."""
    host: str
    """Node the GPUs are on."""
    leaf: str | None = None
    """Leaf switch of the node (locality); ``null``: unknown."""
    gpus: list[OfferedGpu]
    """The offered GPUs, all on ``host``."""
    available_until: float | None = None
    """The broker promises nothing past this (analytics' predicted idle end, Unix s); never
    before ``ts`` (equal to ``ts``: the prediction has passed and nothing is promised beyond
    now). ``null``: no prediction. A claim's ``min_duration_seconds`` is checked against it."""
    expires_at: float
    """The offer lapses at this time (Unix s); also the MQTT 5 message expiry."""
    notice_seconds: float
    """Reclaim notice a lease from this offer gets, seconds: between the lease turning
    ``reclaiming`` and its ``reclaim_deadline``."""
    pool: str = "default"
    """Pool name."""
    zone: str | None = None
    """Latency zone of the pool (broker config ``pool_zones``); ``null``: not configured, and
    then the offer matches no claim that asks for a zone."""
    lent_share_percent: float | None = Field(default=None, gt=0, le=100)
    """A lease from this offer gets its own virtual lane on the fabric, and this is the most of a
    link's bandwidth (percent, 0 < x <= 50) its traffic can take while training keeps the link
    busy; ``null``: the broker manages no fabric QoS."""
    window_price: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Price of a ``window`` lease (promised until ``available_until``), credits per GPU-hour
    (``[broker] window_price``); ``null``: not priced. A window lease can be claimed only while
    ``available_until`` is after now."""
    preemptible_price: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Price of a ``preemptible`` lease (promises only ``notice_seconds``), credits per GPU-hour
    (``[broker] preemptible_price``); ``null``: not priced."""


class Requirements(Message):
    """What a claim without an ``offer_id`` needs; the broker picks the offers (matchmaking,
    ``broker/match.py``). Every field is a filter except ``prefer`` (an order),
    ``allow_cross_leaf`` (a permission) and ``avoid_hosts`` (a preference); the defaults accept
    any idle GPU."""

    model_names: Annotated[list[Name], Field(max_length=LIMITS.max_list_items)] = Field(
        default_factory=list
    )
    """Acceptable GPU models (DCGM ``modelName``); empty: any model. A GPU whose model is unknown
    matches only an empty list."""
    min_fb_total_mib: int | None = Field(default=None, ge=0, le=2**40)
    """Smallest framebuffer per GPU, MiB; a GPU of unknown size does not match."""
    zone: Name | None = None
    """Latency zone the offers must be in (``Offer.zone``); ``null``: any zone."""
    prefer: Annotated[list[Name], Field(max_length=LIMITS.max_list_items)] = Field(default_factory=list)
    """Preference order, best first; each entry names a GPU model or a pool. Among placements of
    equal locality the broker takes the one whose worst GPU ranks best (a GPU ranks at the first
    entry naming its model or its pool; unnamed GPUs rank last)."""
    allow_cross_leaf: bool = False
    """The GPUs may sit under different leaf switches (more fabric hops) when no single node or
    leaf has enough; default: never across leaves."""
    allow_memory_held: bool = True
    """GPUs of grade ``memory_held`` may be taken."""
    avoid_hosts: Annotated[list[Name], Field(max_length=LIMITS.max_list_items)] = Field(
        default_factory=list
    )
    """Nodes (``Offer.host``) the lease should not be placed on, most important first:
    anti-affinity, a preference. A site names the nodes of its other leases, so that one node
    taken back cannot take all of them. The broker places the claim on the other nodes' GPUs when
    they can hold it under every other field, even at a worse locality or ``prefer`` rank; when
    they cannot, it gives up the last names first (the longest prefix of the list it can keep the
    claim off), and with no room off even the first, it places it as if the list were empty. A
    claim is never refused because of it. Empty: no preference."""


class Claim(Message):
    """A site's claim, on ``sites/{site}/claims``: of a named offer (``offer_id``), or of any GPUs
    that meet ``requirements`` (no ``offer_id``: the broker matches them to offers and the lease
    may span several nodes' offers under one leaf switch). Answered with one :class:`Reply`
    (``in_reply_to`` = ``claim_id``) and, when granted, the retained lease message.

    Raises ``pydantic.ValidationError`` (answered ``malformed``) for ``requirements`` or ``gpus``
    on the wrong kind of claim, a matched claim without ``count``, or ``min_duration_seconds``
    above ``duration_seconds``.
    """

    claim_id: Id
    """The site's idempotency key: a repeated ``claim_id`` (within ``retain_terminal_s``, 15 min)
    gets the first answer again and never a second lease."""
    site: SiteName
    """Must equal the ``{site}`` of the topic it arrived on (else ``site_mismatch``)."""
    offer_id: Id | None = None
    """The offer claimed; ``null``: match ``requirements``."""
    gpus: Annotated[list[Name], Field(max_length=LIMITS.max_list_items)] = Field(default_factory=list)
    """The subset of the offer's GPU keys wanted; empty: all of them (or ``count``). Only with
    ``offer_id``."""
    count: int = Field(default=0, ge=0, le=LIMITS.max_count)
    """How many GPUs wanted when ``gpus`` is empty; 0 means all of the offer. At least 1
    without ``offer_id``."""
    duration_seconds: float = Field(default=300.0, gt=0, le=LIMITS.max_duration_seconds, allow_inf_nan=False)
    """The lease length wanted, seconds: the lease ends ``duration_seconds`` after the grant at the
    latest (``ends_at``), and lives only while renewed within the TTL."""
    min_notice_seconds: float = Field(default=0.0, ge=0, le=LIMITS.max_notice_seconds, allow_inf_nan=False)
    """The shortest reclaim notice the site tolerates, seconds (else ``notice_too_short``)."""
    min_duration_seconds: float = Field(
        default=0.0, ge=0, le=LIMITS.max_duration_seconds, allow_inf_nan=False
    )
    """Minimum guaranteed duration, seconds: the offers must be promised (``available_until``) at
    least until ``now + min_duration_seconds`` (else ``duration_unavailable``), and the lease is
    not reclaimed by a training demand before ``granted_at + min_duration_seconds`` unless the
    demand forces it. 0: no guarantee. At most ``duration_seconds``."""
    requirements: Requirements | None = None
    """What to match when there is no ``offer_id`` (default: any idle GPU); must be ``null`` with
    an ``offer_id``."""
    ts: UnixTime
    """When it was sent (Unix s). A claim older than the broker's ``request_max_age_s`` (300 s)
    when it arrives is ignored (counted, not answered)."""
    request_id: Id | None = None
    """Optional id of this message, echoed in the reply's ``request_id`` (match replies without
    MQTT 5 correlation data)."""
    workload: Name | None = None
    """The operator-declared workload profile to run on the leased GPUs (``[broker] workloads``
    of the broker's settings); the lease message then carries its ``endpoint`` once healthy.
    ``null``: the GPUs are held and nothing runs. A profile the site may not use is refused
    (``unknown_workload``); a claim never carries a command (``command_not_allowed``)."""
    lease_kind: Literal["preemptible", "window"] | None = None  # LeaseKind's values (strict wire parsing)
    """``preemptible``: spot capacity, promises only the offer's ``notice_seconds`` (then
    ``min_duration_seconds`` must be 0). ``window``: promised until the offers'
    ``available_until`` (capped at the lease's end; the lease message's ``window_until``),
    refused ``duration_unavailable`` when the offers promise nothing past now or less than
    ``min_duration_seconds``. ``null`` (clients of earlier releases): ``window`` when
    ``min_duration_seconds`` > 0, promised until ``now + min_duration_seconds``, else
    ``preemptible`` (:attr:`kind`)."""

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
        if self.lease_kind == LeaseKind.PREEMPTIBLE.value and self.min_duration_seconds > 0:
            raise ValueError("a preemptible lease promises only the notice: min_duration_seconds must be 0")
        return self

    @property
    def kind(self) -> LeaseKind:
        """The kind of lease asked for (``lease_kind``, or what a claim without one means)."""
        if self.lease_kind is not None:
            return LeaseKind(self.lease_kind)
        return LeaseKind.WINDOW if self.min_duration_seconds > 0 else LeaseKind.PREEMPTIBLE

    @property
    def matched(self) -> bool:
        """True when the broker picks the offers (no ``offer_id``)."""
        return self.offer_id is None


class LeaseMessage(Message):
    """Retained lease state on ``sites/{site}/leases/{lease_id}`` (broker → site), QoS 1.

    State machine (``state``)::

        granted ─► active ─► reclaiming ─► released | revoked | expired
           │          │
           │          └──► released (site) | expired (TTL or ends_at passed)
           └──► active (first renewal) | released | expired | reclaiming

    ``granted``: the GPUs are the site's (and, with fabric isolation, its partition verified);
    ``active``: renewed at least once; ``reclaiming``: training wants them back, release before
    ``reclaim_deadline``; terminal: ``released`` (by the site), ``expired`` (not renewed within
    the TTL, or ``ends_at`` reached), ``revoked`` (taken back at the deadline). A terminal lease
    message stays retained for ``retain_terminal_s`` (15 min) and is then cleared (empty retained
    payload). ``offer_id`` is the first offer the GPUs came from; a matched lease may span several
    offers (``offer_ids``) on several nodes (``hosts``).
    """

    lease_id: str
    """Unique lease id; the last level of the topic; name it in renewals and releases."""
    site: str
    """The site holding it."""
    claim_id: str
    """The claim it answers."""
    offer_id: str
    """The first offer the GPUs came from."""
    offer_ids: list[str] = Field(default_factory=list)
    """Every offer the GPUs came from (first = ``offer_id``); empty in messages of old brokers."""
    hosts: list[str] = Field(default_factory=list)
    """Nodes of the GPUs, sorted; empty in messages of old brokers (the host is the GPU key's
    first part)."""
    gpus: list[str]
    """GPU keys held."""
    state: LeaseState
    """State after the newest transition (see the state machine above)."""
    ts: float
    """Time of the newest transition (Unix s)."""
    expires_at: float
    """Renew before this (Unix s) or the lease expires. Each renewal moves it to
    ``now + min(extend_seconds, lease TTL)`` (TTL 60 s by default), never past ``ends_at`` and
    never backwards."""
    ends_at: float | None = None
    """The lease ends here at the latest (grant time + the claim's ``duration_seconds``, Unix s);
    renewals never move ``expires_at`` past it. ``null``: no end but the TTL."""
    reclaim_deadline: float | None = None
    """When ``reclaiming``: the GPUs are taken back at this time (Unix s)."""
    min_until: float | None = None
    """Minimum guaranteed duration: no unforced reclaim takes the GPUs back before this (Unix s);
    ``null``: no guarantee."""
    notice_seconds: float
    """Reclaim notice of this lease, seconds."""
    partition: Partition | None = None
    """The InfiniBand partition isolating the lease; ``null`` without fabric isolation."""
    lent_share_percent: float | None = Field(default=None, gt=0, le=100)
    """The lent-share bound, percent of a busy link the lease's traffic can take at most
    (``partition.qos`` says how it was verified); ``None``: no fabric QoS managed."""
    reason: str = ""
    """Why the newest transition happened: a :class:`contracts.leases.LeaseReason` value, with a
    suffix where documented there (e.g. ``match:node``, ``demand:<demand_id>;guarantee_broken``)."""
    seq: int = 1
    """Transition counter of the lease (1, 2, 3…): a message with a lower ``seq`` is older."""
    workload: str | None = None
    """The workload profile running on the lease (the claim's ``workload``); ``null``: none."""
    endpoint: str | None = None
    """``host:port`` where the lease's workload serves on its first node (``hosts[0]``), once
    its health check passed (the lease message is then published again with it); ``null``: no
    workload, or not healthy there yet. Kept for sites that know one node per lease; see
    ``endpoints``."""
    endpoints: list[str] = Field(default_factory=list)
    """``host:port`` of every healthy instance of the lease's workload, one per node, in the
    order of ``hosts`` (a multi-node lease runs its workload on each of its nodes; the message is
    published again as each becomes healthy); empty: no workload, none healthy yet, or a broker
    older than this field."""
    kind: LeaseKind = LeaseKind.PREEMPTIBLE
    """``preemptible`` (promises only ``notice_seconds``) or ``window`` (promised until
    ``window_until``): the claim's ``lease_kind``."""
    window_until: float | None = None
    """A window lease's promise as granted (Unix s): no reclaim of gpupool's own before it unless
    forced; never moved later. ``null`` for a preemptible lease."""
    at_risk_since: float | None = None
    """Early warning, before any reclaim notice: set (Unix s, when the broker learnt it) once the
    training scheduler has planned a pending job onto the lease's GPUs; the lease keeps its
    ``state`` and the message's ``reason`` is ``at_risk``. Expect ``state`` ``reclaiming`` by
    ``reclaim_expected_at``; a site that claims a replacement and releases this lease before then
    loses nothing and training waits for nothing. Stays set for the rest of the lease (a plan that
    goes away does not clear it). ``null``: not at risk."""
    reclaim_expected_at: float | None = None
    """With ``at_risk_since``: the scheduler's planned start of that job (Unix s), the latest
    time to move away by; republished (``reason`` ``at_risk``) when a newer plan is earlier,
    never moved later. For a window lease below ``window_until`` the promise is broken by the
    plan: the broker counts it. ``null``: not at risk."""


class Renewal(Message):
    """Heartbeat on ``sites/{site}/renewals``: keeps ``lease_id`` alive. Answered with one
    :class:`Reply` (``in_reply_to`` = ``lease_id``) whose ``expires_at`` and ``ttl_seconds`` say the
    new TTL deadline, and the retained lease message with the same ``expires_at``."""

    lease_id: Id
    """The lease to renew."""
    site: SiteName
    """Must equal the topic's ``{site}``."""
    ts: UnixTime
    """When it was sent (Unix s); stale ones are ignored as for claims."""
    extend_seconds: float | None = Field(
        default=None, gt=0, le=LIMITS.max_extend_seconds, allow_inf_nan=False
    )
    """Wanted TTL from now, seconds; capped at the broker's lease TTL (60 s by default, the
    reply's ``ttl_seconds``); ``null``: the full TTL."""
    request_id: Id | None = None
    """Optional id of this message, echoed in the reply (tells two renewals of one lease apart)."""


class Release(Message):
    """Early release on ``sites/{site}/releases``; answered with one :class:`Reply`
    (``in_reply_to`` = ``lease_id``) and the retained lease message in state ``released``."""

    lease_id: Id
    """The lease to release."""
    site: SiteName
    """Must equal the topic's ``{site}``."""
    ts: UnixTime
    """When it was sent (Unix s); stale ones are ignored as for claims."""
    request_id: Id | None = None
    """Optional id of this message, echoed in the reply."""


class ReasonCode(StrEnum):
    """Why the broker rejected (or accepted) a site's message; carried in :class:`Reply`.
    :data:`REASON_ANSWERS` says which requests each code can answer."""

    OK = "ok"
    """Done: the claim is granted (``lease_id``), the lease renewed (``expires_at``) or released."""
    MALFORMED = "malformed"
    """The payload broke a limit or the schema (too large, too deep, not UTF-8 JSON, not an
    object, non-finite number, wrong type, out of bounds); ``text`` says which. Nothing changed."""
    UNSUPPORTED_VERSION = "unsupported_version"
    """``schema_version`` is not an integer >= 1."""
    SITE_MISMATCH = "site_mismatch"
    """The payload's site differs from the topic's."""
    UNKNOWN_OFFER = "unknown_offer"
    """No such offer, or it was withdrawn (claimed, changed) and its node's current offer does
    not serve the claim on the same terms: claim a current offer."""
    OFFER_EXPIRED = "offer_expired"
    """The offer passed its ``expires_at``."""
    NO_MATCH = "no_match"
    """No live offer (or group of offers under one leaf) meets the claim's requirements."""
    DURATION_UNAVAILABLE = "duration_unavailable"
    """The offer is not promised (``available_until``) for the claim's minimum duration."""
    GPU_UNAVAILABLE = "gpu_unavailable"
    """A wanted GPU is already leased, reserved, held for training or no longer idle, or the
    offer has fewer GPUs than wanted."""
    NOTICE_TOO_SHORT = "notice_too_short"
    """The offer's notice is shorter than the claim's ``min_notice_seconds``."""
    QUOTA_EXCEEDED = "quota_exceeded"
    """The site would hold more GPUs than its quota, or more than its fair share while GPUs are
    scarce and a site below its share is waiting (``broker/quota.py``)."""
    RATE_LIMITED = "rate_limited"
    """The site sent more requests than its rate limit allows (token bucket: ``rate`` per second,
    ``burst`` at once; 50/s and 100 by default); nothing changed, retry later."""
    UNKNOWN_LEASE = "unknown_lease"
    """No such lease of this site (another site's lease is unknown too)."""
    LEASE_NOT_LIVE = "lease_not_live"
    """The lease is terminal (released, expired, revoked) or its TTL already passed."""
    ISOLATION_FAILED = "isolation_failed"
    """The fabric partition could not be applied or verified, or the training scheduler could
    not hold the GPUs for the lease (``text`` says which); nothing was granted."""
    UNKNOWN_WORKLOAD = "unknown_workload"
    """The claim's ``workload`` names no profile the operator declared, or one this site may not
    use; nothing changed."""
    COMMAND_NOT_ALLOWED = "command_not_allowed"
    """The claim tried to pass a command (a ``command``, ``argv``, ``args``, ``cmd``, ``env``,
    ``entrypoint``, ``image`` or ``script`` field): a site only names a workload profile."""
    INTERNAL = "internal"
    """Something failed inside the broker (e.g. the lease log refused the write); nothing
    changed — retry (a claim with the same ``claim_id``)."""


REASON_ANSWERS: dict[ReasonCode, tuple[str, ...]] = {
    ReasonCode.OK: ("claim", "renewal", "release"),
    ReasonCode.MALFORMED: ("claim", "renewal", "release"),
    ReasonCode.UNSUPPORTED_VERSION: ("claim", "renewal", "release"),
    ReasonCode.SITE_MISMATCH: ("claim", "renewal", "release"),
    ReasonCode.UNKNOWN_OFFER: ("claim",),
    ReasonCode.OFFER_EXPIRED: ("claim",),
    ReasonCode.NO_MATCH: ("claim",),
    ReasonCode.DURATION_UNAVAILABLE: ("claim",),
    ReasonCode.GPU_UNAVAILABLE: ("claim",),
    ReasonCode.NOTICE_TOO_SHORT: ("claim",),
    ReasonCode.QUOTA_EXCEEDED: ("claim",),
    ReasonCode.RATE_LIMITED: ("claim", "renewal", "release"),
    ReasonCode.UNKNOWN_LEASE: ("renewal", "release"),
    ReasonCode.LEASE_NOT_LIVE: ("renewal", "release"),
    ReasonCode.ISOLATION_FAILED: ("claim",),
    ReasonCode.UNKNOWN_WORKLOAD: ("claim",),
    ReasonCode.COMMAND_NOT_ALLOWED: ("claim",),
    ReasonCode.INTERNAL: ("claim", "renewal", "release"),
}
"""Which requests (claim, renewal, release) each reason code can answer."""


class Reply(Message):
    """The broker's answer to a site's message, on ``sites/{site}/replies`` (not retained, QoS 1;
    with MQTT 5 also the request's correlation data, and a copy on its response topic when that
    lies in the site's own subtree). Every claim, renewal and release gets exactly one reply,
    except requests ignored as stale or retained (counted in
    ``gpupool_broker_ignored_requests_total``). Match it by ``in_reply_to``, and by ``request_id``
    when the request carried one. ``request``, ``request_id``, ``expires_at`` and ``ttl_seconds``
    are sent only in answer to a request that carried a ``request_id`` (edge sites of the first
    release refuse unknown fields: a request without one gets the first release's reply)."""

    in_reply_to: str
    """The ``claim_id`` or ``lease_id`` answered; ``""`` when the request could not be parsed."""
    site: str
    """The site answered."""
    code: ReasonCode
    """The outcome (:class:`ReasonCode`)."""
    text: str = ""
    """A short human-readable explanation."""
    lease_id: str | None = None
    """The lease granted, renewed or released, when there is one."""
    ts: float
    """When the reply was made (Unix s)."""
    request: str | None = None
    """What was answered: ``claim``, ``renewal`` or ``release``; ``null`` in replies of older
    brokers."""
    request_id: str | None = None
    """The request's ``request_id``, when it carried one."""
    expires_at: float | None = None
    """For an ``ok`` claim or renewal: the lease's new TTL deadline (Unix s), as in the lease
    message."""
    ttl_seconds: float | None = None
    """For an ``ok`` claim or renewal: the broker's lease TTL, seconds (the most one renewal
    extends by)."""


CLAIM_COMMAND_FIELDS = frozenset({"command", "argv", "args", "cmd", "env", "entrypoint", "image", "script"})
"""Fields by which a claim would pass a command, arguments, environment or image of its own: a
claim carrying any of them is refused ``command_not_allowed`` (a site only names a workload
profile the operator declared)."""

REPLY_ADDED_FIELDS = frozenset({"request", "request_id", "expires_at", "ttl_seconds"})
"""Reply fields added after the first release of protocol v1: sent only in answer to a request
that carries a ``request_id`` (a client of a later release); a request without one gets a reply
of the first release's fields, which a reader of that release (unknown fields refused) decodes."""


class PeerState(Message):
    """Retained birth/death on ``sites/{site}/state`` or ``broker/state``; set as Last Will.

    ``seq`` grows with every birth, so a stale death (a Last Will delivered late) can be told apart
    from the current session's.
    """

    peer: str
    """The broker's client id or the site's name."""
    online: bool
    """True: birth; false: death (clean goodbye or Last Will)."""
    seq: int = 0
    """Birth counter (a later session has a higher one)."""
    ts: float
    """When it was sent (Unix s)."""
