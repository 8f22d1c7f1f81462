"""gpupool settings (:mod:`gpupool.settings`) and ``gpupool config show``: environment variables,
the TOML file, precedence, validation and secret masking."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from analytics.classify import IdleConfig
from broker.config import BrokerConfig
from gpupool.cli import app
from gpupool.settings import (
    MASK,
    GpupoolSettings,
    broker_config,
    effective_config,
    idle_config,
    load_settings,
    to_toml,
)

SECRET = "hunter2-do-not-print"


pytestmark = pytest.mark.usefixtures("detach_cli_log_handler")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPUPOOL_* variable of the caller's environment (the Makefile exports some) leaks in."""
    for name in list(os.environ):
        if name.upper().startswith("GPUPOOL_"):
            monkeypatch.delenv(name)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpupool.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_match_the_stage_clis() -> None:
    s = load_settings()
    assert s.config is None and s.kafka is None and s.topic_prefix == ""
    assert s.mqtt == "127.0.0.1:1883" and s.mqtt_username == "gpupool-broker" and s.mqtt_password is None
    assert (s.metrics.collectors, s.metrics.analytics, s.metrics.broker) == (9410, 9411, 9412)
    assert idle_config(s.idle) == IdleConfig()
    assert broker_config(s.broker) == BrokerConfig()


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_KAFKA", "k1:9092, k2:9093")
    monkeypatch.setenv("GPUPOOL_MQTT_PASSWORD", SECRET)
    monkeypatch.setenv("GPUPOOL_IDLE__MIN_IDLE_S", "120")
    monkeypatch.setenv("GPUPOOL_BROKER__NOTICE_S", "45")
    monkeypatch.setenv("GPUPOOL_METRICS__BROKER", "9500")
    monkeypatch.setenv("gpupool_topic_prefix", "prod.")  # names are case-insensitive
    monkeypatch.setenv("GPUPOOL_SITE", "edge-a")  # another command's variable: ignored
    monkeypatch.setenv("GPUPOOL_STATE", "/somewhere")  # the Makefile's: ignored
    s = load_settings()
    assert s.kafka == "k1:9092,k2:9093"
    assert s.mqtt_password is not None and s.mqtt_password.get_secret_value() == SECRET
    assert s.idle.min_idle_s == 120.0 and s.idle.idle_threshold == 0.05
    assert broker_config(s.broker).notice_s == 45.0
    assert s.metrics.broker == 9500 and s.topic_prefix == "prod."


def test_a_group_as_json_in_one_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_IDLE", '{"min_idle_s": 10, "pool": "train-a"}')
    s = load_settings()
    assert (s.idle.min_idle_s, s.idle.pool, s.idle.busy_threshold) == (10.0, "train-a", 0.10)


def test_toml_file_and_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _toml(
        tmp_path,
        """
kafka = "kafka-1:9092"
mqtt = "mqtt.example.internal:8883"
mqtt_password = "from-file"
state_dir = "/var/lib/gpupool"

[idle]
min_idle_s = 300
pool = "train-a"

[broker]
lease_ttl_s = 90
""",
    )
    from_file = load_settings(path)
    assert from_file.config == path and from_file.kafka == "kafka-1:9092"
    assert from_file.mqtt == "mqtt.example.internal:8883" and from_file.state_dir == Path("/var/lib/gpupool")
    assert (from_file.idle.min_idle_s, from_file.idle.pool, from_file.broker.lease_ttl_s) == (
        300.0,
        "train-a",
        90.0,
    )

    monkeypatch.setenv("GPUPOOL_CONFIG", str(path))
    monkeypatch.setenv("GPUPOOL_IDLE__MIN_IDLE_S", "30")  # env beats the file, key by key
    monkeypatch.setenv("GPUPOOL_KAFKA", "env-kafka:9092")
    s = load_settings()
    assert s.config == path
    assert s.kafka == "env-kafka:9092" and s.idle.min_idle_s == 30.0 and s.idle.pool == "train-a"
    assert load_settings(kafka="flag:9092").kafka == "flag:9092"  # flags beat both


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"GPUPOOL_IDLE__IDLE_THRESHOLD": "0.5", "GPUPOOL_IDLE__BUSY_THRESHOLD": "0.2"}, "idle"),
        ({"GPUPOOL_MQTT": "no-port"}, "mqtt"),
        ({"GPUPOOL_KAFKA": "k1:9092,k2"}, "kafka"),
        ({"GPUPOOL_MQTT_PROTOCOL": "3"}, "mqtt_protocol"),
        ({"GPUPOOL_BROKER__LEASE_TTL_S": "0"}, "lease_ttl_s"),
        ({"GPUPOOL_METRICS__ANALYTICS": "70000"}, "analytics"),
        ({"GPUPOOL_IDLE__FORGET_AFTER_S": "30", "GPUPOOL_IDLE__STALE_AFTER_S": "30"}, "forget_after_s"),
        ({"GPUPOOL_COLLECTORS__FORGET_AFTER_S": "0"}, "forget_after_s"),
        ({"GPUPOOL_BROKER__SITE_FORGET_AFTER_S": "-1"}, "site_forget_after_s"),
    ],
)
def test_invalid_values_are_refused(env: dict[str, str], field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValidationError, match=field):
        load_settings()


def test_forget_times_reach_the_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The three forget times come from the settings (env here) and reach what the stages build."""
    from broker.config import broker_config_from

    monkeypatch.setenv("GPUPOOL_IDLE__FORGET_AFTER_S", "30.5")
    monkeypatch.setenv("GPUPOOL_COLLECTORS__FORGET_AFTER_S", "42")
    monkeypatch.setenv("GPUPOOL_BROKER__SITE_FORGET_AFTER_S", "7")
    s = load_settings()
    assert (s.idle.forget_after_s, s.collectors.forget_after_s) == (30.5, 42.0)
    assert broker_config_from(s.broker).site_forget_after_s == 7.0
    monkeypatch.delenv("GPUPOOL_IDLE__FORGET_AFTER_S")
    monkeypatch.delenv("GPUPOOL_COLLECTORS__FORGET_AFTER_S")
    monkeypatch.delenv("GPUPOOL_BROKER__SITE_FORGET_AFTER_S")
    d = load_settings()
    assert (d.idle.forget_after_s, d.collectors.forget_after_s, d.broker.site_forget_after_s) == (3600.0, 300.0, 3600.0)


def test_toml_errors(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="kafak"):
        load_settings(_toml(tmp_path, 'kafak = "typo:9092"\n'))
    with pytest.raises(ValidationError, match="min_idle"):
        load_settings(_toml(tmp_path, "[idle]\nmin_idle = 3\n"))
    with pytest.raises(tomllib.TOMLDecodeError):
        load_settings(_toml(tmp_path, "kafka = \n"))
    with pytest.raises(FileNotFoundError, match=r"missing\.toml"):
        load_settings(tmp_path / "missing.toml")


def test_secrets_are_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_MQTT_PASSWORD", SECRET)
    s = load_settings()
    shown = effective_config(s)
    assert shown["mqtt_password"] == MASK
    assert SECRET not in json.dumps(shown) and SECRET not in to_toml(shown) and SECRET not in repr(s)
    monkeypatch.delenv("GPUPOOL_MQTT_PASSWORD")
    assert effective_config(GpupoolSettings())["mqtt_password"] is None  # unset is not masked


def test_config_show_json_and_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_MQTT_PASSWORD", SECRET)
    monkeypatch.setenv("GPUPOOL_BROKER__NOTICE_S", "12.5")
    path = _toml(tmp_path, 'topic_prefix = "t."\n[idle]\npool = "p"\n')
    runner = CliRunner()

    res = runner.invoke(app, ["config", "show", "--format", "json", "--config", str(path)])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.stdout)
    assert shown["mqtt_password"] == MASK and SECRET not in res.output
    assert (
        shown["broker"]["notice_s"] == 12.5 and shown["topic_prefix"] == "t." and shown["idle"]["pool"] == "p"
    )
    assert shown["config"] == str(path) and shown["kafka"] is None

    monkeypatch.setenv("GPUPOOL_CONFIG", str(path))
    res = runner.invoke(app, ["config", "show"])
    assert res.exit_code == 0, res.output
    assert SECRET not in res.output and f'mqtt_password = "{MASK}"' in res.stdout
    parsed = tomllib.loads(res.stdout)
    assert parsed["broker"]["notice_s"] == 12.5 and "kafka" not in parsed
    (unset,) = [line for line in res.stdout.splitlines() if line.startswith("# not set: ")]
    not_set = set(unset[len("# not set: ") :].split(", "))
    assert {"kafka", "collectors.spool_dir", "broker.fabric_state"} <= not_set

    # the TOML printed is a settings file giving the same settings (password aside: it is masked)
    monkeypatch.delenv("GPUPOOL_CONFIG")
    monkeypatch.delenv("GPUPOOL_MQTT_PASSWORD")
    monkeypatch.delenv("GPUPOOL_BROKER__NOTICE_S")
    again = tmp_path / "again.toml"
    again.write_text(
        res.stdout.replace(f'mqtt_password = "{MASK}"\n', "").replace(f'config = "{path}"\n', "")
    )
    reloaded = effective_config(load_settings(again))
    expected = {**shown, "config": str(again), "mqtt_password": None}
    assert reloaded == expected


def test_config_show_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["config", "show", "--config", str(tmp_path / "nope.toml")])
    assert res.exit_code == 1 and "does not exist" in res.output
    res = runner.invoke(app, ["config", "show", "--config", str(_toml(tmp_path, "kafka = = 1\n"))])
    assert res.exit_code == 1 and "does not parse" in res.output
    monkeypatch.setenv("GPUPOOL_IDLE__MIN_IDLE_S", "-1")
    res = runner.invoke(app, ["config", "show"])
    assert res.exit_code == 1 and "invalid settings" in res.output


def test_default_metrics_ports_are_the_ones_prometheus_scrapes() -> None:
    """The stage commands' defaults (the settings') match deploy/prometheus/prometheus.yml."""
    import yaml

    prometheus_yml = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "prometheus.yml"
    conf = yaml.safe_load(prometheus_yml.read_text())
    ports = {
        job["job_name"]: int(job["static_configs"][0]["targets"][0].rsplit(":", 1)[1])
        for job in conf["scrape_configs"]
        if job["job_name"].startswith("gpupool-")
    }
    m = load_settings().metrics
    assert ports == {
        "gpupool-collectors": m.collectors,
        "gpupool-analytics": m.analytics,
        "gpupool-broker": m.broker,
    }


@pytest.mark.parametrize("stage", ["collectors", "analytics", "broker"])
def test_every_option_of_a_stage_run_command_is_a_setting(stage: str) -> None:
    """One TOML file configures a whole deployment: each option of ``gpupool <stage> run`` maps to
    a field of the settings model (``RUN_SETTINGS``), so it can come from GPUPOOL_* or the file."""
    import importlib
    import inspect

    cli = importlib.import_module(f"{stage}.cli")
    params = set(inspect.signature(cli.run).parameters) - {"config"}
    mapping: dict[str, str] = cli.RUN_SETTINGS
    assert params == set(mapping), f"{stage} run options without a setting: {sorted(params - set(mapping))}"
    defaults = effective_config(GpupoolSettings())
    for option, path in mapping.items():
        node: object = defaults
        for part in path.split("."):
            assert isinstance(node, dict) and part in node, f"{stage} --{option}: no setting {path}"
            node = node[part]


def test_broker_zones_quotas_and_weights_come_from_the_toml(tmp_path: Path) -> None:
    """``[broker.*]`` tables reach the broker's :class:`BrokerConfig` unchanged; a negative quota or
    a zero weight is refused with the group named."""
    cfg = tmp_path / "gpupool.toml"
    cfg.write_text(
        'kafka = "k:9092"\n[broker]\ndefault_site_quota = 8\nfair_share_window_s = 30\n'
        '[broker.pool_zones]\ntraining-a = "metro-east"\n'
        '[broker.site_quotas]\nsite-a = 2\n[broker.site_weights]\nsite-b = 3.0\n'
    )
    bc = broker_config(load_settings(cfg).broker)
    assert bc.pool_zones == {"training-a": "metro-east"}
    assert bc.quota_of("site-a") == 2 and bc.quota_of("site-z") == 8
    assert bc.weight_of("site-b") == 3.0 and bc.weight_of("site-a") == 1.0
    assert bc.fair_share_window_s == 30
    cfg.write_text('kafka = "k:9092"\n[broker.site_quotas]\nsite-a = -1\n')
    with pytest.raises(ValidationError, match="site_quotas"):
        load_settings(cfg)
    cfg.write_text('kafka = "k:9092"\n[broker.site_weights]\nsite-a = 0\n')
    with pytest.raises(ValidationError, match="site_weights"):
        load_settings(cfg)
