"""Random paged-attention cases shared by the backend tests (torch_paged, triton).

A case is a KV cache whose rows hold each request's prefix (and, past its length, stale
slots of other requests, which a backend must mask), plus this step's q/k/v and a
completed host ForwardBatch - exactly what a backend sees inside the executor after the
row table was written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attention.base import AttentionBackend, AttentionLayout
from executor.batch_prep import complete_batch, make_decode_batch, make_extend_batch
from executor.core.forward_batch import ForwardBatch, ForwardMode
from executor.kv_cache import KVPool, ReqToTokenPool


@dataclass
class Case:
    layout: AttentionLayout
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    fb: ForwardBatch  # completed host batch (seq_lens_cpu present, bounds set)
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hk, D]
    v: torch.Tensor


def make_layout(num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionLayout:
    return AttentionLayout(num_heads, num_kv_heads, head_dim, head_dim**-0.5)


def make_case(
    mode: ForwardMode,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    layout: AttentionLayout,
    *,
    seed: int = 0,
    max_context_len: int = 2048,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_reqs: int = 16,
    num_layers: int = 1,
) -> Case:
    """`prefix_lens[i]` cached tokens and `extend_lens[i]` new ones per request (DECODE: 1)."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    total = sum(seq_lens)
    kv_slots = 2 * total + 64
    pool = ReqToTokenPool(max_reqs, max_context_len, device)
    kv = KVPool(kv_slots, num_layers, layout.num_kv_heads, layout.head_dim, dtype, device)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).to(dtype))
    rows = (torch.randperm(max_reqs, generator=g)[:bs] + 1).tolist()
    slots = (torch.randperm(kv_slots, generator=g) + 1).tolist()
    table = torch.randint(1, kv_slots + 1, pool.req_to_token.shape, generator=g, dtype=torch.int32)
    table[0] = 0  # row 0 is the reserved padding row: all slot 0
    pool.req_to_token.copy_(table)  # stale slots everywhere else: only [:seq_len] is valid
    new_locs: list[list[int]] = []
    for i, row in enumerate(rows):
        mine, slots = slots[: seq_lens[i]], slots[seq_lens[i] :]
        pool.req_to_token[row, : seq_lens[i]] = torch.tensor(mine, dtype=torch.int32)
        new_locs.append(mine[prefix_lens[i] :])
    num_tokens = sum(extend_lens)
    if mode is ForwardMode.DECODE:
        assert all(e == 1 for e in extend_lens)
        fb = make_decode_batch(
            input_ids=[0] * bs,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            out_cache_loc=[locs[0] for locs in new_locs],
        )
    else:
        fb = make_extend_batch(
            input_ids=[[0] * e for e in extend_lens],
            req_pool_indices=rows,
            out_cache_loc=new_locs,
            prefix_lens=list(prefix_lens),
        )
    fb = complete_batch(fb, needs_cpu_seq_lens=True, max_context_len=max_context_len)
    fb = fb.to(device)
    q = torch.randn(num_tokens, layout.num_heads, layout.head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, layout.num_kv_heads, layout.head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, layout.num_kv_heads, layout.head_dim, generator=g).to(dtype)
    return Case(layout, pool, kv, fb, q.to(device), k.to(device), v.to(device))


def run(backend: AttentionBackend, case: Case, fb: ForwardBatch | None = None) -> torch.Tensor:
    """Eager metadata + forward for layer 0; the output [T, Hq, D]."""
    fb = case.fb if fb is None else fb
    md = backend.init_forward_metadata(fb)
    return backend.forward(case.q, case.k, case.v, 0, dataclasses.replace(fb, attn_metadata=md))


def random_lengths(
    g: torch.Generator, bs: int, mode: ForwardMode, max_len: int
) -> tuple[list[int], list[int]]:
    """Mixed (prefix, extend) lengths with 1 <= prefix + extend <= max_len."""
    prefix, extend = [], []
    for _ in range(bs):
        total = int(torch.randint(1, max_len + 1, (1,), generator=g))
        if mode is ForwardMode.DECODE:
            new = 1
        else:
            new = int(torch.randint(1, min(total, 300) + 1, (1,), generator=g))
        prefix.append(total - new)
        extend.append(new)
    return prefix, extend
