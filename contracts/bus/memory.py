"""In-process bus: the embedded default (demo, unit tests). Kafka semantics, no durability."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from contracts.bus.api import BusMessage, OnAssign, TopicPartition, check_linger, partition_for


class _Topic:
    def __init__(self, name: str, partitions: int) -> None:
        self.name = name
        self.logs: list[list[BusMessage]] = [[] for _ in range(partitions)]


class MemoryBus:
    """A bus held in this process's memory; see :class:`contracts.bus.api.Bus`.

    Topics are created on first use with ``default_partitions`` partitions. Group offsets are
    kept per ``(group, topic, partition)``. One group's partitions are split over its started
    members, re-split whenever a member starts or stops: partition ``p`` of every topic goes to
    member ``p mod n`` (in joining order), so topics with the same partition count are
    co-partitioned, as with Kafka's range assignor (:mod:`contracts.topics`: a host's GPU and port
    samples meet).
    """

    def __init__(self, default_partitions: int = 1) -> None:
        self.default_partitions = default_partitions
        self._topics: dict[str, _Topic] = {}
        self._committed: dict[tuple[str, TopicPartition], int] = {}
        self._members: dict[str, list[MemoryConsumer]] = {}
        self._changed = asyncio.Condition()

    def topic(self, name: str) -> _Topic:
        """The topic ``name``, created if new."""
        t = self._topics.get(name)
        if t is None:
            t = self._topics[name] = _Topic(name, self.default_partitions)
        return t

    def records(self, topic: str) -> list[BusMessage]:
        """Every record of ``topic`` in partition then offset order (for tests and the demo)."""
        return [m for log in self.topic(topic).logs for m in log]

    async def append(
        self, topic: str, value: bytes | None, key: str | None, headers: Sequence[tuple[str, bytes]]
    ) -> None:
        """Append one record and wake waiting consumers."""
        t = self.topic(topic)
        p = partition_for(key, len(t.logs))
        log = t.logs[p]
        log.append(BusMessage(topic, p, len(log), key, value, tuple(headers), int(time.time() * 1000)))
        async with self._changed:
            self._changed.notify_all()

    async def wait_for_change(self, timeout_s: float) -> None:
        """Sleep until a record is appended or ``timeout_s`` passes."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except TimeoutError:
                pass

    def producer(self, client_id: str = "gpupool", *, linger_ms: float | None = None) -> MemoryProducer:
        """A producer appending to this bus. Records are appended on send, so ``linger_ms`` has
        nothing to tune: it is only checked (``ValueError`` if negative)."""
        check_linger(linger_ms)
        return MemoryProducer(self)

    def consumer(
        self,
        topics: Sequence[str],
        group_id: str,
        *,
        client_id: str = "gpupool",
        on_assign: OnAssign | None = None,
    ) -> MemoryConsumer:
        """A consumer of ``topics`` in ``group_id``."""
        return MemoryConsumer(self, list(topics), group_id, on_assign)

    async def create_topics(
        self, names: Sequence[str], partitions: int = 1, compacted: Sequence[str] = ()
    ) -> None:
        """Create topics with ``partitions`` partitions (compaction is not simulated)."""
        for n in names:
            if n not in self._topics:
                self._topics[n] = _Topic(n, partitions)

    async def missing_topics(self, names: Sequence[str]) -> list[str]:
        """None: the in-process bus makes a topic on first use (it has no operator)."""
        return []

    async def close(self) -> None:
        """Nothing to release."""

    # group membership -----------------------------------------------------------------------
    def _rebalance(self, group: str) -> None:
        members = self._members.get(group, [])
        for m in members:
            m._assigned = set()
        if not members:
            return
        tps = sorted(
            {TopicPartition(t, p) for m in members for t in m.topics for p in range(len(self.topic(t).logs))}
        )
        for tp in tps:
            members[tp.partition % len(members)]._assigned.add(tp)
        for m in members:
            m._needs_positions = True

    def committed(self, group: str, tp: TopicPartition) -> int:
        """The group's committed offset of ``tp`` (0 if none)."""
        return self._committed.get((group, tp), 0)


class MemoryProducer:
    """Producer of a :class:`MemoryBus`."""

    def __init__(self, bus: MemoryBus) -> None:
        self._bus = bus

    async def start(self) -> None:
        """Nothing to connect."""

    async def stop(self) -> None:
        """Nothing to flush."""

    async def send(
        self, topic: str, value: bytes | None, key: str | None = None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        """Append the record at once."""
        await self._bus.append(topic, value, key, headers)

    async def flush(self) -> None:
        """Records are appended on send: nothing pending."""


class MemoryConsumer:
    """Consumer of a :class:`MemoryBus`."""

    def __init__(self, bus: MemoryBus, topics: list[str], group: str, on_assign: OnAssign | None) -> None:
        self._bus = bus
        self.topics = topics
        self.group = group
        self._on_assign = on_assign
        self._assigned: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}
        self._needs_positions = False

    async def start(self) -> None:
        """Join the group (rebalances it)."""
        self._bus._members.setdefault(self.group, []).append(self)
        self._bus._rebalance(self.group)

    async def stop(self) -> None:
        """Leave the group (rebalances it)."""
        members = self._bus._members.get(self.group, [])
        if self in members:
            members.remove(self)
        self._bus._rebalance(self.group)

    def assignment(self) -> set[TopicPartition]:
        """Partitions owned now."""
        return set(self._assigned)

    async def end_offsets(self) -> dict[TopicPartition, int]:
        """Length of each owned partition's log."""
        return {tp: len(self._bus.topic(tp.topic).logs[tp.partition]) for tp in self._assigned}

    async def position(self, tp: TopicPartition) -> int:
        """The offset of the next record of owned partition ``tp``. Raises ``KeyError`` if it is
        not owned."""
        if tp not in self._assigned:
            raise KeyError(f"{tp} is not assigned to this consumer")
        if self._needs_positions:
            await self._refresh_positions()
        return self._positions.get(tp, 0)

    async def _refresh_positions(self) -> None:
        self._needs_positions = False
        self._positions = {tp: self._bus.committed(self.group, tp) for tp in self._assigned}
        if self._on_assign is not None:
            self._positions.update(await self._on_assign(set(self._assigned)))

    async def getmany(self, timeout_s: float = 1.0, max_records: int = 1000) -> list[BusMessage]:
        """Up to ``max_records`` records past the current positions, waiting up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._needs_positions:
                await self._refresh_positions()
            out: list[BusMessage] = []
            for tp in sorted(self._assigned):
                log = self._bus.topic(tp.topic).logs[tp.partition]
                pos = self._positions.get(tp, 0)
                take = log[pos : pos + max_records - len(out)]
                out.extend(take)
                self._positions[tp] = pos + len(take)
                if len(out) >= max_records:
                    break
            remaining = deadline - time.monotonic()
            if out or remaining <= 0:
                return out
            await self._bus.wait_for_change(remaining)

    async def commit(self) -> None:
        """Commit the current positions for the group."""
        for tp, pos in self._positions.items():
            self._bus._committed[(self.group, tp)] = pos
