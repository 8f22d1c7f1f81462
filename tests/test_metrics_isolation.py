"""Each stage's process serves only its own metrics: ``gpupool <stage> run`` imports neither the
other stages nor their module-level Prometheus metrics (default registry), and ``gpupool --help``
still lists every command. Each check runs in a fresh interpreter (``sys.modules`` of this one
holds everything)."""

from __future__ import annotations

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
print(json.dumps({{"modules": mods, "metrics": names}}))
"""

_STAGES = {
    # command: (service module, its metric prefix, packages that must stay unimported)
    "collect": ("collectors.service", "gpupool_collector_", ("analytics", "broker", "simulator")),
    "analytics": ("analytics.service", "gpupool_analytics_", ("collectors", "broker", "simulator")),
    "broker": ("broker.service", "gpupool_broker_", ("collectors", "analytics", "simulator")),
}


@pytest.mark.parametrize("stage", sorted(_STAGES))
def test_stage_run_imports_only_its_own_metrics(stage: str) -> None:
    service, own_prefix, foreign = _STAGES[stage]
    done = subprocess.run([sys.executable, "-c", _PROBE.format(stage=stage, service=service)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    leaked_modules = [m for m in out["modules"] if m.split(".")[0] in foreign]
    assert not leaked_modules, f"gpupool {stage} run imports {leaked_modules}"
    leaked = [n for n in out["metrics"] if not n.startswith(own_prefix)]
    assert not leaked, f"gpupool {stage} run would serve other stages' metrics: {leaked}"
    assert any(n.startswith(own_prefix) for n in out["metrics"]), out["metrics"]


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
