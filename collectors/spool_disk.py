"""The disk tier of :mod:`collectors.spool`: an append-only log of records in segment files.

Format (this module's own; version 1). A folder of segment files ``<id>.seg`` (``id`` a signed
integer; segments are read in numeric order; a segment is rolled at ``segment_bytes``), each a
sequence of frames::

    frame  := u32 body_length | u32 crc32(body) | body                  (big-endian; zlib CRC-32)
    body   := u8 version(=1) | u16 len | topic (UTF-8)
              | i32 len | key (UTF-8; len -1 = no key)
              | u16 count | count × (u16 len | header name (UTF-8) | u32 len | header value)
              | i32 len | value (len -1 = tombstone)

and ``cursor.json`` (replaced atomically: written to a temporary file, then ``os.replace``)
holding the read position ``{"segment", "offset"}``, the count of head records that may already
be on the bus (``"suspect"``) and the end of the unit being handed to the bus
(``"handed_segment"``, ``"handed_end"``). A fully consumed segment is deleted; an empty spool
leaves no segment behind.

fsync policy. Each frame is written with one unbuffered ``write(2)``: once
:meth:`DiskSpool.append` returned, a crash of the *process* loses nothing. Segment files and the
folder are ``fsync``-ed by :func:`sync_paths` (the owner calls it every ``fsync_interval_s``, in a
worker thread, and at stop): a crash of the *machine* loses at most the writes since the last
fsync. A torn frame at the end of a segment is found by its length or CRC at the next
:meth:`DiskSpool.open`, cut off and reported. The cursor is not fsync-ed: after a power loss it
may be older than the acknowledged position, and those records are read again.
"""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Version byte of every frame body."""
_FRAME_HEAD = struct.Struct(">II")  # body length, CRC-32 of the body
_U8, _U16, _U32, _I32 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">i")
_SEGMENT_SUFFIX = ".seg"
_CURSOR = "cursor.json"


class SpoolRecord(NamedTuple):
    """One queued record; ``size`` approximates its bytes in memory (payload, key, topic,
    headers, plus 16)."""

    topic: str
    value: bytes | None
    key: str | None
    headers: tuple[tuple[str, bytes], ...]
    size: int


def make_record(
    topic: str, value: bytes | None, key: str | None, headers: Sequence[tuple[str, bytes]] = ()
) -> SpoolRecord:
    """A :class:`SpoolRecord` (headers copied to ``(str, bytes)`` tuples).

    Raises:
        ValueError: the topic or a header name is longer than a frame holds (65,535 bytes).
    """
    hdrs = tuple((str(k), bytes(v)) for k, v in headers) if headers else ()
    for name in (topic, *(k for k, _ in hdrs)):
        if len(name) > 0x3FFF and len(name.encode()) > 0xFFFF:
            raise ValueError(f"name of {len(name.encode())} bytes: a frame holds at most 65535")
    size = len(topic) + (len(value) if value is not None else 0) + (len(key) if key is not None else 0)
    size += sum(len(k) + len(v) for k, v in hdrs) + 16
    return SpoolRecord(topic, value, key, hdrs, size)


def encode_frame(rec: SpoolRecord) -> bytes:
    """The frame of one record (format in the module docstring)."""
    topic = rec.topic.encode()
    parts = [_U8.pack(FORMAT_VERSION), _U16.pack(len(topic)), topic]
    if rec.key is None:
        parts.append(_I32.pack(-1))
    else:
        key = rec.key.encode()
        parts += [_I32.pack(len(key)), key]
    parts.append(_U16.pack(len(rec.headers)))
    for name, val in rec.headers:
        n = name.encode()
        parts += [_U16.pack(len(n)), n, _U32.pack(len(val)), val]
    if rec.value is None:
        parts.append(_I32.pack(-1))
    else:
        parts += [_I32.pack(len(rec.value)), rec.value]
    body = b"".join(parts)
    return _FRAME_HEAD.pack(len(body), zlib.crc32(body)) + body


class CorruptFrameError(ValueError):
    """A frame whose version or inner lengths do not add up (though its CRC matched)."""


def decode_body(body: bytes) -> SpoolRecord:
    """Inverse of the body part of :func:`encode_frame` (the frame less its 8-byte head).

    Raises:
        CorruptFrameError: a wrong version, lengths that do not add up, or bad UTF-8.
    """
    try:
        (version,) = _U8.unpack_from(body, 0)
        if version != FORMAT_VERSION:
            raise CorruptFrameError(f"frame version {version}")
        (n,) = _U16.unpack_from(body, 1)
        pos = 3
        topic = body[pos : pos + n].decode()
        pos += n
        (n,) = _I32.unpack_from(body, pos)
        pos += 4
        key = None
        if n >= 0:
            key = body[pos : pos + n].decode()
            pos += n
        (count,) = _U16.unpack_from(body, pos)
        pos += 2
        headers = []
        for _ in range(count):
            (n,) = _U16.unpack_from(body, pos)
            name = body[pos + 2 : pos + 2 + n].decode()
            pos += 2 + n
            (n,) = _U32.unpack_from(body, pos)
            headers.append((name, body[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        (n,) = _I32.unpack_from(body, pos)
        pos += 4
        value = None
        if n >= 0:
            value = body[pos : pos + n]
            pos += n
    except (struct.error, UnicodeDecodeError) as e:
        raise CorruptFrameError(str(e)) from e
    if pos != len(body) or (value is not None and len(value) != n):
        raise CorruptFrameError("frame length mismatch")
    return make_record(topic, value, key, headers)


def scan_frames(data: bytes | memoryview, start: int = 0) -> tuple[list[tuple[int, int]], int, bool]:
    """``(frames as (body_offset, body_length), end of the last whole frame, corrupt)`` of
    ``data`` from ``start``; ``corrupt`` is set when a frame's CRC does not match (a short tail is
    just the end)."""
    frames: list[tuple[int, int]] = []
    pos, end = start, len(data)
    while pos + _FRAME_HEAD.size <= end:
        length, crc = _FRAME_HEAD.unpack_from(data, pos)
        body_at = pos + _FRAME_HEAD.size
        if body_at + length > end:
            break
        if zlib.crc32(data[body_at : body_at + length]) != crc:
            return frames, pos, True
        frames.append((body_at, length))
        pos = body_at + length
    return frames, pos, False


@dataclass(slots=True)
class _Segment:
    id: int
    path: Path
    size: int  # bytes in the file
    records: int  # records not yet consumed


@dataclass(slots=True)
class DiskUnit:
    """Records read from the head segment: ``ends[i]`` is the offset just past record ``i``."""

    segment: int
    ends: list[int]


class DiskSpool:
    """The on-disk tier: segment files and a cursor (see the module docstring). Not thread-safe:
    used from the event loop thread; only :meth:`sync` runs in a worker thread (on paths)."""

    def __init__(self, directory: Path, max_bytes: int, segment_bytes: int) -> None:
        self.dir = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self._segs: dict[int, _Segment] = {}
        self._order: deque[int] = deque()  # segment ids, oldest first
        self._head_off = 0
        self._next_id = 0
        self._writer: tuple[int, io.FileIO] | None = None  # (segment id, unbuffered file)
        self._reader: tuple[int, io.BufferedReader] | None = None
        self._handed: tuple[int, int] | None = None
        self._dirty: set[Path] = set()
        self._dir_dirty = False
        self.records = 0
        self.bytes = 0
        self.suspect = 0

    # --- recovery -------------------------------------------------------------------------------
    def open(self) -> int:
        """Create the folder or resume what is in it. Returns how many torn or corrupt frames
        were cut off. Raises ``OSError`` if the folder cannot be created or read."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a prepend or cursor write that did not finish
        ids = sorted(
            int(p.name[: -len(_SEGMENT_SUFFIX)])
            for p in self.dir.glob(f"*{_SEGMENT_SUFFIX}")
            if _is_int(p.name[: -len(_SEGMENT_SUFFIX)])
        )
        cursor = self._load_cursor()
        head_id, head_off = ids[0] if ids else 0, 0
        handed: tuple[int, int] | None = None
        suspect = 0
        if cursor is not None and cursor["segment"] in ids:
            head_id, head_off = cursor["segment"], cursor["offset"]
            suspect = cursor["suspect"]
            if cursor["handed_segment"] == head_id:
                handed = (head_id, cursor["handed_end"])
        elif cursor is not None and ids:
            # The cursor's segment is gone: it was consumed and deleted before the cursor moved
            # on, so every later segment is unread (and if none is later, every one is re-read:
            # duplicates rather than a loss).
            head_id = min((i for i in ids if i > cursor["segment"]), default=ids[0])
        corrupt = 0
        for sid in ids:
            path = self.dir / f"{sid}{_SEGMENT_SUFFIX}"
            if sid < head_id:
                path.unlink(missing_ok=True)  # consumed; its deletion was interrupted
                continue
            data = path.read_bytes()
            start = head_off if sid == head_id else 0
            if start > len(data):
                start = len(data)
            frames, end, bad = scan_frames(data, start)
            if bad or end != len(data):
                corrupt += 1
                log.error("spool_segment_cut", extra={"segment": str(path), "at": end, "size": len(data)})
                with open(path, "r+b") as f:
                    f.truncate(end)
            seg = _Segment(sid, path, end, len(frames))
            if handed is not None and handed[0] == sid:
                suspect = max(suspect, sum(1 for off, _ in frames if off < handed[1]))
            self._segs[sid] = seg
            self._order.append(sid)
            self.records += seg.records
            self.bytes += seg.size
        self._next_id = (ids[-1] + 1) if ids else 0
        if self._order and self._order[0] == head_id:
            self._head_off = min(head_off, self._segs[head_id].size)
        self.suspect = min(suspect, self.records)
        if self.records == 0:
            self._reset()
        else:
            self._drop_consumed_head()
            self._save_cursor()
        return corrupt

    def _load_cursor(self) -> dict[str, int] | None:
        path = self.dir / _CURSOR
        try:
            raw = json.loads(path.read_text())
            keys = ("segment", "offset", "suspect", "handed_segment", "handed_end")
            cursor = {k: int(raw[k]) for k in keys}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            # Without a position every record still on disk is sent again, flagged as suspect.
            log.error("spool_cursor_unreadable", extra={"path": str(path), "error": repr(e)})
            return None
        return cursor

    def _save_cursor(self) -> None:
        head = self._order[0] if self._order else self._next_id
        handed_seg, handed_end = self._handed if self._handed is not None else (head, self._head_off)
        tmp = self.dir / f"{_CURSOR}.tmp"
        tmp.write_text(
            json.dumps(
                {
                    "segment": head,
                    "offset": self._head_off,
                    "suspect": self.suspect,
                    "handed_segment": handed_seg,
                    "handed_end": handed_end,
                }
            )
        )
        os.replace(tmp, self.dir / _CURSOR)

    # --- writing --------------------------------------------------------------------------------
    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under ``max_bytes``."""
        return self.bytes + nbytes <= self.max_bytes

    def append(self, frame: bytes) -> None:
        """Append one frame at the tail (one ``write(2)``). Raises ``OSError``."""
        tail = self._segs[self._order[-1]] if self._order else None
        if (
            tail is None
            or self._writer is None
            or self._writer[0] != tail.id
            or (tail.size > 0 and tail.size + len(frame) > self.segment_bytes)
        ):
            tail = self._new_segment(self._next_id)
            self._next_id += 1
            self._order.append(tail.id)
        assert self._writer is not None
        written = self._writer[1].write(frame)
        if written != len(frame):
            raise OSError(f"short write to {tail.path}: {written} of {len(frame)} bytes")
        tail.size += len(frame)
        tail.records += 1
        self.records += 1
        self.bytes += len(frame)
        self._dirty.add(tail.path)

    def prepend(self, frames: Sequence[bytes], suspect: int) -> None:
        """Write ``frames`` as a new segment *before* the head (records that are older than every
        disk record: the memory tier at shutdown); ``suspect`` of them, from the first, may be on
        the bus already. Raises ``OSError``."""
        if not frames:
            return
        sid = (self._order[0] - 1) if self._order else self._next_id
        if not self._order:
            self._next_id += 1
        path = self.dir / f"{sid}{_SEGMENT_SUFFIX}"
        tmp = path.with_suffix(".tmp")
        data = b"".join(frames)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._segs[sid] = _Segment(sid, path, len(data), len(frames))
        self._order.appendleft(sid)
        self._close_reader()
        self._head_off = 0
        self._handed = None
        self.records += len(frames)
        self.bytes += len(data)
        self.suspect = suspect
        self._dir_dirty = True
        # Cursor first, then the segment's final name: a crash in between re-reads the old head
        # from its start (duplicates, flagged) instead of taking the new segment as consumed.
        self._save_cursor()
        os.replace(tmp, path)

    def _new_segment(self, sid: int) -> _Segment:
        if self._writer is not None:
            self._writer[1].close()
            self._writer = None
        path = self.dir / f"{sid}{_SEGMENT_SUFFIX}"
        raw = io.FileIO(path, "ab")  # unbuffered: one write(2) per frame; kept open as the tail
        self._writer = (sid, raw)
        seg = _Segment(sid, path, 0, 0)
        self._segs[sid] = seg
        self._dir_dirty = True
        return seg

    # --- reading --------------------------------------------------------------------------------
    def read_unit(self, max_records: int, max_bytes: int) -> tuple[list[SpoolRecord], DiskUnit | None, int]:
        """Up to ``max_records`` records (about ``max_bytes``, at least one) from the head, not
        consumed.

        Returns ``(records, unit, corrupt)``; ``corrupt`` > 0 means the head segment had a bad
        frame and its remaining records were dropped (the caller counts them).
        """
        if not self._order:
            return [], None, 0
        sid = self._order[0]
        seg = self._segs[sid]
        left = seg.size - self._head_off
        if left <= 0:
            return [], None, 0
        if self._reader is None or self._reader[0] != sid:
            self._close_reader()
            self._reader = (sid, open(seg.path, "rb"))  # kept open while head
        f = self._reader[1]
        f.seek(self._head_off)
        data = f.read(min(max_bytes, left))
        frames, _, bad = scan_frames(data)
        if not frames and not bad and len(data) >= _FRAME_HEAD.size:
            length, _ = _FRAME_HEAD.unpack_from(data, 0)  # one frame larger than max_bytes
            f.seek(self._head_off)
            data = f.read(min(_FRAME_HEAD.size + length, left))
            frames, _, bad = scan_frames(data)
        out: list[SpoolRecord] = []
        ends: list[int] = []
        for body_at, length in frames[:max_records]:
            try:
                out.append(decode_body(bytes(data[body_at : body_at + length])))
            except CorruptFrameError:
                bad = True
                break
            ends.append(self._head_off + body_at + length)
        if out:
            return out, DiskUnit(sid, ends), 0
        # The head frame is bad (or cut): nothing after it in this segment can be trusted.
        dropped = seg.records
        log.error(
            "spool_frame_corrupt", extra={"segment": str(seg.path), "offset": self._head_off, "bad": bad}
        )
        self.consume(dropped, sid, seg.size)
        return [], None, dropped

    def mark_handed(self, unit: DiskUnit) -> None:
        """Persist that the records up to the end of ``unit`` are being handed to the bus (after
        a crash they are sent again flagged as suspect)."""
        self._handed = (unit.segment, unit.ends[-1])
        self._save_cursor()

    def consume(self, n: int, segment: int, end: int) -> None:
        """The ``n`` head records, which end at offset ``end`` of ``segment``, left the spool:
        advance the cursor, delete a finished segment, reset when empty."""
        seg = self._segs[segment]
        self._head_off = end
        seg.records -= n
        self.records -= n
        self.suspect = max(0, self.suspect - n)
        self._handed = None
        if self.records <= 0:
            self._reset()
            return
        self._drop_consumed_head()
        self._save_cursor()

    def _drop_consumed_head(self) -> None:
        while self._order:
            seg = self._segs[self._order[0]]
            is_tail = len(self._order) == 1
            if seg.records > 0 or is_tail:
                break
            self._order.popleft()
            del self._segs[seg.id]
            self._close_reader()
            self.bytes -= seg.size
            seg.path.unlink(missing_ok=True)
            self._dirty.discard(seg.path)
            self._dir_dirty = True
            self._head_off = 0

    def _reset(self) -> None:
        """Delete every segment (nothing left to send) and start over."""
        self._close_reader()
        if self._writer is not None:
            self._writer[1].close()
            self._writer = None
        for sid in self._order:
            self._segs[sid].path.unlink(missing_ok=True)
        self._segs.clear()
        self._order.clear()
        self._dirty.clear()
        self._dir_dirty = True
        self._head_off = 0
        self._handed = None
        self.records = self.bytes = self.suspect = 0
        self._save_cursor()

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader[1].close()
            self._reader = None

    # --- durability -----------------------------------------------------------------------------
    def take_dirty(self) -> tuple[list[Path], bool]:
        """Paths written since the last call, and whether the folder changed (for :func:`sync`)."""
        paths, self._dirty = sorted(self._dirty), set()
        dir_dirty, self._dir_dirty = self._dir_dirty, False
        return paths, dir_dirty

    def close(self) -> None:
        """Close the files (the caller fsyncs first)."""
        self._close_reader()
        if self._writer is not None:
            self._writer[1].close()
            self._writer = None


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def sync_paths(paths: Sequence[Path], directory: Path | None) -> None:
    """fsync each of ``paths`` (a file deleted meanwhile is skipped), then ``directory``.
    Blocking: run it in a worker thread. Raises ``OSError`` if an fsync fails."""
    for p in [*paths, *([directory] if directory is not None else [])]:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
