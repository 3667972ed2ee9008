"""Tensor parallelism (issue 17): step time at tp 1/2/3 and the all-reduce share of it.

For each tp size it starts the group as `serve` does (`executor.service.tp_launch.start_group`:
rank 0 here, ranks 1..N-1 spawned), builds the model on every rank, then times on rank 0:
- `prefill`: one EXTEND step of `--batch` requests of `--prompt` tokens,
- `decode`: DECODE steps of `--batch` requests (median of `--steps`),
each with the all-reduce time of the step (`StepStats.allreduce_ns`: rank 0's clock, the
time it waited in `all_reduce`, which includes waiting for the slowest rank) and its share.
Greedy tokens of the timed decode are checked equal to tp 1's.

On a small CPU machine the ranks share the same cores, so tensor parallelism costs more
than it saves; this measures the plumbing's cost. On a GPU machine (NCCL) run it with
`--device cuda` (tp sizes up to the GPUs present).

With `--graph-mode both` the timed steps run on the full-graph and piecewise paths (one
bucket each, asserted) and their tokens are checked against tp 1's on the same paths.

    python benchmarks/tp.py [--model smollm2] [--tp 1,2,3] [--batch 8] [--prompt 64]
        [--steps 16] [--device cpu] [--threads 0] [--graph-mode none|both]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# Run from a checkout: import this tree's packages (and its generated stubs).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.service.tp_launch import start_group


def run(config: ExecutorConfig, batch: int, prompt: int, steps: int) -> dict[str, object]:
    group = start_group(config, {}) if config.tp_size > 1 else None
    ex = ModelExecutor(config, comm=group.comm if group else None)
    try:
        ex.warmup()
        rows = list(range(1, batch + 1))
        ids = [[(7 * r + i) % 500 + 3 for i in range(prompt)] for r in rows]
        slots = [list(range(1 + r * 1024, 1 + r * 1024 + prompt)) for r in range(batch)]
        t0 = time.perf_counter_ns()
        out = ex.forward(
            make_extend_batch(input_ids=ids, req_pool_indices=rows, out_cache_loc=slots)
        )
        prefill_ns = time.perf_counter_ns() - t0
        prefill_ar = out.stats.allreduce_ns
        prefill_path = decode_path = out.stats.path
        tokens = out.next_token_ids.tolist()
        decode_ns, decode_ar, generated = [], [], [tokens]
        for step in range(steps):
            seq = prompt + step + 1
            fb = make_decode_batch(
                input_ids=tokens,
                req_pool_indices=rows,
                seq_lens=[seq] * batch,
                out_cache_loc=[1 + r * 1024 + seq - 1 for r in range(batch)],
            )
            t0 = time.perf_counter_ns()
            out = ex.forward(fb)
            decode_ns.append(time.perf_counter_ns() - t0)
            decode_ar.append(out.stats.allreduce_ns)
            tokens = out.next_token_ids.tolist()
            generated.append(tokens)
            decode_path = out.stats.path
        if config.graph_mode == "both":  # the timed steps ran on the graph paths
            assert prefill_path == "piecewise" and decode_path == "full_graph", (
                prefill_path,
                decode_path,
            )
        return {
            "prefill_ms": prefill_ns / 1e6,
            "prefill_ar_ms": prefill_ar / 1e6,
            "decode_ms": statistics.median(decode_ns) / 1e6,
            "decode_ar_ms": statistics.median(decode_ar) / 1e6,
            "tokens": generated,
        }
    finally:
        ex.close()
        if group is not None:
            group.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tp", default="1,2,3")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--graph-mode",
        default="none",
        help="none | both: with both, the decode steps replay a full graph of --batch and the "
        "prefill piecewise graphs of --batch x --prompt tokens (stand-in backend on CPU)",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank; 0 = torch's default"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the spawned ranks read it at start
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, load average {os.getloadavg()}"
    )
    print(
        f"model {args.model}, batch {args.batch}, prompt {args.prompt}, decode steps "
        f"{args.steps}, device {args.device}, graph mode {args.graph_mode}"
    )
    print(
        "| tp | prefill ms | all-reduce ms (share) | decode step ms (median) | all-reduce ms (share) | tokens = tp 1 |"
    )
    print("|---|---|---|---|---|---|")
    reference = None
    for tp in (int(t) for t in args.tp.split(",")):
        config = ExecutorConfig(
            model=args.model,
            device=args.device,
            max_reqs=args.batch + 1,
            kv_slots=(args.batch + 1) * 1024,
            max_context_len=1024,
            graph_mode=args.graph_mode,
            graph_backend="standin" if args.device == "cpu" else "auto",
            graph_batch_sizes=str(args.batch),
            piecewise_token_sizes=str(args.batch * args.prompt),
            max_tokens_per_batch=max(8192, args.batch * args.prompt),
            tp_size=tp,
        )
        r = run(config, args.batch, args.prompt, args.steps)
        reference = reference or r["tokens"]
        p, pa, d, da = (
            float(r[k]) for k in ("prefill_ms", "prefill_ar_ms", "decode_ms", "decode_ar_ms")
        )  # type: ignore[arg-type]
        print(
            f"| {tp} | {p:.1f} | {pa:.1f} ({pa / p:.0%}) | {d:.1f} | {da:.1f} ({da / d:.0%}) | {r['tokens'] == reference} |",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
