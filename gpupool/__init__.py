"""gpupool, the application: CLI (``gpupool ...``), logging, wiring of the stages, the demo."""

__version__ = "0.1.0"
