"""Start-up configuration: one frozen dataclass, validated once, plus what it resolves to.

`ExecutorConfig` holds what the operator asked for ("auto" allowed); `resolve_device` and
`resolve_dtype` turn the "auto" values into concrete ones on this machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from attention import BACKEND_NAMES as ATTENTION_BACKEND_NAMES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GRAPH_MODES = ("none", "decode", "extend", "both")
NEEDS_CPU_SEQ_LENS_VALUES = ("auto", "on", "off")


@dataclass(frozen=True)
class ExecutorConfig:
    """What the executor is built from. Every field has a default a newcomer can run with."""

    model: str = "smollm2"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16
    max_reqs: int = 128  # request rows 1..max_reqs
    max_context_len: int = 0  # 0: the model's context length, capped at 8192
    kv_slots: int = 65536  # KV slots 1..kv_slots
    max_batch_size: int = 0  # 0: max_reqs
    max_tokens_per_batch: int = 8192
    attention_backend: str = "auto"  # auto (triton on CUDA, torch_paged on CPU) | a name
    graph_mode: str = "none"  # none | decode (full graphs) | extend (piecewise) | both
    needs_cpu_seq_lens: str = "auto"  # auto (decided from backends and paths) | on | off
    cache_dir: str = ""  # "": $XDG_CACHE_HOME/model-executor or ~/.cache/model-executor
    seed: int = 0  # seeds draws of requests that bring no seed of their own

    def __post_init__(self) -> None:
        for name in ("max_reqs", "kv_slots", "max_tokens_per_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_context_len", "max_batch_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = derived), got {getattr(self, name)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_NAMES)}, "
                f"got {self.attention_backend!r}"
            )
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(
                f"graph_mode must be one of {', '.join(GRAPH_MODES)}, got {self.graph_mode!r}"
            )
        if self.needs_cpu_seq_lens not in NEEDS_CPU_SEQ_LENS_VALUES:
            raise ValueError(
                f"needs_cpu_seq_lens must be one of {', '.join(NEEDS_CPU_SEQ_LENS_VALUES)}, "
                f"got {self.needs_cpu_seq_lens!r}"
            )

    def replace(self, **changes: Any) -> ExecutorConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ExecutorConfig(**values)


def resolve_device(config: ExecutorConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {config.device!r} was asked for but CUDA is not available")
    return device


def resolve_dtype(config: ExecutorConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[config.dtype]


def resolve_cache_dir(config: ExecutorConfig) -> Path:
    if config.cache_dir:
        return Path(config.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "model-executor"
