"""A serving process on the CPU never imports Triton.

No CPU path runs a Triton kernel: the triton attention backend and the fused ops of
`ops/triton_fused.py` need CUDA. But torch's dynamo imports `triton` whenever it is installed,
and so a CPU server's background compile, or its load of compiled steps, does: the module's
initialisation holds the interpreter lock in one stretch, which a step arriving meanwhile waits
out, and its library stays resident (docs/performance.md, "Start-up"). A process entry point
whose device is the CPU (`serve` rank 0, every worker rank, the compile worker) calls
`keep_out_on_cpu` before anything imports dynamo: `import triton` then fails there as it does
where triton is not installed, and torch takes that path. A library caller's process (a test,
a notebook) keeps its imports: only entry points call it.
"""

from __future__ import annotations

import sys

import torch


def runs_on_cpu(device: str) -> bool:
    """Whether the configured `device` ('auto', 'cpu', 'cuda', 'cuda:N') is the CPU here: the
    rule of `executor.config.resolve_device`, which this bottom layer cannot import (and which
    raises for a CUDA device that is not there, a start-up error the entry point reports
    later)."""
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def keep_out_on_cpu(device: str) -> bool:
    """On a CPU `device`, `import triton` fails in this process from now on (unless triton is
    imported already: then it stays). Whether triton is kept out."""
    if not runs_on_cpu(device):
        return False
    if sys.modules.get("triton") is not None:
        return False
    # importlib's mark for a module that cannot be imported here
    sys.modules["triton"] = None  # type: ignore[assignment]
    return True
