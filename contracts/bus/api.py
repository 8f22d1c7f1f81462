"""The bus interface shared by every implementation (see :mod:`contracts.bus`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class TopicPartition(NamedTuple):
    """A partition of a topic (same shape as aiokafka's ``TopicPartition``)."""

    topic: str
    partition: int


@dataclass(frozen=True, slots=True)
class BusMessage:
    """One record read from the bus.

    Attributes:
        topic / partition / offset: where it was read; ``offset`` grows by one per record.
        key: the record key (UTF-8), or ``None``.
        value: the payload (JSON of a :class:`contracts.base.Record`); ``None`` is a tombstone.
        headers: ``(name, bytes)`` pairs, e.g. ``traceparent``.
        timestamp_ms: producer timestamp, Unix milliseconds.
    """

    topic: str
    partition: int
    offset: int
    key: str | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = field(default=())
    timestamp_ms: int = 0


OnAssign = Callable[[set[TopicPartition]], Awaitable[dict[TopicPartition, int]]]
"""Called when partitions are assigned; returns offsets to start from (e.g. those stored with the
data, for exactly-once). Partitions it leaves out start from the committed group offset."""


def partition_for(key: str | None, partitions: int, _counter: list[int] = [0]) -> int:  # noqa: B006
    """Partition of ``key`` among ``partitions``: Kafka's default partitioner (murmur2 of the
    UTF-8 key bytes, positive, modulo the count: aiokafka's ``aiokafka.partitioner.murmur2``, the
    same as the Java client's ``Utils.murmur2``), round robin for ``None``. Imports aiokafka on
    first use (the in-process bus partitions like Kafka)."""
    if key is None:
        _counter[0] += 1
        return _counter[0] % partitions
    from aiokafka.partitioner import murmur2

    return (int(murmur2(key.encode())) & 0x7FFFFFFF) % partitions


def check_linger(linger_ms: float | None) -> float | None:
    """Return ``linger_ms`` (a producer's batching delay, milliseconds, or ``None`` for the
    default) if it is usable. Raises ``ValueError`` if it is negative or not finite."""
    if linger_ms is not None and not 0 <= linger_ms < float("inf"):
        raise ValueError(f"linger_ms must be a finite number >= 0, got {linger_ms!r}")
    return linger_ms


class Producer(Protocol):
    """Sends records; batched, keyed, idempotent on Kafka."""

    async def start(self) -> None:
        """Connect. Raises ``ConnectionError`` (Kafka: ``KafkaConnectionError``) if unreachable."""

    async def stop(self) -> None:
        """Flush what is pending and disconnect."""

    async def send(
        self, topic: str, value: bytes | None, key: str | None = None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        """Queue one record for ``topic``; returns once it is accepted into the batch (not yet
        acknowledged — call :meth:`flush` for that)."""

    async def flush(self) -> None:
        """Wait until every queued record is acknowledged by the bus."""


class Consumer(Protocol):
    """Reads records of a consumer group; commits explicitly."""

    async def start(self) -> None:
        """Join the group and get partitions."""

    async def stop(self) -> None:
        """Leave the group; uncommitted positions are not committed."""

    async def getmany(self, timeout_s: float = 1.0, max_records: int = 1000) -> list[BusMessage]:
        """Return up to ``max_records`` records (possibly none after ``timeout_s`` seconds)."""

    async def commit(self) -> None:
        """Commit the position after every record returned so far."""

    def assignment(self) -> set[TopicPartition]:
        """The partitions this member owns now."""

    async def end_offsets(self) -> dict[TopicPartition, int]:
        """For each partition owned now, the offset the next record written to it will get (the
        high watermark on Kafka): ``end - next offset to read`` is the consumer lag. Raises the
        bus's error if it cannot be asked (Kafka: ``aiokafka.errors.KafkaError``)."""

    async def position(self, tp: TopicPartition) -> int:
        """The offset of the next record :meth:`getmany` will return from owned partition ``tp``
        (past any offsets compaction removed). Raises the bus's error if ``tp`` is not owned
        (Kafka: ``aiokafka.errors.IllegalStateError``)."""


class Bus(Protocol):
    """Factory of producers and consumers on one cluster (or one process)."""

    def producer(self, client_id: str = "gpupool", *, linger_ms: float | None = None) -> Producer:
        """A new, not yet started, producer.

        ``linger_ms``: how long the producer may hold a record to batch it with later ones before
        sending, milliseconds (>= 0); ``None``: the implementation's default (Kafka: 20 ms, for
        throughput). A producer on a latency path that flushes after each few records (the
        broker's lease log) passes 0-2 ms. Implementations without batching ignore it. Raises
        ``ValueError`` for a negative value.
        """

    def consumer(
        self,
        topics: Sequence[str],
        group_id: str,
        *,
        client_id: str = "gpupool",
        on_assign: OnAssign | None = None,
    ) -> Consumer:
        """A new, not yet started, consumer of ``topics`` in ``group_id``; a group with no
        committed offset starts from the earliest record."""

    async def create_topics(
        self, names: Sequence[str], partitions: int = 1, compacted: Sequence[str] = ()
    ) -> None:
        """Create the topics that do not exist yet (``compacted``: ``cleanup.policy=compact``).
        For the operator's tools (``gpupool topics create``) and tests; no stage calls it."""

    async def missing_topics(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` the bus does not have (in order, without repeats); asking never
        creates one. Raises the bus's connection errors (Kafka: ``aiokafka.errors.KafkaError``)."""

    async def close(self) -> None:
        """Release shared resources (admin clients)."""


class MissingTopicsError(LookupError):
    """Topics a stage needs do not exist on the bus. No stage creates topics (an auto-created topic
    gets the cluster's default partitions, replication and cleanup policy): the operator creates
    them once with ``gpupool topics create``.

    Attributes:
        missing: the full names of the missing topics.
    """

    def __init__(self, missing: Sequence[str]) -> None:
        self.missing = list(missing)
        super().__init__(
            f"Kafka topic{'s' if len(self.missing) != 1 else ''} missing: {', '.join(self.missing)}. "
            "No gpupool stage creates topics: create them first with `gpupool topics create "
            "--kafka HOST:PORT --partitions N --replication-factor R` (same topic_prefix and "
            "settings file as the stages)"
        )


async def require_topics(bus: Bus, names: Sequence[str]) -> None:
    """Return if every topic of ``names`` exists on ``bus``; never creates one.

    Raises:
        MissingTopicsError: some are missing (the message names ``gpupool topics create``).
        The bus's connection errors (Kafka: ``aiokafka.errors.KafkaError``) if it cannot be asked.
    """
    missing = await bus.missing_topics(names)
    if missing:
        raise MissingTopicsError(missing)
