"""The bus on Apache Kafka, through aiokafka (see :class:`contracts.bus.api.Bus`).

Producers are idempotent (``enable_idempotence=True``, ``acks="all"``), batch for 20 ms (or the
``linger_ms`` asked for: a latency path such as the broker's lease log uses 0-2 ms) and
compress with lz4 (gzip if the ``lz4`` package is missing). :meth:`KafkaBusProducer.send` does not
wait for the broker: it keeps the delivery future, and :meth:`KafkaBusProducer.flush` awaits every
one and raises the first delivery error.

Consumers use the range assignor (partition ``p`` of every subscribed topic with the same partition
count goes to the same member: a host's ``telemetry.gpu`` and ``telemetry.ib_port`` partitions
meet, :mod:`contracts.topics`; aiokafka's default, round robin, would split them whenever the member
count does not divide the partition count).
Consumers never auto-commit and start from the earliest record when their group has no committed
offset. :meth:`KafkaBusConsumer.commit` commits, per owned partition, the offset after the last
record :meth:`KafkaBusConsumer.getmany` returned. The ``on_assign`` callback runs inside aiokafka's
rebalance (a ``ConsumerRebalanceListener``), and the consumer seeks to the offsets it returns
before any record of those partitions is fetched.

Keys are UTF-8 strings on the bus and bytes on Kafka; the default partitioner of aiokafka and of
the Java client is murmur2 of the key bytes, the same as :func:`contracts.bus.api.partition_for`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, ConsumerRecord
from aiokafka import TopicPartition as _AioTopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.codec import has_lz4
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError, for_code

from contracts.bus.api import BusMessage, OnAssign, TopicPartition, check_linger

log = logging.getLogger(__name__)

COMPRESSION = "lz4" if has_lz4() else "gzip"
"""Producer compression codec: ``lz4`` when the ``lz4`` package imports, else ``gzip``."""

DEFAULT_LINGER_MS = 20.0
"""Producer batching delay when none is asked for, milliseconds (throughput over latency)."""

_MAX_BATCH_BYTES = 256 * 1024
"""Per-partition batch size (aiokafka's default is 16 KiB; telemetry bursts fill that at once).
Well under the broker's default ``message.max.bytes`` (1 MiB)."""


MAX_RECORD_BYTES = 32 * 1024 * 1024
"""Largest record a producer accepts, uncompressed (aiokafka's ``max_request_size`` checks the
serialised record before compression; its default, 1 MiB, refuses the ``fabric.topology`` snapshot
of a fabric of about 1,000 HCAs: 1.55 MB of JSON for 1,280 HCAs and 100 switches, 95 kB with lz4).
The broker's own limit (``message.max.bytes``, default 1 MiB) applies to the compressed batch."""


def _aio_tp(tp: TopicPartition) -> _AioTopicPartition:
    return _AioTopicPartition(tp.topic, tp.partition)


def _bus_tp(tp: _AioTopicPartition) -> TopicPartition:
    return TopicPartition(tp.topic, tp.partition)


def _to_message(r: ConsumerRecord) -> BusMessage:
    """A :class:`BusMessage` from an aiokafka record. A key that is not UTF-8 (written by some
    other producer) is decoded with U+FFFD replacements rather than dropping the record."""
    key = r.key.decode("utf-8", errors="replace") if r.key is not None else None
    headers = tuple((str(k), bytes(v) if v is not None else b"") for k, v in (r.headers or ()))
    return BusMessage(r.topic, r.partition, r.offset, key, r.value, headers, int(r.timestamp or 0))


class KafkaBus:
    """Factory of Kafka producers and consumers on one cluster.

    Args:
        bootstrap_servers: ``host:port[,host:port...]`` of the cluster's PLAINTEXT listeners.
        client_id: Kafka client id of the admin client (producers and consumers take their own).
        replication_factor: replicas of topics made by :meth:`create_topics` (1 on a single node).
    """

    def __init__(
        self, bootstrap_servers: str, client_id: str = "gpupool", *, replication_factor: int = 1
    ) -> None:
        if not bootstrap_servers:
            raise ValueError("bootstrap_servers is empty")
        self.bootstrap_servers = bootstrap_servers
        self.client_id = client_id
        self.replication_factor = replication_factor
        self._admin: AIOKafkaAdminClient | None = None

    def producer(self, client_id: str = "gpupool", *, linger_ms: float | None = None) -> KafkaBusProducer:
        """A new, not yet started, idempotent batching producer that lingers ``linger_ms``
        milliseconds to batch (``None``: :data:`DEFAULT_LINGER_MS`). Raises ``ValueError`` for a
        negative ``linger_ms``."""
        return KafkaBusProducer(self.bootstrap_servers, client_id, linger_ms=linger_ms)

    def consumer(
        self,
        topics: Sequence[str],
        group_id: str,
        *,
        client_id: str = "gpupool",
        on_assign: OnAssign | None = None,
    ) -> KafkaBusConsumer:
        """A new, not yet started, consumer of ``topics`` in consumer group ``group_id``.

        Raises ``ValueError`` if ``topics`` is empty or ``group_id`` is blank.
        """
        return KafkaBusConsumer(
            self.bootstrap_servers, topics, group_id, client_id=client_id, on_assign=on_assign
        )

    async def _admin_client(self) -> AIOKafkaAdminClient:
        if self._admin is None:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, client_id=self.client_id)
            try:
                await admin.start()
            except BaseException:
                await admin.close()
                raise
            self._admin = admin
        return self._admin

    async def create_topics(
        self, names: Sequence[str], partitions: int = 1, compacted: Sequence[str] = ()
    ) -> None:
        """Create those of ``names`` that do not exist, with ``partitions`` partitions each; the
        ones also in ``compacted`` get ``cleanup.policy=compact``. An existing topic is left as it
        is (its partition count is not changed).

        Raises ``ValueError`` if ``partitions`` < 1, ``aiokafka.errors.KafkaConnectionError`` if
        the cluster is unreachable, and the matching ``aiokafka.errors.KafkaError`` subclass for
        any per-topic error other than ``TOPIC_ALREADY_EXISTS`` (e.g. ``InvalidTopicError``).
        """
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        names = list(dict.fromkeys(names))
        if not names:
            return
        compact = set(compacted)
        admin = await self._admin_client()
        new = [
            NewTopic(
                n,
                num_partitions=partitions,
                replication_factor=self.replication_factor,
                topic_configs={"cleanup.policy": "compact"} if n in compact else {},
            )
            for n in names
        ]
        response = await admin.create_topics(new)
        for topic, code, *rest in response.topic_errors:
            if code == 0 or code == TopicAlreadyExistsError.errno:
                continue
            message = rest[0] if rest else ""
            raise for_code(code)(f"create topic {topic!r}: {message}")
        log.debug("kafka_topics_created", extra={"topics": names, "partitions": partitions})

    async def missing_topics(self, names: Sequence[str], settle_s: float = 3.0) -> list[str]:
        """Those of ``names`` the cluster does not list (Metadata requests for every topic through
        the admin client, which never auto-creates one, then closed), in order, without repeats.

        A topic created a moment ago can be missing from a broker's metadata for a little while
        (KRaft brokers apply the controller's metadata log asynchronously), so a topic is reported
        missing only if it is still not listed ``settle_s`` seconds after the first request.

        Raises ``aiokafka.errors.KafkaConnectionError`` if the cluster is unreachable.
        """
        admin = await self._admin_client()
        deadline = time.monotonic() + settle_s
        try:
            while True:
                existing = set(await admin.list_topics())
                missing = [n for n in dict.fromkeys(names) if n not in existing]
                if not missing or time.monotonic() >= deadline:
                    return missing
                await asyncio.sleep(0.2)
        finally:  # asked once, at a stage's start: no idle admin connection is kept for its life
            await self.close()

    async def close(self) -> None:
        """Close the admin client (producers and consumers are stopped by their owners)."""
        if self._admin is not None:
            admin, self._admin = self._admin, None
            await admin.close()


class KafkaBusProducer:
    """An aiokafka producer: idempotent, ``acks=all``, lz4, lingering ``linger_ms`` (default
    20 ms) to batch (see the module docstring).

    Args:
        bootstrap_servers: ``host:port[,...]``.
        client_id: Kafka client id.
        linger_ms: aiokafka's ``linger_ms``: how long a record may wait for others to join its
            batch, milliseconds; ``None``: :data:`DEFAULT_LINGER_MS`. A producer that flushes
            after every few records (a latency path) wants 0-2 ms.

    After a delivery error the aiokafka producer is replaced by a new one (a new producer id) once
    no record is in flight: aiokafka numbers a partition's batches for idempotence when it takes
    them off the queue, also those it then fails (rejected by the broker, or expired while the
    partition had no leader), so the broker would refuse every later batch of that partition
    with ``OutOfOrderSequenceNumber``. Records sent again after the error go through the new
    producer.

    Raises ``ValueError`` for a negative ``linger_ms``.
    """

    def __init__(
        self, bootstrap_servers: str, client_id: str = "gpupool", *, linger_ms: float | None = None
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.client_id = client_id
        checked = check_linger(linger_ms)
        self.linger_ms: float = DEFAULT_LINGER_MS if checked is None else checked
        """The batching delay this producer uses, milliseconds."""
        self._producer: AIOKafkaProducer | None = None
        self._pending: set[asyncio.Future[object]] = set()
        self._error: BaseException | None = None
        self.failed_records = 0
        """Records whose delivery failed since start (each also logged once)."""
        self.renewals = 0
        """Times the aiokafka producer was replaced after a delivery error (class docstring)."""
        self._started = False
        self._renew = False

    async def start(self) -> None:
        """Connect. Raises ``aiokafka.errors.KafkaConnectionError`` if no bootstrap server answers."""
        self._producer = await self._connect()
        self._started = True
        self._renew = False

    async def _connect(self) -> AIOKafkaProducer:
        """A started aiokafka producer (a new producer id). Raises as :meth:`start`."""
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap_servers,
            client_id=self.client_id,
            enable_idempotence=True,
            acks="all",
            linger_ms=self.linger_ms,
            compression_type=COMPRESSION,
            max_batch_size=_MAX_BATCH_BYTES,
            max_request_size=MAX_RECORD_BYTES,
        )
        try:
            await producer.start()
        except BaseException:
            await producer.stop()
            raise
        return producer

    async def _renew_if_broken(self) -> None:
        """Replace the aiokafka producer after a delivery error once nothing is in flight (class
        docstring). Raises ``aiokafka.errors.KafkaConnectionError`` if the new one cannot
        connect: the next call tries again."""
        if not self._renew or self._pending or not self._started:
            return
        old, self._producer = self._producer, None
        if old is not None:
            await old.stop()
        self._producer = await self._connect()
        self._renew = False
        self.renewals += 1
        log.info("kafka_producer_renewed", extra={"client_id": self.client_id, "renewals": self.renewals})

    def _delivered(self, topic: str, fut: asyncio.Future[object]) -> None:
        self._pending.discard(fut)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.failed_records += 1
            self._renew = True
            if self._error is None:
                self._error = exc
            log.warning(
                "kafka_delivery_failed",
                extra={"topic": topic, "error": repr(exc), "client_id": self.client_id},
            )

    def _raise_failed(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

    async def send(
        self,
        topic: str,
        value: bytes | None,
        key: str | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        """Queue one record (``value`` ``None`` is a tombstone); returns once it is in a batch.

        Raises ``RuntimeError`` if not started; the first delivery error of an earlier record
        (``aiokafka.errors.KafkaError``) if one failed since the last :meth:`flush`; errors of this
        record that aiokafka finds before batching (e.g. ``MessageSizeTooLargeError``);
        ``aiokafka.errors.KafkaConnectionError`` if the producer had to be replaced after a
        delivery error and the new one cannot connect (class docstring).
        """
        if not self._started:
            raise RuntimeError("producer not started")
        self._raise_failed()
        await self._renew_if_broken()  # also retries a replacement that could not connect
        assert self._producer is not None
        fut = await self._producer.send(
            topic,
            value=value,
            key=key.encode("utf-8") if key is not None else None,
            headers=list(headers) or None,
        )
        self._pending.add(fut)
        fut.add_done_callback(functools.partial(self._delivered, topic))

    async def flush(self) -> None:
        """Wait until every queued record is acknowledged by all in-sync replicas.

        Raises the first delivery error (``aiokafka.errors.KafkaError``) since the last flush;
        records not affected by it are delivered all the same. After such an error the
        aiokafka producer is replaced (class docstring) before this returns or raises, when it
        can connect; otherwise at the next :meth:`send`.
        """
        if self._pending:
            await asyncio.wait(set(self._pending))
        if self._renew:
            with contextlib.suppress(KafkaConnectionError):
                await self._renew_if_broken()
        self._raise_failed()

    async def stop(self) -> None:
        """Deliver what is pending and disconnect; then raise a delivery error, if any."""
        self._started = False
        if self._producer is None:
            self._raise_failed()
            return
        producer, self._producer = self._producer, None
        try:
            if self._pending:
                await asyncio.wait(set(self._pending))
        finally:
            await producer.stop()
        self._raise_failed()


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Forwards aiokafka's rebalance callbacks to :class:`KafkaBusConsumer`."""

    def __init__(self, owner: KafkaBusConsumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: list[_AioTopicPartition]) -> None:
        self._owner._revoked({_bus_tp(tp) for tp in revoked})

    async def on_partitions_assigned(self, assigned: list[_AioTopicPartition]) -> None:
        await self._owner._assigned({_bus_tp(tp) for tp in assigned})


class KafkaBusConsumer:
    """An aiokafka consumer in a group; explicit commits (see the module docstring).

    Args:
        bootstrap_servers: ``host:port[,...]``.
        topics: topics to subscribe to.
        group_id: consumer group.
        client_id: Kafka client id.
        on_assign: called with the partitions of each new assignment; the offsets it returns are
            sought to, the others start from the group's committed offset (or the earliest).
        assign_timeout_s: how long :meth:`start` waits for the first assignment, seconds.

    Raises ``ValueError`` if ``topics`` is empty or ``group_id`` is blank.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topics: Sequence[str],
        group_id: str,
        *,
        client_id: str = "gpupool",
        on_assign: OnAssign | None = None,
        assign_timeout_s: float = 30.0,
    ) -> None:
        if not topics:
            raise ValueError("a consumer needs at least one topic")
        if not group_id.strip():
            raise ValueError("group_id is blank")
        self.bootstrap_servers = bootstrap_servers
        self.topics = list(topics)
        self.group_id = group_id
        self.client_id = client_id
        self.assign_timeout_s = assign_timeout_s
        self._on_assign = on_assign
        self._consumer: AIOKafkaConsumer | None = None
        self._returned: dict[TopicPartition, int] = {}
        self._listener_error: BaseException | None = None

    async def start(self) -> None:
        """Join the group and wait (up to ``assign_timeout_s``) for the first assignment.

        If no partition is assigned by then (e.g. the topics do not exist yet) it returns anyway and
        the assignment arrives in the background. Raises ``aiokafka.errors.KafkaConnectionError``
        if the cluster is unreachable.
        """
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            group_id=self.group_id,
            client_id=self.client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            partition_assignment_strategy=(RangePartitionAssignor,),
            heartbeat_interval_ms=1000,
            session_timeout_ms=10000,
        )
        consumer.subscribe(topics=self.topics, listener=_Rebalance(self))
        self._consumer = consumer  # before start: the first rebalance may run inside it and seek
        try:
            await consumer.start()
        except BaseException:
            self._consumer = None
            await consumer.stop()
            raise
        deadline = time.monotonic() + self.assign_timeout_s
        while not consumer.assignment() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not consumer.assignment():
            log.warning(
                "kafka_consumer_unassigned",
                extra={"group_id": self.group_id, "topics": self.topics, "waited_s": self.assign_timeout_s},
            )

    def _revoked(self, revoked: set[TopicPartition]) -> None:
        """Forget what was returned from partitions this member no longer owns: the new owner
        reads them again from the committed offset (at-least-once)."""
        for tp in revoked:
            self._returned.pop(tp, None)

    async def _assigned(self, assigned: set[TopicPartition]) -> None:
        """Run ``on_assign`` and seek; an error is kept and raised by the next :meth:`getmany`."""
        if self._on_assign is None:
            return
        try:
            offsets = await self._on_assign(set(assigned))
        except Exception as e:  # raised to the stage from getmany: aiokafka would only log it
            self._listener_error = e
            log.exception("kafka_on_assign_failed", extra={"group_id": self.group_id})
            return
        consumer = self._consumer
        for tp, offset in offsets.items():
            if tp not in assigned:
                log.warning(
                    "kafka_on_assign_foreign_partition", extra={"topic": tp.topic, "partition": tp.partition}
                )
                continue
            if offset < 0:
                self._listener_error = ValueError(f"on_assign returned a negative offset {offset} for {tp}")
                return
            if consumer is not None:
                consumer.seek(_aio_tp(tp), offset)

    async def getmany(self, timeout_s: float = 1.0, max_records: int = 1000) -> list[BusMessage]:
        """Up to ``max_records`` records, waiting up to ``timeout_s`` seconds for the first; in
        offset order within each partition.

        Raises ``RuntimeError`` if not started, and the exception ``on_assign`` raised (once) if
        it failed during a rebalance.
        """
        if self._consumer is None:
            raise RuntimeError("consumer not started")
        if self._listener_error is not None:
            exc, self._listener_error = self._listener_error, None
            raise exc
        batches = await self._consumer.getmany(
            timeout_ms=max(0, int(timeout_s * 1000)), max_records=max_records
        )
        out: list[BusMessage] = []
        for tp, records in batches.items():
            if not records:
                continue
            out.extend(_to_message(r) for r in records)
            self._returned[_bus_tp(tp)] = records[-1].offset + 1
        return out

    async def commit(self) -> None:
        """Commit, for each partition still owned, the offset after the last record returned.

        Raises ``RuntimeError`` if not started; ``aiokafka.errors.CommitFailedError`` if the
        group rebalanced meanwhile (those records will be delivered again).
        """
        if self._consumer is None:
            raise RuntimeError("consumer not started")
        owned = self._consumer.assignment()
        offsets = {_aio_tp(tp): off for tp, off in self._returned.items() if _aio_tp(tp) in owned}
        if offsets:
            await self._consumer.commit(offsets)

    def assignment(self) -> set[TopicPartition]:
        """The partitions this member owns now (empty before :meth:`start`)."""
        if self._consumer is None:
            return set()
        return {_bus_tp(tp) for tp in self._consumer.assignment()}

    async def end_offsets(self) -> dict[TopicPartition, int]:
        """The high watermark of each partition owned now (one ListOffsets request; empty when
        nothing is owned). Raises ``RuntimeError`` if not started, and
        ``aiokafka.errors.KafkaError`` (e.g. ``KafkaTimeoutError``) if the brokers do not answer."""
        if self._consumer is None:
            raise RuntimeError("consumer not started")
        owned = list(self._consumer.assignment())
        if not owned:
            return {}
        ends = await self._consumer.end_offsets(owned)
        return {_bus_tp(tp): int(off) for tp, off in ends.items()}

    async def position(self, tp: TopicPartition) -> int:
        """The offset of the next record to fetch from owned partition ``tp`` (aiokafka's
        ``position``: past offsets compaction removed). Raises ``RuntimeError`` if not started,
        ``aiokafka.errors.IllegalStateError`` if ``tp`` is not owned."""
        if self._consumer is None:
            raise RuntimeError("consumer not started")
        return int(await self._consumer.position(_aio_tp(tp)))

    async def stop(self) -> None:
        """Leave the group without committing."""
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()
