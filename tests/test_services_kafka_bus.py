"""KafkaBus against a real Kafka 4.1 KRaft node (deploy/local/kafka.sh, via tests/services.py).

Each test uses its own topic prefix and consumer group, so they are independent and can rerun on
the same broker.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import InvalidTopicError, KafkaError, MessageSizeTooLargeError

from contracts.bus import BusMessage, TopicPartition, partition_for
from contracts.topics import KafkaTopics
from runtime.kafka import KafkaBus, KafkaBusConsumer
from tests.services import run_service


def _group() -> str:
    return f"g-{uuid.uuid4().hex}"


async def _produce(bus: KafkaBus, topic: str, records: Sequence[tuple[str | None, bytes | None]]) -> None:
    producer = bus.producer(client_id="test-producer")
    await producer.start()
    try:
        for key, value in records:
            await producer.send(topic, value, key=key, headers=[("traceparent", b"00-abc-01"), ("n", b"1")])
        await producer.flush()
    finally:
        await producer.stop()


async def _read(
    consumer: KafkaBusConsumer, count: int, timeout_s: float = 20.0, max_records: int = 1000
) -> list[BusMessage]:
    """Exactly ``count`` records (fails after ``timeout_s`` s or if more arrive in one call)."""
    out: list[BusMessage] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count:
        assert time.monotonic() < deadline, f"got {len(out)} of {count} records in {timeout_s} s"
        out.extend(await consumer.getmany(timeout_s=0.5, max_records=min(max_records, count - len(out))))
    assert len(out) == count
    return out


async def _assert_quiet(consumer: KafkaBusConsumer, seconds: float = 1.5) -> None:
    extra = await consumer.getmany(timeout_s=seconds)
    assert extra == [], f"unexpected records: {[(m.partition, m.offset) for m in extra]}"


async def test_keyed_records_keep_partition_and_order(kafka_bus: KafkaBus, kafka_topics: KafkaTopics) -> None:
    topic = kafka_topics.telemetry_gpu
    await kafka_bus.create_topics([topic], partitions=4)
    keys = [f"node-{i}/GPU-{uuid.uuid4()}" for i in range(6)]
    records = [(keys[i % len(keys)], f"{i}".encode()) for i in range(300)]
    await _produce(kafka_bus, topic, records)

    consumer = kafka_bus.consumer([topic], _group())
    await consumer.start()
    try:
        got = await _read(consumer, len(records))
    finally:
        await consumer.stop()

    by_key: dict[str, list[BusMessage]] = defaultdict(list)
    for m in got:
        assert m.key is not None
        by_key[m.key].append(m)
    assert set(by_key) == set(keys)
    for key, msgs in by_key.items():
        # Kafka's murmur2 partitioner, as computed by the contracts, on the real cluster.
        assert {m.partition for m in msgs} == {partition_for(key, 4)}
        sent = [int(v) for k, v in records if k == key]
        assert [int(m.value or b"") for m in msgs] == sent
        assert [m.offset for m in msgs] == sorted(m.offset for m in msgs)
    assert {p for p in (partition_for(k, 4) for k in keys)} == {m.partition for m in got}
    assert got[0].headers == (("traceparent", b"00-abc-01"), ("n", b"1"))
    assert got[0].timestamp_ms > 1_600_000_000_000


async def test_uncommitted_records_are_delivered_again(
    kafka_bus: KafkaBus, kafka_topics: KafkaTopics
) -> None:
    topic = kafka_topics.capacity
    await kafka_bus.create_topics([topic], partitions=1)
    await _produce(kafka_bus, topic, [(f"k{i}", f"v{i}".encode()) for i in range(10)])
    group = _group()

    first = kafka_bus.consumer([topic], group)
    await first.start()
    got1 = await _read(first, 10)
    await first.stop()  # no commit

    second = kafka_bus.consumer([topic], group)
    await second.start()
    try:
        got2 = await _read(second, 10)
        await _assert_quiet(second, 0.5)
    finally:
        await second.stop()
    assert [m.offset for m in got1] == [m.offset for m in got2] == list(range(10))


async def test_commit_then_restart_continues_after_returned_records(
    kafka_bus: KafkaBus, kafka_topics: KafkaTopics
) -> None:
    topic = kafka_topics.pool_demand
    await kafka_bus.create_topics([topic], partitions=1)
    await _produce(kafka_bus, topic, [("d", f"{i}".encode()) for i in range(10)])
    group = _group()

    first = kafka_bus.consumer([topic], group)
    await first.start()
    got = await _read(first, 4, max_records=4)  # the other 6 may be fetched, but were not returned
    await first.commit()
    await first.stop()
    assert [m.offset for m in got] == [0, 1, 2, 3]

    await _produce(kafka_bus, topic, [("d", b"10"), ("d", b"11")])
    second = kafka_bus.consumer([topic], group)
    await second.start()
    try:
        rest = await _read(second, 8)
        await second.commit()
        await _assert_quiet(second, 0.5)
    finally:
        await second.stop()
    assert [m.offset for m in rest] == list(range(4, 12))
    assert [int(m.value or b"") for m in rest] == list(range(4, 12))

    third = kafka_bus.consumer([topic], group)
    await third.start()
    try:
        await _assert_quiet(third, 1.0)
    finally:
        await third.stop()


async def test_on_assign_offsets_are_sought(kafka_bus: KafkaBus, kafka_topics: KafkaTopics) -> None:
    topic = kafka_topics.leases_log
    await kafka_bus.create_topics([topic], partitions=2)
    # Unkeyed records spread over both partitions; keyed ones go where murmur2 says.
    await _produce(kafka_bus, topic, [("lease-1", f"{i}".encode()) for i in range(10)])
    p = partition_for("lease-1", 2)
    seen: list[set[TopicPartition]] = []

    async def on_assign(tps: set[TopicPartition]) -> dict[TopicPartition, int]:
        seen.append(tps)
        return {TopicPartition(topic, p): 7}

    consumer = kafka_bus.consumer([topic], _group(), on_assign=on_assign)
    await consumer.start()
    try:
        got = await _read(consumer, 3)
        await _assert_quiet(consumer, 0.5)
    finally:
        await consumer.stop()
    assert seen and seen[0] == {TopicPartition(topic, 0), TopicPartition(topic, 1)}
    assert [(m.partition, m.offset) for m in got] == [(p, 7), (p, 8), (p, 9)]


async def test_on_assign_failure_is_raised_by_getmany(kafka_bus: KafkaBus, kafka_topics: KafkaTopics) -> None:
    topic = kafka_topics.capacity
    await kafka_bus.create_topics([topic], partitions=1)

    async def on_assign(tps: set[TopicPartition]) -> dict[TopicPartition, int]:
        raise LookupError("offsets table unreadable")

    consumer = kafka_bus.consumer([topic], _group(), on_assign=on_assign)
    await consumer.start()
    try:
        with pytest.raises(LookupError, match="offsets table unreadable"):
            await consumer.getmany(timeout_s=0.1)
    finally:
        await consumer.stop()


async def test_two_members_split_four_partitions(kafka_bus: KafkaBus, kafka_topics: KafkaTopics) -> None:
    topic = kafka_topics.telemetry_ib_port
    await kafka_bus.create_topics([topic], partitions=4)
    group = _group()
    a = kafka_bus.consumer([topic], group, client_id="member-a")
    b = kafka_bus.consumer([topic], group, client_id="member-b")
    await a.start()
    assert len(a.assignment()) == 4
    await b.start()
    try:
        deadline = time.monotonic() + 30
        while not (len(a.assignment()) == 2 and len(b.assignment()) == 2):
            assert time.monotonic() < deadline, f"no split: {a.assignment()} / {b.assignment()}"
            await asyncio.gather(a.getmany(timeout_s=0.1), b.getmany(timeout_s=0.1))
        assert a.assignment().isdisjoint(b.assignment())
        assert a.assignment() | b.assignment() == {TopicPartition(topic, i) for i in range(4)}

        keys = [f"0x{i:016x}/1" for i in range(40)]
        await _produce(kafka_bus, topic, [(k, k.encode()) for k in keys])
        got_a: list[BusMessage] = []
        got_b: list[BusMessage] = []
        deadline = time.monotonic() + 20
        while len(got_a) + len(got_b) < len(keys):
            assert time.monotonic() < deadline, f"got {len(got_a)} + {len(got_b)} of {len(keys)}"
            ra, rb = await asyncio.gather(a.getmany(timeout_s=0.3), b.getmany(timeout_s=0.3))
            got_a += ra
            got_b += rb
        owned_a = {tp.partition for tp in a.assignment()}
        assert got_a and got_b
        assert all(m.partition in owned_a for m in got_a)
        assert all(m.partition not in owned_a for m in got_b)
        assert sorted(m.key or "" for m in got_a + got_b) == sorted(keys)
    finally:
        await asyncio.gather(a.stop(), b.stop())


async def test_tombstones_and_unkeyed_records(kafka_bus: KafkaBus, kafka_topics: KafkaTopics) -> None:
    compacted, plain = kafka_topics.leases_log, kafka_topics.capacity
    await kafka_bus.create_topics([compacted], partitions=1, compacted=[compacted])
    await kafka_bus.create_topics([plain], partitions=1)
    await _produce(kafka_bus, compacted, [("lease-9", b"{}"), ("lease-9", None)])
    await _produce(kafka_bus, plain, [(None, b"x"), ("k", None)])
    consumer = kafka_bus.consumer([compacted, plain], _group())
    await consumer.start()
    try:
        got = await _read(consumer, 4)
    finally:
        await consumer.stop()
    by_topic = {t: [(m.key, m.value) for m in got if m.topic == t] for t in (compacted, plain)}
    assert by_topic == {
        compacted: [("lease-9", b"{}"), ("lease-9", None)],
        plain: [(None, b"x"), ("k", None)],
    }


async def test_delivery_error_is_raised_by_flush(kafka_bus: KafkaBus, kafka_topics: KafkaTopics) -> None:
    """A compacted topic refuses records without a key (INVALID_RECORD): send returns, flush raises."""
    topic = kafka_topics.leases_log
    await kafka_bus.create_topics([topic], partitions=1, compacted=[topic])
    producer = kafka_bus.producer()
    await producer.start()
    try:
        await producer.send(topic, b"no key")
        with pytest.raises(KafkaError):
            await producer.flush()
        assert producer.failed_records == 1
        await producer.send(topic, b"{}", key="lease-1")  # the producer goes on working
        await producer.flush()
    finally:
        await producer.stop()


async def test_partition_keeps_working_after_a_failed_batch(
    kafka_bootstrap: str, kafka_bus: KafkaBus, kafka_topics: KafkaTopics
) -> None:
    """A batch the broker refuses (here: larger than the topic's ``max.message.bytes``) has used
    up idempotence sequence numbers in aiokafka: on the same producer every later batch of the
    partition was refused ``OutOfOrderSequenceNumber``, forever. The producer is replaced after
    the error, and the partition's next records arrive, once each and in order."""
    topic = kafka_topics.capacity
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"max.message.bytes": "2048"})])
    finally:
        await admin.close()
    producer = kafka_bus.producer()
    await producer.start()
    try:
        await producer.send(topic, b"before", key="k")
        await producer.flush()
        await producer.send(topic, os.urandom(16384), key="k")  # incompressible: over 2048 bytes
        with pytest.raises(MessageSizeTooLargeError):
            await producer.flush()
        assert (producer.failed_records, producer.renewals) == (1, 1)
        for i in range(3):
            await producer.send(topic, f"after-{i}".encode(), key="k")
            await producer.flush()
        assert (producer.failed_records, producer.renewals) == (1, 1)
    finally:
        await producer.stop()
    consumer = kafka_bus.consumer([topic], _group())
    await consumer.start()
    try:
        got = await _read(consumer, 4)
    finally:
        await consumer.stop()
    assert [m.value for m in got] == [b"before", b"after-0", b"after-1", b"after-2"]


async def test_create_topics_is_idempotent_and_compacts(
    kafka_bootstrap: str, kafka_bus: KafkaBus, kafka_topics: KafkaTopics
) -> None:
    names = kafka_topics.all()
    await kafka_bus.create_topics(names, partitions=3, compacted=[kafka_topics.leases_log])
    await kafka_bus.create_topics(names, partitions=3, compacted=[kafka_topics.leases_log])  # no error

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics(names)
        assert {t["topic"]: len(t["partitions"]) for t in described} == {n: 3 for n in names}
        configs = await admin.describe_configs(
            [
                ConfigResource(ConfigResourceType.TOPIC, n)
                for n in (kafka_topics.leases_log, kafka_topics.capacity)
            ]
        )
        policy = {
            res[3]: {entry[0]: entry[1] for entry in res[4]}["cleanup.policy"]
            for response in configs
            for res in response.resources
        }
        assert policy == {kafka_topics.leases_log: "compact", kafka_topics.capacity: "delete"}
    finally:
        await admin.close()


async def test_create_topics_rejects_bad_names(kafka_bus: KafkaBus) -> None:
    with pytest.raises(InvalidTopicError):
        await kafka_bus.create_topics(["not a valid/topic name"], partitions=1)
    with pytest.raises(ValueError):
        await kafka_bus.create_topics(["t"], partitions=0)


async def test_producer_and_consumer_need_start(kafka_bus: KafkaBus, kafka_topics: KafkaTopics) -> None:
    producer = kafka_bus.producer()
    with pytest.raises(RuntimeError):
        await producer.send(kafka_topics.capacity, b"x")
    consumer = kafka_bus.consumer([kafka_topics.capacity], _group())
    assert consumer.assignment() == set()
    with pytest.raises(RuntimeError):
        await consumer.getmany()
    with pytest.raises(ValueError):
        kafka_bus.consumer([], "g")


async def test_restart_keeps_address_records_and_offsets(
    kafka_bootstrap: str, kafka_bus: KafkaBus, kafka_topics: KafkaTopics
) -> None:
    """kafka.sh stop + start: same port, topics and committed offsets kept; a producer started
    before the restart delivers after it."""
    topic = kafka_topics.capacity
    await kafka_bus.create_topics([topic], partitions=1)
    await _produce(kafka_bus, topic, [("gpu", f"{i}".encode()) for i in range(5)])
    group = _group()
    first = kafka_bus.consumer([topic], group)
    await first.start()
    await _read(first, 3, max_records=3)
    await first.commit()
    await first.stop()
    await kafka_bus.close()

    producer = kafka_bus.producer()
    await producer.start()
    try:
        assert run_service("kafka.sh", "stop").returncode == 0
        done = run_service("kafka.sh", "start")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == kafka_bootstrap
        await producer.send(topic, b"5", key="gpu")
        await asyncio.wait_for(producer.flush(), 60)
    finally:
        await producer.stop()

    second = kafka_bus.consumer([topic], group)
    await second.start()
    try:
        rest = await _read(second, 3)
    finally:
        await second.stop()
    assert [(m.offset, m.value) for m in rest] == [(3, b"3"), (4, b"4"), (5, b"5")]


async def test_a_fabric_sized_topology_record_goes_through(
    kafka_bus: KafkaBus, kafka_topics: KafkaTopics
) -> None:
    """A ``fabric.topology`` snapshot of a 1,000-node fabric is over aiokafka's default 1 MiB
    request size uncompressed (well under the broker's limit compressed): it must go through."""
    topic = kafka_topics.fabric_topology
    await kafka_bus.create_topics([topic], partitions=1, compacted=[topic])
    ports = (b'"port-%d": {"connected": true, "peer_port": 1}' % i for i in range(60_000))
    value = b"{" + b",".join(ports) + b"}"
    assert len(value) > 2 * 1024 * 1024
    await _produce(kafka_bus, topic, [("topology", value)])
    consumer = kafka_bus.consumer([topic], _group())
    await consumer.start()
    try:
        (got,) = await _read(consumer, 1)
    finally:
        await consumer.stop()
    assert (got.key, got.value) == ("topology", value)
