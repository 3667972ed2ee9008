"""`BufferRegistry`: the slots of one runner, and the fill/extract steps every path shares."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from registry.copy import CopyPair, FillStats, grouped_copy_, per_tensor_copy_
from registry.policy import PaddingPolicy
from registry.pool import share_input_buffer
from registry.slot import FillContext, GraphSlot

BatchT = TypeVar("BatchT")
PLANS_PER_REGISTRY = 64  # fill shapes planned per registry (buckets x modes); oldest dropped


@dataclass(frozen=True)
class _FillPlan:
    """What a fill of one shape touches, as ready-made views."""

    ctx: FillContext
    resets: tuple[tuple[torch.Tensor, float | int | bool], ...]  # (tail, value to fill)
    heads: tuple[tuple[str, torch.Tensor, bool], ...]  # (field, head view, off the device)


class BufferRegistry:
    """Fixed-address buffers for the fields of a batch, sized for `max_bs` / `max_num_tokens`.

    One step is `fill_from(batch, ...)` (tails reset, heads copied, hooks run) followed by
    `extract_buffer(...)`, a batch whose slot fields are views of the buffers. The views are
    overwritten by the next fill: consume them before it. With `share_pool`, buffers go
    through :func:`registry.share_input_buffer` (see its NOTE on why that is safe).
    """

    def __init__(
        self,
        device: torch.device | str,
        max_bs: int,
        max_num_tokens: int,
        share_pool: bool = False,
    ) -> None:
        if max_bs < 0 or max_num_tokens < 0:
            raise ValueError(
                f"max_bs and max_num_tokens must be >= 0, got {max_bs} and {max_num_tokens}"
            )
        self.device = torch.device(device)
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.share_pool = share_pool
        self._slots: dict[str, GraphSlot] = {}
        # Slots whose buffer lives off `device` (e.g. a host mirror): copied one by one.
        self._off_device: set[str] = set()
        # What a fill walks, by kind, in registration order (rebuilt at each registration):
        self._plain: tuple[str, ...] = ()  # heads copied from the batch's same-named field
        self._sourced: tuple[GraphSlot, ...] = ()  # heads copied from a source_fn
        self._hooks: tuple[GraphSlot, ...] = ()  # post_fill hooks
        self._exposed: tuple[GraphSlot, ...] = ()  # what extract_buffer may put on the batch
        self._exposed_plain: tuple[str, ...] = ()  # of those, the ones a batch may lack
        self._plans: dict[tuple[tuple[int, int, int, int], tuple[bool, ...]], _FillPlan] = {}
        # buffer_views per (padded_bs, padded_num_tokens, which plain fields the batch has)
        self._views: dict[tuple[int, int, tuple[bool, ...]], dict[str, torch.Tensor]] = {}

    # --- registration ------------------------------------------------------------------
    def register_slot(self, slot: GraphSlot, bind: torch.Tensor | None = None) -> GraphSlot:
        """Add `slot` and allocate its buffer (a disabled slot is stored, never allocated).

        With `bind`, the slot adopts that tensor as its buffer (shape, dtype and device must
        match); it is neither pooled nor pre-filled, so it keeps its contents.
        """
        if slot.name in self._slots:
            raise ValueError(f"slot {slot.name!r} is already registered")
        if slot.buffer is not None:
            raise ValueError(f"slot {slot.name!r} already has a buffer (registered elsewhere?)")
        if slot.enabled:
            slot.buffer = self._allocate(slot, bind)
            if not _same_device(slot.buffer.device, self.device):
                self._off_device.add(slot.name)
        self._slots[slot.name] = slot
        self._index()
        return slot

    def _index(self) -> None:
        live = [s for s in self._slots.values() if s.enabled]
        self._plain = tuple(s.name for s in live if s.copy_from_fb and s.source_fn is None)
        self._sourced = tuple(s for s in live if s.copy_from_fb and s.source_fn is not None)
        self._hooks = tuple(s for s in live if s.post_fill is not None)
        self._exposed = tuple(s for s in live if s.buffer is not None and not s.is_nested)
        self._exposed_plain = tuple(
            s.name for s in self._exposed if not s.is_computed and s.source_fn is None
        )
        self._plans.clear()
        self._views.clear()

    def _allocate(self, slot: GraphSlot, bind: torch.Tensor | None) -> torch.Tensor:
        device = self.slot_device(slot)
        shape = tuple(int(d) for d in slot.shape_fn(self.max_bs, self.max_num_tokens))
        if bind is not None:
            if tuple(bind.shape) != shape or bind.dtype != slot.dtype:
                raise ValueError(
                    f"slot {slot.name!r}: bound tensor is {list(bind.shape)} {bind.dtype}, "
                    f"the slot needs {list(shape)} {slot.dtype}"
                )
            if not _same_device(bind.device, device):
                raise ValueError(
                    f"slot {slot.name!r}: bound tensor is on {bind.device}, the slot on {device}"
                )
            return bind
        # NOTE: never an inference tensor, even when a runner builds the registry inside
        # torch.inference_mode(): such a buffer could not be filled outside it, and pooled
        # buffers outlive the registry that made them.
        with torch.inference_mode(False):
            buf = torch.zeros(shape, dtype=slot.dtype, device=device)
        # NOTE: FILL_ONCE tails are never reset, so a pooled one could be overwritten by
        # another registry's fill for good; those buffers stay private.
        if self.share_pool and slot.padding_policy is not PaddingPolicy.FILL_ONCE:
            buf = share_input_buffer(slot.name, buf)
        if slot.padding_policy.needs_pad_value:
            assert slot.pad_value is not None  # GraphSlot checks it
            buf.fill_(slot.pad_value)
        return buf

    def slot_device(self, slot: GraphSlot) -> torch.device:
        return torch.device(slot.device) if slot.device is not None else self.device

    def has_slot(self, name: str) -> bool:
        """True for a registered, enabled slot."""
        slot = self._slots.get(name)
        return slot is not None and slot.enabled

    def get_slot(self, name: str) -> GraphSlot:
        """The registered slot called `name`, enabled or not (KeyError if none)."""
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"no slot {name!r} in this registry") from None

    def slot_names(self) -> list[str]:
        """Enabled slots, in registration order."""
        return [s.name for s in self._slots.values() if s.enabled]

    @property
    def nbytes(self) -> int:
        """Bytes of the enabled slots' buffers (pooled storage counted once per slot)."""
        return sum(
            s.buffer.numel() * s.buffer.element_size()
            for s in self._slots.values()
            if s.buffer is not None
        )

    # --- one step ----------------------------------------------------------------------
    def fill_from(
        self,
        fb: Any,
        *,
        raw_bs: int,
        padded_bs: int,
        raw_num_tokens: int,
        padded_num_tokens: int,
    ) -> FillStats:
        """Stage `fb` into the buffers for a batch padded to `padded_bs` / `padded_num_tokens`.

        Three phases: every tail gets its padding policy; every head is copied (grouped by
        dtype pair on the registry's device, one by one elsewhere); `post_fill` hooks run.
        A field that is None on `fb` (or a `source_fn` returning None) is not copied. What
        a fill of one shape touches (tail and head views) is planned once and reused.
        """
        if padded_bs > self.max_bs or padded_num_tokens > self.max_num_tokens:
            raise ValueError(
                f"a batch padded to bs={padded_bs}, tokens={padded_num_tokens} does not fit "
                f"this registry (max_bs={self.max_bs}, max_num_tokens={self.max_num_tokens})"
            )
        shape = (raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)
        sources = [getattr(fb, name, None) for name in self._plain]
        present = tuple(src is not None for src in sources)
        plan = self._plans.get((shape, present))
        if plan is None:
            plan = self._plan(FillContext(*shape), present)
        for tail, value in plan.resets:
            tail.fill_(value)
        on_device: list[CopyPair] = []
        elsewhere: list[CopyPair] = []
        for (name, dst, off), src in zip(
            plan.heads, [s for s in sources if s is not None], strict=True
        ):
            if not isinstance(src, torch.Tensor):
                _check_tensor(self._slots[name], src)
            # NOTE: copy_ would broadcast a mismatched source silently; refuse it instead.
            if dst.shape != src.shape:
                raise ValueError(
                    f"slot {name!r}: source shape {list(src.shape)} does not match "
                    f"the staged head {list(dst.shape)}"
                )
            (elsewhere if off else on_device).append((dst, src))
        for slot in self._sourced:
            pair = self._sourced_pair(slot, fb, plan.ctx)
            if pair is not None:
                (elsewhere if slot.name in self._off_device else on_device).append(pair)
        stats = grouped_copy_(on_device) + per_tensor_copy_(elsewhere)
        for slot in self._hooks:
            assert slot.post_fill is not None
            slot.post_fill(slot.require_buffer(), fb, plan.ctx)
        return stats

    def _plan(self, ctx: FillContext, present: tuple[bool, ...]) -> _FillPlan:
        """The views one fill shape touches: each tail to reset (and its value), each head
        to copy into. Cached per shape (the oldest dropped beyond PLANS_PER_REGISTRY)."""
        resets: list[tuple[torch.Tensor, float | int | bool]] = []
        for slot in self._slots.values():
            if not slot.enabled or slot.buffer is None:
                continue
            tail = slot.padding_tail(ctx)
            if tail is None:
                continue
            if slot.padding_policy is PaddingPolicy.ZERO:
                resets.append((tail, 0))
            elif slot.padding_policy is PaddingPolicy.FILL_SENTINEL:
                assert slot.pad_value is not None  # GraphSlot checks it
                resets.append((tail, slot.pad_value))
        heads = tuple(
            (name, slot.head(slot.lanes(ctx.raw_bs, ctx.raw_num_tokens)), name in self._off_device)
            for name, slot, here in zip(
                self._plain, (self._slots[n] for n in self._plain), present, strict=True
            )
            if here
        )
        plan = _FillPlan(ctx, tuple(resets), heads)
        if len(self._plans) >= PLANS_PER_REGISTRY:
            self._plans.pop(next(iter(self._plans)))
        self._plans[
            ((ctx.raw_bs, ctx.padded_bs, ctx.raw_num_tokens, ctx.padded_num_tokens), present)
        ] = plan
        return plan

    def _sourced_pair(self, slot: GraphSlot, fb: Any, ctx: FillContext) -> CopyPair | None:
        assert slot.source_fn is not None
        src = slot.source_fn(fb, ctx)
        if src is None:
            return None
        _check_tensor(slot, src)
        if src.dim() == 0:
            raise ValueError(f"slot {slot.name!r}: source_fn returned a 0-d tensor")
        dst = slot.head(int(src.shape[-1] if slot.slice_fn is not None else src.shape[0]))
        if dst.shape != src.shape:
            raise ValueError(
                f"slot {slot.name!r}: source shape {list(src.shape)} does not match "
                f"the staged head {list(dst.shape)}"
            )
        return dst, src

    def buffer_views(
        self, *, padded_bs: int, padded_num_tokens: int, forward_batch_template: Any
    ) -> dict[str, torch.Tensor]:
        """The fields `extract_buffer` puts on the batch (without `batch_size`): for a caller
        whose batch type has a cheaper replace than `dataclasses.replace`. Made once per
        shape and kept (the buffers never move): read it, do not change it."""
        present = tuple(
            getattr(forward_batch_template, name, None) is not None for name in self._exposed_plain
        )
        key = (padded_bs, padded_num_tokens, present)
        views = self._views.get(key)
        if views is None:
            lacking = {n for n, here in zip(self._exposed_plain, present, strict=True) if not here}
            views = {
                slot.name: slot.slice_for(padded_bs, padded_num_tokens)
                for slot in self._exposed
                if slot.name not in lacking
            }
            if len(self._views) >= PLANS_PER_REGISTRY:
                self._views.pop(next(iter(self._views)))
            self._views[key] = views
        return views

    def extract_buffer(
        self, *, padded_bs: int, padded_num_tokens: int, forward_batch_template: BatchT
    ) -> BatchT:
        """A `dataclasses.replace` of the template whose slot fields are buffer views.

        `batch_size` becomes `padded_bs`. A plain slot whose field is None on the template
        carries None (never a stale buffer); computed slots are always exposed; nested
        (dotted) slots are never put on the batch. The template is not mutated.
        """
        changes: dict[str, Any] = dict(
            self.buffer_views(
                padded_bs=padded_bs,
                padded_num_tokens=padded_num_tokens,
                forward_batch_template=forward_batch_template,
            )
        )
        changes["batch_size"] = padded_bs
        return cast(BatchT, dataclasses.replace(cast(Any, forward_batch_template), **changes))


def _check_tensor(slot: GraphSlot, src: object) -> None:
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"slot {slot.name!r}: the source is a {type(src).__name__}, not a tensor")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
