"""`batch_invariant` at start-up: what it needs, refused together with what it cannot run
with, and switched on in the model's linears and the attention backend.

The property: a row's logits are bitwise the same whatever else is in its batch (other rows,
the batch size, the chunking of its prompt, padding to a graph bucket, the eager, full-graph or
piecewise path). The parts that make it hold live with the code they change:
`ops.batch_invariant` (linears a fixed number of rows per GEMM call, aligned key lengths),
`attention.torch_paged` (one query row per SDPA row) and `graphs.settings.graph_compiler` (the
compiled graph backends trace with dynamo's eager backend, whose graphs call the eager
kernels: inductor's fuse the norms and activations and reduce in another order). Graphs are
allowed, not chosen: `graph_mode` auto resolves to none and the background compile stays off,
since graphs of the eager kernels save no kernel time on a CPU. What it does not cover is
refused at start-up with a message naming both settings:
- CUDA: the Triton kernels and cuBLAS are not made batch-invariant (nor CUDA graphs);
- quantized linears, whose kernels are not tiled (`quantization` auto resolves to none);
- an attention backend other than torch_paged; LoRA adapters; MoE models (their grouped
  expert GEMMs' shapes follow the routing of the whole batch).
"""

from __future__ import annotations

import torch
from torch import nn

from attention.base import AttentionBackend
from attention.torch_paged import TorchPagedBackend
from executor.config import ExecutorConfig
from executor.models.layers import Linear, PackedLinear
from executor.models.moe import routed_expert_layout


def _refuse(other: str, why: str) -> ValueError:
    return ValueError(f"batch_invariant and {other} do not go together: {why}")


def check_batch_invariance(config: ExecutorConfig, device: torch.device) -> None:
    """Refuse, before anything loads, what batch_invariant cannot run with."""
    if not config.batch_invariant:
        return
    if device.type != "cpu":
        raise _refuse(
            f"device={device}",
            "batch-invariant steps run on the CPU only (the CUDA kernels "
            "are not made batch-invariant)",
        )
    if config.attention_backend not in ("auto", TorchPagedBackend.name):
        raise _refuse(
            f"attention_backend={config.attention_backend}",
            "only torch_paged attends one query row per SDPA row; use torch_paged or auto",
        )
    if config.lora or config.max_loras:
        raise _refuse("LoRA adapters", "the adapters' products are not tiled")


def apply_batch_invariance(
    config: ExecutorConfig, model: nn.Module, backend: AttentionBackend
) -> None:
    """Switch the model's linears and the attention backend to their batch-invariant form
    (after `check_batch_invariance` and the load)."""
    if not config.batch_invariant:
        return
    if routed_expert_layout(model)[0]:
        raise _refuse(
            "an MoE model", "its grouped expert GEMMs take shapes from the whole batch's routing"
        )
    if not isinstance(backend, TorchPagedBackend):
        raise _refuse(f"attention_backend={backend.name}", "only torch_paged is batch-invariant")
    backend.batch_invariant = True
    for module in model.modules():
        if isinstance(module, (Linear, PackedLinear)):
            module.tiled = True
    model.tiled_head = True  # type: ignore[assignment]
