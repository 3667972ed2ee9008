"""Eager staging: the two grow-on-demand registries the eager path copies each batch into.

The eager path assembles its inputs through the same registry as the graph runners, so the
model reads one kind of batch whichever path ran. Eager never pads (`padded == raw`), so
no tail is ever read here; the registries are sized by powers of two only to make
rebuilds rare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.forward_batch import ForwardBatch
from executor.step.toggles import Toggles
from registry import BufferRegistry, FillStats, build_decode_registry, build_prefill_registry

EAGER_DECODE = "eager_decode"
EAGER_EXTEND = "eager_extend"

# NOTE: eager never pads, so the decode registry's seq_lens sentinel is never read. 0 (as
# sglang's eager registry uses) keeps it independent of the attention backend; a graph
# runner's registry that shares the pooled buffer resets its own tails on every fill.
EAGER_SEQ_LEN_FILL_VALUE = 0


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass
class GrowingRegistry:
    """A registry built on first use and rebuilt at the next power of two when outgrown."""

    name: str
    build: Callable[[int, int], BufferRegistry]  # (max_bs, max_num_tokens) -> registry
    registry: BufferRegistry | None = None
    builds: int = 0

    @property
    def capacity(self) -> tuple[int, int]:
        """(max_bs, max_num_tokens) of the current registry; (0, 0) before the first build."""
        if self.registry is None:
            return (0, 0)
        return (self.registry.max_bs, self.registry.max_num_tokens)

    def ensure(self, bs: int, num_tokens: int) -> BufferRegistry:
        """A registry that holds `bs` requests and `num_tokens` tokens."""
        max_bs, max_num_tokens = self.capacity
        if self.registry is not None and bs <= max_bs and num_tokens <= max_num_tokens:
            return self.registry
        self.registry = self.build(
            next_power_of_2(max(bs, max_bs)), next_power_of_2(max(num_tokens, max_num_tokens))
        )
        self.builds += 1
        return self.registry

    def drop(self) -> None:
        """Forget the registry; the next `ensure` builds a fresh one at the same capacity."""
        self.registry = None


@dataclass(frozen=True)
class StagedBatch:
    """A batch whose staged fields are registry views, valid until the next fill."""

    fb: ForwardBatch
    registry: str
    stats: FillStats


class EagerInputs:
    """Stages eager batches: DECODE into a bs-axis registry, EXTEND into a token-axis one."""

    def __init__(self, device: torch.device, toggles: Toggles) -> None:
        self.device = device
        self.toggles = toggles
        self._needs_cpu_seq_lens = toggles.needs_cpu_seq_lens  # what the decode registry holds
        self.decode = GrowingRegistry(EAGER_DECODE, self._build_decode)
        self.extend = GrowingRegistry(EAGER_EXTEND, self._build_extend)

    def _build_decode(self, max_bs: int, max_num_tokens: int) -> BufferRegistry:
        return build_decode_registry(
            device=self.device,
            max_bs=max_bs,
            max_num_tokens=max_num_tokens,
            seq_len_fill_value=EAGER_SEQ_LEN_FILL_VALUE,
            needs_cpu_seq_lens=self._needs_cpu_seq_lens,
        )

    def _build_extend(self, max_bs: int, max_num_tokens: int) -> BufferRegistry:
        return build_prefill_registry(
            device=self.device, max_bs=max_bs, max_num_tokens=max_num_tokens
        )

    def stage(self, fb: ForwardBatch) -> StagedBatch:
        """Copy `fb`'s staged fields into the mode's registry and return the registry view.

        Fields the registry does not hold (sampling, `extend_*`, `prefix_cache_loc`,
        `input_embeds`) are carried from `fb` unchanged.
        """
        if self.toggles.needs_cpu_seq_lens != self._needs_cpu_seq_lens:  # a runtime change
            self._needs_cpu_seq_lens = self.toggles.needs_cpu_seq_lens
            self.decode.drop()
        bs, num_tokens = fb.batch_size, fb.num_tokens
        cache = self.extend if fb.forward_mode.is_extend() else self.decode
        reg = cache.ensure(bs, num_tokens)
        stats = reg.fill_from(
            fb, raw_bs=bs, padded_bs=bs, raw_num_tokens=num_tokens, padded_num_tokens=num_tokens
        )
        view = reg.extract_buffer(
            padded_bs=bs, padded_num_tokens=num_tokens, forward_batch_template=fb
        )
        return StagedBatch(view, cache.name, stats)
