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
import functools
import json
import sys
import time
from typing import Any

import aiomqtt
from ready import wait_ready  # deploy/local/ready.py, next to this script


async def _login(creds: dict[str, Any], user: str, left_s: float) -> str | None:
    """One attempt of :func:`ready.wait_ready`: ``None`` when a CONNECT as ``user`` succeeds."""
    try:
        async with aiomqtt.Client(
            creds["host"],
            int(creds["port"]),
            username=user,
            password=creds["users"][user],
            identifier=f"gpupool-ready-{time.monotonic_ns()}",
            timeout=2.0,
        ):
            return None
    except aiomqtt.MqttError as e:
        return f"{type(e).__name__}: {e}"


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
    probe = functools.partial(_login, creds, args.user)
    target = f"{creds['host']}:{creds['port']}"
    return asyncio.run(wait_ready("mqtt_ready", target, probe, args.timeout, args.pid, every_s=0.2))


if __name__ == "__main__":
    sys.exit(main())
