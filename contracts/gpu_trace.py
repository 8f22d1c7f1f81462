"""The Alibaba GenAI 2026 GPU trace as stored: its files, columns and sampling step, and a reader.

Source: ``alibaba/clusterdata`` ``cluster-trace-v2026-GenAI/`` (see
``../shared/data/traces/alibaba_genai_2026/PROVENANCE.md``): two CSV files, each alone inside its
own ``.tar.gz``, with the columns ``value,timestamp_anon,container_ip`` (in any order):
:data:`DUTY_CYCLE_FILE` (GPU duty cycle, %) and :data:`MEMORY_FILE` (GPU memory used, bytes).

The analytics evaluation (:mod:`analytics.evaluate`) and the simulated fleet
(:mod:`simulator.trace`) both read it; each decides what to do with blank cells. Imported only
by them, so importing :mod:`contracts` loads no Arrow.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv

DUTY_CYCLE_FILE = "pod_gpu_duty_cycle_anon.tar.gz"
"""Tarball holding the duty-cycle CSV (PROVENANCE.md)."""
MEMORY_FILE = "pod_gpu_memory_used_bytes_anon.tar.gz"
"""Tarball holding the memory-used CSV (PROVENANCE.md)."""
STEP_S = 57.0
"""Sampling period of the trace, seconds (PROVENANCE.md)."""
COLUMNS = ("value", "timestamp_anon", "container_ip")
"""The columns of both CSV files: sample value, shifted epoch seconds, pod identity (MD5)."""


class TraceReadError(ValueError):
    """A trace tarball is not a readable ``.tar.gz`` holding exactly one CSV with the columns
    ``value,timestamp_anon,container_ip``."""


def read_trace_csv(path: Path) -> pa.Table:
    """The one CSV inside the tarball at ``path`` as an Arrow table with :data:`COLUMNS` in that
    order (value and time as float64, the pod as string; blank cells are nulls).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        TraceReadError: not a readable tar archive, not exactly one ``.csv`` member, or a CSV
            without those columns or with a value that does not parse.
    """
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    try:
        with tarfile.open(path, "r:*") as tf:
            members = [m for m in tf.getmembers() if m.isfile() and m.name.endswith(".csv")]
            if len(members) != 1:
                raise TraceReadError(f"{path.name}: expected one .csv member, found {len(members)}")
            fh = tf.extractfile(members[0])
            if fh is None:
                raise TraceReadError(f"{path.name}: cannot read member {members[0].name}")
            data = fh.read()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise TraceReadError(f"{path.name}: not a readable tar archive: {exc}") from exc
    try:
        return pacsv.read_csv(
            io.BytesIO(data),
            convert_options=pacsv.ConvertOptions(
                column_types={"value": pa.float64(), "timestamp_anon": pa.float64(), "container_ip": pa.string()},
                include_columns=list(COLUMNS),
            ),
        )
    except (pa.ArrowInvalid, KeyError) as exc:
        raise TraceReadError(f"{path.name}: unexpected CSV content ({exc}); want columns {COLUMNS}") from exc
