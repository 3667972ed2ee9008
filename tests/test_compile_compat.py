"""torch.compile's newer knobs asked for only where this torch has them (torch >= 2.5 runs):
each compiled graph keeps its own cache entry either way."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from executor.graphs.compile_compat import compile_isolated, own_code, raise_recompile_limits


def _closure(t: torch.Tensor) -> Any:
    def step() -> torch.Tensor:
        return t * 2

    return step


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, dict[str, Any]]]:
    calls: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append((fn, kw)) or fn)
    return calls


def test_newer_torch_isolates_each_graph_and_skips_its_guards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _spy(monkeypatch)
    fn = _closure(torch.ones(2))
    compile_isolated(fn, parameters=frozenset({"isolate_recompiles"}))
    [(compiled, kwargs)] = calls
    assert compiled is fn and kwargs["isolate_recompiles"] is True
    assert kwargs["fullgraph"] is True and kwargs["dynamic"] is False
    skip = getattr(torch.compiler, "skip_all_guards_unsafe", None)
    assert kwargs.get("options", {}).get("guard_filter_fn") is skip


def test_older_torch_gets_a_code_object_per_graph_and_keeps_its_guards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without `isolate_recompiles` (torch < 2.13) the callable gets a code object of its own,
    dynamo's cache key; without `skip_all_guards_unsafe` (< 2.10) the guards stay."""
    calls = _spy(monkeypatch)
    monkeypatch.delattr(torch.compiler, "skip_all_guards_unsafe", raising=False)
    a, b = _closure(torch.ones(2)), _closure(torch.full((2,), 5.0))
    compile_isolated(a, parameters=frozenset())
    compile_isolated(b, parameters=frozenset())
    (fa, kwa), (fb, _) = calls
    assert "isolate_recompiles" not in kwa and "options" not in kwa
    assert isinstance(fa, types.FunctionType) and fa.__code__ is not a.__code__
    assert fa.__code__ is not fb.__code__
    assert torch.equal(fa(), torch.full((2,), 2.0)) and torch.equal(fb(), torch.full((2,), 10.0))


def test_own_code_behaves_like_the_function() -> None:
    t = torch.arange(3.0)
    fn = _closure(t)
    twin = own_code(fn)
    assert twin.__code__ == fn.__code__ and twin.__code__ is not fn.__code__
    assert torch.equal(twin(), fn())


def test_recompile_limits_use_the_old_names_where_the_new_ones_are_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch._dynamo

    old = types.SimpleNamespace(cache_size_limit=8, accumulated_cache_size_limit=64)
    monkeypatch.setattr(torch._dynamo, "config", old)
    raise_recompile_limits(2, 4)
    assert (old.cache_size_limit, old.accumulated_cache_size_limit) == (10, 68)
    new = types.SimpleNamespace(recompile_limit=8, accumulated_recompile_limit=64)
    monkeypatch.setattr(torch._dynamo, "config", new)
    raise_recompile_limits(2, 4)
    assert (new.recompile_limit, new.accumulated_recompile_limit) == (10, 68)
