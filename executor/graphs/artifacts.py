"""Compiled whole steps on disk, keyed by what they were traced from.

A `compiled_step` graph is compiled ahead of time (`torch.compile(...).aot_compile`: traced
from the shapes of its inputs, nothing run) into a function of its inputs, which is saved
here and loaded by the next process that needs the same graph instead of compiling it
again. A process other than the one that compiled it may load it (the compile worker of
:mod:`executor.compile_worker` compiles, the server loads).

The key is a digest of everything the trace depends on: the torch and Python versions, the
CPU's vector capability, this package's source, the step function, and the structure of
its inputs (`fingerprint`: every module's tensors and settings, the batch view's tensors,
the attention backend's own `compile_fingerprint`). A graph whose inputs differ in any of
these gets another key; a stale file is never read for a changed model or code. The server
also checks every loaded graph's first output against the eager step's before it uses it
(`StepCompiledGraph.capture`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

# Bumped when what a file holds, or how its key is made, changes.
ARTIFACT_FORMAT = 1
_PACKAGES = ("executor", "attention", "ops", "registry")
_MAX_ITEMS = 64  # longer plain lists are state, not structure: only their length counts


@functools.cache
def source_digest() -> str:
    """A digest of the Python source of the packages a step is traced through."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def environment_digest() -> str:
    """torch, Python, the machine and this package's source: what every key starts from."""
    parts = (
        ARTIFACT_FORMAT,
        torch.__version__,
        sys.version,
        platform.machine(),
        torch.backends.cpu.get_cpu_capability(),
        source_digest(),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def fingerprint(value: object) -> str:
    """A digest of the structure of `value` that a trace depends on (see `_describe`)."""
    h = hashlib.sha256()
    for token in _describe(value, full=True, seen={}):
        h.update(token.encode())
        h.update(b"\x00")
    return h.hexdigest()


def _describe(value: object, *, full: bool, seen: dict[int, object]) -> Iterator[str]:
    """Tokens for `value`. `full`: settings (numbers, strings, enums, functions) count; off,
    only tensors and types do (inside objects that also hold changing state, e.g. counters).
    An object met again is a reference ("ref"): `seen` holds every object met, by id.

    Modules and frozen dataclasses (configurations) are described in full wherever they
    are; other objects by their tensors only, except an attention backend, which says
    itself what its traced code reads (`compile_fingerprint`)."""
    if isinstance(value, torch.Tensor):
        yield (
            f"T{tuple(value.shape)}{value.stride()}{value.dtype}{value.device}"
            f"+{value.storage_offset()}"
        )
        return
    if value is None or isinstance(value, bool | int | float | str | bytes):
        yield repr(value) if full else "_"
        return
    if isinstance(value, enum.Enum | torch.dtype | torch.device):
        yield str(value) if full else "_"
        return
    if id(value) in seen:
        yield "ref"
        return
    seen[id(value)] = value  # kept alive: a temporary's id must not be reused in this walk
    fingerprint_of = getattr(value, "compile_fingerprint", None)
    if callable(fingerprint_of):
        yield type(value).__qualname__
        yield from _describe(fingerprint_of(), full=True, seen=seen)
        return
    if isinstance(value, list | tuple):
        if len(value) > _MAX_ITEMS and not any(isinstance(v, torch.Tensor) for v in value):
            yield f"seq[{len(value)}]" if full else "_"
            return
        yield f"seq{len(value)}"
        for item in value:
            yield from _describe(item, full=full, seen=seen)
        return
    if isinstance(value, dict):
        yield f"map{len(value)}"
        for key in sorted(value, key=str):
            yield str(key)
            yield from _describe(value[key], full=full, seen=seen)
        return
    if callable(value) and not isinstance(value, torch.nn.Module):
        yield getattr(value, "__qualname__", type(value).__qualname__) if full else "_"
        return
    yield type(value).__qualname__
    if isinstance(value, torch.nn.Module):
        yield from _describe(vars(value), full=True, seen=seen)
    elif dataclasses.is_dataclass(value):
        frozen = bool(getattr(type(value), "__dataclass_params__").frozen)  # noqa: B009
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        yield from _describe(fields, full=frozen, seen=seen)
    elif hasattr(value, "__dict__"):
        yield from _describe(vars(value), full=False, seen=seen)


class ArtifactStore:
    """Saved compiled steps in one directory (`<cache_dir>/graphs`), one file a graph, and
    beside each one that was checked (its eager step under the capture rules, its output
    matched) an empty `.checked` file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, tag: str, key: str) -> Path:
        return self.directory / f"{tag}-{key[:32]}.aot"

    def has(self, tag: str, key: str) -> bool:
        return self.path(tag, key).is_file()

    def load(self, tag: str, key: str) -> Any:
        """The saved function, or None (not there; or unreadable: the file is removed)."""
        path = self.path(tag, key)
        if not path.is_file():
            return None
        try:
            with path.open("rb") as f:
                compiled = torch.compiler.load_compiled_function(f)
        except Exception as e:  # a file from another torch, truncated, ...: compile again
            log.warning(
                "compiled graph unreadable; compiling it again", path=str(path), error=str(e)
            )
            self.discard(tag, key)
            return None
        compiled.disable_guard_check()  # type: ignore[attr-defined]  # the key stands for guards
        return compiled

    def save(self, tag: str, key: str, compiled: Any) -> None:
        """Write `compiled` (an aot-compiled function) atomically; a failure is logged."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._checked(tag, key).unlink(missing_ok=True)
            compiled.save_compiled_function(str(self.path(tag, key)))
        except Exception as e:  # a full disk, a read-only cache: the graph still serves
            log.warning("compiled graph not saved", tag=tag, error=f"{type(e).__name__}: {e}")

    def checked(self, tag: str, key: str) -> bool:
        """Whether the saved step was checked (`mark_checked`)."""
        return self.has(tag, key) and self._checked(tag, key).is_file()

    def mark_checked(self, tag: str, key: str) -> None:
        """The saved step's eager step passed the capture rules and its output matched."""
        try:
            if self.has(tag, key):
                self._checked(tag, key).touch()
        except OSError as e:  # a read-only cache: the next start checks it again
            log.warning("compiled graph check not saved", tag=tag, error=str(e))

    def discard(self, tag: str, key: str) -> None:
        self._checked(tag, key).unlink(missing_ok=True)
        self.path(tag, key).unlink(missing_ok=True)

    def _checked(self, tag: str, key: str) -> Path:
        return self.path(tag, key).with_suffix(".checked")
