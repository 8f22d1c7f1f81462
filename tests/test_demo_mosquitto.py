"""The demo's private Mosquitto (:mod:`gpupool.demo_mosquitto`): production's users and ACL, MQTT 5,
a child process that is gone after ``stop``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiomqtt
import pytest

from gpupool.demo_mosquitto import OBSERVER_USER, PrivateMosquitto, mosquitto_binary
from tests.support import tool_missing


@pytest.fixture(autouse=True)
def _mosquitto() -> None:
    if mosquitto_binary() is None:
        tool_missing("mosquitto is not installed (bash deploy/local/install-system.sh)")


async def test_private_mosquitto_logs_in_sites_with_their_password_only_and_stops(tmp_path: Path) -> None:
    async with PrivateMosquitto(tmp_path / "mqtt", "gpupool/v1", ["edge-a", "edge-b"]) as m:
        assert set(m.users) >= {"edge-a", "edge-b", OBSERVER_USER, "gpupool-broker"}
        assert m.protocol == 5
        async with aiomqtt.Client(m.host, m.port, username="edge-a", password=m.users["edge-a"],
                                  protocol=aiomqtt.ProtocolVersion.V5, timeout=5.0):
            pass
        with pytest.raises(aiomqtt.MqttError):
            async with aiomqtt.Client(m.host, m.port, username="edge-a", password=m.users["edge-b"],
                                      protocol=aiomqtt.ProtocolVersion.V5, timeout=5.0):
                pass
        proc = m._proc
        assert proc is not None and proc.poll() is None
    assert proc.poll() is not None  # stopped, and waited for


async def test_a_mosquitto_that_cannot_start_is_an_oserror_with_its_log(tmp_path: Path) -> None:
    broken = tmp_path / "mosquitto"
    broken.write_text("#!/bin/sh\necho 'Error: no config' >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(OSError, match="did not start.*exited with 3.*no config"):
        await PrivateMosquitto(tmp_path / "mqtt", "gpupool/v1", ["edge-a"], binary=str(broken)).start()


def test_the_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A demo killed without its cleanup (SIGKILL here) leaves no Mosquitto behind."""
    code = (
        "import asyncio, sys, pathlib\n"
        "from gpupool.demo_mosquitto import PrivateMosquitto\n"
        "async def main():\n"
        "    m = PrivateMosquitto(pathlib.Path(sys.argv[1]), 'gpupool/v1', ['edge-a'])\n"
        "    await m.start()\n"
        "    print(m._proc.pid, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "mqtt")], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    os.kill(pid, 0)  # running
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("mosquitto outlived the process that started it")
