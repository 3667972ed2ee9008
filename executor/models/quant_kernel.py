"""What `quantization=auto` and `quant_kernel` (settings) become on this machine, and why.

`quantization=auto` keeps a GGUF file's own quantization where a kernel for its blocks beats
the float path (as llama.cpp always runs the file as shipped): on a CPU where the qmm kernel
loads, or whose activations are bfloat16 on native bfloat16 (torch's int4 kernel)
(benchmarks/vs_llamacpp.py measures the paths side by side). Everywhere else it is `none`:
float checkpoints, tensor parallelism (it shards float weights only), CUDA (the graphs and
float kernels there are the measured path), and a float32 CPU without the qmm kernel (torch's
int4 kernel, converting float32 activations, loses to float32 at larger batches).

Which kernel the quantized linears run on (`quant_kernel`):

- `qmm`: `ops.qmm`, the CPU kernel built for this machine on first use (int8 activations times
  the 4- or 8-bit weights as stored; 8-bit GGUF blocks in one term);
- `torch`: torch's own weight-only kernels (`_weight_int4pack_mm*`, bfloat16 activations; an
  8-bit block as two int4 terms);
- `auto`: `torch` for bfloat16 activations on a CPU with native bfloat16 (there it is as fast
  as qmm and closer to float32: docs/choices.md); else `qmm` on a CPU where it builds and
  loads (x86-64 with AVX2 and a C compiler); else `torch`; with the reason.
Only group-quantized weights (GGUF blocks, `int4`) take it; `int8`'s per-channel weights run
torch's int8 kernel either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from executor.config import QUANT_KERNELS, cpu_has_native_bf16
from ops import qmm

NATIVE_BF16 = "bfloat16 activations on this CPU's native bfloat16"


@dataclass(frozen=True)
class QuantKernelChoice:
    kernel: str  # qmm | torch
    reason: str  # why (what `auto` saw, or "configured")

    @property
    def use_qmm(self) -> bool:
        return self.kernel == "qmm"


def native_bf16(device: torch.device, dtype: torch.dtype) -> bool:
    """Activations in bfloat16 on a CPU that computes it natively (AVX512-BF16/AMX)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_native_bf16()


def choose_quant_kernel(
    requested: str,
    device: torch.device,
    cache_dir: Path | None,
    dtype: torch.dtype = torch.float32,
) -> QuantKernelChoice:
    """Resolve `requested` on `device` for `dtype` activations, loading (building) the qmm
    kernel when it is chosen; `qmm` where it cannot run is refused with the reason."""
    if requested not in QUANT_KERNELS:
        raise ValueError(
            f"quant_kernel must be one of {', '.join(QUANT_KERNELS)}, got {requested!r}"
        )
    if requested == "torch":
        return QuantKernelChoice("torch", "configured")
    if requested == "auto" and native_bf16(device, dtype):
        why = "torch's int4 kernel takes them as they are: as fast as qmm, closer to float32"
        return QuantKernelChoice("torch", f"auto: {NATIVE_BF16}; {why}")
    refusal = _qmm_refusal(device, cache_dir)
    if refusal is None:
        kernel = qmm.loaded()
        isa = kernel.isa if kernel is not None else "?"
        why = "configured" if requested == "qmm" else f"auto: the CPU kernel loads here ({isa})"
        return QuantKernelChoice("qmm", why)
    if requested == "qmm":
        raise ValueError(f"quant_kernel=qmm: {refusal}")
    return QuantKernelChoice("torch", f"auto: {refusal}")


def choose_quantization(
    requested: str,
    source_kind: str,
    device: torch.device,
    cache_dir: Path | None,
    *,
    quant_kernel: str = "auto",
    tp_size: int = 1,
    dtype: torch.dtype = torch.float32,
) -> tuple[str, str]:
    """(mode, reason) for `requested` on a `source_kind` model (gguf | hf | tiny-random) whose
    activations are `dtype`."""
    if requested != "auto":
        return requested, "configured"
    if source_kind != "gguf":
        return "none", f"auto: the model's weights are float ({source_kind})"
    if tp_size > 1:
        return "none", "auto: tensor parallelism shards float weights only"
    if device.type != "cpu":
        return "none", f"auto: on {device.type} the float path is the measured one"
    if quant_kernel in ("auto", "torch") and native_bf16(device, dtype):
        return "gguf", f"auto: the GGUF's own blocks on torch's int4 kernel ({NATIVE_BF16})"
    if quant_kernel == "torch":
        return (
            "none",
            "auto: quant_kernel=torch (its int4 kernel loses to float32 at larger batches)",
        )
    refusal = _qmm_refusal(device, cache_dir)
    if refusal is not None:
        return (
            "none",
            f"auto: no qmm kernel ({refusal}); torch's int4 kernel loses to float32 at larger batches",
        )
    return (
        "gguf",
        "auto: the GGUF's own blocks on this CPU's qmm kernel (a quarter of float32's bytes a step)",
    )


def _qmm_refusal(device: torch.device, cache_dir: Path | None) -> str | None:
    if device.type != "cpu":
        return f"the qmm kernel is for the CPU, not {device.type}"
    if cache_dir is None:
        return "no cache directory to build the qmm kernel in"
    try:
        qmm.load(cache_dir)
    except qmm.QmmUnavailable as e:
        return str(e)
    return None
