"""``gpupool demo`` with and without fabric isolation.

On the real simulated fabric (ibsim + OpenSM + infiniband-diags, installed by
``deploy/local/install-system.sh``; missing tools fail these tests, never skip them): every lease
the demo grants carries a partition verified on the fabric, the summary prints it, and the demo's
fabric is gone afterwards — also when the demo fails or is cancelled (Ctrl-C). Without the tools
the demo still runs and says once that leases are not isolated.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from contracts import LeaseState
from gpupool.cli import app
from gpupool.demo import DemoConfig, run_demo
from gpupool.demo_fabric import FabricMode, FabricUnavailable, fabric_shape, missing_tools
from gpupool.demo_leases import lease_rows, percentile
from gpupool.report.leases import load_jsonl

pytestmark = pytest.mark.integration


def _processes_using(path: Path) -> list[str]:
    """Command lines of running processes that mention ``path`` (the fabric's state dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if str(path) in cmd and state not in ("Z", "X"):
            found.append(cmd)
    return found


def _fabric_dirs(state: Path) -> list[Path]:
    return sorted(state.glob("fabric-*"))


def test_demo_on_the_simulated_fabric_verifies_every_lease(tmp_path: Path) -> None:
    """A 20 s demo (`gpupool demo --fabric on`): each granted lease has its own PKey, SL 1, and
    its QoS (SL 1 on VL 1 of its own, share ≤ 10 %), verified before the grant, in the lease log,
    the per-lease rows and the printed summary."""
    assert not missing_tools(), "install the fabric tools: bash deploy/local/install-system.sh"
    state = tmp_path / "demo"
    result = CliRunner().invoke(app, ["demo", "--duration", "20", "--fabric", "on", "--scheduler", "none",
                                          "--state-dir", str(state)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output[-3000:]
    out = result.output
    assert out.count("Fabric isolation ON") == 1, out[:2000]

    rows = [json.loads(line) for f in state.glob("lease-rows-*.jsonl") for line in f.read_text().splitlines()]
    assert rows, f"no lease granted in 20 s:\n{out[-3000:]}"
    for r in rows:
        assert r["verified"] is True and r["sl"] == 1, r
        assert r["pkey"] is not None and 0x0002 <= int(r["pkey"], 16) <= 0x7FFE, r
        assert r["isolate_s"] is not None and 0 < r["isolate_s"] < 20, r
        assert (r["qos_verified"], r["qos_vl"], r["qos_share_percent"]) == (True, 1, 10.0), r
        assert r["qos_ports"] >= 4, r  # host, its leaf port, the gateway's leaf port, the gateway
    assert len({r["pkey"] for r in rows}) == len(rows), "two leases share a PKey"

    # the lease log the demo dumped: every granted lease carries its verified partition
    (log_file,) = state.glob("leases-*.jsonl")
    records, rejected = load_jsonl(log_file)
    assert rejected == 0
    granted = [r for r in records if r.state is LeaseState.GRANTED]
    assert {r.lease_id for r in granted} == {r["lease_id"] for r in rows}
    for rec in granted:
        assert rec.partition is not None and rec.partition.verified, rec
        assert rec.partition.limited_members and rec.partition.full_members
        assert rec.partition.qos is not None and rec.partition.qos.verified, rec
        assert rec.lent_share_percent == 10.0, rec

    # the printed summary: one line per lease with its PKey, SL, "PKey+QoS" and the time in ms
    lines = out.splitlines()
    for r in rows:
        line = next((ln for ln in lines if r["lease_id"].removeprefix("lease-")[:8] in ln and r["state"] in ln),
                    None)
        assert line is not None, f"lease {r['lease_id']} not in the summary:\n{out[-3000:]}"
        assert r["pkey"] in line and " PKey+QoS " in line and f"{1000 * r['isolate_s']:.0f} ms" in line, line
    assert f"{len(rows)} / {len(rows)}" in out  # leases with a partition verified on the fabric
    assert "QoS: SL 1 → VL 1, share ≤10% of a busy link" in out
    qos_line = next(ln for ln in lines if "…and their QoS on every port of their paths" in ln)
    assert f"{len(rows)} / {len(rows)}" in qos_line
    assert "isolate→verified p50 / p99" in out

    # the demo's fabric is gone
    (fabric_dir,) = _fabric_dirs(state)
    assert not (fabric_dir / "fabric.json").exists()
    assert not _processes_using(fabric_dir)


async def test_the_fabric_is_stopped_when_the_demo_fails(tmp_path: Path) -> None:
    """An error after everything started (here: the on_started hook) still stops ibsim and OpenSM."""

    def boom(server: object, sysfs: object) -> None:
        raise RuntimeError("injected")

    state = tmp_path / "demo"
    cfg = DemoConfig(duration_s=30.0, nodes=2, fabric=FabricMode.ON, state_dir=state, on_started=boom)
    with pytest.raises(RuntimeError, match="injected"):
        await run_demo(cfg)
    (fabric_dir,) = _fabric_dirs(state)
    assert (fabric_dir / "topology.json").exists()  # it had started
    assert not _processes_using(fabric_dir)


async def test_the_fabric_is_stopped_when_the_demo_is_cancelled(tmp_path: Path) -> None:
    """Ctrl-C (asyncio.run cancels the demo's task) stops the fabric too."""
    state = tmp_path / "demo"
    task = asyncio.create_task(run_demo(DemoConfig(duration_s=60.0, nodes=2, fabric=FabricMode.ON,
                                                   state_dir=state)))
    for _ in range(200):  # until the fabric is up
        await asyncio.sleep(0.05)
        if any((d / "fabric.json").exists() for d in _fabric_dirs(state)):
            break
    (fabric_dir,) = _fabric_dirs(state)
    assert _processes_using(fabric_dir), "the fabric never ran"
    await asyncio.sleep(2.0)  # and the stages
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not _processes_using(fabric_dir)


def test_without_the_tools_the_demo_runs_unisolated_and_says_so_once(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh clone with only the venv: `gpupool demo` (auto) runs, leases carry no partition, and
    one notice says so and how to get isolation; `--fabric on` fails clearly (exit 2)."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # the venv only
    monkeypatch.setenv("GPUPOOL_UMAD2SIM", str(tmp_path / "absent.so"))
    monkeypatch.setattr("gpupool.demo_fabric.UMAD2SIM_GLOBS", (str(tmp_path / "absent" / "*.so"),))
    assert "ibsim" in missing_tools() and "libumad2sim.so" in missing_tools()
    state = tmp_path / "demo"
    runner = CliRunner()
    result = runner.invoke(app, ["demo", "--duration", "10", "--state-dir", str(state)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output[-3000:]
    out = result.output
    assert out.count("leases run without fabric isolation") == 1, out
    assert "bash deploy/local/install-system.sh" in out
    assert "fabric tools not installed: ibsim" in out
    assert "off (leases not isolated)" in out
    assert not _fabric_dirs(state)
    rows = [json.loads(line) for f in state.glob("lease-rows-*.jsonl") for line in f.read_text().splitlines()]
    for r in rows:
        assert (r["pkey"], r["sl"], r["verified"], r["isolate_s"]) == (None, None, False, None), r

    refused = runner.invoke(app, ["demo", "--duration", "5", "--fabric", "on", "--state-dir", str(state)])
    assert refused.exit_code == 2, refused.output
    assert "--fabric on, but the fabric tools are not installed" in refused.output
    assert "install-system.sh" in refused.output


def test_fabric_off_demo_follows_gpupool_state_says_so_once_and_keeps_logs_off_the_terminal(
        tmp_path: Path) -> None:
    """`GPUPOOL_STATE=... gpupool demo --fabric off` (no --state-dir): every file goes to
    $GPUPOOL_STATE/demo, the "no isolation" notice is printed once, and the JSON warning lines
    (fabric_isolation_disabled) go to the run's log file, not between the live tables."""
    state = tmp_path / "state"
    result = CliRunner().invoke(app, ["demo", "--duration", "4", "--nodes", "1", "--fabric", "off", "--scheduler", "none"],
                                env={"COLUMNS": "200", "GPUPOOL_STATE": str(state)})
    assert result.exit_code == 0, result.output[-3000:]
    out = result.output
    assert out.count("leases run without fabric isolation") == 1, out
    assert '"event"' not in out and "fabric_isolation_disabled" not in out, out
    demo_dir = state / "demo"
    assert len(list(demo_dir.glob("analytics-*.duckdb"))) == 1 and len(list(demo_dir.glob("leases-*.jsonl"))) == 1
    (log_file,) = demo_dir.glob("demo-*.log")
    events = [json.loads(line)["event"] for line in log_file.read_text().splitlines()]
    assert "fabric_isolation_disabled" in events
    assert f"log (JSON lines): {log_file}" in out
    assert not Path(".state/demo").joinpath(log_file.name).exists()


def test_default_state_dir_follows_gpupool_state(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpupool.demo import default_state_dir

    monkeypatch.setenv("GPUPOOL_STATE", "/srv/gpupool-state")
    assert default_state_dir() == Path("/srv/gpupool-state/demo")
    assert DemoConfig().state_dir == Path("/srv/gpupool-state/demo")
    monkeypatch.setenv("GPUPOOL_STATE", "")
    assert default_state_dir() == Path(".state/demo")
    monkeypatch.delenv("GPUPOOL_STATE")
    assert DemoConfig().state_dir == Path(".state/demo")


async def test_fabric_off_runs_without_partitions(tmp_path: Path) -> None:
    """``fabric=off`` starts no fabric even with the tools present; the summary says why."""
    summary = await run_demo(DemoConfig(duration_s=6.0, nodes=2, fabric=FabricMode.OFF, state_dir=tmp_path))
    assert summary.fabric == {"enabled": False, "mode": "off", "detail": "--fabric off", "start_s": None}
    assert not _fabric_dirs(tmp_path)
    assert summary.leases_verified == 0 and summary.isolate_p50_s is None
    assert all(r["pkey"] is None and not r["verified"] for r in summary.leases)


def test_a_fabric_that_fails_to_start_is_an_error_with_on_and_a_notice_with_auto(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fabric.sh start`` failing: ``on`` raises with the script's output; ``auto`` runs without
    isolation and says why."""
    script = tmp_path / "fabric.sh"
    script.write_text('if [ "$1" = start ]; then echo "fabric: opensm exited (injected)"; exit 1; fi\nexit 0\n')
    monkeypatch.setattr("gpupool.demo_fabric.FABRIC_SH", script)
    with pytest.raises(FabricUnavailable, match=r"start failed \(exit 1\): fabric: opensm exited \(injected\)"):
        asyncio.run(run_demo(DemoConfig(duration_s=5.0, nodes=2, fabric=FabricMode.ON, state_dir=tmp_path / "on")))
    summary = asyncio.run(run_demo(DemoConfig(duration_s=3.0, nodes=2, fabric=FabricMode.AUTO,
                                              state_dir=tmp_path / "auto")))
    assert summary.fabric["enabled"] is False and summary.fabric["mode"] == "auto"
    assert "did not start" in str(summary.fabric["detail"]) and "injected" in str(summary.fabric["detail"])


# pure helpers -----------------------------------------------------------------------------------------
def test_fabric_shape_has_one_compute_hca_per_host() -> None:
    for nodes in (1, 2, 3, 4, 7, 8, 32):
        s = fabric_shape(nodes)
        assert s["leaves"] * s["hcas_per_leaf"] == nodes
    with pytest.raises(ValueError):
        fabric_shape(0)


def test_percentile_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert percentile([5.0], 0.99) == 5.0
    with pytest.raises(ValueError):
        percentile([1.0], 0.0)


def test_lease_rows_keep_the_partition_and_take_the_newest_state() -> None:
    from contracts import LeaseLogRecord
    from contracts.leases import Partition

    part = Partition(pkey=0x12, sl=1, limited_members=["0x0002c90300b00001"],
                     full_members=["0x0002c90300b00101"], verified=True)
    base = dict(lease_id="lease-a", site="edge-a", claim_id="c", offer_id="o", gpus=["gpu-node-001/GPU-1"],
                granted_at=10.0, expires_at=16.0, notice_seconds=4.0)
    recs = [
        LeaseLogRecord(**base, state=LeaseState.RELEASED, ts=14.0, seq=3, partition=part),
        LeaseLogRecord(**base, state=LeaseState.GRANTED, ts=10.0, seq=1, partition=part),
        LeaseLogRecord(**{**base, "lease_id": "lease-b", "granted_at": 9.0}, state=LeaseState.GRANTED, ts=9.0),
    ]
    rows = lease_rows(recs, {"lease-a": 0.05})
    assert [r.lease_id for r in rows] == ["lease-b", "lease-a"]
    b, a = rows
    assert (a.state, a.pkey, a.sl, a.verified, a.isolate_s, a.live) == ("released", "0x0012", 1, True, 0.05, False)
    assert (b.state, b.pkey, b.sl, b.verified, b.isolate_s, b.live) == ("granted", None, None, False, None, True)
    assert a.hosts() == ["gpu-node-001"]


def test_lease_table_shows_whole_host_names_at_80_columns() -> None:
    """Piped output is 80 columns wide: the GPUs column folds instead of cutting host names."""
    from rich.console import Console

    from gpupool.demo_cli import lease_table
    from gpupool.demo_leases import LeaseRow

    row = LeaseRow(
        lease_id="lease-3ff2d059aa", site="edge-a", gpus=("gpu-node-007/GPU-1", "gpu-node-008/GPU-2"),
        state="released", granted_at=0.0, pkey="0x0007", sl=1, verified=True, isolate_s=0.051,
    )  # fmt: skip
    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    console.print(lease_table([row], "leases", with_state=True))
    text = "".join(console.export_text().split())
    assert "gpu-node-007" in text and "gpu-node-008" in text and "…" not in text
