"""The readers of issue 15: nvidia-smi CSV queries, UFM Telemetry, dcgmi dmon and ibstat, each on
fixtures written from the tools' public documentation (tests/fixtures/*/README.md), plus IB link
width/speed from sysfs and perfquery."""

from __future__ import annotations

from pathlib import Path

import pytest

from collectors.dcgmi_dmon import field_ids, parse_dcgmi_dmon
from collectors.fabric_parse import parse_ibnetdiscover
from collectors.fabric_records import port_sample
from collectors.ib_counters import link_width_speed, rate_width_speed
from collectors.ibstat import parse_ibstat
from collectors.nvsmi_csv import is_csv_query, parse_nvidia_smi_csv, query_properties
from collectors.sysfs_ib import read_sysfs_infiniband
from collectors.ufm_telemetry import PMA_NAMES, parse_ufm_telemetry
from contracts import GpuSample, IbPortSample, decode, encode

FIX = Path(__file__).resolve().parent / "fixtures"


# --- nvidia-smi --query-gpu --format=csv ------------------------------------------------------------
def test_csv_with_header_and_units() -> None:
    res = parse_nvidia_smi_csv((FIX / "nvidia_smi_csv" / "header_units.csv").read_text(), host="n1", ts=5.0)
    assert res.error is None and not res.rejected
    a, b = res.samples
    assert (a.key, a.gpu_index, a.model_name, a.source) == (
        "n1/GPU-8f6b2d4c-1a2b-3c4d-5e6f-7a8b9c0d1e2f", 0, "NVIDIA A100-SXM4-80GB", "nvidia-smi",
    )  # fmt: skip
    assert a.fields == {
        "DCGM_FI_DEV_GPU_UTIL": 87,
        "DCGM_FI_DEV_MEM_COPY_UTIL": 42,
        "DCGM_FI_DEV_FB_TOTAL": 81920,
        "DCGM_FI_DEV_FB_USED": 40960,
        "DCGM_FI_DEV_FB_FREE": 40417,
        "DCGM_FI_DEV_GPU_TEMP": 61,
        "DCGM_FI_DEV_POWER_USAGE": 312.45,
        "DCGM_FI_DEV_SM_CLOCK": 1410,
        "DCGM_FI_DEV_PSTATE": 0,
        "DCGM_FI_DEV_FB_USED_PERCENT": 40960 / (40960 + 40417),
    }
    assert a.attributes == {"pci.bus_id": "00000000:07:00.0"}
    # [N/A] and [Not Supported] are absent, never 0 and never invalid
    assert "DCGM_FI_DEV_FAN_SPEED" not in a.fields | a.invalid | b.fields | b.invalid
    assert b.fields["DCGM_FI_DEV_FB_USED"] == 4 and [s.seq for s in res.samples] == [0, 1]
    assert decode(GpuSample, encode(a)) == a


def test_csv_noheader_nounits_uses_the_query_list() -> None:
    cmd = [
        "nvidia-smi",
        "--query-gpu=index,uuid,utilization.gpu,memory.total,memory.used,power.draw",
        "--format=csv,noheader,nounits",
    ]
    assert is_csv_query(cmd) and not is_csv_query(["nvidia-smi", "-q", "-x"])
    text = (FIX / "nvidia_smi_csv" / "noheader_nounits.csv").read_text()
    res = parse_nvidia_smi_csv(text, host="n1", ts=5.0, properties=query_properties(cmd))
    a, b = res.samples
    assert a.fields == {
        "DCGM_FI_DEV_GPU_UTIL": 87,
        "DCGM_FI_DEV_FB_TOTAL": 81920,
        "DCGM_FI_DEV_FB_USED": 40960,
        "DCGM_FI_DEV_POWER_USAGE": 312.45,
        "DCGM_FI_DEV_FB_USED_PERCENT": 0.5,
    }
    assert b.fields == {"DCGM_FI_DEV_FB_TOTAL": 81920}
    assert b.invalid == {"DCGM_FI_DEV_GPU_UTIL": "unknown_error"}
    assert [(r.reason, r.metric) for r in res.rejected] == [("unknown_error", "DCGM_FI_DEV_GPU_UTIL")]
    # without the query list a headerless output cannot be read, and says so
    assert parse_nvidia_smi_csv(text, host="n1", ts=5.0).error == "no_properties"


def test_csv_header_with_units_values_without_and_no_uuid() -> None:
    res = parse_nvidia_smi_csv((FIX / "nvidia_smi_csv" / "header_nounits.csv").read_text(), host="n1", ts=5.0)
    a, b = res.samples
    assert a.fields["DCGM_FI_DEV_POWER_USAGE"] == 312.45 and a.attributes == {"driver_version": "550.54.15"}
    assert (b.gpu_uuid, b.gpu_index, b.key) == (None, 1, "n1/gpu1")
    assert b.fields == {
        "DCGM_FI_DEV_GPU_UTIL": 5,
        "DCGM_FI_DEV_FB_TOTAL": 16384,
        "DCGM_FI_DEV_FB_USED": 1024,
        "DCGM_FI_DEV_FB_USED_PERCENT": 0.0625,
    }


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("0, GPU-a, 101", "out_of_range"),  # 101 % is no utilisation
        ("0, GPU-a, abc", "not_a_number"),
        ("0, GPU-a, 5 W", "not_a_number"),  # another unit
        ("0, GPU-a", "malformed_line"),
        ("[N/A], [N/A], 5", "missing_uuid"),
    ],
)
def test_csv_bad_lines_lose_only_themselves(line: str, reason: str) -> None:
    text = "index, uuid, utilization.gpu [%]\n" + line + "\n1, GPU-b, 100 %\n"
    res = parse_nvidia_smi_csv(text, host="n", ts=1.0)
    assert [r.reason for r in res.rejected] == [reason]
    assert res.samples[-1].fields == {"DCGM_FI_DEV_GPU_UTIL": 100}


# --- UFM Telemetry ----------------------------------------------------------------------------------
def test_ufm_telemetry_counters_map_to_pma_names() -> None:
    res = parse_ufm_telemetry((FIX / "ufm_telemetry" / "switch_ports.prom").read_text(), ts=9.0, seq_start=4)
    assert not res.rejected
    p2, p3, hca = res.ports
    assert (p2.node_guid, p2.port, p2.host, p2.device, p2.source, p2.seq) == (
        "0x0002c90300f172a0", 2, "0x0002c90300f172a0", "0x0002c90300f172a0", "ufm-telemetry", 4,
    )  # fmt: skip
    assert p2.ts == 1628683905.941
    assert p2.counters == {
        "PortXmitData": 85554128244,
        "PortXmitPkts": 1188251785,
        "PortRcvData": 36298026860928,
        "PortXmitWait": 18446744073709551615,
        "SymbolErrorCounter": 3,
        "PortUnicastXmitPkts": 1188251000,
    }
    assert p2.data_bytes("PortRcvData") == 145192107443712  # words, as perfquery's (IB-11)
    assert p2.counter_bits["PortXmitData"] == 64 and p2.saturated == ["PortXmitWait"]
    assert p2.hw_counters == {"PortFECCorrectableBlockCounter": 17}
    assert (p3.port, p3.counters) == (3, {"PortXmitData": 0})
    assert (hca.host, hca.device, hca.node_guid) == ("worker20", "mlx5_3", "0xb83fd20300da1138")
    assert decode(IbPortSample, encode(p2)) == p2
    assert all(name.endswith("Extended") for name in PMA_NAMES)


def test_ufm_telemetry_bad_lines_lose_only_themselves() -> None:
    good = 'PortXmitDataExtended{node_guid="1",port_num="1"} 5\n'
    body = (
        good
        + 'PortXmitDataExtended{node_guid="1",port_num="1"} 6\n'  # duplicate
        + 'PortRcvDataExtended{node_guid="1",port_num="1"} -1\n'
        + 'PortRcvDataExtended{node_guid="1",port_num="1"} 18446744073709551616\n'
        + 'PortRcvDataExtended{node_guid="zz",port_num="1"} 1\n'
        + 'Temperature{node_guid="1",port_num="1"} 40\n'
        + "garbage\n"
        + 'PortRcvPktsExtended{node_guid="1",port_num="1"} 7 x\n'
    )
    res = parse_ufm_telemetry(body, ts=1.0)
    assert res.rejected_by_reason() == {
        "duplicate_series": 1, "bad_value": 1, "out_of_range": 1, "missing_port": 1,
        "unknown_metric": 1, "malformed_line": 1, "bad_timestamp": 1,
    }  # fmt: skip
    [p] = res.ports
    assert p.counters == {"PortXmitData": 5} and p.node_guid == "0x0000000000000001"


# --- dcgmi dmon -------------------------------------------------------------------------------------
def test_dcgmi_dmon_profiling_columns_last_row_wins() -> None:
    res = parse_dcgmi_dmon((FIX / "dcgmi_dmon" / "gract_tenso_drama.txt").read_text(), host="n", ts=3.0)
    assert not res.rejected and res.error is None
    by_key = {s.key: s for s in res.samples}
    assert by_key["n/gpu0"].fields == {
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.12,
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.05,
        "DCGM_FI_PROF_DRAM_ACTIVE": 0.01,
    }
    assert by_key["n/gpu1"].fields["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == 0.984
    assert by_key["n/gpu2"].fields == {} and by_key["n/gpu2"].invalid == {}  # N/A: absent
    assert all(s.source == "dcgmi" and s.gpu_uuid is None for s in res.samples)


def test_dcgmi_dmon_partial_output_before_an_error_is_kept() -> None:
    text = (FIX / "dcgmi_dmon" / "power_temp_util.txt").read_text()
    res = parse_dcgmi_dmon(text, host="n", ts=3.0)
    assert [r.reason for r in res.rejected] == ["dcgmi_error"]
    a, b = res.samples
    assert a.fields == {
        "DCGM_FI_DEV_POWER_USAGE": 62.546,
        "DCGM_FI_DEV_GPU_TEMP": 33,
        "DCGM_FI_DEV_GPU_UTIL": 0,
        "DCGM_FI_DEV_FB_USED": 1023,
        "DCGM_FI_DEV_FB_FREE": 80137,
        "DCGM_FI_DEV_FB_USED_PERCENT": 1023 / (1023 + 80137),
    }
    assert b.fields["DCGM_FI_DEV_GPU_UTIL"] == 100


def test_dcgmi_dmon_field_ids_from_the_command_and_bad_rows() -> None:
    cmd = ["dcgmi", "dmon", "-e", "203,252", "-c", "1"]
    assert field_ids(cmd) == [203, 252] and field_ids(["dcgmi", "dmon"]) is None
    text = "#Entity  X  Y\nID\nGPU 0  5  10\nGPU 1  101  10\nGPU 2  5\nSwitch 0  1  1\nGPU 3  x  1\n"
    res = parse_dcgmi_dmon(text, host="n", ts=1.0, ids=field_ids(cmd))
    assert [r.reason for r in res.rejected] == ["out_of_range", "malformed_line", "unsupported_entity", "not_a_number"]
    by_key = {s.key: s for s in res.samples}
    assert by_key["n/gpu0"].fields == {"DCGM_FI_DEV_GPU_UTIL": 5, "DCGM_FI_DEV_FB_USED": 10}
    assert by_key["n/gpu1"].invalid == {"DCGM_FI_DEV_GPU_UTIL": "out_of_range"}


# --- ibstat -----------------------------------------------------------------------------------------
def test_ibstat_two_cas() -> None:
    res = parse_ibstat((FIX / "ibstat" / "two_cas.txt").read_text(), host="n1", ts=2.0)
    assert res.problems == [] and res.error is None
    hdr, down, fdr10 = res.ports
    assert (hdr.device, hdr.node_guid, hdr.port, hdr.state_id, hdr.state, hdr.phys_state_id, hdr.phys_state) == (
        "mlx5_0", "0x0c42a10300b0c3d4", 1, 4, "ACTIVE", 5, "LinkUp",
    )  # fmt: skip
    assert (hdr.rate_bytes_per_second, hdr.link_width, hdr.link_speed, hdr.link_layer) == (
        25_000_000_000, None, None, "InfiniBand",
    )  # fmt: skip
    assert (down.device, down.port, down.state_id, down.phys_state, down.rate_bytes_per_second) == (
        "mlx4_0", 1, 1, "Polling", 1_250_000_000,
    )  # fmt: skip
    assert (fdr10.port, fdr10.rate_bytes_per_second, fdr10.link_speed) == (2, 5_000_000_000, "FDR10")
    assert all(p.source == "ibstat" and p.counters == {} for p in res.ports)


def test_ibstat_partial_output_followed_by_an_error_keeps_what_was_read() -> None:
    res = parse_ibstat((FIX / "ibstat" / "partial_then_ibpanic.txt").read_text(), host="n1", ts=2.0)
    [p] = res.ports
    assert (p.device, p.port, p.state, p.rate_bytes_per_second) == ("mlx5_0", 1, "ACTIVE", 312_500_000)
    assert [(x.lineno, x.reason) for x in res.problems] == [(18, "unrecognised_line")]
    cut = parse_ibstat("CA 'mlx5_0'\n\tNode GUID: 0x1\n\tPort 1:\n\t\tState: Armed\n\t\tPhys", host="n", ts=1.0)
    [q] = cut.ports
    assert (q.state_id, q.phys_state_id, q.rate_bytes_per_second) == (3, None, None)
    assert [x.reason for x in cut.problems] == ["unrecognised_line"]


def test_ibstat_single_port_form_roce() -> None:
    res = parse_ibstat((FIX / "ibstat" / "one_port_roce.txt").read_text(), host="n1", ts=2.0)
    [p] = res.ports
    assert (p.device, p.port, p.link_layer, p.node_guid, p.rate_bytes_per_second) == (
        "mlx5_2", 1, "Ethernet", "0x0e42a1fffe5c6d7e", 12_500_000_000,
    )  # fmt: skip
    assert parse_ibstat("  \n", host="n", ts=1.0).error == "empty_output"


# --- link width and speed ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100 Gb/sec (4X EDR)", ("4X", "EDR")),
        ("200 Gb/sec (2X NDR)", ("2X", "NDR")),
        ("40 Gb/sec (4X FDR10)", ("4X", "FDR10")),
        ("10 Gb/sec (4X)", ("4X", None)),
        ("2.5 Gb/sec (1X SDR)", ("1X", "SDR")),
        ("0 GB/sec", (None, None)),
        ("100 Gb/sec (4X ???)", ("4X", None)),
        ("100 Gb/sec (3X EDR)", (None, "EDR")),
    ],
)
def test_rate_width_speed(text: str, expected: tuple[str | None, str | None]) -> None:
    assert rate_width_speed(text) == expected


def test_link_width_speed_normalises_ibnetdiscover_spelling() -> None:
    assert link_width_speed("4x", "HDR") == ("4X", "HDR")
    assert link_width_speed("12x", "???") == ("12X", None)
    assert link_width_speed(None, None) == (None, None)


def test_sysfs_port_has_width_and_speed(tmp_path: Path) -> None:
    port = tmp_path / "sys/class/infiniband/mlx5_0/ports/1"
    port.mkdir(parents=True)
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (port / "state").write_text("4: ACTIVE\n")
    [p] = read_sysfs_infiniband(tmp_path / "sys", "h", 1.0).ports
    assert (p.rate_bytes_per_second, p.link_width, p.link_speed) == (25_000_000_000, "4X", "HDR")


def test_perfquery_port_has_width_and_speed_from_ibnetdiscover() -> None:
    topo = parse_ibnetdiscover(
        "SW     5  1 0x0002c90300a00002 4x EDR - CA     3  1 0x0002c90300b00001 ( 'leaf-1' - 'node001 mlx5_0' )\n"
        "SW     5  2 0x0002c90300a00002 4x ???                                  'leaf-1'\n"
    )
    node = topo.nodes()["0x0002c90300a00002"]
    up, down = port_sample(node, 1, [], ts=1.0), port_sample(node, 2, [], ts=1.0)
    assert (up.link_width, up.link_speed, up.rate_bytes_per_second) == ("4X", "EDR", 12_500_000_000)
    assert (down.link_width, down.link_speed) == (None, None)
