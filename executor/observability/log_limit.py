"""A log that writes at most one line per reason per interval, counting what it held back.

A caller that sends a million refused batches must not write a million log lines (the log
pipeline is shared, and disk on the node is not free). `RateLimitedLog` writes the first line
of each reason at once, then drops the others of that reason until `interval_s` has passed;
the next line written for the reason carries `suppressed`, how many were dropped since the
last one. Reasons are the caller's keys (e.g. "INVALID_ARGUMENT:BatchValidationError"); their
number is bounded by `max_reasons` (the least recently written is forgotten first).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import structlog

_Clock = Callable[[], float]


class RateLimitedLog:
    def __init__(
        self,
        logger: Any | None = None,
        interval_s: float = 10.0,
        *,
        max_reasons: int = 1024,
        clock: _Clock = time.monotonic,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self._log = logger if logger is not None else structlog.get_logger("executor.refusals")
        self.interval_s = interval_s
        self._max_reasons = max_reasons
        self._clock = clock
        self._lock = threading.Lock()
        # reason -> [time of the last line written, lines suppressed since]
        self._reasons: OrderedDict[str, list[float]] = OrderedDict()

    def _admit(self, reason: str) -> int | None:
        """How many lines of `reason` were suppressed before this one; None = suppress it."""
        now = self._clock()
        with self._lock:
            entry = self._reasons.get(reason)
            if entry is not None and now - entry[0] < self.interval_s:
                entry[1] += 1
                return None
            suppressed = int(entry[1]) if entry is not None else 0
            self._reasons[reason] = [now, 0]
            self._reasons.move_to_end(reason)
            while len(self._reasons) > self._max_reasons:
                self._reasons.popitem(last=False)
            return suppressed

    def info(self, reason: str, event: str, /, **fields: Any) -> bool:
        return self._write("info", reason, event, fields)

    def warning(self, reason: str, event: str, /, **fields: Any) -> bool:
        return self._write("warning", reason, event, fields)

    def _write(self, level: str, reason: str, event: str, fields: dict[str, Any]) -> bool:
        """True when the line was written."""
        suppressed = self._admit(reason)
        if suppressed is None:
            return False
        if suppressed:
            fields["suppressed"] = suppressed
            fields["suppressed_interval_s"] = self.interval_s
        getattr(self._log, level)(event, **fields)
        return True
