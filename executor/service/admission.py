"""Admission: how many Forward/ForwardStream calls may hold a handler thread at once, and how
many bytes of batches may wait for or run on the device (`ByteBudget`), and what one batch
holds until its job ends (`BatchClaim`).

Every RPC, health checks included, runs on the server's one pool of `rpc_threads` handler
threads. A stream holds its thread for as long as it is open, a unary Forward while its
batch waits for the device, so without a cap 16 idle streams starve readiness probes and
GetInfo. `CallLimit` admits at most `limit` such calls (fewer than the pool, so the rest is
always free for health, GetInfo and refusals); one more is answered RESOURCE_EXHAUSTED at
once (`CapacityError`), before it waits for anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol


class CapacityError(RuntimeError):
    """Too many calls in progress, or the device too far behind; retry later."""


class StreamIdleError(RuntimeError):
    """A stream sent no batch for `stream_idle_timeout_s` with nothing in flight: closed."""


def forward_call_limit(rpc_threads: int, configured: int) -> int:
    """The cap: `configured`, or by default the pool less a quarter of it (at least 2)."""
    if configured:
        return configured
    return max(1, rpc_threads - max(2, rpc_threads // 4))


class CallLimit:
    """`what`, `setting`: the calls it counts and the setting that caps them (the refusal
    names both): Forward/ForwardStream (max_forward_calls), the KV data plane (max_kv_calls)."""

    def __init__(
        self,
        limit: int,
        what: str = "Forward/ForwardStream calls",
        setting: str = "max_forward_calls",
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.what = what
        self.setting = setting
        # A counter under a plain lock: every Forward takes and gives back a place, and a
        # threading.BoundedSemaphore (a Condition in Python) costs several times as much.
        self._lock = threading.Lock()
        self._taken = 0

    def enter(self, what: str) -> None:
        """Take one of the `limit` places (give it back with `leave`); CapacityError when none
        is free."""
        with self._lock:
            if self._taken < self.limit:
                self._taken += 1
                return
        raise CapacityError(
            f"{self.limit} {self.what} are in progress ({self.setting}); this {what} was not "
            "started: retry later, or send more per call"
        )

    def leave(self) -> None:
        with self._lock:
            if self._taken == 0:
                raise ValueError("CallLimit.leave() without a matching enter()")
            self._taken -= 1


class ByteBudget:
    """How many bytes of batches may be queued for or running on the device at once.

    The queue holds at most `queue_size` batches, but one batch may be as large as the receive
    limit, so counting batches bounds memory only at `queue_size` times that. Each Forward
    batch takes its encoded size from the budget before it is decoded and gives it back when
    its job ends (run, refused or dropped); a batch that does not fit is answered
    RESOURCE_EXHAUSTED (`CapacityError`) at once and nothing is queued. 0 = no budget.
    """

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self.taken = 0

    def take(self, size: int, batch_id: int, what: str = "") -> None:
        """Take `size` bytes for batch `batch_id` (or for `what`, a KV import's staging)."""
        if not self.limit:
            return
        with self._lock:
            if self.taken + size <= self.limit:
                self.taken += size
                return
            taken = self.taken
        raise CapacityError(
            f"{what or f'batch_id {batch_id}'} ({size} bytes) does not fit the byte budget of "
            f"batches and KV imports queued or running (batch_budget_mib: {self.limit} bytes, "
            f"{taken} taken); retry later, or send smaller batches"
        )

    def give(self, size: int) -> None:
        if not self.limit:
            return
        with self._lock:
            if size > self.taken:
                raise ValueError(f"ByteBudget.give({size}) exceeds the {self.taken} bytes taken")
            self.taken -= size


class Arrivals(Protocol):
    """What a batch holds back while it waits or runs (`ModelRunner`: on a CPU, the background
    compile and load)."""

    def batch_arrived(self) -> bool: ...

    def batch_left(self) -> None: ...


class BatchClaim:
    """What one Forward batch holds from its arrival to its job's end: its bytes of the
    `ByteBudget` (taken here: CapacityError when they do not fit, and nothing is held) and
    what `arrivals` holds back for it. `end` gives both back once, however the job ends (run,
    refused, cancelled, never started); `holds` says whether there is anything to give."""

    __slots__ = ("_arrivals", "_budget", "_size")

    def __init__(
        self, budget: ByteBudget, size: Callable[[], int], batch_id: int, arrivals: Arrivals
    ) -> None:
        self._size = size() if budget.limit else 0
        budget.take(self._size, batch_id)
        self._budget = budget
        self._arrivals = arrivals if arrivals.batch_arrived() else None

    @property
    def holds(self) -> bool:
        return bool(self._size) or self._arrivals is not None

    def end(self, _: object = None) -> None:
        """(A done-callback of the batch's job, or called when the job was never made.)"""
        self._budget.give(self._size)
        if self._arrivals is not None:
            self._arrivals.batch_left()
