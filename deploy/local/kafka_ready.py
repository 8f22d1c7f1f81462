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
import functools
import logging
import sys

from aiokafka.admin import AIOKafkaAdminClient
from ready import wait_ready  # deploy/local/ready.py, next to this script


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


async def _brokers_listed(bootstrap: str, left_s: float) -> str | None:
    """One attempt of :func:`ready.wait_ready`: ``None`` when the Metadata response lists a broker."""
    try:
        if await _probe(bootstrap, min(3.0, max(0.5, left_s))) > 0:
            return None
        return "metadata lists no broker yet"
    except Exception as e:  # noqa: BLE001 — any failure means "not ready yet"; the last one is reported
        return f"{type(e).__name__}: {e}"


def main() -> int:
    """CLI entry point; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bootstrap", help="host:port of the PLAINTEXT listener")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to keep trying")
    p.add_argument("--pid", type=int, default=None, help="stop waiting if this process exits")
    args = p.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # aiokafka logs every refused connection
    probe = functools.partial(_brokers_listed, args.bootstrap)
    return asyncio.run(wait_ready("kafka_ready", args.bootstrap, probe, args.timeout, args.pid, every_s=0.25))


if __name__ == "__main__":
    sys.exit(main())
