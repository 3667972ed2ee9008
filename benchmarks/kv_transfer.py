"""KV data plane throughput on loopback: export, import and push, in MB/s and descriptors per MB.

Two executors in their own processes (`served.py`). A request of `--tokens` tokens is
prefilled on A; then, `--repeats` times each (after one round not counted): ExportKV of its
slots into this process, ImportKV of those bytes into B (a free row and slots, released
after), and PushKV from A straight into B. Slots are allocated contiguously (one run on the
wire) or fragmented into pages of `--page` slots in shuffled order, every other page held by
someone else (one run per page): what a paged allocator sends after some churn. MB/s counts
K/V data bytes (every layer and rank); descriptors per MB are the runs the transfer names
plus the chunks it is cut into.

    python benchmarks/kv_transfer.py [--model smollm2] [--tokens 1024] [--repeats 3] [--page 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from executor.batch_prep import make_extend_batch, make_idle_batch
from executor.client.grpc_client import ExecutorClient
from executor.client.kv_client import PushSpec
from executor.kv_transfer.layout import coalesce

MB = 1e6


@dataclass
class TransferFigures:
    layout: str  # contiguous | pages of N
    tokens: int
    mbytes: float  # K/V data of one transfer
    runs: int
    chunks: int
    export_mb_s: list[float]
    import_mb_s: list[float]
    push_mb_s: list[float]

    @property
    def descriptors_per_mb(self) -> float:
        return (self.runs + self.chunks) / self.mbytes


def allocate(n: int, first: int, page: int, seed: int) -> list[int]:
    """`n` slots from `first`: contiguous (page 0), or pages of `page` in shuffled order with
    a page between any two (held by other requests: no two pages coalesce)."""
    if page <= 0:
        return list(range(first, first + n))
    starts = range(first, first + 2 * n, 2 * page)
    pages = [list(range(p, p + page)) for p in starts]
    random.Random(seed).shuffle(pages)
    return [s for p in pages for s in p][:n]


def _release(client: ExecutorClient, row: int) -> None:
    client.forward(
        dataclasses.replace(
            make_idle_batch(), released_req_pool_indices=torch.tensor([row], dtype=torch.int64)
        )
    )


def _prefill(client: ExecutorClient, tokens: int, row: int, slots: list[int]) -> None:
    """Prefill `tokens` tokens into `row` at `slots`, in chunks of the batch token budget."""
    budget = client.info().info.limits.max_tokens_per_batch
    ids = [(7 * i + 3) % 400 + 1 for i in range(tokens)]
    for start in range(0, tokens, budget):
        end = min(tokens, start + budget)
        client.forward(
            make_extend_batch(
                input_ids=[ids[start:end]],
                req_pool_indices=[row],
                out_cache_loc=[slots[start:end]],
                prefix_lens=[start],
            )
        )


def measure(
    a: ExecutorClient, b: ExecutorClient, b_address: str, *, tokens: int, repeats: int, page: int
) -> TransferFigures:
    """One request of `tokens` tokens on A; `repeats` exports, imports and pushes of it."""
    src = allocate(tokens, 1, page, seed=1)
    dst = allocate(tokens, 1, page, seed=2)
    _prefill(a, tokens, 1, src)
    export_s, import_s, push_s = [], [], []
    exported = None
    for i in range(repeats + 1):  # the first round warms both sides up and is not counted
        t0 = time.perf_counter()
        exported = a.kv.export(src)
        export_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b.kv.import_(exported, 1, dst)
        import_s.append(time.perf_counter() - t0)
        _release(b, 1)
        t0 = time.perf_counter()
        [result] = a.kv.push([PushSpec(src, b_address, 1, dst)])
        push_s.append(time.perf_counter() - t0)
        if not result.ok:
            raise RuntimeError(f"push failed: {result.code}: {result.message}")
        _release(b, 1)
        if i == 0:
            export_s, import_s, push_s = [], [], []
    _release(a, 1)
    assert exported is not None
    mbytes = exported.nbytes / MB
    return TransferFigures(
        layout="contiguous" if page <= 0 else f"pages of {page}",
        tokens=tokens,
        mbytes=mbytes,
        runs=int(coalesce(torch.tensor(src).numpy()).shape[0]),
        chunks=len(exported.chunks),
        export_mb_s=[mbytes / s for s in export_s],
        import_mb_s=[mbytes / s for s in import_s],
        push_mb_s=[mbytes / s for s in push_s],
    )


def table(results: list[TransferFigures]) -> str:
    lines = [
        "| slots | tokens | MB | runs | chunks | descriptors/MB | export MB/s | import MB/s | push MB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        med = statistics.median
        lines.append(
            f"| {r.layout} | {r.tokens} | {r.mbytes:.1f} | {r.runs} | {r.chunks} | "
            f"{r.descriptors_per_mb:.2f} | {med(r.export_mb_s):.0f} | {med(r.import_mb_s):.0f} | "
            f"{med(r.push_mb_s):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    from benchmarks.served import cpu_description, served

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page", type=int, default=16)
    args = parser.parse_args()
    flags = ["--model", args.model, "--dtype", args.dtype, "--max-reqs", "4"]
    flags += ["--kv-slots", str(2 * args.tokens + 2 * args.page + 1), "--graph-mode", "none"]
    flags += ["--max-context-len", str(args.tokens + 1)]
    model, simd = cpu_description()
    flags += ["--kv-transfer"]
    with served(flags) as b, served([*flags, "--kv-peers", f"127.0.0.1:{b.port}"]) as a:
        layout = a.client.info().info.kv_layout
        assert layout is not None
        print(f"# {model} ({simd}); {args.model} {args.dtype}, {layout.bytes_per_slot} B/slot")
        results = [
            measure(
                a.client,
                b.client,
                f"127.0.0.1:{b.port}",
                tokens=args.tokens,
                repeats=args.repeats,
                page=page,
            )
            for page in (0, args.page)
        ]
    print(table(results))


if __name__ == "__main__":
    main()
