"""The input-buffer registry on its own: slots, padding policies, fill, extract, pool, factories.

A tiny dataclass stands in for ForwardBatch, so these tests say nothing about the executor.
Buffers are poisoned with -7 before a fill wherever a test checks what a tail holds.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import registry.copy as registry_copy
from registry import (
    INDEX_LIKE_SLOTS,
    BufferRegistry,
    FillContext,
    FillStats,
    GraphSlot,
    PaddingPolicy,
    build_decode_registry,
    build_prefill_registry,
    check_padding_invariants,
    share_input_buffer,
)

POISON = -7
_unique = itertools.count()


def uniq(prefix: str) -> str:
    """A slot name no other test uses, so the process-wide pool cannot couple tests."""
    return f"{prefix}_{next(_unique)}"


@dataclass
class MiniBatch:
    batch_size: int
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    out_cache_loc: torch.Tensor | None = None
    req_pool_indices: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    input_embeds: torch.Tensor | None = None
    num_token_non_padded: torch.Tensor | None = None
    mrope: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    extra: Any = None


def i64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def tokens(max_bs: int, max_num_tokens: int) -> tuple[int, ...]:
    return (max_num_tokens,)


def requests(max_bs: int, max_num_tokens: int) -> tuple[int, ...]:
    return (max_bs,)


def registry_with(*slots: GraphSlot, max_bs: int = 8, max_num_tokens: int = 8) -> BufferRegistry:
    reg = BufferRegistry("cpu", max_bs, max_num_tokens)
    for slot in slots:
        reg.register_slot(slot)
    return reg


def fill(reg: BufferRegistry, fb: Any, raw: int, padded: int) -> FillStats:
    return reg.fill_from(
        fb, raw_bs=raw, padded_bs=padded, raw_num_tokens=raw, padded_num_tokens=padded
    )


def poison(reg: BufferRegistry) -> None:
    for name in reg.slot_names():
        buf = reg.get_slot(name).buffer
        assert buf is not None
        buf.fill_(POISON)


# --- GraphSlot ---------------------------------------------------------------------------


def test_axis_must_be_bs_tokens_or_none() -> None:
    with pytest.raises(ValueError, match="'x': axis must be one of bs, tokens, none"):
        GraphSlot("x", tokens, torch.int64, axis="rows")


@pytest.mark.parametrize("policy", [PaddingPolicy.FILL_SENTINEL, PaddingPolicy.FILL_ONCE])
def test_sentinel_policies_need_a_pad_value(policy: PaddingPolicy) -> None:
    with pytest.raises(ValueError, match=r"'seq_lens'.*needs a pad_value"):
        GraphSlot("seq_lens", requests, torch.int64, axis="bs", padding_policy=policy)


def test_a_dotted_slot_must_have_a_source_fn() -> None:
    with pytest.raises(ValueError, match=r"'extra\.ids'.*source_fn"):
        GraphSlot("extra.ids", tokens, torch.int64)


def test_slice_for_an_unallocated_slot_raises() -> None:
    slot = GraphSlot("positions", tokens, torch.int64)
    with pytest.raises(RuntimeError, match="'positions' has no buffer"):
        slot.slice_for(2, 2)


def test_slice_for_follows_the_axis() -> None:
    reg = registry_with(
        GraphSlot("input_ids", tokens, torch.int64),
        GraphSlot("seq_lens", requests, torch.int64, axis="bs"),
        GraphSlot("scores", lambda b, t: (3,), torch.float32, axis="none"),
        max_bs=4,
        max_num_tokens=16,
    )
    assert reg.get_slot("input_ids").slice_for(2, 9).shape == (9,)
    assert reg.get_slot("seq_lens").slice_for(2, 9).shape == (2,)
    assert reg.get_slot("scores").slice_for(2, 9).shape == (3,)


def test_fill_context_rejects_raw_above_padded() -> None:
    with pytest.raises(ValueError, match="raw_bs <= padded_bs"):
        FillContext(raw_bs=3, padded_bs=2, raw_num_tokens=1, padded_num_tokens=1)


# --- padding policies: head and poisoned tail --------------------------------------------


@pytest.mark.parametrize(
    ("policy", "pad_value", "tail"),
    [
        (PaddingPolicy.KEEP_PAD, None, [POISON] * 3),
        (PaddingPolicy.FOREACH_COPY, None, [POISON] * 3),
        (PaddingPolicy.ZERO, None, [0] * 3),
        (PaddingPolicy.FILL_SENTINEL, 5, [5] * 3),
        (PaddingPolicy.FILL_ONCE, 5, [POISON] * 3),
    ],
)
def test_each_policy_copies_the_head_and_treats_the_tail(
    policy: PaddingPolicy, pad_value: int | None, tail: list[int]
) -> None:
    reg = registry_with(
        GraphSlot("positions", tokens, torch.int64, padding_policy=policy, pad_value=pad_value)
    )
    poison(reg)
    fill(reg, MiniBatch(2, positions=i64(10, 11)), raw=2, padded=5)
    buf = reg.get_slot("positions").buffer
    assert buf is not None
    assert buf[:2].tolist() == [10, 11]
    assert buf[2:5].tolist() == tail
    assert buf[5:].tolist() == [POISON] * 3  # past the padded batch nothing is touched


def test_foreach_copy_is_the_default_policy() -> None:
    assert GraphSlot("x", tokens, torch.int64).padding_policy is PaddingPolicy.FOREACH_COPY


@pytest.mark.parametrize(
    ("policy", "pad_value", "initial"),
    [
        (PaddingPolicy.FILL_SENTINEL, 3, 3),
        (PaddingPolicy.FILL_ONCE, -1, -1),
        (PaddingPolicy.ZERO, None, 0),
        (PaddingPolicy.FOREACH_COPY, None, 0),
        (PaddingPolicy.KEEP_PAD, None, 0),
    ],
)
def test_allocation_fills_sentinel_buffers_whole_and_zeroes_the_rest(
    policy: PaddingPolicy, pad_value: int | None, initial: int
) -> None:
    reg = registry_with(
        GraphSlot("seq_lens", requests, torch.int64, "bs", None, policy, pad_value=pad_value)
    )
    assert reg.get_slot("seq_lens").require_buffer().tolist() == [initial] * 8


def test_a_batch_that_fills_its_bucket_leaves_no_tail_to_reset() -> None:
    reg = registry_with(
        GraphSlot("positions", tokens, torch.int64, padding_policy=PaddingPolicy.ZERO),
        max_num_tokens=4,
    )
    poison(reg)
    fill(reg, MiniBatch(3, positions=i64(1, 2, 3)), raw=3, padded=3)
    assert reg.get_slot("positions").require_buffer().tolist() == [1, 2, 3, POISON]


def test_a_padded_batch_beyond_capacity_is_refused() -> None:
    reg = registry_with(GraphSlot("positions", tokens, torch.int64), max_bs=4, max_num_tokens=4)
    with pytest.raises(ValueError, match="does not fit this registry"):
        fill(reg, MiniBatch(2, positions=i64(1, 2)), raw=2, padded=5)


# --- registration -------------------------------------------------------------------------


def test_a_disabled_slot_is_stored_but_never_allocated_filled_or_extracted() -> None:
    reg = registry_with(
        GraphSlot("input_ids", tokens, torch.int64),
        GraphSlot("positions", tokens, torch.int64, enabled=False),
    )
    slot = reg.get_slot("positions")
    assert slot.buffer is None
    assert not reg.has_slot("positions") and reg.has_slot("input_ids")
    assert reg.slot_names() == ["input_ids"]
    fb = MiniBatch(2, input_ids=i64(1, 2), positions=i64(3, 4))
    assert fill(reg, fb, 2, 2).tensors_copied == 1
    view = reg.extract_buffer(padded_bs=2, padded_num_tokens=2, forward_batch_template=fb)
    assert view.positions is fb.positions


def test_a_duplicate_name_is_refused() -> None:
    reg = registry_with(GraphSlot("positions", tokens, torch.int64))
    with pytest.raises(ValueError, match="'positions' is already registered"):
        reg.register_slot(GraphSlot("positions", tokens, torch.int32))


def test_get_slot_of_an_unknown_name_raises_key_error() -> None:
    with pytest.raises(KeyError, match="no slot 'nope'"):
        registry_with().get_slot("nope")


def test_bind_adopts_a_matching_tensor_and_keeps_its_contents() -> None:
    backing = torch.full((8,), 42, dtype=torch.int64)
    reg = BufferRegistry("cpu", 8, 8)
    slot = GraphSlot(
        "seq_lens", requests, torch.int64, "bs", None, PaddingPolicy.FILL_SENTINEL, pad_value=1
    )
    reg.register_slot(slot, bind=backing)
    assert slot.buffer is backing
    assert backing.tolist() == [42] * 8  # no sentinel pre-fill over adopted memory
    fill(reg, MiniBatch(2, seq_lens=i64(5, 6)), raw=2, padded=4)
    assert backing.tolist() == [5, 6, 1, 1] + [42] * 4


@pytest.mark.parametrize(
    "bind",
    [torch.zeros(7, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)],
    ids=["shape", "dtype"],
)
def test_bind_refuses_a_mismatching_tensor(bind: torch.Tensor) -> None:
    reg = BufferRegistry("cpu", 8, 8)
    with pytest.raises(ValueError, match="'positions': bound tensor"):
        reg.register_slot(GraphSlot("positions", tokens, torch.int64), bind=bind)
    assert not reg.has_slot("positions")  # a refused slot is not half-registered


# --- fill_from -----------------------------------------------------------------------------


def test_a_none_field_is_skipped_and_its_buffer_left_alone() -> None:
    reg = registry_with(
        GraphSlot("input_ids", tokens, torch.int64), GraphSlot("positions", tokens, torch.int64)
    )
    poison(reg)
    stats = fill(reg, MiniBatch(2, input_ids=i64(1, 2)), 2, 2)
    assert stats.tensors_copied == 1
    assert reg.get_slot("positions").require_buffer()[:2].tolist() == [POISON, POISON]


def test_source_fn_overrides_the_field_and_copies_its_own_length() -> None:
    seen: list[FillContext] = []

    def source(fb: MiniBatch, ctx: FillContext) -> torch.Tensor:
        seen.append(ctx)
        return fb.extra

    reg = registry_with(GraphSlot("input_ids", tokens, torch.int64, source_fn=source))
    poison(reg)
    fb = MiniBatch(4, input_ids=i64(1, 2, 3, 4), extra=i64(8, 9))
    stats = fill(reg, fb, raw=4, padded=4)
    assert reg.get_slot("input_ids").require_buffer()[:4].tolist() == [8, 9, POISON, POISON]
    assert stats == FillStats(tensors_copied=1, bytes_copied=16, copy_calls=1)
    assert seen == [FillContext(4, 4, 4, 4)]


def test_source_fn_returning_none_skips_the_copy() -> None:
    reg = registry_with(GraphSlot("input_ids", tokens, torch.int64, source_fn=lambda fb, ctx: None))
    poison(reg)
    stats = fill(reg, MiniBatch(2, input_ids=i64(1, 2)), 2, 2)
    assert stats == FillStats(0, 0, 0)
    assert reg.get_slot("input_ids").require_buffer()[:2].tolist() == [POISON, POISON]


def test_slice_fn_on_a_2d_slot_copies_and_pads_along_the_last_axis() -> None:
    reg = registry_with(
        GraphSlot(
            "mrope",
            lambda b, t: (3, t),  # [3, tokens]
            torch.int64,
            padding_policy=PaddingPolicy.ZERO,
            slice_fn=lambda buf, n: buf[:, :n],
        )
    )
    poison(reg)
    src = torch.arange(6, dtype=torch.int64).view(3, 2)
    fill(reg, MiniBatch(2, mrope=src), raw=2, padded=4)
    buf = reg.get_slot("mrope").require_buffer()
    assert buf[:, :2].tolist() == src.tolist()
    assert buf[:, 2:4].tolist() == [[0, 0]] * 3
    assert buf[:, 4:].tolist() == [[POISON] * 4] * 3
    view = reg.extract_buffer(
        padded_bs=4, padded_num_tokens=4, forward_batch_template=MiniBatch(2, mrope=src)
    )
    assert view.mrope.shape == (3, 4)


def test_post_fill_runs_after_every_copy_in_registration_order() -> None:
    order: list[str] = []

    def total(buf: torch.Tensor, fb: MiniBatch, ctx: FillContext) -> None:
        # Registered before `seq_lens`, yet sees this fill's copied values.
        order.append("total")
        buf.fill_(int(seq_lens_buf[: ctx.raw_bs].sum()))

    def boundary(buf: torch.Tensor, fb: MiniBatch, ctx: FillContext) -> None:
        order.append("boundary")
        buf.fill_(ctx.raw_num_tokens)

    reg = registry_with(
        GraphSlot("scores", lambda b, t: (1,), torch.int64, "none", post_fill=total),
        GraphSlot("seq_lens", requests, torch.int64, axis="bs"),
        GraphSlot(
            "num_token_non_padded",
            lambda b, t: (1,),
            torch.int32,
            "none",
            copy_from_fb=False,
            post_fill=boundary,
        ),
    )
    seq_lens_buf = reg.get_slot("seq_lens").require_buffer()
    fill(reg, MiniBatch(3, seq_lens=i64(4, 5, 6)), raw=3, padded=4)
    assert order == ["total", "boundary"]
    assert reg.get_slot("scores").require_buffer().item() == 15
    assert reg.get_slot("num_token_non_padded").require_buffer().item() == 3


def test_a_source_that_does_not_match_the_head_is_refused() -> None:
    reg = registry_with(GraphSlot("positions", tokens, torch.int64))
    # copy_ would broadcast a 1-element source over the head; the registry refuses it.
    with pytest.raises(ValueError, match="'positions': source shape \\[1\\]"):
        fill(reg, MiniBatch(3, positions=i64(1)), raw=3, padded=3)


def test_a_non_tensor_field_is_refused() -> None:
    reg = registry_with(GraphSlot("extra", tokens, torch.int64))
    with pytest.raises(TypeError, match="'extra': the source is a list"):
        fill(reg, MiniBatch(2, extra=[1, 2]), 2, 2)


def test_a_dotted_slot_is_filled_through_its_source_but_never_extracted() -> None:
    reg = registry_with(
        GraphSlot("extra.ids", tokens, torch.int64, source_fn=lambda fb, ctx: fb.extra)
    )
    fb = MiniBatch(2, extra=i64(6, 7))
    assert fill(reg, fb, 2, 2).tensors_copied == 1
    assert reg.get_slot("extra.ids").require_buffer()[:2].tolist() == [6, 7]
    view = reg.extract_buffer(padded_bs=2, padded_num_tokens=2, forward_batch_template=fb)
    assert view == dataclasses.replace(fb)


# --- extract_buffer ------------------------------------------------------------------------


def test_extract_carries_none_for_a_plain_slot_absent_this_step() -> None:
    reg = registry_with(
        GraphSlot("input_ids", tokens, torch.int64),
        GraphSlot("input_embeds", lambda b, t: (t, 4), torch.float32),
    )
    fb = MiniBatch(2, input_ids=None, input_embeds=torch.ones(2, 4))
    fill(reg, fb, 2, 2)
    view = reg.extract_buffer(padded_bs=2, padded_num_tokens=2, forward_batch_template=fb)
    assert view.input_ids is None  # never a stale buffer
    assert view.input_embeds is not None and view.input_embeds is not fb.input_embeds


def test_buffer_views_are_made_once_per_shape_and_fields_present() -> None:
    reg = registry_with(
        GraphSlot("input_ids", tokens, torch.int64),
        GraphSlot("input_embeds", lambda b, t: (t, 4), torch.float32),
    )
    ids = MiniBatch(2, input_ids=i64(1, 2), input_embeds=None)
    first = reg.buffer_views(padded_bs=2, padded_num_tokens=2, forward_batch_template=ids)
    again = reg.buffer_views(padded_bs=2, padded_num_tokens=2, forward_batch_template=ids)
    assert again is first and set(first) == {"input_ids"}  # kept: no slicing a step
    embeds = MiniBatch(2, input_ids=None, input_embeds=torch.ones(2, 4))
    other = reg.buffer_views(padded_bs=2, padded_num_tokens=2, forward_batch_template=embeds)
    assert set(other) == {"input_embeds"}  # which fields a batch has is part of the key
    wider = reg.buffer_views(padded_bs=4, padded_num_tokens=4, forward_batch_template=ids)
    assert wider["input_ids"].shape == (4,) and first["input_ids"].shape == (2,)
    view = reg.extract_buffer(padded_bs=2, padded_num_tokens=2, forward_batch_template=ids)
    assert view.batch_size == 2 and "batch_size" not in first  # extract adds to a copy


def test_extract_always_exposes_computed_slots() -> None:
    reg = registry_with(
        GraphSlot(
            "num_token_non_padded",
            lambda b, t: (1,),
            torch.int32,
            "none",
            copy_from_fb=False,
            post_fill=lambda buf, fb, ctx: buf.fill_(ctx.raw_num_tokens),
        ),
        GraphSlot("scores", lambda b, t: (2,), torch.float32, "none", copy_from_fb=False),
    )
    fb = MiniBatch(3)
    fill(reg, fb, raw=3, padded=4)
    view = reg.extract_buffer(padded_bs=4, padded_num_tokens=4, forward_batch_template=fb)
    assert view.num_token_non_padded is not None and view.num_token_non_padded.tolist() == [3]
    assert view.scores is reg.get_slot("scores").buffer  # axis "none": the whole buffer


def test_extract_pads_the_batch_views_the_buffers_and_leaves_the_template_alone() -> None:
    reg = registry_with(
        GraphSlot("positions", tokens, torch.int64, padding_policy=PaddingPolicy.ZERO)
    )
    positions = i64(3, 4)
    fb = MiniBatch(2, positions=positions, seq_lens=i64(9, 9), extra="kept")
    fill(reg, fb, raw=2, padded=4)
    view = reg.extract_buffer(padded_bs=4, padded_num_tokens=4, forward_batch_template=fb)
    assert view is not fb and view.batch_size == 4
    assert view.positions is not None and view.positions.tolist() == [3, 4, 0, 0]
    assert view.positions.data_ptr() == reg.get_slot("positions").require_buffer().data_ptr()
    assert view.seq_lens is fb.seq_lens and view.extra == "kept"  # unregistered: carried
    assert fb.batch_size == 2 and fb.positions is positions


# --- grouped copies and FillStats ----------------------------------------------------------


def _mixed_registry() -> tuple[BufferRegistry, MiniBatch]:
    reg = registry_with(
        GraphSlot("input_ids", tokens, torch.int64),
        GraphSlot("positions", tokens, torch.int64),
        GraphSlot("out_cache_loc", tokens, torch.int32),
        GraphSlot("req_pool_indices", requests, torch.int64, axis="bs"),
        GraphSlot("input_embeds", lambda b, t: (t, 4), torch.float32),
    )
    fb = MiniBatch(
        3,
        input_ids=i64(1, 2, 3),
        positions=i64(4, 5, 6),
        out_cache_loc=i64(7, 8, 9),  # int64 into int32: its own dtype group
        req_pool_indices=torch.tensor([1, 2, 3], dtype=torch.int32),  # (int64, int32) group
        input_embeds=torch.ones(3, 4),
    )
    return reg, fb


def test_fill_stats_count_tensors_and_bytes_of_one_fill() -> None:
    reg, fb = _mixed_registry()
    stats = fill(reg, fb, raw=3, padded=3)
    assert stats.tensors_copied == 5
    assert stats.bytes_copied == 3 * 8 * 3 + 3 * 4 + 3 * 4 * 4
    fb.input_embeds = None
    assert fill(reg, fb, raw=3, padded=3).tensors_copied == 4  # per fill, not cumulative


def test_one_foreach_copy_call_per_dtype_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[torch.dtype, torch.dtype, int]] = []
    real = torch._foreach_copy_

    def counting(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        calls.append((dsts[0].dtype, srcs[0].dtype, len(dsts)))
        real(dsts, srcs)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    reg, fb = _mixed_registry()
    stats = fill(reg, fb, raw=3, padded=3)
    assert sorted(calls, key=str) == sorted(
        [
            (torch.int64, torch.int64, 2),
            (torch.int32, torch.int64, 1),
            (torch.int64, torch.int32, 1),
            (torch.float32, torch.float32, 1),
        ],
        key=str,
    )
    assert stats.copy_calls == len(calls) == 4
    assert reg.get_slot("out_cache_loc").require_buffer()[:3].tolist() == [7, 8, 9]


def test_without_foreach_copy_every_tensor_gets_its_own_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry_copy, "HAS_FOREACH_COPY", False)
    monkeypatch.setattr(torch, "_foreach_copy_", None)  # any call would now fail
    reg, fb = _mixed_registry()
    stats = fill(reg, fb, raw=3, padded=3)
    assert stats == FillStats(5, stats.bytes_copied, copy_calls=5)
    assert reg.get_slot("input_ids").require_buffer()[:3].tolist() == [1, 2, 3]


def test_a_slot_off_the_registry_device_is_copied_on_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A "meta" registry stands in for an accelerator: device slots go through one grouped
    # call, the host mirror through its own copy_ (its data is checkable on the CPU).
    grouped: list[int] = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (grouped.append(len(d)), real(d, s)))
    reg = build_decode_registry(
        device="meta", max_bs=4, max_num_tokens=4, seq_len_fill_value=1, share_pool=False
    )
    meta = lambda n: torch.zeros(n, dtype=torch.int64, device="meta")  # noqa: E731
    fb = MiniBatch(
        2,
        input_ids=meta(2),
        positions=meta(2),
        out_cache_loc=meta(2),
        req_pool_indices=meta(2),
        seq_lens=meta(2),
        seq_lens_cpu=i64(5, 6),
    )
    stats = fill(reg, fb, raw=2, padded=3)
    assert grouped == [5]
    assert stats == FillStats(tensors_copied=6, bytes_copied=6 * 16, copy_calls=2)
    assert reg.get_slot("seq_lens_cpu").require_buffer()[:3].tolist() == [5, 6, 1]


def test_fill_stats_add_up() -> None:
    assert FillStats(1, 8, 1) + FillStats(2, 16, 1) == FillStats(3, 24, 2)


# --- the shared pool ---------------------------------------------------------------------


def test_equal_keys_share_storage_and_other_sizes_do_not() -> None:
    name = uniq("pool")
    first = share_input_buffer(name, torch.zeros(8, dtype=torch.int64))
    again = share_input_buffer(name, torch.zeros(2, 4, dtype=torch.int64))
    other_size = share_input_buffer(name, torch.zeros(16, dtype=torch.int64))
    other_dtype = share_input_buffer(name, torch.zeros(8, dtype=torch.int32))
    other_name = share_input_buffer(uniq("pool"), torch.zeros(8, dtype=torch.int64))
    assert again.data_ptr() == first.data_ptr() and again.shape == (2, 4)
    again[1, 3] = 5
    assert first[7] == 5
    assert (
        len(
            {first.data_ptr(), other_size.data_ptr(), other_dtype.data_ptr(), other_name.data_ptr()}
        )
        == 4
    )


@pytest.mark.parametrize("order", [(8, 16, 8, 16), (16, 8, 16, 8)])
def test_sharing_does_not_depend_on_registration_order(order: tuple[int, ...]) -> None:
    name = uniq("pool")
    out = [share_input_buffer(name, torch.zeros(n, dtype=torch.int64)) for n in order]
    by_size: dict[int, set[int]] = {}
    for n, t in zip(order, out, strict=True):
        by_size.setdefault(n, set()).add(t.data_ptr())
    assert {n: len(ptrs) for n, ptrs in by_size.items()} == {8: 1, 16: 1}
    assert by_size[8] != by_size[16]


def test_pooled_registries_share_buffers_and_private_ones_do_not() -> None:
    name = uniq("ids")

    def build(share: bool, max_num_tokens: int) -> BufferRegistry:
        reg = BufferRegistry("cpu", 4, max_num_tokens, share_pool=share)
        reg.register_slot(GraphSlot(name, tokens, torch.int64))
        return reg

    a, b = build(True, 16), build(True, 16)
    c, d = build(True, 32), build(False, 16)

    def ptr(reg: BufferRegistry) -> int:
        return reg.get_slot(name).require_buffer().data_ptr()

    assert ptr(a) == ptr(b)
    assert ptr(c) != ptr(a) and ptr(d) != ptr(a)


def test_fill_once_slots_stay_out_of_the_pool() -> None:
    name = uniq("enc")

    def build(pad: int) -> BufferRegistry:
        reg = BufferRegistry("cpu", 4, 4, share_pool=True)
        slot = GraphSlot(name, requests, torch.int64, "bs", None, PaddingPolicy.FILL_ONCE, pad)
        reg.register_slot(slot)
        return reg

    a, b = build(-1), build(9)
    assert a.get_slot(name).require_buffer().tolist() == [-1] * 4  # b did not overwrite it
    assert b.get_slot(name).require_buffer().tolist() == [9] * 4


# --- the factories -----------------------------------------------------------------------


def _table(reg: BufferRegistry) -> dict[str, tuple[Any, ...]]:
    out = {}
    for name in reg.slot_names():
        s = reg.get_slot(name)
        buf = s.require_buffer()
        out[name] = (s.axis, buf.dtype, tuple(buf.shape), buf.device.type, s.padding_policy)
    return out


Z, S, F = PaddingPolicy.ZERO, PaddingPolicy.FILL_SENTINEL, PaddingPolicy.FOREACH_COPY


@pytest.mark.parametrize("needs_cpu_seq_lens", [True, False])
def test_decode_registry_slot_table(needs_cpu_seq_lens: bool) -> None:
    reg = build_decode_registry(
        device="cpu",
        max_bs=4,
        max_num_tokens=8,
        seq_len_fill_value=1,
        cache_loc_dtype=torch.int32,
        needs_cpu_seq_lens=needs_cpu_seq_lens,
        share_pool=False,
    )
    expected = {
        "input_ids": ("tokens", torch.int64, (8,), "cpu", F),
        "positions": ("tokens", torch.int64, (8,), "cpu", Z),
        "out_cache_loc": ("tokens", torch.int32, (8,), "cpu", Z),
        "req_pool_indices": ("bs", torch.int64, (4,), "cpu", Z),
        "seq_lens": ("bs", torch.int64, (4,), "cpu", S),
    }
    if needs_cpu_seq_lens:
        expected["seq_lens_cpu"] = ("bs", torch.int64, (4,), "cpu", S)
    assert _table(reg) == expected
    assert list(reg.slot_names()) == list(expected)
    if needs_cpu_seq_lens:
        assert reg.get_slot("seq_lens_cpu").device == "cpu"  # the host mirror, always


def test_decode_registry_optional_slots() -> None:
    reg = build_decode_registry(
        device="cpu",
        max_bs=4,
        max_num_tokens=8,
        seq_len_fill_value=1,
        register_input_embeds=True,
        hidden_size=6,
        embed_dtype=torch.bfloat16,
        enable_num_token_non_padded=True,
        share_pool=False,
    )
    table = _table(reg)
    assert table["input_embeds"] == ("tokens", torch.bfloat16, (8, 6), "cpu", Z)
    assert table["num_token_non_padded"][:3] == ("none", torch.int32, (1,))
    fb = MiniBatch(3, input_ids=i64(1, 2, 3), seq_lens=i64(2, 2, 2))
    reg.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    view = reg.extract_buffer(padded_bs=4, padded_num_tokens=4, forward_batch_template=fb)
    assert view.num_token_non_padded is not None and view.num_token_non_padded.tolist() == [3]


def test_decode_registry_pads_requests_harmlessly() -> None:
    reg = build_decode_registry(
        device="cpu", max_bs=8, max_num_tokens=8, seq_len_fill_value=1, share_pool=False
    )
    poison(reg)
    fb = MiniBatch(
        3,
        input_ids=i64(11, 12, 13),
        positions=i64(4, 6, 9),
        out_cache_loc=i64(21, 22, 23),
        req_pool_indices=i64(1, 2, 3),
        seq_lens=i64(5, 7, 10),
        seq_lens_cpu=i64(5, 7, 10),
    )
    stats = reg.fill_from(fb, raw_bs=3, padded_bs=5, raw_num_tokens=3, padded_num_tokens=5)
    view = reg.extract_buffer(padded_bs=5, padded_num_tokens=5, forward_batch_template=fb)
    assert view.batch_size == 5
    assert view.input_ids.tolist() == [11, 12, 13, POISON, POISON]  # FOREACH_COPY: not reset
    assert view.positions.tolist() == [4, 6, 9, 0, 0]
    assert view.out_cache_loc.tolist() == [21, 22, 23, 0, 0]
    assert view.req_pool_indices.tolist() == [1, 2, 3, 0, 0]
    assert view.seq_lens.tolist() == [5, 7, 10, 1, 1]
    assert view.seq_lens_cpu.tolist() == [5, 7, 10, 1, 1]
    assert stats == FillStats(tensors_copied=6, bytes_copied=6 * 3 * 8, copy_calls=1)


def test_prefill_registry_slot_table() -> None:
    reg = build_prefill_registry(device="cpu", max_bs=4, max_num_tokens=16, share_pool=False)
    assert _table(reg) == {
        "input_ids": ("tokens", torch.int64, (16,), "cpu", Z),
        "positions": ("tokens", torch.int64, (16,), "cpu", Z),
        "out_cache_loc": ("tokens", torch.int64, (16,), "cpu", Z),
    }
    full = build_prefill_registry(
        device="cpu",
        max_bs=4,
        max_num_tokens=16,
        register_input_embeds=True,
        hidden_size=3,
        embed_dtype=torch.float32,
        enable_num_token_non_padded=True,
        share_pool=False,
    )
    assert full.slot_names() == [
        "input_ids",
        "positions",
        "out_cache_loc",
        "input_embeds",
        "num_token_non_padded",
    ]


def test_prefill_registry_zero_pads_every_token_slot() -> None:
    reg = build_prefill_registry(
        device="cpu",
        max_bs=4,
        max_num_tokens=8,
        register_input_embeds=True,
        hidden_size=2,
        embed_dtype=torch.float32,
        enable_num_token_non_padded=True,
        share_pool=False,
    )
    poison(reg)
    fb = MiniBatch(
        2,
        input_ids=i64(5, 6, 7),
        positions=i64(0, 1, 0),
        out_cache_loc=i64(3, 4, 9),
        req_pool_indices=i64(1, 2),
        input_embeds=torch.full((3, 2), 0.5),
    )
    reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=3, padded_num_tokens=6)
    view = reg.extract_buffer(padded_bs=2, padded_num_tokens=6, forward_batch_template=fb)
    assert view.input_ids.tolist() == [5, 6, 7, 0, 0, 0]
    assert view.positions.tolist() == [0, 1, 0, 0, 0, 0]
    assert view.out_cache_loc.tolist() == [3, 4, 9, 0, 0, 0]
    assert view.input_embeds.tolist() == [[0.5, 0.5]] * 3 + [[0.0, 0.0]] * 3
    assert view.num_token_non_padded.tolist() == [3]
    assert view.req_pool_indices is fb.req_pool_indices  # per-request fields are carried


@pytest.mark.parametrize("factory", ["decode", "prefill"])
def test_unregistered_input_embeds_are_carried_by_identity(factory: str) -> None:
    if factory == "decode":
        reg = build_decode_registry(
            device="cpu", max_bs=4, max_num_tokens=4, seq_len_fill_value=0, share_pool=False
        )
    else:
        reg = build_prefill_registry(device="cpu", max_bs=4, max_num_tokens=4, share_pool=False)
    assert not reg.has_slot("input_embeds")
    embeds = torch.randn(2, 8)
    fb = MiniBatch(2, input_embeds=embeds, positions=i64(0, 1), out_cache_loc=i64(1, 2))
    reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=2, padded_num_tokens=2)
    view = reg.extract_buffer(padded_bs=2, padded_num_tokens=2, forward_batch_template=fb)
    assert view.input_embeds is embeds
    assert view.input_ids is None


def test_registering_input_embeds_needs_a_hidden_size_and_dtype() -> None:
    with pytest.raises(ValueError, match="register_input_embeds needs hidden_size"):
        build_prefill_registry(
            device="cpu", max_bs=4, max_num_tokens=4, register_input_embeds=True, share_pool=False
        )


def test_factories_bind_every_slot_to_the_source() -> None:
    source = MiniBatch(
        0,
        input_ids=torch.zeros(8, dtype=torch.int64),
        positions=torch.zeros(8, dtype=torch.int64),
        out_cache_loc=torch.zeros(8, dtype=torch.int64),
    )
    reg = build_prefill_registry(device="cpu", max_bs=2, max_num_tokens=8, source=source)
    for name in ("input_ids", "positions", "out_cache_loc"):
        assert reg.get_slot(name).buffer is getattr(source, name)
    source.positions = None
    with pytest.raises(ValueError, match="'positions': source has no tensor"):
        build_prefill_registry(device="cpu", max_bs=2, max_num_tokens=8, source=source)


def test_the_padding_invariant_rejects_a_zero_padded_non_index() -> None:
    reg = registry_with(GraphSlot("seq_lens", requests, torch.int64, "bs", None, Z))
    with pytest.raises(ValueError, match="'seq_lens' pads with ZERO but is not index-like"):
        check_padding_invariants(reg)


def test_the_padding_invariant_rejects_an_address_not_padded_with_zero() -> None:
    reg = registry_with(GraphSlot("out_cache_loc", tokens, torch.int64, padding_policy=F))
    with pytest.raises(ValueError, match="'out_cache_loc' is an address and must pad with ZERO"):
        check_padding_invariants(reg)


def test_every_zero_slot_of_both_factories_is_index_like() -> None:
    kw: dict[str, Any] = dict(
        device="cpu",
        max_bs=2,
        max_num_tokens=2,
        register_input_embeds=True,
        hidden_size=2,
        embed_dtype=torch.float32,
        enable_num_token_non_padded=True,
        share_pool=False,
    )
    for reg in (build_decode_registry(seq_len_fill_value=1, **kw), build_prefill_registry(**kw)):
        zero = {n for n in reg.slot_names() if reg.get_slot(n).padding_policy is Z}
        assert zero - {"input_embeds"} <= INDEX_LIKE_SLOTS
        assert {"positions", "out_cache_loc"} <= zero


def test_buffers_made_in_inference_mode_can_be_filled_outside_it() -> None:
    # Runners build registries inside torch.inference_mode(); pooled buffers outlive them.
    name = uniq("ids")

    def build() -> BufferRegistry:
        reg = BufferRegistry("cpu", 4, 4, share_pool=True)
        slot = GraphSlot(name, tokens, torch.int64, padding_policy=S, pad_value=1)
        slot.source_fn = lambda fb, ctx: fb.extra
        reg.register_slot(slot)
        return reg

    with torch.inference_mode():
        inside = build()
    outside = build()
    assert not inside.get_slot(name).require_buffer().is_inference()
    fill(inside, MiniBatch(2, extra=i64(4, 5)), raw=2, padded=3)
    fill(outside, MiniBatch(1, extra=i64(6)), raw=1, padded=2)  # the same pooled storage
    assert inside.get_slot(name).require_buffer().tolist() == [6, 1, 1, 1]


@pytest.mark.gpu
def test_on_cuda_device_slots_are_grouped_and_the_host_mirror_copied_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grouped: list[int] = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (grouped.append(len(d)), real(d, s)))
    reg = build_decode_registry(
        device="cuda", max_bs=4, max_num_tokens=4, seq_len_fill_value=1, share_pool=False
    )
    dev = lambda *v: i64(*v).cuda()  # noqa: E731
    fb = MiniBatch(
        2,
        input_ids=dev(3, 4),
        positions=dev(5, 6),
        out_cache_loc=dev(7, 8),
        req_pool_indices=dev(1, 2),
        seq_lens=dev(6, 7),
        seq_lens_cpu=i64(6, 7),
    )
    stats = fill(reg, fb, raw=2, padded=3)
    assert grouped == [5] and stats.copy_calls == 2
    view = reg.extract_buffer(padded_bs=3, padded_num_tokens=3, forward_batch_template=fb)
    assert view.seq_lens.device.type == "cuda" and view.seq_lens_cpu.device.type == "cpu"
    assert view.seq_lens.tolist() == [6, 7, 1] and view.seq_lens_cpu.tolist() == [6, 7, 1]
    assert view.out_cache_loc.tolist() == [7, 8, 0]
