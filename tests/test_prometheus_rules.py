"""Prometheus config, recording and alerting rules of deploy/prometheus, checked by promtool and by reading them.

promtool comes with Debian's ``prometheus`` package (``deploy/local/install-system.sh`` installs it;
``make test`` runs that first). Each test fails with promtool's own output.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from grafana import catalog, lint

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "deploy" / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
TEST_FILES = sorted((PROM / "tests").glob("*.yml"))
CONFIGS = [PROM / "prometheus.yml", PROM / "prometheus-demo.yml"]
NODE_EXPORTER_RULES = PROM / "rules" / "infiniband-node-exporter.yml"
SEVERITIES = {"critical", "warning", "info"}
STAGE_PACKAGES = ("collectors", "analytics", "broker", "simulator", "contracts")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found: install Debian's prometheus package (bash deploy/local/install-system.sh)"
        )
    return path


def _run(*args: str) -> None:
    proc = subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=120, cwd=PROM)
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


def _rules() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                yield path, rule


def _alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for _, rule in _rules() if "alert" in rule}


def test_rule_and_test_files_exist() -> None:
    assert RULE_FILES, "no rule files under deploy/prometheus/rules"
    assert TEST_FILES, "no promtool test files under deploy/prometheus/tests"
    assert len(_alerts()) >= 20


def test_promtool_check_rules() -> None:
    _run("check", "rules", *(str(p) for p in RULE_FILES))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_promtool_check_config(config: Path) -> None:
    _run("check", "config", str(config))


def test_configs_load_every_rule_file() -> None:
    for config in CONFIGS:
        globs = yaml.safe_load(config.read_text())["rule_files"]
        loaded = {p for g in globs for p in config.parent.glob(g)}
        assert loaded == set(RULE_FILES), config.name


def test_promtool_unit_tests() -> None:
    _run("test", "rules", *(str(p) for p in TEST_FILES))


def test_every_alert_is_tested_firing_and_silent() -> None:
    """Each alert has a promtool case where it fires and one where it is expected silent."""
    fires: set[str] = set()
    silent: set[str] = set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = set(_alerts())
    assert (
        fires | silent <= alerts
    ), f"tests name alerts that do not exist: {sorted((fires | silent) - alerts)}"
    assert not alerts - fires, f"alerts never tested firing: {sorted(alerts - fires)}"
    assert not alerts - silent, f"alerts never tested silent: {sorted(alerts - silent)}"


def test_alerts_have_for_severity_and_runbook() -> None:
    runbook = (PROM / "RUNBOOK.md").read_text()
    sections = {m.group(1).lower() for m in re.finditer(r"^###\s+(\S+)\s*$", runbook, re.MULTILINE)}
    for name, rule in _alerts().items():
        assert re.fullmatch(r"Gpupool[A-Z][A-Za-z]+", name), name
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), f"{name}: no for: duration"
        assert rule.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity"
        notes = rule.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            assert notes.get(key, "").strip(), f"{name}: no {key} annotation"
        assert notes["runbook"].endswith(f"RUNBOOK.md#{name.lower()}"), f"{name}: runbook anchor"
        assert name.lower() in sections, f"{name}: no section in RUNBOOK.md"


def test_record_names_follow_convention() -> None:
    records = [rule["record"] for _, rule in _rules() if "record" in rule]
    assert records
    for name in records:
        assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", name), name


def test_rules_query_only_real_metrics_and_labels() -> None:
    """Metric names, label names and ``=`` label values in every rule exist in gpupool's code
    (or are node_exporter's, in infiniband-node-exporter.yml only)."""
    gpupool = catalog.exposed_series(catalog.gpupool_metrics(ROOT))
    records: dict[str, frozenset[str] | None] = {r["record"]: None for _, r in _rules() if "record" in r}
    literals = lint.string_literals(p for pkg in STAGE_PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    problems: list[str] = []
    for path, rule in _rules():
        known: dict[str, frozenset[str] | None] = {**gpupool, **records, "up": frozenset()}
        if path == NODE_EXPORTER_RULES:
            known.update(catalog.NODE_EXPORTER_INFINIBAND)
        name = rule.get("alert") or rule.get("record")
        problems += [f"{path.name} {name}: {p}" for p in lint.check_expr(rule["expr"], known, literals)]
    assert not problems, "\n".join(problems)


def test_metric_check_catches_a_misspelt_metric_label_and_value() -> None:
    """The check above is not vacuous: it reports each kind of mistake."""
    known = catalog.exposed_series(catalog.gpupool_metrics(ROOT))
    literals = lint.string_literals((ROOT / "contracts").rglob("*.py"))
    assert lint.check_expr('gpupool_analytics_gpu{state="idle"}', known, literals) == [
        "unknown metric gpupool_analytics_gpu"
    ]
    assert "has no label 'status'" in lint.check_expr('gpupool_analytics_gpus{status="idle"}', known)[0]
    assert (
        "no gpupool code uses the value 'idel'"
        in lint.check_expr('gpupool_analytics_gpus{state="idel"}', known, literals)[0]
    )
    assert lint.check_expr("rate(x[5m]", known)[0].startswith("does not parse")
    assert lint.check_expr('gpupool_analytics_gpus{state="idle"}', known, literals) == []
