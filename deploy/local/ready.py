"""The wait loop shared by ``kafka_ready.py`` and ``mqtt_ready.py`` (deploy/local/*.sh run those).

:func:`wait_ready` calls a probe until it reports the server ready, the time is up, or the
server's process is gone, and maps that to the exit status both scripts document: 0 ready;
1 not ready in time; 3 the process ``pid`` exited while waiting. The last reason is printed on
stderr.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable

Probe = Callable[[float], Awaitable[str | None]]
"""One attempt: given the seconds left (> 0), ``None`` when ready, else why not (an error caught
by the probe, or what the answer lacked)."""


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


async def wait_ready(name: str, target: str, probe: Probe, timeout_s: float, pid: int | None, every_s: float) -> int:
    """Run ``probe`` every ``every_s`` seconds for ``timeout_s`` seconds; returns the exit status of
    the module docstring. ``name`` (the script) and ``target`` (the server's address) prefix the
    messages on stderr."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        if pid is not None and not alive(pid):
            print(f"{name}: process {pid} exited; last error: {last}", file=sys.stderr)
            return 3
        reason = await probe(max(0.0, deadline - time.monotonic()))
        if reason is None:
            return 0
        last = reason
        if time.monotonic() >= deadline:
            print(f"{name}: {target} not ready after {timeout_s:.0f} s; last error: {last}", file=sys.stderr)
            return 1
        await asyncio.sleep(every_s)
