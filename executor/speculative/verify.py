"""Accepting drafts: the longest agreeing prefix per row, then one bonus token, on the device.

Row r brings tokens x_0, d_1 .. d_k (k = k_r) at token indices start_r .. start_r + k; the
logits at index start_r + j predict the token after x_j, so draft d_{j+1} is checked against
them. Greedy rows accept d while it equals the argmax. Sampled rows accept d with probability
p(d) under the row's sampling distribution (ops.sampling.truncate); at the first
rejection the bonus is drawn from p with d removed, after k acceptances from p itself
(the rejection rule for one-hot drafts: the output is distributed as plain sampling). Seeded
rows draw their uniforms from (seed, position of the predicted token): the acceptance test
and an unrejected bonus from the stream DECODE uses, a bonus after a rejection from a
second one, so they stay independent of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.core.forward_batch import SamplingBatch
from ops.sampling import (
    GREEDY_BELOW_TEMPERATURE,
    SamplingPlan,
    draw,
    processed_logprobs,
    seeded_uniform,
    truncate,
)

_BONUS_STREAM = 0x2545F4914F6CDD1D  # xor'd into a seed: the bonus draw's own uniform stream


@dataclass
class Verified:
    """Device tensors: `accepted` [bs] (a_r), `tokens` [bs, kmax + 1] (accepted drafts, the
    bonus at column a_r, -1 after it) and their logprobs when asked (RAW, or PROCESSED: under
    the target distribution at each token's position)."""

    accepted: torch.Tensor
    tokens: torch.Tensor
    bonus: torch.Tensor
    logprobs: torch.Tensor | None = None


def verify_drafts(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    start: torch.Tensor,
    k: torch.Tensor,
    kmax: int,
    positions: torch.Tensor,
    sampling: SamplingBatch,
    plan: SamplingPlan,
    generator: torch.Generator,
    return_logprob: bool,
) -> Verified:
    """`logits` [T, V] of every token; `input_ids` [T] (drafts in place, resolved); `start`
    and `k` [bs]; `positions` [T]; `sampling` per row (device)."""
    num_tokens, device = logits.shape[0], logits.device
    bs = start.shape[0]
    row = torch.repeat_interleave(torch.arange(bs, device=device), k + 1, output_size=num_tokens)
    j = torch.arange(num_tokens, device=device) - start[row]
    nxt = torch.cat([input_ids[1:], input_ids[:1]]).long()  # the draft each token's logits check
    has_draft = j < k[row]
    argmax = logits.argmax(dim=-1)
    temps = sampling.temperatures[row]
    truncated = None
    if not plan.all_greedy or (plan.any_processed and return_logprob):  # draw, or logprobs
        truncated = truncate(
            logits, temps, sampling.top_ks[row], sampling.top_ps[row], sampling.min_ps[row], plan
        )
    if plan.all_greedy:
        match = argmax == nxt
        probs = cand = None
    else:
        assert truncated is not None
        probs, cand = truncated.probs, truncated.cand_ids
        p_draft = _prob_of(probs, cand, nxt) / probs.sum(dim=-1)
        predicted = positions.long() + 1
        u_accept = _uniforms(sampling, row, predicted, generator, plan, stream=0)
        greedy = temps < GREEDY_BELOW_TEMPERATURE
        match = torch.where(greedy, argmax == nxt, u_accept < p_draft)
    match &= has_draft

    cols = torch.arange(kmax, device=device)
    at = (start.unsqueeze(1) + cols.unsqueeze(0)).clamp(max=num_tokens - 1)  # [bs, kmax]
    ok = match[at] & (cols.unsqueeze(0) < k.unsqueeze(1))
    accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1) if kmax else k * 0
    bonus_at = start + accepted  # token index whose logits give the bonus

    bonus = argmax[bonus_at]
    if probs is not None:
        p_b = probs[bonus_at]
        c_b = None if cand is None else cand[bonus_at]
        rejected = accepted < k
        d_b = nxt[bonus_at]
        p_b = torch.where(rejected.unsqueeze(1) & _is(c_b, d_b, p_b), 0.0, p_b)
        predicted_b = positions.long()[bonus_at] + 1
        rows = torch.arange(bs, device=device)
        # After a rejection at this position its first uniform was spent on the test: the
        # bonus takes the second stream. With every draft accepted it takes the first, as a
        # DECODE of the same position would (k = 0 draws exactly what DECODE draws).
        u_bonus = torch.where(
            rejected,
            _uniforms(sampling, rows, predicted_b, generator, plan, stream=1),
            _uniforms(sampling, rows, predicted_b, generator, plan, stream=0),
        )
        sampled = sampling.temperatures >= GREEDY_BELOW_TEMPERATURE
        bonus = torch.where(sampled, draw(p_b, c_b, u_bonus), bonus)

    drafts = nxt[at] if kmax else torch.zeros((bs, 0), dtype=torch.int64, device=device)
    tokens = torch.cat([drafts, torch.zeros_like(bonus).unsqueeze(1)], dim=1)
    width = torch.arange(kmax + 1, device=device).unsqueeze(0)
    tokens = torch.where(width == accepted.unsqueeze(1), bonus.unsqueeze(1), tokens)
    tokens = torch.where(width > accepted.unsqueeze(1), -1, tokens)
    out = Verified(accepted=accepted, tokens=tokens, bonus=bonus)
    if return_logprob:
        logp = torch.log_softmax(logits, dim=-1)
        if plan.any_processed:  # the target distribution itself, on PROCESSED rows
            assert truncated is not None
            processed = sampling.processed[row].unsqueeze(1)
            logp = torch.where(processed, processed_logprobs(truncated), logp)
        src = (start.unsqueeze(1) + width).clamp(max=num_tokens - 1)
        out.logprobs = logp[src, tokens.clamp(min=0)]
    return out


def _prob_of(probs: torch.Tensor, cand: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    if cand is None:
        return probs.gather(1, ids.unsqueeze(1)).squeeze(1)
    return (probs * (cand == ids.unsqueeze(1))).sum(dim=1)


def _is(cand: torch.Tensor | None, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[n, C] bool: which candidate column is `ids` (vocabulary order when `cand` is None)."""
    if cand is not None:
        return cand == ids.unsqueeze(1)
    cols = torch.arange(like.shape[1], device=like.device)
    return cols.unsqueeze(0) == ids.unsqueeze(1)


def _uniforms(
    sampling: SamplingBatch,
    row: torch.Tensor,
    predicted: torch.Tensor,
    generator: torch.Generator,
    plan: SamplingPlan,
    *,
    stream: int,
) -> torch.Tensor:
    u = torch.rand(row.shape[0], generator=generator, device=row.device)
    if plan.any_seeded:
        seeds = sampling.seeds[row] ^ _signed(_BONUS_STREAM) if stream else sampling.seeds[row]
        u = torch.where(sampling.has_seed[row], seeded_uniform(seeds, predicted), u)
    return u


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x
