"""Exactly-once ingest over real Kafka: ``gpupool analytics run`` is SIGKILLed mid-stream and
restarted; the DuckDB file then holds every GPU sample exactly once.

The stage runs as its own process (the installed ``gpupool`` command), so the kill is a real
crash: no ``finally``, no flush, an open DuckDB transaction and uncommitted Kafka offsets. Progress
is read from the process's Prometheus endpoint (``gpupool_analytics_ingest_rows_total``,
``gpupool_analytics_consumer_lag_records``), because DuckDB lets no other process open the file
while the stage holds it.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import duckdb
import httpx
from prometheus_client.parser import text_string_to_metric_families

from analytics.classify import FB_USED, GPU_UTIL, GR_ENGINE_ACTIVE
from contracts import GpuSample, KafkaTopics, encode
from runtime.kafka import KafkaBus
from tests.services import create_stage_topics

GPUS = 200
PER_GPU = 100
N = GPUS * PER_GPU  # 20,000 samples, unique (gpu_key, seq)
PARTITIONS = 3
GPUPOOL = Path(sys.executable).with_name("gpupool")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _samples() -> list[GpuSample]:
    """N samples, 10 s apart per GPU, ending 100 s ago (well inside the raw retention)."""
    rng = random.Random(7)
    t_end = time.time() - 100
    out = []
    for seq in range(PER_GPU):
        for g in range(GPUS):
            out.append(
                GpuSample(
                    ts=t_end - (PER_GPU - seq) * 10.0,
                    host=f"node-{g // 8:03d}",
                    gpu_uuid=f"GPU-{g:08x}-crash",
                    gpu_index=g % 8,
                    model_name="NVIDIA H100 80GB HBM3",
                    fields={
                        GR_ENGINE_ACTIVE: rng.choice((0.0, 0.0, 0.02, 0.7)),
                        GPU_UTIL: rng.randrange(101),
                        FB_USED: rng.randrange(81_000),
                    },
                    seq=seq,
                )
            )
    return out


async def _produce(bus: KafkaBus, topic: str, samples: list[GpuSample], chunk: int, pause_s: float) -> None:
    producer = bus.producer("crash-test-producer")
    await producer.start()
    try:
        for i in range(0, len(samples), chunk):
            for s in samples[i : i + chunk]:
                await producer.send(topic, encode(s), key=s.key)
            await producer.flush()
            await asyncio.sleep(pause_s)
    finally:
        await producer.stop()


def _start_stage(
    bootstrap: str, db: Path, topics: KafkaTopics, group: str, port: int, log: Path
) -> subprocess.Popen[bytes]:
    assert GPUPOOL.exists(), f"{GPUPOOL} missing: install the project (pip install -e .)"
    cmd = [
        str(GPUPOOL), "--log-level", "INFO", "analytics", "run",
        "--kafka", bootstrap, "--db", str(db), "--topic-prefix", topics.prefix,
        "--group-id", group, "--metrics-port", str(port),
    ]  # fmt: skip
    with log.open("ab") as err:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


async def _metrics(
    client: httpx.AsyncClient, port: int
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of the stage's /metrics as ``{(name, sorted labels): value}`` ({} while not up)."""
    try:
        body = (await client.get(f"http://127.0.0.1:{port}/metrics", timeout=2.0)).text
    except httpx.HTTPError:
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
    }


async def _wait_for(
    what: str,
    proc: subprocess.Popen[bytes],
    port: int,
    check: Callable[[dict[tuple[str, tuple[tuple[str, str], ...]], float]], bool],
    timeout_s: float,
    log: Path,
) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"stage exited ({proc.returncode}) waiting for {what}:\n{_tail(log)}"
            if check(await _metrics(client, port)):
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}:\n{_tail(log)}")


def _ingested(m: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return m.get(("gpupool_analytics_ingest_rows_total", (("table", "gpu_samples"),)), 0.0)


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def _kill(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    proc.wait(timeout=30)


async def test_sigkill_mid_stream_then_restart_stores_every_sample_once(
    kafka_bootstrap: str, kafka_bus: KafkaBus, kafka_topics: KafkaTopics, tmp_path: Path
) -> None:
    topics = kafka_topics
    await create_stage_topics(kafka_bootstrap, topics, PARTITIONS)
    samples = _samples()
    db, log = tmp_path / "analytics.duckdb", tmp_path / "stage.log"
    group = f"analytics-crash-{uuid.uuid4().hex}"
    port = _free_port()

    first = _start_stage(kafka_bootstrap, db, topics, group, port, log)
    try:
        await _produce(kafka_bus, topics.telemetry_gpu, samples[:1000], chunk=1000, pause_s=0)
        await _wait_for("the first rows", first, port, lambda m: _ingested(m) > 0, 60, log)
        # The rest arrives while the stage is ingesting: 500 records every 50 ms.
        rest = asyncio.create_task(_produce(kafka_bus, topics.telemetry_gpu, samples[1000:], 500, 0.05))
        await _wait_for("6,000 rows", first, port, lambda m: _ingested(m) >= 6000, 60, log)
        _kill(first, signal.SIGKILL)
        await rest
    finally:
        _kill(first, signal.SIGKILL)

    # The crash left rows and offsets that agree, part of the stream only.
    con = duckdb.connect(str(db), read_only=True)
    try:
        [(n_killed, distinct_killed)] = con.execute(
            "SELECT count(*), count(DISTINCT (kafka_partition, kafka_offset)) FROM gpu_samples"
        ).fetchall()
        [(offsets_sum,)] = con.execute(
            "SELECT coalesce(sum(next_offset), 0) FROM consumer_offsets WHERE topic = ?",
            [topics.telemetry_gpu],
        ).fetchall()
    finally:
        con.close()
    assert 6000 <= n_killed < N, "the kill was not mid-stream"
    assert n_killed == distinct_killed == offsets_sum

    second = _start_stage(kafka_bootstrap, db, topics, group, port, log)
    try:

        def caught_up(m: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> bool:
            lag = {
                dict(labels)["partition"]: v
                for (name, labels), v in m.items()
                if name == "gpupool_analytics_consumer_lag_records"
                and dict(labels)["topic"] == topics.telemetry_gpu
            }
            return len(lag) == PARTITIONS and not any(lag.values())

        # The restart waits for the group to drop the killed member (session timeout 10 s).
        await _wait_for("lag 0 on every partition", second, port, caught_up, 60, log)
        _kill(second, signal.SIGTERM)
        assert second.returncode == 0, _tail(log)
    finally:
        _kill(second, signal.SIGKILL)

    con = duckdb.connect(str(db), read_only=True)
    try:
        [(n, distinct_seq, distinct_pos)] = con.execute(
            "SELECT count(*), count(DISTINCT (gpu_key, seq)), count(DISTINCT (kafka_partition, kafka_offset))"
            " FROM gpu_samples"
        ).fetchall()
        stored = set(con.execute("SELECT gpu_key, seq FROM gpu_samples").fetchall())
        [(offsets_sum,)] = con.execute(
            "SELECT sum(next_offset) FROM consumer_offsets WHERE topic = ?", [topics.telemetry_gpu]
        ).fetchall()
    finally:
        con.close()
    assert stored == {(s.key, s.seq) for s in samples}  # none missing
    assert n == distinct_seq == distinct_pos == offsets_sum == N  # none duplicated
