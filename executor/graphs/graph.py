"""Capture a callable once, replay it: a CUDA graph on CUDA, a checked stand-in on CPU.

A captured callable takes no arguments: it reads its inputs from static buffers (registry
slices, attention metadata buffers) and writes its outputs into static buffers its runner
owns, so every bucket of a runner can share one set of maximum-size output buffers.
NOTE: outputs therefore live in static memory: consume or copy them before the next replay.

On CPU, `CpuGraph` keeps the callable and calls it again at replay. Its capture runs under
the host-read guard in capture mode, which refuses what CUDA capture refuses - host reads of
tensor data (`.item()`, `.cpu()`, `.tolist()`, `bool()`), counted transfers, and ops whose
output size depends on data - so a capture-unsafe change fails in CI, not first on a GPU.

A capture has two phases: `compile`, which runs nothing and touches no device state (so a
background capture runs it off the step lock: inductor's trace, code generation and C++
compile, or the load of a saved compile), and `capture`, which runs the callable (warm-up,
checks, recording) between two steps. The graph backends and their factory:
`executor.graphs.factory`; the whole-step compiled graph: `executor.graphs.step_graph`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from executor.graphs.capture_rules import HostReadError, HostReadGuard
from ops.device_scope import check_device, resolve_index

WARMUP_RUNS = 2


class GraphCaptureError(RuntimeError):
    """A callable could not be captured; its bucket runs eagerly instead."""


class GraphCaptureOOM(GraphCaptureError):
    """Out of memory while capturing, with the capture ended cleanly: only this bucket is lost."""


class GraphCapturePoisoned(GraphCaptureError):
    """A capture that broke what later captures rely on (on CUDA: the capture did not end
    cleanly, or an op the capture forbids ran inside it). No further capture is attempted by
    this factory (on CUDA: in this process), and its graphs are no longer replayed."""


class Graph(ABC):
    @abstractmethod
    def capture(self, fn: Callable[[], None]) -> None:
        """Record `fn` (warm-up runs first) so that `replay` re-executes it on the same buffers."""

    @abstractmethod
    def replay(self) -> None: ...

    def compile(self, fn: Callable[[], None]) -> None:
        """Before `capture`, off the step lock: what capturing `fn` can do without running it
        or touching device state (a compile from its inputs' shapes, or a load of the
        compiled code). Nothing by default: capture does it all."""
        return None

    def capture_twin(self, fn: Callable[[], None], twin: Graph) -> None:
        """Record `fn`, which runs the same code as the captured `twin` on buffers of other
        sizes (a DECODE batch-size bucket's larger KV buckets). A full capture here; backends
        whose capture only checks and compiles code that `twin` already checked and compiled
        (`GraphFactory.shares_twin_captures`) skip the runs."""
        self.capture(fn)


def check_capture_rules(fn: Callable[[], None]) -> None:
    """Run `fn` once under the host-read guard in capture mode, modelling how a CUDA capture
    fails: what CUDA capture refuses (a host read, a counted transfer, an upload from
    pageable memory, a synchronize) invalidates the capture and raises GraphCapturePoisoned
    naming it; an out-of-memory error raises GraphCaptureOOM (the capture ends cleanly)."""
    try:
        with HostReadGuard(capture=True):
            fn()
    except HostReadError as e:
        raise GraphCapturePoisoned(str(e)) from e
    except torch.OutOfMemoryError as e:
        raise GraphCaptureOOM(f"out of memory during capture: {e}") from e


class CpuGraph(Graph):
    """The CPU stand-in: capture checks `fn` is capture-safe; replay calls it again."""

    def __init__(self) -> None:
        self._fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        try:
            for _ in range(WARMUP_RUNS):
                fn()
        except torch.OutOfMemoryError as e:
            raise GraphCaptureOOM(f"out of memory in a warm-up run: {e}") from e
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

    A twin (`capture_twin`: the same batch size at a larger KV bucket) runs nothing at
    capture: its compiled halves see the same shapes as its twin's (attention, the only part
    sized by the KV bucket, runs eagerly between them) and its code passed the twin's check.
    Running the step at every KV bucket up to max_context_len would make start-up slow.
    """

    def __init__(self, compiled: Callable[[], AbstractContextManager[object]]) -> None:
        self._compiled = compiled
        self._fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        check_capture_rules(fn)  # eagerly, as the stand-in does
        try:
            with self._compiled():
                fn()  # compiles what this bucket's shapes need (or finds it in the cache)
        except torch.OutOfMemoryError as e:
            raise GraphCaptureOOM(f"out of memory while compiling: {e}") from e
        except Exception as e:  # dynamo and inductor raise many types; the bucket runs eagerly
            raise GraphCaptureError(f"torch.compile failed: {type(e).__name__}: {e}") from e
        self._fn = fn

    def compile(self, fn: Callable[[], None]) -> None:
        """Before `capture`, off the step lock: what capturing `fn` can do without running it
        or touching device state (a compile from its inputs' shapes, or a load of the
        compiled code). Nothing by default: capture does it all."""
        return None

    def capture_twin(self, fn: Callable[[], None], twin: Graph) -> None:
        if not isinstance(twin, CompiledGraph) or twin._fn is None:
            self.capture(fn)
            return
        self._fn = fn

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay before capture")
        with self._compiled():
            self._fn()


class CudaGraph(Graph):
    """`torch.cuda.CUDAGraph` captured on the factory's side stream into its shared pool.

    Capture does by hand what `torch.cuda.graph` does, so that a failure cannot leave the
    side stream current or the allocator in its "capture underway" state: the stream is
    restored by its `with`, `capture_end` always runs once `capture_begin` did, and a
    `capture_begin` that failed part way is undone (`begin_capture`). A capture that did not
    end cleanly raises GraphCapturePoisoned (no further capture is safe in
    this process); an out-of-memory error in a capture that ended cleanly raises
    GraphCaptureOOM (only this bucket is lost)."""

    def __init__(self, pool: Any, stream: torch.cuda.Stream, device: torch.device) -> None:
        self._pool = pool
        self._stream = stream
        self._device = device
        self._graph: torch.cuda.CUDAGraph | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        check_device(self._device, "CUDA graph capture")
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for _ in range(WARMUP_RUNS):
                fn()
        current.wait_stream(self._stream)
        torch.cuda.synchronize(self._device)
        graph = torch.cuda.CUDAGraph()
        body_error: BaseException | None = None
        # The stream: the previous one comes back on any exit.
        with torch.cuda.stream(self._stream):
            # thread_local: a background capture (set_graph_mode(background=True)) holds the
            # step lock, so no other thread launches work meanwhile; other threads' host-side
            # CUDA calls (an RPC thread, a metrics scrape) must not invalidate the capture.
            begin_capture(graph, self._pool, self._device)
            try:
                fn()
            except BaseException as e:  # the capture must still end (below)
                body_error = e
            try:
                graph.capture_end()
            except RuntimeError as e:
                raise GraphCapturePoisoned(f"CUDA graph capture did not end: {e}") from (
                    body_error or e
                )
        if isinstance(body_error, torch.OutOfMemoryError):
            raise GraphCaptureOOM(f"out of memory during capture: {body_error}") from body_error
        if body_error is not None:
            raise GraphCapturePoisoned(
                f"CUDA graph capture failed: {type(body_error).__name__}: {body_error}"
            ) from body_error
        self._graph = graph

    def replay(self) -> None:
        if self._graph is None:
            raise RuntimeError("replay before capture")
        self._graph.replay()


def begin_capture(graph: Any, pool: Any, device: torch.device) -> None:
    """`graph.capture_begin` into `pool`, undone where it fails part way. CUDA's allocator
    routes the thread's allocations to the pool before the stream capture starts, and a
    failure after that (the pinned-memory allocator's own check, say) would leave the
    allocator believing a capture is under way for good: every later `empty_cache` would
    keep its segments. Undone, the failure costs one bucket (GraphCaptureError); a stream
    capture that started and cannot end poisons (GraphCapturePoisoned)."""
    try:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    except RuntimeError as e:
        if torch.cuda.is_current_stream_capturing():
            try:
                graph.capture_end()
            except RuntimeError as end_error:
                raise GraphCapturePoisoned(
                    f"CUDA graph capture failed to start and did not end: {end_error}"
                ) from e
        else:
            # RuntimeError: the allocator had not routed to the pool yet, nothing to undo.
            with contextlib.suppress(RuntimeError):
                torch._C._cuda_endAllocateToPool(resolve_index(device).index, pool)
        raise GraphCaptureError(f"CUDA graph capture did not start: {e}") from e
