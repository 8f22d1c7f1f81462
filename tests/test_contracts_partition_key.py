"""Both telemetry topics are keyed by host (``partition_key``), record identity stays ``key``:
a host's GPU samples and InfiniBand port samples land on the same partition number for any
partition count (Kafka's murmur2, :func:`contracts.bus.partition_for`), and a consumer group gives
partition ``p`` of both topics to the same member (MemoryBus, and Kafka's range assignor on the
real cluster), whatever the member count.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.fabric_parse import parse_ibnetdiscover
from collectors.fabric_records import port_sample
from contracts import GpuSample, IbPortSample, KafkaTopics, encode
from contracts.bus import MemoryBus, TopicPartition, partition_for
from contracts.topics import gpu_key, ib_port_key, lease_hosts, telemetry_partition_key
from runtime.kafka import KafkaBus

TOPICS = KafkaTopics()
IBX = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "telemetry" / "infiniband_exporter"

# Hosts as they appear: DNS labels, FQDNs, dcgm-exporter Hostname values, switch descriptions.
_HOSTS = st.one_of(
    st.from_regex(r"[a-z][a-z0-9-]{0,30}(\.[a-z0-9-]{1,20}){0,3}", fullmatch=True),
    st.text(min_size=1, max_size=60),  # anything a node description may hold (UTF-8 included)
)


def _gpu(host: str, uuid_: str = "GPU-1", gi: int | None = None) -> GpuSample:
    return GpuSample(ts=1.0, host=host, gpu_uuid=uuid_, gpu_instance_id=gi)


def _port(
    host: str, device: str = "mlx5_0", guid: str | None = "0x0000000000000001", port: int = 1
) -> IbPortSample:
    return IbPortSample(ts=1.0, host=host, device=device, node_guid=guid, port=port)


def test_partition_for_is_kafkas_murmur2() -> None:
    # Kafka's own vectors (clients UtilsTest.testMurmur2): signed murmur2 of the UTF-8 bytes.
    vectors = {
        "21": -973932308,
        "foobar": -790332482,
        "a-little-bit-long-string": -985981536,
        "a-little-bit-longer-string": -1486304829,
        "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        "abc": 479470107,
    }
    for key, signed in vectors.items():
        for n in (1, 2, 3, 7, 12, 64, 1000):
            assert partition_for(key, n) == (signed & 0x7FFFFFFF) % n, (key, n)


def test_kafka_key_is_the_host_and_identity_is_unchanged() -> None:
    g = _gpu("node-7", "GPU-aa", gi=3)
    assert g.partition_key == telemetry_partition_key("node-7") == "node-7"
    assert g.key == gpu_key("node-7", "GPU-aa", 3) == "node-7/GPU-aa/3"
    p = _port("node-7", guid="0x00000000000000ff", port=2)
    assert p.partition_key == "node-7"
    assert p.key == ib_port_key("0x00000000000000ff", 2) == "0x00000000000000ff/2"
    assert _port("node-7", device="i40iw0", guid=None).key == "node-7:i40iw0/1"  # no GUID: host:device


@settings(max_examples=300, deadline=None)
@given(
    host=_HOSTS,
    partitions=st.integers(min_value=1, max_value=10_000),
    uuid_=st.text(min_size=1, max_size=40),
    gi=st.none() | st.integers(min_value=0, max_value=14),
    guid=st.none() | st.integers(min_value=0, max_value=2**64 - 1).map(lambda g: f"0x{g:016x}"),
    port=st.integers(min_value=1, max_value=64),
)
def test_a_hosts_gpus_and_ports_share_a_partition_for_any_count(
    host: str, partitions: int, uuid_: str, gi: int | None, guid: str | None, port: int
) -> None:
    g, p = _gpu(host, uuid_, gi), _port(host, guid=guid, port=port)
    assert partition_for(g.partition_key, partitions) == partition_for(p.partition_key, partitions)


def test_fabric_read_ports_are_keyed_by_the_hca_host_or_the_switch() -> None:
    topo = parse_ibnetdiscover((IBX / "ibnetdiscover" / "test.out").read_text())
    samples = [port_sample(n, p, [], ts=1.0) for n in topo.nodes().values() for p in sorted(n.ports)]
    cas = {s.partition_key for s in samples if s.device != s.host}
    switches = {s.partition_key for s in samples if s.device == s.host}
    # HCAs ("o0001 HCA-1"): keyed by the host, where that host's GPU samples go; identity GUID/port.
    assert cas == {"o0001", "o0002", "p0001"}
    for s in samples:
        assert s.key == f"{s.node_guid}/{s.port}"
        if s.partition_key in cas:
            for n in range(1, 65):
                assert partition_for(s.partition_key, n) == partition_for(_gpu(s.host).partition_key, n)
    # Switches: keyed by their description, all ports of one switch together, no GPU host.
    assert switches == {"ib-i1l1s01", "ib-i4l1s01", "ib-i7l2s01", "ib-i1l2s01"}


async def test_memory_bus_puts_a_host_on_one_partition_number_of_both_topics() -> None:
    hosts = [f"node-{i:03d}" for i in range(60)] + ["switch-a QM9700", "dgx-h100-17.example.org"]
    for partitions in (1, 2, 3, 4, 5, 8, 13, 32):
        bus = MemoryBus(default_partitions=partitions)
        producer = bus.producer()
        for n, h in enumerate(hosts):
            for i in range(2):
                g = _gpu(h, f"GPU-{i}")
                await producer.send(TOPICS.telemetry_gpu, encode(g), key=g.partition_key)
                p = _port(h, device=f"mlx5_{i}", guid=f"0x{2 * n + i + 1:016x}")
                await producer.send(TOPICS.telemetry_ib_port, encode(p), key=p.partition_key)
        where: dict[str, set[int]] = {}
        for topic in (TOPICS.telemetry_gpu, TOPICS.telemetry_ib_port):
            for m in bus.records(topic):
                where.setdefault(m.key or "", set()).add(m.partition)
        assert set(where) == set(hosts)
        assert all(len(ps) == 1 for ps in where.values()), f"{partitions}: a host on two partitions"
        if partitions >= 4:
            assert len({next(iter(ps)) for ps in where.values()}) > 1  # hosts do spread out


async def test_memory_bus_group_gives_partition_p_of_both_topics_to_one_member() -> None:
    topics = [TOPICS.telemetry_gpu, TOPICS.telemetry_ib_port]
    for partitions in (1, 2, 3, 4, 6, 8):
        for members in (1, 2, 3, 5):
            bus = MemoryBus(default_partitions=partitions)
            group = [bus.consumer(topics, "g") for _ in range(members)]
            for c in group:
                await c.start()
            owned = [c.assignment() for c in group]
            assert set().union(*owned) == {TopicPartition(t, p) for t in topics for p in range(partitions)}
            assert sum(map(len, owned)) == 2 * partitions  # disjoint
            for tps in owned:
                by_topic = [{tp.partition for tp in tps if tp.topic == t} for t in topics]
                assert by_topic[0] == by_topic[1], (partitions, members, tps)
            await group[0].stop()  # a member leaves: the re-split keeps the topics together
            for c in group[1:]:
                tps = c.assignment()
                assert {tp.partition for tp in tps if tp.topic == topics[0]} == {
                    tp.partition for tp in tps if tp.topic == topics[1]
                }


async def test_kafka_group_gives_partition_p_of_both_topics_to_one_member(
    kafka_bus: KafkaBus, kafka_topics: KafkaTopics
) -> None:
    # Three members, four partitions per topic: round robin over the sorted topic-partitions
    # would give member 1 gpu:1 but ib:2; the range assignor keeps the numbers together.
    topics = [kafka_topics.telemetry_gpu, kafka_topics.telemetry_ib_port]
    await kafka_bus.create_topics(topics, partitions=4)
    group = f"copart-{uuid.uuid4().hex}"
    members = [kafka_bus.consumer(topics, group, client_id=f"member-{i}") for i in range(3)]
    try:
        for c in members:
            await c.start()
        every = {TopicPartition(t, p) for t in topics for p in range(4)}
        deadline = time.monotonic() + 45
        while True:
            owned = [c.assignment() for c in members]
            if all(owned) and set().union(*owned) == every and sum(map(len, owned)) == len(every):
                break
            assert time.monotonic() < deadline, f"no stable split: {owned}"
            await asyncio.gather(*(c.getmany(timeout_s=0.1) for c in members))
        for tps in owned:
            assert {tp.partition for tp in tps if tp.topic == topics[0]} == {
                tp.partition for tp in tps if tp.topic == topics[1]
            }, owned
    finally:
        await asyncio.gather(*(c.stop() for c in members))


def test_a_leases_nodes_are_its_hosts_or_else_the_hosts_of_its_gpu_keys() -> None:
    keys = [gpu_key("n2", "GPU-b"), gpu_key("n1", "gpu0"), gpu_key("n2", "GPU-a", 3), gpu_key("n10", "GPU-c")]
    assert lease_hosts([], keys) == ("n1", "n10", "n2")  # sorted, unique, MIG and stand-in keys too
    assert lease_hosts(["n2", "n1"], keys) == ("n2", "n1")  # the broker's list as it sent it
    assert lease_hosts((), []) == ()
