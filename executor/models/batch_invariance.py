"""`batch_invariant` at start-up: what it needs, refused together with what it cannot run
with, and switched on in the model's linears and the attention backend.

The property: a row's logits are bitwise the same whatever else is in its batch (other rows,
the batch size, the chunking of its prompt). The parts that make it hold live with the code
they change: `ops.batch_invariant` (linears a fixed number of rows per GEMM call, aligned key
lengths) and `attention.torch_paged` (one query row per SDPA row). What it does not cover is
refused at start-up with a message naming both settings:
- on CUDA, an attention backend other than triton (`attention.triton`: decode splits a
  request's keys by its own length, extend sums keys in blocks at absolute positions); the
  linears there are cuBLAS GEMMs in the same 16-row tiles, the norms, rotary and activation
  the per-row Triton kernels;
- graphs: a compiled graph fuses the norms and activations differently from the eager
  kernels (`graph_mode` auto resolves to none, and the background compile stays off);
- quantized linears, whose kernels are not tiled (`quantization` auto resolves to none);
- on the CPU, an attention backend other than torch_paged; LoRA adapters; MoE models (their grouped
  expert GEMMs' shapes follow the routing of the whole batch).
"""

from __future__ import annotations

import torch
from torch import nn

from attention.base import AttentionBackend
from attention.torch_paged import TorchPagedBackend
from attention.triton.backend import TritonAttnBackend
from executor.config import ExecutorConfig
from executor.models.layers import Linear, PackedLinear
from executor.models.moe import routed_expert_layout

_INVARIANT_BACKENDS: dict[str, type[TorchPagedBackend] | type[TritonAttnBackend]] = {
    "cpu": TorchPagedBackend,
    "cuda": TritonAttnBackend,
}


def _refuse(other: str, why: str) -> ValueError:
    return ValueError(f"batch_invariant and {other} do not go together: {why}")


def check_batch_invariance(config: ExecutorConfig, device: torch.device) -> None:
    """Refuse, before anything loads, what batch_invariant cannot run with."""
    if not config.batch_invariant:
        return
    # The one backend per device whose reductions are made batch-invariant.
    invariant = _INVARIANT_BACKENDS.get(device.type)
    if invariant is None:
        raise _refuse(
            f"device={device}", "batch-invariant steps run on the CPU or on CUDA with triton"
        )
    if config.graph_mode not in ("auto", "none"):
        raise _refuse(
            f"graph_mode={config.graph_mode}",
            "compiled graphs fuse the norms and activations "
            "differently from the eager kernels; use graph_mode=none or auto",
        )
    if config.attention_backend not in ("auto", invariant.name):
        raise _refuse(
            f"attention_backend={config.attention_backend}",
            f"on {device.type}, only {invariant.name} sums each request's keys in an order "
            f"its batch does not change; use {invariant.name} or auto",
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
    invariant = _INVARIANT_BACKENDS.get(backend.req_to_token_pool.req_to_token.device.type)
    if invariant is None or not isinstance(backend, invariant):
        raise _refuse(
            f"attention_backend={backend.name}", "it is not made batch-invariant on this device"
        )
    backend.batch_invariant = True
    for module in model.modules():
        if isinstance(module, (Linear, PackedLinear)):
            module.tiled = True
    model.tiled_head = True  # type: ignore[assignment]
