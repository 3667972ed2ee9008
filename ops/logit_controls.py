"""Sampling controls on logits: penalties, logit bias and vocabulary bitmasks, on the device.

Every function works on a [n, V] float32 block of rows and per-row parameters, reads no
value on the host and branches on none, so a step applies them with no sync. Neutral
parameters leave a row's logits bit for bit as they were (x / 1, x * 1, x - 0, x + 0).
Masks are int32 words: bit j (least significant first) of word w stands for token 32*w + j.
"""

from __future__ import annotations

import torch

MASK_BITS = 32


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, W] int32 words -> [n, vocab] bool (True: allowed); bits past `vocab` dropped."""
    shifts = torch.arange(MASK_BITS, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].bool()


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[n, V] bool -> [n, ceil(V / 32)] int32 words (the inverse of `unpack_bitmask`)."""
    n, vocab = allowed.shape
    words = (vocab + MASK_BITS - 1) // MASK_BITS
    padded = torch.zeros((n, words * MASK_BITS), dtype=torch.int64, device=allowed.device)
    padded[:, :vocab] = allowed.long()
    weights = torch.ones(MASK_BITS, dtype=torch.int64, device=allowed.device) << torch.arange(
        MASK_BITS, device=allowed.device
    )
    packed = (padded.view(n, words, MASK_BITS) * weights).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def token_counts(tokens: torch.Tensor, counted: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, L] token ids and a [n, L] bool of which to count -> [n, vocab] float32 counts.

    Ids outside 0..vocab-1 (a slot whose token is unknown: -1) are never counted."""
    valid = counted & (tokens >= 0) & (tokens < vocab)
    ids = torch.where(valid, tokens, vocab)  # the spare column takes what is not counted
    counts = torch.zeros((tokens.shape[0], vocab + 1), dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, ids, valid.to(torch.float32))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Repetition (HF / vLLM: l / p where l > 0, else l * p, on tokens in `seen` [n, V]
    bool), then frequency and presence (OpenAI: l - f * c - p * (c > 0), c the output
    counts [n, V]); parameters [n]. A new tensor."""
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, penalized, logits)
    return (
        out
        - frequency.unsqueeze(1) * output_counts
        - presence.unsqueeze(1) * (output_counts > 0).to(torch.float32)
    )


def apply_logit_bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
    """`logits[i, ids[i, j]] += values[i, j]` in place; ids unique per row, padding entries
    hold value 0."""
    logits.scatter_add_(1, ids, values)


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor) -> None:
    """Disallowed tokens of each row get -inf, in place (`words` [n, W] int32)."""
    logits.masked_fill_(~unpack_bitmask(words, logits.shape[1]), float("-inf"))


def suppress(logits: torch.Tensor, words: torch.Tensor, active: torch.Tensor) -> None:
    """Tokens set in `words` get -inf in the rows where `active` [n] bool holds, in place."""
    hit = unpack_bitmask(words, logits.shape[1]) & active.unsqueeze(1)
    logits.masked_fill_(hit, float("-inf"))
