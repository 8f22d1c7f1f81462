"""A simulated InfiniBand fabric (ibsim + OpenSM) for integration tests, from ``deploy/local/fabric.sh``.

Use it from a test module with::

    from tests.fabric_fixture import sim_fabric  # noqa: F401  (the session fixture)

    def test_something(sim_fabric: SimFabric) -> None: ...

The fabric gets a private state directory (its own ibsim socket name), so it never collides with a
fabric a developer runs under ``.state/``. It is stopped at the end of the session. When it cannot
start, every test that needs it fails with the script's output — never skipped, in CI (``CI=true``)
or not, as the other service fixtures (:mod:`tests.services`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest

REPO = Path(__file__).resolve().parents[1]
FABRIC_SH = REPO / "deploy" / "local" / "fabric.sh"


def _load_console_module() -> ModuleType:
    """``deploy/local/fabric/console.py`` (a script, not a package) as a module."""
    spec = importlib.util.spec_from_file_location(
        "gpupool_fabric_console", REPO / "deploy/local/fabric/console.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


console_mod = _load_console_module()


@dataclass
class SimFabric:
    """A running simulated fabric.

    Attributes:
        state_dir: its state directory (``fabric.json``, logs, ``partitions.conf``...).
        info: the parsed ``fabric.json`` (``env``, ``nodes`` → GUIDs/LIDs, paths).
        console: the ibsim console (``PerformanceSet``, ``Unlink``, ``ReLink``...).
    """

    state_dir: Path
    info: dict[str, Any]
    console: Any

    @property
    def env(self) -> dict[str, str]:
        """Environment for diag commands: ``IBSIM_SOCKNAME`` and ``LD_PRELOAD``."""
        return dict(self.info["env"])

    @property
    def workdir(self) -> Path:
        """A writable working directory for diag commands (libumad2sim writes ``sys-<pid>/`` there)."""
        return Path(self.info["workdir"])

    def node(self, nodeid: str) -> dict[str, Any]:
        """``fabric.json``'s entry for ``nodeid`` (``node_guid``, ``port_guid``, ``lid``, ``role``...)."""
        return dict(self.info["nodes"][nodeid])


def _fail(message: str) -> NoReturn:
    ci = " (CI=true)" if os.environ.get("CI") == "true" else ""
    pytest.fail(f"{message}{ci}", pytrace=False)


@pytest.fixture(scope="session")
def sim_fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFabric]:
    """Start the default fat tree (2 spines × 4 leaves × 4 HCAs + edge gateway) for the session."""
    state_dir = tmp_path_factory.mktemp("fabric")
    env = {**os.environ, "GPUPOOL_FABRIC_DIR": str(state_dir)}
    for key in (
        "GPUPOOL_FABRIC_SPINES",
        "GPUPOOL_FABRIC_LEAVES",
        "GPUPOOL_FABRIC_HCAS_PER_LEAF",
        "GPUPOOL_FABRIC_UPLINKS",
        "GPUPOOL_FABRIC_SPEED",
        "GPUPOOL_FABRIC_SWITCH_PORTS",
    ):
        env.pop(key, None)
    try:
        done = subprocess.run(
            ["bash", str(FABRIC_SH), "start"],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        _fail(f"deploy/local/fabric.sh start did not finish: {exc}")
    if done.returncode != 0:
        subprocess.run(
            ["bash", str(FABRIC_SH), "stop"], check=False, env=env, capture_output=True, timeout=60
        )
        _fail(
            f"deploy/local/fabric.sh start failed with exit status {done.returncode}\n"
            f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        )
    info = json.loads((state_dir / "fabric.json").read_text())
    try:
        yield SimFabric(state_dir, info, console_mod.IbsimConsole(state_dir))
    finally:
        subprocess.run(
            ["bash", str(FABRIC_SH), "stop"], check=False, env=env, capture_output=True, timeout=60
        )
