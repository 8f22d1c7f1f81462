"""The edge SDK installs alone: ``pip install gpupool`` is the edge-site client and its CLI
(``broker.edge``, ``gpupool edge ...``); the stages' packages are the ``server`` extra.

The install is checked for real in an isolated virtualenv that holds exactly the distributions
pip would install for the core requirements (the closure of their ``Requires-Dist``, read from the
metadata of this environment), none of the server extra: there the SDK imports, ``gpupool edge
offers`` talks to a real MQTT server (amqtt in this process), and a stage command says which extra
it needs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from gpupool.embedded_mqtt import EmbeddedMqttBroker
from tests.services import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SERVER_ONLY = {"aiokafka", "duckdb", "pyarrow", "prometheus_client", "amqtt", "aiohttp", "httpx", "plotly"}
"""Top-level modules an edge install must not have (nor ``opentelemetry.sdk`` / ``.exporter``)."""


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def test_the_core_requirements_are_the_edge_sdk_and_the_server_extra_the_rest() -> None:
    core = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    server = {_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["server"]}
    assert {"aiomqtt", "pydantic", "typer", "opentelemetry-api"} <= core
    assert not core & {"aiokafka", "duckdb", "pyarrow", "prometheus-client", "opentelemetry-sdk",
                       "opentelemetry-exporter-otlp-proto-http", "amqtt", "aiohttp", "httpx", "plotly"}  # fmt: skip
    assert {"aiokafka", "duckdb", "opentelemetry-exporter-otlp-proto-http", "prometheus-client"} <= server


def _closure(requirements: list[str]) -> set[str]:
    """Distributions pip would install for ``requirements`` (no extras), by their metadata here."""
    todo, seen = [Requirement(r) for r in requirements], set[str]()
    while todo:
        req = todo.pop()
        name = _name(str(req.name))
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.distribution(name).requires or []]
    return seen


def _edge_venv(tmp_path: Path) -> Path:
    """A virtualenv (no pip) whose site-packages holds links to the files of the core closure's
    distributions only (their RECORD), and this repository on its path (the flat layout, as an editable install)."""
    venv = tmp_path / "edge-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site,) = venv.glob("lib/python3*/site-packages")
    for name in _closure(PYPROJECT["project"]["dependencies"]):
        dist = metadata.distribution(name)
        for f in dist.files or ():  # file by file: namespace packages (opentelemetry) are shared
            rel = Path(str(f))
            if rel.parts[0] == ".." or "__pycache__" in rel.parts:
                continue
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            if not (site / rel).exists():
                (site / rel).symlink_to(Path(str(dist.locate_file(f))))
    (site / "gpupool-repo.pth").write_text(f"{REPO}\n")
    return venv / "bin" / "python"


_SCRIPT = r"""
import json, sys
from broker.edge import EdgeClient
from broker.kept_leases import KeptLeases
from gpupool.cli import app
import broker.cli
server = sorted(m for m in sys.modules if m.split(".")[0] in SERVER_ONLY
                or m.startswith(("opentelemetry.sdk", "opentelemetry.exporter")))
print(json.dumps({"server_modules": server, "edge": EdgeClient.__module__, "kept": KeptLeases.__module__}), flush=True)
sys.argv = ["gpupool", *sys.argv[1:]]
app()
"""


def test_the_edge_sdk_and_cli_work_in_a_venv_without_the_server_extra(tmp_path: Path) -> None:
    python = _edge_venv(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPOOL_", "OTEL_"))}
    script = f"SERVER_ONLY = {sorted(SERVER_ONLY)!r}\n{_SCRIPT}"
    for module in ("duckdb", "aiokafka", "opentelemetry.exporter.otlp", "opentelemetry.sdk", "prometheus_client"):
        probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True,
                               env=env, timeout=60, check=False)  # fmt: skip
        assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr, (module, probe.stderr)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), "-c", script, *args], capture_output=True, text=True,
                              env=env, timeout=60, cwd=tmp_path, check=False)  # fmt: skip

    async def offers() -> subprocess.CompletedProcess[str]:
        import asyncio

        async with EmbeddedMqttBroker() as server:
            return await asyncio.to_thread(
                run, "edge", "offers", "--mqtt", f"127.0.0.1:{server.port}", "--site", "edge-a",
                "--protocol", "4", "--timeout", "1",
            )  # fmt: skip

    import asyncio

    done = asyncio.run(offers())
    assert done.returncode == 0, done.stderr
    head, body = done.stdout.split("\n", 1)
    assert json.loads(head) == {"server_modules": [], "edge": "broker.edge", "kept": "broker.kept_leases"}
    assert json.loads(body) == []  # no broker runs: no offers, but a real MQTT session
    stage = run("analytics", "run", "--help")
    assert stage.returncode == 2, stage.stdout + stage.stderr
    assert "pip install 'gpupool[server]'" in stage.stderr and "Traceback" not in stage.stderr
