"""collectors.nvsmi: ``nvidia-smi -q -x`` documents (schema v11–v13) → GpuSample with DCGM field
names, checked value by value against every file in ../shared/data/telemetry/nvidia_smi_xml
(values read from the files by hand), the value-level faults by kind, and the async runner
(missing binary, timeout, failing command, bad output)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from collectors.cli import app as cli_app
from collectors.nvsmi import DEVICE_LEVEL_FIELDS, parse_nvidia_smi_xml, read_nvidia_smi
from collectors.service import CollectorService
from contracts import KafkaTopics, decode_gpu_samples
from contracts.bus import MemoryBus

XML_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "telemetry" / "nvidia_smi_xml"
TS = 1_712_744_581.0


def _parse(name: str, host: str = "node-1"):  # type: ignore[no-untyped-def]
    return parse_nvidia_smi_xml((XML_DIR / name).read_bytes(), host=host, ts=TS, target=name)


def _metric(svc: CollectorService, name: str, **labels: str) -> float:
    """A sample of ``svc``'s Prometheus registry (0 if absent)."""
    return svc.registry.get_sample_value(name, labels) or 0.0


def test_every_sample_file_is_covered() -> None:
    assert sorted(p.name for p in XML_DIR.glob("*.xml")) == [
        "a100-sxm4-v12.xml",
        "a10g.xml",
        "rtx-3080-v13.xml",
        "tesla-t4.xml",
    ]


def test_tesla_t4_v11() -> None:
    res = _parse("tesla-t4.xml")
    assert (res.error, res.rejected, res.driver_version) == (None, [], "515.105.01")
    [s] = res.samples
    assert s.key == "node-1/GPU-d37e67a5-91dd-3774-a5cb-99096249601a"
    assert (s.gpu_index, s.gpu_instance_id, s.model_name) == (0, None, "Tesla T4")
    assert (s.source, s.target, s.ts, s.seq) == ("nvidia-smi", "tesla-t4.xml", TS, 0)
    assert s.attributes == {"pci_bus_id": "00000000:00:1E.0"}
    assert s.invalid == {}
    assert s.fields == {
        "DCGM_FI_DEV_GPU_UTIL": 0,
        "DCGM_FI_DEV_MEM_COPY_UTIL": 0,
        "DCGM_FI_DEV_ENC_UTIL": 0,
        "DCGM_FI_DEV_DEC_UTIL": 0,
        "DCGM_FI_DEV_FB_TOTAL": 15360,
        "DCGM_FI_DEV_FB_RESERVED": 388,
        "DCGM_FI_DEV_FB_USED": 1032,
        "DCGM_FI_DEV_FB_FREE": 13939,
        "DCGM_FI_DEV_FB_USED_PERCENT": 1032 / (1032 + 13939),  # derived: Used/(Total - Reserved)
        "DCGM_FI_DEV_BAR1_TOTAL": 256,
        "DCGM_FI_DEV_BAR1_USED": 5,
        "DCGM_FI_DEV_BAR1_FREE": 251,
        "DCGM_FI_DEV_GPU_TEMP": 40,  # memory_temp and its threshold are N/A: absent
        "DCGM_FI_DEV_SHUTDOWN_TEMP": 96,
        "DCGM_FI_DEV_SLOWDOWN_TEMP": 93,
        "DCGM_FI_DEV_GPU_MAX_OP_TEMP": 85,
        "DCGM_FI_DEV_POWER_USAGE": 26.78,  # v11 power_readings/power_draw
        "DCGM_FI_DEV_POWER_MGMT_LIMIT": 70.0,  # power_limit
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": 70.0,
        "DCGM_FI_DEV_POWER_MGMT_LIMIT_DEF": 70.0,
        "DCGM_FI_DEV_POWER_MGMT_LIMIT_MIN": 60.0,
        "DCGM_FI_DEV_POWER_MGMT_LIMIT_MAX": 70.0,
        "DCGM_FI_DEV_SM_CLOCK": 585,
        "DCGM_FI_DEV_MEM_CLOCK": 5000,
        "DCGM_FI_DEV_VIDEO_CLOCK": 810,
        "DCGM_FI_DEV_APP_SM_CLOCK": 585,
        "DCGM_FI_DEV_APP_MEM_CLOCK": 5001,
        "DCGM_FI_DEV_MAX_SM_CLOCK": 1590,
        "DCGM_FI_DEV_MAX_MEM_CLOCK": 5001,
        "DCGM_FI_DEV_MAX_VIDEO_CLOCK": 1470,
        "DCGM_FI_DEV_PCIE_LINK_GEN": 3,
        "DCGM_FI_DEV_PCIE_MAX_LINK_GEN": 3,
        "DCGM_FI_DEV_PCIE_LINK_WIDTH": 8,
        "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH": 16,
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0,
        "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": 0,
        "DCGM_FI_DEV_PCIE_RX_THROUGHPUT": 0,
        "DCGM_FI_DEV_PSTATE": 0,  # fan_speed N/A: absent
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0,  # v11 clocks_throttle_reasons, none active
        "DCGM_FI_DEV_RETIRED_SBE": 0,
        "DCGM_FI_DEV_RETIRED_DBE": 0,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 0,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 0,
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": 0,
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": 0,
    }  # remapped_rows N/A: absent
    assert type(s.fields["DCGM_FI_DEV_FB_USED"]) is int


def test_a10g_v11_idle_with_remapped_rows() -> None:
    res = _parse("a10g.xml")
    [s] = res.samples
    assert res.rejected == [] and s.invalid == {}
    assert s.key == "node-1/GPU-9a9a6c50-2a47-2f51-a902-b82c3b127e94"
    assert s.model_name == "NVIDIA A10G"
    f = s.fields
    assert (f["DCGM_FI_DEV_GPU_UTIL"], f["DCGM_FI_DEV_MEM_COPY_UTIL"]) == (0, 0)
    assert (f["DCGM_FI_DEV_FB_TOTAL"], f["DCGM_FI_DEV_FB_RESERVED"]) == (23028, 435)
    assert (f["DCGM_FI_DEV_FB_USED"], f["DCGM_FI_DEV_FB_FREE"]) == (22, 22569)
    assert (f["DCGM_FI_DEV_BAR1_TOTAL"], f["DCGM_FI_DEV_BAR1_USED"], f["DCGM_FI_DEV_BAR1_FREE"]) == (
        32768,
        1,
        32767,
    )
    assert f["DCGM_FI_DEV_POWER_USAGE"] == 25.58
    assert f["DCGM_FI_DEV_POWER_MGMT_LIMIT_MIN"] == 100.0 and f["DCGM_FI_DEV_POWER_MGMT_LIMIT"] == 300.0
    assert (f["DCGM_FI_DEV_GPU_TEMP"], f["DCGM_FI_DEV_GPU_MAX_OP_TEMP"]) == (17, 88)
    assert (f["DCGM_FI_DEV_SM_CLOCK"], f["DCGM_FI_DEV_MEM_CLOCK"], f["DCGM_FI_DEV_VIDEO_CLOCK"]) == (
        210,
        405,
        555,
    )
    assert (f["DCGM_FI_DEV_PCIE_LINK_GEN"], f["DCGM_FI_DEV_PCIE_MAX_LINK_GEN"]) == (1, 4)
    assert f["DCGM_FI_DEV_FAN_SPEED"] == 0
    assert f["DCGM_FI_DEV_PSTATE"] == 8
    assert f["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"] == 0x1  # clocks_throttle_reason_gpu_idle Active
    assert f["DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"] == 0
    assert f["DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"] == 0
    assert f["DCGM_FI_DEV_ROW_REMAP_PENDING"] == 0 and f["DCGM_FI_DEV_ROW_REMAP_FAILURE"] == 0
    assert "DCGM_FI_DEV_RETIRED_SBE" not in f and "DCGM_FI_DEV_RETIRED_SBE" not in s.invalid  # N/A


def test_rtx_3080_v13_average_and_instant_power_and_deprecated_fields() -> None:
    res = _parse("rtx-3080-v13.xml")
    [s] = res.samples
    assert res.rejected == [] and s.invalid == {} and res.driver_version == "595.58.03"
    assert s.key == "node-1/GPU-19d6d965-2acc-f646-00f8-4c76979aabb4"
    assert s.model_name == "NVIDIA GeForce RTX 3080"
    f = s.fields
    assert (f["DCGM_FI_DEV_GPU_UTIL"], f["DCGM_FI_DEV_MEM_COPY_UTIL"]) == (65, 9)
    assert (f["DCGM_FI_DEV_FB_TOTAL"], f["DCGM_FI_DEV_FB_RESERVED"]) == (10240, 397)
    assert (f["DCGM_FI_DEV_FB_USED"], f["DCGM_FI_DEV_FB_FREE"]) == (9184, 660)
    assert f["DCGM_FI_DEV_POWER_USAGE"] == 139.62  # gpu_power_readings/average_power_draw
    assert f["DCGM_FI_DEV_POWER_USAGE_INSTANT"] == 142.33
    assert f["DCGM_FI_DEV_POWER_MGMT_LIMIT_MAX"] == 336.0
    assert (f["DCGM_FI_DEV_PCIE_TX_THROUGHPUT"], f["DCGM_FI_DEV_PCIE_RX_THROUGHPUT"]) == (1066699, 14742333)
    assert (f["DCGM_FI_DEV_SM_CLOCK"], f["DCGM_FI_DEV_MEM_CLOCK"]) == (1950, 9251)
    assert (f["DCGM_FI_DEV_MAX_SM_CLOCK"], f["DCGM_FI_DEV_MAX_MEM_CLOCK"]) == (2100, 9501)
    assert f["DCGM_FI_DEV_PSTATE"] == 2
    assert f["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"] == 0
    # "Requested functionality has been deprecated" (applications clocks) and N/A (ECC): absent.
    for gone in (
        "DCGM_FI_DEV_APP_SM_CLOCK",
        "DCGM_FI_DEV_APP_MEM_CLOCK",
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "DCGM_FI_DEV_MEMORY_TEMP",
        "DCGM_FI_DEV_GPU_TEMP_LIMIT",
    ):
        assert gone not in f and gone not in s.invalid


def test_a100_v12_mig_instances_are_gpus_of_their_own() -> None:
    res = _parse("a100-sxm4-v12.xml", host="dgx-7")
    assert res.error is None and res.rejected == []
    uuid = "GPU-513536b6-7d19-9063-b049-1e69664bb298"
    assert [s.key for s in res.samples] == [f"dgx-7/{uuid}/{gi}" for gi in (3, 4, 5, 6)]
    assert [s.seq for s in res.samples] == [0, 1, 2, 3]
    for s in res.samples:
        assert (s.gpu_uuid, s.gpu_index, s.model_name) == (uuid, 1, "NVIDIA A100-SXM4-80GB")
        assert s.invalid == {}
        f = s.fields
        # the instance's own memory, not the GPU's 81920 MiB
        assert (f["DCGM_FI_DEV_FB_TOTAL"], f["DCGM_FI_DEV_FB_USED"], f["DCGM_FI_DEV_FB_FREE"]) == (
            19968,
            12,
            19955,
        )
        assert f["DCGM_FI_DEV_FB_RESERVED"] == 0
        assert (f["DCGM_FI_DEV_BAR1_TOTAL"], f["DCGM_FI_DEV_BAR1_USED"]) == (32767, 0)
        # GPU-level values repeated as read (gpu_power_readings, v12), never divided
        assert f["DCGM_FI_DEV_POWER_USAGE"] == 67.03
        assert (f["DCGM_FI_DEV_GPU_TEMP"], f["DCGM_FI_DEV_MEMORY_TEMP"]) == (27, 44)
        assert (f["DCGM_FI_DEV_SHUTDOWN_TEMP"], f["DCGM_FI_DEV_MEM_MAX_OP_TEMP"]) == (92, 95)
        assert (f["DCGM_FI_DEV_SM_CLOCK"], f["DCGM_FI_DEV_MEM_CLOCK"]) == (1275, 1593)
        assert f["DCGM_FI_DEV_ENFORCED_POWER_LIMIT"] == 500.0
        assert f["DCGM_FI_DEV_PCIE_TX_THROUGHPUT"] == 4000
        assert f["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] == 0
        # utilisation is N/A under MIG: absent, so analytics calls the instance unknown, not idle
        assert "DCGM_FI_DEV_GPU_UTIL" not in f
        assert {
            k for k in f if not k.startswith(("DCGM_FI_DEV_FB_", "DCGM_FI_DEV_BAR1_"))
        } <= DEVICE_LEVEL_FIELDS


def test_sequence_numbers_continue_from_seq_start() -> None:
    res = parse_nvidia_smi_xml((XML_DIR / "a100-sxm4-v12.xml").read_text(), host="h", ts=1.0, seq_start=41)
    assert [s.seq for s in res.samples] == [41, 42, 43, 44]


# --- faults, by kind ---------------------------------------------------------------------------------
def _doc(*gpus: str) -> str:
    return (
        '<?xml version="1.0" ?>\n<nvidia_smi_log><driver_version>550.1</driver_version>'
        + "".join(gpus)
        + ("</nvidia_smi_log>")
    )


def _gpu(uuid: str = "GPU-0000aaaa", body: str = "", mig: str = "") -> str:
    return (
        f'<gpu id="00000000:07:00.0"><product_name>NVIDIA H100 80GB HBM3</product_name>{mig}'
        f"<uuid>{uuid}</uuid><minor_number>2</minor_number>{body}</gpu>"
    )


@pytest.mark.parametrize(
    ("text", "field", "value", "reason"),
    [
        ("45 %", "DCGM_FI_DEV_GPU_UTIL", 45, None),
        ("[N/A]", "DCGM_FI_DEV_GPU_UTIL", None, None),
        ("N/A", "DCGM_FI_DEV_GPU_UTIL", None, None),
        ("[Not Supported]", "DCGM_FI_DEV_GPU_UTIL", None, None),
        ("Requested functionality has been deprecated", "DCGM_FI_DEV_GPU_UTIL", None, None),
        ("Unknown Error", "DCGM_FI_DEV_GPU_UTIL", None, "unknown_error"),
        ("[Unknown Error]", "DCGM_FI_DEV_GPU_UTIL", None, "unknown_error"),
        ("[Insufficient Permissions]", "DCGM_FI_DEV_GPU_UTIL", None, "no_permission"),
        ("[GPU requires reset]", "DCGM_FI_DEV_GPU_UTIL", None, "gpu_lost"),
        ("GPU is lost", "DCGM_FI_DEV_GPU_UTIL", None, "gpu_lost"),
        ("4294967295 %", "DCGM_FI_DEV_GPU_UTIL", None, "out_of_range"),
        ("45 MiB", "DCGM_FI_DEV_GPU_UTIL", None, "not_a_number"),  # wrong unit
        ("45", "DCGM_FI_DEV_GPU_UTIL", None, "not_a_number"),  # no unit
        ("lots %", "DCGM_FI_DEV_GPU_UTIL", None, "not_a_number"),
        ("-3 %", "DCGM_FI_DEV_GPU_UTIL", None, "out_of_range"),
    ],
)
def test_value_texts_by_kind(text: str, field: str, value: int | None, reason: str | None) -> None:
    res = parse_nvidia_smi_xml(
        _doc(_gpu(body=f"<utilization><gpu_util>{text}</gpu_util></utilization>")), host="h", ts=1.0
    )
    [s] = res.samples
    assert s.fields.get(field) == value
    assert s.invalid.get(field) == reason
    assert [(r.reason, r.metric) for r in res.rejected] == ([(reason, field)] if reason else [])


def test_other_units_pstate_and_yes_no() -> None:
    body = (
        "<performance_state>P12</performance_state><fan_speed>37 %</fan_speed>"
        "<temperature><gpu_temp>1000 C</gpu_temp><gpu_temp_tlimit>-4 C</gpu_temp_tlimit></temperature>"
        "<remapped_rows><remapped_row_pending>Yes</remapped_row_pending>"
        "<remapped_row_failure>Maybe</remapped_row_failure></remapped_rows>"
        "<pci><pci_gpu_link_info><link_widths><current_link_width>16</current_link_width>"
        "</link_widths></pci_gpu_link_info></pci>"
    )
    [s] = parse_nvidia_smi_xml(_doc(_gpu(body=body)), host="h", ts=1.0).samples
    assert s.fields == {
        "DCGM_FI_DEV_PSTATE": 12,
        "DCGM_FI_DEV_FAN_SPEED": 37,
        "DCGM_FI_DEV_GPU_TEMP_LIMIT": -4,
        "DCGM_FI_DEV_ROW_REMAP_PENDING": 1,
    }
    assert s.invalid == {
        "DCGM_FI_DEV_GPU_TEMP": "out_of_range",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": "not_a_number",
        "DCGM_FI_DEV_PCIE_LINK_WIDTH": "not_a_number",  # "16" without its "x"
    }


def test_clock_event_reasons_mask_and_failures() -> None:
    reasons = (
        "<clocks_event_reasons><clocks_event_reason_gpu_idle>Not Active</clocks_event_reason_gpu_idle>"
        "<clocks_event_reason_sw_power_cap>Active</clocks_event_reason_sw_power_cap>"
        "<clocks_event_reason_hw_thermal_slowdown>Active</clocks_event_reason_hw_thermal_slowdown>"
        "</clocks_event_reasons>"
    )
    [s] = parse_nvidia_smi_xml(_doc(_gpu(body=reasons)), host="h", ts=1.0).samples
    assert s.fields["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"] == 0x4 | 0x40
    bad = reasons.replace(
        "<clocks_event_reason_sw_power_cap>Active", "<clocks_event_reason_sw_power_cap>[Unknown Error]"
    )
    [s] = parse_nvidia_smi_xml(_doc(_gpu(body=bad)), host="h", ts=1.0).samples
    assert s.invalid == {"DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "unknown_error"}
    num = reasons.replace("<clocks_event_reason_sw_power_cap>Active", "<clocks_event_reason_sw_power_cap>5")
    [s] = parse_nvidia_smi_xml(_doc(_gpu(body=num)), host="h", ts=1.0).samples
    assert s.invalid == {"DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "not_a_number"}
    na = reasons.replace("<clocks_event_reason_sw_power_cap>Active", "<clocks_event_reason_sw_power_cap>N/A")
    [s] = parse_nvidia_smi_xml(_doc(_gpu(body=na)), host="h", ts=1.0).samples
    assert "DCGM_FI_DEV_CLOCKS_EVENT_REASONS" not in s.fields | s.invalid


def test_ecc_totals_sum_sram_and_dram_and_v13_split_sram() -> None:
    v13 = (
        "<ecc_errors><volatile><sram_correctable>3</sram_correctable>"
        "<sram_uncorrectable_parity>1</sram_uncorrectable_parity>"
        "<sram_uncorrectable_secded>2</sram_uncorrectable_secded>"
        "<dram_correctable>40</dram_correctable><dram_uncorrectable>5</dram_uncorrectable></volatile>"
        "<aggregate><sram_correctable>7</sram_correctable><sram_uncorrectable>N/A</sram_uncorrectable>"
        "<dram_correctable>Unknown Error</dram_correctable><dram_uncorrectable>0</dram_uncorrectable>"
        "</aggregate></ecc_errors>"
    )
    [s] = parse_nvidia_smi_xml(_doc(_gpu(body=v13)), host="h", ts=1.0).samples
    assert s.fields["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"] == 43
    assert s.fields["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] == 8
    assert s.invalid == {"DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "unknown_error"}
    assert "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL" not in s.fields  # a part is N/A: the total is unknown


def test_bad_gpu_is_rejected_alone() -> None:
    doc = _doc(
        _gpu(uuid="N/A"), _gpu(uuid="GPU-bbbb", body="<fb_memory_usage><used>5 MiB</used></fb_memory_usage>")
    )
    res = parse_nvidia_smi_xml(doc, host="h", ts=1.0)
    assert [s.gpu_uuid for s in res.samples] == ["GPU-bbbb"]
    assert res.samples[0].fields == {"DCGM_FI_DEV_FB_USED": 5}
    assert res.samples[0].gpu_index == 2
    assert [r.reason for r in res.rejected] == ["missing_uuid"]


def test_mig_edge_cases() -> None:
    on = "<mig_mode><current_mig>Enabled</current_mig></mig_mode>"
    fb = "<fb_memory_usage><total>{} MiB</total><used>{} MiB</used></fb_memory_usage>"

    def mig(index: int, gi: str, ci: int, total: int, used: int) -> str:
        return (
            f"<mig_device><index>{index}</index><gpu_instance_id>{gi}</gpu_instance_id>"
            f"<compute_instance_id>{ci}</compute_instance_id>{fb.format(total, used)}</mig_device>"
        )

    devs = (
        "<mig_devices>"
        + mig(0, "2", 0, 40192, 100)
        + mig(1, "2", 1, 40192, 100)
        + mig(2, "N/A", 0, 1, 1)
        + mig(3, "9", 0, 9728, 0)
        + "</mig_devices>"
    )
    gpu_fb = fb.format(81920, 300)
    res = parse_nvidia_smi_xml(_doc(_gpu(mig=on + devs, body=gpu_fb)), host="h", ts=1.0)
    assert [
        (s.gpu_instance_id, s.fields["DCGM_FI_DEV_FB_TOTAL"], s.fields["DCGM_FI_DEV_FB_USED"])
        for s in res.samples
    ] == [
        (2, 40192, 100),  # two compute instances of GI 2: one GPU
        (9, 9728, 0),
    ]
    assert [r.reason for r in res.rejected] == ["bad_gpu_instance_id"]
    # MIG enabled but no instances created: the whole GPU, with its own memory.
    [whole] = parse_nvidia_smi_xml(
        _doc(_gpu(mig=on + "<mig_devices>None</mig_devices>", body=gpu_fb)), host="h", ts=1.0
    ).samples
    assert whole.gpu_instance_id is None and whole.fields["DCGM_FI_DEV_FB_TOTAL"] == 81920
    # mig_devices listed while MIG is disabled (pending change): ignored.
    off = on.replace("Enabled", "Disabled")
    [whole] = parse_nvidia_smi_xml(_doc(_gpu(mig=off + devs, body=gpu_fb)), host="h", ts=1.0).samples
    assert whole.gpu_instance_id is None


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ("", "malformed_xml"),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", "malformed_xml"),
        (_doc(_gpu())[:-30], "malformed_xml"),  # cut off
        ("<html><body>nope</body></html>", "not_nvidia_smi"),
    ],
)
def test_unusable_documents(doc: str, error: str) -> None:
    res = parse_nvidia_smi_xml(doc, host="h", ts=1.0)
    assert res.error == error and res.samples == [] and res.detail


def test_no_gpu_document_is_empty_not_an_error() -> None:
    res = parse_nvidia_smi_xml(_doc(), host="h", ts=1.0)
    assert (res.error, res.samples, res.rejected) == (None, [], [])


# --- the runner ---------------------------------------------------------------------------------------
async def test_runner_reads_a_command_output_and_counts_success() -> None:
    cmd = [
        sys.executable,
        "-c",
        f"import sys; sys.stdout.buffer.write(open({str(XML_DIR / 'tesla-t4.xml')!r}, 'rb').read())",
    ]
    res = await read_nvidia_smi(cmd, 10.0, host="gpu-host", ts=42.0, seq_start=5)
    assert res.reason == "ok" and res.returncode == 0
    [s] = res.samples
    assert (s.key, s.ts, s.seq) == ("gpu-host/GPU-d37e67a5-91dd-3774-a5cb-99096249601a", 42.0, 5)
    assert s.fields["DCGM_FI_DEV_FB_USED"] == 1032
    assert s.target == shlex.join(cmd)  # the shell-quoted command line, also the metric's target label


async def test_missing_binary_is_no_data_and_counted() -> None:
    cmd = ["/nonexistent/nvidia-smi", "-q", "-x"]
    res = await read_nvidia_smi(cmd, 5.0, host="h")
    assert (res.reason, res.samples) == ("binary_not_found", [])
    res = await read_nvidia_smi(["gpupool-no-such-nvidia-smi"], 5.0)
    assert res.reason == "binary_not_found"


async def test_hung_command_is_killed_at_the_timeout() -> None:
    res = await read_nvidia_smi([sys.executable, "-c", "import time; time.sleep(30)"], 0.3, host="h")
    assert res.reason == "timeout" and res.samples == []
    assert res.duration_s < 5


async def test_failing_command_and_garbage_output() -> None:
    msg = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    res = await read_nvidia_smi([sys.executable, "-c", f"print({msg!r}); raise SystemExit(9)"], 5.0, host="h")
    assert (res.reason, res.returncode, res.samples) == ("exit_status", 9, [])
    assert "couldn't communicate" in res.detail
    res = await read_nvidia_smi([sys.executable, "-c", "print('<nvidia_smi_log><gpu>')"], 5.0, host="h")
    assert res.reason == "malformed_xml" and res.samples == []


async def test_runner_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        await read_nvidia_smi([], 1.0)
    with pytest.raises(ValueError):
        await read_nvidia_smi(["nvidia-smi"], 0)


# --- the collector service with nvidia-smi and NVML sources -------------------------------------------
async def test_collector_service_produces_nvsmi_gpus_and_counts_missing_sources() -> None:
    topics = KafkaTopics(prefix="nvsmi.")
    bus = MemoryBus()
    cat = [
        sys.executable,
        "-c",
        f"import sys; sys.stdout.buffer.write(open({str(XML_DIR / 'a100-sxm4-v12.xml')!r}, 'rb').read())",
    ]
    svc = CollectorService(
        bus=bus,
        topics=topics,
        dcgm_targets=[],
        sysfs_roots=[],
        timeout_s=10.0,
        nvsmi_commands=[("dgx-1", cat), ("dgx-2", ["/nonexistent/nvidia-smi", "-q", "-x"])],
        nvml_host="dgx-1",  # no NVML library on this machine: a counted failure each cycle
    )
    await svc.start()
    try:
        first = await svc.collect_once()
        second = await svc.collect_once()
    finally:
        await svc.stop()
    assert (first.targets, first.targets_ok, first.gpu_samples, first.produced) == (3, 1, 4, 1)  # one record per read
    assert first.failures == {"binary_not_found": 1, "library_not_found": 1}
    assert second.failures == first.failures
    assert _metric(svc, "gpupool_collector_scrape_errors_total", target="nvml", reason="library_not_found") == 2
    missing = " ".join(["/nonexistent/nvidia-smi", "-q", "-x"])
    assert _metric(svc, "gpupool_collector_scrape_errors_total", target=missing, reason="binary_not_found") == 2
    assert _metric(svc, "gpupool_collector_scrapes_total", target=shlex.join(cat), result="success") == 2
    assert _metric(svc, "gpupool_collector_scrapes_total", target="nvml", result="failure") == 2
    got = [(m.key, s) for m in bus.records(topics.telemetry_gpu) if m.value for s in decode_gpu_samples(m.value)]
    assert [s.key for _, s in got[:4]] == [
        f"dgx-1/GPU-513536b6-7d19-9063-b049-1e69664bb298/{gi}" for gi in (3, 4, 5, 6)
    ]
    assert all(k == s.partition_key == s.host and s.source == "nvidia-smi" for k, s in got)
    assert [s.seq for _, s in got] == list(range(8)) and svc.seq == 8


def test_cli_run_accepts_nvidia_smi_and_nvml_sources_only() -> None:
    runner = CliRunner()
    res = runner.invoke(cli_app, ["run", "--kafka", "127.0.0.1:1", "--nvidia-smi", "no-equals"])
    assert res.exit_code == 2 and "HOST=COMMAND" in res.output
    res = runner.invoke(cli_app, ["run", "--kafka", "127.0.0.1:1"])
    assert res.exit_code == 2 and "--nvidia-smi" in res.output


# --- fuzz: mutated real documents never raise, every rejection has a known reason ---------------------
_REASONS = {
    "unknown_error",
    "no_permission",
    "gpu_lost",
    "not_a_number",
    "out_of_range",
    "missing_uuid",
    "bad_gpu_instance_id",
}
_DOCS = [p.read_bytes() for p in sorted(XML_DIR.glob("*.xml"))]
_VALUE_TEXT = re.compile(rb">([^<>\n]{1,60})</")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    doc=st.sampled_from(_DOCS),
    cuts=st.lists(st.tuples(st.integers(0, 50_000), st.integers(0, 200)), max_size=3),
    values=st.lists(
        st.tuples(
            st.integers(0, 400),
            st.one_of(
                st.sampled_from(["N/A", "[N/A]", "Unknown Error", "-1 %", "1e9 W", "P99", "16", "Yes", ""]),
                st.text(max_size=12).filter(lambda t: "<" not in t and "&" not in t),
            ),
        ),
        max_size=8,
    ),
)
def test_fuzzed_documents_never_raise(
    doc: bytes, cuts: list[tuple[int, int]], values: list[tuple[int, str]]
) -> None:
    slots = list(_VALUE_TEXT.finditer(doc))
    replaced = {i % len(slots): text.encode() for i, text in values}
    out, last = bytearray(), 0
    for i, m in enumerate(slots):
        if i in replaced:
            out += doc[last : m.start(1)] + replaced[i]
            last = m.end(1)
    out += doc[last:]
    for start, length in cuts:  # cut slices out: truncated or broken XML
        del out[start : start + length]
    res = parse_nvidia_smi_xml(bytes(out), host="h", ts=1.0)
    assert res.error in (None, "malformed_xml", "not_nvidia_smi")
    assert {r.reason for r in res.rejected} <= _REASONS
    for s in res.samples:
        assert set(s.invalid.values()) <= _REASONS
        assert not set(s.invalid) & set(s.fields)
        assert s.source == "nvidia-smi" and s.gpu_uuid.startswith("GPU-")
