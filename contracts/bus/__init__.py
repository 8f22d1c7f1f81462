"""The bus: a small keyed publish/consume interface with two implementations.

* :class:`contracts.bus.memory.MemoryBus` — in-process, the embedded default of the demo and of
  unit tests;
* :class:`contracts.bus.kafka.KafkaBus` — Apache Kafka through aiokafka (idempotent, batched,
  compressed producer; consumers that commit only after their side effect is durable).

Both keep Kafka's semantics that the stages rely on: records with the same key land on the same
partition in order; a consumer group shares the partitions; a consumer's position is committed
explicitly, so anything not committed is delivered again after a restart (at-least-once; a stage
that stores offsets with its rows gets exactly-once).
"""

from contracts.bus.api import (
    Bus,
    BusMessage,
    Consumer,
    MissingTopicsError,
    Producer,
    TopicPartition,
    partition_for,
    require_topics,
)
from contracts.bus.memory import MemoryBus

__all__ = [
    "Bus",
    "BusMessage",
    "Consumer",
    "MissingTopicsError",
    "Producer",
    "TopicPartition",
    "partition_for",
    "require_topics",
    "MemoryBus",
]


def make_bus(bootstrap_servers: str | None, *, client_id: str = "gpupool") -> Bus:
    """Return a :class:`KafkaBus` for ``bootstrap_servers`` (``host:port[,host:port]``), or a new
    :class:`MemoryBus` when it is ``None`` or empty."""
    if not bootstrap_servers:
        return MemoryBus()
    from contracts.bus.kafka import KafkaBus  # aiokafka is imported only when Kafka is used

    return KafkaBus(bootstrap_servers, client_id=client_id)
