"""Helpers of the weight-update tests: new weights, a fresh executor started on them, greedy
tokens, and an update applied in-process through the engine's three stages."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from executor.client.scheduler import generate
from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.models.hf_loader import save_hf_directory
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights
from executor.weights.catalog import TensorSpec
from executor.weights.control import SwapResult

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 40, 41, 200], [17] * 12]
# Large enough that the resident set (or the device's free memory) shows a release plainly:
# ~85 MB of float32 weights (tests/test_memory_release.py, the GPU check's memory_release).
MEDIUM = replace(
    TINY_CONFIGS["tiny-random"],
    hidden_size=512,
    intermediate_size=1536,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    vocab_size=8192,
    name="medium-random",
)


def config(cache_dir: Path, model: str = "tiny-random", **overrides: Any) -> ExecutorConfig:
    values: dict[str, Any] = {
        "model": model,
        "device": "cpu",
        "dtype": "float32",
        "max_reqs": 8,
        "kv_slots": 1024,
        "max_context_len": 256,
        "cache_dir": str(cache_dir),
        "graph_mode": "none",
        "graph_backend": "standin",
    }
    values.update(overrides)
    return ExecutorConfig(**values)


def new_weights(model: str = "tiny-random", seed: int = 1) -> dict[str, torch.Tensor]:
    """Another draw of the model's tiny-random weights: the "trained" ones."""
    return tiny_random_weights(TINY_CONFIGS[model], seed=seed)


def saved(tmp_path: Path, model: str, tensors: dict[str, torch.Tensor]) -> Path:
    """`tensors` as a Hugging Face directory of `model`'s config."""
    path = tmp_path / f"{model}-updated"
    save_hf_directory(path, TINY_CONFIGS[model], tensors)
    return path


def fresh(
    tmp_path: Path, cache_dir: Path, model: str, tensors: dict[str, torch.Tensor], **kw: Any
) -> ModelExecutor:
    """An executor started on `tensors`: what an update to them must equal."""
    return ModelExecutor(config(cache_dir, str(saved(tmp_path, model, tensors)), **kw))


def greedy(ex: Any, n: int = 6, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return generate(ex.forward, ex.limits, prompts, max_new_tokens=n, ignore_eos=True)


def update(ex: ModelExecutor, tensors: dict[str, torch.Tensor], version: str = "") -> SwapResult:
    """Plan, stage and swap `tensors` in-process (the service does the same, per transport)."""
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    plan = ex.weights.plan(specs, version, max_bytes=1 << 40)
    return ex.weights.swap(ex.weights.stage(plan, list(tensors.values())))


def transport_update(
    ex: ModelExecutor, transport: str, model: str, seed: int, version: str, where: str = ""
) -> str:
    """Update `ex` in-process with `new_weights(model, seed)` as each transport stages it
    (every rank its shard under tensor parallelism): `tensors` (a stream's, forwarded by rank
    0), `files` (the safetensors file `where`, read by every rank) or `group` (a trainer
    thread's weights group at port `where`)."""
    tensors = new_weights(model, seed)
    if transport == "group":
        return group_update(ex, tensors, int(where), version)
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    plan = ex.weights.plan(specs, version, max_bytes=1 << 40)
    if transport == "files":
        from safetensors.torch import save_file

        save_file(tensors, where)
        staged = ex.weights.stage_files(plan, [Path(where)])
    else:
        staged = ex.weights.stage_tensors(plan, list(tensors.values()))
    return ex.weights.swap(staged).version


def group_update(
    ex: ModelExecutor, tensors: dict[str, torch.Tensor], port: int, version: str
) -> str:
    """In-process, with a trainer thread: form a weights group (the trainer rank 0, the
    executor's ranks 1..tp) and update `ex` over it with `tensors`."""
    import threading

    from executor.weights.group import GroupSpec, WeightsGroup

    world = 1 + ex.comm.size
    spec = GroupSpec("127.0.0.1", port, 0, world, "gloo", "weights", 60.0)
    trainer: list[WeightsGroup] = []
    joined = threading.Thread(
        target=lambda: trainer.append(WeightsGroup(spec, torch.device("cpu")))
    )
    joined.start()
    ex.weights.join_group(GroupSpec("127.0.0.1", port, 1, world, "gloo", "weights", 60.0))
    joined.join()
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    plan = ex.weights.plan(specs, version, max_bytes=1 << 40)

    def send() -> None:
        assert trainer[0].verdict(0, 1) == 0
        for t in tensors.values():
            trainer[0].broadcast(t.contiguous(), 0)

    sender = threading.Thread(target=send)
    sender.start()
    staged = ex.weights.stage_group(plan, 0)
    sender.join()
    result = ex.weights.swap(staged)
    ex.weights.leave_group()
    trainer[0].close()
    return result.version
