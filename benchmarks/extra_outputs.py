"""What the outputs beyond the next token cost, and that a step asking nothing pays nothing.

    python benchmarks/extra_outputs.py                                   # asks, in-process
    git worktree add /tmp/base c416a5c    # a tree from before the wider step
    python benchmarks/extra_outputs.py --baseline-tree /tmp/base          # plus: asking nothing
    python benchmarks/extra_outputs.py --model tiny-random-qwen3-moe      # + routed experts

1. Asks (in-process, `--model`, default tiny-random): a 256-token EXTEND of `--bs` requests
   with nothing asked, with prompt logprobs, with prompt logprobs and 5 alternatives, with 16
   scored ids, with the final hidden state (LAST) and with MEAN pooling (and, on an MoE
   model, with its routed experts); variants alternate; the medians of the step's `total`
   and `sample` phases.
2. Asking nothing (`--baseline-tree`): this tree's server and the baseline tree's, both
   serving `--model` (graph mode none) in their own processes, the same plain DECODE steps
   alternating call by call; the client's wall time and the step's `total`, medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from served import cpu_description, served

from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.client.grpc_client import ExecutorClient
from executor.config import ExecutorConfig
from executor.core.extras_types import HiddenAsk, Pooling, RowOutputs
from executor.core.forward_batch import ForwardBatch
from executor.model_executor import ModelExecutor

VARIANTS = ("none", "prompt_logprobs", "prompt_top5", "scores16", "hidden_last", "hidden_mean")
MOE_VARIANTS = (*VARIANTS, "routed_experts")  # an MoE model's (limits.routed_expert_layers)


def asks(variant: str, rows: list[int]) -> tuple[tuple[RowOutputs, ...], int]:
    make = {
        "none": None,
        "prompt_logprobs": lambda r: RowOutputs(row=r, prompt_logprobs=True),
        "prompt_top5": lambda r: RowOutputs(row=r, prompt_logprobs=True),
        "scores16": lambda r: RowOutputs(row=r, score_token_ids=tuple(range(16))),
        "hidden_last": lambda r: RowOutputs(row=r, hidden=HiddenAsk()),
        "hidden_mean": lambda r: RowOutputs(row=r, hidden=HiddenAsk(pooling=Pooling.MEAN)),
        "routed_experts": lambda r: RowOutputs(row=r, routed_experts=True),
    }[variant]
    if make is None:
        return (), 0
    return tuple(make(r) for r in rows), 5 if variant == "prompt_top5" else 0


def measure_asks(
    ex: ModelExecutor, bs: int, tokens: int, steps: int
) -> dict[str, tuple[list[float], list[float]]]:
    gen = torch.Generator().manual_seed(0)
    vocab = ex.limits.vocab_size
    rows = list(range(1, bs + 1))
    variants = MOE_VARIANTS if ex.limits.routed_expert_layers else VARIANTS
    out: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in variants}
    for step in range(steps + 1):
        order = variants if step % 2 == 0 else tuple(reversed(variants))
        for variant in order:
            prompts = [torch.randint(0, vocab, (tokens,), generator=gen).tolist() for _ in rows]
            fb = make_extend_batch(
                input_ids=prompts,
                req_pool_indices=rows,
                out_cache_loc=[
                    list(range(1 + i * tokens, 1 + (i + 1) * tokens)) for i in range(bs)
                ],
            )
            row_outputs, top = asks(variant, rows)
            fb = dataclasses.replace(
                fb,
                row_outputs=row_outputs,
                prompt_top_logprobs_num=top,
                released_req_pool_indices=torch.tensor(rows),
            )
            t = ex.forward(fb).stats.timings_ns
            if step:  # the first round warms up
                out[variant][0].append(t["total"] / 1e3)
                out[variant][1].append(t["sample"] / 1e3)
    return out


def plain_decode_steps(bs: int, context: int, steps: int) -> list[ForwardBatch]:
    """A prefill then `steps` DECODE steps of `bs` rows (token ids fixed, not fed back)."""
    rows = list(range(1, bs + 1))
    slot = 1
    locs = []
    for _ in rows:
        locs.append(list(range(slot, slot + context)))
        slot += context
    batches = [
        make_extend_batch(input_ids=[[5] * context] * bs, req_pool_indices=rows, out_cache_loc=locs)
    ]
    for i in range(steps):
        batches.append(
            make_decode_batch(
                input_ids=[7] * bs,
                req_pool_indices=rows,
                seq_lens=[context + i + 1] * bs,
                out_cache_loc=list(range(slot, slot + bs)),
            )
        )
        slot += bs
    release = torch.tensor(rows)
    batches.append(dataclasses.replace(make_idle_batch(), released_req_pool_indices=release))
    return batches


def compare_trees(
    new: ExecutorClient, old: ExecutorClient, bs: int, context: int, steps: int, rounds: int
) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {
        "new": {"wall": [], "total": []},
        "old": {"wall": [], "total": []},
    }
    for r in range(rounds):
        batches = plain_decode_steps(bs, context, steps)
        for i, fb in enumerate(batches):
            pair = [("new", new), ("old", old)]
            for name, client in pair if (r + i) % 2 == 0 else reversed(pair):
                t0 = time.perf_counter_ns()
                result = client.forward(fb)
                wall = (time.perf_counter_ns() - t0) / 1e3
                if 0 < i < len(batches) - 1 and r:  # decode steps of warm rounds
                    out[name]["wall"].append(wall)
                    out[name]["total"].append(result.stats.timings_ns["total"] / 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--bs", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--baseline-tree", type=Path, default=None)
    args = parser.parse_args()
    med = statistics.median
    machine, _ = cpu_description()
    print(f"{machine}; torch {torch.__version__}; model {args.model}")
    ex = ModelExecutor(
        ExecutorConfig(
            model=args.model,
            dtype="float32",
            graph_mode="none",
            max_reqs=args.bs,
            kv_slots=args.bs * args.tokens + 1,
            max_context_len=max(args.tokens, 256),
            max_tokens_per_batch=args.bs * args.tokens,
        )
    )
    result = measure_asks(ex, args.bs, args.tokens, args.steps)
    print(f"\n1. asks: EXTEND of {args.bs} x {args.tokens} tokens, us (medians), total / sample")
    print("| " + " | ".join(result) + " |")
    print("|" + "---:|" * len(result))
    print("| " + " | ".join(f"{med(t):.0f} / {med(s):.0f}" for t, s in result.values()) + " |")
    if args.baseline_tree is None:
        return
    flags = ["--model", args.model, "--dtype", "float32", "--graph-mode", "none", "--max-reqs", "8"]
    with served(flags) as new, served(flags, root=args.baseline_tree.resolve()) as old:
        for bs in (1, 8):
            r = compare_trees(new.client, old.client, bs, context=64, steps=args.steps, rounds=4)
            print(
                f"\n2. asking nothing, bs {bs}: DECODE wall / step total, us (medians): "
                f"this tree {med(r['new']['wall']):.0f} / {med(r['new']['total']):.0f}, "
                f"baseline {med(r['old']['wall']):.0f} / {med(r['old']['total']):.0f} "
                f"({len(r['new']['wall'])} steps each)"
            )


if __name__ == "__main__":
    main()
