"""Wait until a Kafka broker answers a Metadata request (used by deploy/local/kafka.sh).

Usage: ``python kafka_ready.py BOOTSTRAP [--timeout S] [--pid PID]``

Ready means: aiokafka's admin client bootstraps from ``BOOTSTRAP`` (``host:port``) and the
Metadata response (Kafka protocol, ``MetadataRequest``) lists at least one broker, i.e. the KRaft
broker has caught up with the controller and opened its PLAINTEXT listener. Tries every 0.25 s
until ``--timeout`` seconds (default 60) pass.

Exit status: 0 ready; 1 not ready in time; 3 the process ``--pid`` exited while waiting (the
server died: no point waiting longer). The last error is printed on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from aiokafka.admin import AIOKafkaAdminClient


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


async def _probe(bootstrap: str, timeout_s: float) -> int:
    """Number of brokers in one Metadata response from ``bootstrap``; raises on any failure."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        client_id="gpupool-ready",
        request_timeout_ms=max(1000, int(timeout_s * 1000)),
    )
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        cluster = await asyncio.wait_for(admin.describe_cluster(), timeout_s)
        return len(cluster.get("brokers", []))
    finally:
        await admin.close()


async def wait_ready(bootstrap: str, timeout_s: float, pid: int | None) -> int:
    """Poll ``bootstrap`` until ready; returns the exit status described in the module docstring."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        if pid is not None and not _alive(pid):
            print(f"kafka_ready: process {pid} exited; last error: {last}", file=sys.stderr)
            return 3
        try:
            if await _probe(bootstrap, min(3.0, max(0.5, deadline - time.monotonic()))) > 0:
                return 0
            last = "metadata lists no broker yet"
        except Exception as e:  # noqa: BLE001 — any failure means "not ready yet"; the last one is reported
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            print(
                f"kafka_ready: {bootstrap} not ready after {timeout_s:.0f} s; last error: {last}",
                file=sys.stderr,
            )
            return 1
        await asyncio.sleep(0.25)


def main() -> int:
    """CLI entry point; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bootstrap", help="host:port of the PLAINTEXT listener")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to keep trying")
    p.add_argument("--pid", type=int, default=None, help="stop waiting if this process exits")
    args = p.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # aiokafka logs every refused connection
    return asyncio.run(wait_ready(args.bootstrap, args.timeout, args.pid))


if __name__ == "__main__":
    sys.exit(main())
