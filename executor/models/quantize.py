"""`--quantization`: swap a built model's decoder linears for quantized ones.

- `gguf`: the file's own Q4_0 / Q4_1 / Q8_0 blocks (`gguf_blocks.py`), fused and packed for
  the int4 kernel; a linear whose GGUF tensors are float stays a float `Linear`.
- `int4` / `int8`: float weights quantized at load (group-32 min/max int4, per-channel int8);
  int8 is CPU only (`check_device`: torch's CUDA int8 kernel is a naive one).

What each mode quantizes:
- `gguf`: every tensor the file stores in blocks. The four linears of each decoder layer
  (fused QKV, output, fused gate-up, down); the LM head through the same int4 kernel (a Q8_0
  head as two exact int4 terms); the embedding as a `QuantizedEmbedding`, which gathers rows
  of the 8-bit table and dequantizes them exactly. SmolLM2 ties head and embedding to one
  Q8_0 tensor: kept float32 it is 113 MB, two thirds of the quantized model's bytes and of
  what each decode step streams, so both are kept quantized (the two forms hold 67 MB).
- `int4` / `int8`: the four decoder linears only. The embedding and LM head stay float in the
  model dtype: a float checkpoint says nothing about how they tolerate quantization, and the
  head's logits are what sampling reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from executor.models.config import ModelConfig
from executor.models.decoder_model import DecoderModel
from executor.models.layers import Linear
from executor.models.quant_formats import (
    GROUP_SIZE,
    GroupQuant,
    cat_rows,
    quantize_int4,
    quantize_int8,
)
from executor.models.quantized import QuantizedEmbedding, int4_shape_problem, quantized_linear
from executor.models.weights import layer_submodule


def _refuse(mode: str, name: str, shape: tuple[int, int], problem: str) -> ValueError:
    return ValueError(
        f"quantization={mode}: {name} has weight shape [{shape[0]}, {shape[1]}] and {problem}; "
        f"use quantization=none or int8 for this model"
    )


def fused_linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """[N, K] of each fused decoder linear, from the hyper-parameters alone."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "self_attn.qkv_proj": (q + 2 * kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_up_proj": (2 * inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def check_quantization(
    mode: str, source_kind: str, spec: str, config: ModelConfig, device: torch.device
) -> None:
    """Refuse a bad combination at start-up, from metadata only (no weights read): `gguf` on
    a model that is no GGUF file, `int4` on shapes the int4 kernel cannot take."""
    check_source(mode, source_kind, spec)
    check_device(mode, device)
    check_int4_shapes(mode, config, device)


# NOTE: torch's `_weight_int8pack_mm` on CUDA is a naive kernel (one thread per output
# element, no tensor cores, the weight re-read per row of x): slower than the bfloat16 model
# it is meant to beat. No other int8 weight-only kernel ships with torch (`_int_mm` needs int8
# activations), so int8 is refused there rather than served slowly.
INT8_ON_CUDA = (
    "quantization=int8 is not served on CUDA: torch's int8 weight-only kernel there "
    "(_weight_int8pack_mm) is a naive one, slower than the unquantized model; use "
    "quantization=int4 (torch's tinygemm kernel) or none (bfloat16) on CUDA"
)


def check_device(mode: str, device: torch.device) -> None:
    """Refuse a mode whose kernel on `device` would be slower than not quantizing."""
    if mode == "int8" and device.type == "cuda":
        raise ValueError(INT8_ON_CUDA)


def check_source(mode: str, source_kind: str, spec: str) -> None:
    if mode == "gguf" and source_kind != "gguf":
        raise ValueError(
            f"quantization=gguf keeps a GGUF file's own blocks, but model {spec!r} is "
            f"{source_kind}; use quantization=int8 or int4 to quantize float weights at load"
        )


def check_int4_shapes(mode: str, config: ModelConfig, device: torch.device) -> None:
    if mode != "int4":
        return
    for attr, shape in fused_linear_shapes(config).items():
        problem = int4_shape_problem(*shape, GROUP_SIZE, device)
        if problem is not None:
            raise _refuse(mode, f"model.layers.*.{attr}", shape, problem)


def quantize_float_linears(
    model: DecoderModel, mode: str, device: torch.device, *, use_qmm: bool = False
) -> None:
    """Replace every loaded float decoder linear (the family's `FUSED_LINEARS`) by its int4
    or int8 quantization; other weights (grouped experts, routers) stay float."""
    if mode not in ("int4", "int8"):
        raise ValueError(f"quantize_float_linears takes int4 or int8, got {mode!r}")
    check_device(mode, device)
    check_int4_shapes(mode, model.config, device)
    for layer in model.decoder_layers:
        for path in model.FUSED_LINEARS:
            linear = layer_submodule(layer, path)
            if linear is None:
                continue
            assert isinstance(linear, Linear)
            weight = (
                quantize_int4(linear.weight) if mode == "int4" else quantize_int8(linear.weight)
            )
            layer.set_submodule(
                path, quantized_linear(weight, linear.bias, device=device, use_qmm=use_qmm)
            )


def install_gguf_blocks(
    model: DecoderModel,
    blocks: Mapping[str, GroupQuant],
    floats: dict[str, torch.Tensor],
    device: torch.device,
    *,
    use_qmm: bool = False,
) -> int:
    """Swap in an int4-kernel linear for each fused linear whose parts are all GGUF blocks of
    one bit width; the others get their parts dequantized into `floats` (for
    `load_hf_weights`). Biases of swapped linears are taken out of `floats`. Returns how many
    linears were swapped."""
    swapped = 0
    for i, layer in enumerate(model.decoder_layers):
        p = f"model.layers.{i}."
        for attr, sources in model.FUSED_LINEARS.items():
            linear = layer_submodule(layer, attr)
            if not isinstance(linear, Linear):
                continue
            names = [f"{p}{src}.weight" for src in sources]
            parts = [blocks.get(n) for n in names]
            present = [part for part in parts if part is not None]
            if len(present) == len(parts) and len({part.bits for part in present}) == 1:
                weight = cat_rows(present)
                problem = (
                    None if use_qmm else int4_shape_problem(*weight.shape, weight.group, device)
                )
                if problem is not None:
                    raise _refuse("gguf", p + attr, weight.shape, problem)
                bias = None
                if linear.bias is not None:
                    bias = torch.cat([floats.pop(f"{p}{src}.bias") for src in sources])
                    bias = bias.to(device=device, dtype=linear.bias.dtype)
                layer.set_submodule(
                    attr, quantized_linear(weight, bias, device=device, use_qmm=use_qmm)
                )
                swapped += 1
            else:
                for name, part in zip(names, parts, strict=True):
                    if part is not None:
                        floats[name] = part.dequantize()
    _install_head_and_embedding(model, blocks, floats, device, use_qmm=use_qmm)
    return swapped


def _install_head_and_embedding(
    model: DecoderModel,
    blocks: Mapping[str, GroupQuant],
    floats: dict[str, torch.Tensor],
    device: torch.device,
    *,
    use_qmm: bool,
) -> None:
    """The LM head as an int4-kernel linear over its blocks (the embedding's when tied), and
    the embedding as a `QuantizedEmbedding`; a head the kernel cannot take stays float (and,
    when tied, so does the embedding)."""
    embed = blocks.get("model.embed_tokens.weight")
    head = embed if model.config.tie_word_embeddings else blocks.get("lm_head.weight")
    head_fits = head is not None and (
        use_qmm or int4_shape_problem(*head.shape, head.group, device) is None
    )
    if head is not None and head_fits:
        model.lm_head = quantized_linear(head, None, device=device, use_qmm=use_qmm)
    elif head is not None and not model.config.tie_word_embeddings:
        floats["lm_head.weight"] = head.dequantize()
    if embed is not None and (head_fits or not model.config.tie_word_embeddings):
        model.embed_tokens = QuantizedEmbedding(embed, device=device, dtype=model.activation_dtype)
    elif embed is not None:
        floats["model.embed_tokens.weight"] = embed.dequantize()
