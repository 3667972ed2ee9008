"""Reference attention: a Python loop over requests, one SDPA call each.

Simple enough to trust, slow enough to need replacing: it is the yardstick the faster
backends are tested against. It plans each request from host lengths, so it needs
`seq_lens_cpu`, and it cannot run under graph capture. A windowed layer gathers only the keys
inside the window of the request's first new token onward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from attention.base import AttentionBackend, store_layer_kv
from attention.sdpa import sdpa
from ops.host_reads import host_mirror_read
from ops.host_transfer import to_host

if TYPE_CHECKING:
    from executor.core.forward_batch import ForwardBatch


@dataclass(frozen=True)
class TorchNativeMetadata:
    """Per-request host plan: (row, first new token index in T, new tokens, kv length)."""

    rows: list[int]
    starts: list[int]
    extend_lens: list[int]
    kv_lens: list[int]


class TorchNativeBackend(AttentionBackend):
    name: ClassVar[str] = "torch_native"
    needs_cpu_seq_lens: ClassVar[bool] = True
    supports_graph_capture: ClassVar[bool] = False
    # Host reads this backend makes per step, beyond the executor's own.
    host_transfer_reasons: ClassVar[tuple[str, ...]] = ("attention_plan",)

    def init_forward_metadata(self, fb: ForwardBatch) -> TorchNativeMetadata:
        if fb.seq_lens_cpu is None:
            raise RuntimeError(
                "torch_native attention needs seq_lens_cpu (needs_cpu_seq_lens=True)"
            )
        with host_mirror_read("seq_lens_cpu"):
            kv_lens = fb.seq_lens_cpu.tolist()
        rows = to_host(fb.req_pool_indices, "attention_plan").tolist()
        if fb.forward_mode.is_extend():
            assert fb.extend_seq_lens_cpu is not None
            extend_lens = list(fb.extend_seq_lens_cpu)
        else:
            extend_lens = [1] * fb.batch_size
        starts = [0] * fb.batch_size
        for i in range(1, fb.batch_size):
            starts[i] = starts[i - 1] + extend_lens[i - 1]
        return TorchNativeMetadata(
            rows=rows, starts=starts, extend_lens=extend_lens, kv_lens=kv_lens
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        k_buffer, v_buffer = store_layer_kv(self.kv_pool, layer_id, fb, k, v)

        md: TorchNativeMetadata = fb.attn_metadata
        spec = self.layout.layer(layer_id)
        window = spec.sliding_window
        req_to_token = self.req_to_token_pool.req_to_token
        out = torch.empty_like(q)
        for row, start, ext, kv_len in zip(
            md.rows, md.starts, md.extend_lens, md.kv_lens, strict=True
        ):
            prefix = kv_len - ext
            # Keys first..kv_len-1: all of them, or from the first new token's window start.
            first = 0 if window is None else max(0, prefix + 1 - window)
            slots = req_to_token[row, first:kv_len].long()
            keys = k_buffer[slots].transpose(0, 1)  # [Hk, kv_len - first, D]
            values = v_buffer[slots].transpose(0, 1)
            query = q[start : start + ext].transpose(0, 1)  # [Hq, ext, D]
            # Query i sits at position prefix + i and sees keys 0..prefix + i (in a window of
            # W: prefix + i - W + 1..prefix + i).
            mask = None
            if ext > 1 or window is not None:
                q_pos = torch.arange(prefix, kv_len, device=q.device)[:, None]
                k_pos = torch.arange(first, kv_len, device=q.device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
            o = sdpa(
                query.unsqueeze(0),
                keys.unsqueeze(0).to(q.dtype),
                values.unsqueeze(0).to(q.dtype),
                mask,
                scale=self.layout.scaling,
                softcap=spec.logit_softcap,
                enable_gqa=self.layout.num_heads != self.layout.num_kv_heads,
            )  # [1, Hq, ext, D]
            out[start : start + ext] = o[0].transpose(0, 1)
        return out
