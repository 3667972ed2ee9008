"""`BatchLimits`: the caps every batch is checked against, as GetInfo reports them.

Built in one place (`executor.config.batch_limits`); the fields without a setting are the
caps every executor shares.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchLimits:
    """The executor's limits, as `GetInfo` reports them to a scheduler."""

    max_reqs: int  # valid rows 1..max_reqs
    kv_slots: int  # valid slots 1..kv_slots
    max_context_len: int
    vocab_size: int
    hidden_size: int
    max_batch_size: int
    max_tokens_per_batch: int
    max_top_logprobs: int = 20  # most top_logprobs_num a batch may ask for
    future_slots: int = 0  # valid future-token slots 1..future_slots (0: no references)
    max_logit_bias: int = 300  # most logit_bias entries per request (OpenAI's cap)
    max_control_token_ids: int = 4096  # most entries of each sampling-control id list
    max_draft_tokens: int = 16  # VERIFY: most draft tokens per row
    max_ngram: int = 8  # VERIFY: largest prompt-lookup n-gram
    max_score_token_ids: int = 1024  # most RowOutputs.score_token_ids per row
    max_prompt_logprob_bytes: int = 16 << 20  # a response's prompt logprobs (and top-k)
    max_hidden_bytes: int = 16 << 20  # a response's hidden states
    max_output_bytes: int = 32 << 20  # all RowOutputs results of one response
    max_routed_expert_bytes: int = 16 << 20  # a response's routed expert ids
    routed_expert_layers: tuple[int, ...] = ()  # the model's sparse MoE layers (none: not MoE)
    routed_experts_top_k: int = 0  # experts per token in each of them
    allow_input_embeds: bool = True  # the executor's setting (off by default there)


def routed_expert_bytes_per_token(limits: BatchLimits) -> int:
    """Bytes of one token's routed expert ids (int32, every MoE layer); 0: not an MoE model."""
    return 4 * len(limits.routed_expert_layers) * limits.routed_experts_top_k
