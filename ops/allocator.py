"""The CUDA caching allocator's process-wide state, as Python code must respect it.

Two things are process-wide in the allocator and bite code that looks local:
- While any thread captures a CUDA graph or routes its allocations into a private pool
  (`torch.cuda.use_mem_pool`), the allocator may not empty a cache: a `torch.cuda.MemPool`
  destroyed then (its destructor empties the pool's cache) aborts the process
  (`captures_underway.empty()` assert). A capture that did not end cleanly leaves the
  allocator in that state for good.
- A MemPool object is destroyed whenever its last reference goes, which for a pool held by an
  executor means whenever the garbage collector frees that executor: inside another
  executor's capture, for one.

So `routing()` wraps every capture and every routed allocation of this project and counts
them; `mark_poisoned()` records a capture that did not end; and `PoolKeeper` holds every
MemPool the project makes until a point where destroying it is safe (nothing routing,
nothing poisoned), checked and done under one lock so no capture can start in between. Pools
still held at exit are left to the process's end, never destroyed during finalization.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_lock = threading.Lock()
_routing = 0
_poisoned: list[str] = []


@contextmanager
def routing() -> Iterator[None]:
    """Around a CUDA graph capture or allocations routed into a pool (any thread)."""
    global _routing
    with _lock:
        _routing += 1
    try:
        yield
    finally:
        with _lock:
            _routing -= 1


def mark_poisoned(reason: str) -> None:
    """A capture did not end cleanly: the allocator may think one is under way for good."""
    with _lock:
        if not _poisoned:
            _poisoned.append(reason)


def _safe() -> bool:  # under _lock
    return _routing == 0 and not _poisoned


@dataclass
class _Kept:
    key: int
    pool: Any
    owner: weakref.ref[Any] | None  # None: its owner discarded it


class PoolKeeper:
    """Holds memory pools until they can be destroyed safely (module docstring). Callers
    hold a pool's key, never the pool: the keeper's reference is the last one."""

    def __init__(self) -> None:
        self._kept: list[_Kept] = []
        self._next = 0

    def keep(self, pool: Any, owner: object) -> int:
        """Hold `pool` for `owner` (destroyable once `owner` is gone); its key."""
        with _lock:
            self._next += 1
            self._kept.append(_Kept(self._next, pool, weakref.ref(owner)))
            return self._next

    def discard(self, key: int) -> bool:
        """The pool of `key` is no longer needed: destroyed now if that is safe, else at a
        later `reap`. True if it is gone."""
        with _lock:  # rebuilt, not set in a loop whose variable would keep the pool alive
            self._kept = [_Kept(k.key, k.pool, None) if k.key == key else k for k in self._kept]
        self.reap()
        with _lock:
            return all(k.key != key for k in self._kept)

    def reap(self) -> int:
        """Destroy every discarded pool and every pool whose owner is gone, if safe now;
        how many were destroyed."""
        with _lock:
            if not _safe():
                return 0
            before = len(self._kept)
            # The keeper's were the last references: the pools are destroyed here, under
            # the lock, so no capture can start meanwhile.
            self._kept = [k for k in self._kept if k.owner is not None and k.owner() is not None]
            return before - len(self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def leave_to_exit(self) -> None:
        """At exit: every pool still held stays alive until the process ends (the driver
        takes the memory back), so no destructor runs during finalization."""
        with _lock:
            for pool in [k.pool for k in self._kept]:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))
            self._kept = []


POOLS = PoolKeeper()
atexit.register(POOLS.leave_to_exit)
