"""`TpComm`: the collectives a tensor-parallel model runs, timed, with failures made explicit.

One object per process. At `size == 1` every collective is a no-op, so the model code calls
them unconditionally. The all-reduce time is accumulated per step (`take_allreduce_ns`) for
the metrics; on CUDA the host clock sees the enqueue of an NCCL call, not its completion, so
the figure there is a lower bound (inside a CUDA graph it is not seen at all).

A collective that fails (a peer died: connection closed; a peer hangs: the group's timeout)
raises `TpGroupError` and marks the group failed for good: a tensor-parallel group that lost
a rank cannot be resynchronised, so the host stops serving and exits (`on_failure`). gloo
fails the call itself; an NCCL call only enqueues, so its failure (the watchdog aborting it,
`nccl_env.py`) is raised by `settle` at the end of the step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _stream_capturing(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s stream is capturing a CUDA graph (an op there is recorded)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


class TpGroupError(RuntimeError):
    """A collective of the tensor-parallel group failed; the group is unusable."""


@dataclass
class TpComm:
    rank: int = 0
    size: int = 1
    backend: str = "none"  # gloo | nccl | none (size 1)
    group: Any = None  # the torch.distributed process group (None: the default group)
    # Where host data travels (the batch broadcast, pings): a gloo group next to NCCL, so
    # headers and batches never go through device memory; None: `group` (gloo on CPU).
    cpu_group: Any = None
    # Called once, with the reason, when a collective fails (the server turns NOT_SERVING).
    on_failure: Callable[[str], None] | None = None
    failed: str | None = None
    allreduce_ns: int = 0  # accumulated since the last take_allreduce_ns
    allreduce_calls: int = 0
    _notified: bool = field(default=False, repr=False)
    _capture_thread: int | None = field(default=None, repr=False)
    # The bound of `settle`'s wait (the group's timeout, `tp_timeout_s`).
    wait_timeout_s: float = 60.0
    _pending: Any = field(default=None, repr=False)  # the last NCCL all-reduce's Work

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if self.failed is not None:
            raise TpGroupError(f"tensor-parallel group failed earlier: {self.failed}")
        try:
            return fn()
        except RuntimeError as e:  # gloo/NCCL: connection closed, timeout (DistBackendError)
            self.fail(f"{what} on rank {self.rank}: {type(e).__name__}: {e}")
            raise TpGroupError(self.failed) from e

    def fail(self, reason: str) -> None:
        """Mark the group failed (first reason wins) and tell the host once."""
        if self.failed is None:
            self.failed = reason
        if not self._notified and self.on_failure is not None:
            self._notified = True
            self.on_failure(self.failed)

    @contextmanager
    def capture_runs(self) -> Iterator[None]:
        """Around a graph-capture pass on this thread: the model's all-reduces in its warm-up
        and check runs do not communicate (their outputs are discarded, and a rank whose
        bucket fails must not leave the others inside that bucket's collectives); on CUDA
        the all-reduce a capturing stream records is still recorded (it communicates at
        replay). Ranks then agree on each bucket (`executor.parallel.agreement`)."""
        self._capture_thread = threading.get_ident()
        try:
            yield
        finally:
            self._capture_thread = None

    def _local_only(self, tensor: torch.Tensor) -> bool:
        if self._capture_thread != threading.get_ident():
            return False
        return not _stream_capturing(tensor)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self.size == 1 or self._local_only(tensor):
            return tensor
        t0 = time.perf_counter_ns()
        if self.backend == "nccl" and not _stream_capturing(tensor):
            self._call("all_reduce", lambda: self._enqueue_all_reduce(tensor))
        else:
            self._call("all_reduce", lambda: dist.all_reduce(tensor, group=self.group))
        self.allreduce_ns += time.perf_counter_ns() - t0
        self.allreduce_calls += 1
        return tensor

    def _enqueue_all_reduce(self, tensor: torch.Tensor) -> None:
        """NCCL: enqueue the all-reduce and order the current stream after it (no host
        wait); the work is kept so `settle` can see whether it failed."""
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        work.wait()  # NCCL: the current stream waits for the NCCL stream, the host does not
        self._pending = work

    def settle(self) -> None:
        """After a step's device work is done (its one device-to-host read): the step's last
        NCCL collective is waited on, bounded by the group's timeout (`wait_timeout_s`).
        It completed with the step, so the wait costs nothing; a collective the watchdog
        aborted (a dead or hung peer) raises `TpGroupError` here instead of the step
        returning what a broken group computed. A no-op on gloo, whose calls fail
        synchronously."""
        work, self._pending = self._pending, None
        if work is not None:
            self._call("all_reduce", lambda: work.wait(timedelta(seconds=self.wait_timeout_s)))

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` along the last dimension (rank order)."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._call("all_gather", lambda: dist.all_gather(parts, tensor, group=self.group))
        return torch.cat(parts, dim=-1)

    def all_gather_host(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's host `tensor` (same shape and dtype on every rank), in rank order,
        over the CPU group: host facts the ranks must agree on (never device memory)."""
        if self.size == 1:
            return [tensor]
        group = self.cpu_group or self.group
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._call("all_gather", lambda: dist.all_gather(parts, tensor, group=group))
        return parts

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (same shape and dtype), in place."""
        if self.size > 1:
            group = self.cpu_group or self.group
            self._call("broadcast", lambda: dist.broadcast(tensor, src=0, group=group))
        return tensor

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (the others pass None): its length, then its bytes,
        as two tensor broadcasts (never an object broadcast: no Python object is rebuilt)."""
        if self.size == 1:
            assert data is not None
            return data
        group = self.cpu_group or self.group
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self._call("broadcast", lambda: dist.broadcast(length, src=0, group=group))
        if data is not None:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(length[0]), dtype=torch.uint8)
        self._call("broadcast", lambda: dist.broadcast(buf, src=0, group=group))
        return buf.numpy().tobytes()

    def ping(self) -> None:
        """Every rank takes part (a one-element sum on the CPU group): proves they are alive."""
        if self.size > 1:
            group = self.cpu_group or self.group
            one = torch.ones(1)
            self._call("ping", lambda: dist.all_reduce(one, group=group))

    def take_allreduce_ns(self) -> int:
        """The all-reduce time since the last call, and reset it."""
        ns, self.allreduce_ns, self.allreduce_calls = self.allreduce_ns, 0, 0
        return ns
