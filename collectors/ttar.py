"""Reader for ``ttar``, the plain-text tar that prometheus/procfs and node_exporter keep their
sysfs fixtures in.

Format (ideaship/ttar; summarised in ``../shared/data/README.md``): blocks separated by lines
starting ``# ttar - - -``; a block is ``Directory: <path>`` + ``Mode: <octal>``, or
``Path: <path>`` + ``Lines: <n>`` + ``n`` content lines + ``Mode: <octal>``, or ``Path: <path>`` +
``SymlinkTo: <target>``. A content line ending in ``EOF`` is the file's last line and has no
final newline; ``NULLBYTE`` in content stands for a NUL byte.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

_SEPARATOR = "# ttar - "


class TtarError(ValueError):
    """A malformed ttar archive; the message names the line."""


@dataclass(frozen=True, slots=True)
class TtarEntry:
    """One archive member.

    Attributes:
        kind: ``dir``, ``file`` or ``symlink``.
        path: relative POSIX path inside the archive.
        content: file bytes (``b""`` for directories and symlinks).
        mode: permission bits (``None`` when the block gives none, e.g. symlinks).
        target: symlink target (``None`` otherwise).
    """

    kind: Literal["dir", "file", "symlink"]
    path: str
    content: bytes = b""
    mode: int | None = None
    target: str | None = None


def parse_ttar(text: str) -> list[TtarEntry]:
    """Parse a ttar archive's text into its entries, in archive order.

    Raises:
        TtarError: a block that is none of the three forms, a bad ``Lines:``/``Mode:`` value, too
            few content lines, or an absolute or ``..`` path.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    entries: list[TtarEntry] = []
    i = 0
    n = len(lines)
    while i < n:
        line = lines[i]
        if line.startswith(_SEPARATOR) or line == "":
            i += 1
            continue
        if line.startswith("Directory: "):
            path = _safe(line[len("Directory: ") :], i)
            mode, i = _mode(lines, i + 1)
            entries.append(TtarEntry("dir", path, mode=mode))
        elif line.startswith("Path: "):
            path = _safe(line[len("Path: ") :], i)
            nxt = lines[i + 1] if i + 1 < n else ""
            if nxt.startswith("SymlinkTo: "):
                entries.append(TtarEntry("symlink", path, target=nxt[len("SymlinkTo: ") :]))
                i += 2
            elif nxt.startswith("Lines: "):
                count = _int(nxt[len("Lines: ") :], i + 1)
                body = lines[i + 2 : i + 2 + count]
                if len(body) != count:
                    raise TtarError(f"line {i + 1}: {path} wants {count} lines, archive ends")
                mode, i = _mode(lines, i + 2 + count)
                entries.append(TtarEntry("file", path, _content(body), mode))
            else:
                raise TtarError(f"line {i + 2}: expected 'Lines:' or 'SymlinkTo:' after {line!r}")
        else:
            raise TtarError(f"line {i + 1}: unexpected {line[:60]!r}")
    return entries


def _content(body: list[str]) -> bytes:
    if not body:
        return b""
    text = "\n".join(body)
    if text.endswith("EOF"):
        text = text[:-3]
    else:
        text += "\n"
    return text.replace("NULLBYTE", "\0").encode()


def _mode(lines: list[str], i: int) -> tuple[int | None, int]:
    """Read an optional ``Mode:`` line at ``i``; return the mode and the next index."""
    if i < len(lines) and lines[i].startswith("Mode: "):
        text = lines[i][len("Mode: ") :].strip()
        try:
            return int(text, 8), i + 1
        except ValueError:
            raise TtarError(f"line {i + 1}: bad mode {text!r}") from None
    return None, i


def _int(text: str, i: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TtarError(f"line {i + 1}: bad line count {text!r}") from None
    if value < 0:
        raise TtarError(f"line {i + 1}: negative line count")
    return value


def _safe(path: str, i: int) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise TtarError(f"line {i + 1}: unsafe path {path!r}")
    return str(p)


def extract_ttar(archive: Path, dest: Path) -> list[TtarEntry]:
    """Write the members of ``archive`` under ``dest`` (created if missing); return them.

    File modes are applied to files only; directories stay writable so that the tree can be
    removed again. Symlinks are created as written.

    Raises:
        TtarError: malformed archive (nothing is written).
        OSError: ``dest`` cannot be written.
    """
    entries = parse_ttar(archive.read_text(encoding="utf-8"))
    dest.mkdir(parents=True, exist_ok=True)
    for e in entries:
        target = dest / e.path
        if e.kind == "dir":
            target.mkdir(parents=True, exist_ok=True)
        elif e.kind == "file":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(e.content)
            if e.mode is not None:
                os.chmod(target, e.mode)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(e.target or "", target)
    return entries


@contextlib.contextmanager
def materialize_ttar(archive: Path) -> Iterator[Path]:
    """Extract ``archive`` into a new temporary directory, yield it, and delete it afterwards.

    Raises:
        TtarError: malformed archive.
    """
    with tempfile.TemporaryDirectory(prefix="gpupool-ttar-") as tmp:
        root = Path(tmp)
        extract_ttar(archive, root)
        yield root
