"""CUDA memory pools that are never destroyed.

A `torch.cuda.MemPool` whose last reference goes is destroyed, and its destructor empties the
pool's own cache; CUDA's caching allocator aborts the process (`captures_underway.empty()`
assert) when that happens while it believes a graph capture or a routed allocation is under
way on the device: during another thread's capture, or for good after a capture that failed
part way. A destructor runs wherever the garbage collector frees its owner, and no lock of
this project can see the allocator's belief, so no safe point to destroy a pool exists.

So this project never destroys a pool. A pool no longer needed is retired: the allocator is
told its one user is gone (`_cuda_releasePool`, the first half of what the destructor does),
which lets the next `torch.cuda.empty_cache` return the pool's free segments to the driver
(that emptying skips, rather than aborts, while a capture is under way), and the Python
object is kept alive until the process ends, so its destructor never runs. `PoolKeeper` holds
the pools in use, each for an owner, and retires one when its owner discards it or is gone.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Tells the allocator a pool on a device (its index) has no user left.
Release = Callable[[int, Any], None]


def release_cuda_pool(device_index: int, pool: Any) -> None:
    torch._C._cuda_releasePool(device_index, pool.id)


def keep_until_exit(obj: object) -> None:
    """One reference that is never dropped: `obj` lives until the process ends, and no
    destructor of it runs, not even during the interpreter's finalization."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


@dataclass
class _Kept:
    key: int
    pool: Any
    device_index: int
    owner: weakref.ref[Any]


class PoolKeeper:
    """Holds the memory pools in use and retires them (module docstring). Callers hold a
    pool's key; the keeper's reference outlives every other."""

    def __init__(self, release: Release = release_cuda_pool) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._kept: list[_Kept] = []
        self._next = 0
        self.retired = 0

    def keep(self, pool: Any, owner: object, device_index: int) -> int:
        """Hold `pool` (on device `device_index`) for `owner`, until `owner` discards it or
        is gone; its key."""
        with self._lock:
            self._next += 1
            self._kept.append(_Kept(self._next, pool, device_index, weakref.ref(owner)))
            return self._next

    def discard(self, key: int) -> None:
        """The pool of `key` is no longer needed: retired now."""
        with self._lock:
            gone = [k for k in self._kept if k.key == key]
            self._kept = [k for k in self._kept if k.key != key]
        self._retire(gone)

    def reap(self) -> int:
        """Retire the pools whose owner is gone; how many."""
        with self._lock:
            gone = [k for k in self._kept if k.owner() is None]
            self._kept = [k for k in self._kept if k.owner() is not None]
        self._retire(gone)
        return len(gone)

    def _retire(self, gone: list[_Kept]) -> None:
        for k in gone:
            self._release(k.device_index, k.pool)
            keep_until_exit(k.pool)
        with self._lock:  # `discard` and `reap` may retire on two threads at once
            self.retired += len(gone)

    def __len__(self) -> int:
        return len(self._kept)

    def leave_to_exit(self) -> None:
        """At exit: every pool still held lives until the process ends (the driver takes
        the memory back), so no destructor runs during finalization."""
        with self._lock:
            for k in self._kept:
                keep_until_exit(k.pool)
            self._kept = []


POOLS = PoolKeeper()
atexit.register(POOLS.leave_to_exit)
