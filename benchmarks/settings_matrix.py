"""The whole settings matrix (issue 36): attention backend x graph mode x graph backend x dtype
x quantization at tp 1 (in this process; tiny-random, a tiny GGUF for quantization=gguf), and
the combinations that apply at tp 2 (spawned ranks). Each either serves a greedy generation
or is refused at start-up; a failure after "ready" is printed and counted.

    PYTHONPATH=.:proto .venv/bin/python benchmarks/settings_matrix.py [--graph-backends ...]

The compiling graph backends (`compiled`, `compiled_step`, and `auto` on a CPU) compile per
combination: the whole product takes hours on 2 cores; `--graph-backends` narrows it. The
suite runs a covering subset (`tests/test_settings_matrix.py`).
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time
from pathlib import Path

from tests.settings_matrix import AXES, Outcome, product, try_combination, try_combination_tp

# At tp 2: float weights only, no whole-step graphs (refused at start-up, as listed).
TP_AXES = {
    "attention_backend": ("auto", "torch_native"),
    "graph_mode": ("auto", "none", "extend", "both"),
    "graph_backend": ("auto", "standin", "compiled", "compiled_step"),
    "dtype": ("auto", "float32"),
    "quantization": ("auto", "none", "int8"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--graph-backends", default=",".join(AXES["graph_backend"]))
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes to run")
    ap.add_argument("--cache-dir", default="", help="'' = a fresh temporary directory")
    args = ap.parse_args()
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="settings-matrix-"))
    backends = tuple(args.graph_backends.split(","))
    print(f"cache dir {cache}; load {os.getloadavg()}", flush=True)
    counts: collections.Counter[str] = collections.Counter()
    failed: list[Outcome] = []
    t0 = time.perf_counter()
    runs: list[tuple[int, dict[str, str]]] = []
    if "1" in args.tp.split(","):
        runs += [(1, c) for c in product({**AXES, "graph_backend": backends})]
    if "2" in args.tp.split(","):
        tp_backends = tuple(b for b in TP_AXES["graph_backend"] if b in backends)
        runs += [(2, c) for c in product({**TP_AXES, "graph_backend": tp_backends})]
    for tp, combination in runs:
        outcome = (
            try_combination(combination, cache)
            if tp == 1
            else try_combination_tp(combination, cache, tp)
        )
        counts[f"tp{tp} {outcome.kind}"] += 1
        if outcome.kind == "failed":
            failed.append(outcome)
        print(str(outcome).splitlines()[0][:240], flush=True)
    print(f"\n{dict(counts)} in {time.perf_counter() - t0:.0f} s; load {os.getloadavg()}")
    for outcome in failed:
        print(f"\nFAILED {outcome}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
