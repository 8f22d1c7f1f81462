"""collectors.nvml: the availability check for real (no NVIDIA driver here), and the NVML → DCGM
field mapping against an in-process stand-in of the pynvml function surface.

The stand-in reuses pynvml's own ``NVMLError`` classes and constants (the module imports without
the driver); only the device functions are fakes. Nothing here ran on a real GPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from collectors.nvml import NvmlReader, NvmlUnavailableError, nvml_available, read_nvml
from collectors.nvsmi import DEVICE_LEVEL_FIELDS

MIB = 1 << 20
E = pynvml.NVMLError


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    minor: int = 0
    bus_id: str = "00000000:18:00.0"
    util: tuple[int, int] = (37, 12)
    mem: tuple[int, int, int, int] = (
        81559 * MIB,
        1024 * MIB,
        79935 * MIB,
        600 * MIB,
    )  # total used free reserved
    power_mw: int = 312_457
    temp: int = 41
    mig: list[FakeMig] | None = None
    errors: dict[str, int] = field(default_factory=dict)  # function name → NVML error code


@dataclass
class FakeMig:
    gi: int
    ci: int
    name: str
    mem: tuple[int, int, int, int]


class FakeNvml:
    """The subset of pynvml that collectors.nvml calls; each device a FakeGpu."""

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None, count_error: int | None = None):
        self.gpus = gpus
        self.init_error = init_error
        self.count_error = count_error
        self.inits = 0
        self.shutdowns = 0
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlMemory_v")):
                setattr(self, name, getattr(pynvml, name))
        self.NVMLError = pynvml.NVMLError

    # session
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise E(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise E(self.count_error)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        return self.gpus[i]

    def _check(self, h: Any, fn: str) -> None:
        code = getattr(h, "errors", {}).get(fn)
        if code is not None:
            raise E(code)

    # identity
    def nvmlDeviceGetUUID(self, h: Any) -> str:
        self._check(h, "uuid")
        return h.uuid

    def nvmlDeviceGetName(self, h: Any) -> bytes:
        return h.name.encode()  # old pynvml returned bytes: both must work

    def nvmlDeviceGetMinorNumber(self, h: FakeGpu) -> int:
        return h.minor

    def nvmlDeviceGetPciInfo(self, h: FakeGpu) -> Any:
        return SimpleNamespace(busId=h.bus_id.encode())

    # values
    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        if isinstance(h, FakeMig):
            raise E(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._check(h, "util")
        return SimpleNamespace(gpu=h.util[0], memory=h.util[1])

    def nvmlDeviceGetEncoderUtilization(self, h: Any) -> list[int]:
        if isinstance(h, FakeMig):
            raise E(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [3, 167000]

    def nvmlDeviceGetDecoderUtilization(self, h: Any) -> list[int]:
        if isinstance(h, FakeMig):
            raise E(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [0, 167000]

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: int | None = None) -> Any:
        total, used, free, reserved = h.mem
        if version is None:
            return SimpleNamespace(total=total, used=used + reserved, free=free)
        assert version == pynvml.nvmlMemory_v2
        return SimpleNamespace(total=total, used=used, free=free, reserved=reserved)

    def nvmlDeviceGetBAR1MemoryInfo(self, h: Any) -> Any:
        if isinstance(h, FakeMig):
            raise E(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(bar1Total=131072 * MIB, bar1Used=3 * MIB, bar1Free=131069 * MIB)

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        self._check(h, "power")
        return h.power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeGpu) -> int:
        return 9_876_543_210_123  # mJ: an int that must stay an int

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        self._check(h, "temp")
        return h.temp

    def nvmlDeviceGetTemperatureThreshold(self, h: FakeGpu, kind: int) -> int:
        return {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: 92,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 89,
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: 87,
            pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: 95,
        }[kind]

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, kind: int) -> int:
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619, pynvml.NVML_CLOCK_VIDEO: 1545}[kind]

    def nvmlDeviceGetMaxClockInfo(self, h: FakeGpu, kind: int) -> int:
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619, pynvml.NVML_CLOCK_VIDEO: 1545}[kind]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: FakeGpu) -> int:
        return 5

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: FakeGpu) -> int:
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: FakeGpu) -> int:
        return 16

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: FakeGpu) -> int:
        return 16

    def nvmlDeviceGetPcieReplayCounter(self, h: FakeGpu) -> int:
        return 2

    def nvmlDeviceGetPcieThroughput(self, h: FakeGpu, counter: int) -> int:
        return 4000 if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else 125

    def nvmlDeviceGetFanSpeed(self, h: FakeGpu) -> int:
        raise E(pynvml.NVML_ERROR_NOT_SUPPORTED)  # passively cooled: no fan

    def nvmlDeviceGetPerformanceState(self, h: FakeGpu) -> int:
        return 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGpu) -> int:
        return 0x1 | 0x4

    def nvmlDeviceGetPowerManagementLimit(self, h: FakeGpu) -> int:
        return 700_000

    def nvmlDeviceGetEnforcedPowerLimit(self, h: FakeGpu) -> int:
        return 700_000

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: FakeGpu) -> int:
        return 700_000

    def nvmlDeviceGetPowerManagementLimitConstraints(self, h: FakeGpu) -> list[int]:
        return [200_000, 700_000]

    # MIG
    def nvmlDeviceGetMigMode(self, h: FakeGpu) -> list[int]:
        if h.mig is None:
            raise E(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeGpu) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeGpu, i: int) -> FakeMig:
        if h.mig is None or i >= len(h.mig):
            raise E(pynvml.NVML_ERROR_NOT_FOUND)
        return h.mig[i]

    def nvmlDeviceGetGpuInstanceId(self, mh: FakeMig) -> int:
        return mh.gi


# --- real library ----------------------------------------------------------------------------------
def test_nvml_is_unavailable_here_and_says_why() -> None:
    """No NVIDIA driver on this machine: pynvml raises NVMLError_LibraryNotFound inside."""
    assert nvml_available() is False
    with pytest.raises(NvmlUnavailableError) as info:
        read_nvml("node-1", 1.0)
    assert info.value.reason == "library_not_found"
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        pynvml.nvmlInit()


# --- mapping ----------------------------------------------------------------------------------------
def test_whole_gpu_maps_to_dcgm_fields_in_dcgm_units() -> None:
    fake = FakeNvml([FakeGpu("GPU-aaaaaaaa-0000-1111-2222-333333333333", minor=3)])
    assert nvml_available(fake) is True
    assert fake.inits == 1 and fake.shutdowns == 1
    [s] = read_nvml("node-1", 1700000000.5, nvml=fake, seq_start=10)
    assert s.key == "node-1/GPU-aaaaaaaa-0000-1111-2222-333333333333"
    assert (s.source, s.target, s.seq, s.ts) == ("nvml", "nvml", 10, 1700000000.5)
    assert s.gpu_index == 3 and s.model_name == "NVIDIA H100 80GB HBM3"
    assert s.attributes == {"pci_bus_id": "00000000:18:00.0"}
    assert s.gpu_instance_id is None
    assert s.fields == {
        "DCGM_FI_DEV_GPU_UTIL": 37,
        "DCGM_FI_DEV_MEM_COPY_UTIL": 12,
        "DCGM_FI_DEV_ENC_UTIL": 3,
        "DCGM_FI_DEV_DEC_UTIL": 0,
        "DCGM_FI_DEV_FB_TOTAL": 81559,
        "DCGM_FI_DEV_FB_USED": 1024,
        "DCGM_FI_DEV_FB_FREE": 79935,
        "DCGM_FI_DEV_FB_RESERVED": 600,
        "DCGM_FI_DEV_FB_USED_PERCENT": 1024 / (1024 + 79935),  # derived: Used/(Total - Reserved)
        "DCGM_FI_DEV_BAR1_TOTAL": 131072,
        "DCGM_FI_DEV_BAR1_USED": 3,
        "DCGM_FI_DEV_BAR1_FREE": 131069,
        "DCGM_FI_DEV_POWER_USAGE": 312.457,
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 9_876_543_210_123,
        "DCGM_FI_DEV_GPU_TEMP": 41,
        "DCGM_FI_DEV_SLOWDOWN_TEMP": 89,
        "DCGM_FI_DEV_SHUTDOWN_TEMP": 92,
        "DCGM_FI_DEV_GPU_MAX_OP_TEMP": 87,
        "DCGM_FI_DEV_MEM_MAX_OP_TEMP": 95,
        "DCGM_FI_DEV_SM_CLOCK": 1980,
        "DCGM_FI_DEV_MEM_CLOCK": 2619,
        "DCGM_FI_DEV_VIDEO_CLOCK": 1545,
        "DCGM_FI_DEV_MAX_SM_CLOCK": 1980,
        "DCGM_FI_DEV_MAX_MEM_CLOCK": 2619,
        "DCGM_FI_DEV_MAX_VIDEO_CLOCK": 1545,
        "DCGM_FI_DEV_PCIE_LINK_GEN": 5,
        "DCGM_FI_DEV_PCIE_MAX_LINK_GEN": 5,
        "DCGM_FI_DEV_PCIE_LINK_WIDTH": 16,
        "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH": 16,
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 2,
        "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": 4000,
        "DCGM_FI_DEV_PCIE_RX_THROUGHPUT": 125,
        "DCGM_FI_DEV_PSTATE": 0,
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 5,
        "DCGM_FI_DEV_POWER_MGMT_LIMIT": 700.0,
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": 700.0,
        "DCGM_FI_DEV_POWER_MGMT_LIMIT_DEF": 700.0,
        "DCGM_FI_DEV_POWER_MGMT_LIMIT_MIN": 200.0,
        "DCGM_FI_DEV_POWER_MGMT_LIMIT_MAX": 700.0,
    }
    assert "DCGM_FI_DEV_FAN_SPEED" not in s.invalid  # NOT_SUPPORTED: absent, not invalid
    assert s.invalid == {}
    assert type(s.fields["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]) is int


def test_mig_instances_are_gpus_with_their_own_memory_and_repeated_device_fields() -> None:
    gb = 1 << 30
    mig = [
        FakeMig(1, 0, "NVIDIA A100-SXM4-80GB MIG 3g.40gb", (40192 * MIB, 5 * gb, 35 * gb, 0)),
        FakeMig(1, 1, "NVIDIA A100-SXM4-80GB MIG 1c.3g.40gb", (40192 * MIB, 5 * gb, 35 * gb, 0)),
        FakeMig(9, 0, "NVIDIA A100-SXM4-80GB MIG 1g.10gb+me", (9728 * MIB, 0, 9728 * MIB, 0)),
    ]
    fake = FakeNvml([FakeGpu("GPU-bbbb", name="NVIDIA A100-SXM4-80GB", mig=mig)])
    samples = read_nvml("node-2", 5.0, nvml=fake)
    assert [(s.key, s.gpu_instance_profile) for s in samples] == [
        ("node-2/GPU-bbbb/1", "3g.40gb"),
        ("node-2/GPU-bbbb/9", "1g.10gb+me"),
    ]
    assert [s.seq for s in samples] == [0, 1]
    a, b = samples
    assert (a.fields["DCGM_FI_DEV_FB_TOTAL"], a.fields["DCGM_FI_DEV_FB_USED"]) == (40192, 5120)
    assert (b.fields["DCGM_FI_DEV_FB_TOTAL"], b.fields["DCGM_FI_DEV_FB_FREE"]) == (9728, 9728)
    for s in samples:
        assert "DCGM_FI_DEV_GPU_UTIL" not in s.fields and "DCGM_FI_DEV_GPU_UTIL" not in s.invalid
        assert "DCGM_FI_DEV_BAR1_TOTAL" not in s.fields  # the parent's BAR1 is not the instance's
        assert s.fields["DCGM_FI_DEV_POWER_USAGE"] == 312.457  # repeated as read, not divided
        assert s.fields["DCGM_FI_DEV_GPU_TEMP"] == 41
        assert {k for k in s.fields if not k.startswith(("DCGM_FI_DEV_FB_",))} <= DEVICE_LEVEL_FIELDS


def test_field_errors_are_invalid_with_reasons_and_counted() -> None:
    errs = {
        "util": pynvml.NVML_ERROR_NO_PERMISSION,
        "power": pynvml.NVML_ERROR_UNKNOWN,
        "temp": pynvml.NVML_ERROR_GPU_IS_LOST,
    }
    gpu = FakeGpu("GPU-cccc", errors=errs)
    fake = FakeNvml([gpu, FakeGpu("GPU-dddd", util=(4294967295, 0))])
    with NvmlReader(fake) as reader:
        a, b = reader.read("n", 1.0)
    assert a.invalid == {
        "DCGM_FI_DEV_GPU_UTIL": "no_permission",
        "DCGM_FI_DEV_MEM_COPY_UTIL": "no_permission",
        "DCGM_FI_DEV_POWER_USAGE": "unknown_error",
        "DCGM_FI_DEV_GPU_TEMP": "gpu_lost",
    }
    assert not set(a.invalid) & set(a.fields)
    assert a.fields["DCGM_FI_DEV_FB_USED"] == 1024  # the rest of the GPU is kept
    assert b.invalid == {"DCGM_FI_DEV_GPU_UTIL": "out_of_range"}
    assert b.fields["DCGM_FI_DEV_MEM_COPY_UTIL"] == 0
    # what the collector service counts in gpupool_collector_rejected_samples_total{reason}
    assert reader.last_errors == {
        "no_permission": 2,
        "unknown_error": 1,
        "gpu_lost": 1,
        "out_of_range": 1,
    }
    assert reader.last_failure is None


def test_an_unreadable_device_is_left_out_alone() -> None:
    lost = FakeGpu("GPU-eeee", errors={"uuid": pynvml.NVML_ERROR_GPU_IS_LOST})
    fake = FakeNvml([lost, FakeGpu("GPU-ffff", minor=1)])
    with NvmlReader(fake) as reader:
        samples = reader.read("n", 1.0)
        assert [s.gpu_uuid for s in samples] == ["GPU-ffff"]
        assert reader.last_errors == {"gpu_lost": 1}


def test_memory_info_v1_fallback_on_old_drivers() -> None:
    class OldDriver(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, h: Any, version: int | None = None) -> Any:
            if version is not None:
                raise E(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return super().nvmlDeviceGetMemoryInfo(h)

    [s] = read_nvml("n", 1.0, nvml=OldDriver([FakeGpu("GPU-1111")]))
    assert s.fields["DCGM_FI_DEV_FB_USED"] == 1624  # v1 'used' includes the reservation
    assert "DCGM_FI_DEV_FB_RESERVED" not in s.fields


def test_init_and_count_failures() -> None:
    fake = FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert nvml_available(fake) is False
    with pytest.raises(NvmlUnavailableError) as info:
        NvmlReader(fake).open()
    assert info.value.reason == "driver_not_loaded"

    broken = FakeNvml([FakeGpu("GPU-2222")], count_error=pynvml.NVML_ERROR_UNKNOWN)
    with NvmlReader(broken) as reader:
        assert reader.read("n", 1.0) == []
        assert reader.last_failure == "unknown_error"  # the service counts a failed nvml scrape

    with pytest.raises(RuntimeError, match="open"):
        NvmlReader(FakeNvml([])).read("n", 1.0)
