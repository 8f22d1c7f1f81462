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


def setup_logging(level: str | int = "INFO", stream: TextIO | None = None) -> None:
    """Send every log record of the process to ``stream`` (default stderr) as JSON lines.

    Args:
        level: root level name (``DEBUG``, ``INFO``...) or number.
        stream: where to write; stderr keeps stdout free for command output.
    Idempotent: replaces the handlers a previous call installed.
    """
    handler = logging.StreamHandler(stream or sys.stderr)
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
