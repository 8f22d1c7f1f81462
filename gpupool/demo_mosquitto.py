"""The demo's own Mosquitto: a private ``mosquitto`` child process on loopback, with the users and
ACL of production (:func:`broker.acl.write_mosquitto_files`: one user per site, the broker's user,
the observer), speaking MQTT 5.

``gpupool demo`` uses it when no ``--mqtt`` is given and Mosquitto is installed
(``bash deploy/local/install-system.sh``); otherwise it falls back to the in-process amqtt server
(:mod:`gpupool.embedded_mqtt`, MQTT 3.1.1, anonymous), which shares the demo's event loop and
falls behind when the machine is loaded. Its files live in a folder of the demo's state
directory; nothing is kept between runs (``persistence`` is on in the generated config, in that
folder, and the folder is the run's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiomqtt

from broker.acl import write_mosquitto_files
from gpupool.embedded_mqtt import free_port

log = logging.getLogger(__name__)

BROKER_USER = "gpupool-broker"
OBSERVER_USER = "gpupool-observer"


def mosquitto_binary() -> str | None:
    """Path of the ``mosquitto`` executable on ``PATH`` when ``mosquitto_passwd`` is there too
    (the password file needs it), else ``None``."""
    found = shutil.which("mosquitto")
    return found if found is not None and shutil.which("mosquitto_passwd") is not None else None


def _die_with_parent() -> None:
    """In the child before ``exec``: on Linux, SIGTERM it when the process that started it dies
    (``prctl(PR_SET_PDEATHSIG)``), so a demo killed without its cleanup leaves no server behind.
    Elsewhere nothing."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1
"""``prctl`` option of ``<linux/prctl.h>``."""


class PrivateMosquitto:
    """A Mosquitto 2 of the demo's own on ``127.0.0.1`` (a free port).

    Use as ``async with PrivateMosquitto(folder, root, sites) as m: ... m.port, m.users``.

    Args:
        directory: where its config, password file, ACL, credentials and log go (created).
        root: the MQTT topic root of the ACL (``gpupool/v1``).
        sites: site names (each gets a user of that name).
        binary: the ``mosquitto`` executable; default :func:`mosquitto_binary`.
        ready_timeout_s: seconds :meth:`start` waits for the observer to log in.

    Attributes:
        host, port: where it listens, once started.
        users: user name → password (sites, ``gpupool-broker``, ``gpupool-observer``).
        protocol: the MQTT protocol level its clients use (5).
    """

    protocol = 5

    def __init__(self, directory: Path, root: str, sites: list[str], *, binary: str | None = None,
                 ready_timeout_s: float = 10.0) -> None:
        self.directory = directory
        self.root = root
        self.sites = list(sites)
        self.binary = binary or mosquitto_binary()
        self.ready_timeout_s = ready_timeout_s
        self.host = "127.0.0.1"
        self.port = 0
        self.users: dict[str, str] = {}
        self._proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        """Write the files, start ``mosquitto -c`` and wait until the observer can log in.
        Raises ``FileNotFoundError`` without Mosquitto, ``OSError`` (with the end of its log) if
        it exits or does not answer within ``ready_timeout_s``; nothing is left running then."""
        if self.binary is None:
            raise FileNotFoundError("mosquitto is not installed (bash deploy/local/install-system.sh)")
        self.port = free_port(self.host)
        creds: dict[str, Any] = await asyncio.to_thread(
            write_mosquitto_files, self.directory, self.root, self.sites, BROKER_USER, self.port
        )
        self.users = dict(creds["users"])
        out = (self.directory / "stdout.log").open("wb")
        try:
            self._proc = subprocess.Popen([self.binary, "-c", str(self.directory / "mosquitto.conf")],
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=_die_with_parent)
        finally:
            out.close()
        try:
            await asyncio.wait_for(self._ready(), self.ready_timeout_s)
        except (TimeoutError, OSError) as e:
            tail = self._log_tail()
            await self.stop()
            raise OSError(f"the demo's Mosquitto did not start on {self.host}:{self.port}: {e!r}; {tail}") from e
        log.info("demo_mosquitto_started", extra={"host": self.host, "port": self.port, "dir": str(self.directory)})

    async def _ready(self) -> None:
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise OSError(f"mosquitto exited with {self._proc.returncode}")
            try:
                async with aiomqtt.Client(self.host, self.port, username=OBSERVER_USER,
                                          password=self.users[OBSERVER_USER],
                                          protocol=aiomqtt.ProtocolVersion.V5, timeout=1.0):
                    return
            except aiomqtt.MqttError:
                await asyncio.sleep(0.05)

    def _log_tail(self) -> str:
        lines: list[str] = []
        for name in ("mosquitto.log", "stdout.log"):
            with contextlib.suppress(OSError):
                lines += (self.directory / name).read_text(errors="replace").splitlines()[-5:]
        return " | ".join(lines) or "no log"

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; waits until it has exited."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)

    async def __aenter__(self) -> PrivateMosquitto:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
