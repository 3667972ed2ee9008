"""What the KV slot-owner map and the retry fingerprint (issue 12) add per step.

Times `ReqToTokenPool.write_batch` + `undo` with the owner map (kv_slots set) and without it
(kv_slots=0, the table alone), for DECODE batches of 1..256 requests whose rows each hold
`--context` tokens, and one EXTEND batch of `--extend-tokens` new tokens; median of
`--iters` write+undo pairs, on the host (CPU), where the owner map lives on every device.
Then the retry memory's `fingerprint` of the same batches' wire messages (on the RPC thread).

    python benchmarks/slot_owners.py [--context 2048] [--extend-tokens 8192] [--iters 300]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from executor.batch_prep import complete_batch, make_decode_batch, make_extend_batch
from executor.core.forward_batch import ForwardBatch
from executor.kv_cache import ReqToTokenPool
from executor.service.applied_batches import fingerprint
from executor.service.codec import batch_to_proto


def _pool(owners: bool, max_reqs: int, context: int, kv_slots: int) -> ReqToTokenPool:
    return ReqToTokenPool(
        max_reqs, context + 1, torch.device("cpu"), kv_slots=kv_slots if owners else 0
    )


def _fill(pool: ReqToTokenPool, rows: int, context: int) -> None:
    """Each row 1..rows holds `context` tokens in slots of its own."""
    for r in range(1, rows + 1):
        base = 1 + (r - 1) * (context + 1)
        batch = make_extend_batch(
            input_ids=[[1] * context],
            req_pool_indices=[r],
            out_cache_loc=[list(range(base, base + context))],
        )
        pool.write_batch(
            complete_batch(batch, needs_cpu_seq_lens=True, max_context_len=context + 1)
        )


def _time(pool: ReqToTokenPool, batch: ForwardBatch, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        write = pool.write_batch(batch)
        pool.undo(write)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--extend-tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = args.context
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}"
    )
    print(f"# context {ctx}, iters {args.iters}")
    print("| batch | table only us | with owner map us | added us |")
    print("|---|---:|---:|---:|")
    for bs in (1, 16, 64, 256):
        kv_slots = bs * (ctx + 1) + args.extend_tokens + 1
        decode = make_decode_batch(
            input_ids=[1] * bs,
            req_pool_indices=list(range(1, bs + 1)),
            seq_lens=[ctx + 1] * bs,
            out_cache_loc=[r * (ctx + 1) for r in range(1, bs + 1)],
        )
        decode = complete_batch(decode, needs_cpu_seq_lens=True, max_context_len=ctx + 1)
        us = []
        for owners in (False, True):
            pool = _pool(owners, bs, ctx, kv_slots)
            _fill(pool, bs, ctx)
            us.append(_time(pool, decode, args.iters))
        print(f"| DECODE bs {bs} | {us[0]:.1f} | {us[1]:.1f} | {us[1] - us[0]:.1f} |")
    n = args.extend_tokens
    extend = make_extend_batch(
        input_ids=[[1] * n], req_pool_indices=[1], out_cache_loc=[list(range(1, n + 1))]
    )
    extend = complete_batch(extend, needs_cpu_seq_lens=True, max_context_len=n)
    us = []
    for owners in (False, True):
        pool = ReqToTokenPool(1, n, torch.device("cpu"), kv_slots=n if owners else 0)
        us.append(_time(pool, extend, args.iters))
    print(f"| EXTEND {n} tokens | {us[0]:.1f} | {us[1]:.1f} | {us[1] - us[0]:.1f} |")
    print()
    print("| wire batch | fingerprint us |")
    print("|---|---:|")
    for name, batch in (("DECODE bs 256", decode), (f"EXTEND {n} tokens", extend)):
        msg = batch_to_proto(batch)
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter_ns()
            fingerprint(msg)
            times.append(time.perf_counter_ns() - t0)
        print(f"| {name} | {statistics.median(times) / 1000:.1f} |")


if __name__ == "__main__":
    main()
