"""GPUs read in-process through NVML (PyPI ``nvidia-ml-py``, module ``pynvml``) →
:class:`contracts.GpuSample` with DCGM field names.

Source of the calls and units: NVIDIA's NVML API reference (``nvml.h``) as wrapped by
``pynvml``: utilisation in %, memory in bytes (reported as MiB = bytes // 2**20, DCGM's unit),
power in mW (reported in W), energy in mJ, temperatures in C, clocks in MHz, PCIe throughput in
KB/s. The field for each call is the DCGM field DCGM fills from the same call
(``DCGM_FI_DEV_POWER_USAGE`` ← ``nvmlDeviceGetPowerUsage`` ...; the table is :data:`READS`).

Per call: ``NVML_ERROR_NOT_SUPPORTED``, ``NOT_FOUND`` and ``FUNCTION_NOT_FOUND`` (an older driver)
leave the field **absent**; ``NO_PERMISSION`` → ``invalid`` ``no_permission``; ``GPU_IS_LOST`` /
``RESET_REQUIRED`` → ``gpu_lost``; ``UNKNOWN`` → ``unknown_error``; any other NVML error →
``nvml_error``; a value out of range (:func:`collectors.nvsmi.check_value`, e.g. a
``GPU_UTIL`` of 4294967295) → ``out_of_range``. Every invalid value is counted in
``gpupool_collector_rejected_samples_total{reason}``.

MIG: when ``nvmlDeviceGetMigMode`` says enabled, each MIG device handle's GPU instance
(``nvmlDeviceGetGpuInstanceId``) is a GPU of its own with its own memory (and utilisation, where
the driver supports it per instance), and the fields of
:data:`collectors.nvsmi.DEVICE_LEVEL_FIELDS` are repeated on it as read on the parent — the same
convention as :mod:`collectors.nvsmi` and dcgm-exporter. Its profile (``3g.40gb``) is taken from
the MIG device name (``NVIDIA A100-SXM4-40GB MIG 3g.40gb``).

Honesty note: this module has **not been run against a real GPU** — none is present where it was
written. :func:`nvml_available` was run for real (the library is absent here: ``False``), and the
mapping was tested against an in-process stand-in exposing the same ``pynvml`` function names,
constants and ``NVMLError`` classes.
"""

from __future__ import annotations

import importlib
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple, Self

from collectors.dcgm_fields import derive_fields
from collectors.nvsmi import DEVICE_LEVEL_FIELDS, check_value
from contracts import GpuSample

log = logging.getLogger(__name__)

__all__ = [
    "READS",
    "NvmlRead",
    "NvmlReader",
    "NvmlUnavailableError",
    "nvml_available",
    "read_nvml",
]

_MIB = 1 << 20
_TARGET = "nvml"
_MIG_PROFILE = re.compile(r"\bMIG (?:\d+c\.)?(\d+g\.\d+gb(?:\+[a-z0-9]+)*)", re.IGNORECASE)

Nvml = Any
"""The ``pynvml`` module, or an object with the same function names, constants and
``NVMLError`` (tests pass a stand-in)."""
Handle = Any
"""An NVML device handle (opaque)."""


class NvmlUnavailableError(RuntimeError):
    """NVML cannot be used on this machine.

    Attributes:
        reason: ``not_installed`` (no ``pynvml`` module), ``library_not_found`` (no
            ``libnvidia-ml.so``), ``driver_not_loaded``, ``no_permission``, or ``nvml_error``.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"NVML unavailable: {reason}{': ' + detail if detail else ''}")
        self.reason = reason


class NvmlRead(NamedTuple):
    """One NVML call and the DCGM fields it fills.

    Attributes:
        fields: DCGM field names, in the order of the values ``call`` returns.
        call: ``(nvml, handle) -> tuple of values`` (units already DCGM's).
    """

    fields: tuple[str, ...]
    call: Callable[[Nvml, Handle], tuple[int | float, ...]]


def _memory(nv: Nvml, h: Handle) -> tuple[int, ...]:
    """FB total/used/free/reserved, MiB: ``nvmlDeviceGetMemoryInfo`` v2 (``used`` without the
    driver's reservation, as nvidia-smi shows it); v1 (no reserved) on drivers without v2."""
    try:
        m = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
        return (m.total // _MIB, m.used // _MIB, m.free // _MIB, m.reserved // _MIB)
    except nv.NVMLError as e:
        if e.value not in (nv.NVML_ERROR_FUNCTION_NOT_FOUND, nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
            raise
    m = nv.nvmlDeviceGetMemoryInfo(h)
    return (m.total // _MIB, m.used // _MIB, m.free // _MIB)


def _utilization(nv: Nvml, h: Handle) -> tuple[int, int]:
    """GPU and memory-copy utilisation, % (``nvmlDeviceGetUtilizationRates``)."""
    u = nv.nvmlDeviceGetUtilizationRates(h)
    return (u.gpu, u.memory)


def _bar1(nv: Nvml, h: Handle) -> tuple[int, int, int]:
    """BAR1 total/used/free, MiB (``nvmlDeviceGetBAR1MemoryInfo``, bytes)."""
    b = nv.nvmlDeviceGetBAR1MemoryInfo(h)
    return (b.bar1Total // _MIB, b.bar1Used // _MIB, b.bar1Free // _MIB)


def _event_reasons(nv: Nvml, h: Handle) -> tuple[int]:
    """``nvmlDeviceGetCurrentClocksEventReasons`` (r535+), else the older ``...ThrottleReasons``."""
    fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if fn is None:
        fn = nv.nvmlDeviceGetCurrentClocksThrottleReasons
    return (int(fn(h)),)


def _watts(milliwatts: int) -> float:
    return milliwatts / 1000.0


READS: tuple[NvmlRead, ...] = (
    NvmlRead(("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL"), _utilization),
    NvmlRead(("DCGM_FI_DEV_ENC_UTIL",), lambda nv, h: (nv.nvmlDeviceGetEncoderUtilization(h)[0],)),
    NvmlRead(("DCGM_FI_DEV_DEC_UTIL",), lambda nv, h: (nv.nvmlDeviceGetDecoderUtilization(h)[0],)),
    NvmlRead(
        ("DCGM_FI_DEV_FB_TOTAL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED"),
        _memory,
    ),
    NvmlRead(("DCGM_FI_DEV_BAR1_TOTAL", "DCGM_FI_DEV_BAR1_USED", "DCGM_FI_DEV_BAR1_FREE"), _bar1),
    NvmlRead(("DCGM_FI_DEV_POWER_USAGE",), lambda nv, h: (_watts(nv.nvmlDeviceGetPowerUsage(h)),)),
    NvmlRead(
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",), lambda nv, h: (nv.nvmlDeviceGetTotalEnergyConsumption(h),)
    ),
    NvmlRead(
        ("DCGM_FI_DEV_GPU_TEMP",), lambda nv, h: (nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),)
    ),
    NvmlRead(
        ("DCGM_FI_DEV_SLOWDOWN_TEMP",),
        lambda nv, h: (nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),),
    ),
    NvmlRead(
        ("DCGM_FI_DEV_SHUTDOWN_TEMP",),
        lambda nv, h: (nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),),
    ),
    NvmlRead(
        ("DCGM_FI_DEV_GPU_MAX_OP_TEMP",),
        lambda nv, h: (nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_GPU_MAX),),
    ),
    NvmlRead(
        ("DCGM_FI_DEV_MEM_MAX_OP_TEMP",),
        lambda nv, h: (nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),),
    ),
    NvmlRead(("DCGM_FI_DEV_SM_CLOCK",), lambda nv, h: (nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),)),
    NvmlRead(("DCGM_FI_DEV_MEM_CLOCK",), lambda nv, h: (nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),)),
    NvmlRead(
        ("DCGM_FI_DEV_VIDEO_CLOCK",), lambda nv, h: (nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_VIDEO),)
    ),
    NvmlRead(
        ("DCGM_FI_DEV_MAX_SM_CLOCK",), lambda nv, h: (nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),)
    ),
    NvmlRead(
        ("DCGM_FI_DEV_MAX_MEM_CLOCK",), lambda nv, h: (nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM),)
    ),
    NvmlRead(
        ("DCGM_FI_DEV_MAX_VIDEO_CLOCK",),
        lambda nv, h: (nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_VIDEO),),
    ),
    NvmlRead(("DCGM_FI_DEV_PCIE_LINK_GEN",), lambda nv, h: (nv.nvmlDeviceGetCurrPcieLinkGeneration(h),)),
    NvmlRead(("DCGM_FI_DEV_PCIE_MAX_LINK_GEN",), lambda nv, h: (nv.nvmlDeviceGetMaxPcieLinkGeneration(h),)),
    NvmlRead(("DCGM_FI_DEV_PCIE_LINK_WIDTH",), lambda nv, h: (nv.nvmlDeviceGetCurrPcieLinkWidth(h),)),
    NvmlRead(("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH",), lambda nv, h: (nv.nvmlDeviceGetMaxPcieLinkWidth(h),)),
    NvmlRead(("DCGM_FI_DEV_PCIE_REPLAY_COUNTER",), lambda nv, h: (nv.nvmlDeviceGetPcieReplayCounter(h),)),
    NvmlRead(
        ("DCGM_FI_DEV_PCIE_TX_THROUGHPUT",),
        lambda nv, h: (nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES),),
    ),
    NvmlRead(
        ("DCGM_FI_DEV_PCIE_RX_THROUGHPUT",),
        lambda nv, h: (nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES),),
    ),
    NvmlRead(("DCGM_FI_DEV_FAN_SPEED",), lambda nv, h: (nv.nvmlDeviceGetFanSpeed(h),)),
    NvmlRead(("DCGM_FI_DEV_PSTATE",), lambda nv, h: (nv.nvmlDeviceGetPerformanceState(h),)),
    NvmlRead(("DCGM_FI_DEV_CLOCKS_EVENT_REASONS",), _event_reasons),
    NvmlRead(
        ("DCGM_FI_DEV_POWER_MGMT_LIMIT",), lambda nv, h: (_watts(nv.nvmlDeviceGetPowerManagementLimit(h)),)
    ),
    NvmlRead(
        ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT",), lambda nv, h: (_watts(nv.nvmlDeviceGetEnforcedPowerLimit(h)),)
    ),
    NvmlRead(
        ("DCGM_FI_DEV_POWER_MGMT_LIMIT_DEF",),
        lambda nv, h: (_watts(nv.nvmlDeviceGetPowerManagementDefaultLimit(h)),),
    ),
    NvmlRead(
        ("DCGM_FI_DEV_POWER_MGMT_LIMIT_MIN", "DCGM_FI_DEV_POWER_MGMT_LIMIT_MAX"),
        lambda nv, h: tuple(_watts(v) for v in nv.nvmlDeviceGetPowerManagementLimitConstraints(h)),
    ),
)
"""Every NVML read, in call order. Reads whose fields are in
:data:`collectors.nvsmi.DEVICE_LEVEL_FIELDS` are made on the physical GPU only; the others
(utilisation, FB, BAR1) on each MIG device handle too."""

_INSTANCE_READS = tuple(r for r in READS if not DEVICE_LEVEL_FIELDS.issuperset(r.fields))


def _import_pynvml() -> ModuleType:
    try:
        return importlib.import_module("pynvml")
    except ImportError as e:
        raise NvmlUnavailableError("not_installed", str(e)) from e


def _error_reason(nv: Nvml, err: Exception) -> str | None:
    """``None`` when an NVML error means "not there" (the field is absent), else its reason."""
    code = getattr(err, "value", None)
    if code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_NOT_FOUND, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
        return None
    if code == nv.NVML_ERROR_NO_PERMISSION:
        return "no_permission"
    if code in (nv.NVML_ERROR_GPU_IS_LOST, getattr(nv, "NVML_ERROR_RESET_REQUIRED", -1)):
        return "gpu_lost"
    if code == nv.NVML_ERROR_UNKNOWN:
        return "unknown_error"
    return "nvml_error"


def _init_reason(nv: Nvml, err: Exception) -> str:
    code = getattr(err, "value", None)
    if code == nv.NVML_ERROR_LIBRARY_NOT_FOUND:
        return "library_not_found"
    if code == nv.NVML_ERROR_DRIVER_NOT_LOADED:
        return "driver_not_loaded"
    if code == nv.NVML_ERROR_NO_PERMISSION:
        return "no_permission"
    return "nvml_error"


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def nvml_available(nvml: Nvml | None = None) -> bool:
    """True when NVML can be used here: ``pynvml`` imports, ``libnvidia-ml.so`` loads and
    ``nvmlInit`` succeeds (NVML is shut down again). False otherwise — on a machine without the
    NVIDIA driver that is ``NVMLError_LibraryNotFound`` — never raises.

    Args:
        nvml: the module to use (default: ``pynvml``).
    """
    try:
        with NvmlReader(nvml):
            return True
    except NvmlUnavailableError as e:
        log.debug("nvml_unavailable", extra={"reason": e.reason, "error": str(e)})
        return False


class NvmlReader:
    """An NVML session: :meth:`open` once (``nvmlInit``), :meth:`read` every interval,
    :meth:`close` at the end (``nvmlShutdown``); or use it as a context manager. NVML keeps its
    own reference count, so several readers in one process are fine. Calls block (ctypes):
    run :meth:`read` in a worker thread from async code.

    Args:
        nvml: the module to use (default: ``pynvml``, imported on :meth:`open`).
    """

    def __init__(self, nvml: Nvml | None = None) -> None:
        self._nv: Nvml | None = nvml
        self._open = False
        self.last_errors: Counter[str] = Counter()
        """Invalid values and unreadable devices of the last :meth:`read`, by reason."""
        self.last_failure: str | None = None
        """Why the last :meth:`read` could not read the device count (``None``: it could)."""
        self.last_duration_s = 0.0
        """Wall time of the last :meth:`read`, seconds."""

    def open(self) -> None:
        """Initialise NVML.

        Raises:
            NvmlUnavailableError: ``pynvml`` is not installed, or ``nvmlInit`` failed (reason
                ``library_not_found``, ``driver_not_loaded``, ``no_permission``, ``nvml_error``).
        """
        if self._open:
            return
        nv = self._nv if self._nv is not None else _import_pynvml()
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            raise NvmlUnavailableError(_init_reason(nv, e), str(e)) from e
        self._nv = nv
        self._open = True

    def close(self) -> None:
        """Shut NVML down (errors are logged, not raised). Safe to call twice."""
        if not self._open:
            return
        self._open = False
        nv = self._nv
        assert nv is not None
        try:
            nv.nvmlShutdown()
        except Exception as e:  # noqa: BLE001 — closing must not fail the caller
            log.warning("nvml_shutdown_failed", extra={"error": repr(e)})

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, host: str, ts: float, *, seq_start: int = 0) -> list[GpuSample]:
        """Read every GPU (and MIG GPU instance) once.

        Counts the read in ``gpupool_collector_scrapes_total{target="nvml"}``, its time in
        ``gpupool_collector_scrape_duration_seconds{source="nvml"}`` and each invalid value or
        unreadable device in ``gpupool_collector_rejected_samples_total{reason}``.

        Args:
            host: host name of the samples.
            ts: read time, Unix seconds.
            seq_start: ``seq`` of the first sample.

        Returns:
            One sample per GPU or GPU instance, in device index order. A device whose handle or
            UUID cannot be read is left out and counted (:attr:`last_errors`); if the device
            count itself cannot be read the result is empty and :attr:`last_failure` says why.

        Raises:
            RuntimeError: :meth:`open` was not called.
        """
        if not self._open:
            raise RuntimeError("NvmlReader.open() must be called before read()")
        nv = self._nv
        assert nv is not None
        t0 = time.monotonic()
        self.last_errors = Counter()
        self.last_failure = None
        samples: list[GpuSample] = []
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as e:
            count = 0
            reason = _error_reason(nv, e) or "nvml_error"
            self.last_failure = reason
            log.warning("nvml_read_failed", extra={"reason": reason, "error": str(e)})
        for index in range(count):
            samples.extend(self._device(nv, index, host, ts))
        samples = [s.model_copy(update={"seq": seq_start + i}) for i, s in enumerate(samples)]
        self.last_duration_s = time.monotonic() - t0
        return samples

    def _device(self, nv: Nvml, index: int, host: str, ts: float) -> list[GpuSample]:
        """The sample(s) of one physical GPU."""
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nv.nvmlDeviceGetUUID(h))
        except nv.NVMLError as e:
            reason = _error_reason(nv, e) or "nvml_error"
            self.last_errors[reason] += 1
            log.warning("nvml_device_unreadable", extra={"index": index, "reason": reason, "error": str(e)})
            return []
        name = self._optional(nv, lambda: _text(nv.nvmlDeviceGetName(h)))
        minor = self._optional(nv, lambda: int(nv.nvmlDeviceGetMinorNumber(h)))
        bus_id = self._optional(nv, lambda: _text(nv.nvmlDeviceGetPciInfo(h).busId))
        common: dict[str, Any] = {
            "ts": ts,
            "host": host,
            "gpu_uuid": uuid,
            "gpu_index": minor if minor is not None else index,
            "model_name": name or None,
            "attributes": {"pci_bus_id": bus_id} if bus_id else {},
            "source": "nvml",
            "target": _TARGET,
        }
        fields, invalid = self._fields(nv, h, READS)
        instances = self._mig_handles(nv, h)
        if not instances:
            derive_fields(fields, invalid)
            return [GpuSample(**common, fields=fields, invalid=invalid)]
        shared = {k: v for k, v in fields.items() if k in DEVICE_LEVEL_FIELDS}
        shared_invalid = {k: v for k, v in invalid.items() if k in DEVICE_LEVEL_FIELDS}
        out: list[GpuSample] = []
        for gi, profile, mh in instances:
            f, inv = self._fields(nv, mh, _INSTANCE_READS)
            f, inv = {**shared, **f}, {**shared_invalid, **inv}
            derive_fields(f, inv)
            out.append(GpuSample(**common, gpu_instance_id=gi, gpu_instance_profile=profile, fields=f, invalid=inv))
        return out

    def _optional(self, nv: Nvml, call: Callable[[], Any]) -> Any:
        """``call()``, or ``None`` when NVML refuses (an identity detail is never worth a GPU)."""
        try:
            return call()
        except nv.NVMLError:
            return None

    def _profile(self, nv: Nvml, mig_handle: Handle) -> str | None:
        """The GPU instance profile (``3g.40gb``) from a MIG device's name, if it has one."""
        name = self._optional(nv, lambda: _text(nv.nvmlDeviceGetName(mig_handle))) or ""
        m = _MIG_PROFILE.search(name)
        return m.group(1) if m else None

    def _fields(
        self, nv: Nvml, h: Handle, reads: tuple[NvmlRead, ...]
    ) -> tuple[dict[str, int | float], dict[str, str]]:
        fields: dict[str, int | float] = {}
        invalid: dict[str, str] = {}
        for read in reads:
            try:
                values = read.call(nv, h)
            except nv.NVMLError as e:
                reason = _error_reason(nv, e)
                if reason is not None:
                    for f in read.fields:
                        invalid[f] = reason
                    self.last_errors[reason] += len(read.fields)
                continue
            for f, v in zip(read.fields, values, strict=False):
                bad = check_value(f, v)
                if bad is None:
                    fields[f] = v
                else:
                    invalid[f] = bad
                    self.last_errors[bad] += 1
        return fields, invalid

    def _mig_handles(self, nv: Nvml, h: Handle) -> list[tuple[int, str | None, Handle]]:
        """``(gpu_instance_id, profile, handle)`` of each GPU instance when MIG is enabled;
        compute instances of one GPU instance are one GPU (the first handle is used)."""
        try:
            current, _pending = nv.nvmlDeviceGetMigMode(h)
        except nv.NVMLError:
            return []  # NOT_SUPPORTED on GPUs without MIG
        if current != nv.NVML_DEVICE_MIG_ENABLE:
            return []
        try:
            slots = int(nv.nvmlDeviceGetMaxMigDeviceCount(h))
        except nv.NVMLError as e:
            self.last_errors[_error_reason(nv, e) or "nvml_error"] += 1
            return []
        found: dict[int, tuple[int, str | None, Handle]] = {}
        for i in range(slots):
            try:
                mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
                gi = int(nv.nvmlDeviceGetGpuInstanceId(mh))
            except nv.NVMLError as e:
                reason = _error_reason(nv, e)
                if reason is not None:  # NOT_FOUND: an empty slot
                    self.last_errors[reason] += 1
                continue
            if gi not in found:
                found[gi] = (gi, self._profile(nv, mh), mh)
        return [found[gi] for gi in sorted(found)]


def read_nvml(host: str, ts: float, *, nvml: Nvml | None = None, seq_start: int = 0) -> list[GpuSample]:
    """Open NVML, read every GPU once (:meth:`NvmlReader.read`) and close it again.

    For a loop, keep one :class:`NvmlReader` open instead (``nvmlInit`` can take long on hosts
    without persistence mode).

    Args:
        host: host name of the samples.
        ts: read time, Unix seconds.
        nvml: the module to use (default: ``pynvml``).
        seq_start: ``seq`` of the first sample.

    Raises:
        NvmlUnavailableError: NVML cannot be used here (see :meth:`NvmlReader.open`).
    """
    with NvmlReader(nvml) as reader:
        return reader.read(host, ts, seq_start=seq_start)
