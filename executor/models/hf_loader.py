"""Read a Hugging Face model directory: config.json plus one or more *.safetensors shards.

Every shard's header passes `check_safetensors_header` (bounded: sizes, counts and offsets
within the file) before safetensors reads it, and an index may name only files of the
directory itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from executor.models.config import ModelConfig
from executor.models.registry import config_from_hf, hf_config
from executor.models.safetensors_header import check_safetensors_header


def read_hf_config(path: Path) -> ModelConfig:
    config_path = path / "config.json"
    if not config_path.exists():
        raise ValueError(f"{path} has no config.json")
    return config_from_hf(json.loads(config_path.read_text()), name=path.name)


def _weight_files(path: Path) -> list[Path]:
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{path} has no *.safetensors weights")
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        wanted = set(json.loads(index_path.read_text())["weight_map"].values())
        for name in wanted:  # a plain file of this directory: no "../", no absolute path
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise ValueError(
                    f"{index_path.name}: weight_map names {name!r}, not a file of {path}"
                )
        shards = [path / name for name in sorted(wanted)]
    for shard in shards:
        check_safetensors_header(shard)
    return shards


def safetensors_files(path: Path) -> list[Path]:
    """A `.safetensors` file, or a directory's shards (as the loader finds them), each header
    checked."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{path.name} is not a .safetensors file")
        check_safetensors_header(path)
        return [path]
    return _weight_files(path)


def load_hf_directory(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = read_hf_config(path)
    tensors: dict[str, torch.Tensor] = {}
    for shard in _weight_files(path):
        tensors.update(load_file(str(shard)))
    return config, tensors


def lazy_safetensors(files: list[Path]) -> dict[str, Any]:
    """Every tensor of `files` as a lazy slice (`get_shape()`, `[a:b]`, `[:, a:b]`): reading
    a slice reads only those bytes of the memory-mapped file (a tensor-parallel rank's shard)."""
    from safetensors import safe_open

    slices: dict[str, Any] = {}
    for file in files:
        handle = safe_open(str(file), framework="pt")
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            slices[name] = handle.get_slice(name)
    return slices


def lazy_hf_directory(path: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """`load_hf_directory` with lazy slices instead of tensors (see `lazy_safetensors`)."""
    return read_hf_config(path), lazy_safetensors(_weight_files(path))


def save_hf_directory(path: Path, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Write `config.json` + `model.safetensors` that transformers and our loader both read."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(config), indent=2))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
