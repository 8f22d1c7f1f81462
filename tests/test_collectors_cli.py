"""``gpupool collect`` sub-commands through typer's test runner; ``collect run`` taking its
settings from flags, ``GPUPOOL_*`` and the ``--config`` TOML file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from collectors.cli import app, run_settings
from contracts import GpuSample, IbPortSample
from tests.support import settings_file

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
runner = CliRunner()


def test_parse_dcgm_prints_samples_then_rejections() -> None:
    path = DATA / "cases" / "dcgm_exporter_samples" / "readme_blank_sentinel_and_spaces.prom"
    res = runner.invoke(app, ["parse-dcgm", str(path), "--host", "node-9"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.output.splitlines()]
    sample = GpuSample.model_validate(lines[0])
    assert sample.key == "node-9/GPU-88888888-0000-0000-0000-000000000000"
    assert sample.fields == {"DCGM_FI_DEV_SM_CLOCK": 139, "DCGM_FI_DEV_MEM_CLOCK": 405}
    assert lines[1] == {
        "rejected": {
            "reason": "sentinel",
            "metric": "DCGM_FI_DEV_MEMORY_TEMP",
            "detail": "line 9: 9223372036854775794",
        }
    }


def test_read_sysfs_prints_ports() -> None:
    res = runner.invoke(
        app,
        ["read-sysfs", str(DATA / "cases" / "sysfs_cases" / "rate_zero_unpopulated" / "sys"), "--host", "n1"],
    )
    assert res.exit_code == 0, res.output
    [port] = [IbPortSample.model_validate_json(x) for x in res.output.splitlines()]
    assert (port.host, port.device, port.rate_bytes_per_second, port.state) == ("n1", "mlx5_1", 0, "DOWN")


def test_run_needs_kafka_and_something_to_collect() -> None:
    assert runner.invoke(app, ["run", "--dcgm-target", "http://x/metrics"]).exit_code == 2  # no --kafka
    res = runner.invoke(app, ["run", "--kafka", "127.0.0.1:1"])
    assert res.exit_code == 2 and "--dcgm-target" in res.output
    res = runner.invoke(app, ["run", "--kafka", "127.0.0.1:1", "--sysfs-root", "no-equals-sign"])
    assert res.exit_code == 2 and "HOST=PATH" in res.output


def test_run_takes_what_no_flag_gives_from_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = settings_file(
        tmp_path,
        monkeypatch,
        'kafka = "127.0.0.1:1"\n[metrics]\ncollectors = 0\n'
        '[collectors]\ndcgm_targets = ["http://127.0.0.1:9/metrics"]\ninterval_s = 7\ntimeout_s = 3\n',
    )
    monkeypatch.setenv("GPUPOOL_COLLECTORS__TIMEOUT_S", "1.5")
    s = run_settings(toml, interval=None, sysfs_root=["n1=/sys"], dcgm_target=[], concurrency=8)
    assert s.collectors.dcgm_targets == ["http://127.0.0.1:9/metrics"]  # no --dcgm-target: the file's
    assert (s.collectors.interval_s, s.collectors.timeout_s, s.collectors.concurrency) == (7.0, 1.5, 8)
    assert s.collectors.sysfs_roots == ["n1=/sys"] and s.metrics.collectors == 0
    # the file names Kafka and a target: the command gets as far as Kafka (unreachable: exit 1)
    res = runner.invoke(app, ["run", "--config", str(toml)])
    assert res.exit_code == 1, res.output
    monkeypatch.setenv("GPUPOOL_CONFIG", str(toml))  # the same through the environment
    assert runner.invoke(app, ["run"]).exit_code == 1
    toml.write_text('kafka = "127.0.0.1:1"\n[collectors]\ninterval_s = 0\n')
    res = runner.invoke(app, ["run"])
    assert res.exit_code == 2 and "interval_s" in res.output



def test_run_fabric_alone_is_a_source_and_its_options_are_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from collectors.cli import _fabric_collector
    from contracts import KafkaTopics
    from contracts.bus import MemoryBus

    for name in [k for k in os.environ if k.upper().startswith("GPUPOOL_")]:
        monkeypatch.delenv(name)
    # --fabric is enough to run: the command gets as far as Kafka (unreachable: exit 1, not 2)
    res = runner.invoke(app, ["run", "--kafka", "127.0.0.1:1", "--fabric", "--metrics-port", "0"])
    assert res.exit_code == 1, res.output
    res = runner.invoke(app, ["run", "--kafka", "127.0.0.1:1", "--fabric", "--fabric-interval", "0"])
    assert res.exit_code == 2 and "fabric_interval_s" in res.output
    res = runner.invoke(app, ["run", "--kafka", "127.0.0.1:1", "--fabric", "--sysfs-interval", "0"])
    assert res.exit_code == 2 and "sysfs_interval_s" in res.output
    assert run_settings(None).collectors.sysfs_interval_s is None  # every cycle
    assert run_settings(None, sysfs_interval=15).collectors.sysfs_interval_s == 15.0
    toml = tmp_path / "gpupool.toml"
    toml.write_text(
        'kafka = "127.0.0.1:1"\n[collectors]\nfabric = true\nfabric_interval_s = 60\n'
        'fabric_command_prefix = ["sudo", "-n"]\nfabric_concurrency = 3\n'
    )
    monkeypatch.setenv("GPUPOOL_COLLECTORS__FABRIC_TIMEOUT_S", "2.5")
    s = run_settings(toml, fabric_discover_every=4)
    cs = s.collectors
    assert (cs.fabric, cs.fabric_interval_s, cs.fabric_discover_every) == (True, 60.0, 4)
    assert (cs.fabric_concurrency, cs.fabric_timeout_s, cs.fabric_command_prefix) == (3, 2.5, ["sudo", "-n"])
    assert not run_settings(toml, fabric=False).collectors.fabric  # --no-fabric wins over the file
    fc = _fabric_collector(MemoryBus(), KafkaTopics(), cs)
    assert fc is not None
    assert (fc._run_prefix, fc._concurrency, fc._timeout_s) == (["sudo", "-n"], 3, 2.5)
    assert _fabric_collector(MemoryBus(), KafkaTopics(), run_settings(None).collectors) is None
