"""The analytics process's allocator settings (:mod:`analytics.allocator`), each checked in a fresh
Python process (the settings are the whole process's): freed memory below the mmap threshold
stays resident for the next batch, above it goes back to the kernel, and an operator's own
glibc tunables win."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from analytics.allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES, keep_freed_heap

_MIB = 1 << 20

# Prints whether the settings were set, then the resident bytes kept after a block of SIZE bytes
# (every page written) was freed.
_CHILD = """
import os, sys
from analytics.allocator import keep_freed_heap
held = keep_freed_heap() if sys.argv[1] == "hold" else None
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = resident()
block = b"\\x01" * int(sys.argv[2])
del block
print(held, resident() - before)
"""


def _kept_after_free(mode: str, size: int, env: dict[str, str] | None = None) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(size)],
        check=True, capture_output=True, text=True, env={**os.environ, **(env or {})},
    ).stdout.split()  # fmt: skip
    return out[0], int(out[1])


def test_freed_memory_below_the_mmap_threshold_stays_resident_for_the_next_batch() -> None:
    size = MMAP_THRESHOLD_BYTES - _MIB
    held, kept = _kept_after_free("hold", size)
    assert held == "True"
    assert kept >= size - 2 * _MIB
    # glibc's defaults: the same block is returned to the kernel when freed
    assert _kept_after_free("default", size)[1] < 4 * _MIB


def test_a_block_at_the_mmap_threshold_goes_back_to_the_kernel() -> None:
    held, kept = _kept_after_free("hold", MMAP_THRESHOLD_BYTES)
    assert held == "True" and kept < 4 * _MIB


def test_the_operators_own_tunables_win() -> None:
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        held, _ = _kept_after_free("hold", _MIB, env={name: str(64 * _MIB)})
        assert held == "False", name


def test_thresholds_are_bounded() -> None:
    assert TRIM_THRESHOLD_BYTES > MMAP_THRESHOLD_BYTES  # a freed block below the threshold stays
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match="allocator threshold"):
            keep_freed_heap(mmap_threshold=bad)
        with pytest.raises(ValueError, match="allocator threshold"):
            keep_freed_heap(trim_threshold=bad)
