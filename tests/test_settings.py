"""gpupool settings (:mod:`gpupool.settings`) and ``gpupool config show``: environment variables,
the TOML file, precedence, validation and secret masking."""

from __future__ import annotations

import json
import logging
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path

import typing
from typing import Any

import pytest
import typer
from pydantic import BaseModel, ValidationError
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
from runtime.run_options import option_help
from runtime.settings import DeploymentSettings, RunFlags, settings_field

SECRET = "hunter2-do-not-print"


@pytest.fixture(autouse=True)
def _detach_cli_log_handler() -> Iterator[None]:
    """``gpupool``'s callback logs to the stderr CliRunner lends it, closed after ``invoke``:
    detach that handler so later log records do not hit a closed file."""
    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_gpupool", False):
            root.removeHandler(handler)


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


STAGE_COMMANDS = {"collectors": ("collect", "run"), "analytics": ("analytics", "run"), "broker": ("broker", "run")}


def _command(path: tuple[str, ...]) -> Any:
    cmd: Any = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def _model_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, field in model.model_fields.items():
        yield prefix + name, field
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _model_fields(field.annotation, f"{prefix}{name}.")


def test_every_setting_has_a_description() -> None:
    """The options' help is derived from the model: every field (groups too) describes itself."""
    missing = [path for path, field in _model_fields(DeploymentSettings) if not (field.description or "").strip()]
    assert not missing, f"settings without a docstring: {missing}"


def test_option_help_is_the_description_the_model_default_and_the_setting() -> None:
    assert option_help("collectors.interval_s") == (
        "Seconds between the starts of two collection cycles. (default: 5; setting collectors.interval_s)"
    )
    assert option_help("metrics.broker").endswith("(0: off). (default: 9412; setting metrics.broker)")
    assert option_help("broker.tune_gc").endswith("(default: on; setting broker.tune_gc)")
    assert option_help("collectors.dcgm_targets") == (
        "dcgm-exporter /metrics URLs. (repeatable) (setting collectors.dcgm_targets)"  # empty list: no default
    )
    assert option_help("kafka").endswith("(setting kafka)") and "default" not in option_help("mqtt_password")
    with pytest.raises(KeyError):
        option_help("collectors.intervals")


def test_run_flags_select_flagged_fields_by_path_or_pattern() -> None:
    """A command takes :class:`Flag` fields only, under the Flag's name (else the field's); a
    pattern takes every flagged field it matches, in the model's order; two fields under one
    option name, or a selection that matches nothing flagged, are refused."""
    flags = RunFlags("t", "kafka", "mqtt*", "idle.*", "metrics.broker")
    assert flags.fields == {
        "kafka": "kafka",
        "mqtt": "mqtt",
        "username": "mqtt_username",
        "password": "mqtt_password",
        "root": "mqtt_root",
        "protocol": "mqtt_protocol",
        "mqtt_cafile": "mqtt_cafile",
        "mqtt_certfile": "mqtt_certfile",
        "mqtt_keyfile": "mqtt_keyfile",
        "idle_threshold": "idle.idle_threshold",
        "busy_threshold": "idle.busy_threshold",
        "min_idle_s": "idle.min_idle_s",
        "stale_after_s": "idle.stale_after_s",
        "refresh_s": "idle.refresh_s",
        "pool": "idle.pool",  # idle.forget_after_s has no Flag: environment or file only
        "metrics_port": "metrics.broker",
    }
    with pytest.raises(ValueError, match="metrics_port"):
        RunFlags("t", "metrics.broker", "metrics.analytics")  # both are --metrics-port
    with pytest.raises(ValueError, match="state_dir"):
        RunFlags("t", "state_dir")  # a field without a Flag
    with pytest.raises(ValueError, match="nope"):
        RunFlags("t", "nope.*")
    assert RunFlags("t", "broker.*").load(None, notice=12.0).broker.notice_s == 12.0


@pytest.mark.parametrize("stage", sorted(STAGE_COMMANDS))
def test_stage_run_options_are_derived_from_the_settings_fields(stage: str) -> None:
    """One TOML file configures a whole deployment and each option is declared once, as a field of
    the settings model: ``gpupool <stage> run`` has ``--config`` and one option per entry of the
    stage's ``RUN_FLAGS``, each of the field's type, ``None`` when not given (so GPUPOOL_*, the file,
    the default apply), its help the field's description, the model's default and the setting."""
    import importlib

    cli = importlib.import_module(f"{stage}.cli")
    flags: dict[str, str] = cli.RUN_FLAGS.fields
    options = {p.name: p for p in _command(STAGE_COMMANDS[stage]).params}
    assert set(options) == {"config", *flags}
    for flag, path in flags.items():
        field, option = settings_field(path), options[flag]
        assert option.opts == ["--" + flag.replace("_", "-")], flag
        assert option.default is None and not option.required, flag
        assert option.help == option_help(path), flag
        assert option.help.startswith(" ".join(str(field.description).split())), flag
        default = field.get_default(call_default_factory=True)
        if isinstance(default, int | float) and not isinstance(default, bool):
            shown = f"{default:g}" if isinstance(default, float) else str(default)
            assert f"(default: {shown}; setting {path})" in option.help, flag
        if field.annotation is bool:
            assert option.secondary_opts == ["--no-" + flag.replace("_", "-")], flag
        if typing.get_origin(field.annotation) is list:
            assert option.multiple, flag


def _sample_argv(flag: str, path: str) -> tuple[list[str], Any]:
    """Command-line words giving option ``flag`` (field ``path``) a value, and the value parsed."""
    annotation = settings_field(path).annotation
    name = "--" + flag.replace("_", "-")
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    kind = args[0] if args and typing.get_origin(annotation) is not typing.Literal else annotation
    if annotation is bool:
        return [f"--no-{name[2:]}"], False
    if typing.get_origin(annotation) is list:
        item = typing.get_args(annotation)[0]
        return [name, "a", name, "b"], [item("a"), item("b")]
    if typing.get_origin(annotation) is typing.Literal:
        return [name, "4"], 4
    if kind in (int, float):
        return [name, "3"], kind(3)
    if kind is Path:
        return [name, "/x/y"], Path("/x/y")
    return [name, "v:1"], "v:1"  # str, SecretStr


@pytest.mark.parametrize("stage", sorted(STAGE_COMMANDS))
def test_each_derived_option_reaches_its_setting(stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option given on the command line arrives, parsed as the field's type, under its name
    at :func:`runtime.run_options.load_run_settings`, which maps it to the field (RunFlags)."""
    import importlib

    import runtime.run_options as ro

    cli = importlib.import_module(f"{stage}.cli")
    flags: dict[str, str] = cli.RUN_FLAGS.fields
    argv: list[str] = []
    expected: dict[str, Any] = {}
    for flag, path in flags.items():
        words, value = _sample_argv(flag, path)
        argv += words
        expected[flag] = value
    seen: dict[str, Any] = {}

    def record(run_flags: Any, config: Path | None, **values: Any) -> Any:
        seen.update(values, config=config, flags=run_flags)
        raise typer.Exit(0)

    monkeypatch.setattr(ro, "load_run_settings", record)
    res = CliRunner().invoke(app, [*STAGE_COMMANDS[stage], "--config", "/etc/g.toml", *argv])
    assert res.exit_code == 0, res.output
    assert seen.pop("flags") is cli.RUN_FLAGS and seen.pop("config") == Path("/etc/g.toml")
    assert seen == expected
    # nothing given: every flag arrives as None, so the environment, the file or the default wins
    seen.clear()
    res = CliRunner().invoke(app, list(STAGE_COMMANDS[stage]))
    assert res.exit_code == 0, res.output
    assert {k: v for k, v in seen.items() if k not in ("flags", "config")} == dict.fromkeys(flags)


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
