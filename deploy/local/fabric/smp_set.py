"""Change a port's VL arbitration table directly with an SMP Set, the way a switch's own
management (or another subnet manager) would: "behind the subnet manager's back".

infiniband-diags reads these tables (``smpquery vlarb``) but has no command that writes them, so
this sends the ``Set(VLArbitrationTable)`` through libibmad (``smp_set_via``; Debian
``libibmad5``) with ctypes. Under ``LD_PRELOAD=libumad2sim.so`` and ``IBSIM_SOCKNAME`` (from
``fabric.json`` "env") it reaches ibsim; OpenSM does not notice (it re-programs a table only when
its own configuration changes), which is what a drift audit must catch.

Format (InfiniBand Architecture Specification vol. 1, "VLArbitrationTable"): attribute 0x0018,
modifier ``(block << 16) | port`` (block 1: low-priority entries 0..31, 3: high-priority 0..31);
32 entries of 2 bytes: VL in the low 4 bits of the first byte, weight (64-byte units) in the second.

CLI (run it with the fabric's environment and a writable working directory)::

    smp_set.py vlarb LID PORT low|high VL:WEIGHT[,VL:WEIGHT...]

Exit status 0 when the Set was answered, 1 otherwise (the error on stderr). Standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import sys

ATTR_VL_ARBITRATION = 0x18
_CLASSES = (0x01, 0x81, 0x03)  # SMI, directed-route SMI, SA
_BLOCKS = {"low": 1, "high": 3}


def set_vlarb(lid: int, port: int, table: str, entries: list[tuple[int, int]]) -> None:
    """Write ``entries`` ((vl, weight), at most 32) as the first block of ``table`` (``low`` or
    ``high``) of ``port`` of the node at ``lid``; the other entries of the block become (0, 0).

    Raises ``OSError`` when libibmad cannot be loaded or the port opened, ``RuntimeError`` when
    the query or the Set gets no answer, ``ValueError`` for bad entries.
    """
    if table not in _BLOCKS or len(entries) > 32:
        raise ValueError("table must be low or high, with at most 32 entries")
    name = ctypes.util.find_library("ibmad") or "libibmad.so.5"
    mad = ctypes.CDLL(name)
    mad.mad_rpc_open_port.restype = ctypes.c_void_p
    mad.mad_rpc_open_port.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    for fn in (mad.smp_query_via, mad.smp_set_via):
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
    classes = (ctypes.c_int * len(_CLASSES))(*_CLASSES)
    src = mad.mad_rpc_open_port(None, 0, classes, len(_CLASSES))
    if not src:
        raise OSError("mad_rpc_open_port failed")
    try:
        # ib_portid_t (mad.h): "int lid" first; the rest zero = LID-routed, no GRH, QP 0
        portid = ctypes.create_string_buffer(512)
        ctypes.c_int.from_buffer(portid).value = lid
        mod = (_BLOCKS[table] << 16) | port
        buf = ctypes.create_string_buffer(64)
        if not mad.smp_query_via(buf, portid, ATTR_VL_ARBITRATION, mod, 0, src):
            raise RuntimeError(f"VLArbitrationTable query of lid {lid} port {port} got no answer")
        data = bytearray(64)
        for i, (vl, weight) in enumerate(entries):
            if not (0 <= vl <= 15 and 0 <= weight <= 255):
                raise ValueError(f"entry {vl}:{weight} out of range")
            data[2 * i], data[2 * i + 1] = vl, weight
        ctypes.memmove(buf, bytes(data), 64)
        if not mad.smp_set_via(buf, portid, ATTR_VL_ARBITRATION, mod, 0, src):
            raise RuntimeError(f"VLArbitrationTable Set of lid {lid} port {port} got no answer")
    finally:
        mad.mad_rpc_close_port(ctypes.c_void_p(src))


def main(argv: list[str] | None = None) -> int:
    """CLI (module docstring)."""
    ap = argparse.ArgumentParser(description="set a port's VL arbitration table with an SMP Set")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("vlarb")
    p.add_argument("lid", type=int)
    p.add_argument("port", type=int)
    p.add_argument("table", choices=sorted(_BLOCKS))
    p.add_argument("entries", help="VL:WEIGHT[,VL:WEIGHT...]")
    args = ap.parse_args(argv)
    try:
        entries = [(int(v, 0), int(w, 0)) for v, w in (e.split(":") for e in args.entries.split(","))]
        set_vlarb(args.lid, args.port, args.table, entries)
    except (OSError, RuntimeError, ValueError) as e:
        sys.stderr.write(f"smp_set: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
