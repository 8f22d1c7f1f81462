"""No stage creates Kafka topics: a stage started before ``gpupool topics create`` exits 1 with one
message that names the missing topics and the command, and leaves the cluster as it was."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from contracts.bus import MemoryBus, MissingTopicsError, require_topics
from contracts.topics import KafkaTopics
from runtime.kafka import KafkaBus
from tests.services import REPO, create_stage_topics

STAGES = {
    "collect": (["--dcgm-target", "http://127.0.0.1:9/metrics"], ["telemetry.gpu", "telemetry.ib_port"]),
    "analytics": (["--db", "{tmp}/a.duckdb"], ["telemetry.gpu", "telemetry.ib_port", "capacity"]),
    "broker": (["--mqtt", "127.0.0.1:9"], ["capacity", "pool.demand", "leases.log"]),
}


async def _missing(bootstrap: str, names: list[str]) -> list[str]:
    bus = KafkaBus(bootstrap, client_id="gpupool-test")
    try:
        return await bus.missing_topics(names)
    finally:
        await bus.close()


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_stage_without_its_topics_exits_1_naming_topics_create(
    stage: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    topics = KafkaTopics(f"t{uuid.uuid4().hex}.")
    extra, needed = STAGES[stage]
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "gpupool"), stage, "run", "--kafka", kafka_bootstrap,
         "--topic-prefix", topics.prefix, "--metrics-port", "0", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "gpupool topics create" in done.stderr
    for name in needed:
        assert topics.prefix + name in done.stderr
    assert asyncio.run(_missing(kafka_bootstrap, topics.all())) == topics.all()  # nothing created


async def test_require_topics_passes_once_the_operator_created_them(kafka_bootstrap: str) -> None:
    topics = KafkaTopics(f"t{uuid.uuid4().hex}.")
    bus = KafkaBus(kafka_bootstrap, client_id="gpupool-test")
    try:
        with pytest.raises(MissingTopicsError) as caught:
            await require_topics(bus, [topics.capacity, topics.capacity, topics.leases_log])
        assert caught.value.missing == [topics.capacity, topics.leases_log]  # in order, once each
        await create_stage_topics(kafka_bootstrap, topics, partitions=1)
        await require_topics(bus, topics.all())
        assert await bus.missing_topics([*topics.all(), topics.prefix + "nope"]) == [topics.prefix + "nope"]
    finally:
        await bus.close()


async def test_the_in_process_bus_has_no_missing_topics() -> None:
    """The embedded bus (demo, unit tests) has no operator: it makes a topic on first use."""
    await require_topics(MemoryBus(), ["anything"])
