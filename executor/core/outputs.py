"""What a step reports: `StepStats` and `ForwardOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from executor.core.extras_types import ExtraOutputs
from executor.core.runner_output import GraphFallback


@dataclass
class StepStats:
    """What one step did and cost (timings in nanoseconds). All zero until the step ends."""

    path: str = ""  # executor.core.names.Path
    batch_size: int = 0
    padded_batch_size: int = 0
    num_tokens: int = 0
    padded_num_tokens: int = 0
    # Per phase (queue, validate, stage, forward, sample, read) and `total`: the step clock's
    # records.
    timings_ns: dict[str, int] = field(default_factory=dict)
    mode: str = ""  # decode | extend | idle
    # What the eager path's registry received this step: its inputs' one device copy (the
    # staged upload) on the eager path, the graph registries' fills on the graph paths; None
    # / 0 when nothing was staged for the model (eager_no_copy, IDLE).
    fill_registry: str | None = None  # eager_decode | eager_extend | graph_decode | graph_extend
    fill_tensors: int = 0
    fill_bytes: int = 0
    fill_copy_calls: int = 0
    # Graph mode wanted a graph path but the step ran eagerly, and why.
    graph_fallback: GraphFallback | None = None
    d2h_syncs: int = 0  # device-to-host transfers (ops.host_transfer.to_host) the step made
    # Host-to-device (ops.host_transfer.to_device): synchronizing uploads (pageable memory or
    # blocking), and asynchronous copies from the pinned staging buffer (1 per step).
    h2d_syncs: int = 0
    h2d_copies: int = 0
    future_refs: int = 0  # input ids resolved from the future-token table on the device
    # Wall-clock start (time.time_ns) of each phase in `timings_ns`, from the same clock:
    # trace spans are drawn from these afterwards. Not sent over the wire.
    started_ns: dict[str, int] = field(default_factory=dict)
    allreduce_ns: int = 0  # tensor parallel: time in the step's all-reduces (rank 0's clock)
    # Rows each sampling control touched: penalties, logit_bias, min_tokens, token_ids,
    # vocab_mask (absent: none).
    control_rows: dict[str, int] = field(default_factory=dict)
    draft_tokens: int = 0  # VERIFY: drafts scored (sum of k_i)
    accepted_drafts: int = 0  # VERIFY: drafts accepted (sum of a_i)
    lora_rows: int = 0  # rows of the step that ran a LoRA adapter
    accept_lengths: tuple[int, ...] = ()  # VERIFY: tokens each row gained (a_i + 1); not sent
    # The device's idle time before this step while the step was queued: the host's part
    # (admission, staging, the answer before it).
    host_gap_ns: int = 0
    device_busy_ns: int = 0  # the device's time on this step (occupancy); not sent


@dataclass
class ForwardOutput:
    """One step's answer: host tensors, one entry per request of the batch.

    The sampler fills the tokens; the step adds `stats` (and `logits` when asked).
    """

    next_token_ids: torch.Tensor  # [bs] int64
    stats: StepStats = field(default_factory=StepStats)
    next_token_logprobs: torch.Tensor | None = None  # [bs] float32
    top_logprob_ids: torch.Tensor | None = None  # [bs, k] int64
    top_logprobs: torch.Tensor | None = None  # [bs, k] float32
    # [bs, vocab] float32, in-process callers only: what sampling drew from (the model's
    # logits after the sampling controls).
    logits: torch.Tensor | None = None
    # The sampled ids where they were drawn (the device), for the future-token table;
    # in-process only, never sent.
    device_token_ids: torch.Tensor | None = None  # [bs] int64
    # VERIFY (ragged: flat values in batch order, `accepted_lengths` [bs] int32 per row): each
    # row's accepted drafts then its bonus token, and their logprobs when asked.
    accepted_tokens: torch.Tensor | None = None  # [sum(lengths)] int64
    accepted_lengths: torch.Tensor | None = None
    accepted_logprobs: torch.Tensor | None = None  # [sum(lengths)] float32
    extras: ExtraOutputs | None = None  # RowOutputs results (prompt logprobs, scores, hidden)
    weight_version: str = ""  # the weights every logit of this step came from
