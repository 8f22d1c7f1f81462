"""``gpupool edge ...`` and ``gpupool broker demand`` as a user runs them: the commands run in
this thread (each with its own ``asyncio.run``) against a broker service and an amqtt server
running on an event loop in a background thread."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from broker.cli import broker_app, edge_app
from broker.config import BrokerConfig
from broker.service import BrokerService
from contracts import (
    CapacityUpdate,
    GpuState,
    KafkaTopics,
    LeaseState,
    PoolDemand,
    ReasonCode,
    decode,
    encode,
)
from contracts.bus import MemoryBus
from tests.services import create_stage_topics
from tests.support import settings_file
from broker.credentials import edge_client

runner = CliRunner()


class _Live:
    """amqtt + BrokerService + MemoryBus on a loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.bus = MemoryBus()
        self.topics = KafkaTopics()
        self.svc: BrokerService | None = None
        self._amqtt: Any = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def up(self) -> None:
        from amqtt.broker import Broker

        self._amqtt = Broker(
            {
                "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{self.port}"}},
                "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
            }
        )
        await self._amqtt.start()
        self.svc = BrokerService(
            bus=self.bus,
            topics=self.topics,
            mqtt_host="127.0.0.1",
            mqtt_port=self.port,
            protocol=4,
            config=BrokerConfig(notice_s=5, tick_s=0.05),
        )
        await self.svc.start()
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.svc.run(self._stop))
        await self.svc.wait_connected(10)
        now = time.time()
        for i in range(2):
            u = CapacityUpdate(
                ts=now,
                host="n1",
                gpu_uuid=f"GPU-{i}",
                state=GpuState.IDLE,
                since=now,
                predicted_idle_until=now + 3600,
            )
            await self.bus.producer().send(self.topics.capacity, encode(u), key=u.key)
        deadline = time.monotonic() + 5
        while not self.svc.book.offers and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def down(self) -> None:
        assert self._stop is not None and self._task is not None and self.svc is not None
        self._stop.set()
        await self._task
        await self.svc.stop()
        await self._amqtt.shutdown()


@pytest.fixture
def live() -> Iterator[_Live]:
    env = _Live()
    env.call(env.up())
    yield env
    env.call(env.down())
    env.loop.call_soon_threadsafe(env.loop.stop)
    env.thread.join(5)


def _edge(live: _Live, *args: str) -> Any:
    return runner.invoke(
        edge_app, [*args, "--site", "edge-a", "--mqtt", f"127.0.0.1:{live.port}", "--protocol", "4"]
    )


def test_edge_commands_print_json_and_exit_codes(live: _Live) -> None:
    res = _edge(live, "offers", "--timeout", "1")
    assert res.exit_code == 0, res.output
    (offer,) = json.loads(res.stdout)
    assert offer["host"] == "n1" and len(offer["gpus"]) == 2

    res = _edge(live, "claim", offer["offer_id"], "--count", "2", "--duration", "120")
    assert res.exit_code == 0, res.output
    lease = json.loads(res.stdout)
    assert lease["state"] == "granted" and len(lease["gpus"]) == 2 and lease["site"] == "edge-a"

    res = _edge(live, "claim", offer["offer_id"])
    assert res.exit_code == 1
    assert json.loads(res.stdout)["code"] == ReasonCode.GPU_UNAVAILABLE.value

    res = _edge(live, "renew", lease["lease_id"])
    assert res.exit_code == 0 and json.loads(res.stdout)["code"] == "ok"
    # "renewed until 2026-11-30T06:40:00Z (1796020130.998)": ISO-8601 UTC next to the epoch
    text = json.loads(res.stdout)["text"]
    found = re.fullmatch(r"renewed until (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) \((\d+\.\d{3})\)", text)
    assert found is not None, text
    iso = datetime.strptime(found[1], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert iso.timestamp() == int(float(found[2])) and 0 < float(found[2]) - time.time() < 400

    res = _edge(live, "watch", "--limit", "1")
    assert res.exit_code == 0, res.output
    (line,) = [json.loads(x) for x in res.stdout.splitlines()]
    assert line["type"] == "lease" and line["lease_id"] == lease["lease_id"] and line["state"] == "active"

    res = _edge(live, "release", lease["lease_id"])
    assert res.exit_code == 0 and json.loads(res.stdout)["lease_id"] == lease["lease_id"]
    assert live.svc is not None
    assert live.svc.book.leases[lease["lease_id"]].state is LeaseState.RELEASED

    res = _edge(live, "renew", lease["lease_id"])
    assert res.exit_code == 1 and json.loads(res.stdout)["code"] == ReasonCode.LEASE_NOT_LIVE.value


def test_edge_command_without_a_server_exits_2() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = runner.invoke(
        edge_app, ["offers", "--site", "edge-a", "--mqtt", f"127.0.0.1:{port}", "--timeout", "1"]
    )
    assert res.exit_code == 2 and "not reachable" in res.output
    res = runner.invoke(edge_app, ["offers", "--site", "edge-a", "--mqtt", "no-port"])
    assert res.exit_code == 2 and "host:port" in res.output


def test_broker_demand_lands_on_the_real_pool_demand_topic(kafka_bootstrap: str) -> None:
    from runtime.kafka import KafkaBus

    prefix = f"t{uuid.uuid4().hex}."
    asyncio.run(create_stage_topics(kafka_bootstrap, KafkaTopics(prefix)))
    res = runner.invoke(
        broker_app,
        [
            "demand",
            "--kafka",
            kafka_bootstrap,
            "--topic-prefix",
            prefix,
            "--gpu",
            "n1/GPU-0",
            "--gpu",
            "n1/GPU-1",
            "--reason",
            "job-42",
        ],
    )
    assert res.exit_code == 0, res.output
    sent = decode(PoolDemand, res.stdout.strip())
    assert sent.gpus == ["n1/GPU-0", "n1/GPU-1"] and sent.reason == "job-42"

    async def read() -> list[PoolDemand]:
        bus = KafkaBus(kafka_bootstrap)
        c = bus.consumer([KafkaTopics(prefix).pool_demand], f"reader-{uuid.uuid4().hex[:8]}")
        await c.start()
        try:
            for _ in range(40):
                got = await c.getmany(timeout_s=0.5)
                if got:
                    assert got[0].key == sent.demand_id
                    return [decode(PoolDemand, m.value) for m in got if m.value]
            return []
        finally:
            await c.stop()
            await bus.close()

    assert asyncio.run(read()) == [sent]


@pytest.mark.parametrize("wait", ["0", "5"])
def test_broker_demand_without_topics_names_topics_create_and_creates_nothing(
    kafka_bootstrap: str, wait: str
) -> None:
    """No topics under the prefix: exit 1 with one message naming `gpupool topics create`, no
    traceback, and neither pool.demand nor leases.log is created (the cluster auto-creates topics
    on produce, so a send would have made one)."""
    from runtime.kafka import KafkaBus

    topics = KafkaTopics(f"t{uuid.uuid4().hex}.")
    res = runner.invoke(
        broker_app,
        ["demand", "--kafka", kafka_bootstrap, "--topic-prefix", topics.prefix, "--count", "1", "--wait", wait],
    )
    assert res.exit_code == 1, res.output
    assert "gpupool topics create" in res.stderr and topics.pool_demand in res.stderr
    assert "Traceback" not in res.output and res.stdout == ""

    async def missing() -> list[str]:
        bus = KafkaBus(kafka_bootstrap)
        try:
            return await bus.missing_topics(topics.all())
        finally:
            await bus.close()

    assert asyncio.run(missing()) == topics.all()


# broker run: settings -------------------------------------------------------------------------------
def test_broker_run_takes_what_no_flag_gives_from_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flag > GPUPOOL_* > --config TOML > defaults, key by key; the metrics port defaults to the
    9412 deploy/prometheus scrapes; the password comes from the environment and stays secret."""
    from broker.cli import run_settings

    toml = settings_file(
        tmp_path,
        monkeypatch,
        'kafka = "k-file:9092"\nmqtt = "mqtt-file:1883"\nmqtt_root = "root-file"\n'
        "[broker]\nnotice_s = 45\nlease_ttl_s = 90\nfabric_dry_run = true\n",
    )
    monkeypatch.setenv("GPUPOOL_MQTT_PASSWORD", "pw-from-env")
    monkeypatch.setenv("GPUPOOL_BROKER__LEASE_TTL_S", "120")
    s = run_settings(toml, mqtt="mqtt-flag:8883", notice=None, fabric_dry_run=None, protocol=4)
    assert (s.kafka, s.mqtt_root) == ("k-file:9092", "root-file")
    assert (s.mqtt, s.mqtt_protocol) == ("mqtt-flag:8883", 4)
    assert (s.broker.notice_s, s.broker.lease_ttl_s, s.broker.fabric_dry_run) == (45.0, 120.0, True)
    assert s.metrics.broker == 9412 and s.broker.group_id == "gpupool-broker"
    assert s.mqtt_password is not None and s.mqtt_password.get_secret_value() == "pw-from-env"
    assert run_settings(toml, fabric_dry_run=False).broker.fabric_dry_run is False  # --no-fabric-dry-run
    assert (s.broker.tune_gc, s.broker.lease_log_linger_ms, s.mqtt_cafile) == (True, 0.0, None)  # defaults
    toml.write_text(
        toml.read_text().replace("[broker]\n", 'mqtt_cafile = "/etc/ca.pem"\n[broker]\ntune_gc = false\n')
    )
    s = run_settings(toml, lease_log_linger_ms=5.0)
    assert (s.broker.tune_gc, s.broker.lease_log_linger_ms) == (False, 5.0)
    assert s.mqtt_cafile == Path("/etc/ca.pem") and run_settings(toml, tune_gc=True).broker.tune_gc

    res = runner.invoke(broker_app, ["run", "--config", str(toml), "--mqtt", "no-port"])
    assert res.exit_code == 2 and "host:port" in res.output
    res = runner.invoke(broker_app, ["run"])
    assert res.exit_code == 2 and "GPUPOOL_KAFKA" in res.output


# broker demand: settings and --wait over real Kafka + Mosquitto -----------------------------------------
async def test_broker_demand_takes_kafka_from_the_config_and_waits_for_the_reclaim(
    kafka_bootstrap: str,
    kafka_bus: Any,
    kafka_stage_topics: KafkaTopics,
    mosquitto: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`gpupool broker demand --config FILE --count 1 --wait S` with no --kafka: Kafka and the
    topic prefix come from the file; it prints the demand, then the lease the broker turned
    reclaiming for it (reason demand:<id>), and stops before S once the demand is met."""
    from contracts import LeaseLogRecord
    from tests.mqtt_support import running
    from tests.test_broker_service import CFG, _idle, _offer_on

    kafka_topics = kafka_stage_topics
    toml = settings_file(tmp_path, monkeypatch, f'kafka = "{kafka_bootstrap}"\ntopic_prefix = "{kafka_topics.prefix}"\n')
    svc = BrokerService(
        bus=kafka_bus, topics=kafka_topics, mqtt_host=mosquitto["host"], mqtt_port=mosquitto["port"],
        mqtt_username="gpupool-broker", mqtt_password=mosquitto["users"]["gpupool-broker"],
        root=mosquitto["root"], protocol=5, config=CFG, client_id=f"gpupool-broker-demand-{uuid.uuid4().hex[:8]}",
    )  # fmt: skip
    site = edge_client(mosquitto, "edge-a", persistent=False, announce=False)
    async with running(svc), site:
        await _idle(kafka_bus, "dw-n1", 2, topics=kafka_topics)
        offer = await _offer_on(site, "dw-n1")
        lease = await site.claim(offer.offer_id, count=2, duration_seconds=600)
        t0 = time.monotonic()
        res = await asyncio.to_thread(
            runner.invoke,
            broker_app,
            ["demand", "--config", str(toml), "--count", "1", "--reason", "job-7", "--wait", "20"],
        )
        took = time.monotonic() - t0
        assert res.exit_code == 0, res.output
        first, *rest = res.stdout.splitlines()
        sent = decode(PoolDemand, first)
        assert sent.count == 1 and sent.reason == "job-7"
        (reclaimed,) = [decode(LeaseLogRecord, line) for line in rest]
        assert reclaimed.lease_id == lease.lease_id and reclaimed.state is LeaseState.RECLAIMING
        assert reclaimed.reason.startswith(f"demand:{sent.demand_id}")
        assert f"1 leases turned reclaiming for demand {sent.demand_id}" in res.stderr
        assert took < 15, took  # met: did not wait the whole 20 s
        assert svc.book.leases[lease.lease_id].state is LeaseState.RECLAIMING
        caplog.set_level(logging.INFO, logger="broker.service")
    # the broker says it stopped, as analytics does (analytics_stopped)
    (stopped,) = [r for r in caplog.records if r.getMessage() == "broker_stopped"]
    assert stopped.root == mosquitto["root"] and stopped.live_leases == 1  # type: ignore[attr-defined]

    # a demand nobody serves: the request alone, 0 leases after the wait
    res = await asyncio.to_thread(
        runner.invoke, broker_app, ["demand", "--config", str(toml), "--count", "1", "--wait", "1"]
    )
    assert res.exit_code == 0, res.output
    assert len(res.stdout.splitlines()) == 1 and "0 leases turned reclaiming" in res.stderr
    # GPUPOOL_CONFIG works as --config; no Kafka anywhere is a usage error
    monkeypatch.setenv("GPUPOOL_CONFIG", str(toml))
    res = await asyncio.to_thread(runner.invoke, broker_app, ["demand", "--count", "1"])
    assert res.exit_code == 0 and decode(PoolDemand, res.stdout.strip()).count == 1
    monkeypatch.delenv("GPUPOOL_CONFIG")
    res = await asyncio.to_thread(runner.invoke, broker_app, ["demand", "--count", "1"])
    assert res.exit_code == 2 and "GPUPOOL_KAFKA" in res.output
