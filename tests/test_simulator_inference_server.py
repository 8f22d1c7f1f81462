"""The simulated inference server: the GPUs it reports, draining on SIGTERM without a failed
request, and running as a lease's workload on GPUs held in the real Slurm cluster."""

from __future__ import annotations

import asyncio
import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from broker.scheduler import HoldRequest
from broker.scheduler_slurm import SlurmScheduler
from simulator.inference_server import LISTEN_BACKLOG, REPORTED_ENV, InferenceServer, visible_gpus
from tests.services import REPO, SLURM_GRACE_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_health(url: str, timeout_s: float = 15.0) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await client.get(f"{url}/health")
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)


def test_visible_gpus() -> None:
    assert visible_gpus("0,2,3") == [0, 2, 3]
    assert visible_gpus("5") == [5]
    assert visible_gpus(None) == visible_gpus("") == visible_gpus("NoDevFiles") == []
    with pytest.raises(ValueError):
        visible_gpus("GPU-1234")


LEFT_OUT = ("pydantic", "pyarrow", "duckdb", "contracts", "simulator.trace", "simulator.fleet", "simulator.dcgm_http",
            "aiohttp")
"""What the workload's process does not import: it starts on a reclaim's path, on the cores
that serve the endpoint being left."""


def test_the_workload_imports_only_what_serving_needs() -> None:
    code = (
        "import sys, simulator.inference_server\n"
        f"print([m for m in {LEFT_OUT!r} if m in sys.modules])\n"
        "import simulator\n"
        "simulator.Fleet\n"  # the package's names still resolve, from their modules
        "print('simulator.fleet' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout


def test_the_package_names_resolve_lazily() -> None:
    import simulator
    from simulator.fleet import Fleet
    from simulator.trace import load_trace

    assert simulator.Fleet is Fleet and simulator.load_trace is load_trace
    assert sorted(simulator.__all__) == sorted(simulator._EXPORTS)
    for name in simulator.__all__:
        assert getattr(simulator, name) is getattr(importlib.import_module(simulator._EXPORTS[name]), name)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        simulator.nothing  # noqa: B018


async def test_reports_its_gpus_and_drains_without_a_failed_request() -> None:
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "simulator.inference_server", "--port", str(port), "--latency-ms", "200",
        "--quiet-s", "0.3", cwd=REPO,
        env={**{k: v for k, v in os.environ.items() if k not in REPORTED_ENV},
             "CUDA_VISIBLE_DEVICES": "1,3", "GPUPOOL_LEASE_ID": "l-7", "SLURMD_NODENAME": "gpu-node-009",
             "GPUPOOL_CPUS": "4", "UCX_IB_PKEY": "0x0012", "NCCL_IB_SL": "3"},
        stdout=asyncio.subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        health = await _wait_health(url)
        assert health.status_code == 200 and health.json()["gpus"] == [1, 3]
        async with httpx.AsyncClient() as client:
            r = await client.post(f"{url}/v1/infer", json={"prompt": "x"})
            assert r.status_code == 200 and r.json()["gpus"] == [1, 3] and r.json()["lease_id"] == "l-7"
            assert r.json()["node"] == health.json()["node"] == "gpu-node-009"
            assert r.json()["env"] == {"GPUPOOL_CPUS": "4", "UCX_IB_PKEY": "0x0012", "NCCL_IB_SL": "3"}
            in_flight = [asyncio.create_task(client.post(f"{url}/v1/infer")) for _ in range(5)]
            await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.05)
            assert (await client.get(f"{url}/health")).status_code == 503  # draining
            late = await client.post(f"{url}/v1/infer")  # still answered while draining
            results = await asyncio.gather(*in_flight)
        assert [r.status_code for r in results] == [200] * 5 and late.status_code == 200
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_second_sigterm_ends_the_drain_once_no_request_is_in_flight() -> None:
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "simulator.inference_server", "--port", str(port), "--latency-ms", "300",
        "--quiet-s", "30", "--drain-s", "30", cwd=REPO, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_health(url)
        async with httpx.AsyncClient() as client:
            proc.send_signal(signal.SIGTERM)  # the notice: drain, answering (quiet 30 s)
            await asyncio.sleep(0.3)
            assert (await client.post(f"{url}/v1/infer")).status_code == 200
            assert proc.returncode is None
            in_flight = asyncio.create_task(client.post(f"{url}/v1/infer"))
            await asyncio.sleep(0.1)
            proc.send_signal(signal.SIGTERM)  # the lease ended: leave once the request is answered
            assert (await in_flight).status_code == 200
        assert await asyncio.wait_for(proc.wait(), 5) == 0  # not after the 30 s of quiet or drain
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_runs_as_a_lease_workload_on_the_held_gpus(slurm_conf: Path, tmp_path: Path) -> None:
    port = _free_port()
    command = (sys.executable, "-m", "simulator.inference_server", "--port", str(port), "--drain-s", "2")
    s = SlurmScheduler(slurm_conf, output_dir=tmp_path)
    hold = await s.hold(HoldRequest("infer-1", "gpu-node-002", 3, time.time() + 600, SLURM_GRACE_S, command))
    try:
        health = await _wait_health(f"http://127.0.0.1:{port}")
        assert health.status_code == 200
        assert tuple(health.json()["gpus"]) == hold.gpu_indices and len(hold.gpu_indices) == 3
        assert health.json()["lease_id"] == "infer-1"
    finally:
        await s.release("infer-1")
    assert "infer-1" not in await s.holds()


async def test_http_keeps_the_connection_and_answers_other_paths_methods_and_bad_requests() -> None:
    server = InferenceServer([2], "L9", 0.0)
    listening = await server.start("127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            answers = [await client.post("/v1/infer", content=b"{}") for _ in range(3)]
            assert [r.json()["served"] for r in answers] == [1, 2, 3] and server.served == 3
            assert answers[0].headers["content-type"].startswith("application/json")
            assert len(server._writers) == 1  # one kept-alive connection
            assert (await client.get("/health?x=1")).json()["lease_id"] == "L9"
            head = await client.head("/health")
            assert head.status_code == 200 and head.content == b""
            assert (await client.get("/v1/infer")).status_code == 405
            assert (await client.post("/health")).status_code == 405
            assert (await client.get("/metrics")).status_code == 404
        if shutil.which("ss"):  # listen(2)'s backlog: ss shows it as a listening socket's Send-Q
            listed = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True)
            somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
            assert int(listed.stdout.split()[2]) == min(LISTEN_BACKLOG, somaxconn) > 128
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"NOT HTTP\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 400 ")  # then closed
        writer.close()
        assert server.served == 3 and server.in_flight == 0
    finally:
        await server.close()
