"""The Fleet dashboard: GPU state counts from gpupool analytics, per-GPU utilisation, memory,
power and temperature from dcgm-exporter.

gpupool does not re-export per-GPU values to Prometheus (collectors send them to Kafka); operators
scrape dcgm-exporter directly (job ``dcgm-exporter`` in ``deploy/prometheus/prometheus.yml``), so the
per-GPU panels read its ``DCGM_FI_*`` series, labelled ``Hostname``, ``gpu``, ``UUID``,
``modelName`` and, on MIG GPUs, ``GPU_I_ID`` (fields: dcgm-exporter ``etc/default-counters.csv``).
GPU-level fields (power, temperature) are repeated on every MIG instance's series, hence the
``max by (Hostname, gpu, UUID)`` before any sum. Per-GPU idle/busy/unknown state is not exported
as a metric; the state panels show counts.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dashboard_b

from grafana import panels
from grafana.panels import Query

__all__ = ["UID", "dashboard"]

UID = "gpupool-fleet"
"""Dashboard uid (stable: links and provisioning refer to it)."""

_HOST = 'Hostname=~"$Hostname"'
_GPU_LEGEND = "{{Hostname}} GPU {{gpu}} {{GPU_I_ID}}"


def dashboard() -> dashboard_b.Dashboard:
    """The Fleet dashboard builder (uid :data:`UID`); variables ``datasource`` and ``Hostname``."""
    return (
        panels.dashboard(
            "gpupool / Fleet",
            UID,
            "GPU state counts from gpupool analytics; per-GPU utilisation, memory, power from dcgm-exporter.",
            panels.label_variable("Hostname", "DCGM_FI_DEV_GPU_UTIL", "Hostname", "Host"),
        )
        .with_row(panels.row("Fleet state (gpupool analytics)"))
        .with_panel(
            panels.stat(
                "Idle GPUs",
                [Query('sum(gpupool_analytics_gpus{state="idle"})')],
                description="GPUs and MIG instances analytics classifies idle (sustained window with hysteresis).",
            )
        )
        .with_panel(
            panels.stat(
                "Busy GPUs",
                [Query('sum(gpupool_analytics_gpus{state="busy"})')],
                description="GPUs and MIG instances analytics classifies busy.",
                thresholds=[(None, "blue")],
            )
        )
        .with_panel(
            panels.stat(
                "Unknown GPUs",
                [Query('sum(gpupool_analytics_gpus{state="unknown"})')],
                description="GPUs analytics cannot classify (missing field, DCGM blank sentinel, out-of-range "
                "value, stalled profiling, stale samples). Never offered.",
                thresholds=panels.ANY_IS_WARNING,
            )
        )
        .with_panel(
            panels.stat(
                "Unknown share",
                [Query('sum(gpupool_analytics_gpus{state="unknown"}) / sum(gpupool_analytics_gpus)')],
                description="Unknown GPUs over all GPUs known to analytics; alerts at 5 % and rising, and at 50 %.",
                unit="percentunit",
                thresholds=[(None, "green"), (0.05, "orange"), (0.5, "red")],
            )
        )
        .with_panel(
            panels.timeseries(
                "GPUs by state",
                [Query("sum by (state) (gpupool_analytics_gpus)", "{{state}}")],
                description="GPUs (and MIG instances) by state, summed over analytics instances.",
                stack=True,
            )
        )
        .with_panel(
            panels.timeseries(
                "XID errors by code",
                [
                    Query(
                        "sum by (xid) (increase(gpupool_collector_xid_events_total[$__rate_interval]))",
                        "XID {{xid}}",
                    )
                ],
                description="New XID errors the collectors saw (DCGM_FI_DEV_XID_ERRORS changes), by XID code.",
            )
        )
        .with_row(panels.row("Per GPU (dcgm-exporter)"))
        .with_panel(
            panels.timeseries(
                "GPU utilisation",
                [Query(f"DCGM_FI_DEV_GPU_UTIL{{{_HOST}}}", _GPU_LEGEND)],
                description="DCGM_FI_DEV_GPU_UTIL: share of time a kernel ran, per GPU (blank on MIG instances).",
                unit="percent",
                min_value=0,
                max_value=100,
            )
        )
        .with_panel(
            panels.timeseries(
                "Mean GPU utilisation by host",
                [Query(f"avg by (Hostname) (DCGM_FI_DEV_GPU_UTIL{{{_HOST}}})", "{{Hostname}}")],
                description="Mean of DCGM_FI_DEV_GPU_UTIL over each host's GPUs.",
                unit="percent",
                min_value=0,
                max_value=100,
            )
        )
        .with_panel(
            panels.timeseries(
                "Framebuffer used",
                [Query(f"DCGM_FI_DEV_FB_USED{{{_HOST}}} * 1048576", _GPU_LEGEND)],
                description="DCGM_FI_DEV_FB_USED (MiB, shown in bytes), per GPU or MIG instance.",
                unit="bytes",
                min_value=0,
            )
        )
        .with_panel(
            panels.timeseries(
                "Framebuffer used share",
                [
                    Query(
                        f"DCGM_FI_DEV_FB_USED{{{_HOST}}} / (DCGM_FI_DEV_FB_USED{{{_HOST}}} + DCGM_FI_DEV_FB_FREE{{{_HOST}}})",
                        _GPU_LEGEND,
                    )
                ],
                description="FB_USED / (FB_USED + FB_FREE): an idle GPU holding memory is offered as the lower "
                "grade memory_held.",
                unit="percentunit",
                min_value=0,
                max_value=1,
            )
        )
        .with_panel(
            panels.timeseries(
                "Power draw",
                [
                    Query(
                        f"max by (Hostname, gpu, UUID) (DCGM_FI_DEV_POWER_USAGE{{{_HOST}}})",
                        "{{Hostname}} GPU {{gpu}}",
                    )
                ],
                description="DCGM_FI_DEV_POWER_USAGE (W) per physical GPU (MIG instances repeat it: max, not sum).",
                unit="watt",
                min_value=0,
            )
        )
        .with_panel(
            panels.timeseries(
                "Power by host",
                [
                    Query(
                        f"sum by (Hostname) (max by (Hostname, gpu, UUID) (DCGM_FI_DEV_POWER_USAGE{{{_HOST}}}))",
                        "{{Hostname}}",
                    )
                ],
                description="GPU power per host, each physical GPU counted once.",
                unit="watt",
                stack=True,
            )
        )
        .with_panel(
            panels.timeseries(
                "GPU temperature",
                [
                    Query(
                        f"max by (Hostname, gpu, UUID) (DCGM_FI_DEV_GPU_TEMP{{{_HOST}}})",
                        "{{Hostname}} GPU {{gpu}}",
                    )
                ],
                description="DCGM_FI_DEV_GPU_TEMP (°C) per physical GPU.",
                unit="celsius",
                width=24,
            )
        )
    )
