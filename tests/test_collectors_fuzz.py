"""Fuzzing the parsers with hypothesis: mutated real bodies, grammar-generated bodies and random
sysfs trees. No exception may escape, every rejection has a known reason, and whatever is kept is
valid (finite, in range, not a sentinel, serialisable)."""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.dcgm import REJECTION_REASONS, parse_dcgm_exporter
from collectors.dcgm_fields import SENTINELS, field_range, is_sentinel
from collectors.sysfs_ib import read_sysfs_infiniband
from contracts import GpuSample, IbPortSample, NvSwitchSample, decode, encode

SAMPLES = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cases" / "dcgm_exporter_samples"
BODIES = [p.read_text() for p in sorted(SAMPLES.glob("*.prom"))]
TRICKY = (
    '{}",=\\\n\r\t #.-+eE0123456789NaInf_ HELP TYPE gauge GPU_I_ID UUID Hostname hostname \x00\u00e9\ufffd'
)


def _check(body: str) -> None:
    res = parse_dcgm_exporter(body, ts=1.0, target="fuzz", default_host="fuzz-host")
    assert {r.reason for r in res.rejected} <= REJECTION_REASONS
    assert all(r.reason for r in res.rejected)
    keys = [s.key for s in res.samples]
    assert len(keys) == len(set(keys))
    for s in res.samples:
        assert not set(s.fields) & set(s.invalid)
        for name, value in s.fields.items():
            assert math.isfinite(value) and not is_sentinel(value)
            rng = field_range(name)
            assert rng is None or rng[0] <= value <= rng[1]
        for name, series in s.field_series.items():
            assert len(series) >= 1 and s.fields.get(name) is not None
            for v in series:
                assert math.isfinite(v.value) and not is_sentinel(v.value)
        assert s.gpu_uuid or s.gpu_index is not None
        assert decode(GpuSample, encode(s)) == s
    switch_keys = [w.key for w in res.switches]
    assert len(switch_keys) == len(set(switch_keys))
    for w in res.switches:
        assert all(math.isfinite(v) and not is_sentinel(v) for v in w.fields.values())
        assert decode(NvSwitchSample, encode(w)) == w


# Hypothesis draws one seed per example and the bodies are built from a ``random.Random`` of it
# (a failure reports its seed): drawing every character through strategies costs ~50x more time
# than parsing them. Several bodies per example put the total past 10,000 bodies within the
# suite's time budget.
_OPS = ("delete", "insert", "replace", "truncate", "dup_line", "swap_lines")
_BODIES_PER_EXAMPLE = 3


def _tricky_text(rnd: random.Random, size: int, tricky: str = TRICKY) -> str:
    return "".join(rnd.choice(tricky) for _ in range(rnd.randint(0, size)))


def _mutate(rnd: random.Random, body: str, tricky: str = TRICKY) -> str:
    """1..6 random edits of ``body``: deletions, insertions/replacements of ``tricky`` characters,
    a cut, a duplicated or swapped line (shared with tests/test_collectors_readers_fuzz.py)."""
    for _ in range(rnd.randint(1, 6)):
        op = rnd.choice(_OPS)
        n = len(body)
        i, j = sorted((rnd.randint(0, n), rnd.randint(0, n)))
        lines = body.split("\n")
        k, m = rnd.randrange(len(lines)), rnd.randrange(len(lines))
        if op == "delete":
            body = body[:i] + body[j:]
        elif op == "insert":
            body = body[:i] + _tricky_text(rnd, 12, tricky) + body[i:]
        elif op == "replace":
            text = _tricky_text(rnd, 12, tricky)
            body = body[:i] + text + body[i + len(text) :]
        elif op == "truncate":
            body = body[:i]
        elif op == "dup_line":
            lines.insert(m, lines[k])
            body = "\n".join(lines)
        else:
            lines[k], lines[m] = lines[m], lines[k]
            body = "\n".join(lines)
    return body


@settings(max_examples=2500, deadline=None)
@given(seed=st.integers(0, 2**64 - 1))
def test_mutated_real_bodies(seed: int) -> None:
    rnd = random.Random(seed)
    for _ in range(_BODIES_PER_EXAMPLE):
        _check(_mutate(rnd, rnd.choice(BODIES)))


NAMES = [
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_EXP_XID_ERRORS_COUNT",
    "DCGM_EXP_CLOCK_EVENTS_COUNT",
    "DCGM_FI_DEV_POWER_USAGE",
    "dcgm_gpu_utilization",
    "dcgm_fi_prof_dram_active",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_FB_USED_PERCENT",
    "go_goroutines",
    "x",
    "",
]
LABEL_NAMES = [
    "gpu",
    "UUID",
    "uuid",
    "Hostname",
    "hostname",
    "GPU_I_ID",
    "GPU_I_PROFILE",
    "modelName",
    "pod",
    "pod_name",
    "namespace",
    "container",
    "err_msg",
    "xid",
    "nvswitch",
    "nvlink",
    "rack",
    "1bad",
    "a-b",
]
LABEL_VALUES = [
    "0",
    "1",
    "13",
    "GPU-a",
    "GPU-b",
    "",
    "node-1",
    "x,y z",
    'a"b',
    "a\\b",
    "-3",
    "1g.10gb",
    "}",
    "\n",
]
VALUES = (
    [str(v) for v in SENTINELS]
    + [f"{v:f}" for v in SENTINELS]
    + ["NaN", "+Inf", "-Inf", "1e400", "0.000000", "100", "4294967295", "-0", "1_0", "0x1p4", "", "1.5.5"]
)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(rnd: random.Random) -> str:
    kind = rnd.randrange(4)
    if kind == 0:
        return str(rnd.randint(-(2**70), 2**70))
    if kind == 1:
        return repr(rnd.uniform(-1e6, 1e6) * rnd.choice([1e-9, 1, 1e9, 1e300]))
    if kind == 2:
        return rnd.choice(VALUES)
    return "".join(rnd.choice("0123456789.eE+-_xNaInf") for _ in range(rnd.randint(0, 8)))


def _line(rnd: random.Random) -> str:
    name = rnd.choice(NAMES) if rnd.random() < 0.9 else _tricky_text(rnd, 8)
    if rnd.random() < 0.1:
        return rnd.choice(["# HELP {} text", "# TYPE {} gauge", "# TYPE {} nonsense", "# {}", ""]).format(
            name
        )
    labels = []
    for _ in range(rnd.randint(0, 6)):
        v = rnd.choice(LABEL_VALUES) if rnd.random() < 0.8 else _tricky_text(rnd, 6)
        labels.append(f'{rnd.choice(LABEL_NAMES)}="{_escape(v)}"')
    label_text = rnd.choice([",", ", ", " , "]).join(labels) + rnd.choice(["", ","])
    ts = rnd.choice(["", "", " 1700000000000", " -1", " 1.5", " x"])
    return f"{name}{{{label_text}}} {_value(rnd)}{ts}"


@settings(max_examples=2000, deadline=None)
@given(seed=st.integers(0, 2**64 - 1))
def test_generated_bodies(seed: int) -> None:
    rnd = random.Random(seed)
    for _ in range(_BODIES_PER_EXAMPLE):
        body = "\n".join(_line(rnd) for _ in range(rnd.randint(0, 25)))
        _check(body + ("\n" if rnd.random() < 0.8 else ""))


_files = st.sampled_from(
    [
        "counters/port_xmit_data",
        "counters/symbol_error",
        "counters/port_xmit_wait",
        "counters/unicast_xmit_packets",
        "counters_ext/port_xmit_data_64",
        "counters/odd_file",
        "hw_counters/lifespan",
        "rate",
        "state",
        "phys_state",
        "link_layer",
    ]
)
_contents = st.sampled_from(
    [
        "0\n",
        "4294967295\n",
        "65535\n",
        "N/A (no PMA)\n",
        "",
        "\n",
        "4: ACTIVE\n",
        "0 GB/sec\n",
        "100 Gb/sec (4X EDR)\n",
        "x: y",
        "-1\n",
        "18446744073709551615\n",
        "InfiniBand\n\n",
    ]
) | st.text(max_size=10)


@settings(max_examples=200, deadline=None)
@given(files=st.dictionaries(_files, _contents, max_size=8), guid=_contents, dirs_as_files=st.booleans())
def test_random_sysfs_trees(files: dict[str, str], guid: str, dirs_as_files: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dev = Path(tmp) / "sys/class/infiniband/mlx5_0"
        port = dev / "ports" / "1"
        port.mkdir(parents=True)
        (dev / "node_guid").write_text(guid)
        if dirs_as_files:
            (port / "counters").write_text("not a directory")
        for rel, content in files.items():
            path = port / rel
            if dirs_as_files and rel.startswith("counters/"):
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        res = read_sysfs_infiniband(Path(tmp) / "sys", "h", 1.0)
        assert len(res.ports) == 1
        for e in res.errors:
            assert e.reason and e.path
        p = res.ports[0]
        assert all(v is None or v >= 0 for v in p.counters.values())
        assert set(p.saturated) <= set(p.counters)
        assert decode(IbPortSample, encode(p)) == p
