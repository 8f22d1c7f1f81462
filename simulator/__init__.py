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
"""

from simulator.dcgm_http import FAIL_MODES, FailMode, FleetServer, render_metrics
from simulator.demand import TrainingDemand
from simulator.fleet import BUSY_THRESHOLD_PCT, Fleet, SimGpu
from simulator.sysfs import COUNTER_BITS, Hca, SysfsTree
from simulator.trace import Trace, TraceError, TraceStats, default_trace_dir, load_trace

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
