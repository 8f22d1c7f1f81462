"""OpenSmFabric on a real simulated fabric: ibsim + OpenSM + infiniband-diags (Debian packages),
the default fat tree (2 spines x 4 leaves x 4 HCAs + the edge gateway) from
:func:`tests.fabric_fixture.sim_fabric`.

What the fabric shows is read here with our own ``smpquery`` / ``saquery`` calls, not through the
manager. Every test leaves the fabric without lease partitions (other modules share it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from broker.edge import ClaimRejected
from broker.fabric import FabricError
from broker.fabric_opensm import FabricState, OpenSmFabric, default_host_ports
from broker.metrics import BrokerMetrics, FabricMetrics
from broker.service import BrokerService
from contracts import KafkaTopics, LeaseLogRecord, LeaseState, ReasonCode
from contracts.bus import MemoryBus
from tests.fabric_fixture import SimFabric, sim_fabric  # noqa: F401 - the session fixture
from tests.mqtt_support import until
from tests.test_broker_service import CFG, _Amqtt, _free_port, _idle, _offer_on, _service, _site

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)


def _lease(lease_id: str, *hosts: str) -> LeaseLogRecord:
    return LeaseLogRecord(
        lease_id=lease_id,
        site="edge-a",
        claim_id=f"claim-{lease_id}",
        offer_id="offer-1",
        gpus=[f"{h}/GPU-{h}-{i}" for i, h in enumerate(hosts)],
        state=LeaseState.GRANTED,
        ts=time.time(),
        granted_at=time.time(),
        expires_at=time.time() + 60,
        notice_seconds=30,
    )


def _diag(fab: SimFabric, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **fab.env}
    return subprocess.run(
        list(args), env=env, cwd=fab.workdir, capture_output=True, text=True, timeout=30, check=False
    )


def _pkeys(fab: SimFabric, lid: int, port: int | None = None) -> list[int]:
    """The non-empty entries of a PKey table, read with smpquery (our own parse, not the module's)."""
    done = _diag(fab, "smpquery", "pkeys", str(lid), *([str(port)] if port is not None else []))
    assert done.returncode == 0, done.stdout + done.stderr
    values = [
        int(v, 16) for line in done.stdout.splitlines() if ":" in line for v in line.split(":")[1].split()
    ]
    return [v for v in values if v & 0x7FFF]


def _files(fab: SimFabric) -> tuple[bytes, bytes]:
    return (fab.state_dir / "partitions.conf").read_bytes(), (fab.state_dir / "qos-policy.conf").read_bytes()


def _metric(metrics: FabricMetrics | BrokerMetrics, name: str, **labels: str) -> float:
    """A sample of ``metrics``' registry (0 if absent)."""
    return metrics.registry.get_sample_value(name, labels) or 0.0


def _fabric(fab: SimFabric, **kw: object) -> OpenSmFabric:
    return OpenSmFabric(fab.state_dir / "fabric.json", gateway="edge-gw", **kw)  # type: ignore[arg-type]


async def test_partition_is_applied_verified_and_removed(sim_fabric: SimFabric) -> None:  # noqa: F811
    fm = FabricMetrics()
    fab = sim_fabric
    before = _files(fab)
    mgr = _fabric(fab, metrics=fm)
    hosts, gw, other = (fab.node("node005"), fab.node("node006")), fab.node("edge-gw"), fab.node("node007")
    reloads = _metric(fm, "gpupool_broker_fabric_reloads_total", result="ok")

    part = await mgr.isolate(_lease("lease-ab12", "gpu-node-005", "gpu-node-006"))

    assert part.verified and part.sl == 1 and 0x0002 <= part.pkey <= 0x7FFE
    assert part.limited_members == sorted(h["port_guid"] for h in hosts)
    assert part.full_members == [gw["port_guid"]]
    for h in hosts:
        assert part.pkey in _pkeys(fab, h["lid"]), "leased host: limited member (bit 15 clear)"
        assert part.pkey | 0x8000 not in _pkeys(fab, h["lid"])
    assert part.pkey | 0x8000 in _pkeys(fab, gw["lid"]), "gateway: full member"
    assert all(k & 0x7FFF != part.pkey for k in _pkeys(fab, other["lid"])), "a host not leased stays out"
    leaf2 = fab.node("leaf-2")["lid"]  # node005/006 hang off leaf-2 ports 1 and 2: enforcement there too
    assert part.pkey in _pkeys(fab, leaf2, 1) and part.pkey in _pkeys(fab, leaf2, 2)
    assert part.pkey not in _pkeys(fab, leaf2, 3)
    # the SA gives gateway → host paths on the PKey the inference SL; host → host has no path
    pr = _diag(fab, "saquery", "PR", "--slid", str(gw["lid"]), "--dlid", str(hosts[0]["lid"]),
               "--pkey", hex(part.pkey)).stdout  # fmt: skip
    assert "sl......................0x1" in pr and f"pkey....................{hex(part.pkey)}" in pr
    pr = _diag(fab, "saquery", "PR", "--slid", str(hosts[0]["lid"]), "--dlid", str(hosts[1]["lid"]),
               "--pkey", hex(part.pkey)).stdout  # fmt: skip
    assert "PathRecord" not in pr
    # the operator's lines are untouched, ours are between the markers
    partitions, qos = _files(fab)
    assert partitions.startswith(before[0]) and b"lease-ab12=" in partitions
    assert f"any, pkey 0x{part.pkey:04x} : 1  # lease-ab12".encode() in qos
    assert _metric(fm, "gpupool_broker_fabric_reloads_total", result="ok") == reloads + 1

    await mgr.remove(_lease("lease-ab12"))

    for lid, port in ((hosts[0]["lid"], None), (hosts[1]["lid"], None), (gw["lid"], None), (leaf2, 1)):
        assert all(k & 0x7FFF != part.pkey for k in _pkeys(fab, lid, port)), (lid, port)
    assert mgr.partitions() == []
    await mgr.remove(_lease("lease-ab12"))  # nothing left to remove: no-op, no reload
    assert _metric(fm, "gpupool_broker_fabric_reloads_total", result="ok") == reloads + 2


async def test_concurrent_leases_share_one_reload_and_get_their_own_keys(sim_fabric: SimFabric) -> None:  # noqa: F811
    mgr = _fabric(sim_fabric)
    parts = await asyncio.gather(*(mgr.isolate(_lease(f"lease-c{i}", f"gpu-node-00{i}")) for i in (1, 2, 3)))
    assert mgr.reloads == 1, "three changes asked for together: one write, one SIGHUP"
    assert len({p.pkey for p in parts}) == 3 and all(p.verified for p in parts)
    gw = sim_fabric.node("edge-gw")["lid"]
    assert {p.pkey | 0x8000 for p in parts} <= set(_pkeys(sim_fabric, gw))
    # a broker restarted with no live lease clears them all, in one batch
    assert sorted(await _fabric(sim_fabric).remove_stale(keep=[])) == ["lease-c1", "lease-c2", "lease-c3"]
    assert not {p.pkey for p in parts} & {k & 0x7FFF for k in _pkeys(sim_fabric, gw)}


async def test_a_lease_over_many_hosts_is_written_on_several_lines(sim_fabric: SimFabric) -> None:  # noqa: F811
    """10 hosts + gateway: the statement continues on a second line, which OpenSM must read."""
    mgr = _fabric(sim_fabric)
    hosts = [f"gpu-node-{i:03d}" for i in range(1, 11)]
    part = await mgr.isolate(_lease("lease-wide", *hosts))
    text = (sim_fabric.state_dir / "partitions.conf").read_text()
    assert "=limited,\n    0x" in text
    for i in range(1, 11):
        assert part.pkey in _pkeys(sim_fabric, sim_fabric.node(f"node{i:03d}")["lid"]), i
    assert part.pkey | 0x8000 in _pkeys(sim_fabric, sim_fabric.node("edge-gw")["lid"])
    await mgr.remove(_lease("lease-wide"))
    assert "PARSE ERROR" not in (sim_fabric.state_dir / "opensm" / "opensm.out").read_text()


async def test_a_host_not_on_the_fabric_is_not_isolated(sim_fabric: SimFabric) -> None:  # noqa: F811
    fm = FabricMetrics()
    before = _files(sim_fabric)
    unmapped = _metric(fm, "gpupool_broker_fabric_verify_failures_total", reason="unmapped_host")
    unknown = _metric(fm, "gpupool_broker_fabric_verify_failures_total", reason="unknown_port")
    # 16 compute HCAs: gpu-node-017 has none
    with pytest.raises(FabricError, match="gpu-node-017 has no HCA on the fabric"):
        await _fabric(sim_fabric, metrics=fm).isolate(_lease("lease-x1", "gpu-node-003", "gpu-node-017"))
    # a configured port GUID the fabric does not have
    mgr = _fabric(sim_fabric, metrics=fm, host_ports={"gpu-a": ["node001"], "gpu-b": ["0x0002c90300b0ff01"]})
    with pytest.raises(FabricError, match="0x0002c90300b0ff01 of host gpu-b is not on the fabric"):
        await mgr.isolate(_lease("lease-x2", "gpu-a", "gpu-b"))
    assert _files(sim_fabric) == before and mgr.reloads == 0
    assert _metric(fm, "gpupool_broker_fabric_verify_failures_total", reason="unmapped_host") == unmapped + 1
    assert _metric(fm, "gpupool_broker_fabric_verify_failures_total", reason="unknown_port") == unknown + 1


async def test_a_partition_that_cannot_be_verified_is_taken_back(sim_fabric: SimFabric) -> None:  # noqa: F811
    """node012's cable is pulled: OpenSM cannot program its PKey table, the read-back times out,
    the lease's partition is taken out of the files again."""
    fm = FabricMetrics()
    fab = sim_fabric
    before = _files(fab)
    failed = _metric(fm, "gpupool_broker_fabric_verify_failures_total", reason="unreachable")
    mgr = _fabric(fab, metrics=fm, verify_timeout_s=1.5)
    await asyncio.to_thread(fab.console.unlink, "node012", 1)
    try:
        t0 = time.monotonic()
        with pytest.raises(FabricError, match=r"not verified after 1.5s: node012 .*smpquery pkeys"):
            await mgr.isolate(_lease("lease-cut", "gpu-node-011", "gpu-node-012"))
        assert 1.0 < time.monotonic() - t0 < 10  # the last poll is not slept past the deadline
    finally:
        await asyncio.to_thread(fab.console.relink, "node012", 1)
    assert _files(fab) != before and mgr.partitions() == [], "rolled back (the state line moved on)"
    assert _metric(fm, "gpupool_broker_fabric_verify_failures_total", reason="unreachable") == failed + 1
    # node012 comes back (OpenSM re-sweeps after ReLink's trap), without the rolled-back PKey
    lid = fab.node("node012")["lid"]
    deadline = time.monotonic() + 60
    while _diag(fab, "smpquery", "pkeys", str(lid)).returncode != 0:
        assert time.monotonic() < deadline, "node012 did not come back after ReLink"
        await asyncio.sleep(0.5)
    await until(lambda: _pkeys(fab, lid) == [0xFFFF], 30)


async def test_dry_run_prints_the_diff_and_changes_nothing(sim_fabric: SimFabric) -> None:  # noqa: F811
    before = _files(sim_fabric)
    diffs: list[str] = []
    mgr = _fabric(sim_fabric, dry_run=True, on_diff=diffs.append)
    with pytest.raises(FabricError, match="dry run"):
        await mgr.isolate(_lease("lease-dry", "gpu-node-009", "gpu-node-010"))
    (diff,) = diffs
    n9, n10, gw = (sim_fabric.node(n)["port_guid"] for n in ("node009", "node010", "edge-gw"))
    assert "--- a/partitions.conf\n+++ b/partitions.conf\n" in diff
    assert f", ipoib, sl=1, defmember=limited : {n9}=limited, {n10}=limited, {gw}=full ;\n" in diff
    assert "--- a/qos-policy.conf\n+++ b/qos-policy.conf\n" in diff
    assert _files(sim_fabric) == before and mgr.reloads == 0
    assert [k for k in _pkeys(sim_fabric, sim_fabric.node("node009")["lid"])] == [0xFFFF]
    await mgr.remove(_lease("lease-dry"))  # nothing there: no diff
    assert len(diffs) == 1


def test_cli_builds_the_manager_and_prints_dry_run_diffs(
    sim_fabric: SimFabric,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import typer

    from broker.cli import opensm_fabric

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"gpu-a": ["node004"]}))
    mgr = opensm_fabric(sim_fabric.state_dir / "fabric.json", "edge-gw", hosts, 2, 5.0, True)
    assert (mgr.sl, mgr.verify_timeout_s, mgr.dry_run) == (2, 5.0, True)
    with pytest.raises(FabricError, match="dry run"):
        asyncio.run(mgr.isolate(_lease("lease-cli", "gpu-a")))
    err = capsys.readouterr().err
    assert "+++ b/partitions.conf" in err and f"{sim_fabric.node('node004')['port_guid']}=limited" in err
    assert "any, pkey 0x" in err and " : 2  # lease-cli" in err
    hosts.write_text('{"gpu-a": "node004"}')
    with pytest.raises(typer.BadParameter, match="expected"):
        opensm_fabric(sim_fabric.state_dir / "fabric.json", "edge-gw", hosts, 1, 5.0, False)
    with pytest.raises(typer.BadParameter, match="--fabric-state"):
        opensm_fabric(tmp_path / "missing.json", "edge-gw", None, 1, 5.0, False)


def test_default_host_mapping(sim_fabric: SimFabric) -> None:  # noqa: F811
    st = FabricState.load(sim_fabric.state_dir / "fabric.json")
    assert default_host_ports(st, "gpu-node-001") == ["node001"]
    assert default_host_ports(st, "gpu-node-016") == ["node016"]
    assert default_host_ports(st, "node007") == ["node007"]
    assert default_host_ports(st, "gpu-node-017") == []
    assert default_host_ports(st, "edge-gw") == ["edge-gw"]  # an HCA by name (the gateway check refuses it)
    assert default_host_ports(st, "login") == []
    with pytest.raises(ValueError, match="gateway 'leaf-1' is not an HCA"):
        OpenSmFabric(sim_fabric.state_dir / "fabric.json", gateway="leaf-1")


async def test_broker_grants_only_verified_leases(sim_fabric: SimFabric) -> None:  # noqa: F811
    """Through BrokerService (amqtt, in-process bus): a claim on a host off the fabric is refused
    with isolation_failed and its GPU offered again; a claim on a fabric host gets a verified
    partition, which is gone from the fabric after the release."""
    server = _Amqtt(_free_port())
    await server.start()
    bus = MemoryBus()
    mgr = _fabric(sim_fabric)
    try:
        async with _service(bus, server.port, fabric=mgr) as svc:
            async with _site(server.port) as site:
                await _idle(bus, "gpu-node-017", 1)
                off = await _offer_on(site, "gpu-node-017")
                with pytest.raises(ClaimRejected) as e:
                    await site.claim(off.offer_id)
                assert e.value.code is ReasonCode.ISOLATION_FAILED and "gpu-node-017" in e.value.reply.text
                again = await _offer_on(site, "gpu-node-017")
                assert [g.gpu for g in again.gpus] == [g.gpu for g in off.gpus], "the GPU is offered again"

                await _idle(bus, "gpu-node-013", 2)
                lease = await site.claim((await _offer_on(site, "gpu-node-013")).offer_id, count=2)
                part = lease.partition
                assert part is not None and part.verified
                lid = sim_fabric.node("node013")["lid"]
                assert part.pkey in _pkeys(sim_fabric, lid)
                assert part.limited_members == [sim_fabric.node("node013")["port_guid"]]
                await site.release(lease.lease_id)
                await until(lambda: mgr.partitions() == [], 10)
                await until(lambda: part.pkey not in _pkeys(sim_fabric, lid), 10)
                assert any(f"pkey=0x{part.pkey:04x} sl=1 verified" in p for p in svc.stats()["partitions"])
    finally:
        await server.stop()


async def test_isolate_to_verified_latency(sim_fabric: SimFabric) -> None:  # noqa: F811
    """Time from isolate() to verified (2 hosts + gateway, switch ports and SL checked), 10 runs."""
    mgr = _fabric(sim_fabric)
    iso: list[float] = []
    rem: list[float] = []
    for i in range(10):
        t0 = time.perf_counter()
        await mgr.isolate(_lease(f"lease-t{i}", "gpu-node-014", "gpu-node-015"))
        iso.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await mgr.remove(_lease(f"lease-t{i}"))
        rem.append(time.perf_counter() - t0)
    p50, p50r = statistics.median(iso), statistics.median(rem)
    result = {"isolate_p50_s": round(p50, 4), "isolate_max_s": round(max(iso), 4),
              "remove_p50_s": round(p50r, 4), "remove_max_s": round(max(rem), 4)}  # fmt: skip
    log.info("fabric_isolate_latency", extra=result)
    print(f"\nfabric isolate → verified, default fat tree, 10 runs: {json.dumps(result)}")
    assert p50 < 5.0 and p50r < 5.0


async def test_a_restarted_broker_removes_the_partitions_no_live_lease_holds(sim_fabric: SimFabric) -> None:  # noqa: F811
    """Broker A grants two leases (verified partitions); it goes away after logging the release
    of one but before removing its partition, and a claim it was isolating left a partition with
    no lease at all. Broker B rebuilds from the lease log and takes both off the fabric (verified
    gone with our own smpquery), keeping the live lease's."""
    from contracts import decode, encode

    server = _Amqtt(_free_port())
    await server.start()
    bus, topics = MemoryBus(), KafkaTopics()
    lids = {h: sim_fabric.node(f"node00{h}")["lid"] for h in (3, 4, 5)}

    async def broker() -> tuple[BrokerService, asyncio.Event, asyncio.Task[None]]:
        metrics = BrokerMetrics()  # each broker its own, as each process has
        svc = BrokerService(
            bus=bus, topics=topics, mqtt_host="127.0.0.1", mqtt_port=server.port, protocol=4, config=CFG,
            fabric=_fabric(sim_fabric, metrics=metrics.fabric), metrics=metrics,
        )  # fmt: skip
        await svc.start()
        stop = asyncio.Event()
        return svc, stop, asyncio.create_task(svc.run(stop))

    async def down(svc: BrokerService, stop: asyncio.Event, task: asyncio.Task[None]) -> None:
        stop.set()
        await task
        await svc.stop()

    svc, stop, task = await broker()
    try:
        await svc.wait_connected(10)
        async with _site(server.port) as site:
            await _idle(bus, "gpu-node-003", 1)
            await _idle(bus, "gpu-node-004", 1)
            keep = await site.claim((await _offer_on(site, "gpu-node-003")).offer_id)
            ended = await site.claim((await _offer_on(site, "gpu-node-004")).offer_id)
    finally:
        await down(svc, stop, task)
    assert keep.partition is not None and ended.partition is not None
    # what broker A logged last and never acted on: the release of `ended`
    last = [decode(LeaseLogRecord, m.value) for m in bus.records(topics.leases_log) if m.key == ended.lease_id]
    released = last[-1].model_copy(
        update={"state": LeaseState.RELEASED, "seq": last[-1].seq + 1, "ts": time.time(), "reason": "site_release"}
    )
    await bus.producer().send(topics.leases_log, encode(released), key=released.lease_id)
    # ... and the partition of a claim it was isolating, never granted
    orphan = await _fabric(sim_fabric).isolate(_lease("lease-orphan", "gpu-node-005"))
    for h, part in ((3, keep.partition), (4, ended.partition), (5, orphan)):
        assert part.pkey in _pkeys(sim_fabric, lids[h])

    svc, stop, task = await broker()
    try:
        await svc.wait_connected(10)
        mgr = _fabric(sim_fabric)
        await until(lambda: {p.name for p in mgr.partitions()} == {keep.lease_id}, 30)
        # removal is verified before it counts: the PKeys are already gone from the ports
        await until(
            lambda: _metric(svc.metrics, "gpupool_broker_fabric_stale_partitions_removed_total") == 2, 30
        )
        assert ended.partition.pkey not in _pkeys(sim_fabric, lids[4])
        assert orphan.pkey not in _pkeys(sim_fabric, lids[5])
        assert keep.partition.pkey in _pkeys(sim_fabric, lids[3]), "the live lease keeps its partition"
        assert [r.lease_id for r in svc.book.live_leases()] == [keep.lease_id]
        async with _site(server.port) as site:
            await site.release(keep.lease_id)
        await until(lambda: mgr.partitions() == [], 30)
        await until(lambda: keep.partition.pkey not in _pkeys(sim_fabric, lids[3]), 30)
    finally:
        await down(svc, stop, task)
        await server.stop()
