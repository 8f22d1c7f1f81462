"""Structured JSON logs for every gpupool process (python-json-logger on stdlib logging).

Library code logs short event names with fields in ``extra``::

    log.info("scrape_failed", extra={"target": url, "reason": "http_500"})

and this module renders one JSON object per line: ``{"ts": ..., "level": ..., "logger": ...,
"event": "scrape_failed", "target": ..., "reason": ...}``.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from pythonjsonlogger.json import JsonFormatter


class StderrHandler(logging.StreamHandler):
    """A stream handler writing to whatever ``sys.stderr`` is *when a record is emitted*.

    A handler bound to the ``sys.stderr`` of the moment it was installed keeps writing to that
    object after it is replaced and closed (a test runner's or ``typer.testing.CliRunner``'s
    capture): every later record then fails with "I/O operation on closed file" and logging
    prints a traceback per record instead.
    """

    def __init__(self) -> None:
        """Start on the current ``sys.stderr``."""
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record`` (formatted, one line) to the current ``sys.stderr``."""
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(level: str | int = "INFO", stream: TextIO | None = None) -> None:
    """Send every log record of the process to ``stream`` (default: the current stderr, looked
    up at each record: :class:`StderrHandler`) as JSON lines.

    Args:
        level: root level name (``DEBUG``, ``INFO``...) or number.
        stream: where to write; stderr keeps stdout free for command output.
    Idempotent: replaces the handlers a previous call installed.
    """
    handler: logging.Handler = logging.StreamHandler(stream) if stream is not None else StderrHandler()
    handler.setFormatter(
        JsonFormatter(
            "{asctime}{levelname}{name}{message}",
            style="{",
            rename_fields={"asctime": "ts", "levelname": "level", "name": "logger", "message": "event"},
            datefmt="%Y-%m-%dT%H:%M:%S%z",
        )
    )
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_gpupool", False):
            root.removeHandler(h)
    handler._gpupool = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("aiokafka", "amqtt", "transitions", "httpx", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
