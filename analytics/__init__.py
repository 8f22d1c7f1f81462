"""gpupool analytics: telemetry from the bus into DuckDB (offsets stored with the rows), per-GPU
busy / idle / unknown with hysteresis, predicted idle windows, capacity updates on the bus.

Public API:

* :class:`AnalyticsService` — the stage (``start`` / ``step`` / ``run`` / ``stop`` /
  ``current_states``);
* :class:`IdleConfig`, :class:`IdleClassifier`, :class:`GpuStatus`, :class:`IdleRun` — idle
  detection (pure, deterministic);
* :class:`IdlePredictor`, :class:`PredictorConfig`, :class:`Prediction`, :class:`SurvivalCurve` —
  predicted availability;
* :class:`AnalyticsStore`, :class:`StoreBatch` — the DuckDB store;
* :class:`SchedulerJoin` — the training scheduler's state joined with the GPUs (offerable or
  not, promise cut at a planned start, GPUs allocated but idle);
* :mod:`analytics.cli` — ``gpupool analytics run|sql``.
"""

from __future__ import annotations

from runtime.lazy import lazy_exports

_EXPORTS = {
    "GpuStatus": "analytics.classify",
    "IdleClassifier": "analytics.classify",
    "IdleConfig": "analytics.classify",
    "IdleRun": "analytics.classify",
    "IdlePredictor": "analytics.predict",
    "Prediction": "analytics.predict",
    "PredictorConfig": "analytics.predict",
    "SurvivalCurve": "analytics.predict",
    "SchedulerJoin": "analytics.scheduler",
    "AnalyticsService": "analytics.service",
    "AnalyticsStore": "analytics.store",
    "StoreBatch": "analytics.store",
    "StoreSchemaError": "analytics.store",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
