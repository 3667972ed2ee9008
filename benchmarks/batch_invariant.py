"""What `batch_invariant` costs, and that it holds, on SmolLM2-135M: DECODE step time at bs 1
and 32 with the setting off and on, side by side in one process, and whether request 1's
logits at bs 1 and inside the bs-32 batch (last, beside longer and shorter requests) are
bitwise equal; with `--graph-backends`, also the setting on with DECODE graphs of each
backend (buckets 1 and 32), whose logits must equal the eager ones bit for bit.

    python benchmarks/batch_invariant.py                       # SmolLM2, float32 and bfloat16
    python benchmarks/batch_invariant.py --model tiny-random --steps 10
    python benchmarks/batch_invariant.py --graph-backends compiled_step,compiled

Each executor runs torch_paged attention (what the setting runs on) with the linear kernel as
given, eagerly unless it is the graph row; prefills 32 requests of up to `--context` tokens
one at a time, then times `--steps` DECODE steps (after 3 warm-up steps) at each batch size.
Prints one table; docs/performance.md has the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

import torch  # noqa: E402

from executor.batch_prep import make_decode_batch, make_extend_batch  # noqa: E402
from executor.config import ExecutorConfig  # noqa: E402
from executor.model_executor import ModelExecutor  # noqa: E402

ROWS = 32


def _executor(
    model: str,
    dtype: str,
    kernel: str,
    invariant: bool,
    context: int,
    steps: int,
    graph_backend: str | None = None,
) -> ModelExecutor:
    """Eager, or with `graph_backend` DECODE graphs at bs 1 and ROWS."""
    span = context + 2 * (steps + 4)
    return ModelExecutor(
        ExecutorConfig(
            model=model,
            device="cpu",
            dtype=dtype,
            max_reqs=ROWS + 1,
            kv_slots=(ROWS + 1) * span + 1,
            max_context_len=span,
            graph_mode="decode" if graph_backend else "none",
            graph_backend=graph_backend or "auto",
            graph_batch_sizes=f"1,{ROWS}",
            linear_kernel=kernel,
            attention_backend="torch_paged",
            batch_invariant=invariant,
        )
    )


def _measure(ex: ModelExecutor, context: int, steps: int) -> dict[str, object]:
    span = ex.limits.max_context_len
    rows = list(range(1, ROWS + 1))
    vocab = ex.limits.vocab_size
    lengths = {r: context - (13 * r) % 29 for r in rows}  # mixed: the batch's bound moves
    prompts = [[(17 * r + 5 * j) % (vocab - 10) + 10 for j in range(lengths[r])] for r in rows]
    for r, p in zip(rows, prompts, strict=True):  # one prefill per request: no batch effect
        ex.forward(
            make_extend_batch(
                input_ids=[p],
                req_pool_indices=[r],
                out_cache_loc=[[r * span + j for j in range(lengths[r])]],
            )
        )
    lens = dict(lengths)
    result: dict[str, object] = {}
    for bs in (1, ROWS):
        members = rows[:bs][::-1]  # request 1 last: another place in every GEMM tile
        times, first = [], None
        for step in range(steps + 3):
            for r in members:
                lens[r] += 1
            batch = make_decode_batch(
                input_ids=[7] * bs,
                req_pool_indices=members,
                seq_lens=[lens[r] for r in members],
                out_cache_loc=[r * span + lens[r] - 1 for r in members],
            )
            t0 = time.perf_counter()
            out = ex.forward(batch, return_logits=True)
            times.append((time.perf_counter() - t0) * 1e3)
            result[f"bs {bs} path"] = out.stats.path
            if step == 0:
                assert out.logits is not None
                first = out.logits[-1].clone()
        result[f"bs {bs} ms"] = statistics.median(times[3:])
        result[f"bs {bs} row 0"] = first
        lens = dict(lengths)  # the next batch size starts every row from the same length
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--configs",
        default="float32:onednn,float32:aten,bfloat16:aten",
        help="dtype:linear_kernel pairs",
    )
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--graph-backends",
        default="",
        help="comma-separated standin|compiled|compiled_step: also time the setting on with "
        "DECODE graphs of each",
    )
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}")
    print(
        "| dtype | linear kernel | batch_invariant | path (bs 1, bs 32; graph backend) | bs 1 ms "
        "| bs 32 ms "
        "| request 1's logits at bs 1 == at bs 32 | == the eager row's |"
    )
    print("|---|---|---|---|---:|---:|---|---|")
    runs: list[tuple[bool, str | None]] = [(False, None), (True, None)]
    runs += [(True, b) for b in args.graph_backends.split(",") if b]
    for pair in args.configs.split(","):
        dtype, kernel = pair.split(":")
        eager: dict[str, object] = {}
        for invariant, backend in runs:
            ex = _executor(args.model, dtype, kernel, invariant, args.context, args.steps, backend)
            r = _measure(ex, args.context, args.steps)
            if invariant and backend is None:
                eager = r
            compared = f"{_same(eager, r, 'bs 1 row 0')}, {_same(eager, r, f'bs {ROWS} row 0')}"
            print(
                f"| {dtype} | {kernel} | {'on' if invariant else 'off'} "
                f"| {r['bs 1 path']}, {r[f'bs {ROWS} path']}{f' ({backend})' if backend else ''} "
                f"| {r['bs 1 ms']:.2f} "
                f"| {r[f'bs {ROWS} ms']:.2f} | {_equal(r['bs 1 row 0'], r[f'bs {ROWS} row 0'])} "
                f"| {compared if backend else '-'} |",
                flush=True,
            )
            del ex


def _equal(a: object, b: object) -> str:
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return "yes" if torch.equal(a, b) else f"no (max diff {(a - b).abs().max().item():.3g})"


def _same(eager: dict[str, object], r: dict[str, object], key: str) -> str:
    return _equal(eager[key], r[key]) if key in eager else "-"


if __name__ == "__main__":
    main()
