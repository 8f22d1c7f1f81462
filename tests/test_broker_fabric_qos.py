"""Fabric QoS on a real simulated fabric (ibsim + OpenSM + infiniband-diags, the default fat tree of
:func:`tests.fabric_fixture.sim_fabric`): the lent VL and its share bound applied through
``opensm.conf``, read back on every port of a lease's paths before the grant, drift found by the
audit, and refusal when the QoS cannot be applied.

Tables are read here with our own ``smpquery`` calls and our own parsing; the paths are computed
here from the generated ``topology.json``, not by the manager. Each test puts ``opensm.conf``
back as it found it and lets OpenSM re-read it (other modules share the fabric).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from broker.edge import ClaimRejected
from broker.fabric import FabricError
from broker.fabric_opensm import OpenSmFabric
from broker.metrics import BrokerMetrics, FabricMetrics
from contracts import LeaseLogRecord, LeaseState, ReasonCode
from contracts.bus import MemoryBus
from tests.fabric_fixture import SimFabric, sim_fabric  # noqa: F401 - the session fixture
from tests.mqtt_support import until
from tests.test_broker_service import CFG, _Amqtt, _free_port, _idle, _offer_on, _service, _site

pytestmark = pytest.mark.integration

TRAINING_HIGH = [(0, 4), (2, 4), (3, 4), (4, 4), (5, 4), (6, 4), (7, 4)]
"""OpenSM's default weights (VL 0 high, VLs 1-7 low, 4 each) with VL 1 lent: training VLs high."""


def _lease(lease_id: str, *hosts: str) -> LeaseLogRecord:
    now = time.time()
    return LeaseLogRecord(
        lease_id=lease_id, site="edge-a", claim_id=f"claim-{lease_id}", offer_id="offer-1",
        gpus=[f"{h}/GPU-{h}-{i}" for i, h in enumerate(hosts)], state=LeaseState.GRANTED, ts=now,
        granted_at=now, expires_at=now + 60, notice_seconds=30,
    )  # fmt: skip


def _diag(fab: SimFabric, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), env={**os.environ, **fab.env}, cwd=fab.workdir, capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip


def _sl2vl(fab: SimFabric, lid: int, port: int | None) -> list[list[int]]:
    """Every row of ``smpquery sl2vl`` (16 VLs each)."""
    done = _diag(fab, "smpquery", "sl2vl", str(lid), *([str(port)] if port is not None else []))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [ln.split(":", 2)[2] for ln in done.stdout.splitlines() if ln.startswith("ports:")]
    assert rows, done.stdout
    return [[int(c) for c in r.replace("|", " ").split()] for r in rows]


def _vlarb(fab: SimFabric, lid: int, port: int | None) -> dict[str, list[tuple[int, int]]]:
    """``smpquery vlarb`` → {"low": [(vl, weight)...], "high": [...]}, weight-0 entries dropped."""
    done = _diag(fab, "smpquery", "vlarb", str(lid), *([str(port)] if port is not None else []))
    assert done.returncode == 0, done.stdout + done.stderr
    out: dict[str, list[tuple[int, int]]] = {}
    table, vls = "", []
    for ln in done.stdout.splitlines():
        if ln.startswith("# Low") or ln.startswith("# High"):
            table = ln.split()[1].lower()
            out[table] = []
        elif ln.startswith("VL"):
            vls = [int(c, 16) for c in ln.split(":", 1)[1].split("|") if c.strip()]
        elif ln.startswith("WEIGHT"):
            ws = [int(c, 16) for c in ln.split(":", 1)[1].split("|") if c.strip()]
            out[table] += [(v, w) for v, w in zip(vls, ws, strict=True) if w]
    return out


def _path_ports(fab: SimFabric, *hosts: str) -> set[tuple[str, int | None]]:
    """(node id, port) of every port on the shortest paths host ↔ edge-gw in the generated fat
    tree (HCAs as (node id, None)): the host's leaf port and its uplinks, every spine's ports to
    both leaves, the gateway leaf's uplinks and gateway port."""
    topo = json.loads((fab.state_dir / "topology.json").read_text())
    nodes = {n["nodeid"]: n for n in topo["nodes"]}
    gw_leaf = nodes["edge-gw"]["leaf"]
    out: set[tuple[str, int | None]] = {("edge-gw", None), (gw_leaf, nodes["edge-gw"]["links"]["1"][1])}
    for h in hosts:
        leaf = nodes[h]["leaf"]
        out |= {(h, None), (leaf, nodes[h]["links"]["1"][1])}
        for lf in {leaf, gw_leaf}:
            for port, (peer, peer_port) in nodes[lf]["links"].items():
                if nodes[peer]["role"] == "spine":
                    out |= {(lf, int(port)), (peer, int(peer_port))}
    return out


def _metric(metrics: FabricMetrics | BrokerMetrics, name: str, **labels: str) -> float:
    """A sample of ``metrics``' registry (0 if absent)."""
    return metrics.registry.get_sample_value(name, labels) or 0.0


def _fabric(fab: SimFabric, **kw: Any) -> OpenSmFabric:  # noqa: ANN401
    return OpenSmFabric(fab.state_dir / "fabric.json", gateway="edge-gw", qos_share_percent=10.0, **kw)


def _set_vlarb(fab: SimFabric, lid: int, port: int, table: str, entries: str) -> None:
    done = _diag(fab, sys.executable, "-m", "broker.fabric_smp", "set-vlarb", str(lid), str(port), table, entries)
    assert done.returncode == 0, done.stderr


@pytest.fixture
async def conf(sim_fabric: SimFabric) -> AsyncIterator[Path]:  # noqa: F811
    """``opensm.conf`` of the session fabric; restored (and re-read by OpenSM, so the tables go
    back to OpenSM's defaults) after the test, every lease partition removed."""
    path = Path(sim_fabric.info["opensm_conf"])
    before = path.read_bytes()
    try:
        yield path
    finally:
        await OpenSmFabric(sim_fabric.state_dir / "fabric.json").remove_stale(keep=[])
        if path.read_bytes() != before:
            path.write_bytes(before)
            os.kill(int((sim_fabric.state_dir / "opensm.pid").read_text()), 1)
            lid = sim_fabric.node("leaf-1")["lid"]
            await until(lambda: _vlarb(sim_fabric, lid, 1)["low"] != [(1, 64)], 30)


async def test_after_a_grant_every_port_on_the_paths_shows_the_plan(sim_fabric: SimFabric, conf: Path) -> None:  # noqa: F811
    """The operator's own QoS lines (switch external ports weigh VL 0 and 2 differently) stay byte
    for byte; the plan merges them; every port on node005/node006 ↔ edge-gw shows it."""
    fm = FabricMetrics()
    fab = sim_fabric
    operator = conf.read_text() + "# operator: training VLs 0 and 2 on switches\nqos_swe_vlarb_high 0:32,2:16\n"
    conf.write_text(operator)
    mgr = _fabric(fab, metrics=fm)
    reloads = _metric(fm, "gpupool_broker_fabric_reloads_total", result="ok")

    part = await mgr.isolate(_lease("lease-q1", "gpu-node-005", "gpu-node-006"))

    ports = _path_ports(fab, "node005", "node006")
    assert len(ports) == 14  # 3 HCAs, 2 leaf-2 host ports, 2+2 leaf uplinks, 2 ports on each spine, gw port
    assert part.verified and part.qos is not None and part.qos.verified
    assert (part.qos.sl, part.qos.vl, part.qos.share_percent, part.qos.ports_verified) == (1, 1, 10.0, 14)
    for node, port in sorted(ports, key=str):
        lid = fab.node(node)["lid"]
        for row in _sl2vl(fab, lid, port):
            assert row[1] == 1 and [s for s, v in enumerate(row) if v == 1] == [1], (node, port, row)
            assert row == [0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 2, 3, 4, 5, 6, 7], (node, port, row)
        tables = _vlarb(fab, lid, port)
        assert tables["low"] == [(1, 64)], (node, port, tables)
        want = [(0, 32), (2, 16), *TRAINING_HIGH[2:]] if port is not None else TRAINING_HIGH
        assert tables["high"] == want, (node, port, tables)
    # one SIGHUP for partition and QoS; the operator's lines untouched, the block last
    assert _metric(fm, "gpupool_broker_fabric_reloads_total", result="ok") == reloads + 1
    text = conf.read_text()
    assert text.startswith(operator) and text[len(operator):].startswith("# BEGIN gpupool-managed qos")
    assert "qos_high_limit 9\n" in text and "qos_swe_vlarb_high 0:32,2:16,3:4,4:4,5:4,6:4,7:4\n" in text
    # a second lease: the plan is there already, nothing written for QoS, its own paths verified
    other = await mgr.isolate(_lease("lease-q2", "gpu-node-016"))
    assert other.qos is not None and other.qos.ports_verified == len(_path_ports(fab, "node016")) == 12
    assert conf.read_text() == text
    await mgr.remove(_lease("lease-q1"))
    await mgr.remove(_lease("lease-q2"))
    assert conf.read_text() == text, "the plan is fabric-wide: it stays when the leases end"


async def test_a_switch_changed_behind_gpupools_back_is_drift(sim_fabric: SimFabric, conf: Path) -> None:  # noqa: F811
    """An SMP Set gives leaf-3 port 2 other high-priority weights; OpenSM does not notice. The
    audit reports that port, the metric counts it, and a lease whose path crosses a changed
    port is not granted."""
    fm = FabricMetrics()
    fab = sim_fabric
    mgr = _fabric(fab, metrics=fm)
    assert await mgr.audit() == {}, "no plan written yet: nothing to audit"
    await mgr.isolate(_lease("lease-d1", "gpu-node-001"))
    assert await mgr.audit() == {}
    assert _metric(fm, "gpupool_broker_fabric_qos_drift_ports", switch="leaf-3") == 0
    drift_audits = _metric(fm, "gpupool_broker_fabric_qos_audits_total", result="drift")

    leaf3 = fab.node("leaf-3")["lid"]
    _set_vlarb(fab, leaf3, 2, "high", "0:1,2:9")
    assert _vlarb(fab, leaf3, 2)["high"] == [(0, 1), (2, 9)]

    drift = await mgr.audit()
    assert list(drift) == ["leaf-3"] and len(drift["leaf-3"]) == 1
    assert "leaf-3 port 2: vlarb high 0:1,2:9 (want 0:4,2:4" in drift["leaf-3"][0]
    assert _metric(fm, "gpupool_broker_fabric_qos_drift_ports", switch="leaf-3") == 1
    assert _metric(fm, "gpupool_broker_fabric_qos_drift_ports", switch="leaf-2") == 0
    assert _metric(fm, "gpupool_broker_fabric_qos_audits_total", result="drift") == drift_audits + 1

    # leaf-1 port 5 (the gateway's) is on every lease's path: a lease now cannot be verified
    leaf1 = fab.node("leaf-1")["lid"]
    _set_vlarb(fab, leaf1, 5, "low", "1:8")
    failed = _metric(fm, "gpupool_broker_fabric_verify_failures_total", reason="qos_mismatch")
    with pytest.raises(FabricError, match=r"QoS of lease lease-d2 not verified after 6s: leaf-1 port 5: vlarb low"):
        await _fabric(fab, metrics=fm, verify_timeout_s=6).isolate(_lease("lease-d2", "gpu-node-009"))
    assert [p.name for p in mgr.partitions()] == ["lease-d1"], "its partition was taken back"
    assert _metric(fm, "gpupool_broker_fabric_verify_failures_total", reason="qos_mismatch") == failed + 1

    # put both back as planned: no drift
    _set_vlarb(fab, leaf3, 2, "high", ",".join(f"{v}:{w}" for v, w in TRAINING_HIGH))
    _set_vlarb(fab, leaf1, 5, "low", "1:64")
    assert await mgr.audit() == {}
    assert _metric(fm, "gpupool_broker_fabric_qos_drift_ports", switch="leaf-3") == 0


async def test_a_lease_whose_qos_cannot_be_applied_is_refused(sim_fabric: SimFabric, conf: Path) -> None:  # noqa: F811
    """Through BrokerService: the operator's opensm.conf says ``qos FALSE`` (OpenSM would program
    no QoS table), so the claim is refused with isolation_failed and nothing is written; once the
    operator turns QoS on, the next claim gets a lease with its QoS verified and the share bound,
    which every offer showed too."""
    fab = sim_fabric
    operator = conf.read_text() + "qos FALSE\n"
    conf.write_text(operator)
    partitions = (fab.state_dir / "partitions.conf").read_bytes()
    server = _Amqtt(_free_port())
    await server.start()
    bus = MemoryBus()
    mgr = _fabric(fab)
    cfg = CFG.model_copy(update={"lent_share_percent": mgr.lent_share_percent})
    try:
        async with _service(bus, server.port, cfg, fabric=mgr) as svc:
            async with _site(server.port) as site:
                await _idle(bus, "gpu-node-007", 1)
                off = await _offer_on(site, "gpu-node-007")
                assert off.lent_share_percent == 10.0
                with pytest.raises(ClaimRejected) as e:
                    await site.claim(off.offer_id, timeout_s=60)
                assert e.value.code is ReasonCode.ISOLATION_FAILED
                assert "qos TRUE" in e.value.reply.text
                assert conf.read_text() == operator and (fab.state_dir / "partitions.conf").read_bytes() == partitions
                assert mgr.reloads == 0

                conf.write_text(operator.replace("qos FALSE\n", "qos TRUE\n"))
                lease = await site.claim((await _offer_on(site, "gpu-node-007")).offer_id, timeout_s=60)
                assert lease.lent_share_percent == 10.0
                assert lease.partition is not None and lease.partition.qos is not None
                assert lease.partition.qos.verified and lease.partition.qos.ports_verified == 12
                assert any("qos vl=1 share<=10% verified on 12 ports" in p for p in svc.stats()["partitions"])
                await site.release(lease.lease_id)
                await until(lambda: mgr.partitions() == [], 10)
    finally:
        await server.stop()
