"""Fuzzing the readers of nvidia-smi CSV, UFM Telemetry, dcgmi dmon and ibstat with hypothesis, in
the style of tests/test_collectors_fuzz.py: mutated fixtures (written from the tools' docs) and
generated lines. No exception may escape, every rejection has a known reason, and whatever is
kept is valid (finite, in range, serialisable, counters non-negative ints below 2**64)."""

from __future__ import annotations

import math
import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.dcgmi_dmon import parse_dcgmi_dmon
from collectors.ibstat import parse_ibstat
from collectors.nvsmi import NvsmiParseResult, value_range
from collectors.nvsmi_csv import parse_nvidia_smi_csv
from collectors.ufm_telemetry import parse_ufm_telemetry
from contracts import GpuSample, IbPortSample, decode, encode
from tests.test_collectors_fuzz import _mutate as mutate

FIX = Path(__file__).resolve().parent / "fixtures"
CSV = [p.read_text() for p in sorted((FIX / "nvidia_smi_csv").glob("*.csv"))]
UFM = [p.read_text() for p in sorted((FIX / "ufm_telemetry").glob("*.prom"))]
DMON = [p.read_text() for p in sorted((FIX / "dcgmi_dmon").glob("*.txt"))]
IBSTAT = [p.read_text() for p in sorted((FIX / "ibstat").glob("*.txt"))]
TRICKY = "{}\",=\\\n\r\t #:.-+eE0123456789[]%NaInf_/ GPU ID N/A Port State Rate MiB W \x00\u00e9"

GPU_REASONS = frozenset(
    {"malformed_line", "missing_uuid", "not_a_number", "out_of_range", "unknown_error", "no_permission",
     "gpu_lost", "dcgmi_error", "unsupported_entity"}
)  # fmt: skip
UFM_REASONS = frozenset(
    {"malformed_line", "bad_labels", "duplicate_label", "bad_timestamp", "unknown_metric", "missing_port",
     "bad_value", "out_of_range", "duplicate_series"}
)  # fmt: skip
IBSTAT_REASONS = frozenset({"unrecognised_line", "bad_guid", "duplicate_key", "bad_value"})


def _mutate(rnd: random.Random, text: str) -> str:
    return mutate(rnd, text, TRICKY)


def _check_gpus(res: NvsmiParseResult) -> None:
    assert {r.reason for r in res.rejected} <= GPU_REASONS
    for s in res.samples:
        assert s.gpu_uuid or s.gpu_index is not None
        assert not set(s.fields) & set(s.invalid)
        for name, value in s.fields.items():
            assert math.isfinite(value)
            rng = value_range(name)
            assert rng is None or rng[0] <= value <= rng[1], (name, value)
        assert decode(GpuSample, encode(s)) == s


def _check_ports(ports: list[IbPortSample]) -> None:
    for p in ports:
        assert all(v is None or 0 <= v < 2**64 for v in p.counters.values())
        assert p.rate_bytes_per_second is None or p.rate_bytes_per_second >= 0
        assert decode(IbPortSample, encode(p)) == p


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**64 - 1))
def test_mutated_nvidia_smi_csv(seed: int) -> None:
    rnd = random.Random(seed)
    text = _mutate(rnd, rnd.choice(CSV))
    props = rnd.choice([None, ["index", "uuid", "utilization.gpu", "memory.total", "memory.used", "power.draw"]])
    _check_gpus(parse_nvidia_smi_csv(text, host="h", ts=1.0, properties=props))


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**64 - 1))
def test_mutated_dcgmi_dmon(seed: int) -> None:
    rnd = random.Random(seed)
    text = _mutate(rnd, rnd.choice(DMON))
    _check_gpus(parse_dcgmi_dmon(text, host="h", ts=1.0, ids=rnd.choice([None, [203, 252], [1001]])))


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**64 - 1))
def test_mutated_ufm_telemetry(seed: int) -> None:
    rnd = random.Random(seed)
    res = parse_ufm_telemetry(_mutate(rnd, rnd.choice(UFM)), ts=1.0)
    assert {r.reason for r in res.rejected} <= UFM_REASONS
    keys = [(p.node_guid, p.port) for p in res.ports]
    assert len(keys) == len(set(keys))
    _check_ports(res.ports)


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**64 - 1))
def test_mutated_ibstat(seed: int) -> None:
    rnd = random.Random(seed)
    res = parse_ibstat(_mutate(rnd, rnd.choice(IBSTAT)), host="h", ts=1.0)
    assert {p.reason for p in res.problems} <= IBSTAT_REASONS
    _check_ports(res.ports)
    for p in res.ports:
        assert p.state_id is None or 1 <= p.state_id <= 4
        assert p.phys_state_id is None or 0 <= p.phys_state_id <= 7


CELLS = ["0", "87 %", "[N/A]", "[Not Supported]", "[Unknown Error]", "81920 MiB", "1e400", "NaN", "-5", "P0",
         "P99", "GPU-x", "", "312.45 W", "4294967295", "1.5.5", "inf"]  # fmt: skip
PROPS = ["index", "uuid", "name", "utilization.gpu", "memory.used", "memory.total", "memory.free",
         "power.draw", "pstate", "fan.speed", "serial", "temperature.gpu"]  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**64 - 1))
def test_generated_nvidia_smi_csv(seed: int) -> None:
    rnd = random.Random(seed)
    props = rnd.sample(PROPS, rnd.randint(1, len(PROPS)))
    rows = [", ".join(rnd.choice(CELLS) for _ in props) for _ in range(rnd.randint(0, 6))]
    header = [", ".join(f"{p} [%]" if rnd.random() < 0.3 else p for p in props)] if rnd.random() < 0.5 else []
    _check_gpus(parse_nvidia_smi_csv("\n".join(header + rows), host="h", ts=1.0, properties=props))
