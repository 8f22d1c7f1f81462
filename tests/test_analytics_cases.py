"""Real MIG samples from ``../shared/data/cases`` (GPU-05, GPU-06) as :class:`GpuSample` values.

The analytics tests must not import the collectors, so this module reads the handed
dcgm-exporter bodies with a minimal reader of their (simple) label sets, and checks that it got
the values the cases name. Other analytics tests import :func:`mig_samples`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from contracts import GpuSample

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
CASES = DATA / "cases"

_LINE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)\{(?P<labels>.*)\}\s+(?P<value>\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def case(case_id: str) -> dict[str, object]:
    """The entry of ``cases.json`` with ``id == case_id``."""
    for c in json.loads((CASES / "cases.json").read_text()):
        if c["id"] == case_id:
            return dict(c)
    raise KeyError(case_id)


def mig_samples(case_id: str, ts: float) -> dict[int, GpuSample]:
    """One :class:`GpuSample` per MIG GPU instance of the case's dcgm-exporter file, at ``ts``,
    by ``GPU_I_ID``."""
    inp = case(case_id)["input"]
    assert isinstance(inp, dict)
    path = CASES / str(inp["file"])
    labels_by_gi: dict[int, dict[str, str]] = {}
    fields_by_gi: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        labels = dict(_LABEL.findall(m["labels"]))
        gi = int(labels["GPU_I_ID"])
        labels_by_gi.setdefault(gi, labels)
        fields_by_gi.setdefault(gi, {})[m["name"]] = float(m["value"])
    return {
        gi: GpuSample(
            ts=ts,
            host=labels.get("Hostname") or labels["hostname"],
            gpu_uuid=labels["UUID"],
            gpu_index=int(labels["gpu"]),
            gpu_instance_id=gi,
            gpu_instance_profile=labels.get("GPU_I_PROFILE"),
            model_name=labels.get("modelName"),
            fields=dict(fields_by_gi[gi]),
            attributes={k: v for k, v in labels.items() if k in ("pod", "namespace", "container") and v},
        )
        for gi, labels in labels_by_gi.items()
    }


def test_gpu05_reader_gets_the_case_values() -> None:
    s = mig_samples("GPU-05", ts=1.0)
    assert sorted(s) == [1, 5, 13, 14]
    assert s[13].fields["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == 0.784913
    assert s[5].fields["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == 0.290336
    assert all("DCGM_FI_DEV_GPU_UTIL" not in x.fields for x in s.values())
    assert s[13].key == "hpc-node-17/GPU-22222222-3333-4444-5555-666666666666/13"


def test_gpu06_reader_gets_the_case_values() -> None:
    s = mig_samples("GPU-06", ts=1.0)
    assert sorted(s) == [7, 8, 9]
    assert all("DCGM_FI_DEV_FB_USED" not in x.fields for x in s.values())
    assert s[8].attributes == {} and s[7].attributes["pod"].startswith("embed-predictor")
