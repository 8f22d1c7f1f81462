"""The broker stage: capacity (bus) → retained offers (MQTT); site claims → leases; pool demand →
reclaims with notice; every lease transition → the ``leases.log`` topic.

Protocol v1 (DESIGN.md "Broker protocol", topics from :class:`contracts.MqttTopics`):

* ``offers/{offer_id}`` — retained :class:`contracts.Offer`, QoS 1, MQTT 5 message expiry = the
  offer's remaining lifetime; withdrawn with an empty retained payload;
* ``sites/{site}/claims|renewals|releases`` — read; each answered with a :class:`contracts.Reply`
  on ``sites/{site}/replies`` (MQTT 5: with the request's correlation data, and also on its
  response topic when that lies in the site's own subtree);
* ``sites/{site}/leases/{lease_id}`` — retained :class:`contracts.LeaseMessage`, QoS 1;
* ``sites/{site}/state`` — read (site birth/death); ``broker/state`` — the broker's retained birth,
  and its Last Will (death), both :class:`contracts.PeerState` with a growing ``seq``.

Durability: at :meth:`BrokerService.start` the lease book is rebuilt from ``leases.log`` read from
its beginning; each transition is logged (and flushed) before it is published on MQTT, and a
transition the log refuses (or does not acknowledge within ``lease_log_timeout_s``) is undone in
the book and answered ``internal`` (:meth:`BrokerService._apply`). On every (re)connection the
broker republishes its offers and leases, sends the replies that could not be delivered and
clears retained offers and lease messages it does not know (left by an earlier incarnation), so
MQTT converges to the book.

Site requests (``broker/wire.py``) are decoded strictly before any decision; retained requests
are ignored and cleared, stale ones (``request_max_age_s``) ignored, and each site is held to a
request rate (``site_request_rate_per_s``, ``site_request_burst``).

Everything runs on one event loop; handlers of MQTT messages, bus batches and ticks take turns
under one lock, so the book sees one change at a time. Fabric work is never done under that lock
(a partition is verified on the fabric, which can take seconds): a claim reserves its GPUs under
the lock (:meth:`LeaseBook.begin_claim`), is isolated in a task of its own without it, and is
granted or aborted under it again; claims on other GPUs, renewals, releases, demands and ticks
go on meanwhile. Partitions of ended leases are removed in the background, and after a rebuild
the partitions no live lease holds are removed (``FabricManager.remove_stale``). Without fabric
isolation a claim is reserved and granted in one step, and its reply is published right after
its lease message, before the offer changes it caused.

Tracing (:mod:`runtime.tracing`, when on): a capacity or demand record that carries a trace
context is handled in a ``process <topic>`` span (CONSUMER, its child); each offer it publishes
gets a ``publish <root>/offers/{offer_id}`` span (PRODUCER) whose ``traceparent`` goes out as an
MQTT 5 user property (kept for the offer's republishes). A claim is handled in a
``process <root>/sites/{site}/claims`` span (child of the site's ``traceparent`` user property
when it sent one) with a ``grant lease`` span around isolation and grant; lease messages and
replies published meanwhile carry that context, and so do the lease-log records.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import aiomqtt
from prometheus_client import CollectorRegistry
from opentelemetry import trace
from opentelemetry.context import Context

from broker.metrics import BrokerMetrics
from broker.config import BrokerConfig
from broker.fabric import FabricError, FabricManager, NoIsolation, isolation_problem
from broker.lending import Lending, LendingHooks, NoLending
from broker.leases import Answer, Changes, LeaseBook, PendingGrant, demand_of, lease_message
from broker.ratelimit import SiteRateLimiter
from broker.tally import Tally
from broker.transport import (
    TlsOptions,
    birth_seq,
    make_client,
    protocol_version,
    publish_properties,
    response_route,
    serve_mqtt,
    subscriptions,
    user_properties,
)
from broker.wire import Malformed, parse_site_message, payload_bytes, peek_id
from contracts import (
    CapacityUpdate,
    Claim,
    KafkaTopics,
    LeaseLogRecord,
    LeaseState,
    MqttTopics,
    Offer,
    PeerState,
    PoolDemand,
    ReasonCode,
    Release,
    Renewal,
    Reply,
    encode,
)
from contracts.base import decode_compatible
from contracts.bus import Bus, BusMessage, Consumer, Producer, TopicPartition, require_topics
from contracts.leases import LeaseReason, Partition
from contracts.mqtt import CLAIM_COMMAND_FIELDS, REPLY_ADDED_FIELDS
from runtime import tracing
from runtime.backoff import Backoff
from runtime.replay import read_to_end

__all__ = ["BrokerConfig", "BrokerService", "LEASE_LOG_LINGER_MS", "tune_gc"]

log = logging.getLogger(__name__)
_TRACER = tracing.tracer(__name__)

_PUBLISH_TIMEOUT_S = 1.0
"""How long a QoS 1 publish waits for its PUBACK, seconds. aiomqtt does not fail a publish
pending when the connection drops: it would wait its whole client timeout (10 s), and a stop
waits for pending publishes. On a live connection a timed-out message is still delivered; after
a drop the resync republishes state."""

_PENDING_PUBLISHES_WARN = 1000
"""aiomqtt logs a warning per publish while more than this many await their PUBACK (its default,
10, is reached by any claim burst now that publishes are not awaited one by one)."""

LEASE_LOG_LINGER_MS = 0.0
"""Default batching delay of the lease-log producer, milliseconds. Every change is flushed right
after it is sent, under the service lock, so lingering only adds to each claim: with the bus's
throughput default (Kafka: 20 ms) the broker logged ~45 transitions/s and claims queued for
seconds. The records of one change set still share a batch (they are sent before the flush).
Measured with ``bench/broker.py --kafka`` (1,000 sites, 100 claims/s): claim p99 16.5 ms at 0 ms,
25.3 ms at 1 ms."""

_ClaimKey = tuple[str, str]
"""(site, claim_id)."""

_OUTBOX_MAX = 10_000
"""Replies kept for the next MQTT connection at most; older ones are dropped (counted)."""

_PUBLISH_ATTEMPTS = 5
"""Sends of one publish on a live connection before it is left to the reconnect resync (retained
state) or the outbox (replies)."""

_CONNECT_STEP_TIMEOUT_S = 30.0
"""Bound on the steps after a (re)connection (birth, subscriptions, resync), so a wedged step can
never keep the MQTT loop from reconnecting."""

_REQUESTS = {"claims": "claim", "renewals": "renewal", "releases": "release"}
"""Site request topics (last level) → the request they carry."""


def _unless_undone(answer: Answer, undone: set[str]) -> Answer:
    """``answer``, or ``internal`` if the change it reports was undone (the lease log refused it)."""
    if answer.ok and answer.lease_id is not None and answer.lease_id in undone:
        return Answer(ReasonCode.INTERNAL, "the lease log did not take this change; nothing changed; retry")
    return answer


class _GcPolicy:
    """What :func:`tune_gc` asked for; the service's tick loop carries it out (:meth:`due`)."""

    def __init__(self) -> None:
        self.refreeze_every_s = 0.0
        self.full_every_s = 0.0
        self._next_refreeze = math.inf
        self._next_full = math.inf

    def set(self, refreeze_every_s: float, full_every_s: float, now: float) -> None:
        """Re-freeze every ``refreeze_every_s`` seconds and collect fully every ``full_every_s``
        seconds from ``now`` (Unix s); 0 turns either off."""
        self.refreeze_every_s, self.full_every_s = refreeze_every_s, full_every_s
        self._next_refreeze = now + refreeze_every_s if refreeze_every_s > 0 else math.inf
        self._next_full = now + full_every_s if full_every_s > 0 else math.inf

    def run_due(self, now: float) -> None:
        """Refreeze or fully collect if it is time (``now``: ``time.monotonic()``)."""
        if now >= self._next_full:
            t0 = time.perf_counter()
            gc.unfreeze()
            found = gc.collect()
            gc.freeze()
            self._next_full = now + self.full_every_s
            self._next_refreeze = now + self.refreeze_every_s if self.refreeze_every_s > 0 else math.inf
            log.info(
                "gc_full_collection",
                extra={"unreachable": found, "seconds": round(time.perf_counter() - t0, 4),
                       "frozen_objects": gc.get_freeze_count()},
            )  # fmt: skip
        elif now >= self._next_refreeze:
            gc.collect(1)
            gc.freeze()
            self._next_refreeze = now + self.refreeze_every_s


_GC = _GcPolicy()


def tune_gc(refreeze_every_s: float = 1.0, full_every_s: float = 3600.0) -> None:
    """Keep garbage-collector pauses off the claim path of a long-running broker process.

    CPython's full (generation 2) collection walks every container object alive; the broker
    remembers every lease for ``retain_terminal_s`` (15 min: ~90,000 leases at 100 claims/s), so
    with the default settings full collections stall the event loop — and every claim in flight —
    for hundreds of milliseconds a few times a minute (``bench/broker.py --service-only 120
    --no-gc-tune``). Here: everything alive now is moved to the permanent generation
    (``gc.freeze()``, which no collection walks), and every ``refreeze_every_s`` seconds the
    broker's tick collects the young generations and freezes their survivors again, so no
    automatic full collection ever has much to walk. Frozen objects are still freed by reference
    counting; only a reference cycle that was alive when frozen and became garbage later is kept,
    until the full collection (unfreeze, collect everything, freeze) every ``full_every_s``
    seconds (0: never) reclaims it — one longer pause per period, logged as
    ``gc_full_collection`` with what it found.

    Process-wide: call it once, after :meth:`BrokerService.start`, from the process's owner
    (``gpupool broker run``, the benchmark) — not from a library. Raises ``ValueError`` for a
    ``refreeze_every_s`` <= 0 or a negative ``full_every_s``.
    """
    if not refreeze_every_s > 0 or not full_every_s >= 0:
        raise ValueError(
            f"refreeze_every_s must be > 0 and full_every_s >= 0, got {refreeze_every_s}, {full_every_s}"
        )
    gc.collect()
    gc.freeze()
    _GC.set(refreeze_every_s, full_every_s, time.monotonic())
    log.info(
        "gc_tuned",
        extra={"frozen_objects": gc.get_freeze_count(), "refreeze_every_s": refreeze_every_s,
               "full_every_s": full_every_s},
    )  # fmt: skip


class BrokerService:
    """The broker stage (see the module docstring).

    Args:
        bus: where ``topics.capacity`` and ``topics.pool_demand`` are read and ``topics.leases_log``
            is read (at start) and written.
        topics: Kafka topic names.
        mqtt_host / mqtt_port: the MQTT server.
        mqtt_username / mqtt_password: the broker's MQTT credentials (``None``: anonymous).
        root: MQTT topic root (``gpupool/v1``).
        protocol: 5 (MQTT 5) or 4 (MQTT 3.1.1, e.g. the demo's embedded amqtt).
        config: offer/lease/notice times and the consumer group (:class:`BrokerConfig`).
        fabric: fabric isolation applied before each grant; default :class:`NoIsolation`
            ("fabric isolation disabled by configuration").
        lending: the training scheduler's side of each lease (:mod:`broker.lending`: the hold
            placed before each grant, removed at its end, preemption read back as reclaims);
            default :class:`broker.lending.NoLending` (``[broker] scheduler = "none"``).
        client_id: MQTT client id; the broker keeps a persistent session under it, so claims sent
            while it is briefly disconnected are delivered when it is back.
        clock: Unix time source (seconds), injectable for tests.
        tls: connect to the MQTT server over TLS (:class:`broker.transport.TlsOptions`;
            ``mqtt_port`` is then its TLS listener). ``None``: plain TCP.
        lease_log_linger_ms: batching delay of the lease-log producer, milliseconds (see
            :data:`LEASE_LOG_LINGER_MS`); ``None``: the bus's default.
        metrics: this service's Prometheus metrics (:class:`broker.metrics.BrokerMetrics`, one
            per service); ``None``: new ones on a registry of their own. Its ``/metrics`` serves
            :attr:`registry`.

    Raises ``ValueError`` for a protocol other than 5 or 4, or a negative ``lease_log_linger_ms``.
    """

    def __init__(
        self,
        *,
        bus: Bus,
        topics: KafkaTopics,
        mqtt_host: str,
        mqtt_port: int,
        mqtt_username: str | None = None,
        mqtt_password: str | None = None,
        root: str = "gpupool/v1",
        protocol: int = 5,
        config: BrokerConfig | None = None,
        fabric: FabricManager | None = None,
        client_id: str = "gpupool-broker",
        clock: Callable[[], float] = time.time,
        tls: TlsOptions | None = None,
        lease_log_linger_ms: float | None = LEASE_LOG_LINGER_MS,
        lending: Lending | None = None,
        metrics: BrokerMetrics | None = None,
    ) -> None:
        protocol_version(protocol)
        if lease_log_linger_ms is not None and not lease_log_linger_ms >= 0:
            raise ValueError(f"lease_log_linger_ms must be >= 0, got {lease_log_linger_ms}")
        self.bus = bus
        self.topics = topics
        self.mqtt = MqttTopics(root)
        self.config = config or BrokerConfig()
        self.book = LeaseBook(self.config)
        self.fabric: FabricManager = fabric or NoIsolation()
        self._host, self._port = mqtt_host, mqtt_port
        self._username, self._password = mqtt_username, mqtt_password
        self._protocol = protocol
        self._client_id = client_id
        self._clock = clock
        self._lock = asyncio.Lock()
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._publishing: set[asyncio.Task[None]] = set()
        self._seq = 0
        self._sites: dict[str, PeerState] = {}
        self._offline_since: dict[str, float] = {}
        """Sites whose latest state is offline, and since when (clock): :meth:`_forget_sites`."""
        self._offer_trace: dict[str, Context] = {}
        self._tls = tls
        self._linger_ms = lease_log_linger_ms
        self.lending: Lending = lending or NoLending()
        self._inline_isolation = isinstance(self.fabric, NoIsolation)
        self._claiming: dict[_ClaimKey, tuple[str, asyncio.Task[None]]] = {}
        """Claims whose fabric isolation is in progress: key → (lease id, task)."""
        self._background: set[asyncio.Task[Any]] = set()
        """Partition removals, stale-partition cleanup and resent claims, awaited by :meth:`stop`."""
        self._deadlines: dict[str, float] = {}
        """Reclaim deadline of every lease in state reclaiming, for the tick's timer."""
        self.metrics = metrics if metrics is not None else BrokerMetrics()
        """This service's Prometheus metrics."""
        hooks = LendingHooks(self._scheduler_reclaim, self._to_hold, self._scheduler_lendable, self._republish_lease)
        self.lending.bind(hooks, self.metrics)
        if self.lending.enforced:  # nothing is offered before the scheduler holds it for lending
            self.book.set_lendable((), self._clock())
        self.tally = Tally(self.metrics)
        """Counts since start (see :meth:`stats`)."""
        self.metrics.lease_gauge(lambda: {(s.value,): n for s, n in self.tally.lease_counts().items()})
        self.metrics.site_up_gauge(
            lambda: {(site, ): 1.0 if st.online else 0.0 for site, st in dict(self._sites).items()}
        )
        self._limiter = SiteRateLimiter(self.config.site_request_rate_per_s, self.config.site_request_burst)
        self._unlogged: list[LeaseLogRecord] = []
        """Records that undo failed transitions (:meth:`LeaseBook.undo`), written before any
        other record until the lease log takes them."""
        self._producer_broken = False
        """A refused write left the producer unusable and no new one could start yet."""
        self._demand_retry: list[PoolDemand] = []
        """Demands to apply again with the next bus batch (:meth:`_retry_demands`)."""
        self._demands_seen: dict[str, PoolDemand] = {}
        """Demands read recently, by id (what :meth:`_retry_demands` re-applies)."""
        self._outbox: collections.deque[tuple[str, bytes, Any]] = collections.deque()
        """Replies that could not be sent (no connection, or it dropped): sent at the next
        connection, oldest first (at most :data:`_OUTBOX_MAX`)."""

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry this service's ``/metrics`` serves (its metrics only)."""
        return self.metrics.registry

    # lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Check that the topics exist, rebuild the lease book from ``leases.log`` (read to its end
        offsets, :func:`runtime.replay.read_to_end`), start the tick loop and
        the MQTT connection (retried with backoff in the background), then join the consumer group
        of capacity and demand. The tick (reclaim deadlines, TTLs) and MQTT (renewals, releases)
        do not wait for the group: after a crash the dead member holds it until its session times
        out (10 s), longer than what is left of a reclaim notice.

        Raises ``RuntimeError`` if already started, :class:`contracts.bus.MissingTopicsError` if
        a topic is missing (no stage creates topics: ``gpupool topics create``), ``TimeoutError``
        if the lease log cannot be read to its end within ``config.rebuild_timeout_s``, and the
        bus's connection errors.
        """
        if self._tasks:
            raise RuntimeError("BrokerService already started")
        log.info("broker_starting", extra={"fabric_enforced": self.fabric.enforced, "root": self.mqtt.root})
        if not self.fabric.enforced:
            log.warning("fabric_isolation_disabled", extra={"fabric": type(self.fabric).__name__})
        await require_topics(self.bus, [self.topics.capacity, self.topics.pool_demand, self.topics.leases_log])
        self._producer = self.bus.producer(client_id=self._client_id, linger_ms=self._linger_ms)
        await self._producer.start()
        try:
            await self._start_after_producer()
        except BaseException:
            producer, self._producer = self._producer, None
            await producer.stop()
            raise

    async def _start_after_producer(self) -> None:
        assert self._producer is not None
        records, rejected = await read_to_end(
            self.bus,
            self.topics.leases_log,
            LeaseLogRecord,
            group_prefix=f"{self.config.group_id}-rebuild",
            client_id=self._client_id,
            timeout_s=self.config.rebuild_timeout_s,
        )
        for _ in range(rejected):
            self.tally.reject("malformed_lease_log")
        async with self._lock:
            now = self._clock()
            await self._apply(self.book.rebuild(records, now), now)
            self.tally.rebuilt(self.book)
            self._deadlines = {
                r.lease_id: r.reclaim_deadline
                for r in self.book.live_leases()
                if r.state is LeaseState.RECLAIMING and r.reclaim_deadline is not None
            }
        log.info(
            "lease_book_rebuilt", extra={"records": len(records), "live_leases": len(self.book.live_leases())}
        )
        self._in_background(self._remove_stale_partitions(), "fabric-remove-stale")
        await self.lending.start(self.book.live_leases())
        self._tasks = [
            asyncio.create_task(self._mqtt_loop(), name="broker-mqtt"),
            asyncio.create_task(self._tick_loop(), name="broker-tick"),
        ]
        audit = getattr(self.fabric, "audit_forever", None)  # QoS drift audit (broker.fabric_opensm)
        if audit is not None:
            self._tasks.append(asyncio.create_task(audit(), name="broker-fabric-audit"))
        consumer = self.bus.consumer(
            [self.topics.capacity, self.topics.pool_demand],
            self.config.group_id,
            client_id=self._client_id,
            on_assign=self._capacity_from_start,
        )
        try:
            await consumer.start()
        except BaseException:
            tasks, self._tasks = self._tasks, []
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        self._consumer = consumer
        self._tasks.append(asyncio.create_task(self._bus_loop(), name="broker-bus"))

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set (call :meth:`start` first, :meth:`stop` after).

        Raises ``RuntimeError`` if not started, or if a service loop ended on its own (a bug:
        loops log and survive every error of a message, batch or connection).
        """
        if not self._tasks:
            raise RuntimeError("BrokerService not started")
        waiter = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait({waiter, *self._tasks}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        for t in done:
            if t is not waiter:
                raise RuntimeError(f"broker loop {t.get_name()} ended") from (
                    t.exception() if not t.cancelled() else None
                )

    async def stop(self) -> None:
        """Let claims whose isolation is in progress finish (granted or refused, and answered) and
        partition removals complete (each bounded by the fabric's verify timeout), withdraw the
        offers and say goodbye on ``broker/state`` (retained, offline) if connected, disconnect
        cleanly, stop consuming and flush the lease log; then log ``broker_stopped`` (JSON fields
        ``root``, ``offers_withdrawn``, ``live_leases``: leases still live, kept in the lease log
        for the next start). Idempotent (each call logs)."""
        withdrawn = 0
        while self._claiming or self._background:
            pending = [t for _, t in self._claiming.values()] + list(self._background)
            await asyncio.gather(*pending, return_exceptions=True)
        client = self._client
        if client is not None:
            try:
                async with self._lock:
                    for offer in list(self.book.offers.values()):
                        await client.publish(self.mqtt.offer(offer.offer_id), b"", qos=1, retain=True)
                        withdrawn += 1
                    await client.publish(self.mqtt.broker_state, self._peer_state(False), qos=1, retain=True)
            except aiomqtt.MqttError as e:
                log.warning("mqtt_goodbye_failed", extra={"error": str(e)})
        await self.lending.stop()
        # publishes still waiting for their PUBACK (each gives up after _PUBLISH_TIMEOUT_S)
        await asyncio.gather(*list(self._publishing), return_exceptions=True)
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()
        log.info(
            "broker_stopped",
            extra={
                "root": self.mqtt.root,
                "offers_withdrawn": withdrawn,
                "live_leases": len(self.book.live_leases()),
            },
        )

    async def wait_connected(self, timeout_s: float) -> None:
        """Wait until the broker is connected to MQTT and has republished its state.

        Raises ``TimeoutError`` after ``timeout_s`` seconds."""
        await asyncio.wait_for(self._connected.wait(), timeout_s)

    # status -------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A summary for logs and the demo (counts since start)::

        {"offers_published", "offers_withdrawn", "live_offers", "leases_granted", "live_leases",
         "leases_by_state": {state: n}, "reclaims_started", "reclaims_completed",
         "reclaims": {outcome: n}, "expired", "claims": {result: n},
         "rejections": {code: n} (claims), "rejected_messages": {reason: n} (everything),
         "demands": {result: n}, "capacity_records", "sites_online": [site],
         "partitions": ["<lease_id>: <partition>"] (newest grants), "mqtt_connected": bool}
        """
        return {
            **self.tally.snapshot(self.book),
            "sites_online": sorted(s for s, st in self._sites.items() if st.online),
            "mqtt_connected": self._connected.is_set(),
        }

    # bus offsets ------------------------------------------------------------------------------------------
    async def _capacity_from_start(self, assigned: set[TopicPartition]) -> dict[TopicPartition, int]:
        """Capacity is read whole from the beginning at every assignment: the book's view of
        each GPU is the newest update, which a restarted broker must see again."""
        return {tp: 0 for tp in assigned if tp.topic == self.topics.capacity}

    # applying changes -------------------------------------------------------------------------------
    async def _apply(
        self, ch: Changes, now: float, reply: Callable[[set[str]], None] | None = None
    ) -> set[str]:
        """Log lease transitions (flushed), then publish them, then ``reply`` (the answer to the
        site whose request made these changes: what it waits for goes out first), then the offer
        changes on MQTT. Partitions of leases that ended are removed in the background.

        Atomic per lease: a transition the lease log does not take (:meth:`_log`) is undone in
        the book (:meth:`LeaseBook.undo`) and never published; ``reply`` gets, and this returns,
        the ids of the leases undone (empty when everything was logged)."""
        self._count_outcomes(ch)
        undone: set[str] = set()
        if ch.records or self._unlogged:
            undone = await self._log(ch.records)
            if undone:
                restore, offers = self.book.undo(ch, undone, now)
                self._unlogged.extend(restore)
                for rec in restore:
                    if not rec.state.live:  # a grant undone: its hold goes
                        self.lending.ended(rec)
                    if not rec.state.live and not self._inline_isolation:  # and its partition
                        self._in_background(self._remove_partition(rec), f"fabric-remove-{rec.lease_id}")
                self.metrics.lease_log_write_failures.inc(len(undone))
                log.error("lease_transitions_undone", extra={"lease_ids": sorted(undone)})
                ch = Changes(
                    records=[r for r in ch.records if r.lease_id not in undone],
                    published=ch.published, withdrawn=ch.withdrawn, forgotten=ch.forgotten,
                ).extend(offers)  # fmt: skip
        traced = (
            publish_properties(self._protocol, user_properties=tracing.mqtt_user_properties())
            if ch.records
            else None
        )
        for rec in ch.records:
            self._count_transition(rec)
            self._publish(
                self.mqtt.lease(rec.site, rec.lease_id),
                encode(lease_message(rec, self.lending.endpoint(rec.lease_id))),
                retain=True,
                properties=traced,
            )
            if rec.state is LeaseState.RECLAIMING and rec.reclaim_deadline is not None:
                self._deadlines[rec.lease_id] = rec.reclaim_deadline
                self.lending.reclaiming(rec)
            elif not rec.state.live:
                self._deadlines.pop(rec.lease_id, None)
                self.lending.ended(rec)
                if not self._inline_isolation:
                    self._in_background(self._remove_partition(rec), f"fabric-remove-{rec.lease_id}")
        if reply is not None:
            reply(undone)
        # an offer made and withdrawn within one change set was never seen by anyone: skip both
        born = {o.offer_id for o in ch.published}
        died = {o.offer_id for o in ch.withdrawn}
        for offer in ch.withdrawn:
            self._offer_trace.pop(offer.offer_id, None)
            if offer.offer_id in born:
                continue
            self.tally.offer_withdrawn()
            self._publish(self.mqtt.offer(offer.offer_id), b"", retain=True)
        for offer in ch.published:
            if offer.offer_id in died:
                continue
            self.tally.offer_published()
            self._publish_offer(offer, now)
        for rec in ch.forgotten:
            self.tally.forgotten(rec)
            self._publish(self.mqtt.lease(rec.site, rec.lease_id), b"", retain=True)
        return undone

    def _count_outcomes(self, ch: Changes) -> None:
        """Count what the book decided in ``ch``: claim decisions, match placements, broken and
        deferred guarantees, leases at risk and window promises cut."""
        for d in ch.decisions:
            self.metrics.claim_decisions.labels(site=d.site, kind=d.kind, result=d.result).inc()
        for tier in ch.placements:
            self.metrics.match_placements.labels(tier=tier).inc()
        if ch.guarantees_broken:
            self.metrics.guarantees_broken.inc(ch.guarantees_broken)
        if ch.reclaims_deferred:
            self.metrics.reclaims_deferred.inc(ch.reclaims_deferred)
        if ch.at_risk:
            self.metrics.leases_at_risk.inc(ch.at_risk)
        if ch.windows_cut:
            self.metrics.windows_cut.inc(ch.windows_cut)

    async def _log(self, records: Sequence[LeaseLogRecord]) -> set[str]:
        """Write the pending undo records, then ``records``, to the lease log and wait until they
        are acknowledged (at most ``lease_log_timeout_s``). Returns the lease ids of ``records``
        that were not taken: all of them when the log timed out, else (several records, one
        refused, e.g. too large) only those refused again when written one by one. Undo records
        not taken stay pending; those taken are published. Never raises."""
        assert self._producer is not None
        pending = [*self._unlogged, *records]
        if self._producer_broken:
            await self._reset_producer()
        try:
            await self._write(pending)
        except Exception as e:  # noqa: BLE001 — refused, too large, unreachable, not encodable
            log.error("lease_log_write_failed", extra={"records": len(pending), "error": repr(e)[:300]})
            if not isinstance(e, TimeoutError):
                await self._reset_producer()
            if isinstance(e, TimeoutError):
                failed = pending
            else:
                failed = []
                for rec in pending:
                    # twice: the first attempt may only raise the delivery error of an earlier
                    # record (the producer reports it at the next send)
                    for attempt in (1, 2):
                        try:
                            await self._write([rec])
                            break
                        except Exception:  # noqa: BLE001 — this record alone is refused
                            await self._reset_producer()
                            if attempt == 2:
                                failed.append(rec)
        else:
            failed = []
        failed_ids = {id(r) for r in failed}
        written_undo = [r for r in self._unlogged if id(r) not in failed_ids]
        self._unlogged = [r for r in self._unlogged if id(r) in failed_ids]
        if written_undo:
            self.metrics.records_produced.labels(topic=self.topics.leases_log).inc(len(written_undo))
        for rec in written_undo:
            if rec.reason != LeaseReason.LOG_WRITE_FAILED:
                self._publish(self.mqtt.lease(rec.site, rec.lease_id), encode(lease_message(rec, self.lending.endpoint(rec.lease_id))), retain=True)
        taken = len(records) - sum(1 for r in records if id(r) in failed_ids)
        if taken:
            self.metrics.records_produced.labels(topic=self.topics.leases_log).inc(taken)
        return {r.lease_id for r in records if id(r) in failed_ids}

    async def _reset_producer(self) -> None:
        """Replace the lease-log producer after a refused write: an idempotent Kafka producer
        whose batch was refused (e.g. too large) has a gap in its sequence numbers and every later
        batch of it fails (``OutOfOrderSequenceNumber``). The old one is stopped in the
        background; if no new one starts (within ``lease_log_timeout_s``) the old one is kept and
        the next write tries again. Never raises."""
        fresh = self.bus.producer(client_id=self._client_id, linger_ms=self._linger_ms)
        try:
            async with asyncio.timeout(self.config.lease_log_timeout_s):
                await fresh.start()
        except Exception as e:  # noqa: BLE001 — e.g. Kafka unreachable: keep the old one for now
            self._producer_broken = True
            log.warning("lease_log_producer_reset_failed", extra={"error": repr(e)[:300]})
            self._in_background(_stop_quietly(fresh), "lease-log-producer-stop")
            return
        old, self._producer, self._producer_broken = self._producer, fresh, False
        if old is not None:
            self._in_background(_stop_quietly(old), "lease-log-producer-stop")

    async def _write(self, records: Sequence[LeaseLogRecord]) -> None:
        """Send ``records`` and flush, within ``lease_log_timeout_s``; raises what failed."""
        assert self._producer is not None
        headers = tracing.inject_headers()
        async with asyncio.timeout(self.config.lease_log_timeout_s):
            for rec in records:
                await self._producer.send(self.topics.leases_log, encode(rec), key=rec.lease_id, headers=headers)
            await self._producer.flush()

    def _count_transition(self, rec: LeaseLogRecord) -> None:
        self.tally.transition(rec)
        log.info(
            "lease_transition",
            extra={
                "lease_id": rec.lease_id,
                "site": rec.site,
                "state": rec.state.value,
                "reason": rec.reason,
                "seq": rec.seq,
                "gpus": len(rec.gpus),
            },
        )

    async def _remove_partition(self, rec: LeaseLogRecord) -> None:
        """Take ``rec``'s partition off the fabric (outside the service lock); never raises."""
        try:
            await self.fabric.remove(rec)
        except FabricError as e:
            log.error("fabric_remove_failed", extra={"lease_id": rec.lease_id, "error": str(e)})
        except Exception:  # noqa: BLE001 — a broken manager must not take the broker down
            log.exception("fabric_remove_error", extra={"lease_id": rec.lease_id})

    async def _remove_stale_partitions(self) -> None:
        """After the rebuild: remove the partitions of leases that ended while no broker ran (or
        were never granted), keeping those of live leases and of claims being isolated now.
        Runs in the background; never raises (a failure is logged and counted; the next start
        tries again)."""
        keep = {r.lease_id for r in self.book.live_leases()} | {lid for lid, _ in self._claiming.values()}
        try:
            removed = await self.fabric.remove_stale(keep)
        except FabricError as e:  # counted per partition in gpupool_broker_fabric_verify_failures_total
            log.error("fabric_remove_stale_failed", extra={"error": str(e), "kept": len(keep)})
            return
        except Exception:  # noqa: BLE001 — a broken manager must not take the broker down
            log.exception("fabric_remove_stale_error")
            return
        self.metrics.fabric_stale_removed.inc(len(removed))
        if removed:
            log.info("fabric_stale_partitions_removed", extra={"lease_ids": removed, "kept": len(keep)})

    def _in_background(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``coro`` as a task that :meth:`stop` waits for; returns the task."""
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _publish_offer(self, offer: Offer, now: float) -> None:
        topic = self.mqtt.offer(offer.offer_id)
        with self._offer_span(offer, topic) as span:
            props = publish_properties(
                self._protocol,
                expiry_s=max(1.0, offer.expires_at - now),
                user_properties=tracing.mqtt_user_properties(span) if span is not None else (),
            )
            self._publish(topic, encode(offer), retain=True, properties=props)

    @contextlib.contextmanager
    def _offer_span(self, offer: Offer, topic: str) -> Iterator[trace.Span | None]:
        """A ``publish <root>/offers/{offer_id}`` span (PRODUCER) when the offer came from a traced
        capacity record, else nothing (``None``): untraced offers start no trace of their own."""
        parent = self._offer_trace.get(offer.offer_id)
        if parent is None:
            yield None
            return
        attrs = tracing.mqtt_publish_attributes(
            topic, template=self.mqtt.offer("{offer_id}"), message_id=offer.offer_id, client_id=self._client_id
        )
        attrs.update({"host.name": offer.host, "gpupool.offer.gpus": [g.gpu for g in offer.gpus]})
        with _TRACER.start_as_current_span(
            f"publish {self.mqtt.offer('{offer_id}')}", context=parent, kind=tracing.SpanKind.PRODUCER,
            attributes=attrs,
        ) as span:
            yield span

    def _publish(self, topic: str, payload: bytes, *, retain: bool, properties: Any = None) -> bool:
        """QoS 1 publish, sent in call order without waiting here for its PUBACK: the book's lock
        is not held across MQTT round trips, so a claim's offer changes, lease message and reply
        go out back to back (awaiting each PUBACK in turn made a claim cost four round trips).
        ``False`` if not connected. A publish that fails is sent again on the same connection (at
        most :data:`_PUBLISH_ATTEMPTS` times); past that, or without a connection, a retained one is
        left to the reconnect resync (which republishes every offer and lease the book holds and
        clears what it does not) and a reply waits in the outbox for the next connection."""
        client = self._client
        if client is None:
            self._undelivered(topic, payload, retain, properties)
            return False
        # tasks take their first step in creation order, and that step hands the packet to paho
        task = asyncio.create_task(self._publish_now(client, topic, payload, retain, properties))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)
        return True

    async def _publish_now(
        self, client: aiomqtt.Client, topic: str, payload: bytes, retain: bool, properties: Any
    ) -> None:
        for attempt in range(1, _PUBLISH_ATTEMPTS + 1):
            try:
                await client.publish(
                    topic, payload, qos=1, retain=retain, properties=properties, timeout=_PUBLISH_TIMEOUT_S
                )
                return
            except aiomqtt.MqttError as e:
                log.warning("mqtt_publish_failed", extra={"topic": topic, "error": str(e), "attempt": attempt})
                if client is not self._client or attempt == _PUBLISH_ATTEMPTS:
                    break
                self.metrics.mqtt_publish_failures.labels(outcome="retried").inc()
                await asyncio.sleep(0.05 * attempt)
        self._undelivered(topic, payload, retain, properties)

    def _undelivered(self, topic: str, payload: bytes, retain: bool, properties: Any) -> None:
        """A publish that could not be delivered: retained state is republished by the resync of
        the next connection; a reply is kept in the outbox for it (the oldest dropped, counted,
        past :data:`_OUTBOX_MAX`)."""
        if retain:
            self.metrics.mqtt_publish_failures.labels(outcome="resync").inc()
            return
        if len(self._outbox) >= _OUTBOX_MAX:
            self._outbox.popleft()
            self.metrics.mqtt_publish_failures.labels(outcome="dropped").inc()
        self._outbox.append((topic, payload, properties))
        self.metrics.mqtt_publish_failures.labels(outcome="queued").inc()

    def _peer_state(self, online: bool) -> bytes:
        return encode(PeerState(peer=self._client_id, online=online, seq=self._seq, ts=self._clock()))

    # MQTT -------------------------------------------------------------------------------------------------
    async def _mqtt_loop(self) -> None:
        """Connect, serve, and reconnect with backoff — forever (:func:`broker.transport.serve_mqtt`):
        every error of a connection, a message or a resync ends only that connection (the resync
        is bounded by :data:`_CONNECT_STEP_TIMEOUT_S`)."""

        def connect() -> aiomqtt.Client:
            self._seq = birth_seq()
            client = make_client(
                self._host,
                self._port,
                username=self._username,
                password=self._password,
                identifier=self._client_id,
                protocol=self._protocol,
                state_topic=self.mqtt.broker_state,
                peer=self._client_id,
                seq=self._seq,
                persistent=True,
                tls=self._tls,
            )
            client.pending_calls_threshold = _PENDING_PUBLISHES_WARN
            return client

        async def on_connect(client: aiomqtt.Client) -> None:
            self.metrics.mqtt_connections.labels(result="connected").inc()
            self._client = client
            async with asyncio.timeout(_CONNECT_STEP_TIMEOUT_S):
                await self._on_connect(client)

        def on_error(e: Exception, connected: bool) -> bool:
            self.metrics.mqtt_connections.labels(result="lost" if connected else "failed").inc()
            where = {"host": self._host, "port": self._port}
            if isinstance(e, aiomqtt.MqttError):
                log.warning("mqtt_disconnected", extra={**where, "error": str(e)})
            else:  # e.g. a resync step timing out: reconnect, never die
                log.error("mqtt_loop_error", exc_info=e, extra=where)
            return False

        def on_disconnect() -> None:
            self._client = None
            self._connected.clear()

        backoff = Backoff(self.config.reconnect_min_s, self.config.reconnect_max_s)
        await serve_mqtt(connect, on_connect, self._on_message, on_error, on_disconnect, backoff)

    async def _on_connect(self, client: aiomqtt.Client) -> None:
        """Birth, subscriptions, then republish every offer and lease (resync after an outage)."""
        await client.publish(self.mqtt.broker_state, self._peer_state(True), qos=1, retain=True)
        inbound = [*self.mqtt.site_inbound_filters, self.mqtt.broker_state]
        own = [self.mqtt.offers_filter, f"{self.mqtt.root}/sites/+/leases/+"]
        # retain as published: a request a site publishes retained is recognised (and ignored)
        # also when it arrives live, not only when replayed at a (re)subscription
        await client.subscribe(subscriptions(self._protocol, inbound, retain_as_published=True))
        await client.subscribe(subscriptions(self._protocol, own, no_local=True))
        async with self._lock:
            now = self._clock()
            for offer in list(self.book.offers.values()):
                with self._resync_step("offer", offer.offer_id):
                    self._publish_offer(offer, now)
            for rec in list(self.book.leases.values()):
                with self._resync_step("lease", rec.lease_id):
                    self._publish(
                        self.mqtt.lease(rec.site, rec.lease_id), encode(lease_message(rec, self.lending.endpoint(rec.lease_id))), retain=True
                    )
            outbox, self._outbox = list(self._outbox), collections.deque()
            for topic, payload, props in outbox:
                self._publish(topic, payload, retain=False, properties=props)
        self._connected.set()
        log.info("mqtt_connected", extra={"host": self._host, "port": self._port, "seq": self._seq})

    @contextlib.contextmanager
    def _resync_step(self, what: str, ident: str) -> Iterator[None]:
        """One item of the resync: an error is logged and counted and the resync goes on (one
        item that cannot be published must not keep every other one, and the connection, down)."""
        try:
            yield
        except Exception:  # noqa: BLE001 — see the docstring
            self.tally.reject(f"resync_{what}_failed")
            log.exception("resync_item_failed", extra={"what": what, "id": ident})

    async def _on_message(self, msg: aiomqtt.Message) -> None:
        """Dispatch one MQTT message; never raises (errors are logged and counted)."""
        topic = msg.topic.value
        payload = payload_bytes(msg.payload)
        try:
            if topic == self.mqtt.broker_state:
                await self._on_own_state(payload)
                return
            site_kind = self.mqtt.parse_site(topic)
            if site_kind is None:
                await self._on_own_retained(topic, payload, msg.retain)
                return
            site, kind = site_kind
            request = _REQUESTS.get(kind)
            if request is not None and not self._admit(site, topic, request, payload, msg.retain, msg):
                return
            if kind == "claims":
                await self._on_claim(site, payload, response_route(msg), user_properties(msg))
            elif kind == "renewals":
                await self._on_lease_request(site, payload, response_route(msg), Renewal)
            elif kind == "releases":
                await self._on_lease_request(site, payload, response_route(msg), Release)
            elif kind == "state":
                self._on_site_state(site, payload)
        except Exception:  # noqa: BLE001 — one bad message must not stop the broker
            self.tally.reject(ReasonCode.INTERNAL.value)
            log.exception("mqtt_message_failed", extra={"topic": topic})
            site_kind = self.mqtt.parse_site(topic)
            if site_kind is not None and site_kind[1] in _REQUESTS:
                request = _REQUESTS[site_kind[1]]
                in_reply_to = peek_id(payload, "claim_id" if request == "claim" else "lease_id")
                self._reply(
                    site_kind[0], in_reply_to, Malformed(ReasonCode.INTERNAL, "internal error; retry"),
                    response_route(msg), request,
                )  # fmt: skip

    def _admit(
        self, site: str, topic: str, request: str, payload: bytes, retain: bool, msg: aiomqtt.Message
    ) -> bool:
        """Whether a site request may go on: a retained one is ignored (counted ``retained``) and
        cleared — it would be acted on again at every broker (re)start; one past the site's rate
        limit is answered ``rate_limited``."""
        if retain:
            if payload:
                self.metrics.ignored_requests.labels(reason="retained").inc()
                self.tally.reject("retained")
                log.warning("retained_request_ignored", extra={"site": site, "topic": topic})
                self._publish(topic, b"", retain=True)
            return False
        if self._limiter.allow(site, time.monotonic()):
            return True
        self.metrics.rate_limited.labels(site=site).inc()
        self.tally.reject(ReasonCode.RATE_LIMITED.value)
        in_reply_to = peek_id(payload, "claim_id" if request == "claim" else "lease_id")
        self._reply(
            site, in_reply_to,
            Malformed(ReasonCode.RATE_LIMITED, f"more than {self._limiter.rate:g} requests/s "
                      f"(burst {self._limiter.burst:g}); retry later"),
            response_route(msg), request,
        )  # fmt: skip
        return False

    async def _on_own_retained(self, topic: str, payload: bytes, retain: bool) -> None:
        """A retained offer or lease message on the server that the book does not know (left by an
        earlier incarnation) is cleared."""
        if not retain or not payload:
            return
        offers_prefix = f"{self.mqtt.root}/offers/"
        sites_prefix = f"{self.mqtt.root}/sites/"
        if topic.startswith(offers_prefix):
            known = topic[len(offers_prefix) :] in self.book.offers
        elif topic.startswith(sites_prefix):
            parts = topic[len(sites_prefix) :].split("/")
            if len(parts) != 3 or parts[1] != "leases":
                return
            known = parts[2] in self.book.leases
        else:
            return
        if not known:
            log.info("stale_retained_cleared", extra={"topic": topic})
            self._publish(topic, b"", retain=True)

    async def _on_own_state(self, payload: bytes) -> None:
        """A Last Will of an earlier session of this broker that reached the server after the current
        birth would leave ``broker/state`` saying offline: publish the birth again."""
        if not payload:
            return
        try:
            st = decode_compatible(PeerState, payload)
        except ValueError:
            self.tally.reject("malformed_state")
            return
        if not st.online and st.seq < self._seq and self._client is not None:
            log.info("stale_death_replaced", extra={"seq": st.seq, "current_seq": self._seq})
            self._publish(self.mqtt.broker_state, self._peer_state(True), retain=True)

    def _on_site_state(self, site: str, payload: bytes) -> None:
        """Remember a site's retained birth/Last Will (``PeerState``) and export it as
        ``gpupool_broker_site_up{site}`` (1 online, 0 offline); an empty retained payload forgets
        the site and removes its series. A malformed state is counted, a late Last Will of an
        older session (lower ``seq``) ignored."""
        if not payload:
            self._sites.pop(site, None)
            self._offline_since.pop(site, None)
            return
        try:
            st = decode_compatible(PeerState, payload)
        except ValueError:
            self.tally.reject("malformed_state")
            return
        cur = self._sites.get(site)
        if cur is not None and st.seq < cur.seq:
            return  # a late Last Will of an older session
        self._sites[site] = st
        if st.online:
            self._offline_since.pop(site, None)
        else:
            self._offline_since.setdefault(site, self._clock())
        log.info("site_state", extra={"site": site, "online": st.online, "seq": st.seq})

    def _reply(
        self,
        site: str,
        in_reply_to: str,
        answer: Answer | Malformed,
        route: tuple[str | None, bytes | None],
        request: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Publish the :class:`contracts.Reply` to a site's ``request`` (``claim``, ``renewal``,
        ``release``; see the module docstring); an ``ok`` answer about a live lease carries its
        ``expires_at`` and the lease TTL."""
        lease_id = answer.lease_id if isinstance(answer, Answer) else None
        rid = request_id if request_id is not None else getattr(answer, "request_id", None)
        expires_at = ttl = None
        rec = self.book.leases.get(lease_id) if lease_id is not None and answer.code is ReasonCode.OK else None
        if rec is not None and rec.state.live:
            expires_at, ttl = rec.expires_at, self.config.lease_ttl_s
        msg = Reply(
            in_reply_to=in_reply_to,
            site=site,
            code=answer.code,
            text=answer.text,
            lease_id=lease_id,
            ts=self._clock(),
            request=request,
            request_id=rid,
            expires_at=expires_at,
            ttl_seconds=ttl,
        )
        # a request without request_id may come from an edge site of the first release, whose
        # reader refuses unknown fields: it gets the reply fields that release knew
        reply = encode(msg) if rid is not None else msg.model_dump_json(exclude=set(REPLY_ADDED_FIELDS)).encode()
        response_topic, corr = route
        props = publish_properties(
            self._protocol, correlation=corr, user_properties=tracing.mqtt_user_properties()
        )
        replies = self.mqtt.replies(site)
        self._publish(replies, reply, retain=False, properties=props)
        own_subtree = f"{self.mqtt.root}/sites/{site}/"
        if response_topic and response_topic != replies and response_topic.startswith(own_subtree):
            self._publish(response_topic, reply, retain=False, properties=props)

    def _malformed(
        self, site: str, request: str, bad: Malformed, route: tuple[str | None, bytes | None]
    ) -> None:
        """Answer, count (``gpupool_broker_malformed_messages_total``) and log a refused message."""
        self.metrics.malformed_messages.labels(request=request, check=bad.check or "schema").inc()
        log.info(
            "request_malformed",
            extra={"site": site, "request": request, "code": bad.code.value, "check": bad.check,
                   "text": bad.text},
        )  # fmt: skip
        self._reply(site, bad.in_reply_to, bad, route, request, bad.request_id)

    def _stale(self, ts: float) -> bool:
        """True (counted as ``stale``) if a request sent at ``ts`` is older than
        ``request_max_age_s``: it is then ignored."""
        if self._clock() - ts <= self.config.request_max_age_s:
            return False
        self.metrics.ignored_requests.labels(reason="stale").inc()
        self.tally.reject("stale")
        return True

    async def _on_claim(
        self,
        site: str,
        payload: bytes,
        route: tuple[str | None, bytes | None],
        props: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Handle a claim inside a ``process <root>/sites/{site}/claims`` span (CONSUMER), child of
        the trace context in the claim's MQTT 5 user properties ``props`` when there is one. A
        claim whose fabric isolation runs in the background ends its span there."""
        topic = self.mqtt.claims(site)
        attrs = tracing.messaging_attributes(
            tracing.MQTT, "process", topic, template=self.mqtt.claims("{site}"), client_id=self._client_id
        )
        span = _TRACER.start_span(
            f"process {self.mqtt.claims('{site}')}",
            context=tracing.extract_mqtt_context(props),
            kind=tracing.SpanKind.CONSUMER,
            attributes=attrs,
        )
        try:
            with trace.use_span(span, end_on_exit=False):
                code = await self._handle_claim(site, payload, route, span, time.perf_counter())
        except BaseException:
            span.end()
            raise
        if code is not None:
            _end_claim_span(span, code)

    async def _handle_claim(
        self,
        site: str,
        payload: bytes,
        route: tuple[str | None, bytes | None],
        span: trace.Span,
        t0: float,
    ) -> ReasonCode | None:
        """Validate one claim and reserve its GPUs under the lock. Without fabric isolation the
        lease is granted in the same step; with it, isolation runs in a background task without
        the lock (other claims, renewals and ticks go on meanwhile) and that task grants or
        aborts and replies. Returns the reply's code, or ``None`` when a task took the claim over
        (it then ends ``span``). ``t0``: the claim's arrival (``time.perf_counter``)."""
        claim = parse_site_message(Claim, payload, "claim_id", CLAIM_COMMAND_FIELDS)
        if isinstance(claim, Malformed):
            self._malformed(site, "claim", claim, route)
            self.tally.claim(claim.code)
            return claim.code
        if self._stale(claim.ts):
            return None
        if span.is_recording():
            span.set_attribute("messaging.message.id", claim.claim_id)
            if claim.offer_id is not None:
                span.set_attribute("gpupool.offer.id", claim.offer_id)
        key = (site, claim.claim_id)
        busy = self._claiming.get(key)
        if busy is not None:
            # the same claim again (a site resends after a reconnect) while its first copy is
            # being isolated: answer it like a repeat once the first copy is decided
            self._in_background(self._claim_again(busy[1], site, payload, route, span, t0), "claim-again")
            return None
        async with self._lock:
            now = self._clock()
            step, ch = self.book.begin_claim(site, claim, now)
            if isinstance(step, PendingGrant) and not self._inline_isolation:
                task = self._in_background(
                    self._isolate_claim(step, route, span, t0, claim.request_id), "claim-isolate"
                )
                self._claiming[key] = (step.record.lease_id, task)
                await self._apply(ch, now)  # the claimed offer withdrawn, the node's rest offered
                return None
            if isinstance(step, PendingGrant) and (problem := await self.lending.hold(step.record)):
                step, refused = self.book.abort(step, ReasonCode.ISOLATION_FAILED, problem, now)
                ch.extend(refused)  # the training scheduler holds nothing for it (in memory: fast)
            if isinstance(step, PendingGrant):
                with _grant_span(step) as grant:
                    answer, ch2 = self.book.grant(step, now, None)
                    ch.extend(ch2)
                    undone = await self._apply(
                        ch, now, reply=lambda u: self._reply(site, claim.claim_id, _unless_undone(answer, u),
                                                             route, "claim", claim.request_id),
                    )  # fmt: skip
                    answer = _unless_undone(answer, undone)
                    if not answer.ok:
                        tracing.mark_error(grant, answer.code.value, answer.text)
            else:
                answer = step
                rec = self.book.leases.get(answer.lease_id or "")
                if answer.replayed and rec is not None:
                    self._publish(self.mqtt.lease(site, rec.lease_id), encode(lease_message(rec, self.lending.endpoint(rec.lease_id))), retain=True)
                await self._apply(
                    ch, now, reply=lambda _: self._reply(site, claim.claim_id, answer, route, "claim", claim.request_id)
                )  # fmt: skip
        self._claim_answered(site, claim.claim_id, answer, t0)
        return answer.code

    async def _claim_again(
        self,
        first: asyncio.Task[None],
        site: str,
        payload: bytes,
        route: tuple[str | None, bytes | None],
        span: trace.Span,
        t0: float,
    ) -> None:
        """Answer a repeated claim after its first copy (``first``) is decided; ends ``span``
        unless it is handed on again. Never raises (as :meth:`_on_message`)."""
        await asyncio.wait({first})
        try:
            with trace.use_span(span, end_on_exit=False):
                code = await self._handle_claim(site, payload, route, span, t0)
        except Exception:  # noqa: BLE001 — as _on_message: count, log, carry on
            self.tally.reject(ReasonCode.INTERNAL.value)
            log.exception("claim_failed", extra={"site": site})
            span.end()
            return
        if code is not None:
            _end_claim_span(span, code)

    async def _isolate_claim(
        self,
        pending: PendingGrant,
        route: tuple[str | None, bytes | None],
        span: trace.Span,
        t0: float,
        request_id: str | None = None,
    ) -> None:
        """Isolate a reserved claim on the fabric without the service lock, then grant it (or
        abort with ``isolation_failed``) under the lock, reply, and end ``span``. Never raises:
        an error is logged and counted like one of :meth:`_on_message`."""
        key = (pending.site, pending.claim_id)
        code = ReasonCode.INTERNAL
        try:
            with trace.use_span(span, end_on_exit=False), _grant_span(pending) as grant:
                partition, problem = await self._isolate(pending)
                async with self._lock:
                    now = self._clock()
                    if problem:
                        answer, ch = self.book.abort(pending, ReasonCode.ISOLATION_FAILED, problem, now)
                    else:
                        answer, ch = self.book.grant(pending, now, partition)
                    undone = await self._apply(
                        ch, now, reply=lambda u: self._reply(pending.site, pending.claim_id,
                                                             _unless_undone(answer, u), route, "claim",
                                                             request_id)
                    )  # fmt: skip
                    answer = _unless_undone(answer, undone)
                if not answer.ok:
                    tracing.mark_error(grant, answer.code.value, answer.text)
            self._claim_answered(pending.site, pending.claim_id, answer, t0)
            code = answer.code
        except Exception:  # noqa: BLE001 — a bug: count, log, and still answer the site
            self.tally.reject(ReasonCode.INTERNAL.value)
            log.exception("claim_failed", extra={"site": pending.site, "claim_id": pending.claim_id})
            self._reply(
                pending.site, pending.claim_id, Malformed(ReasonCode.INTERNAL, "internal error; retry"), route,
                "claim", request_id,
            )  # fmt: skip
        finally:
            self._claiming.pop(key, None)
            _end_claim_span(span, code)

    async def _isolate(self, pending: PendingGrant) -> tuple[Partition | None, str]:
        """Ask the fabric manager to isolate a reserved claim: ``(partition, "")`` when it may be
        granted, else ``(None, why not)``; a partition made but not verified is removed again
        (in the background)."""
        partition = None
        try:
            partition = await self.fabric.isolate(pending.record)
            problem = isolation_problem(self.fabric, partition) or await self.lending.hold(
                pending.record.model_copy(update={"partition": partition})
            )  # the hold sees the partition: the lease's workload runs inside it
        except FabricError as e:
            problem = str(e) or "fabric isolation failed"
        except Exception as e:  # noqa: BLE001 — a broken manager must not leave the GPUs reserved
            log.exception("fabric_isolate_error", extra={"claim_id": pending.claim_id})
            problem = f"fabric manager error: {e!r}"
        if not problem:
            return partition, ""
        if partition is not None:
            rec = pending.record.model_copy(update={"partition": partition})
            self._in_background(self._remove_partition(rec), f"fabric-remove-{rec.lease_id}")
        log.warning(
            "isolation_failed", extra={"claim_id": pending.claim_id, "site": pending.site, "error": problem}
        )
        return None, problem

    def _claim_answered(self, site: str, claim_id: str, answer: Answer, t0: float) -> None:
        """Count and log a claim's answer; a fresh grant observes the claim → lease latency."""
        self.tally.claim(answer.code)
        if not answer.ok:
            log.info(
                "claim_rejected",
                extra={"site": site, "claim_id": claim_id, "code": answer.code.value, "text": answer.text},
            )
        elif not answer.replayed:
            self.metrics.claim_to_lease.observe(time.perf_counter() - t0)

    async def _on_lease_request(
        self,
        site: str,
        payload: bytes,
        route: tuple[str | None, bytes | None],
        model: type[Renewal] | type[Release],
    ) -> None:
        kind = "renewal" if model is Renewal else "release"
        req = parse_site_message(model, payload, "lease_id")
        if isinstance(req, Malformed):
            self._malformed(site, kind, req, route)
            self.tally.reject(req.code.value)
            return
        if self._stale(req.ts):
            return
        async with self._lock:
            now = self._clock()
            if isinstance(req, Renewal):
                answer, ch = self.book.renew(site, req, now)
            else:
                answer, ch = self.book.release(site, req, now)
            undone = await self._apply(
                ch, now, reply=lambda u: self._reply(site, req.lease_id, _unless_undone(answer, u), route, kind,
                                                     req.request_id),
            )  # fmt: skip
            answer = _unless_undone(answer, undone)
        if not answer.ok:
            self.tally.reject(answer.code.value)

    # bus --------------------------------------------------------------------------------------------------
    async def _bus_loop(self) -> None:
        assert self._consumer is not None
        backoff = Backoff(self.config.reconnect_min_s, self.config.reconnect_max_s)
        while True:
            try:
                batch = await self._consumer.getmany(timeout_s=1.0, max_records=1000)
                if batch or self._demand_retry:
                    async with self._lock:
                        now = self._clock()
                        ch = Changes()
                        for demand in self._demand_retry:  # demands whose reclaim the log refused
                            ch.extend(self.book.apply_demand(demand, now)[1])
                        self._demand_retry = []
                        for msg in batch:
                            try:
                                ch.extend(self._on_traced_record(msg, now))
                            except Exception as e:  # noqa: BLE001 — one record must not fail the batch
                                self._bad_record("record_failed", msg, e)
                        undone = await self._apply(ch, now)  # a transition the log refuses is undone alone
                        self._retry_demands(ch, undone)
                    if batch:
                        await self._consumer.commit()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 — a bus hiccup must not stop the broker
                log.exception("bus_batch_failed")
                await asyncio.sleep(backoff.next())

    def _retry_demands(self, ch: Changes, undone: set[str]) -> None:
        """Apply again, with the next batch, the demands whose reclaims were undone (the lease log
        refused them); the demand record itself is consumed and committed, so it would not come
        back. Each demand is retried while it is younger than ``demand_max_age_s``."""
        ids = {demand_of(r.reason) for r in ch.records if r.lease_id in undone} - {None}
        for demand_id in sorted(i for i in ids if i is not None):
            demand = self._demands_seen.get(demand_id)
            if demand is not None:
                self._demand_retry.append(demand)
        if len(self._demands_seen) > 10_000:
            self._demands_seen.clear()

    def _on_traced_record(self, msg: BusMessage, now: float) -> Changes:
        """:meth:`_on_record` inside a ``process <topic>`` span (CONSUMER) when the record carries a
        trace context (see the module docstring); the offers it publishes remember that span."""
        parent = tracing.extract_context(msg.headers) if msg.headers else None
        if parent is None:
            return self._on_record(msg, now)
        attrs = tracing.messaging_attributes(
            tracing.KAFKA,
            "process",
            msg.topic,
            key=msg.key,
            consumer_group=self.config.group_id,
            partition=msg.partition,
            offset=msg.offset,
        )
        with _TRACER.start_as_current_span(
            f"process {msg.topic}", context=parent, kind=tracing.SpanKind.CONSUMER, attributes=attrs
        ) as span:
            ch = self._on_record(msg, now)
            if ch.published:
                ctx = trace.set_span_in_context(trace.NonRecordingSpan(span.get_span_context()))
                for offer in ch.published:
                    self._offer_trace[offer.offer_id] = ctx
            return ch

    def _on_record(self, msg: BusMessage, now: float) -> Changes:
        self.metrics.records_consumed.labels(topic=msg.topic).inc()
        if msg.value is None:
            return Changes()
        if msg.topic == self.topics.capacity:
            try:
                update = decode_compatible(CapacityUpdate, msg.value)
            except ValueError as e:
                self._bad_record("malformed_capacity", msg, e)
                return Changes()
            self.tally.capacity()
            return self.book.apply_capacity(update, now)
        if msg.topic == self.topics.pool_demand:
            try:
                demand = decode_compatible(PoolDemand, msg.value)
            except ValueError as e:
                self._bad_record("malformed_demand", msg, e)
                return Changes()
            self._demands_seen[demand.demand_id] = demand
            result, ch = self.book.apply_demand(demand, now)
            self.tally.demand(result)
            log.info(
                "pool_demand",
                extra={"demand_id": demand.demand_id, "result": result, "leases": len(ch.records)},
            )
            return ch
        return Changes()

    def _bad_record(self, reason: str, msg: BusMessage, error: Exception) -> None:
        self.tally.reject(reason)
        log.warning(
            "bus_record_rejected",
            extra={
                "reason": reason,
                "topic": msg.topic,
                "partition": msg.partition,
                "offset": msg.offset,
                "error": str(error)[:300],
            },
        )

    # training scheduler (broker.lending) ---------------------------------------------------------------
    async def _scheduler_reclaim(self, lease_id: str, deadline: float, reason: str) -> None:
        """Reclaim a granted or active lease whose hold the training scheduler takes back, with
        the scheduler's deadline (Unix s; forced: the scheduler does not wait for guarantees)."""
        async with self._lock:
            rec = self.book.leases.get(lease_id)
            if rec is None or rec.state not in (LeaseState.GRANTED, LeaseState.ACTIVE):
                return
            now = self._clock()
            await self._apply(self.book.reclaim(now, rec.gpus, reason=reason, force=True, deadline=deadline), now)

    def _to_hold(self) -> list[str]:
        """GPU keys the book would offer if the scheduler held them (what placeholders hold)."""
        return self.book.to_hold_for_lending(self._clock())

    async def _scheduler_lendable(self, gpus: frozenset[str]) -> None:
        """The scheduler holds ``gpus`` for lending now: only they are offered."""
        async with self._lock:
            now = self._clock()
            await self._apply(self.book.set_lendable(gpus, now), now)

    def _republish_lease(self, lease_id: str) -> None:
        """Publish a live lease's message again (its workload's endpoint became known)."""
        rec = self.book.leases.get(lease_id)
        if rec is not None and rec.state.live:
            self._publish(
                self.mqtt.lease(rec.site, lease_id),
                encode(lease_message(rec, self.lending.endpoint(lease_id))),
                retain=True,
            )

    # time -------------------------------------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        failed = False
        while True:
            await asyncio.sleep(self.config.tick_s if failed else self._until_next_tick())
            failed = False
            try:
                await self._tick_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 — e.g. the lease log is briefly unreachable: try next tick
                failed = True
                log.exception("tick_failed")

    async def _tick_once(self) -> None:
        """One tick of the book under the lock (and the sites gone: :meth:`_forget_sites`), then
        (outside it) the GC upkeep of :func:`tune_gc`."""
        async with self._lock:
            now = self._clock()
            await self._apply(self.book.tick(now), now)
            self._forget_sites(now)
        _GC.run_due(time.monotonic())

    def _forget_sites(self, now: float) -> list[str]:
        """Forget every site offline for ``config.site_forget_after_s`` or more before ``now``
        that holds no live lease: drop its state and remove its ``site`` series (site up, claim
        decisions). Returns the sites forgotten."""
        if not self._offline_since:
            return []
        due = {s for s, t in self._offline_since.items() if now - t >= self.config.site_forget_after_s}
        if not due:
            return []
        due -= {r.site for r in self.book.live_leases()}
        for site in sorted(due):
            self._offline_since.pop(site, None)
            self._sites.pop(site, None)
            for kind in ("offer", "match"):
                for code in ReasonCode:
                    with contextlib.suppress(KeyError):
                        self.metrics.claim_decisions.remove(site, kind, code.value)
        if due:
            log.info("sites_forgotten", extra={"sites": sorted(due), "forget_after_s": self.config.site_forget_after_s})
        return sorted(due)

    def _until_next_tick(self) -> float:
        """Seconds to the next tick: ``tick_s``, or less when a reclaim deadline comes sooner, so
        a lease is revoked at its deadline (its GPUs back within the notice), not up to a tick
        after it. The deadlines are kept as transitions are applied (no scan of the book)."""
        soonest = min(self._deadlines.values(), default=math.inf)
        return min(self.config.tick_s, max(0.0, soonest - self._clock()))


async def _stop_quietly(producer: Producer) -> None:
    """Stop a replaced lease-log producer; its errors are logged, never raised."""
    try:
        await producer.stop()
    except Exception as e:  # noqa: BLE001 — it was replaced because it failed
        log.info("lease_log_producer_stopped_with_error", extra={"error": repr(e)[:300]})


@contextlib.contextmanager
def _grant_span(pending: PendingGrant) -> Iterator[trace.Span]:
    """The ``grant lease`` span around isolating and granting a reserved claim."""
    with _TRACER.start_as_current_span(
        "grant lease",
        attributes={
            "gpupool.lease.id": pending.record.lease_id,
            "gpupool.site": pending.site,
            "gpupool.lease.gpus": list(pending.record.gpus),
        },
    ) as span:
        yield span


def _end_claim_span(span: trace.Span, code: ReasonCode) -> None:
    """End a claim's ``process`` span, marked as an error unless ``code`` is ``ok``."""
    if code is not ReasonCode.OK:
        tracing.mark_error(span, code.value)
    span.end()
