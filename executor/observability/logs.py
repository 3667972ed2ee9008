"""Structured logs: JSON lines by default, console rendering when stdout is a terminal.

Every line has `timestamp` (ISO 8601, UTC), `level` and `event`. Lines about a batch carry
`batch_id` (bound per step with structlog's contextvars on the device thread) and the
`trace_id` / `span_id` of its RPC (from the current OpenTelemetry span, which the device
thread attaches per step); errors carry the gRPC status code. Configure once, at process
start; `set_log_level` changes the level later (a runtime toggle).

Lines are written under `WRITE_LOCK`, re-entrant so that a thread can ask whether it holds it:
a background load that waits for the steps (`IdleGate`) never waits in the middle of a line,
holding the lock an RPC thread's line would wait for (the device worker makes it a guard).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog
from opentelemetry import trace

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("auto", "json", "console")
_current_level = "info"
WRITE_LOCK = threading.RLock()  # every configured line's write


class LinePrinter:
    """structlog's logger for `configure_logging`: each rendered line printed under
    `WRITE_LOCK`, flushed."""

    def __init__(self, file: TextIO) -> None:
        self._file = file

    def msg(self, message: str) -> None:
        with WRITE_LOCK:
            print(message, file=self._file, flush=True)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def add_trace_ids(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Add the current OpenTelemetry span's ids (a structlog processor)."""
    if "trace_id" not in event:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            event["trace_id"] = format(ctx.trace_id, "032x")
            event["span_id"] = format(ctx.span_id, "016x")
    return event


def current_level() -> str:
    """The level set by the last `configure_logging` / `set_log_level` ("info" before any)."""
    return _current_level


def debug_enabled() -> bool:
    """Whether debug lines are written: lets a hot path skip building one (a filtered call
    through structlog's lazy logger still costs microseconds)."""
    return _current_level == "debug"


def configure_logging(
    level: str = "info", fmt: str = "auto", stream: TextIO | None = None, rank: int = 0
) -> None:
    """`rank`: the tensor-parallel rank every line carries (`rank`; 0 without TP)."""
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
    global _current_level
    _current_level = level
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _with_rank(rank),
            add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=lambda *_: LinePrinter(stream),
        cache_logger_on_first_use=False,
    )


def _with_rank(rank: int) -> Any:
    def add_rank(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("rank", rank)
        return event

    return add_rank


def set_log_level(level: str) -> None:
    """Change the level of an already configured logger (a runtime toggle)."""
    if level not in LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LEVELS)}, got {level!r}")
    global _current_level
    _current_level = level
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        )
    )
