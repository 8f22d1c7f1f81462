"""The Mosquitto ACL and logins of deploy/local/mosquitto.sh + broker/acl.py, on a real broker.

Every denial is checked against a control message published right after it by the same client on
a topic the receiver may see: Mosquitto delivers one publisher's messages in order, so once the
control message has arrived a delivered forbidden message would already be there.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from broker.acl import BROKER_USER, DEFAULT_ROOT, DEFAULT_SITES, OBSERVER_USER, render_acl
from contracts.topics import MqttTopics
from tests.services import run_service, state_dir


def _sites(creds: dict[str, Any]) -> list[str]:
    sites = [u for u in creds["users"] if u not in (BROKER_USER, OBSERVER_USER)]
    assert len(sites) >= 2, f"need two sites in {sorted(creds['users'])}"
    return sites


@asynccontextmanager
async def _client(
    creds: dict[str, Any], user: str, password: str | None = None
) -> AsyncIterator[aiomqtt.Client]:
    async with aiomqtt.Client(
        creds["host"],
        int(creds["port"]),
        username=user,
        password=creds["users"][user] if password is None else password,
        identifier=f"test-{user}-{uuid.uuid4().hex[:8]}",
        protocol=aiomqtt.ProtocolVersion.V5,
        timeout=5,
    ) as client:
        yield client


async def _topics_until(client: aiomqtt.Client, control: str, timeout_s: float = 5.0) -> list[str]:
    """Topics of the live messages ``client`` receives, up to and including ``control``. Retained
    messages (left by other tests or runs on the persistent broker) are skipped."""
    seen: list[str] = []
    async with asyncio.timeout(timeout_s):
        async for msg in client.messages:
            if msg.retain:
                continue
            seen.append(msg.topic.value)
            if msg.topic.value == control:
                return seen
    return seen


async def test_site_login_works_and_wrong_password_is_refused(mosquitto: dict[str, Any]) -> None:
    site = _sites(mosquitto)[0]
    async with _client(mosquitto, site):
        pass
    with pytest.raises(aiomqtt.MqttError):
        async with _client(mosquitto, site, password="not-" + mosquitto["users"][site]):
            pass
    with pytest.raises(aiomqtt.MqttError):
        async with aiomqtt.Client(mosquitto["host"], int(mosquitto["port"]), timeout=5):  # anonymous
            pass


async def test_site_cannot_read_another_sites_subtree(mosquitto: dict[str, Any]) -> None:
    a, b = _sites(mosquitto)[:2]
    t = MqttTopics(mosquitto["root"])
    lease = f"test-{uuid.uuid4().hex}"
    async with _client(mosquitto, a) as site_a, _client(mosquitto, BROKER_USER) as broker:
        await site_a.subscribe(f"{t.root}/sites/{b}/#", qos=1)  # refused or granted: nothing may arrive
        await site_a.subscribe(t.leases_filter(a), qos=1)
        await broker.publish(t.lease(b, lease), b"for b only", qos=1)
        await broker.publish(t.lease(a, lease), b"control", qos=1)
        assert await _topics_until(site_a, t.lease(a, lease)) == [t.lease(a, lease)]


async def test_site_cannot_publish_offers_or_as_another_site(mosquitto: dict[str, Any]) -> None:
    a, b = _sites(mosquitto)[:2]
    t = MqttTopics(mosquitto["root"])
    offer = t.offer(f"test-{uuid.uuid4().hex}")
    async with _client(mosquitto, BROKER_USER) as broker, _client(mosquitto, a) as site_a:
        await broker.subscribe(t.offers_filter, qos=1)
        for f in t.site_inbound_filters:
            await broker.subscribe(f, qos=1)
        await site_a.publish(offer, b"forged offer", qos=1)
        await site_a.publish(t.claims(b), b"claim in b's name", qos=1)
        await site_a.publish(t.claims(a), b"control", qos=1)
        assert await _topics_until(broker, t.claims(a)) == [t.claims(a)]


async def test_broker_offers_and_state_reach_sites(mosquitto: dict[str, Any]) -> None:
    a = _sites(mosquitto)[0]
    t = MqttTopics(mosquitto["root"])
    offer = t.offer(f"test-{uuid.uuid4().hex}")
    async with _client(mosquitto, a) as site_a, _client(mosquitto, BROKER_USER) as broker:
        await site_a.subscribe(t.offers_filter, qos=1)
        await site_a.subscribe(t.broker_state, qos=1)
        await broker.publish(offer, b'{"offer": 1}', qos=1)
        await broker.publish(t.broker_state, b'{"state": "test"}', qos=1)  # not retained: leaves no trace
        assert await _topics_until(site_a, t.broker_state) == [offer, t.broker_state]


async def test_site_writes_and_reads_its_own_subtree(mosquitto: dict[str, Any]) -> None:
    a = _sites(mosquitto)[0]
    t = MqttTopics(mosquitto["root"])
    async with _client(mosquitto, a) as site_a, _client(mosquitto, BROKER_USER) as broker:
        await broker.subscribe(t.renewals(a), qos=1)
        await site_a.subscribe(t.replies(a), qos=1)
        await site_a.publish(t.renewals(a), b"beat", qos=1)
        assert await _topics_until(broker, t.renewals(a)) == [t.renewals(a)]
        await broker.publish(t.replies(a), b"ok", qos=1)
        assert await _topics_until(site_a, t.replies(a)) == [t.replies(a)]


def test_render_acl_rejects_names_that_would_widen_a_pattern() -> None:
    for bad in ["edge/a", "edge+", "#", "", "-x"]:
        with pytest.raises(ValueError):
            render_acl("gpupool/v1", [bad], BROKER_USER)
    with pytest.raises(ValueError):
        render_acl("gpupool/#", ["edge-a"], BROKER_USER)
    with pytest.raises(ValueError):
        render_acl("gpupool/v1", ["edge-a", BROKER_USER], BROKER_USER)
    acl = render_acl("gpupool/v1", ["edge-a"], BROKER_USER)
    assert "pattern write gpupool/v1/sites/%u/#" not in acl
    for kind in ("claims", "renewals", "releases", "state"):
        assert f"pattern write gpupool/v1/sites/%u/{kind}\n" in acl
    assert "topic readwrite gpupool/v1/#" in acl


def test_shipped_acl_is_rendered_from_broker_acl() -> None:
    shipped = Path(__file__).resolve().parents[1] / "deploy" / "mosquitto" / "acl"
    assert shipped.read_text() == render_acl(DEFAULT_ROOT, list(DEFAULT_SITES), BROKER_USER)


async def test_restart_keeps_port_credentials_and_retained_messages(mosquitto: dict[str, Any]) -> None:
    a = _sites(mosquitto)[0]
    t = MqttTopics(mosquitto["root"])
    lease = t.lease(a, f"test-{uuid.uuid4().hex}")
    async with _client(mosquitto, BROKER_USER) as broker:
        await broker.publish(lease, b'{"state": "active"}', qos=1, retain=True)

    assert run_service("mosquitto.sh", "stop").returncode == 0
    done = run_service("mosquitto.sh", "start")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{mosquitto['host']}:{mosquitto['port']}"
    creds = json.loads((state_dir() / "mosquitto" / "credentials.json").read_text())
    assert creds == mosquitto

    async with _client(mosquitto, a) as site_a:
        await site_a.subscribe(lease, qos=1)
        async with asyncio.timeout(5):
            msg = await anext(aiter(site_a.messages))
        assert (msg.topic.value, msg.payload, msg.retain) == (lease, b'{"state": "active"}', True)
    async with _client(mosquitto, BROKER_USER) as broker:
        await broker.publish(lease, b"", qos=1, retain=True)  # clear it: retained messages persist
