"""gpupool/logs.py: JSON lines on the stderr of the moment, never on a replaced, closed one."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from gpupool.logs import setup_logging


@pytest.fixture
def _restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("_restore_root")
def test_records_follow_stderr_after_a_capture_closed_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed while stderr was a capture (as under CliRunner) that is then closed, the handler
    writes later records to the stderr in place then, one JSON object per line, with no
    "Logging error" traceback."""
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stderr", captured)
    setup_logging("INFO")
    logging.getLogger("gpupool.test").info("first", extra={"n": 1})
    captured.close()
    after = io.StringIO()
    monkeypatch.setattr(sys, "stderr", after)
    logging.getLogger("gpupool.test").info("second", extra={"n": 2})
    (line,) = after.getvalue().splitlines()
    record = json.loads(line)
    assert (record["event"], record["n"], record["level"]) == ("second", 2, "INFO")


@pytest.mark.usefixtures("_restore_root")
def test_an_explicit_stream_is_kept() -> None:
    out = io.StringIO()
    setup_logging("INFO", stream=out)
    logging.getLogger("gpupool.test").warning("kept")
    assert json.loads(out.getvalue())["event"] == "kept"
