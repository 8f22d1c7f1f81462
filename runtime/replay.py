"""Reading a topic from its beginning to its end: the one way every reader of a whole topic uses
(the broker rebuilding its lease book from ``leases.log``, ``gpupool report`` dumping it).

The end is each partition's end offset (:meth:`contracts.bus.Consumer.end_offsets`, the high
watermark on Kafka) taken once the reader owns the partitions; a partition is read when the
consumer's position (:meth:`contracts.bus.Consumer.position`) has reached it. Positions step over
the gaps compaction leaves, so a compacted topic whose last records were cleaned is read to its end
too. Nothing is written to the topic.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TypeVar

from contracts.base import Record, decode_compatible
from contracts.bus.api import Bus, BusMessage, TopicPartition

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Record)


async def read_to_end(
    bus: Bus, topic: str, model: type[R], *, group_prefix: str, client_id: str, timeout_s: float
) -> tuple[list[R], int]:
    """Every record of ``topic`` written before this call, decoded as ``model``.

    Reads with a fresh consumer group ``<group_prefix>-<random>`` (nothing committed, so from the
    earliest record) that owns every partition; stops at the end offsets of the module docstring.
    Records without a value (tombstones) are skipped; records are read tolerantly
    (:func:`contracts.base.decode_compatible`: unknown fields of a newer writer ignored); a record
    that does not decode as ``model`` is logged (``bus_record_rejected``) and skipped.

    Returns ``(records, rejected)``: the records in offset order within each partition, and how many
    did not decode. Raises ``TimeoutError`` if no partition is assigned or the ends are not reached
    within ``timeout_s`` seconds, and the bus's errors (Kafka: ``aiokafka.errors.KafkaError``).
    """
    consumer = bus.consumer([topic], f"{group_prefix}-{uuid.uuid4().hex[:12]}", client_id=client_id)
    deadline = time.monotonic() + timeout_s
    await consumer.start()
    try:
        batch: list[BusMessage] = []
        while not consumer.assignment():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no partition of {topic} assigned to read it to its end")
            batch += await consumer.getmany(timeout_s=0.2)
        ends = {tp: end for tp, end in (await consumer.end_offsets()).items() if tp.topic == topic}
        records: list[R] = []
        rejected = 0
        while True:
            for msg in batch:
                tp = TopicPartition(msg.topic, msg.partition)
                if tp not in ends or msg.offset >= ends[tp] or msg.value is None:
                    continue  # written after this call started, or a tombstone
                try:
                    records.append(decode_compatible(model, msg.value))
                except ValueError as exc:
                    rejected += 1
                    log.warning(
                        "bus_record_rejected",
                        extra={"topic": topic, "partition": msg.partition, "offset": msg.offset,
                               "record": model.__name__, "error": str(exc)[:300]},
                    )
            if all([await consumer.position(tp) >= end for tp, end in ends.items()]):
                return records, rejected
            if time.monotonic() > deadline:
                raise TimeoutError(f"did not reach the end of {topic} within {timeout_s} s")
            batch = await consumer.getmany(timeout_s=0.5)
    finally:
        await consumer.stop()
