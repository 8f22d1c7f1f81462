"""The C allocator's settings of the analytics process (glibc's ``mallopt``, ``mallopt(3)``).

Every batch the stage ingests builds tens of MiB of column buffers (the compiled scrape decoder,
``analytics/native``) that DuckDB reads and that are freed when the batch is written. With
glibc's defaults the freed memory at the top of the heap goes back to the kernel as soon as it
exceeds twice the (dynamic) mmap threshold, so the next batch takes the same memory back one page
fault at a time. :func:`keep_freed_heap` fixes the mmap threshold and raises the trim threshold,
so the heap keeps up to :data:`TRIM_THRESHOLD_BYTES` of freed memory for the next batch: the
process's resident memory then stays near its peak instead of falling between batches (its peak
does not grow: the same memory is reused).

An operator's own ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_THRESHOLD_`` (glibc's tunables by
environment, ``mallopt(3)``) wins: nothing is set then.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1
"""``mallopt`` parameter: free memory at the top of the heap kept before it is returned (bytes)."""
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameter: allocations of at least this many bytes get their own mapping."""

MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations below this come from the heap (a batch's column buffers are below it)."""
TRIM_THRESHOLD_BYTES = 128 << 20
"""Freed memory the heap keeps for the next batch."""

_OPERATOR_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def keep_freed_heap(
    mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES
) -> bool:
    """Set glibc's mmap threshold to ``mmap_threshold`` bytes and its trim threshold to
    ``trim_threshold`` bytes for this process (module docstring). Returns ``True`` when both are
    set; ``False`` when the environment sets either (the operator's choice is kept), or the C
    library has no ``mallopt`` (not glibc) or refuses a value. Raises ``ValueError`` for a size
    that is negative or does not fit a C ``int``."""
    for size in (mmap_threshold, trim_threshold):
        if not 0 <= size < 2**31:
            raise ValueError(f"allocator threshold {size} bytes: 0 .. 2**31 - 1")
    if any(os.environ.get(name) for name in _OPERATOR_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
