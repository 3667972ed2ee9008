"""A digest of the executor state a batch may change: the row table, the resident lengths and
the K/V of every slot a live row references. Equal digests before and after a refused or
failed batch prove it left nothing behind."""

from __future__ import annotations

import hashlib

import torch

from executor.model_executor import ModelExecutor


def state_digest(executor: ModelExecutor) -> str:
    """Call between steps (on an idle device thread)."""
    pool, kv = executor.req_to_token_pool, executor.kv_pool
    h = hashlib.sha256()
    h.update(pool.req_to_token.cpu().numpy().tobytes())
    h.update(pool.resident_lens.tobytes())
    slots = [
        pool.req_to_token[row, : int(length)].to(torch.int64)
        for row, length in enumerate(pool.resident_lens)
        if length > 0
    ]
    if slots:
        index = torch.cat(slots).to(kv.k.device)
        h.update(kv.k[:, index].float().cpu().numpy().tobytes())
        h.update(kv.v[:, index].float().cpu().numpy().tobytes())
    return h.hexdigest()
