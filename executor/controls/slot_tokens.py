"""The token held by every KV slot, on the device: a request's history through the row table.

Penalties count a request's prompt and output tokens, cached prefix included, without the
scheduler re-sending them. Every step writes the id of each new token at its KV slot (the
resolved id where the input was a future-token reference; -1 where the step brought
embeddings), so `tokens[req_to_token[row, :seq_len]]` is the row's history.
"""

from __future__ import annotations

import torch

from ops.future_tokens import resolve_future_tokens

UNKNOWN = -1  # a slot whose token is not known (never written, or written from embeddings)


class SlotTokens:
    def __init__(self, kv_slots: int, device: torch.device) -> None:
        self.tokens = torch.full((kv_slots + 1,), UNKNOWN, dtype=torch.int64, device=device)

    def write(
        self,
        out_cache_loc: torch.Tensor,
        input_ids: torch.Tensor | None,
        future_table: torch.Tensor | None,
    ) -> None:
        """Record a step's new tokens at their slots (device ops only). `future_table`:
        the future-token table when the ids hold references, else None."""
        if out_cache_loc.numel() == 0:
            return
        if input_ids is None:
            self.tokens.index_fill_(0, out_cache_loc.long(), UNKNOWN)
            return
        ids = input_ids if future_table is None else resolve_future_tokens(input_ids, future_table)
        self.tokens.index_copy_(0, out_cache_loc.long(), ids.long())

    def history(self, req_to_token: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
        """[n, length] token ids at positions 0..length-1 of each row (entries past a row's
        length are whatever its cells hold: mask them by the row's seq_len)."""
        slots = req_to_token.index_select(0, rows.long())[:, :length]
        return self.tokens[slots.long()]
