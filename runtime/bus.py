"""Choosing the bus a process uses: Kafka when a bootstrap address is configured, else in-process."""

from __future__ import annotations

from contracts.bus import Bus, MemoryBus


def make_bus(bootstrap_servers: str | None, *, client_id: str = "gpupool") -> Bus:
    """Return a :class:`runtime.kafka.KafkaBus` for ``bootstrap_servers`` (``host:port[,host:port]``),
    or a new :class:`contracts.bus.MemoryBus` when it is ``None`` or empty."""
    if not bootstrap_servers:
        return MemoryBus()
    from runtime.kafka import KafkaBus  # aiokafka is imported only when Kafka is used

    return KafkaBus(bootstrap_servers, client_id=client_id)
