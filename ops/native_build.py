"""Compiling a C file of `ops/` into a shared library, once per source, flags and key.

`build_library(source, cache_dir, flags)` runs the system C compiler (`$CC`, else `cc` or
`gcc`) into `cache_dir/kernels/<stem>-<hash>.so`, where the hash covers the source, the
flags and `key` (what else the build depends on, e.g. the CPU for `-march=native`): a restart
finds it in milliseconds, a changed source builds anew, and a half-written file is never
loaded (the build writes a temporary file and renames it last). Used by the quantized matmul
(`ops/qmm.py`) and the host kernels (`ops/host_kernels.py`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path


class NativeBuildError(RuntimeError):
    """No library: no compiler, or the build failed (the message says which)."""


def library_path(source: Path, cache_dir: Path, flags: tuple[str, ...], key: str = "") -> Path:
    """Where the build of `source` with `flags` (and `key`) lives in `cache_dir`."""
    digest = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags).encode(), key.encode()):
        digest.update(part)
        digest.update(b"\0")
    stem = source.stem.removesuffix("_kernel")
    return cache_dir / "kernels" / f"{stem}-{digest.hexdigest()[:16]}.so"


def build_library(
    source: Path, cache_dir: Path, flags: tuple[str, ...], key: str = "", what: str = ""
) -> Path:
    """Compile `source` into the cache (once per source, flags and key); its path.
    `what` names the library in errors (default: the source's name)."""
    target = library_path(source, cache_dir, flags, key)
    if target.exists():
        return target
    what = what or source.name
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise NativeBuildError(f"no C compiler (cc or gcc) on PATH to build {what}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [compiler, *flags, str(source), "-o", str(tmp), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(f"building {what} failed: {done.stderr.strip()[-500:]}")
    os.replace(tmp, target)  # last: its presence means a whole build
    return target
