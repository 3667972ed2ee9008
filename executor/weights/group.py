"""`WeightsGroup`: the torch.distributed group a trainer forms with an executor's ranks to
send it weights (the transport RL frameworks use: slime's and sglang's
`init_weights_update_group`, OpenRLHF's `init_process_group`).

It is a group of its own, never the default one (which a tensor-parallel executor uses for
its collectives): the trainer's rank 0 serves a rendezvous store (`TCPStore`) at
master_address:master_port; every member connects under the group's name (`PrefixStore`)
and builds a process group on it, gloo on the CPU, NCCL on CUDA.

One update, every member in this order (`executor.client.weights_client` is the trainer's
side):
1. the verdict: int32 [1] broadcast from `verdict_rank` (the executor's first rank): 0 = the
   header was accepted, else refused, and nothing follows;
2. every tensor of the header, whole and in its dtype, broadcast from `src` in order.
A failed collective (a member died, the timeout) leaves the group unusable: `failed` says
why, and a new group must be formed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from executor.core.errors import ModelStateError
from executor.weights.memory import host_bytes
from executor.weights.staging import StagingArena

DEFAULT_TIMEOUT_S = 300.0
RECEIVE_AHEAD = 2  # receives posted beyond the tensor being staged (their buffers held)
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class GroupSpec:
    """Where and how to join: this member's rank in a group of `world_size`."""

    master_address: str
    master_port: int
    rank: int
    world_size: int
    backend: str = "gloo"
    name: str = "weights"
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class WeightsGroup:
    """One member of a weights group. Joining blocks until every member joined (at most the
    timeout); the trainer's rank 0 (`rank` 0) serves the store."""

    def __init__(self, spec: GroupSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.failed: str | None = None
        timeout = timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(
            spec.master_address,
            spec.master_port,
            spec.world_size,
            spec.rank == 0,
            timeout,
            wait_for_workers=False,
        )
        self._store = dist.PrefixStore(spec.name, store)
        if spec.backend == "nccl":
            if device.type != "cuda":
                raise ValueError("backend nccl needs a CUDA device")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(self._store, spec.rank, spec.world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(self._store, spec.rank, spec.world_size, timeout)
        # Every member takes part once: the group is whole when this returns.
        self.broadcast(torch.zeros(1, dtype=torch.int32, device=self.tensor_device), 0)

    @property
    def tensor_device(self) -> torch.device:
        """Where this group's tensors live: the CUDA device for NCCL, else the CPU."""
        return self.device if self.spec.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """`src`'s `tensor` into every member's (same shape and dtype), in place."""
        return self._wait(self._post(tensor, src), tensor)

    def _post(self, tensor: torch.Tensor, src: int) -> Any:
        """Start the broadcast of `tensor` from `src`; its work, to `_wait` for."""
        if self.failed is not None:
            raise ModelStateError(
                f"the weights group failed earlier ({self.failed}); form a new one"
            )
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        try:
            return self.pg.broadcast([tensor], options)
        except RuntimeError as exc:
            raise self._fail(exc) from exc

    def _wait(self, work: Any, tensor: torch.Tensor) -> torch.Tensor:
        try:
            work.wait()
        except RuntimeError as exc:
            raise self._fail(exc) from exc
        return tensor

    def _fail(self, exc: RuntimeError) -> ModelStateError:
        """A member died or hangs: the group is unusable."""
        self.failed = f"{type(exc).__name__}: {exc}"
        return ModelStateError(f"the weights group failed: {self.failed}")

    def verdict(self, code: int, src: int) -> int:
        """The verdict of an update: `src` sends `code`, every member gets it."""
        flag = torch.tensor([code], dtype=torch.int32, device=self.tensor_device)
        return int(self.broadcast(flag, src).item())

    def receive(
        self,
        shapes: list[tuple[tuple[int, ...], torch.dtype]],
        src: int,
        arena: StagingArena | None = None,
    ) -> Iterator[torch.Tensor]:
        """Each tensor `src` broadcasts, in order, the next ones' receives already posted while
        the caller stages it (`_in_flight`). On the CPU they land in `arena` when given (kept
        from one update to the next: no page faults after the first), else in fresh memory;
        on a CUDA device in memory allocated here."""
        if arena is not None and self.tensor_device.type == "cpu":
            sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes]
            arena.begin(sizes)
            buffers: Iterable[torch.Tensor] = (
                arena.take(n).view(dtype).reshape(shape)
                for n, (shape, dtype) in zip(sizes, shapes, strict=True)
            )
        else:
            buffers = (self._buffer(*s) for s in shapes)
        yield from self._in_flight(buffers, src)

    def send(self, tensors: Iterable[torch.Tensor], src: int) -> None:
        """Broadcast each tensor from `src` (this member), in order (`_in_flight`)."""
        for _ in self._in_flight(tensors, src):
            pass

    def _in_flight(self, tensors: Iterable[torch.Tensor], src: int) -> Iterator[torch.Tensor]:
        """Each broadcast done, in order, with up to `RECEIVE_AHEAD` more started before it
        is waited for: the sender keeps sending while a receiver stages."""
        posted: deque[tuple[Any, torch.Tensor]] = deque()
        for tensor in tensors:
            posted.append((self._post(tensor, src), tensor))
            if len(posted) > RECEIVE_AHEAD:
                yield self._wait(*posted.popleft())
        while posted:
            yield self._wait(*posted.popleft())

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.tensor_device.type == "cpu":
            return host_bytes(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)
        return torch.empty(shape, dtype=dtype, device=self.tensor_device)

    def close(self) -> None:
        """Leave the group (its process group and store connection go with this object)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None and self.spec.backend == "nccl":
            shutdown()
        self.pg = None
