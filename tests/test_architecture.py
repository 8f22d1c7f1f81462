"""The structure DESIGN.md promises: stages talk only through ``contracts`` (Kafka and MQTT).

Parses every module's imports with :mod:`ast` (so a local import inside a function counts too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("collectors", "analytics", "broker")
# What each package may import among the project's own packages.
ALLOWED = {
    "contracts": set(),
    # process plumbing (Kafka client, settings, tracing, backoff) shared by the stages
    "runtime": {"contracts"},
    "collectors": {"contracts", "runtime"},
    "analytics": {"contracts", "runtime"},
    "broker": {"contracts", "runtime"},
    # simulated edge sites drive the edge SDK, as a real site would
    "simulator": {"contracts", "broker"},
}
PROJECT = {"contracts", "runtime", "collectors", "analytics", "broker", "simulator", "gpupool"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_it_may(package: str) -> None:
    bad: list[str] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for mod in _imports(path) & PROJECT:
            if mod != package and mod not in ALLOWED[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "stages must talk only through contracts/:\n" + "\n".join(bad)


EDGE_SDK = ("broker", "broker.edge", "broker.kept_leases")
"""The broker's modules an edge site installs and uses (the core distribution)."""


def test_the_simulator_uses_only_the_edge_sdk_of_the_broker() -> None:
    for path in sorted((ROOT / "simulator").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("broker"):
                assert node.module in EDGE_SDK, f"{path.name} imports {node.module}"


HEAVY = ("aiokafka", "opentelemetry.sdk", "opentelemetry.exporter", "duckdb", "aiohttp", "httpx", "pyarrow")


@pytest.mark.parametrize(
    "module",
    ["contracts", "contracts.bus", "collectors.dcgm", "collectors.sysfs_ib", "collectors.ibstat", *EDGE_SDK[1:]],
)
def test_importing_a_contract_a_parser_or_the_edge_sdk_stays_light(module: str) -> None:
    """No Kafka client, OpenTelemetry SDK or exporter, DuckDB, Arrow or HTTP client is loaded."""
    import subprocess
    import sys

    probe = f"import sys, {module}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "", f"importing {module} loads {done.stdout.strip()}"
