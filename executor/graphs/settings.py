"""`GraphSettings`: the bucket lists of the two graph runners, from the config and the limits.

The lists themselves come from :mod:`executor.core.buckets`; this module only picks the
ladder (GPU or CPU), applies the config's explicit lists and caps, and never lets a bucket
exceed what a batch may carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.config import BACKGROUND_DECODE_BUCKETS, ExecutorConfig, background_graph_mode
from executor.core.buckets import (
    CPU_GRAPH_MAX_BS,
    CPU_PIECEWISE_MAX_TOKENS,
    cpu_decode_buckets,
    cpu_piecewise_buckets,
    default_decode_buckets,
    default_piecewise_buckets,
    parse_bucket_list,
)
from executor.core.limits import BatchLimits

# The default caps on a GPU (sglang's defaults); the CPU caps live with the CPU ladders.
GPU_GRAPH_MAX_BS = 160
GPU_PIECEWISE_MAX_TOKENS = 2048


@dataclass(frozen=True)
class GraphSettings:
    """Bucket lists of the two graph runners."""

    decode_buckets: list[int]
    piecewise_buckets: list[int]
    max_bs: int  # the executor's max batch size (piecewise batches carry up to this many)


def graph_settings(
    config: ExecutorConfig, limits: BatchLimits, device: torch.device | None = None
) -> GraphSettings:
    """Bucket lists from config (explicit lists win), never beyond the executor's limits;
    the defaults are the CPU ladders on a CPU device."""
    cpu = device is not None and device.type == "cpu"
    max_bs = config.graph_max_bs or min(
        limits.max_batch_size, CPU_GRAPH_MAX_BS if cpu else GPU_GRAPH_MAX_BS
    )
    decode_list = config.graph_batch_sizes
    if not decode_list and device is not None and background_graph_mode(config, device):
        decode_list = BACKGROUND_DECODE_BUCKETS  # the bucket that pays, compiled while serving
    decode = parse_bucket_list(decode_list) or (
        cpu_decode_buckets(max_bs) if cpu else default_decode_buckets(max_bs)
    )
    max_tokens = config.piecewise_max_tokens or min(
        limits.max_tokens_per_batch,
        CPU_PIECEWISE_MAX_TOKENS if cpu else GPU_PIECEWISE_MAX_TOKENS,
    )
    piecewise = parse_bucket_list(config.piecewise_token_sizes) or (
        cpu_piecewise_buckets(max_tokens) if cpu else default_piecewise_buckets(max_tokens)
    )
    decode = [b for b in decode if b <= limits.max_batch_size] or [limits.max_batch_size]
    piecewise = [t for t in piecewise if t <= limits.max_tokens_per_batch] or [
        limits.max_tokens_per_batch
    ]
    return GraphSettings(
        decode_buckets=decode, piecewise_buckets=piecewise, max_bs=limits.max_batch_size
    )
