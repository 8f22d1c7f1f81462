"""Workload profiles (broker/workloads.py): validation, per-site permission, ports, rendering;
the placeholders' CPUs; the start file a node runs (broker/placeholders.py ``start_script``, run by
bash here: CPU budget, the lease's InfiniBand partition, the P_Key index read from a sysfs tree);
the lease message's endpoints (broker/leases.py ``lease_message``) and the SDK's wait for them
(broker/edge.py ``EdgeClient.wait_endpoints``); a restarted broker's adoption of every instance."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from broker.edge import EdgeClient
from broker.lending import SlurmLending
from broker.leases import lease_message
from broker.placeholders import start_script
from broker.scheduler_slurm import SlurmScheduler
from broker.workloads import WorkloadError, WorkloadProfile, allowed, pick_port, placeholder_cpus, render
from contracts import LeaseLogRecord, LeaseMessage, LeaseState
from contracts.leases import Partition
from simulator.inference_server import reported_env

SERVER = WorkloadProfile(
    name="sim-inference",
    argv=("python3", "-m", "simulator.inference_server", "--port", "{port}", "--tag", "{site}/{lease_id}/{gpus}"),
    port_min=18000,
    port_max=18002,
    sites=("edge-a", "edge-b"),
)


def test_render_replaces_every_field_and_nothing_else() -> None:
    argv = render(SERVER, port=18001, lease_id="l-1", site="edge-a", gpus=4)
    assert argv == ("python3", "-m", "simulator.inference_server", "--port", "18001", "--tag", "edge-a/l-1/4")


@pytest.mark.parametrize("path", ["usr", "/usr/../etc", "", "/opt/\x00x"])
def test_host_paths_must_be_absolute_without_dot_dot(path: str) -> None:
    with pytest.raises(ValueError, match="absolute path"):
        WorkloadProfile.model_validate({**SERVER.model_dump(), "host_paths": [path]})
    ok = WorkloadProfile.model_validate({**SERVER.model_dump(), "host_paths": ["/usr", "/opt/model"]})
    assert ok.host_paths == ("/usr", "/opt/model")


def test_a_site_can_only_name_an_allowed_profile() -> None:
    assert allowed([SERVER], "edge-b", "sim-inference") is SERVER
    with pytest.raises(WorkloadError, match="not allowed to site 'edge-c'"):
        allowed([SERVER], "edge-c", "sim-inference")
    with pytest.raises(WorkloadError, match="unknown workload profile 'rm -rf /'"):
        allowed([SERVER], "edge-a", "rm -rf /")
    open_profile = SERVER.model_copy(update={"sites": ()})
    assert allowed([open_profile], "edge-z", "sim-inference") is open_profile


def test_ports_lowest_free_and_exhaustion() -> None:
    assert pick_port(SERVER, []) == 18000
    assert pick_port(SERVER, [18000]) == 18001
    assert pick_port(SERVER, [18000, 18001]) == 18002  # the range's last port is used
    with pytest.raises(WorkloadError, match="every port 18000-18002 is in use"):
        pick_port(SERVER, [18000, 18001, 18002])


@pytest.mark.parametrize(
    "bad",
    [
        {"argv": ("x", "{port.__class__}")},  # attribute access in a template
        {"argv": ("x", "{env}")},  # an unknown field
        {"argv": ("x", "{")},  # a broken template
        {"argv": ()},
        {"port_min": 18003, "port_max": 18002},
        {"port_min": 80},
        {"name": "Has Space"},
        {"health_path": "health"},
        {"unexpected": 1},
    ],
)
def test_invalid_profiles_are_refused(bad: dict[str, object]) -> None:
    fields = SERVER.model_dump() | bad
    with pytest.raises(ValidationError):
        WorkloadProfile(**fields)


def test_a_one_port_range_is_valid() -> None:
    p = SERVER.model_copy(update={"port_max": 18000})
    WorkloadProfile(**p.model_dump())
    assert pick_port(p, []) == 18000


def test_placeholders_ask_for_the_most_demanding_profile_and_never_below_the_default() -> None:
    two = SERVER.model_copy(update={"name": "two", "cpus_per_gpu": 2})
    four = SERVER.model_copy(update={"name": "four", "cpus_per_gpu": 4})
    assert placeholder_cpus([], 1) == 1
    assert placeholder_cpus([SERVER], 1) == 1  # the profile's default: 1
    assert placeholder_cpus([SERVER, two], 1) == 2
    assert placeholder_cpus([four, two], 1) == 4
    assert placeholder_cpus([two], 3) == 3  # the scheduler's own CPUs per GPU stay the floor


_DUMP_ENV = (sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))")


def _run(script: str) -> dict[str, str]:
    """Run a start file as the placeholder does (``bash <file>``) with an empty environment;
    the environment its ``exec`` got."""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={}, check=True)
    env: dict[str, str] = json.loads(done.stdout)
    return env


def _pkeys(root: Path, device: str, port: int, table: list[str]) -> None:
    d = root / device / "ports" / str(port) / "pkeys"
    d.mkdir(parents=True)
    for i, value in enumerate(table):
        (d / str(i)).write_text(value + "\n")


def test_start_file_gives_gpus_lease_and_cpu_budget_and_no_fabric_knobs_without_a_partition(tmp_path: Path) -> None:
    _pkeys(tmp_path, "mlx5_0", 1, ["0xffff", "0x0012"])  # even with the P_Key listed: no partition, no knob
    env = _run(start_script(_DUMP_ENV, [3, 1], "lease-1", cpus=6, ib_sysfs=str(tmp_path)))
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["GPUPOOL_LEASE_ID"] == "lease-1"
    assert env["GPUPOOL_CPUS"] == env["OMP_NUM_THREADS"] == "6"
    assert not {k for k in env if "IB_" in k}


def test_start_file_puts_the_workload_in_the_lease_partition_with_the_pkey_index_from_sysfs(tmp_path: Path) -> None:
    part = Partition(pkey=0x12, sl=3, verified=True)
    # mlx5_0 port 1 lacks it; mlx5_1 port 1 lists it limited at index 4 and full at index 2, with junk around
    _pkeys(tmp_path, "mlx5_0", 1, ["0xffff", "0x0013", "0x0000"])
    _pkeys(tmp_path, "mlx5_1", 1, ["0xffff", "garbage", "0x8012", "0x1012", "0x0012"])
    (tmp_path / "mlx5_1" / "ports" / "1" / "pkeys" / "notanindex").write_text("0x0012\n")
    env = _run(start_script(_DUMP_ENV, [0], "lease-2", cpus=2, partition=part, ib_sysfs=str(tmp_path)))
    assert env["GPUPOOL_IB_PKEY"] == env["UCX_IB_PKEY"] == "0x0012"
    assert env["GPUPOOL_IB_SL"] == env["NCCL_IB_SL"] == env["UCX_IB_SL"] == "3"
    assert env["NCCL_IB_PKEY"] == "2"  # the lowest index holding 0x0012 (membership bit masked), not 0x1012's


def test_start_file_leaves_nccl_ib_pkey_unset_when_no_port_lists_the_partition(tmp_path: Path) -> None:
    part = Partition(pkey=0x7FFE, sl=0, verified=True)
    _pkeys(tmp_path, "mlx5_0", 1, ["0xffff", "0x7ffd"])
    env = _run(start_script(_DUMP_ENV, [0], "l", cpus=1, partition=part, ib_sysfs=str(tmp_path)))
    assert env["UCX_IB_PKEY"] == "0x7ffe" and env["NCCL_IB_SL"] == "0" and "NCCL_IB_PKEY" not in env
    env = _run(start_script(_DUMP_ENV, [0], "l", cpus=1, partition=part, ib_sysfs=str(tmp_path / "none")))
    assert "NCCL_IB_PKEY" not in env and env["GPUPOOL_IB_PKEY"] == "0x7ffe"  # no InfiniBand on the node


def test_start_file_quotes_what_it_runs() -> None:
    out = subprocess.run(
        ["bash", "-c", start_script(("printf", "%s|", "a b", "$HOME", "';x"), [0], "l;rm", cpus=1)],
        capture_output=True, text=True, env={"HOME": "/h"}, check=True,
    )  # fmt: skip
    assert out.stdout == "a b|$HOME|';x|"


def _record(**update: object) -> LeaseLogRecord:
    rec = LeaseLogRecord(
        lease_id="lease-9", site="edge-a", claim_id="c", offer_id="o1", offer_ids=["o1", "o2"],
        hosts=["n1", "n2"], gpus=["n1/gpu0", "n2/gpu1"], state=LeaseState.GRANTED, ts=1.0,
        granted_at=1.0, expires_at=61.0, notice_seconds=30.0, workload="sim-inference",
    )  # fmt: skip
    return rec.model_copy(update=update)


def test_lease_message_lists_endpoints_in_node_order_and_endpoint_is_the_first_nodes() -> None:
    rec = _record()
    assert lease_message(rec).endpoint is None and lease_message(rec).endpoints == []
    only_second = lease_message(rec, {"n2": "10.0.0.2:18000"})
    assert only_second.endpoint is None and only_second.endpoints == ["10.0.0.2:18000"]
    both = lease_message(rec, {"n2": "10.0.0.2:18000", "n1": "10.0.0.1:18001", "elsewhere": "x:1"})
    assert both.endpoint == "10.0.0.1:18001" and both.endpoints == ["10.0.0.1:18001", "10.0.0.2:18000"]
    old = _record(hosts=[])  # a record of a broker before ``hosts``: the nodes come from the GPU keys
    assert lease_message(old, {"n1": "a:1", "n2": "b:2"}).endpoints == ["a:1", "b:2"]


def test_a_lease_message_without_endpoints_still_reads() -> None:
    msg = lease_message(_record(), {"n1": "10.0.0.1:18000"})
    data = json.loads(msg.model_dump_json())
    del data["endpoints"]  # as a broker before the field sends it
    back = LeaseMessage.model_validate(data)
    assert back.endpoints == [] and back.endpoint == "10.0.0.1:18000"


def test_the_inference_server_reports_only_its_workload_knobs() -> None:
    env = {"GPUPOOL_CPUS": "4", "UCX_IB_PKEY": "0x0012", "NCCL_IB_SL": "3", "PATH": "/bin", "SECRET": "x"}
    assert reported_env(env) == {"GPUPOOL_CPUS": "4", "UCX_IB_PKEY": "0x0012", "NCCL_IB_SL": "3"}


@pytest.mark.parametrize(
    ("content", "ports"),
    [
        ({"nodes": [{"host": "n1", "port": 18000}, {"host": "n2", "port": 18001}]}, {"n1": 18000, "n2": 18001}),
        ({"host": "n1", "port": 18002}, {"n1": 18002}),  # as a broker running one instance per lease wrote it
        ({"nodes": [{"host": "n1"}]}, None),  # malformed: not adopted, logged
        ([1, 2], None),
    ],
)
async def test_a_restarted_broker_adopts_every_instance_from_the_endpoint_file(
    tmp_path: Path, content: object, ports: dict[str, int] | None
) -> None:
    lending = SlurmLending(SlurmScheduler(tmp_path / "slurm.conf"), workloads=(SERVER,), control_dir=tmp_path)
    (tmp_path / "lease-9.endpoint").write_text(json.dumps(content))
    lending._addr.update({"n1": "127.0.0.1", "n2": "127.0.0.1"})  # known: no scontrol here
    rec = _record(site="edge-a")
    lending._adopt_workload(rec)
    tasks = set(lending._tasks)
    try:
        assert lending._ports.get(rec.lease_id) == ports
        assert sorted(t.get_name() for t in tasks) == [f"workload-health-lease-9/{h}" for h in sorted(ports or {})]
        await asyncio.sleep(0.05)  # the health checks run (nothing listens: they keep polling)
        assert not lending.endpoint(rec.lease_id)
    finally:
        lending.ended(rec)
        await asyncio.gather(*tasks, return_exceptions=True)
    assert not lending._ports and all(t.cancelled() for t in tasks)


async def test_the_sdk_waits_for_an_instance_on_every_node_and_reads_old_brokers() -> None:
    site = EdgeClient(site="edge-a", host="127.0.0.1", port=1)  # never connected: messages set below
    two = lease_message(_record(), {"n2": "b:2"})
    site._leases[two.lease_id] = two
    assert await site.wait_endpoints(two.lease_id, 1.0, every_node=False) == ["b:2"]
    with pytest.raises(TimeoutError):
        await site.wait_endpoints(two.lease_id, 0.2)  # n1's instance is not healthy yet
    site._leases[two.lease_id] = lease_message(_record(), {"n2": "b:2", "n1": "a:1"})
    assert await site.wait_endpoints(two.lease_id, 1.0) == ["a:1", "b:2"]
    old = lease_message(_record(hosts=["n1"], gpus=["n1/gpu0"]), {"n1": "a:1"}).model_copy(
        update={"endpoints": [], "hosts": []}
    )  # a broker before ``endpoints`` (and ``hosts``)
    site._leases[old.lease_id] = old
    assert await site.wait_endpoints(old.lease_id, 1.0) == ["a:1"]
    site._leases[old.lease_id] = old.model_copy(update={"state": LeaseState.RELEASED, "endpoint": None})
    with pytest.raises(TimeoutError, match="released"):
        await site.wait_endpoints(old.lease_id, 5.0)


def test_ports_are_taken_per_node_address_whatever_the_profile(tmp_path: Path) -> None:
    lending = SlurmLending(SlurmScheduler(tmp_path / "slurm.conf"), workloads=(SERVER,), control_dir=tmp_path)
    lending._addr.update({"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.1"})
    lending._ports.update({"lease-a": {"n1": 18000}, "lease-b": {"n2": 18001}})  # any profiles
    assert lending._ports_near("n1", {}) == [18000]
    assert lending._ports_near("n3", {}) == [18000]  # another node on n1's address
    assert lending._ports_near("n2", {}) == [18001]
    assert sorted(lending._ports_near("n4", {})) == [18000, 18001]  # address not read yet: avoid all
    assert lending._ports_near("n3", {"n1": 18002}) == [18000, 18002]  # picked for the same lease
    assert lending._ports_near("n2", {"n1": 18002}) == [18001]
