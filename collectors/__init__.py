"""gpupool collectors: GPU and InfiniBand sources → normalised records → the bus.

Public API:

* :func:`parse_dcgm_exporter` (:mod:`collectors.dcgm`) — a dcgm-exporter ``/metrics`` body →
  :class:`contracts.GpuSample` per GPU / MIG instance, with :class:`Rejection` s;
* :func:`read_sysfs_infiniband` (:mod:`collectors.sysfs_ib`) — ``/sys/class/infiniband`` →
  :class:`contracts.IbPortSample` per port;
* :class:`Scraper` (:mod:`collectors.scrape`) — concurrent HTTP scrapes with a deadline each;
* :class:`CollectorService` (:mod:`collectors.service`) — the stage loop producing to the bus;
* :class:`XidTracker` (:mod:`collectors.xid`) — XID errors as events on change;
* :class:`SlurmCollector` (:mod:`collectors.slurm_collector`) — the Slurm source: ``scontrol``
  nodes and jobs (:mod:`collectors.slurm_parse`) → :class:`contracts.scheduler.SchedulerNode`
  per node (:mod:`collectors.slurm_records`);
* :func:`materialize_ttar` (:mod:`collectors.ttar`) — node_exporter/procfs ttar fixtures.
"""

from __future__ import annotations

from runtime.lazy import lazy_exports

_EXPORTS = {
    "DcgmParseResult": "collectors.dcgm",
    "Rejection": "collectors.dcgm",
    "parse_dcgm_exporter": "collectors.dcgm",
    "Scraper": "collectors.scrape",
    "ScrapeResult": "collectors.scrape",
    "CollectorService": "collectors.service",
    "CollectStats": "collectors.service",
    "SlurmCollector": "collectors.slurm_collector",
    "SlurmRead": "collectors.slurm_collector",
    "IbDevice": "collectors.sysfs_ib",
    "SysfsError": "collectors.sysfs_ib",
    "SysfsReadResult": "collectors.sysfs_ib",
    "read_sysfs_infiniband": "collectors.sysfs_ib",
    "extract_ttar": "collectors.ttar",
    "materialize_ttar": "collectors.ttar",
    "parse_ttar": "collectors.ttar",
    "XidEvent": "collectors.xid",
    "XidObservation": "collectors.xid",
    "XidTracker": "collectors.xid",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
