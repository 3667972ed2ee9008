"""The one door through which serving-path data leaves the device, counted per reason.

Every device-to-host read on the forward path calls :func:`to_host` with a `reason`
(``sampled_tokens``, ``logprobs``, ``seq_lens_cpu``, ...). The counts feed the
`model_executor_d2h_syncs_total` metric, and tests assert them exactly. On a CPU device the
"transfer" is a copy, counted all the same so that the accounting is checked in CI. Tests
run the step under :class:`ops.host_read_guard.HostReadGuard`, which fails on any host read
that bypasses this door.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from ops.host_read_guard import counted_transfer, mark_host


@dataclass
class HostTransferCounts:
    """Process-wide counts of device-to-host transfers, by reason."""

    syncs: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    # All reasons together: a step reads it before and after to count its own syncs.
    total_syncs: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, reason: str, nbytes: int) -> None:
        with self._lock:
            self.syncs[reason] += 1
            self.bytes[reason] += nbytes
            self.total_syncs += 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.syncs), dict(self.bytes)


host_transfers = HostTransferCounts()


def to_host(tensor: torch.Tensor, reason: str, *, non_blocking: bool = False) -> torch.Tensor:
    """Copy `tensor` to the host and count it under `reason`; returns a CPU tensor.

    A CPU tensor is copied too (and counted): the count describes the serving path's design,
    not the device it happens to run on, and the result never aliases device memory on any
    device (a graph's static output buffer is overwritten by the next replay).
    """
    host_transfers.record(reason, tensor.numel() * tensor.element_size())
    with counted_transfer(reason):
        if tensor.device.type == "cpu":
            host = tensor.clone()
        else:
            host = tensor.to("cpu", non_blocking=non_blocking)
    mark_host(host)
    return host
