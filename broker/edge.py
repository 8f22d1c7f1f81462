"""The edge-site SDK: an async MQTT client that lists offers, claims leases, renews and releases
them, and follows reclaim notices (protocol v1, :mod:`contracts.mqtt`; topics
:class:`contracts.MqttTopics`).

::

    async with EdgeClient(site="edge-a", host="127.0.0.1", port=1883, username="edge-a",
                          password=secret) as site:
        offers = await site.offers(timeout_s=1.0)
        lease = await site.claim(offers[0].offer_id, count=1)
        # or let the broker pick: 4 GPUs of >= 80 GiB, one node or one leaf switch
        lease = await site.request(4, Requirements(min_fb_total_mib=80_000), min_duration_seconds=600)
        # run an operator-declared workload on it: one instance per node of the lease
        lease = await site.request(12, workload="sim-inference")
        urls = await site.wait_endpoints(lease.lease_id, timeout_s=60)   # ["10.0.0.5:28100", ...]
        await site.renew(lease.lease_id)
        async with contextlib.aclosing(site.watch()) as events:
            async for event in events:      # Offer | OfferWithdrawn | LeaseMessage | Reply
                ...

A refused login (CONNACK 0x86/0x87/0x8C, 3.1.1 codes 4/5) or a TLS mismatch on the first
connection is not retried: entering the client raises at once (:class:`broker.transport.LoginRefused`,
:class:`broker.transport.TlsHandshakeFailed`, :class:`broker.transport.NoMqttAnswer`).

The client keeps one connection alive in the background: it reconnects with exponential backoff,
resubscribes, and resends requests still waiting for their reply (claims are idempotent by
``claim_id``). With ``persistent=True`` (the default) the server keeps the session, so lease
messages — a reclaim notice above all — queue while the site is briefly offline (MQTT 5 session
expiry; MQTT 3.1.1 ``clean_session=False``). The incoming queue is unbounded: aiomqtt would drop
messages silently past its bound. A site announces itself with a retained birth on
``sites/{site}/state`` and leaves a retained Last Will (death), each with a growing ``seq``.

Tracing (:mod:`runtime.tracing`, when on, MQTT 5): :meth:`EdgeClient.claim` runs in a ``claim``
span (CLIENT) — child of the caller's current span if there is one, else of the offer's
``traceparent`` user property — and sends its own ``traceparent`` as a user property of the claim,
so the broker's grant joins the trace that found the idle GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import aiomqtt
from opentelemetry import trace

from broker.transport import (
    Backoff,
    LoginRefused,
    TlsOptions,
    birth_seq,
    connect_failure,
    make_client,
    protocol_version,
    publish_properties,
    serve_mqtt,
    subscriptions,
    user_properties,
)
from broker.wire import payload_bytes
from contracts import (
    Claim,
    LeaseKind,
    LeaseMessage,
    LeaseState,
    MqttTopics,
    Offer,
    PeerState,
    ReasonCode,
    Release,
    Renewal,
    Reply,
    encode,
)
from contracts.base import decode_compatible
from contracts.mqtt import Requirements
from runtime import tracing

log = logging.getLogger(__name__)
_TRACER = tracing.tracer(__name__)


def _request_id() -> str:
    """A fresh ``request_id`` for a request: the broker echoes it, and answers a request that has
    one with the full :class:`contracts.Reply` (``expires_at``, ``ttl_seconds``...)."""
    return uuid.uuid4().hex[:16]


class BrokerRejected(Exception):
    """The broker answered a request with a reason code other than ``ok``.

    Attributes:
        reply: the broker's :class:`contracts.Reply`.
        code: ``reply.code`` (:class:`contracts.ReasonCode`).
    """

    def __init__(self, reply: Reply) -> None:
        super().__init__(f"{reply.code.value}: {reply.text}")
        self.reply = reply
        self.code = reply.code


class ClaimRejected(BrokerRejected):
    """A claim was refused (``unknown_offer``, ``offer_expired``, ``gpu_unavailable``,
    ``notice_too_short``, ``isolation_failed``, ``malformed``...)."""


class LeaseRequestRejected(BrokerRejected):
    """A renewal or release was refused (``unknown_lease``, ``lease_not_live``...)."""


@dataclass(frozen=True, slots=True)
class OfferWithdrawn:
    """An offer's retained message was cleared: it was claimed, changed or lapsed."""

    offer_id: str


WatchEvent = Offer | OfferWithdrawn | LeaseMessage | Reply
"""What :meth:`EdgeClient.watch` yields."""


class EdgeClient:
    """One edge site's connection to the gpupool broker (see the module docstring).

    Args:
        site: the site name (the ``{site}`` topic level; with Mosquitto also the user name).
        host / port: the MQTT server.
        username / password: the site's credentials (``None``: anonymous).
        root: MQTT topic root.
        protocol: 5 (MQTT 5: response topic and correlation data) or 4 (MQTT 3.1.1).
        persistent: keep the server-side session across disconnects (see the module docstring).
        session_expiry_s: MQTT 5 session expiry of a persistent session, seconds.
        client_id: MQTT client id; default ``gpupool-site-<site>`` when persistent (a session is
            found again by its id: run one persistent client per site), else a random one.
        announce: publish the retained birth and set the Last Will on ``sites/{site}/state``
            (one-shot tools pass False so they do not mark the site offline when they exit).
        connect_timeout_s: how long entering the context waits for the first connection; each
            attempt (and each MQTT operation) times out after 0.75 × this, at most 10 s.
        reconnect_min_s / reconnect_max_s: reconnect backoff bounds, seconds.
        tls: connect over TLS (CA, optional client certificate; :class:`broker.transport.TlsOptions`);
            ``port`` is then the server's TLS listener. ``None``: plain TCP.

    Raises ``ValueError`` for a protocol other than 5 or 4.
    """

    def __init__(
        self,
        *,
        site: str,
        host: str,
        port: int,
        username: str | None = None,
        password: str | None = None,
        root: str = "gpupool/v1",
        protocol: int = 5,
        persistent: bool = True,
        session_expiry_s: int = 3600,
        client_id: str | None = None,
        announce: bool = True,
        connect_timeout_s: float = 10.0,
        reconnect_min_s: float = 0.2,
        reconnect_max_s: float = 30.0,
        tls: TlsOptions | None = None,
    ) -> None:
        protocol_version(protocol)
        self.site = site
        self._tls = tls
        self.topics = MqttTopics(root)
        self.protocol = protocol
        self._host, self._port = host, port
        self._username, self._password = username, password
        self._persistent = persistent
        self._session_expiry_s = session_expiry_s
        self._client_id = client_id or (
            f"gpupool-site-{site}" if persistent else f"gpupool-{site}-{uuid.uuid4().hex[:10]}"
        )
        self._announce = announce
        self._connect_timeout_s = connect_timeout_s
        self._backoff = Backoff(reconnect_min_s, reconnect_max_s)
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._seq = 0
        self._last_error: str = ""
        self._fatal: ConnectionError | None = None
        self._ever_connected = False
        self._offers: dict[str, Offer] = {}
        self._leases: dict[str, LeaseMessage] = {}
        self._broker_state: PeerState | None = None
        self._changed = asyncio.Condition()
        self._last_offer_msg = 0.0
        self._subscribed_at = 0.0
        self._waiters: dict[str, list[asyncio.Future[Reply]]] = {}
        self._inflight: dict[str, tuple[str, bytes, str, tuple[tuple[str, str], ...]]] = {}
        self._offer_trace: dict[str, list[tuple[str, str]]] = {}
        self._watchers: set[asyncio.Queue[WatchEvent]] = set()
        self.reconnects = 0
        """Connections made after the first one."""
        self.undecodable = 0
        """Messages on the site's topics that did not parse (logged, skipped)."""

    # lifecycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> EdgeClient:
        """Connect (in the background, retried) and wait for the first connection.

        Raises, at once (no retry can fix it): :class:`broker.transport.LoginRefused` when the
        server refuses the login ("MQTT server refused the login of <user>: not authorized");
        :class:`broker.transport.TlsHandshakeFailed` / :class:`broker.transport.NoMqttAnswer`
        (subclasses of ``ConnectionError``; "MQTT host:port not reachable as 'site': TLS handshake
        failed: ..." / "...: no MQTT answer: is this a TLS port? give --mqtt-cafile"). Raises
        ``ConnectionError`` if no attempt succeeds within ``connect_timeout_s`` (server down...),
        with the last error in the message."""
        self._task = asyncio.create_task(self._loop(), name=f"edge-{self.site}")
        connected = asyncio.ensure_future(self._connected.wait())
        done, _ = await asyncio.wait(
            {connected, self._task}, timeout=self._connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if connected in done:
            return self
        connected.cancel()
        crashed = self._task.exception() if self._task.done() else None
        await self._cancel()
        if crashed is not None:
            raise ConnectionError(
                f"MQTT {self._host}:{self._port}: connecting failed: {crashed!r}"
            ) from crashed
        fatal = self._fatal
        if isinstance(fatal, LoginRefused):
            raise fatal
        where = f"MQTT {self._host}:{self._port} not reachable as {self.site!r}"
        if fatal is not None:
            raise type(fatal)(f"{where}: {fatal}")
        raise ConnectionError(
            f"{where} within {self._connect_timeout_s} s: {self._last_error or 'no answer'}"
        )

    async def __aexit__(self, *exc: object) -> None:
        """Publish the retained goodbye (offline) if announcing, and disconnect cleanly."""
        client = self._client
        if client is not None and self._announce:
            with contextlib.suppress(aiomqtt.MqttError):
                await client.publish(
                    self.topics.site_state(self.site), self._peer_state(False), qos=1, retain=True
                )
        await self._cancel()

    async def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # state -------------------------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """True while connected and subscribed."""
        return self._connected.is_set()

    @property
    def known_offers(self) -> Mapping[str, Offer]:
        """Offers seen and not withdrawn or lapsed (``expires_at`` in the future), by id."""
        now = time.time()
        return MappingProxyType({k: o for k, o in self._offers.items() if o.expires_at > now})

    @property
    def known_leases(self) -> Mapping[str, LeaseMessage]:
        """The newest message of each of this site's leases (any state), by id (read-only)."""
        return MappingProxyType(self._leases)

    @property
    def broker_online(self) -> bool | None:
        """The broker's retained birth/death state; ``None`` if not seen."""
        return None if self._broker_state is None else self._broker_state.online

    # requests --------------------------------------------------------------------------------------------
    async def offers(self, timeout_s: float = 1.0) -> list[Offer]:
        """A snapshot of the live retained offers, oldest first.

        Waits until the retained burst after subscribing has settled (no new offer for 0.3 s,
        at most ``timeout_s`` seconds in all), so a fresh client sees every offer."""
        settle = min(0.3, timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            quiet_since = max(self._subscribed_at, self._last_offer_msg)
            if self.connected and time.monotonic() - quiet_since >= settle:
                break
            await asyncio.sleep(0.05)
        return sorted(self.known_offers.values(), key=lambda o: (o.ts, o.offer_id))

    async def claim(
        self,
        offer_id: str,
        gpus: Sequence[str] = (),
        count: int = 0,
        duration_seconds: float = 300.0,
        min_notice_seconds: float = 0.0,
        timeout_s: float = 5.0,
        claim_id: str | None = None,
        min_duration_seconds: float = 0.0,
        workload: str | None = None,
        lease_kind: LeaseKind | None = None,
    ) -> LeaseMessage:
        """Claim GPUs of an offer and wait for the lease.

        Args:
            offer_id: the offer.
            gpus: GPU keys wanted (a subset of the offer's); empty: ``count`` of them, or all.
            count: how many GPUs when ``gpus`` is empty; 0 means all.
            duration_seconds: the lease length wanted (bounded by the offer's availability).
            min_notice_seconds: the shortest reclaim notice acceptable.
            timeout_s: how long to wait for the reply and the lease, seconds.
            claim_id: idempotency key (default: a random one); a repeated id gets the same answer.
            min_duration_seconds: minimum guaranteed duration (see :meth:`request`); the offer
                must be promised that long (else ``duration_unavailable``).
            workload: an operator-declared workload profile to run on the GPUs (else
                ``unknown_workload``); its ``endpoints`` come in later lease messages
                (:meth:`wait_endpoints`).
            lease_kind: ``preemptible`` (promises only the notice) or ``window`` (promised until
                the offer's ``available_until``, the lease message's ``window_until``);
                ``None``: as a claim of an earlier release (:attr:`contracts.Claim.kind`).

        Returns the lease's retained :class:`contracts.LeaseMessage` (state ``granted``).
        Raises :class:`ClaimRejected` with the broker's reply, ``TimeoutError`` if no answer came.
        """
        claim = Claim(
            claim_id=claim_id or uuid.uuid4().hex,
            site=self.site,
            offer_id=offer_id,
            gpus=list(gpus),
            count=count,
            duration_seconds=duration_seconds,
            min_notice_seconds=min_notice_seconds,
            min_duration_seconds=min_duration_seconds,
            ts=time.time(),
            request_id=_request_id(),
            workload=workload,
            lease_kind=None if lease_kind is None else lease_kind.value,
        )
        return await self._submit(claim, timeout_s)

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
        lease_kind: LeaseKind | None = None,
    ) -> LeaseMessage:
        """Claim ``count`` GPUs by requirements and let the broker pick the offers (matchmaking:
        one node if it can, else several nodes under one leaf switch; ``broker/match.py``).

        Args:
            count: how many GPUs (>= 1).
            requirements: model, memory per GPU (MiB), zone, preference order, locality
                (:class:`contracts.mqtt.Requirements`); ``None``: any idle GPU.
            duration_seconds: the lease length wanted, seconds.
            min_notice_seconds: the shortest reclaim notice acceptable, seconds.
            min_duration_seconds: minimum guaranteed duration, seconds: only offers promised that
                long match, and no unforced training demand takes the lease back sooner.
            timeout_s: how long to wait for the reply and the lease, seconds.
            claim_id: idempotency key (default: a random one); resend a claim that timed out
                with the same id, so it never makes a second lease.
            workload: an operator-declared workload profile to run on the GPUs, one instance per
                node of the lease (else ``unknown_workload``); see :meth:`wait_endpoints`.
            lease_kind: ``preemptible`` or ``window`` (as for :meth:`claim`).

        Returns the lease's retained :class:`contracts.LeaseMessage` (state ``granted``; its
        ``hosts`` and ``offer_ids`` say where the GPUs are). Raises ``ValueError`` (a
        ``pydantic.ValidationError``) for ``count`` < 1 or ``min_duration_seconds`` above
        ``duration_seconds``, :class:`ClaimRejected` with the broker's reply (e.g. ``no_match``,
        ``quota_exceeded``), ``TimeoutError`` if no answer came.
        """
        claim = Claim(
            claim_id=claim_id or uuid.uuid4().hex,
            site=self.site,
            count=count,
            requirements=requirements or Requirements(),
            duration_seconds=duration_seconds,
            min_notice_seconds=min_notice_seconds,
            min_duration_seconds=min_duration_seconds,
            ts=time.time(),
            request_id=_request_id(),
            workload=workload,
            lease_kind=None if lease_kind is None else lease_kind.value,
        )
        return await self._submit(claim, timeout_s)

    async def _submit(self, claim: Claim, timeout_s: float) -> LeaseMessage:
        """Send ``claim`` in a ``claim`` span, wait for the reply and the granted lease."""
        deadline = time.monotonic() + timeout_s
        offer_id = claim.offer_id
        topic = self.topics.claims(self.site)
        offer_ctx = tracing.extract_mqtt_context(self._offer_trace.get(offer_id) if offer_id else None)
        own = trace.get_current_span().get_span_context().is_valid
        attrs = tracing.mqtt_publish_attributes(
            topic, template=self.topics.claims("{site}"), message_id=claim.claim_id, client_id=self._client_id
        )
        if offer_id is not None:
            attrs["gpupool.offer.id"] = offer_id
        with _TRACER.start_as_current_span(
            "claim",
            context=None if own else offer_ctx,
            kind=tracing.SpanKind.CLIENT,
            links=tracing.link(offer_ctx) if own else None,
            attributes=attrs,
        ) as span:
            props = tuple(tracing.mqtt_user_properties(span))
            reply = await self._request(topic, claim.claim_id, encode(claim), timeout_s, props)
            if reply.code is not ReasonCode.OK or reply.lease_id is None:
                tracing.mark_error(span, reply.code.value, reply.text)
                raise ClaimRejected(reply)
            if span.is_recording():
                span.set_attribute("gpupool.lease.id", reply.lease_id)
            left = max(0.0, deadline - time.monotonic())
            return await self.wait_lease(reply.lease_id, lambda _: True, left)

    async def renew(
        self, lease_id: str, extend_seconds: float | None = None, timeout_s: float = 5.0
    ) -> Reply:
        """Heartbeat a lease (``extend_seconds``: how long, capped by the broker's lease TTL).

        Returns the ``ok`` reply; the lease's retained message shows the new ``expires_at``.
        Raises :class:`LeaseRequestRejected`, ``TimeoutError``."""
        body = encode(
            Renewal(lease_id=lease_id, site=self.site, ts=time.time(), extend_seconds=extend_seconds,
                    request_id=_request_id())
        )
        reply = await self._request(self.topics.renewals(self.site), lease_id, body, timeout_s)
        if reply.code is not ReasonCode.OK:
            raise LeaseRequestRejected(reply)
        return reply

    async def release(self, lease_id: str, timeout_s: float = 5.0) -> Reply:
        """Give a lease back early. A release resent after a reconnect whose first copy had
        already worked is answered ``lease_not_live``; that counts as success when the lease's
        retained state is ``released``. Raises :class:`LeaseRequestRejected`, ``TimeoutError``."""
        body = encode(Release(lease_id=lease_id, site=self.site, ts=time.time(), request_id=_request_id()))
        reply = await self._request(self.topics.releases(self.site), lease_id, body, timeout_s)
        if reply.code is ReasonCode.OK:
            return reply
        known = self._leases.get(lease_id)
        if (
            reply.code is ReasonCode.LEASE_NOT_LIVE
            and known is not None
            and known.state is LeaseState.RELEASED
        ):
            return reply
        raise LeaseRequestRejected(reply)

    async def wait_lease(
        self, lease_id: str, predicate: Callable[[LeaseMessage], bool], timeout_s: float
    ) -> LeaseMessage:
        """Wait until lease ``lease_id``'s newest message satisfies ``predicate`` (e.g.
        ``lambda m: m.state is LeaseState.RECLAIMING``). Raises ``TimeoutError``."""

        def ready() -> bool:
            msg = self._leases.get(lease_id)
            return msg is not None and predicate(msg)

        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(ready), timeout_s)
        return self._leases[lease_id]

    async def wait_endpoints(self, lease_id: str, timeout_s: float, every_node: bool = True) -> list[str]:
        """Wait until the workload of lease ``lease_id`` serves, and return where:
        ``host:port`` of each healthy instance, in the order of the lease's ``hosts``
        (:attr:`contracts.LeaseMessage.endpoints`). ``every_node``: wait for an instance on each
        node of the lease (else for the first one that is healthy). A message of a broker that
        sends only ``endpoint`` counts as one instance. Raises ``TimeoutError`` (also when the
        lease ends first: it will never serve then)."""

        def found(m: LeaseMessage) -> list[str]:
            return list(m.endpoints) or ([m.endpoint] if m.endpoint else [])

        def serving(m: LeaseMessage) -> bool:
            if not m.state.live:
                return True  # stop waiting: checked below
            have = found(m)
            return bool(have) and (not every_node or len(have) >= max(1, len(m.hosts)))

        msg = await self.wait_lease(lease_id, serving, timeout_s)
        if not msg.state.live:
            raise TimeoutError(f"lease {lease_id} is {msg.state.value}: its workload will not serve")
        return found(msg)

    async def watch(self) -> AsyncGenerator[WatchEvent, None]:
        """Every offer and lease known now, then every change as it arrives (offers, withdrawals,
        lease messages, replies), without end; an item may repeat. Unbounded: consume it
        promptly, and close it (``contextlib.aclosing``) when done."""
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            for offer in list(self.known_offers.values()):
                yield offer
            for lease in list(self._leases.values()):
                yield lease
            while True:
                yield await queue.get()
        finally:
            self._watchers.discard(queue)

    async def _request(
        self, topic: str, key: str, payload: bytes, timeout_s: float, props: tuple[tuple[str, str], ...] = ()
    ) -> Reply:
        """Publish a request (with MQTT 5 user properties ``props``) answered by a :class:`Reply`
        for ``key`` and wait for it; resent after a reconnect while unanswered. Raises
        ``TimeoutError``."""
        token = uuid.uuid4().hex
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(fut)
        self._inflight[token] = (topic, payload, key, props)
        try:
            await self._send(topic, payload, key, props)
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._inflight.pop(token, None)
            waiting = self._waiters.get(key, [])
            if fut in waiting:
                waiting.remove(fut)
            if not waiting:
                self._waiters.pop(key, None)

    async def _send(
        self, topic: str, payload: bytes, key: str, user_props: tuple[tuple[str, str], ...] = ()
    ) -> None:
        client = self._client
        if client is None:
            return  # resent by the reconnect
        props = publish_properties(
            self.protocol,
            response_topic=self.topics.replies(self.site),
            correlation=key.encode(),
            user_properties=user_props,
        )
        try:
            await client.publish(topic, payload, qos=1, properties=props)
        except aiomqtt.MqttError as e:
            log.warning("edge_publish_failed", extra={"site": self.site, "topic": topic, "error": str(e)})

    # connection ------------------------------------------------------------------------------------------
    def _peer_state(self, online: bool) -> bytes:
        return encode(PeerState(peer=self.site, online=online, seq=self._seq, ts=time.time()))

    async def _loop(self) -> None:
        """Stay connected (:func:`broker.transport.serve_mqtt`) until a refused login or TLS
        mismatch on the first connection ends it (:attr:`_fatal`)."""
        first = True

        def connect() -> aiomqtt.Client:
            self._seq = birth_seq()
            return make_client(
                self._host,
                self._port,
                username=self._username,
                password=self._password,
                identifier=self._client_id,
                protocol=self.protocol,
                state_topic=self.topics.site_state(self.site) if self._announce else None,
                peer=self.site,
                seq=self._seq,
                persistent=self._persistent,
                session_expiry_s=self._session_expiry_s,
                tls=self._tls,
                # below the connect timeout, so a missing CONNACK is seen (and explained) in time
                timeout_s=min(10.0, self._connect_timeout_s * 0.75),
            )

        async def on_connect(client: aiomqtt.Client) -> None:
            nonlocal first
            self._client = client
            await self._on_connect(client)
            if not first:
                self.reconnects += 1
            first = False
            self._ever_connected = True

        def on_error(e: Exception, connected: bool) -> bool:
            if not isinstance(e, aiomqtt.MqttError):
                self._last_error = repr(e)
                log.error("edge_loop_error", exc_info=e, extra={"site": self.site})
                return False
            failure = None if connected else connect_failure(e, username=self._username, tls=self._tls is not None)
            self._last_error = str(failure or e)
            if failure is not None and not self._ever_connected:
                # a refused login or a TLS mismatch: retrying cannot help, __aenter__ says so
                self._fatal = failure
                log.warning("edge_connect_refused", extra={"site": self.site, "error": str(failure)})
                return True
            log.warning("edge_disconnected", extra={"site": self.site, "error": self._last_error})
            return False

        def on_disconnect() -> None:
            self._client = None
            self._connected.clear()

        await serve_mqtt(connect, on_connect, self._dispatch, on_error, on_disconnect, self._backoff)

    async def _on_connect(self, client: aiomqtt.Client) -> None:
        # withdrawals published while away are not retained: forget every offer, the retained
        # burst after subscribing brings back those still standing
        self._offer_trace.clear()
        for offer_id in list(self._offers):
            del self._offers[offer_id]
            await self._emit(OfferWithdrawn(offer_id))
        if self._announce:
            await client.publish(
                self.topics.site_state(self.site), self._peer_state(True), qos=1, retain=True
            )
        wanted = [
            self.topics.offers_filter,
            self.topics.leases_filter(self.site),
            self.topics.replies(self.site),
            self.topics.broker_state,
        ]
        if self._announce:
            wanted.append(self.topics.site_state(self.site))
        await client.subscribe(subscriptions(self.protocol, wanted))
        self._subscribed_at = time.monotonic()
        self._connected.set()
        for topic, payload, key, props in list(self._inflight.values()):
            await self._send(topic, payload, key, props)
        log.info("edge_connected", extra={"site": self.site, "seq": self._seq})

    async def _dispatch(self, msg: aiomqtt.Message) -> None:
        topic = msg.topic.value
        payload = payload_bytes(msg.payload)
        if self._announce and topic == self.topics.site_state(self.site):
            await self._on_own_state(payload)
            return
        event: WatchEvent | None = None
        try:
            event = self._absorb(topic, payload, msg)
        except ValueError as e:  # pydantic's ValidationError included
            self.undecodable += 1
            log.warning(
                "edge_message_undecodable", extra={"site": self.site, "topic": topic, "error": str(e)[:300]}
            )
        if event is not None:
            await self._emit(event)

    async def _on_own_state(self, payload: bytes) -> None:
        """A Last Will of an earlier session that reached the server after the current birth would
        leave the site marked offline: publish the birth again."""
        client = self._client
        if not payload or client is None:
            return
        try:
            st = decode_compatible(PeerState, payload)
        except ValueError:
            self.undecodable += 1
            return
        if not st.online and st.seq < self._seq:
            log.info("edge_stale_death_replaced", extra={"site": self.site, "seq": st.seq})
            with contextlib.suppress(aiomqtt.MqttError):
                await client.publish(
                    self.topics.site_state(self.site), self._peer_state(True), qos=1, retain=True
                )

    async def _emit(self, event: WatchEvent) -> None:
        for q in self._watchers:
            q.put_nowait(event)
        async with self._changed:
            self._changed.notify_all()

    def _absorb(self, topic: str, payload: bytes, msg: aiomqtt.Message) -> WatchEvent | None:
        """Update the local view from one message; returns the event to report, if any.
        Raises ``ValueError`` (pydantic's included) for a payload that does not parse."""
        offers_prefix = f"{self.topics.root}/offers/"
        if topic.startswith(offers_prefix):
            self._last_offer_msg = time.monotonic()
            offer_id = topic[len(offers_prefix) :]
            if not payload:
                self._offer_trace.pop(offer_id, None)
                return OfferWithdrawn(offer_id) if self._offers.pop(offer_id, None) is not None else None
            offer = decode_compatible(Offer, payload)
            self._offers[offer.offer_id] = offer
            if tracing.enabled():  # the trace the offer belongs to, for the claim's span
                self._offer_trace[offer.offer_id] = user_properties(msg)
            return offer
        leases_prefix = f"{self.topics.root}/sites/{self.site}/leases/"
        if topic.startswith(leases_prefix):
            if not payload:
                self._leases.pop(topic[len(leases_prefix) :], None)
                return None
            lease = decode_compatible(LeaseMessage, payload)
            cur = self._leases.get(lease.lease_id)
            if cur is not None and cur.seq > lease.seq:
                return None  # an older state delivered late
            self._leases[lease.lease_id] = lease
            return lease
        if topic == self.topics.replies(self.site):
            reply = decode_compatible(Reply, payload)
            corr = msg.properties and getattr(msg.properties, "CorrelationData", None)
            key = bytes(corr).decode(errors="replace") if corr else reply.in_reply_to
            for fut in self._waiters.get(key, []):
                if not fut.done():
                    fut.set_result(reply)
                    break
            return reply
        if topic == self.topics.broker_state and payload:
            self._broker_state = decode_compatible(PeerState, payload)
        return None
