"""Reading the lease log (Kafka ``leases.log``, :class:`contracts.LeaseLogRecord` keyed by
``lease_id``) from its beginning to its end, for a starting broker.

The bus interface has no "end offset" call, so the end is marked: after the reader has its
partitions, one tombstone (``value=None``) with a key of the form
``__gpupool_rebuild_marker__/<nonce>/<i>`` is written to each partition (keys chosen with Kafka's
default partitioner, :func:`contracts.bus.partition_for`); once the reader has seen all of them,
it has read everything written before. Tombstones are removed by compaction; readers of the log
skip records without a value.
"""

from __future__ import annotations

import logging
import time
import uuid

from contracts import LeaseLogRecord
from contracts.base import decode_compatible
from contracts.bus import Bus, BusMessage, Producer, partition_for

log = logging.getLogger(__name__)

MARKER_PREFIX = "__gpupool_rebuild_marker__"
"""Key prefix of the end markers (tombstones) written to the lease log."""


async def read_lease_log(
    bus: Bus, producer: Producer, topic: str, *, group_prefix: str, client_id: str, timeout_s: float
) -> tuple[list[LeaseLogRecord], int]:
    """Every record of ``topic`` written before this call, in partition order.

    Reads with a fresh consumer group ``<group_prefix>-rebuild-<random>`` (so from the beginning,
    never committed) and the started ``producer`` writes the end markers.

    Returns ``(records, rejected)``: the decoded records, and how many records did not decode
    (each logged; they are skipped). Raises ``TimeoutError`` if no partition is assigned or the
    markers are not all read back within ``timeout_s`` seconds, and the bus's errors.
    """
    group = f"{group_prefix}-rebuild-{uuid.uuid4().hex[:12]}"
    consumer = bus.consumer([topic], group, client_id=client_id)
    deadline = time.monotonic() + timeout_s
    await consumer.start()
    try:
        batch: list[BusMessage] = []
        while not consumer.assignment():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no partition of {topic} assigned to read the lease log")
            batch += await consumer.getmany(timeout_s=0.2)
        markers = marker_keys(
            len({tp for tp in consumer.assignment() if tp.topic == topic}), uuid.uuid4().hex[:12]
        )
        for key in markers:
            await producer.send(topic, None, key=key)
        await producer.flush()
        records: list[LeaseLogRecord] = []
        seen: set[str] = set()
        rejected = 0
        while True:
            for msg in batch:
                if msg.key in markers:
                    seen.add(msg.key)
                elif msg.value is not None:
                    try:
                        records.append(decode_compatible(LeaseLogRecord, msg.value))
                    except ValueError as e:
                        rejected += 1
                        log.warning(
                            "lease_log_record_rejected",
                            extra={"partition": msg.partition, "offset": msg.offset, "error": str(e)[:300]},
                        )
            if len(seen) == len(markers):
                return records, rejected
            if time.monotonic() > deadline:
                raise TimeoutError(f"did not reach the end of {topic} within {timeout_s} s")
            batch = await consumer.getmany(timeout_s=0.5)
    finally:
        await consumer.stop()


def marker_keys(partitions: int, nonce: str) -> set[str]:
    """One marker key per partition of a topic with ``partitions`` partitions (``>= 1``)."""
    keys: dict[int, str] = {}
    i = 0
    while len(keys) < partitions:
        key = f"{MARKER_PREFIX}/{nonce}/{i}"
        keys.setdefault(partition_for(key, partitions), key)
        i += 1
    return set(keys.values())
