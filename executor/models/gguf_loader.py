"""Read a GGUF file (llama.cpp's format) into a ModelConfig and Hugging Face-named tensors.

The family (`general.architecture`, looked up in `registry.py`) names its layer tensors
(`DecoderModel.GGUF_NAMES`) and says whether llama.cpp permuted its Q/K rows.

Quantized tensors are dequantized to float32 with the `gguf` package. Dequantizing takes
seconds, so the result is cached as safetensors keyed by the file's sha256
(:mod:`executor.models.file_cache`); a restart loads the cache in well under a second.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from executor.models.config import AttentionConfig, ModelConfig, MoeConfig
from executor.models.decoder_model import DecoderModel
from executor.models.file_cache import atomic_write, cache_path
from executor.models.gguf_blocks import BLOCK_FORMATS, read_blocks
from executor.models.gguf_header import open_gguf
from executor.models.quant_formats import GroupQuant
from executor.models.registry import check_config, from_gguf_architecture, model_class

CACHE_FORMAT = 2
_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str, family: type[DecoderModel]) -> str:
    """The Hugging Face name of a GGUF tensor; `{e}` in it: a stack of per-expert tensors."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in family.GGUF_NAMES:
            return f"model.layers.{idx}.{family.GGUF_NAMES[rest]}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no known {family.gguf_architecture} counterpart"
    )


def _named(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """`{name: tensor}`, or one tensor per expert when `name` holds `{e}` (a stack)."""
    if "{e}" not in name:
        return {name: tensor}
    return {name.format(e=e): part.contiguous() for e, part in enumerate(tensor.unbind(0))}


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves the two rotary halves of each head.

    The converter maps HF rows [head, half, i] to [head, i, half]; rows of a weight or bias
    are regrouped back here so that our rotate-half rotary embedding sees HF's layout.
    """
    rows = weight.shape[0]
    dim = rows // n_head // 2
    return weight.reshape(n_head, dim, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _attention_config(reader: Any, arch: str) -> AttentionConfig | None:
    """Sliding windows and soft-caps, None without any. Which layers are windowed, GGUF does
    not say: the family completes it (`DecoderModel.gguf_config_defaults`)."""
    window = _field(reader, f"{arch}.attention.sliding_window")
    attn_cap = _field(reader, f"{arch}.attn_logit_softcapping")
    final_cap = _field(reader, f"{arch}.final_logit_softcapping")
    if window is None and attn_cap is None and final_cap is None:
        return None
    return AttentionConfig(
        sliding_window=int(window) if window else None,
        attn_logit_softcapping=float(attn_cap) if attn_cap is not None else None,
        final_logit_softcapping=float(final_cap) if final_cap is not None else None,
    )


def read_config(reader: Any, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    family = from_gguf_architecture(arch)
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = {int(eos)} if eos is not None else set()
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.add(int(eot))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    experts = int(_field(reader, f"{arch}.expert_count", 0))
    moe = None
    if experts > 0:
        # No GGUF key names the dense layers: they are the ones without a router.
        blocks = int(_field(reader, f"{arch}.block_count"))
        dense = tuple(
            i for i in range(blocks) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
        )
        moe = MoeConfig(
            num_experts=experts,
            top_k=int(_field(reader, f"{arch}.expert_used_count")),
            intermediate_size=int(_field(reader, f"{arch}.expert_feed_forward_length")),
            norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", True)),
            mlp_only_layers=dense,
        )
    config = ModelConfig(
        architecture=family.model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        moe=moe,
        attention=_attention_config(reader, arch),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(sorted(eos_ids)),
        name=str(_field(reader, "general.name", name)),
    )
    return check_config(family.gguf_config_defaults(config))


def _config_from_json(text: str) -> ModelConfig | None:
    data = json.loads(text)
    if data.pop("format", None) != CACHE_FORMAT:
        return None
    return ModelConfig.from_dict(data)


def read_gguf_config(path: Path, cache_dir: Path | None) -> ModelConfig:
    """Metadata only (tensors are never read). Parsing walks the whole vocabulary, which takes
    seconds for a large one, so the result is cached as `<sha256>.config.json`."""

    cached = cache_path(path, cache_dir, ".config.json") if cache_dir is not None else None
    if cached is not None and cached.exists():
        config = _config_from_json(cached.read_text())
        if config is not None:
            return config
    config = read_config(open_gguf(path), path.stem)
    if cached is not None:
        atomic_write(cached, json.dumps({"format": CACHE_FORMAT, **config.as_dict()}).encode())
    return config


def _permuted_rows(name: str, config: ModelConfig) -> int | None:
    """The head count whose rotary halves llama.cpp interleaved in this tensor's rows, if any."""
    permuted = model_class(config.architecture).GGUF_PERMUTED_QK
    if permuted and (".attn_q." in name or ".attn_k." in name):
        return config.num_heads if ".attn_q." in name else config.num_kv_heads
    return None


def _check_type(t: Any) -> None:
    if t.tensor_type.name not in _SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {t.name!r} has type {t.tensor_type.name}; supported: {', '.join(_SUPPORTED_TYPES)}"
        )


def _float_tensor(t: Any, config: ModelConfig) -> torch.Tensor:
    import gguf

    data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    n_head = _permuted_rows(t.name, config)
    if n_head is not None:
        data = unpermute_qk(data, n_head)
    shift = model_class(config.architecture).GGUF_NORM_SHIFT
    if shift and t.name.endswith("norm.weight"):
        data = data - np.float32(shift)
    if not data.flags.writeable or not data.flags.c_contiguous:  # F32 tensors are views of the mmap
        data = np.array(data, copy=True, order="C")
    return torch.from_numpy(data)


def dequantize_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Parse and dequantize a GGUF file: (config, float32 tensors under HF names)."""

    reader = open_gguf(path)
    config = read_config(reader, path.stem)
    family = model_class(config.architecture)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        _check_type(t)
        tensors.update(_named(hf_tensor_name(t.name, family), _float_tensor(t, config)))
    return config, tensors


def _unpermute_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    return torch.from_numpy(unpermute_qk(rows.numpy(), n_head).copy())


def read_gguf_blocks(
    path: Path,
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, GroupQuant]]:
    """(config, float tensors, quantized 2-D tensors kept as their blocks), under HF names.

    Q4_0 / Q4_1 / Q8_0 matrices become `GroupQuant` values (no dequantization: a fraction of a
    second for SmolLM2); everything else is read as float32 as `dequantize_gguf` does.
    """

    reader = open_gguf(path)
    config = read_config(reader, path.stem)
    family = model_class(config.architecture)
    floats: dict[str, torch.Tensor] = {}
    blocks: dict[str, GroupQuant] = {}
    for t in reader.tensors:
        _check_type(t)
        name = hf_tensor_name(t.name, family)
        if t.tensor_type.name not in BLOCK_FORMATS or len(t.shape) != 2:
            floats.update(_named(name, _float_tensor(t, config)))
            continue
        weight = read_blocks(t.data, t.tensor_type.name, rows=int(t.shape[1]), cols=int(t.shape[0]))
        n_head = _permuted_rows(t.name, config)
        if n_head is not None:
            weight = weight.map_rows(partial(_unpermute_rows, n_head=n_head))
        blocks[name] = weight
    return config, floats, blocks


def lazy_gguf(path: Path, cache_dir: Path | None) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, lazy slices) of the dequantized cache, filled first when missing: a
    tensor-parallel rank then reads only its shard of the float weights. Without a cache
    directory the whole file is dequantized in memory (every rank does it)."""
    from executor.models.hf_loader import lazy_safetensors

    if cache_dir is None:
        return dequantize_gguf(path)
    weights = cache_path(path, cache_dir, ".safetensors")
    if not weights.exists():
        load_gguf(path, cache_dir)
    return read_gguf_config(path, cache_dir), lazy_safetensors([weights])


def load_gguf(path: Path, cache_dir: Path | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, tensors) from the cache when present, else dequantize and fill the cache."""
    from safetensors.torch import load_file, save_file

    if cache_dir is None:
        return dequantize_gguf(path)
    weights = cache_path(path, cache_dir, ".safetensors")
    if weights.exists():
        return read_gguf_config(path, cache_dir), load_file(str(weights))
    config, tensors = dequantize_gguf(path)
    atomic_write(
        cache_path(path, cache_dir, ".config.json"),
        json.dumps({"format": CACHE_FORMAT, **config.as_dict()}).encode(),
    )
    tmp = weights.with_name(f".{weights.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"format": str(CACHE_FORMAT), "source": str(path)})
    os.replace(tmp, weights)  # last: its presence means the whole entry is complete
    return config, tensors
