"""Talk to a running ibsim's console (started by ``deploy/local/fabric.sh``); reap dead clients.

ibsim reads console commands on its stdin and answers on its stdout, ending every answer with a
``sim> `` prompt. ``fabric.sh`` starts it as ``ibsim -s net <>console.fifo >ibsim.out``: stdin is
the FIFO opened read-write, so ibsim itself holds a writer and never reads EOF (a closed stdin
makes ibsim's ``select`` loop spin at 100 % CPU). Anyone may write a command line to the FIFO;
this module also reads the answer back from ``ibsim.out``, under a lock so that concurrent callers
get their own answer.

Console commands (ibsim 0.10 ``help``; handles are the net file's node ids, e.g. ``"leaf-2"``)::

    PerformanceSet "leaf-2"[3] PortCountersExtended.PortXmitData=1152921504606859191
    PerformanceSet "leaf-2"[3] PortCounters.PortXmitWait=1000
    Unlink "node016"[1]        ReLink "node016"[1]        Attached        X <client>

ibsim serves at most 10 clients (``IBSIM_MAX_CLIENTS``); a client process that dies without
running its ``atexit`` handler (SIGKILL, SIGTERM, a timeout kill) keeps its slot forever. The
reaper (:meth:`IbsimConsole.reap`, ``console.py reap-loop``) lists ``Attached`` clients and
disconnects (``X <n>``) those whose pid is gone.

CLI::

    console.py [--dir STATE_DIR] send 'PerformanceSet "leaf-1"[1] PortCounters.PortXmitWait=5'
    console.py [--dir STATE_DIR] reap | reap-loop [--interval 2]

``STATE_DIR`` defaults to ``$GPUPOOL_FABRIC_DIR`` or ``${GPUPOOL_STATE:-<repo>/.state}/fabric``.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROMPT = "sim> "
_ATTACHED = re.compile(r"^Client (\d+): pid (\d+) connected", re.MULTILINE)


class ConsoleError(RuntimeError):
    """ibsim is not running, did not answer in time, or refused the command."""


def default_state_dir() -> Path:
    """``$GPUPOOL_FABRIC_DIR``, else ``${GPUPOOL_STATE:-<repo>/.state}/fabric``."""
    explicit = os.environ.get("GPUPOOL_FABRIC_DIR")
    if explicit:
        return Path(explicit)
    repo = Path(__file__).resolve().parents[3]
    return Path(os.environ.get("GPUPOOL_STATE") or repo / ".state") / "fabric"


@dataclass(frozen=True)
class AttachedClient:
    """One ``Attached`` line: ibsim client slot ``client`` held by process ``pid``."""

    client: int
    pid: int


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (an unreaped child still answers ``kill -0``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    # state is the field after the parenthesised command name
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


class IbsimConsole:
    """The console of the ibsim whose state lives in ``state_dir`` (``console.fifo``, ``ibsim.out``).

    Raises :class:`ConsoleError` from every method when ibsim is not there or does not answer.
    """

    def __init__(self, state_dir: Path | str | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir()
        self.fifo = self.state_dir / "console.fifo"
        self.out = self.state_dir / "ibsim.out"
        self._lock_path = self.state_dir / "console.lock"

    def send(self, command: str, timeout_s: float = 5.0) -> str:
        """Run one console ``command``; return ibsim's answer (text before the next prompt).

        Raises:
            ConsoleError: no FIFO / ibsim not reading it, or no prompt within ``timeout_s``.
            ValueError: ``command`` contains a newline.
        """
        if "\n" in command:
            raise ValueError("one command per call")
        try:
            with open(self._lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                return self._send_locked(command, timeout_s)
        except FileNotFoundError as exc:
            raise ConsoleError(f"no fabric state in {self.state_dir}: {exc.strerror}") from exc

    def _send_locked(self, command: str, timeout_s: float) -> str:
        try:
            start = self.out.stat().st_size
        except OSError as exc:
            raise ConsoleError(f"no ibsim output file {self.out}") from exc
        try:
            fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # ENXIO: nobody has the FIFO open for reading
            raise ConsoleError(f"ibsim is not reading {self.fifo}: {exc.strerror}") from exc
        try:
            os.write(fd, (command + "\n").encode())
        finally:
            os.close(fd)
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            with open(self.out, "rb") as fh:
                fh.seek(start)
                text = fh.read().decode(errors="replace")
            if text.endswith(PROMPT):
                return text[: -len(PROMPT)].strip("\n")
            time.sleep(0.005)
        raise ConsoleError(f"no answer to {command!r} within {timeout_s}s (got {text[-200:]!r})")

    def performance_set(self, nodeid: str, port: int, attribute: str, field: str, value: int) -> None:
        """Set a PMA counter: ``PerformanceSet "nodeid"[port] attribute.field=value``.

        ``attribute`` is ``PortCounters`` or ``PortCountersExtended`` (ibsim ``sim_cmd.c``);
        ``field`` a PMA counter name (``PortXmitData``, ``PortXmitWait``...).

        Raises:
            ConsoleError: ibsim did not confirm ("... has been set to ...").
        """
        answer = self.send(f'PerformanceSet "{nodeid}"[{port}] {attribute}.{field}={value}')
        if "has been set to" not in answer:
            raise ConsoleError(f"PerformanceSet refused: {answer!r}")

    def unlink(self, nodeid: str, port: int) -> str:
        """Take the link at ``nodeid[port]`` down (both ends); returns ibsim's answer."""
        return self.send(f'Unlink "{nodeid}"[{port}]')

    def relink(self, nodeid: str, port: int) -> str:
        """Restore a link taken down by :meth:`unlink`; returns ibsim's answer."""
        return self.send(f'ReLink "{nodeid}"[{port}]')

    def attached(self) -> list[AttachedClient]:
        """The clients ibsim has attached now (``Attached``)."""
        return [AttachedClient(int(c), int(p)) for c, p in _ATTACHED.findall(self.send("Attached"))]

    def reap(self) -> list[AttachedClient]:
        """Disconnect (``X <n>``) every attached client whose process is gone; return them.

        Also removes the ``sys-<pid>`` trees that killed clients left in the state directory's
        ``work/`` and ``opensm/`` (libumad2sim removes its tree only in an ``atexit`` handler).
        """
        dead = [c for c in self.attached() if not _pid_alive(c.pid)]
        for c in dead:
            self.send(f"X {c.client}")
        for sub in ("work", "opensm"):
            for tree in (self.state_dir / sub).glob("sys-*"):
                pid = tree.name[4:]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    shutil.rmtree(tree, ignore_errors=True)
        return dead


def main(argv: list[str] | None = None) -> int:
    """CLI: ``send``, ``reap``, ``reap-loop``. Exit 1 on :class:`ConsoleError`."""
    ap = argparse.ArgumentParser(description="ibsim console for the gpupool simulated fabric")
    ap.add_argument("--dir", type=Path, default=None, help="fabric state dir")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_send = sub.add_parser("send", help="run one console command, print the answer")
    p_send.add_argument("words", nargs="+")
    p_send.add_argument("--timeout", type=float, default=5.0)
    sub.add_parser("reap", help="disconnect clients whose process is gone")
    p_loop = sub.add_parser("reap-loop", help="reap every --interval seconds until ibsim goes away")
    p_loop.add_argument("--interval", type=float, default=2.0)
    args = ap.parse_args(argv)
    con = IbsimConsole(args.dir)
    try:
        if args.cmd == "send":
            sys.stdout.write(con.send(" ".join(args.words), args.timeout) + "\n")
        elif args.cmd == "reap":
            for c in con.reap():
                sys.stdout.write(f"reaped client {c.client} (pid {c.pid})\n")
        else:
            while True:
                for c in con.reap():
                    sys.stdout.write(f"reaped client {c.client} (pid {c.pid})\n")
                    sys.stdout.flush()
                time.sleep(args.interval)
    except ConsoleError as exc:
        sys.stderr.write(f"console: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
