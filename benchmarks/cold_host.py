"""How much slower the step's host work runs after the thread was away, on this machine.

    python benchmarks/cold_host.py                 # bs 1, 300 admissions per case
    python benchmarks/cold_host.py --bs 32 --repeats 500

A served step runs its admission after the thread waited (for the request, for the device):
whatever ran meanwhile on the machine (other processes, other tenants of a VM's host, the
model's forward on a CPU device) has taken the caches the admission's code and data were in.
This times `Step.admit` of one DECODE batch (tiny-random, in this process, one intra-op
thread; each admission undone, so every one is the same) back to back, and after each of
these gaps: a sleep (the thread blocked, as a served step's thread is between steps), a spin
on the clock (the thread busy but touching nothing new) and a read of a kept buffer of 16 MiB
(the caches taken by this process itself, as a CPU model's forward does). Medians in us.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from rpc_overhead import decode_batches
from served import cpu_description

from executor.config import ExecutorConfig
from executor.core.clock import StepClock
from executor.model_executor import ModelExecutor


def spin(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ex = ModelExecutor(
        ExecutorConfig(
            model="tiny-random", device="cpu", dtype="float32", graph_mode="none",
            max_reqs=args.bs + 1, max_batch_size=args.bs, kv_slots=64 * args.bs + 8,
            max_context_len=64, cache_dir=tempfile.mkdtemp(prefix="cold-host-"),
        )
    )  # fmt: skip
    prefill, decodes = decode_batches(args.bs, 1, 1)
    ex.forward(prefill)
    step, batch = ex.step, decodes[0]

    def admit_after(gap: Callable[[], object]) -> float:
        times = []
        for _ in range(args.repeats):
            gap()
            t0 = time.perf_counter_ns()
            sb = step.admit(batch, StepClock())
            times.append(time.perf_counter_ns() - t0)
            step.undo(sb)
        return statistics.median(times) / 1e3

    kept = torch.ones(4 << 20)  # 16 MiB
    model, simd = cpu_description()
    print(f"# {model} ({simd}); torch {torch.__version__}; bs {args.bs}, {args.repeats} each")
    hot = admit_after(lambda: None)
    print("\n| before each admission | admission, us | against back to back |")
    print("|---|---:|---:|")
    print(f"| nothing (back to back) | {hot:.0f} | 1.00x |")
    cases: list[tuple[str, Callable[[], object]]] = [
        (f"a sleep of {ms:g} ms", lambda ms=ms: time.sleep(ms / 1e3)) for ms in (0.1, 2, 10)
    ]
    cases += [(f"a spin of {ms:g} ms", lambda ms=ms: spin(ms / 1e3)) for ms in (2, 10)]
    cases.append(("a read of a kept 16 MiB buffer", kept.sum))
    for name, gap in cases:
        took = admit_after(gap)
        print(f"| {name} | {took:.0f} | {took / hot:.2f}x |")


if __name__ == "__main__":
    main()
