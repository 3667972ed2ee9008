"""The byte limits of the gRPC port: the largest message it receives and sends (from the
largest batch and response the executor accepts), and the byte budget of batches waiting for
or running on the device (`batch_budget_mib`, at least one largest batch)."""

from __future__ import annotations

import structlog

from executor.config import ExecutorConfig, batch_limits
from executor.core.controls_types import mask_words

log = structlog.get_logger(__name__)

MESSAGE_SLACK = 1 << 20


def message_limits(
    config: ExecutorConfig, hidden_size: int, vocab_size: int, max_context_len: int
) -> tuple[int, int]:
    """(receive, send) byte limits from the largest batch and response the executor accepts."""
    caps = batch_limits(
        config, vocab_size=vocab_size, hidden_size=hidden_size, max_context_len=max_context_len
    )
    bs, tokens = caps.max_batch_size, caps.max_tokens_per_batch
    # ids, slots, positions (int64) and embeddings (float32) per token; per-request fields; a
    # prefix_cache_loc covering every request's whole context; sampling params.
    # Per request: a vocab mask row, its controls (logit bias entries and three id lists, as
    # varints of at most 5 bytes plus a float), its score ids; the release lists.
    per_request = (
        mask_words(vocab_size) * 4
        + caps.max_logit_bias * 12
        + 3 * caps.max_control_token_ids * 5
        + caps.max_score_token_ids * 5
    )
    receive = (
        tokens * (3 * 8 + hidden_size * 4)
        + bs * (4 * 8 + 48 + per_request)
        + bs * max_context_len * 8
        + (config.max_reqs + 4 * config.max_reqs) * 8
        + MESSAGE_SLACK
    )
    # next ids and logprobs, top-k ids + logprobs with k up to max_top_logprobs, the accepted
    # drafts of a VERIFY step, and the extra outputs up to their cap.
    k = min(config.max_top_logprobs, vocab_size)
    draft = bs * (caps.max_draft_tokens + 1) * (8 + 4)
    send = bs * (8 + 4) + bs * k * (8 + 4) + draft + caps.max_output_bytes + MESSAGE_SLACK
    return receive, send


def batch_budget_bytes(budget_mib: int, receive_limit: int) -> int:
    """The byte budget of queued and running batches: `budget_mib`, raised to one batch of the
    receive limit (a budget smaller than the largest batch would refuse it forever)."""
    if not budget_mib:
        return 0
    budget = budget_mib << 20
    if budget < receive_limit:
        log.warning(
            "batch_budget_mib is below the largest batch; raised to it",
            batch_budget_mib=budget_mib,
            max_receive_bytes=receive_limit,
        )
        return receive_limit
    return budget
