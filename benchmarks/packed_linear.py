"""The linears of one SmolLM2 decode step: `F.linear` against oneDNN-packed weights.

One "step" is what a model step runs through its linears: 30 layers x (qkv 576->960,
o 576->576, gate_up 576->3072, down 1536->576) plus the tied head 576->49152, each layer with
its own weights (so they come from DRAM, as in a real step, not from cache). For each row count
(the batch size of a DECODE step) it prints the median ms of such a step for `F.linear` on the
plain weight (`linear_kernel=aten`) and for `executor.models.onednn_linear` on weights packed with each
batch hint (`linear_kernel=onednn` packs with `PACK_BATCH_HINT`).

    python benchmarks/packed_linear.py [--rows 1,8,32,64] [--hints 1,8,16,32,64] [--repeats 10]

Random float32 weights (the kernels do not look at values); torch's default threads.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from executor.models.onednn_linear import PACK_BATCH_HINT, PackedWeight, onednn_linear

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in] of one layer
HEAD = (49152, 576)


def _step_ms(run: Callable[[], None], repeats: int) -> float:
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--hints", default="1,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    hints = [int(h) for h in args.hints.split(",")]

    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES] for _ in range(LAYERS)]
    head = torch.randn(*HEAD, generator=g) * 0.05
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
        f"capability {torch.backends.cpu.get_cpu_capability()}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}"
    )
    header = ["rows", "F.linear"] + [
        f"onednn hint {h}" + (" (default)" if h == PACK_BATCH_HINT else "") for h in hints
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---:|" * len(header))
    for m in rows:
        xs = [torch.randn(m, k, generator=g) for _, k in SHAPES]
        xh = torch.randn(m, HEAD[1], generator=g)
        cells = [f"{_step_ms(partial(_plain_step, weights, head, xs, xh), args.repeats):.1f}"]
        for hint in hints:
            packed = [[PackedWeight(w, hint) for w in layer] for layer in weights]
            packed_head = PackedWeight(head, hint)
            ms = _step_ms(partial(_packed_step, packed, packed_head, xs, xh), args.repeats)
            cells.append(f"{ms:.1f}")
        print(f"| {m} | " + " | ".join(cells) + " |")


def _plain_step(
    weights: list[list[torch.Tensor]], head: torch.Tensor, xs: list[torch.Tensor], xh: torch.Tensor
) -> None:
    for layer in weights:
        for x, w in zip(xs, layer, strict=True):
            F.linear(x, w)
    F.linear(xh, head)


def _packed_step(
    packed: list[list[PackedWeight]], head: PackedWeight, xs: list[torch.Tensor], xh: torch.Tensor
) -> None:
    for layer in packed:
        for x, p in zip(xs, layer, strict=True):
            onednn_linear(x, p.key, None)
    onednn_linear(xh, head.key, None)


if __name__ == "__main__":
    main()
