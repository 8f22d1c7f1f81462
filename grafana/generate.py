"""Render gpupool's dashboards to JSON files, or check that the committed ones are current.

Usage (from the repository root)::

    python -m grafana.generate           # (re)write grafana/dashboards/*.json
    python -m grafana.generate --check   # exit 1 and name the files that differ

Output: Grafana dashboard JSON models (schemaVersion 41, Grafana 11.6; format:
https://grafana.com/docs/grafana/latest/dashboards/build-dashboards/view-dashboard-json-model/),
keys sorted, 2-space indent, a final newline, panel ids numbered 1.. in layout order, so that a
regenerated file is byte-identical to the committed one.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from grafana import fabric, fleet, idle, pipeline

__all__ = ["DASHBOARDS", "DEFAULT_OUT", "main", "render", "render_all", "stale", "write_all"]

DASHBOARDS: Mapping[str, Callable[[], dashboard_b.Dashboard]] = {
    "fleet.json": fleet.dashboard,
    "idle-capacity.json": idle.dashboard,
    "fabric.json": fabric.dashboard,
    "pipeline-health.json": pipeline.dashboard,
}
"""Output file name → dashboard builder factory."""

DEFAULT_OUT = Path(__file__).resolve().parent / "dashboards"
"""Where the rendered dashboards are committed (``grafana/dashboards``)."""


def render(builder: dashboard_b.Dashboard) -> str:
    """The dashboard's JSON text: panel ids assigned 1.. in layout order (rows and their nested
    panels included), keys sorted, 2-space indent, trailing newline."""
    model = builder.build()
    next_id = 1
    for panel in model.panels or []:
        panel.id_val = next_id
        next_id += 1
        for inner in getattr(panel, "panels", None) or []:
            inner.id_val = next_id
            next_id += 1
    return json.dumps(model, cls=JSONEncoder, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def render_all() -> dict[str, str]:
    """``{file name: JSON text}`` for every dashboard in :data:`DASHBOARDS`."""
    return {name: render(factory()) for name, factory in DASHBOARDS.items()}


def write_all(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """Write every dashboard into ``out_dir`` (created if missing); returns the paths written.
    Raises ``OSError`` if a file cannot be written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all().items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def stale(out_dir: Path = DEFAULT_OUT) -> list[str]:
    """Names of files in ``out_dir`` that differ from a fresh render: ``missing: x.json``,
    ``differs: x.json``, or ``extra: y.json`` for a ``*.json`` no builder produces. Empty: current."""
    rendered = render_all()
    problems = []
    for name, text in rendered.items():
        path = out_dir / name
        if not path.exists():
            problems.append(f"missing: {name}")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"differs: {name}")
    problems += [f"extra: {p.name}" for p in sorted(out_dir.glob("*.json")) if p.name not in rendered]
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: write the dashboards, or with ``--check`` report stale files. Exit status 0 when
    written or current, 1 when ``--check`` found differences."""
    parser = argparse.ArgumentParser(prog="python -m grafana.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory of the dashboard JSON files")
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale(args.out)
        for line in problems:
            sys.stderr.write(f"{line}\n")
        return 1 if problems else 0
    for path in write_all(args.out):
        sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
