"""What a slot's padded tail `[raw:padded]` gets on each fill."""

from __future__ import annotations

from enum import Enum


class PaddingPolicy(Enum):
    """Tail behaviour of one slot when a batch is padded (`raw < padded`).

    The tail is `[raw:padded]` of the slot's axis; for a 2-D slot with a `slice_fn` it is
    the last axis of the padded view. Tails are reset before heads are copied, so a head
    copy is never overwritten.
    """

    KEEP_PAD = "keep_pad"
    """Nothing: whoever reads the buffer guarantees the tail is never read."""

    FILL_SENTINEL = "fill_sentinel"
    """`pad_value` each fill; the whole buffer also starts as `pad_value`."""

    ZERO = "zero"
    """Zeros each fill, so padded lanes of an index point at the reserved row/slot 0."""

    FOREACH_COPY = "foreach_copy"
    """Nothing: only the head is copied; the tail keeps what earlier fills left there."""

    FILL_ONCE = "fill_once"
    """`pad_value` once at allocation and never reset."""

    @property
    def needs_pad_value(self) -> bool:
        return self in (PaddingPolicy.FILL_SENTINEL, PaddingPolicy.FILL_ONCE)
