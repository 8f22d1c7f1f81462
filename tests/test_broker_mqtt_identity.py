"""The broker's identity and topics are its own (issue 10), over the real Mosquitto of
deploy/local/mosquitto.sh (generated config: ``use_username_as_clientid``, ACL, ``max_packet_size``):

* a site connecting with the broker's client id gets its own user name as client id instead, so
  the broker stays connected and keeps answering;
* a site cannot publish on its own ``leases/…`` or ``replies`` topics (retained or not): only the
  broker speaks there;
* a packet over ``max_packet_size`` is refused by Mosquitto (the client is disconnected and the
  message goes nowhere), one just under it passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import aiomqtt
import pytest

from broker.config import BrokerConfig
from broker.service import BrokerService
from contracts import Claim, KafkaTopics, MqttTopics, ReasonCode, Reply, decode, encode
from contracts.bus import MemoryBus
from contracts.mqtt import LIMITS
from tests.mqtt_support import running

pytestmark = pytest.mark.integration


def _client(creds: dict[str, Any], user: str, identifier: str, v5: bool = True) -> aiomqtt.Client:
    return aiomqtt.Client(
        creds["host"], creds["port"], username=user, password=creds["users"][user], identifier=identifier,
        protocol=aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311, timeout=5,
    )  # fmt: skip


async def _next(client: aiomqtt.Client, timeout_s: float) -> aiomqtt.Message | None:
    """The next live message within ``timeout_s`` (retained ones skipped), else ``None``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            async for msg in client.messages:
                if not msg.retain:
                    return msg
    return None


def _lost(svc: BrokerService) -> float:
    return svc.registry.get_sample_value("gpupool_broker_mqtt_connections_total", {"result": "lost"}) or 0.0


async def test_a_site_using_the_brokers_client_id_cannot_take_its_session(mosquitto: dict[str, Any]) -> None:
    t = MqttTopics(mosquitto["root"])
    svc = BrokerService(bus=MemoryBus(), topics=KafkaTopics(prefix="ident."), mqtt_host=mosquitto["host"],
                        mqtt_port=mosquitto["port"], mqtt_username="gpupool-broker",
                        mqtt_password=mosquitto["users"]["gpupool-broker"], root=mosquitto["root"], protocol=5,
                        config=BrokerConfig(), client_id="gpupool-broker")  # fmt: skip
    async with running(svc):
        lost = _lost(svc)
        async with _client(mosquitto, "edge-a", "gpupool-broker") as impostor:
            await impostor.subscribe(t.replies("edge-a"), qos=1)
            await asyncio.sleep(0.5)
            assert svc.stats()["mqtt_connected"] and _lost(svc) == lost, "the broker was knocked off"
            # the broker still answers, and the impostor's session is edge-a's, not the broker's
            claim = Claim(claim_id=f"c-{uuid.uuid4().hex[:8]}", site="edge-a", count=1, ts=time.time())
            await impostor.publish(t.claims("edge-a"), encode(claim), qos=1)
            msg = await _next(impostor, 5)
            assert msg is not None
            reply = decode(Reply, bytes(msg.payload))  # type: ignore[arg-type]
            assert (reply.in_reply_to, reply.code) == (claim.claim_id, ReasonCode.NO_MATCH)
            # a second login as edge-a (another client id) takes that session over: the id was edge-a
            async with _client(mosquitto, "edge-a", "another-id"):
                with pytest.raises(aiomqtt.MqttError):
                    async with asyncio.timeout(5):
                        async for _ in impostor.messages:
                            pass
        await asyncio.sleep(0.3)
        assert svc.stats()["mqtt_connected"] and _lost(svc) == lost


async def test_a_site_cannot_write_its_own_leases_or_replies(mosquitto: dict[str, Any]) -> None:
    t = MqttTopics(mosquitto["root"])
    forged_lease = t.lease("edge-a", f"lease-forged-{uuid.uuid4().hex[:8]}")
    async with _client(mosquitto, "gpupool-observer", "observer-forgery") as observer:
        await observer.subscribe(f"{t.root}/sites/edge-a/#", qos=1)
        async with _client(mosquitto, "edge-a", "edge-a-forger") as site:
            await site.publish(forged_lease, b'{"forged": true}', qos=1, retain=True)
            await site.publish(t.replies("edge-a"), b'{"forged": true}', qos=1, retain=True)
            await site.publish(t.replies("edge-a"), b'{"forged": true}', qos=1)
            await site.publish(t.renewals("edge-a"), b"control", qos=1)
        msg = await _next(observer, 5)
        assert msg is not None and msg.topic.value == t.renewals("edge-a"), "a forged message got through"
    # nothing retained on those topics either (a fresh subscriber would get it at once)
    async with _client(mosquitto, "gpupool-observer", "observer-retained") as fresh:
        await fresh.subscribe(forged_lease, qos=1)
        await fresh.subscribe(t.replies("edge-a"), qos=1)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                async for m in fresh.messages:
                    assert not m.payload or m.topic.value not in (forged_lease, t.replies("edge-a")), m.topic.value


@pytest.mark.parametrize("v5", [False, True])
async def test_an_oversized_publish_is_refused_by_mosquitto(mosquitto: dict[str, Any], v5: bool) -> None:
    t = MqttTopics(mosquitto["root"])
    topic = t.claims("edge-b")
    overhead = 2 + len(topic) + 2 + 5 + (1 if v5 else 0)  # topic length + topic, packet id, fixed header
    async with _client(mosquitto, "gpupool-observer", f"observer-size-{v5}") as observer:
        await observer.subscribe(topic, qos=1)
        async with _client(mosquitto, "edge-b", "edge-b-size", v5=v5) as site:
            fits = LIMITS.mosquitto_max_packet_bytes - overhead - 64
            await site.publish(topic, b"x" * fits, qos=1)
            msg = await _next(observer, 5)
            assert msg is not None and len(msg.payload) == fits  # type: ignore[arg-type]
            too_big = b"x" * (LIMITS.mosquitto_max_packet_bytes + 1)
            with pytest.raises(aiomqtt.MqttError):
                await site.publish(topic, too_big, qos=1, timeout=5)
                await site.publish(topic, b"after", qos=1, timeout=5)  # the connection is gone
        assert await _next(observer, 1.0) is None, "the oversized message was delivered"
