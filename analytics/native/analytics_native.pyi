"""Type stub of the compiled decoder of :class:`contracts.GpuScrape` records (``src/lib.rs``; the
crate documentation gives the checks and the buffers' layout)."""

from typing import final

RECORD_MEMBERS: list[str]
"""Members of a ``GpuScrape`` record the decoder knows, in the model's order."""
COLUMN_MEMBERS: list[str]
"""Members of ``GpuColumns`` (the record's ``gpus``) the decoder knows, in the model's order."""
SERIES_MEMBERS: list[str]
"""Members of ``SeriesValue`` the decoder knows, in the model's order."""
SHARD_BYTES: int
"""Bytes of JSON a thread reads at least (:meth:`ScrapeDecoder.decode`)."""

@final
class Buffer:
    """Bytes the decoder built, handed over without a copy: a read-only buffer (``bytes(b)``,
    ``memoryview(b)``, ``pyarrow.py_buffer(b)``)."""

    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...

Buffers = tuple[Buffer | None, Buffer, Buffer | None, int]
"""One Arrow array's buffers: (LSB-first validity bitmap or None when no value is null,
little-endian values (float64/int64) or UTF-8 data, int32 offsets for strings else None,
null count)."""

@final
class DecodedScrapes:
    """What :meth:`ScrapeDecoder.decode` made of a batch: per accepted record (``accepted`` are
    their indexes into the values given) and per GPU (records in order, GPUs in column order)."""

    @property
    def accepted(self) -> list[int]: ...
    @property
    def counts(self) -> list[int]:
        """GPUs per accepted record."""
    @property
    def observations(self) -> list[tuple[float | int | str | None, ...]]:
        """Per GPU an instance of the ``observation`` class given to the decoder: the
        ``fields`` values of the observed names, then their ``invalid`` reasons (in the order the
        names were given; None where the GPU has no entry), then ``ts``, ``host``, ``gpu_uuid``,
        ``gpu_index``, ``gpu_instance_id``, ``model_name``."""
    @property
    def chunk_rows(self) -> list[int]:
        """Rows of each chunk of the columns (one chunk per run of records a thread read)."""
    @property
    def arrays(self) -> dict[str, list[Buffers]]:
        """``ts`` (int64: Unix microseconds, rounded half to even), ``host``, ``source``,
        ``target`` (utf8: the GPU's record's), ``seq`` (int64: the record's ``seq`` + the GPU's
        place, NULL past int64), ``gpu_uuid``, ``gpu_instance_profile``, ``model_name`` (utf8),
        ``gpu_index``, ``gpu_instance_id`` (int64), ``fields``, ``invalid``, ``attributes``
        (utf8: each map's JSON text as sent) → per chunk its buffers."""
    @property
    def float_fields(self) -> dict[str, list[Buffers]]:
        """Promoted field name → per chunk its float64 buffers."""
    @property
    def whole_fields(self) -> dict[str, list[Buffers]]:
        """Promoted field name → per chunk its int64 buffers (whole numbers; floats rounded half to even)."""

@final
class ScrapeDecoder:
    """Compiled decoder of ``contracts.GpuScrape`` JSON records: accepts a subset of what the
    model accepts, with the same values; refuses every other record (left out of the result)."""

    def __init__(
        self,
        schema_version: int,
        sources: list[str],
        default_source: str,
        default_target: str,
        default_seq: int,
        ts_min: float,
        ts_max: float,
        float_fields: list[str],
        whole_fields: list[str],
        observed: list[str],
        observation: type[tuple[float | int | str | None, ...]],
    ) -> None:
        """Raises ``ValueError`` if ``default_source`` is not one of ``sources``, or
        ``observation`` is not a named tuple of ``2 * len(observed) + 6`` fields."""
    def decode(self, values: list[bytes], threads: int = 1) -> DecodedScrapes:
        """Decode a batch of records' JSON (UTF-8 bytes), read by at most ``threads`` threads
        (each a run of consecutive records of at least 1 MiB, without the GIL; one chunk of the
        columns per run). Raises ``TypeError`` for an element that is not bytes and
        ``OverflowError`` for a negative ``threads``; never raises for a record's content."""
