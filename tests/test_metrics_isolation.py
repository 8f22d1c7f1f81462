"""Each stage's metrics belong to the service that counts them: a service builds its metrics on a
registry of its own (``service.registry``, what its ``/metrics`` serves), two services of one stage
in one process do not mix (the stage tests drive both: ``test_two_*_keep_their_metrics_apart``),
stage code defines no module-level metric object, and the pure cores import no metrics at all.
``gpupool <stage> run`` still imports no other stage (checked in a fresh interpreter: ``sys.modules``
of this one holds everything), and ``gpupool --help`` still lists every command."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys
from prometheus_client import REGISTRY, generate_latest
from gpupool.cli import app
try:
    app(args=[{stage!r}, "run", "--help"], prog_name="gpupool", standalone_mode=False)
except SystemExit:
    pass
import {service}  # what `run` imports when it starts the stage
names = sorted({{line.split("{{")[0].split(" ")[0] for line in generate_latest(REGISTRY).decode().splitlines()
                if line.startswith("gpupool_")}})
mods = sorted(m for m in sys.modules if m.split(".")[0] in ("collectors", "analytics", "broker", "simulator"))
print(json.dumps({{"modules": mods, "default_registry": names}}))
"""

_STAGES = {
    # command: (service module, packages that must stay unimported)
    "collect": ("collectors.service", ("analytics", "broker", "simulator")),
    "analytics": ("analytics.service", ("collectors", "broker", "simulator")),
    "broker": ("broker.service", ("collectors", "analytics", "simulator")),
}

_METRIC_CLASSES = frozenset({"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum", "StateGauge"})

_PURE_CORES = (
    "broker/leases.py",
    "broker/match.py",
    "broker/quota.py",
    "analytics/classify.py",
    "analytics/predict.py",
    "analytics/rows.py",
    "analytics/scheduler.py",
    "collectors/dcgm.py",
    "collectors/nvsmi.py",
    "collectors/nvsmi_csv.py",
    "collectors/nvml.py",
    "collectors/fabric_parse.py",
    "collectors/slurm_parse.py",
    "collectors/ufm_telemetry.py",
    "collectors/sysfs_ib.py",
    "collectors/ibstat.py",
)
"""Decision logic and parsers: they return what happened; the service counts it."""


@pytest.mark.parametrize("stage", sorted(_STAGES))
def test_stage_run_imports_no_other_stage_and_registers_nothing_globally(stage: str) -> None:
    service, foreign = _STAGES[stage]
    done = subprocess.run([sys.executable, "-c", _PROBE.format(stage=stage, service=service)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    leaked_modules = [m for m in out["modules"] if m.split(".")[0] in foreign]
    assert not leaked_modules, f"gpupool {stage} run imports {leaked_modules}"
    assert out["default_registry"] == [], "a module-level metric landed on the default registry"


def _calls(tree: ast.AST, names: frozenset[str] = _METRIC_CLASSES) -> list[tuple[int, str]]:
    """Calls of ``names`` (a metric class, by the name it is bound to) in ``tree``: (line, name)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in names:
                out.append((node.lineno, name))
    return out


def test_no_module_level_metric_objects_in_stage_code() -> None:
    """No stage module builds a metric at import time; only a stage's ``metrics.py`` builds
    metrics at all (inside the classes the services instantiate)."""
    found = []
    for stage in ("collectors", "analytics", "broker"):
        for path in sorted((REPO / stage).glob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            rel = path.relative_to(REPO).as_posix()
            for node in tree.body:  # module level
                if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None and _calls(node.value):
                    found.append(f"{rel}:{node.lineno} (module level)")
            if path.name != "metrics.py":
                # the names prometheus_client's metric classes are bound to here (``Counter as
                # PromCounter``), so collections.Counter() is not taken for a metric
                bound = frozenset(
                    a.asname or a.name
                    for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("prometheus_client")
                    for a in n.names
                    if a.name in _METRIC_CLASSES
                )
                found.extend(f"{rel}:{line} {name}(...) outside metrics.py" for line, name in _calls(tree, bound))
    assert found == []


@pytest.mark.parametrize("rel", _PURE_CORES)
def test_pure_cores_import_no_metrics(rel: str) -> None:
    tree = ast.parse((REPO / rel).read_text(encoding="utf-8"))
    imported = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            imported.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            imported.add(n.module or "")
            imported.update(f"{n.module}.{a.name}" for a in n.names)
    bad = sorted(m for m in imported if m.startswith("prometheus_client") or m.split(".")[-1] == "metrics"
                 or m.endswith(("_metrics", ".metrics")) or "metrics." in m)
    assert bad == [], f"{rel} imports {bad}"


def test_each_service_serves_its_own_registry_with_only_its_stage_series() -> None:
    """Two services of each stage built in one process: distinct registries (building the second
    does not clash with the first), each holding only its own stage's series."""
    from analytics.service import AnalyticsService
    from broker.service import BrokerService
    from collectors.service import CollectorService
    from contracts import KafkaTopics
    from contracts.bus import MemoryBus

    topics = KafkaTopics()
    built = {
        "gpupool_collector_": [
            CollectorService(bus=MemoryBus(), topics=topics, dcgm_targets=[], sysfs_roots=[]) for _ in range(2)
        ],
        "gpupool_analytics_": [
            AnalyticsService(bus=MemoryBus(), topics=topics, db_path=":memory:") for _ in range(2)
        ],
        "gpupool_broker_": [
            BrokerService(bus=MemoryBus(), topics=topics, mqtt_host="127.0.0.1", mqtt_port=1) for _ in range(2)
        ],
    }
    registries = [svc.registry for services in built.values() for svc in services]
    assert len({id(r) for r in registries}) == len(registries)
    for prefix, services in built.items():
        for svc in services:
            names = {m.name for m in svc.registry.collect()}
            assert names and all(n.startswith(prefix) for n in names), (prefix, sorted(names))


def test_entry_point_help_lists_every_command() -> None:
    exe = Path(sys.executable).parent / "gpupool"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from gpupool.cli import app; app(prog_name='gpupool')"]
    done = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, check=False)
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.split("Commands:")[1].splitlines() if line.strip()}
    assert listed == {"collect", "analytics", "broker", "edge", "topics", "simulate", "config", "report", "demo"}


def test_an_unknown_command_is_a_usage_error() -> None:
    done = subprocess.run([sys.executable, "-c", "from gpupool.cli import app; app(prog_name='gpupool')", "nope"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert done.returncode == 2
    assert "No such command" in done.stderr
