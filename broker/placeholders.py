"""Placeholder holds: idle GPUs held ahead of time by one-GPU jobs in Slurm's lent partition,
carved into leases on claim (as HTCondor's glide-ins hold slots), so no ``sbatch`` is on a
claim's path.

A placeholder is a batch job ``sbatch -p <lent> -w <node> --gres=gpu[:type]:1`` named
``gpupool-lease`` with ``Comment=gpupool-idle`` (:data:`broker.scheduler_slurm.IDLE_COMMENT`).
Slurm chooses its GPU; the GRES index it allocated (``scontrol show job -d``: ``IDX:``) is mapped
to the GPU's key by a :class:`GpuMap`. Being in the lent partition, it is preempted by any pending
training job that needs its GPU, exactly as a lease's hold is, whether or not gpupool runs.

Carving a lease: the broker takes the placeholders on the lease's GPUs, renames each one's
*idle* file (``<control dir>/<job id>.idle``, written by the script when it starts) to its
*held* file (``<job id>.held``), renames the jobs ``Comment=gpupool-lease=<lease id>``
and sets their time limit to the lease's end; on each node of the lease, the first placeholder's
*start* file (``<job id>.start``, a bash script, :func:`start_script`) starts one instance of the
workload with ``CUDA_VISIBLE_DEVICES`` = the GRES indices Slurm allocated to the lease's
placeholders on that node, its CPU budget and the lease's InfiniBand partition. The script
(:func:`placeholder_script`) polls for its start file every 0.1 s.

Signals (``--signal=B:TERM@<notice>``, ``preempt_send_user_signal``): an idle placeholder leaves
at once on SIGTERM (training gets the GPU at Slurm's next scheduling pass) after renaming its idle
file away; ``rename(2)`` is atomic, so either the broker carves it (and it stays, as a lease's
hold, for the notice) or it leaves (and the claim is refused), never both; one running the
workload forwards SIGTERM to it and leaves when it exits or ``notice`` seconds have passed; one
of a lease without the workload keeps its GPU, at most ``notice`` seconds, while its held file
exists (the broker removes it when the lease ends); one whose workload left before the notice
ran out keeps its GPU too, within the notice, while its held file exists and its *told* file
(``<job id>.told``, written by the broker once the lease's site was sent the reclaim) does not:
Slurm's training job never gets a lease's GPU before the site heard of the reclaim. A carved one writes the time its first
SIGTERM arrived (``date +%s.%6N``, from bash's ``EPOCHREALTIME``) to its *term* file
(``<job id>.term``): the broker watches for it (:func:`read_term`) and so hears of a preemption
as soon as Slurm signals it, without waiting for its next read of Slurm's jobs.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from broker.scheduler_slurm import leave_function
from contracts.leases import Partition
from contracts.topics import gpu_key

_INDEX_ID = re.compile(r"^gpu(\d+)$")


class GpuMap:
    """Node-local GRES indices ↔ GPU keys (:func:`contracts.topics.gpu_key`).

    Args:
        uuids: node → the GPU UUIDs by index (``nvidia-smi --query-gpu=index,uuid`` on each
            node); a node not listed uses keys ``<node>/gpu<index>`` (what telemetry sends for a
            GPU known without a UUID).
    """

    def __init__(self, uuids: Mapping[str, Sequence[str]] | None = None) -> None:
        self._uuids = {h: list(u) for h, u in (uuids or {}).items()}
        self._where = {gpu_key(h, u): (h, i) for h, us in self._uuids.items() for i, u in enumerate(us)}

    @classmethod
    def load(cls, path: Path | None) -> GpuMap:
        """A map from a JSON file ``{"<node>": ["<uuid of index 0>", ...]}``; ``None``: empty.
        Raises ``ValueError`` on a file of another shape, ``OSError`` if it cannot be read."""
        if path is None:
            return cls()
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not all(
            isinstance(h, str) and isinstance(us, list) and all(isinstance(u, str) for u in us)
            for h, us in data.items()
        ):
            raise ValueError(f"{path}: expected {{node: [uuid, ...]}}")
        return cls(data)

    def key(self, host: str, index: int) -> str:
        """The key of GPU ``index`` on ``host``. Raises ``KeyError`` for an index the node's
        UUID list does not have."""
        uuids = self._uuids.get(host)
        if uuids is None:
            return gpu_key(host, f"gpu{index}")
        if not 0 <= index < len(uuids):
            raise KeyError(f"{host} has no GPU index {index} in the GPU map")
        return gpu_key(host, uuids[index])

    def by_node(self, keys: Iterable[str]) -> dict[str, set[int]]:
        """The GPU keys this map can locate, as node → indices (keys it cannot are left out)."""
        out: dict[str, set[int]] = {}
        for key in keys:
            where = self.locate(key)
            if where is not None:
                out.setdefault(where[0], set()).add(where[1])
        return out

    def locate(self, key: str) -> tuple[str, int] | None:
        """``(host, index)`` of a GPU key, or ``None`` if it is not a whole GPU this map knows
        (a MIG instance, a UUID not listed)."""
        found = self._where.get(key)
        if found is not None:
            return found
        host, _, rest = key.partition("/")
        match = _INDEX_ID.match(rest)
        if host and match and host not in self._uuids:
            return host, int(match.group(1))
        return None


def placeholder_script(notice_s: float, control_dir: Path) -> str:
    """The batch script of a placeholder (module docstring: start and held files, signals)."""
    notice = max(0, math.ceil(notice_s))
    ctl = shlex.quote(str(control_dir))
    return f"""#!/bin/bash
# gpupool placeholder: hold one GPU until a lease takes it; run the lease's workload; leave on notice.
idle={ctl}/$SLURM_JOB_ID.idle
held={ctl}/$SLURM_JOB_ID.held
start={ctl}/$SLURM_JOB_ID.start
term={ctl}/$SLURM_JOB_ID.term
told={ctl}/$SLURM_JOB_ID.told
{leave_function(notice, '"$held"', '"$told"')}# SIGTERM while idle: take the idle file away (rename: exactly one of this and a carving wins)
# and leave at once; once carved (the broker renamed it to the held file), write when the first
# SIGTERM arrived (Unix s, microseconds) to the term file (renamed into place: never read half
# written) and leave as a lease hold.
trap 't=$EPOCHREALTIME
if mv -T "$idle" "$idle.left" 2>/dev/null; then rm -f "$idle.left"; leaving=1; exit 0; fi
[ -n "$leaving" ] || {{ echo "$t" >"$term.new" && mv -f "$term.new" "$term"; }}
leave $notice_ds' TERM
: >"$idle"
echo "gpupool-placeholder start $(date +%s) CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
while true; do
    if [ -z "$child" ] && [ -f "$start" ]; then
        bash "$start" &
        child=$!
    fi
    nap 0.1
done
"""


IB_SYSFS = "/sys/class/infiniband"
"""Where the kernel lists a node's InfiniBand devices (``<device>/ports/<port>/pkeys/<index>``,
each the P_Key at that index of the port's table, ``0x8012``; Linux
``Documentation/ABI/stable/sysfs-class-infiniband``)."""


def start_script(
    argv: Sequence[str],
    gpu_indices: Sequence[int],
    lease_id: str,
    *,
    cpus: int,
    partition: Partition | None = None,
    ib_sysfs: str = IB_SYSFS,
) -> str:
    """The start file of a lease's workload on one node (a bash script the placeholder job runs),
    then ``exec`` of ``argv`` (the rendered profile, quoted with :func:`shlex.join`; never text
    from a site). It exports:

    * ``CUDA_VISIBLE_DEVICES`` = ``gpu_indices`` (the GRES indices Slurm allocated to the lease's
      placeholders on this node), ``GPUPOOL_LEASE_ID``;
    * ``GPUPOOL_CPUS`` and ``OMP_NUM_THREADS`` = ``cpus`` (the profile's ``cpus_per_gpu`` × the
      lease's GPUs on this node: the CPU budget Slurm reserved for it);
    * with a ``partition`` (the lease's InfiniBand isolation; ``None``: nothing of this), the
      knobs that put the workload's IB traffic in it:

      - ``GPUPOOL_IB_PKEY`` and ``UCX_IB_PKEY`` = the P_Key value (``0x0012``, the 15-bit
        partition number): UCX's ``UCX_IB_PKEY`` is "which pkey value to use, between 0 and
        0x7fff" (``auto`` by default: the first valid one with full membership; openucx/ucx
        ``src/uct/ib/base/ib_iface.c``, ``uct_ib_iface_config_table``);
      - ``GPUPOOL_IB_SL``, ``NCCL_IB_SL`` and ``UCX_IB_SL`` = the service level (0..15): NCCL's
        "InfiniBand Service Level" of its queue pairs (default 0; NCCL User Guide, Environment
        Variables), UCX's "InfiniBand: Service level" (``ib_iface.c`` as above);
      - ``NCCL_IB_PKEY`` = the *index* of the partition in the node's P_Key table, found when
        the script runs: NCCL's ``NCCL_IB_PKEY`` is a P_Key table index (default 0; NCCL User
        Guide, Environment Variables; ``NCCL_PARAM(IbPkey, "IB_PKEY", 0)`` in NCCL's
        ``src/transport/net_ib``), the index ``ibv_get_pkey_index(3)`` would return. The first
        port (``<ib_sysfs>/<device>/ports/<port>``, in name order) listing the P_Key, with the
        membership bit 0x8000 masked off, gives its lowest such index; not exported when no
        port lists it (no InfiniBand on the node: NCCL's default, index 0, applies).
    """
    lines = [
        f"export CUDA_VISIBLE_DEVICES={','.join(str(i) for i in sorted(gpu_indices))}",
        f"export GPUPOOL_LEASE_ID={shlex.quote(lease_id)}",
        f"export GPUPOOL_CPUS={int(cpus)} OMP_NUM_THREADS={int(cpus)}",
    ]
    if partition is not None:
        pkey, sl = f"0x{partition.pkey:04x}", int(partition.sl)
        lines += [
            f"export GPUPOOL_IB_PKEY={pkey} UCX_IB_PKEY={pkey}",
            f"export GPUPOOL_IB_SL={sl} NCCL_IB_SL={sl} UCX_IB_SL={sl}",
            "# NCCL_IB_PKEY: the partition's index in this node's P_Key table (membership bit masked)",
            "index=",
            f"for port in {shlex.quote(ib_sysfs)}/*/ports/*; do",
            '    for entry in "$port"/pkeys/*; do',
            '        { read -r value <"$entry"; } 2>/dev/null || continue',
            "        [[ $value =~ ^0x[0-9a-fA-F]{1,4}$ ]] || continue",
            f"        (( (value & 0x7fff) == {pkey} )) || continue",
            "        i=${entry##*/}",
            "        [[ $i =~ ^[0-9]+$ ]] || continue",
            '        if [ -z "$index" ] || (( i < index )); then index=$i; fi',
            "    done",
            '    [ -n "$index" ] && break',
            "done",
            '[ -n "$index" ] && export NCCL_IB_PKEY=$index',
        ]
    lines.append(f"exec {shlex.join(argv)}")
    return "\n".join(lines) + "\n"


def read_term(path: Path) -> float | None:
    """The time (Unix s) a carved placeholder's script got its first SIGTERM, from its term file
    (one decimal number; bash writes ``EPOCHREALTIME`` with the locale's decimal separator);
    ``None`` while the file does not exist. Raises ``ValueError`` on another content."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return float(text.strip().replace(",", "."))
