"""Staging cost of the eager path per DECODE step: registry-backed vs no-copy (issue 4).

For each batch size 1, 2, 4, ..., 256 it times, on one executor:
- `fill`: `fill_from` into the eager decode registry (the copies),
- `stage`: the whole registry staging (`fill_from` + `extract_buffer`),
- `no-copy`: what the escape hatch does instead (`dataclasses.replace(batch)`),
each as the median of `--iters` calls, plus the FillStats of one fill; then the median of
`--steps` whole `ModelExecutor.forward` decode steps on each path (interleaved), for scale.

    python benchmarks/eager_staging.py [--model tiny-random] [--device auto] [--iters 2000]
        [--steps 6] [--threads 1]

Staging copies per-request index tensors only (embeddings are not registered for eager),
so its cost does not depend on the model; tiny-random keeps the whole-step column quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run from a checkout: import this tree's packages, not an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import structlog
import torch

from executor.batch_prep import complete_batch, make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.forward_batch import ForwardBatch
from executor.model_executor import ModelExecutor

BATCH_SIZES = [2**i for i in range(9)]  # 1 .. 256
PROMPT_LEN = 8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_us(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter_ns()
        fn()
        _sync(device)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def decode_batch(rows: list[int], seq_len: int, first_slot: int) -> ForwardBatch:
    return make_decode_batch(
        input_ids=[5] * len(rows),
        req_pool_indices=rows,
        seq_lens=[seq_len] * len(rows),
        out_cache_loc=list(range(first_slot, first_slot + len(rows))),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--cache-dir", default="", help="weights cache (default: the executor's)")
    parser.add_argument("--iters", type=int, default=2000, help="timed staging calls per size")
    parser.add_argument("--steps", type=int, default=6, help="timed forward steps per path")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: no thread rendezvous noise on a small shared CPU)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))

    max_bs = BATCH_SIZES[-1]
    steps = 2 * args.steps + 2
    config = ExecutorConfig(
        model=args.model,
        device=args.device,
        max_reqs=max_bs,
        kv_slots=max_bs * (PROMPT_LEN + steps + 1),
        max_context_len=256,
        cache_dir=args.cache_dir,
    )
    ex = ModelExecutor(config)
    print(
        f"# eager staging, model={args.model}, device={ex.device}, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"threads={torch.get_num_threads()}, iters={args.iters}, steps={args.steps}"
    )
    print(
        "| bs | fill us | stage us | no-copy us | tensors | bytes | copy calls "
        "| step us (eager) | step us (no-copy) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    measure(ModelExecutor(config, loaded=ex.loaded), 1, args.iters, steps)  # warm-up, discarded
    for bs in BATCH_SIZES:
        ex = ModelExecutor(config, loaded=ex.loaded)  # a fresh cache and fresh registries
        print(measure(ex, bs, args.iters, steps))


def measure(ex: ModelExecutor, bs: int, iters: int, steps: int) -> str:
    """One table row for batch size `bs`."""
    device = ex.device
    # Fresh requests in rows 1..bs, each PROMPT_LEN tokens, in one EXTEND.
    rows = list(range(1, bs + 1))
    locs = [list(range(1 + i * PROMPT_LEN, 1 + (i + 1) * PROMPT_LEN)) for i in range(bs)]
    ex.forward(
        make_extend_batch(
            input_ids=[[7] * PROMPT_LEN] * bs, req_pool_indices=rows, out_cache_loc=locs
        )
    )
    # Staging alone, on one completed, on-device decode batch.
    host = complete_batch(
        decode_batch(rows, PROMPT_LEN + 1, first_slot=1 + bs * PROMPT_LEN),
        needs_cpu_seq_lens=ex.toggles.needs_cpu_seq_lens,
    )
    fb = host.to(device)
    inputs = ex.runner.eager_inputs
    stats = inputs.stage(fb).stats  # builds the registry outside the timed loops
    reg = inputs.decode.ensure(bs, bs)
    fill_us = median_us(
        lambda: reg.fill_from(fb, raw_bs=bs, padded_bs=bs, raw_num_tokens=bs, padded_num_tokens=bs),
        iters,
        device,
    )
    stage_us = median_us(lambda: inputs.stage(fb), iters, device)
    no_copy_us = median_us(lambda: dataclasses.replace(fb), iters, device)
    # Whole decode steps, alternating paths so both see the same cache growth.
    step_us: dict[bool, list[float]] = {False: [], True: []}
    slot = 1 + bs * PROMPT_LEN
    for i in range(steps):
        no_copy = i % 2 == 1
        ex.toggles.eager_input_no_copy = no_copy
        batch = decode_batch(rows, PROMPT_LEN + 1 + i, first_slot=slot)
        slot += bs
        _sync(device)
        t0 = time.perf_counter_ns()
        ex.forward(batch)
        _sync(device)
        if i >= 2:  # the first step of each path warms up
            step_us[no_copy].append((time.perf_counter_ns() - t0) / 1e3)
    return (
        f"| {bs} | {fill_us:.1f} | {stage_us:.1f} | {no_copy_us:.1f} | "
        f"{stats.tensors_copied} | {stats.bytes_copied} | {stats.copy_calls} | "
        f"{statistics.median(step_us[False]):.0f} | {statistics.median(step_us[True]):.0f} |"
    )


if __name__ == "__main__":
    main()
