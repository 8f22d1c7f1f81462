"""gpupool simulator: a GPU pool that exposes what real hardware exposes, driven by a real trace.

* :mod:`simulator.trace` — the Alibaba GenAI 2026 trace, read from its tarballs and aligned per pod;
* :mod:`simulator.fleet` — N nodes × M H100 GPUs replaying trace pods, with the ground truth;
* :mod:`simulator.dcgm_http` — dcgm-exporter ``/metrics`` endpoints, one per node, with faults;
* :mod:`simulator.sysfs` — InfiniBand sysfs trees whose counters advance with the load;
* :mod:`simulator.demand` — training demand: idle→busy edges of the trace → ``pool.demand``;
* :mod:`simulator.sites` — simulated edge sites (claim, renew, release over MQTT).
* :mod:`simulator.training_jobs` — training jobs fitted to AcmeTrace's published job statistics;
* :mod:`simulator.replay` — those jobs replayed on a real scheduler, time-compressed, and measured;
* :mod:`simulator.slurm_replay`, :mod:`simulator.kubernetes_replay` — its Slurm and Kubernetes clients.

The names in ``__all__`` are imported from their modules on first use (PEP 562 ``__getattr__``):
importing one submodule, such as :mod:`simulator.inference_server` (the workload a lease starts,
whose process start is on a reclaim's path), does not import the others (pyarrow, pydantic, the
trace reader).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulator.dcgm_http import FAIL_MODES, FailMode, FleetServer, render_metrics
    from simulator.demand import TrainingDemand
    from simulator.fleet import BUSY_THRESHOLD_PCT, Fleet, SimGpu
    from simulator.sysfs import COUNTER_BITS, Hca, SysfsTree
    from simulator.trace import Trace, TraceError, TraceStats, default_trace_dir, load_trace

_EXPORTS = {
    "FAIL_MODES": "simulator.dcgm_http",
    "FailMode": "simulator.dcgm_http",
    "FleetServer": "simulator.dcgm_http",
    "render_metrics": "simulator.dcgm_http",
    "TrainingDemand": "simulator.demand",
    "BUSY_THRESHOLD_PCT": "simulator.fleet",
    "Fleet": "simulator.fleet",
    "SimGpu": "simulator.fleet",
    "COUNTER_BITS": "simulator.sysfs",
    "Hca": "simulator.sysfs",
    "SysfsTree": "simulator.sysfs",
    "Trace": "simulator.trace",
    "TraceError": "simulator.trace",
    "TraceStats": "simulator.trace",
    "default_trace_dir": "simulator.trace",
    "load_trace": "simulator.trace",
}
"""Each public name of the package → the module that defines it."""

__all__ = [
    "BUSY_THRESHOLD_PCT",
    "COUNTER_BITS",
    "FAIL_MODES",
    "FailMode",
    "Fleet",
    "FleetServer",
    "Hca",
    "SimGpu",
    "SysfsTree",
    "Trace",
    "TraceError",
    "TraceStats",
    "TrainingDemand",
    "default_trace_dir",
    "load_trace",
    "render_metrics",
]


def __getattr__(name: str) -> Any:
    """``simulator.<name>`` for a name of ``__all__``: imported from its module on first use.
    Raises ``AttributeError`` for any other name."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'simulator' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
