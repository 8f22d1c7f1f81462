"""Wait until a Mosquitto broker accepts an MQTT login (used by deploy/local/mosquitto.sh).

Usage: ``python mqtt_ready.py CREDENTIALS_JSON [--user U] [--timeout S] [--pid PID]``

``CREDENTIALS_JSON`` is the file written by ``broker.acl`` (``{"host", "port", "users", "root"}``).
Ready means an MQTT CONNECT as ``--user`` (default ``gpupool-observer``, the read-only user: a
login as the broker would take its session over) with its password gets a
successful CONNACK (aiomqtt). Tries every 0.2 s until ``--timeout`` seconds (default 20) pass.

Exit status: 0 ready; 1 not ready in time (or a bad credentials file); 3 the process ``--pid``
exited while waiting. The last error is printed on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import aiomqtt


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


async def wait_ready(creds: dict[str, Any], user: str, timeout_s: float, pid: int | None) -> int:
    """Try to log in as ``user`` until it works; returns the exit status of the module docstring."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        if pid is not None and not _alive(pid):
            print(f"mqtt_ready: process {pid} exited; last error: {last}", file=sys.stderr)
            return 3
        try:
            async with aiomqtt.Client(
                creds["host"],
                int(creds["port"]),
                username=user,
                password=creds["users"][user],
                identifier=f"gpupool-ready-{time.monotonic_ns()}",
                timeout=2.0,
            ):
                return 0
        except aiomqtt.MqttError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            print(
                f"mqtt_ready: {creds['host']}:{creds['port']} not ready after {timeout_s:.0f} s; "
                f"last error: {last}",
                file=sys.stderr,
            )
            return 1
        await asyncio.sleep(0.2)


def main() -> int:
    """CLI entry point; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("credentials", help="credentials.json written by broker.acl")
    p.add_argument("--user", default="gpupool-observer")
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--pid", type=int, default=None)
    args = p.parse_args()
    try:
        with open(args.credentials) as f:
            creds = json.load(f)
        creds["users"][args.user]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"mqtt_ready: bad credentials file {args.credentials}: {e!r}", file=sys.stderr)
        return 1
    return asyncio.run(wait_ready(creds, args.user, args.timeout, args.pid))


if __name__ == "__main__":
    sys.exit(main())
