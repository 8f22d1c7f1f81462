"""gpupool's Grafana dashboards (grafana/): committed JSON is current, every query parses and names
real metrics and labels, provisioning files fit the dashboards.

Not tested here (no Grafana server, and no Prometheus scraping a running demo in this suite yet):
that each query returns data.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from grafana import catalog, generate, lint

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / ".." / "shared" / "data"
DCGM_CSVS = [
    SHARED / "telemetry" / "dcgm_exporter" / "default-counters.csv",
    SHARED / "telemetry" / "dcgm_exporter" / "dcp-metrics-included.csv",
]
DCGM_SAMPLES = SHARED / "cases" / "dcgm_exporter_samples"
NODE_EXPORTER_E2E = SHARED / "telemetry" / "node_exporter_e2e_output_infiniband.prom"
STAGE_PACKAGES = ("collectors", "analytics", "broker", "simulator", "contracts")
DASHBOARD_DIR = ROOT / "grafana" / "dashboards"
PROVISIONING = ROOT / "grafana" / "provisioning"


def _dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def _known() -> dict[str, frozenset[str] | None]:
    known: dict[str, frozenset[str] | None] = dict(catalog.exposed_series(catalog.gpupool_metrics(ROOT)))
    known["up"] = frozenset()
    known.update({name: catalog.DCGM_LABELS for name in catalog.dcgm_fields(DCGM_CSVS)})
    known.update(catalog.NODE_EXPORTER_INFINIBAND)
    return known


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def test_committed_dashboards_are_current() -> None:
    """A regenerated dashboard equals the committed JSON (run `python -m grafana.generate` if not)."""
    assert generate.stale() == []
    assert set(_dashboards()) == set(generate.DASHBOARDS)


def test_rendering_is_deterministic() -> None:
    assert generate.render_all() == generate.render_all()


def test_generate_cli_writes_then_checks(tmp_path: Path) -> None:
    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "fleet.json").write_text("{}\n")
    (tmp_path / "old.json").write_text("{}\n")
    assert generate.stale(tmp_path) == ["differs: fleet.json", "extra: old.json"]


def test_every_panel_query_parses() -> None:
    exprs = [
        (name, title, e) for name, d in _dashboards().items() for title, e in lint.dashboard_expressions(d)
    ]
    assert len(exprs) >= 60
    for name, title, expr in exprs:
        try:
            lint.selectors(lint.expand_variables(expr))
        except ValueError as exc:
            pytest.fail(f"{name} / {title}: {expr!r} does not parse: {exc}")


def test_panel_queries_use_only_real_metrics_and_labels() -> None:
    known = _known()
    literals = lint.string_literals(p for pkg in STAGE_PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    problems = [
        f"{name} / {title}: {problem}"
        for name, d in _dashboards().items()
        for title, expr in lint.dashboard_expressions(d)
        for problem in lint.check_expr(lint.expand_variables(expr), known, literals)
    ]
    assert not problems, "\n".join(problems)


def test_variable_queries_name_real_metrics_and_labels() -> None:
    known = _known()
    for name, d in _dashboards().items():
        for var in d["templating"]["list"]:
            if var["type"] == "query":
                assert lint.check_variable_query(var["query"], known) == [], f"{name}: {var['name']}"
            else:
                assert var["type"] == "datasource" and var["query"] == "prometheus", f"{name}: {var['name']}"


def test_external_metric_names_match_real_exporter_output() -> None:
    """DCGM labels in the catalog occur in real dcgm-exporter bodies; node_exporter names in
    node_exporter's own test output (symbol_error_total came with node_exporter 1.6, after it)."""
    seen_labels = {
        m.group(1)
        for p in DCGM_SAMPLES.glob("*.prom")
        for m in re.finditer(r"[{,]\s*([A-Za-z_][A-Za-z0-9_]*)=\"", p.read_text())
    }
    assert catalog.DCGM_LABELS <= seen_labels, sorted(catalog.DCGM_LABELS - seen_labels)
    e2e = NODE_EXPORTER_E2E.read_text()
    names = set(re.findall(r"^(node_infiniband_\w+)\{", e2e, re.MULTILINE))
    assert set(catalog.NODE_EXPORTER_INFINIBAND) - names == {"node_infiniband_symbol_error_total"}
    for name, labels in catalog.NODE_EXPORTER_INFINIBAND.items():
        if name in names:
            first = re.search(rf"^{name}\{{([^}}]*)\}}", e2e, re.MULTILINE)
            assert first is not None
            assert set(re.findall(r"(\w+)=", first.group(1))) == labels, name


def test_dashboard_structure() -> None:
    dashboards = _dashboards()
    uids = [d["uid"] for d in dashboards.values()]
    assert sorted(uids) == ["gpupool-fabric", "gpupool-fleet", "gpupool-idle", "gpupool-pipeline"]
    for name, d in dashboards.items():
        assert d["schemaVersion"] == 41, name  # Grafana 11.6
        assert d["title"].startswith("gpupool / ") and "gpupool" in d["tags"], name
        panels = _panels(d)
        assert len({p["id"] for p in panels}) == len(panels), f"{name}: duplicate panel ids"
        for p in panels:
            pos = p["gridPos"]
            assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, f"{name} / {p['title']}"
            if p["type"] == "row":
                assert p["panels"] == [] and p["collapsed"] is False
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, f"{name} / {p['title']}"
            assert p["targets"] and p.get("description"), f"{name} / {p['title']}"
            assert [t["refId"] for t in p["targets"]] == [chr(65 + i) for i in range(len(p["targets"]))]
        _assert_no_overlap(name, [p for p in panels])


def _assert_no_overlap(name: str, panels: list[dict[str, Any]]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{name}: {p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_provisioning_files_fit_the_dashboards() -> None:
    ds = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True and source["uid"]
    assert source["url"].startswith("http")
    prov = yaml.safe_load((PROVISIONING / "dashboards" / "gpupool.yaml").read_text())
    assert prov["apiVersion"] == 1
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    assert provider["folder"] == "gpupool"


def test_lint_reports_broken_queries() -> None:
    """The checks above are not vacuous."""
    known = _known()
    broken = {
        "panels": [
            {
                "title": "ok",
                "targets": [{"expr": "sum(rate(gpupool_broker_claims_total[$__rate_interval]))"}],
            },
            {"title": "row", "type": "row", "panels": [{"title": "nested", "targets": [{"expr": "sum(up"}]}]},
            {"title": "typo", "targets": [{"expr": 'DCGM_FI_DEV_GPU_UTIL{hostName=~"$Hostname"}'}]},
        ]
    }
    found = list(lint.dashboard_expressions(broken))
    assert [t for t, _ in found] == ["ok", "nested", "typo"]
    results = [lint.check_expr(lint.expand_variables(e), known) for _, e in found]
    assert results[0] == []
    assert results[1][0].startswith("does not parse")
    assert "has no label 'hostName'" in results[2][0]
    assert lint.check_variable_query("label_values(DCGM_FI_DEV_GPU_UTIL, host)", known) == [
        "label_values: DCGM_FI_DEV_GPU_UTIL has no label 'host'"
    ]
