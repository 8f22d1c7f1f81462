"""The demo's private Mosquitto (:mod:`gpupool.demo_mosquitto`): production's users and ACL, MQTT 5,
a child process that is gone after ``stop``."""

from __future__ import annotations

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
