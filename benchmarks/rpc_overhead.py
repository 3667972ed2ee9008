"""What the gRPC hop costs: per-step DECODE time through Forward, ForwardStream and in-process,
and the codec's encode+decode time for a 64k-token EXTEND batch.

    .venv/bin/python benchmarks/rpc_overhead.py                  # tiny-random: overhead dominates
    .venv/bin/python benchmarks/rpc_overhead.py --model smollm2  # the default model

Decode batches are precomputed (fixed input tokens, advancing lengths and slots) so a stream
can pipeline them; unary and in-process calls run them one after another. The server runs in
this process on loopback (its device thread competes with the client for the same cores, as
a co-located scheduler would).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.config import ExecutorConfig
from executor.core.forward_batch import ForwardBatch
from executor.model_executor import ModelExecutor
from executor.service.codec import batch_from_proto, batch_to_proto
from executor.service.server import start_server
from executor.service.server_config import ServerConfig
from model_executor.v1 import executor_pb2 as pb

PROMPT_LEN = 16


def decode_batches(bs: int, steps: int, first_row: int) -> tuple[ForwardBatch, list[ForwardBatch]]:
    """A prefill of `bs` requests and `steps` DECODE batches that follow it."""
    rows = list(range(first_row, first_row + bs))
    span = PROMPT_LEN + steps
    slots = {r: list(range(1 + (r - 1) * span, 1 + r * span)) for r in rows}
    prefill = make_extend_batch(
        input_ids=[[7] * PROMPT_LEN] * bs,
        req_pool_indices=rows,
        out_cache_loc=[slots[r][:PROMPT_LEN] for r in rows],
    )
    decodes = [
        make_decode_batch(
            input_ids=[11] * bs,
            req_pool_indices=rows,
            seq_lens=[PROMPT_LEN + i + 1] * bs,
            out_cache_loc=[slots[r][PROMPT_LEN + i] for r in rows],
        )
        for i in range(steps)
    ]
    return prefill, decodes


def per_step_ms(run: Callable[[list[ForwardBatch]], None], decodes: list[ForwardBatch]) -> float:
    t0 = time.perf_counter()
    run(decodes)
    return (time.perf_counter() - t0) * 1e3 / len(decodes)


def codec_ms(tokens: int, repeats: int) -> tuple[float, float, int]:
    bs = 64
    per = tokens // bs
    fb = make_extend_batch(
        input_ids=[[5] * per] * bs,
        req_pool_indices=list(range(1, bs + 1)),
        out_cache_loc=[list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(bs)],
    )
    enc, dec = [], []
    wire = b""
    for _ in range(repeats):
        t0 = time.perf_counter()
        wire = pb.ForwardRequest(batch_id=1, batch=batch_to_proto(fb)).SerializeToString()
        t1 = time.perf_counter()
        msg = pb.ForwardRequest()
        msg.ParseFromString(wire)
        back = batch_from_proto(msg.batch)
        t2 = time.perf_counter()
        assert back.num_tokens == tokens
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return statistics.median(enc) * 1e3, statistics.median(dec) * 1e3, len(wire)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    args = ap.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    max_bs = max(sizes)
    cfg = ExecutorConfig(
        model=args.model,
        max_reqs=3 * max_bs,
        kv_slots=3 * max_bs * (PROMPT_LEN + args.steps) + 8,
        max_context_len=1024,
    )
    running = start_server(
        cfg, ServerConfig(port=0, metrics_port=0, log_level="warning"), block_until_ready=True
    )
    local = ModelExecutor(cfg)
    print(
        f"model={args.model} torch={torch.__version__} threads={torch.get_num_threads()} steps={args.steps}"
    )
    print(
        f"{'bs':>4} {'in-process ms':>14} {'Forward ms':>11} {'ForwardStream ms':>17} {'unary overhead':>15}"
    )
    with ExecutorClient(f"127.0.0.1:{running.port}") as client:
        for bs in sizes:
            # Three disjoint row ranges, one per path, so each path decodes real requests.
            p_local, d_local = decode_batches(bs, args.steps, 1)
            p_unary, d_unary = decode_batches(bs, args.steps, 1 + max_bs)
            p_stream, d_stream = decode_batches(bs, args.steps, 1 + 2 * max_bs)
            local.forward(p_local)
            client.forward(p_unary)
            client.forward(p_stream)
            t_local = per_step_ms(lambda bs_: [local.forward(b) for b in bs_], d_local)
            t_unary = per_step_ms(lambda bs_: [client.forward(b) for b in bs_], d_unary)
            t_stream = per_step_ms(lambda bs_: list(client.stream(bs_)), d_stream)
            print(
                f"{bs:>4} {t_local:>14.2f} {t_unary:>11.2f} {t_stream:>17.2f} {t_unary - t_local:>+14.2f}"
            )
    running.drain()
    enc, dec, size = codec_ms(65536, repeats=5)
    print(
        f"codec, 64k-token EXTEND (64 requests, {size / 2**20:.1f} MiB on the wire): encode {enc:.2f} ms, decode {dec:.2f} ms"
    )


if __name__ == "__main__":
    main()
