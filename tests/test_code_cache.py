"""Inductor's generated modules compiled once (`executor.graphs.code_cache`): a load that finds
a kept code object does not compile the source, and nothing else changes."""

from __future__ import annotations

import builtins
import sys
from pathlib import Path
from typing import Any

import pytest

from executor.graphs import code_cache

SOURCE = "VALUE = 6 * 7\n\ndef twice(x):\n    return 2 * x\n"


def no_compile(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From here on the builtin `compile` of a module's source fails (and is counted)."""
    calls: list[str] = []
    real = builtins.compile

    def counting(source: Any, filename: Any, mode: str, *args: Any, **kwargs: Any) -> Any:
        if mode == "exec":
            calls.append(str(filename))
            raise AssertionError(f"compiled {filename} again")
        return real(source, filename, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "compile", counting)
    return calls


def test_a_kept_code_object_is_read_instead_of_compiling_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "mod.py")
    first = code_cache.compile_kept(SOURCE, path)
    kept = code_cache.kept_path(SOURCE.encode(), path)
    assert kept.is_file() and list(tmp_path.glob("*.tmp")) == []
    calls = no_compile(monkeypatch)
    again = code_cache.compile_kept(SOURCE, path)
    assert calls == [] and again.co_filename == path and again == first
    namespace: dict[str, Any] = {}
    exec(again, namespace)
    assert namespace["VALUE"] == 42 and namespace["twice"](4) == 8


def test_another_source_or_path_never_reads_a_kept_file(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a.py"), str(tmp_path / "b.py")
    code_cache.compile_kept(SOURCE, a)
    assert code_cache.kept_path(SOURCE.encode(), b) != code_cache.kept_path(SOURCE.encode(), a)
    other = SOURCE.replace("6 * 7", "6 * 8")
    assert code_cache.kept_path(other.encode(), a) != code_cache.kept_path(SOURCE.encode(), a)
    namespace: dict[str, Any] = {}
    exec(code_cache.compile_kept(other, a), namespace)
    assert namespace["VALUE"] == 48


def test_an_unreadable_kept_file_is_compiled_again_and_replaced(tmp_path: Path) -> None:
    path = str(tmp_path / "mod.py")
    kept = code_cache.kept_path(SOURCE.encode(), path)
    kept.write_bytes(b"\x00not marshal")
    namespace: dict[str, Any] = {}
    exec(code_cache.compile_kept(SOURCE, path), namespace)
    assert namespace["VALUE"] == 42
    assert kept.read_bytes() != b"\x00not marshal"


def test_a_source_that_does_not_compile_raises_as_compile_does(tmp_path: Path) -> None:
    path = str(tmp_path / "bad.py")
    with pytest.raises(SyntaxError):
        code_cache.compile_kept("def (:\n", path)
    assert not code_cache.kept_path(b"def (:\n", path).exists()


def test_inductor_loads_its_generated_modules_through_the_kept_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PyCodeCache.load` writes a module's source into inductor's cache dir and loads it
    (`_reload_python_module`): the second load, as in a restarted server, compiles nothing."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    from torch._inductor.codecache import PyCodeCache

    assert code_cache.install() and code_cache.installed()
    source = SOURCE + f"\nTAG = {str(tmp_path)!r}\n"  # a module no other test has loaded
    mod = PyCodeCache.load(source)
    assert mod.VALUE == 42 and mod.twice(5) == 10
    assert mod.__file__ is not None and mod.__file__.startswith(str(tmp_path / "inductor"))
    assert code_cache.kept_path(Path(mod.__file__).read_bytes(), mod.__file__).is_file()
    sys.modules.pop(mod.__name__, None)
    from torch._inductor.runtime import compile_tasks

    calls = no_compile(monkeypatch)
    again = compile_tasks._reload_python_module(mod.key, mod.__file__)
    assert calls == [] and again is not mod and again.VALUE == 42 and again.twice(3) == 6
    assert again.__file__ == mod.__file__ and sys.modules[again.__name__] is again
