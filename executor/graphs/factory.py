"""`GraphFactory`: makes the graphs of one backend for one device, and what they share.

Backends: `cuda` (every graph shares one memory pool and one capture stream, captured
largest first so smaller graphs reuse the larger ones' memory), `compiled` (the model's layer
halves compiled by inductor), `compiled_step` (whole DECODE steps compiled one by one, saved
under `<cache_dir>/graphs`; other graphs as `compiled`) or `standin` (the CPU stand-in).
The two compiled backends compile with `compiler` (`executor.core.names.GRAPH_COMPILERS`):
inductor, or dynamo's `eager` backend under batch_invariant, whose whole steps are not saved.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from executor.core.names import GRAPH_BACKENDS, GRAPH_COMPILERS, INDUCTOR
from executor.graphs import code_cache
from executor.graphs.artifacts import ArtifactStore
from executor.graphs.compile_compat import raise_recompile_limits
from executor.graphs.graph import CompiledGraph, CpuGraph, CudaGraph, Graph
from executor.graphs.step_graph import StepCompiledGraph

# CUDA's caching allocator and capture state are process-wide: once one CUDA capture is
# poisoned, no factory in the process captures or replays again. Set once, never cleared.
_cuda_poisoned: list[str] = []


class GraphFactory:
    """Makes graphs of one backend for one device (module docstring)."""

    def __init__(
        self,
        device: torch.device,
        backend: str = "standin",
        *,
        cache_dir: Path | None = None,
        compiled: Callable[[], AbstractContextManager[object]] = nullcontext,
        compile_halves: Callable[[int, str], None] | None = None,
        stop: threading.Event | None = None,
        compiler: str = INDUCTOR,
    ) -> None:
        """`compiled`: the context in which the model runs its compiled layer halves;
        `compile_halves(tokens, kind)`: compiles those halves for `tokens` rows as the `kind`
        runner calls them, without touching device state (a capture's compile phase);
        `compiler`: the torch.compile backend of whole steps (the halves' is the caller's)."""
        if backend not in GRAPH_BACKENDS:
            raise ValueError(
                f"graph backend must be one of {', '.join(GRAPH_BACKENDS)}, got {backend!r}"
            )
        if compiler not in GRAPH_COMPILERS:
            raise ValueError(
                f"graph compiler must be one of {', '.join(GRAPH_COMPILERS)}, got {compiler!r}"
            )
        if backend == "cuda" and device.type != "cuda":
            raise ValueError(f"graph backend 'cuda' needs a CUDA device, got {device}")
        self.device = device
        self.backend = backend
        self.compiler = compiler
        self.cache_dir = cache_dir
        self.compiled = compiled
        self._compile_halves = compile_halves
        # (runner kind, row-count class: 1, or 2 and more) compiled so far.
        self._halves_compiled: set[tuple[str, int]] = set()
        # Where whole compiled steps are saved and loaded from (compiled_step with a cache).
        self.store = (
            ArtifactStore(cache_dir / "graphs")
            if cache_dir is not None and backend == "compiled_step" and compiler == INDUCTOR
            else None
        )
        # The compile worker's: a whole step already saved is not loaded, only kept.
        self.store_only = False
        # Set by the host to interrupt a capture pass at the next bucket (shutdown at start-up).
        self.stop = stop or threading.Event()
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._poisoned: str | None = None
        if backend == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=device)

    def new_round(self) -> None:
        """Every graph captured so far is dropped: later captures go into a new pool. A pool
        id outlives its graphs in CUDA's pinned-memory allocator (an entry with no user left),
        and a capture into an id whose graphs are all gone fails in `capture_begin`."""
        if self.backend == "cuda":
            self._pool = torch.cuda.graph_pool_handle()

    def new(self, *, whole_step: bool = False) -> Graph:
        """A graph for one bucket. `whole_step`: the callable is a whole model step (the
        DECODE runner's `StepCall`), which `compiled_step` compiles as one graph."""
        if self.backend == "cuda":
            assert self._stream is not None
            return CudaGraph(self._pool, self._stream, self.device)
        if self.whole_steps and whole_step:
            return StepCompiledGraph(self.store, load=not self.store_only, compiler=self.compiler)
        if self.backend in ("compiled", "compiled_step"):
            return CompiledGraph(self.compiled)
        return CpuGraph()

    @property
    def whole_steps(self) -> bool:
        """Whether a whole DECODE step compiles as one graph (`StepCompiledGraph`)."""
        return self.backend == "compiled_step"

    @property
    def compiles(self) -> bool:
        """Whether capturing compiles code (inductor), which a background capture does in a
        compile worker first (`executor.compile_worker`)."""
        return self.backend in ("compiled", "compiled_step")

    def compile_halves(self, tokens: int, kind: str) -> None:
        """The capture's compile phase for graphs that run the compiled layer halves: compile
        them for `tokens` rows, as the `kind` runner calls them, on private inputs (no
        device state), so that the capture that follows finds them compiled. Nothing for
        the other backends. The halves are compiled with dynamic shapes: one compile serves
        every row count from 2 up (1 is its own)."""
        shape_class = (kind, min(tokens, 2))
        if self._compile_halves is None or not self.compiles:
            return
        if shape_class not in self._halves_compiled:
            self._compile_halves(tokens, kind)
            self._halves_compiled.add(shape_class)

    @property
    def shares_twin_captures(self) -> bool:
        """Whether `capture_twin` of a whole step costs nothing here (compiled), so a runner
        captures the smallest of a set of twins fully and the others as its twins."""
        return self.backend == "compiled"

    def prepare(self, graphs: int) -> None:
        """Before capturing `graphs` more graphs. For the compiled backends: room in dynamo's
        recompile limit (the compiled halves are one code object with one entry per shape,
        two where the first layer's residual differs). Their on-disk caches live under the
        cache dir (`executor.graphs.compile_cache`), and the code objects of inductor's
        generated modules beside them (`executor.graphs.code_cache`)."""
        if not self.compiles:
            return
        code_cache.install()
        raise_recompile_limits(2 * graphs, 4 * graphs)

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Around a whole capture pass: no autograd state; on CUDA, a collected, frozen heap,
        so a GC pause (freeing tensors) cannot land inside a capture. The CPU backends skip
        the full collection: their captures are runs and compiles that a pause cannot break,
        and it would hold the interpreter lock, stalling the steps a server runs meanwhile,
        for as long as the whole heap takes to walk."""
        cuda = self.backend == "cuda"
        if cuda:
            gc.collect()
            gc.freeze()
        try:
            with torch.inference_mode():
                yield
        finally:
            if cuda:
                gc.unfreeze()

    @property
    def poisoned(self) -> str | None:
        """Why capturing (and replaying) stopped for good, or None."""
        if self.backend == "cuda" and _cuda_poisoned:
            return _cuda_poisoned[0]
        return self._poisoned

    def poison(self, reason: str) -> None:
        """Stop capturing and replaying with this factory (on CUDA: in this process)."""
        if self._poisoned is None:
            self._poisoned = reason
        if self.backend == "cuda" and not _cuda_poisoned:
            _cuda_poisoned.append(reason)

    def memory_bytes(self) -> int:
        """Device memory the CUDA caching allocator holds for this device (reserved, not
        allocated: a graph's pool is reserved while its tensors are freed after capture);
        0 on CPU."""
        return int(torch.cuda.memory_reserved(self.device)) if self.device.type == "cuda" else 0
