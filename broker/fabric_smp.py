"""Read the QoS tables of many ports in one process, with SMPs sent through libibmad; and set a
port's VL arbitration table (what a switch's own management or another SM could do).

``smpquery`` (infiniband-diags) reads one table per process, and ``smpquery sl2vl`` on a switch
port reads the rows of *every* input port (one SMP each: 81 on an 80-port spine). Verifying a
lease's paths that way costs two processes per port. This module is run as one child process per
verification round (``python -m broker.fabric_smp read``): it opens the management port once
(libibmad ``mad_rpc_open_port``, Debian ``libibmad5``, through ctypes) and sends only the SMPs
needed — per port its VL arbitration blocks and the SL2VL rows of the input ports that are on the
lease's paths. It runs under the fabric's environment (``LD_PRELOAD=libumad2sim.so`` and
``IBSIM_SOCKNAME`` on the simulated fabric, nothing on a real one), like the diag commands.
Standard library only.

Formats (InfiniBand Architecture Specification vol. 1, "SLtoVLMappingTable" and
"VLArbitrationTable"):

* SL2VL, attribute 0x0017, modifier ``(input port << 8) | output port`` on a switch (0 on a CA):
  8 bytes, SL 2i in the high nibble of byte i, SL 2i+1 in its low nibble;
* VL arbitration, attribute 0x0018, modifier ``(block << 16) | port`` (block 1: low-priority
  entries 0..31, 3: high-priority 0..31): 32 entries of 2 bytes, the VL in the low nibble of the
  first, the weight (64-byte units) in the second.

CLI::

    python -m broker.fabric_smp read < requests.json     # JSON answers on stdout
    python -m broker.fabric_smp set-vlarb LID PORT low|high VL:WEIGHT[,VL:WEIGHT...]

A request is ``{"lid": 5, "port": 7, "in_ports": [1, 2]}`` (a switch's output port and the input
ports whose rows to read) or ``{"lid": 3, "port": null}`` (a CA port); the answer to each is
``{"sl2vl": {"<in port>": [16 VLs]}, "low": [[vl, weight], ...], "high": [...]}`` (weight-0
entries left out) or ``{"error": "..."}``. Exit status 0 when the port could be opened (per-port
errors are in the answers), 1 otherwise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import sys
from typing import Any

ATTR_SL2VL = 0x17
ATTR_VLARB = 0x18
_CLASSES = (0x01, 0x81, 0x03)  # SMI, directed-route SMI, SA
VLARB_BLOCKS = {"low": 1, "high": 3}
"""VL arbitration table → the attribute-modifier block of its entries 0..31."""


class SmpPort:
    """The local management port, opened through libibmad (``mad_rpc_open_port``).

    Raises ``OSError`` when libibmad cannot be loaded or the port cannot be opened.
    """

    def __init__(self) -> None:
        self._mad = ctypes.CDLL(ctypes.util.find_library("ibmad") or "libibmad.so.5")
        self._mad.mad_rpc_open_port.restype = ctypes.c_void_p
        self._mad.mad_rpc_open_port.argtypes = [
            ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int,
        ]  # fmt: skip
        for fn in (self._mad.smp_query_via, self._mad.smp_set_via):
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_uint] * 3 + [ctypes.c_void_p]
        classes = (ctypes.c_int * len(_CLASSES))(*_CLASSES)
        self._src = self._mad.mad_rpc_open_port(None, 0, classes, len(_CLASSES))
        if not self._src:
            raise OSError("mad_rpc_open_port failed: no management port")

    def close(self) -> None:
        """Close the port (idempotent)."""
        if self._src:
            self._mad.mad_rpc_close_port(ctypes.c_void_p(self._src))
            self._src = None

    def _portid(self, lid: int) -> ctypes.Array[ctypes.c_char]:
        # ib_portid_t (mad.h) starts with "int lid"; the rest zero: LID-routed, no GRH, QP 0
        portid = ctypes.create_string_buffer(512)
        ctypes.c_int.from_buffer(portid).value = lid
        return portid

    def query(self, lid: int, attr: int, mod: int) -> bytes:
        """The 64 data bytes of SMP Get(``attr``, ``mod``) to ``lid``. Raises ``RuntimeError``
        when no answer comes."""
        buf = ctypes.create_string_buffer(64)
        if not self._mad.smp_query_via(buf, self._portid(lid), attr, mod, 0, self._src):
            raise RuntimeError(f"no answer to SMP 0x{attr:04x} mod 0x{mod:x} from lid {lid}")
        return buf.raw

    def set(self, lid: int, attr: int, mod: int, data: bytes) -> None:
        """SMP Set(``attr``, ``mod``) of ``data`` (64 bytes) to ``lid``. Raises ``RuntimeError``."""
        buf = ctypes.create_string_buffer(bytes(data[:64]).ljust(64, b"\0"), 64)
        if not self._mad.smp_set_via(buf, self._portid(lid), attr, mod, 0, self._src):
            raise RuntimeError(f"no answer to SMP Set 0x{attr:04x} mod 0x{mod:x} from lid {lid}")


def decode_sl2vl(data: bytes) -> list[int]:
    """VL of SL 0..15 from an SL2VL attribute's 8 bytes (module docstring)."""
    return [v for b in data[:8] for v in (b >> 4, b & 0xF)]


def decode_vlarb(data: bytes) -> list[list[int]]:
    """``[vl, weight]`` entries of a VL arbitration block, weight-0 entries left out."""
    return [[data[i] & 0xF, data[i + 1]] for i in range(0, 64, 2) if data[i + 1]]


def encode_vlarb(entries: list[tuple[int, int]]) -> bytes:
    """A VL arbitration block of ``entries`` ((vl, weight), at most 32), zero-filled. Raises
    ``ValueError`` for too many entries or one out of range."""
    if len(entries) > 32:
        raise ValueError("at most 32 entries per block")
    out = bytearray(64)
    for i, (vl, weight) in enumerate(entries):
        if not (0 <= vl <= 15 and 0 <= weight <= 255):
            raise ValueError(f"entry {vl}:{weight} out of range")
        out[2 * i], out[2 * i + 1] = vl, weight
    return bytes(out)


def read_tables(port: SmpPort, request: dict[str, Any]) -> dict[str, Any]:
    """The answer to one request (module docstring); errors are answered, not raised."""
    try:
        lid = int(request["lid"])
        out_port = request.get("port")
        answer: dict[str, Any] = {"sl2vl": {}}
        if out_port is None:
            answer["sl2vl"]["0"] = decode_sl2vl(port.query(lid, ATTR_SL2VL, 0))
        else:
            for inp in request.get("in_ports") or [0]:
                mod = (int(inp) << 8) | int(out_port)
                answer["sl2vl"][str(inp)] = decode_sl2vl(port.query(lid, ATTR_SL2VL, mod))
        for table, block in VLARB_BLOCKS.items():
            answer[table] = decode_vlarb(port.query(lid, ATTR_VLARB, (block << 16) | int(out_port or 0)))
        return answer
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        return {"error": str(e)}


def main(argv: list[str] | None = None) -> int:
    """CLI (module docstring)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        port = SmpPort()
    except OSError as e:
        sys.stderr.write(f"fabric_smp: {e}\n")
        return 1
    try:
        if args[:1] == ["read"]:
            requests = json.load(sys.stdin)
            json.dump([read_tables(port, r) for r in requests], sys.stdout)
            return 0
        if len(args) == 5 and args[0] == "set-vlarb" and args[3] in VLARB_BLOCKS:
            entries = [(int(v, 0), int(w, 0)) for v, w in (e.split(":") for e in args[4].split(","))]
            port.set(int(args[1]), ATTR_VLARB, (VLARB_BLOCKS[args[3]] << 16) | int(args[2]), encode_vlarb(entries))
            return 0
        sys.stderr.write("usage: python -m broker.fabric_smp read < requests.json | set-vlarb LID PORT low|high VL:W,...\n")
        return 2
    except (OSError, RuntimeError, ValueError) as e:
        sys.stderr.write(f"fabric_smp: {e}\n")
        return 1
    finally:
        port.close()


if __name__ == "__main__":
    raise SystemExit(main())
