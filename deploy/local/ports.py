"""Pick free TCP ports on 127.0.0.1 for the local services (deploy/local/*.sh).

Usage: ``python ports.py COUNT [PREFERRED ...]`` prints COUNT port numbers, space separated. The
i-th preferred port (a port kept in a service's state from its last run) is used when it can be
bound now; any other is a fresh ephemeral port from the kernel. All sockets are held open until
every port is chosen, so the ports printed are distinct.

Binding uses ``SO_REUSEADDR`` like the servers themselves (Java's ``ServerSocketChannel`` and
Mosquitto set it), so a port whose last server left only TIME_WAIT connections counts as free.
Exit status 2 with a message on stderr on bad arguments.
"""

from __future__ import annotations

import socket
import sys


def _bind(port: int) -> socket.socket | None:
    """A socket bound to ``127.0.0.1:port`` (0: any free port), or ``None`` if that port is taken."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


def pick(count: int, preferred: list[int]) -> list[int]:
    """``count`` distinct free loopback ports; ``preferred[i]`` is kept for slot i when free.

    Raises ``ValueError`` if ``count`` < 1 or a preferred port is outside 1..65535.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for i in range(count):
            want = preferred[i] if i < len(preferred) else 0
            if want and not 0 < want < 65536:
                raise ValueError(f"port out of range: {want}")
            s = _bind(want) if want and want not in ports else None
            if s is None:
                s = _bind(0)
                if s is None:
                    raise OSError("no free port on 127.0.0.1")
            held.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in held:
            s.close()
    return ports


def main(argv: list[str]) -> int:
    """CLI entry: print the ports of :func:`pick`; 2 on bad arguments."""
    try:
        count = int(argv[0])
        preferred = [int(a) for a in argv[1:] if a]
        print(" ".join(str(p) for p in pick(count, preferred)))
    except (IndexError, ValueError) as e:
        print(f"usage: ports.py COUNT [PREFERRED ...]: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
