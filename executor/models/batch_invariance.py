"""`batch_invariant` at start-up: what it needs, refused together with what it cannot run
with, and switched on in the model's linears and the attention backend.

The property: a row's logits are bitwise the same whatever else is in its batch (other rows,
the batch size, the chunking of its prompt, padding to a graph bucket, the eager, full-graph or
piecewise path). The parts that make it hold live with the code they change:
- `ops.batch_invariant`: linears a fixed number of rows per GEMM call (oneDNN or MKL on the
  CPU, cuBLAS on CUDA), aligned key lengths;
- attention: on the CPU `attention.torch_paged` (one query row per SDPA row), on CUDA
  `attention.triton` (decode splits a request's keys by its own length, extend sums keys in
  blocks at absolute positions); the norms, rotary and activation there are per-row Triton
  kernels;
- graphs: `graphs.settings.graph_compiler` (the compiled graph backends trace with dynamo's
  eager backend, whose graphs call the eager kernels: inductor's fuse the norms and
  activations and reduce in another order); a CUDA graph replays the eager kernels as they
  are. Graphs are allowed, not chosen: `graph_mode` auto resolves to none and the background
  compile stays off (graphs of the eager kernels save no kernel time on a CPU).
What it does not cover is refused at start-up with a message naming both settings: another
device; an attention backend other than the device's one above; quantized linears, whose
kernels are not tiled (`quantization` auto resolves to none); LoRA adapters; MoE models (their
grouped expert GEMMs' shapes follow the routing of the whole batch).
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
    if config.attention_backend not in ("auto", invariant.name):
        raise _refuse(
            f"attention_backend={config.attention_backend}",
            f"on {device.type}, only {invariant.name} sums each request's keys in an order "
            f"its batch does not change; use {invariant.name} or auto",
        )
    if config.quantization not in ("auto", "none"):
        raise _refuse(
            f"quantization={config.quantization}",
            "batch-invariant steps run float linears; use quantization=none or auto",
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
