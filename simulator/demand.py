"""Simulated training: it wants a GPU back the moment that GPU's trace turns busy.

The trace is the pool owner's view: a GPU idle in the trace is one training does not need; when
its duty cycle goes from 0 to above 0 (:data:`simulator.fleet.BUSY_THRESHOLD_PCT`), training wants
it back. :class:`TrainingDemand` polls the fleet every ``tick_s`` and, for each GPU with such an
idle→busy edge among the fleet steps since its previous poll, produces one
:class:`contracts.PoolDemand` naming that GPU on ``topics.pool_demand``, keyed by ``demand_id``.
Demands for GPUs that are not leased are expected: the broker ignores them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable

from contracts import KafkaTopics, PoolDemand, encode
from contracts.bus import Bus, Producer
from simulator.fleet import Fleet
from simulator.metrics import DEMAND_ERRORS, DEMANDS

log = logging.getLogger(__name__)


class TrainingDemand:
    """Produces pool demands on idle→busy edges of the fleet's trace.

    Args:
        fleet: the simulated fleet.
        bus: where to produce (:class:`contracts.bus.Bus`).
        topics: topic names; demands go to ``topics.pool_demand``.
        clock: wall clock (Unix s); default the fleet's.
        tick_s: polling period, wall seconds (> 0).
        gpus: GPU keys to watch; default every GPU of the fleet.

    Attributes:
        emitted: demands produced so far.
        failed: demands that could not be produced (bus errors), counted by
            ``gpupool_simulator_demand_errors_total{reason}`` too.

    Raises:
        ValueError: ``tick_s`` <= 0.
        KeyError: a key in ``gpus`` is not a GPU of the fleet.
    """

    def __init__(
        self,
        fleet: Fleet,
        bus: Bus,
        topics: KafkaTopics,
        clock: Callable[[], float] | None = None,
        *,
        tick_s: float = 1.0,
        gpus: Iterable[str] | None = None,
    ) -> None:
        if not tick_s > 0:
            raise ValueError(f"tick_s must be > 0, got {tick_s}")
        self.fleet = fleet
        self.bus = bus
        self.topics = topics
        self.clock = clock or fleet.now
        self.tick_s = tick_s
        self.keys = list(fleet.gpu_keys() if gpus is None else gpus)
        for k in self.keys:
            fleet.gpu_by_key(k)
        self.emitted = 0
        self.failed = 0
        self._last_step: int | None = None
        self._run_id = uuid.uuid4().hex[:8]

    def edges(self, at: float) -> tuple[int, list[str]]:
        """``(step, keys)``: the fleet step at ``at`` and the watched GPUs with an idle→busy edge
        in the steps after the previous call up to it. The first call only sets the baseline
        (no keys). At most one trace cycle is scanned after a long gap."""
        step = self.fleet.step_at(at)
        prev, self._last_step = self._last_step, step
        if prev is None or step <= prev:
            return step, []
        first = max(prev + 1, step - self.fleet.trace.steps + 1)
        out: list[str] = []
        for key in self.keys:
            busy_before = self.fleet.is_busy_step(key, first - 1)
            for s in range(first, step + 1):
                busy = self.fleet.is_busy_step(key, s)
                if busy and not busy_before:
                    out.append(key)
                    break
                busy_before = busy
        return step, out

    async def poll_once(self, producer: Producer) -> list[PoolDemand]:
        """Detect edges now and produce one demand per GPU with an edge; returns those produced.
        A failed send is logged and counted, never raised."""
        at = self.clock()
        step, keys = self.edges(at)
        sent: list[PoolDemand] = []
        for key in keys:
            demand = PoolDemand(
                demand_id=f"train-{self._run_id}-{self.emitted + self.failed + 1}",
                ts=at,
                gpus=[key],
                reason=f"simulated training wants {key} back (trace idle->busy by step {step})",
            )
            try:
                await producer.send(self.topics.pool_demand, encode(demand), key=demand.demand_id)
            except Exception as e:  # noqa: BLE001 — a bus error must not stop the simulation
                self.failed += 1
                DEMAND_ERRORS.labels(reason=type(e).__name__).inc()
                log.warning("demand_send_failed", extra={"demand_id": demand.demand_id, "error": repr(e)})
                continue
            self.emitted += 1
            DEMANDS.inc()
            sent.append(demand)
            log.info("demand_produced", extra={"demand_id": demand.demand_id, "gpu": key, "step": step})
        if sent:
            try:
                await producer.flush()
            except Exception as e:  # noqa: BLE001
                DEMAND_ERRORS.labels(reason=type(e).__name__).inc()
                log.warning("demand_flush_failed", extra={"error": repr(e)})
        return sent

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every ``tick_s`` until ``stop`` is set, then stop the producer.

        Raises whatever ``producer.start()`` raises if the bus is unreachable."""
        producer = self.bus.producer(client_id="gpupool-simulator-demand")
        await producer.start()
        try:
            while not stop.is_set():
                started = time.monotonic()
                await self.poll_once(producer)
                remaining = self.tick_s - (time.monotonic() - started)
                if remaining > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), remaining)
                    except TimeoutError:
                        pass
        finally:
            await producer.stop()
