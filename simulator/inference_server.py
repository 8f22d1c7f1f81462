"""A simulated inference server: what an edge site's workload looks like on a lease's GPUs.

Run as ``python -m simulator.inference_server --port N`` (the lease job of a workload profile
starts it on the held GPUs). It serves, over HTTP on ``--bind``:``--port``:

* ``GET /health`` — ``200 {"status": "ok", ...}`` while serving, ``503 {"status": "draining"}``
  once it got SIGTERM (a load balancer or the edge SDK stops sending new requests);
* ``POST /v1/infer`` (any JSON body, or none) — ``200 {"gpus": [...], "lease_id": ..., "pid": ...,
  "served": N, "node": ..., "env": {...}}`` after ``--latency-ms`` milliseconds: the GPUs it was
  given are the indices in ``CUDA_VISIBLE_DEVICES`` (as Slurm sets them), the lease the value of
  ``GPUPOOL_LEASE_ID``, the node ``SLURMD_NODENAME`` (``""`` outside Slurm), and ``env`` the
  values of the :data:`REPORTED_ENV` variables that are set (its CPU budget and InfiniBand
  partition, as the lease's start file exported them; :func:`broker.placeholders.start_script`).

It speaks HTTP/1.1 with keep-alive through h11 (the protocol) on asyncio streams, without a web
framework: the process starts on a reclaim's path, on the cores of the endpoints still serving,
so it imports only what serving needs (no HTTP client, TLS stack or CA certificates).

On SIGTERM it drains: health turns 503, requests keep being answered (those in flight and those
that still arrive), and it exits 0 once no request came for ``--quiet-s`` seconds or
``--drain-s`` seconds have passed, whichever is first. A second SIGTERM (the lease ended: Slurm
cancels the hold's job, after the site moved its traffic and released) ends the drain as soon as
no request is in flight. SIGINT counts as SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from collections.abc import Mapping

import h11

LISTEN_BACKLOG = 1024
"""Connections the kernel queues for the server before it accepts them (``listen(2)``'s backlog,
capped by ``net.core.somaxconn``). Past it the kernel drops a client's SYN, which the client
sends again only after a second: a load balancer opening a connection per request while the
server's process waits for a CPU (a reclaim's burst) would otherwise see those seconds."""

REPORTED_ENV = (
    "GPUPOOL_GPU_SLOTS",
    "GPUPOOL_CPUS",
    "OMP_NUM_THREADS",
    "GPUPOOL_IB_PKEY",
    "GPUPOOL_IB_SL",
    "NCCL_IB_PKEY",
    "NCCL_IB_SL",
    "UCX_IB_PKEY",
    "UCX_IB_SL",
)
"""Environment variables the server reports (``env`` in its answers): the lease's GPU slots on
Kubernetes (broker/lending_kubernetes.py), and what a real workload would use for its CPU threads
and its InfiniBand traffic."""


def reported_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The :data:`REPORTED_ENV` variables set in ``environ``, with their values."""
    return {name: environ[name] for name in REPORTED_ENV if name in environ}


def visible_gpus(value: str | None) -> list[int]:
    """``CUDA_VISIBLE_DEVICES`` as GPU indices: ``"0,2,3"`` -> ``[0, 2, 3]``; unset, empty or
    ``NoDevFiles`` -> ``[]``. Raises ``ValueError`` on a non-numeric entry (UUID forms are not
    what Slurm sets for GRES)."""
    if not value or value == "NoDevFiles":
        return []
    return [int(v) for v in value.split(",")]


class InferenceServer:
    """The server's state and handlers (see the module docstring for the HTTP interface).

    Args:
        gpus: the GPU indices it was given.
        lease_id: the lease it runs for (``""`` outside a lease).
        latency_s: simulated work per request, seconds.
        node: the Slurm node it runs on (``""`` outside Slurm).
        env: what it reports of its environment (:func:`reported_env`).
    """

    def __init__(
        self,
        gpus: list[int],
        lease_id: str,
        latency_s: float,
        node: str = "",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.gpus = gpus
        self.lease_id = lease_id
        self.node = node
        self.env = dict(env or {})
        self.latency_s = latency_s
        self.served = 0
        self.in_flight = 0
        self.draining = False
        self.leaving = False
        """A second SIGTERM came: exit once no request is in flight."""
        self.last_request = time.monotonic()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def health(self) -> tuple[int, dict[str, object]]:
        """``GET /health``: 200 while serving, 503 while draining (status, JSON body)."""
        body: dict[str, object] = {"status": "draining" if self.draining else "ok", "gpus": self.gpus,
                "lease_id": self.lease_id, "served": self.served, "node": self.node, "env": self.env}  # fmt: skip
        return 503 if self.draining else 200, body

    async def infer(self) -> tuple[int, dict[str, object]]:
        """``POST /v1/infer``: answer after the simulated latency with the GPUs used."""
        await asyncio.sleep(self.latency_s)
        self.served += 1
        return 200, {"gpus": self.gpus, "lease_id": self.lease_id, "pid": os.getpid(), "served": self.served,
                     "node": self.node, "env": self.env}  # fmt: skip

    async def route(self, method: str, path: str) -> tuple[int, dict[str, object]]:
        """The answer to ``method`` ``path`` (status, JSON body): the two routes, 405 for another
        method on them, 404 elsewhere."""
        routes = {"/health": "GET", "/v1/infer": "POST"}
        path = path.split("?", 1)[0]
        if path not in routes:
            return 404, {"error": "not found"}
        if method != routes[path] and not (method == "HEAD" and routes[path] == "GET"):
            return 405, {"error": f"{method} not allowed"}
        return await self.infer() if path == "/v1/infer" else self.health()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one HTTP/1.1 connection (keep-alive; the protocol is h11's) until the client or
        :meth:`close` ends it. A request h11 cannot parse gets 400 and the connection closes."""
        conn = h11.Connection(h11.SERVER)
        self._writers.add(writer)

        async def next_event() -> object:
            while (event := conn.next_event()) is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            return event

        try:
            while isinstance(request := await next_event(), h11.Request):
                self.in_flight += 1
                self.last_request = time.monotonic()
                try:
                    while isinstance(part := await next_event(), h11.Data):
                        pass  # any body, or none
                    if not isinstance(part, h11.EndOfMessage):
                        break
                    status, body = await self.route(request.method.decode(), request.target.decode())
                    payload = json.dumps(body).encode()
                    headers = [("content-type", "application/json; charset=utf-8"), ("content-length", str(len(payload)))]
                    out = [conn.send(h11.Response(status_code=status, headers=headers))]
                    if request.method != b"HEAD":
                        out.append(conn.send(h11.Data(data=payload)))
                    out.append(conn.send(h11.EndOfMessage()))
                    writer.write(b"".join(b for b in out if b))  # one write: one send(2)
                    await writer.drain()
                finally:
                    self.in_flight -= 1
                    self.last_request = time.monotonic()
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    break
                conn.start_next_cycle()
        except h11.RemoteProtocolError as e:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                payload = json.dumps({"error": str(e)}).encode()
                headers = [("content-type", "application/json; charset=utf-8"), ("content-length", str(len(payload)))]
                writer.write(conn.send(h11.Response(status_code=e.error_status_hint, headers=headers)) or b"")
                writer.write(conn.send(h11.Data(data=payload)) or b"")
                writer.write(conn.send(h11.EndOfMessage()) or b"")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def start(self, bind: str, port: int) -> asyncio.Server:
        """Listen on ``bind``:``port`` (0: any free port; the server's ``sockets`` say which),
        with a backlog of :data:`LISTEN_BACKLOG`."""
        self._server = await asyncio.start_server(self.connection, bind, port, backlog=LISTEN_BACKLOG)
        return self._server

    async def close(self) -> None:
        """Stop listening and close every connection (those idle between requests; call it once
        no request is in flight)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()


async def serve(bind: str, port: int, server: InferenceServer, drain_s: float, quiet_s: float) -> None:
    """Serve until SIGTERM/SIGINT, then drain until quiet, ``drain_s`` or a second signal
    (module docstring) and return."""
    await server.start(bind, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            server.leaving = True
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    print(json.dumps({"event": "inference_serving", "bind": bind, "port": port, "gpus": server.gpus,
                      "lease_id": server.lease_id}), flush=True)
    await stop.wait()
    server.draining = True
    began = time.monotonic()
    while time.monotonic() - began < drain_s:
        if server.in_flight == 0 and (server.leaving or time.monotonic() - server.last_request >= quiet_s):
            break
        await asyncio.sleep(0.05)
    await server.close()
    print(json.dumps({"event": "inference_stopped", "served": server.served,
                      "drained_s": round(time.monotonic() - began, 3)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--port`` (required), ``--bind`` (127.0.0.1), ``--latency-ms`` (5),
    ``--drain-s`` (30), ``--quiet-s`` (0.5). Exit 0 after a drain; 2 on bad arguments."""
    p = argparse.ArgumentParser(prog="python -m simulator.inference_server", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bind", default="127.0.0.1")
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--drain-s", type=float, default=30.0)
    p.add_argument("--quiet-s", type=float, default=0.5)
    args = p.parse_args(argv)
    try:
        gpus = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ValueError:
        p.error(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} is not a list of indices")
    server = InferenceServer(
        gpus,
        os.environ.get("GPUPOOL_LEASE_ID", ""),
        args.latency_ms / 1000.0,
        node=os.environ.get("SLURMD_NODENAME", ""),
        env=reported_env(os.environ),
    )
    asyncio.run(serve(args.bind, args.port, server, args.drain_s, args.quiet_s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
