"""Per-step latency of each path - eager, eager_no_copy, full_graph, piecewise - by size,
with a PNG plot.

    .venv/bin/python benchmarks/paths.py                      # SmolLM2, CPU
    .venv/bin/python benchmarks/paths.py --model tiny-random  # overheads only
    .venv/bin/python benchmarks/paths.py --device cuda        # where a GPU exists

DECODE is timed at each batch size on requests with a 128-token context; EXTEND as one
fresh request of each token count. One executor serves every path: the eager toggles and
`set_graph_mode` switch it between steps, exactly as the runtime toggles do. On a CPU the
graphs are `graph_backend=auto`'s: inductor-compiled layer halves (`compiled`), padded to
their buckets; on a GPU, CUDA graphs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor

CONTEXT = 128
DECODE_SIZES = [1, 2, 4, 8, 16, 32, 64]
EXTEND_SIZES = [16, 64, 256, 1024]
PATHS = {  # path -> (eager_input_no_copy, graph_mode)
    "eager": (False, "none"),
    "eager_no_copy": (True, "none"),
    "full_graph": (False, "decode"),
    "piecewise": (False, "extend"),
}


def set_path(ex: ModelExecutor, path: str) -> None:
    no_copy, mode = PATHS[path]
    ex.toggles.eager_input_no_copy = no_copy
    ex.control.set_graph_mode(mode)


def sync(ex: ModelExecutor) -> None:
    if ex.device.type == "cuda":
        torch.cuda.synchronize()


def time_decode(
    ex: ModelExecutor, bs: int, paths: list[str], reps: int, slot0: int
) -> dict[str, float]:
    rows = list(range(1, bs + 1))
    span = CONTEXT + (reps + 1) * len(paths) + 1
    locs = [list(range(slot0 + i * span, slot0 + (i + 1) * span)) for i in range(bs)]
    per_batch = max(1, ex.limits.max_tokens_per_batch // CONTEXT)
    for i in range(0, bs, per_batch):  # prefill within the per-batch token budget
        part = rows[i : i + per_batch]
        ex.forward(
            make_extend_batch(
                input_ids=[[7] * CONTEXT] * len(part),
                req_pool_indices=part,
                out_cache_loc=[loc[:CONTEXT] for loc in locs[i : i + per_batch]],
            )
        )
    seq, out = CONTEXT, {}
    for path in paths:
        set_path(ex, path)
        times = []
        for _ in range(reps + 1):  # the first step of each path is a warm-up
            batch = make_decode_batch(
                input_ids=[11] * bs,
                req_pool_indices=rows,
                seq_lens=[seq + 1] * bs,
                out_cache_loc=[loc[seq] for loc in locs],
            )
            sync(ex)
            t0 = time.perf_counter()
            res = ex.forward(batch)
            sync(ex)
            times.append(time.perf_counter() - t0)
            assert res.stats.path == path, (path, res.stats.path, res.stats.graph_fallback)
            seq += 1
        out[path] = statistics.median(times[1:]) * 1e3
    return out


def time_extend(
    ex: ModelExecutor, n: int, paths: list[str], reps: int, slot0: int
) -> dict[str, float]:
    out = {}
    for path in paths:
        set_path(ex, path)
        times = []
        for _ in range(reps + 1):
            batch = make_extend_batch(
                input_ids=[[5] * n],
                req_pool_indices=[1],
                out_cache_loc=[list(range(slot0, slot0 + n))],
            )
            sync(ex)
            t0 = time.perf_counter()
            res = ex.forward(batch)
            sync(ex)
            times.append(time.perf_counter() - t0)
            assert res.stats.path == path, (path, res.stats.path, res.stats.graph_fallback)
        out[path] = statistics.median(times[1:]) * 1e3
    return out


def plot(
    decode: dict[int, dict[str, float]], extend: dict[int, dict[str, float]], title: str, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in ("eager", "eager_no_copy", "full_graph"):
        ax1.plot(list(decode), [decode[s][name] for s in decode], marker="o", label=name)
    ax1.set(
        xscale="log", yscale="log", xlabel="DECODE batch size", ylabel="ms per step", title="DECODE"
    )
    for name in ("eager", "eager_no_copy", "piecewise"):
        ax2.plot(list(extend), [extend[s][name] for s in extend], marker="o", label=name)
    ax2.set(
        xscale="log", yscale="log", xlabel="EXTEND tokens", ylabel="ms per step", title="EXTEND"
    )
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--plot", default="docs/paths.png")
    args = ap.parse_args()
    max_bs, max_tokens = max(DECODE_SIZES), max(EXTEND_SIZES)
    cfg = ExecutorConfig(
        model=args.model,
        device=args.device,
        max_reqs=max_bs,
        max_context_len=2048,
        kv_slots=max_bs * (CONTEXT + 4 * (args.reps + 2)) + 2 * max_tokens + 8,
        max_tokens_per_batch=max_tokens,
        graph_mode="none",
        graph_batch_sizes=",".join(map(str, DECODE_SIZES)),
        piecewise_token_sizes=",".join(map(str, EXTEND_SIZES)),
    )
    ex = ModelExecutor(cfg)
    t0 = time.perf_counter()
    ex.control.set_graph_mode("both")  # capture once, up front
    capture_s = time.perf_counter() - t0
    title = f"{args.model} on {ex.device} ({ex.dtype}), torch {torch.__version__}, {torch.get_num_threads()} threads"
    print(title)
    print(
        f"graph capture: {capture_s:.1f} s ({len(DECODE_SIZES)} decode buckets, {len(EXTEND_SIZES)} piecewise buckets)"
    )
    slot = 1
    decode: dict[int, dict[str, float]] = {}
    print(f"\nDECODE, context {CONTEXT}: ms per step (median of {args.reps})")
    print(f"{'bs':>5} {'eager':>9} {'no_copy':>9} {'full_graph':>11}")
    for bs in DECODE_SIZES:
        decode[bs] = time_decode(ex, bs, ["eager", "eager_no_copy", "full_graph"], args.reps, slot)
        r = decode[bs]
        print(f"{bs:>5} {r['eager']:>9.2f} {r['eager_no_copy']:>9.2f} {r['full_graph']:>11.2f}")
    extend: dict[int, dict[str, float]] = {}
    print(f"\nEXTEND, one fresh request: ms per step (median of {args.reps})")
    print(f"{'tokens':>6} {'eager':>9} {'no_copy':>9} {'piecewise':>10}")
    extend_slot = cfg.kv_slots - max_tokens
    for n in EXTEND_SIZES:
        extend[n] = time_extend(
            ex, n, ["eager", "eager_no_copy", "piecewise"], args.reps, extend_slot
        )
        r = extend[n]
        print(f"{n:>6} {r['eager']:>9.2f} {r['eager_no_copy']:>9.2f} {r['piecewise']:>10.2f}")
    plot(decode, extend, title, Path(args.plot))
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
