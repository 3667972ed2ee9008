"""What the eager input registry costs against the no-copy path, side by side.

    .venv/bin/python benchmarks/eager_registry.py                       # tiny-random and SmolLM2
    .venv/bin/python benchmarks/eager_registry.py --models tiny-random  # host overhead only

One executor per model; each rep runs the same DECODE (bs 1 and 32) or EXTEND (16 and 256
fresh tokens) step once on each path, alternating, so both see the same machine state. It
reports the median of the step's `forward` phase (the runner: registry fill, attention
metadata, model) per path, and the registry's fill + extract alone, timed around
`EagerRegistry.fill` on the same batch. The default of `eager_input_no_copy` follows these
figures (docs/performance.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from executor.batch_prep import complete_batch, make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.core.forward_batch import ForwardBatch
from executor.model_executor import ModelExecutor

CONTEXT = 64


def _released(fb: ForwardBatch, rows: list[int]) -> ForwardBatch:
    """`fb`, freeing `rows` first (each benchmark reuses its rows)."""
    return dataclasses.replace(fb, released_req_pool_indices=torch.tensor(rows))


def _forward_ms(ex: ModelExecutor, no_copy: bool, batch_fn, reps: int) -> list[float]:  # type: ignore[no-untyped-def]
    ex.toggles.eager_input_no_copy = no_copy
    out = []
    for i in range(reps):
        stats = ex.forward(batch_fn(i)).stats
        out.append(stats.timings_ns["forward"] / 1e6)
    return out


def bench_decode(ex: ModelExecutor, bs: int, reps: int) -> dict[str, float]:
    rows = list(range(1, bs + 1))
    span = CONTEXT + 2 * reps + 2
    locs = [list(range(1 + i * span, 1 + (i + 1) * span)) for i in range(bs)]
    ex.forward(
        _released(
            make_extend_batch(
                input_ids=[[3 + (j % 50) for j in range(CONTEXT)] for _ in rows],
                req_pool_indices=rows,
                out_cache_loc=[loc[:CONTEXT] for loc in locs],
            ),
            rows,
        )
    )
    step = [CONTEXT]

    def batch(i: int):  # type: ignore[no-untyped-def]
        step[0] += 1
        n = step[0]
        return make_decode_batch(
            input_ids=[5] * bs,
            req_pool_indices=rows,
            seq_lens=[n] * bs,
            out_cache_loc=[loc[n - 1] for loc in locs],
        )

    registry: list[float] = []
    forward: dict[bool, list[float]] = {False: [], True: []}
    for i in range(reps):
        for no_copy in (False, True):
            forward[no_copy] += _forward_ms(ex, no_copy, batch, 1)
        fb = complete_batch(batch(i), needs_cpu_seq_lens=False, max_context_len=4096)
        fb = fb.to(ex.device)
        t0 = time.perf_counter_ns()
        ex.runner.eager_inputs.fill(fb)
        registry.append((time.perf_counter_ns() - t0) / 1e6)
        step[0] -= 1  # the timing batch was not run
    return {
        "registry": statistics.median(forward[False]),
        "no_copy": statistics.median(forward[True]),
        "fill": statistics.median(registry),
    }


def bench_extend(ex: ModelExecutor, tokens: int, reps: int) -> dict[str, float]:
    base = ex.limits.kv_slots - tokens

    def batch(i: int):  # type: ignore[no-untyped-def]
        return _released(
            make_extend_batch(
                input_ids=[[3 + (j % 50) for j in range(tokens)]],
                req_pool_indices=[1],
                out_cache_loc=[list(range(base, base + tokens))],
            ),
            [1],
        )

    forward: dict[bool, list[float]] = {False: [], True: []}
    registry: list[float] = []
    for i in range(reps):
        for no_copy in (False, True):
            forward[no_copy] += _forward_ms(ex, no_copy, batch, 1)
        fb = complete_batch(batch(i), needs_cpu_seq_lens=False, max_context_len=4096)
        fb = fb.to(ex.device)
        t0 = time.perf_counter_ns()
        ex.runner.eager_inputs.fill(fb)
        registry.append((time.perf_counter_ns() - t0) / 1e6)
    return {
        "registry": statistics.median(forward[False]),
        "no_copy": statistics.median(forward[True]),
        "fill": statistics.median(registry),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny-random,smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    for model in args.models.split(","):
        cfg = ExecutorConfig(
            model=model,
            device=args.device,
            max_reqs=32,
            max_context_len=1024,
            kv_slots=32 * (CONTEXT + 2 * args.reps + 4) + 512,
            max_tokens_per_batch=32 * CONTEXT,
            graph_mode="none",
        )
        ex = ModelExecutor(cfg)
        print(f"\n{model} on {ex.device} ({ex.dtype}), {torch.get_num_threads()} threads")
        print(f"{'step':>14} {'registry ms':>12} {'no_copy ms':>11} {'fill+extract ms':>16}")
        for bs in (1, 32):
            r = bench_decode(ex, bs, args.reps)
            print(
                f"{'DECODE bs ' + str(bs):>14} {r['registry']:>12.3f} {r['no_copy']:>11.3f} {r['fill']:>16.3f}"
            )
        for tokens in (16, 256):
            r = bench_extend(ex, tokens, args.reps)
            label = f"EXTEND {tokens}"
            print(f"{label:>14} {r['registry']:>12.3f} {r['no_copy']:>11.3f} {r['fill']:>16.3f}")


if __name__ == "__main__":
    main()
