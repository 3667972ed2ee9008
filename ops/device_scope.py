"""The executor's device, current on whichever thread touches it.

CUDA keeps a *current device* per thread, and kernel launches (Triton's included), stream
look-ups and `synchronize()` use it, not the device of the tensors they are given. An
executor on `cuda:1` therefore needs `cuda:1` current on its loader thread, its device
worker and any thread that captures graphs; otherwise Triton launches on device 0 with
pointers into device 1. :func:`device_scope` makes the device current for a block (and
restores the previous one after); :func:`check_device` is what a launch helper calls to
make sure it runs inside one. The scope is recorded per thread for every device type, so
CPU tests can check that each thread ran its device work inside the executor's scope.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch


class DeviceScopeError(RuntimeError):
    """Device work ran outside the executor's device scope (or under another device)."""


class _Current(threading.local):
    def __init__(self) -> None:
        self.devices: list[torch.device] = []


_current = _Current()


def resolve_index(device: torch.device) -> torch.device:
    """`cuda` -> `cuda:<current index>`, so a device names its index everywhere."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class device_scope:  # lower case: used as `with device_scope(device):`, as before
    """Make `device` current on this thread for the block (CUDA: `torch.cuda.set_device`,
    restored after). Nests: the innermost scope is the current one. A class, not a
    generator: every step enters one."""

    __slots__ = ("_device", "_previous")

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def __enter__(self) -> None:
        device = self._device = resolve_index(self._device)
        self._previous: int | None = None
        if device.type == "cuda":
            self._previous = torch.cuda.current_device()
            if self._previous != device.index:
                torch.cuda.set_device(device.index)
        _current.devices.append(device)

    def __exit__(self, *exc: object) -> None:
        _current.devices.pop()
        previous = self._previous
        if previous is not None and previous != self._device.index:
            torch.cuda.set_device(previous)


def current_scope() -> torch.device | None:
    """The device of this thread's innermost :func:`device_scope`, None outside one."""
    return _current.devices[-1] if _current.devices else None


def check_device(device: torch.device, what: str) -> None:
    """Raise DeviceScopeError unless `device` is current on this thread: inside its
    :func:`device_scope` and, on CUDA, `torch.cuda.current_device()` (launch helpers)."""
    device = resolve_index(device)
    scope = current_scope()
    if scope != device:
        raise DeviceScopeError(
            f"{what} runs on {device} outside its device scope (this thread's scope: {scope}); "
            "wrap the device work in ops.device_scope.device_scope"
        )
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        raise DeviceScopeError(
            f"{what} runs on {device} but CUDA's current device is "
            f"cuda:{torch.cuda.current_device()}"
        )


class _HasDevice(Protocol):
    device: torch.device


S = TypeVar("S", bound=_HasDevice)
P = ParamSpec("P")
R = TypeVar("R")


def on_own_device(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """A method decorator: the body runs inside `device_scope(self.device)`."""

    @functools.wraps(method)
    def scoped(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with device_scope(self.device):
            return method(self, *args, **kwargs)

    return scoped
