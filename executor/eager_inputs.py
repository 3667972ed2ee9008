"""The eager path's input-buffer registries: persistent buffers the eager model reads.

Eager never pads (`padded == raw`). With `eager_input_no_copy` off (the registry path), the
step's staged device views are filled into two lazily built registries - `eager_decode`
(bs axis, for DECODE) and `eager_extend` (token axis, for EXTEND) - by the registry's own
`fill_from` (one grouped device-to-device copy), and the model reads `extract_buffer`'s
view: the registry's buffers, computed slots (`num_token_non_padded`) exposed, `None`
carried for a registered field the batch does not have (`input_ids` under input
embeddings), every unregistered field carried from the batch as it is. Each registry
grows to the next power of two when a batch exceeds it, and keeps its buffers otherwise,
so a step allocates nothing. With the toggle on, the model reads the staged views
themselves and nothing is copied or counted.

The buffers are private (`share_pool=False`): a background graph capture fills the graph
runners' pooled buffers while eager steps run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.core.forward_batch import ForwardBatch
from executor.core.names import EAGER_DECODE, EAGER_EXTEND
from registry import BufferRegistry, FillStats, build_decode_registry, build_prefill_registry


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class EagerFill:
    """One eager step's inputs through a registry: the batch the model reads and the fill."""

    batch: ForwardBatch
    registry: str
    stats: FillStats


class EagerRegistry:
    """One mode's registry, built on first use and rebuilt at the next power of two when a
    batch does not fit (`capacity` says what the buffers hold now)."""

    def __init__(self, name: str, device: torch.device, seq_len_fill_value: int) -> None:
        self.name = name
        self.device = device
        self.seq_len_fill_value = seq_len_fill_value
        self.registry: BufferRegistry | None = None

    @property
    def capacity(self) -> tuple[int, int]:
        """(requests, tokens) the buffers hold; (0, 0) before the first batch."""
        r = self.registry
        return (0, 0) if r is None else (r.max_bs, r.max_num_tokens)

    def _ensure(self, bs: int, num_tokens: int) -> BufferRegistry:
        r = self.registry
        if r is not None and bs <= r.max_bs and num_tokens <= r.max_num_tokens:
            return r
        cap_bs, cap_tokens = self.capacity
        max_bs, max_tokens = _next_pow2(max(bs, cap_bs)), _next_pow2(max(num_tokens, cap_tokens))
        if self.name == EAGER_DECODE:
            r = build_decode_registry(
                device=self.device,
                max_bs=max_bs,
                max_num_tokens=max_tokens,
                seq_len_fill_value=self.seq_len_fill_value,
                needs_cpu_seq_lens=False,  # the host mirror is carried from the batch
                enable_num_token_non_padded=True,
                share_pool=False,
            )
        else:
            r = build_prefill_registry(
                device=self.device,
                max_bs=max_bs,
                max_num_tokens=max_tokens,
                enable_num_token_non_padded=True,
                share_pool=False,
            )
        self.registry = r
        return r

    def fill(self, fb: ForwardBatch) -> EagerFill:
        """Copy `fb`'s inputs into the buffers; the batch of buffer views the model reads."""
        bs, tokens = fb.batch_size, fb.num_tokens
        registry = self._ensure(bs, tokens)
        stats = registry.fill_from(
            fb, raw_bs=bs, padded_bs=bs, raw_num_tokens=tokens, padded_num_tokens=tokens
        )
        # extract_buffer's view, through ForwardBatch's own (cheaper) replace
        views = registry.buffer_views(
            padded_bs=bs, padded_num_tokens=tokens, forward_batch_template=fb
        )
        return EagerFill(fb.replace(**views), self.name, stats)


class EagerInputs:
    """The two eager registries of a runner."""

    def __init__(self, device: torch.device, *, seq_len_fill_value: int) -> None:
        self.decode = EagerRegistry(EAGER_DECODE, device, seq_len_fill_value)
        self.extend = EagerRegistry(EAGER_EXTEND, device, seq_len_fill_value)

    def registry_for(self, fb: ForwardBatch) -> EagerRegistry:
        return self.extend if fb.forward_mode.is_extend() else self.decode

    def fill(self, fb: ForwardBatch) -> EagerFill:
        return self.registry_for(fb).fill(fb)
