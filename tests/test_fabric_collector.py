"""FabricCollector against stand-in diag commands: every failure kind is counted and the sweep goes on.

The stand-ins are small Python scripts that print real-format output (or hang, fail, print
nothing) depending on the LID asked; no fabric is needed. The real thing is tested in
``test_fabric_ibsim.py``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from collectors.fabric_collector import FabricCollector
from contracts.base import decode
from contracts.bus import MemoryBus
from contracts.fabric import FabricTopology
from contracts.telemetry import IbPortSample
from contracts.topics import KafkaTopics

TOPOLOGY = """\
SW    10  1 0x0000000000000a10 4x EDR - CA    11  1 0x0000000000000b11 ( 'sw-a' - 'h11 mlx5_0' )
SW    10  2 0x0000000000000a10 4x EDR - CA    12  1 0x0000000000000b12 ( 'sw-a' - 'h12 mlx5_0' )
SW    10  3 0x0000000000000a10 4x EDR                                    'sw-a'
SW    20  1 0x0000000000000a20 4x HDR - CA    13  1 0x0000000000000b13 ( 'sw-b' - 'h13 mlx5_0' )
SW    20  2 0x0000000000000a20 4x HDR - CA    14  1 0x0000000000000b14 ( 'sw-b' - 'h14 mlx5_0' )
CA    11  1 0x0000000000000b11 4x EDR - SW    10  1 0x0000000000000a10 ( 'h11 mlx5_0' - 'sw-a' )
CA    12  1 0x0000000000000b12 4x EDR - SW    10  2 0x0000000000000a10 ( 'h12 mlx5_0' - 'sw-a' )
CA    13  1 0x0000000000000b13 4x HDR - SW    20  1 0x0000000000000a20 ( 'h13 mlx5_0' - 'sw-b' )
CA    14  1 0x0000000000000b14 4x HDR - SW    20  2 0x0000000000000a20 ( 'h14 mlx5_0' - 'sw-b' )
this line is garbage
"""

PERFQUERY = r"""
import os, sys, time
args = [a for a in sys.argv[1:]]
extended = "-x" in args
args = [a for a in args if a != "-x"]
lid, ports = int(args[0]), [int(p) for p in args[1].split(",")]
with open(sys.argv[0] + ".log", "a") as log:
    log.write(f"{'x' if extended else 'legacy'} {lid} {args[1]}\n")
with open(sys.argv[0] + ".cwd", "a") as log:
    log.write(os.getcwd() + "\n")
if lid == 11:
    time.sleep(30)
if lid == 12:
    sys.stderr.write("ibwarn: [1] mad_rpc: _do_madrpc failed; dport (Lid 12)\n"
                     "perfquery: iberror: failed: classportinfo query\n")
    sys.exit(255)
if lid == 13:
    sys.exit(0)
if lid == 20:
    ports = ports[:1]
for p in ports:
    if extended:
        print(f"# Port extended counters: Lid {lid} port {p} (CapMask: 0x5300 CapMask2: 0x0000002)")
        print(f"PortSelect:......................{p}")
        print("CounterSelect:...................0x0000")
        print(f"PortXmitData:....................{2**60 + lid * 100 + p}")
        print("PortRcvData:.....................7")
        if lid != 14:
            print("PortXmitWait:....................3")
    else:
        print(f"# Port counters: Lid {lid} port {p} (CapMask: 0x1300)")
        print(f"PortSelect:......................{p}")
        print("PortXmitData:....................4294967295")
        print("PortXmitWait:....................65535")
        print("SymbolErrorCounter:..............65535")
"""


def _err(fc: FabricCollector, reason: str) -> float:
    return fc.metrics.registry.get_sample_value("gpupool_collector_fabric_errors_total", {"reason": reason}) or 0.0


def _timeouts(fc: FabricCollector) -> float:
    return fc.metrics.registry.get_sample_value("gpupool_collector_fabric_timeouts_total") or 0.0


@pytest.fixture
def tools(tmp_path: Path) -> tuple[Path, Path]:
    ibnet = tmp_path / "ibnetdiscover"
    ibnet.write_text(
        f"#!{sys.executable}\nimport sys\nassert sys.argv[1:] == ['-p']\nprint({TOPOLOGY!r}, end='')\n"
    )
    perf = tmp_path / "perfquery"
    perf.write_text(f"#!{sys.executable}\n{PERFQUERY}")
    for p in (ibnet, perf):
        p.chmod(0o755)
    return ibnet, perf


def _collector(
    tools: tuple[Path, Path], bus: MemoryBus | None = None, topics: KafkaTopics | None = None, **options: Any
) -> FabricCollector:
    """A collector running the fake ``tools`` (ibnetdiscover, perfquery) on ``bus`` (default a new
    in-process bus); ``options`` are further ``FabricCollector`` keyword arguments."""
    ibnet, perf = tools
    return FabricCollector(
        bus or MemoryBus(), topics or KafkaTopics(), perfquery=str(perf), ibnetdiscover=str(ibnet), **options
    )


async def test_sweep_counts_every_failure_and_keeps_going(tools: tuple[Path, Path], tmp_path: Path) -> None:
    _, perf = tools
    bus, topics = MemoryBus(), KafkaTopics(prefix="t.")
    async with _collector(tools, bus, topics, timeout_s=0.8, concurrency=4, workdir=tmp_path / "work") as fc:
        topo = await fc.discover()
        assert len(topo.ports) == 9 and [p.reason for p in topo.problems] == ["too_few_fields"]
        t0 = time.monotonic()
        samples = await fc.sweep()
        elapsed = time.monotonic() - t0
    assert elapsed < 5, "the hung perfquery was not killed at its timeout"
    got = {(s.node_guid, s.port): s for s in samples}
    # sw-a ports 1, 2 (3 never had a peer), sw-b port 1 (port 2 missing from the output), h14 via legacy too
    assert sorted(got) == [
        ("0x0000000000000a10", 1),
        ("0x0000000000000a10", 2),
        ("0x0000000000000a20", 1),
        ("0x0000000000000b14", 1),
    ]
    assert got[("0x0000000000000a10", 2)].counters["PortXmitData"] == 2**60 + 1002
    h14 = got[("0x0000000000000b14", 1)]
    assert h14.counters["PortXmitData"] == 2**60 + 1401 and h14.counter_bits["PortXmitData"] == 64
    assert h14.counters["PortXmitWait"] == 65535 and h14.counter_bits["PortXmitWait"] == 32
    assert h14.counters["SymbolErrorCounter"] == 65535 and h14.saturated == ["SymbolErrorCounter"]
    assert (h14.host, h14.device, h14.rate_bytes_per_second) == ("h14", "mlx5_0", 25_000_000_000)
    assert _err(fc, "timeout") == 1 and _timeouts(fc) == 1
    assert _err(fc, "unreachable") == 1
    assert _err(fc, "empty_output") == 1
    assert _err(fc, "missing_port") == 1
    assert _err(fc, "too_few_fields") == 1
    # switches first, then CAs; legacy only where PortXmitWait was missing
    calls = (perf.parent / "perfquery.log").read_text().split("\n")
    assert calls[:2] == ["x 10 1,2", "x 20 1,2"] or calls[:2] == ["x 20 1,2", "x 10 1,2"]
    assert sum(c.startswith("legacy") for c in calls) == 1 and "legacy 14 1" in calls
    # records on the bus: one topology under the compaction key, the samples under their host
    topo_recs = bus.records(topics.fabric_topology)
    assert [r.key for r in topo_recs] == ["topology"]
    rec = decode(FabricTopology, topo_recs[0].value or b"")
    assert len(rec.nodes) == 6 and len(rec.links) == 4 and rec.problems == 1
    ib = bus.records(topics.telemetry_ib_port)
    assert sorted(r.key or "" for r in ib) == sorted(s.partition_key for s in samples)
    assert decode(IbPortSample, ib[0].value or b"") in samples
    assert not list((tmp_path / "work").glob("sys-*"))


async def test_a_port_that_loses_its_peer_is_reported_down(tools: tuple[Path, Path], tmp_path: Path) -> None:
    ibnet, _ = tools
    bus, topics = MemoryBus(), KafkaTopics()
    async with _collector(tools, bus, topics, timeout_s=0.5, include_cas=False) as fc:
        await fc.discover()
        first = {(s.node_guid, s.port): s for s in await fc.sweep()}
        assert first[("0x0000000000000a10", 1)].phys_state == "LinkUp"
        # h11's link goes down: sw-a port 1 has no peer any more, h11 disappears
        ibnet.write_text(
            ibnet.read_text()
            .replace(
                "SW    10  1 0x0000000000000a10 4x EDR - CA    11  1 0x0000000000000b11"
                " ( 'sw-a' - 'h11 mlx5_0' )",
                "SW    10  1 0x0000000000000a10 4x EDR                                    'sw-a'",
            )
            .replace(
                "CA    11  1 0x0000000000000b11 4x EDR - SW    10  1 0x0000000000000a10"
                " ( 'h11 mlx5_0' - 'sw-a' )\n",
                "",
            )
        )
        await fc.discover()
        second = {(s.node_guid, s.port): s for s in await fc.sweep()}
    down = second[("0x0000000000000a10", 1)]
    assert (down.state, down.state_id, down.phys_state, down.rate_bytes_per_second) == ("DOWN", 1, None, None)
    assert down.counters["PortXmitData"] == 2**60 + 1001  # still read: the switch answers for it
    assert second[("0x0000000000000a10", 2)].phys_state == "LinkUp"


async def test_missing_tools_and_not_started(tmp_path: Path) -> None:
    bus = MemoryBus()
    fc = FabricCollector(
        bus, KafkaTopics(), perfquery=str(tmp_path / "nope"), ibnetdiscover=str(tmp_path / "nope")
    )
    with pytest.raises(RuntimeError):
        await fc.sweep()
    before = _err(fc, "exec_error")
    async with fc:
        topo = await fc.discover()
        assert topo.error == "exec_error" and await fc.sweep() == []
    assert _err(fc, "exec_error") - before == 2  # discover, then the sweep's own discovery attempt
    with pytest.raises(ValueError):
        FabricCollector(bus, KafkaTopics(), concurrency=0)


async def test_run_loop_stops_and_survives_a_failing_bus(tools: tuple[Path, Path]) -> None:

    class _Broken(MemoryBus):
        def producer(self, client_id: str = "gpupool"):  # type: ignore[no-untyped-def]
            p = super().producer(client_id)

            async def send(*a: object, **k: object) -> None:
                raise ConnectionError("bus down")

            p.send = send  # type: ignore[method-assign]
            return p

    stop = asyncio.Event()
    async with _collector(tools, _Broken(), timeout_s=0.3, include_cas=False) as fc:
        task = asyncio.create_task(fc.run(0.05, stop=stop))
        await asyncio.sleep(0.6)
        stop.set()
        await asyncio.wait_for(task, 5)
    assert _err(fc, "publish") >= 2


async def test_legacy_every_nth_sweep_reads_error_counters_only_then(
    tools: tuple[Path, Path], tmp_path: Path
) -> None:
    """``legacy_every=3``: legacy perfquery on sweeps 0 and 3 only; the other sweeps' samples have the
    extended counters and lack the legacy-only ones (absent, not 0, not copied from sweep 0)."""
    _, perf = tools
    async with _collector(
        tools,
        timeout_s=5.0,
        include_cas=False,
        legacy_counters="always",
        legacy_every=3,
        workdir=tmp_path / "work",
    ) as fc:
        await fc.discover()
        sweeps = []
        due = []
        for _ in range(5):
            due.append(fc.legacy_due)
            sweeps.append({(s.node_guid, s.port): s for s in await fc.sweep()})
    assert due == [True, False, False, True, False]
    calls = [c for c in (perf.parent / "perfquery.log").read_text().split("\n") if c]
    # 2 switches: an extended run every sweep, a legacy run on sweeps 0 and 3
    assert sum(c.startswith("x ") for c in calls) == 10
    assert sorted(c for c in calls if c.startswith("legacy")) == ["legacy 10 1,2"] * 2 + ["legacy 20 1,2"] * 2
    for i, got in enumerate(sweeps):
        s = got[("0x0000000000000a10", 2)]
        assert s.counters["PortXmitData"] == 2**60 + 1002 and s.counter_bits["PortXmitData"] == 64
        assert s.counters["PortXmitWait"] == 3  # in this PMA's extended output: every sweep
        if due[i]:
            assert s.counters["SymbolErrorCounter"] == 65535 and s.saturated == ["SymbolErrorCounter"]
        else:
            assert "SymbolErrorCounter" not in s.counters and "SymbolErrorCounter" not in s.counter_bits
            assert s.saturated == []


async def test_legacy_every_in_auto_mode_and_never(tools: tuple[Path, Path], tmp_path: Path) -> None:
    """auto: the CA whose extended output lacks PortXmitWait gets it on legacy sweeps only; never:
    no legacy run at all, whatever legacy_every says."""
    _, perf = tools
    h14 = ("0x0000000000000b14", 1)
    async with _collector(
        tools,
        timeout_s=0.3,  # lid 11 hangs
        legacy_every=2,
        workdir=tmp_path / "work",
    ) as fc:
        await fc.discover()
        first = {(s.node_guid, s.port): s for s in await fc.sweep()}
        second = {(s.node_guid, s.port): s for s in await fc.sweep()}
        third = {(s.node_guid, s.port): s for s in await fc.sweep()}
    assert first[h14].counters["PortXmitWait"] == 65535 == third[h14].counters["PortXmitWait"]
    assert "PortXmitWait" not in second[h14].counters and second[h14].saturated == []
    assert second[h14].counters["PortXmitData"] == 2**60 + 1401
    calls = (perf.parent / "perfquery.log").read_text().split("\n")
    assert calls.count("legacy 14 1") == 2
    (perf.parent / "perfquery.log").unlink()
    async with _collector(
        tools,
        timeout_s=0.3,
        include_cas=False,
        legacy_counters="never",
        legacy_every=1,
        workdir=tmp_path / "work",
    ) as fc:
        assert not fc.legacy_due
        await fc.sweep()
    assert not any(c.startswith("legacy") for c in (perf.parent / "perfquery.log").read_text().split("\n"))
    with pytest.raises(ValueError):
        FabricCollector(MemoryBus(), KafkaTopics(), legacy_every=0)


async def test_private_workdir_is_on_tmpfs_and_removed(tools: tuple[Path, Path]) -> None:
    """Without ``workdir`` the commands run in a private directory, under /dev/shm when writable
    (libumad2sim's per-process sysfs tree is cheaper there), removed by stop()."""
    _, perf = tools
    async with _collector(tools, include_cas=False) as fc:
        await fc.sweep()
    cwds = set((perf.parent / "perfquery.cwd").read_text().split())
    assert len(cwds) == 1
    cwd = Path(cwds.pop())
    assert cwd.name.startswith("gpupool-fabric-") and not cwd.exists()
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        assert cwd.parent == shm
    else:
        assert cwd.parent == Path(tempfile.gettempdir())


@pytest.mark.parametrize(
    "stderr",
    [
        "ibpanic: [17624] sim_attach: can't connect to sim socket gpupool-1:out1: Operation not permitted",
        "ibwarn: [10754] _do_madrpc: send failed; Operation not permitted\n"
        "ibwarn: [10754] mad_rpc: _do_madrpc failed; dport (Lid 10)",
    ],
)
async def test_a_lost_ibsim_client_slot_is_retried_as_transport(tmp_path: Path, stderr: str) -> None:
    """The first run of each device fails as ibsim does when its client slot is taken away; the retry
    succeeds, so every port is read and nothing is counted as an error."""
    ibnet = tmp_path / "ibnetdiscover"
    ibnet.write_text(f"#!{sys.executable}\nprint({TOPOLOGY!r}, end='')\n")
    perf = tmp_path / "perfquery"
    perf.write_text(
        f"#!{sys.executable}\n"
        "import pathlib, sys\n"
        "lid, port = sys.argv[-2], sys.argv[-1]\n"
        "mark = pathlib.Path(sys.argv[0] + '.' + lid)\n"
        "if not mark.exists():\n"
        "    mark.touch()\n"
        f"    sys.stderr.write({stderr!r})\n"
        "    sys.exit(255)\n"
        "for p in port.split(','):\n"
        "    print(f'# Port extended counters: Lid {lid} port {p} (CapMask: 0x5300)')\n"
        "    print(f'PortSelect:......................{p}')\n"
        "    print('PortXmitData:....................9')\n"
        "    print('PortXmitWait:....................0')\n"
    )
    for t in (ibnet, perf):
        t.chmod(0o755)
    async with _collector((ibnet, perf), include_cas=False, retries=1) as fc:
        samples = await fc.sweep()
    assert sorted((s.node_guid, s.port) for s in samples) == [
        ("0x0000000000000a10", 1),
        ("0x0000000000000a10", 2),
        ("0x0000000000000a20", 1),
        ("0x0000000000000a20", 2),
    ]
    assert all(s.counters["PortXmitData"] == 9 for s in samples)
    assert {r: _err(fc, r) for r in ("transport", "unreachable", "exit_status")} == {
        "transport": 0,
        "unreachable": 0,
        "exit_status": 0,
    }
