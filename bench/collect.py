"""Benchmark: gpupool's dcgm-exporter parser vs prometheus_client's text parser, same body, same run.

The body is a realistic 8-GPU H100 ``/metrics`` page in dcgm-exporter's current format (as in
``../shared/data/cases/dcgm_exporter_samples/synthesized_current_template_4x.prom``): a ``# HELP``
and ``# TYPE`` per family, one series per GPU with ``gpu``, ``UUID``, ``pci_bus_id``, ``device``,
``modelName``, ``hostname`` and ``DCGM_FI_DRIVER_VERSION`` labels, pod labels on the GPUs a pod
holds, ``err_code``/``err_msg`` on the XID series, ``%f`` floats and integer counters.

Yardstick: ``prometheus_client.parser.text_string_to_metric_families`` consuming every sample.
Both parse the same string, alternating in every round (10 gpupool parses, then one yardstick
parse); the ratio of their median times per body is printed (target >= 10). gpupool's time
includes building the validated ``GpuSample`` records; the yardstick's only its metric families.

Run: ``.venv/bin/python bench/collect.py [--gpus 8] [--rounds 60]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from collectors.dcgm import parse_dcgm_exporter

# (field, type, help, generator of a realistic value string)
_FIELDS: list[tuple[str, str, str, Callable[[random.Random], str]]] = [
    (
        "DCGM_FI_DEV_SM_CLOCK",
        "gauge",
        "SM clock frequency (in MHz).",
        lambda r: str(r.choice([345, 1755, 1980])),
    ),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", lambda r: "2619"),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", lambda r: str(r.randint(30, 70))),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda r: str(r.randint(28, 80))),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda r: f"{r.uniform(68, 700):f}"),
    (
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
        lambda r: str(r.randint(10**10, 10**13)),
    ),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.", lambda r: "0"),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda r: str(r.randint(0, 100))),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", lambda r: str(r.randint(0, 100))),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", lambda r: "0"),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", lambda r: "0"),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", lambda r: str(r.randint(0, 81000))),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", lambda r: str(r.randint(0, 81000))),
    ("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).", lambda r: "591"),
    (
        "DCGM_FI_DEV_POWER_VIOLATION",
        "counter",
        "Throttling duration due to power constraints (in us).",
        lambda r: str(r.randint(0, 10**9)),
    ),
    (
        "DCGM_FI_DEV_THERMAL_VIOLATION",
        "counter",
        "Throttling duration due to thermal constraints (in us).",
        lambda r: "0",
    ),
    (
        "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
        "counter",
        "Throttling duration due to sync-boost constraints (in us).",
        lambda r: "0",
    ),
    (
        "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",
        "counter",
        "Throttling duration due to board limit constraints (in us).",
        lambda r: "0",
    ),
    (
        "DCGM_FI_DEV_LOW_UTIL_VIOLATION",
        "counter",
        "Throttling duration due to low utilization (in us).",
        lambda r: "0",
    ),
    (
        "DCGM_FI_DEV_RELIABILITY_VIOLATION",
        "counter",
        "Throttling duration due to reliability constraints (in us).",
        lambda r: "0",
    ),
    (
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "counter",
        "Total number of single-bit volatile ECC errors.",
        lambda r: "0",
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "counter",
        "Total number of double-bit volatile ECC errors.",
        lambda r: "0",
    ),
    (
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "counter",
        "Total number of single-bit persistent ECC errors.",
        lambda r: "0",
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "counter",
        "Total number of double-bit persistent ECC errors.",
        lambda r: "0",
    ),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
        lambda r: "0",
    ),
    (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for correctable errors",
        lambda r: "0",
    ),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed", lambda r: "0"),
    (
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "Total number of NVLink bandwidth counters for all lanes.",
        lambda r: str(r.randint(0, 10**12)),
    ),
    (
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "gauge",
        "Ratio of time the graphics engine is active.",
        lambda r: f"{r.random():f}",
    ),
    (
        "DCGM_FI_PROF_SM_ACTIVE",
        "gauge",
        "The ratio of cycles an SM has at least 1 warp assigned.",
        lambda r: f"{r.random():f}",
    ),
    (
        "DCGM_FI_PROF_SM_OCCUPANCY",
        "gauge",
        "The ratio of number of warps resident on an SM.",
        lambda r: f"{r.random():f}",
    ),
    (
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
        lambda r: f"{r.random():f}",
    ),
    (
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "gauge",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
        lambda r: f"{r.random():f}",
    ),
    (
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "gauge",
        (
            "The rate of data transmitted over the PCIe bus - including both "
            "protocol headers and data payloads - in bytes per second."
        ),
        lambda r: str(r.randint(0, 10**9)),
    ),
    (
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "gauge",
        (
            "The rate of data received over the PCIe bus - including both "
            "protocol headers and data payloads - in bytes per second."
        ),
        lambda r: str(r.randint(0, 10**9)),
    ),
]
_XID = ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.")


def build_h100_body(gpus: int = 8, host: str = "gpu-node-001", seed: int = 7) -> str:
    """A dcgm-exporter body for ``gpus`` H100s: 35 fields plus ``DCGM_FI_DEV_XID_ERRORS`` per GPU,
    families in exporter order, pods on every other GPU."""
    r = random.Random(seed)
    labels = []
    for g in range(gpus):
        base = (
            f'gpu="{g}",UUID="GPU-c0ffee00-0000-4000-8000-{g:012x}",'
            f'pci_bus_id="00000000:{0x18 + 16 * g:02X}:00.0",'
            f'device="nvidia{g}",modelName="NVIDIA H100 80GB HBM3",hostname="{host}",'
            f'DCGM_FI_DRIVER_VERSION="570.86.15"'
        )
        if g % 2:
            base += (
                f',container="trainer",namespace="ml-team",pod="llm-train-{g}",'
                f'pod_uid="0b9d7a52-1111-4222-8333-9444555566{g:02d}"'
            )
        labels.append(base)
    out: list[str] = []
    for name, typ, help_, gen in _FIELDS:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} {typ}\n")
        out.extend(f"{name}{{{lb}}} {gen(r)}\n" for lb in labels)
    name, typ, help_ = _XID
    out.append(f"# HELP {name} {help_}\n# TYPE {name} {typ}\n")
    out.extend(f'{name}{{{lb},err_code="0",err_msg="No Error"}} 0\n' for lb in labels)
    return "".join(out)


def _gpupool(body: str) -> int:
    return len(parse_dcgm_exporter(body, ts=0.0, target="bench").samples)


def _yardstick(body: str) -> int:
    return sum(len(f.samples) for f in text_string_to_metric_families(body))


def _timed(fn: Callable[[str], int], body: str, times: int) -> float:
    t0 = time.perf_counter()
    for _ in range(times):
        fn(body)
    return (time.perf_counter() - t0) / times


def run(gpus: int = 8, rounds: int = 60) -> dict[str, float]:
    """Time both parsers on the same body, alternating within every round so that both see the
    same machine load; return the median seconds per body of each and their ratio."""
    body = build_h100_body(gpus)
    assert _gpupool(body) == gpus, "gpupool parser lost GPUs"
    series = _yardstick(body)
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(rounds):
        ours.append(_timed(_gpupool, body, 10))
        theirs.append(_timed(_yardstick, body, 1))
    o, t = statistics.median(ours), statistics.median(theirs)
    return {
        "gpus": gpus,
        "series": series,
        "bytes": len(body),
        "gpupool_s": o,
        "prometheus_client_s": t,
        "ratio": t / o,
    }


def main() -> None:
    """Print the measurement as ``key=value`` lines."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    res = run(args.gpus, args.rounds)
    print(f"body: {res['gpus']} GPUs, {res['series']} series, {res['bytes']} bytes")
    print(f"gpupool parse_dcgm_exporter:               {res['gpupool_s'] * 1e3:8.3f} ms/body")
    print(
        f"prometheus_client text_string_to_metric_families: {res['prometheus_client_s'] * 1e3:8.3f} ms/body"
    )
    print(f"ratio (prometheus_client / gpupool): {res['ratio']:.1f}x (target >= 10x)")


if __name__ == "__main__":
    main()
