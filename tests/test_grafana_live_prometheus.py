"""Every Grafana panel query returns data from a real Prometheus that scraped a running demo.

Processes, each started here and stopped by its PID at the end:

* the demo (:func:`gpupool.demo.run_demo`, 2 nodes of 8 GPUs, ``metrics_port`` serving every
  stage's metrics) in a fresh interpreter, so that the default prometheus_client registry holds
  only what the demo registers and increments (this pytest process has imported other stages'
  metric modules and moved their counters in other tests: in-process, a panel could "return data"
  left there by another test). Its ``on_started`` hook writes the simulated nodes' endpoints to a
  JSON file and injects two seconds of truncated bodies, then two seconds of HTTP 500, on one
  node's dcgm-exporter endpoint (``FleetServer.fail_mode``), so the scrape-error panels have errors
  to show;
* one Debian ``prometheus-node-exporter`` per simulated node, infiniband collector only, reading
  the node's simulated sysfs (``--path.sysfs``): the Fabric dashboard's ``node_infiniband_*``;
* Debian ``prometheus`` on a free loopback port, scrape and rule evaluation every second, jobs
  ``gpupool-demo`` (the demo's metrics port), ``dcgm-exporter`` (the simulated endpoints),
  ``node-exporter`` — the job names of ``deploy/prometheus/prometheus.yml`` — and every rule file
  of ``deploy/prometheus/rules/``.

Each panel target's expression, Grafana variables replaced by :func:`grafana.lint.expand_variables`
(the same expansion the static tests parse: ranges ``5m``, template variables ``.*``), goes to
``/api/v1/query`` (instant query) until every target expected to have data has some (a series with
a value other than NaN), or a deadline. Targets whose metrics the demo cannot produce are listed in
:data:`ALLOWANCES` with the reason; one listed as always empty that has data fails the test,
so the list stays honest (entries with ``always_empty=False`` depend on chance or timing and pass
either way). Also checked: every dashboard variable's ``label_values`` has values,
every rule evaluates without error, and every recording rule has data.

Needs ``/usr/bin/prometheus`` and ``prometheus-node-exporter`` (Debian packages ``prometheus``,
``prometheus-node-exporter``): skipped without them, except in CI (``CI=true``) where it fails.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml

from grafana import lint
from tests.support import tool_missing

if TYPE_CHECKING:
    from simulator.dcgm_http import FleetServer
    from simulator.sysfs import SysfsTree

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_DIR = ROOT / "grafana" / "dashboards"
_LABEL_VALUES = re.compile(r"label_values\(\s*(?P<metric>[^,()]+?)\s*,\s*(?P<label>\w+)\s*\)")
"""Grafana's Prometheus variable query ``label_values(metric, label)`` (the only form the dashboards use)."""
RULE_FILES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))

DEMO_NODES = 2
DEMO_MAX_S = 80.0
"""The demo's ``duration_s``: an upper bound, it is stopped (SIGTERM) once the checks are done."""
DATA_DEADLINE_S = 60.0
"""Seconds after Prometheus is ready by which every expected target must have data (the slowest,
which need the first lease and reclaim, took 8 to 37 s in trials)."""
FAULT_HOST_S = 2.0
"""Seconds of each injected fault (truncated bodies, then HTTP 500) on the first node."""


@dataclass(frozen=True)
class Allowance:
    """Why a panel target may return no data from the demo.

    ``always_empty``: the demo cannot produce the metric at all, and the test fails if it returns
    data (the allowance is then stale). ``False``: the demo produces it in some runs only (it
    depends on a random choice or on timing), so either outcome passes.
    """

    reason: str
    always_empty: bool = True


_NO_SCHEDULER = Allowance(
    "the demo runs without a training scheduler (no Slurm source, analytics without --scheduler), so "
    "gpupool_analytics_allocated_idle_gpus and gpupool_collector_slurm_* have no series; "
    "tests/test_collectors_slurm.py and tests/test_analytics_scheduler.py set them"
)
_NO_FABRIC_COLLECTOR = Allowance(
    "the demo runs no fabric collector (collectors.fabric needs ibnetdiscover/perfquery on an "
    "InfiniBand fabric, e.g. ibsim), so no gpupool_collector_fabric_* metric exists; "
    "tests/test_fabric_ibsim.py exercises it against ibsim"
)
_NO_FABRIC_QOS = Allowance(
    "this demo runs without a fabric (DemoConfig.fabric is off): no QoS plan is written, no lease "
    "QoS verified and no audit completes, so these series stay empty (the unlabelled audit "
    "histogram has only zero buckets: NaN); tests/test_broker_fabric_qos.py exercises them on ibsim"
)
_HEALTHY = "the demo's stages hit no such error: the counter's labelled series appears at its first error"

_NO_KUBERNETES_SOURCE = Allowance(
    "the collectors' Kubernetes source (gpupool_collector_kubernetes_*) reads a Kubernetes API server; "
    "the demo's collectors read Slurm or nothing, so its counters never appear"
)
ALLOWANCES: dict[tuple[str, str, str], Allowance] = {
    ("fabric.json", "Ports down", "A"): _NO_FABRIC_COLLECTOR,
    ("fabric.json", "Port samples per second", "A"): _NO_FABRIC_COLLECTOR,
    ("fabric.json", "Sweep time p95", "A"): _NO_FABRIC_COLLECTOR,
    ("fabric.json", "Diag timeouts in range", "A"): _NO_FABRIC_COLLECTOR,
    ("fabric.json", "Fabric collection errors by reason", "A"): _NO_FABRIC_COLLECTOR,
    ("fabric.json", "Sweep, discovery and per-device time", "A"): _NO_FABRIC_COLLECTOR,
    ("fabric.json", "Sweep, discovery and per-device time", "B"): _NO_FABRIC_COLLECTOR,
    ("fabric.json", "Sweep, discovery and per-device time", "C"): _NO_FABRIC_COLLECTOR,
    ("fabric.json", "Leaf uplink headroom and the lent share", "A"): Allowance(
        "the leaf of a host and its uplinks come from fabric.topology and the switch ports' reads, "
        "which only the fabric collector produces; the demo runs none"
    ),
    ("fabric.json", "Leaf uplink XmitWait", "A"): Allowance(
        "no leaf uplink reads without the fabric collector (see the headroom panel)"
    ),
    ("fabric.json", "Last QoS audit", "A"): _NO_FABRIC_QOS,
    ("fabric.json", "Lease QoS verify p95", "A"): _NO_FABRIC_QOS,
    ("fabric.json", "QoS drift per switch", "A"): _NO_FABRIC_QOS,
    ("fabric.json", "QoS verify and audit time", "A"): _NO_FABRIC_QOS,
    ("fabric.json", "QoS verify and audit time", "B"): _NO_FABRIC_QOS,
    ("fleet.json", "XID errors by code", "A"): Allowance(
        "the simulated GPUs never raise an XID (simulator/fleet.py: DCGM_FI_DEV_XID_ERRORS is always "
        "0), and gpupool_collector_xid_events_total{xid} appears at the first XID"
    ),
    ("idle-capacity.json", "Kubernetes source errors by resource and reason", "A"): _NO_KUBERNETES_SOURCE,
    ("idle-capacity.json", "Kubernetes source errors by resource and reason", "B"): _NO_KUBERNETES_SOURCE,
    ("idle-capacity.json", "Revoked at deadline in range", "A"): Allowance(
        "needs a reclaim that a site lets run out: each simulated site releases within the notice "
        "with probability 0.85 (simulator/sites.py), and whether a reclaim happens at all before "
        "the query depends on the trace and timing",
        always_empty=False,
    ),
    ("pipeline-health.json", "Rejected site messages by reason", "A"): Allowance(
        "needs a site message the broker refuses; in the demo that is a claim that lost the race for "
        "an offer to another of the three simulated sites (or came after the offer expired), which "
        "depends on timing",
        always_empty=False,
    ),
    ("pipeline-health.json", "sysfs errors and loop errors by reason", "A"): Allowance(
        f"{_HEALTHY} (the simulated sysfs files are replaced atomically, never unreadable)"
    ),
    ("pipeline-health.json", "sysfs errors and loop errors by reason", "B"): Allowance(
        f"{_HEALTHY} (an unexpected exception in the collection loop)"
    ),
    ("pipeline-health.json", "Produce errors by topic", "A"): Allowance(
        f"{_HEALTHY} (the in-process bus accepts every record)"
    ),
    ("idle-capacity.json", "GPUs allocated to jobs but idle", "A"): _NO_SCHEDULER,
    ("idle-capacity.json", "GPU-hours allocated but idle in range, by job", "A"): _NO_SCHEDULER,
    ("idle-capacity.json", "Slurm source errors by command and reason", "A"): _NO_SCHEDULER,
    ("pipeline-health.json", "Rejected records by reason", "A"): Allowance(
        f"{_HEALTHY} (analytics reads only well-formed records from the in-process bus)"
    ),
}
"""``(dashboard file, panel title, refId)`` → why that target may return no data from the demo."""


@dataclass(frozen=True)
class _Target:
    dashboard: str
    panel: str
    ref: str
    expr: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.dashboard, self.panel, self.ref)


def _targets() -> list[_Target]:
    out = []
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        for panel in _panels(json.loads(path.read_text())["panels"]):
            for target in panel.get("targets") or []:
                out.append(_Target(path.name, panel["title"], target["refId"], target["expr"]))
    return out


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])


def _variables() -> list[tuple[str, str]]:
    return [
        (path.name, var["query"])
        for path in sorted(DASHBOARD_DIR.glob("*.json"))
        for var in json.loads(path.read_text())["templating"]["list"]
        if var["type"] == "query"
    ]


# --- the demo, in its own interpreter ---------------------------------------------------------


def _demo_main() -> None:
    """Subprocess entry: ``python -c '...; _demo_main()' ENDPOINTS_JSON STATE_DIR METRICS_PORT``.

    Runs the demo; once its stages have started, writes ``{"dcgm": {host: url}, "sysfs": {host:
    /sys folder}}`` to ENDPOINTS_JSON (via a temporary file, so a reader sees all or nothing) and
    injects the faults described in the module docstring. Interrupted with SIGINT.
    """
    import asyncio
    import logging

    from gpupool.demo import DemoConfig, run_demo

    endpoints, state_dir, port = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def started(server: FleetServer, sysfs: SysfsTree) -> None:
        host = sorted(server.urls())[0]
        loop = asyncio.get_running_loop()
        server.fail_mode[host] = "truncate"
        loop.call_later(FAULT_HOST_S, server.fail_mode.__setitem__, host, "http500")
        loop.call_later(2 * FAULT_HOST_S, server.fail_mode.__setitem__, host, None)
        doc = {"dcgm": server.urls(), "sysfs": {h: str(p) for h, p in sysfs.roots()}}
        tmp = endpoints.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(endpoints)

    cfg = DemoConfig(
        duration_s=DEMO_MAX_S, nodes=DEMO_NODES, metrics_port=port, state_dir=state_dir, on_started=started
    )
    asyncio.run(run_demo(cfg))


# --- helpers -----------------------------------------------------------------------------------


def _binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        tool_missing(f"{name} not found: install Debian's {package} package (deploy/local/install-system.sh)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class _Processes:
    """The processes this test started, each stopped by its PID (SIGTERM, SIGKILL after 10 s)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, name: str, args: list[str], cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``args`` with stdout and stderr in ``<log_dir>/<name>.log``."""
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
        self.procs.append((proc, log))
        return proc

    def wait_for(
        self, proc: subprocess.Popen[bytes], what: str, ok: Callable[[], bool], timeout_s: float
    ) -> None:
        """Poll ``ok()`` until true; fails with the process' log if it exits or ``timeout_s`` passes."""
        log = next(lg for p, lg in self.procs if p is proc)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"{what}: exited with {proc.returncode}:\n{_tail(log)}")
            if ok():
                return
            time.sleep(0.2)
        pytest.fail(f"{what}: not ready after {timeout_s} s:\n{_tail(log)}")

    def stop_all(self) -> None:
        for proc, _ in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc, _ in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _prometheus_config(metrics_port: int, dcgm_urls: list[str], node_exporters: list[str]) -> dict[str, Any]:
    """Prometheus configuration
    (https://prometheus.io/docs/prometheus/latest/configuration/configuration/)."""
    assert all(httpx.URL(u).path == "/metrics" for u in dcgm_urls), dcgm_urls
    dcgm = [f"{httpx.URL(u).host}:{httpx.URL(u).port}" for u in dcgm_urls]
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in RULE_FILES],
        "scrape_configs": [
            {"job_name": "gpupool-demo", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]},
            {"job_name": "dcgm-exporter", "static_configs": [{"targets": dcgm}]},
            {"job_name": "node-exporter", "static_configs": [{"targets": node_exporters}]},
        ],
    }


@dataclass
class _Stack:
    client: httpx.Client
    demo: subprocess.Popen[bytes]
    demo_log: Path
    ready_at: float
    """``time.monotonic()`` when Prometheus answered ``/-/ready``."""


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[_Stack]:
    """The demo, a node_exporter per simulated node and Prometheus scraping them (module docstring)."""
    prometheus = _binary("prometheus", "prometheus")
    node_exporter = _binary("prometheus-node-exporter", "prometheus-node-exporter")
    procs = _Processes(tmp_path)
    try:
        metrics_port = _free_port()
        endpoints = tmp_path / "endpoints.json"
        entry = "from tests.test_grafana_live_prometheus import _demo_main; _demo_main()"
        demo_args = [sys.executable, "-c", entry, str(endpoints), str(tmp_path / "demo"), str(metrics_port)]
        demo = procs.start("demo", demo_args, cwd=ROOT)
        procs.wait_for(demo, "demo", endpoints.exists, 30.0)
        ends = json.loads(endpoints.read_text())
        assert len(ends["dcgm"]) == DEMO_NODES and len(ends["sysfs"]) == DEMO_NODES, ends

        exporters = []
        for host, sys_root in sorted(ends["sysfs"].items()):
            port = _free_port()
            exporters.append(f"127.0.0.1:{port}")
            flags = [f"--web.listen-address=127.0.0.1:{port}", f"--path.sysfs={sys_root}"]
            proc = procs.start(
                f"node-exporter-{host}",
                [node_exporter, *flags, "--collector.disable-defaults", "--collector.infiniband"],
            )
            url = f"http://127.0.0.1:{port}/metrics"
            procs.wait_for(proc, f"node_exporter {host}", lambda u=url: _http_ok(u), 15.0)

        prom_port = _free_port()
        config = tmp_path / "prometheus.yml"
        prom_config = _prometheus_config(metrics_port, list(ends["dcgm"].values()), exporters)
        config.write_text(yaml.safe_dump(prom_config))
        prom = procs.start(
            "prometheus",
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
        )
        base = f"http://127.0.0.1:{prom_port}"
        procs.wait_for(prom, "prometheus", lambda: _http_ok(f"{base}/-/ready"), 30.0)
        with httpx.Client(base_url=base, timeout=10.0) as client:
            yield _Stack(client, demo, tmp_path / "demo.log", time.monotonic())
    finally:
        procs.stop_all()


def _query(client: httpx.Client, expr: str) -> list[dict[str, Any]]:
    """Result of an instant query (``/api/v1/query``) as a list of samples; fails on an API error."""
    body = client.get("/api/v1/query", params={"query": expr}).json()
    assert body["status"] == "success", f"{expr!r}: {body}"
    data = body["data"]
    if data["resultType"] == "scalar":
        return [{"metric": {}, "value": data["result"]}]
    return list(data["result"])


def _has_data(client: httpx.Client, expr: str) -> bool:
    """The dashboard expression ``expr`` (Grafana variables expanded) returns a value other than NaN."""
    result = _query(client, lint.expand_variables(expr))
    return any(not math.isnan(float(s["value"][1])) for s in result)


def _poll(stack: _Stack, expected: list[_Target]) -> tuple[list[_Target], dict[tuple[str, str, str], float]]:
    """Query ``expected`` every 2 s until all have data or :data:`DATA_DEADLINE_S` passed.
    Returns the targets still without data and, for the others, when their data first showed
    (seconds after Prometheus was ready). Fails if the demo exits meanwhile."""
    missing = expected
    first_data: dict[tuple[str, str, str], float] = {}
    while True:
        if stack.demo.poll() is not None:
            pytest.fail(f"the demo exited with {stack.demo.returncode}:\n{_tail(stack.demo_log)}")
        now = time.monotonic() - stack.ready_at
        missing = [t for t in missing if not _has_data(stack.client, t.expr)]
        first_data.update((t.key, now) for t in expected if t.key not in first_data and t not in missing)
        if not missing or now > DATA_DEADLINE_S:
            return missing, first_data
        time.sleep(2.0)


def _label_values(client: httpx.Client, query: str) -> list[str]:
    """Values of a ``label_values(metric, label)`` variable query (``/api/v1/label/<label>/values``)."""
    m = _LABEL_VALUES.fullmatch(query.strip())
    assert m is not None, f"unsupported variable query {query!r}"
    params = {"match[]": m.group("metric")}
    body = client.get(f"/api/v1/label/{m.group('label')}/values", params=params).json()
    assert body["status"] == "success", body
    return list(body["data"])


def _rules(client: httpx.Client) -> tuple[list[str], list[str]]:
    """``(rule files not loaded and rules with an evaluation error, recording rules without data)``."""
    groups = client.get("/api/v1/rules").json()["data"]["groups"]
    loaded = {g["file"] for g in groups}
    problems = [f"rule file not loaded: {p}" for p in RULE_FILES if str(p) not in loaded]
    records: list[str] = []
    for group in groups:
        for rule in group["rules"]:
            if rule["health"] != "ok":
                problems.append(f"{rule['name']}: {rule['health']} {rule.get('lastError', '')}")
            if rule["type"] == "recording":
                records.append(rule["name"])
    return problems, [r for r in records if not _has_data(client, r)]


def _report(
    targets: list[_Target],
    missing: list[_Target],
    allowed_with_data: set[tuple[str, str, str]],
    first_data: dict[tuple[str, str, str], float],
) -> str:
    """One line per target: when its data first showed (seconds after Prometheus was ready),
    ``NO DATA``, or its allowance's outcome."""
    missing_keys = {t.key for t in missing}
    lines = [f"\n{len(targets)} panel targets:"]
    for t in targets:
        if t.key in ALLOWANCES:
            state = "data (allowed empty)" if t.key in allowed_with_data else "empty (allowed)"
        else:
            state = "NO DATA" if t.key in missing_keys else f"data at {first_data[t.key]:.0f} s"
        lines.append(f"  {state:22} {t.dashboard} / {t.panel} / {t.ref}")
    return "\n".join(lines) + "\n"


# --- the test ----------------------------------------------------------------------------------


def test_allowances_name_real_targets() -> None:
    targets = _targets()
    assert len(targets) >= 60
    keys = {t.key for t in targets}
    assert len(keys) == len(targets), "two targets share (dashboard, panel title, refId)"
    assert set(ALLOWANCES) <= keys, f"allowances for no target: {sorted(set(ALLOWANCES) - keys)}"


def test_every_panel_query_returns_data_from_prometheus_scraping_the_demo(stack: _Stack) -> None:
    targets = _targets()
    missing, first_data = _poll(stack, [t for t in targets if t.key not in ALLOWANCES])
    allowed_with_data = {t.key for t in targets if t.key in ALLOWANCES and _has_data(stack.client, t.expr)}
    sys.stdout.write(_report(targets, missing, allowed_with_data, first_data))

    assert not missing, "panel targets without data:\n" + "\n".join(
        f"  {t.dashboard} / {t.panel} / {t.ref}: {t.expr}" for t in missing
    )
    stale = sorted(k for k in allowed_with_data if ALLOWANCES[k].always_empty)
    assert not stale, f"allowed to be empty but returned data (drop the allowance): {stale}"
    without_values = [(name, q) for name, q in _variables() if not _label_values(stack.client, q)]
    assert not without_values, f"dashboard variables without values: {without_values}"
    rule_problems, records_without_data = _rules(stack.client)
    assert not rule_problems, rule_problems
    assert not records_without_data, f"recording rules without data: {records_without_data}"
    active = stack.client.get("/api/v1/targets").json()["data"]["activeTargets"]
    health = sorted((t["labels"]["job"], t["labels"]["instance"], t["health"]) for t in active)
    assert [job for job, _, _ in health] == [
        "dcgm-exporter", "dcgm-exporter", "gpupool-demo", "node-exporter", "node-exporter",
    ], health
    assert all(h == "up" for _, _, h in health), health
