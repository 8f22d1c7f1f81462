"""broker.lending.SlurmLending: the port of a lease's workload is chosen among the workloads at
the same node address (several slurmd on one host share it, as in deploy/local/slurm.sh), and a
port stays taken until the ended lease's hold is gone (its workload may still be draining)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from broker.lending import SlurmLending
from broker.scheduler import Hold, HoldState
from broker.workloads import WorkloadProfile
from contracts import LeaseLogRecord, LeaseState

PROFILE = WorkloadProfile(
    name="infer",
    argv=(sys.executable, "-c", "pass", "{port}"),
    port_min=28100,
    port_max=28199,
    health_timeout_s=1,
)


class _Slurm:
    """Three nodes, two of them at one address; holds listed until ``gone`` is set."""

    partition, gres_type, cpus_per_gpu = "lent", "h100", 1

    def __init__(self) -> None:
        self.gone = False
        self.cancelled: list[str] = []

    async def command(self, *argv: str, stdin: str | None = None) -> str:
        if argv == ("scontrol", "show", "node", "-o"):
            return (
                "NodeName=n1 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=localhost Port=6001\n"
                "NodeName=n2 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=localhost Port=6002\n"
                "NodeName=n3 Arch=x86_64 NodeAddr=10.0.0.3 NodeHostName=n3\n"
            )
        if argv[0] == "scancel":
            self.cancelled += argv[1:]
            return ""
        if argv[:2] == ("scontrol", "update"):
            return ""
        raise AssertionError(f"unexpected command {argv}")

    async def jobs(self, job_id: str | None = None) -> list[Hold]:
        return [] if self.gone else [Hold("a", "11", "n1", (0,), HoldState.RUNNING)]


def _record(lease_id: str, host: str) -> LeaseLogRecord:
    return LeaseLogRecord(
        lease_id=lease_id, site="edge-a", claim_id=f"c-{lease_id}", offer_id="o", gpus=[f"{host}/gpu0"],
        state=LeaseState.GRANTED, ts=0.0, granted_at=0.0, expires_at=60.0, notice_seconds=5.0, workload="infer",
    )  # fmt: skip


async def test_ports_per_node_address_and_held_until_the_hold_is_gone(tmp_path: Path) -> None:
    slurm = _Slurm()
    lending = SlurmLending(slurm, workloads=(PROFILE,), control_dir=tmp_path)  # type: ignore[arg-type]
    await lending._read_addrs()
    jobs = iter(range(11, 100))

    def start(lease_id: str, host: str) -> int:
        assert lending._start_workload(_record(lease_id, host), [Hold("", str(next(jobs)), host, (0,))]) == ""
        return lending._ports[lease_id][host]

    try:
        assert [start("a", "n1"), start("b", "n2"), start("c", "n3")] == [28100, 28101, 28100]
        lending._leases["a"] = [Hold("a", "11", "n1", (0,), HoldState.RUNNING)]
        lending.ended(_record("a", "n1"))
        await asyncio.sleep(0.1)
        assert slurm.cancelled == ["11"]
        assert start("d", "n2") == 28102  # a's workload may still be draining on 28100
        slurm.gone = True
        async with asyncio.timeout(5):
            while "a" in lending._ports:
                await asyncio.sleep(0.02)
        assert start("e", "n1") == 28100
    finally:
        await lending.stop()
