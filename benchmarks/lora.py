"""What LoRA adapters cost per DECODE step, in-process, against the same step without.

    python benchmarks/lora.py                                   # SmolLM2-135M, bs 1, 8, 32
    python benchmarks/lora.py --model tiny-random --batch-sizes 1,8 --steps 10

Two executors of the same model: one with LoRA off, one with `--adapters` adapters loaded
(rank `--rank`, every projection targeted, random weights written as PEFT files). Reported,
as medians of the wall time of `forward` per DECODE step, the variants alternating step by
step so that drift falls on all alike:
- `off`: the base-only step with LoRA off;
- `loaded`: the base-only step with the adapters loaded (should match `off`: no LoRA work);
- `mixed`: every row on an adapter, the rows spread over the adapters (one with bs 1);
and the load time of one adapter (reading, checking, writing its slot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import save_file

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.core.lora_types import RowAdapter
from executor.model_executor import ModelExecutor

PROMPT = 16  # prompt tokens per row


def write_adapter(ex: ModelExecutor, out: Path, rank: int, seed: int) -> Path:
    """A PEFT adapter over every projection this model adapts, random A and B."""
    assert ex.lora is not None
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    targets = set()
    for proj in ex.lora.weights.projections.values():
        n_out, n_in = proj.shape
        key = f"base_model.model.model.layers.{proj.layer}.{proj.part}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) / rank**0.5
        targets.add(proj.target)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sorted(targets)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


class Rows:
    """`bs` rows starting at `first`, prefilled once (with `adapters`), then decoded."""

    def __init__(self, ex: ModelExecutor, first: int, bs: int, adapters: list[str]) -> None:
        rows = list(range(first, first + bs))
        base = (first - 1) * (PROMPT + 1) + 1
        locs = [
            list(range(base + i * (PROMPT + 1), base + i * (PROMPT + 1) + PROMPT))
            for i in range(bs)
        ]
        prefill = make_extend_batch(
            input_ids=[[3 + i] * PROMPT for i in range(bs)],
            req_pool_indices=rows,
            out_cache_loc=locs,
        )
        if adapters:
            entries = tuple(RowAdapter(r, adapters[i % len(adapters)]) for i, r in enumerate(rows))
            prefill = dataclasses.replace(prefill, row_adapters=entries)
        ex.forward(prefill)
        self.batch = make_decode_batch(
            input_ids=[5] * bs,
            req_pool_indices=rows,
            seq_lens=[PROMPT + 1] * bs,
            out_cache_loc=[loc[-1] + 1 for loc in locs],
        )

    def step_ms(self, ex: ModelExecutor) -> float:
        t = time.perf_counter()
        ex.forward(self.batch)
        return (time.perf_counter() - t) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--graph-mode", default="auto")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows_needed = 2 * sum(sizes)

    def make(max_loras: int) -> ModelExecutor:
        return ModelExecutor(
            ExecutorConfig(
                model=args.model,
                dtype=args.dtype,
                graph_mode=args.graph_mode,
                max_reqs=rows_needed,
                kv_slots=(rows_needed + 1) * (PROMPT + 2),
                max_context_len=64,
                max_loras=max_loras,
                max_lora_rank=args.rank,
            )
        )

    off, on = make(0), make(args.adapters)
    names = [f"a{i}" for i in range(args.adapters)]
    load_s = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            path = write_adapter(on, Path(tmp) / name, args.rank, seed=i)
            t = time.perf_counter()
            on.load_lora(name, str(path))
            load_s.append(time.perf_counter() - t)
    print(f"# {platform.processor() or platform.machine()}, model {args.model}, "
          f"{args.adapters} adapters of rank {args.rank}, graph_mode {args.graph_mode}")  # fmt: skip
    print(f"adapter load: median {statistics.median(load_s) * 1e3:.1f} ms over {len(load_s)}")
    print("bs  off_ms  loaded_ms  loaded/off  mixed_ms  mixed/loaded")
    first = 1
    for bs in sizes:
        base_off = Rows(off, first, bs, [])
        base_on = Rows(on, first, bs, [])
        mixed = Rows(on, first + bs, bs, names)
        first += 2 * bs
        times: dict[str, list[float]] = {"off": [], "loaded": [], "mixed": []}
        for step in range(args.steps + 3):
            runs = (("off", off, base_off), ("loaded", on, base_on), ("mixed", on, mixed))
            for name, ex, rows in runs[step % 3 :] + runs[: step % 3]:
                ms = rows.step_ms(ex)
                if step >= 3:  # warm-up (graph capture on first use)
                    times[name].append(ms)
        m = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"{bs:<3} {m['off']:7.3f} {m['loaded']:10.3f} {m['loaded'] / m['off']:10.3f}"
            f" {m['mixed']:9.3f} {m['mixed'] / m['loaded']:12.3f}"
        )


if __name__ == "__main__":
    main()
