"""Future-token references: resolve negative input ids from the future table, and store.

A scheduler that overlaps steps refers to a token not sampled yet by `-k`, "the token stored
in future slot k". The executor stores each sampled token in its slot after sampling
(`store_future_tokens`) and gathers referenced tokens into the input ids before the model
reads them (`resolve_future_tokens`). Both are pure device ops: no value is read on the host,
no branch depends on the data, so they run inside a captured graph unchanged.
"""

from __future__ import annotations

import torch


def resolve_future_tokens(input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`input_ids` with every `-k` replaced by `table[k]` (a new tensor; the input is kept).

    `table` is [future_slots + 1] int64; entry 0 is never a valid reference, so a
    non-negative id gathers entry 0 and keeps its own value. Ids must be >= -future_slots
    (validated on the host before the step).
    """
    slots = torch.clamp(-input_ids, min=0)
    return torch.where(input_ids < 0, torch.index_select(table, 0, slots), input_ids)


def store_future_tokens(table: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """`table[slots[i]] = tokens[i]` in place; `slots` are unique (validated on the host)."""
    table.index_copy_(0, slots, tokens.to(table.dtype))


def resolve_future_tokens_reference(input_ids: list[int], table: list[int]) -> list[int]:
    """The rule in plain Python, for tests: `-k` reads `table[k]`, anything else stays."""
    return [table[-t] if t < 0 else t for t in input_ids]
