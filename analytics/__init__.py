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

from analytics.classify import GpuStatus, IdleClassifier, IdleConfig, IdleRun
from analytics.predict import IdlePredictor, Prediction, PredictorConfig, SurvivalCurve
from analytics.scheduler import SchedulerJoin
from analytics.service import AnalyticsService
from analytics.store import AnalyticsStore, StoreBatch, StoreSchemaError

__all__ = [
    "AnalyticsService",
    "AnalyticsStore",
    "GpuStatus",
    "IdleClassifier",
    "IdleConfig",
    "IdlePredictor",
    "IdleRun",
    "Prediction",
    "PredictorConfig",
    "SchedulerJoin",
    "StoreBatch",
    "StoreSchemaError",
    "SurvivalCurve",
]
