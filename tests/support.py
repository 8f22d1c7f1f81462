"""Helpers shared across the test suite (a pytest plugin, see conftest.py).

* :data:`T0`, :class:`Clock` — a fixed start time and a clock the test moves by hand;
* :data:`TRACE_DIR`, :func:`trace` — the Alibaba GenAI trace in ``../shared/data`` and a fixture
  loading it once;
* :func:`detach_cli_log_handler` — a fixture for tests that invoke the ``gpupool`` CLI;
* :func:`settings_file` — a ``gpupool.toml`` as the only source of settings besides the flags.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from simulator.trace import Trace, load_trace

T0 = 1_700_000_000.0
"""A fixed start time, Unix seconds (2023-11-14T22:13:20Z)."""
TRACE_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces" / "alibaba_genai_2026"
"""The Alibaba GenAI 2026 trace folder (``../shared/data/traces/alibaba_genai_2026``)."""


class Clock:
    """A settable wall clock: reads ``t`` (Unix seconds, default :data:`T0`) until a test moves it."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="session")
def trace() -> Trace:
    """The trace at :data:`TRACE_DIR`, loaded once."""
    return load_trace(TRACE_DIR)


@pytest.fixture
def detach_cli_log_handler() -> Iterator[None]:
    """``gpupool``'s callback logs to the stderr CliRunner lends it, closed after ``invoke``:
    detach that handler so later log records do not hit a closed file."""
    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_gpupool", False):
            root.removeHandler(handler)


def settings_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    """Write ``text`` to ``tmp_path/gpupool.toml`` and unset every ``GPUPOOL_*`` environment
    variable for the test (so only that file and what the test sets apply); returns the file."""
    for name in [k for k in os.environ if k.upper().startswith("GPUPOOL_")]:
        monkeypatch.delenv(name)
    toml = tmp_path / "gpupool.toml"
    toml.write_text(text)
    return toml


def tool_missing(message: str) -> NoReturn:
    """A tool a test needs is absent: skip on a developer's machine, fail under ``CI=true``
    (where the machine or ``make deps`` must provide it). Raises pytest's skip or fail outcome."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message} (CI=true: the machine or `make deps` must provide it)")
    pytest.skip(message)
