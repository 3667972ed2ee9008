"""Time the attention backends on one layer of paged attention.

DECODE batches (every request at the same context length) over a grid of batch sizes and
context lengths, plus one EXTEND shape (a chunk of new tokens after a cached prefix),
with SmolLM2-135M's head geometry (9 query heads, 3 KV heads, head_dim 64). Each row is
the median over `--repeats` steps of building the step's metadata and of one layer's
`forward` (which also stores the new tokens' K/V).

    python benchmarks/attention_backends.py                      # every backend available here
    python benchmarks/attention_backends.py --backends torch_paged --repeats 20
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import BACKENDS, AttentionBackend, AttentionLayout
from executor.batch_prep import complete_batch, make_decode_batch, make_extend_batch
from executor.core.forward_batch import ForwardBatch
from executor.kv_cache import KVPool, ReqToTokenPool
from ops.device_scope import device_scope

LAYOUT = AttentionLayout(num_heads=9, num_kv_heads=3, head_dim=64, scaling=64**-0.5)
BATCH_SIZES = (1, 4, 16, 64)
CONTEXTS = (128, 512, 1024, 4096)
EXTEND_SHAPE = (4, 512, 512)  # (requests, cached prefix, new tokens)


@dataclasses.dataclass
class Setup:
    pool: ReqToTokenPool
    kv: KVPool
    fb: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def make_setup(
    bs: int, prefix: int, new: int, device: torch.device, dtype: torch.dtype, decode: bool
) -> Setup:
    """`bs` requests, each with `prefix` cached tokens and `new` tokens this step."""
    g = torch.Generator().manual_seed(0)
    ctx = prefix + new
    slots = bs * ctx
    pool = ReqToTokenPool(bs, ctx, device)
    kv = KVPool(slots, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype, device)
    kv.k.normal_()
    kv.v.normal_()
    # Scattered slots, as after a while of serving: request i's tokens are not contiguous.
    perm = (torch.randperm(slots, generator=g) + 1).to(torch.int32).view(bs, ctx)
    pool.req_to_token[1:] = perm.to(device)
    rows = list(range(1, bs + 1))
    new_locs = perm[:, prefix:].tolist()
    if decode:
        fb = make_decode_batch(
            input_ids=[0] * bs,
            req_pool_indices=rows,
            seq_lens=[ctx] * bs,
            out_cache_loc=[locs[0] for locs in new_locs],
        )
    else:
        fb = make_extend_batch(
            input_ids=[[0] * new] * bs,
            req_pool_indices=rows,
            out_cache_loc=new_locs,
            prefix_lens=[prefix] * bs,
        )
    fb = complete_batch(fb, needs_cpu_seq_lens=True, max_context_len=ctx).to(device)
    tokens = bs * new
    q = torch.randn(tokens, LAYOUT.num_heads, LAYOUT.head_dim, device=device, dtype=dtype)
    k = torch.randn(tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    return Setup(pool, kv, fb, q, k, v)


def median_ms(fn: Callable[[], object], repeats: int, warmup: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_backend(
    cls: type[AttentionBackend], setup: Setup, repeats: int, warmup: int, device: torch.device
) -> tuple[float, float]:
    backend = cls(LAYOUT, setup.pool, setup.kv)
    md = backend.init_forward_metadata(setup.fb)
    fb = dataclasses.replace(setup.fb, attn_metadata=md)
    meta_ms = median_ms(lambda: backend.init_forward_metadata(setup.fb), repeats, warmup, device)
    fwd_ms = median_ms(
        lambda: backend.forward(setup.q, setup.k, setup.v, 0, fb), repeats, warmup, device
    )
    return meta_ms, fwd_ms


def available_backends(device: torch.device) -> list[str]:
    names = ["torch_native", "torch_paged"]
    if device.type == "cuda":
        try:
            BACKENDS["triton"].check_available(device)
            names.append("triton")
        except ValueError as exc:
            print(f"# triton skipped: {exc}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="*", help="default: every backend available here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--native-max-tokens",
        type=int,
        default=0,
        help="skip torch_native rows with bs * context above this (0: run them all)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    names = args.backends or available_backends(device)

    print(
        f"# torch {torch.__version__}, {device}, {args.dtype}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}; Hq={LAYOUT.num_heads} "
        f"Hk={LAYOUT.num_kv_heads} D={LAYOUT.head_dim}; median of {args.repeats}"
    )
    print("| mode | bs | context | new tokens | backend | metadata ms | forward ms | total ms |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    # The backends check that their device is current on the calling thread (CUDA kernels
    # launch on the current device): the whole run is inside its scope.
    with torch.inference_mode(), device_scope(device):
        shapes = [("DECODE", bs, ctx - 1, 1) for bs in BATCH_SIZES for ctx in CONTEXTS]
        shapes.append(("EXTEND", *EXTEND_SHAPE))
        for mode, bs, prefix, new in shapes:
            setup = make_setup(bs, prefix, new, device, dtype, decode=mode == "DECODE")
            for name in names:
                if (
                    name == "torch_native"
                    and args.native_max_tokens
                    and bs * (prefix + new) > args.native_max_tokens
                ):
                    continue
                meta, fwd = time_backend(BACKENDS[name], setup, args.repeats, args.warmup, device)
                print(
                    f"| {mode} | {bs} | {prefix + new} | {new} | {name} | {meta:.3f} | {fwd:.3f} "
                    f"| {meta + fwd:.3f} |",
                    flush=True,
                )
            del setup


if __name__ == "__main__":
    main()
