"""What bounds one KV data-plane call on this server, whoever calls it.

- Its place: at most `max_kv_calls` KV calls run at once, apart from the Forward places
  (`admission.CallLimit`), so KV traffic never refuses a batch.
- Its time: `KVDeadline` cancels the call once it has run `kv_call_timeout_s`, whatever
  deadline the caller set, and an import once it goes `kv_chunk_timeout_s` without its next
  message. A push's transfers share the call's time.
- Its memory: an import's host staging takes its bytes from the Forward byte budget
  (`batch_budget_mib`) before it is allocated, and gives them back when the call ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class KVDeadline:
    """Cancels a call (`cancel`, the RPC's `context.cancel`) past its time: `total_s` from now,
    or `idle_s` after the last `touch` (None: no idle bound). One waiting thread per call
    (KV calls are few: `max_kv_calls`); `close` ends it."""

    def __init__(
        self,
        cancel: Callable[[], None],
        total_s: float,
        idle_s: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        total_setting: str = "kv_call_timeout_s",
        idle_setting: str = "kv_chunk_timeout_s",
    ) -> None:
        """`total_setting` / `idle_setting`: the settings a cancellation names."""
        self._cancel = cancel
        self._names = (total_setting, idle_setting)
        self._clock = clock
        self._end = clock() + total_s
        self.total_s = total_s
        self.idle_s = idle_s
        self._last = clock()
        self._done = threading.Event()
        self.expired = ""  # why the call was cancelled ("" = it was not)
        threading.Thread(target=self._watch, name="kv-deadline", daemon=True).start()

    def touch(self) -> None:
        """A message arrived: the idle clock starts again."""
        self._last = self._clock()

    def remaining(self) -> float:
        return max(0.0, self._end - self._clock())

    def close(self) -> None:
        self._done.set()

    def _next(self) -> tuple[float, str]:
        due, why = self._end, f"it ran past {self._names[0]} ({self.total_s:g} s)"
        if self.idle_s is not None and self._last + self.idle_s < due:
            due = self._last + self.idle_s
            why = f"it sent no message for {self._names[1]} ({self.idle_s:g} s)"
        return due, why

    def _watch(self) -> None:
        while True:
            due, why = self._next()
            wait = due - self._clock()
            if wait <= 0:
                self.expired = why
                self._cancel()
                return
            if self._done.wait(wait):
                return

    def touching(self, messages: Iterator[T]) -> Iterator[T]:
        """`messages`, touching the idle clock at each."""
        for message in messages:
            self.touch()
            yield message
