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

from collectors.dcgm import DcgmParseResult, Rejection, parse_dcgm_exporter
from collectors.scrape import Scraper, ScrapeResult
from collectors.service import CollectorService, CollectStats
from collectors.slurm_collector import SlurmCollector, SlurmRead
from collectors.sysfs_ib import IbDevice, SysfsError, SysfsReadResult, read_sysfs_infiniband
from collectors.ttar import extract_ttar, materialize_ttar, parse_ttar
from collectors.xid import XidEvent, XidObservation, XidTracker

__all__ = [
    "CollectStats",
    "CollectorService",
    "DcgmParseResult",
    "IbDevice",
    "Rejection",
    "ScrapeResult",
    "Scraper",
    "SlurmCollector",
    "SlurmRead",
    "SysfsError",
    "SysfsReadResult",
    "XidEvent",
    "XidObservation",
    "XidTracker",
    "extract_ttar",
    "materialize_ttar",
    "parse_dcgm_exporter",
    "parse_ttar",
    "read_sysfs_infiniband",
]
