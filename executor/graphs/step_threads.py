"""`StepThreads`: the intra-op threads a CPU step runs with, one fewer while a compile worker
runs beside the server.

The worker (`compile_job`) traces and compiles on a core of its own for minutes, at a low
priority. The step's OpenMP team still counts on every core: a parallel region then waits at
its barrier for the thread the worker displaced, and a step now and then took many times its
length (docs/performance.md). With one thread fewer the team fits beside the worker.
The count is per thread in torch (OpenMP's), so the thread that runs the steps applies it,
between two steps (`apply`); the capture thread only says how many cores the worker holds.
"""

from __future__ import annotations

import torch


class StepThreads:
    def __init__(self) -> None:
        self.full = torch.get_num_threads()  # the process's, as configured at start-up
        self.reserved = 0  # cores a compile worker holds now (set by the capture thread)

    @property
    def wanted(self) -> int:
        return max(1, self.full - self.reserved)

    def apply(self) -> None:
        """On the thread that runs steps, before one: its intra-op threads as wanted now."""
        wanted = self.wanted
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
