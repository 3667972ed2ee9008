"""Scoring and embedding texts through `Forward`: perplexity and per-token logprobs, pooled
embeddings. Token ids in, numbers out; the CLI (`model-executor score|embed`) and
`ExecutorClient.score` / `embed` use these.

A text longer than one batch's token budget is prefilled in chunks; each chunk asks its
prompt logprobs with the next chunk's first token (`next_prompt_token`), so every token after
the first is scored exactly once. The request holds row 1 and slots 1..n for its duration and
releases the row at the end: run it against an executor no other scheduler is using.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.batch_prep import make_extend_batch, make_idle_batch
from executor.core.extras_types import HiddenAsk, Pooling, RowOutputs
from executor.core.forward_batch import ForwardBatch
from executor.core.limits import BatchLimits
from executor.core.outputs import ForwardOutput

ForwardFn = Callable[[ForwardBatch], ForwardOutput]
ROW = 1


@dataclass(frozen=True)
class TextScore:
    tokens: int  # tokens in the text
    scored: int  # tokens scored (all but the first)
    mean_nll: float  # mean negative log-likelihood per scored token (nats)
    perplexity: float
    token_logprobs: tuple[float, ...]  # one per scored token, in order

    def summary(self, per_token: bool = False) -> dict[str, object]:
        out: dict[str, object] = {
            "tokens": self.tokens,
            "mean_nll": self.mean_nll,
            "perplexity": self.perplexity,
        }
        if per_token:
            out["token_logprobs"] = list(self.token_logprobs)
        return out


def _chunks(tokens: list[int], limits: BatchLimits) -> list[tuple[int, list[int]]]:
    if not tokens:
        raise ValueError("nothing to score: the text has no tokens")
    if len(tokens) > min(limits.max_context_len, limits.kv_slots):
        raise ValueError(
            f"the text has {len(tokens)} tokens; this executor holds at most "
            f"{min(limits.max_context_len, limits.kv_slots)} per request"
        )
    step = limits.max_tokens_per_batch
    return [(i, tokens[i : i + step]) for i in range(0, len(tokens), step)]


def _run(
    forward: ForwardFn,
    limits: BatchLimits,
    tokens: list[int],
    ask: Callable[[int, int], RowOutputs],
) -> list[ForwardOutput]:
    """Prefill `tokens` on ROW chunk by chunk (`ask(start, end)` per chunk), then release."""
    outs = []
    try:
        for start, chunk in _chunks(tokens, limits):
            fb = make_extend_batch(
                input_ids=[chunk],
                req_pool_indices=[ROW],
                out_cache_loc=[list(range(1 + start, 1 + start + len(chunk)))],
                prefix_lens=[start],
            )
            outs.append(
                forward(dataclasses.replace(fb, row_outputs=(ask(start, start + len(chunk)),)))
            )
    finally:
        release = torch.tensor([ROW], dtype=torch.int64)
        forward(dataclasses.replace(make_idle_batch(), released_req_pool_indices=release))
    return outs


def score_tokens(forward: ForwardFn, limits: BatchLimits, tokens: list[int]) -> TextScore:
    """The logprob of every token after the first, from chunked EXTENDs."""

    def ask(start: int, end: int) -> RowOutputs:
        nxt = tokens[end] if end < len(tokens) else None
        return RowOutputs(row=ROW, prompt_logprobs=True, next_prompt_token=nxt)

    logprobs: list[float] = []
    for out in _run(forward, limits, tokens, ask):
        assert out.extras is not None
        if out.extras.prompt_logprobs is not None:
            logprobs.extend(out.extras.prompt_logprobs.values.tolist())
    nll = -sum(logprobs) / len(logprobs) if logprobs else 0.0
    return TextScore(len(tokens), len(logprobs), nll, math.exp(nll), tuple(logprobs))


def embed_tokens(
    forward: ForwardFn,
    limits: BatchLimits,
    tokens: list[int],
    *,
    pooling: Pooling = Pooling.MEAN,
    layer: int | None = None,
) -> list[float]:
    """The text's pooled hidden state (float32 values)."""
    hidden = HiddenAsk(pooling=pooling, layer=layer)
    outs = _run(forward, limits, tokens, lambda start, end: RowOutputs(row=ROW, hidden=hidden))
    last = outs[-1].extras
    assert last is not None and last.hidden_states is not None
    return last.hidden_states.values[0].float().tolist()
