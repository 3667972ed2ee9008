"""Structured logs: JSON lines by default, console rendering when stdout is a terminal.

Lines about a batch carry `batch_id` (bound per step with structlog's contextvars on the
device thread); errors carry the gRPC status code. Configure once, at process start.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("auto", "json", "console")


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    if level not in LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    stream = stream or sys.stdout
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer: Any = (
        structlog.dev.ConsoleRenderer() if fmt == "console" else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def set_log_level(level: str) -> None:
    """Change the level of an already configured logger (a runtime toggle)."""
    if level not in LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LEVELS)}, got {level!r}")
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        )
    )
