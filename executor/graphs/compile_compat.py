"""torch.compile's knobs that only newer torch releases have, asked for where they exist.

The project runs on torch >= 2.5 (a GPU machine's preinstalled torch is often older than
the pinned one). What `StepCompiledGraph` and `prepare` need, and the fallback where a
release lacks it:

- `isolate_recompiles=True` (each compiled graph its own cache entry): else the callable is
  given a code object of its own, which is what dynamo keys its cache on;
- `guard_filter_fn=skip_all_guards_unsafe` (no guard checks at replay): else dynamo's
  guards stay (correct, a little slower per call);
- `recompile_limit` / `accumulated_recompile_limit`: else their older names
  `cache_size_limit` / `accumulated_cache_size_limit`.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from executor.core.names import INDUCTOR


def _compile_parameters() -> frozenset[str]:
    try:
        return frozenset(inspect.signature(torch.compile).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a C-level signature
        return frozenset()


def own_code(fn: Callable[[], None]) -> Callable[[], None]:
    """`fn` with a code object of its own: dynamo caches compiled code per code object, so
    closures of one function compiled apart would otherwise share (and, with guards
    skipped, reuse) each other's entries."""
    if not isinstance(fn, types.FunctionType):
        return fn
    code = fn.__code__.replace()  # an equal, distinct code object
    clone = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    return clone


def compile_isolated(
    fn: Callable[[], None],
    *,
    parameters: frozenset[str] | None = None,
    compiler: str = INDUCTOR,
) -> Callable[[], None]:
    """torch.compile of a whole-step callable by `compiler` (the torch.compile backend): full
    graph, static shapes, its own cache entry, and no guard checks where this torch can skip
    them safely (isolated entries)."""
    params = _compile_parameters() if parameters is None else parameters
    kwargs: dict[str, Any] = {"backend": compiler, "fullgraph": True, "dynamic": False}
    if "isolate_recompiles" in params:
        kwargs["isolate_recompiles"] = True
    else:
        fn = own_code(fn)
    skip_guards = getattr(torch.compiler, "skip_all_guards_unsafe", None)
    if skip_guards is not None:
        kwargs["options"] = {"guard_filter_fn": skip_guards}
    return torch.compile(fn, **kwargs)


def raise_recompile_limits(per_code: int, accumulated: int) -> None:
    """Room for `per_code` more entries per code object and `accumulated` more in all."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for new, old, extra in (
        ("recompile_limit", "cache_size_limit", per_code),
        ("accumulated_recompile_limit", "accumulated_cache_size_limit", accumulated),
    ):
        name = new if hasattr(cfg, new) else old
        setattr(cfg, name, getattr(cfg, name) + extra)
