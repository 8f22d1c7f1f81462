"""One key per GPU, whether its samples carry its UUID or not.

A GPU sample without a UUID (an older or trimmed exporter, ``dcgmi dmon``: see
:attr:`contracts.GpuSample.gpu_uuid`) is known by ``host`` + ``gpu_index`` (+ MIG instance) and
keyed ``host/gpu<index>[/gi]``. When one GPU's samples come both ways — the exporter is upgraded,
a relabelling drops the ``UUID`` label on some series — its history must stay under one key, the
UUID one, since that is the key the broker leases by:

* a sample **with** a UUID and an index teaches ``(host, index, instance) → UUID``; the first time
  a slot that this instance has seen under its stand-in key ``host/gpu<index>[/gi]`` gets a UUID,
  :meth:`GpuIdentities.resolve` returns that stand-in key so the caller moves the GPU's history
  (idle track, predictor runs, stored rows) to the UUID key;
* a sample **without** a UUID gets the learned UUID of its slot (then it is the same GPU, same
  key), else the stand-in id ``gpu<index>`` as its ``gpu_uuid`` (so every row, status and
  capacity update downstream has a string id; :func:`contracts.topics.gpu_id`).

The map lives in memory; at start the stage tells it which stand-in keys the store still holds
(:meth:`GpuIdentities.remember_stand_in`), so a UUID that appears after a restart still moves
their history. UUIDs are learned again from the next sample that carries one.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, cast

import msgspec

from contracts import GpuSample, gpu_key
from contracts.topics import gpu_id

__all__ = ["GpuIdentities", "with_uuid"]

_Slot = tuple[str, int, int | None]


class Identified(Protocol):
    """What :class:`GpuIdentities` reads of a GPU sample: :class:`contracts.GpuSample`, its
    msgspec twin and :class:`analytics.scrapes.GpuObservation` have it (same meanings)."""

    @property
    def host(self) -> str: ...
    @property
    def gpu_uuid(self) -> str | None: ...
    @property
    def gpu_index(self) -> int | None: ...
    @property
    def gpu_instance_id(self) -> int | None: ...


_S = TypeVar("_S", bound=Identified)


class GpuIdentities:
    """Resolves each GPU sample to its one key (module docstring). Not thread-safe."""

    def __init__(self) -> None:
        """Start knowing no GPU."""
        self._uuid: dict[_Slot, str] = {}
        self._stand_in_seen: set[_Slot] = set()

    def __len__(self) -> int:
        """Slots whose UUID is known."""
        return len(self._uuid)

    def remember_stand_in(self, host: str, stand_in: str, gpu_instance_id: int | None) -> bool:
        """Note that GPU ``host/<stand_in>[/gi]`` (a stand-in id ``gpu<index>``) has history, e.g.
        rows stored before a restart. Returns False (nothing noted) when ``stand_in`` is not one."""
        digits = stand_in[3:] if stand_in.startswith("gpu") else ""
        if not (digits.isascii() and digits.isdigit()):
            return False
        self._stand_in_seen.add((host, int(digits), gpu_instance_id))
        return True

    def resolve(self, sample: _S) -> tuple[_S, str | None]:
        """``(sample to use, stand-in key it replaces or None)``; ``sample`` is the model, its
        msgspec twin (:data:`analytics.decode.GpuRecord`) or a
        :class:`analytics.scrapes.GpuObservation`, and so is the sample returned.

        The sample is returned unchanged when it has a UUID, else with ``gpu_uuid`` set to the
        learned UUID or to the stand-in id ``gpu<index>``. The second item is the stand-in key
        ``host/gpu<index>[/gi]`` when this sample is the first with a UUID for a slot seen before
        without one: the caller moves that key's history to ``sample.key``.
        """
        if sample.gpu_index is None:
            return sample, None
        slot = (sample.host, sample.gpu_index, sample.gpu_instance_id)
        uuid = sample.gpu_uuid
        if uuid:
            known = self._uuid.get(slot)
            self._uuid[slot] = uuid
            if known is None and slot in self._stand_in_seen:
                self._stand_in_seen.discard(slot)
                return sample, gpu_key(sample.host, gpu_id(None, sample.gpu_index), sample.gpu_instance_id)
            return sample, None
        learned = self._uuid.get(slot)
        if learned is None:
            self._stand_in_seen.add(slot)
            learned = gpu_id(None, sample.gpu_index)
        return with_uuid(sample, learned), None


def with_uuid(sample: _S, gpu_uuid: str) -> _S:
    """``sample`` with ``gpu_uuid`` set (a new object; a pydantic model, a msgspec struct or a
    named tuple alike). Raises ``TypeError`` for another kind of object."""
    if isinstance(sample, msgspec.Struct):
        return msgspec.structs.replace(sample, gpu_uuid=gpu_uuid)
    if isinstance(sample, tuple) and hasattr(sample, "_replace"):
        return cast(_S, sample._replace(gpu_uuid=gpu_uuid))
    if isinstance(sample, GpuSample):
        return cast(_S, sample.model_copy(update={"gpu_uuid": gpu_uuid}))
    raise TypeError(f"cannot set gpu_uuid on {type(sample).__name__}")
