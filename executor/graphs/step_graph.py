"""`StepCompiledGraph`: a whole DECODE step compiled by inductor as one graph (`compiled_step`).

`CompiledGraph` compiles the layer halves and runs attention between them, so a step is two
compiled calls a layer, each paying dynamo's guard check and the wrapper's prologue. Here the
captured step - embedding, every layer, attention, the KV write (an `index_put_` on the pool)
- is one graph: one call a step, with its fused kernels. The price is compiling per bucket:
a graph holds one (batch size, KV bucket) with every layer unrolled (compile times:
docs/performance.md).

The step is a function of its inputs (`StepCall`: the model, the backend, the bucket's batch
view, the output buffer), compiled ahead of time from their shapes
(`torch.compile(...).aot_compile`), which runs nothing: the compile touches no device state,
so it runs off the step lock, in another thread or another process (the compile worker), and
its result is saved (`ArtifactStore`) for the next start to load instead. Capture, under the
lock, is the part that runs: the eager step under CUDA's capture rules, then the compiled one,
whose output must match the eager one's.

Replay runs the compiled function without dynamo's guards, as a CUDA graph replays: it reads
only static buffers that live as long as the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from executor.core.names import EAGER_KERNELS, INDUCTOR
from executor.graphs.artifacts import ArtifactStore, environment_digest, fingerprint
from executor.graphs.compile_compat import compile_isolated
from executor.graphs.graph import Graph, GraphCaptureError, GraphCaptureOOM, check_capture_rules

log = structlog.get_logger(__name__)

# How far the compiled step's first output may be from the eager step's (relative to its
# norm). A graph traced from other inputs is off by the order of the values themselves. In
# float32 the two differ by rounding only. In bfloat16 and float16 the compiled step keeps
# float32 intermediates that the eager step rounds after each op; at the capture's padded
# request (one token at position 0, whose hidden state holds a model's large first-token
# activations) that exceeds float32's bound on a real model, while on real steps the compiled
# and the eager step are as far from float32 as each other (docs/performance.md).
MATCH_TOLERANCE = 0.1
HALF_MATCH_TOLERANCE = 0.3


def match_tolerance(dtype: torch.dtype) -> float:
    """The relative error a compiled step's `dtype` output may have against the eager one."""
    return HALF_MATCH_TOLERANCE if dtype in (torch.bfloat16, torch.float16) else MATCH_TOLERANCE


@dataclass(frozen=True)
class StepCall:
    """`fn(*args)`: a whole step over static buffers, writing its result into `out`.

    `tag` names the bucket (its saved file's prefix, e.g. `decode-bs1-kv256`)."""

    fn: Callable[..., None]
    args: tuple[Any, ...]
    out: torch.Tensor
    tag: str

    def __call__(self) -> None:
        self.fn(*self.args)

    def key(self) -> str:
        """What the compiled step depends on: the environment, the function and the
        structure of its inputs (`executor.graphs.artifacts`)."""
        return fingerprint((environment_digest(), self.fn.__qualname__, self.args))


def compile_step(call: StepCall, compiler: str = INDUCTOR) -> Any:
    """`call.fn` compiled ahead of time by `compiler` (the torch.compile backend) for
    `call.args`' shapes (an aot-compiled function taking the same arguments); nothing runs.
    Raises what dynamo or inductor raise. A torch without `aot_compile` (older releases,
    `executor.graphs.compile_compat`) gets None: its step compiles at its first call, in
    `capture`, and is not saved."""
    skip_guards = getattr(torch.compiler, "skip_all_guards_unsafe", None)
    compiled = torch.compile(
        call.fn,
        backend=compiler,
        fullgraph=True,
        dynamic=False,
        options={"guard_filter_fn": skip_guards} if skip_guards is not None else None,
    )
    aot_compile = getattr(compiled, "aot_compile", None)
    if aot_compile is None:
        return None
    with torch.inference_mode():  # as the step runs
        result = aot_compile((call.args, {}))
    result.disable_guard_check()
    return result


def _compiled_at_first_call(call: StepCall, compiler: str) -> Callable[..., None]:
    """The step compiled by plain torch.compile (its own cache entry), called with the
    step's arguments as an aot-compiled one is (they are the closure's)."""
    compiled = compile_isolated(lambda: call.fn(*call.args), compiler=compiler)
    return lambda *_args: compiled()


class StepCompiledGraph(Graph):
    """One bucket's whole step, compiled (`compile`, off the lock) then checked and warmed up
    (`capture`, under it). `store`: where compiled steps are saved and loaded from; `load`
    off (the compile worker): a saved step is left there, not loaded. `compiler`: the
    torch.compile backend; with `EAGER_KERNELS` (batch_invariant) the compiled step's output
    must equal the eager step's bit for bit, and it is neither saved nor loaded (compiling
    it is a trace, and its saved form would hold no compiled code)."""

    def __init__(
        self, store: ArtifactStore | None = None, *, load: bool = True, compiler: str = INDUCTOR
    ) -> None:
        self._exact = compiler == EAGER_KERNELS
        self._store = None if self._exact else store
        self._compiler = compiler
        self._load = load
        self._compiled: Any = None
        self._call: StepCall | None = None
        self._key = ""
        self.loaded = False  # the compiled step came from the store
        self.reference: torch.Tensor | None = None  # the eager step's output it was checked on

    def compile(self, fn: Callable[[], None]) -> None:
        """Load the compiled step from the store, or compile it (and save it); touches no
        device state. Raises GraphCaptureError if the compile fails."""
        call = _as_call(fn)
        self._key = call.key()
        if self._store is not None:
            if not self._load and self._store.has(call.tag, self._key):
                return
            self._compiled = self._store.load(call.tag, self._key) if self._load else None
            if self._compiled is not None:
                self.loaded = True
                return
        try:
            self._compiled = compile_step(call, self._compiler)
        except torch.OutOfMemoryError as e:
            raise GraphCaptureOOM(f"out of memory while compiling: {e}") from e
        except Exception as e:  # dynamo and inductor raise many types; the bucket runs eagerly
            raise GraphCaptureError(f"torch.compile failed: {type(e).__name__}: {e}") from e
        if self._compiled is None:  # no ahead-of-time compile in this torch
            self._compiled = _compiled_at_first_call(call, self._compiler)
            return
        if self._store is not None:
            self._store.save(call.tag, self._key, self._compiled)

    def capture(self, fn: Callable[[], None], reference: torch.Tensor | None = None) -> None:
        """The eager step under CUDA's capture rules, then the compiled step (compiled here
        first if `compile` did not run), which must give the eager step's output.

        `reference`: that output, from another graph of the same inputs and code (a DECODE
        batch's larger KV buckets: the same padded requests, whose output does not depend on
        the bucket), which checked the rules: the eager step does not run again. Not with
        batch_invariant, whose compiled step must equal its own bucket's eager step. A saved
        step checked before (in the compile worker, or an earlier start; the store's
        `.checked` mark) runs its eager step without the rules' slow mode."""
        call = _as_call(fn)
        if self._compiled is None:
            self.compile(call)
        ruled = False
        if reference is None or self._exact:
            if self._store is not None and self._store.checked(call.tag, self._key):
                call()  # eagerly: the reference (its code passed the rules before)
            else:
                check_capture_rules(call)  # eagerly, as the stand-in does: the reference
                ruled = True
            reference = call.out.clone()
        expected = reference
        try:
            self._compiled(*call.args)
        except torch.OutOfMemoryError as e:
            raise GraphCaptureOOM(f"out of memory in the compiled step: {e}") from e
        except Exception as e:
            self._forget(call)
            raise GraphCaptureError(f"the compiled step failed: {type(e).__name__}: {e}") from e
        error = _relative_error(call.out, expected)
        if self._exact and not torch.equal(call.out, expected):
            self._forget(call)
            raise GraphCaptureError(
                f"the compiled step's output differs from the eager step's (relative error "
                f"{error:.3g}) where it must be equal (batch_invariant): not used"
            )
        tolerance = match_tolerance(call.out.dtype)
        if not error <= tolerance:
            self._forget(call)
            raise GraphCaptureError(
                f"the compiled step's output differs from the eager step's (relative error "
                f"{error:.3g} > {tolerance} in {str(call.out.dtype).removeprefix('torch.')}): "
                "not used, and not kept in the cache"
            )
        log.info("compiled step checked", tag=call.tag, loaded=self.loaded, error=round(error, 5))
        if ruled and self._store is not None:
            self._store.mark_checked(call.tag, self._key)
        self._call, self.reference = call, expected

    @property
    def compiled(self) -> bool:
        """Whether a compiled step is held (compiled or loaded here)."""
        return self._compiled is not None

    def _forget(self, call: StepCall) -> None:
        """A compiled step that does not work is not kept, on disk either."""
        if self._store is not None and self._key:
            self._store.discard(call.tag, self._key)
        self._compiled = None

    def replay(self) -> None:
        if self._call is None:
            raise RuntimeError("replay before capture")
        self._compiled(*self._call.args)


def _as_call(fn: Callable[[], None]) -> StepCall:
    if not isinstance(fn, StepCall):
        raise TypeError(f"a whole-step graph captures a StepCall, got {type(fn).__name__}")
    return fn


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().nan_to_num(), want.float().nan_to_num()
    scale = float(want.norm()) or 1.0
    return float((got - want).norm()) / scale
