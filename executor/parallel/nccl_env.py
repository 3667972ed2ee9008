"""NCCL's error handling, set by the launcher before the group is joined.

NCCL collectives are asynchronous: a dead or hung peer does not fail the call that enqueued
the collective, so without help `TpGroupError` never fires on CUDA. PyTorch's watchdog
thread finds a collective that ran past the group's timeout; with asynchronous error
handling in "clean up only" mode (2) it aborts the communicator and marks the work failed
instead of killing the process (modes 1 and 3, the default, end the process from the
watchdog: no NOT_SERVING, no log line of ours). `TpComm.settle` then raises the failure as
`TpGroupError` at the end of the step.

The variable is read when the NCCL process group is created, so it is set by the launcher
(`executor.service.tp_launch`, before `init_comm`), never at import. An operator's own
value wins.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"  # abort the communicator, fail the work, keep the process


def set_nccl_error_handling(env: MutableMapping[str, str], device: torch.device) -> str | None:
    """Turn asynchronous error handling on in `env` (the process environment) when this rank
    joins over NCCL (a CUDA device); the value in force, or None on CPU (gloo fails its
    calls synchronously)."""
    if device.type != "cuda":
        return None
    return env.setdefault(ASYNC_ERROR_HANDLING, CLEAN_UP_ONLY)
