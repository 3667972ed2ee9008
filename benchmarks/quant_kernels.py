"""One quantized linear alone: the qmm kernel against torch's int4 kernel and a float32 linear.

For SmolLM2's shapes (QKV 576->960, gate-up 576->3072, the 49152 x 576 head) and each row count,
a random float32 weight is quantized to 4 bits in groups of 32 (`quantize_int4`, as the loader
does) and run as the layers the executor builds: `GroupQmmLinear` (`ops/qmm.py`, the CPU default
for GGUF weights), `Int4Linear` (torch's `_weight_int4pack_mm_for_cpu`) and `F.linear` on the
float32 weight. One thread (`torch.set_num_threads(1)`: the kernels' own speed, not how they
spread); each figure is the minimum of `--calls` calls after two warm-ups, in ms.

    python benchmarks/quant_kernels.py [--rows 1,32] [--calls 30] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from benchmarks.served import cpu_description
from executor.models.quant_formats import quantize_int4
from executor.models.quantized import GroupQmmLinear, Int4Linear
from ops import qmm

SHAPES = {
    "QKV 960 x 576": (960, 576),
    "gate-up 3072 x 576": (3072, 576),
    "head 49152 x 576": (49152, 576),
}


def _min_ms(run: Callable[[], object], calls: int) -> float:
    for _ in range(2):
        run()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def measure(
    shapes: dict[str, tuple[int, int]], rows: list[int], calls: int
) -> list[tuple[str, int, dict[str, float]]]:
    """(linear, rows, {layer: ms}) for every shape and row count; the qmm kernel loaded."""
    cpu = torch.device("cpu")
    out = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k) * 0.02
        quant = quantize_int4(w)
        layers = {
            "qmm": GroupQmmLinear(quant, None, device=cpu),
            "int4": Int4Linear(quant, None, device=cpu),
        }
        for r in rows:
            x = torch.randn(r, k)
            with torch.inference_mode():
                ms = {key: _min_ms(partial(m, x), calls) for key, m in layers.items()}
                ms["float32"] = _min_ms(partial(F.linear, x, w), calls)
            out.append((name, r, ms))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--cache-dir", default="", help="where the qmm kernel is built (a temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        kernel = qmm.load(Path(args.cache_dir or tmp))
    model, simd = cpu_description()
    print(f"# {model} ({simd}); torch {torch.__version__}; qmm isa {kernel.isa}; one thread")
    print("| linear | rows | qmm ms | torch int4 ms | float32 ms |")
    print("|---|---:|---:|---:|---:|")
    rows = [int(r) for r in args.rows.split(",")]
    for name, r, ms in measure(SHAPES, rows, args.calls):
        print(f"| {name} | {r} | {ms['qmm']:.3f} | {ms['int4']:.3f} | {ms['float32']:.3f} |")


if __name__ == "__main__":
    main()
