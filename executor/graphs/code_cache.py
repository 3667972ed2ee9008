"""Inductor's generated Python compiled once: each module's code object kept beside its source.

Inductor turns every graph it compiles, or loads from its caches or a saved step
(`executor.graphs.artifacts`), into a generated Python module: the source is written into
inductor's cache dir, then `compile()`d and run (`torch._inductor.runtime.compile_tasks.
_reload_python_module`). A whole step's module is large (its wrapper calls every kernel of
every layer), and `compile()` is one C call: the thread that loads it holds the GIL for all of
it, and a server's step waits for the GIL as long. `IdleGate` cannot pause the load there
(it acts between Python calls, never inside one).

`install()` makes that loader's `compile` read the code object that an earlier compile of the
same source kept (`marshal`, written atomically beside the source), and keep it on a miss. A
marshalled code object loads in a small fraction of the compile (docs/performance.md,
"Start-up"). The compile worker compiles each step's module first, so a server finds the code
objects of every step the worker made. The key is the source's digest, its path (the code's
file name) and the interpreter's bytecode version: another source, another place or another
Python never reads a kept file, and an unreadable one is compiled again and replaced.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib.util
import marshal
import os
import threading
from pathlib import Path
from types import CodeType
from typing import Any

SUFFIX = ".code"  # the kept file: `<source path>.<key>.code`


def kept_path(source: bytes, filename: str) -> Path:
    """Where the code object of `source` compiled as `filename` is kept."""
    h = hashlib.sha256(importlib.util.MAGIC_NUMBER)
    h.update(filename.encode())
    h.update(b"\x00")
    h.update(source)
    return Path(f"{filename}.{h.hexdigest()[:32]}{SUFFIX}")


def compile_kept(source: str | bytes, filename: str) -> CodeType:
    """`compile(source, filename, "exec", dont_inherit=True)`, from the kept code object when
    there is one (else compiled, and kept: a failure to write is only a cost)."""
    raw = source.encode() if isinstance(source, str) else source
    kept = kept_path(raw, filename)
    try:
        code = marshal.loads(kept.read_bytes())
        if isinstance(code, CodeType) and code.co_filename == filename:
            return code
    except (OSError, EOFError, ValueError, TypeError):  # none kept, or unreadable
        pass
    code = builtins.compile(source, filename, "exec", dont_inherit=True)
    tmp = kept.with_name(f"{kept.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(marshal.dumps(code))
        os.replace(tmp, kept)
    except OSError:  # a read-only or full cache dir
        tmp.unlink(missing_ok=True)
    return code


def _compile(source: Any, filename: Any, mode: str, *args: Any, **kwargs: Any) -> Any:
    """`compile` for the loader's module: its one call (a module's source, "exec",
    `dont_inherit=True`) goes through `compile_kept`; anything else to the builtin."""
    module = mode == "exec" and not args and kwargs == {"dont_inherit": True}
    if module and isinstance(source, str | bytes) and isinstance(filename, str):
        return compile_kept(source, filename)
    return builtins.compile(source, filename, mode, *args, **kwargs)


def install() -> bool:
    """Route inductor's module loader through `compile_kept` (idempotent; imports inductor's
    runtime: call it where a compile or load is about to). False where this torch
    has no such loader (then modules compile as inductor does itself)."""
    try:
        from torch._inductor.runtime import compile_tasks
    except ImportError:  # pragma: no cover - a torch without inductor's runtime
        return False
    if not hasattr(compile_tasks, "_reload_python_module"):
        return False  # pragma: no cover - another torch's loader
    compile_tasks.compile = _compile  # type: ignore[attr-defined]  # its global, not builtins'
    return True


def installed() -> bool:
    """Whether inductor's loader goes through `compile_kept` in this process."""
    try:
        from torch._inductor.runtime import compile_tasks
    except ImportError:  # pragma: no cover
        return False
    return getattr(compile_tasks, "compile", None) is _compile
