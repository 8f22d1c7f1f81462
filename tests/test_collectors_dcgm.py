"""dcgm-exporter body parser: the handed cases (cases.json) with their right values, every sample
file, and each quirk of the exposition format by kind."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors.dcgm import REJECTION_REASONS, DcgmParseResult, parse_dcgm_exporter
from collectors.dcgm_fields import DCGM_FP64_BLANK, DCGM_INT32_BLANK, DCGM_INT64_BLANK, SENTINELS
from collectors.xid import XidTracker
from contracts import GpuSample, NvSwitchSample, decode, encode

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / ".." / "shared" / "data"
SAMPLES = DATA / "cases" / "dcgm_exporter_samples"
CASES = {c["id"]: c for c in json.loads((DATA / "cases" / "cases.json").read_text())}


def _parse(body: str, **kw: object) -> DcgmParseResult:
    kw.setdefault("default_host", "node-x")
    res = parse_dcgm_exporter(body, ts=1_700_000_000.0, target="http://node-x:9400/metrics", **kw)  # type: ignore[arg-type]
    assert {r.reason for r in res.rejected} <= REJECTION_REASONS
    return res


def _by_gi(res: DcgmParseResult) -> dict[int | None, GpuSample]:
    return {s.gpu_instance_id: s for s in res.samples}


# --- the handed cases ------------------------------------------------------------------------
def test_gpu01_not_supported_sentinel_dropped_and_comma_space_labels() -> None:
    res = _parse((DATA / "cases" / CASES["GPU-01"]["input"]["file"]).read_text())
    [s] = res.samples
    assert s.gpu_uuid == "GPU-88888888-0000-0000-0000-000000000000"
    assert s.fields == {"DCGM_FI_DEV_SM_CLOCK": 139, "DCGM_FI_DEV_MEM_CLOCK": 405}
    assert type(s.fields["DCGM_FI_DEV_SM_CLOCK"]) is int
    assert s.invalid == {"DCGM_FI_DEV_MEMORY_TEMP": "sentinel"}
    assert s.attributes == {}  # container="" namespace="" pod="" are absent
    assert [(r.reason, r.metric) for r in res.rejected] == [("sentinel", "DCGM_FI_DEV_MEMORY_TEMP")]


def test_gpu03_util_out_of_range_rejected_not_clamped() -> None:
    res = _parse(CASES["GPU-03"]["input"]["content"])
    [s] = res.samples
    assert "DCGM_FI_DEV_GPU_UTIL" not in s.fields
    assert s.invalid == {"DCGM_FI_DEV_GPU_UTIL": "out_of_range"}
    assert res.rejected_by_reason() == {"out_of_range": 1}


@pytest.mark.parametrize(
    "value,ok",
    [
        ("0", True),
        ("100", True),
        ("57", True),
        ("100.5", False),
        ("1000", False),
        ("200000", False),
        ("-1", False),
        ("4294967295", False),
    ],
)
def test_gpu03_util_range_whole_kind(value: str, ok: bool) -> None:
    res = _parse(f'DCGM_FI_DEV_MEM_COPY_UTIL{{gpu="0",UUID="GPU-x"}} {value}\n')
    [s] = res.samples
    assert ("DCGM_FI_DEV_MEM_COPY_UTIL" in s.fields) is ok
    assert ("DCGM_FI_DEV_MEM_COPY_UTIL" in s.invalid) is not ok


@pytest.mark.parametrize(
    "field",
    [
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "DCGM_FI_PROF_SM_OCCUPANCY",
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_DEV_FB_USED_PERCENT",
    ],
)
def test_profiling_ratios_outside_0_1_rejected(field: str) -> None:
    res = _parse(f'{field}{{UUID="GPU-a"}} 1.000001\n{field}{{UUID="GPU-b"}} 1.000000\n')
    a, b = res.samples
    assert a.invalid == {field: "out_of_range"} and b.fields == {field: 1.0}


def test_gpu05_mig_instances_are_gpus_and_missing_util_is_not_zero() -> None:
    res = _parse((DATA / "cases" / CASES["GPU-05"]["input"]["file"]).read_text())
    by_gi = _by_gi(res)
    assert {gi: s.fields["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] for gi, s in by_gi.items()} == {
        13: 0.784913,
        14: 0.0,
        5: 0.290336,
        1: 0.0,
    }
    assert {gi: s.gpu_instance_profile for gi, s in by_gi.items()} == {
        13: "1g.10gb",
        14: "1g.10gb",
        5: "2g.20gb",
        1: "3g.40gb",
    }
    assert [s.key for s in res.samples] == [
        f"hpc-node-17/GPU-22222222-3333-4444-5555-666666666666/{gi}" for gi in (13, 14, 5, 1)
    ]
    for s in res.samples:
        assert "DCGM_FI_DEV_GPU_UTIL" not in s.fields and "DCGM_FI_DEV_GPU_UTIL" not in s.invalid
        assert s.model_name == "NVIDIA A100-SXM4-80GB"
    assert by_gi[13].attributes["hpc_job"] == "2115078" and by_gi[5].attributes["hpc_job"] == "2115116"
    assert not res.rejected


def test_gpu06_fb_used_absent_for_gis_is_unknown_not_zero() -> None:
    res = _parse((DATA / "cases" / CASES["GPU-06"]["input"]["file"]).read_text())
    by_gi = _by_gi(res)
    assert set(by_gi) == {7, 8, 9}
    for s in by_gi.values():
        assert "DCGM_FI_DEV_FB_USED" not in s.fields and "DCGM_FI_DEV_FB_USED" not in s.invalid
        assert s.fields == {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.0}
    assert by_gi[7].attributes["pod"] == "embed-predictor-00008-deployment-7f6d5c4b3a-abcde"
    assert "pod" not in by_gi[8].attributes
    assert by_gi[9].attributes["namespace"] == "team-a-stg"


def test_gpu08_hostname_and_Hostname_are_one_identity() -> None:
    res = _parse(CASES["GPU-08"]["input"]["content"] + "\n", default_host=None)
    [s] = res.samples
    assert (s.host, s.gpu_uuid, s.key) == ("node-1", "GPU-x", "node-1/GPU-x")
    assert s.fields == {"DCGM_FI_DEV_GPU_TEMP": 41}
    # one identity: the second line is the same series again (an exact duplicate), counted
    assert [(r.reason, r.metric) for r in res.rejected] == [("duplicate_series", "DCGM_FI_DEV_GPU_TEMP")]


def test_gpu08_uuid_label_spelling_and_conflicting_repeat() -> None:
    body = (
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",uuid="GPU-x",hostname="node-1"} 41\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-x",Hostname="node-1"} 42\n'
    )
    res = _parse(body)
    [s] = res.samples
    assert s.fields == {"DCGM_FI_DEV_GPU_TEMP": 41}  # the first reading is kept
    assert [r.reason for r in res.rejected] == ["duplicate_series"]


def test_gpu10_xid_is_an_event_on_change_not_a_count() -> None:
    tracker = XidTracker()
    line = CASES["GPU-10"]["input"]["samples"][0] + "\n"
    before = line.replace(
        'err_code="31",err_msg="GPU memory page fault"} 31', 'err_code="0",err_msg="No Error"} 0'
    )
    events = []
    for body in (before, line, line, line):  # 0, then 31, then the same 31 ten minutes later...
        res = _parse(body)
        assert res.samples[0].fields["DCGM_FI_DEV_XID_ERRORS"] in (0, 31)
        events += tracker.observe(res.xid)
    assert [(e.xid, e.previous, e.count, e.message, e.source) for e in events] == [
        (31, 0, 1, "GPU memory page fault", "last_value")
    ]
    res = _parse(line.replace("31", "43"))
    assert [(e.xid, e.previous) for e in tracker.observe(res.xid)] == [(43, 31)]


def test_gpu10_windowed_xid_count_preferred() -> None:
    tracker = XidTracker()
    body = (
        'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-x",err_code="31"} 31\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="0",UUID="GPU-x",xid="31",window_size_in_ms="300000"} 2\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="0",UUID="GPU-x",xid="79",window_size_in_ms="300000"} 1\n'
    )
    res = _parse(body)
    [s] = res.samples
    assert s.fields["DCGM_EXP_XID_ERRORS_COUNT"] == 3  # events of every code in the window
    assert res.xid[0].window_counts == {31: 2, 79: 1}
    assert [(e.xid, e.count, e.source) for e in tracker.observe(res.xid)] == [
        (31, 2, "window_count"),
        (79, 1, "window_count"),
    ]
    assert tracker.observe(_parse(body).xid) == []  # same window, no repeat
    again = _parse(body.replace('"31",window_size_in_ms="300000"} 2', '"31",window_size_in_ms="300000"} 3'))
    assert [(e.xid, e.count, e.previous) for e in tracker.observe(again.xid)] == [(31, 1, 2)]


def test_gpu12_identity_ignores_pod_labels_which_become_attributes() -> None:
    res = _parse((DATA / "cases" / CASES["GPU-12"]["input"]["file"]).read_text())
    assert [s.key for s in res.samples] == [
        f"computeinstance-0001/GPU-33333333-aaaa-bbbb-cccc-{n * 12}" for n in "0123"
    ]
    gpu0 = res.samples[0]
    assert {k: gpu0.attributes[k] for k in ("pod", "namespace", "container")} == {
        "pod": "dcgmproftester2",
        "namespace": "default",
        "container": "dcgmproftester2",
    }
    for s in res.samples[1:]:
        assert not {"pod", "namespace", "container"} & set(s.attributes)
    assert all(s.fields == {"DCGM_FI_DEV_GPU_UTIL": 0} for s in res.samples)


def test_gpu12_label_sets_changing_between_series_keep_one_identity() -> None:
    body = (
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-x",pod="",namespace=""} 5\n'
        'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-x",pod="p1",namespace="ns"} 100\n'
    )
    [s] = _parse(body).samples
    assert s.fields == {"DCGM_FI_DEV_GPU_UTIL": 5, "DCGM_FI_DEV_FB_USED": 100}
    assert s.attributes == {"pod": "p1", "namespace": "ns"}


def test_gpu14_stalled_profiling_values_are_delivered_as_read() -> None:
    [s] = _parse(CASES["GPU-14"]["input"]["content"]).samples
    assert s.fields == {"DCGM_FI_DEV_GPU_UTIL": 99, "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.0}


# --- sample files ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(SAMPLES.glob("*.prom")), ids=lambda p: p.name)
def test_every_sample_file_parses(path: Path) -> None:
    res = _parse(path.read_text())
    assert res.samples
    for s in res.samples:
        assert decode(GpuSample, encode(s)) == s


def test_mig_gpu_level_fields_repeated_per_instance_are_not_summed() -> None:
    res = _parse((SAMPLES / "a30_mig_gpu_level_fields_repeated_per_gi.prom").read_text())
    power = {(s.gpu_uuid[-4:], s.gpu_instance_id): s.fields["DCGM_FI_DEV_POWER_USAGE"] for s in res.samples}
    assert power == {
        ("5555", 3): 52.636,
        ("5555", 4): 52.636,
        ("5555", 5): 52.746,
        ("5555", 6): 52.746,
        ("aaaa", 3): 56.121,
        ("aaaa", 4): 56.127,
    }
    assert all(s.gpu_instance_id is not None for s in res.samples)  # no invented parent GPU
    assert all(s.fields["DCGM_FI_DEV_XID_ERRORS"] == 0 for s in res.samples)
    assert not res.rejected


def test_old_namespace_names_and_labels_are_mapped() -> None:
    res = _parse((SAMPLES / "old_namespace_lowercase_names.prom").read_text())
    by_key = {s.key: s for s in res.samples}
    aa = by_key["dcgm-exporter-6ldbb/GPU-77777777-0000-0000-0000-0000000000aa"]
    assert aa.fields == {
        "DCGM_FI_DEV_SM_CLOCK": 585,
        "DCGM_FI_DEV_MEM_CLOCK": 5000,
        "DCGM_FI_DEV_GPU_TEMP": 54,
        "DCGM_FI_DEV_POWER_USAGE": 30.982,
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 55491669881,
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0,
        "DCGM_FI_DEV_GPU_UTIL": 0,
    }
    mig = by_key["node-x/GPU-77777777-0000-0000-0000-000000000003/1"]  # no host label: the default
    assert mig.fields == {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.0} and mig.gpu_instance_profile == "4g.40gb"
    pod = by_key["node-x/GPU-77777777-0000-0000-0000-000000000004"]
    assert {k: pod.attributes[k] for k in ("pod", "namespace", "container")} == {
        "pod": "d85np-t6mdg",
        "namespace": "ai-1",
        "container": "-grpc-pod",
    }
    assert pod.fields == {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.008246}


def test_current_template_values() -> None:
    res = _parse((SAMPLES / "synthesized_current_template_4x.prom").read_text())
    by_key = {s.key: s for s in res.samples}
    g1 = by_key["gpu-node-001/GPU-c0ffee00-0000-4000-8000-000000000001"]
    assert g1.fields == {
        "DCGM_FI_DEV_SM_CLOCK": 1980,
        "DCGM_FI_DEV_POWER_USAGE": 612.889,
        "DCGM_FI_DEV_GPU_UTIL": 97,
        "DCGM_FI_DEV_XID_ERRORS": 45,
        "DCGM_FI_DEV_FB_USED": 74321,
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.912597,
        "DCGM_FI_PROF_PCIE_TX_BYTES": 67358889,
    }
    assert g1.attributes["pod_uid"] == "0b9d7a52-1111-4222-8333-944455556666"
    g0 = by_key["gpu-node-001/GPU-c0ffee00-0000-4000-8000-000000000000"]
    assert g0.fields["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == 129931554972
    assert type(g0.fields["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]) is int
    assert g0.model_name == "NVIDIA H100 80GB HBM3" and g0.gpu_index == 0
    assert set(_by_gi(res)) == {None, 1, 2}
    assert [(r.reason, r.metric) for r in res.rejected] == [("unknown_metric", "TEST_METRIC")]
    [xid45] = [x for x in res.xid if x.last_xid == 45]
    assert xid45.message.startswith("Preemptive cleanup")  # type: ignore[union-attr]


# --- sentinels, by family ----------------------------------------------------------------------
@pytest.mark.parametrize("value", sorted(SENTINELS))
@pytest.mark.parametrize("fmt", ["{:d}", "{:f}"])
def test_every_sentinel_of_every_family_is_dropped(value: int, fmt: str) -> None:
    res = _parse(f'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{UUID="GPU-x"}} {fmt.format(value)}\n')
    [s] = res.samples
    assert s.fields == {} and s.invalid == {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "sentinel"}


def test_sentinel_constants_are_dcgm_structs_values() -> None:
    assert (DCGM_INT32_BLANK, DCGM_INT64_BLANK, DCGM_FP64_BLANK) == (0x7FFFFFF0, 0x7FFFFFFFFFFFFFF0, 2.0**47)
    assert 9223372036854775794 in SENTINELS  # DCGM_INT64_NOT_SUPPORTED of case GPU-01
    assert len(SENTINELS) == 12


@pytest.mark.parametrize("value", ["9223372036854775807", "9.223372036854776e18"])
def test_int64_blank_range_is_sentinel(value: str) -> None:
    [s] = _parse(f'DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL{{UUID="GPU-x"}} {value}\n').samples
    assert s.invalid == {"DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "sentinel"}


@pytest.mark.parametrize(
    "value", [DCGM_INT32_BLANK - 1, DCGM_INT32_BLANK + 4, 2**53 + 1, int(DCGM_FP64_BLANK) - 1]
)
def test_values_next_to_sentinels_are_kept_exactly(value: int) -> None:
    [s] = _parse(f'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{UUID="GPU-x"}} {value}\n').samples
    got = s.fields["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
    assert got == value and type(got) is int


# --- exposition format quirks ------------------------------------------------------------------
def test_label_values_with_commas_spaces_escapes_and_braces() -> None:
    body = (
        'DCGM_FI_DEV_XID_ERRORS{gpu="0", UUID="GPU-x" , modelName="NVIDIA H100 80GB HBM3",'
        'err_msg="a, b \\"quoted\\" c:\\\\d}\\nline2", Hostname="n1",} 13\n'
    )
    res = _parse(body)
    [s] = res.samples
    assert s.key == "n1/GPU-x" and s.model_name == "NVIDIA H100 80GB HBM3"
    assert res.xid[0].message == 'a, b "quoted" c:\\d}\nline2'
    assert s.fields == {"DCGM_FI_DEV_XID_ERRORS": 13}


def test_timestamps_families_out_of_order_and_foreign_type_lines() -> None:
    body = (
        "# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).\n"
        "# TYPE DCGM_FI_DEV_FB_FREE gauge\n"  # a family with no samples
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
        'DCGM_FI_DEV_FB_USED{UUID="GPU-x"} 10 1700000000123\n'  # under another family's TYPE
        "# HELP DCGM_FI_DEV_GPU_TEMP x\n"
        'DCGM_FI_DEV_GPU_UTIL{UUID="GPU-x"} 7 1700000000100\n'  # its family's TYPE came earlier
        "# TYPE DCGM_FI_DEV_FB_USED gauge\n"  # TYPE after its samples
        '\r\nDCGM_FI_DEV_GPU_TEMP{UUID="GPU-x"} 40\r\n'
    )
    res = _parse(body)
    [s] = res.samples
    assert s.fields == {"DCGM_FI_DEV_FB_USED": 10, "DCGM_FI_DEV_GPU_UTIL": 7, "DCGM_FI_DEV_GPU_TEMP": 40}
    assert s.ts == pytest.approx(1700000000.123)
    assert not res.rejected


def test_no_timestamp_uses_scrape_time() -> None:
    [s] = _parse('DCGM_FI_DEV_GPU_UTIL{UUID="GPU-x"} 7\n').samples
    assert s.ts == 1_700_000_000.0


def test_truncated_last_line_and_garbage_lines_lose_only_themselves() -> None:
    good = 'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a"} 50\nDCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-b"} 60\n'
    bad = (
        "this is not a metric line\n"
        'DCGM_FI_DEV_FB_USED{UUID="GPU-a" 5\n'
        'DCGM_FI_DEV_FB_USED{UUID="GPU-a"} abc\n'
        'DCGM_FI_DEV_FB_USED{UUID="GPU-a"} 1 2 3\n'
        'DCGM_FI_DEV_FB_USED{UUID="GPU-a"} 1 12.5\n'
        'DCGM_FI_DEV_FB_USED{UUID="GPU-a" pod="x"} 1\n'
        'DCGM_FI_DEV_FB_USED{UUID="GPU-a",UUID="GPU-b"} 1\n'
        'DCGM_FI_DEV_FB_USED{1abc="x",UUID="GPU-a"} 1\n'
        'DCGM_FI_DEV_FB_USED{device="nvidia0"} 1\n'
        'DCGM_FI_DEV_FB_USED{UUID="GPU-a",GPU_I_ID="x1"} 1\n'
        "# TYPE DCGM_FI_DEV_FB_USED sometype\n"
        "\x00\xff\ufffd garbage {{{ ]]]\n"
    )
    res = _parse(bad + good + 'DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-b"} 7')  # cut off: no final \n
    assert [s.fields for s in res.samples] == [{"DCGM_FI_DEV_GPU_UTIL": 50}, {"DCGM_FI_DEV_GPU_UTIL": 60}]
    assert res.rejected_by_reason() == {
        "unknown_metric": 1,
        "bad_labels": 4,
        "bad_value": 1,
        "malformed_line": 1,
        "bad_timestamp": 1,
        "duplicate_label": 1,
        "missing_uuid": 1,
        "bad_gpu_instance_id": 1,
        "bad_type_line": 1,
        "truncated_line": 1,
    }


def test_nan_and_inf_are_invalid() -> None:
    body = (
        'DCGM_FI_DEV_POWER_USAGE{UUID="GPU-x"} NaN\nDCGM_FI_DEV_GPU_TEMP{UUID="GPU-x"} +Inf\n'
        'DCGM_FI_DEV_SM_CLOCK{UUID="GPU-x"} -Inf\nDCGM_FI_DEV_MEM_CLOCK{UUID="GPU-x"} 1e3\n'
    )
    [s] = _parse(body).samples
    assert s.invalid == {
        "DCGM_FI_DEV_POWER_USAGE": "not_a_number",
        "DCGM_FI_DEV_GPU_TEMP": "out_of_range",
        "DCGM_FI_DEV_SM_CLOCK": "out_of_range",
    }
    assert s.fields == {"DCGM_FI_DEV_MEM_CLOCK": 1000.0}
    assert not any(math.isnan(v) for v in s.fields.values())


def test_empty_label_values_are_absent_and_host_is_required() -> None:
    body = 'DCGM_FI_DEV_GPU_UTIL{UUID="GPU-x",GPU_I_ID="",GPU_I_PROFILE="",Hostname=""} 3\n'
    [s] = _parse(body).samples
    assert (s.key, s.gpu_instance_id, s.gpu_instance_profile) == ("node-x/GPU-x", None, None)
    res = _parse(body, default_host=None)
    assert not res.samples and res.rejected_by_reason() == {"missing_host": 1}
    assert not _parse('DCGM_FI_DEV_GPU_UTIL{UUID=""} 3\n').samples


def test_seq_numbers_and_target() -> None:
    res = _parse((SAMPLES / "a100_mig_hpc_job.prom").read_text(), seq_start=100)
    assert [s.seq for s in res.samples] == [100, 101, 102, 103]
    assert {s.target for s in res.samples} == {"http://node-x:9400/metrics"}
    assert {s.source for s in res.samples} == {"dcgm-exporter"}


def test_empty_and_comment_only_bodies() -> None:
    for body in ("", "\n\n", "# HELP x y\n# TYPE x gauge\n", "   \n\t\n"):
        res = _parse(body)
        assert res.samples == [] and res.rejected == [] and res.sample_lines == 0


def test_bench_body_is_a_valid_h100_page() -> None:
    spec = importlib.util.spec_from_file_location("bench_collect", REPO / "bench" / "collect.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    body = mod.build_h100_body(8)
    res = _parse(body)
    assert len(res.samples) == 8 and not res.rejected
    # 36 series per GPU, plus DCGM_FI_DEV_FB_USED_PERCENT derived from FB_USED and FB_FREE
    assert all(len(s.fields) == 37 and "DCGM_FI_DEV_FB_USED_PERCENT" in s.fields for s in res.samples)
    assert sum(len(f.samples) for f in text_string_to_metric_families(body)) == 8 * 36


# --- issue 15: no series lost for a missing label -------------------------------------------------
def test_gpu_without_uuid_is_known_by_host_and_index() -> None:
    body = (
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="node-1",device="nvidia0"} 7\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="1",Hostname="node-1",device="nvidia1"} 8\n'
        'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="1",GPU_I_ID="3",Hostname="node-1"} 0.5\n'
    )
    res = _parse(body, default_host=None)
    assert not res.rejected
    assert [(s.key, s.gpu_uuid, s.gpu_index, s.gpu_instance_id) for s in res.samples] == [
        ("node-1/gpu0", None, 0, None),
        ("node-1/gpu1", None, 1, None),
        ("node-1/gpu1/3", None, 1, 3),
    ]
    assert res.samples[0].fields == {"DCGM_FI_DEV_GPU_UTIL": 7}
    assert res.samples[0].attributes == {"device": "nvidia0"}
    assert decode(GpuSample, encode(res.samples[2])) == res.samples[2]


def test_series_without_uuid_join_the_gpu_of_the_same_index_in_the_body() -> None:
    """A UUID on some series only (trimmed relabelling): every series of gpu 0 is one GPU, keyed
    by its UUID, whichever comes first; an index no UUID'd series has stays its own GPU."""
    body = (
        'DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n"} 100\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",Hostname="n"} 5\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",Hostname="n"} 40\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n"} 6\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="2",Hostname="n"} 9\n'
    )
    res = _parse(body, default_host=None)
    assert [s.key for s in res.samples] == ["n/GPU-a", "n/gpu2"]
    a = res.samples[0]
    assert (a.gpu_uuid, a.gpu_index) == ("GPU-a", 0)
    assert a.fields == {"DCGM_FI_DEV_GPU_UTIL": 5, "DCGM_FI_DEV_FB_USED": 100, "DCGM_FI_DEV_GPU_TEMP": 40}
    # the same field from the UUID-less series is the same series again: a counted duplicate
    assert [(r.reason, r.metric) for r in res.rejected] == [("duplicate_series", "DCGM_FI_DEV_GPU_UTIL")]


def test_series_without_any_device_identity_are_rejected() -> None:
    res = _parse('DCGM_FI_DEV_GPU_UTIL{Hostname="n",device="nvidia0"} 5\n', default_host=None)
    assert res.samples == [] and [r.reason for r in res.rejected] == ["missing_uuid"]


def test_nvswitch_series_are_kept_with_per_link_values() -> None:
    """dcgm-exporter's switch template ``{nvswitch="N"}`` and link template
    ``{nvlink="L",nvswitch="N"}`` (internal/pkg/rendermetrics): no GPU UUID, not dropped."""
    body = (
        'DCGM_FI_DEV_NVSWITCH_TEMPERATURE_CURRENT{nvswitch="0",Hostname="n"} 45\n'
        'DCGM_FI_DEV_NVSWITCH_LINK_THROUGHPUT_TX{nvlink="0",nvswitch="0",Hostname="n"} 100\n'
        'DCGM_FI_DEV_NVSWITCH_LINK_THROUGHPUT_TX{nvlink="1",nvswitch="0",Hostname="n"} 200\n'
        'DCGM_FI_DEV_NVSWITCH_TEMPERATURE_CURRENT{nvswitch="1",Hostname="n"} 47\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",Hostname="n"} 5\n'
    )
    res = _parse(body, default_host=None, seq_start=10)
    assert not res.rejected
    assert [s.key for s in res.samples] == ["n/GPU-a"] and res.samples[0].seq == 10
    assert [(w.key, w.nvswitch, w.seq) for w in res.switches] == [("n/nvswitch0", 0, 11), ("n/nvswitch1", 1, 12)]
    sw0 = res.switches[0]
    assert sw0.fields == {
        "DCGM_FI_DEV_NVSWITCH_TEMPERATURE_CURRENT": 45,
        "DCGM_FI_DEV_NVSWITCH_LINK_THROUGHPUT_TX": 100,
    }
    assert [(v.labels, v.value) for v in sw0.field_series["DCGM_FI_DEV_NVSWITCH_LINK_THROUGHPUT_TX"]] == [
        ({"nvlink": "0"}, 100),
        ({"nvlink": "1"}, 200),
    ]
    assert decode(NvSwitchSample, encode(sw0)) == sw0


def test_every_label_is_kept_and_a_split_field_keeps_every_series() -> None:
    """An XID field split by an ``xid`` label keeps every code; unknown labels are attributes."""
    body = (
        'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a",xid="31",err_msg="MMU fault",rack="r1"} 31\n'
        'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a",xid="79",err_msg="fell off the bus",rack="r1"} 79\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",rack="r1",pod="p1"} 10\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",rack="r1",pod="p2"} 10\n'
    )
    res = _parse(body)
    assert not res.rejected
    [s] = res.samples
    assert s.attributes == {"rack": "r1", "pod": "p1"}
    assert s.fields == {"DCGM_FI_DEV_XID_ERRORS": 31, "DCGM_FI_DEV_GPU_UTIL": 10}
    assert [(v.labels, v.value) for v in s.field_series["DCGM_FI_DEV_XID_ERRORS"]] == [
        ({"err_msg": "MMU fault", "rack": "r1", "xid": "31"}, 31),
        ({"err_msg": "fell off the bus", "rack": "r1", "xid": "79"}, 79),
    ]
    # a GPU shared by two pods: one series per pod, both kept
    assert [v.labels["pod"] for v in s.field_series["DCGM_FI_DEV_GPU_UTIL"]] == ["p1", "p2"]
    assert decode(GpuSample, encode(s)) == s


def test_one_series_with_a_per_series_label_keeps_it() -> None:
    [s] = _parse('DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a",err_code="31",err_msg="x"} 31\n').samples
    assert s.attributes == {}
    assert [(v.labels, v.value) for v in s.field_series["DCGM_FI_DEV_XID_ERRORS"]] == [
        ({"err_code": "31", "err_msg": "x"}, 31)
    ]


def test_exact_duplicate_series_are_flagged_like_conflicting_ones() -> None:
    line = 'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a"} 5\n'
    for second, detail in ((line, "repeats it"), (line.replace(" 5", " 6"), "has 5, dropped 6")):
        res = _parse(line + second)
        [s] = res.samples
        assert s.fields == {"DCGM_FI_DEV_GPU_UTIL": 5} and s.field_series == {}
        [r] = res.rejected
        assert (r.reason, r.metric) == ("duplicate_series", "DCGM_FI_DEV_GPU_UTIL") and detail in r.detail


def test_duplicate_windowed_count_series_are_not_added_twice() -> None:
    body = (
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="0",UUID="GPU-x",xid="31"} 2\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="0",UUID="GPU-x",xid="31"} 2\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="0",UUID="GPU-x",xid="79"} 1\n'
    )
    res = _parse(body)
    [s] = res.samples
    assert s.fields["DCGM_EXP_XID_ERRORS_COUNT"] == 3
    assert res.xid[0].window_counts == {31: 2, 79: 1}
    assert [r.reason for r in res.rejected] == ["duplicate_series"]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ('1000\nDCGM_FI_DEV_FB_FREE{UUID="GPU-a"} 3000', 0.25),  # used / (used + free)
        ('1000\nDCGM_FI_DEV_FB_TOTAL{UUID="GPU-a"} 4000', 0.25),  # used / total
        ('1000\nDCGM_FI_DEV_FB_TOTAL{UUID="GPU-a"} 4500\nDCGM_FI_DEV_FB_RESERVED{UUID="GPU-a"} 500', 0.25),
        ('4000\nDCGM_FI_DEV_FB_FREE{UUID="GPU-a"} 0', 1.0),
        ('0\nDCGM_FI_DEV_FB_FREE{UUID="GPU-a"} 0', None),  # no denominator
        ('1000', None),  # total unknown
        ('1000\nDCGM_FI_DEV_FB_USED_PERCENT{UUID="GPU-a"} 0.5', 0.5),  # sent: kept as sent
    ],
)
def test_fb_used_fraction_derived_where_used_and_total_are_known(fields: str, expected: float | None) -> None:
    body = 'DCGM_FI_DEV_FB_USED{UUID="GPU-a"} ' + fields + "\n"
    [s] = _parse(body).samples
    assert s.fields.get("DCGM_FI_DEV_FB_USED_PERCENT") == expected


def test_fb_used_over_total_is_invalid_not_kept() -> None:
    body = 'DCGM_FI_DEV_FB_USED{UUID="GPU-a"} 5000\nDCGM_FI_DEV_FB_TOTAL{UUID="GPU-a"} 4000\n'
    [s] = _parse(body).samples
    assert "DCGM_FI_DEV_FB_USED_PERCENT" not in s.fields
    assert s.invalid == {"DCGM_FI_DEV_FB_USED_PERCENT": "out_of_range"}


def test_series_without_uuid_stay_their_own_gpu_when_the_index_is_ambiguous() -> None:
    body = (
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",Hostname="n"} 5\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-b",Hostname="n"} 6\n'  # two GPUs claim index 0
        'DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n"} 100\n'
    )
    res = _parse(body, default_host=None)
    assert [s.key for s in res.samples] == ["n/GPU-a", "n/GPU-b", "n/gpu0"]
    assert res.samples[2].fields == {"DCGM_FI_DEV_FB_USED": 100} and not res.rejected


def test_xid_field_split_by_xid_label_reports_every_code_once() -> None:
    tracker = XidTracker()
    one = 'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a",xid="31"} 31\n'
    two = one + 'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a",xid="79"} 79\n'
    assert [(e.xid, e.previous) for e in tracker.observe(_parse(one).xid)] == [(31, None)]
    res = _parse(two)
    assert res.xid[0].codes == (31, 79)
    assert [(e.xid, e.previous, e.source) for e in tracker.observe(res.xid)] == [(79, 31, "last_value")]
    assert tracker.observe(_parse(two).xid) == []  # the same two codes: no repeat
