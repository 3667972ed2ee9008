"""Declared host reads and counted transfers: the hooks a host-read guard checks.

Production code marks, at almost no cost, what a device step is allowed to bring to the host:
`counted_transfer` wraps `ops.host_transfer.to_host`, `host_mirror_read(name)` wraps a read of
a host mirror (e.g. torch_native's `seq_lens_cpu`), `mark_host` records a transfer's result,
`declare_pinned` records a host buffer that is pinned on CUDA, and `check_upload` refuses a
pageable upload under a capture guard. Outside an active guard each costs one thread-local
lookup. The guard itself (`executor.graphs.capture_rules.HostReadGuard`, a torch function and
dispatch mode) registers in `state.guards` and fails on every read these hooks do not cover.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, Protocol

import torch
from torch.utils.weak import WeakTensorKeyDictionary


class HostReadError(AssertionError):
    """A host read inside a guarded device step that no `to_host` or declaration covers."""


class ActiveGuard(Protocol):
    """What the hooks need of a guard entered on this thread."""

    capture: bool
    host_tensors: WeakTensorKeyDictionary

    def fail(self, op: str, subject: Any) -> NoReturn: ...


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.guards: list[ActiveGuard] = []
        self.transfer_depth = 0  # inside to_host
        self.mirror_names: list[str] = []  # inside host_mirror_read
        self.allowed_depth = 0  # inside a Python-level read the function mode allowed


state = _ThreadState()


def refuse_in_capture(what: str, subject: Any = None) -> None:
    for guard in state.guards:
        if guard.capture:
            guard.fail(what, subject)


# Host buffers that stand for pinned memory (really pinned on CUDA; declared on CPU).
_pinned: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
_pinned_lock = threading.Lock()


def declare_pinned(tensor: torch.Tensor) -> None:
    """Record a host buffer as pinned (page-locked) for the capture rules; on CUDA pin it
    with `pin_memory()` as well - this only makes the CPU model agree."""
    with _pinned_lock:
        _pinned[tensor] = True


def is_pinned(tensor: torch.Tensor) -> bool:
    """Pinned for the capture rules: really pinned, or a view of a declared buffer."""
    if tensor.device.type != "cpu":
        return False
    if torch.cuda.is_available() and tensor.is_pinned():
        return True
    with _pinned_lock:
        return tensor in _pinned or (tensor._base is not None and tensor._base in _pinned)


def check_upload(tensor: torch.Tensor, what: str) -> None:
    """Under a capture guard, refuse a host-to-device copy from pageable memory (CUDA
    capture cannot record one: it synchronizes the stream)."""
    if state.guards and not is_pinned(tensor):
        refuse_in_capture(f"{what} from pageable (non-pinned) host memory", tensor)


@contextmanager
def counted_transfer(reason: str) -> Iterator[None]:
    """The body of `ops.host_transfer.to_host`: everything inside may move data to the host
    (except under a capture guard: a captured graph cannot wait for the host)."""
    if not state.guards:
        yield
        return
    refuse_in_capture(f"to_host(reason={reason!r})")
    state.transfer_depth += 1
    try:
        yield
    finally:
        state.transfer_depth -= 1


@contextmanager
def host_mirror_read(name: str) -> Iterator[None]:
    """Declare that the reads inside touch only the host mirror `name` (CPU tensors)."""
    if not state.guards:
        yield
        return
    refuse_in_capture(f"host_mirror_read({name!r})")
    state.mirror_names.append(name)
    try:
        yield
    finally:
        state.mirror_names.pop()


def mark_host(tensor: torch.Tensor) -> None:
    """Record `tensor` (a `to_host` result) as host data for every active guard."""
    for guard in state.guards:
        guard.host_tensors[tensor] = True
