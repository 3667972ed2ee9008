"""Capture a callable once, replay it: a CUDA graph on CUDA, a checked stand-in on CPU.

A captured callable takes no arguments: it reads its inputs from static buffers (registry
slices, attention metadata buffers) and writes its outputs into static buffers its runner
owns, so every bucket of a runner can share one set of maximum-size output buffers.
NOTE: outputs therefore live in static memory: consume or copy them before the next replay.

On CPU, `CpuGraph` keeps the callable and calls it again at replay. Its capture runs under
the host-read guard in capture mode, which refuses what CUDA capture refuses - host reads of
tensor data (`.item()`, `.cpu()`, `.tolist()`, `bool()`), counted transfers, and ops whose
output size depends on data - so a capture-unsafe change fails in CI, not first on a GPU.
"""

from __future__ import annotations

import gc
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ops.host_read_guard import HostReadError, HostReadGuard

WARMUP_RUNS = 2


class GraphCaptureError(RuntimeError):
    """A callable could not be captured; its bucket runs eagerly instead."""


class Graph(ABC):
    @abstractmethod
    def capture(self, fn: Callable[[], None]) -> None:
        """Record `fn` (warm-up runs first) so that `replay` re-executes it on the same buffers."""

    @abstractmethod
    def replay(self) -> None: ...


class CpuGraph(Graph):
    """The CPU stand-in: capture checks `fn` is capture-safe; replay calls it again."""

    def __init__(self) -> None:
        self._fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        for _ in range(WARMUP_RUNS):
            fn()
        try:
            with HostReadGuard(capture=True):
                fn()
        except HostReadError as e:
            raise GraphCaptureError(str(e)) from e
        self._fn = fn

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay before capture")
        self._fn()


class CudaGraph(Graph):
    """`torch.cuda.CUDAGraph` captured on the factory's side stream into its shared pool."""

    def __init__(self, pool: Any, stream: torch.cuda.Stream) -> None:
        self._pool = pool
        self._stream = stream
        self._graph: torch.cuda.CUDAGraph | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(self._stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
                fn()
        except RuntimeError as e:  # e.g. "operation not permitted when stream is capturing"
            raise GraphCaptureError(f"CUDA graph capture failed: {e}") from e
        self._graph = graph

    def replay(self) -> None:
        if self._graph is None:
            raise RuntimeError("replay before capture")
        self._graph.replay()


class GraphFactory:
    """Makes graphs for one device; on CUDA every graph shares one memory pool and one
    capture stream (captured largest first, smaller graphs reuse the larger ones' memory)."""

    def __init__(self, device: torch.device, stop: threading.Event | None = None) -> None:
        self.device = device
        # Set by the host to interrupt a capture pass at the next bucket (shutdown at start-up).
        self.stop = stop or threading.Event()
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=device)

    def new(self) -> Graph:
        if self.device.type == "cuda":
            assert self._stream is not None
            return CudaGraph(self._pool, self._stream)
        return CpuGraph()

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Around a whole capture pass: a collected, frozen heap, so a GC pause cannot land
        inside a capture, and no autograd state."""
        gc.collect()
        gc.freeze()
        try:
            with torch.inference_mode():
                yield
        finally:
            gc.unfreeze()

    def memory_bytes(self) -> int:
        """Device memory currently allocated (CUDA); 0 on CPU."""
        return int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else 0
