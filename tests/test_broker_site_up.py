"""``gpupool_broker_site_up{site}``: the broker exports each edge site's retained birth / Last Will
(``sites/{site}/state``, :class:`contracts.PeerState`) as 1 online / 0 offline; the
GpupoolEdgeSiteOffline alert (deploy/prometheus) reads it.

Over a real MQTT server: amqtt in this process (the demo's embedded broker, MQTT 3.1.1), the
in-process bus. The gauge is read from the default registry, as Prometheus would scrape it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiomqtt
import pytest

from broker.config import BrokerConfig
from broker.edge import EdgeClient
from broker.service import BrokerService
from contracts import KafkaTopics, MqttTopics, PeerState, encode
from contracts.bus import MemoryBus
from gpupool.embedded_mqtt import EmbeddedMqttBroker
from tests.mqtt_support import running, until
from tests.support import Clock

MT = MqttTopics()
CFG = BrokerConfig(tick_s=0.05, reconnect_min_s=0.05, reconnect_max_s=0.5)


def _up(svc: BrokerService, site: str) -> float | None:
    return svc.registry.get_sample_value("gpupool_broker_site_up", {"site": site})


def _malformed(svc: BrokerService) -> float:
    value = svc.registry.get_sample_value("gpupool_broker_rejected_messages_total", {"reason": "malformed_state"})
    return value or 0.0


@contextlib.asynccontextmanager
async def _broker(port: int) -> AsyncIterator[BrokerService]:
    svc = BrokerService(
        bus=MemoryBus(), topics=KafkaTopics(), mqtt_host="127.0.0.1", mqtt_port=port, protocol=4, config=CFG
    )
    async with running(svc):
        yield svc


def _state(*, online: bool, seq: int) -> bytes:
    return encode(PeerState(peer="edge-up-b", online=online, seq=seq, ts=float(seq)))


async def _publish_state(port: int, site: str, payload: bytes) -> None:
    async with aiomqtt.Client(
        "127.0.0.1", port, identifier=f"probe-{site}", protocol=aiomqtt.ProtocolVersion.V311
    ) as c:
        await c.publish(MT.site_state(site), payload, qos=1, retain=True)


async def test_site_up_follows_birth_goodbye_and_clearing() -> None:
    async with EmbeddedMqttBroker() as server, _broker(server.port) as svc:
        site = EdgeClient(site="edge-up-a", host="127.0.0.1", port=server.port, protocol=4)
        async with site:
            await until(lambda: _up(svc, "edge-up-a") == 1.0, 5, "site_up 1 after the birth")
        # a clean exit publishes the site's death (online false, retained)
        await until(lambda: _up(svc, "edge-up-a") == 0.0, 5, "site_up 0 after the goodbye")

        # a late Last Will of an older session (lower seq) does not turn a newer birth offline
        await _publish_state(server.port, "edge-up-b", _state(online=True, seq=5))
        await until(lambda: _up(svc, "edge-up-b") == 1.0, 5, "site_up of edge-up-b")
        await _publish_state(server.port, "edge-up-b", _state(online=False, seq=4))
        await asyncio.sleep(0.3)
        assert _up(svc, "edge-up-b") == 1.0

        # garbage is counted and changes nothing; clearing the retained state removes the series
        before = _malformed(svc)
        await _publish_state(server.port, "edge-up-b", b"{not json")
        await until(lambda: _malformed(svc) > before, 5, "malformed_state counted")
        assert _up(svc, "edge-up-b") == 1.0
        await _publish_state(server.port, "edge-up-b", b"")
        await until(lambda: _up(svc, "edge-up-b") is None, 5, "series removed when the state is cleared")
        assert _up(svc, "edge-up-a") == 0.0


FORGET_S = 100.0


def _decided(svc: BrokerService, site: str) -> float | None:
    return svc.registry.get_sample_value(
        "gpupool_broker_claim_decisions_total", {"site": site, "kind": "offer", "result": "unknown_offer"}
    )


async def test_a_site_offline_for_site_forget_after_s_loses_its_series() -> None:
    """A site offline (its goodbye) for ``site_forget_after_s`` by the broker's clock is forgotten:
    its site_up and claim-decision series are gone; just under that it is still there (0). A
    site holding a live lease is kept however long it is offline; a birth makes a site new."""
    from broker.edge import BrokerRejected
    from tests.test_broker_service import _idle, _offer_on

    clock = Clock(time.time())
    bus = MemoryBus()
    cfg = CFG.model_copy(update={"site_forget_after_s": FORGET_S, "lease_ttl_s": 1e6, "offer_ttl_s": 1e6})
    async with EmbeddedMqttBroker() as server:
        svc = BrokerService(bus=bus, topics=KafkaTopics(), mqtt_host="127.0.0.1", mqtt_port=server.port,
                            protocol=4, config=cfg, clock=clock)  # fmt: skip
        async with running(svc):
            gone = EdgeClient(site="edge-gone", host="127.0.0.1", port=server.port, protocol=4)
            holder = EdgeClient(site="edge-holds", host="127.0.0.1", port=server.port, protocol=4)
            async with gone, holder:
                with pytest.raises(BrokerRejected):
                    await gone.claim("no-such-offer")
                await _idle(bus, "n1", 1)
                await holder.claim((await _offer_on(holder, "n1")).offer_id, count=1, duration_seconds=1e5)
                await until(lambda: _up(svc, "edge-gone") == 1.0 and _up(svc, "edge-holds") == 1.0, 5, "both online")
            await until(lambda: _up(svc, "edge-gone") == 0.0 and _up(svc, "edge-holds") == 0.0, 5, "both offline")
            assert _decided(svc, "edge-gone") == 1.0
            clock.t += FORGET_S - 0.5
            await asyncio.sleep(0.3)  # a few ticks (tick_s 0.05)
            assert _up(svc, "edge-gone") == 0.0 and _decided(svc, "edge-gone") == 1.0  # just under: kept
            clock.t += 0.5
            await until(lambda: _up(svc, "edge-gone") is None, 5, "edge-gone forgotten")
            assert _decided(svc, "edge-gone") is None
            assert _up(svc, "edge-holds") == 0.0  # offline as long, but it holds a live lease
            clock.t += 10 * FORGET_S
            await asyncio.sleep(0.3)
            assert _up(svc, "edge-holds") == 0.0
            async with EdgeClient(site="edge-gone", host="127.0.0.1", port=server.port, protocol=4):
                await until(lambda: _up(svc, "edge-gone") == 1.0, 5, "edge-gone back as a new site")
