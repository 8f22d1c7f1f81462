"""``gpupool topics create|list`` against the real local Kafka, each test on its own topic prefix."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from contracts.topics import KafkaTopics
from gpupool.cli import app
from runtime.kafka import KafkaBus


def _prefix() -> str:
    return f"t{uuid.uuid4().hex}."


def _invoke(*args: str) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(app, ["--log-level", "INFO", "topics", *args])
    doc = json.loads(result.stdout) if result.stdout.lstrip().startswith("{") else {}
    return result.exit_code, doc, result.output


def test_create_makes_every_topic_then_is_idempotent(kafka_bootstrap: str, tmp_path: Path) -> None:
    prefix = _prefix()
    topics = KafkaTopics(prefix=prefix)
    code, doc, out = _invoke("create", "--kafka", kafka_bootstrap, "--topic-prefix", prefix, "--partitions", "3")
    assert code == 0, out
    states = {t["name"]: t for t in doc["topics"]}
    assert list(states) == topics.all()
    assert doc["problems"] == []
    for name, t in states.items():
        assert t["exists"] and t["created"], t
        assert t["partitions"] == 3 and t["replication_factor"] == 1
        compacted = name in (topics.leases_log, topics.fabric_topology)
        assert t["cleanup_policy"] == ("compact" if compacted else "delete"), t

    code, again, out = _invoke("create", "--kafka", kafka_bootstrap, "--topic-prefix", prefix, "--partitions", "5")
    assert code == 0, out
    assert all(t["exists"] and not t["created"] and t["partitions"] == 3 for t in again["topics"])

    settings = tmp_path / "gpupool.toml"
    settings.write_text(f'kafka = "{kafka_bootstrap}"\ntopic_prefix = "{prefix}"\n')
    code, listed, out = _invoke("list", "--config", str(settings))
    assert code == 0, out
    assert [{k: v for k, v in t.items() if k != "created"} for t in listed["topics"]] == [
        {k: v for k, v in t.items() if k != "created"} for t in doc["topics"]
    ]


def test_mismatched_existing_telemetry_topic_is_reported(kafka_bootstrap: str) -> None:
    prefix = _prefix()
    topics = KafkaTopics(prefix=prefix)

    async def _premake() -> None:  # someone made telemetry.gpu by hand, with another count
        bus = KafkaBus(kafka_bootstrap, client_id="gpupool-test")
        try:
            await bus.create_topics([topics.telemetry_gpu, topics.leases_log], partitions=2)
        finally:
            await bus.close()

    asyncio.run(_premake())
    code, doc, out = _invoke("create", "--kafka", kafka_bootstrap, "--topic-prefix", prefix, "--partitions", "4")
    assert code == 1, out
    created = {t["name"]: t["created"] for t in doc["topics"]}
    assert created[topics.telemetry_gpu] is False and created[topics.telemetry_ib_port] is True
    problems = " | ".join(doc["problems"])
    assert "same count" in problems and f"{topics.leases_log} has cleanup.policy=delete" in problems


def test_list_of_an_empty_prefix_says_what_is_missing(kafka_bootstrap: str) -> None:
    prefix = _prefix()
    code, doc, out = _invoke("list", "--kafka", kafka_bootstrap, "--topic-prefix", prefix)
    assert code == 1, out
    assert all(not t["exists"] for t in doc["topics"])
    assert len(doc["problems"]) == len(KafkaTopics(prefix=prefix).all())  # one missing topic each


def test_create_without_kafka_is_a_usage_error(monkeypatch: Any) -> None:
    monkeypatch.delenv("GPUPOOL_KAFKA", raising=False)
    monkeypatch.delenv("GPUPOOL_CONFIG", raising=False)
    result = CliRunner().invoke(app, ["topics", "create"])
    assert result.exit_code == 2
    assert "no Kafka bootstrap servers" in result.output


def test_unreachable_kafka_exits_1_with_a_message() -> None:
    result = CliRunner().invoke(app, ["topics", "list", "--kafka", "127.0.0.1:1"])
    assert result.exit_code == 1
    assert "error: Kafka" in result.output
