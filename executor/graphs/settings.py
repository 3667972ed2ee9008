"""The graph settings: what `graph_mode` and `graph_backend` resolve to (`auto`: by device and
tensor parallelism; the mode a CPU server captures in the background), and `GraphSettings`,
the bucket lists of the two graph runners, from the config and the limits.

The lists themselves come from :mod:`executor.core.buckets`; this module only picks the
ladder (GPU or CPU), applies the config's explicit lists and caps, and never lets a bucket
exceed what a batch may carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.config import ExecutorConfig
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
from executor.core.names import EAGER_KERNELS, INDUCTOR


def resolve_graph_mode(
    config: ExecutorConfig, device: torch.device, capture_refusal: str | None = None
) -> str:
    """The start-up mode: `auto` is `both` on CUDA (graphs pay off there) and `none` on CPU,
    where a server then captures `background_graph_mode` while it serves; `none` wherever the
    attention backend cannot be captured (`capture_refusal`: its reason), and under
    batch_invariant, whose graphs run the eager kernels (`graph_compiler`): on its CPU they
    save no kernel time, so they are captured only where graph_mode asks for them."""
    if config.graph_mode != "auto":
        return config.graph_mode
    if capture_refusal is not None or config.batch_invariant:
        return "none"
    return "both" if device.type == "cuda" else "none"


def check_graph_mode(
    config: ExecutorConfig, attention_backend: str, capture_refusal: str | None
) -> None:
    """Refuse at start-up (ValueError naming both settings) a configured graph mode with
    DECODE graphs that the attention backend cannot be captured in."""
    if config.graph_mode in ("decode", "both") and capture_refusal is not None:
        raise ValueError(
            f"graph_mode={config.graph_mode} and attention_backend={attention_backend} do not "
            f"go together: DECODE graphs cannot capture this backend ({capture_refusal}); use "
            "graph_mode=extend, none or auto, or another attention_backend"
        )


def background_graph_mode(
    config: ExecutorConfig, device: torch.device, capture_refusal: str | None = None
) -> str | None:
    """`graph_mode=auto` on a CPU: the mode a server captures in the background once it
    serves (eager until then), or None. Whole-step compiled DECODE graphs (`compiled_step`)
    for batch size 1 only: the one path measured faster than eager on a CPU (one inductor
    graph a step instead of some forty ops a layer); a larger batch is bound by its matmuls,
    where the layer-half graphs (`compiled`) measured no faster than eager. Each graph takes
    minutes to compile cold (docs/performance.md), hence in the background, in a compile
    worker; `cache_dir` keeps the compiled code for the next start. Not under tensor
    parallelism (ranks capture in step at start-up), nor with another graph backend
    configured, nor with an attention backend that cannot be captured (`capture_refusal`),
    nor under batch_invariant (its graphs run the eager kernels: `graph_compiler`)."""
    if config.graph_mode != "auto" or device.type != "cpu" or config.tp_size > 1:
        return None
    if config.batch_invariant:
        return None
    if capture_refusal is not None or resolve_graph_backend(config, device) != "compiled_step":
        return None
    return "decode"


# The DECODE bucket a CPU server compiles in the background (`background_graph_mode`).
BACKGROUND_DECODE_BUCKETS = "1"


def resolve_graph_backend(config: ExecutorConfig, device: torch.device) -> str:
    """`auto` is `cuda` on CUDA; on a CPU `compiled_step` where a server compiles decode graphs
    in the background (`graph_mode=auto`, one rank), else `compiled`. CUDA graphs need a CUDA
    device."""
    if config.graph_backend == "auto":
        if device.type == "cuda":
            return "cuda"
        background = config.graph_mode == "auto" and config.tp_size == 1
        return "compiled_step" if background else "compiled"
    if config.graph_backend == "cuda" and device.type != "cuda":
        raise ValueError(f"graph_backend 'cuda' needs a CUDA device, got device {device}")
    return config.graph_backend


# The default caps on a GPU (sglang's defaults); the CPU caps live with the CPU ladders.
GPU_GRAPH_MAX_BS = 160
GPU_PIECEWISE_MAX_TOKENS = 2048


def graph_compiler(config: ExecutorConfig) -> str:
    """The torch.compile backend of the compiled graph backends: inductor, or under
    batch_invariant dynamo's `eager` backend, whose graphs call the eager path's own torch ops
    (inductor's generated kernels fuse the norms and activations and reduce in another order,
    which changes a row's logits in their last bits)."""
    return EAGER_KERNELS if config.batch_invariant else INDUCTOR


@dataclass(frozen=True)
class GraphSettings:
    """Bucket lists of the two graph runners, and what compiles their graphs."""

    decode_buckets: list[int]
    piecewise_buckets: list[int]
    max_bs: int  # the executor's max batch size (piecewise batches carry up to this many)
    compiler: str = INDUCTOR  # `graph_compiler`


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
        decode_buckets=decode,
        piecewise_buckets=piecewise,
        max_bs=limits.max_batch_size,
        compiler=graph_compiler(config),
    )
