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
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
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


def check_capture_rules(fn: Callable[[], None]) -> None:
    """Run `fn` once under the host-read guard in capture mode: what CUDA capture refuses
    raises GraphCaptureError naming it."""
    try:
        with HostReadGuard(capture=True):
            fn()
    except HostReadError as e:
        raise GraphCaptureError(str(e)) from e


class CpuGraph(Graph):
    """The CPU stand-in: capture checks `fn` is capture-safe; replay calls it again."""

    def __init__(self) -> None:
        self._fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        for _ in range(WARMUP_RUNS):
            fn()
        check_capture_rules(fn)
        self._fn = fn

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay before capture")
        self._fn()


class CompiledGraph(Graph):
    """The CPU backend that pays: `fn` runs with the model's layer halves compiled by
    inductor (static shapes), so each bucket's shapes are compiled once and shared by every
    layer; attention and the glue between halves stay as they are.

    Capture first runs `fn` as the stand-in does, under CUDA's capture rules, so a
    capture-unsafe change fails here too; then compiles by warming `fn` up inside
    `compiled()` once (a compile error fails the capture: its bucket runs eagerly). Replay calls
    `fn` inside `compiled()` again, on the same static buffers.
    """

    def __init__(self, compiled: Callable[[], AbstractContextManager[object]]) -> None:
        self._compiled = compiled
        self._fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        check_capture_rules(fn)  # eagerly, as the stand-in does
        try:
            with self._compiled():
                fn()  # compiles what this bucket's shapes need (or finds it in the cache)
        except Exception as e:  # dynamo and inductor raise many types; the bucket runs eagerly
            raise GraphCaptureError(f"torch.compile failed: {type(e).__name__}: {e}") from e
        self._fn = fn

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay before capture")
        with self._compiled():
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


GRAPH_BACKEND_NAMES = ("cuda", "compiled", "standin")


class GraphFactory:
    """Makes graphs of one backend for one device: `cuda` (every graph shares one memory pool
    and one capture stream, captured largest first so smaller graphs reuse the larger ones'
    memory), `compiled` (inductor; its caches under `cache_dir`) or `standin`."""

    def __init__(
        self,
        device: torch.device,
        backend: str = "standin",
        *,
        cache_dir: Path | None = None,
        compiled: Callable[[], AbstractContextManager[object]] = nullcontext,
        stop: threading.Event | None = None,
    ) -> None:
        if backend not in GRAPH_BACKEND_NAMES:
            raise ValueError(
                f"graph backend must be one of {', '.join(GRAPH_BACKEND_NAMES)}, got {backend!r}"
            )
        if backend == "cuda" and device.type != "cuda":
            raise ValueError(f"graph backend 'cuda' needs a CUDA device, got {device}")
        self.device = device
        self.backend = backend
        self.cache_dir = cache_dir
        self.compiled = compiled  # `compiled`: the context in which the model runs compiled
        # Set by the host to interrupt a capture pass at the next bucket (shutdown at start-up).
        self.stop = stop or threading.Event()
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        if backend == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=device)

    def new(self) -> Graph:
        if self.backend == "cuda":
            assert self._stream is not None
            return CudaGraph(self._pool, self._stream)
        if self.backend == "compiled":
            return CompiledGraph(self.compiled)
        return CpuGraph()

    def prepare(self, graphs: int) -> None:
        """Before capturing `graphs` more graphs. For `compiled`: room in dynamo's recompile
        limit (the compiled halves are one code object with one entry per shape, two where
        the first layer's residual differs), and inductor's on-disk caches under
        `cache_dir`, so a restart with the same model and buckets loads compiled code
        instead of compiling it again."""
        if self.backend != "compiled":
            return
        import torch._dynamo

        cfg = torch._dynamo.config
        cfg.recompile_limit = cfg.recompile_limit + 2 * graphs
        cfg.accumulated_recompile_limit = cfg.accumulated_recompile_limit + 4 * graphs
        if self.cache_dir is not None:
            # NOTE: process-wide; inductor reads it whenever it looks for a cached artifact.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir / "inductor")

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
