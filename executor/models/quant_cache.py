"""The `--quantization gguf` model as packed for the kernels, cached on disk.

Reading a GGUF walks its whole vocabulary (seconds) and packing every linear for the int4
kernel takes seconds more, so the finished model's state (float and packed tensors) is kept
as safetensors beside the dequantized-weights cache (`file_cache.py`, keyed by the file's
sha256), with a manifest in its metadata naming each quantized module's class and
attributes. The key also names the device type, the model dtype, the quantized kernel and the
torch version: the kernels' packed layouts differ between kernels and between CPU and CUDA,
and may change between releases.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from executor.models.decoder_model import DecoderModel
from executor.models.file_cache import cache_path
from executor.models.quantized import (
    GroupQmmLinear,
    Int4Linear,
    Int8Linear,
    QuantizedEmbedding,
    Restorable,
)

CACHE_FORMAT = 3  # 2: modules nested as self_attn.* / mlp.*; 3: qmm scales and mins as halves
_CLASSES: dict[str, type[Restorable]] = {
    cls.__name__: cls for cls in (Int4Linear, Int8Linear, GroupQmmLinear, QuantizedEmbedding)
}


def packed_cache_file(
    model_file: Path, cache_dir: Path, device: torch.device, dtype: torch.dtype, kernel: str
) -> Path:
    """`kernel`: the quantized linears' kernel (qmm | torch), whose layouts differ."""
    torch_version = torch.__version__.replace("+", "-")
    dtype_name = str(dtype).removeprefix("torch.")
    suffix = (
        f".packed-v{CACHE_FORMAT}-{device.type}-{dtype_name}-{kernel}-torch{torch_version}"
        ".safetensors"
    )
    return cache_path(model_file, cache_dir, suffix)


def save_packed(model: DecoderModel, path: Path) -> None:
    from safetensors.torch import save_file

    manifest = {
        name: {"class": type(m).__name__, "attrs": m.cached_attrs()}
        for name, m in model.named_modules()
        if isinstance(m, Restorable)
    }
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(state, str(tmp), metadata={"manifest": json.dumps(manifest)})
    os.replace(tmp, path)  # last: its presence means the whole entry is complete


def load_packed(model: DecoderModel, path: Path, device: torch.device) -> None:
    """Swap in the cached quantized modules and load every tensor (strictly: a key the model
    lacks or a tensor the cache lacks raises)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        manifest = json.loads((f.metadata() or {})["manifest"])
    state = load_file(str(path), device=str(device))
    for name, entry in manifest.items():
        prefix = f"{name}."
        buffers = {
            k.removeprefix(prefix): v
            for k, v in state.items()
            if k.startswith(prefix) and "." not in k.removeprefix(prefix)
        }
        parent, _, attr = name.rpartition(".")
        # setattr, not set_submodule: the tied head's slot holds None until now.
        setattr(
            model.get_submodule(parent),
            attr,
            _CLASSES[entry["class"]].restore(entry["attrs"], buffers),
        )
    model.load_state_dict(state, strict=True)
