"""The bus: a small keyed publish/consume interface, the in-process implementation, and the rule
of which partition a key lands on. Two implementations exist:

* :class:`contracts.bus.memory.MemoryBus` — in-process, the embedded default of the demo and of
  unit tests;
* :class:`runtime.kafka.KafkaBus` — Apache Kafka through aiokafka (idempotent, batched,
  compressed producer; consumers that commit only after their side effect is durable). It lives in
  the runtime package so that importing a contract never loads a Kafka client.

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

