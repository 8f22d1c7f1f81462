"""Inference that survives a reclaim: leases of one workload profile kept at a target size and
replaced on notice (:class:`KeptLeases`), and the endpoints view a site's load balancer reads
(:class:`Endpoints`). Part of the edge SDK: it needs nothing beyond :mod:`broker.edge`.

::

    async with EdgeClient(site="edge-a", host=..., port=1883, username="edge-a", password=secret) as site:
        async with KeptLeases(site, target=2, workload="infer") as kept:
            await kept.ready(timeout_s=60)          # 2 leases serving
            with kept.endpoints.use() as endpoint:  # per request: a serving host:port (round robin)
                ...                                  # send the request to http://{endpoint}/...
            async with kept.endpoints.acquire(wait_s=5) as endpoint:  # or wait for one, at most 5 s
                ...

What a lease goes through (the broker lends through a training scheduler and runs the workload,
``[[broker.workloads]]``; its health check publishes ``LeaseMessage.endpoint``):

1. *claimed*: a matched claim (:meth:`broker.edge.EdgeClient.request`) of ``gpus_per_lease`` GPUs
   naming the profile; a refused claim is sent again after a backoff (:class:`runtime.backoff.Backoff`,
   a new ``claim_id``), one without answer (broker or MQTT down) with the same ``claim_id`` (never a
   second lease). Each claim asks the broker to keep off the nodes of the kept leases
   (``Requirements.avoid_hosts``), so that one node taken back takes at most its own leases; most
   important first: the nodes of leases being handed over (a replacement keeps off the node being
   taken back), then those of the other kept leases, then those of leases taken back in the last
   ``avoid_taken_back_s``. The broker gives up the last ones first when no other node can hold
   the lease, and never refuses it for them. Claims go one at a time, so each knows where the one
   before it landed;
2. *serving*: once its lease message carries an ``endpoint`` (and the site's own ``probe``, if
   given, answers true) the endpoint joins :attr:`KeptLeases.endpoints`; ``on_change`` is called;
   with ``recheck``, a serving endpoint that fails it ``recheck_failures`` times in a row (its
   workload died without a notice) leaves the view at once and its lease is released and replaced;
3. *noticed*: the lease turns ``reclaiming`` (or :meth:`KeptLeases.at_risk` is called): it no
   longer counts towards the target, so a replacement is claimed at once, while the old endpoint
   keeps serving (the simulated and the recommended workload drain on SIGTERM: answering, not
   accepting less);
4. *switched*: as soon as the endpoints serving without it still reach the target (the
   replacement is healthy) and the replacement has shared the traffic for ``overlap_s``, or
   ``handover_margin_s`` before the deadline if another endpoint serves, it leaves the view: no
   new request goes there;
5. *drained*: the requests in flight on it finish (:meth:`Endpoints.drained`, at most until the
   deadline or ``drain_timeout_s``);
6. *released* early: the pool gets the GPUs back before the deadline.

A lease that ends without notice (revoked, expired, a renewal answered ``unknown_lease`` or
``lease_not_live``: lost) leaves the view at once and is replaced; one that is granted but not
serving within ``ready_timeout_s`` is released and replaced. Every live lease is renewed every
``renew_every_s`` (keep it well under the broker's lease TTL) and again as soon as the broker's
birth follows its death (a broker restart). Renewals and releases without answer are retried;
the :class:`broker.edge.EdgeClient` below resends requests after a reconnect and keeps lease
messages queued while the site is offline (persistent session).

An *at-risk* lease message (``LeaseMessage.at_risk_since`` set: the training scheduler has planned
a job onto the lease's GPUs, before any reclaim notice) starts the same hand-over at once, without
a deadline until the lease turns ``reclaiming`` (:meth:`KeptLeases.at_risk`). A site can call
:meth:`KeptLeases.at_risk` from its own signals too (an endpoint that fails its health checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from broker.edge import ClaimRejected, LeaseRequestRejected, WatchEvent
from contracts import LeaseMessage, LeaseState, ReasonCode, Reply
from contracts.mqtt import LIMITS, Requirements
from contracts.topics import lease_hosts
from runtime.backoff import Backoff

log = logging.getLogger(__name__)

AVOID_BUDGET_BYTES = LIMITS.max_payload_bytes // 2
"""Most bytes the ``avoid_hosts`` list of a claim may take in its JSON (half of the protocol's
``LIMITS.max_payload_bytes``, the rest for the other fields): the least important names are cut."""

_LOST_CODES = frozenset({ReasonCode.UNKNOWN_LEASE, ReasonCode.LEASE_NOT_LIVE})
"""Renewal answers meaning the broker no longer has the lease live."""


class NoEndpoint(LookupError):
    """No endpoint serves now (:meth:`Endpoints.use`)."""


class Endpoints:
    """The endpoints (``host:port``) serving now, chosen round robin, with the requests in flight
    on each counted, so a leaving endpoint is released only once drained. Written by
    :class:`KeptLeases`; a site's load balancer reads :attr:`serving` or calls :meth:`use` per
    request. Single event loop; not thread-safe."""

    def __init__(self) -> None:
        self._serving: tuple[str, ...] = ()
        self._next = 0
        self._in_flight: Counter[str] = Counter()
        self._idle: dict[str, asyncio.Event] = {}
        self._some = asyncio.Event()
        """Set while at least one endpoint serves (:meth:`acquire` waits on it)."""

    @property
    def serving(self) -> tuple[str, ...]:
        """The endpoints new requests may go to, in the order they joined."""
        return self._serving

    def in_flight(self, endpoint: str) -> int:
        """Requests taken with :meth:`use` on ``endpoint`` and not finished."""
        return self._in_flight[endpoint]

    @contextlib.contextmanager
    def use(self) -> Iterator[str]:
        """The next serving endpoint (round robin), counted in flight until the block exits.
        Raises :class:`NoEndpoint` when none serves."""
        if not self._serving:
            raise NoEndpoint("no endpoint serves")
        endpoint = self._serving[self._next % len(self._serving)]
        self._next += 1
        self._in_flight[endpoint] += 1
        try:
            yield endpoint
        finally:
            self._in_flight[endpoint] -= 1
            if self._in_flight[endpoint] <= 0:
                del self._in_flight[endpoint]
                idle = self._idle.get(endpoint)
                if idle is not None:
                    idle.set()

    @contextlib.asynccontextmanager
    async def acquire(self, wait_s: float) -> AsyncGenerator[str, None]:
        """:meth:`use`, but while no endpoint serves, wait for one, at most ``wait_s`` seconds:
        a request sent in the gap between a lease's deadline and its replacement serving is
        answered late rather than failed (as KServe's activator holds requests while no replica
        is ready). Raises :class:`NoEndpoint` when none serves within ``wait_s`` (at once for
        ``wait_s`` <= 0)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not self._serving and (left := deadline - loop.time()) > 0:
            try:
                await asyncio.wait_for(self._some.wait(), left)
            except TimeoutError:
                break
        with self.use() as endpoint:
            yield endpoint

    async def drained(self, endpoint: str, timeout_s: float) -> bool:
        """Wait until no request is in flight on ``endpoint``, at most ``timeout_s`` seconds;
        True if drained. Call it after the endpoint left :attr:`serving`."""
        if not self._in_flight[endpoint]:
            return True
        idle = self._idle.setdefault(endpoint, asyncio.Event())
        idle.clear()
        try:
            await asyncio.wait_for(idle.wait(), max(0.0, timeout_s))
            return True
        except TimeoutError:
            return not self._in_flight[endpoint]
        finally:
            self._idle.pop(endpoint, None)

    def _set(self, serving: Sequence[str]) -> bool:
        """Replace the serving endpoints; True if they changed."""
        new = tuple(serving)
        if new == self._serving:
            return False
        self._serving = new
        if new:
            self._some.set()
        else:
            self._some.clear()
        return True


class LeaseClient(Protocol):
    """What :class:`KeptLeases` uses of :class:`broker.edge.EdgeClient` (a fake in tests)."""

    site: str

    @property
    def known_leases(self) -> Mapping[str, LeaseMessage]:
        """Newest message of each of the site's leases."""
        ...

    @property
    def broker_online(self) -> bool | None:
        """The broker's retained birth/death."""
        ...

    async def request(
        self,
        count: int,
        requirements: Requirements | None = None,
        duration_seconds: float = 300.0,
        min_notice_seconds: float = 0.0,
        min_duration_seconds: float = 0.0,
        timeout_s: float = 5.0,
        claim_id: str | None = None,
        workload: str | None = None,
    ) -> LeaseMessage:
        """A matched claim (:meth:`broker.edge.EdgeClient.request`)."""
        ...

    async def renew(
        self, lease_id: str, extend_seconds: float | None = None, timeout_s: float = 5.0
    ) -> Reply:
        """A renewal (:meth:`broker.edge.EdgeClient.renew`)."""
        ...

    async def release(self, lease_id: str, timeout_s: float = 5.0) -> Reply:
        """A release (:meth:`broker.edge.EdgeClient.release`)."""
        ...

    def watch(self) -> AsyncGenerator[WatchEvent, None]:
        """Known state, then every change (:meth:`broker.edge.EdgeClient.watch`)."""
        ...


@dataclass
class Handover:
    """One kept lease taken back (a reclaim notice or :meth:`KeptLeases.at_risk`) and how it was
    handed over; times are Unix s (the ``clock`` of :class:`KeptLeases`), ``None`` until reached.

    Attributes:
        lease_id: the lease.
        reason: the lease message's ``reason`` (``scheduler_preempted:<job>``, ``demand:<id>``...)
            or the one given to :meth:`KeptLeases.at_risk`.
        noticed_at: when the site learnt of it.
        deadline: the ``reclaim_deadline`` (``None``: at risk, no deadline yet).
        endpoint: the lease's endpoint when noticed (``None``: it was not serving).
        switched_at: when the endpoint left the view.
        drained_at: when its last request in flight finished (or the drain timed out).
        drained: False if requests were still in flight when the drain gave up.
        released_at: when the broker acknowledged the early release.
        ended: the lease's terminal state (``released``, ``revoked``, ``expired``) once known.
    """

    lease_id: str
    reason: str
    noticed_at: float
    deadline: float | None
    endpoint: str | None
    switched_at: float | None = None
    drained_at: float | None = None
    drained: bool = True
    released_at: float | None = None
    ended: LeaseState | None = None

    @property
    def early(self) -> bool:
        """Released by the site before the deadline (or with no deadline)."""
        return self.released_at is not None and (self.deadline is None or self.released_at < self.deadline)


@dataclass
class _Kept:
    lease_id: str
    since: float
    hosts: tuple[str, ...] = ()
    endpoint: str | None = None
    serving: bool = False
    serving_since: float = 0.0
    probing: bool = False
    handover: Handover | None = None
    retiring: bool = False
    failures: int = 0
    releasing: bool = False
    released: bool = False


def _noticed(k: _Kept) -> float:
    """When a kept lease's hand-over was noticed; infinity without one."""
    return k.handover.noticed_at if k.handover is not None else float("inf")


def _deadline(h: Handover | None) -> float:
    """A hand-over's deadline; infinity without one."""
    return h.deadline if h is not None and h.deadline is not None else float("inf")


class KeptLeases:
    """Leases of one workload profile kept at ``target``, each replaced before it is given back
    (module docstring). Use as an async context manager on a connected client.

    Args:
        client: the site's :class:`broker.edge.EdgeClient` (entered).
        target: leases to keep serving (>= 1).
        workload: the operator's workload profile each claim names.
        gpus_per_lease: GPUs of each lease (>= 1).
        requirements: what the GPUs must meet (:class:`contracts.mqtt.Requirements`); ``None``: any.
            Each claim adds the nodes of the kept leases to its ``avoid_hosts`` (:meth:`avoid_hosts`).
        avoid_taken_back_s: how long the nodes of a lease handed over (reclaim notice, at risk,
            unhealthy) stay at the end of each claim's ``avoid_hosts``, seconds (0: not kept).
        duration_seconds: lease length asked for, seconds.
        min_notice_seconds: shortest reclaim notice acceptable, seconds.
        renew_every_s: seconds between renewals of each live lease.
        ready_timeout_s: a lease not serving this many seconds after its grant is released and
            replaced.
        drain_timeout_s: longest wait for the requests in flight on a leaving endpoint, seconds
            (never past the reclaim deadline).
        handover_margin_s: with no replacement serving yet, a leaving endpoint leaves the view
            this many seconds before its deadline if another endpoint serves (time to drain).
        overlap_s: a leaving endpoint stays in the view this many seconds after its replacement
            joined (never past ``handover_margin_s`` before its deadline), so the replacement
            takes a share of the traffic before it takes the whole of it; 0: it leaves as soon as
            the replacement serves.
        request_timeout_s: how long one claim, renewal or release waits for the broker, seconds.
        retry_min_s / retry_max_s: backoff bounds of claims and releases sent again, seconds.
        probe: the site's own readiness check of a new endpoint (``await probe("host:port",
            lease_id)`` → True when it serves that lease); an endpoint joins the view only once it
            passes (tried every ``retry_min_s`` until ``ready_timeout_s``). ``None``: the broker's
            health check is trusted.
        recheck: the site's health check of a serving endpoint (same signature), run every
            ``recheck_every_s``; ``None``: none (only the broker's messages take an endpoint out).
        recheck_every_s / recheck_failures: period of ``recheck``, seconds, and the failures in a
            row that take an endpoint out (>= 1).
        on_change: called with the serving endpoints each time they change (e.g. to rewrite a
            load balancer's upstreams); exceptions it raises are logged.
        release_on_exit: release every kept lease when the context exits.
        clock: Unix time source.

    Attributes:
        endpoints: the :class:`Endpoints` view.
        handovers: one :class:`Handover` per lease taken back, in notice order.
        counts: ``claims_sent``, ``claim_timeouts``, ``refused:<code>``, ``granted``, ``serving``,
            ``reclaims``, ``at_risk``, ``unhealthy``, ``released_early``, ``released_late``, ``revoked``,
            ``expired``, ``lost``, ``start_failed``, ``renewals``, ``renewal_timeouts``,
            ``broker_restarts``.

    Raises ``ValueError`` for ``target`` or ``gpus_per_lease`` below 1, or a negative ``overlap_s``
    or ``avoid_taken_back_s``.
    """

    def __init__(
        self,
        client: LeaseClient,
        *,
        target: int,
        workload: str,
        gpus_per_lease: int = 1,
        requirements: Requirements | None = None,
        avoid_taken_back_s: float = 30.0,
        duration_seconds: float = 3600.0,
        min_notice_seconds: float = 0.0,
        renew_every_s: float = 10.0,
        ready_timeout_s: float = 60.0,
        drain_timeout_s: float = 30.0,
        handover_margin_s: float = 1.0,
        overlap_s: float = 0.0,
        request_timeout_s: float = 5.0,
        retry_min_s: float = 0.2,
        retry_max_s: float = 5.0,
        probe: Callable[[str, str], Awaitable[bool]] | None = None,
        recheck: Callable[[str, str], Awaitable[bool]] | None = None,
        recheck_every_s: float = 1.0,
        recheck_failures: int = 2,
        on_change: Callable[[tuple[str, ...]], None] | None = None,
        release_on_exit: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if target < 1 or gpus_per_lease < 1 or recheck_failures < 1:
            raise ValueError(
                f"target ({target}), gpus_per_lease ({gpus_per_lease}) and recheck_failures "
                f"({recheck_failures}) must be >= 1"
            )
        if overlap_s < 0 or avoid_taken_back_s < 0:
            raise ValueError(
                f"overlap_s ({overlap_s}) and avoid_taken_back_s ({avoid_taken_back_s}) must be >= 0"
            )
        Backoff(retry_min_s, retry_max_s)  # the bounds are checked here, not at the first refusal
        self.client = client
        self.target = target
        self.workload = workload
        self.gpus_per_lease = gpus_per_lease
        self.requirements = requirements
        self.avoid_taken_back_s = avoid_taken_back_s
        self.duration_seconds = duration_seconds
        self.min_notice_seconds = min_notice_seconds
        self.renew_every_s = renew_every_s
        self.ready_timeout_s = ready_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.handover_margin_s = handover_margin_s
        self.overlap_s = overlap_s
        self.request_timeout_s = request_timeout_s
        self.retry_min_s, self.retry_max_s = retry_min_s, retry_max_s
        self.probe = probe
        self.recheck = recheck
        self.recheck_every_s = recheck_every_s
        self.recheck_failures = recheck_failures
        self.on_change = on_change
        self.release_on_exit = release_on_exit
        self._clock = clock
        self.endpoints = Endpoints()
        self.handovers: list[Handover] = []
        self.counts: Counter[str] = Counter()
        self._kept: dict[str, _Kept] = {}
        self._claim_ids: set[str] = set()
        self._claiming = 0
        self._claim_lock = asyncio.Lock()
        self._taken_back: dict[str, float] = {}
        """Node of a lease handed over → until when claims keep off it (Unix s)."""
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._closing = False
        self._broker_online: bool | None = None

    # lifecycle ---------------------------------------------------------------------------------
    async def __aenter__(self) -> KeptLeases:
        """Adopt the site's live leases of this workload (a site restarted on a persistent
        session gets them back) and start claiming, watching and renewing."""
        self._broker_online = self.client.broker_online
        for msg in list(self.client.known_leases.values()):
            if msg.state.live and msg.workload == self.workload and len(self._kept) < self.target:
                self._kept[msg.lease_id] = _Kept(msg.lease_id, self._clock())
                self._on_lease(msg)
        self._loops = [
            asyncio.create_task(self._watch(), name="kept-leases-watch"),
            asyncio.create_task(self._renew_forever(), name="kept-leases-renew"),
            asyncio.create_task(self._tick_forever(), name="kept-leases-tick"),
        ]
        if self.recheck is not None:
            self._loops.append(asyncio.create_task(self._recheck_forever(), name="kept-leases-recheck"))
        self._reconcile()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stop claiming and watching; release every kept lease if ``release_on_exit``."""
        self._closing = True
        for t in [*self._loops, *self._tasks]:
            t.cancel()
        await asyncio.gather(*self._loops, *self._tasks, return_exceptions=True)
        self._loops = []
        if self.release_on_exit:
            await asyncio.gather(
                *(self._release(k) for k in list(self._kept.values()) if not k.released),
                return_exceptions=True,
            )
        self.endpoints._set(())

    async def ready(self, timeout_s: float) -> tuple[str, ...]:
        """Wait until ``target`` endpoints serve; returns them. Raises ``TimeoutError``."""
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: len(self.endpoints.serving) >= self.target), timeout_s
            )
        return self.endpoints.serving

    def avoid_hosts(self) -> list[str]:
        """What the next claim's ``Requirements.avoid_hosts`` holds, most important first, each
        node once: the site's own (``requirements``), the nodes of the kept leases being handed
        over (in notice order), of the other kept leases (oldest first), then of leases handed
        over in the last ``avoid_taken_back_s`` (newest first). Cut so the claim stays well inside
        the protocol's limits (:data:`AVOID_BUDGET_BYTES`, ``LIMITS.max_list_items``); names
        longer than ``LIMITS.max_name_chars`` are left out."""
        now = self._clock()
        self._taken_back = {h: t for h, t in self._taken_back.items() if t > now}
        kept = self._kept.values()
        leaving = sorted((k for k in kept if k.handover is not None), key=_noticed)
        staying = sorted((k for k in kept if k.handover is None), key=lambda k: k.since)
        recent = sorted(self._taken_back, key=lambda h: -self._taken_back[h])
        own = self.requirements.avoid_hosts if self.requirements is not None else []
        ordered = [*own, *(h for k in [*leaving, *staying] for h in k.hosts), *recent]
        out: list[str] = []
        size = 0
        for host in dict.fromkeys(ordered):
            size += len(json.dumps(host)) + 2  # the name, quoted and escaped, and ", "
            if size > AVOID_BUDGET_BYTES or len(out) == LIMITS.max_list_items:
                break
            if 0 < len(host) <= LIMITS.max_name_chars:
                out.append(host)
        return out

    @property
    def leases(self) -> Mapping[str, str | None]:
        """The kept leases (serving, starting or leaving) → their endpoint (``None`` until known)."""
        return {k.lease_id: k.endpoint for k in self._kept.values()}

    def at_risk(self, lease_id: str, reason: str = "at_risk", deadline: float | None = None) -> bool:
        """Hand over ``lease_id`` as on a reclaim notice: a replacement is claimed now and the
        lease is drained and released once it serves (by ``deadline``, Unix s, if given; a later
        ``reclaiming`` message sets it). Called on the broker's at-risk lease message, or by a
        site on a signal of its own (module docstring). Returns False for a lease not kept or
        already handed over."""
        k = self._kept.get(lease_id)
        if k is None or k.handover is not None:
            return False
        self.counts["at_risk"] += 1
        self._notice(k, reason, deadline)
        self._reconcile()
        return True

    # decisions -----------------------------------------------------------------------------------
    def _reconcile(self) -> None:
        """Give up on slow starts, claim what the target lacks, hand over leaving endpoints."""
        if self._closing:
            return
        now = self._clock()
        for k in list(self._kept.values()):
            if k.handover is None and not k.serving and now - k.since >= self.ready_timeout_s:
                self.counts["start_failed"] += 1
                log.warning("kept_lease_start_failed", extra={"lease_id": k.lease_id, "endpoint": k.endpoint})
                self._drop(k)
                self._spawn(self._release(k), "kept-leases-release")
        staying = sum(1 for k in self._kept.values() if k.handover is None)
        for _ in range(self.target - staying - self._claiming):
            self._claiming += 1
            self._spawn(self._claim(), "kept-leases-claim")
        serving = [k for k in self._kept.values() if k.serving]
        leaving = [k for k in self._kept.values() if k.handover is not None and not k.retiring]
        leaving.sort(key=lambda k: _deadline(k.handover))
        for k in leaving:
            if not k.serving:
                self._retire(k)  # nothing to hand over: give it back now
                continue
            deadline = _deadline(k.handover)
            # replaced: the others serving reach the target, the newest of them for overlap_s
            others = [x.serving_since for x in serving if x is not k]
            replaced = len(others) >= self.target and now >= max(others) + self.overlap_s
            pressed = now >= deadline - self.handover_margin_s and len(serving) > 1
            if replaced or pressed:
                serving.remove(k)
                self._retire(k)

    def _retire(self, k: _Kept) -> None:
        k.retiring = True
        if k.serving:
            k.serving = False
            self._publish()
        assert k.handover is not None
        k.handover.switched_at = self._clock()
        self._spawn(self._drain_and_release(k), "kept-leases-retire")

    def _notice(self, k: _Kept, reason: str, deadline: float | None) -> None:
        k.handover = Handover(k.lease_id, reason, self._clock(), deadline, k.endpoint if k.serving else None)
        if self.avoid_taken_back_s > 0:
            for host in k.hosts:
                self._taken_back[host] = k.handover.noticed_at + self.avoid_taken_back_s
        self.handovers.append(k.handover)
        log.info(
            "kept_lease_notice",
            extra={"lease_id": k.lease_id, "reason": reason, "deadline": deadline, "endpoint": k.endpoint},
        )

    def _on_lease(self, msg: LeaseMessage) -> None:
        """Absorb the newest message of a lease (kept, or granted to one of our claims)."""
        k = self._kept.get(msg.lease_id)
        if k is None:
            if msg.claim_id not in self._claim_ids or not msg.state.live:
                return  # not ours (another workload, a claim of someone else), or over already
            k = self._kept[msg.lease_id] = _Kept(msg.lease_id, self._clock())
        if not msg.state.live:
            self._ended(k, msg.state)
            return
        k.hosts = lease_hosts(msg.hosts, msg.gpus)
        if msg.state is LeaseState.RECLAIMING:
            if k.handover is None:
                self.counts["reclaims"] += 1
                self._notice(k, msg.reason, msg.reclaim_deadline)
            elif k.handover.deadline is None:
                k.handover.deadline = msg.reclaim_deadline  # at risk first, now with a deadline
        elif msg.at_risk_since is not None and k.handover is None:
            # the broker's early warning: the scheduler plans a job onto the lease's GPUs
            self.at_risk(msg.lease_id, msg.reason or "at_risk")
        if msg.endpoint and k.endpoint is None:
            # a later message without endpoint (a restarted broker checking health again) keeps ours
            k.endpoint = msg.endpoint
            if k.handover is None:
                if self.probe is None:
                    self._serve(k)
                elif not k.probing:
                    k.probing = True
                    self._spawn(self._probe(k), "kept-leases-probe")

    def _serve(self, k: _Kept) -> None:
        if k.serving or k.handover is not None or k.lease_id not in self._kept:
            return
        k.serving = True
        k.serving_since = self._clock()
        self.counts["serving"] += 1
        log.info("kept_lease_serving", extra={"lease_id": k.lease_id, "endpoint": k.endpoint})
        self._publish()

    def _ended(self, k: _Kept, state: LeaseState) -> None:
        h = k.handover
        if h is not None:
            h.ended = state
        if state is not LeaseState.RELEASED or not k.releasing:
            # not our release: revoked at a deadline, expired, or released by someone else
            self.counts[state.value] += 1
            if h is None:
                self.counts["lost"] += 1
            log.warning("kept_lease_ended", extra={"lease_id": k.lease_id, "state": state.value})
        self._drop(k)

    def _drop(self, k: _Kept) -> None:
        self._kept.pop(k.lease_id, None)
        if k.serving:
            k.serving = False
            self._publish()

    def _publish(self) -> None:
        """Put the serving endpoints into the view; tell ``on_change``; wake :meth:`ready`."""
        serving = [k.endpoint for k in self._kept.values() if k.serving and k.endpoint]
        if not self.endpoints._set(serving):
            return
        if self.on_change is not None:
            try:
                self.on_change(self.endpoints.serving)
            except Exception:  # noqa: BLE001 — a site's callback must not stop the hand-over
                log.exception("kept_leases_on_change_failed")
        self._spawn(self._notify(), "kept-leases-notify")

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # requests ------------------------------------------------------------------------------------
    async def _claim(self) -> None:
        """One lease: claimed again after a backoff until granted (module docstring, step 1)."""
        backoff = Backoff(self.retry_min_s, self.retry_max_s)
        claim_id = uuid.uuid4().hex
        granted: LeaseMessage | None = None
        try:
            while not self._closing:
                self._claim_ids.add(claim_id)
                self.counts["claims_sent"] += 1
                try:
                    # one at a time: the lease granted is kept (its nodes known) before the next claim
                    async with self._claim_lock:
                        granted = await self.client.request(
                            self.gpus_per_lease,
                            self._requirements(),
                            duration_seconds=self.duration_seconds,
                            min_notice_seconds=self.min_notice_seconds,
                            timeout_s=self.request_timeout_s,
                            claim_id=claim_id,
                            workload=self.workload,
                        )
                        self._keep(granted)
                    break
                except ClaimRejected as e:
                    self.counts[f"refused:{e.code.value}"] += 1
                    log.info("kept_lease_claim_refused", extra={"code": e.code.value, "text": e.reply.text})
                    claim_id = uuid.uuid4().hex
                except TimeoutError:
                    self.counts["claim_timeouts"] += 1  # the same claim_id again: never two leases
                await asyncio.sleep(backoff.next())
        finally:
            self._claiming -= 1
        if granted is not None:
            self.counts["granted"] += 1
        self._reconcile()

    def _requirements(self) -> Requirements | None:
        """``requirements`` with :meth:`avoid_hosts` (as given when there is nothing to avoid)."""
        avoid = self.avoid_hosts()
        if not avoid:
            return self.requirements
        return (self.requirements or Requirements()).model_copy(update={"avoid_hosts": avoid})

    def _keep(self, granted: LeaseMessage) -> None:
        """Keep a lease granted to one of our claims (its newest message, if one came already)."""
        newest = self.client.known_leases.get(granted.lease_id, granted)
        if newest.state.live and granted.lease_id not in self._kept:
            self._kept[granted.lease_id] = _Kept(granted.lease_id, self._clock())
        self._on_lease(newest)

    async def _probe(self, k: _Kept) -> None:
        assert self.probe is not None and k.endpoint is not None
        while k.lease_id in self._kept and k.handover is None:
            try:
                if await self.probe(k.endpoint, k.lease_id):
                    self._serve(k)
                    self._reconcile()
                    return
            except Exception:  # noqa: BLE001 — a failing probe means "not healthy yet"
                log.debug("kept_lease_probe_failed", exc_info=True)
            await asyncio.sleep(self.retry_min_s)

    async def _drain_and_release(self, k: _Kept) -> None:
        """Module docstring, steps 5 and 6."""
        h = k.handover
        assert h is not None
        if h.endpoint is not None and k.endpoint is not None:
            limit = self.drain_timeout_s
            if h.deadline is not None:
                limit = min(limit, h.deadline - self._clock())
            h.drained = await self.endpoints.drained(k.endpoint, limit)
            h.drained_at = self._clock()
        await self._release(k)
        if k.released and h.released_at is not None:
            self.counts["released_early" if h.early else "released_late"] += 1
        log.info(
            "kept_lease_handed_over",
            extra={
                "lease_id": k.lease_id,
                "switched_at": h.switched_at,
                "drained": h.drained,
                "released_at": h.released_at,
                "deadline": h.deadline,
            },
        )

    async def _release(self, k: _Kept) -> None:
        """Release ``k``; sent again without answer until its deadline (or ``drain_timeout_s``)."""
        backoff = Backoff(self.retry_min_s, self.retry_max_s)
        h = k.handover
        until = self._clock() + self.drain_timeout_s
        if h is not None and h.deadline is not None:
            until = max(self._clock(), h.deadline)
        k.releasing = True  # its ``released`` message may come before the reply
        while True:
            try:
                await self.client.release(k.lease_id, timeout_s=self.request_timeout_s)
            except LeaseRequestRejected as e:
                log.info("kept_lease_release_refused", extra={"lease_id": k.lease_id, "code": e.code.value})
                return  # already over: its terminal message says how
            except TimeoutError:
                if self._clock() >= until:
                    log.warning("kept_lease_release_unanswered", extra={"lease_id": k.lease_id})
                    return
                await asyncio.sleep(backoff.next())
                continue
            k.released = True
            if h is not None:
                h.released_at = self._clock()
            return

    async def _renew_all(self) -> None:
        async def one(k: _Kept) -> None:
            try:
                await self.client.renew(k.lease_id, timeout_s=self.request_timeout_s)
                self.counts["renewals"] += 1
            except TimeoutError:
                self.counts["renewal_timeouts"] += 1
            except LeaseRequestRejected as e:
                if e.code in _LOST_CODES and k.lease_id in self._kept and not k.retiring:
                    self.counts["lost"] += 1
                    log.warning("kept_lease_lost", extra={"lease_id": k.lease_id, "code": e.code.value})
                    self._drop(k)
                    self._reconcile()

        await asyncio.gather(*(one(k) for k in list(self._kept.values()) if not k.released))

    # loops ---------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        async with contextlib.aclosing(self.client.watch()) as events:
            async for event in events:
                if isinstance(event, LeaseMessage):
                    self._on_lease(event)
                    self._reconcile()

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.renew_every_s)
            await self._renew_all()

    async def _tick_forever(self, period_s: float = 0.1) -> None:
        """Deadlines and slow starts (:meth:`_reconcile`); a broker back online (its birth after
        its death) gets every lease renewed at once."""
        while True:
            await asyncio.sleep(period_s)
            online = self.client.broker_online
            if online and self._broker_online is False:
                self.counts["broker_restarts"] += 1
                log.info("kept_leases_broker_back", extra={"leases": len(self._kept)})
                self._spawn(self._renew_all(), "kept-leases-renew-now")
            self._broker_online = online
            self._reconcile()

    async def _recheck_forever(self) -> None:
        """Every ``recheck_every_s``: ``recheck`` each serving endpoint (module docstring, step 2)."""
        while True:
            await asyncio.sleep(self.recheck_every_s)
            serving = [k for k in self._kept.values() if k.serving and k.handover is None]
            results = await asyncio.gather(*(self._recheck_one(k) for k in serving))
            for k, ok in zip(serving, results, strict=True):
                k.failures = 0 if ok else k.failures + 1
                if k.failures >= self.recheck_failures and k.serving and k.handover is None:
                    self.counts["unhealthy"] += 1
                    log.warning(
                        "kept_lease_unhealthy", extra={"lease_id": k.lease_id, "endpoint": k.endpoint}
                    )
                    k.serving = False  # out at once: nothing to hand over from a dead endpoint
                    self._publish()
                    self._notice(k, "unhealthy", None)
            self._reconcile()

    async def _recheck_one(self, k: _Kept) -> bool:
        assert self.recheck is not None and k.endpoint is not None
        try:
            return await self.recheck(k.endpoint, k.lease_id)
        except Exception:  # noqa: BLE001 — a check that raises is a failed check
            log.debug("kept_lease_recheck_failed", exc_info=True)
            return False

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
