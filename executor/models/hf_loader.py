"""Read a Hugging Face model directory: config.json plus one or more *.safetensors shards."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from executor.models.config import ModelConfig


def read_hf_config(path: Path) -> ModelConfig:
    config_path = path / "config.json"
    if not config_path.exists():
        raise ValueError(f"{path} has no config.json")
    return ModelConfig.from_hf_config(json.loads(config_path.read_text()), name=path.name)


def load_hf_directory(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = read_hf_config(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{path} has no *.safetensors weights")
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        wanted = set(json.loads(index_path.read_text())["weight_map"].values())
        shards = [path / name for name in sorted(wanted)]
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(str(shard)))
    return config, tensors


def save_hf_directory(path: Path, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Write `config.json` + `model.safetensors` that transformers and our loader both read."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
