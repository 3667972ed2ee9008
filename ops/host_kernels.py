"""Host kernels of a step (`host_kernels.c`), loaded with ctypes: admission, staging, and
the CPU device's greedy pick.

Admission checks a batch's few index arrays a dozen ways (ranges, duplicates, resident
lengths, the slot-owner map) and staging packs a dozen small tensors into one buffer; in numpy
or torch each of those is a call of a microsecond or more, and a step makes about a hundred.
The C file does each stage's pass in one call. Its checks answer only "every rule holds" or
"look closer": on the second the caller runs its Python rules, which name the field and the
rule, so a batch the kernels pass is one the Python rules pass too, and the refusals and their
messages live in one place (`executor/validation.py`, `executor/kv_cache.py`). On a CPU
device, greedy sampling's argmax is one of them too: torch's over a vocabulary-wide row costs
tens of times more (`ops/sampling.py`).

`load(cache_dir)` builds the library with the system C compiler on first use (`-O3`, no
CPU-specific flags; `ops/native_build.py`), or takes the prebuilt one shipped beside the
source (the container image's), and makes it the process's kernel; `loaded()` is that kernel,
or None: every caller then takes its pure-Python path, which stays complete and tested
(`disabled()` forces it, for tests).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ops import native_build

ABI_VERSION = 2
SOURCE = Path(__file__).with_name("host_kernels.c")
PREBUILT = SOURCE.with_name("host_kernels_prebuilt.so")
CFLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")
_LOCK = threading.Lock()
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class HostKernels:
    """The loaded library's functions, declared once (argument types, results)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        lib.hk_version.restype = _int
        if lib.hk_version() != ABI_VERSION:
            raise native_build.NativeBuildError(
                f"{path} is version {lib.hk_version()}, not {ABI_VERSION}"
            )
        self.path = path
        self.check_decode = lib.hk_check_decode
        self.check_decode.argtypes = [
            _i64, _ptr, _int, _i64, _i64, _ptr, _ptr, _int, _i64, _ptr, _int, _i64, _ptr, _int,
            _i64, _ptr, _ptr,
        ]  # fmt: skip
        self.check_decode.restype = _int
        self.sampling = lib.hk_sampling
        self.sampling.argtypes = [_i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_float, _ptr]
        self.sampling.restype = _int
        self.decode_fields = lib.hk_decode_fields
        self.decode_fields.argtypes = [_i64, _ptr, _int, _ptr, _int, _ptr, _ptr]
        self.decode_fields.restype = None
        self.decode_cells = lib.hk_decode_cells
        self.decode_cells.argtypes = [
            _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr,
        ]  # fmt: skip
        self.decode_cells.restype = _int
        self.owners_apply = lib.hk_owners_apply
        self.owners_apply.argtypes = [_i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]
        self.owners_apply.restype = None
        self.argmax_f32 = lib.hk_argmax_f32
        self.argmax_f32.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
        self.argmax_f32.restype = None
        self.pack = lib.hk_pack
        self.pack.argtypes = [_i64, _ptr, _ptr, _ptr]
        self.pack.restype = None


_kernel: list[HostKernels] = []  # the process's kernel, once loaded
_disabled: list[bool] = [False]  # `disabled()`: every thread takes the Python paths


def load(cache_dir: Path) -> HostKernels | str:
    """Build (or find) and load the library, once per process; the kernel, or why there is
    none (the callers then run their Python paths)."""
    with _LOCK:
        if _kernel:
            return _kernel[0]
        try:
            path = native_build.build_library(SOURCE, cache_dir, CFLAGS, what="the host kernels")
        except native_build.NativeBuildError as no_build:
            if not PREBUILT.exists():
                return str(no_build)
            path = PREBUILT
        try:
            kernel = HostKernels(path)
        except (OSError, AttributeError, native_build.NativeBuildError) as e:
            return f"loading {path} failed: {e}"
        _kernel.append(kernel)
        return kernel


def loaded() -> HostKernels | None:
    """The process's kernel; None before `load`, after a failed one, or inside `disabled()`."""
    return None if _disabled[0] or not _kernel else _kernel[0]


@contextmanager
def disabled() -> Iterator[None]:
    """Every caller, on every thread, takes its Python path while inside (tests, A/B runs)."""
    before = _disabled[0]
    _disabled[0] = True
    try:
        yield
    finally:
        _disabled[0] = before


_addresses: dict[int, tuple[weakref.ref[np.ndarray], int]] = {}


def address(a: np.ndarray) -> int:
    """The data address of a contiguous numpy array, remembered for the arrays that live as
    long as an executor (row lengths, the owner map): a look-up, not numpy's interface dict."""
    entry = _addresses.get(id(a))
    if entry is not None and entry[0]() is a:
        return entry[1]
    addr = int(a.__array_interface__["data"][0])
    if len(_addresses) >= 256:
        _addresses.clear()  # a process that made many executors (tests)
    _addresses[id(a)] = (weakref.ref(a), addr)
    return addr


def element_size(t: torch.Tensor) -> int:
    """An index tensor's element size (int32: 4, int64: 8), as the kernels take it."""
    return 4 if t.dtype is torch.int32 else 8


def plain_i64(*tensors: torch.Tensor) -> bool:
    """Contiguous int64 host tensors: what a kernel reads in place."""
    return all(t.dtype is torch.int64 and t.is_cpu and t.is_contiguous() for t in tensors)
