"""The CPU's group-quantized matmul (`qmm_kernel.c`): built on first use, called without copies.

torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) takes bfloat16 activations and, on a
CPU without native bfloat16, converts its way through every call. The kernel here does what
llama.cpp does with a GGUF file: the activations are quantized to int8 and
multiplied with the 4- or 8-bit weights as integer dot products, so a decode step streams the
weights as stored (a Q4 weight with its half scale and min is about a sixth of float32's bytes) and the matmul's arithmetic is
32 products an instruction. Each half group of 16 activations has its own scale (finer than
llama.cpp's 32), which keeps one outlier from coarsening its neighbours.

Building: `build(cache_dir)` compiles the C file with the system C compiler (`cc`, `-O3
-march=native -fopenmp`) into `cache_dir/kernels/`, named by a hash of the source, the flags
and the CPU's model and flags, so a restart loads it in milliseconds and another CPU builds its
own. `load(cache_dir)` returns the kernel or the reason there is none (no compiler, a build
error, no AVX2: the caller keeps torch's kernel and says why).

The op `model_executor::qmm(x, qweight, scale, min, bits) -> y` has a fake (shape-only)
implementation, so compiled graphs call it as an extern kernel; eager steps call the library
directly (no dispatcher). The library links the process's one OpenMP runtime (torch's), so its
threads are torch's threads.
"""

from __future__ import annotations

import ctypes
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ops import native_build

GROUP = 32
ABI_VERSION = 4
SOURCE = Path(__file__).with_name("qmm_kernel.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_LOCK = threading.Lock()
_LOADED: dict[Path, QmmKernel] = {}


class QmmUnavailable(RuntimeError):
    """No usable kernel on this machine; the message says why."""


def _cpu_signature() -> str:
    """What `-march=native` compiles for: the CPU's model name and flags (Linux), else the
    platform's processor string."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def library_path(cache_dir: Path, flags: tuple[str, ...] | None = None) -> Path:
    """Where the build for this source, these flags (default CFLAGS) and this CPU lives."""
    flags = CFLAGS if flags is None else flags
    return native_build.library_path(SOURCE, cache_dir, flags, _cpu_signature())


def build(cache_dir: Path, flags: tuple[str, ...] | None = None) -> Path:
    """Compile the kernel into the cache (once per source, flags and CPU); its path."""
    flags = CFLAGS if flags is None else flags
    try:
        return native_build.build_library(
            SOURCE, cache_dir, flags, _cpu_signature(), what="the quantized kernel"
        )
    except native_build.NativeBuildError as e:
        raise QmmUnavailable(str(e)) from None


@dataclass(frozen=True)
class QmmKernel:
    """The loaded library: `matmul` runs one multiply on contiguous CPU tensors."""

    lib: ctypes.CDLL
    path: Path
    isa: str

    def matmul(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        mn: torch.Tensor,
        bits: int,
    ) -> torch.Tensor:
        """x [M, K] float32 (contiguous), the weight's scales and mins as float16 [N, K / 32]
        -> [M, N] float32: one library call (the activations'
        int8 copy lives in the call's own scratch)."""
        if x.dtype != torch.float32 or scale.dtype != torch.float16 or mn.dtype != torch.float16:
            raise TypeError("qmm takes float32 activations and float16 scales and mins")
        m, k = x.shape
        n = scale.shape[0]
        y = torch.empty((m, n), dtype=torch.float32)
        rc = self.lib.qmm_forward(
            x.data_ptr(), m, k, qweight.data_ptr(), scale.data_ptr(), mn.data_ptr(), n, bits,
            y.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError(f"qmm: no scratch for a [{m}, {k}] activation")
        return y


# A portable build shipped beside the source (the container image compiles it in its build
# stage, whose compiler the runtime image does not keep): every AVX2 + FMA + F16C CPU runs it.
PREBUILT = SOURCE.with_name("qmm_prebuilt.so")
PORTABLE_CFLAGS = (*(f for f in CFLAGS if f != "-march=native"), "-march=haswell")
_PORTABLE_NEEDS = ("avx2", "fma", "f16c")


def _cpu_runs_portable() -> bool:
    flags = set(_cpu_signature().split())
    return all(f in flags for f in _PORTABLE_NEEDS)


def load(cache_dir: Path) -> QmmKernel:
    """The kernel built for this machine (building it first if needed), else the portable
    prebuilt one where there is no compiler; QmmUnavailable says why there is none."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise QmmUnavailable(
            f"the quantized kernel is written for x86-64, not {platform.machine()}"
        )
    with _LOCK:
        try:
            path = build(cache_dir)
        except QmmUnavailable as no_build:
            if not PREBUILT.exists():
                raise
            if not _cpu_runs_portable():
                raise QmmUnavailable(
                    f"{no_build}; the prebuilt kernel needs {', '.join(_PORTABLE_NEEDS)}"
                ) from None
            path = PREBUILT
        if path in _LOADED:
            return _LOADED[path]
        kernel = open_library(path)
        if kernel.isa == "scalar":
            raise QmmUnavailable(
                "this CPU has no AVX2/FMA: the quantized kernel would run its scalar reference"
            )
        _LOADED[path] = kernel
        _register_op(kernel)
        return kernel


def open_library(path: Path) -> QmmKernel:
    """Load a built library and declare its functions (any build: tests run the scalar one)."""
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.qmm_version.restype = ctypes.c_int
    lib.qmm_isa.restype = ctypes.c_char_p
    lib.qmm_forward.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int, ptr]
    lib.qmm_forward.restype = ctypes.c_int
    if lib.qmm_version() != ABI_VERSION:
        raise QmmUnavailable(f"{path} is version {lib.qmm_version()}, not {ABI_VERSION}")
    return QmmKernel(lib, path, lib.qmm_isa().decode())


# --- the op compiled graphs call ----------------------------------------------------------
_OP_KERNEL: list[QmmKernel] = []  # the kernel the op runs (one per process)
_LIB: torch.library.Library | None = None


def _register_op(kernel: QmmKernel) -> None:
    global _LIB
    _OP_KERNEL[:] = [kernel]
    if _LIB is not None:
        return
    _LIB = torch.library.Library("model_executor", "FRAGMENT")
    _LIB.define("qmm(Tensor x, Tensor qweight, Tensor scale, Tensor mn, int bits) -> Tensor")

    def impl(
        x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int
    ) -> torch.Tensor:
        return _OP_KERNEL[0].matmul(x.contiguous(), qweight, scale, mn, bits)

    def fake(
        x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], scale.shape[0]))

    _LIB.impl("qmm", impl, "CPU")
    torch.library.register_fake("model_executor::qmm", fake, lib=_LIB)


def qmm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int
) -> torch.Tensor:
    """x [M, K] float32 @ W^T with the loaded kernel: through the op while torch.compile
    traces, else directly. RuntimeError before `load`."""
    if torch.compiler.is_compiling():
        return torch.ops.model_executor.qmm(x, qweight, scale, mn, bits)
    if not _OP_KERNEL:
        raise RuntimeError("ops.qmm: no kernel loaded (ops.qmm.load(cache_dir) first)")
    return _OP_KERNEL[0].matmul(x.contiguous(), qweight, scale, mn, bits)


def loaded() -> QmmKernel | None:
    """The kernel this process loaded, if any."""
    return _OP_KERNEL[0] if _OP_KERNEL else None


def pack_groups(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Group values [N, K] into the kernel's bytes: 4-bit 0..15 as [N, K / 2] uint8 (per group
    of 32: byte i holds input i in its low nibble and input i + 16 in its high one), 8-bit
    -128..127 as [N, K] int8."""
    if bits == 8:
        return q.to(torch.int8).contiguous()
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n, k // GROUP, GROUP)
    return (g[..., :16] | (g[..., 16:] << 4)).reshape(n, k // 2).contiguous()
