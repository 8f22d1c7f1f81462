"""SpoolingProducer against a fake bus with aiokafka's delivery semantics (records handed to it
stay handed while the bus is down; a flush waits, or raises for part of a unit), and against the
in-process MemoryBus: no loss, no duplicate, FIFO, tiers, backpressure, drops counted by reason,
restart from disk, torn frames."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from aiokafka.errors import KafkaTimeoutError

from collectors.spool import REDELIVERY_HEADER, RecordDroppedError, SpoolingProducer
from collectors.spool_disk import decode_body, encode_frame, make_record
from contracts.bus import MemoryBus

Sent = tuple[str, str | None, bytes | None, tuple[tuple[str, bytes], ...]]


class FakeBus:
    """A producer that behaves like aiokafka's idempotent one towards its caller.

    * ``up`` cleared: ``start`` raises ``ConnectionError``; ``flush`` waits (records handed stay
      handed, and are delivered once when ``up`` is set again).
    * ``fail_flush = (k, exc)``: the next flush delivers the first ``k`` pending records, loses the
      others and raises ``exc`` (a flush that fails half way).
    * ``poison``: values whose ``send`` raises ``ValueError`` (a permanent error);
    * ``busy_sends``: the first that many ``send`` calls raise ``KafkaTimeoutError`` (a full
      buffer for a while: not the record's fault).
    """

    def __init__(self, up: bool = True) -> None:
        self.up = asyncio.Event()
        if up:
            self.up.set()
        self.delivered: list[Sent] = []
        self.pending: list[Sent] = []
        self.fail_flush: tuple[int, BaseException] | None = None
        self.poison: set[bytes] = set()
        self.busy_sends = 0
        self.send_calls = 0
        self.started = 0
        self.stopped = 0

    async def start(self) -> None:
        if not self.up.is_set():
            raise ConnectionError("no broker")
        self.started += 1

    async def stop(self) -> None:
        await self.flush()
        self.stopped += 1

    async def send(
        self,
        topic: str,
        value: bytes | None,
        key: str | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        self.send_calls += 1
        if self.send_calls <= self.busy_sends:
            raise KafkaTimeoutError()
        if value in self.poison:
            raise ValueError("record refused")
        self.pending.append((topic, key, value, tuple(headers)))

    async def flush(self) -> None:
        await self.up.wait()
        if self.fail_flush is not None:
            k, exc = self.fail_flush
            self.fail_flush = None
            self.delivered += self.pending[:k]
            self.pending.clear()
            raise exc
        self.delivered += self.pending
        self.pending.clear()


def _metric(spool: SpoolingProducer, name: str, **labels: str) -> float:
    """A sample of the registry ``spool`` counts on (0 if absent)."""
    return spool.metrics.registry.get_sample_value(name, labels) or 0.0


def _values(sent: list[Sent]) -> list[int]:
    return [int(v) for _, _, v, _ in sent if v is not None]


def _spool(inner: FakeBus | object, **kw: object) -> SpoolingProducer:
    opts: dict[str, object] = {
        "backoff_s": (0.01, 0.05),
        "flush_poll_s": 0.05,
        "max_wait_s": 0.1,
        "drain_timeout_s": 0.3,
        "stop_timeout_s": 0.3,
        "fsync_interval_s": 0.05,
    }
    opts.update(kw)
    return SpoolingProducer(inner, **opts)  # type: ignore[arg-type]


async def _until(cond: object, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.01)


def test_frame_round_trip() -> None:
    for rec in [
        make_record("t.telemetry.gpu", b'{"a":1}', "node/GPU-1", [("traceparent", b"00-ab-01"), ("x", b"")]),
        make_record("leases.log", None, "lease-1", []),  # tombstone
        make_record("t", b"\x00\xff" * 100, None, []),
    ]:
        frame = encode_frame(rec)
        assert decode_body(frame[8:]) == rec


async def test_memory_bus_gets_every_record_in_order() -> None:
    bus = MemoryBus(default_partitions=4)
    await bus.create_topics(["t"], partitions=4)
    spool = _spool(bus.producer())
    await spool.start()
    for i in range(500):
        await spool.send("t", str(i).encode(), key=f"k{i % 7}")
    await spool.flush()
    assert spool.queued == 0 and spool.delivered == 500
    await spool.stop()
    got = bus.records("t")
    assert len(got) == 500
    for k in range(7):
        seq = [int(m.value or b"") for m in got if m.key == f"k{k}"]
        assert seq == list(range(k, 500, 7))
    assert _metric(spool, "gpupool_collector_spool_drained_total") == 500


async def test_outage_spools_to_memory_then_disk_and_delivers_exactly_once(tmp_path: Path) -> None:
    fake = FakeBus(up=True)
    spool = _spool(fake, memory_records=50, disk_dir=tmp_path / "spool", batch_records=20)
    await spool.start()
    for i in range(30):
        await spool.send("t", str(i).encode(), key="k")
    await spool.flush()
    fake.up.clear()  # the broker goes away: handed records stay handed, new ones wait
    for i in range(30, 330):
        await spool.send("t", str(i).encode(), key="k")
    await asyncio.sleep(0.3)  # several flush polls time out meanwhile
    tiers = spool.queued_by_tier
    assert tiers["memory"] == 50 and tiers["disk"] == 250  # memory full, the rest on disk
    assert _metric(spool, "gpupool_collector_spool_spooled_total", tier="disk") == 250
    assert _metric(spool, "gpupool_collector_spool_records", tier="disk") >= 250
    assert _metric(spool, "gpupool_collector_spool_bus_up") == 0
    assert len(fake.pending) == 20  # one unit in the inner producer, never handed twice
    fake.up.set()
    await asyncio.wait_for(spool.flush(), 5)
    assert _values(fake.delivered) == list(range(330))  # every record once, in order
    assert not any(h for *_, h in fake.delivered)  # nothing had to be flagged
    assert list((tmp_path / "spool").glob("*.seg")) == []  # an empty spool leaves no segment
    assert _metric(spool, "gpupool_collector_spool_bus_up") == 1
    await spool.stop()


async def test_bus_unreachable_at_start_is_retried(tmp_path: Path) -> None:
    fake = FakeBus(up=False)
    spool = _spool(fake)
    await spool.start()  # does not raise: records wait
    for i in range(10):
        await spool.send("t", str(i).encode())
    await asyncio.sleep(0.1)
    assert fake.started == 0 and spool.queued == 10
    fake.up.set()
    await asyncio.wait_for(spool.flush(), 5)
    assert fake.started == 1 and _values(fake.delivered) == list(range(10))
    await spool.stop()


async def test_flush_failing_half_way_resends_flagged_and_loses_nothing() -> None:
    fake = FakeBus()
    spool = _spool(fake, batch_records=10)
    fake.up.clear()
    await spool.start()
    fake.up.set()
    fake.fail_flush = (4, KafkaTimeoutError())  # 4 of the first 10 reach the bus, 6 are lost
    for i in range(25):
        await spool.send("t", str(i).encode(), key="k")
    await asyncio.wait_for(spool.flush(), 5)
    await spool.stop()
    values = _values(fake.delivered)
    assert sorted(set(values)) == list(range(25))  # nothing lost
    flagged = [int(v or b"") for _, _, v, h in fake.delivered if (REDELIVERY_HEADER, b"1") in h]
    assert flagged == list(range(10))  # the whole unit of unknown outcome, sent again, flagged
    dupes = [v for v in set(values) if values.count(v) > 1]
    assert sorted(dupes) == [0, 1, 2, 3] and set(dupes) <= set(flagged)  # only flagged ones repeat
    first = [v for i, v in enumerate(values) if v not in values[:i]]
    assert first == list(range(25))  # first deliveries in order
    assert _metric(spool, "gpupool_collector_spool_redelivered_total") == 10


async def test_poison_record_is_dropped_after_max_attempts_others_flow() -> None:
    fake = FakeBus()
    fake.poison = {b"3"}
    spool = _spool(fake, max_attempts=3)
    await spool.start()
    for i in range(8):
        await spool.send("t", str(i).encode())
    await asyncio.wait_for(spool.flush(), 5)
    await spool.stop()
    assert _values(fake.delivered) == [0, 1, 2, 4, 5, 6, 7]
    assert spool.dropped == 1
    assert _metric(spool, "gpupool_collector_spool_dropped_total", reason="rejected") == 1


async def test_transient_send_errors_never_drop() -> None:
    fake = FakeBus()
    fake.busy_sends = 12
    spool = _spool(fake, max_attempts=2)
    await spool.start()
    for i in range(5):
        await spool.send("t", str(i).encode())
    await asyncio.wait_for(spool.flush(), 5)
    await spool.stop()
    assert _values(fake.delivered) == list(range(5)) and spool.dropped == 0


async def test_backpressure_then_drop_counted_then_recovery() -> None:
    fake = FakeBus(up=False)
    spool = _spool(fake, memory_records=3, max_wait_s=0.2)
    await spool.start()
    for i in range(3):
        await spool.send("t", str(i).encode())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(RecordDroppedError) as info:
        await spool.send("t", b"3")
    assert info.value.reason == "full" and loop.time() - t0 >= 0.19  # waited for space first
    t0 = loop.time()
    with pytest.raises(RecordDroppedError):
        await spool.send("t", b"4")
    assert loop.time() - t0 < 0.1  # already shedding: no second wait
    assert _metric(spool, "gpupool_collector_spool_dropped_total", reason="full") == 2

    # A sender waiting for space gets in as soon as the bus takes records again.
    fake.up.set()
    await asyncio.wait_for(spool.flush(), 5)
    await spool.send("t", b"5")
    await asyncio.wait_for(spool.flush(), 5)
    assert _values(fake.delivered) == [0, 1, 2, 5]
    await spool.stop()


async def test_waiting_sender_is_admitted_when_space_frees() -> None:
    fake = FakeBus(up=False)
    spool = _spool(fake, memory_records=2, max_wait_s=3.0)
    await spool.start()
    await spool.send("t", b"0")
    await spool.send("t", b"1")
    waiting = asyncio.create_task(spool.send("t", b"2"))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    fake.up.set()
    await asyncio.wait_for(waiting, 3)
    await asyncio.wait_for(spool.flush(), 3)
    assert _values(fake.delivered) == [0, 1, 2]
    await spool.stop()


async def test_disk_full_and_too_large(tmp_path: Path) -> None:
    fake = FakeBus(up=False)
    spool = _spool(
        fake,
        memory_records=1,
        disk_dir=tmp_path,
        disk_bytes=1 << 20,
        max_record_bytes=200_000,
        max_wait_s=0.05,
    )
    await spool.start()
    with pytest.raises(RecordDroppedError) as info:
        await spool.send("t", b"x" * 300_000)
    assert info.value.reason == "too_large"
    payload = b"y" * 150_000
    accepted = 0
    with pytest.raises(RecordDroppedError):
        for _ in range(20):
            await spool.send("t", payload)
            accepted += 1
    assert accepted == 1 + 6  # one in memory, 6 frames of ~150 kB in 1 MiB of disk
    assert _metric(spool, "gpupool_collector_spool_dropped_total", reason="full") == 1
    assert _metric(spool, "gpupool_collector_spool_dropped_total", reason="too_large") == 1
    assert sum(p.stat().st_size for p in tmp_path.glob("*.seg")) <= 1 << 20
    fake.up.set()
    await asyncio.wait_for(spool.flush(), 5)
    assert len(fake.delivered) == 7
    await spool.stop()


async def test_restart_resumes_the_disk_spool(tmp_path: Path) -> None:
    down = FakeBus(up=False)
    first = _spool(down, memory_records=0, disk_dir=tmp_path)  # every record through disk
    await first.start()
    for i in range(40):
        await first.send("t", str(i).encode(), key=f"k{i % 3}", headers=[("n", str(i).encode())])
    await first.stop()  # the bus never came: everything stays on disk
    assert down.send_calls == 0
    assert len(list(tmp_path.glob("*.seg"))) == 1

    up = FakeBus()
    second = _spool(up, disk_dir=tmp_path)
    await second.start()
    assert second.accepted == 40
    await asyncio.wait_for(second.flush(), 5)
    await second.stop()
    assert _values(up.delivered) == list(range(40))
    assert [h for *_, h in up.delivered][:2] == [(("n", b"0"),), (("n", b"1"),)]  # headers kept
    assert [k for _, k, _, _ in up.delivered][:4] == ["k0", "k1", "k2", "k0"]
    assert list(tmp_path.glob("*.seg")) == []


async def test_stop_during_outage_persists_memory_before_disk_and_flags_in_flight(tmp_path: Path) -> None:
    fake = FakeBus()
    spool = _spool(fake, memory_records=10, disk_dir=tmp_path, batch_records=5)
    await spool.start()
    fake.up.clear()
    for i in range(25):  # unit 0-4 handed (in flight), 5-9 in memory, 10-24 on disk
        await spool.send("t", str(i).encode())
    await _until(lambda: len(fake.pending) == 5)
    await spool.stop()  # the flush never returns: the in-flight unit's outcome is unknown
    assert fake.delivered == []
    cursor = json.loads((tmp_path / "cursor.json").read_text())
    assert cursor["suspect"] == 5

    fresh = FakeBus()
    again = _spool(fresh, disk_dir=tmp_path)
    await again.start()
    await asyncio.wait_for(again.flush(), 5)
    await again.stop()
    assert _values(fresh.delivered) == list(range(25))  # memory tier first, then the disk tier
    flagged = [int(v or b"") for _, _, v, h in fresh.delivered if h == ((REDELIVERY_HEADER, b"1"),)]
    assert flagged == [0, 1, 2, 3, 4]


async def test_memory_only_stop_during_outage_counts_what_it_drops() -> None:
    fake = FakeBus(up=False)
    spool = _spool(fake, memory_records=100)
    await spool.start()
    for i in range(7):
        await spool.send("t", str(i).encode())
    await spool.stop()
    assert spool.dropped == 7
    assert _metric(spool, "gpupool_collector_spool_dropped_total", reason="shutdown") == 7
    with pytest.raises(RuntimeError):
        await spool.send("t", b"late")
    with pytest.raises(RuntimeError):
        await spool.start()  # a stopped spool is not reused


async def test_torn_tail_is_cut_and_counted(tmp_path: Path) -> None:
    down = FakeBus(up=False)
    first = _spool(down, memory_records=0, disk_dir=tmp_path)
    await first.start()
    for i in range(10):
        await first.send("t", str(i).encode())
    await first.stop()
    [seg] = list(tmp_path.glob("*.seg"))
    frame = encode_frame(make_record("t", b"10", None, []))
    with open(seg, "ab") as f:
        f.write(frame[: len(frame) - 3])  # a power loss in the middle of a write

    up = FakeBus()
    second = _spool(up, disk_dir=tmp_path)
    await second.start()
    await asyncio.wait_for(second.flush(), 5)
    await second.stop()
    assert _values(up.delivered) == list(range(10))
    assert _metric(second, "gpupool_collector_spool_dropped_total", reason="corrupt") == 1


async def test_corrupt_frame_in_the_middle_loses_only_its_segment(tmp_path: Path) -> None:
    down = FakeBus(up=False)
    first = _spool(down, memory_records=0, disk_dir=tmp_path, disk_bytes=1 << 20, segment_bytes=4096)
    await first.start()
    for i in range(300):
        await first.send("t", str(i).encode() + b" " * 60)
    await first.stop()
    segs = sorted(tmp_path.glob("*.seg"), key=lambda p: int(p.stem))
    assert len(segs) > 3
    data = bytearray(segs[1].read_bytes())
    data[100] ^= 0xFF  # flip a byte of the second segment's second frame
    segs[1].write_bytes(bytes(data))

    up = FakeBus()
    second = _spool(up, disk_dir=tmp_path)
    await second.start()
    await asyncio.wait_for(second.flush(), 5)
    await second.stop()
    got = _values(up.delivered)
    per_segment = 4096 // len(encode_frame(make_record("t", b"0" + b" " * 60, None, [])))
    lost = set(range(300)) - set(got)
    assert got == sorted(got) and len(got) == len(set(got))
    assert lost and all(per_segment <= v < 2 * per_segment for v in lost)  # only segment 2's tail


def test_bad_settings() -> None:
    fake = FakeBus()
    with pytest.raises(ValueError):
        SpoolingProducer(fake, memory_records=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SpoolingProducer(fake, disk_dir=Path("/tmp/x"), disk_bytes=1000)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SpoolingProducer(fake, flush_poll_s=0)  # type: ignore[arg-type]
