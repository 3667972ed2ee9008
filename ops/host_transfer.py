"""The doors through which serving-path data crosses between host and device, counted.

Every device-to-host read on the forward path calls :func:`to_host` with a `reason`
(``sampled_tokens``, ``logits``, ``seq_lens_cpu``, ...). The counts feed the
`model_executor_d2h_syncs_total` metric, and tests assert them exactly. On a CPU device the
"transfer" is a copy, counted all the same so that the accounting is checked in CI. Tests
run the step under `executor.graphs.capture_rules.HostReadGuard`, which fails on any host read
that bypasses this door.

The other direction goes through :func:`to_device`: an upload from pinned memory with
`non_blocking=True` is an asynchronous copy (`h2d_copies`); anything else - pageable memory,
or a blocking copy - synchronizes the host with the stream on CUDA and is counted as a sync
(`h2d_syncs`), so a step's sync count is honest in both directions.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from ops.host_reads import check_upload, counted_transfer, is_pinned, mark_host
from ops.host_reads import state as read_state


@dataclass
class HostTransferCounts:
    """Process-wide counts of device-to-host transfers, by reason."""

    syncs: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    # All reasons together: a step reads it before and after to count its own syncs.
    total_syncs: int = 0
    # Host-to-device: asynchronous copies from pinned memory, and synchronizing uploads.
    h2d_copies: Counter[str] = field(default_factory=Counter)
    h2d_syncs: Counter[str] = field(default_factory=Counter)
    h2d_bytes: Counter[str] = field(default_factory=Counter)
    total_h2d_copies: int = 0
    total_h2d_syncs: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, reason: str, nbytes: int) -> None:
        with self._lock:
            self.syncs[reason] += 1
            self.bytes[reason] += nbytes
            self.total_syncs += 1

    def record_h2d(self, reason: str, nbytes: int, *, sync: bool) -> None:
        with self._lock:
            if sync:
                self.h2d_syncs[reason] += 1
                self.total_h2d_syncs += 1
            else:
                self.h2d_copies[reason] += 1
                self.total_h2d_copies += 1
            self.h2d_bytes[reason] += nbytes

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.syncs), dict(self.bytes)

    def h2d_snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        """(synchronizing uploads, asynchronous staged copies) by reason."""
        with self._lock:
            return dict(self.h2d_syncs), dict(self.h2d_copies)

    def totals(self) -> tuple[int, int, int]:
        """(device-to-host syncs, host-to-device syncs, host-to-device async copies)."""
        with self._lock:
            return self.total_syncs, self.total_h2d_syncs, self.total_h2d_copies


host_transfers = HostTransferCounts()


def to_host(tensor: torch.Tensor, reason: str, *, non_blocking: bool = False) -> torch.Tensor:
    """Copy `tensor` to the host and count it under `reason`; returns a CPU tensor.

    A CPU tensor is copied too (and counted): the count describes the serving path's design,
    not the device it happens to run on, and the result never aliases device memory on any
    device (a graph's static output buffer is overwritten by the next replay).
    """
    host_transfers.record(reason, tensor.numel() * tensor.element_size())
    if not read_state.guards:  # the serving path: no guard to tell (every step comes here)
        return tensor.clone() if tensor.is_cpu else tensor.to("cpu", non_blocking=non_blocking)
    with counted_transfer(reason):
        if tensor.device.type == "cpu":
            host = tensor.clone()
        else:
            host = tensor.to("cpu", non_blocking=non_blocking)
    mark_host(host)
    return host


def to_host_packed(tensors: list[torch.Tensor], reason: str) -> list[torch.Tensor]:
    """Several device tensors to the host in one counted transfer: their bytes concatenated
    on the device, copied once, and viewed back with each one's dtype and shape."""
    return to_host_async(tensors, reason).wait()


class HostCopy:
    """Device tensors on their way to the host: one counted transfer, enqueued by
    :func:`to_host_async`; :meth:`wait` returns the host copies (each one's dtype and shape).

    On CUDA the bytes go into pinned memory with a non-blocking copy and an event recorded
    after it, so the host is free until it waits; on a CPU device the copy is made at once."""

    def __init__(
        self,
        host: torch.Tensor,
        shapes: list[tuple[torch.dtype, torch.Size, int, int]],
        event: torch.cuda.Event | None,
    ) -> None:
        self._host = host
        self._shapes = shapes  # (dtype, shape, byte offset, bytes) per tensor
        self._event = event

    def ready(self) -> bool:
        """Whether the copy is done (never blocks)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> list[torch.Tensor]:
        """The host copies, once the copy is done (CUDA: the step's one wait for the device)."""
        if self._event is not None:
            self._event.synchronize()
        host = self._host
        mark_host(host)  # host data for a guard entered since the copy was enqueued
        if len(self._shapes) == 1 and host.dtype == self._shapes[0][0]:
            return [host]
        out = [host[at : at + n].view(dtype).reshape(shape) for dtype, shape, at, n in self._shapes]
        for t in out:
            mark_host(t)
        return out


def to_host_async(tensors: list[torch.Tensor], reason: str) -> HostCopy:
    """Enqueue the copy of `tensors` to the host in one counted transfer (their bytes
    concatenated on the device, each part 8-byte aligned); the result is read with
    :meth:`HostCopy.wait`."""
    if len(tensors) == 1:
        t = tensors[0]
        nbytes = t.numel() * t.element_size()
        if t.device.type == "cpu":
            return HostCopy(to_host(t, reason), [(t.dtype, t.shape, 0, nbytes)], None)
        flat_one = t.contiguous()
        return _enqueue(flat_one, [(t.dtype, t.shape, 0, nbytes)], reason)
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    pad = [(-f.numel()) % 8 for f in flat]  # every part starts 8-byte aligned
    parts, shapes, at = [], [], 0
    for t, f, p in zip(tensors, flat, pad, strict=True):
        parts.append(f)
        if p:
            parts.append(f.new_zeros(p))
        shapes.append((t.dtype, t.shape, at, f.numel()))
        at += f.numel() + p
    packed = torch.cat(parts)
    if packed.device.type == "cpu":
        return HostCopy(to_host(packed, reason), shapes, None)
    return _enqueue(packed, shapes, reason)


def _enqueue(
    device: torch.Tensor, shapes: list[tuple[torch.dtype, torch.Size, int, int]], reason: str
) -> HostCopy:
    """CUDA: a non-blocking copy into pinned host memory, and an event after it."""
    host_transfers.record(reason, device.numel() * device.element_size())
    with counted_transfer(reason):
        host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
        host.copy_(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device.device))
    mark_host(host)
    return HostCopy(host, shapes, event)


def to_device(
    tensor: torch.Tensor,
    out: torch.Tensor | torch.device,
    reason: str,
    *,
    non_blocking: bool = True,
    pinned: bool | None = None,
) -> torch.Tensor:
    """Copy host `tensor` to the device (into `out` when it is a tensor) and count it under
    `reason`: asynchronous from pinned memory with `non_blocking`, a sync otherwise (a
    pageable upload waits for the stream on CUDA). Under a capture guard an upload from
    pageable memory is refused, as CUDA capture refuses it. On CPU it is a copy all the same,
    counted the same way. `pinned`: what the caller knows of `tensor` (None: look it up)."""
    check_upload(tensor, f"to_device(reason={reason!r})")
    sync = not (non_blocking and (is_pinned(tensor) if pinned is None else pinned))
    host_transfers.record_h2d(reason, tensor.numel() * tensor.element_size(), sync=sync)
    if isinstance(out, torch.Tensor):
        return out.copy_(tensor, non_blocking=not sync)
    if out.type == "cpu":
        return tensor.clone()
    return tensor.to(out, non_blocking=not sync)
