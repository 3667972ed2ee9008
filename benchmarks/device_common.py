"""What the GPU check's stages share (benchmarks/device_check.py): the run's context, the
models it builds on the device, executors over them, and a stage's result.

The main model is SmolLM2-135M's shape with seeded random weights, made where it runs
(nothing to carry): 30 layers, hidden 576, MLP 1536, 9 query / 3 KV heads of 64, vocabulary
49152. Unlike SmolLM2 its LM head is untied (tiny-random's x4 head keeps logits apart, so
greedy tokens compare); the head GEMM's shape is the same. The dry run (`--dry-run`, on the
CPU) uses tiny-random in its place and the capture-checked stand-in for graphs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.models.tiny_random import TINY_CONFIGS

SMOLLM2_SHAPE = "smollm2-shape-random"
SLIDING = "tiny-random-gemma2"  # windows of 8 on layers 0 and 2, soft-capped logits
MOE = "tiny-random-qwen3-moe"  # 4 experts, top 2


@dataclass
class StageResult:
    """PASS / FAIL / SKIP, the summary line's key figures, a table for the log, and the
    details written to details.jsonl."""

    status: str
    figures: str
    lines: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Context:
    device: torch.device
    dry_run: bool
    cache_dir: Path

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def main_model(self) -> str:
        return "tiny-random" if self.dry_run else SMOLLM2_SHAPE

    @property
    def models(self) -> tuple[str, ...]:
        return (self.main_model, SLIDING, MOE)

    @property
    def backend(self) -> str:
        """The attention backend every path runs on: the device's default."""
        return "triton" if self.cuda else "torch_paged"

    @property
    def other_backends(self) -> tuple[str, ...]:
        """Backends compared eagerly with the default's tokens."""
        return ("torch_paged", "torch_native") if self.cuda else ("torch_native",)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def describe(self) -> str:
        if self.cuda:
            name = torch.cuda.get_device_name(self.device)
            return f"{name}, torch {torch.__version__} (CUDA {torch.version.cuda})"
        return f"CPU (dry run), torch {torch.__version__}"


def register_models() -> None:
    """Add the SmolLM2-shaped random model to the tiny configs (the loader reads them at
    call time), so `model=smollm2-shape-random` builds it like any tiny-random model."""
    TINY_CONFIGS[SMOLLM2_SHAPE] = replace(
        TINY_CONFIGS["tiny-random"],
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        name=SMOLLM2_SHAPE,
    )


def executor_config(ctx: Context, model: str, dtype: str, **overrides: Any) -> ExecutorConfig:
    """One executor of the check: the device's default backend, graphs off until a stage
    turns them on, the buckets the stages' batches fit."""
    values: dict[str, Any] = {
        "model": model,
        "device": str(ctx.device),
        "dtype": dtype,
        "attention_backend": ctx.backend,
        "graph_mode": "none",
        "graph_backend": "cuda" if ctx.cuda else "standin",
        "linear_kernel": "aten",
        "max_reqs": 16,
        "kv_slots": 16384 if ctx.cuda else 4096,
        "max_context_len": 1024 if ctx.cuda else 256,
        "graph_batch_sizes": "1,2,4,8",
        "piecewise_token_sizes": "16,32,64,128,256",
        "cache_dir": str(ctx.cache_dir),
    }
    values.update(overrides)
    return ExecutorConfig(**values)


def build(
    ctx: Context, model: str, dtype: str, loaded: Any = None, **overrides: Any
) -> ModelExecutor:
    """An executor; `loaded`: another executor's weights (`ex.loaded`), so executors of one
    model share them instead of building them again."""
    return ModelExecutor(executor_config(ctx, model, dtype, **overrides), loaded)


def percentiles(values: list[float]) -> tuple[float, float]:
    """(median, p90)."""
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def markdown_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines
