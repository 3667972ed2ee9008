"""`StepThreads`: the intra-op threads a CPU step runs with, one fewer while this process
compiles beside its steps (its compile worker failed).

Such a compile runs its C++ compiler processes beside the steps (the worker's stop while steps
run, `CompilePause`, and so do not). The step's OpenMP team still counts on every core: a
parallel region then waits at its barrier for the thread a compiler displaced, and a step now
and then took many times its length (docs/performance.md). With one thread fewer the team fits
beside it. The count is per thread in torch (OpenMP's), so the thread that runs the steps
applies it, between two steps (`apply`); the capture thread only says how many cores it holds.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# The GIL's switch interval while this process loads (or compiles) a graph beside the steps.
# That thread holds the GIL for seconds (inductor's import, its cache loads); a step's thread
# that released it for an op then waits up to the interval (5 ms by default) to run its next
# line, hundreds of times a step: a step took seconds. A short interval bounds each wait.
LOAD_SWITCH_S = 1e-4


class StepThreads:
    def __init__(self) -> None:
        self.full = torch.get_num_threads()  # the process's, as configured at start-up
        self.reserved = 0  # cores a compile in this process holds now (the capture thread's)

    @property
    def wanted(self) -> int:
        return max(1, self.full - self.reserved)

    def apply(self) -> None:
        """On the thread that runs steps, before one: its intra-op threads as wanted now."""
        wanted = self.wanted
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)


@contextmanager
def short_gil_turns(interval: float = LOAD_SWITCH_S) -> Iterator[None]:
    """Around a background load or compile in this process (one at a time): the GIL's
    switch interval `interval`, the process's own again after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@contextmanager
def collections_paused() -> Iterator[None]:
    """Around a background load and what follows it until its objects are frozen (`serve`'s
    heap, `heap.refreeze`): no automatic collection of the cyclic garbage collector. The load
    adds a few hundred thousand objects (dynamo's, inductor's and sympy's modules, the saved
    steps deserialized) and the oldest generation is collected each time it has grown by a
    quarter: every such collection walks them all holding the GIL, and a step waits for it
    (docs/performance.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
