"""One registry slot: a batch field mirrored into a fixed-address buffer, plus its fill rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from registry.policy import PaddingPolicy

AXES = ("bs", "tokens", "none")

ShapeFn = Callable[[int, int], tuple[int, ...]]
"""`(max_bs, max_num_tokens) -> buffer shape`, called once when the slot is registered."""
PostFillFn = Callable[[torch.Tensor, Any, "FillContext"], None]
"""`(buffer, batch, ctx)`: writes a computed value after every slot's head was copied."""
SliceFn = Callable[[torch.Tensor, int], torch.Tensor]
"""`(buffer, n) -> view of the first n lanes` for slots whose lanes are not the first axis."""
SourceFn = Callable[[Any, "FillContext"], "torch.Tensor | None"]
"""`(batch, ctx) -> tensor to copy, or None to skip`, instead of `getattr(batch, name)`."""


@dataclass(frozen=True)
class FillContext:
    """The shapes of one fill, handed to `source_fn` and `post_fill` hooks."""

    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int

    def __post_init__(self) -> None:
        for raw, padded, what in (
            (self.raw_bs, self.padded_bs, "bs"),
            (self.raw_num_tokens, self.padded_num_tokens, "num_tokens"),
        ):
            if not 0 <= raw <= padded:
                raise ValueError(f"need 0 <= raw_{what} <= padded_{what}, got {raw} and {padded}")


@dataclass(eq=False)
class GraphSlot:
    """One batch field (`name`) and the buffer that stages it.

    `axis` says which batch dimension the first axis follows: `"bs"` (requests), `"tokens"`
    (tokens of the step) or `"none"` (a fixed-size buffer used whole). A slot whose name
    holds a dot is a nested or side input: it is filled only through `source_fn` and is
    never put on the extracted batch. A slot with `post_fill` or `copy_from_fb=False` is
    computed: it is always exposed by `extract_buffer`. `buffer` is set by the registry.
    """

    name: str
    shape_fn: ShapeFn
    dtype: torch.dtype
    axis: str = "tokens"
    device: torch.device | str | None = None  # None: the registry's device
    padding_policy: PaddingPolicy = PaddingPolicy.FOREACH_COPY
    pad_value: float | int | bool | None = None
    enabled: bool = True
    copy_from_fb: bool = True
    post_fill: PostFillFn | None = None
    slice_fn: SliceFn | None = None
    source_fn: SourceFn | None = None
    buffer: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a slot needs a non-empty name")
        if self.axis not in AXES:
            raise ValueError(
                f"slot {self.name!r}: axis must be one of {', '.join(AXES)}, got {self.axis!r}"
            )
        if not isinstance(self.padding_policy, PaddingPolicy):
            raise ValueError(
                f"slot {self.name!r}: padding_policy must be a PaddingPolicy, "
                f"got {self.padding_policy!r}"
            )
        if self.padding_policy.needs_pad_value and self.pad_value is None:
            raise ValueError(f"slot {self.name!r}: {self.padding_policy.name} needs a pad_value")
        if self.is_nested and self.copy_from_fb and self.source_fn is None:
            raise ValueError(
                f"slot {self.name!r}: a dotted (nested or side) slot is filled only through "
                "its source_fn; give one or set copy_from_fb=False"
            )

    @property
    def is_nested(self) -> bool:
        return "." in self.name

    @property
    def is_computed(self) -> bool:
        return self.post_fill is not None or not self.copy_from_fb

    def lanes(self, bs: int, num_tokens: int) -> int:
        """How many lanes of this slot a batch of `bs` requests and `num_tokens` tokens uses."""
        if self.axis == "bs":
            return bs
        if self.axis == "tokens":
            return num_tokens
        return self.capacity

    @property
    def capacity(self) -> int:
        """Lanes the buffer holds (its last axis with a `slice_fn`, else its first)."""
        buf = self.require_buffer()
        return int(buf.shape[-1] if self.slice_fn is not None else buf.shape[0])

    def require_buffer(self) -> torch.Tensor:
        if self.buffer is None:
            state = "disabled" if not self.enabled else "not registered with a registry"
            raise RuntimeError(f"slot {self.name!r} has no buffer ({state})")
        return self.buffer

    def head(self, n: int) -> torch.Tensor:
        """The first `n` lanes (a view)."""
        buf = self.require_buffer()
        if n > self.capacity:
            raise ValueError(
                f"slot {self.name!r}: {n} lanes asked, the buffer holds {self.capacity}"
            )
        return self.slice_fn(buf, n) if self.slice_fn is not None else buf[:n]

    def slice_for(self, padded_bs: int, padded_num_tokens: int) -> torch.Tensor:
        """The view a padded batch reads: `[:padded]` of the axis, or the whole buffer."""
        buf = self.require_buffer()
        if self.axis == "none":
            return buf
        return self.head(self.lanes(padded_bs, padded_num_tokens))

    def padding_tail(self, ctx: FillContext) -> torch.Tensor | None:
        """The tail `[raw:padded]` a fill of `ctx`'s shape pads, or None if there is none."""
        if self.buffer is None or self.axis == "none":
            return None
        raw = self.lanes(ctx.raw_bs, ctx.raw_num_tokens)
        padded = self.lanes(ctx.padded_bs, ctx.padded_num_tokens)
        if raw >= padded:
            return None
        return self.head(padded)[..., raw:padded] if self.slice_fn else self.buffer[raw:padded]

    def reset_padding(self, ctx: FillContext) -> None:
        """Apply the padding policy to the tail `[raw:padded]` (nothing if there is none)."""
        tail = self.padding_tail(ctx)
        if tail is None:
            return
        if self.padding_policy is PaddingPolicy.ZERO:
            tail.zero_()
        elif self.padding_policy is PaddingPolicy.FILL_SENTINEL:
            assert self.pad_value is not None  # checked in __post_init__
            tail.fill_(self.pad_value)
        # KEEP_PAD, FOREACH_COPY and FILL_ONCE leave the tail as it is.
