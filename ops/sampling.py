"""Sampling kernels: seeded uniforms and top-k / top-p / min-p inverse-CDF sampling.

A seeded request's draw depends only on (seed, position): the uniform comes from a
counter-based hash (splitmix64) of the two, never from a shared generator's state, so it
does not change with which other requests share the batch, nor with the device.
Each request consumes one uniform: the token is the inverse CDF of its truncated,
renormalized distribution at that point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops import host_kernels

_U64 = 1 << 64
# Temperatures below this are greedy: dividing logits by a smaller one overflows float32
# (1e-38 turns every logit into inf or NaN), and the distribution is already a point mass.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _signed(x: int) -> int:
    return x - _U64 if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A float32 uniform in [0, 1) per entry from int64 seeds and positions (wrapping arithmetic).

    24 bits of the splitmix64 output are used, so every value is exact in float32 and < 1.
    """
    z = seeds + (positions + 1) * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 40).to(torch.float32) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class SamplingPlan:
    """Which truncations any row of the batch uses, decided on the host (no device sync).

    The truncating rows are the sampled ones and, with `processed`, the rows whose logprobs
    are PROCESSED (a greedy one is truncated at temperature 1 for its logprobs)."""

    all_greedy: bool  # no row samples: the draw is the argmax
    any_top_k: bool
    all_top_k: bool  # every truncating row has top_k > 0: restrict to the top max_k candidates
    max_top_k: int
    any_top_p: bool
    any_min_p: bool
    any_seeded: bool = False  # some sampled row brings its own seed
    any_processed: bool = False  # some row's logprobs are PROCESSED (`processed_logprobs`)

    @classmethod
    def from_host(
        cls,
        temperatures: torch.Tensor,
        top_ks: torch.Tensor,
        top_ps: torch.Tensor,
        min_ps: torch.Tensor,
        has_seed: torch.Tensor | None = None,
        processed: torch.Tensor | None = None,
    ) -> SamplingPlan:
        sampled = temperatures >= GREEDY_BELOW_TEMPERATURE
        truncating = sampled if processed is None else sampled | processed
        if not bool(truncating.any()):  # every row greedy: no truncation or seed to look at
            return ALL_GREEDY
        ks = top_ks[truncating]
        return cls(
            all_greedy=not bool(sampled.any()),
            any_top_k=bool((ks > 0).any()),
            all_top_k=bool(ks.numel() > 0 and (ks > 0).all()),
            max_top_k=int(ks.max()) if ks.numel() else 0,
            any_top_p=bool((top_ps[truncating] < 1).any()),
            any_min_p=bool((min_ps[truncating] > 0).any()),
            any_seeded=has_seed is not None and bool(has_seed[sampled].any()),
            any_processed=processed is not None and bool(processed.any()),
        )


ALL_GREEDY = SamplingPlan(
    all_greedy=True,
    any_top_k=False,
    all_top_k=False,
    max_top_k=0,
    any_top_p=False,
    any_min_p=False,
    any_seeded=False,
)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of [n, V] logits; on a CPU device float32 rows go through the
    host kernel (`ops/host_kernels.py`; same answer: the first maximum, NaN the largest)."""
    k = host_kernels.loaded()
    if (
        k is None
        or not logits.is_cpu
        or logits.dtype is not torch.float32
        or logits.dim() != 2
        or logits.shape[1] == 0
        or logits.stride(1) != 1
        or torch.compiler.is_compiling()
    ):
        return logits.argmax(dim=-1)
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    k.argmax_f32(logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr())
    return out


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    uniforms: torch.Tensor,
    plan: SamplingPlan,
) -> torch.Tensor:
    """Next token per row of logits [n, V]: argmax where the temperature is below
    GREEDY_BELOW_TEMPERATURE (0 included), else a draw (`draw` from `truncate`)."""
    greedy_ids = argmax_rows(logits)
    if plan.all_greedy:
        return greedy_ids
    t = truncate(logits, temperatures, top_ks, top_ps, min_ps, plan)
    return drawn(t, greedy_ids, temperatures, uniforms)


def drawn(
    t: Truncated, greedy_ids: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """The argmax on greedy rows, a draw from `t` on the others."""
    greedy = temperatures < GREEDY_BELOW_TEMPERATURE
    return torch.where(greedy, greedy_ids, draw(t.probs, t.cand_ids, uniforms))


@dataclass(frozen=True)
class Truncated:
    """Each row's truncated distribution (`truncate`), on the device."""

    scaled: torch.Tensor  # [n, V] logits / temperature (1 for greedy rows), vocabulary order
    probs: torch.Tensor  # [n, C] candidates' probabilities, excluded ones 0, not renormalized
    cand_ids: torch.Tensor | None  # [n, C]; None: the whole vocabulary in vocabulary order
    excluded: torch.Tensor  # [n, C] bool: the candidates truncation removed


def truncate(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    plan: SamplingPlan,
) -> Truncated:
    """Each row's sampling distribution (`Truncated`). Excluded candidates have probability 0;
    the rest are not renormalized (`draw` scales by the total).

    Order: temperature, then top-k, then top-p on the top-k-renormalized distribution, then
    min-p relative to the most likely token. The most likely token is never excluded. Rows
    below GREEDY_BELOW_TEMPERATURE get temperature 1 here (their callers take the argmax).
    """
    vocab = logits.shape[-1]
    greedy = temperatures < GREEDY_BELOW_TEMPERATURE
    scaled_vocab = logits / torch.where(
        greedy, torch.ones_like(temperatures), temperatures
    ).unsqueeze(-1)
    scaled = scaled_vocab

    cand_ids: torch.Tensor | None = None  # None: candidates are the whole vocab, in vocab order
    if plan.all_top_k:
        scaled, cand_ids = scaled.topk(min(plan.max_top_k, vocab), dim=-1)  # sorted, descending
    elif plan.any_top_k or plan.any_top_p:
        scaled, cand_ids = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(scaled, dim=-1)  # [n, C]

    excluded = torch.zeros_like(probs, dtype=torch.bool)
    if plan.any_top_k:
        rank = torch.arange(probs.shape[-1], device=probs.device)
        excluded |= (top_ks.unsqueeze(-1) > 0) & (rank.unsqueeze(0) >= top_ks.unsqueeze(-1))
    if plan.any_top_p:
        kept = probs.masked_fill(excluded, 0.0)
        kept = kept / kept.sum(dim=-1, keepdim=True)
        before = kept.cumsum(dim=-1) - kept  # probability mass strictly ahead of each candidate
        excluded |= before > top_ps.unsqueeze(-1)
    if plan.any_min_p:
        excluded |= probs < (min_ps * probs.max(dim=-1).values).unsqueeze(-1)
    if cand_ids is not None:
        excluded[:, 0] = False  # sorted: column 0 is the most likely token
    else:
        excluded.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
    return Truncated(scaled_vocab, probs.masked_fill(excluded, 0.0), cand_ids, excluded)


def processed_logprobs(t: Truncated) -> torch.Tensor:
    """[n, V] float32: each row's log-probabilities under its truncated, renormalized
    distribution (-inf outside it): the log-softmax of the scaled logits with every excluded
    token at -inf, in vocabulary order whatever the candidates' order, so a row's values do
    not depend on which truncation path its batch took."""
    excluded = t.excluded
    if t.cand_ids is not None:  # back to vocabulary order; tokens past the top-k: excluded
        vocab_excluded = torch.ones_like(t.scaled, dtype=torch.bool)
        excluded = vocab_excluded.scatter_(1, t.cand_ids, t.excluded)
    return torch.log_softmax(t.scaled.masked_fill(excluded, float("-inf")), dim=-1)


def draw(
    probs: torch.Tensor, cand_ids: torch.Tensor | None, uniforms: torch.Tensor
) -> torch.Tensor:
    """The inverse CDF of each row's distribution (`truncate`) at its uniform in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    # Stay strictly below the total so the search lands on a kept (non-zero) candidate.
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).clamp_(max=probs.shape[-1] - 1)
    return idx.squeeze(-1) if cand_ids is None else cand_ids.gather(1, idx).squeeze(-1)
