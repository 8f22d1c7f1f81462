"""Helpers shared by the tests that run their own Mosquitto (a pytest plugin, see conftest.py).

* :func:`private_mosquitto` — a fixture: a Mosquitto of one test only, started and stopped with
  ``deploy/local/mosquitto.sh`` on a private ``GPUPOOL_STATE`` (tests that restart or kill their
  server must not disturb the shared session one);
* :func:`mosquitto_script` / :func:`mosquitto_script_async` — run that script;
* :func:`until` — poll a condition;
* :func:`retained_leases` — read a site's retained lease messages as that site would;
* :func:`running` — a broker service started, serving and connected for the block, then stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from broker.acl import OBSERVER_USER
from broker.credentials import mqtt_client
from broker.service import BrokerService
from contracts import LeaseMessage, MqttTopics, decode
from tests.services import run_service

T = TypeVar("T")

MOSQUITTO_SH = Path(__file__).resolve().parents[1] / "deploy" / "local" / "mosquitto.sh"


def mosquitto_script(state: Path, action: str) -> subprocess.CompletedProcess[str]:
    """``deploy/local/mosquitto.sh <action>`` (start, stop, status) on the state dir ``state``
    (:func:`tests.services.run_service`, 90 s at most)."""
    return run_service("mosquitto.sh", action, 90, state=state)


async def mosquitto_script_async(state: Path, action: str) -> tuple[int, str, str]:
    """:func:`mosquitto_script` without blocking the event loop (clients keep running meanwhile);
    returns ``(exit status, stdout, stderr)``. Raises ``TimeoutError`` after 90 s."""
    proc = await asyncio.create_subprocess_exec(
        "bash",
        str(MOSQUITTO_SH),
        action,
        env={**os.environ, "GPUPOOL_STATE": str(state)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
def private_mosquitto(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A Mosquitto of this test only (ACL, per-site users, persistence): the ``credentials.json``
    dict (``host``, ``port``, ``users``, ``root``) plus ``"state"``, its GPUPOOL_STATE dir.
    Fails the test (never skips) if it cannot start; stopped by the script, by pid, afterwards."""
    state = tmp_path / "state"
    done = mosquitto_script(state, "start")
    if done.returncode != 0:
        pytest.fail(f"mosquitto.sh start failed:\n{done.stdout}\n{done.stderr}", pytrace=False)
    creds: dict[str, Any] = json.loads((state / "mosquitto" / "credentials.json").read_text())
    creds["state"] = state
    yield creds
    mosquitto_script(state, "stop")


async def until(pred: Callable[[], T | None], timeout_s: float = 5.0, what: str = "condition") -> T:
    """Poll ``pred`` every 20 ms until it returns something truthy; return that.

    Raises ``AssertionError`` naming ``what`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout_s} s")


async def retained_leases(creds: dict[str, Any], site: str, root: str | None = None) -> dict[str, LeaseMessage]:
    """The retained lease messages of ``site`` (by lease id) under ``root`` (default
    ``creds["root"]``), read for 1 s by a fresh MQTT 5 client logged in as the read-only observer
    user (logging in as the site would take its own connection's session over)."""
    found: dict[str, LeaseMessage] = {}
    async with mqtt_client(creds, OBSERVER_USER, identifier=f"probe-{uuid.uuid4().hex[:10]}") as c:
        await c.subscribe(MqttTopics(root or creds["root"]).leases_filter(site), qos=1)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                async for msg in c.messages:
                    if msg.retain and msg.payload:
                        lease = decode(LeaseMessage, bytes(msg.payload))  # type: ignore[arg-type]
                        found[lease.lease_id] = lease
    return found


@contextlib.asynccontextmanager
async def running(svc: BrokerService, connect_timeout_s: float = 10.0) -> AsyncIterator[BrokerService]:
    """Start ``svc``, serve it (``run``) and wait until it is connected to its MQTT server (at most
    ``connect_timeout_s``; ``TimeoutError`` otherwise); on leaving, stop serving and stop it."""
    await svc.start()
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    try:
        await svc.wait_connected(connect_timeout_s)
        yield svc
    finally:
        stop.set()
        await task
        await svc.stop()
