"""Benchmark: how many GPUs one core collects, and CPU per sample against Prometheus, in one run.

1. **Capacity** (in process). Simulated 8-GPU H100 bodies (``simulator.dcgm_http.render_metrics``
   over a ``simulator.fleet.Fleet`` replaying the Alibaba trace) go through what the collector
   does to each body: :func:`collectors.dcgm.parse_dcgm_exporter`, :func:`contracts.encode` of the
   body's :class:`contracts.GpuSample` records grouped into :class:`contracts.GpuScrape` records
   (:func:`contracts.gpu_scrapes`), and ``send`` to the in-process bus (:class:`contracts.bus.MemoryBus`),
   once straight and once through :class:`collectors.spool.SpoolingProducer` (memory tier). CPU
   seconds per GPU sample are ``time.process_time()`` over the loop; the GPU count one core
   sustains at a 5 s interval is ``5 s / (CPU seconds per GPU sample)`` (target >= 10,000).

2. **Scrape → bus vs Prometheus** (three processes, side by side for the same period). A child
   process serves ``--nodes`` simulated dcgm-exporter endpoints (``simulator.dcgm_http.FleetServer``);
   a second runs :class:`collectors.service.CollectorService` on all of them (HTTP scrape, parse,
   encode, produce: in-process bus, or Kafka with ``--kafka``); Prometheus (the Debian
   ``prometheus`` binary) scrapes the same endpoints at the same interval with a fresh TSDB. After
   a warm-up, each one's CPU (``/proc/<pid>/stat`` utime + stime) and samples are read at the start
   and the end of the window: Prometheus' samples from its own
   ``prometheus_tsdb_head_samples_appended_total`` (less the 5 report series it appends per
   scrape: ``up``, ``scrape_duration_seconds``...), gpupool's as successful scrapes
   (``gpupool_collector_scrapes_total{result="success"}``) × sample lines per body. Printed: CPU
   µs per sample of each, their ratio (target <= 2× Prometheus), and the GPU count one core
   sustains on the whole scrape path.

Run: ``.venv/bin/python bench/collect_capacity.py [--nodes 100] [--interval 5] [--duration 60]
[--kafka HOST:PORT]`` (about 100 s with the defaults). ``serve`` and ``collect`` are the child
processes' own sub-commands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from collectors.dcgm import parse_dcgm_exporter
from collectors.spool import SpoolingProducer
from contracts import KafkaTopics, encode, gpu_scrapes
from contracts.bus import MemoryBus, Producer
from simulator.dcgm_http import render_metrics
from simulator.fleet import Fleet
from simulator.trace import load_trace

REPO = Path(__file__).resolve().parents[1]
TRACE_DIR = REPO / ".." / "shared" / "data" / "traces" / "alibaba_genai_2026"
CAPACITY_INTERVAL_S = 5.0
GPUS_PER_NODE = 8
REPORT_SERIES_PER_SCRAPE = (
    5  # up, scrape_duration_seconds, scrape_samples_scraped, ..._post_metric_relabeling, scrape_series_added
)


# --- 1. capacity -------------------------------------------------------------------------------
async def _pipeline(bodies: list[str], producer: Producer, min_cpu_s: float) -> tuple[float, int]:
    """Parse, encode and send every body over and over for at least ``min_cpu_s`` CPU seconds;
    return (CPU seconds, GPU samples)."""
    topic = KafkaTopics(prefix="bench.").telemetry_gpu
    await producer.start()
    samples = 0
    seq = 0
    t0 = time.process_time()
    while time.process_time() - t0 < min_cpu_s:
        for body in bodies:
            parsed = parse_dcgm_exporter(body, ts=time.time(), target="bench", seq_start=seq)
            for record in gpu_scrapes(parsed.samples):  # one record per read of a host, as the stage sends
                await producer.send(topic, encode(record), key=record.partition_key)
            seq += len(parsed.samples)
            samples += len(parsed.samples)
        await producer.flush()
    cpu = time.process_time() - t0
    await producer.stop()
    return cpu, samples


def capacity(fleet: Fleet, bodies_n: int = 32, min_cpu_s: float = 4.0) -> dict[str, float]:
    """CPU seconds per GPU sample of parse + encode + produce, straight and through the spool."""
    bodies = [render_metrics(fleet, h) for h in fleet.hosts()[:bodies_n]]
    cpu, n = asyncio.run(_pipeline(bodies, MemoryBus().producer(), min_cpu_s))
    spool_cpu, spool_n = asyncio.run(
        _pipeline(bodies, SpoolingProducer(MemoryBus().producer(), memory_records=200_000), min_cpu_s)
    )
    return {"cpu_per_gpu_s": cpu / n, "spool_cpu_per_gpu_s": spool_cpu / spool_n, "samples": n}


# --- 2. scrape -> bus vs Prometheus --------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (proc(5): fields 14 and 15 of /proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sum_metric(text: str, name: str, match: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
    """Sum of the samples named ``name`` (whose labels pass ``match``) in an exposition body."""
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and match(s.labels)
    )


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def side_by_side(nodes: int, interval_s: float, duration_s: float, kafka: str | None) -> dict[str, float]:
    """Run the endpoints, gpupool's collector and Prometheus together; measure the window."""
    prom_bin = shutil.which("prometheus")
    if prom_bin is None:
        raise SystemExit("prometheus not found: install the Debian package (deploy/local/install-system.sh)")
    me = [sys.executable, str(Path(__file__).resolve())]
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as tmp:
        try:
            server = subprocess.Popen([*me, "serve", "--nodes", str(nodes)], stdout=subprocess.PIPE)
            procs.append(server)
            assert server.stdout is not None
            urls: list[str] = json.loads(server.stdout.readline())["urls"]
            lines_per_body = sum(
                1 for ln in httpx.get(urls[0], timeout=5).text.splitlines() if ln and not ln.startswith("#")
            )
            timeout_s = min(4.0, interval_s * 0.8)

            prom_port = _free_port()
            config = Path(tmp) / "prometheus.yml"
            config.write_text(
                json.dumps(  # YAML is a superset of JSON
                    {
                        "global": {
                            "scrape_interval": f"{int(interval_s * 1000)}ms",
                            "scrape_timeout": f"{int(timeout_s * 1000)}ms",
                        },
                        "scrape_configs": [
                            {
                                "job_name": "dcgm",
                                "static_configs": [{"targets": [u.split("/")[2] for u in urls]}],
                            }
                        ],
                    }
                )
            )
            prom = subprocess.Popen(
                [
                    prom_bin,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp}/tsdb",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                    "--log.level=warn",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append(prom)
            coll_port = _free_port()
            urls_file = Path(tmp) / "urls.json"
            urls_file.write_text(json.dumps(urls))
            collect_cmd = [
                *me,
                "collect",
                str(urls_file),
                "--interval",
                str(interval_s),
                "--timeout",
                str(timeout_s),
                "--metrics-port",
                str(coll_port),
            ]
            collector = subprocess.Popen(collect_cmd + (["--kafka", kafka] if kafka else []))
            procs.append(collector)
            prom_url, coll_url = f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{coll_port}/metrics"
            _wait_http(f"{prom_url}/-/ready", 60, prom)
            _wait_http(coll_url, 60, collector)
            time.sleep(2 * interval_s + 1)  # warm-up: imports, first scrapes, TSDB head creation

            def snapshot() -> tuple[float, float, float, float]:
                p_text = httpx.get(f"{prom_url}/metrics", timeout=5).text
                c_text = httpx.get(coll_url, timeout=5).text
                return (
                    _cpu_s(prom.pid),
                    _sum_metric(p_text, "prometheus_tsdb_head_samples_appended_total"),
                    _cpu_s(collector.pid),
                    _sum_metric(
                        c_text, "gpupool_collector_scrapes_total", lambda lb: lb.get("result") == "success"
                    ),
                )

            p_cpu0, p_app0, c_cpu0, c_ok0 = snapshot()
            time.sleep(duration_s)
            p_cpu1, p_app1, c_cpu1, c_ok1 = snapshot()
            up = httpx.get(f"{prom_url}/api/v1/query", params={"query": "sum(up)"}, timeout=5).json()
            prom_up = float(up["data"]["result"][0]["value"][1]) if up["data"]["result"] else 0.0
            failed = _sum_metric(
                httpx.get(coll_url, timeout=5).text,
                "gpupool_collector_scrapes_total",
                lambda lb: lb.get("result") == "failure",
            )
        finally:
            for p in reversed(procs):
                _stop(p)
    appended = p_app1 - p_app0
    prom_samples = appended * lines_per_body / (lines_per_body + REPORT_SERIES_PER_SCRAPE)
    ours_samples = (c_ok1 - c_ok0) * lines_per_body
    return {
        "nodes": nodes,
        "lines_per_body": lines_per_body,
        "prom_cpu_s": p_cpu1 - p_cpu0,
        "prom_samples": prom_samples,
        "prom_up": prom_up,
        "ours_cpu_s": c_cpu1 - c_cpu0,
        "ours_samples": ours_samples,
        "ours_scrapes": c_ok1 - c_ok0,
        "ours_failed_scrapes": failed,
    }


# --- child processes ----------------------------------------------------------------------------
def _fleet(nodes: int) -> Fleet:
    return Fleet(load_trace(TRACE_DIR), nodes=nodes, gpus_per_node=GPUS_PER_NODE, seed=3)


def serve(nodes: int) -> None:
    """Serve ``nodes`` simulated endpoints; print ``{"urls": [...]}`` on one line; run until SIGTERM."""
    from simulator.dcgm_http import FleetServer

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        async with FleetServer(_fleet(nodes)) as server:
            sys.stdout.write(json.dumps({"urls": list(server.urls().values())}) + "\n")
            sys.stdout.flush()
            await stop.wait()

    asyncio.run(main())


def collect(
    urls_file: Path, interval_s: float, timeout_s: float, metrics_port: int, kafka: str | None
) -> None:
    """Run the collector service on the URLs in ``urls_file`` until SIGTERM, /metrics on the port."""
    from prometheus_client import start_http_server

    from collectors.service import CollectorService
    from runtime.bus import make_bus

    start_http_server(metrics_port, addr="127.0.0.1")
    urls = json.loads(urls_file.read_text())

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        bus = make_bus(kafka, client_id="gpupool-bench")
        topics = KafkaTopics(prefix=f"bench{os.getpid()}.")
        if kafka:
            await bus.create_topics(topics.all(), partitions=4)
        svc = CollectorService(
            bus=bus,
            topics=topics,
            dcgm_targets=urls,
            sysfs_roots=[],
            interval_s=interval_s,
            timeout_s=timeout_s,
            concurrency=64,
        )
        await svc.start()
        try:
            await svc.run(stop)
        finally:
            await svc.stop()
            await bus.close()

    asyncio.run(main())


# --- main -----------------------------------------------------------------------------------------
def main() -> None:
    """Parse the command line; run the benchmark (or a child process) and print the results."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    sp = sub.add_parser("serve")
    sp.add_argument("--nodes", type=int, required=True)
    cp = sub.add_parser("collect")
    cp.add_argument("urls_file", type=Path)
    cp.add_argument("--interval", type=float, required=True)
    cp.add_argument("--timeout", type=float, required=True)
    cp.add_argument("--metrics-port", type=int, required=True)
    cp.add_argument("--kafka", default=None)
    ap.add_argument("--nodes", type=int, default=100, help="simulated 8-GPU nodes (endpoints)")
    ap.add_argument("--interval", type=float, default=5.0, help="scrape interval of both, seconds")
    ap.add_argument("--duration", type=float, default=60.0, help="measured window, seconds")
    ap.add_argument("--kafka", default=None, help="produce to this Kafka instead of the in-process bus")
    ap.add_argument("--capacity-cpu", type=float, default=4.0, help="CPU seconds per capacity loop")
    args = ap.parse_args()
    if args.cmd == "serve":
        serve(args.nodes)
        return
    if args.cmd == "collect":
        collect(args.urls_file, args.interval, args.timeout, args.metrics_port, args.kafka)
        return

    fleet = _fleet(32)
    cap = capacity(fleet, min_cpu_s=args.capacity_cpu)
    per = cap["cpu_per_gpu_s"]
    print("capacity: parse + encode + produce to the in-process bus, simulated 8-GPU H100 bodies")
    print(f"  CPU per GPU sample:                {per * 1e6:8.1f} us")
    gpus = CAPACITY_INTERVAL_S / per
    print(f"  GPUs one core sustains at {CAPACITY_INTERVAL_S:.0f} s:    {gpus:8,.0f} (target >= 10,000)")
    sp_per = cap["spool_cpu_per_gpu_s"]
    sp_gpus = CAPACITY_INTERVAL_S / sp_per
    print(f"  through the delivery spool:        {sp_per * 1e6:8.1f} us -> {sp_gpus:,.0f} GPUs")

    res = side_by_side(args.nodes, args.interval, args.duration, args.kafka)
    bus = f"Kafka {args.kafka}" if args.kafka else "in-process bus"
    ours = res["ours_cpu_s"] / res["ours_samples"] if res["ours_samples"] else float("inf")
    prom = res["prom_cpu_s"] / res["prom_samples"] if res["prom_samples"] else float("inf")
    print(
        f"scrape -> {bus} vs Prometheus: {args.nodes} endpoints x 8 GPUs ({res['lines_per_body']} samples "
        f"each), every {args.interval:g} s, {args.duration:g} s window"
    )
    print(
        f"  gpupool collector: {res['ours_cpu_s']:6.2f} CPU s, {res['ours_samples']:10,.0f} samples "
        f"({res['ours_scrapes']:.0f} scrapes, {res['ours_failed_scrapes']:.0f} failed in all) "
        f"-> {ours * 1e6:6.2f} us/sample"
    )
    print(
        f"  prometheus:        {res['prom_cpu_s']:6.2f} CPU s, {res['prom_samples']:10,.0f} samples "
        f"(up: {res['prom_up']:.0f} of {args.nodes}) -> {prom * 1e6:6.2f} us/sample"
    )
    print(f"  ratio (gpupool / prometheus CPU per sample): {ours / prom:.2f}x (target <= 2x)")
    per_gpu = ours * res["lines_per_body"] / GPUS_PER_NODE
    print(
        f"  whole scrape path: {per_gpu * 1e6:.1f} us CPU per GPU sample -> "
        f"{CAPACITY_INTERVAL_S / per_gpu:,.0f} GPUs per core at {CAPACITY_INTERVAL_S:.0f} s"
    )


if __name__ == "__main__":
    main()
