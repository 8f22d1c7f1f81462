"""Wait until OpenSM has brought the simulated fabric up, then write ``fabric.json``.

Used by ``deploy/local/fabric.sh start``. "Up" means, read from the fabric itself through
infiniband-diags under libumad2sim:

1. ``sminfo`` reports an SM in state ``SMINFO_MASTER``;
2. ``iblinkinfo -l`` shows every expected port ``Active/ LinkUp`` (2 × links of the generated
   topology), i.e. the SM has assigned LIDs and armed/activated every link;
3. ``ibnetdiscover -p`` shows every generated node with a LID.

``fabric.json`` (read by tests, the fabric collector and the fabric manager)::

    {"state_dir", "sockname", "env": {"IBSIM_SOCKNAME", "LD_PRELOAD"}, "workdir",
     "net_file", "console_fifo", "ibsim_out", "opensm_conf", "opensm_log",
     "partitions_conf", "qos_policy_conf", "sm": {"lid", "guid"}, "links", "ready_seconds",
     "nodes": {"<nodeid>": {"description", "kind", "role", "leaf", "node_guid", "port_guid", "lid"}}}

For HCAs ``port_guid`` is port 1's GUID (ibsim: node GUID + 1; ``ibnetdiscover -p`` prints this
one); for switches it equals ``node_guid`` (port 0). Only the standard library is used.

CLI: ``fabric_state.py --dir STATE wait --timeout 60`` (exit 1 with a diagnosis on timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

_SMINFO = re.compile(r"sm lid (\d+) sm guid (0x[0-9a-fA-F]+).*SMINFO_MASTER")
_PORTS_LINE = re.compile(r"^(SW|CA|RT)\s+(\d+)\s+(\d+)\s+(0x[0-9a-fA-F]+)\s")


def _run(args: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> str:
    """Run a diag command; return stdout ("" on failure or timeout: the caller polls again)."""
    try:
        done = subprocess.run(
            args, check=False, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s
        )
    except (subprocess.TimeoutExpired, OSError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def wait_ready(state_dir: Path, timeout_s: float) -> dict[str, object]:
    """Poll until the fabric in ``state_dir`` is up (see module docstring); return ``fabric.json``'s content.

    Raises:
        TimeoutError: not up within ``timeout_s``; the message says which check failed last.
    """
    meta = json.loads((state_dir / "meta.json").read_text())
    topo = json.loads((state_dir / "topology.json").read_text())
    env = {**os.environ, **meta["env"]}
    workdir = Path(meta["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    nodes = topo["nodes"]
    expected_active = sum(len(n["links"]) for n in nodes)  # each link counted from both ends
    t0 = time.monotonic()
    last = "no check ran"
    while True:
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"fabric not up after {timeout_s:.0f}s: {last}")
        sm = _SMINFO.search(_run(["sminfo"], env, workdir, 10))
        if not sm:
            last = "sminfo does not report a MASTER SM"
            time.sleep(0.5)
            continue
        active = _run(["iblinkinfo", "-l"], env, workdir, 60).count(" Active/")
        if active != expected_active:
            last = f"iblinkinfo: {active} of {expected_active} ports Active"
            time.sleep(0.5)
            continue
        lids: dict[str, int] = {}
        for line in _run(["ibnetdiscover", "-p"], env, workdir, 60).splitlines():
            m = _PORTS_LINE.match(line)
            if m:
                lids[f"0x{int(m.group(4), 16):016x}"] = int(m.group(2))
        out_nodes: dict[str, dict[str, object]] = {}
        missing = []
        for n in nodes:
            node_guid = int(n["guid"], 16)
            port_guid = f"0x{node_guid + (1 if n['kind'] == 'hca' else 0):016x}"
            lid = lids.get(port_guid, 0)
            if lid == 0:
                missing.append(n["nodeid"])
            out_nodes[n["nodeid"]] = {
                "description": n["description"],
                "kind": n["kind"],
                "role": n["role"],
                "leaf": n["leaf"],
                "node_guid": n["guid"],
                "port_guid": port_guid,
                "lid": lid,
            }
        if missing:
            last = f"ibnetdiscover: no LID for {len(missing)} nodes, e.g. {missing[:3]}"
            time.sleep(0.5)
            continue
        return {
            **meta,
            "sm": {"lid": int(sm.group(1)), "guid": f"0x{int(sm.group(2), 16):016x}"},
            "links": expected_active // 2,
            "ready_seconds": round(time.monotonic() - t0, 3),
            "nodes": out_nodes,
        }


def main(argv: list[str] | None = None) -> int:
    """CLI: ``wait`` writes ``fabric.json`` once the fabric is up; exit 1 on timeout."""
    ap = argparse.ArgumentParser(description="wait for the simulated fabric, write fabric.json")
    ap.add_argument("--dir", type=Path, required=True, help="fabric state dir")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_wait = sub.add_parser("wait")
    p_wait.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    try:
        state = wait_ready(args.dir, args.timeout)
    except TimeoutError as exc:
        sys.stderr.write(f"fabric: {exc}\n")
        return 1
    tmp = args.dir / "fabric.json.tmp"
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.replace(args.dir / "fabric.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
