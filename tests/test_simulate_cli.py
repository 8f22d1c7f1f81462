"""``gpupool simulate serve`` as an operator runs it: a subprocess serving the real trace, read with
the collectors' own file_sd, dcgm-exporter and sysfs parsers, then stopped with SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from typer.testing import CliRunner

from collectors.dcgm import parse_dcgm_exporter
from collectors.sysfs_ib import read_sysfs_infiniband
from collectors.targets import parse_file_sd
from gpupool.cli import app

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / ".." / "shared" / "data" / "traces" / "alibaba_genai_2026"


def _json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_serve_subprocess_scraped_by_collectors_then_sigterm(tmp_path: Path) -> None:
    file_sd = tmp_path / "targets.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", "from gpupool.cli import app; app(prog_name='gpupool')",
         "--log-level", "INFO", "simulate", "serve", "--gpus", "16", "--port", "0",
         "--trace-dir", str(TRACE), "--sysfs-dir", str(tmp_path / "sysfs"), "--file-sd", str(file_sd),
         "--sysfs-interval", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until serving (or exit: then empty)
        assert line, proc.stderr.read() if proc.stderr else ""
        doc = json.loads(line)
        assert doc["event"] == "simulate_serving" and doc["gpus"] == 16 and doc["nodes"] == 2

        targets, dropped = parse_file_sd(file_sd.read_bytes(), source=str(file_sd))
        assert not dropped and len(targets) == 2
        assert [t.url for t in targets] == list(doc["targets"].values())  # type: ignore[union-attr]
        with urllib.request.urlopen(targets[1].url, timeout=10) as resp:
            assert resp.status == 200
            body = resp.read().decode()
        parsed = parse_dcgm_exporter(body, ts=time.time(), target=targets[1].url)
        assert not parsed.rejected
        assert len(parsed.samples) == 8
        assert {s.host for s in parsed.samples} == {"gpu-node-002"}
        assert all(s.model_name == "NVIDIA H100 80GB HBM3" for s in parsed.samples)

        roots = doc["sysfs_roots"]
        assert isinstance(roots, dict)
        ib = read_sysfs_infiniband(Path(roots["gpu-node-001"]), "gpu-node-001", time.time())
        assert not ib.errors and len(ib.ports) == 4  # one HCA per 2 GPUs
        assert doc["collect_args"][:2] == ["--file-sd", str(file_sd.resolve())]  # type: ignore[index]

        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert rc == 0, stderr
    events = [e.get("event") for e in _json_lines(stderr)]
    assert "simulate_serving" in events and events[-1] == "simulate_stopped", stderr


def test_serve_refuses_gpus_not_a_multiple_of_a_node() -> None:
    result = CliRunner().invoke(app, ["simulate", "serve", "--gpus", "12"])
    assert result.exit_code == 2
    assert "not a multiple" in result.output


def test_serve_reports_a_missing_trace(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["simulate", "serve", "--gpus", "8", "--trace-dir", str(tmp_path / "none"),
                                      "--sysfs-dir", str(tmp_path / "s"), "--file-sd", str(tmp_path / "t.json")])
    assert result.exit_code == 1
    assert "cannot read the trace" in result.output
    assert not (tmp_path / "t.json").exists()
