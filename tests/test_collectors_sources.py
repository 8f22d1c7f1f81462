"""The readers of issue 15 wired into CollectorService (in-process bus): a UFM Telemetry endpoint
as a scrape target, nvidia-smi CSV queries as an nvidia-smi command, NVSwitch series of a
dcgm-exporter page on their own topic."""

from __future__ import annotations

import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from collectors.service import CollectorService
from contracts import IbPortSample, KafkaTopics, NvSwitchSample, decode, decode_gpu_samples
from contracts.bus import MemoryBus

FIX = Path(__file__).resolve().parent / "fixtures"
TOPICS = KafkaTopics(prefix="s.")
DCGM_WITH_SWITCH = (
    'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",Hostname="n1"} 5\n'
    'DCGM_FI_DEV_GPU_UTIL{gpu="1",Hostname="n1"} 7\n'
    'DCGM_FI_DEV_NVSWITCH_LINK_THROUGHPUT_TX{nvlink="0",nvswitch="2",Hostname="n1"} 100\n'
    'DCGM_FI_DEV_NVSWITCH_LINK_THROUGHPUT_TX{nvlink="1",nvswitch="2",Hostname="n1"} 200\n'
)


@pytest.fixture
async def server() -> AsyncIterator[str]:
    bodies = {
        "/ufm": (FIX / "ufm_telemetry" / "switch_ports.prom").read_text(),
        "/ufm-garbage": "hello\n",
        "/dcgm": DCGM_WITH_SWITCH,
    }

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=bodies[request.path])

    app = web.Application()
    for path in bodies:
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_ufm_telemetry_target_and_nvswitch_records(server: str) -> None:
    bus = MemoryBus()
    svc = CollectorService(
        bus=bus,
        topics=TOPICS,
        dcgm_targets=[f"{server}/dcgm"],
        sysfs_roots=[],
        ufm_targets=[f"{server}/ufm", f"{server}/ufm-garbage"],
        timeout_s=2.0,
    )
    await svc.start()
    try:
        stats = await svc.collect_once()
    finally:
        await svc.stop()
    assert (stats.targets, stats.targets_ok, dict(stats.failures)) == (3, 2, {"garbage": 1})
    assert (stats.gpu_samples, stats.nvswitches, stats.ib_ports) == (2, 1, 3)
    gpus = [s for m in bus.records(TOPICS.telemetry_gpu) for s in decode_gpu_samples(m.value or b"")]
    assert sorted(s.key for s in gpus) == ["n1/GPU-a", "n1/gpu1"]
    [sw] = [decode(NvSwitchSample, m.value) for m in bus.records(TOPICS.telemetry_nvswitch)]
    assert sw.key == "n1/nvswitch2" and bus.records(TOPICS.telemetry_nvswitch)[0].key == "n1"
    assert [v.value for v in sw.field_series["DCGM_FI_DEV_NVSWITCH_LINK_THROUGHPUT_TX"]] == [100, 200]
    ports = [decode(IbPortSample, m.value) for m in bus.records(TOPICS.telemetry_ib_port)]
    assert sorted((p.node_guid, p.port) for p in ports) == [
        ("0x0002c90300f172a0", 2), ("0x0002c90300f172a0", 3), ("0xb83fd20300da1138", 1),
    ]  # fmt: skip
    assert all(p.source == "ufm-telemetry" for p in ports)
    seqs = sorted([s.seq for s in gpus] + [sw.seq] + [p.seq for p in ports])
    assert seqs == list(range(6))  # one sequence over every record, no gap


async def test_nvidia_smi_csv_query_command(tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"
    csv = FIX / "nvidia_smi_csv" / "noheader_nounits.csv"
    fake.write_text(f"#!/bin/sh\ncat '{csv}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    cmd = [str(fake), "--query-gpu=index,uuid,utilization.gpu,memory.total,memory.used,power.draw",
           "--format=csv,noheader,nounits"]  # fmt: skip
    bus = MemoryBus()
    svc = CollectorService(bus=bus, topics=TOPICS, dcgm_targets=[], sysfs_roots=[], nvsmi_commands=[("n2", cmd)])
    await svc.start()
    try:
        stats = await svc.collect_once()
    finally:
        await svc.stop()
    assert (stats.targets_ok, stats.gpu_samples, dict(stats.rejected)) == (1, 2, {"unknown_error": 1})
    a, b = (s for m in bus.records(TOPICS.telemetry_gpu) for s in decode_gpu_samples(m.value or b""))
    assert (a.host, a.gpu_index, a.fields["DCGM_FI_DEV_GPU_UTIL"], a.source) == ("n2", 0, 87, "nvidia-smi")
    assert b.invalid == {"DCGM_FI_DEV_GPU_UTIL": "unknown_error"}


@pytest.mark.parametrize(
    ("kind", "file", "records", "rejected"),
    [
        ("ibstat", "ibstat/partial_then_ibpanic.txt", 1, 1),
        ("ufm-telemetry", "ufm_telemetry/switch_ports.prom", 3, 0),
        ("dcgmi-dmon", "dcgmi_dmon/power_temp_util.txt", 2, 1),
        ("nvidia-smi-csv", "nvidia_smi_csv/header_units.csv", 2, 0),
    ],
)
def test_parse_output_command(kind: str, file: str, records: int, rejected: int) -> None:
    import json

    from typer.testing import CliRunner

    from gpupool.cli import app

    result = CliRunner().invoke(app, ["collect", "parse-output", kind, str(FIX / file), "--host", "n9"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert sum("rejected" not in d for d in lines) == records and sum("rejected" in d for d in lines) == rejected
    bad = CliRunner().invoke(app, ["collect", "parse-output", "xml", str(FIX / file)])
    assert bad.exit_code == 2
