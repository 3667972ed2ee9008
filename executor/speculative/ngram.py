"""Drafting inside the executor: the `Drafter` interface and prompt lookup over a row's history.

A drafter proposes each VERIFY row's draft tokens on the device, from what the executor
already holds (the row table and the slot-token map), before the model scores them: the
scheduler sends only the last token and k + 1 slots. `NgramDrafter` is prompt lookup (the
last n tokens looked up in the row's own history; the tokens after their most recent earlier
occurrence are the drafts). A draft model (a second, smaller model over the same slots)
would be another `Drafter`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Drafter(Protocol):
    def draft(
        self,
        history: torch.Tensor,
        lengths: torch.Tensor,
        ngram: torch.Tensor,
        k: int,
        sizes: list[int],
    ) -> torch.Tensor:
        """[bs, k] draft ids per row. `history` [bs, L] the rows' tokens (valid below
        `lengths` [bs], the last one the row's input token); `ngram` [bs] the per-row setting
        (0: the row is not drafted: any value); `sizes` the distinct settings > 0 (host)."""
        ...


class NgramDrafter:
    """Prompt lookup: device ops only, no host read; one pass per distinct n-gram size."""

    def draft(
        self,
        history: torch.Tensor,
        lengths: torch.Tensor,
        ngram: torch.Tensor,
        k: int,
        sizes: list[int],
    ) -> torch.Tensor:
        bs, length = history.shape
        last = history.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1))  # the input token
        out = last.expand(bs, k).clone()  # no match: the input token repeated
        for n in sizes:
            if n >= length:
                continue
            drafts = ngram_lookup(history, lengths, n, k)
            out = torch.where((ngram == n).unsqueeze(1), drafts, out)
        return out


def ngram_lookup(history: torch.Tensor, lengths: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[bs, k]: per row, the k tokens after the most recent earlier occurrence of its last n
    tokens (positions past the row's end repeat its last token); the last token repeated
    when the n-gram occurs nowhere earlier."""
    bs, length = history.shape
    at = torch.arange(length, device=history.device)
    suffix_pos = (lengths.unsqueeze(1) - n + at[:n].unsqueeze(0)).clamp(min=0)  # [bs, n]
    suffix = history.gather(1, suffix_pos)
    windows = history.unfold(1, n, 1)  # [bs, length - n + 1, n]
    starts = at[: length - n + 1].unsqueeze(0)
    # An earlier occurrence with at least one token after it (so never the suffix itself).
    valid = (starts + n < lengths.unsqueeze(1)) & (lengths.unsqueeze(1) > n)
    match = (windows == suffix.unsqueeze(1)).all(dim=-1) & valid
    best = torch.where(match, starts, -1).max(dim=1).values  # [bs], -1: none
    follow = best.unsqueeze(1) + n + torch.arange(k, device=history.device).unsqueeze(0)
    follow = torch.minimum(follow, (lengths - 1).unsqueeze(1)).clamp(min=0)
    last = history.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1))
    return torch.where((best >= 0).unsqueeze(1), history.gather(1, follow), last.expand(bs, k))


def ngram_lookup_reference(tokens: list[int], n: int, k: int) -> list[int]:
    """The rule in plain Python, for tests."""
    if len(tokens) > n:
        suffix = tokens[-n:]
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s : s + n] == suffix:
                follow = tokens[s + n : s + n + k]
                return follow + [tokens[-1]] * (k - len(follow))
    return [tokens[-1]] * k
