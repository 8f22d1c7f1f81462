"""The Slurm source over the real local Slurm cluster (deploy/local/slurm.sh) and the real Kafka:
a training job holds GPUs 0-3 of gpu-node-001, a pending job is planned onto the node, the
source streams per-node records keyed by host, and analytics (joined with the scheduler) does
not offer the GPUs the job holds, though DCGM says idle, and cuts the others' window at the plan."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC
from pathlib import Path

import pytest

from analytics.classify import FB_USED, GR_ENGINE_ACTIVE, IdleConfig
from analytics.service import AnalyticsService
from collectors.slurm_collector import SlurmCollector
from collectors.slurm_parse import expand_hostlist, parse_slurm_time
from contracts import CapacityUpdate, GpuSample, GpuState, KafkaTopics, decode, encode
from contracts.bus import BusMessage, MemoryBus
from contracts.scheduler import SchedulerNode
from runtime.kafka import KafkaBus

HOST = "gpu-node-001"


def _slurm(conf: Path, *args: str) -> str:
    done = subprocess.run(
        list(args), capture_output=True, text=True, timeout=30, check=False,
        env={**os.environ, "SLURM_CONF": str(conf)},
    )  # fmt: skip
    assert done.returncode == 0, f"{args}: {done.stderr}"
    return done.stdout


def _sbatch(conf: Path, partition: str, gpus: int, name: str, wrap: str) -> str:
    """Submit ``wrap`` to ``partition`` on HOST with ``gpus`` GPUs (1 CPU, 5 min); its job id."""
    return _slurm(
        conf, "sbatch", "--parsable", "-p", partition, "-w", HOST, f"--gres=gpu:h100:{gpus}", "-c", "1",
        "-t", "5", "-J", name, "-o", "/dev/null", "--wrap", wrap,
    ).strip()  # fmt: skip


def _wait(pred: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.2)
    pytest.fail(f"not within {timeout_s} s: {what}")


async def _read(bus: KafkaBus, topic: str, count: int, timeout_s: float = 20.0) -> list[BusMessage]:
    consumer = bus.consumer([topic], f"g{uuid.uuid4().hex}")
    await consumer.start()
    out: list[BusMessage] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < count and time.monotonic() < deadline:
            out += await consumer.getmany(timeout_s=1.0)
    finally:
        await consumer.stop()
    return out


async def test_slurm_source_streams_allocations_and_plans_to_kafka(
    slurm_conf: Path, kafka_bus: KafkaBus, kafka_topics: KafkaTopics
) -> None:
    train = _sbatch(slurm_conf, "training", 4, "train-4", "sleep 120")
    big = ""
    try:
        state = ("squeue", "-h", "-j", train, "-o", "%T")
        _wait(lambda: _slurm(slurm_conf, *state).strip() == "RUNNING", 20, "RUNNING")
        # needs every GPU of the node: pends until the training job's time limit, planned onto HOST
        big = _sbatch(slurm_conf, "training", 8, "train-8", "sleep 1")

        def planned() -> bool:
            out = _slurm(slurm_conf, "squeue", "--start", "-h", "-j", big, "-o", "%S|%Y")
            return bool(re.match(r"\d{4}-", out)) and HOST in out

        _wait(planned, 20, "backfill estimate for the pending job")
        topic = kafka_topics.telemetry_scheduler
        await kafka_bus.create_topics([topic], partitions=3)
        collector = SlurmCollector(kafka_bus, kafka_topics, slurm_conf=slurm_conf)
        await collector.start()
        try:
            read = await collector.collect()
        finally:
            await collector.stop()
        assert read.ok and read.failure is None and read.produced == 4 and not read.problems
        squeue = _slurm(slurm_conf, "squeue", "--start", "-h", "-j", big, "-o", "%S|%Y")
        start_text, sched = squeue.strip().split("|")

        msgs = await _read(kafka_bus, topic, 4)
        assert len(msgs) == 4
        records = {m.key: decode(SchedulerNode, m.value or b"") for m in msgs}
        assert set(records) == {f"gpu-node-00{i}" for i in range(1, 5)}  # keyed by host
        node = records[HOST]
        held = [(g.index, g.job_id, g.partition, g.user, g.gres_type) for g in node.gpus if g.allocated]
        assert held == [(i, train, "training", "root", "h100") for i in range(4)]
        assert [g.index for g in node.gpus if not g.allocated] == [4, 5, 6, 7]
        [pending] = [p for p in node.pending if p.job_id == big]
        assert pending.gpus_per_node == 8 and pending.gpus == 8 and pending.partition == "training"
        assert HOST in pending.planned_nodes and HOST in expand_hostlist(sched)
        assert pending.planned_start == parse_slurm_time(start_text)  # squeue --start agrees
        assert node.next_planned_start() == pending.planned_start
        assert node.state in ("MIXED", "ALLOCATED") and node.schedulable
        assert abs(node.ts - time.time()) < 30

        # analytics over the same record: GPUs 0-3 are idle by DCGM but held by the job
        await _analytics_join(node)
    finally:
        _slurm(slurm_conf, "scancel", train, *([big] if big else []))


async def _analytics_join(node: SchedulerNode) -> None:
    """Feed ``node`` and 40 s of idle DCGM samples of its 8 GPUs to analytics joined with the
    scheduler; the held GPUs are not offered, nor are the free ones the pending job is planned
    onto (with the plan's start)."""
    bus, topics = MemoryBus(), KafkaTopics()
    now = [node.ts - 40]
    svc = AnalyticsService(
        bus=bus, topics=topics, db_path=":memory:", idle=IdleConfig(min_idle_s=30.0, stale_after_s=25.0),
        clock=lambda: now[0], refresh_s=3600.0, scheduler=True,
    )  # fmt: skip
    await svc.start()
    try:
        await bus.producer().send(topics.telemetry_scheduler, encode(node), key=node.partition_key)
        for t in range(0, 41, 10):
            now[0] = node.ts - 40 + t
            for i in range(8):
                s = GpuSample(
                    ts=now[0], host=HOST, gpu_uuid=f"GPU-{i}", gpu_index=i,
                    fields={GR_ENGINE_ACTIVE: 0.0, FB_USED: 0},
                )  # fmt: skip
                await bus.producer().send(topics.telemetry_gpu, encode(s), key=s.partition_key)
            while await svc.step(timeout_s=0.01):
                pass
        states = svc.current_states()
        for i in range(8):
            u: CapacityUpdate = states[f"{HOST}/GPU-{i}"]
            if i < 4:
                assert u.state is GpuState.UNKNOWN and u.reason == "scheduler_allocated", (i, u)
            else:  # free, but the pending 8-GPU job is planned onto them: not lent (issue 14)
                assert u.state is GpuState.UNKNOWN and u.reason == "scheduler_planned", (i, u)
                assert u.planned_start == node.next_planned_start()
        job = next(g.job_id for g in node.gpus if g.allocated)
        labels = {"partition": "training", "user": "root", "job": job or ""}
        assert svc.registry.get_sample_value("gpupool_analytics_allocated_idle_gpus", labels) == 4
    finally:
        await svc.stop()


async def test_a_failing_slurm_command_fails_that_read_only() -> None:
    bus = MemoryBus()
    topics = KafkaTopics()
    collector = SlurmCollector(bus, topics, run_prefix=["sh", "-c", "echo boom >&2; exit 3", "sh"])
    await collector.start()
    try:
        read = await collector.collect()
        assert not read.ok and read.failure is not None and read.failure.endswith(":exit_status")
        # the node and job commands run together: the one that failed first is counted
        labels = {"command": read.failure.removesuffix(":exit_status"), "reason": "exit_status"}
        assert labels["command"] in ("scontrol --all show node", "scontrol --all show job")
        assert read.records == [] and bus.records(topics.telemetry_scheduler) == []
        missing = SlurmCollector(bus, topics, run_prefix=["/nonexistent/scontrol-wrapper"])
        await missing.start()
        read = await missing.collect()
        assert read.failure is not None and read.failure.endswith(":not_found")
        await missing.stop()
        slow = SlurmCollector(bus, topics, run_prefix=["sh", "-c", "sleep 5", "sh"], timeout_s=0.3)
        await slow.start()
        t0 = time.monotonic()
        read = await slow.collect()
        assert read.failure is not None and read.failure.endswith(":timeout") and time.monotonic() - t0 < 3
        await slow.stop()
        garbage = SlurmCollector(bus, topics, run_prefix=["sh", "-c", "echo not slurm output", "sh"])
        await garbage.start()
        read = await garbage.collect()
        assert read.failure is not None and read.failure.endswith(":no_records")
        await garbage.stop()
    finally:
        await collector.stop()
    assert collector.metrics.registry.get_sample_value("gpupool_collector_slurm_errors_total", labels) == 1
    await asyncio.sleep(0)


async def test_pending_gpus_gauge_is_read_from_the_latest_read(tmp_path: Path) -> None:
    """``gpupool_collector_slurm_pending_gpus`` shows the latest read's pending GPUs by partition,
    on the registry the Slurm source was given (the collector service's); a partition with no
    pending GPU job left has no series."""
    from collectors.metrics import SlurmMetrics
    from collectors.service import CollectorService

    fixtures = Path(__file__).parent / "fixtures" / "slurm"
    jobs = tmp_path / "jobs.txt"
    jobs.write_text((fixtures / "jobs_mixed.txt").read_text())
    script = f'if [ "$4" = node ]; then cat {fixtures / "nodes_mixed.txt"}; else cat {jobs}; fi'
    bus, topics = MemoryBus(), KafkaTopics()
    svc = CollectorService(bus=bus, topics=topics, dcgm_targets=[], sysfs_roots=[])
    collector = SlurmCollector(bus, topics, run_prefix=["sh", "-c", script, "sh"], tz=UTC,
                               metrics=SlurmMetrics(svc.registry))  # fmt: skip
    gauge = "gpupool_collector_slurm_pending_gpus"
    await collector.start()
    try:
        assert svc.registry.get_sample_value(gauge, {"partition": "training"}) is None  # nothing read yet
        assert (await collector.collect()).ok
        assert svc.registry.get_sample_value(gauge, {"partition": "training"}) == 42
        assert svc.registry.get_sample_value(gauge, {"partition": "lent"}) is None
        running = [line for line in jobs.read_text().splitlines() if "JobState=PENDING" not in line]
        jobs.write_text("\n".join(running) + "\n")
        assert (await collector.collect()).ok
        assert svc.registry.get_sample_value(gauge, {"partition": "training"}) is None
        assert svc.registry.get_sample_value("gpupool_collector_slurm_records_total") == 8
    finally:
        await collector.stop()


async def test_collect_run_with_slurm_conf_streams_node_records(
    slurm_conf: Path, kafka_bus: KafkaBus, kafka_stage_topics: KafkaTopics
) -> None:
    """``gpupool collect run --slurm-conf`` alone (no GPU source) reads Slurm every
    --slurm-interval and produces to the prefixed telemetry.scheduler, until SIGTERM (the
    topics created first, as an operator does)."""
    kafka_topics = kafka_stage_topics
    topic = kafka_topics.telemetry_scheduler
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "gpupool"), "collect", "run",
            "--kafka", kafka_bus.bootstrap_servers,
            "--topic-prefix", kafka_topics.prefix, "--slurm-conf", str(slurm_conf), "--slurm-interval", "0.5",
            "--metrics-port", "0",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        msgs = await _read(kafka_bus, topic, 8, timeout_s=30.0)  # two reads of four nodes
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert len(msgs) >= 8
    hosts = [decode(SchedulerNode, m.value or b"").host for m in msgs]
    assert {m.key for m in msgs} == set(hosts) == {f"gpu-node-00{i}" for i in range(1, 5)}
    assert all(len(decode(SchedulerNode, m.value or b"").gpus) == 8 for m in msgs)


async def test_a_pending_placeholder_slurm_plans_is_no_demand(slurm_conf: Path) -> None:
    """Slurm's backfill plans gpupool's own pending placeholder (``SchedNodeList``, ``StartTime``)
    as it plans training jobs; analytics must not take it for a training job: it withholds no
    GPU (``planned_gpus``), cuts no window and puts no lease at risk."""
    from analytics.scheduler import planned_gpus
    from contracts.scheduler import LENT_JOB_NAME

    train = _sbatch(slurm_conf, "training", 8, "train-8", "sleep 120")
    held = ""
    try:
        state = ("squeue", "-h", "-j", train, "-o", "%T")
        _wait(lambda: _slurm(slurm_conf, *state).strip() == "RUNNING", 20, "RUNNING")
        held = _sbatch(slurm_conf, "lent", 1, LENT_JOB_NAME, "sleep 120")

        def planned() -> bool:
            out = _slurm(slurm_conf, "squeue", "--start", "-h", "-j", held, "-o", "%S|%Y")
            return bool(re.match(r"\d{4}-", out)) and HOST in out

        _wait(planned, 20, "backfill estimate for the pending placeholder")
        bus, topics = MemoryBus(), KafkaTopics()
        collector = SlurmCollector(bus, topics, slurm_conf=slurm_conf)
        await collector.start()
        try:
            read = await collector.collect()
        finally:
            await collector.stop()
        node = next(r for r in read.records if r.host == HOST)
        [pending] = [p for p in node.pending if p.job_id == held]
        assert pending.job_name == LENT_JOB_NAME and pending.planned_start is not None
        assert HOST in pending.planned_nodes
        assert node.planned_training() == [] and node.next_planned_start() is None
        assert planned_gpus(node) == {}
    finally:
        _slurm(slurm_conf, "scancel", train, *([held] if held else []))
